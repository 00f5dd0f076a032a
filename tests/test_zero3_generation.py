"""`TrainLoop.gathered_for_generation` under DeepSpeed ZeRO-3, against a stand-in for DeepSpeed (not installed here).

What is checked is our side of the contract, the recipe of TRL's `unwrap_model_for_generation`: the engine's
parameters are gathered once around all of sampling, the engine's fetch/release hooks are removed while the whole
weights are there and registered again afterwards (with the parameter coordinator's trace invalidated), and nothing of
this happens without ZeRO-3. Whether DeepSpeed itself behaves so was not run here (no GPU, no DeepSpeed)."""

import sys
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from unittest import mock

import pytest
from torch import nn

from instruct_goose import TrainLoop, TrainingConfig
from accelerate.state import AcceleratorState


class Hook:
    def __init__(self, log):
        self.log = log

    def remove(self):
        self.log.append("hook removed")


class Coordinator:
    def __init__(self, log):
        self.log, self.invalid = log, False

    def is_invalid_trace(self):
        return self.invalid

    def _invalidate_trace(self):
        self.invalid = True
        self.log.append("trace invalidated")


def fake_engine(log):
    module = nn.Linear(2, 2)
    for p in module.parameters():
        p.ds_active_sub_modules = {1, 2}
    offload = SimpleNamespace(
        module=module,
        forward_hooks=[Hook(log)],
        backward_hooks=[Hook(log)],
        param_coordinator=Coordinator(log),
        _register_deepspeed_module=lambda m: log.append(("hooks registered", m is module)),
    )
    return SimpleNamespace(
        parameters=module.parameters, optimizer=SimpleNamespace(parameter_offload=offload)
    ), offload


def fake_deepspeed(log):
    @contextmanager
    def gathered(params):
        log.append(("gathered", len(params)))
        yield
        log.append("partitioned")

    deepspeed = ModuleType("deepspeed")
    deepspeed.zero = SimpleNamespace(GatheredParameters=gathered)
    return deepspeed


@pytest.mark.parametrize("stage", [None, 2, 3])
def test_weights_are_gathered_once_under_zero3_only(stage, tmp_path):
    loop = TrainLoop(TrainingConfig(output_dir=str(tmp_path), disable_tqdm=True))
    log = []
    loop.prepared, offload = fake_engine(log)
    plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
    with (
        mock.patch.object(AcceleratorState, "deepspeed_plugin", new=property(lambda self: plugin)),
        mock.patch.dict(sys.modules, {"deepspeed": fake_deepspeed(log)}),
    ):
        with loop.gathered_for_generation():
            log.append("generate")
            inside = (
                [p.ds_active_sub_modules for p in offload.module.parameters()],
                offload.forward_hooks,
                offload.backward_hooks,
            )
    if stage != 3:
        assert log == ["generate"]
        return
    assert log == [
        ("gathered", 2),
        "hook removed",
        "hook removed",
        "generate",
        "trace invalidated",
        ("hooks registered", True),
        "partitioned",
    ]
    assert inside == ([set(), set()], [], [])
