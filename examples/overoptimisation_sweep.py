"""Reward over-optimisation under PPO, in the manner of Gao et al. (2022): proxy and gold score against √KL.

The setting is tutorial 19's (nbs/19_tutorial_overoptimisation.ipynb): an SFT model on the built-in task, three proxy
reward models trained on 128 length-biased labels, and the task's VADER scorer as the gold judge. Here PPO, not
best-of-n, pushes the policy against a reward, and every `--every` steps the policy is measured on 32 held-out prompts
(`evaluate_policy`, sampling seed 0): KL to the SFT model, proxy 0's score, the gold score, completion length.

Runs, each from the same SFT model with PPO seed 0:
  proxy, β=0           PPO against proxy 0 with no KL penalty
  proxy, β=0.1 / 0.3   the same with a KL penalty (`--kl_coefs`)
  ensemble, β=0        against the three proxies' mean − 1·std (Coste et al. 2023)
  debiased, β=0        against proxy 0 with its length component removed (`length_debiased`)

    python examples/overoptimisation_sweep.py --out nbs/overoptimisation_ppo.json     # ~12 min on 2 busy CPU cores

Seeds: SFT 0; proxies 0, 1, 2; the labeller's coin `random.Random(0)`; PPO 0; evaluation sampling 0.
"""
import argparse, copy, json, logging, math, platform, random, tempfile, time

import torch
from transformers.utils import logging as hf_logging

from instruct_goose import (Agent, RLHFConfig, RLHFTrainer, RewardConfig, RewardModel, RewardTrainer, SFTConfig, SFTTrainer,
                            gold_score, load_task, task_tokenizer, tiny_causal_lm)
from instruct_goose.onpolicy import evaluate_policy
from instruct_goose.reward_eval import RewardEnsemble, length_debiased


def length_loving_labels(n: int = 128, seed: int = 0):
    "The task's first `n` training pairs; where the chosen completion is the shorter, a fair coin swaps the labels."
    coin = random.Random(seed)
    def swap(row):
        if len(row["chosen"]) < len(row["rejected"]) and coin.random() < 0.5:
            return {**row, "chosen": row["rejected"], "rejected": row["chosen"]}
        return row
    return load_task("preferences").select(range(n)).map(swap, keep_in_memory=True)


def setup(work: str):
    "Tutorial 19's models: (tokenizer, SFT model, three proxies, the labels they were trained on)."
    hf_logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    tokenizer = task_tokenizer()
    sft_trainer = SFTTrainer(tiny_causal_lm(tokenizer, seed=0),
                     args=SFTConfig(output_dir=f"{work}/sft", learning_rate=3e-3, per_device_train_batch_size=32, max_steps=150,
                                    warmup_steps=20, disable_tqdm=True, seed=0),
                     train_dataset=load_task("sft"), processing_class=tokenizer)
    sft_trainer.train()
    sft = sft_trainer.model
    labels = length_loving_labels()
    def proxy(seed):
        args = RewardConfig(output_dir=f"{work}/rm{seed}", learning_rate=1e-3, per_device_train_batch_size=32, max_steps=90,
                            disable_tqdm=True, seed=seed, disable_dropout=False)   # dropout on, as the saved sweep was run
        trainer = RewardTrainer(RewardModel(copy.deepcopy(sft), tokenizer=tokenizer), args, labels.shuffle(seed=seed))
        trainer.train()
        return trainer.reward_model
    return tokenizer, sft, [proxy(seed) for seed in (0, 1, 2)], labels


# `sampler`: "decode", the library's own sampling loop (the default on the CPU), or "generate", 🤗 `generate` with its
# dynamic cache (TRL's `cache_implementation="dynamic"`), which the saved sweep (nbs/overoptimisation_ppo.json) used:
# the same distribution, other random numbers.
def measure(policy, sft, tokenizer, prompts: list, proxy, sampler: str = "decode") -> dict:
    "KL to the SFT model, proxy and gold score, completion length (tokens) of the policy on held-out prompts; the random state is left as it was."
    with torch.random.fork_rng():
        metrics, records = evaluate_policy(policy, sft, tokenizer, prompts, proxy, gold=gold_score, response_length=16, seed=0,
                                           sampling={"static_cache": False} if sampler == "generate" else None)
    lengths = [len(tokenizer(r["policy"], add_special_tokens=False)["input_ids"]) for r in records]
    return {"kl": metrics["eval/kl"], "sqrt_kl": math.sqrt(max(metrics["eval/kl"], 0.0)), "proxy": metrics["eval/reward"],
            "gold": metrics["eval/gold"], "length": sum(lengths) / len(lengths)}


