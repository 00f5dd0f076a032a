"""The memory levers: each is a config field, runs, and changes results by no more than its stated tolerance.

- `gradient_checkpointing`: recomputes activations in the backward pass; the same arithmetic, so equal results (1e-6).
  `gradient_checkpointing_policy="selective"` keeps the matmuls' outputs and recomputes the rest: equal results too.
- `local_rollout_forward_batch_size`: rows per forward pass in the rollout; given the same samples the rollout is the
  same (1e-5). It also sets how sampling is seeded (per chunk), so a different value draws different samples.
- `offload_models`: the reference and reward models wait on the CPU; equal results (1e-6), and the models go to the
  device only while they run.
- `mixed_precision="bf16"`: π_old is computed under the same autocast as π_θ, so the first epoch's ratio is exactly 1.
"""

import copy
import math

import pytest
import torch
from torch import nn

from instruct_goose import (
    Agent,
    GRPOConfig,
    GRPOTrainer,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    RewardModel,
    TrainLoop,
    TrainingConfig,
    create_reference_model,
    load_task,
    task_tokenizer,
    tiny_causal_lm,
)
from instruct_goose.levers import enable_gradient_checkpointing, keep_matmul_outputs


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def reward(prompts, completions):
    return [len(c) / 10 for c in completions]


def ppo(tokenizer, tmp_path, **config):
    model = tiny_causal_lm(tokenizer, seed=0)
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        total_episodes=16,
        response_length=8,
        local_rollout_forward_batch_size=4,
        disable_tqdm=True,
        num_sample_generations=0,
        learning_rate=1e-3,
    )
    torch.manual_seed(0)
    trainer = RLHFTrainer(
        Agent(copy.deepcopy(model)),
        create_reference_model(model),
        RLHFConfig(**{**settings, **config}),
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=load_task("prompts"),
    )
    trainer.train()
    return trainer


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_gradient_checkpointing_gives_the_same_run(tokenizer, tmp_path):
    plain = ppo(tokenizer, tmp_path / "plain")
    checkpointed = ppo(tokenizer, tmp_path / "checkpointed", gradient_checkpointing=True)
    assert (
        checkpointed.model.model.is_activation_checkpointing
        and not plain.model.model.is_activation_checkpointing
    )
    assert max_difference(plain.model, checkpointed.model) <= 1e-6
    # training moved it
    assert max_difference(plain.model, Agent(tiny_causal_lm(tokenizer, seed=0))) > 1e-4


def grpo(tokenizer, tmp_path, peft_config=None, **config):
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        total_episodes=8,
        max_completion_length=8,
        beta=0.05,
        learning_rate=1e-3,
        disable_tqdm=True,
        num_sample_generations=0,
    )
    torch.manual_seed(0)
    trainer = GRPOTrainer(
        tiny_causal_lm(tokenizer, arch="llama", seed=0),
        None,
        GRPOConfig(**{**settings, **config}),
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=load_task("prompts"),
        peft_config=peft_config,
    )
    trainer.train()
    return trainer


def test_selective_checkpointing_gives_the_same_run(tokenizer, tmp_path):
    """PPO (GPT-2, float32) and GRPO (Llama, bf16 autocast, with the kept first pass; full and LoRA) with
    selective checkpointing end on the very weights of the plain runs."""
    selective = dict(gradient_checkpointing=True, gradient_checkpointing_policy="selective")
    plain, checkpointed = (
        ppo(tokenizer, tmp_path / "plain"),
        ppo(tokenizer, tmp_path / "selective", **selective),
    )
    assert max_difference(plain.model, checkpointed.model) == 0.0
    plain, checkpointed = (
        grpo(tokenizer, tmp_path / "grpo-plain", mixed_precision="bf16"),
        grpo(tokenizer, tmp_path / "grpo-selective", mixed_precision="bf16", **selective),
    )
    for layer in checkpointed.model.model.layers:
        assert (
            layer.gradient_checkpointing
            and layer._gradient_checkpointing_func.keywords["context_fn"] is keep_matmul_outputs
        )
    assert not plain.model.model.layers[0].gradient_checkpointing
    assert max_difference(plain.model, checkpointed.model) == 0.0
    # training moved it
    assert max_difference(plain.model, tiny_causal_lm(tokenizer, arch="llama", seed=0)) > 1e-4
    from peft import LoraConfig  # LoRA's adapter matmuls are kept too

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    plain, checkpointed = (
        grpo(tokenizer, tmp_path / "lora-plain", lora, mixed_precision="bf16"),
        grpo(tokenizer, tmp_path / "lora-selective", lora, mixed_precision="bf16", **selective),
    )
    assert max_difference(plain.model, checkpointed.model) == 0.0


