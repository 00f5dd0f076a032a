"""Issue 14: correct on the checkpoints users actually bring.

Every check runs on a tiny model of each family, built from the family's own config class with its own defaults
(tests/_families.py), saved, and loaded back with `from_pretrained` the way a user's checkpoint arrives: in eval mode,
with its `generation_config.json` (a chat checkpoint's: sampling on, repetition penalty, top-k/top-p, temperature,
no-repeat n-grams). The expected numbers need no reference implementation:

- a PPO/RLOO step's first epoch scores the rollout with the very policy that sampled it: ratio 1, variance 0, approx-KL 0
  (with the rollout's pass made apart, `keeps_first_pass=False`: a kept pass would make the ratio 1 by construction);
- log π_old, as the library computes it, is the log-probability `generate` actually sampled from (its processed scores),
  and `decode`, our own sampling loop, samples what `generate` samples wherever it takes the model;
- left padding and batching change nothing but float error;
- a reward model scores like the 🤗 classifier it was built from, and what it saves loads back to the same scores,
  with `RewardModel.from_pretrained` and with plain `AutoModelForSequenceClassification`.

The whole SFT → RM → PPO → RLOO pipeline runs by default for two families (Llama: rotary/GQA, the shape of most
current checkpoints; OPT: dropout held in float attributes); the others are marked `slow` (run them with `-m ""`).
Four mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS) are among the families. The cases of Qwen2-MoE,
Mixtral, GPT-OSS, Gemma 2, OLMo 2 and 3 and SmolLM3 are all `slow`: their code paths are checked by default elsewhere
(Qwen2's and Mistral's attention and Qwen3-MoE's sparse blocks in this matrix; GPT-OSS's sinks, Gemma 2's soft-capped
attention and the OLMo and SmolLM3 layers in chapter 03a).
"""

import contextlib
import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from instruct_goose import (
    Agent,
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
    encode_prompts,
    eval_mode,
    generate_responses,
    load_task,
    logprobs_from_logits,
    packed_linears,
    response_logits,
    task_tokenizer,
)
from instruct_goose import decoding
from instruct_goose.decoding import decoding_refusal, drawing_with

from _families import BY_NAME, CAUSAL, ENCODERS, build_causal, build_classifier

CAUSAL_NAMES = [f.name for f in CAUSAL]
ENCODER_NAMES = [f.name for f in ENCODERS]
PIPELINE_BY_DEFAULT = {"llama", "opt"}
# in the full matrix only: the code paths of each are checked by default elsewhere (see above)
SLOW_FAMILIES = {"qwen2_moe", "mixtral", "gpt_oss", "gemma2", "olmo2", "olmo3", "smollm3"}


def marked(names):
    "`names` as test parameters, those of `SLOW_FAMILIES` marked `slow`."
    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_FAMILIES else name for name in names]


# ----------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    "checkpoint(kind, family) -> the directory of that tiny model, saved once per module with its tokenizer."

    @functools.cache
    def save(kind, name):
        family = BY_NAME[name]
        model = build_causal(family, tokenizer) if kind == "causal" else build_classifier(family, tokenizer)
        path = tmp_path_factory.mktemp(f"{kind}-{name}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path

    return save


@pytest.fixture
def causal(checkpoint):
    "causal(family) -> a fresh copy of the family's causal LM, loaded as a user's checkpoint is."
    return lambda name: AutoModelForCausalLM.from_pretrained(checkpoint("causal", name))


def length_reward(prompts, completions):
    return [len(c) / 10 for c in completions]


def on_policy(tmp_path, **more):
    """One rollout of 4 responses, one PPO epoch, one minibatch: the update's forward pass is the rollout's,
    repeated."""
    return dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        total_episodes=4,
        response_length=8,
        max_prompt_length=32,
        num_ppo_epochs=1,
        num_mini_batches=1,
        disable_tqdm=True,
        num_sample_generations=0,
        **more,
    )


PROMPTS = [
    "Review: The editing in this western",
    "Review: a",
    "Review: The picture we saw on sunday at the old cinema",
    "Review: This second feature",
]


# ------------------------------------------------------------------------------ 1. the first-epoch ratio is
# exactly 1


