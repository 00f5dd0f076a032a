"""GRPO on the shared engine, end to end: 1 vs 2 processes, kill-and-resume, the first-iteration ratio, weighted rewards.

- `test_two_processes_equal_one` (slow, torchrun): 1 process × 2 micro-batches vs 2 CPU processes (gloo) × 1 micro-batch,
  with `beta` > 0 (reference log-probabilities, the k3 term), `scale_rewards="batch"` (the std of all processes' rewards)
  and `num_iterations=2` (old log-probabilities at rollout): final weights and every logged metric equal to 1e-6.
- `test_killed_run_resumes_to_the_same_result`: a run killed (`os._exit`, no clean-up) in its reward function after a
  checkpoint, resumed with `resume_from_checkpoint="latest"`, ends with the weights and metrics of an uninterrupted run.
- `test_first_iteration_ratio_is_one`: with μ = 2 the rollout's log-probabilities are computed at sampling time; on the
  first pass the ratio is exactly 1, nothing is clipped, and the first micro-batch's loss is −Σ n_i A_i / N (dapo).
- `test_weighted_rewards_log_each_mean`: several reward functions with weights log `rewards/<name>/mean`, and `reward`
  is their weighted sum.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from instruct_goose import GRPOConfig, GRPOTrainer, load_task

from conftest import run_here

SCRIPT = '''
import json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from instruct_goose import GRPOConfig, GRPOTrainer
policy, out, accumulation = sys.argv[1], sys.argv[2], int(sys.argv[3])
resume = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
crash_at = int(os.environ.get("CRASH_AT_CALL", "0"))      # 1-based reward call at which the process dies
calls = [0]
def length(prompts, completions):
    calls[0] += 1
    if calls[0] == crash_at: os._exit(3)                  # like SIGKILL: no clean-up, no checkpoint of this step
    return [len(c) / 10 for c in completions]
tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
prompts = [{"prompt": p} for p in json.load(open(os.path.join(policy, "prompts.json")))]
args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation, max_steps=int(os.environ.get("STEPS", "4")),
                  num_generations=2, max_completion_length=6, local_rollout_forward_batch_size=4, num_iterations=2,
                  beta=0.1, scale_rewards="batch", loss_type="dapo", num_sample_generations=0, disable_tqdm=True,
                  learning_rate=1e-3, save_steps=int(os.environ.get("SAVE_STEPS", "2")), logging_steps=1, resume_from_checkpoint=resume)
trainer = GRPOTrainer(model, args=args, processing_class=tokenizer, train_dataset=prompts, reward_funcs=length)
trainer.train()
rank = os.environ.get("RANK", "0")
torch.save(trainer.model.state_dict(), f"{out}/weights{rank}.pt")
json.dump(trainer.loop.state.history, open(f"{out}/history{rank}.json", "w"))
'''


@pytest.fixture(scope="module")
def setup_dir(policy_dir, tmp_path_factory):
    "The tiny policy, the task prompts and the training script, in one directory."
    where = tmp_path_factory.mktemp("grpo_setup")
    shutil.copytree(policy_dir, where, dirs_exist_ok=True)
    (where / "prompts.json").write_text(json.dumps(list(load_task("prompts")["prompt"])))
    (where / "train.py").write_text(SCRIPT)
    return where


def _run(setup_dir, out, processes=1, accumulation=2, resume=None, check=True, **env):
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(out) + "-cache",
        **{k: str(v) for k, v in env.items()},
    }
    script = [str(setup_dir / "train.py"), str(setup_dir), str(out), str(accumulation), resume or "-"]
    if processes == 1:
        command = [sys.executable] + script
    else:
        command = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            str(processes),
        ] + script
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    if not check:
        return result
    assert result.returncode == 0, result.stderr[-8000:]
    return torch.load(out / "weights0.pt"), json.loads((out / "history0.json").read_text())


def _run_here(setup_dir, out, accumulation=2, **env):
    "The uninterrupted reference run, in this process (`run_here`)."
    env = {"ACCELERATE_USE_CPU": "true", **{k: str(v) for k, v in env.items()}}
    assert run_here(setup_dir / "train.py", setup_dir, out, accumulation, "-", env=env) == 0
    return torch.load(out / "weights0.pt"), json.loads((out / "history0.json").read_text())


def _assert_same(a, b, what, steps=4, eps=1e-6):
    "Weights to `eps`, and every logged metric but wall-clock speed to `eps` relative."
    (weights_a, history_a), (weights_b, history_b) = a, b
    worst = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    assert worst <= eps, f"{what}: weights differ by {worst}"
    assert len(history_a) == len(history_b) == steps
    for row_a, row_b in zip(history_a, history_b):
        assert row_a.keys() == row_b.keys(), (what, sorted(row_a.keys() ^ row_b.keys()))
        for key in row_a.keys() - {"eps", "step_time"}:
            assert abs(row_a[key] - row_b[key]) <= eps * max(1, abs(row_a[key])), (
                what,
                row_a["step"],
                key,
                row_a[key],
                row_b[key],
            )


@pytest.mark.slow
def test_two_processes_equal_one(setup_dir, tmp_path):
    one = _run(setup_dir, tmp_path / "one", processes=1, accumulation=2)
    two = _run(setup_dir, tmp_path / "two", processes=2, accumulation=1)
    rank1 = torch.load(tmp_path / "two" / "weights1.pt")
    for name, value in two[0].items():
        assert torch.equal(rank1[name], value), name  # the processes agree
    assert {"kl", "reward", "reward_std", "clip_ratio/region_mean", "grad_norm"} <= one[1][0].keys()
    # the k3 term was live
    assert one[1][-1]["kl"] > 0
    _assert_same(one, two, "1 process x 2 micro-batches vs 2 processes")
    start = AutoModelForCausalLM.from_pretrained(setup_dir).state_dict()
    # and training did move them
    assert not torch.equal(one[0]["lm_head.weight"], start["lm_head.weight"])


def test_killed_run_resumes_to_the_same_result(setup_dir, tmp_path):
    env = dict(STEPS=4, SAVE_STEPS=1)
    straight = _run_here(setup_dir, tmp_path / "straight", **env)
    # dies sampling step 3
    killed = _run(setup_dir, tmp_path / "killed", check=False, CRASH_AT_CALL=3, **env)
    assert killed.returncode == 3, killed.stderr[-4000:]
    assert sorted(p.name for p in (tmp_path / "killed").glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    resumed = _run(setup_dir, tmp_path / "killed", resume="latest", **env)
    _assert_same(straight, resumed, "uninterrupted vs killed at step 3 and resumed from checkpoint-2")


def _tiny_trainer(policy_dir, tmp_path, reward, **overrides):
    args = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=1,
        num_generations=4,
        max_completion_length=8,
        local_rollout_forward_batch_size=4,
        num_sample_generations=0,
        disable_tqdm=True,
        learning_rate=1e-3,
        logging_steps=1,
    )
    args = {**args, **overrides}
    return GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(policy_dir),
        args=GRPOConfig(**args),
        processing_class=AutoTokenizer.from_pretrained(policy_dir),
        train_dataset=load_task("prompts").select(range(64)),
        reward_funcs=reward,
    )


def length(prompts, completions):
    return [len(c) / 10 for c in completions]


def test_first_iteration_ratio_is_one(policy_dir, tmp_path, monkeypatch):
    from instruct_goose import grpo

    trainer = _tiny_trainer(
        policy_dir, tmp_path, length, num_iterations=2, loss_type="dapo", learning_rate=1e-6
    )
    # μ = 2: old log-probabilities are computed at rollout time
    assert not trainer.reuses_current_logprobs
    seen = []  # (micro-batch, its loss terms, the ratio) in order
    token_loss = grpo.grpo_token_loss

    def recording_token_loss(*args, **kwargs):
        out = token_loss(*args, **kwargs)
        seen[-1]["ratio"] = out[1].detach()
        return out

    monkeypatch.setattr(grpo, "grpo_token_loss", recording_token_loss)
    loss_of = trainer.micro_batch_loss

    def recording_loss(policy, part, draw):
        seen.append({"part": part})
        losses, stats = loss_of(policy, part, draw)
        seen[-1]["loss"], seen[-1]["stats"] = losses["policy"].detach(), stats
        return losses, stats

    trainer.micro_batch_loss = recording_loss
    trainer.train()
    assert len(seen) == 4  # 2 passes × 2 micro-batches
    first_pass = seen[:2]
    for s in first_pass:
        assert s["stats"]["clip_ratio/region_mean"] == 0
        mask = s["part"].loss_mask
        assert torch.equal(s["ratio"][mask], torch.ones_like(s["ratio"][mask])), (
            (s["ratio"][mask] - 1).abs().max()
        )
    part = first_pass[0]["part"]
    n = part.loss_mask.sum(1).float()  # n_i: tokens of completion i
    expected = -(n * part.advantages).sum() / n.sum()  # −Σ n_i A_i / N
    assert part.advantages.abs().sum() > 0  # a non-trivial check: not every group was tied
    torch.testing.assert_close(first_pass[0]["loss"], expected, atol=1e-6, rtol=0)
    # logged: the mean over both passes (lr 1e-6: pass 2 stays inside ±ε)
    row = trainer.loop.state.history[0]
    assert row["clip_ratio/region_mean"] == row["clip_ratio/low_mean"] == row["clip_ratio/high_mean"] == 0


def test_first_logged_step_has_no_clipping_with_one_pass(policy_dir, tmp_path):
    """μ = 1: the sampling policy is the current one, so the first (only) pass clips nothing: `clip_ratio/*` are
    0."""
    trainer = _tiny_trainer(policy_dir, tmp_path, length, num_iterations=1, max_steps=2)
    assert trainer.reuses_current_logprobs
    trainer.train()
    for row in trainer.loop.state.history:
        assert row["clip_ratio/region_mean"] == row["clip_ratio/low_mean"] == row["clip_ratio/high_mean"] == 0


def has_digit(prompts, completions):
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def test_weighted_rewards_log_each_mean(policy_dir, tmp_path):
    trainer = _tiny_trainer(policy_dir, tmp_path, [length, has_digit], reward_weights=[1.0, 0.5], max_steps=2)
    trainer.train()
    for row in trainer.loop.state.history:
        assert {"rewards/length/mean", "rewards/has_digit/mean"} <= row.keys(), sorted(row)
        assert row["reward"] == pytest.approx(
            row["rewards/length/mean"] + 0.5 * row["rewards/has_digit/mean"], abs=1e-5
        )
        assert 0 <= row["rewards/has_digit/mean"] <= 1


def test_all_truncated_minibatch_does_not_stop_training(policy_dir, tmp_path):
    """DAPO's `mask_truncated_completions`: a minibatch whose completions all ran out of length has no token in its loss.
    TRL then takes a zero-loss step (its normaliser is clamped at 1); a long run must not die on such a draw.
    FAILS at a26e883: `TrainLoop.loss_scale` raises "the minibatch has nothing to learn from (0 tokens in its loss)"
    (dapo/bnpo count tokens of `loss_mask`; grpo/dr_grpo count rows and do not raise)."""
    trainer = _tiny_trainer(
        policy_dir, tmp_path, length, max_completion_length=2, mask_truncated_completions=True, max_steps=2
    )
    trainer.train()
    rows = trainer.loop.state.history
    # every completion truncated: nothing to learn
    assert len(rows) == 2 and rows[0]["completions/clipped_ratio"] == 1
    assert all(torch.isfinite(torch.tensor(r["grad_norm"])) for r in rows)


@pytest.mark.parametrize(
    "cut",
    [
        dict(per_device_train_batch_size=8, gradient_accumulation_steps=1),
        dict(per_device_train_batch_size=4, gradient_accumulation_steps=2),
        dict(per_device_train_batch_size=2, gradient_accumulation_steps=4),
    ],
)
def test_logged_loss_is_the_minibatch_mean_whatever_the_cut(cut, policy_dir, tmp_path):
    """TRL's `loss`: the token mean of each minibatch's loss (dapo), averaged over the passes, by hand from each
    micro-batch's mean and tokens (it was G× too big at G micro-batches)."""
    trainer = _tiny_trainer(
        policy_dir, tmp_path, length, loss_type="dapo", num_generations=2, beta=0.1, num_iterations=2, **cut
    )
    seen, loss_of = [], trainer.micro_batch_loss

    def recording_loss(policy, part, draw, **kept):
        losses, stats = loss_of(policy, part, draw, **kept)
        seen.append((losses["policy"].item(), part.loss_mask.sum().item()))
        return losses, stats

    trainer.micro_batch_loss = recording_loss
    trainer.train()
    # 2 passes; the second's ratios and KL make the loss non-zero
    assert len(seen) == 2 * cut["gradient_accumulation_steps"]
    assert abs(seen[-1][0]) > 1e-5
    by_hand = sum(mean * tokens for mean, tokens in seen) / sum(tokens for _, tokens in seen)
    assert trainer.loop.state.history[0]["loss"] == pytest.approx(by_hand, rel=1e-5, abs=1e-7)


