"""Time and peak RSS of one PPO step as the response length and the batch size grow; table + scaling.png.

Each configuration runs in its own subprocess (so peak RSS is that configuration's): 1 warm-up step, then the median
of `--reps` steps. Peak RSS = max of psutil's RSS sampled every 5 ms by a thread during the timed steps.

    OMP_NUM_THREADS=1 .venv/bin/python bench/scaling.py --reps 3

Writes scaling.json and scaling.png into bench/results/<today>_scaling/; `--replot` redraws the newest such folder's plot.
"""
import argparse, json, os, subprocess, sys, threading, time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _results import latest, results_dir


def child(batch, length, reps):
    import psutil, torch
    sys.path.insert(0, str(HERE))
    from _common import Timers, make_trainer, median, quiet
    quiet(); torch.manual_seed(0)
    trainer, agent, prompts = make_trainer(batch, length, epochs=4, max_positions=512)
    timers = Timers(trainer)
    timers.step(agent, prompts)                     # warm-up
    proc, peak, done = psutil.Process(), [0], threading.Event()
    def sample():
        while not done.is_set(): peak[0] = max(peak[0], proc.memory_info().rss); time.sleep(0.005)
    th = threading.Thread(target=sample, daemon=True); th.start()
    times, gens = [], []
    for _ in range(reps):
        r = timers.step(agent, prompts); times.append(r["total"]); gens.append(r["_gen_len"])
    done.set(); th.join()
    print(json.dumps({"batch": batch, "length": length, "s": median(times), "min": min(times), "max": max(times),
                      "peak_rss_mib": peak[0] / 2**20, "gen_len": min(gens)}))


def fit_exponent(xs, ys):
    "Slope of log(y) on log(x): 1 = linear."
    import math
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--child", nargs=2, type=int)
    p.add_argument("--replot", action="store_true", help="only redraw scaling.png from the newest bench/results/*_scaling/scaling.json")
    a = p.parse_args()
    if a.child: return child(*a.child, a.reps)
    if a.replot: src = latest("scaling", "scaling.json"); return plot(json.loads(src.read_text()), src.parent)
    runs = {"response length (batch 8)": [(8, n) for n in (16, 32, 64, 128, 256)],
            "batch size (response 32)": [(b, 32) for b in (4, 8, 16, 32, 64)]}
    results = {}
    for name, cfgs in runs.items():
        results[name] = []
        for b, n in cfgs:
            out = subprocess.run([sys.executable, __file__, "--child", str(b), str(n), "--reps", str(a.reps)],
                                 capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
            if out.returncode: sys.exit(out.stderr[-3000:])
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for name, rows in results.items():
        key = "length" if name.startswith("response") else "batch"
        print(f"\n{name}")
        print(f"{key:>8}{'step s':>9}{'(min-max)':>16}{'s/unit x1000':>14}{'peak RSS MiB':>14}{'gen tokens':>11}")
        for r in rows:
            print(f"{r[key]:>8}{r['s']:>9.3f}{'(%.3f-%.3f)' % (r['min'], r['max']):>16}{1000 * r['s'] / r[key]:>14.2f}"
                  f"{r['peak_rss_mib']:>14.1f}{r['gen_len']:>11}")
        xs, ys = [r[key] for r in rows], [r["s"] for r in rows]
        print(f"log-log slope of time vs {key}: {fit_exponent(xs, ys):.2f} overall, "
              f"{fit_exponent(xs[-3:], ys[-3:]):.2f} over the largest three (1.00 = linear)")
    out = results_dir("scaling")
    (out / "scaling.json").write_text(json.dumps(results, indent=1))
    plot(results, out)


def plot(results, out):
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, (name, rows) in enumerate(results.items()):
        key = "length" if name.startswith("response") else "batch"
        xs = [r[key] for r in rows]
        axes[0, col].plot(xs, [r["s"] for r in rows], "o-", label="measured")
        axes[0, col].plot(xs, [rows[-1]["s"] * x / xs[-1] for x in xs], "--", label="linear through last point")
        axes[0, col].set(xlabel=name, ylabel="seconds per PPO step", xscale="log", yscale="log"); axes[0, col].legend()
        axes[1, col].plot(xs, [r["peak_rss_mib"] for r in rows], "o-")
        axes[1, col].set(xlabel=name, ylabel="peak RSS (MiB)", xscale="log")
        for ax in axes[:, col]: ax.set_xticks(xs, [str(x) for x in xs]); ax.minorticks_off()
    fig.suptitle("instruct_goose PPO step scaling (tiny GPT-2, 2 layers, 64 hidden; CPU, OMP_NUM_THREADS=1)")
    fig.tight_layout(); fig.savefig(out / "scaling.png", dpi=100)
    print(f"\nsaved {out / 'scaling.png'}")


if __name__ == "__main__":
    main()