def assert_first_epoch_is_on_policy(row):
    """The first epoch of the first step: π_θ = π_old, so the ratio is 1 (to float error), its variance and the
    approx KL 0."""
    assert row["val/ratio"] == pytest.approx(1.0, abs=1e-6), row
    assert row["val/ratio_var"] == pytest.approx(0.0, abs=1e-10), row
    assert row["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-10), row


@pytest.mark.parametrize("family", marked(CAUSAL_NAMES))
def test_ppo_first_epoch_ratio_is_one(family, causal, tokenizer, tmp_path):
    agent = Agent(causal(family))
    trainer = RLHFTrainer(
        agent,
        create_reference_model(agent),
        RLHFConfig(**on_policy(tmp_path)),
        processing_class=tokenizer,
        reward_funcs=length_reward,
        train_dataset=load_task("prompts"),
    )
    trainer.keeps_first_pass = False  # two passes that must agree, not one pass reused
    trainer.train()
    assert_first_epoch_is_on_policy(trainer.loop.state.history[0])


@pytest.mark.parametrize("family", marked(CAUSAL_NAMES))
def test_rloo_first_epoch_ratio_is_one(family, causal, tokenizer, tmp_path):
    policy = causal(family)
    trainer = RLOOTrainer(
        policy,
        create_reference_model(policy),
        RLOOConfig(num_generations=2, **on_policy(tmp_path)),
        processing_class=tokenizer,
        reward_funcs=length_reward,
        train_dataset=load_task("prompts"),
    )
    trainer.keeps_first_pass = False  # two passes that must agree, not one pass reused
    trainer.train()
    assert_first_epoch_is_on_policy(trainer.loop.state.history[0])


# ---------------------------------------------------------------- 2. what is sampled is what is scored (log
# π_old)


def capture_generate_scores(model) -> list:
    """Make `model.generate` also keep its processed scores (the distribution each token was drawn from); returns
    the list they go to."""
    captured, generate = [], model.generate

    def generate_and_keep_scores(*args, generation_config, **kwargs):
        generation_config = copy.deepcopy(generation_config)
        generation_config.output_scores = generation_config.return_dict_in_generate = True
        out = generate(*args, generation_config=generation_config, **kwargs)
        # (batch, steps, vocab), after every logits processor
        captured.append(torch.stack(out.scores, 1))
        return out.sequences

    model.generate = generate_and_keep_scores
    return captured


@pytest.mark.parametrize("family", marked(CAUSAL_NAMES))
def test_sampled_distribution_is_the_scored_one(family, causal, tokenizer):
    """log softmax of `generate`'s processed scores at each sampled token = `Agent.response_stats` log π_old (T =
    1, the default)."""
    agent = Agent(causal(family))
    captured = capture_generate_scores(agent.model)
    q, m = encode_prompts(tokenizer, PROMPTS)
    torch.manual_seed(0)
    r, rm = agent.generate(
        q, m, 12, tokenizer.eos_token_id, tokenizer.pad_token_id, temperature=1.0, own_decoder=False
    )
    scores = captured[0].float()
    steps = scores.shape[1]
    sampled = F.log_softmax(scores, -1).gather(-1, r[:, :steps, None]).squeeze(-1)
    ours = agent.response_stats(q, m, r, rm, temperature=1.0, entropy="skip").logprobs[:, :steps]
    real = rm[:, :steps]
    assert real.any()
    gap = (sampled - ours).abs()[real].max().item()
    assert gap <= 1e-4, (
        f"{family}: generate sampled from a distribution {gap:.3g} nats away from the one the library "
        f"scores (generation_config: {agent.model.generation_config.to_diff_dict()})"
    )


@pytest.mark.parametrize("family", marked(CAUSAL_NAMES))
def test_static_cache_samples_the_same_tokens(family, causal, tokenizer):
    """The static KV cache (on by default on a GPU) samples exactly what the dynamic one does from the same seed."""
    model = causal(family)
    q, m = encode_prompts(tokenizer, PROMPTS)
    samples = []
    for static in (False, True):
        torch.manual_seed(0)
        samples.append(
            generate_responses(
                model,
                q,
                m,
                12,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                static_cache=static,
                own_decoder=False,
            )
        )
    assert torch.equal(samples[0][0], samples[1][0]) and torch.equal(samples[0][1], samples[1][1]), family


@pytest.mark.parametrize("family", marked(CAUSAL_NAMES))
def test_packed_linears_sample_the_same_tokens(family, causal, tokenizer):
    """oneDNN-packed linear layers (on by default on the CPU) give the same logits to float rounding and the same
    samples."""
    model = causal(family)
    q, m = encode_prompts(tokenizer, PROMPTS)
    with torch.no_grad():
        plain = model(input_ids=q, attention_mask=m).logits
        # the tiny layers too
        with packed_linears(model, len(q), min_features=1):
            packed = model(input_ids=q, attention_mask=m).logits
    torch.testing.assert_close(packed, plain, rtol=1e-4, atol=1e-5)
    # every layer's own forward is back
    assert not any("forward" in vars(layer) for layer in model.modules())
    samples = []
    for pack in (False, True):
        torch.manual_seed(0)
        with (
            torch.no_grad(),
            packed_linears(model, len(q), min_features=1) if pack else contextlib.nullcontext(),
        ):
            samples.append(
                generate_responses(
                    model, q, m, 12, tokenizer.eos_token_id, tokenizer.pad_token_id, packed=False
                )
            )
    assert torch.equal(samples[0][0], samples[1][0]) and torch.equal(samples[0][1], samples[1][1]), family


# ------------------------------------------------------- 2b. our own decoding loop samples what `generate`
# samples

OWN_DECODING = [
    "gpt2",
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gpt_neox",
    "opt",
    "gemma2",
    "gemma3",
    "olmo2",
    "olmo3",
    "smollm3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
]


def test_decode_takes_the_families_it_has_a_step_for(causal):
    for family in CAUSAL_NAMES:
        refusal = decoding_refusal(causal(family))
        assert (refusal is None) == (family in OWN_DECODING), (family, refusal)


@pytest.mark.parametrize(
    "options",
    [{}, dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.1)],
    ids=["defaults", "chat-options"],
)
@pytest.mark.parametrize("family", marked(OWN_DECODING))
def test_decode_samples_the_tokens_generate_samples(family, options, causal, tokenizer):
    """With 🤗's draw (`torch.multinomial`) and the same seed, `decode` gives `generate`'s very tokens (no stop:
    the stop id is never drawn)."""
    model = causal(family)
    q, m = encode_prompts(tokenizer, PROMPTS)
    never = model.config.vocab_size
    samples = []
    for own in (False, True):
        torch.manual_seed(0)
        with drawing_with(lambda p: torch.multinomial(p, 1).squeeze(1)):
            samples.append(
                generate_responses(
                    model, q, m, 12, never, tokenizer.pad_token_id, own_decoder=own, **options
                )[0]
            )
    assert torch.equal(samples[0], samples[1]), family


