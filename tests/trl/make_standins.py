"""Offline stand-ins for the Hub repositories TRL's trainer tests load (`make test-trl`).

TRL's tests load tiny random models (`trl-internal-testing/tiny-Qwen2ForCausalLM-2.5`, ...) and small data sets
(`trl-internal-testing/zen`, one config per data set type) from the Hugging Face Hub. This machine has no Hub, so this
script writes stand-ins into a local cache laid out as the Hub libraries keep it, and the tests then run unchanged with
`HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME=<out>`:

* models: `<out>/hub/models--<org>--<name>/snapshots/<fixed hash>/` (config, bf16 safetensors, tokenizer, chat
  template, generation config) and `refs/main`, which `from_pretrained` resolves offline as it would a real download;
* data sets: `<out>/datasets/<org>___<name>/<config>/0.0.0/<fixed hash>/` (Arrow files and `dataset_info.json`), the
  cache `datasets.load_dataset` falls back on offline, as on a machine that once loaded them from the Hub (splits,
  slicing such as `train[:2]` and `streaming=True` work as they would there).

The models follow TRL's own generator scripts (`scripts/generate_tiny_models/`): the same config class and sizes
(hidden size 8 or 16, 2 layers, 4 heads, 2 KV heads, MLP 32), bf16 weights with TRL's tiny-model init, seeded. What
cannot be had offline is the base model's tokenizer (Qwen2.5's, Qwen3's, Llama 3.2's), so each family gets a
byte-level BPE trained here on a small corpus, laid out like the real one: the same vocabulary size, the special tokens
at the same ids (`<|endoftext|>` 151643 as pad, `<|im_end|>` 151645 as eos, ...), the same pre-tokenizer, and the real
chat template, read from the installed TRL's `trl/chat_templates/` (TRL recognises templates by exact text, so the
text has to be the real one). Ordinary text is encoded into the ~3,000 ids the BPE learned; the remaining ids up to
the special tokens are `<fillerN>` entries that no merge produces (a sampled one decodes to its own text).

The data sets are read from TRL's `scripts/generate_zen_dataset.py` (the literal rows of each config) in the TRL
checkout given with `--trl-src` (the tests come from the same checkout, see run.py), and split as that script splits
them (`train_test_split(test_size=0.1, shuffle=False)`: 17 train rows, 2 test rows).

Only what the five test files of run.py load is made; ids the tests load that have no stand-in here fail on TRL too and
are reported as such by run.py.

    python tests/trl/make_standins.py --trl-src .trl-standins/trl-src --out .trl-standins/hf
"""

import argparse
import ast
import hashlib
import json
import shutil
import sys
from pathlib import Path

GENERATOR_VERSION = "1"  # bump to rebuild every stand-in
ORG = "trl-internal-testing"

# ---------------------------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------------------------

# The pre-tokenizer split of Qwen2/Qwen2.5/Qwen3's tokenizer.json (a Split on this pattern, then ByteLevel without the
# regex), and of Llama 3's (the tiktoken cl100k-style pattern).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN25_ADDED = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]
# in the real tokenizers the tool-call, FIM and think tokens are added tokens that are not "special" (kept on decode)
QWEN_NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
}
QWEN3_ADDED = QWEN25_ADDED + ["<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA3_NAMED = {
    0: "<|begin_of_text|>",
    1: "<|end_of_text|>",
    2: "<|reserved_special_token_0|>",
    3: "<|reserved_special_token_1|>",
    4: "<|finetune_right_pad_id|>",
    5: "<|reserved_special_token_2|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    8: "<|eom_id|>",
    9: "<|eot_id|>",
    10: "<|python_tag|>",
}
LLAMA3_ADDED = [LLAMA3_NAMED.get(i, f"<|reserved_special_token_{i - 8}|>") for i in range(256)]

