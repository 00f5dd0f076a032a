"""LoRA policies (peft) in PPO and RLOO: only adapters (and PPO's value head) train, the reference is the base model
with the adapter off (no second copy), and what is saved loads back. SFT and reward models with LoRA save the adapter
as TRL does, and it loads back with peft's and 🤗's classes."""

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from instruct_goose import (
    Agent,
    AdapterOffReference,
    RewardConfig,
    RewardModel,
    RewardTrainer,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
    create_reference_model,
    load_task,
    response_logits,
    task_tokenizer,
    tiny_causal_lm,
)


def reward(prompts, completions):
    return [len(c) / 10 for c in completions]


@pytest.fixture
def base_dir(policy_dir):
    return policy_dir  # the LoRA adapters' base model


def lora(base_dir):
    return get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )


def settings(tmp_path):
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        total_episodes=12,
        response_length=8,
        disable_tqdm=True,
        num_sample_generations=0,
        learning_rate=1e-2,
    )


def split(named):
    "(adapter weights, base weights) of a LoRA model's state, copied."
    adapters = {n: p.detach().clone() for n, p in named if "lora_" in n}
    base = {n: p.detach().clone() for n, p in named if "lora_" not in n}
    return adapters, base


def changed(before, after):
    return {n for n in before if not torch.equal(before[n], after[n])}


def test_lora_ppo_trains_adapters_and_value_head_only(base_dir, tmp_path):
    tokenizer = task_tokenizer()
    torch.manual_seed(0)
    agent = Agent(lora(base_dir))
    reference = create_reference_model(agent)
    assert isinstance(reference, AdapterOffReference) and list(reference.parameters()) == []
    adapters, base = split(list(agent.model.named_parameters()))
    head = agent.value_head.weight.detach().clone()
    trainer = RLHFTrainer(
        agent,
        reference,
        RLHFConfig(**settings(tmp_path)),
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=load_task("prompts"),
    )
    trainer.train()
    adapters_after, base_after = split(list(trainer.model.model.named_parameters()))
    # every adapter moved (B starts at 0)
    assert changed(adapters, adapters_after) == set(adapters)
    assert changed(base, base_after) == set()  # the base did not
    assert not torch.equal(head, trainer.model.value_head.weight)  # the value head trained

    # the reference is still exactly the base model, and the saved run loads back as a trainable LoRA agent
    q = torch.tensor([[5, 6, 7]])
    qm = torch.ones_like(q)
    r = torch.tensor([[8, 9]])
    rm = torch.ones_like(r)
    plain = AutoModelForCausalLM.from_pretrained(base_dir)
    assert torch.allclose(
        response_logits(trainer.ref_model, q, qm, r, rm)[0],
        response_logits(plain, q, qm, r, rm)[0],
        atol=1e-6,
    )
    saved = {p.name for p in Path(tmp_path).iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "value_head.safetensors"} <= saved
    assert "model.safetensors" not in saved  # the base is not written again
    reloaded = Agent.from_pretrained(tmp_path)
    ours, theirs = trainer.model.response_stats(q, qm, r, rm), reloaded.response_stats(q, qm, r, rm)
    assert torch.allclose(ours.logprobs, theirs.logprobs, atol=1e-6) and torch.allclose(
        ours.values, theirs.values, atol=1e-6
    )


def test_lora_rloo_trains_adapters_only(base_dir, tmp_path):
    tokenizer = task_tokenizer()
    policy = lora(base_dir)
    adapters, base = split(list(policy.named_parameters()))
    trainer = RLOOTrainer(
        policy,
        create_reference_model(policy),
        RLOOConfig(num_generations=2, num_iterations=4, **settings(tmp_path)),
        processing_class=tokenizer,
        reward_funcs=reward,
        train_dataset=load_task("prompts"),
    )
    trainer.train()
    adapters_after, base_after = split(list(trainer.model.named_parameters()))
    assert changed(adapters, adapters_after) == set(adapters) and changed(base, base_after) == set()
    kl = [row["objective/kl"] for row in trainer.loop.state.history]
    # KL to the adapter-off base: 0, then grows
    assert kl[0] == pytest.approx(0.0, abs=1e-5) and kl[-1] > 1e-4


