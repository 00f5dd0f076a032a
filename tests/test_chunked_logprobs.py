"""Log-probabilities and entropy from the last hidden state in chunks (`logprobs_from_hidden`, `response_logprobs`).

- The same numbers and gradients as the logits path, on GPT-2 and Qwen2, at a temperature, through `Agent.response_stats`
  (shared and separate critic), `logprobs_in_chunks`, `token_logprobs` and a LoRA policy with its adapter-off reference.
- Models whose forward soft-caps or scales the output layer's logits (Gemma 2, Cohere, Granite, Falcon-H1, ...) are scored in
  chunks too, with the same operation after the layer: the logits path's log-probabilities and gradients; a model whose
  transformation the library does not know is scored from its logits.
- At Qwen2.5's vocabulary (151,936) and 512 response tokens, autograd keeps no tensor of batch × resp × vocab elements
  (in the loss's pass, and in a GRPO and an RLOO training step, whose gradients equal the logits path's), and the peak of torch's CPU allocations in a scoring or training pass falls (`python tests/test_chunked_logprobs.py` prints them).
"""

import copy
import json
import sys

import pytest
import torch
import transformers as T

import instruct_goose.agent as agent_module
import instruct_goose.core as core
from instruct_goose import (
    Agent,
    GRPOConfig,
    GRPOTrainer,
    RLOOConfig,
    RLOOTrainer,
    create_reference_model,
    entropy_from_logits,
    logprobs_from_logits,
    task_tokenizer,
)
from instruct_goose.agent import _output_layer, response_logits, response_logprobs, token_logprobs
from instruct_goose.grpo import GRPORollout, high_entropy_mask
from instruct_goose.rloo import RLOORollout
from instruct_goose.rollout import logprobs_in_chunks

QWEN_VOCAB = 151_936


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def tiny(arch: str, vocab_size: int, hidden: int = 32, seed: int = 0, **extra):
    "A 2-layer GPT-2 or Qwen2 from its config class (Qwen2 unties its output layer, as Qwen2.5-7B and up do)."
    torch.manual_seed(seed)
    if arch == "gpt2":
        return T.GPT2LMHeadModel(
            T.GPT2Config(
                n_layer=2,
                n_embd=hidden,
                n_head=2,
                n_inner=2 * hidden,
                vocab_size=vocab_size,
                n_positions=1024,
                **extra,
            )
        ).eval()
    return T.Qwen2ForCausalLM(
        T.Qwen2Config(
            num_hidden_layers=2,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=vocab_size,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
            **extra,
        )
    ).eval()


def batch(vocab_size: int, n_resp: int = 6, seed: int = 0):
    "Two left-padded prompts and two right-padded responses."
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(3, vocab_size, (2, 4), generator=g)
    qm = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    r = torch.randint(3, vocab_size, (2, n_resp), generator=g)
    rm = torch.ones(2, n_resp, dtype=torch.bool)
    rm[1, n_resp - 2 :] = False
    return q, qm, r, rm


@pytest.fixture
def small_chunks(monkeypatch):
    "Chunks of 2 positions whatever the vocabulary, so a few positions make several chunks."

    def chunk_for(model):
        monkeypatch.setattr(core, "_LOGITS_PER_CHUNK", 2 * model.config.vocab_size)

    return chunk_for


