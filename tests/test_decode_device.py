"""`decode` on a device that is not the CPU, without a GPU: every family's loop run on PyTorch's `meta` device.

No CUDA graph has been recorded on the machines this project is tested on, and the CPU runs hide two kinds of bug
that only a GPU would show: a tensor made on the CPU where the model's device was meant (`torch.arange(n)` without
`device=`), and, inside the step a graph records, what recording forbids: a host sync (`.item()`, `int(t)`, a
boolean mask's `nonzero`), a copy between host and device, or a CPU tensor read by a kernel (recording would bake
its value into the graph). On the `meta` device tensors have shapes and no values, so every operation runs where
the model is, and a mode below each operation checks the devices of its tensors. The loop's one host sync a step
(how many rows are still going) is answered from a schedule, so rows leave the batch and the batch shrinks through
the powers of two as it would on a GPU; `_Replay` runs its step eagerly off CUDA, and the check inside it is the
stricter one: no sync, no CPU tensor at all. A LoRA policy samples through `merged_adapters` the same way, and the
update's pass (log-probabilities in chunks from the last hidden state, entropies, values of a shared or separate
critic) runs forward and backward under the same check.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from instruct_goose import decoding, encode_prompts, task_tokenizer

from _families import BY_NAME, build_causal
from test_architectures import OWN_DECODING

META = torch.device("meta")


class OnTheDevice(TorchDispatchMode):
    """Every operation's tensors on one device; host syncs answered from `left` (rows still going) and counted.
    `strict`: inside a recorded step, no sync and no CPU tensor, scalar or not."""

    def __init__(self, left: list[int]):
        super().__init__()
        self.left, self.syncs, self.strict = list(left), 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name == "_local_scalar_dense":
            assert not self.strict, "a host sync inside the step a CUDA graph records"
            self.syncs += 1
            return self.left.pop(0)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tensors = inputs + [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # outside a graph a CPU scalar is a kernel argument
        on_cpu = [t for t in tensors if t.device.type == "cpu" and (self.strict or t.dim() > 0)]
        assert not (on_cpu and (self.strict or any(t.device.type == "meta" for t in inputs))), (
            f"{func}: a CPU tensor where the model's device was meant"
            + (" (inside the step a CUDA graph records)" if self.strict else "")
        )
        return out


def on_meta(name, tokenizer):
    """The family's tiny model, built on the meta device (weights without values), as decode finds it: eval mode,
    no gradients."""
    config = build_causal(BY_NAME[name], tokenizer).config
    with META:
        model = AutoModelForCausalLM.from_config(config)
    # 🤗's experts kernel (grouped_mm) multiplies bf16 only off the CPU
    if hasattr(config, "output_router_logits"):
        model.to(torch.bfloat16)
    return model.eval().requires_grad_(False)


def record_strictly(monkeypatch, mode: OnTheDevice, sizes: list):
    """Make decode's `_Replay` run its step (what a CUDA graph would record) under `mode`'s strict check, noting
    each one's batch size in `sizes`."""

    class Checked(decoding._Replay):
        def __init__(self, step, lm, cache, rows, device):
            super().__init__(step, lm, cache, rows, device)
            sizes.append(rows)
            run = self.run

            def strict():
                mode.strict = True
                try:
                    return run()
                finally:
                    mode.strict = False

            self.run = strict

    monkeypatch.setattr(decoding, "_Replay", Checked)


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "plain"])
@pytest.mark.parametrize("family", OWN_DECODING)
def test_decode_runs_on_the_models_device(family, graphs, tokenizer, monkeypatch):
    """decode's whole loop on `meta`: each operation on the model's device, one host sync a step but the last,
    and (graphs) a recorded step that neither syncs nor reads the host."""
    model = on_meta(family, tokenizer)
    q, m = encode_prompts(
        tokenizer, ["Review: The editing in this western", "Review: a", "Review: dull", "Review: I"]
    )
    # rows still going after each step but the last: 4 → 3 (batch 4) → 2 → 1
    left, steps = [4, 3, 3, 2, 1, 1], 7
    mode, sizes = OnTheDevice(left), []
    record_strictly(monkeypatch, mode, sizes)
    with mode:
        # graphs: the projections stacked too
        out = decoding.decode(
            model,
            q.to(META),
            m.to(META),
            steps,
            [0],
            tokenizer.pad_token_id,
            graphs=graphs,
            fuse=graphs,
            temperature=0.7,
            top_k=20,
            top_p=0.8,
            min_p=0.05,
            repetition_penalty=1.1,
        )
    assert out.device == META and out.shape == (4, steps)
    # one host sync a step (none after the last), none elsewhere
    assert mode.syncs == steps - 1 and not mode.left
    # powers of two: 3 rows run as 4
    assert sizes == ([4, 2, 1] if graphs else [])


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "plain"])
def test_sync_every_syncs_every_n_steps(graphs, tokenizer, monkeypatch):
    """`sync_every=3` over 7 steps: host syncs after steps 3 and 6 only, the batch shrinking there (graphs: 4 → 2
    at the first, 2 → 1 at the second)."""
    model = on_meta("qwen2", tokenizer)
    q, m = encode_prompts(
        tokenizer, ["Review: The editing in this western", "Review: a", "Review: dull", "Review: I"]
    )
    mode, sizes = OnTheDevice([2, 1]), []
    record_strictly(monkeypatch, mode, sizes)
    with mode:
        out = decoding.decode(
            model, q.to(META), m.to(META), 7, [0], tokenizer.pad_token_id, graphs=graphs, sync_every=3
        )
    assert out.shape == (4, 7) and mode.syncs == 2 and not mode.left
    assert sizes == ([4, 2, 1] if graphs else [])


