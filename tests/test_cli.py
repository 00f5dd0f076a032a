"`goose` end to end: the console script, a short pipeline on the built-in task, and what it writes and logs."

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from instruct_goose import task_tokenizer, tiny_causal_lm

GOOSE = str(Path(sys.executable).parent / "goose")


def goose(*args, cwd=None):
    """The console script in its own process: for what only a process shows (the entry point, start-up,
    determinism across runs)."""
    return subprocess.run(
        [GOOSE, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_every_command_has_help(capsys):
    # in-process: the entry point itself is run by the other tests
    from instruct_goose.cli import main

    for command in ("sft", "rm", "ppo", "rloo", "grpo", "dpo", "eval", "pipeline"):
        with pytest.raises(SystemExit) as stopped:
            main([command, "--help"])
        assert stopped.value.code == 0, command
        out = capsys.readouterr().out
        assert "--output_dir" in out or "--output" in out, command


def test_bad_value_is_refused_before_any_work(tmp_path, goose_here):
    result = goose_here("ppo", "--kl_coef", "nan", "--output_dir", str(tmp_path / "ppo"))
    assert result.returncode == 2
    assert "`kl_coef` must be a finite number" in result.stderr
    assert not (tmp_path / "ppo").exists()


@pytest.mark.parametrize(
    "algo",
    ["ppo", pytest.param("rloo", marks=pytest.mark.slow), pytest.param("grpo", marks=pytest.mark.slow)],
)
def test_short_pipeline_trains_evaluates_and_reports(tmp_path, algo, goose_here):
    out = tmp_path / "run"
    result = goose_here(
        "pipeline",
        "--output_dir",
        str(out),
        "--algo",
        algo,
        "--sft_steps",
        "40",
        "--rm_steps",
        "10",
        "--rl_episodes",
        "64",
        "--response_length",
        "8",
        "--disable_tqdm",
        "true",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    metrics = summary["metrics"]
    assert {"eval/reward", "eval/gold", "eval/kl", "eval/reward_win_rate", "eval/gold_win_rate"} <= set(
        metrics
    )
    assert all(v == v for v in metrics.values())  # no NaN
    assert (out / f"{algo}_curves.png").stat().st_size > 10_000
    for stage in ("sft", "rm", algo):
        assert (out / stage / "config.json").is_file(), stage
        assert any((out / stage).glob("checkpoint-*")), stage
    assert "samples at step" in result.stdout and "policy vs reference" in result.stdout
    history = json.loads((out / "eval.json").read_text())
    assert len(history["samples"]) == 64


# --- a run you can watch: metrics.jsonl and goose plot
# -------------------------------------------------------------


def test_ppo_metrics_jsonl_holds_every_metric_of_every_logged_step(policy_dir, tmp_path, goose_here):
    out = tmp_path / "ppo"
    result = goose_here(
        "ppo",
        "--policy",
        str(policy_dir),
        "--reward_model",
        "gold",
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "8",
        "--num_mini_batches",
        "2",
        "--total_episodes",
        "48",
        "--response_length",
        "8",
        "--logging_steps",
        "1",
        "--num_sample_generations",
        "0",
        "--disable_tqdm",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    history = torch.load(out / "checkpoint-3" / "custom_checkpoint_0.pkl", weights_only=False)["history"]
    assert rows == history and [row["step"] for row in rows] == [1, 2, 3]
    assert [row["episode"] for row in rows] == [16, 32, 48]
    expected = {
        "objective/kl",
        "objective/scores",
        "objective/rlhf_reward",
        "objective/entropy",
        "policy/clipfrac_avg",
        "policy/approxkl_avg",
        "loss/policy_avg",
        "loss/value_avg",
        "val/ratio",
        "lr",
        "eps",
        "val/num_eos_tokens",
    }
    assert all(expected <= set(row) for row in rows), set(rows[0])
    # no bar: each logged step printed as a line
    assert result.stdout.count("step 1/3 episode=16") == 1
    plot = goose_here("plot", str(out))
    assert plot.returncode == 0, plot.stderr
    assert (out / "curves.png").stat().st_size > 10_000


# --- your own data
# ------------------------------------------------------------------------------------------------


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_own_data_never_mixes_in_the_task(policy_dir, tmp_path, goose_here):
    pairs = write_jsonl(
        tmp_path / "pairs.jsonl", [{"q": "The film", "chosen": " was good.", "rejected": " was bad."}] * 8
    )
    rm = goose_here(
        "rm",
        "--model",
        str(policy_dir),
        "--dataset",
        pairs,
        "--columns",
        "q:prompt",
        "--output_dir",
        str(tmp_path / "rm"),
        "--per_device_train_batch_size",
        "4",
        "--max_steps",
        "2",
        "--disable_tqdm",
    )
    assert rm.returncode == 0, rm.stderr[-3000:]
    assert "held-out pairs for eval_accuracy: none (your own --dataset" in rm.stdout
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "The film"}] * 16)
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions): return [len(c) / 10 for c in completions]\n"
        "def one(prompts, completions): return [1.0] * len(completions)\n"
    )
    ppo = goose_here(
        "ppo",
        "--policy",
        str(policy_dir),
        "--dataset",
        prompts,
        "--reward_funcs",
        "my_rewards:length,my_rewards:one",
        "--reward_weights",
        "1,0.5",
        "--ptx_coef",
        "0.5",
        "--output_dir",
        str(tmp_path / "ppo"),
        "--total_episodes",
        "16",
        "--per_device_train_batch_size",
        "8",
        "--response_length",
        "4",
        "--num_sample_generations",
        "0",
        "--disable_tqdm",
        cwd=tmp_path,
    )
    assert ppo.returncode == 0, ppo.stderr[-3000:]
    assert "PPO-ptx pretraining texts: none (your own --dataset" in ppo.stdout
    assert "loss/ptx_avg" not in json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()[0])
    recorded = json.loads(next((tmp_path / "ppo").glob("checkpoint-*/training_config.json")).read_text())
    assert (recorded["reward_weights"], recorded["reward_funcs"], recorded["dataset"]) == (
        [1.0, 0.5],
        ["my_rewards:length", "my_rewards:one"],
        prompts,
    )


