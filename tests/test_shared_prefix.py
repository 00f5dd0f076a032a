"""`shared_prefix` in the on-policy trainers: rows with the same prompt run it once in every pass after sampling.

RLOO and GRPO sample G completions per prompt, so each prompt sits G times in a rollout. With `shared_prefix=True` the
policy's, the reference's and a separate critic's passes run each distinct prompt once and then every row's response,
reading its prompt's keys and values from 🤗's cache (`shared_prompt_forward`). What must hold:

- `response_logprobs(shared_prefix=True)` gives the padded log-probabilities, entropies and gradient on every causal
  family of the matrix (sliding windows of 4 tokens, shorter than the rows, where a family has them), BLOOM's ALiBi
  and Falcon included;
- a run with it is the run without it: the same parameters after two steps of SGD and the same logged metrics, for
  RLOO, GRPO (grpo, dr_grpo, dapo) and PPO (shared and separate critic, on a dataset that repeats its prompts), on GPT-2,
  Llama and Gemma 2, with two accumulated micro-batches, two minibatches (shuffled: some micro-batches share nothing),
  LoRA at T = 0.7, gradient checkpointing (full and selective), and `padding_free` beside it;
- every pass after sampling shared its prompts (a reward model's that the trainer makes too), and read fewer positions than padded; the sampler was asked to share them too
  (`generate_responses`' `share_prompts`; `decode`'s tokens with it are checked in chapter 03a; here 🤗 `generate` samples,
  since the configs pass it a `sequence_bias`);
- a load-balancing loss and reentrant checkpointing are refused with one-line errors.
"""

from unittest import mock

import pytest
import torch
from datasets import Dataset

import instruct_goose.onpolicy as onpolicy

from instruct_goose import Agent, GRPOConfig, GRPOTrainer, load_task, task_tokenizer
from instruct_goose.agent import _PromptRead, _PromptWrite, disable_dropout, response_logprobs
from instruct_goose.levers import enable_gradient_checkpointing

from _families import BY_NAME, CAUSAL, build_causal
from test_padding_free import length_reward, make


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def rows(tokenizer, P=9, R=7):
    """Three prompts (9, 5 and 2 real tokens, left-padded), each twice, and six right-padded responses of 7, 2,
    5, 1, 7 and 3 tokens."""
    torch.manual_seed(0)
    qm = torch.ones(3, P, dtype=torch.long)
    qm[1, :4] = 0
    qm[2, :7] = 0
    q = torch.randint(5, len(tokenizer), (3, P)) * qm + tokenizer.pad_token_id * (1 - qm)
    rm = (torch.arange(R) < torch.tensor([7, 2, 5, 1, 7, 3])[:, None]).long()
    r = torch.randint(5, len(tokenizer), (6, R)) * rm + tokenizer.pad_token_id * (1 - rm)
    return q.repeat_interleave(2, 0), qm.repeat_interleave(2, 0), r, rm


@pytest.mark.parametrize("family", [f.name for f in CAUSAL])
def test_shared_prompts_give_the_padded_numbers(family, tokenizer):
    model = disable_dropout(build_causal(BY_NAME[family], tokenizer, seed=0)).train()
    # shorter than the prompts: the window bites
    if getattr(model.config, "sliding_window", None) is not None:
        model.config.sliding_window = 4
    q, qm, r, rm = rows(tokenizer)
    real = rm.bool()
    padded = response_logprobs(model, q, qm, r, rm, 0.7, "grad")
    shared = response_logprobs(model, q, qm, r, rm, 0.7, "grad", shared_prefix=True)
    for s, p in zip(shared[:2], padded[:2]):
        torch.testing.assert_close(s[real], p[real], rtol=1e-5, atol=1e-5)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [
        torch.cat([g.flatten() for g in torch.autograd.grad((x[0] + 0.1 * x[1])[real].sum(), params)])
        for x in (padded, shared)
    ]
    # (OPT's key biases: 0 but for rounding)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-5 * float(grads[0].abs().max()))


def test_checkpointing_and_its_refusal(tokenizer):
    """Full and selective gradient checkpointing give the gradient without it; reentrant checkpointing is refused
    where a backward would follow."""
    q, qm, r, rm = rows(tokenizer)
    grads = {}
    for policy in (None, "full", "selective"):
        model = disable_dropout(build_causal(BY_NAME["gemma2"], tokenizer, seed=0)).train()
        if policy:
            enable_gradient_checkpointing(model, policy=policy)
        response_logprobs(model, q, qm, r, rm, shared_prefix=True)[0][rm.bool()].sum().backward()
        grads[policy] = torch.cat([p.grad.flatten() for p in model.parameters()])
    for policy in ("full", "selective"):
        torch.testing.assert_close(grads[policy], grads[None], rtol=1e-5, atol=1e-6)
    enable_gradient_checkpointing(model, {"use_reentrant": True})
    with pytest.raises(ValueError, match="`shared_prefix` with reentrant gradient checkpointing"):
        response_logprobs(model, q, qm, r, rm, shared_prefix=True)


def repeated_prompts():
    return Dataset.from_dict({"prompt": [p for p in load_task("prompts")["prompt"][:8] for _ in range(2)]})


