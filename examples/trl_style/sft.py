"""Supervised fine-tuning on conversations, written as TRL's docs write it (TRL 1.x `SFTTrainer`).

Only the import line differs from the TRL script. The rows are `messages` conversations; the loss is on the
assistant's turns. Run: python examples/trl_style/sft.py --model_name_or_path tiny/model --dataset tiny/sft
"""
import argparse

from datasets import load_dataset
from peft import LoraConfig
from instruct_goose import SFTConfig, SFTTrainer   # TRL: from trl import SFTConfig, SFTTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model_name_or_path", required=True)
parser.add_argument("--dataset", required=True, help="a folder with train.jsonl and test.jsonl (a `messages` column)")
parser.add_argument("--output_dir", default="sft-model")
parser.add_argument("--use_peft", action="store_true", help="train LoRA adapters only")
parser.add_argument("--max_steps", type=int, default=200)
script_args = parser.parse_args()

dataset = load_dataset("json", data_files={"train": f"{script_args.dataset}/train.jsonl",
                                           "test": f"{script_args.dataset}/test.jsonl"})
training_args = SFTConfig(
    output_dir=script_args.output_dir,
    per_device_train_batch_size=16,
    max_steps=script_args.max_steps,
    learning_rate=1e-3,
    logging_steps=5,
    eval_steps=script_args.max_steps,
)
peft_config = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM") if script_args.use_peft else None
trainer = SFTTrainer(
    model=script_args.model_name_or_path,
    args=training_args,
    train_dataset=dataset["train"],
    eval_dataset=dataset["test"],
    peft_config=peft_config,
)
trainer.train()
trainer.save_model(training_args.output_dir)
