"""FSDP2 (torch's `fully_shard` through Accelerate's FSDP plugin, `fsdp_version: 2`) with 2 CPU processes (torchrun,
gloo) against 1 unsharded process with the same global batch and seed: the standard of tests/test_multiprocess.py.

Accelerate 1.15 selects FSDP only on an accelerator (on the CPU it silently falls back to DDP or to one process);
`fresh_accelerator` switches FSDP2 on over gloo when the launch asks for it (`ACCELERATE_USE_FSDP`, `FSDP_VERSION=2`,
`ACCELERATE_USE_CPU`, under torchrun) and refuses, in one line, an FSDP launch it cannot honour. (`accelerate launch`
cannot start this: its FSDP launcher sets `ACCELERATE_USE_CPU=false` whatever the config's `use_cpu` says.)
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import with_bitsandbytes
from test_multiprocess import _assert_same as _same_runs  # tests/: the 1-vs-2-process comparison

SCRIPT = '''
import copy, json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from instruct_goose.dpo import DPOConfig, DPOTrainer
from instruct_goose import RewardConfig, RewardModel, RewardTrainer, SFTConfig, SFTTrainer, load_task
algo, policy, out, accumulation = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
resume = sys.argv[5] if len(sys.argv) > 5 else None
tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
for m in model.modules():   # dropout draws differ by process: off, so that 1 process and 2 compute the same thing
    if isinstance(m, torch.nn.Dropout): m.p = 0.0
common = dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
              disable_tqdm=True, learning_rate=1e-3, save_steps=2, resume_from_checkpoint=resume, max_steps=4)
if algo == "sft":
    trainer = SFTTrainer(model, args=SFTConfig(max_length=32, **common), train_dataset=load_task("sft").select(range(64)), processing_class=tokenizer)
elif algo == "rm":
    torch.manual_seed(0)    # the fresh head: the same draw in every process (FSDP2 does not broadcast rank 0's weights as DDP does)
    reward_model = RewardModel(model, tokenizer=tokenizer)
    for m in reward_model.modules():
        if isinstance(m, torch.nn.Dropout): m.p = 0.0
    trainer = RewardTrainer(reward_model, RewardConfig(max_length=32, normalize=False, **common), load_task("preferences").select(range(64)))
elif algo == "sft_8bit":   # bitsandbytes' 8-bit AdamW: its step cannot update DTensors, so the run must refuse it in one line
    trainer = SFTTrainer(model, args=SFTConfig(max_length=32, optim="adamw_8bit", **common), train_dataset=load_task("sft").select(range(64)), processing_class=tokenizer)
elif algo == "sft_given":   # an optimizer made before the trainer (🤗's `optimizers`): under FSDP the optimizer belongs to the sharded model
    trainer = SFTTrainer(model, args=SFTConfig(max_length=32, **common), train_dataset=load_task("sft").select(range(64)), processing_class=tokenizer,
                         optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-3), None))
elif algo == "sft_best":   # 🤗's load_best_model_at_end: every process loads the best step's sharded checkpoint at the end
    trainer = SFTTrainer(model, args=SFTConfig(max_length=32, **{**common, "save_steps": 1}, eval_steps=1, load_best_model_at_end=True,
                                               greater_is_better=True),   # the largest eval_loss: a step other than the last, as the loss falls
                         train_dataset=load_task("sft").select(range(64)), eval_dataset=load_task("sft").select(range(8)), processing_class=tokenizer)
elif algo == "dpo":   # the frozen reference (a copy, not prepared) is replicated in every process beside the sharded policy
    trainer = DPOTrainer(model, args=DPOConfig(**common), train_dataset=load_task("preferences").select(range(64)), processing_class=tokenizer)
trainer.train()
rank = os.environ.get("RANK", "0")
json.dump(trainer.loop.state.history, open(f"{out}/history{rank}.json", "w"))
if algo == "sft_best": json.dump(trainer.evaluate(), open(f"{out}/evaluated{rank}.json", "w"))   # the model the run ended with, evaluated again
'''

ONPOLICY = '''
import copy, json, os, sys, torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
from instruct_goose import (Agent, GRPOConfig, GRPOTrainer, RLHFConfig, RLHFTrainer, RLOOConfig, RLOOTrainer,
                            create_reference_model, load_task)
algo, policy, out, accumulation = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
resume = sys.argv[5] if len(sys.argv) > 5 else None
tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
prompts = [{"prompt": p} for p in load_task("prompts")["prompt"][:64]]
reward = lambda prompts, completions: [len(c) / 10 for c in completions]
common = dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation, max_steps=4,
              local_rollout_forward_batch_size=4, num_sample_generations=0, disable_tqdm=True, learning_rate=1e-3,
              save_steps=2, resume_from_checkpoint=resume)
if os.environ.get("GOOSE_CHECKPOINTING"):   # a gradient checkpointing policy for every trained model
    common.update(gradient_checkpointing=True, gradient_checkpointing_policy=os.environ["GOOSE_CHECKPOINTING"])
if algo.startswith("ppo"):   # the reference (a frozen copy, not prepared) is replicated in every process beside the sharded agent
    torch.manual_seed(0)     # the fresh value head: the same draw in every process (FSDP2 does not broadcast rank 0's weights)
    critic = AutoModel.from_pretrained(policy) if algo == "ppo_critic" else None
    trainer = RLHFTrainer(Agent(copy.deepcopy(model), critic), create_reference_model(model),
                          RLHFConfig(whiten_rewards=True, ptx_coef=0.5, response_length=6, num_ppo_epochs=2, **common),
                          processing_class=tokenizer, reward_funcs=reward, train_dataset=prompts, pretrain_dataset=load_task("pretrain"))
elif algo == "rloo":
    trainer = RLOOTrainer(copy.deepcopy(model), model, RLOOConfig(num_generations=2, normalize_advantages=True, response_length=6,
                          num_ppo_epochs=2, **common), processing_class=tokenizer, reward_funcs=reward, train_dataset=prompts)
else:
    trainer = GRPOTrainer(model, args=GRPOConfig(num_generations=2, max_completion_length=6, num_iterations=2, beta=0.1,
                          scale_rewards="batch", loss_type="dapo", logging_steps=1, **common),
                          processing_class=tokenizer, train_dataset=prompts, reward_funcs=reward)
trainer.train()
json.dump(trainer.loop.state.history, open(f"{out}/history{os.environ.get('RANK', '0')}.json", "w"))
'''

FSDP2_CPU = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
}


@pytest.fixture(scope="module")
def setup_dir(policy_dir, tmp_path_factory):
    where = tmp_path_factory.mktemp("setup")
    shutil.copytree(policy_dir, where, dirs_exist_ok=True)
    (where / "train.py").write_text(SCRIPT)
    (where / "onpolicy.py").write_text(ONPOLICY)
    return where


ON_POLICY = ("ppo", "ppo_critic", "rloo", "grpo")


def _run(
    setup_dir,
    out,
    algo,
    processes,
    accumulation,
    resume=None,
    fsdp=False,
    check=True,
    engine=None,
    checkpointing=None,
):
    """Train `algo` in 1 process or under torchrun; `engine`: the launch's environment in place of `use_cpu`
    (DeepSpeed's, tests/test_deepspeed.py); `checkpointing`: a gradient checkpointing policy (on-policy runs).
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACCELERATE_", "FSDP_", "GOOSE_CHECKPOINTING"))
    }
    env |= {
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(out) + "-cache",
        **({"GOOSE_CHECKPOINTING": checkpointing} if checkpointing else {}),
        **(engine if engine is not None else {"ACCELERATE_USE_CPU": "true", **(FSDP2_CPU if fsdp else {})}),
    }
    script = [
        str(setup_dir / ("onpolicy.py" if algo in ON_POLICY else "train.py")),
        algo,
        str(setup_dir),
        str(out),
        str(accumulation),
    ] + ([resume] if resume else [])
    if processes == 1:
        command = [sys.executable] + script
    else:
        command = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            str(processes),
        ] + script
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if not check:
        return result
    assert result.returncode == 0, result.stderr[-8000:]
    return _saved(out, algo), json.loads((out / "history0.json").read_text())


