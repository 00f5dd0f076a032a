"""How `decode` records its CUDA graphs (`_record`, `_Replay`), checked without a GPU.

`_record` records as `torch.cuda.graph` does (warm-up on a side stream, a device sync, capture on that stream) with
two changes: PyTorch's memory cache is emptied only when less than `_ROOM` is free (`torch.cuda.graph` empties it at
every recording, and a trainer records every step), and Python's garbage collector is off while the graph records
(a graph the collector frees during another recording is a CUDA error). The CUDA calls are replaced here by fakes
that log what is called, in order, and whether the collector was on at that moment. `_Replay` must hold no
reference to itself, so that the loop's dropped replays (and their graphs) go at once.
"""

import gc
import weakref

import pytest
import torch

from instruct_goose import decoding, task_tokenizer, tiny_causal_lm
from instruct_goose.decoding import KVCache, _Replay, _record, _step_for


class FakeCuda:
    """The parts of `torch.cuda` that `_record` calls, logging each call with whether Python's collector was on."""

    def __init__(self, free: int):
        self.free, self.log = free, []
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

            def wait_stream(self, other):
                fake.note(f"{self.name} waits {other.name}")

        class Graph:
            def capture_begin(self):
                fake.note("capture_begin")

            def capture_end(self):
                fake.note("capture_end")

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                fake.note(f"on {self.stream.name}")

            def __exit__(self, *exc):
                fake.note(f"off {self.stream.name}")

        current = Stream()
        current.name = "current"
        self.patches = dict(
            Stream=Stream,
            CUDAGraph=Graph,
            stream=StreamContext,
            current_stream=lambda device=None: current,
            synchronize=lambda device=None: fake.note("synchronize"),
            mem_get_info=lambda device=None: (fake.free, 80 << 30),
            empty_cache=lambda: fake.note("empty_cache"),
        )

    def note(self, what: str):
        self.log.append((what, gc.isenabled()))


@pytest.fixture
def fake_cuda(monkeypatch):
    def make(free: int) -> FakeCuda:
        fake = FakeCuda(free)
        for name, value in fake.patches.items():
            monkeypatch.setattr(torch.cuda, name, value)
        return fake

    return make


def test_record_keeps_the_cache_when_there_is_room(fake_cuda):
    fake = fake_cuda(free=decoding._ROOM)
    step = lambda: fake.note("step") or torch.ones(1)
    graph, out = _record(step, torch.device("cuda"))
    assert [w for w, _ in fake.log] == [
        "side waits current",
        "on side",
        "step",
        "off side",
        "current waits side",
        "synchronize",
        "on side",
        "capture_begin",
        "step",
        "capture_end",
        "off side",
    ]
    collector = dict(fake.log[6:])
    # off while it records
    assert not collector["capture_begin"] and not collector["step"] and not collector["capture_end"]
    # on for the warm-up, and after
    assert fake.log[2] == ("step", True) and gc.isenabled()
    assert torch.equal(out, torch.ones(1)) and graph is not None


def test_record_empties_the_cache_when_short_of_room(fake_cuda):
    fake = fake_cuda(free=decoding._ROOM - 1)
    _record(lambda: torch.ones(1), torch.device("cuda"))
    whats = [w for w, _ in fake.log]
    assert whats.count("empty_cache") == 1 and whats.index("synchronize") < whats.index(
        "empty_cache"
    ) < whats.index("capture_begin")


def test_record_ends_the_capture_and_restores_the_collector_when_the_step_fails(fake_cuda):
    fake, calls = fake_cuda(free=decoding._ROOM), []

    def step():
        calls.append(1)
        if len(calls) % 2 == 0:
            raise RuntimeError("inside the capture")  # the recording, not the warm-up
        return torch.ones(1)

    with pytest.raises(RuntimeError, match="inside the capture"):
        _record(step, torch.device("cuda"))
    assert [w for w, _ in fake.log][-3:] == ["capture_begin", "capture_end", "off side"] and gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError):
            _record(step, torch.device("cuda"))
        assert not gc.isenabled()  # a collector that was off stays off
    finally:
        gc.enable()


def test_a_dropped_replay_goes_at_once():
    """No reference cycle: with the collector off, the last reference dropped frees the replay (on a GPU: its
    graph and memory pool)."""
    model = tiny_causal_lm(task_tokenizer(), n_layer=1, hidden_size=16, seed=0).eval()
    cache = KVCache(1, 8)
    with torch.no_grad():
        _step_for(model)(
            model,
            torch.zeros(2, 3, dtype=torch.long),
            torch.arange(3).expand(2, 3),
            cache,
            0,
            torch.ones(2, 1, 3, 3, dtype=torch.bool).tril(),
        )
        gc.disable()
        try:
            replay = _Replay(_step_for(model), model, cache, 2, torch.device("cpu"))
            logits = replay(torch.tensor([5, 6]), torch.tensor([3, 3]), 3, torch.ones(2, 8, dtype=torch.bool))
            gone = weakref.ref(replay)
            del replay
            assert gone() is None and logits.shape == (2, model.config.vocab_size)
        finally:
            gc.enable()
