"""The TRL options of issue 28 end to end: `log_completions` (GRPO and RLOO on the tiny policy): the rows of completions.jsonl, their scores against the
logged reward means, their advantages against the group formula, resume without doubled or lost rows, `goose completions`.

- `test_grpo_logs_every_completion`: 2 steps, 2 prompts × 4 completions: 16 rows, 8 per step; each step's mean `length` score is
  the logged `rewards/length/mean`, and the advantages are `group_advantages` of the scores.
- `test_goose_completions_shows_the_last`: `goose completions RUN_DIR --last 3` prints the last three rows; no file: status 2.
- `test_resume_neither_doubles_nor_loses_rows` (slow): resumed from step 1's checkpoint, step 2 is redone: the file again holds steps
  1 and 2 once each, with the same rows as the uninterrupted run.
- `test_unique_prompts_and_rloo` (slow): `log_unique_prompts` keeps one row per prompt; RLOO logs its leave-one-out advantages.
- `test_rloo_syncs_its_reference` (slow): RLOO's TR-DPO sync after step 2: π_ref = α·θ₂ + (1 − α)·π₀.
- `test_adaptive_entropy_coefficient_survives_resume` (slow): GRPO's entropy controller, applied 0 then c₁ = 0.03, is checkpointed.
"""

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from instruct_goose import (
    GRPOConfig,
    GRPOTrainer,
    RLOOConfig,
    RLOOTrainer,
    group_advantages,
    load_task,
    read_completions,
    rloo_advantages,
)


def length(prompts, completions):
    return [len(c) / 10 for c in completions]


def _train(policy_dir, out, trainer=GRPOTrainer, config=GRPOConfig, resume=None, **options):
    args = config(
        output_dir=str(out),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        logging_steps=1,
        save_steps=1,
        num_sample_generations=0,
        disable_tqdm=True,
        resume_from_checkpoint=resume,
        **{"learning_rate": 1e-3, "log_completions": True, "num_completions_to_print": 2, **options},
    )
    t = trainer(
        AutoModelForCausalLM.from_pretrained(policy_dir),
        args=args,
        processing_class=AutoTokenizer.from_pretrained(policy_dir),
        train_dataset=load_task("prompts").select(range(8)),
        reward_funcs=length,
    )
    t.train()
    return t


@pytest.fixture(scope="module")
def grpo_run(policy_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_completions")
    return out, _train(policy_dir, out)


def test_grpo_logs_every_completion(grpo_run):
    out, trainer = grpo_run
    rows = read_completions(out)
    assert [r["step"] for r in rows] == [1] * 8 + [2] * 8
    assert set(rows[0]) == {"step", "prompt", "completion", "length", "advantage"}
    for step, logged in zip((1, 2), trainer.loop.state.history):
        mine = [r for r in rows if r["step"] == step]
        scores = torch.tensor([r["length"] for r in mine])
        # the reward function's own numbers (float32)
        assert torch.allclose(scores, torch.tensor([len(r["completion"]) / 10 for r in mine]), atol=1e-6)
        assert abs(scores.mean().item() - logged["rewards/length/mean"]) <= 1e-6, (
            step,
            logged["rewards/length/mean"],
        )
        assert torch.allclose(
            torch.tensor([r["advantage"] for r in mine]), group_advantages(scores, 4), atol=1e-5
        )
        # G completions of each prompt in a row
        assert all(mine[i]["prompt"] == mine[i - i % 4]["prompt"] for i in range(8))


@pytest.mark.slow
def test_resume_neither_doubles_nor_loses_rows(grpo_run, policy_dir, tmp_path):
    out, _ = grpo_run
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    _train(policy_dir, resumed, resume=str(resumed / "checkpoint-1"))
    again, before = read_completions(resumed), read_completions(out)
    assert [r["step"] for r in again] == [1] * 8 + [2] * 8
    assert [r["completion"] for r in again] == [r["completion"] for r in before]


def test_goose_completions_shows_the_last(grpo_run, goose_here):
    out, _ = grpo_run
    shown = goose_here("completions", str(out), "--last", "3")
    assert shown.returncode == 0, shown.stderr
    last = read_completions(out, last=3)
    assert "the last 3 completions" in shown.stdout and all(r["prompt"][:10] in shown.stdout for r in last)
    missing = goose_here("completions", str(out / "nothing"))
    assert missing.returncode == 2 and "log_completions=True" in missing.stderr


@pytest.mark.slow
def test_unique_prompts_and_rloo(policy_dir, tmp_path):
    t = _train(
        policy_dir,
        tmp_path / "rloo",
        trainer=RLOOTrainer,
        config=RLOOConfig,
        log_unique_prompts=False,
        num_iterations=1,
    )
    rows = read_completions(tmp_path / "rloo")
    assert len(rows) == 16
    first = [r for r in rows if r["step"] == 1]
    # β·KL = 0 at step 1: π = π_ref, so the reward is the score
    rlhf = torch.tensor([r["length"] for r in first])
    assert torch.allclose(torch.tensor([r["advantage"] for r in first]), rloo_advantages(rlhf, 4), atol=1e-5)
    _train(policy_dir, tmp_path / "unique", log_unique_prompts=True)
    unique = read_completions(tmp_path / "unique")
    assert [r["step"] for r in unique] == [1, 1, 2, 2] and unique[0]["prompt"] != unique[1]["prompt"]


@pytest.mark.slow
def test_rloo_syncs_its_reference(policy_dir, tmp_path):
    "RLOO's `sync_ref_model` (TR-DPO) after step 2 of 2: π_ref = α·θ₂ + (1 − α)·π₀, π₀ the initial policy."
    initial = AutoModelForCausalLM.from_pretrained(policy_dir)
    t = _train(
        policy_dir,
        tmp_path / "rloo_sync",
        trainer=RLOOTrainer,
        config=RLOOConfig,
        num_iterations=1,
        sync_ref_model=True,
        ref_model_mixup_alpha=0.25,
        ref_model_sync_steps=2,
        learning_rate=1e-2,
    )
    for r, p, p0 in zip(t.ref_model.parameters(), t.model.parameters(), initial.parameters()):
        assert torch.allclose(r, 0.25 * p.detach() + 0.75 * p0.detach(), atol=1e-6)
    assert (
        max((p.detach() - p0).abs().max().item() for p, p0 in zip(t.model.parameters(), initial.parameters()))
        > 1e-4
    )


@pytest.mark.slow
def test_adaptive_entropy_coefficient_survives_resume(policy_dir, tmp_path):
    """GRPO's `use_adaptive_entropy` controller is saved with each checkpoint: resumed from step 1, it ends where
    the whole run ends."""
    options = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_coef_delta=0.02,
        entropy_target=50.0,
        log_completions=False,
    )
    whole = _train(policy_dir, tmp_path / "whole", **options)
    # two steps below the target: 0.01 + 2 × 0.02
    assert whole.entropy_ctl.state_dict()["coef"] == pytest.approx(0.05)
    # applied: off, then c₁
    assert [row["entropy_coef"] for row in whole.loop.state.history] == pytest.approx([0.0, 0.03])
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    resumed = _train(
        policy_dir, tmp_path / "resumed", resume=str(tmp_path / "resumed" / "checkpoint-1"), **options
    )
    assert resumed.entropy_ctl.state_dict() == pytest.approx(whole.entropy_ctl.state_dict())
