"""Our GRPO loss against TRL 1.16's own `GRPOTrainer._compute_loss`, on one fixed rollout, for every loss type and importance-sampling level.

TRL's method runs unchanged on a bare `GRPOTrainer` object carrying only the attributes it reads; its model pass
(`_get_per_token_logps_and_entropies`) is replaced by a leaf tensor of log-probabilities, so both sides differentiate
the same numbers. The rollout: 4 completions of lengths 5, 2, 7, 4 (padding after), ratios from 0.62 to 2.01,
advantages of both signs, β = 0.04 with a reference different from both policies, `use_bias_correction_kl` on (TRL's
default), and the options each loss type comes with. Loss and gradient must agree to float error.
"""

import dataclasses
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from trl import GRPOConfig as TRLGRPOConfig
from trl import GRPOTrainer as TRLGRPOTrainer
from trl import RLOOConfig as TRLRLOOConfig
from transformers import TrainingArguments

from instruct_goose.core import entropy_from_logits, logprobs_from_logits, masked_mean
from instruct_goose.grpo import (
    _LOSS_TYPES,
    GRPOConfig,
    aggregate,
    clip_stats,
    grpo_token_loss,
    high_entropy_mask,
    off_policy_mask,
)
from instruct_goose.losses import AdaptiveEntropyController
from instruct_goose.rloo import RLOOConfig
from instruct_goose.trl_names import TRL_REFUSED as _TRL_REFUSED

T, LENGTHS, MAX_LEN = 7, (5, 2, 7, 4), 8


def _rollout():
    "A fixed rollout: masks of varied lengths, π_θ, π_old and π_ref all different, both signs of advantage."
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    logprobs = -torch.rand(4, T, generator=g) * 2 - 0.1
    # log-ratios in [-0.48, 0.70]: ρ from 0.62 to 2.01
    old = logprobs - (torch.rand(4, T, generator=g) * 1.18 - 0.48)
    ref = logprobs + torch.randn(4, T, generator=g) * 0.3
    advantages = torch.tensor([1.3, -0.7, 0.4, -1.1])
    return mask, logprobs, old, ref, advantages


def _trl_trainer(**options):
    """A `GRPOTrainer` holding only what `_compute_loss` reads, from a TRL `GRPOConfig` (TRL's defaults, then
    `options`)."""
    args = TRLGRPOConfig(
        output_dir="/tmp/unused",
        beta=0.04,
        max_completion_length=MAX_LEN,
        report_to="none",
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
        **options,
    )
    t = TRLGRPOTrainer.__new__(TRLGRPOTrainer)
    t.args, t.accelerator, t._metrics = (
        args,
        Accelerator(cpu=True),
        {"train": defaultdict(list), "eval": defaultdict(list)},
    )
    for name in (
        "beta",
        "loss_type",
        "importance_sampling_level",
        "off_policy_mask_threshold",
        "top_entropy_quantile",
        "max_completion_length",
        "use_vllm",
        "entropy_coef",
        "use_adaptive_entropy",
    ):
        setattr(t, name, getattr(args, name))
    t.epsilon_low, t.epsilon_high = (
        args.epsilon,
        args.epsilon if args.epsilon_high is None else args.epsilon_high,
    )
    t.model, t.current_gradient_accumulation_steps = SimpleNamespace(training=True), 1
    t._entropy_bonus_enabled, t.aux_loss_enabled = (
        args.entropy_coef != 0.0 or args.use_adaptive_entropy,
        False,
    )
    return t