def grads(model):
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_response_stats_equal_the_logits_path(arch, small_chunks):
    """Log-probabilities, entropies, values and every gradient (policy and value head) agree with the logits
    path."""
    agent = Agent(tiny(arch, 97)).eval()
    small_chunks(agent.model)
    x = batch(97)
    assert _output_layer(agent.model).weight is agent.model.get_output_embeddings().weight
    stats = agent.response_stats(*x, temperature=0.7)
    (stats.logprobs.exp().sum() + 0.3 * stats.entropy.sum() + stats.values.pow(2).sum()).backward()
    ours = grads(agent)
    agent.zero_grad()
    logits, hidden = response_logits(agent.model, *x, output_hidden_states=True)
    lp, H, V = (
        logprobs_from_logits(logits, x[2], 0.7),
        entropy_from_logits(logits, 0.7),
        agent._values(hidden),
    )
    (lp.exp().sum() + 0.3 * H.sum() + V.pow(2).sum()).backward()
    torch.testing.assert_close(stats.logprobs, lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(stats.entropy, H, rtol=0, atol=1e-5)
    torch.testing.assert_close(stats.values, V, rtol=0, atol=1e-6)
    for a, b in zip(ours, grads(agent)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_separate_critic_and_no_grad_entropy(small_chunks):
    "With a separate critic the values come from it; an entropy for logging carries no graph."
    agent = Agent(tiny("qwen2", 97), value_model=tiny("gpt2", 97, seed=1)).eval()
    small_chunks(agent.model)
    x = batch(97)
    stats = agent.response_stats(*x, temperature=1.3, entropy="no_grad")
    assert stats.logprobs.requires_grad and not stats.entropy.requires_grad
    logits = response_logits(agent.model, *x)[0]
    torch.testing.assert_close(stats.logprobs, logprobs_from_logits(logits, x[2], 1.3), rtol=0, atol=1e-5)
    torch.testing.assert_close(stats.entropy, entropy_from_logits(logits.detach(), 1.3), rtol=0, atol=1e-5)
    assert agent.response_stats(*x, entropy="skip").entropy is None


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_scoring_passes_equal_the_logits_path(arch, small_chunks):
    "`logprobs_in_chunks` (π_old, π_ref) and `token_logprobs` (SFT, pretraining term) equal the logits path."
    model = tiny(arch, 97)
    small_chunks(model)
    x = batch(97)
    with torch.no_grad():
        ours = logprobs_in_chunks(model, *x, temperature=0.7, size=1)
        theirs = logprobs_from_logits(response_logits(model, *x)[0], x[2], 0.7)
        torch.testing.assert_close(ours[x[3]], theirs[x[3]], rtol=0, atol=1e-5)
        ids, mask = torch.cat([x[0], x[2]], 1), torch.cat([x[1], x[3].long()], 1)
        full = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits
        torch.testing.assert_close(
            token_logprobs(model, ids, mask)[:, 1:],
            logprobs_from_logits(full[:, :-1], ids[:, 1:]),
            rtol=0,
            atol=1e-5,
        )


def test_bf16_autocast_backward(small_chunks):
    """Under bf16 autocast (`mixed_precision`) the forward gives the logits path's numbers and the recomputed
    backward (run under the same autocast) is no further from the float32 gradients than the logits path's."""
    model = tiny("qwen2", 97)
    small_chunks(model)
    x = batch(97)

    def run(chunked, autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, H = training_pass(model, x, chunked)
        (lp.sum() + H.sum()).backward()
        return lp, grads(model)

    (lp, ours), (ref_lp, theirs), (_, exact) = run(True, True), run(False, True), run(False, False)
    # the same bf16 products, the same float32 reductions
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-6)
    error = lambda g: max((a - b).abs().max().item() for a, b in zip(g, exact))
    assert error(ours) <= 1.5 * error(theirs), (error(ours), error(theirs))


def test_lora_policy_and_adapter_off_reference(small_chunks):
    "A LoRA policy is scored with its adapter, its reference (the same weights, adapter off) without."
    peft = pytest.importorskip("peft")
    base = tiny("gpt2", 97)
    policy = peft.get_peft_model(
        copy.deepcopy(base),
        peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False),
    )
    reference = create_reference_model(policy)
    small_chunks(base)
    x = batch(97)
    assert _output_layer(policy) is not None and _output_layer(reference) is not None
    with torch.no_grad():
        ref_lp = response_logprobs(reference, *x)[0]
        torch.testing.assert_close(
            ref_lp, logprobs_from_logits(response_logits(base, *x)[0], x[2]), rtol=0, atol=1e-5
        )
        pol_lp = response_logprobs(policy, *x)[0]
        torch.testing.assert_close(
            pol_lp, logprobs_from_logits(response_logits(policy, *x)[0], x[2]), rtol=0, atol=1e-5
        )
        assert (pol_lp - ref_lp).abs().max() > 1e-3


def test_a_trained_copy_of_the_output_layer_is_scored_in_chunks(small_chunks, monkeypatch):
    """peft's `modules_to_save=["lm_head"]` (the output layer trained in full beside LoRA adapters, as when
    tokens were added): the policy is scored in chunks through the trained copy, its reference (adapters off)
    through the original, with the logits path's numbers and gradients."""
    peft = pytest.importorskip("peft")
    base = tiny("qwen2", 97)
    policy = peft.get_peft_model(
        copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    )
    # the copy, trained
    with torch.no_grad():
        policy.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    reference = create_reference_model(policy)
    small_chunks(base)
    x = batch(97)
    assert _output_layer(policy).weight is policy.base_model.model.lm_head.modules_to_save["default"].weight
    with torch.no_grad():
        torch.testing.assert_close(
            response_logprobs(reference, *x)[0],
            logprobs_from_logits(response_logits(base, *x)[0], x[2]),
            rtol=0,
            atol=1e-5,
        )
    results = []
    for chunked in (True, False):
        if not chunked:
            monkeypatch.setattr(agent_module, "_output_layer", lambda model: None)
        policy.zero_grad()
        lp, H = training_pass(policy, x, chunked)
        (lp.exp().sum() + H.sum()).backward()
        results.append((lp, [p.grad.clone() for p in policy.parameters() if p.grad is not None]))
    (lp, ours), (ref_lp, theirs) = results
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
    assert len(ours) == len(theirs) > 2  # the LoRA factors and the output layer's copy
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * b.abs().max().item())


