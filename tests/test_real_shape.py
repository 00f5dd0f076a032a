"""Gradient checkpointing, LoRA and the chunked output layer at Qwen2.5-0.5B's real shape (issue 33, item 2).

The model is `Qwen2ForCausalLM` from its config at the shape of `bench/real_size.py`'s `SHAPES["0.5b"]`: 24 layers, hidden
h = 896, 14 heads of 64 (2 KV heads), MLP width I = 4864, vocabulary V = 151,936, tied embeddings, 494,032,768 parameters
(1.98 GB in float32), random weights (seed 0), built once for the module. The tokenizer is the task's (`task_tokenizer`,
512 tokens): a model with more rows than its tokenizer has tokens is normal (Qwen2.5's 151,936 rows hold 151,665 tokens);
here sampled ids above 511 decode to nothing, which the rewards below do not read.

Saved tensors are counted as chapter 05 counts GELU's bytes: a `saved_tensors_hooks` pack hook records each storage autograd
keeps for the backward, once. "Activations" are those storages that are not parameters (the weights are kept whatever the
levers: they are the model). Non-reentrant checkpointing keeps a layer's keyword arguments (the rotary cos/sin, B·L·64 each,
and the mask) in its recompute closure, not through the hook: 128 floats and ≤ L bytes a token, shared by all layers.

On one CPU core: ~2 minutes and ~6 GB peak RSS (`pytest tests/test_real_shape.py -m slow -n 0`).
"""

import gc
import hashlib

import pytest
import torch
import transformers as T

from instruct_goose import GRPOConfig, GRPOTrainer, task_tokenizer
from instruct_goose.agent import AdapterOffReference
from instruct_goose.grpo import GRPORollout
from instruct_goose.levers import LiveBytes, enable_gradient_checkpointing

pytestmark = pytest.mark.slow

LAYERS, H, I, V, Q_HEADS, KV_HEADS, HEAD_DIM = 24, 896, 4864, 151_936, 14, 2, 64
N_PARAMS = 494_032_768  # V·h (tied) + 24 layers + the final norm: Qwen2.5-0.5B's count
LORA_R = 8
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


