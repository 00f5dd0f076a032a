"""Bad input is refused early with a message that names what was wrong, or handled in a documented way.

Each case asserts the exact behaviour: the error type and the words of its message, or the values of the
documented correction. Models are tiny and built offline.
"""

import copy
import math

import pytest
import torch

from instruct_goose import (
    Agent,
    PPOLoss,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    RewardConfig,
    RewardModel,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
    ShapeError,
    TrainLoop,
    TrainingConfig,
    compute_gae,
    compute_rewards,
    create_reference_model,
    encode_prompts,
    masked_mean,
    rloo_advantages,
    score_completions,
    train_tokenizer,
    tiny_causal_lm,
)

TEXTS = ["the goose says honk", "a good film, I loved it", "the plot was dull and slow", "honk honk"] * 4


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_causal_lm(tokenizer, seed=0, max_positions=64)


def ppo_trainer(model, tokenizer, tmp_path, reward=lambda p, c: [1.0] * len(c), prompts=None, **config):
    settings = dict(
        output_dir=str(tmp_path / "ppo"),
        per_device_train_batch_size=4,
        total_episodes=4,
        response_length=4,
        num_ppo_epochs=1,
        max_prompt_length=8,
        disable_tqdm=True,
        num_sample_generations=0,
    )
    return RLHFTrainer(
        Agent(copy.deepcopy(model)),
        create_reference_model(model),
        RLHFConfig(**{**settings, **config}),
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=prompts if prompts is not None else [{"prompt": "the goose"}] * 4,
    )


# --- reward functions and reward models
# --------------------------------------------------------------------------


def test_nan_score_from_reward_function():
    with pytest.raises(ValueError, match=r"reward function `<lambda>` returned NaN or inf at \[1\]"):
        score_completions(lambda p, c: [0.0, float("nan")], ["a", "b"], ["c", "d"])


def test_inf_score_from_reward_function():
    with pytest.raises(ValueError, match=r"returned NaN or inf at \[0\]"):
        score_completions(lambda p, c: [float("inf")], ["a"], ["c"])


def test_reward_function_returns_wrong_number_of_scores():
    with pytest.raises(ValueError, match="returned 3 scores for 2 completions"):
        score_completions(lambda p, c: [1.0, 2.0, 3.0], ["a", "b"], ["c", "d"])


def test_reward_function_returns_non_numbers():
    """A string is refused; None is not a mistake (the function does not apply to that sample: TRL's GRPO
    convention)."""
    with pytest.raises(TypeError, match=r"returned non-numbers at \[0\]: \['good'\]"):
        score_completions(lambda p, c: ["good", None], ["a", "b"], ["c", "d"])


def test_nan_score_from_reward_model(tokenizer):
    reward_model = RewardModel(tiny_causal_lm(tokenizer, seed=2), tokenizer=tokenizer)
    with torch.no_grad():
        reward_model.head.weight.fill_(float("nan"))
    with pytest.raises(
        ValueError, match=r"reward model `GPT2ForSequenceClassification` returned NaN or inf at \[0\]"
    ):
        score_completions(reward_model, ["the goose"], [" says honk"])


def test_nan_score_reaching_the_rollout_is_refused():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"`scores` is NaN or infinite at rows \[0\]"):
        compute_rewards(torch.tensor([float("nan"), 1.0]), torch.zeros(2, 3), torch.zeros(2, 3), mask, 0.1)


def test_reward_model_with_another_tokenizer_reads_text_not_ids(tokenizer):
    other = train_tokenizer(["completely different words here"] * 8 + TEXTS, vocab_size=280)
    assert other.get_vocab() != tokenizer.get_vocab()
    reward_model = RewardModel(tiny_causal_lm(other, seed=1), tokenizer=other).eval()
    prompts, completions = ["the goose"], [" says honk"]
    scored = score_completions(reward_model, prompts, completions)
    ids, mask = reward_model.encode(["the goose says honk"])
    assert torch.allclose(scored, reward_model(ids, mask).detach())  # re-tokenized with its own tokenizer
    assert ids.tolist() == [other("the goose says honk").input_ids]


# --- data
# ------------------------------------------------------------------------------------------------------


