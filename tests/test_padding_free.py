"""`padding_free` in the on-policy trainers: every pass after sampling over the real tokens packed in bins.

A rollout's rows are a left-padded prompt and a right-padded response; completions that stop early leave most of a row
padding, and a micro-batch cut at its longest response (`trim_responses`) still carries the shorter rows' padding.
With `padding_free=True` the policy's, the reference's and a separate critic's passes read the real tokens only,
packed into bins (`packed_forward`), and the output layer runs at the real response tokens only. What must hold:

- `packed_forward` gives each family's padded states, with the family's own attention rule: sliding windows (Mistral,
  OLMo 3, Gemma 2 and 3, GPT-OSS, each with a 4-token window here so that it bites) and eager attention's additive
  mask (Gemma 2, GPT-OSS); BLOOM (ALiBi, no `position_ids`) is refused by name;
- a run with it is the run without it: the same parameters after two steps of SGD and the same logged metrics, for PPO
  (shared and separate critic), RLOO and GRPO (grpo, dr_grpo, dapo; and with the entropy's gradient), on GPT-2, Llama
  and Gemma 2 (sliding and full layers, eager attention), with one micro-batch, two minibatches and two accumulated
  micro-batches, LoRA and gradient checkpointing (full and selective);
- every such pass was packed (a reward model the trainer makes from a 🤗 classifier too), and none read more positions than padded;
- a mixture-of-experts policy with its load-balancing loss on is refused with a one-line error (SFT and DPO too).
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
from instruct_goose.agent import _final_hidden, packed_forward

from _families import BY_NAME, CAUSAL, build_causal, build_classifier

RESPONSE, STEPS = 16, 2


def length_reward(prompts, completions):
    return [len(c) / 10 for c in completions]


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


@pytest.mark.parametrize("family", [f.name for f in CAUSAL])
def test_packed_states_are_the_padded_states(family, tokenizer):
    model = build_causal(BY_NAME[family], tokenizer, seed=0).eval()
    # shorter than the rows: the window bites
    if getattr(model.config, "sliding_window", None) is not None:
        model.config.sliding_window = 4
    torch.manual_seed(0)
    lengths = torch.tensor([24, 7, 15, 3])
    mask = (torch.arange(24) < lengths[:, None]).long()
    ids = torch.randint(5, len(tokenizer), (4, 24)) * mask + tokenizer.pad_token_id * (1 - mask)
    if family == "bloom":
        with pytest.raises(ValueError, match="`padding_free` needs a model that takes `position_ids`"):
            packed_forward(model, ids, mask, hidden=True)
        return
    padded = _final_hidden(model, ids, mask)[mask.bool()]
    for capacity in (None, 49):  # bins of the longest row (3 here); all in one
        torch.testing.assert_close(
            packed_forward(model, ids, mask, hidden=True, capacity=capacity), padded, rtol=1e-5, atol=1e-5
        )


def make(
    algo,
    family,
    tokenizer,
    tmp_path,
    padding_free,
    loss_type="grpo",
    lora=False,
    reward_model=False,
    dataset=None,
    **more,
):
    """A tiny trainer of `algo` on `family`, 2 steps of 4 responses that often stop early, packed or padded;
    `lora`: adapters (r 4) on every projection, the reference the adapter-off base."""
    policy = build_causal(BY_NAME[family], tokenizer, seed=0)
    common = {
        **dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=STEPS,
            seed=0,
            disable_tqdm=True,
            padding_free=padding_free,
            num_sample_generations=0,
            max_prompt_length=16,
            generation_kwargs={"sequence_bias": [[[tokenizer.eos_token_id], 6.0]]},
        ),
        **more,
    }
    value = build_classifier(BY_NAME[family], tokenizer, seed=1) if algo == "ppo_separate" else None
    for m in (policy, value):
        if m is not None and getattr(m.config, "sliding_window", None) is not None:
            m.config.sliding_window = 4
    if lora:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(
            policy, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
        )
    model = Agent(policy, value_model=value) if algo.startswith("ppo") else policy
    # SGD: the parameters' change is the gradients'
    sgd = (torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2), None)
    # a 🤗 classifier: the trainer makes its RewardModel
    reward = build_classifier(BY_NAME[family], tokenizer, seed=2) if reward_model else length_reward
    dataset = load_task("prompts") if dataset is None else dataset
    if algo.startswith("ppo"):
        return RLHFTrainer(
            model,
            args=RLHFConfig(response_length=RESPONSE, num_ppo_epochs=2, **common),
            optimizers=sgd,
            processing_class=tokenizer,
            reward_funcs=reward,
            train_dataset=dataset,
        )
    if algo == "rloo":
        return RLOOTrainer(
            model,
            args=RLOOConfig(response_length=RESPONSE, num_generations=2, **common),
            optimizers=sgd,
            processing_class=tokenizer,
            reward_funcs=reward,
            train_dataset=dataset,
        )
    return GRPOTrainer(
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
        reward_funcs=reward,
        train_dataset=dataset,
    )


def run(algo, family, tokenizer, tmp_path, padding_free, **more):
    trainer = make(algo, family, tokenizer, tmp_path / f"packed{padding_free}", padding_free, **more)
    models = [trainer.model.model if isinstance(trainer.model, Agent) else trainer.model, trainer.ref_model]
    if isinstance(trainer.model, Agent) and trainer.model.value_model is not None:
        models.append(trainer.model.value_model)
    # a reward model made by the trainer packs with it
    models += [m.backbone for m in trainer.reward_model.models]
    positions = []

    # positions read by each pass over whole sequences (the sampler's one-token steps aside)
    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if (
            ids is not None
            and ids.shape[1] > 1
            and kwargs.get("past_key_values", kwargs.get("cache")) is None
        ):
            mask = kwargs.get("attention_mask")
            # (positions, packed)
            positions.append((ids.numel(), isinstance(mask, dict) or (mask is not None and mask.ndim == 4)))

    for m in models:
        m.register_forward_pre_hook(hook, with_kwargs=True)
    trainer.train()
    return (
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        trainer.loop.state.history,
        positions,
    )


def assert_same_run(algo, family, tokenizer, tmp_path, **more):
    packed, hist_packed, pos_packed = run(algo, family, tokenizer, tmp_path, True, **more)
    padded, hist_padded, pos_padded = run(algo, family, tokenizer, tmp_path, False, **more)
    for name, p in padded.items():
        torch.testing.assert_close(
            packed[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{algo}/{family}/{more} {name}: {m}"
        )
    # val/clipfrac_avg compares (V_old + clamp(V − V_old) − R)² with (V − R)², equal but for rounding when V ≈
    # V_old (TRL's formula too).
    # The packed passes' matrices have other shapes, so log π rounds differently (~1e-7 relative); where π_old
    # comes from another pass than
    # the update's (two minibatches) that enters the ratio, and a loss of ~5e-3 moves by ~1e-6: hence abs 5e-6
    for row_packed, row_padded in zip(hist_packed, hist_padded, strict=True):
        for key, value in row_padded.items():
            if isinstance(value, float) and key not in ("eps", "step_time", "val/clipfrac_avg"):
                assert row_packed[key] == pytest.approx(value, rel=1e-4, abs=5e-6), (algo, family, more, key)
    # the same passes ...
    assert len(pos_packed) == len(pos_padded), (pos_packed, pos_padded)
    # ... every one packed, or none
    assert all(packed for _, packed in pos_packed) and not any(packed for _, packed in pos_padded)
    # never more positions (bins of the longest row)
    assert sum(n for n, _ in pos_packed) <= sum(n for n, _ in pos_padded)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
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
def test_packed_runs_train_as_padded_runs(algo, loss_type, family, tokenizer, tmp_path):
    assert_same_run(
        algo, family, tokenizer, tmp_path, **({} if loss_type is None else dict(loss_type=loss_type))
    )


@pytest.mark.parametrize(
    "algo, more",
    [
        ("ppo_separate", dict(num_mini_batches=2)),
        ("ppo", dict(ent_coef=0.01)),
        ("grpo", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, loss_type="dapo")),
        (
            "grpo",
            dict(
                num_mini_batches=2,
                entropy_coef=0.01,
                top_entropy_quantile=0.5,
                local_rollout_forward_batch_size=2,
            ),
        ),
        ("rloo", dict(num_mini_batches=2, local_rollout_forward_batch_size=2)),
        ("rloo", dict(lora=True, temperature=0.7)),
        (
            "grpo",
            dict(gradient_checkpointing=True, gradient_checkpointing_policy="selective", loss_type="dapo"),
        ),
        ("ppo_separate", dict(gradient_checkpointing=True)),
        ("grpo", dict(reward_model=True, loss_type="dapo")),
    ],
)
def test_packed_micro_batches_and_rollout_pieces(algo, more, tokenizer, tmp_path):
    """Two minibatches or two accumulated micro-batches (no kept pass: every pass its own), rollout passes in
    pieces of 2 rows, entropy with its gradient, LoRA (the reference: adapters off) at T = 0.7, gradient
    checkpointing, a reward model the trainer makes from a 🤗 classifier."""
    assert_same_run(algo, "llama", tokenizer, tmp_path, **more)


def test_a_load_balancing_loss_is_refused(tokenizer, tmp_path):
    """GRPO, SFT and DPO refuse packing with a mixture-of-experts load-balancing loss when they are made (it
    crashed inside 🤗's L_aux before), and take it with the loss off."""
    from instruct_goose.sft import SFTConfig, SFTTrainer
    from instruct_goose.dpo import DPOConfig, DPOTrainer

    policy = build_causal(BY_NAME["qwen3_moe"], tokenizer, seed=0)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        padding_free=True,
        router_aux_loss_coef=0.01,
        per_device_train_batch_size=4,
        num_generations=2,
    )
    with pytest.raises(
        ValueError,
        match=r"`padding_free` \(or `packing`\) with a load-balancing loss \(`router_aux_loss_coef`=0.01\)",
    ):
        GRPOTrainer(
            policy,
            args=args,
            processing_class=tokenizer,
            reward_funcs=length_reward,
            train_dataset=load_task("prompts"),
        )
    GRPOTrainer(
        policy,
        args=GRPOConfig(
            output_dir=str(tmp_path),
            padding_free=True,
            router_aux_loss_coef=0.0,
            per_device_train_batch_size=4,
            num_generations=2,
        ),
        processing_class=tokenizer,
        reward_funcs=length_reward,
        train_dataset=load_task("prompts"),
    )
    for Trainer, Config, data, more in (
        (SFTTrainer, SFTConfig, "sft", dict(padding_free=True)),
        (SFTTrainer, SFTConfig, "sft", dict(packing=True)),
        (DPOTrainer, DPOConfig, "preferences", dict(padding_free=True)),
    ):
        with pytest.raises(ValueError, match=r"`padding_free` \(or `packing`\) with a load-balancing loss"):
            Trainer(
                policy,
                args=Config(output_dir=str(tmp_path), router_aux_loss_coef=0.01, **more),
                processing_class=tokenizer,
                train_dataset=load_task(data),
            )
        Trainer(
            policy,
            args=Config(output_dir=str(tmp_path), router_aux_loss_coef=0.0, **more),
            processing_class=tokenizer,
            train_dataset=load_task(data),
        )
    # a checkpoint's config with it on: the forward refuses too
    policy.config.output_router_logits = True
    with pytest.raises(ValueError, match="with the model's `output_router_logits` on"):
        packed_forward(policy, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