_DECODER = dict(
    num_hidden_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# family: (config class, model class, what makes the forward change the logits after the output layer, other
# sizes)
TRANSFORMED = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(final_logit_softcapping=3.0), dict(head_dim=8)),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(final_logit_softcapping=3.0),
        dict(head_dim=8),
    ),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(logit_scale=0.3), {}),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(logit_scale=0.3), {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(logits_scaling=0.3), {}),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(logits_scaling=0.3), _MOE),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(logits_scaling=0.3),
        dict(**_MOE, shared_intermediate_size=32),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(logits_scaling=0.3),
        dict(
            **_MOE,
            shared_intermediate_size=32,
            layer_types=["attention", "mamba"],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=8,
        ),
    ),
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(logits_scaling=3.0), {}),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(lm_head_multiplier=0.3),
        dict(
            head_dim=8,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
        ),
    ),
}


def transformed(name: str, vocab_size: int = 97, **override):
    """A tiny model of `name` whose forward changes its logits after the output layer (soft-capping or scaling by
    a non-neutral value)."""
    config_class, model_class, transform, sizes = TRANSFORMED[name]
    if not hasattr(T, config_class):
        pytest.skip(f"{config_class} is not in this transformers")
    torch.manual_seed(0)
    config = getattr(T, config_class)(
        **{**_DECODER, **sizes, **transform, "vocab_size": vocab_size, **override}
    )
    return getattr(T, model_class)(config).eval()


@pytest.mark.parametrize("name", list(TRANSFORMED))
def test_soft_capped_and_scaled_logits_are_scored_in_chunks(name, small_chunks):
    """Gemma 2's soft-capping, Cohere's, Granite's, HyperCLOVA X's and Falcon-H1's scaling: the chunked path
    applies the same operation after the output layer, so its log-probabilities, entropies and gradients are
    the logits path's, in float32 and (the log-probabilities bit for bit) under bf16 autocast."""
    model = transformed(name)
    head = _output_layer(model)
    assert head is not None and head.after is not None
    small_chunks(model)
    x = batch(97)
    for autocast in (False, True):
        results = []
        for chunked in (True, False):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if chunked:
                    lp, H = response_logprobs(model, *x, temperature=0.7, entropy="grad")[:2]
                else:
                    logits = response_logits(model, *x)[0]
                    lp, H = logprobs_from_logits(logits, x[2], 0.7), entropy_from_logits(logits, 0.7)
            (lp.exp().sum() + H.sum()).backward()
            results.append((lp, H, grads(model)))
        (lp, H, ours), (ref_lp, ref_H, theirs) = results
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=0 if autocast else 1e-5)
        torch.testing.assert_close(H, ref_H, rtol=0, atol=1e-5)
        # under autocast, the derivative of the capping in float32 vs autograd's in bf16
        for a, b in zip(ours, theirs):
            if b is not None:
                torch.testing.assert_close(
                    a, b, rtol=0, atol=(3e-2 if autocast else 1e-4) * b.abs().max().item()
                )
        assert max(g.abs().max() for g in theirs if g is not None) > 1e-3