def test_gradient_checkpointing_really_recomputes(tokenizer):
    "In train mode a checkpointed block's attention runs twice per backward: once forward, once to recompute."

    def attention_calls(agent):
        calls = []
        agent.model.transformer.h[0].attn.register_forward_hook(lambda *args: calls.append(1))
        agent.train()(torch.tensor([[5, 6, 7, 8]])).values.sum().backward()
        return len(calls)

    assert attention_calls(Agent(tiny_causal_lm(tokenizer, seed=0))) == 1
    assert attention_calls(enable_gradient_checkpointing(Agent(tiny_causal_lm(tokenizer, seed=0)))) == 2


def test_gradient_checkpointing_reaches_every_model_inside(tokenizer):
    critic_agent = Agent(
        tiny_causal_lm(tokenizer, seed=0), value_model=tiny_causal_lm(tokenizer, arch="llama", seed=1)
    )
    enable_gradient_checkpointing(critic_agent)
    assert (
        critic_agent.model.is_activation_checkpointing
        and critic_agent.value_model.is_activation_checkpointing
    )
    assert enable_gradient_checkpointing(
        RewardModel(tiny_causal_lm(tokenizer, seed=0))
    ).backbone.is_activation_checkpointing
    with pytest.raises(ValueError, match="`gradient_checkpointing`: Linear holds no 🤗 model"):
        enable_gradient_checkpointing(nn.Linear(2, 2))
    loop = TrainLoop(
        TrainingConfig(output_dir="/tmp/goose-gc-test", gradient_checkpointing=True, disable_tqdm=True)
    )
    with pytest.raises(ValueError, match="`gradient_checkpointing`"):
        loop.setup_optimizer(nn.Linear(2, 2), num_training_steps=1)


def test_offload_models_gives_the_same_run(tokenizer, tmp_path):
    plain = ppo(tokenizer, tmp_path / "plain")
    offloaded = ppo(tokenizer, tmp_path / "offloaded", offload_models=True)
    assert max_difference(plain.model, offloaded.model) <= 1e-6
    assert next(offloaded.ref_model.parameters()).device.type == "cpu"


class Recorder(nn.Module):
    "Records where it is asked to move."

    def __init__(self):
        super().__init__()
        self.moves = []

    def to(self, device):
        self.moves.append(str(device))
        return self


@pytest.mark.parametrize("offload", [True, False])
def test_on_device_moves_only_when_offloading(offload, tokenizer):
    trainer = RLOOTrainer(
        tiny_causal_lm(tokenizer),
        tiny_causal_lm(tokenizer),
        RLOOConfig(offload_models=offload, output_dir="/tmp/goose-offload-test"),
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=[{"prompt": "x"}],
    )
    model = Recorder()  # only the device's name is used
    with trainer.on_device(model, "cuda:7"):
        assert model.moves == (["cuda:7"] if offload else [])
    assert model.moves == (["cuda:7", "cpu"] if offload else [])
    with pytest.raises(RuntimeError, match="boom"):  # back on the CPU even when the block fails
        with trainer.on_device(model, "cuda:7"):
            raise RuntimeError("boom")
    assert model.moves[-1:] == (["cpu"] if offload else [])
    # a reward function is not a module: left alone
    with trainer.on_device(reward, "cuda:7") as same:
        assert same is reward


