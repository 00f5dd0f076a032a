"""instruct_goose's RLOOTrainer against TRL's RLOOTrainer on the same tiny GPT-2, prompts, reward and settings.

The tiny model + tokenizer are saved to a temp dir; each side loads them and trains `--steps` steps in its own
subprocess; runs alternate ours, TRL, ours, TRL, ... over `--reps` repetitions, repetition r using seed r on both
sides. The reward callable (the same function on both sides) records the wall time of each call and the mean score
of that call's completions (the raw score, before any KL term); each side makes exactly one call per step.

Per side: completions/s over the `train()` call (median, min-max), peak RSS (ru_maxrss), mean reward over the first 5
and last `--last` steps; then the time and steps until the `--window`-step moving average of the reward first
reaches a target R (by default R = start + f·(min final − start) for f in `--fracs`, see `targets`), and ours/TRL.
`--save FILE` keeps the raw per-step rewards and times; `--report FILE` prints the tables again from such a file.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rloo_vs_trl.py --reps 16 --steps 100 --lr 1e-3
"""
import argparse, hashlib, json, logging, os, resource, statistics, subprocess, sys, tempfile, time, warnings
from pathlib import Path

HERE = Path(__file__).parent
PROMPTS_PER_STEP, K, RESPONSE_LENGTH, KL_COEF, EPOCHS = 4, 4, 32, 0.05, 1
FIRST = 5  # "start" reward = mean over the first FIRST steps

CALLS = []  # (perf_counter, mean score, number of completions) per reward call; filled in the child process


def length_reward(prompts, completions, **kwargs):
    "Completion length in characters / 100 (TRL passes extra keyword columns; ours passes none). Records each call."
    scores = [len(c) / 100 for c in completions]
    CALLS.append((time.perf_counter(), sum(scores) / len(scores), len(scores)))
    return scores


def quiet():
    import datasets
    from transformers.utils import logging as hf_logging
    datasets.disable_progress_bars(); hf_logging.disable_progress_bar(); hf_logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR); warnings.filterwarnings("ignore")
    os.environ["TQDM_DISABLE"] = "1"


def make_ours(model_dir, out_dir, steps, lr, seed):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from instruct_goose import RLOOConfig, RLOOTrainer, create_reference_model, load_task
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = RLOOConfig(output_dir=out_dir, per_device_train_batch_size=PROMPTS_PER_STEP * K, num_generations=K, num_ppo_epochs=EPOCHS,
                     num_mini_batches=1, max_completion_length=RESPONSE_LENGTH, learning_rate=lr, beta=KL_COEF, seed=seed,
                     total_episodes=PROMPTS_PER_STEP * K * steps, logging_steps=1, disable_tqdm=True,
                     num_sample_generations=0, temperature=1.0)
    return RLOOTrainer(policy, create_reference_model(policy), cfg, processing_class=tok, reward_funcs=length_reward,
                       train_dataset=load_task("prompts"))


