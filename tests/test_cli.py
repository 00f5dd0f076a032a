"`goose` end to end: the console script, a short pipeline on the built-in task, and what it writes and logs."
import json
import subprocess
import sys
from pathlib import Path

import pytest

GOOSE = str(Path(sys.executable).parent / "goose")


def goose(*args, cwd=None):
    return subprocess.run([GOOSE, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_every_command_has_help():
    for command in ("sft", "rm", "ppo", "rloo", "eval", "pipeline"):
        result = goose(command, "--help")
        assert result.returncode == 0, result.stderr
        assert "--output_dir" in result.stdout or "--output" in result.stdout


def test_bad_value_is_refused_before_any_work(tmp_path):
    result = goose("ppo", "--kl_coef", "nan", "--output_dir", str(tmp_path / "ppo"))
    assert result.returncode == 2
    assert "`kl_coef` must be a finite number" in result.stderr
    assert not (tmp_path / "ppo").exists()


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_short_pipeline_trains_evaluates_and_reports(tmp_path, algo):
    out = tmp_path / "run"
    result = goose("pipeline", "--output_dir", str(out), "--algo", algo, "--sft_steps", "40", "--rm_steps", "10",
                   "--rl_episodes", "64", "--response_length", "8", "--disable_tqdm", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    metrics = summary["metrics"]
    assert {"eval/reward", "eval/gold", "eval/kl", "eval/reward_win_rate", "eval/gold_win_rate"} <= set(metrics)
    assert all(v == v for v in metrics.values())                      # no NaN
    assert (out / f"{algo}_curves.png").stat().st_size > 10_000
    for stage in ("sft", "rm", algo):
        assert (out / stage / "config.json").is_file(), stage
        assert any((out / stage).glob("checkpoint-*")), stage
    assert "samples at step" in result.stdout and "policy vs reference" in result.stdout
    history = json.loads((out / "eval.json").read_text())
    assert len(history["samples"]) == 64
