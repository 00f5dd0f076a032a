"""The rollout's policy pass kept for the update (`OnPolicyTrainer.first_pass`, issue 20).

When the update's first micro-batch is the whole rollout (one minibatch, no gradient accumulation), the pass that gives
log π_θold (and PPO's old values) is made once, with gradients, and reused as that micro-batch's pass. What must hold,
checked on GPT-2 (Conv1D, learned positions) and Llama (rotary, no biases) built from their own config classes:

- the run is the run with a separate no-grad pass (`keeps_first_pass=False`): the same parameters after two steps and
  the same logged metrics, up to float rounding, for PPO (shared and separate critic), RLOO and GRPO with two passes;
- it saves exactly one full forward of the policy per step (counted with a hook), and none when it cannot apply
  (two minibatches, or gradient accumulation).
"""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

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

RESPONSE, STEPS = 6, 2


def length_reward(prompts, completions):
    return [len(c) / 10 for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def make(algo, family, tokenizer, tmp_path, keep, **more):
    "A tiny trainer of `algo` on `family`, 2 steps of 4 responses, with the first pass kept or not."
    policy = build_causal(BY_NAME[family], tokenizer, seed=0)
    common = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
        num_sample_generations=0,
        max_prompt_length=16,
        **more,
    )
    if algo.startswith("ppo"):
        value = build_classifier(BY_NAME[family], tokenizer, seed=1) if algo == "ppo_separate" else None
        trainer = RLHFTrainer(
            Agent(policy) if value is None else policy,
            args=RLHFConfig(response_length=RESPONSE, num_ppo_epochs=2, **common),
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
            value_model=value,
        )
    elif algo == "rloo":
        trainer = RLOOTrainer(
            policy,
            args=RLOOConfig(response_length=RESPONSE, num_generations=2, **common),
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
        )
    else:  # two passes over each rollout: GRPO needs its own π_θold pass then (one pass reuses the loss's)
        trainer = GRPOTrainer(
            policy,
            args=GRPOConfig(
                max_completion_length=RESPONSE, num_generations=2, num_iterations=2, beta=0.05, **common
            ),
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
        )
    trainer.keeps_first_pass = keep
    return trainer


def count_full_passes(trainer):
    "Count the policy's forward calls over whole prompt+response sequences (not generate's one-token steps)."
    lm = trainer.model.model if isinstance(trainer.model, Agent) else trainer.model
    calls = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] > RESPONSE:
            calls.append(torch.is_grad_enabled())

    lm.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def run(algo, family, tokenizer, tmp_path, keep, **more):
    trainer = make(algo, family, tokenizer, tmp_path / f"keep{keep}", keep, **more)
    calls = count_full_passes(trainer)
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return params, trainer.loop.state.history, calls


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("algo", ["ppo", "ppo_separate", "rloo", "grpo"])
def test_kept_pass_trains_as_a_separate_pass(algo, family, tokenizer, tmp_path):
    kept, hist_kept, calls_kept = run(algo, family, tokenizer, tmp_path, True)
    plain, hist_plain, calls_plain = run(algo, family, tokenizer, tmp_path, False)
    for name, p in plain.items():
        torch.testing.assert_close(
            kept[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{algo}/{family} {name}: {m}"
        )
    for row_kept, row_plain in zip(hist_kept, hist_plain, strict=True):
        for key, value in row_plain.items():
            # eps: episodes per second, a timing
            if isinstance(value, float) and key not in ("eps", "step_time"):
                assert row_kept[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (algo, family, key)
    # one full pass fewer per step: the rollout's no-grad pass is gone, the update's passes are all there
    assert len(calls_plain) - len(calls_kept) == STEPS, (calls_plain, calls_kept)
    assert calls_kept.count(False) == calls_plain.count(False) - STEPS


@pytest.mark.parametrize("more", [dict(num_mini_batches=2), dict(gradient_accumulation_steps=2)])
def test_no_pass_kept_when_the_first_micro_batch_is_not_the_rollout(more, tokenizer, tmp_path):
    """Two minibatches or two accumulated micro-batches: the rollout's pass cannot be a micro-batch's, so it is
    made apart."""
    kept, _, calls_kept = run("rloo", "llama", tokenizer, tmp_path, True, **more)
    plain, _, calls_plain = run("rloo", "llama", tokenizer, tmp_path, False, **more)
    # the rollout's no-grad passes are all made
    assert calls_kept == calls_plain and calls_kept.count(False) >= STEPS
    for name, p in plain.items():
        assert torch.equal(kept[name], p), name
