"""Chat RL on the chat variant of the built-in task (issue 17): after a tiny chat SFT, sampling starts from the prompt rendered
with the generation prompt and stops at `<|im_end|>`; a chat PPO run with a reward function written the TRL way
(`f(completions, **kwargs)` over messages) and a chat RLOO run with a chat reward model each raise the score on held-out prompts."""

import copy
import math
import os

import pytest
import torch

from instruct_goose import RLHFConfig, RLHFTrainer, RLOOConfig, RLOOTrainer
from instruct_goose.toy import chat_task_tokenizer, gold_score, load_task, tiny_causal_lm
from instruct_goose.sft import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from instruct_goose.onpolicy import evaluate_policy

# the RL runs' seed: 0 in the suite (the margins below were set from seeds 0-5)
SEED = int(os.environ.get("CHAT_RL_SEED", 0))


@pytest.fixture(scope="session")
def chat_sft(tmp_path_factory):
    """(tokenizer, SFT model): 40 steps of chat SFT on the task's conversations (the run of tests/test_chat.py),
    a few seconds."""
    tok, out = chat_task_tokenizer(), tmp_path_factory.mktemp("chat_sft")
    config = SFTConfig(
        output_dir=str(out),
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        max_steps=40,
        warmup_steps=4,
        disable_tqdm=True,
        seed=0,
        assistant_only_loss=True,
    )
    sft = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        args=config,
        train_dataset=load_task("sft", chat=True),
        processing_class=tok,
    )
    sft.train()
    model = sft.model
    return tok, model.eval()


