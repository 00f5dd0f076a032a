"""TRL 1.16's reward helpers (`instruct_goose.rewards`, chapter 4b) and reward functions of every TRL signature.

- Parity: `think_format_reward`, `get_soft_overlong_punishment` and `get_repetition_penalty_reward` give what
  `trl.rewards`' own functions give on the same inputs (edge cases included). TRL's `accuracy_reward` needs `math_verify`
  (not installed by TRL or by us): 42 cases recorded from it are checked, and TRL's function is called where it is installed.
- Signatures: `completion_ids` only, `completions` only, `prompts, completions`, `**kwargs` only, positional
  `(p, c)`, through `score_completions` and `reward_from`; booleans are 0/1, None is skipped, strings are refused in
  one line naming the function.
- A short GRPO run with `get_soft_overlong_punishment` among the reward functions logs its TRL-named mean.
"""

import importlib.util
import pickle

import pytest
import torch
import trl.rewards as trl_rewards
from transformers import AutoModelForCausalLM, AutoTokenizer

from instruct_goose import GRPOConfig, GRPOTrainer, load_task, reward_from, score_completions
from instruct_goose import rewards


# TRL's helpers read messages only
def as_chat(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


THINK_CASES = [
    "<think>\nreasoning\n</think>\nanswer",
    "<think>\nreasoning\nanswer",
    "\n<think>x</think>y",
    " <think>x</think>",
    "<think>a<think>b</think>",
    "<think>a</think>b<think>c</think>",
    "<think></think>",
    "</think>",
    "<think>",
    "no tags",
    "",
    "<think>x</think>\n\n</think>",
    "<THINK>x</THINK>",
    "<think>multi\nline\n</think>\n<tail>",
]


def test_think_format_reward_matches_trl():
    ours = rewards.think_format_reward(as_chat(THINK_CASES))
    assert ours == trl_rewards.think_format_reward(as_chat(THINK_CASES))
    # plain-text completions read the same
    assert ours == rewards.think_format_reward(THINK_CASES)
    # by hand: starts with <think>, no second one, closed
    assert [i for i, r in enumerate(ours) if r == 1.0] == [0, 6, 11, 13]


@pytest.mark.parametrize("max_len,cache", [(100, 20), (8, 4), (4, 0), (5, 5), (1, 1)])
def test_soft_overlong_punishment_matches_trl(max_len, cache):
    ids = [[7] * n for n in range(0, max_len + 3)]
    ours = rewards.get_soft_overlong_punishment(max_len, cache)
    theirs = trl_rewards.get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
    assert ours(ids) == theirs(ids)
    assert ours.__name__ == theirs.__name__ == "soft_overlong_punishment_reward"


@pytest.mark.parametrize("ngram_size,max_penalty", [(3, -1.0), (2, -1.0), (1, -0.5), (4, -2.0)])
def test_repetition_penalty_matches_trl(ngram_size, max_penalty):
    ids = [
        [1, 2, 3, 4],
        [5, 5, 5, 5, 5],
        [1, 2, 1, 2, 1, 2],
        [1],
        [],
        [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
        [0] * 20,
    ]
    ours, theirs = (
        rewards.get_repetition_penalty_reward(ngram_size, max_penalty),
        trl_rewards.get_repetition_penalty_reward(ngram_size, max_penalty),
    )
    assert ours(ids) == pytest.approx(theirs(ids), abs=1e-12)
    assert ours.__name__ == theirs.__name__


def test_helpers_have_trls_names_and_pickle():
    """Every name `trl.rewards` exports exists here; the factories' rewards pickle (TRL's async rollout worker
    needs it)."""
    assert set(
        trl_rewards._import_structure["accuracy_rewards"]
        + trl_rewards._import_structure["format_rewards"]
        + trl_rewards._import_structure["other_rewards"]
    ) == set(rewards.__all__)
    for f in (
        rewards.get_soft_overlong_punishment(8, 2),
        rewards.get_repetition_penalty_reward(),
        rewards.get_cosine_scaled_reward(10),
    ):
        assert pickle.loads(pickle.dumps(f)).__name__ == f.__name__


# (completion, solution, TRL 1.16's accuracy_reward with math-verify 0.9.0): recorded on 2026-11-24 and
# re-checked below where
# math_verify is installed. Ours agrees on every one of these; the three known differences follow.
AGREE = [
    (r"\boxed{42}", "42", 1.0),
    (r"\boxed{41}", "42", 0.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{-3}", "-3", 1.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1.0),
    (r"\boxed{+5}", "5", 1.0),
    (r"\boxed{-\frac{1}{2}}", "-0.5", 1.0),
    (r"\boxed{3.0}", "3", 1.0),
    (r"\boxed{x = 4}", "4", 1.0),
    (r"\boxed{1000}", "1,000", 1.0),
    (r"so \boxed{4}.", "$4$", 1.0),
    (r"\boxed{4}", r"\boxed{4}", 1.0),
    (r"\boxed{-0.5}", r"-\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{3}}", r"$\frac{1}{3}$", 1.0),
    (r"\boxed{5.}", "5", 0.0),
    (r"\boxed{12", "12", 0.0),
    (r"\boxed{}", "1", 0.0),
    ("", "1", 0.0),
    (r"not \boxed{2} but \boxed{3}", "3", 0.0),
    (r"\boxed{3} and \boxed{3}", "3", 1.0),
    (r"\boxed{3}, i.e. \boxed{\frac{6}{2}}", "3", 1.0),
    (r"The answer is $7$", "7", 1.0),
    (r"answer $7$", "7", 1.0),
    (r"Answer: $7$", "7", 1.0),
    (r"The answer is: \(7\)", "7", 1.0),
    (r"final answer is \[7\]", "7", 1.0),
    (r"Final Answer: $7$ and then $8$", "7", 1.0),
    (r"final answer is $7$. Check: $8$", "7", 1.0),
    (r"the result is $7$", "7", 0.0),
    (r"$7$ is the final answer", "7", 0.0),
    ("final answer is 7", "7", 0.0),
    ("the answer is 42", "42", 0.0),
    (r"$0.5$", "1/2", 0.0),
    (r"$x = 4$", "4", 0.0),
    (r"\[ 7 \]", "7", 0.0),
    (r"$$9$$", "9", 0.0),
    ("$5$ apples, $6$", "6", 0.0),
    (r"\boxed{2/4}", r"\frac12", None),
    (r"\boxed{x+1}", "x+1", None),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}", None),
]
# (completion, solution, TRL's value, ours): 6-decimal rounding, percentages, and several spans after one
# anchor (a set in math-verify)
DIFFER = [
    (r"\boxed{0.333333}", r"\frac{1}{3}", 1.0, 0.0),
    (r"\boxed{10\%}", "10", 1.0, 0.0),
    (r"final answer is $9$ and $10$", "9", 0.0, 1.0),
]


def test_accuracy_reward_agrees_with_trl_on_numbers():
    """Ours against TRL's values; TRL's own function is called too where math_verify is installed (it is not a
    dependency)."""
    completions, solution = as_chat([c for c, _, _ in AGREE]), [s for _, s, _ in AGREE]
    assert rewards.accuracy_reward(completions, solution) == [v for _, _, v in AGREE]
    assert rewards.accuracy_reward([c for c, _, _, _ in DIFFER], [s for _, s, _, _ in DIFFER]) == [
        v for *_, v in DIFFER
    ]
    if importlib.util.find_spec("math_verify") is None:
        with pytest.raises(ImportError, match="math_verify"):
            trl_rewards.accuracy_reward(completions, solution)
    else:
        assert trl_rewards.accuracy_reward(completions, solution) == [v for _, _, v in AGREE]
        assert trl_rewards.accuracy_reward(as_chat([c for c, *_ in DIFFER]), [s for _, s, *_ in DIFFER]) == [
            v for _, _, v, _ in DIFFER
        ]


REASONING = [
    r"<think>r</think> so \boxed{4}",
    r"<think>\boxed{4}",
    r"<think>\boxed{5}</think>\boxed{4}",
    r"\boxed{4}",
    r"<think>a</think>b</think>\boxed{4}",
    r"<think>x</think>\boxed{\sqrt{2}}",
]
REASONING_SOLUTION, LENGTHS = ["4", "4", "4", "4", "4", r"\sqrt{2}"], [0, 10, 50, 100, 150, 3]


def test_reasoning_and_cosine_rewards_agree_with_trl():
    """Recorded from TRL 1.16 with math-verify 0.9.0 (re-checked where it is installed). Cosine, row 1: right at
    10 of 100 tokens,"""
    (
        " 0.5 + 0.25·(1 + cos(0.1π)) = 0.98776; row 2: two boxes {5, 4} are wrong at 50 tokens, -0.5 - 0.25 "
        "= -0.75."
    )
    completions, ids = as_chat(REASONING), [[1] * n for n in LENGTHS]
    reasoning, cosine = [1.0, 0.0, 1.0, 0.0, 1.0, None], [1.0, 0.9877641290737884, -0.75, 0.5, 0.5, None]
    assert rewards.reasoning_accuracy_reward(completions, REASONING_SOLUTION) == reasoning
    assert rewards.get_cosine_scaled_reward(100)(completions, REASONING_SOLUTION, ids) == pytest.approx(
        cosine, abs=1e-12
    )
    if importlib.util.find_spec("math_verify") is not None:
        assert trl_rewards.reasoning_accuracy_reward(completions, REASONING_SOLUTION) == reasoning
        assert trl_rewards.get_cosine_scaled_reward(100)(
            completions, REASONING_SOLUTION, ids
        ) == pytest.approx(cosine, abs=1e-12)


# --- every TRL signature, through the library's reward path
# ---------------------------------------------------------

PROMPTS, COMPLETIONS, IDS = ["1+1=", "2+2=", "3+3="], [" 2", " 5 5 5", " 6"], [[5, 0], [6, 9, 9, 9, 0], [7]]


def tokens_only(completion_ids, **kwargs):
    return [float(len(t)) for t in completion_ids]


def completions_only(completions):
    return [float(len(c)) for c in completions]


def prompts_and_completions(prompts, completions):
    return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]


def everything(**kwargs):
    return [
        float(len(kwargs["completion_ids"][i]) + (kwargs["answer"][i] == c.strip()))
        for i, c in enumerate(kwargs["completions"])
    ]


def positional(p, c):
    return [float(len(x)) for x in c]


def booleans(completions, answer, **kwargs):
    return [c.strip() == a for c, a in zip(completions, answer)]


def not_applicable(completions, answer, **kwargs):
    return [None if a is None else 1.0 for a in answer]


@pytest.mark.parametrize(
    "reward,expected",
    [
        # TRL's overlong punishment reads only the token ids
        (tokens_only, [2.0, 5.0, 1.0]),
        (completions_only, [2.0, 6.0, 2.0]),
        (prompts_and_completions, [6.0, 10.0, 6.0]),
        # ids' lengths + 1 where the answer is right (rows 0 and 2)
        (everything, [3.0, 5.0, 2.0]),
        (positional, [2.0, 6.0, 2.0]),
        (booleans, [1.0, 0.0, 1.0]),  # True/False scored 1/0, as TRL does
        (not_applicable, [1.0, 1.0, float("nan")]),  # None: not applicable (NaN, left out of the sum)
        (rewards.get_soft_overlong_punishment(4, 2), [0.0, -1.0, 0.0]),  # 2 tokens free, 5 > 4: -1
    ],
)
def test_every_trl_signature_is_called(reward, expected):
    columns = dict(
        answer=["2", "4", None] if reward is not_applicable else ["2", "4", "6"], completion_ids=IDS
    )
    got = score_completions(reward, PROMPTS, COMPLETIONS, **columns)
    torch.testing.assert_close(got, torch.tensor(expected), equal_nan=True)
    nan_free = torch.nan_to_num(torch.tensor(expected), nan=0.0)
    torch.testing.assert_close(
        reward_from([reward, completions_only], [2.0, 0.0])(PROMPTS, COMPLETIONS, **columns), 2 * nan_free
    )


def test_strings_are_refused_in_one_line_naming_the_function():
    def verdict(completions, **kwargs):
        return ["good" for _ in completions]

    with pytest.raises(TypeError) as info:
        reward_from(verdict)(PROMPTS, COMPLETIONS, completion_ids=IDS)
    assert (
        str(info.value)
        == "reward function `verdict` returned non-numbers at [0, 1, 2]: ['good', 'good', 'good']"
    )


def test_a_name_the_call_lacks_is_refused_by_name():
    with pytest.raises(
        TypeError,
        match=r"reward function `tokens_named` needs 'completion_ids', which is neither `prompts`, "
        r"`completions` "
        r"nor a column",
    ):

        def tokens_named(completion_ids):
            return [0.0] * len(completion_ids)

        score_completions(tokens_named, PROMPTS, COMPLETIONS)
    with pytest.raises(ValueError, match="needs the column 'solution', which the data does not have"):
        score_completions(rewards.accuracy_reward, PROMPTS, COMPLETIONS, completion_ids=IDS)


def test_trainer_state_is_not_a_column():
    "TRL passes `trainer_state` (and its loggers) once per call; a function with **kwargs may read it."
    seen = {}

    def shaped(completions, trainer_state=None, **kwargs):
        seen["state"] = trainer_state
        return [1.0] * len(completions)

    score_completions(shaped, PROMPTS, COMPLETIONS, trainer_state={"global_step": 3}, completion_ids=IDS)
    assert seen["state"] == {"global_step": 3}


# --- a short training run
# ---------------------------------------------------------------------------------------------


def test_grpo_trains_with_soft_overlong_punishment(policy_dir, tmp_path):
    """Two GRPO steps with TRL's overlong punishment beside a text reward: its mean is logged under TRL's name,
    in [-1, 0]."""
    punish = rewards.get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=4)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        num_generations=4,
        max_completion_length=6,
        num_sample_generations=0,
        disable_tqdm=True,
        learning_rate=1e-3,
        logging_steps=1,
        reward_weights=[1.0, 0.1],
    )
    trainer = GRPOTrainer(
        AutoModelForCausalLM.from_pretrained(policy_dir),
        args=args,
        processing_class=AutoTokenizer.from_pretrained(policy_dir),
        train_dataset=load_task("prompts").select(range(16)),
        reward_funcs=[punish, completions_only],
    )
    trainer.train()
    rows = trainer.loop.state.history
    assert len(rows) == 2
    for row in rows:
        mean = row["rewards/soft_overlong_punishment_reward/mean"]
        assert -1.0 <= mean <= 0.0
        assert row["reward"] == pytest.approx(mean + 0.1 * row["rewards/completions_only/mean"], abs=1e-5)
    # 6-token cap, 2 free: most are punished
    assert any(row["rewards/soft_overlong_punishment_reward/mean"] < 0 for row in rows)
