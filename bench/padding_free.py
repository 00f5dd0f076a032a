"""`padding_free` and `shared_prefix` (on-policy trainers) against the padded pass: one update micro-batch's forward and
backward, and one rollout's no-grad reference pass, on rows whose completions stop at different lengths, as a trained
policy's do, or (`--generations G`) G completions of each prompt, as RLOO and GRPO sample them.

Rows: `--batch` prompts of `--prompt` tokens, left-padded to the longest (each 50–100 % of it), and completions whose
lengths are a seeded draw (the same rows for both sides), right-padded to the longest: by default the first stop of a
policy that stops with p = 4 / `--response` a token (geometric, mean ~ a quarter of `--response`, at least `--min_len`,
cut at `--response`), or (`--lengths uniform`) uniform on [`--min_len`, `--response`], or all `--response` (`--lengths full`);
with `--generations G` the `--batch` rows are `--batch` / G prompts, each G times. The policy is random, GPT-2-small's shape (vocabulary 32,000) or Qwen2-0.5B's (`--model-shape 0.5b`,
151,936; on a GPU in bf16 autocast). Each side (`--layouts`: padded, padding_free, shared_prefix) is `response_logprobs`
with that flag, the entropy for logging, then `backward` of Σ log π over the real tokens; and the same pass without
gradients (the reference's). Sides alternate, `--reps` times after a warm-up; medians. Printed: positions each side's
trunk and output layer read, ms, and `<layout> ratio=X` (padded ms ÷ its ms, forward + backward).

    OMP_NUM_THREADS=2 .venv/bin/python bench/padding_free.py
    OMP_NUM_THREADS=2 .venv/bin/python bench/padding_free.py --generations 4 --prompt 64 --response 64 --lengths full --layouts padded shared_prefix
    python3 bench/padding_free.py --device cuda --model-shape 0.5b --response 512 --batch 16
"""
import argparse, json, statistics, sys, time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-shape", "--model_shape", dest="model_shape", default="gpt2-small", choices=["gpt2-small", "0.5b", "tiny"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--min_len", type=int, default=16)
    p.add_argument("--lengths", default="geometric", choices=["geometric", "uniform", "full"],
                   help="completion lengths: geometric (a stop token with p = 4 / response a token, as a policy that stops; capped at --response), uniform on [min_len, response], or all --response")
    p.add_argument("--generations", type=int, default=1, help="G: the rows are batch / G prompts, each G times (RLOO's k, GRPO's G)")
    p.add_argument("--layouts", nargs="+", default=["padded", "padding_free"], choices=["padded", "padding_free", "shared_prefix"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args()
    if a.json: Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    import torch
    import real_size as rs
    from instruct_goose.agent import response_logprobs
    rs.quiet()
    vocab = rs.SHAPES[a.model_shape]["vocab"]
    special = type("Tok", (), dict(pad_token_id=0, eos_token_id=1, bos_token_id=1, __len__=lambda self: vocab))()
    cfg = rs.model_config(a.model_shape, special, a.prompt + a.response)
    from transformers import AutoModelForCausalLM
    with torch.device(a.device):
        torch.manual_seed(0); model = AutoModelForCausalLM.from_config(cfg).train()
    g = torch.Generator().manual_seed(0)
    if a.batch % a.generations or "padded" not in a.layouts: sys.exit("--batch must be a multiple of --generations, and --layouts must hold padded")
    q_len = torch.randint(a.prompt // 2, a.prompt + 1, (a.batch // a.generations,), generator=g).repeat_interleave(a.generations)
    if a.lengths == "uniform": r_len = torch.randint(a.min_len, a.response + 1, (a.batch,), generator=g)
    elif a.lengths == "full": r_len = torch.full((a.batch,), a.response)
    else:   # the first stop of a coin with p = 4 / response a token: mean ~ response / 4, a long tail cut at response
        u = torch.rand(a.batch, generator=g)
        r_len = (torch.log1p(-u) / torch.log1p(torch.tensor(-4 / a.response))).ceil().long().clamp(a.min_len, a.response)
    Q, R = int(q_len.max()), int(r_len.max())
    qm = (torch.arange(Q) >= Q - q_len[:, None]).long()
    rm = (torch.arange(R) < r_len[:, None]).long()
    q = torch.randint(2, vocab, (a.batch // a.generations, Q), generator=g).repeat_interleave(a.generations, 0) * qm
    r = torch.randint(2, vocab, (a.batch, R), generator=g) * rm
    q, qm, r, rm = (t.to(a.device) for t in (q, qm, r, rm))
    cuda = a.device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def sync():
        if cuda: torch.cuda.synchronize()

    flags = lambda layout: {layout: True} if layout != "padded" else {}

    def train_pass(layout):
        with autocast:
            lp, ent, _ = response_logprobs(model, q, qm, r, rm, 1.0, "no_grad", **flags(layout))
            (lp * rm).sum().backward()
        model.zero_grad(set_to_none=True)

    def ref_pass(layout):
        with torch.no_grad(), autocast: response_logprobs(model, q, qm, r, rm, 1.0, **flags(layout))

    times = {(kind, layout): [] for kind in ("train", "ref") for layout in a.layouts}
    for rep in range(a.reps + 1):
        for layout in (a.layouts if rep % 2 == 0 else a.layouts[::-1]):
            for kind, fn in (("train", train_pass), ("ref", ref_pass)):
                sync(); t = time.perf_counter(); fn(layout); sync()
                if rep: times[kind, layout].append(1e3 * (time.perf_counter() - t))
    from instruct_goose.agent import pack_layout
    mask = torch.cat([qm, rm], 1).cpu()
    bins = pack_layout(mask)[1].shape
    pos = {"padded trunk": a.batch * (Q + R), "packed trunk": bins[0] * bins[1], "shared trunk": a.batch // a.generations * Q + a.batch * R,
           "padded head": a.batch * R, "packed head": int(r_len.sum())}
    med = {f"{kind} {layout} ms": statistics.median(v) for (kind, layout), v in times.items()}
    print(f"{a.model_shape} on {a.device}: {a.batch} rows ({a.generations} a prompt), prompts {q_len.tolist()}, completions {r_len.tolist()}")
    print("positions:", pos, f"({bins[0]} bins of {bins[1]})")
    for k, v in med.items(): print(f"  {k}: {v:.1f}")
    ratios = {f"{kind} {layout}": med[f"{kind} padded ms"] / med[f"{kind} {layout} ms"] for kind in ("train", "ref") for layout in a.layouts if layout != "padded"}
    for layout in [l for l in a.layouts if l != "padded"]:
        print(f"{layout} ratio={ratios['train ' + layout]:.2f} (forward + backward); reference pass {ratios['ref ' + layout]:.2f}")
    if a.json:
        import subprocess
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
        Path(a.json).write_text(json.dumps({"args": vars(a), "commit": commit, "positions": pos, "ms": med, "runs": {f"{k[0]} {k[1]}": v for k, v in times.items()},
                                            "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