class Curve:
    "A callback: `measure` the policy before training and every `every` optimizer steps."
    def __init__(self, every: int, measure_policy):
        self.every, self.measure_policy, self.points = every, measure_policy, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.points.append({"step": 0, **self.measure_policy(model)})

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every == 0: self.points.append({"step": state.global_step, **self.measure_policy(model)})


def ppo_curve(reward, sft, tokenizer, proxy, eval_prompts: list, kl_coef: float, steps: int, every: int, work: str,
              seed: int = 0, batch_size: int = 16, learning_rate: float = 1e-3, sampler: str = "decode") -> list[dict]:
    "Train PPO against `reward` for `steps` steps from the SFT model; the policy measured every `every` steps (`measure`)."
    curve = Curve(every, lambda policy: measure(policy, sft, tokenizer, eval_prompts, proxy, sampler))
    args = RLHFConfig(output_dir=work, kl_coef=kl_coef, learning_rate=learning_rate, lr_scheduler_type="constant",
                      cache_implementation="dynamic" if sampler == "generate" else None,
                      per_device_train_batch_size=batch_size, total_episodes=steps * batch_size, response_length=16,
                      num_sample_generations=0, disable_tqdm=True, seed=seed, logging_steps=every)
    trainer = RLHFTrainer(Agent(copy.deepcopy(sft)), args=args, processing_class=tokenizer, reward_funcs=reward,
                          train_dataset=load_task("prompts"), callbacks=[curve])
    trainer.train()
    return curve.points


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="nbs/overoptimisation_ppo.json")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--kl_coefs", default="0.1,0.3", help="the KL coefficients β > 0 of the proxy's extra runs")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--sampler", choices=["decode", "generate"], default="decode",
                        help="the library's own sampling loop, or 🤗 generate (what nbs/overoptimisation_ppo.json was made with)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    start, work = time.perf_counter(), tempfile.mkdtemp()
    tokenizer, sft, proxies, labels = setup(work)
    debiased = length_debiased(proxies[0], list(labels["prompt"]) * 2, list(labels["chosen"]) + list(labels["rejected"]))
    eval_prompts = list(load_task("prompts", "eval")["prompt"])[:32]
    runs = {"proxy, β=0": (proxies[0], 0.0), **{f"proxy, β={float(b):g}": (proxies[0], float(b)) for b in a.kl_coefs.split(",")},
            "ensemble mean−std, β=0": (RewardEnsemble(proxies, "mean_minus_std"), 0.0), "debiased proxy, β=0": (debiased, 0.0)}
    curves = {}
    for i, (name, (reward, kl_coef)) in enumerate(runs.items()):
        curves[name] = ppo_curve(reward, sft, tokenizer, proxies[0], eval_prompts, kl_coef, a.steps, a.every, f"{work}/ppo{i}",
                                 learning_rate=a.learning_rate, sampler=a.sampler)
        print(f"{name}: {time.perf_counter() - start:.0f} s", {k: round(v, 3) for k, v in curves[name][-1].items()}, flush=True)
    settings = {"command": f"python examples/overoptimisation_sweep.py --out {a.out} --steps {a.steps} --every {a.every} "
                           f"--kl_coefs {a.kl_coefs} --learning_rate {a.learning_rate:g} --sampler {a.sampler}",
                "sampler": a.sampler,
                "seeds": {"sft": 0, "proxies": [0, 1, 2], "labeller_coin": 0, "ppo": 0, "eval_sampling": 0},
                "ppo": {"learning_rate": a.learning_rate, "lr_scheduler_type": "constant", "per_device_train_batch_size": 16, "response_length": 16,
                        "steps": a.steps, "kl_coef": {name: kl for name, (_, kl) in runs.items()}},
                "eval_prompts": len(eval_prompts), "torch": torch.__version__, "machine": platform.machine(),
                "seconds": round(time.perf_counter() - start)}
    with open(a.out, "w") as f: json.dump({"settings": settings, "curves": curves}, f, indent=1, ensure_ascii=False)
    print(f"wrote {a.out} in {settings['seconds']} s")


if __name__ == "__main__": main()