def test_same_command_same_reward_model(policy_dir, tmp_path, goose_here):
    """config.seed seeds the fresh reward head: two runs of the same command give the same weights (one after the
    other in this process: the random state the first run left does not matter)."""
    for name in ("a", "b"):
        result = goose_here(
            "rm",
            "--model",
            str(policy_dir),
            "--output_dir",
            str(tmp_path / name),
            "--max_steps",
            "1",
            "--eval_dataset",
            "none",
            "--disable_tqdm",
        )
        assert result.returncode == 0, result.stderr[-3000:]
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- mistakes end in one line, exit 2
# -----------------------------------------------------------------------------


def one_line_error(result, *words):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and result.stderr.strip().count("\n") == 0, result.stderr[-2000:]
    assert all(w in result.stderr for w in words), result.stderr


def test_mistakes_end_in_one_line(policy_dir, tmp_path, goose_here):
    """Each mistake ends in one line on stderr and exit 2 (in-process: an exception the CLI does not turn into
    that line fails the test)."""
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "The film"}] * 4)
    (tmp_path / "lr.yaml").write_text("learning_rate: 1e-3\nmax_steps: 1\n")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "checkpoint-5").mkdir()
    # within the tiny model's context: no warning before the error
    sft = ["sft", "--model", str(policy_dir), "--disable_tqdm", "--max_length", "64"]
    one_line_error(goose_here("trian"), "unknown command 'trian'")
    one_line_error(
        goose_here("sft", "--dataset", str(tmp_path / "missing.jsonl")),
        "--dataset",
        "missing.jsonl' does not exist",
    )
    one_line_error(
        goose_here("ppo", "--policy", str(tmp_path / "nothing"), "--reward_model", "gold"),
        "--policy",
        "nothing",
    )
    one_line_error(
        goose_here("ppo", "--policy", str(policy_dir), "--reward_model", str(tmp_path / "no_rm")),
        "--reward_model",
    )
    one_line_error(
        goose_here(*sft, "--dataset", bad, "--output_dir", str(tmp_path / "s1")),
        "`train_dataset` needs the columns",
    )
    one_line_error(
        goose_here(*sft, "--resume_from_checkpoint", "latest", "--output_dir", str(tmp_path / "s2")),
        "names no checkpoint",
    )
    one_line_error(
        goose_here(*sft, "--output_dir", str(tmp_path / "old")),
        "holds another run's checkpoints (checkpoint-5)",
    )
    one_line_error(goose_here("sft", "--learning_rate", "fast"), "--learning_rate", "invalid float value")
    one_line_error(
        goose_here("ppo", "--reward_funcs", "nomodule:f", "--policy", str(policy_dir)),
        "--reward_funcs",
        "nomodule",
    )
    ok = goose_here(*sft, "--config", str(tmp_path / "lr.yaml"), "--output_dir", str(tmp_path / "s3"))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (
        json.loads((tmp_path / "s3" / "checkpoint-1" / "training_config.json").read_text())["learning_rate"]
        == 0.001
    )


