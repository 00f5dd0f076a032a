"""Kill `goose ppo` / `goose rloo` with SIGKILL at a random moment after the first checkpoint, resume, and check
that the final weights and the logged metrics equal those of a run that was never interrupted (CPU, same seed).
Also: the same seed gives the same metrics twice."""

import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_here


GOOSE = str(Path(sys.executable).parent / "goose")
STEPS = 10


def command(algo, policy_dir, output_dir, *extra):
    return [
        GOOSE,
        algo,
        "--policy",
        str(policy_dir),
        "--reward_model",
        "gold",
        "--output_dir",
        str(output_dir),
        "--per_device_train_batch_size",
        "8",
        "--num_mini_batches",
        "2",
        "--total_episodes",
        str(16 * STEPS),
        "--response_length",
        "8",
        "--save_steps",
        "1",
        "--logging_steps",
        "1",
        "--num_sample_generations",
        "0",
        "--disable_tqdm",
        "true",
        *extra,
    ]


def run(args):
    result = subprocess.run(
        args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]


def goose_here(args):
    "A `goose` command run in this process (`run_here`), for the uninterrupted reference runs."
    assert run_here(Path(args[0]), *args[1:]) == 0


def final_state(output_dir):
    "(weights, logged history) at the end of a run."
    history = torch.load(
        Path(output_dir) / f"checkpoint-{STEPS}" / "custom_checkpoint_0.pkl", weights_only=False
    )["history"]
    return load_file(Path(output_dir) / "model.safetensors"), history


def kill_after_first_checkpoint(args, output_dir):
    "Start a run, wait for checkpoint-1, SIGKILL it at a random moment later; return the delay used."
    process = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    deadline = time.time() + 300
    while not (Path(output_dir) / "checkpoint-1").is_dir():
        assert process.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    delay = random.uniform(0.0, 0.8)
    time.sleep(delay)
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    return delay


@pytest.fixture(scope="module")
def straight_ppo(policy_dir, tmp_path_factory):
    """One uninterrupted `goose ppo` run, the reference of both PPO resume tests (a process costs ~10 s of
    imports on 2 cores)."""
    straight = tmp_path_factory.mktemp("straight_ppo")
    goose_here(command("ppo", policy_dir, straight))
    return straight


# rloo: the same loop, in the full set
@pytest.mark.parametrize("algo", ["ppo", pytest.param("rloo", marks=pytest.mark.slow)])
def test_killed_run_resumes_to_the_same_result(algo, policy_dir, tmp_path, request):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    if algo == "ppo":
        straight = request.getfixturevalue("straight_ppo")
    else:
        goose_here(command(algo, policy_dir, straight))
    delay = kill_after_first_checkpoint(command(algo, policy_dir, killed), killed)
    done = sorted(int(p.name.split("-")[1]) for p in killed.glob("checkpoint-*"))
    assert done and done[-1] < STEPS, (delay, done)
    run(command(algo, policy_dir, killed, "--resume_from_checkpoint", "latest"))
    weights, history = final_state(straight)
    resumed_weights, resumed_history = final_state(killed)
    for name, value in weights.items():
        torch.testing.assert_close(resumed_weights[name], value, atol=1e-6, rtol=0)
    assert [{k: v for k, v in row.items() if k not in ("eps", "step_time")} for row in resumed_history] == [
        {k: v for k, v in row.items() if k not in ("eps", "step_time")} for row in history
    ]  # eps is wall-clock speed


# in the full set: the resume tests below compare a straight run with a resumed one, which needs this too
@pytest.mark.slow
def test_same_seed_same_metrics(policy_dir, tmp_path):
    run(command("ppo", policy_dir, tmp_path / "a"))
    run(command("ppo", policy_dir, tmp_path / "b"))
    strip = lambda rows: [{k: v for k, v in row.items() if k not in ("eps", "step_time")} for row in rows]
    assert strip(final_state(tmp_path / "a")[1]) == strip(final_state(tmp_path / "b")[1])


# --- Ctrl-C and SIGTERM: finish the step, keep everything, resume to the same result
# --------------------------------


def interrupt_midway(args, output_dir, sig):
    "Start a run, send `sig` once it has logged 2 steps, and return (exit code, stderr)."
    process = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    metrics, deadline = Path(output_dir) / "metrics.jsonl", time.time() + 300
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert process.poll() is None and time.time() < deadline, (
            "the run ended before it could be interrupted"
        )
        time.sleep(0.02)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


SFT_STEPS = 40


def sft_command(policy_dir, output_dir, *extra):
    return [
        GOOSE,
        "sft",
        "--model",
        str(policy_dir),
        "--output_dir",
        str(output_dir),
        "--max_steps",
        str(SFT_STEPS),
        "--per_device_train_batch_size",
        "8",
        "--logging_steps",
        "1",
        "--disable_tqdm",
        *extra,
    ]


# SIGTERM: the same handler, in the full set
@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_sft_stopped_by_a_signal_resumes_to_the_same_weights(sig, policy_dir, tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    goose_here(sft_command(policy_dir, straight))
    code, stderr = interrupt_midway(sft_command(policy_dir, stopped), stopped, sig)
    assert code == 128 + sig, stderr[-3000:]
    (checkpoint,) = stopped.glob("checkpoint-*")
    assert 2 <= int(checkpoint.name.split("-")[1]) < SFT_STEPS
    # the model too
    assert (stopped / "model.safetensors").is_file() and (stopped / "tokenizer.json").is_file()
    resume = stderr.strip().splitlines()[-1].strip()
    assert resume.startswith("goose sft ") and resume.endswith("--resume_from_checkpoint latest"), stderr[
        -2000:
    ]
    run([GOOSE, *shlex.split(resume)[1:]])
    expected, resumed = load_file(straight / "model.safetensors"), load_file(stopped / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0)


def test_ppo_ctrl_c_resumes_to_the_same_weights(policy_dir, straight_ppo, tmp_path):
    straight, stopped = straight_ppo, tmp_path / "stopped"
    code, stderr = interrupt_midway(
        command("ppo", policy_dir, stopped, "--save_steps", "0"), stopped, signal.SIGINT
    )
    assert code == 130, stderr[-3000:]
    assert latest_done(stopped) < STEPS and (stopped / "model.safetensors").is_file()
    run(command("ppo", policy_dir, stopped, "--resume_from_checkpoint", "latest"))
    weights, resumed = final_state(straight)[0], final_state(stopped)[0]
    for name, value in weights.items():
        torch.testing.assert_close(resumed[name], value, atol=1e-6, rtol=0)


def latest_done(output_dir):
    return max(int(p.name.split("-")[1]) for p in Path(output_dir).glob("checkpoint-*"))