def drawn_and_scored(agent, tokenizer, around=contextlib.nullcontext, **options):
    """`generate_responses` at T = 0.7 (inside `around()`), each step's p kept: log p of each drawn token as
    drawn, and log π_old of it as `Agent.response_stats` scores it (under the caller's autocast, if any)."""
    q, m = encode_prompts(tokenizer, PROMPTS)
    drawn, inverse_cdf = [], decoding._draw
    torch.manual_seed(0)
    with torch.no_grad(), around(), drawing_with(lambda p: drawn.append(p) or inverse_cdf(p)):
        r, rm = generate_responses(
            agent.model,
            q,
            m,
            10,
            agent.model.config.vocab_size,
            tokenizer.pad_token_id,
            temperature=0.7,
            **options,
        )
    assert rm.all() and len(drawn) == 10
    sampled = torch.stack(drawn, 1).gather(-1, r[..., None]).squeeze(-1).log()
    return sampled, agent.response_stats(q, m, r, rm, temperature=0.7, entropy="skip").logprobs


@pytest.mark.parametrize("family", marked(OWN_DECODING))
def test_decode_draws_from_the_scored_distribution(family, causal, tokenizer):
    """Each token's probability as `decode` drew it = exp log π_old as `Agent.response_stats` scores it (T =
    0.7)."""
    sampled, scored = drawn_and_scored(Agent(causal(family)), tokenizer)
    assert (sampled - scored).abs().max().item() <= 1e-5, family


