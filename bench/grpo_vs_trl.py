"""instruct_goose's GRPOTrainer against TRL's GRPOTrainer (trl 1.16) on the same tiny GPT-2, prompts, reward and settings.

Same set-up as `rloo_vs_trl.py`: the tiny model + tokenizer are saved to a temp dir; each side loads them and trains
`--steps` steps in its own subprocess; runs alternate ours, TRL, ours, TRL, ... over `--reps` repetitions, repetition r
using seed r on both sides. The reward callable (the same function on both sides) records the wall time and the mean
score of each call; each side makes exactly one call per step (G completions for each of P prompts).

Matched settings: num_generations G=4, P=4 prompts per step (16 completions), max_completion_length 32, loss_type
"dapo", beta 0 (no reference model on either side), num_iterations 1, epsilon 0.2, scale_rewards "group", one
optimizer step per generation (TRL: steps_per_generation=1, gradient_accumulation_steps=1), lr linear decay, grad clip
1.0, temperature 1 with top-k/top-p off, dropout off, no checkpoints, logging every step.

Per side: completions/s over the `train()` call (median, min-max), peak RSS (ru_maxrss), reward over the first 5 and
the last `--last` steps (mean ± standard error over seeds), and the last line `grpo ratio=X.XX` (ours/TRL completions/s).

    OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_vs_trl.py --reps 4 --steps 60 --lr 1e-3
"""
import argparse, json, os, resource, statistics, subprocess, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rloo_vs_trl import library_fingerprint, mask_positions, quiet, se_of_difference  # noqa: E402

PROMPTS_PER_STEP, G, COMPLETION_LENGTH = 4, 4, 32
FIRST = 5
CALLS = []  # (perf_counter, mean score, number of completions) per reward call; filled in the child process


def length_reward(prompts, completions, **kwargs):
    "Completion length in characters / 100 (TRL passes extra keyword columns; ours passes none). Records each call."
    scores = [len(c) / 100 for c in completions]
    CALLS.append((time.perf_counter(), sum(scores) / len(scores), len(scores)))
    return scores


def make_ours(model_dir, out_dir, steps, lr, seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from instruct_goose import GRPOConfig, GRPOTrainer, load_task
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=PROMPTS_PER_STEP * G, gradient_accumulation_steps=1,
                      num_generations=G, max_completion_length=COMPLETION_LENGTH, loss_type="dapo", beta=0.0,
                      num_iterations=1, epsilon=0.2, scale_rewards="group", learning_rate=lr, seed=seed, max_steps=steps,
                      logging_steps=1, disable_tqdm=True, num_sample_generations=0, temperature=1.0)
    return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=length_reward, args=args,
                       train_dataset=load_task("prompts"), processing_class=AutoTokenizer.from_pretrained(model_dir))


def make_trl(model_dir, out_dir, steps, lr, seed, positions=False):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from instruct_goose import load_task
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=PROMPTS_PER_STEP * G, gradient_accumulation_steps=1,
                      steps_per_generation=1, num_generations=G, max_completion_length=COMPLETION_LENGTH, loss_type="dapo",
                      beta=0.0, num_iterations=1, epsilon=0.2, scale_rewards="group", learning_rate=lr, seed=seed,
                      max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                      temperature=1.0, top_p=1.0, top_k=0, disable_dropout=True, max_grad_norm=1.0,
                      lr_scheduler_type="linear", disable_tqdm=True, dataloader_num_workers=0,
                      **({} if os.environ.get("TRL_DEFAULTS") else dict(bf16=False, gradient_checkpointing=False)))   # TRL 1.x: both on by default, even on the CPU; ours: float32, no checkpointing
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return GRPOTrainer(model=mask_positions(model) if positions else model, reward_funcs=length_reward, args=args,
                       train_dataset=load_task("prompts"), processing_class=AutoTokenizer.from_pretrained(model_dir))


