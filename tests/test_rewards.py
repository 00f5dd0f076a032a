"""Reward functions as TRL users write them, end to end through the on-policy trainers: the dataset's columns reach
each sample (also with k/G samples per prompt), several weighted functions and their per-function metrics, None, async,
chat prompts, and evaluation during RL (eval/score, eval/win_rate, eval/kl at the right steps; resume stays exact; the same
numbers with 1 or 2 processes, in the slow set)."""

import asyncio
import copy
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from instruct_goose import (
    Agent,
    GRPOConfig,
    GRPOTrainer,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    task_tokenizer,
    tiny_causal_lm,
)
from instruct_goose.toy import chat_task_tokenizer, load_task
from instruct_goose.reward import reward_from, score_completions

SMALL = dict(
    learning_rate=1e-3, per_device_train_batch_size=4, num_sample_generations=0, disable_tqdm=True, seed=0
)
ARITHMETIC = Dataset.from_dict(
    {
        "prompt": ["1+1=", "2+2=", "3+3=", "4+4=", "5+5=", "6+6=", "7+7=", "8+8="],
        "answer": ["2", "4", "6", "8", "10", "12", "14", "16"],
        "level": [1, 1, 1, 1, 2, 2, 2, 2],
    }
)


def trainer(
    algo,
    tmp_path,
    reward_funcs,
    data=ARITHMETIC,
    tokenizer=None,
    eval_dataset=None,
    callbacks=None,
    **overrides,
):
    "A tiny PPO, RLOO or GRPO trainer built the TRL way (keywords), 8-token responses."
    tokenizer = tokenizer or task_tokenizer()
    model = tiny_causal_lm(tokenizer, seed=0)
    if algo == "ppo":
        args = RLHFConfig(output_dir=str(tmp_path), response_length=8, **{**SMALL, **overrides})
        model = Agent(model)
    elif algo == "rloo":
        args = RLOOConfig(output_dir=str(tmp_path), response_length=8, rloo_k=2, **{**SMALL, **overrides})
    else:
        args = GRPOConfig(
            output_dir=str(tmp_path), max_completion_length=8, num_generations=2, **{**SMALL, **overrides}
        )
    kind = {"ppo": RLHFTrainer, "rloo": RLOOTrainer, "grpo": GRPOTrainer}[algo]
    return kind(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=data,
        eval_dataset=eval_dataset,
        reward_funcs=reward_funcs,
        callbacks=callbacks,
    )


# --- the dataset's columns reach the reward, row by row
# ---------------------------------------------------------------