TOKENIZERS = {
    # name: (pre-tokenizer pattern, id of the first added token, added tokens, tokenizer class, template file,
    #        special tokens map, model_max_length)
    "qwen2.5": dict(
        split=QWEN_SPLIT,
        base=151643,
        added=QWEN25_ADDED,
        cls="Qwen2Tokenizer",
        template="qwen2_5.jinja",
        specials=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None),
        max_len=131072,
        not_special=QWEN_NOT_SPECIAL,
    ),
    "qwen3": dict(
        split=QWEN_SPLIT,
        base=151643,
        added=QWEN3_ADDED,
        cls="Qwen2Tokenizer",
        template="qwen3.jinja",
        specials=dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None),
        max_len=131072,
        not_special=QWEN_NOT_SPECIAL,
    ),
    "llama3.2": dict(
        split=LLAMA3_SPLIT,
        base=128000,
        added=LLAMA3_ADDED,
        cls="PreTrainedTokenizerFast",
        template="llama3_2.jinja",
        specials=dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token=None),
        max_len=131072,
        not_special=set(),
    ),
}


def corpus(zen_rows) -> list[str]:
    "What the BPE learns its merges from: every string of the zen data sets, rendered chat turns, JSON and prose."
    texts = []

    def walk(x):
        if isinstance(x, str):
            texts.append(x)
        elif isinstance(x, dict):
            [walk(v) for v in x.values()]
        elif isinstance(x, (list, tuple)):
            [walk(v) for v in x]

    walk(zen_rows)
    texts += [
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        "You are a helpful assistant with tool calling capabilities.",
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
        '{"name": "multiply", "arguments": {"a": 3, "b": 4}}',
        '{"type": "function", "function": {}}',
        "For each function call, return a json object with function name and arguments within XML tags.",
        "The quick brown fox jumps over the lazy dog. What is the weather like today? I don't know.",
        "Done! The answer is 42. Let me think step by step. Hello world, this is a test sentence.",
        " ".join(str(i) for i in range(200)),
    ]
    return texts * 3


def build_tokenizer(name: str, out: Path, zen_rows, trl_templates: Path):
    "Train a byte-level BPE laid out like tokenizer `name` (vocab size, special ids, template) and save it in `out`."
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    spec = TOKENIZERS[name]
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC() if name.startswith("qwen") else None
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(corpus(zen_rows), trainer=trainer)
    learned = json.loads(tok.to_str())["model"]
    vocab = dict(learned["vocab"])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    # fill the ids up to the first added token with entries no merge produces
    for i in range(len(vocab), spec["base"]):
        vocab[f"<filler{i}>"] = i
    assert len(vocab) == spec["base"], (name, len(vocab))
    full = Tokenizer(BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=False))
    full.normalizer, full.pre_tokenizer, full.decoder = tok.normalizer, pre, decoders.ByteLevel()
    from tokenizers import AddedToken

    for t in spec["added"]:  # one at a time, so that each gets the next id, in the real tokenizer's order
        if t in spec["not_special"]:
            full.add_tokens([AddedToken(t, special=False, normalized=False)])
        else:
            full.add_special_tokens([AddedToken(t, special=True, normalized=False)])
    assert full.token_to_id(spec["added"][0]) == spec["base"] and full.get_vocab_size() == spec["base"] + len(
        spec["added"]
    )
    specials = {k: v for k, v in spec["specials"].items() if v is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=full, model_max_length=spec["max_len"], **specials)
    fast.chat_template = (trl_templates / spec["template"]).read_text(encoding="utf-8")
    fast.save_pretrained(out)
    # name the class the real repository names, as AutoTokenizer reads it from tokenizer_config.json
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = spec["cls"]
    if spec["specials"].get("bos_token", "") is None:
        cfg["bos_token"] = None
    cfg["padding_side"] = "right" if name.startswith("qwen") else cfg.get("padding_side", "right")
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    return full.get_vocab_size()


# ---------------------------------------------------------------------------------------------------------------
# models: (repo name, tokenizer, builder) -- sizes as in TRL's scripts/generate_tiny_models/
# ---------------------------------------------------------------------------------------------------------------

