"""Where one side's peak memory is and what it is made of: a run of `real_size.py` (ours or TRL's) under the CPU profiler.

Every allocation the CPU allocator makes while the run goes (models built, two training steps: the second with AdamW's
moments) is recorded with the operator that made it and the phase it was made in (the phases `real_size.py` times, plus
finer ones: `first_pass`, the reference's/π_old's chunked log-probs, `backward`, the optimizer). At the highest live total
the live allocations are summed by term: weights, gradients, AdamW moments, reference, reward model, autocast's cached bf16
weight casts, activations kept for backward, logits-sized temporaries, optimizer-step temporaries. The CPU runs the
arithmetic the GPU runs (bf16 autocast, float32 master weights); activations and logits-sized terms scale with the tokens
(batch x (padded prompt + response)), the rest does not.

    OMP_NUM_THREADS=2 .venv/bin/python bench/mem_profile.py --side ours --algo grpo --response_length 32 --tok_dir /tmp/tok05
    OMP_NUM_THREADS=2 .venv/bin/python bench/mem_profile.py --side trl --algo grpo --response_length 32 --tok_dir /tmp/tok05
"""
import argparse, collections, json, os, sys, tempfile, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import real_size as rs

MiB = 2**20


class ProfClock(rs.Clock):
    "`real_size`'s phase clock whose wrapped functions are also profiler ranges named `PHASE:<phase>`."
    def wrap(self, phase, fn, on_start=None, on_end=None):
        import torch
        w = super().wrap(phase, fn, on_start, on_end)
        def r(*a, **k):
            with torch.profiler.record_function("PHASE:" + phase): return w(*a, **k)
        r.__wrapped__ = fn
        return r

    def step_end(self):
        import torch
        with torch.profiler.record_function(f"STEP_END:{len(self.steps)}"): pass
        super().step_end()


def label(clock, owner, name, phase):
    "Wrap `owner.name` in a profiler range `PHASE:<phase>` (no time added to the clock)."
    import torch
    fn = getattr(owner, name)
    def r(*a, **k):
        with torch.profiler.record_function("PHASE:" + phase): return fn(*a, **k)
    r.__wrapped__ = fn
    setattr(owner, name, r)


def finer_phases(side, clock):
    import accelerate, torch
    if side == "ours":
        import instruct_goose.grpo as gm, instruct_goose.rloo as rm, instruct_goose.ppo as pm
        from instruct_goose.loop import TrainLoop
        from instruct_goose.onpolicy import OnPolicyTrainer
        label(clock, OnPolicyTrainer, "first_pass", "first_pass")
        for m in (gm, rm, pm): label(clock, m, "logprobs_in_chunks", "chunked_logprobs")
        label(clock, TrainLoop, "backward", "backward")
        label(clock, TrainLoop, "optimizer_step", "optimizer_step")
    else:
        import trl
        for C in (trl.GRPOTrainer, trl.RLOOTrainer):
            label(clock, C, "_get_per_token_logps_and_entropies", "logps")
        label(clock, accelerate.Accelerator, "backward", "backward")