def test_the_device_check_catches_a_cpu_tensor_and_a_sync(tokenizer, monkeypatch):
    """The check is not vacuous: a position range made on the CPU, or a sync inside the recorded step, fails it."""
    model = on_meta("llama", tokenizer)
    q, m = encode_prompts(tokenizer, ["Review: The editing", "Review: a"])
    update = decoding.LayerCache.update
    for bug, message in [
        (lambda k, start: start + torch.arange(k.shape[2]), "a CPU tensor"),
        (lambda k, start: start.item(), "a host sync"),
    ]:

        def buggy(self, k, v, start, bug=bug):
            if isinstance(start, torch.Tensor):
                bug(k, start)
            return update(self, k, v, start)

        monkeypatch.setattr(decoding.LayerCache, "update", buggy)
        mode = OnTheDevice([2, 2, 2])
        record_strictly(monkeypatch, mode, [])
        with pytest.raises(AssertionError, match=message), mode:
            decoding.decode(model, q.to(META), m.to(META), 3, [0], tokenizer.pad_token_id, graphs=True)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_lora_sampling_runs_on_the_models_device(family, tokenizer, monkeypatch):
    """A LoRA policy samples through `merged_adapters` (W + s·BA made once a call) and then decode, its merged q,
    k, v and gate, up stacked (`fuse`): the merge and the stacking too stay on the model's device."""
    from peft import LoraConfig, get_peft_model
    from instruct_goose.generation import merged_adapters

    model = get_peft_model(
        on_meta(family, tokenizer),
        LoraConfig(r=4, target_modules="all-linear", fan_in_fan_out=family == "gpt2"),
    ).requires_grad_(False)
    q, m = encode_prompts(tokenizer, ["Review: The editing", "Review: a"])
    mode, sizes = OnTheDevice([2, 2, 2]), []
    record_strictly(monkeypatch, mode, sizes)
    with torch.no_grad(), mode, merged_adapters(model):
        assert sum(1 for n, _ in model.named_modules() if n.endswith("merged_for_sampling")) > 0
        fused = []
        with decoding.drawing_with(
            lambda p: (
                fused.append(
                    sum(n.endswith(("fused_qkv", "fused_gate_up")) for n, _ in model.named_modules())
                )
                or p.argmax(-1)
            )
        ):
            out = decoding.decode(
                model, q.to(META), m.to(META), 3, [0], tokenizer.pad_token_id, graphs=True, fuse=True
            )
    assert out.device == META and sizes == [2]
    # Llama: each layer's q, k, v and gate, up
    assert fused == ([0] * 3 if family == "gpt2" else [2 * model.config.num_hidden_layers] * 3)


class AnswerAll(OnTheDevice):
    "`OnTheDevice` with every host sync answered True (the padding checks' yes), however many there are."

    def __init__(self):
        super().__init__([])
        self.left = type("Always", (), {"pop": lambda self, i: 1})()


@pytest.mark.parametrize("critic", ["shared", "separate"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3"])
def test_the_policy_pass_runs_on_the_models_device(family, critic, tokenizer):
    """The update's pass: log-probabilities from the last hidden state in chunks (`_Head`), entropies and values,
    forward and backward, on `meta`: every operation and every gradient on the model's device."""
    from instruct_goose import Agent

    value_model = None
    if critic == "separate":
        from transformers import AutoModelForSequenceClassification

        with META:
            value_model = AutoModelForSequenceClassification.from_config(on_meta(family, tokenizer).config)
    # a trainer moves it so
    agent = Agent(on_meta(family, tokenizer).requires_grad_(True), value_model=value_model).to(META)
    q, m = encode_prompts(tokenizer, ["Review: The editing in this western", "Review: a"])
    r, rm = torch.zeros(2, 5, dtype=torch.long, device=META), torch.ones(2, 5, dtype=torch.bool, device=META)
    with AnswerAll():
        stats = agent.response_stats(q.to(META), m.to(META), r, rm, temperature=0.7, entropy="grad")
        (stats.logprobs.sum() + stats.entropy.sum() + stats.values.sum()).backward()
    assert {p.grad.device for p in agent.parameters() if p.requires_grad} == {META}


def test_generate_responses_samples_through_decode_off_the_cpu(tokenizer, monkeypatch):
    """Off the CPU (a GPU; here `meta`, where decode runs its plain loop: graphs are for CUDA)
    `generate_responses` samples through `decode` by default; 🤗 `generate` only when asked or refused."""
    from instruct_goose import generate_responses, generation

    model = on_meta("qwen2", tokenizer)
    q, m = encode_prompts(tokenizer, ["Review: The editing in this western", "Review: a"])
    hf = []
    monkeypatch.setattr(
        generation,
        "_hf_generate",
        lambda *args: hf.append(args[0]) or torch.zeros(2, 3, dtype=torch.long, device=META),
    )
    with AnswerAll():
        r, rm = generate_responses(model, q.to(META), m.to(META), 3, [0], tokenizer.pad_token_id)
    assert r.device == META and r.shape == (2, 3) and hf == []
    with AnswerAll():
        generate_responses(model, q.to(META), m.to(META), 3, [0], tokenizer.pad_token_id, own_decoder=False)
    # TRL's "dynamic"
    with AnswerAll():
        generate_responses(model, q.to(META), m.to(META), 3, [0], tokenizer.pad_token_id, static_cache=False)
    assert hf == [model, model]
