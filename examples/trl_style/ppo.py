"""PPO from a reward model, written as TRL's example script writes it (TRL ≤ 1.12 `trl.experimental.ppo.PPOTrainer`,
earlier `trl.PPOTrainer`; examples/scripts/ppo/ppo.py).

Only the import line differs from the TRL script: the policy, reference, reward and value models are 🤗 models
loaded by the script, the prompts are tokenized into `input_ids` first, as TRL's PPO expects. Run:
python examples/trl_style/ppo.py --sft_model_path sft-model --reward_model_path reward-model --dataset tiny/prompts
"""
import argparse

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from instruct_goose import PPOConfig, PPOTrainer   # TRL ≤ 1.12: from trl.experimental.ppo import PPOConfig, PPOTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--sft_model_path", required=True)
parser.add_argument("--reward_model_path", required=True)
parser.add_argument("--dataset", required=True, help="a folder with train.jsonl and test.jsonl (a conversational `prompt`)")
parser.add_argument("--output_dir", default="ppo-model")
parser.add_argument("--total_episodes", type=int, default=512)
script_args = parser.parse_args()

training_args = PPOConfig(
    output_dir=script_args.output_dir,
    per_device_train_batch_size=8,
    total_episodes=script_args.total_episodes,
    learning_rate=1e-4,
    response_length=16,
    kl_coef=0.05,
    num_ppo_epochs=2,
    logging_steps=1,
)
tokenizer = AutoTokenizer.from_pretrained(script_args.sft_model_path, padding_side="left")
policy = AutoModelForCausalLM.from_pretrained(script_args.sft_model_path)
ref_policy = AutoModelForCausalLM.from_pretrained(script_args.sft_model_path)
reward_model = AutoModelForSequenceClassification.from_pretrained(script_args.reward_model_path, num_labels=1)
value_model = AutoModelForSequenceClassification.from_pretrained(script_args.reward_model_path, num_labels=1)

dataset = load_dataset("json", data_files={"train": f"{script_args.dataset}/train.jsonl",
                                           "test": f"{script_args.dataset}/test.jsonl"})


def prepare_dataset(dataset, tokenizer):
    "TRL's PPO reads token ids: the prompt rendered with the chat template and the assistant's turn opened."
    def tokenize(row):
        return {"input_ids": tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]}
    return dataset.map(tokenize, remove_columns=dataset.column_names)


trainer = PPOTrainer(
    args=training_args,
    processing_class=tokenizer,
    model=policy,
    ref_model=ref_policy,
    reward_model=reward_model,
    value_model=value_model,
    train_dataset=prepare_dataset(dataset["train"], tokenizer),
    eval_dataset=prepare_dataset(dataset["test"], tokenizer),
)
trainer.train()
trainer.save_model(training_args.output_dir)
