"""A script written the TRL way runs unchanged (issue 17): examples/trl_style/*.py, each TRL's own script with only the
import line changed, run as `python script.py` would run it (in the test's process) on tiny settings. Each must exit 0, leave a model 🤗 `from_pretrained` reads,
and a metrics.jsonl with the metric names a TRL user charts.
"""

import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from conftest import run_example

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "examples" / "trl_style"
# not on sys.path: sft.py, reward.py... stay unimportable
_spec = importlib.util.spec_from_file_location("make_tiny", SCRIPTS / "make_tiny.py")
_make_tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_make_tiny)
make_tiny = _make_tiny.make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The Hub's stand-ins: a tiny chat LM (tiny/model), a reward model on it (tiny/reward_model), the task's
    data as JSON."""
    from instruct_goose import RewardModel

    root = make_tiny(tmp_path_factory.mktemp("tiny"))
    # a fresh 1-label head
    RewardModel.from_pretrained(root / "model").save_pretrained(root / "reward_model")
    return root


def run_script(name: str, out: Path, *args) -> Path:
    """Run examples/trl_style/`name` with `--output_dir out` as `python name ...` would (in this process: no
    start-up); fail if it does not exit 0."""
    code = run_example(SCRIPTS / name, "--output_dir", out, *args)
    if code:
        pytest.fail(f"{name} exited {code}")
    return out


def logged(out: Path) -> list[dict]:
    "The rows of the run's metrics.jsonl."
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft(tiny, tmp_path):
    "SFT on `messages` rows: the held-out loss is logged, and falls from the untrained model's."
    out = run_script(
        "sft.py",
        tmp_path / "sft",
        "--model_name_or_path",
        tiny / "model",
        "--dataset",
        tiny / "sft",
        "--max_steps",
        8,
    )
    rows = logged(out)
    assert [r["step"] for r in rows if "loss" in r][-1] == 8
    assert "eval_loss" in rows[-1]
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.slow
def test_reward(tiny, tmp_path):
    """A reward model on chat pairs from a causal-LM path: accuracy and held-out accuracy logged; 🤗 reads it as a
    classifier."""
    out = run_script(
        "reward.py",
        tmp_path / "rm",
        "--model_name_or_path",
        tiny / "model",
        "--dataset",
        tiny / "preferences",
        "--max_steps",
        8,
    )
    rows = logged(out)
    assert {"loss", "accuracy", "learning_rate", "epoch"} <= set(rows[0]) and "eval_accuracy" in rows[-1]
    assert AutoModelForSequenceClassification.from_pretrained(out).config.num_labels == 1


@pytest.mark.slow
def test_rloo(tiny, tmp_path):
    """RLOO on conversational prompts with [reward model, function] and weights: each reward's mean logged by
    name."""
    out = run_script(
        "rloo.py",
        tmp_path / "rloo",
        "--model_name_or_path",
        tiny / "model",
        "--reward_model_name_or_path",
        tiny / "reward_model",
        "--dataset",
        tiny / "prompts",
        "--max_steps",
        2,
    )
    rows = logged(out)
    assert len([r for r in rows if "objective/scores" in r]) == 2
    assert {"rewards/brevity/mean", "rewards/brevity/std"} <= set(rows[0])
    # a model is named by its folder, as in TRL
    assert {"rewards/reward_model/mean", "rewards/reward_model/std"} <= set(rows[0])
    # TRL ≤ 0.21's names and 1.16's
    assert {"lr", "learning_rate", "reward", "reward_std", "kl", "entropy", "loss", "epoch"} <= set(rows[0])
    assert {"eval/score", "eval_score"} <= set(rows[-1])
    AutoModelForCausalLM.from_pretrained(out)


# the answer column reaching a TRL-style function is also checked in process (tests/test_rewards.py)
@pytest.mark.slow
def test_grpo(tiny, tmp_path):
    """GRPO with a reward function reading the `answer` column: its mean logged as rewards/accuracy/mean; eval at
    the end."""
    out = run_script(
        "grpo.py",
        tmp_path / "grpo",
        "--model_name_or_path",
        tiny / "model",
        "--dataset",
        tiny / "arithmetic",
        "--max_steps",
        2,
    )
    rows = logged(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert {
        "reward",
        "reward_std",
        "rewards/accuracy/mean",
        "rewards/accuracy/std",
        "loss",
        "learning_rate",
        "epoch",
    } <= set(rows[0])
    assert "eval_score" in rows[-1] and "lr" not in rows[0]  # TRL 1.16's names
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.slow
def test_dpo(tiny, tmp_path):
    "DPO on chat pairs: TRL's reward metrics logged; the policy saved."
    out = run_script(
        "dpo.py",
        tmp_path / "dpo",
        "--model_name_or_path",
        tiny / "model",
        "--dataset",
        tiny / "preferences",
        "--max_steps",
        4,
    )
    rows = logged(out)
    assert {"loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"} <= set(
        rows[0]
    )
    assert "eval_loss" in rows[-1]
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.slow
def test_ppo(tiny, tmp_path):
    """PPO as TRL's example writes it (🤗 policy, reference, reward and value models; tokenized prompts): TRL's
    PPO metrics."""
    out = run_script(
        "ppo.py",
        tmp_path / "ppo",
        "--sft_model_path",
        tiny / "model",
        "--reward_model_path",
        tiny / "reward_model",
        "--dataset",
        tiny / "prompts",
        "--total_episodes",
        16,
    )
    rows = logged(out)
    assert len(rows) == 2  # 16 episodes / 8 prompts per step
    assert {
        "objective/kl",
        "objective/scores",
        "objective/rlhf_reward",
        "policy/approxkl_avg",
        "loss/value_avg",
    } <= set(rows[0])
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.slow
def test_sft_lora(tiny, tmp_path):
    "The SFT script with TRL's `peft_config` (a LoraConfig): trains, logs, and leaves a model 🤗 reads."
    out = run_script(
        "sft.py",
        tmp_path / "sft-lora",
        "--model_name_or_path",
        tiny / "model",
        "--dataset",
        tiny / "sft",
        "--max_steps",
        4,
        "--use_peft",
    )
    assert [r["step"] for r in logged(out) if "loss" in r][-1] == 4
    AutoModelForCausalLM.from_pretrained(out)


def _paper_run(tiny, tmp_path, *only):
    out = run_script(
        "paper_configs.py",
        tmp_path / "papers",
        "--model_name_or_path",
        tiny / "model",
        "--dataset",
        tiny / "arithmetic",
        "--max_steps",
        2,
        *(["--only", *only] if only else []),
    )
    return json.loads((out / "summary.json").read_text())


def test_paper_config_lite_ppo(tiny, tmp_path):
    """TRL's Lite PPO recipe (top_p, top_k, temperature, steps_per_generation, batch-scaled rewards) with
    completion logging."""
    summary = _paper_run(tiny, tmp_path, "lite_ppo")
    assert summary["lite_ppo"]["steps"] == [1, 2]
    # TRL's generation_batch_size = per_device_train_batch_size 8 x steps_per_generation 4 = 32 completions; a
    # step here is one generation
    assert summary["lite_ppo"]["completions_logged"] == 2 * 32


@pytest.mark.slow
def test_paper_configs_all(tiny, tmp_path):
    """Every GRPO/RLOO recipe of TRL's paper index runs with its documented options (sizes shrunk) and logs its
    completions."""
    summary = _paper_run(tiny, tmp_path)
    assert set(summary) == {
        "deepseek_r1",
        "gspo",
        "dapo",
        "entropy_80_20",
        "dr_grpo",
        "lite_ppo",
        "scalerl",
        "sapo",
        "deepseek_v32",
        "rloo",
    }
    assert all(s["steps"] == [1, 2] and s["completions_logged"] > 0 for s in summary.values())