def _saved(out, algo="sft"):
    """The weights the run saved, read back with plain 🤗 `from_pretrained` (PPO: and the value head, and the
    critic with `AutoModel`)."""
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if algo == "rm" else AutoModelForCausalLM
    weights = auto.from_pretrained(out).state_dict()
    if algo.startswith("ppo"):
        weights |= {f"value_head.{k}": v for k, v in load_file(out / "value_head.safetensors").items()}
    if algo == "ppo_critic":
        weights |= {
            f"critic.{k}": v for k, v in AutoModel.from_pretrained(out / "value_model").state_dict().items()
        }
    return weights


COMPARED = (
    "loss",
    "grad_norm",
    "learning_rate",
    "epoch",
    "objective/scores",
    "objective/kl",
    "objective/rlhf_reward",
    "loss/policy_avg",
    "policy/approxkl_avg",
    "reward",
    "kl",
    "entropy",
)


def _assert_same(a, b, what, eps=1e-6):
    "The multi-process tests' comparison (tests/test_multiprocess.py), on the supervised trainers' metrics."
    _same_runs(a, b, what, eps, COMPARED)


# DPO: tests/test_dpo.py's DDP standard (its pair log-ratio differences cost a digit). On-policy: the weights
# end 1.1e-6
# apart (PPO, GRPO; metrics 7e-7), a reduce-scatter summing the two halves in another order than one process's
# accumulation
EPS = {"sft": 1e-6, "rm": 1e-6, "dpo": 1e-5, "ppo": 1e-5, "ppo_critic": 1e-5, "rloo": 1e-5, "grpo": 1e-5}


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["sft", "rm", "dpo", *ON_POLICY])
def test_fsdp2_two_processes_equal_one(algo, setup_dir, tmp_path):
    """FSDP2 over 2 processes × 1 micro-batch = 1 unsharded process × 2 micro-batches; the saved model loads with
    `from_pretrained`."""
    one = _run(setup_dir, tmp_path / "one", algo, processes=1, accumulation=2)
    two = _run(setup_dir, tmp_path / "two", algo, processes=2, accumulation=1, fsdp=True)
    # FSDP's sharded checkpoint, one shard a rank
    assert (tmp_path / "two" / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()
    _assert_same(one, two, f"{algo}: 1 process x 2 micro-batches vs FSDP2 over 2 processes", EPS[algo])
    start = _saved(setup_dir)
    moved = "lm_head.weight" if algo == "sft" else "transformer.h.0.mlp.c_fc.weight"
    # training moved the weights
    assert not torch.equal(two[0][moved], start[moved])

    # kill-and-resume: the FSDP2 checkpoint of step 2, resumed by FSDP2, ends where the uninterrupted run did
    shutil.copytree(tmp_path / "two" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(
        setup_dir, tmp_path / "resumed", algo, processes=2, accumulation=1, resume="latest", fsdp=True
    )
    _assert_same(two, resumed, f"{algo}: FSDP2 run vs its checkpoint resumed under FSDP2", EPS[algo])


@pytest.mark.slow
def test_fsdp2_loads_the_best_checkpoint_as_one_process_does(setup_dir, tmp_path):
    """`load_best_model_at_end` under FSDP2 over 2 processes: the best step (not the last) is the one process's,
    and the saved model is that step's, as in 1 process."""
    one = _run(setup_dir, tmp_path / "one", "sft_best", processes=1, accumulation=2)
    two = _run(setup_dir, tmp_path / "two", "sft_best", processes=2, accumulation=1, fsdp=True)
    losses = [row["eval_loss"] for row in two[1]]
    # the "best" (greater_is_better) is not the last step
    assert losses.index(max(losses)) < 3, losses
    # and it is the model each process ended with
    for rank in (0, 1):
        assert (
            abs(
                json.loads((tmp_path / "two" / f"evaluated{rank}.json").read_text())["eval_loss"]
                - max(losses)
            )
            < 1e-6
        )
    _assert_same(one, two, "sft_best: 1 process x 2 micro-batches vs FSDP2 over 2 processes", EPS["sft"])


@pytest.mark.slow
def test_fsdp2_refuses_a_bitsandbytes_optimizer_in_one_line(setup_dir, tmp_path, monkeypatch):
    """bitsandbytes' optimizers have no sharding rule for FSDP2's DTensors (its step raised NotImplementedError
    at the first update): refused before training, naming `optim`."""
    monkeypatch.setenv("PYTHONPATH", with_bitsandbytes(dict(os.environ))["PYTHONPATH"])
    result = _run(
        setup_dir, tmp_path / "eight", "sft_8bit", processes=2, accumulation=1, fsdp=True, check=False
    )
    assert (
        result.returncode != 0
        and (
            "ValueError: `optim`='adamw_8bit' is a bitsandbytes optimizer, whose step cannot update FSDP2's "
            "sharded parameters"
        )
        in result.stderr
    ), result.stderr[-3000:]
    assert not list((tmp_path / "eight").glob("checkpoint-*"))


@pytest.mark.slow
def test_fsdp2_refuses_a_given_optimizer_in_one_line(setup_dir, tmp_path):
    """An optimizer made before the trainer (`optimizers=`) holds the unsharded parameters: refused under FSDP
    before training, as 🤗's Trainer refuses it."""
    result = _run(
        setup_dir, tmp_path / "given", "sft_given", processes=2, accumulation=1, fsdp=True, check=False
    )
    assert (
        result.returncode != 0 and "ValueError: `optimizers` cannot be given under FSDP" in result.stderr
    ), result.stderr[-3000:]
    assert not list((tmp_path / "given").glob("checkpoint-*"))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo_critic"])
def test_fsdp2_with_selective_checkpointing_equals_one_plain_process(algo, setup_dir, tmp_path):
    """Selective checkpointing (every block, the critic's too) under FSDP2 over 2 processes trains as 1 unsharded
    process without checkpointing."""
    one = _run(setup_dir, tmp_path / "one", algo, processes=1, accumulation=2)
    two = _run(
        setup_dir, tmp_path / "two", algo, processes=2, accumulation=1, fsdp=True, checkpointing="selective"
    )
    _assert_same(
        one,
        two,
        f"{algo}: 1 plain process x 2 micro-batches vs FSDP2 over 2 processes with selective checkpointing",
        EPS[algo],
    )


@pytest.mark.parametrize(
    "env, says",
    [
        # a GPU FSDP config (use_cpu: false) on a CPU machine
        ({}, "no GPU"),
        ({"ACCELERATE_USE_CPU": "true", "FSDP_VERSION": "1"}, "FSDP2"),  # FSDP1 has no CPU path
    ],
)
def test_fsdp_launch_it_cannot_honour_is_one_line(env, says):
    """Accelerate would silently train unsharded; goose stops in one line naming the fix (a fresh interpreter
    each: ~9 s)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))},
        "ACCELERATE_USE_FSDP": "true",
        **env,
    }
    result = subprocess.run(
        [sys.executable, "-c", "from instruct_goose.launch import fresh_accelerator; fresh_accelerator()"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert (
        last.startswith("ValueError: the launch asks for FSDP")
        and says in last
        and "ACCELERATE_USE_CPU=true FSDP_VERSION=2" in last
    ), last


def test_deepspeed_launch_on_the_cpu_is_one_line():
    """Accelerate never selects DeepSpeed with `use_cpu` and would train plain DDP; goose stops in one line
    naming the fix (~9 s)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))},
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
        "ACCELERATE_USE_CPU": "true",
    }
    result = subprocess.run(
        [sys.executable, "-c", "from instruct_goose.launch import fresh_accelerator; fresh_accelerator()"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    # Accelerate's own one line (the project does not install DeepSpeed)
    if importlib.util.find_spec("deepspeed") is None:
        assert last.startswith("ImportError: DeepSpeed is not installed"), last
    else:
        assert (
            last.startswith("ValueError: the launch asks for DeepSpeed")
            and "use_cpu" in last
            and "fsdp2_cpu.yaml" in last
        ), last


@pytest.mark.slow
def test_accelerate_launch_fsdp2_config_runs_goose_grpo(policy_dir, tmp_path):
    """`accelerate launch --config_file configs/fsdp2_cpu.yaml -m instruct_goose.cli grpo`: 2 sharded CPU
    processes, end to end."""
    out = tmp_path / "grpo"
    (tmp_path / "length_reward.py").write_text(
        "def length(prompts, completions): return [len(c) / 10 for c in completions]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    config = Path(__file__).parents[1] / "configs" / "fsdp2_cpu.yaml"
    result = subprocess.run(
        [
            str(Path(sys.executable).parent / "accelerate"),
            "launch",
            "--config_file",
            str(config),
            "-m",
            "instruct_goose.cli",
            "grpo",
            "--policy",
            str(policy_dir),
            "--reward_funcs",
            "length_reward:length",
            "--output_dir",
            str(out),
            "--per_device_train_batch_size",
            "4",
            "--num_generations",
            "2",
            "--max_steps",
            "2",
            "--max_completion_length",
            "6",
            "--num_sample_generations",
            "0",
            "--save_steps",
            "1",
            "--logging_steps",
            "1",
            "--disable_tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-6000:]
    # sharded: one shard per rank
    assert (out / "checkpoint-2" / "pytorch_model_fsdp_0").is_dir()
    assert {p.name for p in (out / "checkpoint-2").glob("random_states_*.pkl")} == {
        "random_states_0.pkl",
        "random_states_1.pkl",
    }
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # 2 processes × 4 completions a step
    assert [row["episode"] for row in rows] == [8, 16]
    trained, start = _saved(out, "grpo"), _saved(policy_dir)
    assert not torch.equal(
        trained["transformer.h.0.mlp.c_fc.weight"], start["transformer.h.0.mlp.c_fc.weight"]
    )
