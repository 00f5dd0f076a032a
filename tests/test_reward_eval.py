"""The reward-model report, length control and ensembles end to end: a 🤗 classifier and conversational pairs in the
report, an ensemble and a length penalty as the reward of PPO and RLOO runs (a few steps), each member's score logged
beside the trainers' own metrics. The quantities themselves are checked by hand in nbs/04c_reward_eval.ipynb."""

import json
import math

import pytest
import torch
from datasets import Dataset

from instruct_goose import (
    Agent,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    RewardModel,
    task_tokenizer,
    tiny_causal_lm,
)
from instruct_goose.toy import chat_task_tokenizer, load_task
from instruct_goose.reward_eval import (
    RewardEnsemble,
    evaluate_reward_model,
    length_debiased,
    length_penalty,
    pair_scores,
    reward_report,
)

SMALL = dict(
    learning_rate=1e-3,
    per_device_train_batch_size=4,
    num_sample_generations=0,
    disable_tqdm=True,
    seed=0,
    response_length=8,
    missing_eos_penalty=None,
)
PROMPTS = Dataset.from_dict(
    {"prompt": ["Review: The film", "Review: This movie", "Review: The plot", "Review: The cast"] * 2}
)


@pytest.fixture(scope="module")
def tok():
    return task_tokenizer()


@pytest.fixture(scope="module")
def members(tok):
    return [RewardModel(tiny_causal_lm(tok, seed=s), tokenizer=tok) for s in (0, 1)]


def rl_trainer(algo, tmp_path, tok, reward_funcs, **overrides):
    "A tiny PPO or RLOO trainer built the TRL way, 8-token responses."
    model = tiny_causal_lm(tok, seed=0)
    if algo == "ppo":
        kind, args, model = (
            RLHFTrainer,
            RLHFConfig(output_dir=str(tmp_path), **SMALL, **overrides),
            Agent(model),
        )
    else:
        kind, args = RLOOTrainer, RLOOConfig(output_dir=str(tmp_path), rloo_k=2, **SMALL, **overrides)
    return kind(
        model=model, args=args, processing_class=tok, train_dataset=PROMPTS, reward_funcs=reward_funcs
    )


# --- an ensemble is a reward wherever one is accepted
# ------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_ensemble_rewards_a_short_rl_run(algo, tmp_path, tok, members):
    ensemble = RewardEnsemble(members, "mean_minus_std", k=1.0)
    t = rl_trainer(algo, tmp_path, tok, ensemble, max_steps=2)
    t.train()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 2 and all(math.isfinite(r["objective/scores"]) for r in rows)
    assert all(math.isfinite(r["rewards/ensemble_mean_minus_std/mean"]) for r in rows)
    # (members, completions)
    scores = ensemble.member_scores(["Review: it"] * 4, [" was good", " was bad", " was", " was great fun"])
    assert scores.shape[0] == 2 and (scores[0] != scores[1]).any()  # two seeds, two opinions
    stats = ensemble.stats(scores)
    assert stats["rewards/ensemble/std"] > 0 and set(stats) >= {f"rewards/{n}/mean" for n in ensemble.names}
    # each member's mean and the spread, every step
    for row in rows:
        assert all(math.isfinite(row[k]) for k in stats), set(stats) - set(row)


def test_ensemble_scores_are_its_members_aggregated_inside_the_trainer(tmp_path, tok, members):
    ensemble = RewardEnsemble(members, "min")
    t = rl_trainer("rloo", tmp_path, tok, ensemble)
    _, samples = t.sample_rollout(t.model, PROMPTS[:2], seed=0)
    one, two = (m.score(samples.prompts, samples.completions) for m in members)
    torch.testing.assert_close(samples.scores, torch.minimum(one, two), rtol=0, atol=1e-5)


def test_ensemble_members_are_logged_from_the_rollouts_own_scores(tmp_path, tok, members):
    """The members' means in the trainer's statistics are those of the rollout's completions, scored by each
    member alone."""
    ensemble = RewardEnsemble(members, "mean_minus_std", k=0.5)
    t = rl_trainer("rloo", tmp_path, tok, ensemble)
    _, samples = t.sample_rollout(t.model, PROMPTS[:4], seed=0)
    alone = [m.score(samples.prompts, samples.completions) for m in members]
    stats = t.reward_model.stats(samples.reward_scores)
    for name, scores in zip(ensemble.names, alone):
        torch.testing.assert_close(stats[f"rewards/{name}/mean"], scores.mean(), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        stats["rewards/ensemble/std"], (alone[0] - alone[1]).abs().mean() / 2, rtol=0, atol=1e-5
    )
    mean, spread = (alone[0] + alone[1]) / 2, (alone[0] - alone[1]).abs() / 2
    torch.testing.assert_close(samples.scores, mean - 0.5 * spread, rtol=0, atol=1e-5)