def _trl_loss(t, logprobs, old, ref, advantages, mask):
    "TRL's loss with its model pass replaced by `logprobs`."
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logprobs, torch.ones_like(logprobs), None)
    inputs = {
        "prompt_ids": torch.zeros(4, 1, dtype=torch.long),
        "prompt_mask": torch.ones(4, 1, dtype=torch.long),
        "completion_ids": torch.zeros(4, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return t._compute_loss(None, inputs)


OPTIONS = {
    "cispo": {"epsilon_high": 5.0},
    "dapo": {"epsilon_high": 0.28},
    "grpo": {"delta": 1.5},
    "bnpo": {"off_policy_mask_threshold": 0.05},
    "sapo": {},
    "luspo": {},
    "vespo": {},
    "dr_grpo": {},
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", _LOSS_TYPES)
def test_loss_and_gradient_equal_trl(loss_type, level):
    mask, logprobs, old, ref, advantages = _rollout()
    options = {"loss_type": loss_type, "importance_sampling_level": level, **OPTIONS[loss_type]}
    t = _trl_trainer(**options)
    theirs_lp = logprobs.clone().requires_grad_()
    theirs = _trl_loss(t, theirs_lp, old, ref, advantages, mask)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_lp)
    a = t.args
    ours_lp = logprobs.clone().requires_grad_()
    token_loss, _, _ = grpo_token_loss(
        ours_lp,
        old,
        advantages,
        mask,
        a.epsilon,
        t.epsilon_high,
        ref,
        a.beta,
        level,
        loss_type,
        a.delta,
        (a.sapo_temperature_pos, a.sapo_temperature_neg),
        (a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg),
        a.use_bias_correction_kl,
        a.off_policy_mask_threshold,
    )
    ours, _ = aggregate(token_loss, mask, loss_type, MAX_LEN)
    (ours_grad,) = torch.autograd.grad(ours, ours_lp)
    assert a.use_bias_correction_kl  # TRL 1.16's default is what we compare
    assert abs(ours.item() - theirs.item()) <= 1e-6 * max(1.0, abs(theirs.item())), (
        ours.item(),
        theirs.item(),
    )
    assert (ours_grad - theirs_grad).abs().max().item() <= 1e-6, (ours_grad - theirs_grad).abs().max().item()
    assert theirs_grad.abs().max().item() > 1e-3  # a real gradient, not two zeros


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "cispo"])
def test_clip_statistics_equal_trl(loss_type, level):
    """The clip statistics TRL logs from its loss (`clip_ratio/*` with `low_min` and `high_max`, or
    `cispo_clip_ratio`) are `clip_stats` of our ratio."""
    mask, logprobs, old, ref, advantages = _rollout()
    t = _trl_trainer(
        loss_type=loss_type,
        importance_sampling_level=level,
        **{**OPTIONS[loss_type], "epsilon_high": 1.0 if loss_type == "cispo" else 0.28},
    )
    _trl_loss(t, logprobs, old, ref, advantages, mask)
    theirs = {k: v[-1] for k, v in t._metrics["train"].items() if "clip_ratio" in k}
    a = t.args
    _, ratio, _ = grpo_token_loss(
        logprobs,
        old,
        advantages,
        mask,
        a.epsilon,
        t.epsilon_high,
        ref,
        a.beta,
        level,
        loss_type,
        a.delta,
        (a.sapo_temperature_pos, a.sapo_temperature_neg),
        (a.vespo_k_pos, a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg),
        a.use_bias_correction_kl,
        a.off_policy_mask_threshold,
    )
    ours = clip_stats(
        ratio,
        advantages,
        mask,
        SimpleNamespace(
            loss_type=loss_type,
            cliprange=a.epsilon,
            clip_high=t.epsilon_high,
            importance_sampling_level=level,
        ),
    )
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    for name, value in theirs.items():
        assert ours[name].item() == pytest.approx(value, abs=1e-6), (name, ours[name].item(), value)
    # something was clipped: the numbers can differ
    assert any(v > 0 for v in theirs.values()), theirs


def test_rollout_is_off_policy_as_described():
    "The rollout has the ratios the docstring says, so clipping, the masks and the KL weighting all act."
    mask, logprobs, old, _, advantages = _rollout()
    ratio = torch.exp(logprobs - old)[mask]
    assert 0.6 < ratio.min().item() < 0.7 and 1.9 < ratio.max().item() < 2.1
    assert off_policy_mask(
        logprobs, old, advantages, mask, OPTIONS["bnpo"]["off_policy_mask_threshold"]
    ).flatten().tolist() == [1, 0, 1, 1]
    above_delta = (torch.exp(logprobs - old) > OPTIONS["grpo"]["delta"]) & mask & (advantages[:, None] < 0)
    assert above_delta.any()  # `delta` caps something


def _other(value):
    "A value different from a field's default, of a plausible type."
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "_other"
    return 1


def _trl_added(trl_config):
    "The fields TRL 1.16's config adds to 🤗 `TrainingArguments`, with TRL's defaults."
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    default = lambda f: f.default_factory() if f.default is dataclasses.MISSING else f.default
    return {f.name: default(f) for f in dataclasses.fields(trl_config) if f.name not in base}