@pytest.fixture(scope="session")
def chat_rm(chat_sft, tmp_path_factory):
    """A reward model trained on the chat preference pairs from a copy of the SFT model (the RM shares its trunk:
    the SFT model stays as it was)."""
    tok, sft = chat_sft
    # RewardTrainer draws the new score head before it applies `seed` (reported): the same head whichever
    # tests ran first
    torch.manual_seed(0)
    config = RewardConfig(
        output_dir=str(tmp_path_factory.mktemp("chat_rm")),
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        max_steps=20,
        warmup_steps=2,
        disable_tqdm=True,
        seed=0,
    )
    trainer = RewardTrainer(
        copy.deepcopy(sft),
        args=config,
        train_dataset=load_task("preferences", chat=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer.reward_model.eval()


def held_out_prompts(repeats: int = 4) -> list:
    """The 64 held-out chat prompts, each `repeats` times: 256 samples make the mean score's standard error small
    (see the margins)."""
    return list(load_task("prompts", "eval", chat=True)["prompt"]) * repeats


def score_before_after(trained, sft, tok, reward, response_length):
    """(metrics, records) of the trained policy against the SFT model on the held-out prompts, both sampled from
    one seed (common random numbers)."""
    return evaluate_policy(
        trained, sft, tok, held_out_prompts(), reward, response_length=response_length, seed=123
    )


def vader_reward(completions, **kwargs):
    """A reward function written the TRL way: completions as message lists, the task's gold judge (VADER) on the
    assistant's text."""
    assert all(c[-1]["role"] == "assistant" and "<|im_end|>" not in c[-1]["content"] for c in completions)
    return gold_score(None, [c[-1]["content"] for c in completions])


def test_chat_sft_samples_start_at_the_generation_prompt_and_end_the_turn(chat_sft, tmp_path):
    tok, sft = chat_sft
    seen = []

    def record(prompts, completions, **kwargs):
        seen.append((prompts, completions))
        return [0.0] * len(completions)

    args = RLOOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_generations=2,
        max_completion_length=24,
        num_sample_generations=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = RLOOTrainer(
        model=copy.deepcopy(sft),
        args=args,
        processing_class=tok,
        train_dataset=load_task("prompts", chat=True),
        reward_funcs=record,
    )
    rows = load_task("prompts", "eval", chat=True)[:32]
    _, samples = trainer.sample_rollout(trainer.model, rows, seed=0)
    # ChatML with the assistant's turn opened: "<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
    # each prompt k = 2 times
    rendered = [
        f"<|im_start|>user\n{p[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
        for p in rows["prompt"]
        for _ in range(2)
    ]
    assert samples.prompts == rendered
    # what the policy saw
    assert [
        tok.decode(q[m.bool()]) for q, m in zip(samples.query_ids, samples.query_attention_mask)
    ] == rendered
    # the reward gets the conversations themselves
    assert seen[0][0] == [p for p in rows["prompt"] for _ in range(2)]
    ids, mask = samples.response_ids, samples.response_mask.bool()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == eos
    last = ids[torch.arange(len(ids)), mask.sum(1) - 1]  # each response's last real token
    stopped = ((ids == eos) & mask).any(1)
    # a response that stops ends at the stop: nothing after it
    assert torch.equal(last == eos, stopped)
    # The SFT replies are 13.5 tokens on average with their <|im_end|> (20 at most), so 24 leave room: 56 of
    # these 64 rows stopped (0.875).
    assert stopped.float().mean() > 0.75, stopped.float().mean()
    # The untrained model stops by chance: about 1 − (513/514)^24 ≈ 4.6% of rows if its next token were
    # uniform over the 514 tokens
    # (2 of these 64 rows stopped).
    raw = RLOOTrainer(
        model=tiny_causal_lm(tok, seed=0),
        args=args,
        processing_class=tok,
        train_dataset=load_task("prompts", chat=True),
        reward_funcs=record,
    )
    _, untrained = raw.sample_rollout(raw.model, rows, seed=0)
    assert ((untrained.response_ids == eos) & untrained.response_mask.bool()).any(1).float().mean() < 0.25


def test_chat_ppo_with_a_trl_style_reward_function_raises_the_score(chat_sft, tmp_path):
    tok, sft = chat_sft
    args = RLHFConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        response_length=12,
        max_steps=32,
        learning_rate=3e-3,
        kl_coef=0.02,
        num_sample_generations=0,
        disable_tqdm=True,
        seed=SEED,
    )
    trainer = RLHFTrainer(
        model=copy.deepcopy(sft),
        args=args,
        processing_class=tok,
        train_dataset=load_task("prompts", chat=True),
        reward_funcs=vader_reward,
    )
    trainer.train()
    metrics, _ = score_before_after(trainer.model, sft, tok, vader_reward, 12)
    before, after, win = metrics["eval/reward_ref"], metrics["eval/reward"], metrics["eval/reward_win_rate"]
    # VADER is in [-1, 1]; the SFT model's completions score −0.012 (std 0.23 over the 256 samples: standard
    # error 0.014). Seeds 0-5
    # of this run measured rises of 0.80, 0.74, 0.83, 0.80, 0.79, 0.78 and win rates 0.94-0.98 (at 24 steps
    # seed 3 rose only 0.14, hence
    # 32): a rise of 0.4 is nearly 30 standard errors of the measurement and about half the smallest rise.
    assert after - before > 0.4 and win > 0.75, (before, after, win)
    assert math.isfinite(metrics["eval/kl"])


def test_chat_rloo_with_a_chat_reward_model_raises_the_score(chat_sft, chat_rm, tmp_path):
    tok, sft = chat_sft
    args = RLOOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=12,
        beta=0.02,
        num_iterations=4,
        max_steps=16,
        learning_rate=1e-3,
        num_sample_generations=0,
        disable_tqdm=True,
        seed=SEED,
    )
    trainer = RLOOTrainer(
        model=copy.deepcopy(sft),
        args=args,
        processing_class=tok,
        train_dataset=load_task("prompts", chat=True),
        reward_funcs=chat_rm,
    )
    trainer.train()
    metrics, _ = score_before_after(trainer.model, sft, tok, chat_rm, 12)
    before, after, win = metrics["eval/reward_ref"], metrics["eval/reward"], metrics["eval/reward_win_rate"]
    # The reward model scores the SFT model's completions −0.71 on average (std 0.72 over the 256 samples:
    # standard error 0.045). Seeds
    # 0-5 of this run measured rises of 0.92, 1.26, 0.79, 1.17, 0.73, 0.47 and win rates 0.81-0.99 (at 12
    # steps seed 5 rose only 0.33,
    # hence 16): a rise of 0.25 is over 5 standard errors of the measurement and about half the smallest rise.
    assert after - before > 0.25 and win > 0.7, (before, after, win)
    assert math.isfinite(metrics["eval/kl"])