QWEN25_GEN = dict(
    bos_token_id=151643,
    pad_token_id=151643,
    do_sample=True,
    eos_token_id=[151645, 151643],
    repetition_penalty=1.05,
    temperature=0.7,
    top_p=0.8,
    top_k=20,
)  # Qwen2.5-32B-Instruct's
QWEN3_GEN = dict(
    bos_token_id=151643,
    pad_token_id=151643,
    do_sample=True,
    eos_token_id=[151645, 151643],
    temperature=0.6,
    top_k=20,
    top_p=0.95,
)  # Qwen3-8B's / 30B-A3B's
LLAMA32_GEN = dict(
    bos_token_id=128000, do_sample=True, eos_token_id=[128001, 128008, 128009], temperature=0.6, top_p=0.9
)  # Llama-3.2-1B-Instruct's
SMALL = dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32)


def _qwen2_causal(vocab):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=8, **SMALL))


def _qwen2_seqcls(vocab):
    # TRL takes Qwen2.5-32B-Instruct's config and shrinks it: its vocab (152064), rope and window settings stay
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    cfg = Qwen2Config(
        vocab_size=152064,
        hidden_size=16,
        num_labels=1,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        sliding_window=131072,
        max_window_layers=64,
        use_sliding_window=False,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
        **SMALL,
    )
    return Qwen2ForSequenceClassification(cfg)


def _qwen3_causal(vocab):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=8, **SMALL))


def _qwen3_moe(vocab):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        norm_topk_prob=True,
        bos_token_id=151643,
        eos_token_id=151645,
        head_dim=128,
        max_window_layers=48,
        **SMALL,
    )
    return Qwen3MoeForCausalLM(cfg)


def _qwen3_seqcls(vocab):
    # from Qwen3-4B's config: vocab 151936, head_dim 128, tied embeddings
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    cfg = Qwen3Config(
        vocab_size=151936,
        hidden_size=16,
        num_labels=1,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        bos_token_id=151643,
        eos_token_id=151645,
        **SMALL,
    )
    return Qwen3ForSequenceClassification(cfg)


def _llama_causal(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=8, **SMALL))


def _llama_seqcls(vocab):
    # from Llama-3.2-1B-Instruct's config: head_dim 64, llama3 rope scaling, tied embeddings
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=16,
        num_labels=1,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            high_freq_factor=4.0,
            low_freq_factor=1.0,
            original_max_position_embeddings=8192,
        ),
        **SMALL,
    )
    return LlamaForSequenceClassification(cfg)


MODELS = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2.5", _qwen2_causal, QWEN25_GEN),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2.5", _qwen2_seqcls, QWEN25_GEN),
    "tiny-Qwen3ForCausalLM": ("qwen3", _qwen3_causal, QWEN3_GEN),
    "tiny-Qwen3MoeForCausalLM": ("qwen3", _qwen3_moe, QWEN3_GEN),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", _qwen3_seqcls, QWEN3_GEN),
    "tiny-LlamaForCausalLM-3.2": ("llama3.2", _llama_causal, LLAMA32_GEN),
    "tiny-LlamaForSequenceClassification-3.2": ("llama3.2", _llama_seqcls, LLAMA32_GEN),
}


def init_weights_tiny_model(model):
    "TRL's init for its tiny models (no NaNs from uninitialised weights): Xavier linear/conv, N(0, 0.02) embeddings."
    from torch import nn

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv1d)):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def fixed_hash(kind: str, repo_id: str) -> str:
    return hashlib.sha1(f"instruct_goose-standin-{GENERATOR_VERSION}-{kind}-{repo_id}".encode()).hexdigest()


def write_model(hf_home: Path, name: str, tok_dirs: dict, zen_rows, trl_templates: Path, seed: int):
    import torch
    from transformers import GenerationConfig

    tok_name, build, gen = MODELS[name]
    repo_id = f"{ORG}/{name}"
    root = hf_home / "hub" / f"models--{ORG}--{name}"
    h = fixed_hash("model", repo_id)
    snap = root / "snapshots" / h
    if (snap / ".complete").exists():
        return
    shutil.rmtree(root, ignore_errors=True)
    snap.mkdir(parents=True)
    if tok_name not in tok_dirs:
        d = hf_home / "_tokenizers" / tok_name
        shutil.rmtree(d, ignore_errors=True)
        tok_dirs[tok_name] = (d, build_tokenizer(tok_name, d, zen_rows, trl_templates))
    tok_dir, vocab = tok_dirs[tok_name]
    torch.manual_seed(seed)
    model = build(vocab).to(dtype=torch.bfloat16)
    init_weights_tiny_model(model)
    model.save_pretrained(snap)
    GenerationConfig(**gen).save_pretrained(snap)
    for f in tok_dir.iterdir():
        shutil.copy(f, snap / f.name)
    (snap / "README.md").write_text(
        f"Offline stand-in for {repo_id}, written by instruct_goose's "
        f"tests/trl/make_standins.py (random weights, trained toy tokenizer).\n"
    )
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(h)
    (snap / ".complete").write_text("")