def test_goose_rloo_with_lora(base_dir, tmp_path, goose_here):
    out = tmp_path / "rloo"
    result = goose_here(
        "rloo",
        "--policy",
        str(base_dir),
        "--reward_model",
        "gold",
        "--use_peft",  # TRL's switch; --lora_r alone is refused
        "--lora_r",
        "4",
        "--lora_target_modules",
        "c_attn,c_fc",
        "--total_episodes",
        "16",
        "--per_device_train_batch_size",
        "8",
        "--num_mini_batches",
        "1",
        "--response_length",
        "6",
        "--num_sample_generations",
        "0",
        "--disable_tqdm",
        "true",
        "--output_dir",
        str(out),
    )
    assert result.returncode == 0, result.stderr[-4000:]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["c_attn", "c_fc"]
    # 🤗 loads base + adapter on its own
    assert AutoModelForCausalLM.from_pretrained(out) is not None


def test_decode_samples_through_the_adapters(base_dir):
    """`decode` calls the adapted layers: each token is drawn with the LoRA policy's probability (as
    `Agent.response_stats` scores it), not the base's."""
    from instruct_goose import decoding, drawing_with, encode_prompts, generate_responses

    tok = task_tokenizer()
    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules="all-linear",
            # adapters that
            # change the output
            init_lora_weights=False,
        ),
    )
    assert decoding.decoding_refusal(model) is None
    q, m = encode_prompts(tok, ["Review: The editing in this western", "Review: a"])
    drawn, inverse_cdf = [], decoding._draw
    with drawing_with(lambda p: drawn.append(p) or inverse_cdf(p)):
        # a stop id never drawn: 8 steps each
        r, rm = generate_responses(model, q, m, 8, len(tok) + 1, tok.pad_token_id)
    sampled = torch.stack(drawn, 1).gather(-1, r[..., None]).squeeze(-1).log()
    scored = Agent(model).response_stats(q, m, r, rm, entropy="skip").logprobs
    assert (sampled - scored).abs().max().item() <= 1e-5
    with model.disable_adapter():
        base = Agent(model).response_stats(q, m, r, rm, entropy="skip").logprobs
    # the adapters do change the distribution
    assert (sampled - base).abs().max().item() > 1e-2


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_compiled_decode_samples_through_the_adapters_a_layer_at_a_time(arch):
    """Compiled (`generate_responses(compile=...)`: dynamo, each graph run as traced), a LoRA policy samples the
    tokens the uncompiled `decode` samples through its merged adapters, and compiles as many graphs at 4
    layers as at 2: its layers, adapters and all, share one layer graph."""
    from instruct_goose import drawing_with, encode_prompts, generate_responses, tiny_causal_lm

    tok = task_tokenizer()
    q, m = encode_prompts(
        tok, [f"Review: {w} film" for w in ("a", "the", "one", "my", "dull", "great", "long", "short")]
    )

    def by_argmax(p):  # a draw that depends on p alone: the same tokens from the same probabilities
        cdf = p.double().cumsum(-1)
        return torch.searchsorted(
            cdf, (p.argmax(-1, keepdim=True).double() * 0.618034 + 0.3) % 1 * cdf[:, -1:], right=True
        ).squeeze(1)

    graphs = []
    for n_layer in (2, 4):
        model = get_peft_model(
            tiny_causal_lm(tok, arch=arch, n_layer=n_layer, seed=0),
            LoraConfig(
                r=4, target_modules="all-linear", fan_in_fan_out=arch == "gpt2", init_lora_weights=False
            ),
        ).eval()
        noted = []
        torch._dynamo.reset()
        try:
            with drawing_with(by_argmax):
                compiled, _ = generate_responses(
                    model,
                    q,
                    m,
                    12,
                    [tok.eos_token_id],
                    tok.pad_token_id,
                    compile=dict(backend=lambda g, ex: noted.append(g) or g.forward),
                )
        finally:
            torch._dynamo.reset()
        with drawing_with(by_argmax):
            eager, _ = generate_responses(
                model, q, m, 12, [tok.eos_token_id], tok.pad_token_id, own_decoder=True
            )
        assert torch.equal(compiled, eager), (arch, n_layer)
        graphs.append(len(noted))
    # Llama: the rotary table, a layer, the output layer; GPT-2: a layer
    assert graphs == ([3, 3] if arch == "llama" else [1, 1]), graphs