@pytest.fixture(scope="module")
def model():
    "Qwen2.5-0.5B's shape, random weights, float32, train mode (Qwen2's dropout rates are 0)."
    torch.manual_seed(0)
    config = T.Qwen2Config(
        num_hidden_layers=LAYERS,
        hidden_size=H,
        intermediate_size=I,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=V,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    m = T.Qwen2ForCausalLM(config).train()
    assert sum(p.numel() for p in m.parameters()) == N_PARAMS
    return m


def rollout(tokenizer, batch: int, n_prompt: int, n_resp: int, seed: int = 0) -> GRPORollout:
    """A GRPO micro-batch made by hand: left-padded prompts, right-padded responses (ids over the whole
    vocabulary), π_old a little off π_θ's scale, advantages ±1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(3, len(tokenizer), (batch, n_prompt), generator=g)
    qm = torch.ones(batch, n_prompt, dtype=torch.long)
    qm[0, :3] = 0
    r = torch.randint(3, V, (batch, n_resp), generator=g)
    rm = torch.ones(batch, n_resp, dtype=torch.bool)
    rm[-1, n_resp - 5 :] = False
    old = torch.log(torch.tensor(1.0 / V)) + 0.01 * torch.randn(batch, n_resp, generator=g)
    advantages = torch.tensor([1.0, -1.0]).repeat(batch // 2)
    return GRPORollout(
        q,
        qm,
        r,
        rm,
        rm.clone(),
        torch.zeros(batch),
        advantages,
        old,
        old.clone(),
        rm.clone(),
        torch.zeros(batch),
        (rm.sum() / batch).repeat(batch),
    )


def checkpointing(model) -> bool:
    "Whether 🤗 gradient checkpointing is on (its name from transformers 5 on, or before)."
    return (
        model.is_activation_checkpointing
        if hasattr(model, "is_activation_checkpointing")
        else model.is_gradient_checkpointing
    )


def saved_storages(fn):
    """Run `fn`; return ({storage pointer: bytes} of every storage autograd keeps for the backward, each once;
    `fn`'s result)."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return kept, out


def activation_bytes(kept: dict, model) -> int:
    "Bytes of the kept storages that are not parameters."
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in kept.items() if ptr not in params)


def test_gradient_checkpointing_at_05b(model, tokenizer, tmp_path):
    """A GRPO micro-batch's loss (`micro_batch_loss`, batch 2, prompts of 8, responses of 64: T = 144 tokens) with and without
    `enable_gradient_checkpointing`: the same loss and every gradient (the recompute runs the same float32 kernels on the same
    inputs: each gradient within 1e-6 of its largest entry, measured: equal bit for bit), and the activations autograd keeps fall
    by at least the factor derived here.

    Without checkpointing, each layer's MLP alone keeps 4 tensors of I per token (gate_proj's output for SiLU, SiLU's output and
    up_proj's output for their product, the product for down_proj): ≥ 24·4·I = 466,944 floats a token (measured 687,716, with
    attention's and the norms' tensors).
    With it, a token keeps: each layer's input (24·h, the checkpoint's saved inputs; layer 0's is the embedding's output), the
    final RMSNorm's input, normalised and output states (3h) and rsqrt (1), the chunked head's flattened copy of the response
    positions (h·64/72 ≤ h), the ids, labels and the loss's few per-token tensors (< 8 floats): ≤ 28h + 8 = 25,096 floats
    (measured 24,996). (144 response positions ≥ 110 = 2^24 // V, so the head runs in chunks, keeping no logits.)
    So the factor is ≥ 466,944 / 25,096 = 18.6 (measured 27.5)."""
    trainer = GRPOTrainer(
        model,
        processing_class=tokenizer,
        reward_funcs=lambda p, c: [0.0] * len(c),
        args=GRPOConfig(
            num_generations=2,
            per_device_train_batch_size=2,
            max_completion_length=64,
            output_dir=str(tmp_path),
            disable_tqdm=True,
        ),
    )
    assert trainer.ref_model is None and trainer.model is model  # beta = 0: no reference, no copy
    part, tokens = rollout(tokenizer, 2, 8, 64), 2 * (8 + 64)
    named = list(model.named_parameters())

    def loss_pass():
        kept, (losses, _) = saved_storages(lambda: trainer.micro_batch_loss(model, part, 0))
        return activation_bytes(kept, model), sum(losses.values())

    plain_bytes, plain_loss = loss_pass()
    plain_loss.backward()
    reference = {n: p.grad for n, p in named}  # taken, not copied: 2 GB, not 4
    for _, p in named:
        p.grad = None
    assert all(g is not None for g in reference.values())

    errors = {}

    # each gradient checked and dropped as it lands
    def compare(name):
        def hook(p):
            errors[name] = (
                (p.grad - reference[name]).abs().max() / reference[name].abs().max().clamp(min=1e-30)
            ).item()
            p.grad = None

        return hook

    enable_gradient_checkpointing(model)
    assert checkpointing(model)
    handles = [p.register_post_accumulate_grad_hook(compare(n)) for n, p in named]
    try:
        checkpointed_bytes, checkpointed_loss = loss_pass()
        checkpointed_loss.backward()
    finally:
        for h in handles:
            h.remove()
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        del reference
        gc.collect()
    print(
        f"\nactivations kept: {plain_bytes:,} B without checkpointing, {checkpointed_bytes:,} B with "
        f"(×{plain_bytes / checkpointed_bytes:.1f}); largest gradient error {max(errors.values()):.2e}"
    )
    assert (
        torch.equal(checkpointed_loss.detach(), plain_loss.detach())
        or abs((checkpointed_loss - plain_loss).item()) <= 1e-6
    )
    assert len(errors) == len(named) and max(errors.values()) <= 1e-6, sorted(
        errors.items(), key=lambda kv: -kv[1]
    )[:3]
    assert plain_bytes >= LAYERS * 4 * I * 4 * tokens, plain_bytes
    assert checkpointed_bytes <= (28 * H + 8) * 4 * tokens, checkpointed_bytes
    assert plain_bytes >= 18.6 * checkpointed_bytes


def adapter_count() -> int:
    """r·(in + out) for each targeted projection of a layer, times 24: q (896→896), k and v (896→128), o
    (896→896), gate and up (896→4864), down (4864→896)."""
    kv = KV_HEADS * HEAD_DIM
    shapes = [(H, H), (H, kv), (H, kv), (H, H), (H, I), (H, I), (I, H)]
    # 14,336 + 2·8,192 + 14,336 + 3·46,080 = 183,296
    per_layer = sum(LORA_R * (i + o) for i, o in shapes)
    return LAYERS * per_layer  # 4,399,104


def digests(named) -> dict[str, str]:
    "BLAKE2 digest of each tensor's bytes: equal digests, equal bits (without a 2 GB copy)."
    return {n: hashlib.blake2b(p.detach().numpy().tobytes(), digest_size=16).hexdigest() for n, p in named}


def live_storages() -> dict[int, int]:
    """The CPU storages of every live tensor in this process (after a garbage collection): data pointer -> bytes.
    A compiled test run earlier in the same worker can leave tensors of torch.compile's tracing (fake or
    functional ones) that have no storage to read: they hold no memory and are left out."""
    gc.collect()
    out = {}
    for o in gc.get_objects():
        if not (
            isinstance(type(o), type)
            and issubclass(type(o), torch.Tensor)
            and o.device.type == "cpu"
            and not o.is_meta
        ):
            continue
        try:
            out[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
        # "Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)"
        except RuntimeError:
            continue
    return out


def test_selective_checkpointing_at_05b_blocks():
    """What one block of the 0.5B shape keeps per token under bf16 autocast (the GPU's setting), with no checkpointing, full,
    and selective (`policy="selective"`, chapter levers): the kept bytes (`LiveBytes`) of a 2-block model less a 1-block
    one's, at 32 and 96 tokens, their difference per token (it cancels autocast's bf16 weights, which do not grow with
    tokens). The chapter's table: 28h + 8k + 8i = 65,024 bytes with nothing recomputed, 12h + 4k + 4i = 30,720 selective
    (k = 2 heads × 64), 4h = 3,584 full (measured 66,368, 30,776, 3,584: the table leaves out a few small terms).
    At GRPO's update in bench/real_size.py (24 blocks, 4,160 tokens) selective keeps ≥ 3.2 GiB less."""
    shape = dict(
        hidden_size=H,
        intermediate_size=I,
        num_attention_heads=Q_HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=256,
    )

    def per_token(policy):
        kept = {}
        for blocks in (1, 2):
            torch.manual_seed(0)
            m = T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=blocks, **shape)).train()
            if policy != "none":
                enable_gradient_checkpointing(m, policy=policy)
            for n in (32, 96):
                with torch.autocast("cpu", dtype=torch.bfloat16), LiveBytes() as live:
                    logits = m(
                        torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
                    ).logits
                    kept[blocks, n] = live.sweep()  # while `logits` holds the graph
        return ((kept[2, 96] - kept[1, 96]) - (kept[2, 32] - kept[1, 32])) / 64

    k = KV_HEADS * HEAD_DIM
    kept = {policy: per_token(policy) for policy in ("none", "full", "selective")}
    print(f"\nbytes a token and block keeps at the 0.5B shape: {kept}")
    assert kept["full"] == 4 * H
    assert 1 <= kept["none"] / (28 * H + 8 * k + 8 * I) <= 1.03, kept
    assert 1 <= kept["selective"] / (12 * H + 4 * k + 4 * I) <= 1.01, kept
    assert (
        kept["none"] - kept["selective"] >= 34_000
        and 24 * 4160 * (kept["none"] - kept["selective"]) / 2**30 >= 3.2
    )


