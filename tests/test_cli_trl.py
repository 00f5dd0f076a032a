"""`goose` against TRL 1.16's CLI (issue 61, item 3): TRL's YAML keys and flags, `goose reward`, TRL's reward
names and dotted paths, `--use_peft`, local data folders, one set of defaults with the API, a `--help` that
starts with what users set."""

import dataclasses
import json
from pathlib import Path

import pytest

from instruct_goose import cli
from instruct_goose.cli import main, parse_config

API = {
    "sft": "SFTConfig",
    "reward": "RewardConfig",
    "ppo": "RLHFConfig",
    "rloo": "RLOOConfig",
    "grpo": "GRPOConfig",
    "dpo": "DPOConfig",
}
WHERE = {
    "sft": "runs/sft",
    "reward": "runs/rm",
    "ppo": "runs/ppo",
    "rloo": "runs/rloo",
    "grpo": "runs/grpo",
    "dpo": "runs/dpo",
}


def run_main(capsys, *argv):
    "(exit code, stdout, stderr) of `goose argv` in this process."
    code = 0
    try:
        main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


# --- item 6: one set of defaults
@pytest.mark.parametrize("command", list(API))
def test_every_default_is_the_api_configs(command):
    """Every field the command shares with its API config has the config's default (`output_dir` alone differs:
    each stage's folder, so the next stage finds it)."""
    import instruct_goose

    cls, api = cli._COMMANDS[command][0], getattr(instruct_goose, API[command])
    ours, theirs = dataclasses.asdict(parse_config(cls, [], f"goose {command}")), dataclasses.asdict(api())
    shared = [f.name for f in dataclasses.fields(api)]
    assert set(shared) <= set(ours)
    differ = {n: (ours[n], theirs[n]) for n in shared if ours[n] != theirs[n]}
    assert differ == {"output_dir": (WHERE[command], theirs["output_dir"])}


def test_script_settings_have_trls_defaults():
    "The ScriptArguments / ModelConfig settings goose takes have TRL 1.16's defaults."
    trl = pytest.importorskip("trl")
    ours = {f.name: f.default for f in dataclasses.fields(cli.ScriptSettings)}
    theirs = {
        f.name: f.default for c in (trl.ScriptArguments, trl.ModelConfig) for f in dataclasses.fields(c)
    }
    assert set(ours) <= set(theirs)
    assert {n: v for n, v in ours.items() if theirs[n] != v} == {}


def test_demo_config_keeps_the_toy_settings(tmp_path):
    "make demo passes configs/demo.yaml: the pipeline's stages get the toy's laptop-sized values."
    demo = Path(__file__).parents[1] / "configs" / "demo.yaml"
    assert "--config configs/demo.yaml" in (Path(__file__).parents[1] / "Makefile").read_text()
    args = parse_config(cli.PipelineCommand, ["--config", str(demo)], "goose pipeline")
    assert args.sft["learning_rate"] == 3e-3 and args.ppo["learning_rate"] == 5e-4
    sft = cli._stage(cli.SFTCommand, args.sft, "sft", {}, {"output_dir": str(tmp_path)})
    assert (sft.learning_rate, sft.max_steps, sft.warmup_steps) == (3e-3, 300, 20)
    with pytest.raises(cli.UsageError, match="did you mean --learning_rate"):
        cli._stage(cli.SFTCommand, {"learning_rat": 1.0}, "sft", {}, {})


# --- item 1: TRL's keys and flags
TRL_GRPO_YAML = """\
model_name_or_path: tiny-gpt2
model_revision: main
torch_dtype: float32
attn_implementation: null
dataset_name: {data}
dataset_train_split: train
dataset_test_split: test
reward_funcs: [think_format_reward]
learning_rate: 1.0e-06
per_device_train_batch_size: 4
num_generations: 2
max_completion_length: 4
max_steps: 1
logging_steps: 1
output_dir: {out}
use_peft: true
lora_r: 8
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules: [c_attn]
"""


def test_trl_yaml_keys_are_read(tmp_path):
    (tmp_path / "grpo.yaml").write_text(TRL_GRPO_YAML.format(data=tmp_path / "d", out=tmp_path / "o"))
    args = parse_config(cli.GRPOCommand, ["--config", str(tmp_path / "grpo.yaml")], "goose grpo")
    assert (args.policy, args.dataset, args.dtype, args.reward_funcs) == (
        "tiny-gpt2",
        str(tmp_path / "d"),
        "float32",
        ["think_format_reward"],
    )
    peft = cli.lora_config(args)
    # a list stays a list (TRL's one-name string is a regex of the full module name)
    assert (peft.r, peft.lora_alpha, peft.target_modules) == (8, 16, {"c_attn"})


def test_trl_flags_are_read():
    args = parse_config(
        cli.SFTCommand,
        [
            "--model_name_or_path",
            "tiny-llama",
            "--dataset_name=trl-lib/Capybara",
            "--dataset_config",
            "default",
            "--torch_dtype",
            "bfloat16",
            "--use_peft",
            "--lora_r",
            "4",
        ],
        "goose sft",
    )
    assert (args.model, args.dataset, args.dataset_config, args.dtype, args.use_peft, args.lora_r) == (
        "tiny-llama",
        "trl-lib/Capybara",
        "default",
        "bfloat16",
        True,
        4,
    )
    reward = parse_config(cli.RLOOCommand, ["--reward_model_name_or_path", "gold"], "goose rloo")
    assert reward.reward_model == ["gold"]