def test_empty_prompt_dataset(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is empty"):
        ppo_trainer(model, tokenizer, tmp_path, prompts=[])


def test_dataset_without_prompt_column(model, tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"`train_dataset` needs the columns \('prompt',\)"):
        ppo_trainer(model, tokenizer, tmp_path, prompts=[{"question": "hi"}])


def test_prompt_plus_response_longer_than_the_context(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path, max_prompt_length=60, response_length=10)
    with pytest.raises(
        ValueError,
        match=r"`max_prompt_length` \(60\) \+ `response_length` \(10\) exceeds the model's context of 64",
    ):
        trainer.train()


def test_long_prompt_is_cut_from_the_left(tokenizer):
    ids, mask = encode_prompts(tokenizer, ["the goose says honk " * 10], max_length=5)
    assert ids.shape == (1, 5) and mask.all()
    assert ids[0].tolist() == tokenizer("the goose says honk " * 10, add_special_tokens=False).input_ids[-5:]


def test_tokenizer_without_pad_token(tokenizer):
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    with pytest.raises(ValueError, match="the tokenizer has no pad token"):
        encode_prompts(no_pad, ["the goose"])


def test_pad_equal_to_eos_trains_with_correct_masks(model, tokenizer, tmp_path):
    gpt2_style = copy.deepcopy(tokenizer)
    gpt2_style.pad_token = gpt2_style.eos_token
    trainer = ppo_trainer(model, gpt2_style, tmp_path)
    rollout, samples = trainer.sample_rollout(trainer.model, ["the goose"] * 4)
    for ids, real in zip(samples.response_ids.tolist(), samples.response_mask.tolist()):
        n = sum(real)
        # the first EOS is real
        if gpt2_style.eos_token_id in ids:
            assert n == ids.index(gpt2_style.eos_token_id) + 1
        else:
            assert n == len(ids)
    trainer.train()
    assert math.isfinite(trainer.model.value_head.weight.sum().item())


# --- configs
# ----------------------------------------------------------------------------------------------------


def test_response_length_zero():
    with pytest.raises(ValueError, match="`response_length` must be a finite number"):
        RLHFConfig(response_length=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("kl_coef", -0.1),
        ("kl_coef", float("nan")),
        ("vf_coef", float("inf")),
        ("cliprange", 0.0),
        ("lam", 1.5),
        ("ptx_coef", -1.0),
        ("learning_rate", float("nan")),
    ],
)
def test_negative_or_nan_coefficients(field, value):
    with pytest.raises(ValueError, match=f"`{field}` must be a finite number"):
        RLHFConfig(**{field: value})


def test_rloo_k_must_divide_the_rollout():
    with pytest.raises(ValueError, match=r"`num_generations`=3 does not divide the rollout of 8 responses"):
        RLOOConfig(rloo_k=3, per_device_train_batch_size=8)


def test_rloo_k_one():
    with pytest.raises(ValueError, match=r"`num_generations` \(`rloo_k`\) must be at least 2"):
        RLOOConfig(rloo_k=1)


def test_rewards_not_a_multiple_of_k():
    with pytest.raises(ValueError, match="`rewards` has 5 items, which is not a multiple of `k`=2"):
        rloo_advantages(torch.ones(5), k=2)


# --- tensors
# ----------------------------------------------------------------------------------------------------


def test_float_ids_are_refused(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path)
    q, m = encode_prompts(tokenizer, ["the goose"])
    with pytest.raises(ShapeError, match="`query_ids` should be Int"):
        trainer.compute_loss(
            q.float(),
            m,
            torch.ones(1, 3, dtype=torch.long),
            torch.ones(1, 3, dtype=torch.long),
            torch.ones(1),
        )


def test_mask_of_the_wrong_shape(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path)
    q, m = encode_prompts(tokenizer, ["the goose"])
    with pytest.raises(
        ShapeError, match="dimension `resp` is 3 in `response_ids` but 2 in `response_attention_mask`"
    ):
        trainer.compute_loss(
            q, m, torch.ones(1, 3, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), torch.ones(1)
        )


def test_rewards_of_the_wrong_length(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path)
    q, m = encode_prompts(tokenizer, ["the goose", "a"])
    with pytest.raises(ShapeError, match="dimension `batch` is 2 in `query_ids` but 3 in `rewards`"):
        trainer.compute_loss(
            q, m, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), torch.ones(3)
        )


