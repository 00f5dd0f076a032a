"""DPO on chat preference pairs, written as TRL's docs write it (TRL 1.x `DPOTrainer`).

Only the import line differs from the TRL script. Rows: `prompt`, `chosen`, `rejected` as message lists; with no
`ref_model` the reference is a frozen copy of the model. Run:
python examples/trl_style/dpo.py --model_name_or_path sft-model --dataset tiny/preferences
"""
import argparse

from datasets import load_dataset
from instruct_goose import DPOConfig, DPOTrainer   # TRL: from trl import DPOConfig, DPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model_name_or_path", required=True)
parser.add_argument("--dataset", required=True, help="a folder with train.jsonl and test.jsonl (prompt, chosen, rejected)")
parser.add_argument("--output_dir", default="dpo-model")
parser.add_argument("--max_steps", type=int, default=100)
script_args = parser.parse_args()

dataset = load_dataset("json", data_files={"train": f"{script_args.dataset}/train.jsonl",
                                           "test": f"{script_args.dataset}/test.jsonl"})
training_args = DPOConfig(
    output_dir=script_args.output_dir,
    per_device_train_batch_size=16,
    max_steps=script_args.max_steps,
    learning_rate=1e-4,
    beta=0.1,
    logging_steps=5,
    eval_steps=script_args.max_steps,
)
trainer = DPOTrainer(
    model=script_args.model_name_or_path,
    args=training_args,
    train_dataset=dataset["train"],
    eval_dataset=dataset["test"],
)
trainer.train()
trainer.save_model(training_args.output_dir)