@pytest.mark.parametrize("family", marked(OWN_DECODING))
def test_decode_draws_the_scored_distribution_under_cpu_bf16_autocast(family, causal, tokenizer):
    """Under CPU autocast to bf16 (the trainers' mixed precision there), with every linear layer packed in bf16
    and `_attend` attending bf16 queries in float32 over a float32 cache: each token drawn from exp log π_old
    as the trainers score it under the same autocast, to bf16's rounding (≤ 0.0042 measured on the 17 families
    on this CPU)."""
    agent = Agent(causal(family))

    @contextlib.contextmanager
    def packed():
        with packed_linears(agent.model, len(PROMPTS), min_features=1, dtype=torch.bfloat16):
            # the tiny layers packed too
            assert any("forward" in vars(mod) for mod in agent.model.modules())
            yield

    # a CPU without oneDNN's bf16 kernels: autocast's own multiplies
    around = packed if torch.ops.mkldnn._is_mkldnn_bf16_supported() else contextlib.nullcontext
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sampled, scored = drawn_and_scored(agent, tokenizer, around, packed=False)
    assert scored.dtype == torch.float32
    # 7× the 0.0042 measured here, for other CPUs' kernels; the bf16 path's mask ignored gives 0.19-0.28
    # (GPT-2, OPT)
    assert (sampled - scored).abs().max().item() <= 3e-2, family


# q, k, v apart (gpt2, gpt_neox, phi3: one layer already)
FUSED = {
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "opt",
    "gemma2",
    "gemma3",
    "olmo2",
    "olmo3",
    "smollm3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
}


@pytest.mark.parametrize("family", marked(OWN_DECODING))
def test_fused_projections_draw_the_scored_distribution(family, causal, tokenizer):
    """`fuse=True` (q, k, v and a gated MLP's gate, up stacked for the call, as under the trainers' mixed
    precision): each token drawn from exp log π_old as the trainers score it, the separate layers' tokens, and
    the model as it was after."""
    agent = Agent(causal(family))
    q, m = encode_prompts(tokenizer, PROMPTS)
    drawn, stacked, inverse_cdf = [], [], decoding._draw

    def draw(p):
        drawn.append(p)
        stacked.append(
            sum(n.endswith(("fused_qkv", "fused_gate_up")) for n, _ in agent.model.named_modules())
        )
        return inverse_cdf(p)

    torch.manual_seed(0)
    with drawing_with(draw), eval_mode(agent.model):
        r = decoding.decode(
            agent.model,
            q,
            m,
            10,
            agent.model.config.vocab_size,
            tokenizer.pad_token_id,
            temperature=0.7,
            fuse=True,
        )
    rm = torch.ones_like(r, dtype=torch.bool)
    sampled = torch.stack(drawn, 1).gather(-1, r[..., None]).squeeze(-1).log()
    scored = agent.response_stats(q, m, r, rm, temperature=0.7, entropy="skip").logprobs
    assert (sampled - scored).abs().max().item() <= 1e-5, family
    # the fused layers were made (and used: the draws above)
    assert (stacked[0] > 0) == (family in FUSED), (family, stacked)
    assert not any(
        n.endswith(("fused_qkv", "fused_gate_up")) or hasattr(mod, "_merged_away")
        for n, mod in agent.model.named_modules()
    )
    runs = []
    for fuse in (False, True):
        with drawing_with(by_argmax), eval_mode(agent.model):
            runs.append(
                decoding.decode(
                    agent.model, q, m, 12, agent.model.config.vocab_size, tokenizer.pad_token_id, fuse=fuse
                )
            )
    assert torch.equal(*runs), family