def test_rollout_chunking_does_not_change_the_rollout(tokenizer, tmp_path):
    # one short step, to have a trained value head
    trainer = ppo(tokenizer, tmp_path / "run", total_episodes=4)
    prompts = load_task("prompts")["prompt"][:6]
    torch.manual_seed(0)
    samples = trainer.sample_and_score(trainer.model.model, prompts)
    rollouts = []
    for chunk in (1, 4, 64):
        trainer.config.local_rollout_forward_batch_size = chunk
        stats = trainer.model.response_stats(
            samples.query_ids, samples.query_attention_mask, samples.response_ids, samples.response_mask
        )
        rollouts.append(
            trainer.make_rollout(
                samples.query_ids,
                samples.query_attention_mask,
                samples.response_ids,
                samples.response_mask,
                samples.scores,
                stats.logprobs,
                stats.values,
            )
        )
    for other in rollouts[1:]:
        for name in ("ref_logprobs", "rewards", "advantages", "returns"):
            assert (getattr(other, name) - getattr(rollouts[0], name)).abs().max() <= 1e-5, name


def test_bf16_rollout_is_computed_under_the_same_autocast(tokenizer, tmp_path):
    """One PPO epoch over micro-batches that are exactly the rollout's chunks: π_old and π_θ are the same
    computation."""
    trainer = ppo(tokenizer, tmp_path, mixed_precision="bf16", num_ppo_epochs=1, total_episodes=8)
    for row in trainer.loop.state.history:
        assert row["val/ratio"] == 1.0 and row["policy/approxkl_avg"] == 0.0, row
        assert all(math.isfinite(v) for v in row.values())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_bf16_reference_copy_in_half_precision_gives_the_same_run(arch, tokenizer, tmp_path, monkeypatch):
    """Under bf16 mixed precision the trainer's own reference copy, and a reward model it loads from a path, hold
    their linear layers in bf16 (`half_linears`): every logged number is the one the float32 models give, and
    the first KL is exactly 0."""
    from instruct_goose import engine

    RewardModel(tiny_causal_lm(tokenizer, arch=arch, seed=1), tokenizer).save_pretrained(tmp_path / "rm")

    def run(path):
        config = RLOOConfig(
            output_dir=str(path),
            mixed_precision="bf16",
            per_device_train_batch_size=4,
            num_generations=2,
            total_episodes=8,
            response_length=8,
            beta=0.05,
            learning_rate=1e-3,
            disable_tqdm=True,
            num_sample_generations=0,
        )
        trainer = RLOOTrainer(
            tiny_causal_lm(tokenizer, arch=arch, seed=0),
            None,
            config,
            processing_class=tokenizer,
            reward_funcs=str(tmp_path / "rm"),
            train_dataset=load_task("prompts"),
        )
        trainer.train()
        # eps: wall-clock
        return trainer, [
            {k: v for k, v in row.items() if k not in ("eps", "step_time")}
            for row in trainer.loop.state.history
        ]

    half, half_rows = run(tmp_path / "half")
    linear = nn.Linear if arch == "llama" else type(half.ref_model.transformer.h[0].attn.c_attn)
    for made_here in (half.ref_model, half.reward_model.models[0].model):
        layers = [m for m in made_here.modules() if type(m) is linear]
        assert layers and {p.dtype for m in layers for p in m.parameters(recurse=False)} == {torch.bfloat16}
        assert {
            p.dtype
            for n, p in made_here.named_parameters()
            if "embed" in n or "wte" in n or "norm" in n or "ln_" in n
        } == {torch.float32}
    monkeypatch.setattr(engine, "half_linears", lambda model, dtype: 0)  # the float32 models
    full, full_rows = run(tmp_path / "full")
    assert {p.dtype for p in full.ref_model.parameters()} | {
        p.dtype for p in full.reward_model.models[0].parameters()
    } == {torch.float32}
    assert half_rows == full_rows and len(half_rows) == 2
    # π_θ = π_ref at the first rollout, to the bit
    assert half_rows[0]["objective/kl"] == 0.0, half_rows[0]
