"""PPO and RLOO with 2 CPU processes (torchrun, gloo) against 1 process with the same global batch and seed.

What makes the runs equal:
- each process takes a contiguous share of the step's prompts (`batch_indices`), and a process's micro-batch `i` is the
  `i`-th contiguous share, so 1 process × 2 micro-batches sees the rows that 2 processes × 1 micro-batch see;
- sampling is seeded per chunk of `local_rollout_forward_batch_size` rows from (seed, step, first global row), so a
  chunk's samples do not depend on which process draws them (the chunk size must divide each process's rollout);
- advantage and reward whitening use the statistics of all processes' rows (gathered);
- an RLOO group is k adjacent rows, so no group is split across processes;
- PPO-ptx draws its pretraining batch from a global micro-batch counter;
- gradients are averaged over processes (`TrainLoop.average_gradients`), which equals accumulating over micro-batches;
- the learning-rate schedule steps once per optimizer step (Accelerate's default steps it once per process).

Every forward pass cuts its rows' prompts to the longest among them, so a chunk or micro-batch is padded the same
whichever process holds it: the matrix shapes match and the runs agree to float precision, prompts of any length. The
rollout's no-grad passes take a micro-batch's 4 rows at a time: each of 2 processes keeps its rollout pass for its one
micro-batch (`first_pass`) while 1 process × 2 micro-batches makes a separate pass, and equal widths keep the shapes equal.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from instruct_goose import load_task, task_tokenizer, tiny_causal_lm

SCRIPT = '''
import copy, json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from instruct_goose import Agent, RLHFConfig, RLHFTrainer, RLOOConfig, RLOOTrainer, create_reference_model, load_task
algo, policy, out, accumulation = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
resume = sys.argv[5] if len(sys.argv) > 5 else None
tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
prompts = [{"prompt": p} for p in json.load(open(os.path.join(policy, "prompts.json")))]
reward = lambda prompts, completions: [len(c) / 10 for c in completions]
common = dict(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation, total_episodes=32,
              response_length=6, local_rollout_forward_batch_size=4, num_ppo_epochs=2, num_sample_generations=0,
              disable_tqdm=True, learning_rate=1e-3, save_steps=2, resume_from_checkpoint=resume)
if os.environ.get("EARLY_STOPS"):   # EOS likely: each process's longest response differs, the rollout keeps the longest of all
    common["generation_kwargs"] = {"sequence_bias": [[[tokenizer.eos_token_id], 5.0]]}
common["padding_free"] = bool(os.environ.get("PADDING_FREE"))
common["shared_prefix"] = bool(os.environ.get("SHARED_PREFIX"))
if algo == "ppo":
    torch.manual_seed(0)
    trainer = RLHFTrainer(Agent(copy.deepcopy(model)), create_reference_model(model),
                          RLHFConfig(whiten_rewards=True, ptx_coef=0.5, **common), processing_class=tokenizer, reward_funcs=reward,
                          train_dataset=prompts, pretrain_dataset=load_task("pretrain"))
else:
    trainer = RLOOTrainer(copy.deepcopy(model), model, RLOOConfig(num_generations=2, normalize_advantages=True, **common),
                          processing_class=tokenizer, reward_funcs=reward, train_dataset=prompts)
trainer.train()
rank = os.environ.get("RANK", "0")
torch.save(trainer.model.state_dict(), f"{out}/weights{rank}.pt")
json.dump(trainer.loop.state.history, open(f"{out}/history{rank}.json", "w"))
'''

COMPARED = (
    "objective/scores",
    "objective/kl",
    "objective/rlhf_reward",
    "loss/policy_avg",
    "policy/approxkl_avg",
    "loss",
    "grad_norm",
    "lr",
)


@pytest.fixture(scope="module")
def setup_dir(policy_dir, tmp_path_factory):
    "The tiny policy, the task prompts and the training script, in one directory."
    where = tmp_path_factory.mktemp("setup")
    shutil.copytree(policy_dir, where, dirs_exist_ok=True)
    prompts = load_task("prompts")["prompt"]
    assert len({len(task_tokenizer()(p)["input_ids"]) for p in prompts[:64]}) > 3  # prompts of many lengths
    (where / "prompts.json").write_text(json.dumps(list(prompts)))
    (where / "train.py").write_text(SCRIPT)
    return where


def _run(
    setup_dir,
    out,
    algo,
    processes,
    accumulation,
    resume=None,
    early_stops=False,
    padding_free=False,
    shared_prefix=False,
):
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": str(out) + "-cache",
        **({"EARLY_STOPS": "1"} if early_stops else {}),
        **({"PADDING_FREE": "1"} if padding_free else {}),
        **({"SHARED_PREFIX": "1"} if shared_prefix else {}),
    }
    script = [str(setup_dir / "train.py"), algo, str(setup_dir), str(out), str(accumulation)] + (
        [resume] if resume else []
    )
    if processes == 1:
        command = [sys.executable] + script
    else:
        command = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            str(processes),
        ] + script
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-8000:]
    return torch.load(out / "weights0.pt"), json.loads((out / "history0.json").read_text())


def _assert_same(a, b, what, eps=1e-6, compared=COMPARED):
    """Two runs' (weights, logged rows) equal to `eps`: every weight, and each metric in `compared` at every
    step."""
    weights_a, history_a = a
    weights_b, history_b = b
    worst = max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a)
    assert worst <= eps, f"{what}: weights differ by {worst}"
    assert len(history_a) == len(history_b) == 4
    for row_a, row_b in zip(history_a, history_b):
        for key in compared:
            if key in row_a:
                assert abs(row_a[key] - row_b[key]) <= eps * max(1, abs(row_a[key])), (
                    what,
                    row_a["step"],
                    key,
                    row_a[key],
                    row_b[key],
                )


# PPO runs in `make test` through chapter 14 (the same 1-vs-2-process comparison and the resume of a 2-process
# checkpoint
# by 1 process); here both algorithms are in the full set
@pytest.mark.parametrize(
    "algo", [pytest.param("ppo", marks=pytest.mark.slow), pytest.param("rloo", marks=pytest.mark.slow)]
)
def test_two_processes_equal_one(algo, setup_dir, tmp_path):
    one = _run(setup_dir, tmp_path / "one", algo, processes=1, accumulation=2)
    two = _run(setup_dir, tmp_path / "two", algo, processes=2, accumulation=1)

    rank1 = torch.load(tmp_path / "two" / "weights1.pt")
    for name, value in two[0].items():
        assert torch.equal(rank1[name], value), name  # the processes agree
    saved = {p.name for p in (tmp_path / "two" / "checkpoint-4").iterdir()}
    # both processes' states saved
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= saved
    assert sorted(p.name for p in (tmp_path / "two").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]

    # 1 process deals its rows into its 2 micro-batches by length (`like_rows`), 2 processes each run their
    # own half: the
    # same gradient summed in another order, which Adam makes up to ~2e-6 (PPO, 2.1e-6 seen, 2026-11-28;
    # chapter 14 too)
    _assert_same(one, two, "1 process x 2 micro-batches vs 2 processes", eps=1e-5)
    start = tiny_causal_lm(task_tokenizer(), seed=0).state_dict()
    trained = {name.removeprefix("model."): value for name, value in two[0].items()}
    # and training did move them
    assert not torch.equal(trained["lm_head.weight"], start["lm_head.weight"])
    # one schedule step per step
    assert one[1][-1]["lr"] < one[1][1]["lr"] and one[1][1]["lr"] == two[1][1]["lr"] > 0

    # the 2-process checkpoint of step 2, resumed by 1 process with 2 micro-batches, ends where the 2-process
    # run did
    shutil.copytree(tmp_path / "two" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    resumed = _run(setup_dir, tmp_path / "resumed", algo, processes=1, accumulation=2, resume="latest")
    _assert_same(two, resumed, "2-process run vs its checkpoint resumed by 1 process")


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_two_processes_equal_one_when_responses_stop_early(setup_dir, tmp_path, padding_free):
    """PPO (its whitening gathers (rows × response) tensors from every process) with responses that stop early: each
    process's rollout keeps the response columns of the longest response of any process (`response_width`), so the
    gathered shapes agree (without it the gather fails) and 2 processes train as 1 process with 2 micro-batches;
    with `padding_free` too (each process packs its own rows)."""
    one = _run(
        setup_dir,
        tmp_path / "one",
        "ppo",
        processes=1,
        accumulation=2,
        early_stops=True,
        padding_free=padding_free,
    )
    two = _run(
        setup_dir,
        tmp_path / "two",
        "ppo",
        processes=2,
        accumulation=1,
        early_stops=True,
        padding_free=padding_free,
    )
    # 1 process deals its rows into 2 micro-batches by length (`like_rows`) and cuts each at its own longest
    # response; each
    # of 2 processes reuses its rollout pass over its own half, as wide as both processes' longest: other rows
    # summed
    # together, other matrix shapes, other rounding, which Adam (lr 1e-3) makes up to ~1e-5 (1.01e-5 seen,
    # 2026-11-28)
    _assert_same(one, two, "responses that stop early: 1 process x 2 micro-batches vs 2 processes", eps=3e-5)
    # some responses did stop
    assert any(row["val/num_eos_tokens"] > 0 for row in one[1])


@pytest.mark.slow
def test_two_processes_equal_one_with_shared_prompts(setup_dir, tmp_path):
    """RLOO with `shared_prefix` and responses that stop early: each process runs its own rows' prompts once (a group of
    k adjacent rows never spans two processes), so 2 processes train as 1 process with 2 micro-batches."""
    one = _run(
        setup_dir, tmp_path / "one", "rloo", processes=1, accumulation=2, early_stops=True, shared_prefix=True
    )
    two = _run(
        setup_dir, tmp_path / "two", "rloo", processes=2, accumulation=1, early_stops=True, shared_prefix=True
    )
    _assert_same(one, two, "shared prompts: 1 process x 2 micro-batches vs 2 processes", eps=1e-5)
