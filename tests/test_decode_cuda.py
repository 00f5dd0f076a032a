"""`decode` on a GPU: each step replayed from a CUDA graph (`graphs=True`, its default there). Skipped without CUDA.

The CPU runs the same loop with `_Replay` calling the step eagerly (chapter 03a, tests/test_architectures.py); what
only a GPU can show is that recording and replaying change nothing: with a draw that depends on p alone, the graphs
give the plain loop's tokens, for weights in float32 and bfloat16 and for float32 weights under bf16 autocast (the
trainers' mixed precision, where the step reads the casts autocast cached during the prompt's pass); that the drawn
probabilities are the scored ones; and that a call of B rows records at most 1 + log2 B graphs. Without a GPU,
tests/test_decode_device.py runs every family's loop on the `meta` device and checks what recording forbids.

    python3 -m pytest tests/test_decode_cuda.py -q          # on a machine with a GPU
"""

import math
from contextlib import contextmanager

import pytest
import torch

from instruct_goose import Agent, encode_prompts, generate_responses, task_tokenizer, tiny_causal_lm
from instruct_goose import decoding
from instruct_goose.decoding import drawing_with

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPTS = [
    "Review: The editing in this western",
    "Review: a",
    "Review: The picture we saw on sunday at the old cinema",
    "Review: This second feature",
    "Review: I",
    "Review: what a film",
    "Review: dull",
    "Review: the goose",
]


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def by_argmax(p):
    "A draw that depends on p alone: the inverse CDF at (0.618 × the most likely token + 0.3) mod 1."
    cdf = p.double().cumsum(-1)
    return torch.searchsorted(
        cdf, (p.argmax(-1, keepdim=True).double() * 0.618034 + 0.3) % 1 * cdf[:, -1:], right=True
    ).squeeze(1)


@contextmanager
def counting_graphs(made: list):
    "Inside the block each `_Replay` decode makes (a graph on a GPU) notes its batch size in `made`."
    plain = decoding._Replay

    class Counted(plain):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(args[3])

    decoding._Replay = Counted
    try:
        yield made
    finally:
        decoding._Replay = plain


def run(model, q, m, stops, pad, graphs, autocast=False):
    rows, made = [], []
    with (
        counting_graphs(made),
        drawing_with(lambda p: rows.append(len(p)) or by_argmax(p)),
        torch.autocast("cuda", torch.bfloat16, enabled=autocast),
    ):
        ids = decoding.decode(model, q, m, 24, stops, pad, graphs=graphs)
    return ids, rows, made


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "autocast"])
def test_graphs_give_the_plain_loops_tokens(arch, precision, tokenizer):
    model = tiny_causal_lm(tokenizer, arch=arch, seed=0).eval().cuda()
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    q, m = (t.cuda() for t in encode_prompts(tokenizer, PROMPTS))
    stops = list(range(3, model.config.vocab_size, 8))
    plain, graphed = (
        run(model, q, m, stops, tokenizer.pad_token_id, g, precision == "autocast") for g in (False, True)
    )
    assert torch.equal(plain[0], graphed[0])
    assert plain[1][-1] < len(PROMPTS)  # rows left the batch
    assert all(n <= b < 2 * n for b, n in zip(graphed[1], plain[1]))
    assert len(plain[2]) == 0 and 1 <= len(graphed[2]) <= 1 + math.log2(len(PROMPTS))


@pytest.mark.parametrize("fuse", [None, True], ids=["default", "stacked"])
def test_graphs_draw_from_the_scored_distribution(fuse, tokenizer):
    """No row stops (the stop id is never drawn), so no filler: each drawn p is exp log π_old as
    `Agent.response_stats` scores it; with q, k, v and gate, up stacked (`fuse=True`) too."""
    agent = Agent(tiny_causal_lm(tokenizer, arch="llama", seed=0).eval().cuda())
    q, m = (t.cuda() for t in encode_prompts(tokenizer, PROMPTS))
    drawn, inverse_cdf = [], decoding._draw
    torch.manual_seed(0)
    with drawing_with(lambda p: drawn.append(p) or inverse_cdf(p)):
        if fuse:
            r = decoding.decode(
                agent.model,
                q,
                m,
                10,
                agent.model.config.vocab_size,
                tokenizer.pad_token_id,
                temperature=0.7,
                fuse=True,
            )
        else:
            r = generate_responses(
                agent.model,
                q,
                m,
                10,
                agent.model.config.vocab_size,
                tokenizer.pad_token_id,
                temperature=0.7,
                own_decoder=True,
            )[0]
    rm = torch.ones_like(r, dtype=torch.bool)
    sampled = torch.stack(drawn, 1).gather(-1, r[..., None]).squeeze(-1).log()
    scored = agent.response_stats(q, m, r, rm, temperature=0.7, entropy="skip").logprobs
    assert (sampled - scored).abs().max().item() <= 1e-4


