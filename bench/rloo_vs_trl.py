"""instruct_goose's RLOOTrainer against TRL's RLOOTrainer on the same tiny GPT-2, prompts, reward and settings.

The tiny model + tokenizer are saved to a temp dir; each side loads them and trains `--steps` steps in its own
subprocess; runs alternate ours, TRL, ours, TRL, ... over `--reps` repetitions. Per side: completions/s over the
`train()` call (median, min-max), peak RSS (ru_maxrss), mean reward over the last `--last` steps; then ours/TRL.

    OMP_NUM_THREADS=1 .venv/bin/python bench/rloo_vs_trl.py --reps 3 --steps 20
"""
import argparse, json, logging, os, resource, statistics, subprocess, sys, tempfile, time, warnings
from pathlib import Path

HERE = Path(__file__).parent
PROMPTS_PER_STEP, K, RESPONSE_LENGTH, LR, KL_COEF, SEED, EPOCHS = 4, 4, 32, 1e-4, 0.05, 0, 1


def length_reward(prompts, completions, **kwargs):
    "Completion length in characters / 100 (TRL passes extra keyword columns; ours passes none)."
    return [len(c) / 100 for c in completions]


def quiet():
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar(); hf_logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR); warnings.filterwarnings("ignore")
    os.environ["TQDM_DISABLE"] = "1"


def run_ours(model_dir, out_dir, steps):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from instruct_goose import RLOOConfig, RLOOTrainer, create_reference_model, load_task
    tok = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = RLOOConfig(output_dir=out_dir, per_device_train_batch_size=PROMPTS_PER_STEP * K, rloo_k=K, num_ppo_epochs=EPOCHS,
                     num_mini_batches=1, response_length=RESPONSE_LENGTH, learning_rate=LR, kl_coef=KL_COEF, seed=SEED,
                     total_episodes=PROMPTS_PER_STEP * K * steps, logging_steps=1, disable_tqdm=True,
                     num_sample_generations=0, temperature=1.0)
    tr = RLOOTrainer(cfg, tok, policy, create_reference_model(policy), length_reward, load_task("prompts"))
    s = time.perf_counter(); tr.train(); wall = time.perf_counter() - s
    return wall, [h["objective/scores"] for h in tr.loop.state.history]


def run_trl(model_dir, out_dir, steps):
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer
    from instruct_goose import load_task
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = RLOOConfig(output_dir=out_dir, per_device_train_batch_size=PROMPTS_PER_STEP * K, num_generations=K,
                     steps_per_generation=1, num_iterations=EPOCHS, max_completion_length=RESPONSE_LENGTH,
                     learning_rate=LR, beta=KL_COEF, seed=SEED, max_steps=steps, logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=True, temperature=1.0, top_p=1.0, top_k=0, disable_dropout=True,
                     normalize_advantages=False, epsilon=0.2, max_grad_norm=1.0, lr_scheduler_type="linear",
                     disable_tqdm=True, dataloader_num_workers=0)
    tr = RLOOTrainer(model=model, reward_funcs=length_reward, args=cfg, train_dataset=load_task("prompts"),
                     processing_class=tok)
    s = time.perf_counter(); tr.train(); wall = time.perf_counter() - s
    rewards = [h["reward"] for h in tr.state.log_history if "reward" in h]
    return wall, rewards


def child(side, model_dir, steps):
    quiet()
    with tempfile.TemporaryDirectory() as out:
        wall, rewards = (run_ours if side == "ours" else run_trl)(model_dir, out, steps)
    print(json.dumps({"side": side, "wall": wall, "cps": PROMPTS_PER_STEP * K * steps / wall, "rewards": rewards,
                      "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--child", nargs=2)
    a = p.parse_args()
    if a.child: return child(a.child[0], a.child[1], a.steps)
    quiet()
    import trl, transformers
    from instruct_goose import task_tokenizer, tiny_causal_lm
    with tempfile.TemporaryDirectory() as model_dir:
        tok = task_tokenizer(); tok.padding_side = "left"
        tiny_causal_lm(tok, n_layer=2, hidden_size=64, seed=0).save_pretrained(model_dir); tok.save_pretrained(model_dir)
        res = {"ours": [], "trl": []}
        for rep in range(a.reps):
            for side in ("ours", "trl"):
                out = subprocess.run([sys.executable, __file__, "--child", side, model_dir, "--steps", str(a.steps)],
                                     capture_output=True, text=True)
                if out.returncode: sys.exit(f"{side} failed:\n{out.stderr[-4000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1]); res[side].append(r)
                print(f"rep {rep} {side}: {r['cps']:.1f} completions/s, {r['wall']:.1f} s, peak RSS {r['peak_rss_mib']:.0f} MiB",
                      flush=True)
    print(f"\nTRL {trl.__version__}, transformers {transformers.__version__}; {a.steps} steps of {PROMPTS_PER_STEP} prompts x "
          f"k={K}, response {RESPONSE_LENGTH} tokens, lr {LR}, KL coef {KL_COEF}, {EPOCHS} epoch, seed {SEED}, "
          f"torch threads via OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    summary = {}
    print(f"{'side':<6}{'compl/s median':>16}{'(min-max)':>16}{'peak RSS MiB':>14}{f'reward last {a.last}':>16}{'reward first 5':>16}")
    for side, rs in res.items():
        cps = [r["cps"] for r in rs]
        rew_last = statistics.mean(statistics.mean(r["rewards"][-a.last:]) for r in rs)
        rew_first = statistics.mean(statistics.mean(r["rewards"][:5]) for r in rs)
        rss = statistics.median(r["peak_rss_mib"] for r in rs)
        summary[side] = (statistics.median(cps), rss, rew_last)
        print(f"{side:<6}{statistics.median(cps):>16.1f}{f'({min(cps):.1f}-{max(cps):.1f})':>16}{rss:>14.0f}{rew_last:>16.3f}{rew_first:>16.3f}")
    o, t = summary["ours"], summary["trl"]
    print(f"ours/TRL: throughput {o[0] / t[0]:.2f}x, peak RSS {o[1] / t[1]:.2f}x, last-step reward {o[2] / t[2]:.2f}x")


if __name__ == "__main__":
    main()