def test_grpo_normalize_then_sum_leaves_the_members_rows_out():
    """GDPO standardises each reward's row and sums with `weights`: the members' rows weigh 0, so they change
    nothing."""
    from instruct_goose.grpo import normalized_sum_advantages
    from instruct_goose.reward import reward_from

    def one(prompts, completions):
        return [float(len(c)) for c in completions]

    def two(prompts, completions):
        return [float(c.count("a")) for c in completions]

    def three(prompts, completions):
        return [1.0] * len(completions)

    combined = reward_from([RewardEnsemble([one, two], "min"), three], [1.0, 0.5])
    rows = combined.each([""] * 4, ["a", "aab", "bbbb", "aa"])
    assert rows.shape == (4, 4) and combined.weights == [1.0, 0.5, 0.0, 0.0]
    torch.testing.assert_close(
        normalized_sum_advantages(rows, combined.weights, 2),
        normalized_sum_advantages(rows[:2], [1.0, 0.5], 2),
        rtol=0,
        atol=0,
    )


ENSEMBLE_SCRIPT = '''
import json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from instruct_goose import RLOOConfig, RLOOTrainer, load_task
from instruct_goose.reward_eval import RewardEnsemble
policy, out, accumulation = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
def long(prompts, completions): return [len(c) / 10 for c in completions]
def vowels(prompts, completions): return [float(sum(ch in "aeiou" for ch in c)) for c in completions]
reward = RewardEnsemble([long, vowels], "mean_minus_std", k=0.5)
config = RLOOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation, total_episodes=32,
                    response_length=6, local_rollout_forward_batch_size=4, num_generations=2, num_sample_generations=0,
                    disable_tqdm=True, learning_rate=1e-3)
trainer = RLOOTrainer(model, args=config, processing_class=tokenizer, reward_funcs=reward,
                      train_dataset=load_task("prompts").select(range(64)))
trainer.train()
json.dump(trainer.loop.state.history, open(f"{out}/history{os.environ.get('RANK', '0')}.json", "w"))
'''


