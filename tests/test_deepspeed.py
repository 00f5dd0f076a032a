"""DeepSpeed ZeRO-2 and ZeRO-3 through Accelerate with 2 CPU processes (torchrun; DeepSpeed's CPU accelerator over gloo)
against 1 plain process with the same global batch and seed: the standard of tests/test_fsdp.py.

DeepSpeed is not a dependency of the project: these tests run where `deepspeed` is importable (here: `pip install
--target DIR deepspeed==0.19.8` and `PYTHONPATH=DIR`) and are skipped otherwise. Accelerate never selects DeepSpeed
with `use_cpu`, so the launch leaves `ACCELERATE_USE_CPU` out; DeepSpeed then JIT-compiles its shared-memory all-reduce
op once (3 to 10 minutes; `TORCH_EXTENSIONS_DIR` says where it is kept; a stale `lock` file there makes it wait forever).
What ran here and the differences measured are in the scaling chapter, "Sharded engines: what ran here".
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

from test_fsdp import ON_POLICY, ONPOLICY, SCRIPT, _assert_same, _saved

# tests/test_fsdp.py's on-policy script; `KEEP_FIRST_PASS=0` turns off the rollout's kept policy pass (see the ZeRO-3 test)
ONPOLICY_DS = ONPOLICY.replace("trainer.train()", 'trainer.keeps_first_pass = os.environ.get("KEEP_FIRST_PASS", "1") == "1"\ntrainer.train()')

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="DeepSpeed is not installed (not a dependency of the project; `pip install deepspeed` to run these)")


def _zero(stage):
    "The environment `accelerate launch` makes of configs/deepspeed_zero{stage}.yaml in float32, less `use_cpu` (it drops DeepSpeed)."
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage), "ACCELERATE_GRADIENT_CLIPPING": "1.0",
           "ACCELERATE_MIXED_PRECISION": "no"}
    if stage == 3: env |= {"ACCELERATE_DEEPSPEED_ZERO3_INIT": "false", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}
    return env


@pytest.fixture(scope="module")
def setup_dir(policy_dir, tmp_path_factory):
    where = tmp_path_factory.mktemp("setup")
    shutil.copytree(policy_dir, where, dirs_exist_ok=True)
    (where / "train.py").write_text(SCRIPT)
    (where / "onpolicy.py").write_text(ONPOLICY_DS)
    return where


def _run(setup_dir, out, algo, processes, accumulation, stage=None, resume=None, check=True, **env_extra):
    "tests/test_fsdp.py's `_run`: `stage` None is the plain run (`use_cpu`), else DeepSpeed ZeRO-`stage` under torchrun."
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env |= {"OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(out) + "-cache", **(_zero(stage) if stage else {"ACCELERATE_USE_CPU": "true"}), **env_extra}
    script = [str(setup_dir / ("onpolicy.py" if algo in ON_POLICY else "train.py")), algo, str(setup_dir), str(out), str(accumulation)] + ([resume] if resume else [])
    if processes == 1: command = [sys.executable] + script
    else: command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(processes)] + script
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if not check: return result
    assert result.returncode == 0, result.stderr[-8000:]
    return _saved(out, algo), json.loads((out / "history0.json").read_text())


# Measured here (deepspeed 0.19.8, CPU accelerator, gloo): the weights of 2 ZeRO processes end within these of 1 plain process
# (SFT 8.8e-7, GRPO 2.0e-6; the scaling chapter has the table); tests/test_fsdp.py's tolerances
EPS = {"sft": 1e-6, "dpo": 1e-5, "ppo": 1e-5, "grpo": 1e-5}
_ONE = {}


def _one(setup_dir, tmp_path_factory, algo):
    "The plain 1-process run with 2 micro-batches a step, made once per trainer for both stages."
    if algo not in _ONE: _ONE[algo] = _run(setup_dir, tmp_path_factory.mktemp(f"one-{algo}"), algo, processes=1, accumulation=2)
    return _ONE[algo]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("algo", ["sft", "dpo", "ppo", "grpo"])
def test_zero_two_processes_equal_one(algo, stage, setup_dir, tmp_path, tmp_path_factory):
    "ZeRO over 2 CPU processes × 1 micro-batch = 1 plain process × 2 micro-batches; a ZeRO checkpoint (one optimizer shard a rank)."
    # ZeRO-3 on-policy: without the kept pass (see test_zero3_kept_first_pass_is_a_known_defect); sampling runs under the gathering
    two = _run(setup_dir, tmp_path / "two", algo, processes=2, accumulation=1, stage=stage,
               **({"KEEP_FIRST_PASS": "0"} if stage == 3 and algo in ON_POLICY else {}))
    shards = {p.name for p in (tmp_path / "two" / "checkpoint-2" / "pytorch_model").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= shards, shards
    assert [row["episode"] for row in two[1]][:2] == [8, 16]                              # 2 processes × 4 rows a step: both counted
    _assert_same(_one(setup_dir, tmp_path_factory, algo), two, f"{algo}: 1 process x 2 micro-batches vs ZeRO-{stage} over 2 processes", EPS[algo])
    start = _saved(setup_dir)
    moved = "lm_head.weight" if algo == "sft" else "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(two[0][moved], start[moved])                                  # training moved the weights


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known defect, not fixed here: under ZeRO-3 the rollout's policy pass kept with gradients "
                   "(`first_pass`) is made inside the gathering for generation; after it the parameters are partitioned again and "
                   "its backward finds a LayerNorm weight of shape [0]. Fix: `first_pass` returns None under ZeRO-3 (nbs/08_onpolicy.ipynb)")
def test_zero3_kept_first_pass_is_a_known_defect(setup_dir, tmp_path):
    result = _run(setup_dir, tmp_path / "two", "grpo", processes=2, accumulation=1, stage=3, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
