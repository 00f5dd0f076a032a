"""The seeds' signatures are the library's contract (issue 59): the names, order and defaults of `Agent`,
`AgentObjective`, `RLHFTrainer` and its `compute_loss`, `PPOLoss` (torchtune's) and its `forward`, and RLOO's config
fields, read here with `inspect`, so that a rename fails a test. What the library adds comes after the seed's
parameters, each with a default, so that every call written against the seed still runs; a parameter the library
renamed keeps the seed's name working as an alias."""

import dataclasses, inspect

import pytest

from instruct_goose import (
    Agent,
    AgentObjective,
    PPOLoss,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    task_tokenizer,
    tiny_causal_lm,
)

REQUIRED = inspect.Parameter.empty
SEEDS = {  # each seed's parameters, in order, with their defaults (REQUIRED: none)
    "Agent": (Agent, [("model", REQUIRED)]),
    "AgentObjective": (
        AgentObjective,
        [
            ("model", REQUIRED),
            ("sft_model", REQUIRED),
            ("reward_model", REQUIRED),
            ("gamma", REQUIRED),
            ("beta", REQUIRED),
        ],
    ),
    "RLHFTrainer.compute_loss": (
        RLHFTrainer.compute_loss,
        [
            ("query_ids", REQUIRED),
            ("query_attention_mask", REQUIRED),
            ("response_ids", REQUIRED),
            ("response_attention_mask", REQUIRED),
            ("rewards", REQUIRED),
        ],
    ),
    "PPOLoss": (PPOLoss, [("epsilon", 0.1), ("value_clip_range", 0.2), ("value_coeff", 0.1)]),  # torchtune's
    "PPOLoss.forward": (
        PPOLoss.forward,
        [
            ("pi_old_logprobs", REQUIRED),
            ("pi_logprobs", REQUIRED),
            ("advantages", REQUIRED),
            ("phi_old_values", REQUIRED),
            ("phi_values", REQUIRED),
            ("returns", REQUIRED),
            ("padding_masks", None),
            ("value_padding_masks", None),
        ],
    ),
}
RLOO_FIELDS = {
    "rloo_k": 2,
    "normalize_reward": False,
    "reward_clip_range": None,
    "normalize_advantage": False,
    "token_level_kl": False,
}


def _parameters(f):
    return [p for p in inspect.signature(f).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", SEEDS)
def test_seed_parameters_keep_their_names_order_and_defaults(name):
    f, seed = SEEDS[name]
    parameters = _parameters(f)
    assert [(p.name, p.default) for p in parameters[: len(seed)]] == seed
    # what was added after them: optional, so seed calls still run
    for p in parameters[len(seed) :]:
        assert p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not REQUIRED, (
            f"{name}: {p.name} is required"
        )


def test_rlhf_trainer_takes_the_seeds_model_ref_model_config():
    # TRL's `args` third
    assert [p.name for p in _parameters(RLHFTrainer)[:3]] == ["model", "ref_model", "args"]
    config = RLHFConfig(output_dir="unused", response_length=6, disable_tqdm=True)
    by_position = RLHFTrainer(
        tiny_causal_lm(task_tokenizer(), seed=0), None, config, processing_class=task_tokenizer()
    )
    by_seed_name = RLHFTrainer(
        model=tiny_causal_lm(task_tokenizer(), seed=0),
        ref_model=None,
        config=config,
        processing_class=task_tokenizer(),
    )
    assert by_position.config is config and by_seed_name.config is config


def test_rloo_seed_fields_keep_their_names_and_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(RLOOConfig)}
    assert {name: fields.get(name, "missing") for name in RLOO_FIELDS} == RLOO_FIELDS
    given = dict(
        rloo_k=4, normalize_reward=True, reward_clip_range=3.0, normalize_advantage=True, token_level_kl=True
    )
    config = RLOOConfig(output_dir="unused", per_device_train_batch_size=4, **given)
    # [−c, c]
    assert {name: getattr(config, name) for name in given} == given | {"reward_clip_range": (-3.0, 3.0)}


def test_ppo_loss_takes_torchtunes_names_and_trls():
    seed = PPOLoss(epsilon=0.2, value_clip_range=0.3, value_coeff=0.5)
    trl = PPOLoss(cliprange=0.2, cliprange_value=0.3, vf_coef=0.5)
    assert (seed.epsilon, seed.value_clip_range, seed.value_coeff) == (0.2, 0.3, 0.5)
    assert (trl.epsilon, trl.value_clip_range, trl.value_coeff) == (0.2, 0.3, 0.5)
    with pytest.raises(ValueError, match="give `epsilon` or its TRL name `cliprange`, not both"):
        PPOLoss(epsilon=0.3, cliprange=0.2)
