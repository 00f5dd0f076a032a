"""The vectorised math core against plain per-row Python loops, on many random inputs.

The notebooks test hand-worked examples; here each function meets an independent, obviously
correct implementation on random shapes, masks and values, including batches of one and rows
with a single real token.
"""

import math
import random

import pytest
import torch

from instruct_goose import (
    compute_gae,
    compute_rewards,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    rloo_advantages,
    truncate_after_stop,
)
from instruct_goose.core import assert_tensor

SEEDS = range(20)


def random_prefix_mask(g, batch, length):
    "Right-padded mask: each row has 1..length real tokens."
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    return torch.arange(length)[None, :] < lengths[:, None]


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_stats_match_the_counted_values(seed):
    g = torch.Generator().manual_seed(seed)
    batch, length = random.Random(seed).randint(1, 5), random.Random(seed + 1).randint(1, 9)
    x = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=g) > 0.5
    mask[0, 0] = True
    counted = x[mask]
    assert_tensor(masked_mean(x, mask), counted.mean(), eps=1e-12)
    expected_var = counted.var() if counted.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    assert_tensor(masked_var(x, mask), expected_var, eps=1e-12)
    whitened = masked_whiten(x, mask)
    assert_tensor(whitened[mask], (counted - counted.mean()) / torch.sqrt(expected_var + 1e-8), eps=1e-9)
    assert_tensor(whitened[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))


def gae_loop(rewards, values, length, gamma, lam):
    advantages, next_advantage, next_value = [0.0] * length, 0.0, 0.0
    for t in reversed(range(length)):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t], next_value = next_advantage, values[t]
    return advantages


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_and_rewards_match_row_loops(seed):
    g = torch.Generator().manual_seed(seed)
    batch, length = 1 + seed % 4, 1 + seed % 7
    mask = random_prefix_mask(g, batch, length)
    scores = torch.randn(batch, generator=g, dtype=torch.float64)
    logprobs = -torch.rand(batch, length, generator=g, dtype=torch.float64)
    ref_logprobs = -torch.rand(batch, length, generator=g, dtype=torch.float64)
    values = torch.randn(batch, length, generator=g, dtype=torch.float64)
    gamma, lam, kl_coef = 0.5 + 0.5 * random.Random(seed).random(), 0.9, 0.3
    rewards, _, _ = compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    for b in range(batch):
        n = int(mask[b].sum())
        row_rewards = [-kl_coef * (logprobs[b, t] - ref_logprobs[b, t]).item() for t in range(n)]
        row_rewards[-1] += scores[b].item()
        assert_tensor(rewards[b], row_rewards + [0.0] * (length - n), eps=1e-12)
        row_adv = gae_loop(row_rewards, values[b, :n].tolist(), n, gamma, lam)
        assert_tensor(advantages[b], row_adv + [0.0] * (length - n), eps=1e-12)
        assert_tensor(
            returns[b],
            [a + v for a, v in zip(row_adv, values[b, :n].tolist())] + [0.0] * (length - n),
            eps=1e-12,
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_policy_loss_matches_token_loop(seed):
    g = torch.Generator().manual_seed(seed)
    batch, length, eps = 3, 5, 0.2
    old = -torch.rand(batch, length, generator=g, dtype=torch.float64)
    new = old + 0.5 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=g, dtype=torch.float64)
    mask = random_prefix_mask(g, batch, length)
    loss, ratios, clipfrac = policy_loss(old, new, adv, mask, eps)
    terms, clipped = [], []
    for b, t in mask.nonzero().tolist():
        ratio, a = math.exp(new[b, t] - old[b, t]), adv[b, t].item()
        surrogate = min(ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a)
        terms.append(-surrogate)
        clipped.append(surrogate != ratio * a)
    assert_tensor(loss, sum(terms) / len(terms), eps=1e-12)
    assert_tensor(clipfrac, sum(clipped) / len(clipped), eps=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    prompts, k = 1 + seed % 5, 2 + seed % 4
    rewards = torch.randn(prompts * k, generator=g, dtype=torch.float64)
    expected = torch.empty_like(rewards)
    for b in range(prompts):
        for i in range(k):
            others = [rewards[b * k + j].item() for j in range(k) if j != i]
            expected[b * k + i] = rewards[b * k + i] - sum(others) / (k - 1)
    assert_tensor(rloo_advantages(rewards, k), expected, eps=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(2, 4, 50, generator=g)).to(dtype)
    labels = torch.randint(0, 50, (2, 4), generator=g)
    temperature = 0.5 + seed / 10
    expected = torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert_tensor(logprobs_from_logits(logits, labels, temperature), expected, eps=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_truncate_after_stop_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (4, 7), generator=g)
    stops, pad = [0, 5], 99
    new_ids, mask = truncate_after_stop(ids, stops, pad)
    for b in range(4):
        row, seen = [], False
        for token in ids[b].tolist():
            row.append(pad if seen else token)
            seen = seen or token in stops
        assert_tensor(new_ids[b], row)
        assert_tensor(mask[b], [token != pad for token in row])
