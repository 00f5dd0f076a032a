"""A rollout's response columns end at its longest response (`OnPolicyTrainer.response_width`), a micro-batch's at its
own (`trim_responses`).

Responses are sampled `response_length` wide; after each one's stop token the columns are padding. The trainers keep
them only up to the longest response, and each micro-batch of the update up to its own, so every later pass of the
step reads fewer tokens. What must hold, checked on
GPT-2 (Conv1D, learned positions) and Llama (rotary, no biases) built from their own config classes, with completions
made to stop early (a bias on the EOS logit):

- the run is the run without the cut (`trims_responses=False`): the same parameters after two steps of SGD and the
  same logged metrics (the loss and `grad_norm` among them, which a wrong normaliser would change), up to float rounding, for PPO (shared and separate critic), RLOO, and GRPO with three loss types
  (grpo: a mean per sequence; dr_grpo: a constant normaliser, `max_completion_length`; dapo: the tokens of the batch);
- the passes after sampling did read fewer columns: the widest full-sequence pass of the run with the cut is
  narrower than prompt + `response_length`, and every pass of the run without it reads the whole width.
"""

import pytest
import torch

from instruct_goose import (
    Agent,
    GRPOConfig,
    GRPOTrainer,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    load_task,
    task_tokenizer,
)

from _families import BY_NAME, build_causal, build_classifier

RESPONSE, STEPS = 16, 2


def length_reward(prompts, completions):
    return [len(c) / 10 for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def make(algo, family, tokenizer, tmp_path, trims, loss_type="grpo", **more):
    """A tiny trainer of `algo` on `family`, 2 steps of 4 responses that often stop early, with the response
    columns cut or not."""
    policy = build_causal(BY_NAME[family], tokenizer, seed=0)
    common = {
        **dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=STEPS,
            seed=0,
            disable_tqdm=True,
            num_sample_generations=0,
            max_prompt_length=16,
            generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 6.0]]},
        ),
        **more,
    }
    value = build_classifier(BY_NAME[family], tokenizer, seed=1) if algo == "ppo_separate" else None
    # PPO: the critic built here, so the optimizer can hold it
    model = Agent(policy, value_model=value) if algo.startswith("ppo") else policy
    # SGD: the parameters' change is the gradients' (Adam would make a near-zero gradient's rounding a whole
    # step)
    sgd = (torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2), None)
    if algo.startswith("ppo"):
        trainer = RLHFTrainer(
            model,
            args=RLHFConfig(response_length=RESPONSE, num_ppo_epochs=2, **common),
            optimizers=sgd,
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
        )
    elif algo == "rloo":
        trainer = RLOOTrainer(
            model,
            args=RLOOConfig(response_length=RESPONSE, num_generations=2, **common),
            optimizers=sgd,
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
        )
    else:
        trainer = GRPOTrainer(
            model,
            args=GRPOConfig(
                max_completion_length=RESPONSE,
                num_generations=2,
                num_iterations=2,
                beta=0.05,
                loss_type=loss_type,
                **common,
            ),
            optimizers=sgd,
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
        )
    trainer.trims_responses = trims
    return trainer