def mask_positions(model):
    """Give `model` position ids counted over real tokens (from the attention mask) in every call that passes none:
    TRL 1.16's scoring passes (log-probs for the loss, π_old, π_ref) pass none, so a left-padded row is scored at
    positions shifted by its padding, while 🤗 `generate` samples it at mask positions (trl#6800 for Online DPO; ours
    scores as it samples). The side "trl_pos" is TRL with this one change; generation passes its own ids."""
    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = (kwargs["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        return args, kwargs
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


def make_trl(model_dir, out_dir, steps, lr, seed, positions=False):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer
    from instruct_goose import load_task
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if positions: mask_positions(model)
    # Matching choices: one generation per optimizer step (steps_per_generation=1) and one update per rollout
    # (num_iterations=1) like ours; sampling at temperature 1 with top-k/top-p off like ours; dropout off; no advantage
    # normalisation (ours does none); clip ε 0.2, grad clip 1.0 and a linear schedule over all steps, as ours.
    cfg = RLOOConfig(output_dir=out_dir, per_device_train_batch_size=PROMPTS_PER_STEP * K, num_generations=K,
                     steps_per_generation=1, num_iterations=EPOCHS, max_completion_length=RESPONSE_LENGTH,
                     learning_rate=lr, beta=KL_COEF, seed=seed, max_steps=steps, logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=True, temperature=1.0, top_p=1.0, top_k=0, disable_dropout=True,
                     normalize_advantages=False, epsilon=0.2, max_grad_norm=1.0, lr_scheduler_type="linear",
                     disable_tqdm=True, dataloader_num_workers=0,
                     **({} if os.environ.get("TRL_DEFAULTS") else dict(bf16=False, gradient_checkpointing=False)))   # TRL 1.x: both on by default, even on the CPU; ours: float32, no checkpointing
    return RLOOTrainer(model=model, reward_funcs=length_reward, args=cfg, train_dataset=load_task("prompts"),
                       processing_class=tok)


def child(side, model_dir, steps, lr, seed):
    "Train one side; print one JSON line with wall time, completions/s, per-step rewards and times, peak RSS."
    quiet()
    with tempfile.TemporaryDirectory() as out:
        tr = make_ours(model_dir, out, steps, lr, seed) if side == "ours" else \
            make_trl(model_dir, out, steps, lr, seed, positions=side == "trl_pos")
        CALLS.clear()
        c0, t0 = time.process_time(), time.perf_counter()
        tr.train()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0  # CPU time: a check against a busy machine
    if len(CALLS) != steps or any(n != PROMPTS_PER_STEP * K for *_, n in CALLS):
        sys.exit(f"{side}: expected {steps} reward calls of {PROMPTS_PER_STEP * K}, got {[n for *_, n in CALLS]}")
    print(json.dumps({"side": side, "wall": wall, "cps": PROMPTS_PER_STEP * K * steps / wall,
                      "cps_cpu": PROMPTS_PER_STEP * K * steps / cpu,
                      "rewards": [r for _, r, _ in CALLS], "times": [t - t0 for t, _, _ in CALLS],
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def library_fingerprint():
    "git HEAD + a hash of instruct_goose/*.py: the library is edited while benchmarks run, so check it did not change."
    import instruct_goose
    pkg = Path(instruct_goose.__file__).parent
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(pkg.glob("*.py")))).hexdigest()[:10]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=pkg, capture_output=True, text=True).stdout.strip()
    return f"HEAD {head or '?'}, instruct_goose/*.py sha1 {digest}"


def moving_average(xs, w):
    "Trailing mean over w steps, defined from step w on (entry i is the mean of steps i-w+1..i)."
    return [statistics.mean(xs[i - w + 1:i + 1]) for i in range(w - 1, len(xs))]


def time_to_reach(run, target, w):
    "(seconds, steps) until the w-step moving average of the reward first reaches target; (inf, inf) if never."
    for i, m in enumerate(moving_average(run["rewards"], w)):
        if m >= target: return run["times"][i + w - 1], i + w
    return float("inf"), float("inf")


def mean_reward(runs, sl):
    "Mean over repetitions of the mean reward over the steps in slice sl."
    return statistics.mean(statistics.mean(r["rewards"][sl]) for r in runs)


def targets(res, fracs, last):
    """Target rewards R = start + f·(min final − start): start = mean reward of the first FIRST steps over both sides and
    all repetitions (both start from the same model); final = each side's mean over its last `last` steps."""
    start = mean_reward(res["ours"] + res["trl"], slice(0, FIRST))
    final = min(mean_reward(res[s], slice(-last, None)) for s in res)
    return start, final, [(f, start + f * (final - start)) for f in fracs]


def fmt(x, spec): return "never" if x == float("inf") else format(x, spec)


def run_all(a, model_dir):
    "Alternate ours, TRL for each repetition (seed = repetition) in fresh subprocesses."
    res = {side: [] for side in a.sides}
    for rep in range(a.reps):
        for side in a.sides:
            cmd = [sys.executable, __file__, "--child", side, model_dir, "--steps", str(a.steps), "--lr", str(a.lr),
                   "--seed", str(a.seed0 + rep)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode: sys.exit(f"{side} failed:\n{out.stderr[-4000:]}")
            r = json.loads(out.stdout.strip().splitlines()[-1]); res[side].append(r)
            print(f"rep {rep} (seed {a.seed0 + rep}) {side:<7}: {r['cps']:.1f} completions/s ({r['cps_cpu']:.1f}/CPU-s), "
                  f"{r['wall']:.1f} s, load {os.getloadavg()[0]:.1f}, peak RSS "
                  f"{r['peak_rss_mib']:.0f} MiB, reward first {FIRST} {statistics.mean(r['rewards'][:FIRST]):.3f} "
                  f"last {a.last} {statistics.mean(r['rewards'][-a.last:]):.3f}", flush=True)
    return res


def report_throughput(res, last):
    "Throughput, peak RSS and reward per side; the reward spread is over repetitions (seeds)."
    print(f"{'side':<6}{'compl/s median':>16}{'(min-max)':>16}{'compl/CPU-s':>13}{'peak RSS MiB':>14}"
          f"{f'reward first {FIRST}':>16}{f'reward last {last}':>16}{'(min-max over reps)':>22}")
    summary = {}
    for side, rs in res.items():
        cps, cps_cpu = [r["cps"] for r in rs], statistics.median(r["cps_cpu"] for r in rs)
        rss = statistics.median(r["peak_rss_mib"] for r in rs)
        fins = [statistics.mean(r["rewards"][-last:]) for r in rs]
        summary[side] = (statistics.median(cps), rss, statistics.mean(fins), fins, cps_cpu)
        print(f"{side:<8}{summary[side][0]:>14.1f}{f'({min(cps):.1f}-{max(cps):.1f})':>16}{cps_cpu:>13.1f}{rss:>14.0f}"
              f"{mean_reward(rs, slice(0, FIRST)):>16.3f}{statistics.mean(fins):>16.3f}"
              f"{f'({min(fins):.3f}-{max(fins):.3f})':>22}")
    o, t = summary["ours"], summary["trl"]
    print(f"ours/TRL: throughput {o[0] / t[0]:.2f}x (per CPU-second {o[4] / t[4]:.2f}x), peak RSS {o[1] / t[1]:.2f}x, "
          f"reward last {last} steps {o[2] / t[2]:.3f}x (ours - TRL {o[2] - t[2]:+.3f} ± {se_of_difference(o[3], t[3]):.3f})")
    if "trl_pos" in summary:
        q = summary["trl_pos"]
        print(f"reward last {last} steps, ours - trl_pos {o[2] - q[2]:+.3f} ± {se_of_difference(o[3], q[3]):.3f}, "
              f"trl_pos - TRL {q[2] - t[2]:+.3f} ± {se_of_difference(q[3], t[3]):.3f} (s.e.)")


def se_of_difference(xs, ys):
    "Standard error of mean(xs) − mean(ys) for independent runs (the same seed gives different samples on each side)."
    if min(len(xs), len(ys)) < 2: return float("nan")
    return (statistics.variance(xs) / len(xs) + statistics.variance(ys) / len(ys)) ** 0.5


def report_curve(res, every=10):
    "Mean reward over repetitions in blocks of `every` steps: the reward after the same number of steps."
    n = len(res["ours"][0]["rewards"])
    blocks = {s: [[statistics.mean(r["rewards"][i:i + every]) for r in rs] for i in range(0, n, every)] for s, rs in res.items()}
    print(f"\nmean reward per {every}-step block (steps 1-{every}, ...); ours - TRL ± standard error")
    for side, bs in blocks.items(): print(f"{side:<6}" + "".join(f"{statistics.mean(b):>8.3f}" for b in bs))
    pairs = list(zip(blocks["ours"], blocks["trl"]))
    print(f"{'diff':<6}" + "".join(f"{statistics.mean(o) - statistics.mean(t):>+8.3f}" for o, t in pairs))
    print(f"{'± se':<6}" + "".join(f"{se_of_difference(o, t):>8.3f}" for o, t in pairs))


def report_time_to_target(res, tgts, w):
    "Median seconds and steps to reach each target per side ('never': the median run did not reach it), TRL/ours."
    print(f"{'target R':<16}{'ours s':>9}{'TRL s':>9}{'TRL/ours':>10}{'ours steps':>12}{'TRL steps':>11}"
          f"{'steps ours-TRL, mean ± se':>28}")
    per_rep = []
    for label, target in tgts:
        hit = {s: [time_to_reach(r, target, w) for r in rs] for s, rs in res.items()}
        sec = {s: statistics.median(x[0] for x in h) for s, h in hit.items()}
        stp = {s: statistics.median(x[1] for x in h) for s, h in hit.items()}
        ratio = sec["trl"] / sec["ours"] if sec["ours"] < float("inf") else float("nan")  # inf: only ours reached R
        steps = [[x[1] for x in hit[s]] for s in ("ours", "trl")]
        reached = all(x < float("inf") for xs in steps for x in xs)
        d = f"{statistics.mean(steps[0]) - statistics.mean(steps[1]):+.1f} ± {se_of_difference(*steps):.1f}" if reached \
            else "a run never reached R"
        print(f"{f'{label} {target:.3f}':<16}{fmt(sec['ours'], '.1f'):>9}{fmt(sec['trl'], '.1f'):>9}{ratio:>10.2f}"
              f"{fmt(stp['ours'], 'g'):>12}{fmt(stp['trl'], 'g'):>11}{d:>28}")
        per_rep.append(f"  {label}: " + " ".join(fmt(x[0], ".1f") for x in hit["ours"]) + " | "
                       + " ".join(fmt(x[0], ".1f") for x in hit["trl"]))
    print("seconds per repetition, ours | TRL:\n" + "\n".join(per_rep))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=8, help="repetitions; repetition r runs seed r on both sides")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3, help="same on both sides; 1e-4 barely moves the reward in 30 steps")
    p.add_argument("--last", type=int, default=10, help="final reward = mean over the last LAST steps")
    p.add_argument("--window", type=int, default=5, help="moving-average window for time-to-target")
    p.add_argument("--fracs", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                   help="targets at these fractions of the way from the start reward to the smaller final reward")
    p.add_argument("--target", type=float, nargs="+", help="fixed target reward(s) R instead of --fracs")
    p.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl", "trl_pos"],
                   help="run in this order each repetition; trl_pos: TRL scoring at mask positions (`mask_positions`)")
    p.add_argument("--save", help="write the per-run results (per-step rewards and times) to this JSON file")
    p.add_argument("--report", help="only print the tables from a file written by --save")
    p.add_argument("--seed0", type=int, default=0, help="repetition r runs seed SEED0 + r on both sides")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # set per child: repetition r uses seed r
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.save: Path(a.save).parent.mkdir(parents=True, exist_ok=True)
    if a.child: return child(a.child[0], a.child[1], a.steps, a.lr, a.seed)
    if a.report: meta, res = (lambda d: (d["meta"], d["res"]))(json.loads(Path(a.report).read_text()))
    else: meta, res = measure(a)
    if a.save: Path(a.save).write_text(json.dumps({"meta": meta, "res": res}))
    report(meta, res, a)