def test_version_and_bare_flags(goose_here):
    result = goose_here("--version")
    assert result.returncode == 0 and result.stdout.startswith("goose (instruct_goose) ")
    bare = goose_here()  # no command: the usage, every command named
    assert bare.returncode == 0 and all(
        command in bare.stdout for command in ("sft", "rm", "ppo", "rloo", "grpo", "dpo", "eval")
    )


def test_tiny_models_get_one_torch_thread(monkeypatch):
    from instruct_goose.cli import set_threads

    tiny, threads = tiny_causal_lm(task_tokenizer()), torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        # not set: one thread for a model under 50 M parameters
        assert set_threads(tiny) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        torch.set_num_threads(2)
        assert set_threads(tiny) == 2  # set: the user's count stands
    finally:
        torch.set_num_threads(threads)


# --- one set of defaults: the CLI and the Python API (issue 27, item 7)
# --------------------------------------------

TRAINING = ["sft", "reward", "ppo", "rloo", "grpo", "dpo"]  # goose rm: tests/test_cli_trl.py


@pytest.mark.parametrize("command", [*TRAINING, "eval"])
def test_cli_defaults_are_the_python_apis_or_printed(command):
    """Every setting `goose COMMAND` trains with is the Python API's default, or is named in the line each run
    starts with."""
    import inspect
    from dataclasses import asdict, fields, is_dataclass
    from instruct_goose.cli import _COMMANDS, _PYTHON_API, parse_config, python_call

    cls = _COMMANDS[command][0]
    args, api = parse_config(cls, [], f"goose {command}"), _PYTHON_API[cls.__name__]
    if is_dataclass(api):
        python = asdict(api())
    else:
        python = {
            n: p.default
            for n, p in inspect.signature(api).parameters.items()
            if n in {f.name for f in fields(cls)} and isinstance(p.default, (int, float))
        }
    second = set(getattr(api, "same_setting", {}).values())
    printed = python_call(args)
    differ = {n for n, v in python.items() if getattr(args, n) != v and n not in second}
    assert all(f"{n}=" in printed for n in differ), (differ, printed)
    assert printed.count("=") == len(differ), printed  # and nothing else is claimed to differ


def test_grpo_cli_keeps_the_python_reward_and_rollout():
    """The defects the TRL-user trial found: `goose grpo` subtracted 1 from cut completions' rewards and doubled
    the rollout."""
    from instruct_goose import GRPOConfig
    from instruct_goose.cli import GRPOCommand, parse_config

    args = parse_config(GRPOCommand, [], "goose grpo")
    assert (
        (args.missing_eos_penalty, args.num_mini_batches)
        == (GRPOConfig().missing_eos_penalty, GRPOConfig().num_mini_batches)
        == (None, 1)
    )


def test_pipeline_defaults_are_the_stage_commands():
    """The pipeline passes on only what it is given: its stage settings default to None (the stage command's
    default)."""
    from dataclasses import fields
    from instruct_goose.cli import PipelineCommand

    own = {
        "output_dir",
        "model",
        "algo",
        "adaptive_kl",
        "kl_target",
        "ptx_coef",
        "overwrite_output_dir",
        "disable_tqdm",
    }
    # PPO-ptx's demo settings are its own
    assert {f.name for f in fields(PipelineCommand) if f.default is not None} == own


