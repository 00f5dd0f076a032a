"""The Accelerate configs in `configs/`: each loads with Accelerate's own loader, reaches a launched process as the
settings it names, and the commands in configs/README.md use only flags `accelerate launch` and `goose` know.

Nothing here needs a GPU or DeepSpeed: `accelerate launch` is stopped just before it would start processes, and the
launcher's environment is handed to Accelerate's plugin classes to read back."""

import os
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
NAMES = ["deepspeed_zero2", "deepspeed_zero3", "fsdp"]


def load(name) -> ClusterConfig:
    return load_config_from_file(str(CONFIGS / f"{name}.yaml"))  # also rejects unknown top-level keys


def launched_env(name) -> dict[str, str]:
    """The environment `accelerate launch --config_file configs/<name>.yaml` gives each process (no process
    started)."""
    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{name}.yaml"), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    # as `launch_command` does before `deepspeed_launcher`
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(
            [*defaults.deepspeed_config, "mixed_precision"]
        )
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("name", NAMES)
def test_one_node_eight_gpus_bf16(name):
    c = load(name)
    assert (c.num_machines, c.num_processes, c.machine_rank) == (1, 8, 0)
    assert c.mixed_precision == "bf16" and not c.use_cpu
    assert c.compute_environment.value == "LOCAL_MACHINE"


@pytest.mark.parametrize("name", NAMES)
def test_every_nested_key_is_a_launch_flag(name):
    """Accelerate checks only top-level keys; a misspelt `deepspeed_config`/`fsdp_config` key would be ignored
    silently."""
    c = load(name)
    flags = {a.dest for a in launch_command_parser()._actions}
    nested = {
        **c.deepspeed_config,
        **{k if k.startswith("fsdp") else f"fsdp_{k}": v for k, v in c.fsdp_config.items()},
    }
    assert nested and set(nested) <= flags, set(nested) - flags


def test_zero2_shards_optimizer_and_gradients_only():
    c = load("deepspeed_zero2")
    assert c.distributed_type == DistributedType.DEEPSPEED
    ds = c.deepspeed_config
    assert ds["zero_stage"] == 2
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"
    assert ds["zero3_init_flag"] is False


def test_zero3_shards_parameters_too():
    c = load("deepspeed_zero3")
    assert c.distributed_type == DistributedType.DEEPSPEED
    ds = c.deepspeed_config
    assert ds["zero_stage"] == 3
    assert ds["zero3_init_flag"] is True and ds["zero3_save_16bit_model"] is True
    assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"


