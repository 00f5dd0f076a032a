"""PPO with a KL penalty, built from instruct_goose's math core alone, on a toy "language".

The policy writes responses of up to 6 tokens from an 8-token vocabulary; its logits depend on
the position only (a table, no network), so the whole run takes a few seconds on a CPU. The
reward counts the "honk" tokens in a response and subtracts 2 when the response never
stops (no <eos>). A KL penalty to the starting (uniform) policy, steered by the adaptive KL
controller, keeps the policy from collapsing onto one response.

Every step is the InstructGPT/PPO recipe the trainers will run on real models: sample, cut each
response after its first stop token, score, per-token log-probabilities of policy and reference,
shaped rewards (-beta*KL per token + score on the last real token), GAE, whitened advantages,
then epochs of minibatch PPO updates.
"""
import argparse

import torch

from instruct_goose import (AdaptiveKLController, PPOLoss, compute_gae, compute_rewards, entropy_from_logits,
                            logprobs_from_logits, masked_mean, masked_whiten, truncate_after_stop)

WORDS = ["<eos>", "<pad>", "the", "goose", "says", "quack", "moo", "honk"]
EOS, PAD, HONK = 0, 1, 7
LENGTH, VOCAB = 6, len(WORDS)
NEVER = torch.tensor([0.0, -30.0] + [0.0] * (VOCAB - 2))  # the pad token is never sampled


def score(ids, mask, missing_eos_penalty=2.0):
    "+1 for every real 'honk', minus `missing_eos_penalty` when the response has no <eos>."
    honks = ((ids == HONK) & mask).sum(1).float()
    stopped = ((ids == EOS) & mask).any(1)
    return honks - missing_eos_penalty * (~stopped).float()


def decode(ids, mask): return " ".join(WORDS[i] for i, real in zip(ids.tolist(), mask.tolist()) if real)


def train(steps=40, batch=64, epochs=4, minibatches=4, seed=0, log_every=5, verbose=True):
    "Train the table policy with PPO; return the mean score of each step's rollout."
    torch.manual_seed(seed)
    policy = torch.zeros(LENGTH, VOCAB, requires_grad=True)   # logits of π_φ(y_t), one row per position
    reference = torch.zeros(LENGTH, VOCAB)                      # π_ref: the policy we started from
    value_head = torch.zeros(LENGTH, requires_grad=True)        # V(t), one value per position
    optimizer = torch.optim.Adam([policy, value_head], lr=0.05)
    ppo = PPOLoss(cliprange=0.2, cliprange_value=0.2, vf_coef=0.5)
    kl_ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=500)
    history = []
    for step in range(steps):
        with torch.no_grad():                                    # the rollout: constants of this step
            logits = (policy + NEVER).expand(batch, -1, -1)
            ids, mask = truncate_after_stop(torch.distributions.Categorical(logits=logits).sample(), EOS, PAD)
            logprobs = logprobs_from_logits(logits, ids)
            ref_logprobs = logprobs_from_logits((reference + NEVER).expand(batch, -1, -1), ids)
            values = value_head.expand(batch, -1).clone()
            scores = score(ids, mask)
            rewards, kl, non_score_reward = compute_rewards(scores, logprobs, ref_logprobs, mask, kl_ctl.value)
            advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=0.95)
            advantages = masked_whiten(advantages, mask)
        for _ in range(epochs):
            for mb in torch.randperm(batch).chunk(minibatches):
                new_logits = (policy + NEVER).expand(len(mb), -1, -1)
                loss, pg_loss, vf_loss, ratio, clipfrac = ppo(
                    logprobs[mb], logprobs_from_logits(new_logits, ids[mb]), advantages[mb],
                    values[mb], value_head.expand(len(mb), -1), returns[mb], mask[mb])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        mean_kl = kl.sum(1).mean()
        kl_ctl.update(mean_kl, n_steps=batch)
        history.append(scores.mean().item())
        if verbose and (step % log_every == 0 or step == steps - 1):
            entropy = masked_mean(entropy_from_logits(logits), mask)
            print(f"{step:>4}  {scores.mean():>15.3f}  {mean_kl:>12.3f}  {kl_ctl.value:>17.4f}  {entropy:>17.3f}"
                  f"  {pg_loss:>15.3f}  {clipfrac:>19.3f}  {decode(ids[0], mask[0])}")
    return history


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("instruct_goose demo: the math core (masks, shaped rewards, GAE, PPOLoss, adaptive KL) trains a\n"
          "table policy on a toy vocabulary. This is the library's shortest honest end-to-end run until\n"
          "the trainers land; the full SFT -> reward model -> PPO demo on a tiny GPT-2 replaces it then.\n")
    print(f"{'step':>4}  {'objective/scores':>15}  {'objective/kl':>12}  {'objective/kl_coef':>17}  "
          f"{'objective/entropy':>17}  {'loss/policy_avg':>15}  {'policy/clipfrac_avg':>19}  sample")
    history = train(steps=args.steps, seed=args.seed)
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    print(f"\nmean score over the first 5 steps {first:.2f} -> last 5 steps {last:.2f} "
          f"(best possible {LENGTH - 1}: five honks then <eos>)")


if __name__ == "__main__":
    main()
