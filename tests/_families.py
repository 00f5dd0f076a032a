"""Tiny models of the families users bring, each built from its own 🤗 config class with that family's defaults.

Only the sizes are set (2 layers, width 64, 4 heads, a small MLP), the vocabulary and the special ids come from the
task tokenizer, and every causal model carries a realistic, non-neutral `generation_config` (the kind a chat checkpoint
ships with). Dropout is left at the family's default, except where that default is 0 and the family reads its dropout
from a float attribute or from the config (BLOOM, Falcon, GPT-NeoX): there it is set to 0.1, as in checkpoints
fine-tuned with dropout, so that the "dropout is off everywhere" rule is really tested.
"""

from dataclasses import dataclass, field

import transformers as T
from transformers import GenerationConfig

LAYERS, WIDTH, HEADS, KV_HEADS, MLP, CONTEXT = 2, 64, 4, 2, 128, 256

# What a chat checkpoint's generation_config.json typically says: everything here changes the sampled
# distribution.
CHAT_GENERATION = dict(
    do_sample=True, repetition_penalty=1.1, top_k=20, top_p=0.8, temperature=0.7, no_repeat_ngram_size=3
)


@dataclass(frozen=True)
class Family:
    "A model family: its config class, the sizes in that class's own argument names, and its model classes."

    name: str
    config_class: str  # e.g. "LlamaConfig"
    sizes: dict = field(default_factory=dict)
    # the ...ForCausalLM class (None: an encoder, reward backbone only)
    causal_class: str | None = None
    classifier_class: str = ""  # the ...ForSequenceClassification class

    def config(self, tokenizer, **extra):
        special = dict(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
        return getattr(T, self.config_class)(**self.sizes, **special, **extra)


def _decoder(**more):
    "Sizes in the argument names most decoder configs share (Llama and its descendants)."
    return dict(
        num_hidden_layers=LAYERS,
        hidden_size=WIDTH,
        intermediate_size=MLP,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        **more,
    )


def _encoder(**more):
    return dict(
        num_hidden_layers=LAYERS,
        hidden_size=WIDTH,
        intermediate_size=MLP,
        num_attention_heads=HEADS,
        max_position_embeddings=CONTEXT,
        **more,
    )


CAUSAL = [
    Family(
        "gpt2",
        "GPT2Config",
        dict(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, n_inner=MLP, n_positions=CONTEXT),
        "GPT2LMHeadModel",
        "GPT2ForSequenceClassification",
    ),
    Family("llama", "LlamaConfig", _decoder(), "LlamaForCausalLM", "LlamaForSequenceClassification"),
    Family("qwen2", "Qwen2Config", _decoder(), "Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    Family(
        "qwen3",
        "Qwen3Config",
        _decoder(head_dim=WIDTH // HEADS),
        "Qwen3ForCausalLM",
        "Qwen3ForSequenceClassification",
    ),
    Family("mistral", "MistralConfig", _decoder(), "MistralForCausalLM", "MistralForSequenceClassification"),
    # SmolLM3: Llama without rotary positions on every 4th layer (NoPE): 4 layers here, so that one is
    Family(
        "smollm3",
        "SmolLM3Config",
        {**_decoder(), "num_hidden_layers": 4},
        "SmolLM3ForCausalLM",
        "SmolLM3ForSequenceClassification",
    ),
    # OLMo 2 and 3: q, k normalised over all heads, norms after attention and MLP; OLMo 3 with sliding and
    # full layers in turn
    Family("olmo2", "Olmo2Config", _decoder(), "Olmo2ForCausalLM", "Olmo2ForSequenceClassification"),
    Family("olmo3", "Olmo3Config", _decoder(), "Olmo3ForCausalLM", "Olmo3ForSequenceClassification"),
    # Gemma 2: attention logits soft-capped (50), the final ones too (30), sliding and full layers in turn
    Family(
        "gemma2",
        "Gemma2Config",
        _decoder(head_dim=WIDTH // HEADS),
        "Gemma2ForCausalLM",
        "Gemma2ForSequenceClassification",
    ),
    Family(
        "gemma3",
        "Gemma3TextConfig",
        _decoder(head_dim=WIDTH // HEADS),
        "Gemma3ForCausalLM",
        "Gemma3TextForSequenceClassification",
    ),
    Family("phi3", "Phi3Config", _decoder(), "Phi3ForCausalLM", "Phi3ForSequenceClassification"),
    # mixture-of-experts: every MLP a sparse block of 4 experts, 2 per token (routing in float32, 🤗's
    # grouped_mm experts)
    Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        _decoder(
            head_dim=WIDTH // HEADS, moe_intermediate_size=MLP // 4, num_experts=4, num_experts_per_tok=2
        ),
        "Qwen3MoeForCausalLM",
        "Qwen3MoeForSequenceClassification",
    ),
    # Qwen2-MoE: Qwen2's attention, a sparse block of 4 experts (2 a token) plus a shared expert every token
    # passes through
    Family(
        "qwen2_moe",
        "Qwen2MoeConfig",
        _decoder(
            moe_intermediate_size=MLP // 4,
            shared_expert_intermediate_size=MLP // 2,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "Qwen2MoeForCausalLM",
        "Qwen2MoeForSequenceClassification",
    ),
    Family(
        "mixtral",
        "MixtralConfig",
        _decoder(num_local_experts=4, num_experts_per_tok=2),
        "MixtralForCausalLM",
        "MixtralForSequenceClassification",
    ),
    # GPT-OSS: biases on q, k, v, o, a learned sink logit per head, sliding and full layers in turn (window
    # 128), 4 experts, 2 a token
    Family(
        "gpt_oss",
        "GptOssConfig",
        _decoder(head_dim=WIDTH // HEADS, num_local_experts=4, num_experts_per_tok=2),
        "GptOssForCausalLM",
        "GptOssForSequenceClassification",
    ),
    # OPTConfig's default dropout=0.1 is kept: OPT reads it from a float attribute of each layer, not an
    # nn.Dropout
    Family(
        "opt",
        "OPTConfig",
        dict(
            num_hidden_layers=LAYERS,
            hidden_size=WIDTH,
            word_embed_proj_dim=WIDTH,
            ffn_dim=MLP,
            num_attention_heads=HEADS,
            max_position_embeddings=CONTEXT,
        ),
        "OPTForCausalLM",
        "OPTForSequenceClassification",
    ),
    Family(
        "gpt_neox",
        "GPTNeoXConfig",
        dict(
            num_hidden_layers=LAYERS,
            hidden_size=WIDTH,
            intermediate_size=MLP,
            num_attention_heads=HEADS,
            max_position_embeddings=CONTEXT,
            hidden_dropout=0.1,
            attention_dropout=0.1,
        ),
        "GPTNeoXForCausalLM",
        "GPTNeoXForSequenceClassification",
    ),
    # BLOOM: hidden_dropout is a float attribute used by `dropout_add`; BLOOM has no position embeddings
    # (ALiBi)
    Family(
        "bloom",
        "BloomConfig",
        dict(n_layer=LAYERS, hidden_size=WIDTH, n_head=HEADS, hidden_dropout=0.1, attention_dropout=0.1),
        "BloomForCausalLM",
        "BloomForSequenceClassification",
    ),
    # Falcon reads `config.hidden_dropout` / `config.attention_dropout` inside the decoder layer's forward
    Family(
        "falcon",
        "FalconConfig",
        dict(
            num_hidden_layers=LAYERS,
            hidden_size=WIDTH,
            num_attention_heads=HEADS,
            ffn_hidden_size=MLP,
            max_position_embeddings=CONTEXT,
            hidden_dropout=0.1,
            attention_dropout=0.1,
        ),
        "FalconForCausalLM",
        "FalconForSequenceClassification",
    ),
]

ENCODERS = [
    Family("bert", "BertConfig", _encoder(), None, "BertForSequenceClassification"),
    Family("roberta", "RobertaConfig", _encoder(), None, "RobertaForSequenceClassification"),
    Family("deberta_v2", "DebertaV2Config", _encoder(), None, "DebertaV2ForSequenceClassification"),
]

BY_NAME = {f.name: f for f in CAUSAL + ENCODERS}


def build_causal(family: Family, tokenizer, seed: int = 0):
    "A randomly initialised causal LM of `family`, with a chat checkpoint's `generation_config`."
    import torch

    torch.manual_seed(seed)
    model = getattr(T, family.causal_class)(family.config(tokenizer))
    model.generation_config = GenerationConfig(
        **CHAT_GENERATION,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return model


def build_classifier(family: Family, tokenizer, seed: int = 0):
    "A randomly initialised 1-label sequence classifier (reward backbone) of `family`, its head included."
    import torch

    torch.manual_seed(seed)
    return getattr(T, family.classifier_class)(family.config(tokenizer, num_labels=1))
