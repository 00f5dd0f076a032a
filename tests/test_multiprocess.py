"""Two CPU processes (torchrun, gloo) train `goose ppo` / `goose rloo`: every process must end with the same weights.

The on-policy trainers call the agent through its methods (`response_stats`, `response_logits`), not through the
DDP-wrapped `forward`, so DDP alone would not synchronise their gradients; `TrainLoop.average_gradients` does."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from instruct_goose import task_tokenizer, tiny_causal_lm

SCRIPT = '''
import copy, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from instruct_goose import Agent, RLHFConfig, RLHFTrainer, RLOOConfig, RLOOTrainer, create_reference_model, load_task
algo, policy, out = sys.argv[1:4]
tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
reward = lambda prompts, completions: [float(len(c)) for c in completions]      # differs between samples
common = dict(output_dir=out + "/run", per_device_train_batch_size=4, total_episodes=32, response_length=6,
              num_sample_generations=0, disable_tqdm=True, learning_rate=1e-3)
if algo == "ppo":
    torch.manual_seed(0)
    trainer = RLHFTrainer(Agent(copy.deepcopy(model)), create_reference_model(model), RLHFConfig(**common),
                          tokenizer=tokenizer, reward_model=reward, train_dataset=load_task("prompts"))
else:
    trainer = RLOOTrainer(RLOOConfig(rloo_k=2, **common), tokenizer, copy.deepcopy(model), model, reward, load_task("prompts"))
trainer.train()
torch.save(trainer.model.state_dict(), f"{out}/rank{os.environ['RANK']}.pt")
'''


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_two_processes_stay_in_sync(algo, tmp_path):
    tokenizer = task_tokenizer()
    tiny_causal_lm(tokenizer, seed=0).save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    (tmp_path / "train.py").write_text(SCRIPT)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    # a fresh datasets cache, as on a new machine: both processes read and filter the task files at the same time
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([torchrun, "--nproc_per_node", "2", str(tmp_path / "train.py"), algo, str(tmp_path / "policy"),
                             str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-8000:]
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-4"]   # 32 episodes / (4 x 2)
    saved = {p.name for p in (tmp_path / "run" / "checkpoint-4").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= saved        # both processes' states made it in
    for name, value in rank0.items():
        assert torch.equal(rank1[name], value), name
    start = tiny_causal_lm(tokenizer, seed=0).state_dict()
    trained = {name.removeprefix("model."): value for name, value in rank0.items()}
    assert not torch.equal(trained["lm_head.weight"], start["lm_head.weight"])           # and training did move them
