"""instruct_goose's DPOTrainer against TRL's DPOTrainer on the same tiny GPT-2, preference pairs and settings.

The tiny model + tokenizer are saved to a temp dir; each side loads them and trains `--steps` steps of `--batch` pairs
in its own subprocess; runs alternate ours, TRL, ours, TRL, ... over `--reps` repetitions (repetition r: seed r on both
sides). Matched settings: sigmoid loss (`--loss_type` to change, both sides), β 0.1, `--padding_free` on both sides or neither
(TRL 1.16 accepts it, warns, and pads: its DPO refactor disabled it), no label smoothing, AdamW at `--lr` with a linear schedule and no warm-up,
grad clip 1.0, dropout off, float32 and no gradient checkpointing (TRL 1.x turns on bf16 and checkpointing by
default; both are switched off for it here unless `--trl_defaults`), the reference a frozen copy scored on the fly (no precomputing), max_length 256 cut from
the end (no prompt here is long enough to be cut), EOS appended to each completion, one process on the CPU.
The data order differs (each library's own seeded sampler), so the loss curves agree only within noise.

Per side: pairs/s over the `train()` call (median, min-max), peak RSS (ru_maxrss of the child), the seconds the
trainer's construction took (both sides tokenise the pairs there, once: TRL in its dataset `map`, ours in
`DPOTrainer.pairs`; so `train()` times the same work on both), the loss at step 1 (log 2 = 0.6931 on both: policy =
reference) and the mean loss per block of steps. The ratio of medians is printed with the per-repetition ratios (each
repetition's two runs ran back to back, so they saw about the same load). Ends with `dpo ratio=X.XX`
(ours/TRL pairs/s, medians).

    OMP_NUM_THREADS=1 .venv/bin/python bench/dpo_vs_trl.py --reps 4 --steps 40
"""
import argparse, importlib, json, logging, os, resource, statistics, subprocess, sys, tempfile, time, warnings
from pathlib import Path

BETA, MAX_LENGTH = 0.1, 256


def quiet():
    import datasets
    from transformers.utils import logging as hf_logging
    datasets.disable_progress_bars(); hf_logging.disable_progress_bar(); hf_logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR); warnings.filterwarnings("ignore")
    os.environ["TQDM_DISABLE"] = "1"


PREAMBLE = ("Read the review below with care, think about what it says of the film, and go on with it in the same voice; "
            "keep its tone and its tense, and say what you would check first before you finish it. ").split()


