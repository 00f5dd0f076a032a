"""The arithmetic floor of one PPO step with a separate critic, beside what TRL 1.12 and we take for it.

PPO with a separate critic trunk (`bench/real_size.py --algos ppo_separate`) cannot be faster than the matrix
multiplies its equations need, whoever writes it. This script times each of those multiplies alone (`torch.mm` /
`torch.bmm` at its real shape, float32, this machine's threads), counts how many of each the step needs, and adds
the memory-bound parts at the measured copy bandwidth:

  sampling   R decoding steps, each reading the policy's weights once: weight bytes / bandwidth
  scoring    the reward model's trunk over every row, forward
  reference  the reference's trunk over every row + its output layer over the response positions, forward
  policy     E x (the same forward, then its backward: dX and dW of every layer, layer 0's dX too: the embeddings train)
  critic     E x (its trunk forward, then backward)
  optimizer  E x fused AdamW over both trained models (read p, g, m, v; write p, m, v; zero g: 32 bytes a parameter)

Each multiply's time is its best of `--reps`. Everything else a step does (layer norms, GELU, softmax and log-softmax, the value head, GAE, statistics, Python) is
left out, so the sum is a lower bound on any implementation of the same arithmetic in float32 here. pi_old needs no
pass of its own (TRL reads it from the sampler's logits; we from the first epoch's forward). The last line,
`ppo_separate best_possible_ratio=X`, divides TRL's measured step (from a real_size.py JSON, or `--trl_step_s`) by the
floor: no implementation of this arithmetic can be more than X times TRL's speed on this machine.

    OMP_NUM_THREADS=2 .venv/bin/python bench/ppo_separate_floor.py --from_json bench/results/2026-11-28_real_size_cpu_gpt2-small_freed_memory_kept/real_size_cpu_gpt2-small_1128c.json
"""
import argparse, json, os, statistics, time

import torch

GPT2_SMALL = dict(layers=12, hidden=768, heads=12, mlp=3072)


def timed_mm(a_shape, b_shape, reps):
    "The fastest of `reps` multiplies of a random `a_shape` by `b_shape` (batched where 3-d) into one output, after a warm-up: a floor takes the best."
    a, b = torch.randn(*a_shape), torch.randn(*b_shape)
    f = torch.bmm if len(a_shape) == 3 else torch.mm
    out = f(a, b)
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); f(a, b, out=out); ts.append(time.perf_counter() - t)
    return min(ts)


def linear(rows, fan_in, fan_out, reps, backward):
    "A linear layer over `rows` inputs: the forward multiply, and with `backward` its dX and dW."
    s = timed_mm((rows, fan_in), (fan_in, fan_out), reps)
    if backward: s += timed_mm((rows, fan_out), (fan_out, fan_in), reps) + timed_mm((fan_in, rows), (rows, fan_out), reps)
    return s


def trunk(B, S, d, heads, mlp, layers, reps, backward):
    "A GPT-2 trunk over B rows of S tokens: four projections and two attention products a layer (backward: 2x each)."
    T, hd = B * S, d // heads
    proj = sum(linear(T, i, o, reps, backward) for i, o in ((d, 3 * d), (d, d), (d, mlp), (mlp, d)))
    qk, pv = timed_mm((B * heads, S, hd), (B * heads, hd, S), reps), timed_mm((B * heads, S, S), (B * heads, S, hd), reps)
    return layers * (proj + (qk + pv) * (3 if backward else 1))


def bandwidth():
    src = torch.ones(2**28, dtype=torch.uint8); dst = torch.empty_like(src)
    ts = []
    for _ in range(13):
        t = time.perf_counter(); dst.copy_(src); ts.append(time.perf_counter() - t)
    return 2 * src.numel() / statistics.median(ts[3:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=10, help="prompt tokens per row (the bench's prompts are ~10)")
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--trl_step_s", type=float, help="TRL's measured step (s)")
    p.add_argument("--ours_step_s", type=float, help="our measured step (s)")
    p.add_argument("--from_json", help="a real_size.py JSON: both steps from its ppo_separate summary")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    if a.json: os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    if a.from_json:
        s = json.load(open(a.from_json))["summary"]["ppo_separate"]
        a.trl_step_s = a.trl_step_s or s["trl"]["phases_s"]["total"]
        a.ours_step_s = a.ours_step_s or s["ours"]["phases_s"]["total"]
    g, B, S, R, E = GPT2_SMALL, a.batch, a.prompt + a.response, a.response, a.epochs
    d = g["hidden"]
    fwd = trunk(B, S, d, g["heads"], g["mlp"], g["layers"], a.reps, backward=False)
    fwd_bwd = trunk(B, S, d, g["heads"], g["mlp"], g["layers"], a.reps, backward=True)
    head, head_fb = linear(B * R, d, a.vocab, a.reps, False), linear(B * R, d, a.vocab, a.reps, True)
    n_policy = g["layers"] * (4 * d * d + 2 * d * g["mlp"]) + a.vocab * d + 1024 * d   # weights only; norms and biases are < 0.1 %
    bw = bandwidth()
    parts = {"sampling (weights read once a token)": R * 4 * n_policy / bw,
             "scoring (trunk forward)": fwd,
             "reference (trunk + head forward)": fwd + head,
             "policy fwd+bwd x epochs": E * (fwd_bwd + head_fb),
             "critic fwd+bwd x epochs": E * fwd_bwd,
             "optimizer x epochs (bandwidth)": E * 2 * n_policy * 32 / bw}
    total = sum(parts.values())
    flop = 2 * B * S * g["layers"] * (4 * d * d + 2 * d * g["mlp"]) * (2 + 3 * E + 3 * E) + 2 * B * R * d * a.vocab * (1 + 3 * E)
    print(f"PPO separate floor: GPT-2-small, vocab {a.vocab}, {B} rows x ({a.prompt} + {R}) tokens, {E} epochs, float32, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, copy bandwidth {bw / 1e9:.1f} GB/s")
    for k, v in parts.items(): print(f"  {k:<38}{v:8.3f} s")
    print(f"  {'floor':<38}{total:8.3f} s   ({flop / 1e9:.0f} GFLOP of projections and output layer, "
          f"{flop / 1e9 / (total - parts['sampling (weights read once a token)'] - parts['optimizer x epochs (bandwidth)']):.0f} GFLOP/s in the multiplies)")
    out = {"parts_s": parts, "floor_s": total, "bandwidth_bytes_per_s": bw, "gflop": flop / 1e9, "args": vars(a),
           "torch": torch.__version__, "threads": torch.get_num_threads()}
    if a.ours_step_s:
        print(f"ours step {a.ours_step_s:.2f} s = {a.ours_step_s / total:.2f}x the floor"); out["ours_over_floor"] = a.ours_step_s / total
    if a.trl_step_s:
        print(f"TRL step {a.trl_step_s:.2f} s = {a.trl_step_s / total:.2f}x the floor")
        print(f"ppo_separate best_possible_ratio={a.trl_step_s / total:.2f}")
        out["best_possible_ratio"] = a.trl_step_s / total
    if a.json: json.dump(out, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