@pytest.mark.parametrize(
    "trl_config, ours, counts",
    [(TRLGRPOConfig, GRPOConfig, (77, 54, 23, 18)), (TRLRLOOConfig, RLOOConfig, (51, 34, 17, 13))],
)
def test_every_trl_field_is_taken_or_refused(trl_config, ours, counts):
    """Each field TRL 1.16 adds to `TrainingArguments` exists here: taken at TRL's default, or refused by name in
    one line when set."""
    added = _trl_added(trl_config)
    assert not [name for name in added if name not in {f.name for f in dataclasses.fields(ours)}]
    refused, declared = (
        [name for name in added if name in _TRL_REFUSED],
        {f.name: f.default for f in dataclasses.fields(ours)},
    )
    # declared at TRL's default (but `disable_dropout`: always on here), refused away from it
    for name in refused:
        assert declared[name] == added[name] or name == "disable_dropout", name
        with pytest.raises(ValueError) as error:
            ours(per_device_train_batch_size=8, **{name: _other(declared[name])})
        message = str(error.value)
        assert message.startswith(f"`{name}`=") and "\n" not in message, message
        # vLLM: the built-in settings instead
        assert ("set `temperature`, `max_completion_length`" in message) == ("vllm" in name), message
    taken = [name for name in added if name not in _TRL_REFUSED]
    for name in taken:
        config = ours(per_device_train_batch_size=8, **{name: added[name]})
        assert getattr(config, name) == added[name] or name == "scale_rewards", name
    vllm = [name for name in refused if "vllm" in name]
    assert (len(added), len(taken), len(refused), len(vllm)) == counts, (
        len(added),
        len(taken),
        len(refused),
        len(vllm),
        taken,
    )


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_entropy_bonus_equal_trl(loss_type):
    """`entropy_coef`: TRL's loss − coef × the mean entropy of the completion tokens, differentiated through the
    logits on both sides."""
    mask, _, _, ref, advantages = _rollout()
    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(4, T, 5, generator=g), torch.randint(0, 5, (4, T), generator=g)

    def logprobs_and_entropy(x):
        lp = torch.log_softmax(x, -1)
        return lp.gather(-1, ids[..., None])[..., 0], -(lp.exp() * lp).sum(-1)

    old = logprobs_and_entropy(logits)[0] - (torch.rand(4, T, generator=g) * 1.18 - 0.48)
    t = _trl_trainer(loss_type=loss_type, entropy_coef=0.03)
    theirs_logits = logits.clone().requires_grad_()
    t._get_per_token_logps_and_entropies = lambda *a, **k: (*logprobs_and_entropy(theirs_logits), None)
    inputs = {
        "prompt_ids": torch.zeros(4, 1, dtype=torch.long),
        "prompt_mask": torch.ones(4, 1, dtype=torch.long),
        "completion_ids": ids,
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    theirs = TRLGRPOTrainer._compute_loss(t, None, inputs)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logits)
    ours_logits = logits.clone().requires_grad_()
    logprobs = logprobs_from_logits(ours_logits, ids, 1.0)
    token_loss, _, _ = grpo_token_loss(
        logprobs, old, advantages, mask, 0.2, 0.2, ref, 0.04, loss_type=loss_type
    )
    ours = aggregate(token_loss, mask, loss_type, MAX_LEN)[0] - 0.03 * masked_mean(
        entropy_from_logits(ours_logits, 1.0), mask
    )
    (ours_grad,) = torch.autograd.grad(ours, ours_logits)
    assert abs(ours.item() - theirs.item()) <= 1e-6, (ours.item(), theirs.item())
    assert (ours_grad - theirs_grad).abs().max().item() <= 1e-6


