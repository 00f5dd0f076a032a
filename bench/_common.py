"""Shared set-up for the bench scripts: a tiny PPO trainer with its TrainLoop ready, and a timed PPO step."""
import logging, statistics, time, warnings

import torch
from transformers.utils import logging as hf_logging

from instruct_goose import (Agent, RLHFConfig, RLHFTrainer, create_reference_model, load_task, task_tokenizer,
                            tiny_causal_lm)
from instruct_goose import onpolicy as trainer_mod
from instruct_goose.loop import TrainLoop
from instruct_goose.reward import reward_from


def quiet():
    hf_logging.disable_progress_bar(); hf_logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def length_reward(prompts, completions):
    "Cheap reward: completion length in characters / 100."
    return [len(c) / 100 for c in completions]


def make_trainer(batch=16, response_length=32, epochs=4, n_layer=2, hidden_size=64, max_positions=256, output_dir="runs/bench"):
    tokenizer = task_tokenizer()
    model = tiny_causal_lm(tokenizer, n_layer=n_layer, hidden_size=hidden_size, seed=0, max_positions=max_positions)
    config = RLHFConfig(output_dir=output_dir, learning_rate=1e-5, lr_scheduler_type="constant",
                        per_device_train_batch_size=batch, num_mini_batches=1, num_ppo_epochs=epochs,
                        response_length=response_length, total_episodes=batch * 10_000, num_sample_generations=0,
                        disable_tqdm=True, seed=0)
    trainer = RLHFTrainer(Agent(model), create_reference_model(model), config, processing_class=tokenizer,
                          reward_funcs=length_reward, train_dataset=load_task("prompts"))
    trainer.check_ready()
    loop = trainer.loop = TrainLoop(config)
    loop.register(trainer.kl_ctl)
    agent = loop.accelerator.unwrap_model(loop.setup_optimizer(trainer.model, 10_000 * epochs))
    trainer.ref_model.to(loop.device)
    prompts = trainer.train_dataset[:batch]["prompt"]
    return trainer, agent, prompts


class Timers:
    "Wraps the library's own functions with perf_counter; `t` holds seconds per phase for the current step."
    def __init__(self, trainer):
        self.t = {}
        self.trainer = trainer
        orig_gen = trainer_mod.generate_responses
        trainer.reward_model = reward = reward_from(trainer.reward_model)   # the one reward `train` calls (functions, weights)
        orig_sas, orig_opt = trainer.sample_and_score, trainer.loop.optimizer_step
        def timed(name, fn):
            def w(*a, **k):
                s = time.perf_counter(); r = fn(*a, **k); self.t[name] = self.t.get(name, 0) + time.perf_counter() - s
                return r
            return w
        trainer_mod.generate_responses = timed("_gen", orig_gen)
        reward.forward = timed("_score_fn", reward.forward)
        trainer.sample_and_score = timed("_sas", orig_sas)
        trainer.loop.optimizer_step = timed("optimizer", orig_opt)

    def step(self, agent, prompts):
        "One PPO step exactly as `OnPolicyTrainer.train`'s loop body (without sample tables/checkpoints); returns phases."
        tr, loop, c = self.trainer, self.trainer.loop, self.trainer.config
        self.t = {}
        t0 = time.perf_counter()
        rollout, samples = tr.sample_rollout(agent, prompts, loop=loop)   # with the loop, as `train` calls it (`first_pass`)
        t1 = time.perf_counter()
        rstats = tr.rollout_stats(rollout)
        t2 = time.perf_counter()
        stats = {**rstats, **tr.update(agent, rollout, loop)}
        t3 = time.perf_counter()
        stats = {k: loop.accelerator.reduce(v, reduction="mean") for k, v in stats.items()}
        tr.kl_ctl.update(stats["objective/kl"], n_steps=len(rollout))
        loop.state.step += 1
        eos = ((samples.response_ids == tr.stop_token_id) & samples.response_mask).sum()
        loop.log({**stats, "val/num_eos_tokens": eos, "eps": len(rollout) / (time.perf_counter() - t0),
                  "lr": loop.lr, "episode": loop.state.step * c.rollout_size})
        t4 = time.perf_counter()
        t = self.t
        phases = {"generate": t["_gen"], "score": t["_sas"] - t["_gen"],
                  "rollout stats": (t1 - t0) - t["_sas"] + (t2 - t1),
                  "PPO epochs (fwd+bwd)": (t3 - t2) - t["optimizer"], "optimizer": t["optimizer"],
                  "logging": t4 - t3, "total": t4 - t0}
        phases["_score_fn"] = t["_score_fn"]
        phases["_gen_len"] = samples.response_ids.shape[1]
        return phases


def median(xs): return statistics.median(xs)