def child(side, model_dir, steps, lr, seed):
    "Train one side; print one JSON line with wall time, completions/s, per-step rewards and times, peak RSS."
    quiet()
    with tempfile.TemporaryDirectory() as out:
        tr = make_ours(model_dir, out, steps, lr, seed) if side == "ours" else \
            make_trl(model_dir, out, steps, lr, seed, positions=side == "trl_pos")
        CALLS.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        tr.train()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = PROMPTS_PER_STEP * G
    if len(CALLS) != steps or any(k != n for *_, k in CALLS):
        sys.exit(f"{side}: expected {steps} reward calls of {n}, got {[k for *_, k in CALLS]}")
    print(json.dumps({"side": side, "wall": wall, "cps": n * steps / wall, "cps_cpu": n * steps / cpu,
                      "rewards": [r for _, r, _ in CALLS], "times": [t - t0 for t, _, _ in CALLS],
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def mean_se(xs):
    return statistics.mean(xs), (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=4, help="repetitions; repetition r runs seed r on both sides")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--last", type=int, default=10, help="final reward = mean over the last LAST steps")
    p.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl", "trl_pos"],
                   help="run in this order each repetition; trl_pos: TRL scoring at mask positions (`mask_positions`)")
    p.add_argument("--save", help="write the per-run results to this JSON file")
    p.add_argument("--seed0", type=int, default=0, help="repetition r runs seed SEED0 + r on both sides")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.save: Path(a.save).parent.mkdir(parents=True, exist_ok=True)
    if a.child: return child(a.child[0], a.child[1], a.steps, a.lr, a.seed)

    quiet()
    import trl, transformers
    from instruct_goose import task_tokenizer, tiny_causal_lm
    res = {side: [] for side in a.sides}
    with tempfile.TemporaryDirectory() as model_dir:
        tok = task_tokenizer(); tok.padding_side = "left"
        tiny_causal_lm(tok, n_layer=2, hidden_size=64, seed=0).save_pretrained(model_dir); tok.save_pretrained(model_dir)
        before = library_fingerprint()
        for rep in range(a.reps):
            for side in a.sides:   # alternating: a slow patch of the machine hits both sides
                cmd = [sys.executable, __file__, "--child", side, model_dir, "--steps", str(a.steps), "--lr", str(a.lr),
                       "--seed", str(a.seed0 + rep)]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode: sys.exit(f"{side} failed:\n{out.stderr[-4000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1]); res[side].append(r)
                print(f"rep {rep} (seed {a.seed0 + rep}) {side:<7}: {r['cps']:.1f} completions/s ({r['cps_cpu']:.1f}/CPU-s), "
                      f"{r['wall']:.1f} s, load {os.getloadavg()[0]:.1f}, peak RSS {r['peak_rss_mib']:.0f} MiB, reward first "
                      f"{FIRST} {statistics.mean(r['rewards'][:FIRST]):.3f} last {a.last} "
                      f"{statistics.mean(r['rewards'][-a.last:]):.3f}", flush=True)
        after = library_fingerprint()
    if a.save: Path(a.save).write_text(json.dumps(res))

    print(f"\nTRL {trl.__version__}, transformers {transformers.__version__}; {a.steps} steps of {PROMPTS_PER_STEP} prompts x "
          f"G={G}, max_completion_length {COMPLETION_LENGTH}, loss_type dapo, beta 0, num_iterations 1, lr {a.lr} (linear), "
          f"seeds {a.seed0}..{a.seed0 + a.reps - 1}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}\nlibrary: {before}"
          + ("" if after == before else f"\nWARNING: the library changed during the run, now {after}"))
    print(f"{'side':<6}{'compl/s median':>16}{'(min-max)':>16}{'compl/CPU-s':>13}{'peak RSS MiB':>14}"
          f"{f'reward first {FIRST}':>18}{f'reward last {a.last}':>18}")
    summary = {}
    for side, rs in res.items():
        cps = [r["cps"] for r in rs]
        first, last = (mean_se([statistics.mean(r["rewards"][sl]) for r in rs]) for sl in (slice(0, FIRST), slice(-a.last, None)))
        summary[side] = dict(cps=statistics.median(cps), cpu=statistics.median(r["cps_cpu"] for r in rs),
                             rss=statistics.median(r["peak_rss_mib"] for r in rs),
                             fins=[statistics.mean(r["rewards"][-a.last:]) for r in rs])
        print(f"{side:<8}{summary[side]['cps']:>14.1f}{f'({min(cps):.1f}-{max(cps):.1f})':>16}{summary[side]['cpu']:>13.1f}"
              f"{summary[side]['rss']:>14.0f}{f'{first[0]:.3f} ± {first[1]:.3f}':>18}{f'{last[0]:.3f} ± {last[1]:.3f}':>18}")
    o, t = summary["ours"], summary["trl"]
    diff = statistics.mean(o["fins"]) - statistics.mean(t["fins"])
    print(f"ours/TRL: completions/s {o['cps'] / t['cps']:.2f}x (per CPU-second {o['cpu'] / t['cpu']:.2f}x), peak RSS "
          f"{o['rss'] / t['rss']:.2f}x, reward last {a.last} steps ours - TRL {diff:+.3f} ± {se_of_difference(o['fins'], t['fins']):.3f} (s.e.)")
    if "trl_pos" in summary:
        q = statistics.mean(summary["trl_pos"]["fins"])
        print(f"reward last {a.last} steps, ours - trl_pos {statistics.mean(o['fins']) - q:+.3f} ± "
              f"{se_of_difference(o['fins'], summary['trl_pos']['fins']):.3f}, trl_pos - TRL "
              f"{q - statistics.mean(t['fins']):+.3f} ± {se_of_difference(summary['trl_pos']['fins'], t['fins']):.3f} (s.e.)")
    print(f"grpo ratio={o['cps'] / t['cps']:.2f}")


if __name__ == "__main__":
    main()
