"""Kill `goose ppo` / `goose rloo` with SIGKILL at a random moment after the first checkpoint, resume, and check
that the final weights and the logged metrics equal those of a run that was never interrupted (CPU, same seed).
Also: the same seed gives the same metrics twice."""
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


GOOSE = str(Path(sys.executable).parent / "goose")
STEPS = 10


def command(algo, policy_dir, output_dir, *extra):
    return [GOOSE, algo, "--policy", str(policy_dir), "--reward_model", "gold", "--output_dir", str(output_dir),
            "--per_device_train_batch_size", "8", "--num_mini_batches", "2", "--total_episodes", str(16 * STEPS),
            "--response_length", "8", "--save_steps", "1", "--logging_steps", "1", "--num_sample_generations", "0",
            "--disable_tqdm", "true", *extra]


def run(args):
    result = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]


def final_state(output_dir):
    "(weights, logged history) at the end of a run."
    history = torch.load(Path(output_dir) / f"checkpoint-{STEPS}" / "custom_checkpoint_0.pkl", weights_only=False)["history"]
    return load_file(Path(output_dir) / "model.safetensors"), history


def kill_after_first_checkpoint(args, output_dir):
    "Start a run, wait for checkpoint-1, SIGKILL it at a random moment later; return the delay used."
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
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


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_killed_run_resumes_to_the_same_result(algo, policy_dir, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run(command(algo, policy_dir, straight))
    delay = kill_after_first_checkpoint(command(algo, policy_dir, killed), killed)
    done = sorted(int(p.name.split("-")[1]) for p in killed.glob("checkpoint-*"))
    assert done and done[-1] < STEPS, (delay, done)
    run(command(algo, policy_dir, killed, "--resume_from_checkpoint", "latest"))
    weights, history = final_state(straight)
    resumed_weights, resumed_history = final_state(killed)
    for name, value in weights.items():
        torch.testing.assert_close(resumed_weights[name], value, atol=1e-6, rtol=0)
    assert [{k: v for k, v in row.items() if k != "eps"} for row in resumed_history] == \
           [{k: v for k, v in row.items() if k != "eps"} for row in history]   # eps is wall-clock speed


def test_same_seed_same_metrics(policy_dir, tmp_path):
    run(command("ppo", policy_dir, tmp_path / "a"))
    run(command("ppo", policy_dir, tmp_path / "b"))
    strip = lambda rows: [{k: v for k, v in row.items() if k != "eps"} for row in rows]
    assert strip(final_state(tmp_path / "a")[1]) == strip(final_state(tmp_path / "b")[1])
