"""DeepSpeed ZeRO-2 and ZeRO-3 through Accelerate with 2 CPU processes (torchrun; DeepSpeed's CPU accelerator over gloo)
against 1 plain process with the same global batch and seed: the standard of tests/test_fsdp.py.

DeepSpeed is not a dependency of the project: these tests run where `deepspeed` is importable (here: `pip install
--target DIR deepspeed==0.19.8` and `PYTHONPATH=DIR`) and are skipped otherwise. Accelerate never selects DeepSpeed
with `use_cpu`, so the launch leaves `ACCELERATE_USE_CPU` out; DeepSpeed then JIT-compiles its shared-memory all-reduce
op once (3 to 10 minutes; `TORCH_EXTENSIONS_DIR` says where it is kept; a stale `lock` file there makes it wait forever).
What ran here and the differences measured are in the scaling chapter, "Sharded engines: what ran here".
"""

import importlib.util

import pytest
import torch

from test_fsdp import _assert_same, _saved, setup_dir  # noqa: F401 (setup_dir: the fixture)
from test_fsdp import _run as _launch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="DeepSpeed is not installed (not a dependency of the project; `pip "
    "install deepspeed` to run these)",
)


def _zero(stage):
    """The environment `accelerate launch` makes of configs/deepspeed_zero{stage}.yaml in float32, less `use_cpu`
    (it drops DeepSpeed)."""
    env = {
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE": str(stage),
        "ACCELERATE_GRADIENT_CLIPPING": "1.0",
        "ACCELERATE_MIXED_PRECISION": "no",
    }
    if stage == 3:
        env |= {
            "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
            "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true",
        }
    return env


def _run(setup_dir, out, algo, processes, accumulation, stage=None):
    """tests/test_fsdp.py's `_run`: `stage` None is the plain run (`use_cpu`), else DeepSpeed ZeRO-`stage` under
    torchrun."""
    return _launch(setup_dir, out, algo, processes, accumulation, engine=_zero(stage) if stage else None)


# Measured here (deepspeed 0.19.8, CPU accelerator, gloo): the weights of 2 ZeRO processes end within these of
# 1 plain process
# (SFT 8.8e-7, GRPO 2.0e-6; the scaling chapter has the table); tests/test_fsdp.py's tolerances
EPS = {"sft": 1e-6, "rm": 1e-5, "dpo": 1e-5, "ppo": 1e-5, "ppo_critic": 1e-5, "rloo": 1e-5, "grpo": 1e-5}
_ONE = {}


def _one(setup_dir, tmp_path_factory, algo):
    "The plain 1-process run with 2 micro-batches a step, made once per trainer for both stages."
    if algo not in _ONE:
        _ONE[algo] = _run(
            setup_dir, tmp_path_factory.mktemp(f"one-{algo}"), algo, processes=1, accumulation=2
        )
    return _ONE[algo]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("algo", ["sft", "rm", "dpo", "ppo", "ppo_critic", "rloo", "grpo"])
def test_zero_two_processes_equal_one(algo, stage, setup_dir, tmp_path, tmp_path_factory):
    """ZeRO over 2 CPU processes × 1 micro-batch = 1 plain process × 2 micro-batches; a ZeRO checkpoint (one
    optimizer shard a rank)."""
    # ZeRO-3 on-policy: sampling runs under the gathering, and the rollout's policy pass is not kept for the
    # update (`first_pass`)
    two = _run(setup_dir, tmp_path / "two", algo, processes=2, accumulation=1, stage=stage)
    shards = {p.name for p in (tmp_path / "two" / "checkpoint-2" / "pytorch_model").iterdir()}
    assert {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= shards, shards
    # 2 processes × 4 rows a step: both counted
    assert [row["episode"] for row in two[1]][:2] == [8, 16]
    one = _one(setup_dir, tmp_path_factory, algo)
    # the pairwise loss is blind to ln_f's bias (it shifts both scores by w·b) and to the keys' biases
    # (softmax
    if algo == "rm":
        # is blind to a shift): their gradients are float noise (~1e-9), which Adam scales up to steps
        # ~lr·noise/(noise+ε); ln_f.bias
        # ended 2.1e-5 (ZeRO-2) apart while every logged loss, margin and gradient norm agreed to 1e-7
        # relative
        one, two = [({k: v for k, v in w.items() if k != "transformer.ln_f.bias"}, h) for w, h in (one, two)]
    _assert_same(one, two, f"{algo}: 1 process x 2 micro-batches vs ZeRO-{stage} over 2 processes", EPS[algo])
    # the chapter's table (-s)
    print(
        f"{algo} ZeRO-{stage}: weights within "
        f"{max((one[0][k] - two[0][k]).abs().max().item() for k in one[0]):.1e}"
    )
    start = _saved(setup_dir)
    moved = "lm_head.weight" if algo == "sft" else "transformer.h.0.mlp.c_fc.weight"
    # training moved the weights
    assert not torch.equal(two[0][moved], start[moved])