def test_generate_responses_samples_through_graphs_by_default(tokenizer):
    """On a GPU `generate_responses` samples through `decode` with its steps replayed from graphs unless told
    otherwise."""
    model = tiny_causal_lm(tokenizer, arch="llama", seed=0).eval().cuda()
    q, m = (t.cuda() for t in encode_prompts(tokenizer, PROMPTS))
    with counting_graphs([]) as made:
        generate_responses(model, q, m, 6, model.config.vocab_size, tokenizer.pad_token_id)
        assert made == [len(PROMPTS)]  # no row stops: one graph, all rows
        generate_responses(model, q, m, 6, model.config.vocab_size, tokenizer.pad_token_id, own_decoder=False)
        assert made == [len(PROMPTS)]  # 🤗 generate: no graph of ours


def test_the_compiled_step_gives_the_graphs_tokens(tokenizer):
    """`compile=True`, float32: inductor's kernels recorded in the graph give the uncompiled graph's tokens (a
    draw of p alone), rows leaving: a later batch size of 2 or more runs the graph compiled with the batch a
    symbol (automatic dynamic shapes; on the CPU these rows pass through 8, 4, 1)."""
    model = tiny_causal_lm(tokenizer, arch="llama", seed=0).eval().cuda()
    q, m = (t.cuda() for t in encode_prompts(tokenizer, PROMPTS))
    stops = list(range(3, model.config.vocab_size, 8))
    made = []
    torch._dynamo.reset()
    with drawing_with(by_argmax):
        graphed = decoding.decode(model, q, m, 24, stops, tokenizer.pad_token_id)
        with counting_graphs(made):
            compiled = decoding.decode(model, q, m, 24, stops, tokenizer.pad_token_id, compile=True)
    assert torch.equal(graphed, compiled)
    assert any(1 < b < made[0] for b in made), made
    torch._dynamo.reset()


def autocast_draw_error(agent, q, m, tokenizer, **options):
    """Under bf16 autocast, `decode` with `options` (no row stops): the largest |log p drawn - log π_old scored|
    over the drawn tokens."""
    drawn, inverse_cdf = [], decoding._draw
    torch.manual_seed(0)
    with drawing_with(lambda p: drawn.append(p) or inverse_cdf(p)), torch.autocast("cuda", torch.bfloat16):
        r = decoding.decode(
            agent.model, q, m, 10, agent.model.config.vocab_size, tokenizer.pad_token_id, **options
        )
        scored = agent.response_stats(q, m, r, torch.ones_like(r, dtype=torch.bool), entropy="skip").logprobs
    return (torch.stack(drawn, 1).gather(-1, r[..., None]).squeeze(-1).log() - scored).abs().max().item()


def test_the_compiled_step_under_autocast_draws_the_scored_p(tokenizer):
    """`compile=True` under bf16 autocast (the trainers' mixed precision): each drawn p is the scored p to bf16's
    rounding, as the uncompiled graph's is."""
    agent = Agent(tiny_causal_lm(tokenizer, arch="llama", seed=0).eval().cuda())
    q, m = (t.cuda() for t in encode_prompts(tokenizer, PROMPTS))
    errors = [autocast_draw_error(agent, q, m, tokenizer, compile=compile) for compile in (False, True)]
    assert errors[1] <= max(2 * errors[0], 0.05), errors
    torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_under_autocast_the_cache_holds_autocasts_dtype(arch, tokenizer, monkeypatch):
    """Under bf16 autocast over float32 weights the cache holds bf16 keys and values: a rotary family's (Llama)
    leave the rotation in float32 and are rounded as written, what autocast's attention would round at every
    read (GPT-2's are bf16 already). Each drawn p is still the scored p, as closely as with the plain loop,
    graphs replaying."""
    made, plain = [], decoding.KVCache

    class Kept(plain):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(decoding, "KVCache", Kept)
    agent = Agent(tiny_causal_lm(tokenizer, arch=arch, seed=0).eval().cuda())
    q, m = (t.cuda() for t in encode_prompts(tokenizer, PROMPTS))
    errors = [autocast_draw_error(agent, q, m, tokenizer, graphs=graphs) for graphs in (False, True)]
    assert [layer.keys.dtype for cache in made for layer in cache.layers] == [torch.bfloat16] * (
        2 * len(made[0].layers)
    )
    assert errors[0] <= 1e-2 and errors[1] <= max(2 * errors[0], 1e-2), errors


@pytest.mark.parametrize("compile", [False, True], ids=["graphs", "compiled"])
def test_a_float32_head_under_autocast_draws_the_scored_p(compile, tokenizer):
    """GRPO's `cast_lm_head_to_fp32`: under bf16 autocast the replayed (and the compiled) step calls the output
    layer in float32, its weight float32, and each drawn p is the scored p at least as closely as with the
    bf16 layer."""
    from instruct_goose import Float32Linear, cast_lm_head_to_fp32

    agents = [Agent(tiny_causal_lm(tokenizer, arch="llama", seed=0).eval().cuda()) for _ in range(2)]
    cast_lm_head_to_fp32(agents[1].model)
    q, m = (t.cuda() for t in encode_prompts(tokenizer, PROMPTS))
    weights, forward = [], Float32Linear.forward
    Float32Linear.forward = lambda self, x: weights.append(self.weight.dtype) or forward(self, x)
    try:
        errors = [autocast_draw_error(agent, q, m, tokenizer, compile=compile) for agent in agents]
    finally:
        Float32Linear.forward = forward
    assert weights and set(weights) == {torch.float32}
    assert errors[1] <= max(errors[0], 1e-2), errors
    torch._dynamo.reset()