# sliding windows of 6 positions, past which every row reads (prompts up to 9 wide + 12 new tokens): on every
# layer where the family
# reads the config's window (Mistral, Mixtral, Phi-3, Qwen3-MoE), on the NoPE 4th (SmolLM3), on the second of
# two (Qwen2, Qwen3: `max_window_layers`), on the first (Gemma 2 and 3, OLMo 3, GPT-OSS)
WINDOWED = {
    "mistral": dict(sliding_window=6),
    "mixtral": dict(sliding_window=6),
    "phi3": dict(sliding_window=6),
    "qwen3_moe": dict(use_sliding_window=True, sliding_window=6),
    "smollm3": dict(use_sliding_window=True, sliding_window=6),
    **dict.fromkeys(("qwen2", "qwen3"), dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen2_moe": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
    **dict.fromkeys(
        ("gemma2", "gemma3", "olmo3", "gpt_oss"),
        dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    ),
}


@pytest.mark.parametrize("family", marked(list(WINDOWED)))
def test_decode_reads_sliding_windows_as_generate_and_the_scoring_pass_do(family, tokenizer):
    """Past a sliding window: `decode` gives 🤗 `generate`'s tokens (its draw, its seed), each token's p is exp
    log π_old as the trainers score it, and graphs change no token."""
    spec = BY_NAME[family]
    torch.manual_seed(0)
    model = getattr(transformers, spec.causal_class)(spec.config(tokenizer, **WINDOWED[family])).eval()
    windows = decoding._windows(model.config)
    assert 6 in windows and decoding_refusal(model) is None, windows
    q, m = encode_prompts(tokenizer, PROMPTS)
    never, samples, drawn = model.config.vocab_size, [], []
    for own in (False, True):
        torch.manual_seed(0)
        with drawing_with(lambda p: (drawn.append(p) if own else None) or torch.multinomial(p, 1).squeeze(1)):
            samples.append(
                generate_responses(model, q, m, 12, never, tokenizer.pad_token_id, own_decoder=own)[0]
            )
    assert torch.equal(samples[0], samples[1]), family
    r = samples[1]
    sampled = torch.stack(drawn, 1).gather(-1, r[..., None]).squeeze(-1).log()
    scored = (
        Agent(model).response_stats(q, m, r, torch.ones_like(r, dtype=torch.bool), entropy="skip").logprobs
    )
    assert (sampled - scored).abs().max().item() <= 1e-5, family
    runs = []
    # the windows of a tensor-held write position, as a graph replays it
    for graphs in (False, True):
        with drawing_with(by_argmax):
            runs.append(decoding.decode(model, q, m, 12, never, tokenizer.pad_token_id, graphs=graphs))
    assert torch.equal(*runs), family


def by_argmax(p):
    "A draw that depends on p alone: the inverse CDF at (0.618 × the most likely token + 0.3) mod 1."
    cdf = p.double().cumsum(-1)
    return torch.searchsorted(
        cdf, (p.argmax(-1, keepdim=True).double() * 0.618034 + 0.3) % 1 * cdf[:, -1:], right=True
    ).squeeze(1)


@pytest.mark.parametrize("family", marked(OWN_DECODING))
def test_decode_under_graphs_gives_the_plain_loops_tokens(family, causal, tokenizer):
    """`graphs=True` (static inputs, full-length masks, a tensor-held write position, power-of-two batches with
    filler rows; eager here on the CPU) changes no row's tokens, with rows stopping at different steps. So
    does `compile` (what `compile_generation=True` runs on a GPU), q, k, v and gate, up stacked: dynamo traces
    each part of the step whole (`fullgraph`; run as traced, no inductor here) at the first batch size, once
    more with the batch a symbol for the later sizes (and for batch 1), one layer's graph for all the layers
    that run the same code, and a second call traces nothing new."""
    model = causal(family)
    q, m = encode_prompts(tokenizer, PROMPTS * 2)
    # one id in 8: rows stop at different steps
    stops = list(range(3, model.config.vocab_size, 8))
    traced = []

    def backend(graph, example_inputs):
        traced.append(graph)
        return graph.forward

    runs = {}
    # dynamo remembers which sizes changed in earlier tests: start afresh
    torch._dynamo.reset()
    try:
        for run, options in [
            ("plain", dict(graphs=False)),
            ("graphs", dict(graphs=True)),
            *[(f"compiled {call}", dict(compile=dict(backend=backend), fuse=True)) for call in (1, 2)],
        ]:
            rows = []
            with drawing_with(lambda p: rows.append(len(p)) or by_argmax(p)):
                ids = decoding.decode(
                    model, q, m, 16, stops, tokenizer.pad_token_id, repetition_penalty=1.1, **options
                )
            # graphs, and those of a layer (they write its cache)
            runs[run] = ids, rows, len(traced), sum("index_copy" in g.code for g in traced)
    finally:
        torch._dynamo.reset()
    for run in ("graphs", "compiled 1", "compiled 2"):
        assert torch.equal(runs["plain"][0], runs[run][0]), (family, run)
    assert runs["plain"][1][-1] < 8 <= runs["plain"][1][0], runs["plain"][1]  # rows did leave the batch
    assert all(n <= b < 2 * n for b, n in zip(runs["graphs"][1], runs["plain"][1])), runs
    assert runs["compiled 1"][1] == runs["graphs"][1], runs  # the same batch sizes
    # batch sizes after the prompt's pass
    first, *later = sorted(set(runs["graphs"][1][1:]), reverse=True)
    # the first size's graph, one with the batch a symbol, batch 1's (dynamo specialises 1)
    per_part = 1 + any(b >= 2 for b in later) + (1 in later)
    # layers that run other code: SmolLM3's without rotary positions (NoPE)
    kinds = 2 if family == "smollm3" else 1
    # not a graph a layer, nor one a size: a per-layer guard (its index, say) doubles it
    assert runs["compiled 1"][3] == kinds * per_part, (family, runs)
    # the rotary table(s), the output layer; none anew
    assert (
        runs["compiled 1"][2] <= (kinds + 3) * per_part and runs["compiled 2"][2:] == runs["compiled 1"][2:]
    ), runs


# ------------------------------------------------------------------------ 3. left padding and batching change
# nothing


@pytest.mark.parametrize("family", marked(CAUSAL_NAMES))
def test_response_logprobs_do_not_depend_on_padding(family, causal, tokenizer):
    """Each row of a left-padded batch of prompts (responses right-padded) gets the log-probs and values it gets
    alone."""
    agent = Agent(causal(family))
    q, m = encode_prompts(tokenizer, PROMPTS)
    lengths = [7, 3, 5, 1]
    gen = torch.Generator().manual_seed(0)
    r = torch.randint(3, len(tokenizer), (len(PROMPTS), max(lengths)), generator=gen)  # no pad/eos/unk ids
    rm = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    r = r.masked_fill(~rm, tokenizer.pad_token_id)
    batch = agent.response_stats(q, m, r, rm, entropy="skip")
    for i, n in enumerate(lengths):
        qi, mi = encode_prompts(tokenizer, PROMPTS[i : i + 1])
        alone = agent.response_stats(qi, mi, r[i : i + 1, :n], rm[i : i + 1, :n], entropy="skip")
        torch.testing.assert_close(
            batch.logprobs[i, :n], alone.logprobs[0], atol=1e-5, rtol=0, msg=f"{family} row {i} log-probs"
        )
        torch.testing.assert_close(
            batch.values[i, :n], alone.values[0], atol=1e-5, rtol=0, msg=f"{family} row {i} values"
        )


# ----------------------------------------------------------------------- 4. the whole pipeline on a tiny
# model


def assert_finite_history(trainer, stage):
    history = trainer.loop.state.history
    assert history, f"{stage} logged nothing"
    bad = {k: v for row in history for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"{stage}: non-finite metrics {bad}"


def assert_reloads_as_causal_lm(trained, path, tokenizer):
    """The policy a trainer saved loads with plain `AutoModelForCausalLM` to the trained model's
    log-probabilities."""
    q, m = encode_prompts(tokenizer, PROMPTS)
    r = torch.randint(3, len(tokenizer), (len(PROMPTS), 5), generator=torch.Generator().manual_seed(1))
    rm = torch.ones_like(r, dtype=torch.bool)
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad(), eval_mode(trained):
        ours, theirs = (response_logits(model, q, m, r, rm)[0] for model in (trained, reloaded))
    torch.testing.assert_close(
        logprobs_from_logits(theirs, r), logprobs_from_logits(ours, r), atol=1e-5, rtol=0
    )


def pipeline_params():
    return [
        name if name in PIPELINE_BY_DEFAULT else pytest.param(name, marks=pytest.mark.slow)
        for name in CAUSAL_NAMES
    ]


@pytest.mark.parametrize("family", pipeline_params())
def test_pipeline_sft_rm_ppo_rloo(family, causal, tokenizer, tmp_path):
    """SFT → reward model (from the SFT checkpoint, as InstructGPT) → PPO → RLOO, two steps each: finite,
    reference untouched."""
    stage = dict(max_steps=2, per_device_train_batch_size=4, max_length=64, disable_tqdm=True)
    sft = SFTTrainer(
        causal(family),
        args=SFTConfig(output_dir=str(tmp_path / "sft"), **stage),
        train_dataset=load_task("sft"),
        processing_class=tokenizer,
    )
    sft.train()
    assert_finite_history(sft, "SFT")

    reward_model = RewardModel(str(tmp_path / "sft"), tokenizer=tokenizer)
    rm = RewardTrainer(
        reward_model, RewardConfig(output_dir=str(tmp_path / "rm"), **stage), load_task("preferences")
    )
    rm.train()
    assert_finite_history(rm, "reward model")

    rl = dict(
        per_device_train_batch_size=4,
        total_episodes=8,
        response_length=8,
        max_prompt_length=32,
        disable_tqdm=True,
        num_sample_generations=0,
        learning_rate=1e-3,
    )
    agent = Agent(AutoModelForCausalLM.from_pretrained(tmp_path / "sft"))
    reference = create_reference_model(agent)
    before = {k: v.clone() for k, v in reference.state_dict().items()}
    ppo = RLHFTrainer(
        agent,
        reference,
        RLHFConfig(output_dir=str(tmp_path / "ppo"), num_ppo_epochs=2, **rl),
        processing_class=tokenizer,
        reward_funcs=rm.reward_model,
        train_dataset=load_task("prompts"),
    )
    ppo.train()
    assert len(ppo.loop.state.history) == 2
    assert_finite_history(ppo, "PPO")
    assert all(torch.equal(before[k], v) for k, v in ppo.ref_model.state_dict().items()), (
        "PPO changed the reference model"
    )
    assert not any(p.requires_grad for p in ppo.ref_model.parameters())
    assert ppo.loop.state.history[-1]["objective/kl"] != 0.0  # the policy did move
    assert_reloads_as_causal_lm(ppo.model.model, tmp_path / "ppo", tokenizer)

    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    rloo = RLOOTrainer(
        policy,
        create_reference_model(policy),
        RLOOConfig(output_dir=str(tmp_path / "rloo"), num_generations=2, num_ppo_epochs=2, **rl),
        processing_class=tokenizer,
        reward_funcs=rm.reward_model,
        train_dataset=load_task("prompts"),
    )
    rloo.train()
    assert len(rloo.loop.state.history) == 2
    assert_finite_history(rloo, "RLOO")
    assert_reloads_as_causal_lm(rloo.model, tmp_path / "rloo", tokenizer)


# ------------------------------------------------------------- 5. reward models: the checkpoint's head, save
# → reload


def reward_texts():
    rows = load_task("preferences")[:6]
    return rows["prompt"], [
        c if i % 2 else r for i, (c, r) in enumerate(zip(rows["chosen"], rows["rejected"]))
    ]


def hf_scores(model, reward_model, texts):
    """The 🤗 classifier's own logits on `texts`, tokenized as the reward model tokenizes them (padded on the
    right)."""
    ids, mask = reward_model.encode(texts)
    with torch.no_grad():
        return model.eval()(input_ids=ids, attention_mask=mask).logits.squeeze(-1).float()


ALL_REWARD_BACKBONES = CAUSAL_NAMES + ENCODER_NAMES


@pytest.mark.parametrize("family", marked(ALL_REWARD_BACKBONES))
def test_reward_model_keeps_the_checkpoint_head(family, checkpoint, tokenizer):
    "RewardModel(path of a 1-label XForSequenceClassification) scores exactly as that classifier does."
    path = checkpoint("classifier", family)
    reward_model = RewardModel(str(path), tokenizer=tokenizer)
    prompts, completions = reward_texts()
    texts = [p + c for p, c in zip(prompts, completions)]
    theirs = hf_scores(AutoModelForSequenceClassification.from_pretrained(path), reward_model, texts)
    torch.testing.assert_close(reward_model.score(prompts, completions), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", marked(ALL_REWARD_BACKBONES))
def test_reward_model_reloads_as_reward_model(family, checkpoint, tokenizer, tmp_path):
    reward_model = RewardModel(str(checkpoint("classifier", family)), tokenizer=tokenizer)
    prompts, completions = reward_texts()
    reward_model.save_pretrained(tmp_path)
    torch.testing.assert_close(
        RewardModel.from_pretrained(tmp_path).score(prompts, completions),
        reward_model.score(prompts, completions),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("family", marked(ALL_REWARD_BACKBONES))
def test_reward_model_reloads_as_plain_transformers_classifier(family, checkpoint, tokenizer, tmp_path):
    "What `RewardModel.save_pretrained` writes is a 🤗 sequence classifier giving the reward model's scores."
    reward_model = RewardModel(str(checkpoint("classifier", family)), tokenizer=tokenizer)
    prompts, completions = reward_texts()
    reward_model.save_pretrained(tmp_path)
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    theirs = hf_scores(plain, reward_model, [p + c for p, c in zip(prompts, completions)])
    torch.testing.assert_close(theirs, reward_model.score(prompts, completions), atol=1e-5, rtol=0)


def hf_head_has_bias(path) -> bool:
    """Whether the 🤗 classifier's output layer (the last 1-output Linear) has a bias: every causal family's
    `score` has none."""
    model = AutoModelForSequenceClassification.from_pretrained(path)
    head = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1][-1]
    return head.bias is not None


@pytest.mark.parametrize("family", marked(ALL_REWARD_BACKBONES))
def test_reward_model_normalize(family, checkpoint, tokenizer):
    """`normalize_(reference)` maps every score s to (s − mean)/std of `reference` where the head has a bias, to s/std where not.

    A 🤗 causal `XForSequenceClassification` has a bias-less `score` Linear, so a shift cannot be saved in a form plain
    🤗 reloads to the same numbers (test_normalized_reward_model_reloads_as_plain_transformers_classifier); there the
    head is only scaled (a constant in the score does not change RLOO's leave-one-out advantages, and PPO's value
    function absorbs it). The reference scores are given, mean 1.25 and std √3.75 by hand, not the tiny model's own:
    an untrained encoder scores every text nearly alike (std ~6e-5 around 0.03), and dividing by that std would
    magnify float32 rounding past any fixed tolerance."""
    path = checkpoint("classifier", family)
    reward_model = RewardModel(str(path), tokenizer=tokenizer)
    prompts, completions = reward_texts()
    before = reward_model.score(prompts, completions)
    reference = torch.tensor([-1.0, 0.5, 2.0, 3.5])
    mean, std = 1.25, 3.75**0.5
    assert reference.mean().item() == pytest.approx(mean) and reference.std().item() == pytest.approx(std)
    reward_model.normalize_(reference)
    expected = (before - mean) / std if hf_head_has_bias(path) else before / std
    torch.testing.assert_close(reward_model.score(prompts, completions), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", marked(ALL_REWARD_BACKBONES))
def test_normalized_reward_model_reloads_as_plain_transformers_classifier(
    family, checkpoint, tokenizer, tmp_path
):
    """After `normalize_` (what `RewardTrainer` does by default) the saved model still loads in 🤗 to the
    normalised scores."""
    reward_model = RewardModel(str(checkpoint("classifier", family)), tokenizer=tokenizer)
    prompts, completions = reward_texts()
    # well-conditioned: see test_reward_model_normalize
    reward_model.normalize_(torch.tensor([-1.0, 0.5, 2.0, 3.5]))
    reward_model.save_pretrained(tmp_path)
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    theirs = hf_scores(plain, reward_model, [p + c for p, c in zip(prompts, completions)])
    torch.testing.assert_close(theirs, reward_model.score(prompts, completions), atol=1e-5, rtol=0)


# ---------------------------------------------------- 7. selective checkpointing changes no gradient, on
# every family


@pytest.mark.parametrize(
    "autocast", [pytest.param(False, marks=pytest.mark.slow), True], ids=["float32", "bf16-autocast"]
)
@pytest.mark.parametrize("family", marked(ALL_REWARD_BACKBONES))
def test_selective_checkpointing_gives_the_plain_gradients(family, autocast, checkpoint, tokenizer):
    """`gradient_checkpointing_policy="selective"` keeps what each block's matmuls and attention return and recomputes the
    rest (chapter levers): the loss and every gradient are the plain backward's to the bit, in train mode (dropout on: the
    recompute replays the same random draws), for each causal family and each reward backbone (as its classifier)."""
    from instruct_goose.levers import enable_gradient_checkpointing

    kind = "classifier" if family in ENCODER_NAMES else "causal"
    Auto = AutoModelForSequenceClassification if kind == "classifier" else AutoModelForCausalLM
    batch = tokenizer(PROMPTS, padding=True, return_tensors="pt")

    def loss_and_grads(policy):
        model = Auto.from_pretrained(checkpoint(kind, family)).train()
        if policy:
            enable_gradient_checkpointing(model, policy=policy)
            # the blocks checkpoint
            assert any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**batch).logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads(None)
    loss_, grads_ = loss_and_grads("selective")
    assert torch.equal(loss_, loss) and grads_.keys() == grads.keys() and len(grads) > 10
    assert all(torch.equal(grads_[n], grads[n]) for n in grads), [
        n for n in grads if not torch.equal(grads_[n], grads[n])
    ][:5]
