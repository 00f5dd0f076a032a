"""Numerical safety under bf16 autocast: float32 log-probabilities, a first-epoch ratio of exactly 1, finite
training."""

import math

import torch

from instruct_goose import (
    Agent,
    RLHFConfig,
    RLHFTrainer,
    create_reference_model,
    encode_prompts,
    train_tokenizer,
    tiny_causal_lm,
)

TEXTS = ["the goose says honk", "a good film, I loved it", "the plot was dull and slow"] * 4


def setup(tmp_path, **config):
    tokenizer = train_tokenizer(TEXTS, vocab_size=300)
    model = tiny_causal_lm(tokenizer, seed=0)
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        total_episodes=8,
        response_length=6,
        disable_tqdm=True,
        num_sample_generations=0,
    )
    trainer = RLHFTrainer(
        Agent(model),
        create_reference_model(model),
        RLHFConfig(**{**settings, **config}),
        processing_class=tokenizer,
        reward_funcs=lambda p, c: [float(len(x)) for x in c],
        train_dataset=[{"prompt": "the goose"}] * 8,
    )
    return tokenizer, trainer


def test_bf16_autocast_keeps_logprobs_float32_and_the_first_ratio_exactly_one(tmp_path):
    tokenizer, trainer = setup(tmp_path)
    q, m = encode_prompts(tokenizer, ["the goose", "a good film", "the plot"])
    torch.manual_seed(0)
    r, rm = trainer.model.generate(q, m, 6, tokenizer.eos_token_id, tokenizer.pad_token_id)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = trainer.model.model(input_ids=torch.cat([q, r], 1)).logits
        stats = trainer.model.response_stats(q, m, r, rm)
        loss, loss_stats = trainer.compute_loss(
            q, m, r, rm, torch.tensor([1.0, 0.0, -1.0]), return_stats=True
        )
    assert logits.dtype == torch.bfloat16  # the model really ran in bf16
    assert stats.logprobs.dtype == stats.values.dtype == stats.entropy.dtype == torch.float32
    assert loss_stats["val/ratio"].item() == 1.0 and loss_stats["val/ratio_var"].item() == 0.0
    assert loss_stats["policy/clipfrac_avg"].item() == 0.0
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in trainer.model.parameters() if p.grad is not None)


def test_bf16_mixed_precision_training_stays_finite(tmp_path):
    _, trainer = setup(tmp_path, mixed_precision="bf16", total_episodes=16)
    trainer.train()
    history = trainer.loop.state.history
    assert len(history) == 4
    assert all(math.isfinite(v) for row in history for v in row.values())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
