"""Peak memory of PPO with full fine-tuning vs LoRA on a ~20M-parameter GPT-2, each in its own process.

    OMP_NUM_THREADS=1 python bench/lora_memory.py [--steps 3] [--json bench/results/<date>_lora_memory/lora_memory.json]

Full fine-tuning keeps the policy, a frozen copy as the reference, a gradient and two Adam moments per weight; LoRA
keeps the policy once (the reference is the same weights with the adapter off) and a gradient and Adam moments for the
adapters and the value head only. Printed per side: parameters, trainable parameters, the bytes of that model state
(float32: 4 bytes per weight, and 12 more per trainable weight for gradient + Adam m, v; plus 4 per weight of the
reference copy), peak RSS of the process, and peak RSS above the process's RSS before the models were built (the
interpreter and torch, the same for both sides). Writing checkpoints is switched off: it is measured training."""
import argparse, json, os, subprocess, sys
from pathlib import Path

WORKER = r'''
import copy, json, resource, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import psutil, torch
from instruct_goose import Agent, RLHFConfig, RLHFTrainer, create_reference_model, load_task, task_tokenizer, tiny_causal_lm
side, steps = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
before = psutil.Process().memory_info().rss
tokenizer = task_tokenizer()
sft = tiny_causal_lm(tokenizer, n_layer=6, hidden_size=512, n_head=8, seed=0)
if side == "lora":
    from peft import LoraConfig, get_peft_model
    policy = get_peft_model(sft, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    reference = create_reference_model(policy)
else:
    policy, reference = copy.deepcopy(sft), create_reference_model(sft)
    del sft
agent = Agent(policy)
config = RLHFConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, num_mini_batches=1, num_ppo_epochs=2,
                    response_length=32, total_episodes=8 * steps, num_sample_generations=0, disable_tqdm=True,
                    learning_rate=1e-4, save_steps=10_000)
trainer = RLHFTrainer(agent, reference, config, processing_class=tokenizer, reward_funcs=lambda p, c: [len(x) / 100 for x in c],
                      train_dataset=load_task("prompts"))
from instruct_goose.loop import TrainLoop
TrainLoop.save_checkpoint = lambda self: None     # measure training, not the writing of checkpoints
Agent.save_pretrained = lambda self, *a, **k: None
trainer.train()
params = sum(p.numel() for p in agent.parameters())
trainable = sum(p.numel() for p in agent.parameters() if p.requires_grad)
reference_copy = sum(p.numel() for p in reference.parameters())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"side": side, "parameters": params, "trainable": trainable, "reference_copy": reference_copy,
                  "model_state_bytes": 4 * params + 12 * trainable + 4 * reference_copy,
                  "peak_rss": peak, "peak_above_start": peak - before}))
'''


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="PPO steps per side")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if args.json: Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for side in ("full", "lora"):
        # glibc raises its mmap threshold after large frees, after which freed tensors stay in the heap and RSS reports
        # what was once used; a fixed threshold returns large blocks to the OS, so RSS follows the live tensors
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", WORKER, side, str(args.steps)], capture_output=True, text=True,
                             check=True, env=env)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = lambda b: b / 2**20
    print(f"{'':<22}{'parameters':>12}{'trainable':>12}{'model state MiB':>17}{'peak RSS MiB':>14}{'above start MiB':>17}")
    for r in rows:
        print(f"{r['side']:<22}{r['parameters']:>12,}{r['trainable']:>12,}{mib(r['model_state_bytes']):>17.0f}"
              f"{mib(r['peak_rss']):>14.0f}{mib(r['peak_above_start']):>17.0f}")
    full, lora = rows
    print(f"LoRA / full: model state {lora['model_state_bytes'] / full['model_state_bytes']:.2f}x, "
          f"peak RSS {lora['peak_rss'] / full['peak_rss']:.2f}x, above start {lora['peak_above_start'] / full['peak_above_start']:.2f}x")
    if args.json: Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