def _saved_base(tmp_path):
    "A tiny GPT-2 and its tokenizer saved: the base a peft adapter names (`base_model_name_or_path`)."
    tok = task_tokenizer()
    tiny_causal_lm(tok, seed=0).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    return tok, tmp_path / "base"


def test_lora_sft_saves_the_adapter_as_trl(tmp_path):
    """SFT with `peft_config` writes what TRL writes (the adapter and the tokenizer, no full model); peft's
    AutoPeftModelForCausalLM loads it to the trained model's logits, and `merge_and_unload` gives them too."""
    from peft import AutoPeftModelForCausalLM

    tok, base = _saved_base(tmp_path)
    out = tmp_path / "sft"
    config = SFTConfig(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, disable_tqdm=True
    )
    trainer = SFTTrainer(
        str(base),
        config,
        load_task("sft").select(range(8)),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]),
    )
    trainer.train()
    trained = trainer.model
    saved = {p.name for p in out.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
    } <= saved and "model.safetensors" not in saved, saved
    ids = torch.tensor([tok("Review: The movie was fine.").input_ids])
    with torch.no_grad():
        ours = trained.eval()(input_ids=ids).logits
        loaded = AutoPeftModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits
        merged = trained.merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(loaded, ours, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged, ours, atol=1e-5, rtol=1e-5)
    # the adapter trained: the test can tell
    assert (plain - ours).abs().max() > 1e-3


def test_lora_reward_saves_the_adapter_and_score_head(tmp_path):
    """A reward model with `peft_config` writes the adapter with its score head (peft's `modules_to_save`, as
    TRL's with task_type SEQ_CLS), normalised; AutoPeftModelForSequenceClassification, 🤗's
    AutoModelForSequenceClassification and RewardModel load it to the trained scores, and `merge_and_unload`
    gives them too."""
    from peft import AutoPeftModelForSequenceClassification
    from safetensors import safe_open
    from transformers import AutoModelForSequenceClassification

    tok, base = _saved_base(tmp_path)
    out = tmp_path / "rm"
    config = RewardConfig(
        output_dir=str(out), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2, disable_tqdm=True
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"])
    trainer = RewardTrainer(
        str(base), config, load_task("preferences").select(range(8)), processing_class=tok, peft_config=lora
    )
    trainer.train()
    trained = trainer.reward_model
    # the caller's config is left as it was
    assert lora.task_type is None and lora.modules_to_save is None
    saved = {p.name for p in out.iterdir()}
    assert {
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
    } <= saved and "model.safetensors" not in saved, saved
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (
        adapter["task_type"] == "SEQ_CLS"
        and "score" in adapter["modules_to_save"]
        and adapter["base_model_name_or_path"] == str(base)
    )
    with safe_open(out / "adapter_model.safetensors", "pt") as f:
        assert any(k.endswith("score.weight") for k in f.keys())
    texts = ["Review: The movie was wonderful.", "Review: dull"]
    ids, mask = trained.encode(texts)
    with torch.no_grad():
        ours = trained.eval()(ids, mask)
        for loaded in (
            AutoPeftModelForSequenceClassification.from_pretrained(out, num_labels=1),
            AutoModelForSequenceClassification.from_pretrained(out, num_labels=1),
        ):
            # the base LM's config names none
            loaded.config.pad_token_id = tok.pad_token_id
            torch.testing.assert_close(
                loaded.eval()(input_ids=ids, attention_mask=mask).logits.squeeze(-1),
                ours,
                atol=1e-5,
                rtol=1e-5,
            )
        torch.testing.assert_close(RewardModel.from_pretrained(out)(ids, mask), ours, atol=1e-5, rtol=1e-5)
        trained.model = trained.model.merge_and_unload()
        torch.testing.assert_close(trained(ids, mask), ours, atol=1e-5, rtol=1e-5)
    assert type(trained.model).__name__ == "GPT2ForSequenceClassification"