def measure(a):
    "Save the tiny model once, run every repetition; returns (what was run, results per side)."
    quiet()
    import trl, transformers
    from instruct_goose import task_tokenizer, tiny_causal_lm
    with tempfile.TemporaryDirectory() as model_dir:
        tok = task_tokenizer(); tok.padding_side = "left"
        tiny_causal_lm(tok, n_layer=2, hidden_size=64, seed=0).save_pretrained(model_dir); tok.save_pretrained(model_dir)
        before = library_fingerprint()
        res = run_all(a, model_dir)
        after = library_fingerprint()
    meta = (f"TRL {trl.__version__}, transformers {transformers.__version__}; {a.steps} steps of {PROMPTS_PER_STEP} "
            f"prompts x k={K}, response {RESPONSE_LENGTH} tokens, lr {a.lr} (linear decay), KL coef {KL_COEF}, "
            f"{EPOCHS} epoch, seeds {a.seed0}..{a.seed0 + a.reps - 1}, torch threads via OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
            f"\nlibrary: {before}" + ("" if after == before else f"\nWARNING: the library changed during the run, now {after}"))
    return meta, res


def report(meta, res, a):
    print("\n" + meta)
    report_throughput(res, a.last)
    report_curve(res)
    if a.target: tgts = [("R", t) for t in a.target]
    else:
        start, final, fr = targets(res, a.fracs, a.last)
        print(f"\nTargets: R = start + f*(min final - start), start {start:.3f} = mean reward of the first {FIRST} steps "
              f"(both sides, all reps), min final {final:.3f} = the smaller side's mean over its last {a.last} steps")
        if final <= start: print("WARNING: the reward did not rise on one side; these targets say nothing")
        tgts = [(f"f={f:g}", t) for f, t in fr]
    print(f"Time to reach R = wall time (from the start of train()) of the reward call at the first step where the "
          f"{a.window}-step moving average of the mean score is >= R\n")
    report_time_to_target(res, tgts, a.window)

if __name__ == "__main__":
    main()