def run(algo, family, tokenizer, tmp_path, shared, **more):
    """Train; the positions each pass over whole sequences read (the sampler's steps aside), and whether it
    shared its prompts."""
    ppo = algo.startswith("ppo")
    # PPO samples once per prompt: a dataset with each twice
    extra = dict(dataset=repeated_prompts(), shuffle_dataset=False) if ppo else {}
    trainer = make(
        algo,
        family,
        tokenizer,
        tmp_path / f"shared{shared}",
        more.pop("padding_free", False),
        shared_prefix=shared,
        **extra,
        **more,
    )
    models = [trainer.model.model if isinstance(trainer.model, Agent) else trainer.model, trainer.ref_model]
    if isinstance(trainer.model, Agent) and trainer.model.value_model is not None:
        models.append(trainer.model.value_model)
    # a reward model made by the trainer shares with it
    models += [m.backbone for m in trainer.reward_model.models]
    passes = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        kind = type(cache.layers[0]) if cache is not None and getattr(cache, "layers", None) else None
        if kind in (_PromptWrite, _PromptRead):
            passes.append((ids.numel(), kind))
        # a padded (or packed) pass
        elif cache is None and ids is not None and ids.shape[1] > 1:
            passes.append((ids.numel(), None))

    for m in models:
        if m is not None:
            m.register_forward_pre_hook(hook, with_kwargs=True)
    shares, sample = [], onpolicy.generate_responses
    with mock.patch.object(
        onpolicy,
        "generate_responses",
        lambda *args, **kwargs: shares.append(kwargs["share_prompts"]) or sample(*args, **kwargs),
    ):
        trainer.train()
    # the sampler was asked to run each prompt once too (or not)
    assert shares and all(s == shared for s in shares), shares
    return (
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        trainer.loop.state.history,
        passes,
    )


def assert_same_run(algo, family, tokenizer, tmp_path, all_shared=True, **more):
    shared, hist_shared, pos_shared = run(algo, family, tokenizer, tmp_path, True, **dict(more))
    padded, hist_padded, pos_padded = run(algo, family, tokenizer, tmp_path, False, **dict(more))
    for name, p in padded.items():
        torch.testing.assert_close(
            shared[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{algo}/{family}/{more} {name}: {m}"
        )
    # tolerances as in test_padding_free
    for row_shared, row_padded in zip(hist_shared, hist_padded, strict=True):
        for key, value in row_padded.items():
            if isinstance(value, float) and key not in ("eps", "step_time", "val/clipfrac_avg"):
                assert row_shared[key] == pytest.approx(value, rel=1e-4, abs=5e-6), (algo, family, more, key)
    writes = [n for n, kind in pos_shared if kind is _PromptWrite]
    # each shared pass: the prompts, then the responses
    assert len(writes) == sum(kind is _PromptRead for _, kind in pos_shared) > 0
    # every pass shared its prompts
    if all_shared:
        assert len(writes) == len(pos_padded) and all(kind is not None for _, kind in pos_shared)
    # and read fewer positions than padded
    if not more.get("padding_free"):
        assert sum(n for n, _ in pos_shared) < sum(n for n, _ in pos_padded)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
@pytest.mark.parametrize(
    "algo, loss_type",
    [
        ("rloo", None),
        ("grpo", "grpo"),
        ("grpo", "dr_grpo"),
        ("grpo", "dapo"),
        ("ppo", None),
        ("ppo_separate", None),
    ],
)
def test_shared_runs_train_as_padded_runs(algo, loss_type, family, tokenizer, tmp_path):
    assert_same_run(
        algo, family, tokenizer, tmp_path, **({} if loss_type is None else dict(loss_type=loss_type))
    )


@pytest.mark.parametrize(
    "algo, more",
    [
        ("grpo", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, loss_type="dapo")),
        ("rloo", dict(num_mini_batches=2, local_rollout_forward_batch_size=2, all_shared=False)),
        ("grpo", dict(num_mini_batches=2, entropy_coef=0.01, top_entropy_quantile=0.5, all_shared=False)),
        ("rloo", dict(lora=True, temperature=0.7)),
        (
            "grpo",
            dict(gradient_checkpointing=True, gradient_checkpointing_policy="selective", loss_type="dapo"),
        ),
        ("ppo_separate", dict(gradient_checkpointing=True)),
        ("grpo", dict(padding_free=True, loss_type="dapo")),
        ("rloo", dict(generation_kwargs=None)),
        ("grpo", dict(reward_model=True, loss_type="dapo")),
        ("ppo_separate", dict(padding_free=True, num_mini_batches=2, all_shared=False)),
    ],
)
def test_shared_micro_batches_and_rollout_pieces(algo, more, tokenizer, tmp_path):
    """Two accumulated micro-batches of one prompt each; two minibatches, shuffled, so that some micro-batches
    repeat no prompt and run padded (or packed); rollout passes in pieces of 2 rows; the entropy's gradient;
    LoRA (the reference: adapters off) at T = 0.7; checkpointing; `padding_free` for the passes that share
    nothing; no `sequence_bias`, so that `decode` samples, each prompt prefilled once; a reward model the
    trainer makes from a 🤗 classifier, scoring each prompt's tokens once."""
    assert_same_run(algo, "llama", tokenizer, tmp_path, **more)


def test_a_load_balancing_loss_is_refused(tokenizer, tmp_path):
    policy = build_causal(BY_NAME["qwen3_moe"], tokenizer, seed=0)
    config = lambda coef: GRPOConfig(
        output_dir=str(tmp_path),
        shared_prefix=True,
        router_aux_loss_coef=coef,
        per_device_train_batch_size=4,
        num_generations=2,
    )
    with pytest.raises(
        ValueError, match=r"`shared_prefix` with a load-balancing loss \(`router_aux_loss_coef`=0.01\)"
    ):
        GRPOTrainer(
            policy,
            args=config(0.01),
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
        )
    GRPOTrainer(
        policy,
        args=config(0.0),
        processing_class=tokenizer,
        reward_funcs=length_reward,
        train_dataset=load_task("prompts"),
    )