def test_help_lists_one_flag_per_setting(capsys):
    """`--beta`/`--kl_coef`, `--max_completion_length`/`--response_length`, `--epsilon`/`--cliprange`: one
    listed, both accepted."""
    from instruct_goose.cli import main, parse_config, GRPOCommand

    with pytest.raises(SystemExit):
        main(["grpo", "--help"])
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert len(listed) == len(set(listed))
    for shown, hidden in [
        ("beta", "kl_coef"),
        ("max_completion_length", "response_length"),
        ("epsilon", "cliprange"),
        ("num_iterations", "num_ppo_epochs"),
    ]:
        assert f"--{shown}" in listed and f"--{hidden}" not in listed, (shown, hidden)
    assert not [
        flag for flag in listed if flag.startswith("--no_") or "-" in flag[2:] and flag != "--help-all"
    ]
    assert parse_config(GRPOCommand, ["--kl_coef", "0.1", "--response_length", "8"], "goose grpo").beta == 0.1


class Recorder:
    "Stands in for a trainer: keeps the config it was given, trains nothing."

    made = []

    def __init__(self, *args, **kwargs):
        self.config = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.reward_funcs, self.eval_dataset = kwargs.get("reward_funcs"), None
        self.model = self.reward_model = None  # what the commands return after `train()`
        Recorder.made.append(self)

    def train(self):
        return None


FLAGS = {
    "sft": ["--model", "tiny-gpt2"],
    "rm": ["--model", "tiny-gpt2"],
    "reward": ["--model", "tiny-gpt2"],
    "dpo": ["--model", "tiny-gpt2"],
    **{
        c: [
            "--policy",
            "tiny-gpt2",
            "--reward_funcs",
            "instruct_goose.toy:gold_score,instruct_goose.toy:gold_score",
            "--reward_weights",
            "1,0.5",
        ]
        for c in ("ppo", "rloo", "grpo")
    },
}
TRAINERS = {
    "sft": "SFTTrainer",
    "rm": "RewardTrainer",
    "reward": "RewardTrainer",
    "ppo": "RLHFTrainer",
    "rloo": "RLOOTrainer",
    "grpo": "GRPOTrainer",
    "dpo": "DPOTrainer",
}


@pytest.mark.parametrize("command", TRAINING)
def test_training_config_records_every_setting(command, monkeypatch, capsys):
    """The trainer's config is the command itself, so training_config.json (asdict of it) holds every flag,
    --reward_weights too."""
    import json
    from dataclasses import asdict, fields
    from instruct_goose import cli

    monkeypatch.setattr(cli, TRAINERS[command], Recorder)
    Recorder.made.clear()
    cli.main([command, *FLAGS[command], "--disable_tqdm"])
    (trainer,) = Recorder.made
    recorded = json.loads(json.dumps(asdict(trainer.config), default=str))  # what the loop writes
    assert set(recorded) == {f.name for f in fields(cli._COMMANDS[command][0])}
    name = cli._COMMAND_NAMES[type(trainer.config).__name__]  # goose rm prints its TRL name, goose reward
    assert capsys.readouterr().out.splitlines()[0] == f"{name}: {cli.python_call(trainer.config)}"
    if command in ("ppo", "rloo", "grpo"):
        assert (
            recorded["reward_weights"] == [1.0, 0.5]
            and len(recorded["reward_funcs"]) == len(trainer.reward_funcs) == 2
        )


# --- goose eval on preference pairs: a reward model's report (issue 31)
# -------------------------------------------


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    "Two tiny reward models of different seeds, saved as `goose rm` saves them."
    from instruct_goose import RewardModel, task_tokenizer, tiny_causal_lm

    tok, root = task_tokenizer(), tmp_path_factory.mktemp("rms")
    for seed in (0, 1):
        RewardModel(tiny_causal_lm(tok, seed=seed), tokenizer=tok).save_pretrained(root / f"rm{seed}")
    return [str(root / f"rm{seed}") for seed in (0, 1)]


@pytest.fixture(scope="module")
def pair_rows():
    from instruct_goose.toy import load_task

    pairs = load_task("preferences", "eval").select(range(24))
    return [{**row, "topic": ["plot", "cast", "music"][i % 3]} for i, row in enumerate(pairs)]


