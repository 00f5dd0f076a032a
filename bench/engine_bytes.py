"""Bytes per parameter that each engine keeps in every process: DDP against FSDP2 full-shard, 2 CPU processes (gloo).

For PPO with a separate critic, built the way the trainers build it (an `Agent` prepared by `TrainLoop.setup_optimizer`,
the reference and the reward model beside it, not prepared), this sums the storage of the tensors each process holds,
by part: the policy's and the critic's weights, their gradients after one backward, the optimizer's state after one
step, the frozen reference and reward model. Each sum is divided by the parameter count of the part it belongs to (the
optimizer and gradients by the trained parameters), so the numbers are bytes per parameter, independent of the model
size. A second run trains the policy through LoRA adapters (rank 8 on attention and MLP): then the reference is the
policy with its adapter off (no second copy), and gradients and optimizer state exist for the adapters only.

What the sums cannot see: DDP's gradient buckets (torch's C++ reducer keeps a flat copy of the gradients for the
all-reduce, another 4 bytes per trained parameter in float32) and FSDP2's transient all-gather buffers (one unit's
full weights while it runs). Activations and the KV cache are not model state and depend on batch and length.

    OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=true torchrun --standalone --nproc_per_node 2 bench/engine_bytes.py ddp
    OMP_NUM_THREADS=1 ACCELERATE_USE_CPU=true ACCELERATE_USE_FSDP=true FSDP_VERSION=2 \\
        FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP FSDP_RESHARD_AFTER_FORWARD=true \\
        torchrun --standalone --nproc_per_node 2 bench/engine_bytes.py fsdp2
    python bench/engine_bytes.py --merge       # writes engine_bytes.json from the two runs' parts

Each run writes its part into bench/results/<today>_engine_bytes/; `--merge` joins the parts of the newest such folder
into its engine_bytes.json (chapter 14 reads the 2026-11-24 run's by its path).
"""
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _results import RESULTS, results_dir


def storage_bytes(tensors) -> int:
    "Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard only)."
    seen, total = set(), 0
    for t in tensors:
        if t is None: continue
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        if s.data_ptr() in seen: continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def optimizer_tensors(optimizer, params: set) -> list:
    "The optimizer's state tensors for the parameters in `params` (by identity)."
    return [v for p, st in optimizer.state.items() if id(p) in params for v in st.values() if torch.is_tensor(v) and v.dim() > 0]


def measure(engine: str, lora: bool) -> dict:
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model
    from instruct_goose import Agent, RewardModel, TrainLoop, TrainingConfig, create_reference_model, task_tokenizer
    from instruct_goose.loading import with_peft
    tokenizer = task_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=128, n_layer=4, n_head=4,
                        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    policy, critic = GPT2LMHeadModel(config), GPT2Model(config)
    reward = RewardModel(GPT2ForSequenceClassification(config.__class__(**{**config.to_dict(), "num_labels": 1})), tokenizer=tokenizer)
    if lora:
        from peft import LoraConfig
        policy = with_peft(policy, LoraConfig(r=8, target_modules=["c_attn", "c_proj", "c_fc"], task_type="CAUSAL_LM"))
    ref = None if lora else create_reference_model(policy)
    agent = Agent(policy, critic)
    counts = {"policy": sum(p.numel() for p in agent.model.parameters()),
              "critic": sum(p.numel() for n, p in agent.named_parameters() if not n.startswith("model.")),
              "reference": sum(p.numel() for p in ref.parameters()) if ref is not None else 0,
              "reward": sum(p.numel() for p in reward.parameters())}
    trained = {"policy": sum(p.numel() for p in agent.model.parameters() if p.requires_grad),
               "critic": counts["critic"]}
    with tempfile.TemporaryDirectory() as d:
        loop = TrainLoop(TrainingConfig(output_dir=d, disable_tqdm=True, report_to="none"))
        model = loop.accelerator.unwrap_model(loop.setup_optimizer(agent, 10))
        parts = {"policy": [p for p in model.model.parameters()],
                 "critic": [p for n, p in model.named_parameters() if not n.startswith("model.")]}
        setup = {k: storage_bytes(v) for k, v in parts.items()}
        ids = torch.randint(5, len(tokenizer), (4, 16))
        mask = torch.ones_like(ids)
        model.train()
        stats = model.response_stats(ids[:, :8], mask[:, :8], ids[:, 8:], mask[:, 8:], 1.0, entropy="skip")
        loop.backward(stats.logprobs.mean() + stats.values.square().mean())
        grads = {k: storage_bytes([p.grad for p in v]) for k, v in parts.items()}
        loop.optimizer_step(model)
        opt = {k: storage_bytes(optimizer_tensors(loop.optimizer, {id(p) for p in v})) for k, v in parts.items()}
        after = {k: storage_bytes(v) for k, v in parts.items()}
    frozen = {"reference": storage_bytes(ref.parameters()) if ref is not None else 0,
              "reward": storage_bytes(reward.parameters())}
    per = lambda b, n: round(b / n, 3) if n else 0.0
    return {"engine": engine, "lora": lora, "processes": int(os.environ.get("WORLD_SIZE", "1")),
            "params": counts, "trained_params": trained,
            "bytes": {"weights_setup": setup, "weights_after_step": after, "grads": grads, "optimizer": opt, "frozen": frozen},
            "bytes_per_param": {
                "policy_weights": per(after["policy"], counts["policy"]), "critic_weights": per(after["critic"], counts["critic"]),
                "policy_grads": per(grads["policy"], counts["policy"]), "critic_grads": per(grads["critic"], counts["critic"]),
                "policy_optimizer": per(opt["policy"], counts["policy"]), "critic_optimizer": per(opt["critic"], counts["critic"]),
                "reference": per(frozen["reference"], counts["policy"]), "reward": per(frozen["reward"], counts["reward"])}}


def main():
    if sys.argv[1] == "--merge":
        parts = sorted(RESULTS.glob("????-??-??_engine_bytes/engine_bytes_*.part.json"))
        if not parts: sys.exit("no bench/results/<date>_engine_bytes/engine_bytes_*.part.json: run ddp and fsdp2 first")
        out = parts[-1].parent
        rows = [json.loads(p.read_text()) for p in sorted(out.glob("engine_bytes_*.part.json"))]
        (out / "engine_bytes.json").write_text(json.dumps({
            "meta": f"tiny GPT-2 (4 layers, 128 wide) policy + separate GPT-2 critic, fp32 on the CPU, 2 processes over gloo; "
                    f"torch {torch.__version__}; storage summed per process (rank 0) by bench/engine_bytes.py",
            "rows": rows}, indent=1) + "\n")
        for p in out.glob("engine_bytes_*.part.json"): p.unlink()
        return
    engine = sys.argv[1]
    rows = [measure(engine, lora) for lora in (False, True)]
    if int(os.environ.get("RANK", "0")) == 0:
        for row in rows:
            (results_dir("engine_bytes") / f"engine_bytes_{engine}_{'lora' if row['lora'] else 'full'}.part.json").write_text(json.dumps(row, indent=1))
            print(json.dumps(row["bytes_per_param"]))


if __name__ == "__main__":
    main()