# ---------------------------------------------------------------------------------------------------------------
# data sets
# ---------------------------------------------------------------------------------------------------------------


def zen_configs(script: Path) -> dict[str, dict]:
    "The rows of each config of TRL's zen data set, read (not run) from its generator script's `Dataset.from_dict` literals."
    tree = ast.parse(script.read_text(encoding="utf-8"))
    configs = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.endswith("_dataset")
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "attr", None) == "from_dict"
        ):
            configs[node.targets[0].id[: -len("_dataset")]] = ast.literal_eval(node.value.args[0])
    if not configs:
        raise SystemExit(f"no Dataset.from_dict literals in {script}")
    return configs


def write_dataset(hf_home: Path, name: str, configs: dict[str, dict], test_size: float = 0.1):
    "Each config as the Arrow cache `load_dataset` reads offline: <org>___<name>/<config>/0.0.0/<hash>/."
    from datasets import Dataset
    from datasets.packaged_modules.parquet.parquet import Parquet

    repo_id = f"{ORG}/{name}"
    h = fixed_hash("dataset", repo_id)
    cache = hf_home / "datasets"
    final_root = cache / f"{ORG}___{name}"
    if (final_root / ".complete").exists():
        return
    shutil.rmtree(final_root, ignore_errors=True)
    work = hf_home / "_build" / name
    shutil.rmtree(work, ignore_errors=True)
    for config, rows in configs.items():
        splits = Dataset.from_dict(rows).train_test_split(test_size=test_size, shuffle=False)
        files = {}
        for split, ds in splits.items():
            p = work / "parquet" / config / f"{split}-00000-of-00001.parquet"
            p.parent.mkdir(parents=True, exist_ok=True)
            ds.to_parquet(str(p))
            files[split] = str(p)
        # the parquet builder, as `load_dataset` runs it on the Hub's parquet files, into a scratch cache ...
        builder = Parquet(
            cache_dir=str(work / "cache"), dataset_name=name, config_name=config, hash=h, data_files=files
        )
        builder.download_and_prepare()
        # ... moved to where the Hub download would have put it (<org>___<name>/<config>/...), named by config alone
        dest = final_root / config / "0.0.0" / h
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(builder.cache_dir, dest)
        info = json.loads((dest / "dataset_info.json").read_text())
        info["config_name"] = config
        (dest / "dataset_info.json").write_text(json.dumps(info))
    shutil.rmtree(work, ignore_errors=True)
    (final_root / ".complete").write_text("")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-src", type=Path, required=True, help="a TRL source tree (its scripts/ are read)")
    ap.add_argument("--out", type=Path, required=True, help="HF_HOME to write the stand-ins in")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import datasets, transformers, trl

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    trl_templates = Path(trl.__file__).parent / "chat_templates"
    configs = zen_configs(args.trl_src / "scripts" / "generate_zen_dataset.py")
    args.out.mkdir(parents=True, exist_ok=True)
    write_dataset(args.out, "zen", configs)
    tok_dirs = {}
    for i, name in enumerate(MODELS):
        write_model(args.out, name, tok_dirs, configs, trl_templates, seed=args.seed + i)
        print(f"stand-in: {ORG}/{name}", file=sys.stderr)
    shutil.rmtree(args.out / "_tokenizers", ignore_errors=True)
    shutil.rmtree(args.out / "_build", ignore_errors=True)


if __name__ == "__main__":
    main()
