"""TRL's paper-index recipes for GRPO and RLOO (TRL 1.14–1.16 docs, `docs/source/paper_index.md`), run as TRL users write them.

Each recipe below sets the options TRL's documentation gives for the paper (loss type, clipping, KL, sampling,
generation batching, entropy masking, reward scaling) word for word; only the sizes are shrunk to a tiny model on a
CPU (`SMALL`: batch, group size, completion length, accumulation), and every run also turns on TRL's completion
logging (`log_completions`, `num_completions_to_print`). Only the import line differs from TRL. Run:

    python examples/trl_style/make_tiny.py tiny
    python examples/trl_style/paper_configs.py --model_name_or_path tiny/model --dataset tiny/arithmetic [--only gspo]

ScaleRL's recipe includes `cast_lm_head_to_fp32=True`: the output layer computes the logits in float32, for sampling
and scoring alike.
"""
import argparse
import json
from pathlib import Path

from datasets import load_dataset
from instruct_goose import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer   # TRL: from trl import ...
from instruct_goose.rewards import get_soft_overlong_punishment                 # TRL: from trl.rewards import ...

parser = argparse.ArgumentParser()
parser.add_argument("--model_name_or_path", required=True)
parser.add_argument("--dataset", required=True, help="a folder with train.jsonl and test.jsonl (`prompt` and `answer`)")
parser.add_argument("--output_dir", default="paper-configs")
parser.add_argument("--max_steps", type=int, default=2)
parser.add_argument("--only", nargs="*", help="run only these recipes (default: all)")
script_args = parser.parse_args()

COMPLETION = 4   # tokens: the arithmetic answers are at most 4 long
SMALL = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=COMPLETION, learning_rate=1e-4,
             max_steps=script_args.max_steps, logging_steps=1, log_completions=True, num_completions_to_print=2)


def accuracy(completions, answer, **kwargs):
    "1 when the completion starts with the right answer, else 0 (`answer` is the dataset's column)."
    return [1.0 if completion.strip().startswith(a) else 0.0 for completion, a in zip(completions, answer)]


sop_reward = get_soft_overlong_punishment(max_completion_len=COMPLETION, soft_punish_cache=2)   # DAPO's, shrunk like the rest

RECIPES = {   # name: (config class, the paper's options as TRL documents them, extra reward functions)
    "deepseek_r1": (GRPOConfig, dict(loss_type="grpo", beta=0.001, epsilon=10.0, steps_per_generation=2), []),
    "gspo": (GRPOConfig, dict(importance_sampling_level="sequence", loss_type="grpo", beta=0.0, epsilon=3e-4, epsilon_high=4e-4,
                              gradient_accumulation_steps=1, steps_per_generation=4), []),
    "dapo": (GRPOConfig, dict(mask_truncated_completions=True, loss_type="dapo", epsilon_high=0.28, epsilon=0.2, beta=0.0), [sop_reward]),
    "entropy_80_20": (GRPOConfig, dict(mask_truncated_completions=True, loss_type="dapo", epsilon_high=0.28, epsilon=0.2, beta=0.0,
                                       top_entropy_quantile=0.2), [sop_reward]),
    "dr_grpo": (GRPOConfig, dict(loss_type="dr_grpo", beta=0.0), []),
    "lite_ppo": (GRPOConfig, dict(scale_rewards="batch", loss_type="dapo", beta=0.0, top_p=0.99, top_k=100, temperature=0.99,
                                  num_iterations=1, gradient_accumulation_steps=2, steps_per_generation=4), []),
    "scalerl": (GRPOConfig, dict(loss_type="cispo", epsilon_high=5.0, scale_rewards="batch", cast_lm_head_to_fp32=True), []),
    "sapo": (GRPOConfig, dict(loss_type="sapo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, scale_rewards="group"), []),
    "deepseek_v32": (GRPOConfig, dict(beta=0.001, use_bias_correction_kl=True), []),
    "rloo": (RLOOConfig, dict(steps_per_generation=2, beta=0.03, num_generations=2, learning_rate=1e-6), []),
}

dataset = load_dataset("json", data_files={"train": f"{script_args.dataset}/train.jsonl"})["train"]
summary = {}
for name, (config_class, options, extra_rewards) in RECIPES.items():
    if script_args.only and name not in script_args.only: continue
    out = Path(script_args.output_dir) / name
    training_args = config_class(output_dir=str(out), **(SMALL | options))
    trainer_class = GRPOTrainer if config_class is GRPOConfig else RLOOTrainer
    trainer = trainer_class(model=script_args.model_name_or_path, reward_funcs=[accuracy, *extra_rewards],
                            args=training_args, train_dataset=dataset)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary[name] = {"steps": [r["step"] for r in rows], "reward": [r.get("reward") for r in rows],
                     "completions_logged": len((out / "completions.jsonl").read_text().splitlines())}
    print(name, summary[name])
(Path(script_args.output_dir) / "summary.json").write_text(json.dumps(summary, indent=1))
