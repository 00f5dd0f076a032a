"""🤗 Trainer's surface on every trainer (issue 61, item 7 and 8): `train()` returns 🤗's `TrainOutput`, `trainer.model`
is the trained model, `trainer.state` is 🤗's `TrainerState` kept during the run, `log_metrics`/`save_metrics`/
`save_state` write 🤗's files, and a `checkpoint-N` of a 🤗 model loads with `from_pretrained` and `pipeline` (resuming
from it stays exact: tests/test_crash_resume.py)."""

import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, TrainerCallback, TrainerState
from transformers.trainer_utils import TrainOutput

from instruct_goose import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    RewardConfig,
    RewardModel,
    RewardTrainer,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
    load_task,
    task_tokenizer,
    tiny_causal_lm,
)

PROMPTS = [{"prompt": p} for p in ("the film was", "I thought it", "a goose", "the plot")] * 4
COMMON = dict(
    max_steps=2, logging_steps=1, save_steps=1, disable_tqdm=True, report_to="none", learning_rate=1e-2
)


def length(prompts, completions):
    return [len(c) / 10 for c in completions]


def make(algo, tmp_path, callbacks=None):
    "A two-step run of `algo` on the toy model, every step logged and checkpointed."
    tok, out = task_tokenizer(), str(tmp_path / algo)
    model = tiny_causal_lm(tok, seed=0)
    if algo == "sft":
        args = SFTConfig(output_dir=out, per_device_train_batch_size=2, **COMMON)
        return SFTTrainer(
            model, args, load_task("sft").select(range(8)), processing_class=tok, callbacks=callbacks
        )
    if algo == "reward":
        args = RewardConfig(output_dir=out, per_device_train_batch_size=2, **COMMON)
        return RewardTrainer(
            RewardModel(model, tokenizer=tok),
            args,
            load_task("preferences").select(range(8)),
            processing_class=tok,
            callbacks=callbacks,
        )
    if algo == "dpo":
        args = DPOConfig(output_dir=out, per_device_train_batch_size=2, **COMMON)
        return DPOTrainer(
            model,
            args=args,
            train_dataset=load_task("preferences").select(range(8)),
            processing_class=tok,
            callbacks=callbacks,
        )
    on_policy = dict(output_dir=out, per_device_train_batch_size=4, num_sample_generations=0, **COMMON)
    if algo == "ppo":
        args = RLHFConfig(response_length=6, num_ppo_epochs=1, **on_policy)
    elif algo == "rloo":
        args = RLOOConfig(max_completion_length=6, num_generations=2, num_ppo_epochs=1, **on_policy)
    else:
        args = GRPOConfig(max_completion_length=6, num_generations=2, **on_policy)
    trainer = {"ppo": RLHFTrainer, "rloo": RLOOTrainer, "grpo": GRPOTrainer}[algo]
    return trainer(
        model=model,
        args=args,
        processing_class=tok,
        train_dataset=PROMPTS,
        reward_funcs=[length],
        callbacks=callbacks,
    )


ALGOS = ["sft", "reward", "dpo", "ppo", "rloo", "grpo"]


class SeesState(TrainerCallback):
    "Records, at each step's end, what `trainer.state` says then (the trainer is set once it exists)."

    trainer = None

    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        s = self.trainer.state
        self.seen.append((s.global_step, s.max_steps, len(s.log_history)))


@pytest.mark.parametrize("algo", ALGOS)
def test_train_returns_trainoutput_and_the_state_follows_the_run(algo, tmp_path):
    watcher = SeesState()
    trainer = make(algo, tmp_path, callbacks=[watcher])
    watcher.trainer = trainer
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert isinstance(trainer.state, TrainerState) and trainer.state.global_step == 0
    output = trainer.train()
    assert isinstance(output, TrainOutput) and output.global_step == 2
    # the mean of the two logged losses, as 🤗's mean over every step when each is logged
    losses = [
        row.get("loss", row.get("loss/policy_avg")) for row in trainer.state.log_history[:-1] if "step" in row
    ]
    assert len(losses) == 2 and output.training_loss == pytest.approx(sum(losses) / 2)
    assert output.metrics["train_loss"] == output.training_loss
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "epoch"} <= set(
        output.metrics
    )
    # during the run: the step as it went, the rows logged so far
    assert watcher.seen == [(1, 2, 1), (2, 2, 2)]
    state = trainer.state
    assert state.global_step == 2 and state.max_steps == 2 and state.epoch > 0
    assert [row["step"] for row in state.log_history] == [1, 2, 2]
    assert state.log_history[-1]["train_loss"] == output.training_loss  # 🤗's closing row
    # the weights moved (TRL's tests check it this way)
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved


@pytest.mark.parametrize("algo", ["sft", "grpo"])
def test_metrics_and_state_files_are_hf_trainers(algo, tmp_path):
    trainer = make(algo, tmp_path)
    output = trainer.train()
    trainer.log_metrics("train", output.metrics)
    trainer.save_metrics("train", output.metrics)
    trainer.save_metrics("eval", {"eval_loss": 1.5})
    trainer.save_state()
    out = tmp_path / algo
    assert json.loads((out / "train_results.json").read_text()) == output.metrics
    assert json.loads((out / "all_results.json").read_text()) == {**output.metrics, "eval_loss": 1.5}
    saved = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert saved.global_step == 2 and saved.max_steps == 2
    assert saved.log_history == json.loads(json.dumps(trainer.state.log_history))


@pytest.mark.parametrize("algo", ["sft", "dpo", "grpo"])
def test_checkpoints_load_with_from_pretrained_and_pipeline(algo, tmp_path):
    trainer = make(algo, tmp_path)
    trainer.train()
    last = tmp_path / algo / "checkpoint-2"
    assert {"config.json", "tokenizer_config.json"} <= {p.name for p in last.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(last)
    for (name, p), q in zip(loaded.named_parameters(), trainer.model.parameters()):
        assert torch.equal(p, q.detach().cpu()), name
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / algo / "checkpoint-1"))
    assert pipe("the film was", max_new_tokens=2, do_sample=False)[0]["generated_text"].startswith(
        "the film was"
    )


@pytest.mark.parametrize("algo", ["sft", "dpo", "ppo", "grpo"])
def test_the_learning_rate_logged_is_the_one_the_step_used(algo, tmp_path):
    """🤗 Trainer and TRL log, at step k, the rate the k-th optimizer step used (read before the schedule steps).
    The linear schedule over N = 2 steps without warm-up gives lr·(N − k + 1)/N: 1e-2 then 5e-3 (it logged
    [5e-3, 0.0], a step late, before)."""
    trainer = make(algo, tmp_path)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "learning_rate" in r or "lr" in r]
    logged = [r.get("learning_rate", r.get("lr")) for r in rows][:2]
    assert logged == pytest.approx([1e-2, 5e-3], rel=1e-9), logged
