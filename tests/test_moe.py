"""A mixture-of-experts policy's load-balancing loss in RLOO and GRPO (TRL 1.16's `router_aux_loss_coef`).

TRL adds c·L_aux of each micro-batch's training pass to that micro-batch's loss, divided by the gradient-accumulation
steps: the mean over the step's micro-batches. Here the same step is run twice from the same weights and seed, with
c = 0.5 and c = 0: the rollouts are the same (c changes no sample), so under plain SGD (lr 0.1, no clipping) the two
runs' weights differ by exactly −0.1 · 0.5 · ∇ mean_i L_aux(micro-batch i) at the starting weights, computed here by
hand from the captured rollout (`router_aux_losses` around the policy's pass over each micro-batch; the agent chapter
checks L_aux against the Switch Transformer formula). Two micro-batches (each its own pass), and one (RLOO: the
rollout's kept pass, `first_pass`, carries its L_aux to the update).
"""

import tempfile

import pytest
import torch
import transformers

from instruct_goose import (
    GRPOConfig,
    GRPOTrainer,
    RLOOConfig,
    RLOOTrainer,
    load_task,
    response_logprobs,
    router_aux_losses,
    task_tokenizer,
    tiny_causal_lm,
)
from instruct_goose.loop import read_metrics

TOKENIZER = task_tokenizer()
ALGOS = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}


def tiny_moe():
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=len(TOKENIZER),
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=TOKENIZER.pad_token_id,
            eos_token_id=TOKENIZER.eos_token_id,
        )
    )


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def one_step(algo, coef, per_device, accumulation, output_dir):
    "One SGD step of `algo` on the tiny MoE: the trained policy, the rollout the update saw, the logged row."
    config_class, trainer_class = ALGOS[algo]
    config = config_class(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        logging_steps=1,
        optim="sgd",
        learning_rate=0.1,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        router_aux_loss_coef=coef,
        disable_tqdm=True,
        save_strategy="no",
        seed=3,
    )
    trainer = trainer_class(
        tiny_moe(),
        None,
        config,
        processing_class=TOKENIZER,
        reward_funcs=length_reward,
        train_dataset=load_task("prompts").select(range(16)),
    )
    seen, update = {}, trainer.update

    def spy(model, rollout, loop):
        # the first micro-batch's responses cut to 3 tokens: unequal token counts (GRPO's loss is a token
        # mean)
        if accumulation > 1:
            for mask in (rollout.response_mask, rollout.loss_mask):
                mask[:per_device, 3:] = False
        seen["rollout"], seen["kept"] = rollout, rollout.kept is not None
        return update(model, rollout, loop)

    trainer.update = spy
    trainer.train()
    return trainer.model, seen, read_metrics(output_dir)[0]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("per_device, accumulation", [(4, 2), (8, 1)], ids=["two_micro_batches", "kept_pass"])
def test_the_step_adds_the_mean_load_balancing_loss(algo, per_device, accumulation):
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as e:
        with_aux, seen, row = one_step(algo, 0.5, per_device, accumulation, d)
        without, seen_0, row_0 = one_step(algo, 0.0, per_device, accumulation, e)
    # GRPO at num_iterations=1 scores π_old with the loss's own pass
    assert seen["kept"] == (accumulation == 1 and algo == "rloo")
    assert "aux_loss" in row and "aux_loss" not in row_0
    rollout = seen["rollout"]
    assert torch.equal(rollout.response_ids, seen_0["rollout"].response_ids)  # c changes no sample
    start = tiny_moe()
    aux, tokens = [], []
    # the update's micro-batches: in order, one pass each
    for i in range(accumulation):
        part = rollout[torch.arange(i * per_device, (i + 1) * per_device)]
        with router_aux_losses(start) as found:
            response_logprobs(
                start, part.query_ids, part.query_attention_mask, part.response_ids, part.response_mask
            )
        aux, tokens = aux + found, tokens + [part.response_mask.sum()]
    assert len(aux) == accumulation
    torch.stack(aux).mean().backward()
    # L_aux reaches no output layer
    step = [-0.1 * 0.5 * (torch.zeros_like(p) if p.grad is None else p.grad) for p in start.parameters()]
    worst = max(
        ((a - b) - s).abs().max().item() for a, b, s in zip(with_aux.parameters(), without.parameters(), step)
    )
    moved = max(s.abs().max().item() for s in step)
    assert moved > 1e-4 and worst < 1e-6, (worst, moved)
    plain, by_tokens = (
        torch.stack(aux).mean().item(),
        (torch.stack(aux) * torch.stack(tokens)).sum().item() / sum(tokens).item(),
    )
    # logged as TRL logs it: the plain mean of the micro-batches'
    assert row["aux_loss"] == pytest.approx(plain, rel=1e-5)
    # ... which a token-weighted mean is not, here
    if accumulation > 1:
        assert abs(plain - by_tokens) > 1e-4 * plain


@pytest.mark.parametrize("algo", ALGOS)
def test_the_coefficient_is_trls_rule(algo):
    """None: the model config's (Qwen3-MoE: 0.001); a number given; 0: off; a model without experts: an error
    naming the field."""
    config_class, trainer_class = ALGOS[algo]
    make = lambda model, **c: trainer_class(
        model,
        None,
        config_class(output_dir="unused", num_generations=2, per_device_train_batch_size=2, **c),
        processing_class=TOKENIZER,
        reward_funcs=length_reward,
    )
    assert [
        make(tiny_moe(), **c).router_aux_loss_coef
        for c in ({}, {"router_aux_loss_coef": 0.5}, {"router_aux_loss_coef": 0.0})
    ] == [0.001, 0.5, 0.0]
    assert make(tiny_causal_lm(TOKENIZER)).router_aux_loss_coef == 0.0
    with pytest.raises(
        ValueError, match="`router_aux_loss_coef`=0.1, but GPT2LMHeadModel is not a mixture-of-experts model"
    ):
        make(tiny_causal_lm(TOKENIZER), router_aux_loss_coef=0.1)
    with pytest.raises(ValueError, match="`router_aux_loss_coef` must be"):
        config_class(router_aux_loss_coef=-1.0)