def test_an_unknown_logit_transform_is_scored_from_the_logits():
    """A model whose config sets a logit transformation the library does not know for its family is scored from
    its logits (the output layer alone would miss it)."""
    model = tiny("qwen2", 97, logit_scale=0.5)
    assert _output_layer(model) is None
    # no soft-capping: the layer alone
    assert _output_layer(transformed("gemma2", final_logit_softcapping=None)).after is None
    x = batch(97)
    with torch.no_grad():
        torch.testing.assert_close(
            response_logprobs(model, *x)[0], logprobs_from_logits(response_logits(model, *x)[0], x[2])
        )


# ------------------------------------------------------------------ memory at a real vocabulary (151,936, 512
# tokens)
def saved_tensor_sizes(fn):
    """Run `fn` and return the sizes in elements of the storages autograd keeps for the backward (each once),
    largest first."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sorted(kept.values(), reverse=True), out


def training_pass(model, x, chunked: bool):
    """The loss's pass: log-probabilities and entropy with gradients, from the hidden state in chunks or from the
    logits."""
    if chunked:
        return response_logprobs(model, *x, entropy="grad")[:2]
    logits = response_logits(model, *x)[0]
    return logprobs_from_logits(logits, x[2]), entropy_from_logits(logits)


# ~10 s each on 2 busy cores
@pytest.mark.parametrize("arch", [pytest.param("gpt2", marks=pytest.mark.slow), "qwen2"])
def test_no_saved_tensor_holds_the_logits(arch):
    """At V = 151,936 and 512 response tokens the chunked pass keeps nothing near batch × resp × vocab; the
    logits path keeps it."""
    model = tiny(arch, QWEN_VOCAB, hidden=16).train()
    x = batch(QWEN_VOCAB, n_resp=512)
    ours, (lp, H) = saved_tensor_sizes(lambda: training_pass(model, x, chunked=True))
    # the largest: the output weight (V × 16), 1/64 of the logits
    assert ours[0] <= QWEN_VOCAB * 16, ours[:3]
    (lp.sum() + H.sum()).backward()


def test_a_soft_capped_model_keeps_no_logits():
    """Gemma 2 (its logits soft-capped after the output layer) at V = 151,936 and 512 response tokens: the
    chunked pass keeps nothing near batch × resp × vocab either (before, such a model was scored from its
    whole logits)."""
    model = transformed(
        "gemma2", vocab_size=QWEN_VOCAB, hidden_size=16, intermediate_size=32, head_dim=4
    ).train()
    ours, (lp, H) = saved_tensor_sizes(
        lambda: training_pass(model, batch(QWEN_VOCAB, n_resp=512), chunked=True)
    )
    assert ours[0] <= QWEN_VOCAB * 16, ours[:3]  # the largest: the output weight (V × 16)
    (lp.sum() + H.sum()).backward()


@pytest.mark.slow
def test_the_count_sees_the_logits():
    """The same count on the logits path does find a tensor of batch × resp × vocab elements (so the test above
    can fail)."""
    model = tiny("qwen2", QWEN_VOCAB, hidden=16).train()
    theirs, _ = saved_tensor_sizes(lambda: training_pass(model, batch(QWEN_VOCAB, n_resp=512), chunked=False))
    assert theirs[0] >= 2 * 512 * QWEN_VOCAB, theirs[:3]


def trainer_step(algo: str, tmp_path, tokenizer, hidden: int = 16):
    """A GRPO (entropy bonus on the top half of tokens by entropy, μ = 2) or RLOO trainer on a 2-layer Qwen2 at V
    = 151,936, and a rollout of 2 × 512 response tokens made by hand (π_old: the policy's own
    log-probabilities, a little shifted)."""
    model = tiny("qwen2", QWEN_VOCAB, hidden=hidden).train()
    q, qm, r, rm = x = batch(QWEN_VOCAB, n_resp=512)
    with torch.no_grad():
        lp, H, _ = response_logprobs(model, *x, entropy="no_grad")
    old = lp + 0.01 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(1))
    advantages = torch.tensor([1.0, -0.5])
    if algo == "grpo":
        trainer = GRPOTrainer(
            model,
            processing_class=tokenizer,
            reward_funcs=lambda p, c: [0.0] * len(c),
            args=GRPOConfig(
                num_generations=2,
                per_device_train_batch_size=2,
                max_completion_length=512,
                num_iterations=2,
                entropy_coef=0.1,
                top_entropy_quantile=0.5,
                output_dir=str(tmp_path),
            ),
        )
        part = GRPORollout(
            q,
            qm,
            r,
            rm,
            rm.clone(),
            torch.zeros(2),
            advantages,
            old,
            torch.zeros_like(old),
            high_entropy_mask(H, rm, 0.5),
            torch.full((2,), 0.1),
            (rm.sum() / 2).repeat(2),
        )
    else:
        trainer = RLOOTrainer(
            model,
            copy.deepcopy(model),
            processing_class=tokenizer,
            reward_funcs=lambda p, c: [0.0] * len(c),
            args=RLOOConfig(
                num_generations=2,
                per_device_train_batch_size=2,
                max_completion_length=512,
                output_dir=str(tmp_path),
            ),
        )
        zeros = torch.zeros_like(old)
        part = RLOORollout(
            q, qm, r, rm, torch.zeros(2), old, zeros, zeros, torch.zeros(2), advantages, rm.clone()
        )
    return trainer, part


def step_gradients(trainer, part):
    """The micro-batch's losses (summed) backward: (the sizes autograd kept, the losses, the statistics, every
    gradient)."""
    trainer.model.zero_grad()
    sizes, (losses, stats) = saved_tensor_sizes(lambda: trainer.micro_batch_loss(trainer.model, part, 0))
    sum(losses.values()).backward()
    return sizes, losses, stats, grads(trainer.model)


# the logits path at this size: GBs and ~50 s on 2 busy cores
@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "rloo"])
def test_trainer_step_keeps_no_logits(algo, tmp_path, tokenizer, monkeypatch):
    """A GRPO or RLOO training step (`micro_batch_loss` through `policy_pass`) at V = 151,936 and 2 × 512 tokens
    keeps nothing near batch × resp × vocab; the logits path (the output layer hidden from
    `response_logprobs`) keeps the logits and gives the same losses, statistics and gradients."""
    trainer, part = trainer_step(algo, tmp_path, tokenizer)
    ours, losses, stats, ours_grads = step_gradients(trainer, part)
    # the largest: an output-layer-sized weight (V × 16)
    assert ours[0] <= QWEN_VOCAB * 16, ours[:3]
    if algo == "grpo":
        assert set(losses) == {"policy", "entropy"} and losses["entropy"].requires_grad
    monkeypatch.setattr(agent_module, "_output_layer", lambda model: None)
    theirs, ref_losses, ref_stats, ref_grads = step_gradients(trainer, part)
    assert theirs[0] >= 2 * 512 * QWEN_VOCAB, theirs[:3]
    for k in losses:
        torch.testing.assert_close(losses[k], ref_losses[k], rtol=1e-5, atol=1e-6)
    for k in stats:
        torch.testing.assert_close(stats[k], ref_stats[k], rtol=1e-5, atol=1e-6)
    assert max(g.abs().max() for g in ref_grads if g is not None) > 1e-4
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def peak_allocated(fn) -> int:
    """The most bytes torch's CPU allocator held at once while `fn` ran, above what it held before (the
    profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak


def measure(arch: str, chunked: bool, grad: bool) -> dict:
    """Peak bytes a pass allocates (a training pass: forward and backward) and the largest tensor autograd keeps,
    at V = 151,936, 2 × 512 tokens."""
    model = tiny(arch, QWEN_VOCAB, hidden=64).train()
    x = batch(QWEN_VOCAB, n_resp=512)
    sizes = []

    def run():
        with torch.set_grad_enabled(grad):
            sizes[:], (lp, H) = saved_tensor_sizes(lambda: training_pass(model, x, chunked))
            if grad:
                (lp.sum() + H.sum()).backward()

    return {
        "arch": arch,
        "chunked": chunked,
        "grad": grad,
        "peak_mib": round(peak_allocated(run) / 2**20),
        "largest_saved": sizes[0] if sizes else 0,
    }


@pytest.mark.slow
def test_peak_memory_falls():
    """A training pass (Qwen2 shape, hidden 64, V = 151,936, 2 × 512 tokens): a fifth of the logits path's peak
    or less."""
    chunked, logits = measure("qwen2", True, True), measure("qwen2", False, True)
    assert chunked["peak_mib"] * 5 < logits["peak_mib"], (chunked, logits)
    # above one float32 logits tensor (594 MiB)
    assert logits["peak_mib"] > 2 * 512 * QWEN_VOCAB * 4 / 2**20


