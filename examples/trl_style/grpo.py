"""GRPO with a verifiable reward that reads a dataset column, written as TRL's docs write it (TRL 1.x `GRPOTrainer`).

Only the import line differs from the TRL script. The rows have a `prompt` ("12+7=") and an `answer` ("19"); the
trainer passes the `answer` of each completion's own prompt to the reward function, as TRL does. Run:
python examples/trl_style/grpo.py --model_name_or_path tiny/model --dataset tiny/arithmetic
"""
import argparse

from datasets import load_dataset
from instruct_goose import GRPOConfig, GRPOTrainer   # TRL: from trl import GRPOConfig, GRPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model_name_or_path", required=True)
parser.add_argument("--dataset", required=True, help="a folder with train.jsonl and test.jsonl (`prompt` and `answer`)")
parser.add_argument("--output_dir", default="grpo-model")
parser.add_argument("--max_steps", type=int, default=100)
script_args = parser.parse_args()


def accuracy(completions, answer, **kwargs):
    "1 when the completion starts with the right answer, else 0 (`answer` is the dataset's column)."
    return [1.0 if completion.strip().startswith(a) else 0.0 for completion, a in zip(completions, answer)]


dataset = load_dataset("json", data_files={"train": f"{script_args.dataset}/train.jsonl",
                                           "test": f"{script_args.dataset}/test.jsonl"})
training_args = GRPOConfig(
    output_dir=script_args.output_dir,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=4,
    max_steps=script_args.max_steps,
    learning_rate=1e-4,
    logging_steps=1,
)
trainer = GRPOTrainer(
    model=script_args.model_name_or_path,
    reward_funcs=accuracy,
    args=training_args,
    train_dataset=dataset["train"],
    eval_dataset=dataset["test"],
)
trainer.train()
trainer.save_model(training_args.output_dir)
