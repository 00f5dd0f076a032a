"""`decode` (the library's own sampling loop) against 🤗 `generate` (through `generate_responses(own_decoder=False)`), per
new token, on the CPU, and both against a floor: the time to read every weight once from memory (weight bytes ÷ the
bandwidth of a large copy measured here), which a decoding step cannot beat when its matrix multiplies are memory-bound.

Shapes (random weights from a config, seed 0): `tiny` = the benches' 2-layer, 64-wide GPT-2 (vocabulary 512), `llama`
= a 2-layer, 64-wide Llama with grouped-query attention (4 query heads, 2 key heads), `gpt2-small` = GPT-2 with 12 layers,
768 wide, a 32,000-token vocabulary, `0.5b` = Qwen2-0.5B's shape (24 layers, 896 wide, 14 heads / 2 KV heads, MLP 4864,
151,936 tokens; for a GPU). Prompts: `--batch` rows of random ids, 40 wide, the first half of the rows
left-padded by 8. No row stops (the stop id is never drawn), so both sides run `--tokens` steps. Runs alternate our loop
and 🤗's, `--reps` times each, in one process; each prints milliseconds per new token (the prefill included, divided
by the number of new tokens). Both sides sample with the library's defaults otherwise: fused GELU, packed linear layers
where the layers are wide enough (`packed_linears`).

On a GPU (`--device cuda`, weights in `--dtype`, bf16 by default there) a third side runs: `decode` with each step
replayed from a CUDA graph (`graphs=True`, its default there), beside the plain loop (`graphs=False`) and 🤗
`generate` with a static cache (which 🤗 compiles, CUDA graphs included); the floor's bandwidth is a large
device-to-device copy's, counting bytes read and written. `--compiled` adds `decode(compile=True)`: the graphed step
through torch.compile (inductor). The warm-up calls use `--tokens` new tokens as the timed ones do, so the cache
length, and with it 🤗's and our compiled step, is the same (a warm-up of other lengths made 🤗 compile in the timed
calls: 136 ms a token on 2026-11-26).

    OMP_NUM_THREADS=1 .venv/bin/python bench/decode_speed.py --shapes tiny llama --batch 16 --tokens 32 --reps 5
    OMP_NUM_THREADS=2 .venv/bin/python bench/decode_speed.py --shapes gpt2-small --batch 8 --tokens 64 --reps 3
    python3 bench/decode_speed.py --device cuda --shapes gpt2-small 0.5b --batch 8 --tokens 256 --reps 3
"""
import argparse, statistics, time, warnings

import torch
import transformers as T


def build(shape):
    torch.manual_seed(0)
    if shape == "tiny": return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256))
    if shape == "llama":
        return T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                intermediate_size=128, vocab_size=512))
    if shape == "0.5b":
        return T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                                                intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True))
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=32000))