def test_unknown_key_names_the_closest(tmp_path, capsys):
    (tmp_path / "x.yaml").write_text("model_name_or_path: tiny-gpt2\nlerning_rate: 1.0e-5\n")
    code, _, err = run_main(capsys, "sft", "--config", str(tmp_path / "x.yaml"))
    assert code == 2 and err.count("\n") == 1
    assert "unknown setting 'lerning_rate'" in err and "did you mean learning_rate?" in err
    code, _, err = run_main(capsys, "grpo", "--num_generatoins", "4")
    assert code == 2 and err.count("\n") == 1 and "did you mean --num_generations?" in err


def test_quantised_loading_and_lora_without_use_peft_are_refused(capsys):
    code, _, err = run_main(capsys, "sft", "--load_in_4bit")
    assert code == 2 and "`load_in_4bit`" in err and "not supported" in err
    code, _, err = run_main(capsys, "sft", "--lora_r", "8")
    assert code == 2 and "--lora_r has no effect without --use_peft" in err


# --- item 2: goose reward
def test_goose_reward_is_trls_name_and_rm_stays(capsys):
    for name in ("reward", "rm"):
        code, out, _ = run_main(capsys, name, "--help")
        assert code == 0 and "goose reward:" in out, name
    code, out, _ = run_main(capsys)
    assert "reward" in out and "goose rm" in out


# --- item 3: TRL's reward names and dotted paths
def test_reward_funcs_by_trl_name_and_dotted_path():
    from instruct_goose import accuracy_reward
    from instruct_goose.toy import gold_score

    args = parse_config(
        cli.GRPOCommand,
        [
            "--reward_funcs",
            "accuracy_reward",
            "instruct_goose.toy.gold_score",
            "instruct_goose.toy:gold_score",
        ],
        "goose grpo",
    )
    assert cli.command_reward(args) == [accuracy_reward, gold_score, gold_score]
    both = parse_config(cli.GRPOCommand, ["--reward_model", "gold", "--reward_funcs", "accuracy_reward"], "g")
    assert cli.command_reward(both) == [gold_score, accuracy_reward]  # TRL: the model first


# --- item 4: goose sft --use_peft
class Recorder:
    made = []

    def __init__(
        self,
        model,
        args=None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        peft_config=None,
        **kwargs,
    ):
        self.args, self.peft_config, self.train_dataset, self.eval_dataset = (
            args,
            peft_config,
            train_dataset,
            eval_dataset,
        )
        self.model = self.reward_model = None  # what the commands return after `train()`
        Recorder.made.append(self)

    def train(self):
        return None

    def evaluate(self):
        return {}


@pytest.mark.parametrize(
    "command, trainer", [("sft", "SFTTrainer"), ("reward", "RewardTrainer"), ("dpo", "DPOTrainer")]
)
def test_use_peft_reaches_the_trainer(command, trainer, monkeypatch, capsys):
    monkeypatch.setattr(cli, trainer, Recorder)
    Recorder.made.clear()
    main(
        [
            command,
            "--model",
            "tiny-gpt2",
            "--use_peft",
            "--lora_r",
            "4",
            "--lora_target_modules",
            "c_attn",
            "--disable_tqdm",
        ]
    )
    (made,) = Recorder.made
    assert (made.peft_config.r, made.peft_config.lora_alpha, made.peft_config.target_modules) == (
        4,
        32,
        {"c_attn"},
    )


def test_sft_with_peft_trains_adapters(tmp_path):
    pytest.importorskip("peft")
    trainer = cli.run_sft(
        parse_config(
            cli.SFTCommand,
            [
                "--use_peft",
                "--lora_r",
                "4",
                "--max_steps",
                "1",
                "--output_dir",
                str(tmp_path),
                "--disable_tqdm",
                "--per_device_train_batch_size",
                "2",
            ],
            "goose sft",
        )
    )
    assert trainer is not None


# --- item 5: a local folder of data files
def test_dataset_folder_of_jsonl_loads_as_trls_dataset_name(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(6)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    for name in (str(folder), f"{folder}/", "./data"):
        monkeypatch.chdir(tmp_path)
        assert cli.load_data(name, "sft").num_rows == 6, name
        assert cli.load_data(name, "sft", "test").num_rows == 2, name
    monkeypatch.setattr(cli, "SFTTrainer", Recorder)
    Recorder.made.clear()
    main(["sft", "--dataset_name", str(folder), "--eval_strategy", "steps", "--disable_tqdm"])
    (made,) = Recorder.made
    assert (made.train_dataset.num_rows, made.eval_dataset.num_rows) == (6, 2)
    # a save_to_disk folder still works
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    assert cli.load_data(str(tmp_path / "saved"), "sft").num_rows == 6
    with pytest.raises(cli.UsageError, match="--dataset"):
        cli.load_data(str(tmp_path / "nothing_here"), "sft")


# --- item 7: --help starts with what users set
def test_help_shows_the_main_settings_first(capsys):
    code, out, _ = run_main(capsys, "grpo", "--help")
    assert code == 0
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert listed[:4] == ["--help-all", "--config", "--policy", "--dataset"]
    for flag in (
        "--output_dir",
        "--reward_funcs",
        "--learning_rate",
        "--per_device_train_batch_size",
        "--max_steps",
        "--num_generations",
        "--use_peft",
    ):
        assert flag in listed, flag
    assert "vllm" not in out.lower() and "tool" not in out.lower()
    assert len(out.splitlines()) < 150 and "--help-all lists every one" in out
    code, everything, _ = run_main(capsys, "grpo", "--help-all")
    assert (
        code == 0
        and "--use_vllm" in everything
        and everything.index("--policy") < everything.index("--use_vllm")
    )