def test_cast_lm_head_to_fp32_samples_and_scores_in_float32(policy_dir, tmp_path, monkeypatch):
    """TRL 1.16's `cast_lm_head_to_fp32` under bf16 mixed precision: the policy's and the reference's output
    layers are `Float32Linear`s; the sampler calls the policy's with its float32 weight (not the bf16 cast it
    makes of every other layer) and gets float32 logits; π_θ = π_ref at the first step gives a KL of exactly 0
    (a reference scored through a bf16 head would not)."""
    from instruct_goose.core import Float32Linear

    calls, forward = [], Float32Linear.forward

    def recording(self, x):
        out = forward(self, x)
        calls.append((self.weight.dtype, out.dtype, torch.is_grad_enabled()))
        return out

    monkeypatch.setattr(Float32Linear, "forward", recording)
    trainer = _tiny_trainer(
        policy_dir, tmp_path, length, cast_lm_head_to_fp32=True, beta=0.1, mixed_precision="bf16"
    )
    heads = [m.get_output_embeddings() for m in (trainer.model, trainer.ref_model)]
    assert [type(h) for h in heads] == [Float32Linear, Float32Linear] and heads[0] is not heads[1]
    trainer.train()
    sampling = [c for c in calls if not c[2]]
    assert len(sampling) >= 8 and all(c[:2] == (torch.float32, torch.float32) for c in sampling), sampling[:3]
    row = trainer.loop.state.history[0]
    # one pass: the KL before any update
    assert row["kl"] == 0.0, row
    plain = _tiny_trainer(policy_dir, tmp_path / "plain", length, beta=0.1)
    assert type(plain.model.get_output_embeddings()) is torch.nn.Linear  # off by default, as TRL's
