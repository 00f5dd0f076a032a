"""RLOO on conversational prompts with a reward model and a reward function, written as TRL's docs write it
(TRL ≥ 0.22 / 1.x `RLOOTrainer`: `reward_funcs`, `reward_weights`, `num_generations`, `beta`, `max_completion_length`).

Only the import line differs from the TRL script. Each reward's mean is logged as `rewards/<name>/mean`; their
weighted sum is the score. Run:
python examples/trl_style/rloo.py --model_name_or_path sft-model --reward_model_name_or_path reward-model --dataset tiny/prompts
"""
import argparse

from datasets import load_dataset
from peft import LoraConfig
from instruct_goose import RLOOConfig, RLOOTrainer   # TRL: from trl import RLOOConfig, RLOOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model_name_or_path", required=True)
parser.add_argument("--reward_model_name_or_path", required=True)
parser.add_argument("--dataset", required=True, help="a folder with train.jsonl and test.jsonl (a conversational `prompt`)")
parser.add_argument("--output_dir", default="rloo-model")
parser.add_argument("--use_peft", action="store_true", help="train LoRA adapters only")
parser.add_argument("--max_steps", type=int, default=100)
script_args = parser.parse_args()


def brevity(completions, **kwargs):
    "TRL's reward-function shape: conversational completions are message lists; a short reply earns up to 1."
    return [1.0 - min(len(completion[0]["content"]), 60) / 60 for completion in completions]


dataset = load_dataset("json", data_files={"train": f"{script_args.dataset}/train.jsonl",
                                           "test": f"{script_args.dataset}/test.jsonl"})
training_args = RLOOConfig(
    output_dir=script_args.output_dir,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=16,
    beta=0.05,
    reward_weights=[1.0, 0.5],
    max_steps=script_args.max_steps,
    learning_rate=1e-4,
    logging_steps=1,
    eval_steps=script_args.max_steps,
)
peft_config = LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM") if script_args.use_peft else None
trainer = RLOOTrainer(
    model=script_args.model_name_or_path,
    reward_funcs=[script_args.reward_model_name_or_path, brevity],
    args=training_args,
    train_dataset=dataset["train"],
    eval_dataset=dataset["test"],
    peft_config=peft_config,
)
trainer.train()
trainer.save_model(training_args.output_dir)