def test_eval_reports_a_reward_model_on_local_pairs(tmp_path, rm_dirs, pair_rows, goose_here):
    """goose eval on a JSONL of pairs: the same numbers as `evaluate_reward_model` in Python, in metrics.jsonl,
    with the plot."""
    from instruct_goose.reward_eval import evaluate_reward_model
    from instruct_goose.toy import gold_score

    pairs, out = write_jsonl(tmp_path / "pairs.jsonl", pair_rows), tmp_path / "report"
    result = goose_here(
        "eval",
        "--reward_model",
        rm_dirs[0],
        "--dataset",
        pairs,
        "--category_column",
        "topic",
        "--gold",
        "vader",
        "--output_dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reward model report" in result.stdout and "accuracy (95% Wilson)" in result.stdout
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = evaluate_reward_model(rm_dirs[0], pair_rows, gold=gold_score, category_column="topic")
    assert row.pop("step") == 0 and row.keys() == expected.keys()
    assert {
        "eval/accuracy/plot",
        "eval/pairs/music",
        "eval/gold/agreement",
        "eval/length/prefer_shorter",
    } <= row.keys()
    assert all(row[k] == pytest.approx(v, abs=1e-5, nan_ok=True) for k, v in expected.items())
    assert row["eval/pairs/plot"] == row["eval/pairs/cast"] == row["eval/pairs/music"] == 8
    assert (out / "report.png").stat().st_size > 10_000


def test_eval_ensembles_several_reward_models_from_parquet(tmp_path, rm_dirs, pair_rows, goose_here):
    """Two --reward_model paths and --ensemble_aggregation min: the report of `RewardEnsemble(..., 'min')`, not
    of either member."""
    from datasets import Dataset
    from instruct_goose.reward_eval import RewardEnsemble, evaluate_reward_model

    Dataset.from_list(pair_rows).to_parquet(tmp_path / "pairs.parquet")
    result = goose_here(
        "eval",
        "--reward_model",
        *rm_dirs,
        "--ensemble_aggregation",
        "min",
        "--dataset",
        str(tmp_path / "pairs.parquet"),
        "--output",
        str(tmp_path / "report.json"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((tmp_path / "report.json").read_text())["metrics"]
    ensemble = evaluate_reward_model(RewardEnsemble(rm_dirs, "min"), pair_rows, category_column="topic")
    assert metrics["eval/margin"] == pytest.approx(ensemble["eval/margin"], abs=1e-5)
    assert all(
        metrics["eval/margin"] != pytest.approx(evaluate_reward_model(d, pair_rows)["eval/margin"], abs=1e-5)
        for d in rm_dirs
    )
    # no "category" column, no --category_column: no groups
    assert not any(
        k.startswith("eval/pairs/") and k != "eval/pairs/chosen_shorter" and k != "eval/pairs/chosen_longer"
        for k in metrics
    )


def test_eval_refuses_report_flags_it_cannot_honour(rm_dirs, pair_rows, tmp_path):
    "Each mistake is one UsageError naming the flag, before any model is read."
    from instruct_goose.cli import EvalCommand, UsageError, parse_config, run_eval

    pairs = write_jsonl(tmp_path / "pairs.jsonl", pair_rows)

    def refused(flags, *words):
        with pytest.raises(UsageError) as e:
            run_eval(parse_config(EvalCommand, flags, "goose eval"))
        assert all(w in str(e.value) for w in words), str(e.value)

    refused(
        ["--reward_model", rm_dirs[0], "--dataset", pairs, "--category_column", "genre"],
        "--category_column 'genre'",
        "topic",
    )
    refused(
        ["--reward_model", rm_dirs[0], "--dataset", pairs, "--ensemble_aggregation", "min"],
        "two or more --reward_model",
    )
    refused(
        [
            "--reward_model",
            *rm_dirs,
            "--dataset",
            pairs,
            "--ensemble_aggregation",
            "min",
            "--ensemble_k",
            "2",
        ],
        "--ensemble_k",
        "min",
    )
    refused(
        ["--reward_model", rm_dirs[0], "--output_dir", str(tmp_path / "x")],
        "--output_dir",
        "chosen and rejected",
    )
    assert not (tmp_path / "x").exists()