def pairs(n, prompt_words=0):
    "The task's first n pairs, each prompt after `prompt_words` words of instructions (both sides): long prompts, as a real set's."
    from instruct_goose import load_task
    data = load_task("preferences").select(range(n))
    if not prompt_words: return data
    preamble = " ".join((PREAMBLE * (prompt_words // len(PREAMBLE) + 1))[:prompt_words])
    return data.map(lambda row: {"prompt": f"{preamble} {row['prompt']}"})


def make_ours(model_dir, out_dir, a, seed, data):
    from instruct_goose.dpo import DPOConfig, DPOTrainer
    cfg = DPOConfig(output_dir=out_dir, per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=a.lr,
                    beta=BETA, loss_type=a.loss_type, max_length=MAX_LENGTH, max_prompt_length=None, warmup_steps=0,
                    padding_free=a.padding_free, shared_prefix=a.shared_prefix,
                    lr_scheduler_type="linear", max_grad_norm=1.0, seed=seed, logging_steps=1, disable_tqdm=True)
    trainer = DPOTrainer(model_dir, args=cfg, train_dataset=data)
    return trainer, lambda: [row["loss"] for row in trainer.loop.state.history]


def make_trl(model_dir, out_dir, a, seed, data):
    from trl import DPOConfig, DPOTrainer
    cfg = DPOConfig(output_dir=out_dir, per_device_train_batch_size=a.batch, max_steps=a.steps, learning_rate=a.lr,
                    beta=BETA, loss_type=a.loss_type.split(","), max_length=MAX_LENGTH, truncation_mode="keep_start",
                    padding_free=a.padding_free,
                    warmup_steps=0, lr_scheduler_type="linear", max_grad_norm=1.0, seed=seed, logging_steps=1,
                    report_to="none", save_strategy="no", use_cpu=True, disable_dropout=True, disable_tqdm=True,
                    dataloader_num_workers=0, precompute_ref_log_probs=False,
                    **({} if a.trl_defaults else dict(bf16=False, gradient_checkpointing=False)))  # TRL 1.x: both on by default
    trainer = DPOTrainer(model=model_dir, args=cfg, train_dataset=data)
    return trainer, lambda: [row["loss"] for row in trainer.state.log_history if "loss" in row]


def child(side, model_dir, a, seed):
    "Train one side; print one JSON line with wall time, pairs/s, the per-step losses and peak RSS."
    quiet()
    with tempfile.TemporaryDirectory() as out:
        data = pairs(a.pairs, a.prompt_words)
        importlib.import_module("instruct_goose.dpo" if side == "ours" else "trl.trainer.dpo_trainer")   # imports are not timed
        i0 = time.perf_counter()
        trainer, losses = (make_ours if side == "ours" else make_trl)(model_dir, out, a, seed, data)
        c0, t0 = time.process_time(), time.perf_counter()
        init = t0 - i0
        trainer.train()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        loss = losses()
    if len(loss) != a.steps: sys.exit(f"{side}: expected {a.steps} logged losses, got {len(loss)}")
    print(json.dumps({"side": side, "wall": wall, "init": init, "pps": a.batch * a.steps / wall, "pps_cpu": a.batch * a.steps / cpu,
                      "loss": loss, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def save_model(path):
    from instruct_goose import task_tokenizer, tiny_causal_lm
    tokenizer = task_tokenizer()
    tiny_causal_lm(tokenizer, n_layer=2, hidden_size=64, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)


def report(res, every):
    print(f"\n{'side':<6}{'pairs/s median':>16}{'(min-max)':>16}{'pairs/CPU-s':>13}{'peak RSS MiB':>14}{'init s':>8}"
          f"{'loss step 1':>13}")
    med = {}
    for side, rs in res.items():
        pps = [r["pps"] for r in rs]
        med[side] = (statistics.median(pps), statistics.median(r["peak_rss_mib"] for r in rs),
                     statistics.median(r["pps_cpu"] for r in rs))
        print(f"{side:<6}{med[side][0]:>16.1f}{f'({min(pps):.1f}-{max(pps):.1f})':>16}{med[side][2]:>13.1f}"
              f"{med[side][1]:>14.0f}{statistics.median(r['init'] for r in rs):>8.2f}"
              f"{statistics.mean(r['loss'][0] for r in rs):>13.4f}")
    n = len(res["ours"][0]["loss"])
    print(f"\nmean loss per {every}-step block, over repetitions (ours - TRL ± standard error of the difference)")
    blocks = {s: [[statistics.mean(r["loss"][i:i + every]) for r in rs] for i in range(0, n, every)] for s, rs in res.items()}
    for side, bs in blocks.items(): print(f"{side:<6}" + "".join(f"{statistics.mean(b):>8.4f}" for b in bs))
    se = lambda x, y: (statistics.variance(x) / len(x) + statistics.variance(y) / len(y)) ** 0.5 if len(x) > 1 else float("nan")
    print(f"{'diff':<6}" + "".join(f"{statistics.mean(o) - statistics.mean(t):>+8.4f}" for o, t in zip(*blocks.values())))
    print(f"{'± se':<6}" + "".join(f"{se(o, t):>8.4f}" for o, t in zip(*blocks.values())))
    paired = sorted(o["pps"] / t["pps"] for o, t in zip(res["ours"], res["trl"]))   # each repetition's two runs sat side by side
    ratio = med["ours"][0] / med["trl"][0]
    print(f"\nours/TRL: pairs/s {ratio:.2f}x (per CPU-second {med['ours'][2] / med['trl'][2]:.2f}x; per repetition, "
          f"median {statistics.median(paired):.2f}x, {paired[0]:.2f}-{paired[-1]:.2f}x), peak RSS {med['ours'][1] / med['trl'][1]:.2f}x")
    print(f"dpo ratio={ratio:.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=4, help="repetitions; repetition r runs seed r on both sides")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=16, help="pairs per step")
    p.add_argument("--pairs", type=int, default=800, help="training pairs (the task's first N)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate, both sides")
    p.add_argument("--every", type=int, default=10, help="block size of the loss curve table")
    p.add_argument("--trl_defaults", action="store_true", help="leave TRL's bf16 autocast and gradient checkpointing on")
    p.add_argument("--padding_free", action="store_true", help="padding_free=True on both sides (TRL 1.16 warns and pads anyway)")
    p.add_argument("--loss_type", default="sigmoid", help="loss type(s), comma-separated, both sides")
    p.add_argument("--shared_prefix", action="store_true", help="ours: each pair's prompt run once for its two completions (TRL has no such option)")
    p.add_argument("--prompt_words", type=int, default=0, help="words of instructions before each prompt, both sides (long prompts)")
    p.add_argument("--child", nargs=2, metavar=("SIDE", "MODEL_DIR"), help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child: return child(a.child[0], a.child[1], a, a.seed)
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir)
        res = {"ours": [], "trl": []}
        for rep in range(a.reps):
            for side in ("ours", "trl"):
                cmd = [sys.executable, __file__, "--child", side, model_dir, "--seed", str(rep)] + [
                    x for k in ("steps", "batch", "pairs", "lr", "loss_type", "prompt_words") for x in (f"--{k}", str(getattr(a, k)))] + (
                    ["--trl_defaults"] if a.trl_defaults else []) + (["--padding_free"] if a.padding_free else []) + (
                    ["--shared_prefix"] if a.shared_prefix else [])
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode: sys.exit(f"{side} failed:\n{out.stderr[-4000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1]); res[side].append(r)
                print(f"rep {rep} {side:<4}: {r['pps']:.1f} pairs/s, {r['wall']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                      f"loss first {r['loss'][0]:.4f} last {a.every} {statistics.mean(r['loss'][-a.every:]):.4f}", flush=True)
    report(res, a.every)


if __name__ == "__main__": main()