@pytest.fixture(scope="module")
def lora_run(model, tokenizer, tmp_path_factory):
    """One GRPO training step as a user at this size would run it: `peft_config` (LoRA r = 8 on every
    projection), gradient checkpointing, beta = 0.04 (so there is a reference), 2 completions of 8 tokens for
    one prompt, rewards 0 and 1 (the completions' order: advantages ±0.71 whatever was sampled)."""
    from peft import LoraConfig

    before = digests(model.named_parameters())
    # the model's, and whatever earlier tests in this process left alive
    existing = live_storages()
    trainer = GRPOTrainer(
        model,
        processing_class=tokenizer,
        reward_funcs=lambda prompts, completions, **kw: [float(i) for i in range(len(completions))],
        train_dataset=[{"prompt": "Review: The editing in this western"}],
        peft_config=LoraConfig(r=LORA_R, lora_alpha=16, target_modules=PROJECTIONS),
        args=GRPOConfig(
            num_generations=2,
            per_device_train_batch_size=2,
            max_completion_length=8,
            max_steps=1,
            beta=0.04,
            learning_rate=1e-3,
            gradient_checkpointing=True,
            output_dir=str(tmp_path_factory.mktemp("lora")),
            disable_tqdm=True,
            save_strategy="no",
        ),
    )
    trainer.train()
    return trainer, before, existing