def test_every_response_ending_at_its_first_token(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path)
    q, m = encode_prompts(tokenizer, ["the goose", "a good film", "honk", "the plot"])
    eos = torch.full((4, 3), tokenizer.pad_token_id)
    eos[:, 0] = tokenizer.eos_token_id
    mask = torch.zeros(4, 3, dtype=torch.long)
    mask[:, 0] = 1
    loss, stats = trainer.compute_loss(
        q, m, eos, mask, torch.tensor([1.0, 0.0, 2.0, -1.0]), return_stats=True
    )
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())
    assert stats["val/ratio"].item() == 1.0


def test_empty_mask_gives_zero_not_nan():
    assert masked_mean(torch.tensor([[float("nan"), 1.0]]), torch.zeros(1, 2, dtype=torch.bool)).item() == 0.0


def test_left_padded_response_mask_is_refused_by_gae():
    with pytest.raises(ValueError, match="`mask` must be True on a prefix of each row"):
        compute_gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[False, True, True]]))


def test_ppo_loss_entropy_required():
    with pytest.raises(ValueError, match="`entropy` is required when `ent_coef` > 0"):
        PPOLoss(ent_coef=0.1)(*[torch.zeros(1, 2)] * 6)


# --- checkpoints and output
# -------------------------------------------------------------------------------------


def test_resume_from_nothing(tmp_path):
    with pytest.raises(ValueError, match="`resume_from_checkpoint`=.*checkpoint-7' names no checkpoint"):
        TrainLoop(
            TrainingConfig(output_dir=str(tmp_path), resume_from_checkpoint=str(tmp_path / "checkpoint-7"))
        )


def test_resume_from_an_incompatible_checkpoint(model, tokenizer, tmp_path):
    ppo_trainer(model, tokenizer, tmp_path).train()
    other = ppo_trainer(model, tokenizer, tmp_path, resume_from_checkpoint="latest", cliprange=0.3)
    with pytest.raises(ValueError, match="change what its steps meant .*cliprange: checkpoint 0.2, now 0.3"):
        other.train()


def test_resume_may_extend_the_run(model, tokenizer, tmp_path):
    ppo_trainer(model, tokenizer, tmp_path, save_steps=1).train()
    longer = ppo_trainer(model, tokenizer, tmp_path, resume_from_checkpoint="latest", total_episodes=8)
    longer.train()
    assert [row["step"] for row in longer.loop.state.history] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "ppo").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]


def test_new_run_into_a_directory_with_checkpoints(model, tokenizer, tmp_path):
    ppo_trainer(model, tokenizer, tmp_path).train()
    with pytest.raises(
        ValueError,
        match="holds another run's checkpoints \\(checkpoint-1\\): resume it with "
        "resume_from_checkpoint='latest', or set overwrite_output_dir=True",
    ):
        ppo_trainer(model, tokenizer, tmp_path).train()
    assert (tmp_path / "ppo" / "checkpoint-1").is_dir()  # nothing deleted
    ppo_trainer(model, tokenizer, tmp_path, overwrite_output_dir=True).train()


def test_model_only_checkpoints_are_small_and_not_resumable(model, tokenizer, tmp_path):
    ppo_trainer(
        model, tokenizer, tmp_path, save_only_model=True, save_total_limit=1, total_episodes=8, save_steps=1
    ).train()
    (checkpoint,) = (tmp_path / "ppo").glob("checkpoint-*")
    assert checkpoint.name == "checkpoint-2" and not list(checkpoint.glob("optimizer*"))
    with pytest.raises(ValueError, match="holds the model only"):
        ppo_trainer(model, tokenizer, tmp_path, resume_from_checkpoint="latest").train()


def test_tracker_not_installed_is_refused_when_configured():
    with pytest.raises(ValueError, match="`report_to`='swanlab', but swanlab is not installed"):
        RLHFConfig(report_to="swanlab")