def _logits_rollout(seed=1):
    """Logits (so the entropy is differentiable), token ids and π_old a little off the logits' log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    logits, ids = torch.randn(4, T, 5, generator=g), torch.randint(0, 5, (4, T), generator=g)

    def logprobs_and_entropy(x):
        lp = torch.log_softmax(x, -1)
        return lp.gather(-1, ids[..., None])[..., 0], -(lp.exp() * lp).sum(-1)

    old = logprobs_and_entropy(logits)[0] - (torch.rand(4, T, generator=g) * 1.18 - 0.48)
    return logits, ids, old, logprobs_and_entropy


def _trl_logits_loss(t, logits, ids, old, ref, advantages, mask, logprobs_and_entropy):
    t._get_per_token_logps_and_entropies = lambda *a, **k: (*logprobs_and_entropy(logits), None)
    inputs = {
        "prompt_ids": torch.zeros(4, 1, dtype=torch.long),
        "prompt_mask": torch.ones(4, 1, dtype=torch.long),
        "completion_ids": ids,
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    return TRLGRPOTrainer._compute_loss(t, None, inputs)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_top_entropy_quantile_equal_trl(loss_type):
    """`top_entropy_quantile=0.5` with a bonus: the same tokens kept (padding never ranked), the same loss and
    gradient as TRL on one micro-batch."""
    mask, _, _, ref, advantages = _rollout()
    logits, ids, old, logprobs_and_entropy = _logits_rollout()
    t = _trl_trainer(loss_type=loss_type, entropy_coef=0.03, top_entropy_quantile=0.5)
    theirs_logits = logits.clone().requires_grad_()
    theirs = _trl_logits_loss(t, theirs_logits, ids, old, ref, advantages, mask, logprobs_and_entropy)
    (theirs_grad,) = torch.autograd.grad(theirs, theirs_logits)
    ours_logits = logits.clone().requires_grad_()
    entropy = entropy_from_logits(ours_logits, 1.0)
    keep = high_entropy_mask(entropy.detach(), mask, 0.5)
    assert keep.sum().item() == math.ceil(mask.sum().item() / 2) and not (keep & ~mask).any()
    logprobs = logprobs_from_logits(ours_logits, ids, 1.0)
    token_loss, _, _ = grpo_token_loss(
        logprobs, old, advantages, mask, 0.2, 0.2, ref, 0.04, loss_type=loss_type, entropy_mask=keep
    )
    ours = aggregate(token_loss, mask, loss_type, MAX_LEN)[0] - 0.03 * masked_mean(entropy, mask & keep)
    (ours_grad,) = torch.autograd.grad(ours, ours_logits)
    assert abs(ours.item() - theirs.item()) <= 1e-6, (ours.item(), theirs.item())
    assert (ours_grad - theirs_grad).abs().max().item() <= 1e-6


def test_adaptive_entropy_equal_trl():
    """`use_adaptive_entropy` over five optimizer steps (one micro-batch each): the coefficient applied and the
    one after each step are TRL's."""
    mask, _, _, ref, advantages = _rollout()
    logits, ids, old, logprobs_and_entropy = _logits_rollout()
    # sharper logits: lower entropy, so the target is crossed both ways
    scales = (1.0, 3.0, 3.0, 0.5, 3.0)
    target = masked_mean(entropy_from_logits(logits * 2.0, 1.0), mask).item()
    t = _trl_trainer(
        loss_type="dapo",
        entropy_coef=0.01,
        use_adaptive_entropy=True,
        entropy_coef_delta=0.02,
        entropy_target=target,
    )
    t.entropy_coef, t._last_world_entropy, t._entropy_window_stats = 0.01, math.inf, None
    ours_ctl, applied = AdaptiveEntropyController(0.01, target, 0.02, 0.0, 1.0), []
    for s in scales:
        x = logits * s
        theirs = _trl_logits_loss(t, x, ids, old, ref, advantages, mask, logprobs_and_entropy)
        entropy = entropy_from_logits(x, 1.0)
        token_loss, _, _ = grpo_token_loss(
            logprobs_from_logits(x, ids, 1.0), old, advantages, mask, 0.2, 0.2, ref, 0.04, loss_type="dapo"
        )
        applied.append(ours_ctl.value)
        ours = aggregate(token_loss, mask, "dapo", MAX_LEN)[0] - ours_ctl.value * masked_mean(entropy, mask)
        ours_ctl.update(masked_mean(entropy, mask))
        assert abs(ours.item() - theirs.item()) <= 1e-6, (s, ours.item(), theirs.item())
        assert abs(ours_ctl.coef - t.entropy_coef) <= 1e-12, (ours_ctl.coef, t.entropy_coef)
    # off at first, then on, up and down
    assert applied[0] == 0.0 and len({round(a, 6) for a in applied}) >= 3, applied