def test_lora_step_at_05b(lora_run):
    """After one GRPO step with LoRA and gradient checkpointing: every lora_B moved (B starts at 0, so at step 1 only B has a
    gradient: ∂L/∂A = Bᵀ·(…) = 0) and nothing else did (the base's 290 tensors bit for bit, by digest); AdamW's state holds exactly
    the adapters, r·(in + out) summed over the 7 projections of 24 layers = 24 × 183,296 = 4,399,104 parameters (each with its 2
    moments); the reference is the adapter-off policy, holding no parameters; and the run leaves alive no tensor of the
    embedding's size (V·h = 136,134,656) and less than half a model's bytes (the storages alive before it, the model's and any an
    earlier test of this process left, are set aside)."""
    trainer, before, existing = lora_run
    policy = trainer.model
    base_model = policy.get_base_model()
    assert checkpointing(base_model)
    after = digests(policy.named_parameters())
    adapters = {n for n in after if "lora_" in n}
    assert len(adapters) == 2 * len(PROJECTIONS) * LAYERS
    base_after = {
        n.replace("base_model.model.", "").replace(".base_layer", ""): d
        for n, d in after.items()
        if n not in adapters
    }
    # the base, bit for bit (and the same 290 names)
    assert base_after == before
    moved = {n for n, p in policy.named_parameters() if "lora_B" in n and p.abs().max() > 0}
    # every B trained, through the checkpointed layers
    assert moved == {n for n in adapters if "lora_B" in n}

    optimizer = trainer.loop.optimizer.optimizer  # AdamW under Accelerate's wrapper
    in_groups = [p for g in optimizer.param_groups for p in g["params"]]
    trainable = [p for n, p in policy.named_parameters() if n in adapters]
    assert {id(p) for p in in_groups} == {id(p) for p in trainable} == {id(p) for p in optimizer.state}
    assert all(p.requires_grad == (n in adapters) for n, p in policy.named_parameters())
    assert sum(p.numel() for p in in_groups) == adapter_count() == 4_399_104
    assert all(s["exp_avg"].numel() == p.numel() for p, s in optimizer.state.items())

    assert isinstance(trainer.ref_model, AdapterOffReference) and list(trainer.ref_model.parameters()) == []
    assert trainer.ref_model.get_base_model() is base_model
    embedding = base_model.get_input_embeddings().weight
    assert embedding is base_model.get_output_embeddings().weight  # tied, as Qwen2.5-0.5B's
    assert embedding.untyped_storage().data_ptr() in existing  # built before the run
    new = {ptr: n for ptr, n in live_storages().items() if ptr not in existing}  # what the run left alive
    # no second tensor of the embedding's size
    assert [n for n in new.values() if n >= V * H * 4] == []
    # adapters and their moments, not a second model
    assert sum(new.values()) < 0.5 * N_PARAMS * 4, sum(new.values())
    print(
        f"\nadapter parameters in the optimizer: {sum(p.numel() for p in in_groups):,}; tensor bytes the run "
        f"left alive {sum(new.values()):,}"
    )


def test_no_logits_kept_at_05b_512_tokens(lora_run, tokenizer):
    """The loss's pass (GRPO `micro_batch_loss`, LoRA + gradient checkpointing as trained above) on batch B = 2, prompts of 8 and
    512 response tokens: autograd keeps no tensor of B·512·V = 155,582,464 elements or more. Derivation: the largest storage kept is
    the tied output layer's weight, V·h = 136,134,656 elements (a parameter, kept for the hidden state's gradient); the largest
    activation is a layer's input, B·(8 + 512)·h = 931,840 elements (checkpointing keeps each layer's input; the chunked head keeps
    the response positions' hidden states, B·512·h, and recomputes each chunk's logits, 110 positions × V, in the backward),
    1/167 of the logits (without checkpointing the MLPs would keep B·L·I = 5,058,560-element tensors: the bound also checks that it is
    on). The backward then runs (recomputing layers and logit chunks) and every adapter B gets a finite gradient."""
    trainer, *_ = lora_run
    policy = trainer.model.train()
    part = rollout(tokenizer, 2, 8, 512)
    kept, (losses, _) = saved_storages(lambda: trainer.micro_batch_loss(policy, part, 0))
    params = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    # float32 (ids and masks are counted at 4 bytes too: an over-count)
    elements = {ptr: n // 4 for ptr, n in kept.items()}
    largest = max(elements.values())
    largest_activation = max(n for ptr, n in elements.items() if ptr not in params)
    print(
        f"\nlargest kept: {largest:,} elements (the output layer's weight); largest activation: "
        f"{largest_activation:,}; "
        f"logits would be {2 * 512 * V:,}"
    )
    assert largest == V * H < 2 * 512 * V
    assert largest_activation <= 2 * (8 + 512) * H
    policy.zero_grad(set_to_none=True)
    sum(losses.values()).backward()
    grads = [p.grad for n, p in policy.named_parameters() if "lora_B" in n]
    assert (
        all(g is not None and torch.isfinite(g).all() for g in grads)
        and max(g.abs().max() for g in grads) > 0
    )
    policy.zero_grad(set_to_none=True)