@pytest.mark.parametrize("algo", ["ppo", "rloo", "grpo"])
def test_completion_ids_reach_reward_functions(algo, tmp_path):
    """TRL passes each completion's token ids as `completion_ids`: the sampled tokens up to and with the stop
    token, decoding to the completion."""
    seen = {}

    def tokens(completions, completion_ids, **kwargs):
        seen.update(completions=completions, ids=completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    t = trainer(algo, tmp_path, tokens)
    samples = t.sample_and_score(
        t.model.model if algo == "ppo" else t.model, ARITHMETIC[[0, 1, 2, 3]], seed=0
    )
    tok = t.tokenizer
    assert seen["ids"] == [
        row[mask].tolist() for row, mask in zip(samples.response_ids, samples.response_mask)
    ]
    assert [tok.decode(ids, skip_special_tokens=True) for ids in seen["ids"]] == seen["completions"]
    # the reward counted real tokens
    assert samples.scores.tolist() == samples.response_mask.sum(1).float().tolist()
    # plain lists, as TRL gives them
    assert all(isinstance(i, int) for ids in seen["ids"] for i in ids)


@pytest.mark.parametrize("algo,k", [("ppo", 1), ("rloo", 2), ("grpo", 2)])
def test_answer_column_reaches_every_sample(algo, k, tmp_path):
    seen = []

    # TRL's signature, reads the `answer` column
    def exact(prompts, completions, answer, **kwargs):
        seen.extend(zip(prompts, answer, kwargs["level"]))
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    t = trainer(algo, tmp_path, exact)
    rows = ARITHMETIC[[5, 0, 3]]  # answers differ from row to row
    t.sample_rollout(t.model, rows, seed=0)  # PPO: the agent
    expected = [
        (p, a, lv) for p, a, lv in zip(rows["prompt"], rows["answer"], rows["level"]) for _ in range(k)
    ]
    # sample i got its own prompt's answer, k times
    assert seen == expected


def test_trl_style_function_gets_everything_by_keyword():
    got = {}

    def f(completions, **kwargs):
        got.update(kwargs, completions=completions)
        return [1.0] * len(completions)

    score_completions(f, ["a", "b"], ["c", "d"], answer=["1", "2"])
    assert got == {"prompts": ["a", "b"], "completions": ["c", "d"], "answer": ["1", "2"]}


# --- several weighted functions: the weighted sum and each one's metrics
# ------------------------------------------------


def first_token_is_digit(prompts, completions):
    return [float(c.strip()[:1].isdigit()) for c in completions]


def length(prompts, completions):
    return [len(c) for c in completions]


def test_weighted_sum_by_hand():
    reward = reward_from([first_token_is_digit, length], [2.0, -0.5])
    total = reward(["1+1=", "2+2="], [" 2", " four"])
    # " 2": 2·1 − 0.5·2 = 1.0; " four": 2·0 − 0.5·5 = −2.5
    torch.testing.assert_close(total, torch.tensor([1.0, -2.5]))
    stats = {
        k: round(v.item(), 4) for k, v in reward.stats(reward.each(["1+1=", "2+2="], [" 2", " four"])).items()
    }
    assert stats == {
        "rewards/first_token_is_digit/mean": 0.5,
        "rewards/first_token_is_digit/std": round(0.5**0.5, 4),
        "rewards/length/mean": 3.5,
        "rewards/length/std": round(4.5**0.5, 4),
    }


@pytest.mark.parametrize("algo", ["ppo", "rloo", "grpo"])
def test_per_function_metrics_are_logged(algo, tmp_path):
    t = trainer(algo, tmp_path, [first_token_is_digit, length], max_steps=2, reward_weights=[2.0, 0.1])
    t.train()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2
    for row in rows:
        for name in ("first_token_is_digit", "length"):
            assert math.isfinite(row[f"rewards/{name}/mean"]) and row[f"rewards/{name}/std"] >= 0
        # 8 sampled tokens decode to some text
        assert row["rewards/length/mean"] > 0


# --- None, async, what functions may return
# -----------------------------------------------------------------------------


def test_none_is_left_out_of_the_sum():
    def math_only(prompts, completions, answer):
        return [None if a is None else float(c.strip() == a) for c, a in zip(completions, answer)]

    def chat_only(prompts, completions, answer):
        return [0.5 if a is None else None for a in answer]

    reward = reward_from([math_only, chat_only], [3.0, 2.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = reward(["1+1=", "1+1=", "hi"], [" 2", " 3", " hello"], answer=["2", "2", None])
    torch.testing.assert_close(total, torch.tensor([3.0, 0.0, 1.0]))  # 3·1; 3·0; 2·0.5
    # every completion had a reward that applied
    assert caught == []
    nothing = reward_from(lambda p, c: [None] * len(c))
    with pytest.warns(UserWarning, match="every reward function returned None"):
        torch.testing.assert_close(nothing(["a", "b"], ["c", "d"]), torch.zeros(2))


def test_async_functions_run_concurrently():
    order = []

    async def slow(prompts, completions):
        order.append("slow starts")
        await asyncio.sleep(0.05)
        order.append("slow ends")
        return [1.0] * len(completions)

    async def fast(prompts, completions):
        order.append("fast starts")
        await asyncio.sleep(0)
        order.append("fast ends")
        return [2.0] * len(completions)

    total = reward_from([slow, fast])(["a"], ["b"])
    torch.testing.assert_close(total, torch.tensor([3.0]))
    # gathered, not one after the other
    assert order == ["slow starts", "fast starts", "fast ends", "slow ends"]


@pytest.mark.parametrize(
    "out", [np.array([1, 0]), torch.tensor([1.0, 0.0]), (1, 0.0), [np.float64(1), np.int32(0)]]
)
def test_array_and_tensor_outputs_are_accepted(out):
    torch.testing.assert_close(
        score_completions(lambda p, c: out, ["a", "b"], ["c", "d"]), torch.tensor([1.0, 0.0])
    )


@pytest.mark.parametrize(
    "out,message",
    [
        ([1.0], "returned 1 scores for 2 completions"),
        ([1.0, "x"], "non-numbers at [1]"),
        ([1.0, float("inf")], "NaN or inf at [1]"),
        (3.0, "not a list of 2 scores"),
    ],
)
def test_bad_outputs_are_refused_in_one_line(out, message):
    with pytest.raises((TypeError, ValueError)) as info:
        reward_from(lambda p, c: out)(["a", "b"], ["c", "d"])
    assert message in str(info.value) and "\n" not in str(info.value)


# --- chat prompts
# ---------------------------------------------------------------------------------------------------


def test_chat_prompts_reach_functions_as_messages_and_samples_show_text(tmp_path):
    chat = load_task("prompts", chat=True).select(range(4))
    got = {}

    def f(prompts, completions, **kwargs):
        got.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    tok = chat_task_tokenizer()
    t = trainer("rloo", tmp_path, f, data=chat, tokenizer=tok)
    _, samples = t.sample_rollout(t.model, chat[:2], seed=0)
    # the conversations, each k times
    assert got["prompts"] == [p for p in chat[:2]["prompt"] for _ in range(2)]
    assert all(
        c == [{"role": "assistant", "content": text}]
        for c, text in zip(got["completions"], samples.completions)
    )
    assert samples.prompts[0] == tok.apply_chat_template(
        chat[0]["prompt"], tokenize=False, add_generation_prompt=True
    )


def test_chat_prompts_without_a_chat_template_fail_before_training(tmp_path):
    t = trainer("rloo", tmp_path, length, data=load_task("prompts", chat=True).select(range(8)), max_steps=1)
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        t.train()
    assert not (tmp_path / "metrics.jsonl").exists()


# --- evaluation during RL
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["ppo", "rloo", "grpo"])
def test_eval_metrics_at_the_right_steps(algo, tmp_path):
    t = trainer(algo, tmp_path, length, eval_dataset=ARITHMETIC.select(range(5)), max_steps=3, eval_steps=2)
    t.train()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # GRPO: TRL 1.16's names (RLOO logs both)
    e = "eval_" if algo == "grpo" else "eval/"
    assert [r["step"] for r in rows if f"{e}score" in r] == [2, 3]
    with_ref = {f"{e}score_ref", f"{e}win_rate", f"{e}kl"}
    # GRPO, beta 0: no reference
    assert with_ref <= set(rows[1]) if algo != "grpo" else not with_ref & set(rows[1])
    assert all(math.isfinite(r[f"{e}score"]) for r in rows if f"{e}score" in r)


def test_eval_win_rate_by_hand(tmp_path):
    """A reward that only ever says 1: every prompt a tie, win rate ½; a step too small to move a float32 weight
    keeps the policy equal to its reference: KL 0."""
    t = trainer(
        "rloo",
        tmp_path,
        lambda p, c: [1.0] * len(c),
        eval_dataset=ARITHMETIC,
        max_steps=1,
        learning_rate=1e-12,
    )
    t.train()
    row = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[-1])
    assert (
        row["eval/win_rate"] == 0.5
        and row["eval/score"] == row["eval/score_ref"] == 1.0
        and row["eval/kl"] == 0.0
    )


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_with_evaluation_is_exact(tmp_path):
    """A run with evaluations stopped after step 3 and resumed ends with the metrics and weights of the run never
    stopped."""

    def run(out, callbacks=None, **extra):
        t = trainer(
            "rloo",
            out,
            length,
            eval_dataset=ARITHMETIC.select(range(6)),
            max_steps=5,
            eval_steps=2,
            save_steps=1,
            eval_temperature=0.7,
            callbacks=callbacks,
            **extra,
        )
        t.train()
        return t

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped", [StopAt(3)])
    resumed = run(tmp_path / "stopped", resume_from_checkpoint="latest")
    timing = lambda k: k in ("eps", "step_time") or k.endswith(("_runtime", "_per_second"))  # seconds
    strip = lambda rows: [{k: v for k, v in r.items() if not timing(k)} for r in rows]
    assert strip(resumed.loop.state.history) == strip(straight.loop.state.history)
    assert [r["step"] for r in straight.loop.state.history if "eval/score" in r] == [2, 4, 5]
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


EVAL_SCRIPT = '''
import json, os, sys, torch
from datasets import Dataset
from instruct_goose import RLHFConfig, RLHFTrainer, task_tokenizer, tiny_causal_lm
out = sys.argv[1]
tokenizer = task_tokenizer()
prompts = Dataset.from_dict({"prompt": ["Review: The film", "Review: A goose", "Review: The plot", "Review: I"] * 2})
held_out = Dataset.from_dict({"prompt": ["Review: It", "Review: My", "Review: This", "Review: The", "Review: One"]})
torch.manual_seed(0)
args = RLHFConfig(output_dir=out, per_device_train_batch_size=4 // int(os.environ.get("WORLD_SIZE", 1)), max_steps=2,
                  response_length=6, local_rollout_forward_batch_size=2, num_sample_generations=0, disable_tqdm=True,
                  learning_rate=1e-3, eval_steps=1, seed=0)
trainer = RLHFTrainer(tiny_causal_lm(tokenizer, seed=0), args=args, processing_class=tokenizer, train_dataset=prompts,
                      eval_dataset=held_out, reward_funcs=lambda p, c: [len(x) / 10 for x in c])
trainer.train()
if os.environ.get("RANK", "0") == "0": json.dump(trainer.loop.state.history, open(f"{out}/history.json", "w"))
'''


@pytest.mark.slow
def test_evaluation_does_not_depend_on_the_process_count(tmp_path):
    """5 held-out prompts in chunks of 2: 1 process takes all 3 chunks, 2 processes take 2 and 1; the metrics
    agree."""
    (tmp_path / "eval.py").write_text(EVAL_SCRIPT)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    histories = []
    for procs in (1, 2):
        out = tmp_path / f"p{procs}"
        launch = (
            [sys.executable]
            if procs == 1
            else [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]
        )
        result = subprocess.run(
            launch + [str(tmp_path / "eval.py"), str(out)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        histories.append(json.loads((out / "history.json").read_text()))
    for one, two in zip(*histories):
        for key in ("eval/score", "eval/score_ref", "eval/win_rate", "eval/kl"):
            assert abs(one[key] - two[key]) <= 1e-5 * max(1, abs(one[key])), (
                one["step"],
                key,
                one[key],
                two[key],
            )


# --- reward models' tokenizers and what rewards log, as TRL passes them
# -------------------------------------------------------------


def _named_classifier(name):
    "A 🤗 reward classifier object whose config names a Hub id, as `from_pretrained(<id>)` leaves it."
    from instruct_goose.reward import RewardModel

    classifier = RewardModel(tiny_causal_lm(task_tokenizer(), seed=0)).model
    classifier.config._name_or_path = name
    return classifier


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_reward_model_by_hub_id_gets_its_own_tokenizer(algo, tmp_path, monkeypatch):
    """TRL loads a reward model's tokenizer from `config._name_or_path` (a Hub id here, no folder): not the
    policy's, and padding with EOS where it has no pad token."""
    import instruct_goose.reward as reward_module

    # a copy: `task_tokenizer` is cached
    policy_tok, own = task_tokenizer(), copy.deepcopy(task_tokenizer())
    own.pad_token = None
    asked = []

    def from_hub(name, *args, **kwargs):
        asked.append(name)
        if name != "someone/tiny-reward":
            raise OSError(f"{name} is not cached")
        return own

    monkeypatch.setattr(reward_module.AutoTokenizer, "from_pretrained", from_hub)
    t = trainer(algo, tmp_path, _named_classifier("someone/tiny-reward"), tokenizer=policy_tok)
    assert asked == ["someone/tiny-reward"]
    assert t.reward_model.functions[0].tokenizer is own and t.reward_processing_classes == [own]
    assert own.pad_token == own.eos_token
    assert t.reward_model.functions[0].config.pad_token_id == own.eos_token_id


@pytest.mark.parametrize("kind", [RLOOTrainer, GRPOTrainer])
def test_reward_processing_classes_as_trl_takes_them(kind, tmp_path):
    "One tokenizer for one reward, a list with one per reward (None for a function), else a one-line error."
    tok, reward_tok = task_tokenizer(), copy.deepcopy(task_tokenizer())
    config = (
        RLOOConfig(output_dir=str(tmp_path), rloo_k=2, **SMALL)
        if kind is RLOOTrainer
        else GRPOConfig(output_dir=str(tmp_path), num_generations=2, **SMALL)
    )
    model = lambda: tiny_causal_lm(tok, seed=0)
    classifier = _named_classifier("")
    one = kind(
        model(),
        args=config,
        processing_class=tok,
        train_dataset=ARITHMETIC,
        reward_funcs=classifier,
        reward_processing_classes=reward_tok,
    )
    assert (
        one.reward_processing_classes == [reward_tok]
        and one.reward_model.functions[0].tokenizer is reward_tok
    )
    two = kind(
        model(),
        args=config,
        processing_class=tok,
        train_dataset=ARITHMETIC,
        reward_funcs=[classifier, length],
        reward_processing_classes=[reward_tok, None],
    )
    assert two.reward_processing_classes == [reward_tok, None]
    with pytest.raises(
        ValueError, match=r"^`reward_processing_classes` has 1 tokenizers for 2 reward functions"
    ):
        kind(
            model(),
            args=config,
            processing_class=tok,
            train_dataset=ARITHMETIC,
            reward_funcs=[classifier, length],
            reward_processing_classes=reward_tok,
        )


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_rewards_read_the_state_and_log_metrics_and_columns(algo, tmp_path):
    """TRL's per-call keywords: `trainer_state` is the run's state at the step, `log_metric` values appear in
    the step's logged row under their own name, `log_extra` columns in the completions table."""
    steps = []

    def exact(completions, answer, trainer_state, log_metric, log_extra, **kwargs):
        steps.append(trainer_state.global_step)
        right = [float(c.strip() == a) for c, a in zip(completions, answer)]
        log_metric("accuracy", 0.25 + trainer_state.global_step)
        log_extra("expected", answer)
        return right

    t = trainer(algo, tmp_path, [exact, length], max_steps=2, log_completions=True)
    t.train()
    assert steps == [0, 1]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # the value logged at each step, read back from its row
    assert [r["accuracy"] for r in rows] == [0.25, 1.25]
    table = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    answers = dict(zip(ARITHMETIC["prompt"], ARITHMETIC["answer"]))
    assert table and all(r["expected"] == answers[r["prompt"]] for r in table)


def test_a_reward_that_applies_to_nothing_logs_none(tmp_path, caplog):
    "TRL: `rewards/<name>/mean` is None for a reward that returned None for every completion, and it warns."

    def never(completions, **kwargs):
        return [None] * len(completions)

    t = trainer("rloo", tmp_path, [never, length], max_steps=1)
    with caplog.at_level("WARNING"):
        t.train()
    row = json.loads(open(tmp_path / "metrics.jsonl").readline())
    assert row["rewards/never/mean"] is None and row["rewards/never/std"] is None
    assert row["rewards/length/mean"] > 0
    only = trainer("rloo", tmp_path / "only", never, max_steps=1)
    with caplog.at_level("WARNING"):
        only.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_evaluation_passes_the_per_call_keywords(algo, tmp_path):
    """A reward that asks for TRL's `trainer_state`, `log_metric` and `log_extra` scores the held-out prompts too
    (it was told the data has no `trainer_state` column), seeing the run's state at the evaluation."""
    seen = []

    def exact(completions, answer, trainer_state, log_metric, log_extra, **kwargs):
        seen.append(trainer_state.global_step)
        log_metric("accuracy", 1.0)
        log_extra("expected", answer)
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    t = trainer(algo, tmp_path, [exact, length], max_steps=1, eval_dataset=ARITHMETIC.select(range(4)))
    t.train()
    seen.clear()
    metrics = t.evaluate()
    assert seen and set(seen) == {1}, seen
    assert all(math.isfinite(v) for k, v in metrics.items() if isinstance(v, float)), metrics