def analyse(prof, clock_steps):
    "The live allocations at the CPU peak, each with its operator and phase chain; the live total per step and phase."
    from torch._C._profiler import _EventType
    allocs, marks = [], []
    def walk(node, chain):
        name = node.name
        if node.typed[0] == _EventType.Allocation:
            f = node.typed[1]
            if f.device.type == "cpu": allocs.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated, tuple(chain)))
            return
        if name.startswith("STEP_END:"): marks.append((node.start_time_ns, int(name.split(":")[1])))
        for c in node.children: walk(c, chain + [name])
    for root in prof.profiler.kineto_results.experimental_event_tree(): walk(root, [])
    allocs.sort(key=lambda x: x[0]); marks.sort()
    live, total, peak, peak_i, series = {}, 0, -1, 0, []
    for i, (t, ptr, size, tot, chain) in enumerate(allocs):
        if size > 0: live[ptr] = (size, chain, t); total += size
        else:
            s = live.pop(ptr, None)
            if s is not None: total -= s[0]
        series.append((t, total))
        if total > peak: peak, peak_i = total, i
    # replay to the peak
    live, total = {}, 0
    for t, ptr, size, tot, chain in allocs[:peak_i + 1]:
        if size > 0: live[ptr] = (size, chain, t)
        else: live.pop(ptr, None)
    def step_of(t):
        for tm, k in marks:
            if t <= tm: return k
        return len(marks)
    def phase_of(chain):
        ph = [c[6:] for c in chain if c.startswith("PHASE:")]
        return "/".join(ph) if ph else "(outside)"
    def op_of(chain):
        ops = [c for c in chain if c.startswith("aten::") or c.startswith("autograd::") or "Backward" in c or c.startswith("Optimizer")]
        return ops[0] if ops else (chain[-1] if chain else "(none)")
    peak_t, peak_chain = allocs[peak_i][0], allocs[peak_i][4]
    groups = collections.Counter(); ops = collections.Counter()
    for size, chain, t in live.values():
        key = f"step{step_of(t)} {phase_of(chain)}"
        groups[key] += size
        ops[(key, op_of(chain))] += size
    # the live total at each step's and phase's high point
    phase_peaks = collections.defaultdict(int)
    for (t, ptr, size, tot, chain), (_, tl) in zip(allocs, series):
        k = f"step{step_of(t)} {phase_of(chain)}"
        phase_peaks[k] = max(phase_peaks[k], tl)
    return {"peak_mib": peak / MiB, "peak_step": step_of(peak_t), "peak_phase": phase_of(peak_chain), "peak_op_chain": list(peak_chain[-6:]),
            "live_at_peak_by_phase_mib": {k: v / MiB for k, v in groups.most_common()},
            "live_at_peak_by_phase_op_mib": [[k, op, v / MiB] for (k, op), v in ops.most_common(60)],
            "phase_high_points_mib": {k: v / MiB for k, v in phase_peaks.items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", choices=["ours", "trl"], required=True)
    p.add_argument("--algo", choices=["grpo", "rloo", "ppo_shared"], default="grpo")
    p.add_argument("--model-shape", "--model_shape", dest="model_shape", choices=list(rs.SHAPES), default="0.5b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--response_length", type=int, default=32)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--tok_dir", default="/tmp/tok05")
    p.add_argument("--lever", action="append")
    p.add_argument("--json")
    a = p.parse_args()
    if a.json: Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    a.device, a.dtype, a.steps, a.warmup, a.lora, a.trl_ppo_path = "cpu", "bf16", 1, 1, False, "/tmp/trl112"
    rs.quiet()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from transformers import AutoTokenizer
    tok_dir = Path(a.tok_dir)
    if not (tok_dir / "tokenizer.json").exists():
        tok_dir.mkdir(parents=True, exist_ok=True); rs.build_tokenizer(rs.SHAPES[a.model_shape]["vocab"], str(tok_dir))
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    clock = ProfClock(False)
    finer_phases(a.side, clock)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as out, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                                      profile_memory=True, record_shapes=False) as prof:
        (rs.run_ours if a.side == "ours" else rs.run_trl)(a.algo, a, tok, out, clock)
    wall = time.perf_counter() - t
    r = {"side": a.side, "algo": a.algo, "shape": a.model_shape, "batch": a.batch, "response_length": a.response_length,
         "levers": a.lever or [], "wall_s": wall, **analyse(prof, clock.steps)}
    print(json.dumps({k: v for k, v in r.items() if k != "live_at_peak_by_phase_op_mib"}, indent=1))
    for k, op, v in r["live_at_peak_by_phase_op_mib"][:40]: print(f"{v:10.1f}  {k:50s} {op}")
    if a.json: Path(a.json).write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
