"""One PPO iteration of the library against its floor: the same batch, in the same process.

Library step = `sample_rollout` + `rollout_stats` + `update` + the logging of `OnPolicyTrainer.train`, timed with
perf_counter around the library's own functions. Floor = only the unavoidable work written directly with
torch/transformers: `model.generate` (KV cache) for the same number of new tokens, one reference forward, one policy
forward (old logprobs + values), `num_ppo_epochs` × (policy forward + backward) and the optimizer steps.
`lean=True` (`--lean`) gives the floor the library's levers, so that it stays a floor: sampling through oneDNN-packed
linear layers on the CPU (`packed_linears`), and no separate old-logprob pass (the first epoch's forward is π_θold).
Both floors run the library's fused GELU (`fuse_activations`): their model is a copy of the one the library trains.

    OMP_NUM_THREADS=1 .venv/bin/python bench/ppo_floor.py --reps 7
"""
import argparse, copy, sys, time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).parent))
from _common import Timers, make_trainer, median, quiet  # noqa: E402
from instruct_goose import packed_linears  # noqa: E402


def floor_step(agent, ref, opt, q_ids, q_mask, n_new, epochs, pad_id, lean=False):
    "The unavoidable work of one PPO step, timed per phase (`lean`: with the library's levers, see the module's doc)."
    t = {}
    s = time.perf_counter()
    gen_cfg = GenerationConfig(do_sample=True, top_k=0, top_p=1.0, max_new_tokens=n_new, eos_token_id=None,
                               pad_token_id=pad_id, use_cache=True)
    agent.model.eval()
    packed = packed_linears(agent.model, len(q_ids)) if lean and not q_ids.is_cuda else nullcontext()
    with torch.no_grad(), packed:
        out = agent.model.generate(input_ids=q_ids, attention_mask=q_mask, generation_config=gen_cfg)
    t["generate"] = time.perf_counter() - s
    resp = out[:, q_ids.shape[1]:]
    assert resp.shape[1] == n_new, resp.shape
    ids, mask = out, torch.cat([q_mask, torch.ones_like(resp)], 1)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    n = resp.shape[1]
    def logp(logits): return torch.log_softmax(logits[:, -n - 1:-1].float(), -1).gather(-1, resp[..., None]).squeeze(-1)
    s = time.perf_counter()
    with torch.no_grad():
        ref_lp = logp(ref(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits)
        if not lean:
            o = agent.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, output_hidden_states=True)
            old_lp, old_v = logp(o.logits), agent.value_head(o.hidden_states[-1][:, -n - 1:-1]).squeeze(-1)
    t["rollout stats"] = time.perf_counter() - s
    adv = torch.randn_like(ref_lp)  # stand-in for GAE (its cost is a few elementwise ops)
    t["PPO epochs (fwd+bwd)"] = t["optimizer"] = 0.0
    for epoch in range(epochs):
        s = time.perf_counter()
        o = agent.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, output_hidden_states=True)
        lp, v = logp(o.logits), agent.value_head(o.hidden_states[-1][:, -n - 1:-1]).squeeze(-1)
        if lean and epoch == 0: old_lp, old_v = lp.detach(), v.detach()   # the first epoch's pass is π_θold's
        ratio = (lp - old_lp).exp()
        loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() + 0.1 * F.mse_loss(v, old_v + adv)
        loss.backward()
        t["PPO epochs (fwd+bwd)"] += time.perf_counter() - s
        s = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(agent.parameters(), 1.0)
        opt.step(); opt.zero_grad(set_to_none=True)
        t["optimizer"] += time.perf_counter() - s
    t["total"] = sum(t.values())
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--response_length", type=int, default=32)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    quiet()
    torch.manual_seed(0)
    trainer, agent, prompts = make_trainer(a.batch, a.response_length, a.epochs)
    timers = Timers(trainer)
    f_agent = copy.deepcopy(agent).train()
    f_ref = copy.deepcopy(trainer.ref_model)
    f_opt = torch.optim.AdamW([q for q in f_agent.parameters() if q.requires_grad], lr=1e-5, fused=True)  # as the library and TRL
    from instruct_goose.data import encode_prompts
    q_ids, q_mask = encode_prompts(trainer.tokenizer, prompts, trainer.config.max_prompt_length)
    pad = trainer.tokenizer.pad_token_id
    lib, flo = [], []
    for i in range(a.warmup + a.reps):          # library and floor in turn, so drift hits both alike
        if i % 2 == 0:                          # and swap which goes first every repetition
            L = timers.step(agent, prompts)
            F_ = floor_step(f_agent, f_ref, f_opt, q_ids, q_mask, a.response_length, a.epochs, pad)
        else:
            F_ = floor_step(f_agent, f_ref, f_opt, q_ids, q_mask, a.response_length, a.epochs, pad)
            L = timers.step(agent, prompts)
        if i >= a.warmup: lib.append(L); flo.append(F_)
    keys = ["generate", "score", "rollout stats", "PPO epochs (fwd+bwd)", "optimizer", "logging", "total"]
    print(f"PPO step, batch {a.batch}, response {a.response_length} tokens (library generated {lib[-1]['_gen_len']}), "
          f"{a.epochs} epochs, 1 minibatch; medians of {a.reps} (after {a.warmup} warm-up), torch threads {torch.get_num_threads()}")
    print(f"{'phase':<22}{'library ms':>12}{'floor ms':>10}{'lib/floor':>10}")
    for k in keys:
        lm = median([r[k] for r in lib]) * 1e3
        fm = median([r.get(k, 0.0) for r in flo]) * 1e3
        print(f"{k:<22}{lm:>12.1f}{fm:>10.1f}{(lm / fm if fm else float('nan')):>10.2f}")
    print(f"  (of score: reward fn {median([r['_score_fn'] for r in lib]) * 1e3:.2f} ms; rest = tokenize + decode)")
    ratios = [l["total"] / f["total"] for l, f in zip(lib, flo)]
    print(f"step/floor ratio: median {median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); "
          f"logged eps (last) {trainer.loop.state.history[-1]['eps']:.1f}")


if __name__ == "__main__":
    main()