def test_numbers_given_as_text():
    config = RLHFConfig(learning_rate="1e-3", total_episodes="64", missing_eos_penalty="1")
    assert (config.learning_rate, config.total_episodes, config.missing_eos_penalty) == (0.001, 64, 1.0)
    with pytest.raises(ValueError, match="`kl_coef` must be a number, got 'high'"):
        RLHFConfig(kl_coef="high")


def test_sft_prompt_filling_max_length_is_reported_not_trained(model, tokenizer, tmp_path):
    rows = [{"prompt": "honk " * 40, "completion": " a"}] + [
        {"prompt": "the goose", "completion": " says honk"}
    ] * 4
    with pytest.warns(UserWarning, match="1 of 5 prompts fill max_length \\(16\\) tokens"):
        trainer = SFTTrainer(
            copy.deepcopy(model),
            args=SFTConfig(output_dir=str(tmp_path), max_length=16),
            train_dataset=rows,
            processing_class=tokenizer,
        )
    assert len(trainer.train_dataset) == 4


def test_sft_max_length_beyond_the_context_is_cut(model, tokenizer, tmp_path):
    with pytest.warns(
        UserWarning, match="`max_length` \\(256\\) is longer than the model's context \\(64 tokens\\)"
    ):
        trainer = SFTTrainer(
            copy.deepcopy(model),
            args=SFTConfig(output_dir=str(tmp_path), max_length=256),
            train_dataset=[{"text": "honk " * 100}] * 2,
            processing_class=tokenizer,
        )
    ids, _, _ = trainer.encode(trainer.train_dataset[:2])[0]
    assert ids.shape[1] == 64


def test_reward_training_max_length_beyond_the_context_is_cut(model, tokenizer, tmp_path):
    pairs = [
        {"prompt": "honk " * 100, "chosen": " good", "rejected": " bad"},
        {"prompt": "a", "chosen": " good", "rejected": " bad"},
    ]
    with pytest.warns(UserWarning, match="is longer than the model's context \\(64 tokens\\)"):
        trainer = RewardTrainer(
            RewardModel(copy.deepcopy(model), tokenizer=tokenizer),
            RewardConfig(output_dir=str(tmp_path)),
            pairs,
        )
    # the pair whose prompt fills 64 tokens is left out
    assert len(trainer.train_dataset) == 1 and trainer.max_length == 64


def test_evaluate_returns_numbers(model, tokenizer, tmp_path):
    rows = [{"prompt": "the goose", "completion": " says honk"}] * 2
    trainer = SFTTrainer(
        copy.deepcopy(model),
        args=SFTConfig(output_dir=str(tmp_path), max_length=32),
        train_dataset=rows,
        eval_dataset=rows,
        processing_class=tokenizer,
    )
    assert type(trainer.evaluate()["eval_loss"]) is float


def test_unwritable_output_dir_fails_before_training(model, tokenizer, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    calls = []
    trainer = ppo_trainer(
        model,
        tokenizer,
        tmp_path,
        output_dir=str(tmp_path / "file" / "out"),
        reward=lambda p, c: calls.append(1) or [0.0] * len(c),
    )
    with pytest.raises(ValueError, match="`output_dir` .* cannot be written"):
        trainer.train()
    assert calls == []  # nothing was sampled or scored


def test_train_without_a_reward(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path, reward=None)
    with pytest.raises(ValueError, match="`reward_funcs` is needed to train"):
        trainer.train()


def test_nonfinite_loss_stops_with_the_step_and_quantity(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path)
    with torch.no_grad():
        trainer.model.value_head.bias.fill_(float("nan"))  # a broken critic
    policy_before = copy.deepcopy(trainer.model.model.state_dict())
    with pytest.raises(
        FloatingPointError, match="step 1: the gradient norm is nan; non-finite: .*loss/value_avg"
    ):
        trainer.train()
    # no NaN written
    assert all(torch.equal(v, policy_before[k]) for k, v in trainer.model.model.state_dict().items())


def test_nonfinite_batches_can_be_skipped(model, tokenizer, tmp_path):
    trainer = ppo_trainer(model, tokenizer, tmp_path, skip_nonfinite=True, total_episodes=8)
    with torch.no_grad():
        trainer.model.value_head.bias.fill_(float("nan"))
    with pytest.warns(UserWarning, match="the batch was skipped"):
        trainer.train()
    assert trainer.loop.skipped_steps == 2