@pytest.mark.slow  # two RLOO runs, one under torchrun: ~1 min
def test_ensemble_members_logged_over_two_processes_equal_one(policy_dir, tmp_path):
    """Each member's mean and the spread are over every process's completions: 2 processes log what 1 process
    logs."""
    import os, subprocess, sys
    from pathlib import Path

    (tmp_path / "train.py").write_text(ENSEMBLE_SCRIPT)

    def run(processes, accumulation):
        out = tmp_path / f"p{processes}"
        env = {
            **os.environ,
            "ACCELERATE_USE_CPU": "true",
            "OMP_NUM_THREADS": "1",
            "HF_DATASETS_CACHE": str(out) + "-cache",
        }
        script = [str(tmp_path / "train.py"), str(policy_dir), str(out), str(accumulation)]
        launcher = (
            [sys.executable]
            if processes == 1
            else [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2"]
        )
        result = subprocess.run(launcher + script, capture_output=True, text=True, timeout=600, env=env)
        assert result.returncode == 0, result.stderr[-8000:]
        return json.loads((out / "history0.json").read_text())

    one, two = run(1, 2), run(2, 1)
    keys = (
        "rewards/long/mean",
        "rewards/vowels/mean",
        "rewards/ensemble/std",
        "rewards/ensemble_mean_minus_std/mean",
        "rewards/ensemble_mean_minus_std/std",
    )
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        for key in keys:
            assert a[key] == pytest.approx(b[key], abs=1e-5), (a["step"], key, a[key], b[key])
    # the steps differ; the members disagree
    assert len({row["rewards/long/mean"] for row in one}) > 1 and one[0]["rewards/ensemble/std"] > 0


def test_an_ensemble_of_one_has_the_report_of_its_member(members):
    pairs = load_task("preferences", "eval").select(range(16))
    alone = evaluate_reward_model(members[0], pairs)
    for aggregation in ("mean", "min", "mean_minus_std", "mean_minus_var"):
        together = evaluate_reward_model(RewardEnsemble(members[:1], aggregation, k=2.0), pairs)
        assert together.keys() == alone.keys()
        assert all(
            math.isclose(together[k], alone[k], abs_tol=1e-5)
            or (math.isnan(together[k]) and math.isnan(alone[k]))
            for k in alone
        )


def test_ensemble_refuses_bad_settings(members):
    with pytest.raises(ValueError, match="`members` is empty"):
        RewardEnsemble([])
    with pytest.raises(ValueError, match="`k` must be"):
        RewardEnsemble(members, "mean_minus_std", k=-1)
    with pytest.raises(ValueError, match="`aggregation` must be one of"):
        RewardEnsemble(members, "max")


# --- length control in the RL trainers
# ---------------------------------------------------------------------------------


def test_length_penalty_counts_the_policys_tokens(tmp_path, tok):
    t = rl_trainer("rloo", tmp_path, tok, [length_penalty(0.25)])
    _, samples = t.sample_rollout(t.model, PROMPTS[:2], seed=0)
    torch.testing.assert_close(
        samples.scores, -0.25 * samples.response_mask.sum(1).float(), rtol=0, atol=1e-6
    )


def test_length_debiased_reward_in_a_trainer_is_its_formula(tmp_path, tok, members):
    ref = load_task("preferences")
    debiased = length_debiased(
        members[0], list(ref["prompt"][:32]) * 2, list(ref["chosen"][:32]) + list(ref["rejected"][:32])
    )
    t = rl_trainer("rloo", tmp_path, tok, debiased)
    _, samples = t.sample_rollout(t.model, PROMPTS[:2], seed=0)
    lengths = torch.tensor(
        [float(len(tok(c, add_special_tokens=False).input_ids)) for c in samples.completions]
    )
    expected = members[0].score(samples.prompts, samples.completions) - debiased.slope * (
        lengths - debiased.mean_length
    )
    torch.testing.assert_close(samples.scores, expected, rtol=0, atol=1e-5)


# --- any reward model, any preference set
# ------------------------------------------------------------------------------


def test_a_hf_classifier_is_reported_as_its_reward_model(tok, members):
    pairs = load_task("preferences", "eval").select(range(16))
    classifier = members[0].model  # a 🤗 ...ForSequenceClassification
    assert type(classifier).__name__.endswith("ForSequenceClassification")
    assert evaluate_reward_model(classifier, pairs, tokenizer=tok) == evaluate_reward_model(members[0], pairs)


def test_conversational_pairs_keep_their_groups():
    tok = chat_task_tokenizer()
    user = lambda text: [{"role": "user", "content": text}]
    reply = lambda text: [{"role": "assistant", "content": text}]
    rows = [
        {"prompt": user("hi"), "chosen": reply("hello there"), "rejected": reply("yo"), "category": "greet"},
        {"prompt": user("2+2"), "chosen": reply("4"), "rejected": reply("five"), "category": "math"},
    ]

    def characters(prompts, completions):
        return [float(len(c)) for c in completions]

    s = pair_scores(characters, rows, tokenizer=tok)
    assert s.groups == ["greet", "math"]
    report = reward_report(s)
    assert (report["eval/accuracy/greet"], report["eval/accuracy/math"]) == (1.0, 0.0)
    assert report["eval/accuracy"] == report["eval/length/prefer_longer"] == 0.5


def test_the_report_is_one_json_line(members):
    report = evaluate_reward_model(members[0], load_task("preferences", "eval").select(range(8)))
    assert all(isinstance(v, float) for v in report.values())
    assert json.loads(json.dumps(report)).keys() == report.keys()


def test_a_saved_reward_model_is_read_from_its_path_with_its_tokenizer(tmp_path, members):
    members[0].save_pretrained(tmp_path / "rm")
    pairs = load_task("preferences", "eval").select(range(8))
    from_path, in_memory = pair_scores(str(tmp_path / "rm"), pairs), pair_scores(members[0], pairs)
    # tokens, not characters
    torch.testing.assert_close(from_path.chosen_length, in_memory.chosen_length, rtol=0, atol=0)
    torch.testing.assert_close(from_path.chosen, in_memory.chosen, rtol=0, atol=1e-5)
