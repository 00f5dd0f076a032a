"""Stand-ins for the Hub: a tiny chat model and the built-in task's data as JSON files, for the TRL-style scripts.

    python examples/trl_style/make_tiny.py tiny      # writes tiny/model and tiny/{sft,preferences,prompts,arithmetic}/
"""
import sys
from pathlib import Path

from instruct_goose.toy import arithmetic_task, chat_task_tokenizer, load_task, tiny_causal_lm


def write_split(dataset, folder: Path, n_test: int):
    "train.jsonl and test.jsonl (the last `n_test` rows), as `load_dataset('json', data_files=...)` reads them."
    folder.mkdir(parents=True, exist_ok=True)
    dataset.select(range(len(dataset) - n_test)).to_json(folder / "train.jsonl")
    dataset.select(range(len(dataset) - n_test, len(dataset))).to_json(folder / "test.jsonl")


def make_tiny(root: str | Path) -> Path:
    "A randomly initialised chat LM with its tokenizer (ChatML template) in `root`/model, and the data sets beside it."
    root = Path(root)
    tokenizer = chat_task_tokenizer()
    tiny_causal_lm(tokenizer).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    write_split(load_task("sft", chat=True), root / "sft", n_test=64)                  # `messages` conversations
    write_split(load_task("preferences", chat=True), root / "preferences", n_test=64)  # prompt / chosen / rejected messages
    write_split(load_task("prompts", chat=True), root / "prompts", n_test=32)          # conversational prompts
    write_split(arithmetic_task(n=300), root / "arithmetic", n_test=32)                # prompt "12+7=" and its answer
    return root


if __name__ == "__main__": make_tiny(sys.argv[1] if len(sys.argv) > 1 else "tiny")
