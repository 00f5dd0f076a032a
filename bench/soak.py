"""Soak test: many PPO steps on the built-in task's tiny model; watch memory and numbers.

Runs `--steps` PPO-ptx steps (adaptive KL, VADER gold score as the reward function, so no reward model is
trained first), records the process's resident memory (RSS) after every step, and prints RSS at step 100 and at
the end, the growth between them, whether any logged metric was ever non-finite, and the metric curves (every
`--every` steps). Saves the history and a plot to `--output_dir`.

    .venv/bin/python bench/soak.py --steps 2000            # about 10 minutes on 2 CPU cores
"""
import argparse, json, logging, math, os, resource, time
from pathlib import Path

import psutil
import torch
from transformers.utils import logging as hf_logging

from instruct_goose import Agent, RLHFConfig, RLHFTrainer, create_reference_model, gold_score, load_task, task_tokenizer, tiny_causal_lm
from instruct_goose.cli import plot_metrics


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--output_dir", default="runs/soak")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    torch.manual_seed(0)
    tokenizer = task_tokenizer()
    model = tiny_causal_lm(tokenizer, seed=0)
    batch = 8
    config = RLHFConfig(output_dir=args.output_dir, learning_rate=1e-4, per_device_train_batch_size=batch, num_ppo_epochs=2,
                        total_episodes=batch * args.steps, response_length=12, adaptive_kl=True, kl_target=4.0,
                        kl_horizon=2000, ptx_coef=0.1, missing_eos_penalty=1.0, num_sample_generations=0,
                        logging_steps=1, disable_tqdm=True, save_steps=0)
    trainer = RLHFTrainer(Agent(model), create_reference_model(model), config, processing_class=tokenizer, reward_funcs=gold_score,
                          train_dataset=load_task("prompts"), pretrain_dataset=load_task("pretrain"))
    process, rss = psutil.Process(os.getpid()), {}
    original = trainer.rollout_stats
    def rollout_stats(rollout):             # called once per step: a cheap place to sample memory
        rss[len(rss) + 1] = process.memory_info().rss
        return original(rollout)
    trainer.rollout_stats = rollout_stats
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    history = trainer.loop.state.history
    finite = all(math.isfinite(v) for row in history for v in row.values())
    at_100, at_end = rss[min(100, len(rss))], rss[len(rss)]
    growth = (at_end - at_100) / at_100
    print(f"steps {len(history)} in {seconds:.0f} s; RSS at step 100: {at_100 / 2**20:.1f} MiB, at step {len(rss)}: "
          f"{at_end / 2**20:.1f} MiB, growth {growth:+.2%}; peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.1f} MiB; "
          f"all metrics finite: {finite}")
    print(f"{'step':>6} {'scores':>8} {'kl':>7} {'kl_coef':>8} {'ptx':>7} {'RSS MiB':>8}")
    for row in history[args.every - 1::args.every]:
        print(f"{row['step']:>6} {row['objective/scores']:>8.3f} {row['objective/kl']:>7.2f} {row['objective/kl_coef']:>8.4f} "
              f"{row['loss/ptx_avg']:>7.3f} {rss[row['step']] / 2**20:>8.1f}")
    out = Path(args.output_dir)
    (out / "soak.json").write_text(json.dumps({"rss": rss, "history": history, "seconds": seconds}, indent=0))
    plot_metrics(history, out / "soak_curves.png", ["objective/scores", "objective/kl", "objective/kl_coef", "loss/ptx_avg"])


if __name__ == "__main__":
    main()