@pytest.mark.parametrize("name", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_takes_accumulation_from_goose(name):
    """A config value would become ACCELERATE_GRADIENT_ACCUMULATION_STEPS, which overrides what goose gives its
    Accelerator."""
    c = load(name)
    assert "gradient_accumulation_steps" not in c.deepspeed_config
    # goose's default --max_grad_norm
    assert c.deepspeed_config["gradient_clipping"] == 1.0


@pytest.mark.parametrize("name, stage", [("deepspeed_zero2", 2), ("deepspeed_zero3", 3)])
def test_deepspeed_plugin_reads_back_the_config(name, stage):
    env = launched_env(name)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env
    with mock.patch.dict(os.environ, env, clear=True):
        # pure Python: DeepSpeed itself is not imported
        plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert plugin.zero_stage == zero["stage"] == stage
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "none"
    # filled from goose's flag at prepare
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"
    assert plugin.zero3_init_flag is (stage == 3)
    assert zero["stage3_gather_16bit_weights_on_model_save"] is (stage == 3)


def test_fsdp_full_shard_with_original_parameters():
    c = load("fsdp")
    assert c.distributed_type == DistributedType.FSDP
    f = c.fsdp_config
    # use_orig_params / sync_module_states are FSDP1 settings
    assert f["fsdp_version"] == 1
    assert f["fsdp_sharding_strategy"] == f["fsdp_reshard_after_forward"] == "FULL_SHARD"
    assert f["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and f["fsdp_transformer_layer_cls_to_wrap"]
    assert f["fsdp_use_orig_params"] is True
    assert f["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert f["fsdp_cpu_ram_efficient_loading"] is True and f["fsdp_sync_module_states"] is True
    assert f["fsdp_offload_params"] is False


def test_fsdp_plugin_reads_back_the_config():
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy, StateDictType

    env = launched_env("fsdp")
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "1"
    assert env["FSDP_CPU_RAM_EFFICIENT_LOADING"] == env["FSDP_SYNC_MODULE_STATES"] == "true"
    with mock.patch.dict(os.environ, env, clear=True):
        # sync_module_states broadcasts from an accelerator device at construction; on this CPU-only check it
        # is off
        plugin = FullyShardedDataParallelPlugin(sync_module_states=False, cpu_ram_efficient_loading=False)
    assert plugin.fsdp_version == 1
    assert plugin.sharding_strategy == ShardingStrategy.FULL_SHARD
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.use_orig_params is True and plugin.cpu_offload.offload_params is False
    assert plugin.backward_prefetch == BackwardPrefetch.BACKWARD_PRE
    assert plugin.transformer_cls_names_to_wrap == [
        load("fsdp").fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
    ]


def test_fsdp_wrap_class_is_found_in_a_goose_agent():
    """goose prepares an `Agent`; the block class the FSDP1 config names (over the `Agent`'s own
    `_no_split_modules`) must exist in it."""
    from accelerate.utils.dataclasses import get_module_class_from_name
    from instruct_goose import Agent, task_tokenizer, tiny_causal_lm

    agent = Agent(tiny_causal_lm(task_tokenizer(), arch="llama"))
    # what FSDP2's fsdp2.yaml leaves to the model
    assert agent._no_split_modules == ["LlamaDecoderLayer", "LlamaForCausalLM"]
    name = load("fsdp").fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
    assert get_module_class_from_name(agent, name) is not None


# ---- the commands documented in configs/README.md ----


def documented_commands() -> list[list[str]]:
    """Every `accelerate launch ...` command in a ```bash block of configs/README.md, as argv (lines joined at
    `\\`)."""
    text = (CONFIGS / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip().startswith("accelerate launch"):
                commands.append(shlex.split(command.split("#")[0]))
    return commands


def test_readme_documents_a_command_per_config():
    used = {argv[argv.index("--config_file") + 1] for argv in documented_commands()}
    assert {f"configs/{n}.yaml" for n in NAMES} <= used


@pytest.mark.parametrize(
    "argv", documented_commands(), ids=lambda argv: argv[argv.index("--config_file") + 1]
)
def test_readme_command_uses_real_flags(argv):
    from instruct_goose.cli import _COMMANDS, parse_config

    script = next(i for i, a in enumerate(argv) if a.endswith("goose") or a == "$(which goose)")
    launch_args, (command, *goose_args) = argv[2:script], argv[script + 1 :]
    parsed = launch_command_parser().parse_args([*launch_args, "train.py"])
    config = load_config_from_file(str(CONFIGS.parent / parsed.config_file))
    goose = parse_config(_COMMANDS[command][0], goose_args, prog=f"goose {command}")
    # the on-policy trainers refuse FSDP
    if config.distributed_type == "FSDP":
        assert command not in ("ppo", "rloo")
    # goose hands its own mixed_precision to the Accelerator, which wins over the launcher's: they must agree
    assert goose.mixed_precision == config.mixed_precision == "bf16"
    assert goose.max_grad_norm == config.deepspeed_config.get("gradient_clipping", goose.max_grad_norm)


def test_sft_refuses_shared_prefix_in_one_line():
    "`shared_prefix` runs a repeated prompt once: SFT's rows repeat none, so its config refuses it by name."
    from instruct_goose import SFTConfig

    with pytest.raises(ValueError, match=r"^`shared_prefix`: SFTConfig's rows"):
        SFTConfig(output_dir="unused", shared_prefix=True)