def run(algo, family, tokenizer, tmp_path, trims, **more):
    trainer = make(algo, family, tokenizer, tmp_path / f"trims{trims}", trims, **more)
    lm = trainer.model.model if isinstance(trainer.model, Agent) else trainer.model
    widths, prompt = [], []

    # the widths of the policy's passes over whole prompt + response sequences
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > 1:
            widths.append(ids.shape[1])

    lm.register_forward_pre_hook(hook, with_kwargs=True)
    sample = trainer.sample_and_score

    def noting(*args, **kwargs):
        samples = sample(*args, **kwargs)
        prompt.append(samples.query_ids.shape[1])
        return samples

    trainer.sample_and_score = noting
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return params, trainer.loop.state.history, widths, prompt


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "algo, loss_type",
    [
        ("ppo", None),
        ("ppo_separate", None),
        ("rloo", None),
        ("grpo", "grpo"),
        ("grpo", "dr_grpo"),
        ("grpo", "dapo"),
    ],
)
def test_cut_columns_train_as_the_whole_width(algo, loss_type, family, tokenizer, tmp_path):
    more = {} if loss_type is None else dict(loss_type=loss_type)
    cut, hist_cut, widths_cut, prompts = run(algo, family, tokenizer, tmp_path, True, **more)
    whole, hist_whole, widths_whole, _ = run(algo, family, tokenizer, tmp_path, False, **more)
    for name, p in whole.items():
        torch.testing.assert_close(
            cut[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{algo}/{loss_type}/{family} {name}: {m}"
        )
    for row_cut, row_whole in zip(hist_cut, hist_whole, strict=True):
        for key, value in row_whole.items():
            # eps: episodes per second, a timing
            if isinstance(value, float) and key not in ("eps", "step_time"):
                assert row_cut[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (
                    algo,
                    loss_type,
                    family,
                    key,
                )
    # without the cut: the whole width
    assert max(widths_whole) == max(prompts) + RESPONSE, (widths_whole, prompts)
    # with it: fewer columns in every pass
    assert max(widths_cut) < max(prompts) + RESPONSE, (widths_cut, prompts)


@pytest.mark.parametrize("algo", ["ppo_separate", "grpo"])
@pytest.mark.parametrize(
    "cut", [dict(num_mini_batches=2), dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)]
)
def test_micro_batches_cut_to_their_own_longest(algo, cut, tokenizer, tmp_path):
    """Two minibatches, or two accumulated micro-batches of 2 rows: each micro-batch's passes end at its own
    longest response, and the run is the run without the cut."""
    more = dict(loss_type="dapo") if algo == "grpo" else {}
    cut_run, hist_cut, widths_cut, prompts = run(algo, "llama", tokenizer, tmp_path, True, **cut, **more)
    whole, hist_whole, _, _ = run(algo, "llama", tokenizer, tmp_path, False, **cut, **more)
    for name, p in whole.items():
        torch.testing.assert_close(
            cut_run[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{algo} {cut} {name}: {m}"
        )
    for row_cut, row_whole in zip(hist_cut, hist_whole, strict=True):
        for key, value in row_whole.items():
            if isinstance(value, float) and key not in ("eps", "step_time"):
                assert row_cut[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (algo, cut, key)


@pytest.mark.parametrize(
    "algo, more",
    [("ppo_separate", {}), ("rloo", {}), ("grpo", dict(loss_type="dapo", top_entropy_quantile=0.5))],
)
def test_rollout_passes_in_chunks_of_their_own_width(algo, more, tokenizer, tmp_path, monkeypatch):
    """The rollout's no-grad passes (reference, π_old, PPO's values; GRPO's π_old with its entropy) in pieces of 2 rows,
    each cut at its own longest response (`chunked(responses=True)`), train as the same pieces at the rollout's width:
    two minibatches, so no pass is kept and every such pass runs chunked."""
    from instruct_goose import grpo, ppo, rollout

    settings = dict(num_mini_batches=2, local_rollout_forward_batch_size=2, **more)
    cut, hist_cut, _, _ = run(algo, "llama", tokenizer, tmp_path / "cut", True, **settings)
    plain = rollout.chunked
    for module in (rollout, ppo, grpo):  # every piece at the rollout's width
        monkeypatch.setattr(
            module, "chunked", lambda *args, responses=False, **kwargs: plain(*args, **kwargs)
        )
    whole, hist_whole, _, _ = run(algo, "llama", tokenizer, tmp_path / "whole", True, **settings)
    for name, p in whole.items():
        torch.testing.assert_close(cut[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{algo} {name}: {m}")
    # val/clipfrac_avg counts tokens where (V_old + clamp(V − V_old) − R)² > (V − R)²; with V ≈ V_old the two
    # sides differ
    # by rounding (V_old + (V − V_old) ≠ V in floats), as in TRL's formula, so other matrix shapes flip a
    # token or two
    for row_c, row_w in zip(hist_cut, hist_whole, strict=True):
        for key, value in row_w.items():
            if isinstance(value, float) and key not in ("eps", "step_time", "val/clipfrac_avg"):
                assert row_c[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (algo, key)