def measure_step(algo: str) -> dict:
    """Peak bytes of one GRPO or RLOO training step (`micro_batch_loss` and its backward; hidden 64, V = 151,936,
    2 × 512 tokens) with the library on the path."""
    import tempfile

    trainer, part = trainer_step(algo, tempfile.mkdtemp(), task_tokenizer(), hidden=64)

    def step():
        trainer.model.zero_grad()
        sum(trainer.micro_batch_loss(trainer.model, part, 0)[0].values()).backward()

    return {"algo": algo, "step_peak_mib": round(peak_allocated(step) / 2**20)}


if __name__ == "__main__":  # the numbers quoted in the levers chapter
    # a GRPO and an RLOO training step (run it on the commit before, too)
    if sys.argv[1:] == ["steps"]:
        for algo in ("grpo", "rloo"):
            print(json.dumps(measure_step(algo)))
        sys.exit()
    for arch in ("gpt2", "qwen2"):
        for grad in (False, True):
            for chunked in (False, True):
                print(json.dumps(measure(arch, chunked, grad)))


# a few minutes on two CPU cores without bf16 instructions; the notebook checks the same at V = 65,536
@pytest.mark.slow
def test_head_backward_holds_8VH_at_most():
    """Under bf16 autocast the chunked head's backward holds at most 8·V·H bytes of W-sized tensors (the float32
    ∂W, one bf16 cast of W, one chunk's bf16 ∂W), one `_add_into` block and a chunk's logits: autograd's way,
    a float32 copy of each chunk's ∂W too, held 12·V·H (297 MiB more here, 519 MiB at Qwen2-0.5B's V × 896).
    Its gradients are a float32 computation's to bf16 rounding."""
    from instruct_goose.core import _ADD_BLOCK, logprobs_from_hidden

    # ∂W's terms outgrow a chunk's logits (110 × V)
    H = 512
    W0 = torch.randn(QWEN_VOCAB, H, generator=torch.Generator().manual_seed(1)) * 0.05

    def run(autocast):
        g = torch.Generator().manual_seed(0)
        # 120 positions: 2 chunks of 110 and 10
        h = torch.randn(2, 60, H, generator=g).requires_grad_()
        W = W0.clone().requires_grad_()
        labels = torch.randint(0, QWEN_VOCAB, (2, 60), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, _ = logprobs_from_hidden(h, W, None, labels, 0.7)
        peak = peak_allocated(lambda: (lp.exp() * torch.linspace(-1, 1, 120).view(2, 60)).sum().backward())
        return h.grad, W.grad, peak

    mixed, exact = run(True), run(False)
    for ours, theirs in zip(mixed[:2], exact[:2]):
        assert theirs.abs().max() > 0 and (ours - theirs).abs().max() <= 2e-2 * theirs.abs().max()
    chunk_logits = 4 * 110 * QWEN_VOCAB  # one chunk's float32 logits (67 MB)
    assert 8 * QWEN_VOCAB * H <= mixed[2] <= 8 * QWEN_VOCAB * H + 4 * _ADD_BLOCK + 2 * chunk_logits, (
        mixed[2] / 2**20
    )