def bandwidth(device="cpu", mb=512, reps=5):
    "Bytes per second of a large tensor copy (it reads and writes each byte once), the best of `reps`."
    x = torch.empty(mb * 2**20 // 4, device=device); y = torch.empty_like(x)
    best = min(_time(lambda: y.copy_(x)) for _ in range(reps))
    return 2 * x.numel() * 4 / best


def _time(fn):
    if torch.cuda.is_available(): torch.cuda.synchronize()
    t = time.perf_counter(); fn()
    if torch.cuda.is_available(): torch.cuda.synchronize()
    return time.perf_counter() - t


def draw_costs(a, vocab, dtype):
    "One step's draw alone, eager, at (--batch, vocab): the library's inverse CDF (a float64 cumsum of each row), an exponential race"
    " (argmax p/E, E ~ Exp(1): the same distribution, V random numbers a row), and the inverse CDF in two levels (block sums, then one block)."
    from instruct_goose.decoding import _draw
    torch.manual_seed(0)
    p = (torch.randn(a.batch, vocab, device=a.device) * 3).softmax(-1)
    def race(p): return (p / torch.empty_like(p).exponential_()).argmax(-1)
    def two_level(p, C=512):
        B, V = p.shape; n = -(-V // C)
        blocks = torch.nn.functional.pad(p.double(), (0, n * C - V)).view(B, n, C)
        ends = blocks.sum(-1).cumsum(-1)
        u = torch.rand(B, 1, dtype=ends.dtype, device=p.device) * ends[:, -1:]
        b = torch.searchsorted(ends, u, right=True).clamp(max=n - 1)
        before = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), 0.0)
        inner = blocks.gather(1, b[:, :, None].expand(-1, -1, C)).squeeze(1).cumsum(-1)
        return (b * C + torch.searchsorted(inner, u - before, right=True).clamp(max=C - 1)).squeeze(1)
    out = {}
    for name, f in (("inverse CDF", _draw), ("exponential race", race), ("two-level CDF", two_level)):
        f(p); out[name] = statistics.median(_time(lambda: f(p)) for _ in range(20)) * 1e3
    print(f"  draw alone, {a.batch} x {vocab}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in out.items()), flush=True)


def profile_sides(a, shape, sides, model, q, m, never):
    "One call of each side under `torch.profiler` (kernels replayed from CUDA graphs included, where CUPTI reports them): where a token's time goes."
    from pathlib import Path
    from torch.profiler import ProfilerActivity, profile
    cuda = a.device == "cuda"
    for s, run in sides.items():
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            wall = _time(lambda: run(model, q, m, a.tokens, never, 0))
        ev = prof.key_averages()
        busy = sum(e.self_device_time_total for e in ev) / 1e3 if cuda else float("nan")   # ms of kernels (overlapping streams counted twice)
        kernels = sum(e.count for e in ev if e.self_device_time_total > 0)
        head = (f"{shape} {s}: {wall / a.tokens * 1e3:.2f} ms a token under the profiler; kernels {busy / a.tokens:.3f} ms a token "
                f"({kernels / a.tokens:.0f} a token), so the GPU idles {100 * (1 - busy / (wall * 1e3)):.0f} % of the time\n")
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        name = s.replace(",", "").replace(" ", "_").replace("🤗", "hf")
        Path(a.profile, f"decode_{shape}_{name}.txt").write_text(head + ev.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                                                                 row_limit=40, max_name_column_width=80))
        print("  " + head, end="", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["tiny", "llama"], choices=["tiny", "llama", "gpt2-small", "0.5b"])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="the weights' dtype (default: fp32 on the CPU, bf16 on a GPU)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", metavar="DIR", help="after the timed reps, one call of each side under torch.profiler: its table (by self CUDA time on a GPU) to DIR")
    p.add_argument("--sync_every", type=int, default=1, help="sides more: `decode(sync_every=N)` (one host sync every N steps), with graphs and, with --compiled, compiled")
    p.add_argument("--draws", action="store_true", help="time the draw alone: our inverse CDF against an exponential race and a two-level CDF")
    p.add_argument("--no_hf", action="store_true", help="leave out 🤗 `generate` (its static cache compiles ~45 s at 0.5B on a GPU: device time)")
    p.add_argument("--compiled", action="store_true", help="a side more: `decode(compile=True)`, the step through torch.compile (inductor; its compilation in the warm-up)")
    p.add_argument("--fused", action="store_true", help="sides more: `decode(fuse=True)` (q, k, v and gate, up each in one multiply, stacked for the call), with graphs and, with --compiled, compiled; the other sides take decode's default (no stacking over weights already in their dtype)")
    p.add_argument("--autotune", action="store_true", help="a side more: `decode(compile=dict(mode=\"max-autotune-no-cudagraphs\"), fuse=True)`: inductor times its matrix-multiply kernels for these shapes and keeps the fastest (Triton templates with the elementwise work after them fused in, against cuBLAS); compiled a layer at a time, one tuning serves every layer")
    a = p.parse_args()
    warnings.filterwarnings("ignore"); T.utils.logging.set_verbosity_error()
    from instruct_goose import decode, generate_responses
    from instruct_goose.levers import fuse_activations
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype or ("bf16" if a.device == "cuda" else "fp32")]
    bw = bandwidth(a.device)
    print(f"torch {torch.__version__}, transformers {T.__version__}, {a.device} {torch.cuda.get_device_name() if a.device == 'cuda' else ''}"
          f"{torch.get_num_threads()} threads, {dtype}; copy bandwidth {bw / 1e9:.1f} GB/s")
    sides = {"ours": lambda *args: generate_responses(*args, own_decoder=True)}
    if a.compiled: sides["ours, compiled"] = lambda *args: decode(*args, compile=True)
    if a.sync_every > 1:
        sides[f"ours, sync {a.sync_every}"] = lambda *args: decode(*args, sync_every=a.sync_every)
        if a.compiled: sides[f"compiled, sync {a.sync_every}"] = lambda *args: decode(*args, compile=True, sync_every=a.sync_every)
    if a.fused:
        sides["ours, fused"] = lambda *args: decode(*args, fuse=True)
        if a.compiled: sides["compiled, fused"] = lambda *args: decode(*args, compile=True, fuse=True)
    if a.autotune: sides["compiled, fused, autotuned"] = lambda *args: decode(*args, compile=dict(mode="max-autotune-no-cudagraphs"), fuse=True)
    if a.device == "cuda": sides["ours, no graphs"] = lambda *args: decode(*args, graphs=False)
    if not a.no_hf: sides["🤗"] = lambda *args: generate_responses(*args, own_decoder=False)
    print(f"{'shape':<11}" + "".join(f"{s + ' ms/token':>22}" for s in sides) + f" {'🤗/ours':>8} {'floor ms':>9} {'ours/floor':>10}")
    for shape in a.shapes:
        model = fuse_activations(build(shape).eval()).to(a.device, dtype)
        vocab = model.config.vocab_size
        if a.draws: draw_costs(a, vocab, dtype)
        q = torch.randint(3, vocab, (a.batch, 40), device=a.device)
        m = torch.ones_like(q); m[: a.batch // 2, :8] = 0
        never = vocab                                           # a stop id never drawn: every row runs --tokens steps
        times = {s: [] for s in sides}
        for s, run in sides.items():   # warm-up at the timed length (🤗 and `compile`: their compilation); printed as it goes,
            t0 = time.perf_counter(); run(model, q, m, a.tokens, never, 0)   # so a run stopped at its limit keeps what it measured
            print(f"  {shape} warm-up {s}: {time.perf_counter() - t0:.1f} s", flush=True)
        for r in range(a.reps):
            for s in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                torch.manual_seed(r)
                times[s].append(_time(lambda: sides[s](model, q, m, a.tokens, never, 0)) / a.tokens * 1e3)
            print(f"  {shape} rep {r}: " + ", ".join(f"{s} {times[s][-1]:.2f}" for s in sides) + " ms/token", flush=True)
        if a.profile: profile_sides(a, shape, sides, model, q, m, never)
        med = {s: statistics.median(t) for s, t in times.items()}
        ours, theirs = med["ours"], med.get("🤗", float("nan"))
        floor = sum(t.numel() * t.element_size() for t in model.parameters()) / bw * 1e3    # tied weights once
        print(f"{shape:<11}" + "".join(f"{med[s]:>22.2f}" for s in sides) + f" {theirs / ours:>7.2f}x {floor:>9.3f} {ours / floor:>9.1f}x")
        for s in sides: print(f"  {s}: {med[s] / floor:.1f}x the floor")
        print(f"decode_{shape} ratio={theirs / ours:.2f}")

if __name__ == "__main__":
    main()
