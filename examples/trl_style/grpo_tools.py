"""GRPO with a tool, in the form of TRL's agent-training example (TRL ≥ 0.26 `GRPOTrainer(tools=[...])`).

Only the import line differs from the TRL script. The model may call `multiply` while it samples; the reward reads the
last assistant turn of each conversation. The model's chat template must render tools (the tools chapter's
`with_tool_template` gives a tiny tokenizer one). Run:
python examples/trl_style/grpo_tools.py --model_name_or_path tiny/model
"""
import argparse

from datasets import Dataset
from instruct_goose import GRPOConfig, GRPOTrainer   # TRL: from trl import GRPOConfig, GRPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--model_name_or_path", required=True)
parser.add_argument("--output_dir", default="grpo-tools-model")
parser.add_argument("--max_steps", type=int, default=100)
script_args = parser.parse_args()


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


dataset = Dataset.from_list([
    {"prompt": [{"role": "user", "content": f"What is {a} multiplied by {b}?"}], "answer": a * b}
    for a in range(3, 9) for b in range(4, 10)
])


def correctness(completions, answer, **kwargs):
    "1 when the final assistant message contains the product."
    return [float(str(a) in completion[-1]["content"]) for completion, a in zip(completions, answer)]


training_args = GRPOConfig(
    output_dir=script_args.output_dir,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=64,
    max_tool_calling_iterations=2,
    max_steps=script_args.max_steps,
    logging_steps=1,
)
trainer = GRPOTrainer(
    model=script_args.model_name_or_path,
    reward_funcs=correctness,
    args=training_args,
    train_dataset=dataset,
    tools=[multiply],
)
trainer.train()
trainer.save_model(script_args.output_dir)
