"""instruct_goose against TRL at the size people train: a GPT-2-small-shaped (or ~0.5B Qwen2-shaped) model.

Algorithms: PPO with the critic sharing the policy's trunk (`ppo_shared`), PPO with a separate critic trunk
(`ppo_separate`), RLOO (`rloo`), GRPO (`grpo`). TRL's side: TRL 1.16's `RLOOTrainer` and `GRPOTrainer`; for PPO, `trl.experimental.ppo.PPOTrainer` from TRL 1.12.0, the last release that ships it
(TRL 1.13 dropped it), loaded from `--trl_ppo_path` (`pip install --no-deps --target DIR trl==1.12.0`). TRL's PPO has
only a separate critic, so `ppo_shared` compares our shared-trunk PPO with TRL's (separate) PPO, and `ppo_separate` is
the like-for-like comparison.

Models: random weights from a config (same seed on both sides): `gpt2-small` = GPT-2 with 12 layers, 768 wide,
12 heads, a 32,000-token vocabulary; `0.5b` = Qwen2-0.5B's shape (24 layers, 896 wide, 14 heads / 2 KV heads, MLP 4864,
151,936 tokens, tied embeddings); `1.5b` = Qwen2.5-1.5B's (28 layers, 1536 wide, 12 heads / 2 KV heads, MLP 8960, the
same vocabulary, tied; `--params` counts it on the meta device: 1,543,714,304). `--lora`: peft LoRA (r 16, alpha 32) on
both sides through each trainer's `peft_config`, the references the adapter-off policy. The tokenizer is a byte-level BPE trained with `instruct_goose.train_tokenizer` to
exactly that vocabulary size on the task's text plus generated pseudo-words, so every id the random policy samples
decodes to text. The reward model (and TRL's / our separate critic) is a 1-label sequence classifier of the same shape.
A random policy almost never samples EOS, so every response runs the full `--response_length` tokens.

Each (algorithm, side) runs in its own subprocess (fresh peak-memory counters), alternating ours/TRL with the order
swapped every repetition. Per step: a phase breakdown measured by wrapping each side's own functions (synchronising
the GPU at each boundary): generation, scoring (decode/re-tokenize + reward model), rollout forwards (no-grad
logprobs/values/reference + advantages), update (forward + backward of the epochs), optimizer (grad clip + AdamW step
+ zero_grad), other (the rest: logging, stats, data). Completions/s over the steps after `--warmup`.
The last lines are `<algorithm> ratio=X.XX` (ours/TRL completions/s). Per side also: tokens/s, peak memory, trainable
parameters, and generation ms per decoding step beside the floor (policy weights in bf16 / fp32 bytes ÷ the memory
bandwidth, measured once per bench by a large copy). `--max_batch`: the largest batch whose first training step fits
(doubling, then bisection; a probe fails on out-of-memory or a peak over `--mem_limit_mib`). The plan for a GPU
session: bench/results/2026-11-26_real_size_h100_0.5b_r512/gpu_session.md.

    OMP_NUM_THREADS=2 .venv/bin/python bench/real_size.py --trl_ppo_path /tmp/trl112 --json bench/results/<date>_real_size_cpu/real_size_cpu.json
    python3 bench/real_size.py --device cuda --dtype bf16 --model-shape 0.5b --trl_ppo_path /tmp/trl112
    .venv/bin/python bench/real_size.py --floor --reps 3      # our PPO step against its floor, with --lever ...
    .venv/bin/python bench/real_size.py --model-shape tiny --algos grpo --max_batch --modes full lora --batch 4 --mem_limit_mib 600
"""
import argparse, copy, json, os, random, resource, statistics, subprocess, sys, tempfile, time, warnings
from pathlib import Path

HERE = Path(__file__).parent
SHAPES = {
    "gpt2-small": dict(arch="gpt2", n_layer=12, hidden=768, heads=12, vocab=32000),
    "0.5b": dict(arch="qwen2", n_layer=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "1.5b": dict(arch="qwen2", n_layer=28, hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=151936),  # Qwen2.5-1.5B's
    "tiny": dict(arch="gpt2", n_layer=2, hidden=64, heads=4, vocab=2000),          # for checking the script only
}
PHASES = ["generation", "scoring", "rollout forwards", "update (fwd+bwd)", "optimizer", "other"]
LR, KL_COEF, RLOO_K, MAX_PROMPT = 3e-6, 0.05, 4, 64
PROMPT_WORDS = 0   # --prompt_words: words of instructions before each prompt (MAX_PROMPT grows with them)
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0)   # `--lora`, both sides: on every attention and MLP projection
LORA_TARGETS = {"qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                "gpt2": ["c_attn", "c_proj", "c_fc"]}   # GPT-2: attention qkv + out (c_proj), MLP in (c_fc) + out (c_proj)


# ---------------------------------------------------------------- set-up shared by both sides
def quiet():
    import logging
    os.environ["TQDM_DISABLE"] = "1"
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar(); hf_logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    try:
        import datasets; datasets.disable_progress_bars(); datasets.logging.set_verbosity_error()
    except ImportError: pass


def build_tokenizer(vocab, out_dir):
    "A byte-level BPE of exactly `vocab` tokens: the task's text plus enough generated pseudo-words to fill it."
    from instruct_goose import load_task, train_tokenizer
    rng = random.Random(0)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ea", "y")]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 5))) for _ in range(3 * vocab)})
    rng.shuffle(words)
    lines = [" ".join([w] * (2 + 200 // (i + 1))) for i, w in enumerate(words[:int(1.6 * vocab)])]  # Zipf-like counts
    rng.shuffle(lines)
    sft, pretrain = load_task("sft"), load_task("pretrain")
    corpus = [p + c for p, c in zip(sft["prompt"], sft["completion"])] + list(pretrain["text"])
    corpus += [" ".join(lines[i:i + 50]) for i in range(0, len(lines), 50)]
    tok = train_tokenizer(corpus, vocab_size=vocab)
    if len(tok) != vocab: sys.exit(f"tokenizer has {len(tok)} tokens, wanted {vocab}: generate more words")
    tok.padding_side = "left"
    tok.save_pretrained(out_dir)


def positions(response_length):
    "Position slots for prompts of at most MAX_PROMPT tokens + the responses: 512 (as before), more for long responses."
    return max(512, -(-(MAX_PROMPT + response_length) // 128) * 128)


def lora_config(shape):
    "`--lora`: peft LoRA r=16, alpha=32, no dropout, on q/k/v/o and gate/up/down (GPT-2: c_attn, c_proj, c_fc)."
    from peft import LoraConfig
    return LoraConfig(**LORA, target_modules=LORA_TARGETS[SHAPES[shape]["arch"]], task_type="CAUSAL_LM")


def n_params(model, trainable=False):
    "Parameters (tied ones once: `parameters()` yields each tensor once), or only those with requires_grad."
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def model_config(shape, tok, n_positions=512):
    s = SHAPES[shape]
    special = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   bos_token_id=tok.bos_token_id)
    if s["arch"] == "gpt2":
        from transformers import GPT2Config
        return GPT2Config(n_layer=s["n_layer"], n_embd=s["hidden"], n_head=s["heads"], n_positions=n_positions, **special)
    from transformers import Qwen2Config
    return Qwen2Config(num_hidden_layers=s["n_layer"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"],
                       max_position_embeddings=n_positions, tie_word_embeddings=True, **special)


def build_models(shape, tok, response_length=64, value=True, device="cpu", eos_bias=0.0):
    "(policy, value classifier or None when `value` is False, reward classifier): random weights, fixed seeds, identical on both sides; `eos_bias`: the policy's output layer gets a bias, `eos_bias` on the EOS logit (completions that stop early, as a trained policy's do)."
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    cfg = model_config(shape, tok, positions(response_length))
    # initialised where they will train: on a GPU random init of 1.5B weights takes ~1 s, on the CPU many seconds (the
    # CUDA generator draws other numbers than the CPU's: GPU runs have other random weights than CPU runs, the same on both sides)
    with torch.device(device):
        torch.manual_seed(0); policy = AutoModelForCausalLM.from_config(cfg)
        cls_cfg = copy.deepcopy(cfg); cls_cfg.num_labels = 1
        if value: torch.manual_seed(1); value = AutoModelForSequenceClassification.from_config(cls_cfg)
        else: value = None   # RLOO, GRPO and our shared-critic PPO have no critic trunk: not built (the seeds keep the others as they were)
        torch.manual_seed(2); reward = AutoModelForSequenceClassification.from_config(cls_cfg)
    policy.generation_config.pad_token_id = tok.pad_token_id
    if eos_bias:   # a trainable bias on the output layer (tied weight untouched): the same model on both sides, it samples shorter completions
        head = policy.get_output_embeddings()
        head.bias = torch.nn.Parameter(torch.zeros(head.out_features, device=head.weight.device))
        with torch.no_grad(): head.bias[tok.eos_token_id] = eos_bias
    return policy, value, reward


PREAMBLE = ("Read the task below with care, think about what it asks, and answer it in a few plain sentences; "
            "say what you would check first, and why, before you give the answer itself. ").split()


def prompts_dataset():
    "The built-in prompts (~10 tokens), each after `--prompt_words` words of instructions where asked (the long prompts of a real task: a distinct prompt per row still)."
    from instruct_goose import load_task
    ds = load_task("prompts")
    if not PROMPT_WORDS: return ds
    preamble = " ".join((PREAMBLE * (PROMPT_WORDS // len(PREAMBLE) + 1))[:PROMPT_WORDS])
    return ds.map(lambda row: {"prompt": f"{preamble} {row['prompt']}"})


# ---------------------------------------------------------------- phase clock
class Clock:
    "Per-step phase seconds; `wrap` adds a function's time to a phase (GPU synchronised at both ends)."
    def __init__(self, cuda):
        self.cuda, self.steps, self.cur, self.marks, self.t_end, self.info = cuda, [], {}, {}, [], {}

    def now(self):
        if self.cuda:
            import torch; torch.cuda.synchronize()
        return time.perf_counter()

    def add(self, phase, dt): self.cur[phase] = self.cur.get(phase, 0.0) + dt

    def wrap(self, phase, fn, on_start=None, on_end=None):
        clock = self
        def w(*a, **k):
            s = clock.now()
            if on_start: on_start(s, a, k)
            try: return fn(*a, **k)
            finally:
                e = clock.now(); clock.add(phase, e - s)
                if on_end: on_end(e)
        w.__wrapped__ = fn
        return w

    def step_end(self):
        t = self.now()
        start = self.t_end[-1] if self.t_end else self.t0
        self.cur["total"] = t - start
        self.steps.append(self.cur); self.cur = {}; self.t_end.append(t)


def patch_optimizer(clock):
    "Grad clipping, AdamW.step and zero_grad count as 'optimizer' on every side (all three go through these)."
    import torch
    torch.nn.utils.clip_grad_norm_ = clock.wrap("optimizer", torch.nn.utils.clip_grad_norm_)
    torch.optim.AdamW.step = clock.wrap("optimizer", torch.optim.AdamW.step)
    torch.optim.AdamW.zero_grad = clock.wrap("optimizer", torch.optim.AdamW.zero_grad)


def profiled(a, phase, fn, last):
    "`fn` whose `last`-th call runs under `torch.profiler` (CPU, and CUDA on a GPU: kernels inside CUDA graphs too, where the CUPTI allows),"
    "its operators and kernels by self time written to `<--profile>/profile_<algo>_<side>_<phase>.txt`."
    import torch
    from torch.profiler import ProfilerActivity, profile
    calls = [0]
    def w(*x, **k):
        calls[0] += 1
        if calls[0] != last: return fn(*x, **k)
        cuda = a.device == "cuda"
        counts = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
        stats = lambda: {c: torch.cuda.memory_stats().get(c, 0) for c in counts} if cuda else {}
        before = stats()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            t, cpu_t = time.perf_counter(), time.process_time(); r = fn(*x, **k)
            if cuda: torch.cuda.synchronize()
            wall, host = time.perf_counter() - t, time.process_time() - cpu_t
        grew = {c: v - before[c] for c, v in stats().items()}   # cudaMalloc/cudaFree calls and allocator retries inside the call
        ev = prof.key_averages()
        by = "self_device_time_total" if cuda else "self_cpu_time_total"
        gpu = sum(e.self_device_time_total for e in ev) / 1e6 if cuda else float("nan")
        cpu = sum(e.self_cpu_time_total for e in ev) / 1e6
        head = (f"{a.algo} {a.side} {phase}, call {last} (untimed), {a.model_shape} {a.device} {a.dtype}: wall {wall:.3f} s under the profiler, "
                f"process CPU time {host:.3f} s, self CPU {cpu:.3f} s, self GPU {gpu:.3f} s, {sum(e.count for e in ev)} events"
                + (f", allocator {grew}" if grew else "") + "\n")
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        Path(a.profile, f"profile_{a.algo}_{a.side}_{phase}.txt").write_text(head + ev.table(sort_by=by, row_limit=45, max_name_column_width=70))
        print(head, end="", flush=True)
        return r
    w.__wrapped__ = fn
    return w


def training(a, clock):
    "The context `tr.train()` runs in: with --live_bytes, `instruct_goose.levers.LiveBytes`, whose peak (the bytes of tensors made during training and alive at once: activations, gradients, AdamW's moments, logits; not the weights built before) goes to the result."
    import contextlib
    if not a.live_bytes: return contextlib.nullcontext()
    from instruct_goose.levers import LiveBytes
    live = LiveBytes()
    @contextlib.contextmanager
    def counted():
        with live: yield
        clock.info["live_peak_mib"] = live.peak / 2**20
    return counted()


# ---------------------------------------------------------------- our side
def run_ours(algo, a, tok, out, clock):
    import torch
    import instruct_goose.onpolicy as tm
    from instruct_goose import (Agent, GRPOConfig, GRPOTrainer, RLHFConfig, RLHFTrainer, RLOOConfig, RLOOTrainer,
                                RewardModel)
    from instruct_goose.loop import TrainLoop
    from instruct_goose.onpolicy import OnPolicyTrainer
    policy, value, reward = build_models(a.model_shape, tok, a.response_length, value=algo == "ppo_separate", device=a.device, eos_bias=a.eos_bias)
    clock.info["policy_params"] = n_params(policy)
    # LoRA: adapters through the trainers' `peft_config` (TRL's argument); the reference is then the adapter-off base
    # (ref_model=None), as TRL's (no second copy of the weights)
    peft = lora_config(a.model_shape) if a.lora else None
    ref = lambda: None   # the trainer's own copy (LoRA: the adapter-off base), as TRL's make theirs; under bf16 its linear layers are held in bf16 (`half_linears`: the same numbers)
    apply_levers(a.lever)   # before the trainer: it fuses the models' activations when it takes them
    steps = a.warmup + a.steps + bool(a.profile)   # --profile: one step more, under the profiler, not timed
    micro = a.micro_batch or a.batch   # rows per micro-batch, a.batch // micro of them accumulated: one optimizer step a rollout
    common = dict(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=a.batch // micro, response_length=a.response_length,
                  learning_rate=LR, kl_coef=KL_COEF, seed=0, total_episodes=a.batch * steps, num_sample_generations=0,
                  disable_tqdm=True, mixed_precision="bf16" if a.dtype == "bf16" else "no", temperature=1.0,
                  max_prompt_length=MAX_PROMPT, save_steps=0, gradient_checkpointing=a.checkpointing != "none",
                  gradient_checkpointing_policy="selective" if a.checkpointing == "selective" else "full", optim=a.optim,
                  padding_free="padding_free" in (a.lever or []),   # --lever padding_free, shared_prefix: config fields, not patches
                  shared_prefix="shared_prefix" in (a.lever or []),
                  keep_freed_cpu_memory="glibc_memory" not in (a.lever or []))   # --lever glibc_memory: glibc's own malloc settings
    rm = RewardModel(reward, tokenizer=tok, padding_free="padding_free" in (a.lever or []), shared_prefix="shared_prefix" in (a.lever or []))
    if algo.startswith("ppo"):
        # TRL's PPO does not clip gradients: max_grad_norm=0 (no clipping) here too
        cfg = RLHFConfig(**common, num_ppo_epochs=a.epochs, num_mini_batches=1, max_grad_norm=0.0, vf_coef=0.1,
                         cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95)
        agent = Agent(policy, value_model=value if algo == "ppo_separate" else None)
        tr, cls = RLHFTrainer(agent, ref(), cfg, processing_class=tok, reward_funcs=rm, peft_config=peft,
                              train_dataset=prompts_dataset()), RLHFTrainer
    elif algo == "rloo":
        cfg = RLOOConfig(**common, num_generations=RLOO_K, num_ppo_epochs=1, num_mini_batches=1, max_grad_norm=1.0)
        tr, cls = RLOOTrainer(policy, ref(), cfg, processing_class=tok, reward_funcs=rm, peft_config=peft,
                              train_dataset=prompts_dataset()), RLOOTrainer
    else:   # GRPO: β = KL_COEF (k3 in the loss, so both sides run a reference), DAPO token averaging, group scaling
        cfg = GRPOConfig(**common, num_generations=RLOO_K, num_iterations=1, num_mini_batches=1, max_grad_norm=1.0,
                         loss_type="dapo", scale_rewards="group")
        assert cfg.beta == KL_COEF and cfg.max_completion_length == a.response_length, (cfg.beta, cfg.max_completion_length)
        tr, cls = GRPOTrainer(policy, ref(), cfg, processing_class=tok, reward_funcs=rm, peft_config=peft,
                              train_dataset=prompts_dataset()), GRPOTrainer
    clock.info["trainable_params"] = n_params(tr.model, trainable=True)
    clock.info["reference"] = type(tr.ref_model).__name__ if tr.ref_model is not None else "none"
    # measure training, not the writing of the final checkpoint and model (TRL's side saves nothing: save_strategy="no")
    TrainLoop.save_checkpoint = lambda self: None
    Agent.save_pretrained = lambda self, *x, **k: None
    type(policy).save_pretrained = lambda self, *x, **k: None
    tm.generate_responses = clock.wrap("generation", tm.generate_responses)
    sas = {}
    OnPolicyTrainer.sample_and_score = clock.wrap("_sas", OnPolicyTrainer.sample_and_score)
    cls.sample_rollout = clock.wrap("_rollout", cls.sample_rollout)
    cls.update = clock.wrap("_update", cls.update)
    if a.profile:
        tm.generate_responses = profiled(a, "generation", tm.generate_responses, steps)
        cls.update = profiled(a, "update", cls.update, steps)
    patch_optimizer(clock)
    log = TrainLoop.log
    def log_and_mark(self, *x, **k):
        r = log(self, *x, **k); clock.step_end(); return r
    TrainLoop.log = log_and_mark
    clock.t0 = clock.now()
    with training(a, clock): tr.train()
    for s in clock.steps:   # nested wrappers -> exclusive phases
        s["scoring"] = s.pop("_sas") - s.get("generation", 0)
        s["rollout forwards"] = s.pop("_rollout") - s["generation"] - s["scoring"]
        s["update (fwd+bwd)"] = s.pop("_update") - s.get("optimizer", 0)
    return torch.__version__


# ---------------------------------------------------------------- TRL's side
def run_trl(algo, a, tok, out, clock):
    cuda, micro = a.device == "cuda", a.micro_batch or a.batch   # --micro_batch: as ours (run_ours)
    if algo.startswith("ppo"):
        sys.path.insert(0, a.trl_ppo_path)          # TRL 1.12.0: the last release with experimental PPO
    import torch, trl
    from datasets import Dataset
    from transformers import TrainerCallback
    policy, value, reward = build_models(a.model_shape, tok, a.response_length, value=algo.startswith("ppo"), device=a.device, eos_bias=a.eos_bias)
    clock.info["policy_params"] = n_params(policy)
    peft = lora_config(a.model_shape) if a.lora else None
    steps = a.warmup + a.steps
    class Mark(TrainerCallback):
        def on_step_end(self, *x, **k): clock.step_end()
    patch_optimizer(clock)
    ds = prompts_dataset()
    if algo.startswith("ppo"):
        import trl.experimental.ppo.ppo_trainer as pm
        from trl.experimental.ppo import PPOConfig, PPOTrainer
        ids = [tok(p, add_special_tokens=False)["input_ids"][-MAX_PROMPT:] for p in ds["prompt"]]
        ds = Dataset.from_dict({"input_ids": ids})
        cfg = PPOConfig(output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=a.batch // micro,
                        num_mini_batches=1, num_ppo_epochs=a.epochs, response_length=a.response_length,
                        total_episodes=a.batch * steps, learning_rate=LR, kl_coef=KL_COEF, kl_estimator="k1",
                        cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, temperature=1.0,
                        whiten_rewards=False, stop_token="eos", missing_eos_penalty=None, num_sample_generations=0, optim=a.optim,
                        local_rollout_forward_batch_size=64, report_to="none", save_strategy="no", seed=0,
                        use_cpu=not cuda, bf16=a.dtype == "bf16", logging_steps=1, disable_tqdm=True,
                        dataloader_num_workers=0, lr_scheduler_type="linear")
        st = {}
        step = torch.optim.AdamW.step   # patched before the trainer exists: its LR scheduler captures the function
        def step_marked(*x, **k):
            r = step(*x, **k); st["last_opt"] = time.perf_counter(); return r
        torch.optim.AdamW.step = step_marked
        # LoRA: ref_model=None, TRL then takes the adapter-off policy as the reference (`null_ref_context`)
        tr = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=None if a.lora else copy.deepcopy(policy).eval(),
                        reward_model=reward, value_model=value, train_dataset=ds, eval_dataset=ds, callbacks=[Mark()],
                        peft_config=peft)
        clock.info["reference"] = "adapter-off policy (null_ref_context)" if tr.ref_model is None else type(tr.ref_model).__name__
        # phases: generation = batch_generation; scoring = get_reward on the reward model; rollout = from the end of
        # generation to the first forward with gradients (less scoring); update = from there to the step's last
        # optimizer call (less optimizer)
        pm.batch_generation = clock.wrap("generation", pm.batch_generation, on_end=lambda e: st.update(gen_end=e, first=None))
        get_reward = pm.get_reward
        def get_reward_timed(model, *x, **k):
            if model is not tr.reward_model: return get_reward(model, *x, **k)
            return clock.wrap("scoring", get_reward)(model, *x, **k)
        pm.get_reward = get_reward_timed
        fwd = pm.forward
        def forward_marked(model, *x, **k):
            if torch.is_grad_enabled() and st.get("first") is None:
                st["first"] = clock.now(); clock.add("_rollout_window", st["first"] - st["gen_end"])
            return fwd(model, *x, **k)
        pm.forward = forward_marked
        mark_end = clock.step_end
        def step_end():
            clock.cur["_update_window"] = st["last_opt"] - st["first"]
            mark_end()
        clock.step_end = step_end
    else:
        from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
        shared = dict(output_dir=out, per_device_train_batch_size=micro, num_generations=RLOO_K, gradient_accumulation_steps=a.batch // micro,
                      steps_per_generation=a.batch // micro, num_iterations=1, max_completion_length=a.response_length,
                      learning_rate=LR, beta=KL_COEF, seed=0, max_steps=steps, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=not cuda, bf16=a.dtype == "bf16", temperature=1.0, top_p=1.0,
                      top_k=0, disable_dropout=True, epsilon=0.2, max_grad_norm=1.0, optim=a.optim,
                      lr_scheduler_type="linear", disable_tqdm=True, dataloader_num_workers=0,
                      gradient_checkpointing=a.checkpointing == "full")   # TRL 1.x's default is True; off unless --checkpointing full (TRL has no selective)
        if algo == "rloo": cfg, Trainer = RLOOConfig(**shared, normalize_advantages=False), RLOOTrainer
        else: cfg, Trainer = GRPOConfig(**shared, loss_type="dapo", scale_rewards="group"), GRPOTrainer
        policy.save_pretrained(f"{out}/policy")   # with beta > 0 TRL loads its reference from the policy's path
        del policy                                # TRL loads its own copy: this one would only hold memory
        if cuda: torch.cuda.empty_cache()
        # LoRA: `peft_config`; with beta > 0 TRL's reference is then the adapter-off policy (ref_model None)
        tr = Trainer(model=f"{out}/policy", reward_funcs=reward, reward_processing_classes=tok, args=cfg,
                     train_dataset=ds, processing_class=tok, callbacks=[Mark()], peft_config=peft)
        clock.info["reference"] = ("adapter-off policy (disable_adapter)" if getattr(tr, "ref_model", None) is None
                                   else type(tr.ref_model).__name__)
        C = type(tr)
        C._generate_single_turn = clock.wrap("generation", C._generate_single_turn)
        C._generate = clock.wrap("_gen_all", C._generate)
        C._calculate_rewards = clock.wrap("_rewards", C._calculate_rewards)
        C._generate_and_score_completions = clock.wrap("_gas", C._generate_and_score_completions)
        C.compute_loss = clock.wrap("update (fwd+bwd)", C.compute_loss)
        import accelerate
        accelerate.Accelerator.backward = clock.wrap("update (fwd+bwd)", accelerate.Accelerator.backward)
    clock.info["trainable_params"] = n_params(tr.model, trainable=True)
    clock.t0 = clock.now()
    with training(a, clock): tr.train()
    for s in clock.steps:
        if algo.startswith("ppo"):
            s["rollout forwards"] = s.pop("_rollout_window") - s.get("scoring", 0)
            s["update (fwd+bwd)"] = s.pop("_update_window") - s.get("optimizer", 0)
        else:
            s["scoring"] = s.pop("_gen_all") - s["generation"] + s["_rewards"]
            s["rollout forwards"] = s.pop("_gas") - s["scoring"] - s["generation"]
            s.pop("_rewards")
    return trl.__version__


# ---------------------------------------------------------------- levers (library changes measured by monkeypatching)
def apply_levers(levers):
    "Experiments on the library, applied in our child only; each is the change proposed in bench/results/HISTORY.md."
    import torch
    import instruct_goose.agent as am
    import instruct_goose.core as cm
    import instruct_goose.generation as gm
    import instruct_goose.ppo as pm
    import instruct_goose.rloo as rm
    import instruct_goose.onpolicy as tm
    for lever in levers or []:
        if lever == "logprobs_fused":
            # one log_softmax over the whole (batch, resp, vocab) block instead of a Python loop over rows
            def logprobs_from_logits(logits, labels, temperature=1.0):
                z = logits.float() if temperature == 1.0 else logits.float() / temperature
                return z.gather(-1, labels[..., None]).squeeze(-1) - torch.logsumexp(z, -1)
            for m in (cm, am, tm, rm): m.logprobs_from_logits = logprobs_from_logits
        elif lever == "no_checks":
            # the per-call host syncs (`_check_left_padded`'s bool(), `_trim_left_padding`'s int()) and the runtime
            # shape checks (jaxtyping + beartype) on the hot path
            am._check_left_padded = lambda mask: None
            def unchecked(f):
                "f without its `typecheck` wrapper (kept under an outer torch.no_grad())."
                code = getattr(f, "__code__", None)
                if code is not None and code.co_name == "_checked": return f.__wrapped__
                inner = getattr(f, "__wrapped__", None)
                if inner is not None and getattr(inner, "__code__", None) is not None and inner.__code__.co_name == "_checked":
                    return torch.no_grad()(inner.__wrapped__)
                return f
            for m in (am, tm, rm, cm):
                for name in dir(m):
                    f = getattr(m, name)
                    if callable(f) and not isinstance(f, type): setattr(m, name, unchecked(f))
            for cls in (am.Agent, tm.OnPolicyTrainer, pm.RLHFTrainer):
                for name, f in list(vars(cls).items()):
                    if callable(f): setattr(cls, name, unchecked(f))
        elif lever == "static_cache":
            # sampling with a static KV cache (transformers compiles the decoding step on CUDA)
            gen = gm.generate_responses
            def generate_static(*x, **k): return gen(*x, **{**k, "static_cache": True, "own_decoder": False})
            tm.generate_responses = generate_static
        elif lever == "own_decoder":
            # sampling through `decode`, the library's own loop (its default on the CPU, and on a GPU since 2026-11-26,
            # where it replays each step from a CUDA graph; before, a GPU sampled through 🤗 `generate` with a static cache)
            gen = gm.generate_responses
            def generate_own(*x, **k): return gen(*x, **{**k, "own_decoder": True})
            tm.generate_responses = generate_own
        elif lever == "compiled_decoder":
            # `decode` with its static step through torch.compile (inductor), recorded inside the CUDA graph: fused kernels
            import instruct_goose.decoding as dm
            def decode_compiled(*x, **k): return dm.decode(*x, **{**k, "compile": True})
            gm.decode = decode_compiled
        elif lever == "dynamic_cache":
            # 🤗 `generate` with its dynamic KV cache, as TRL samples without vLLM (the library's GPU default before b4705e0)
            gen = gm.generate_responses
            def generate_dynamic(*x, **k): return gen(*x, **{**k, "static_cache": False, "own_decoder": False})
            tm.generate_responses = generate_dynamic
        elif lever == "unpacked":
            # the 🤗 default linear layers while sampling on the CPU (the library packs them for oneDNN: `packed_linears`)
            gen = gm.generate_responses
            def generate_unpacked(*x, **k): return gen(*x, packed=False, **k)
            tm.generate_responses = generate_unpacked
        elif lever == "hf_generate":
            # 🤗 `generate` samples (a static cache on a GPU), as before `decode` (the library's own decoding loop, its default)
            gen = gm.generate_responses
            def generate_hf(*x, **k): return gen(*x, **{**k, "own_decoder": False})
            tm.generate_responses = generate_hf
        elif lever == "continuous_batching":
            # 🤗's continuous batching engine samples (`generate_batch`, paged KV cache sized to the batch; TRL 1.16's
            # `use_transformers_continuous_batching`), in the weights' dtype: autocast does not reach its thread
            gen = gm.generate_responses
            def generate_cb(*x, **k): return gen(*x, **{**k, "continuous_batching": True})
            tm.generate_responses = generate_cb
        elif lever == "unfused":
            # GPT-2's GELU as 🤗 writes it, seven tensor operations (the library runs PyTorch's fused kernel: `fuse_activations`)
            import instruct_goose.loop as lm
            lm._WRITTEN_OUT_GELUS = ()
        elif lever == "untrimmed":
            # every pass after sampling reads the whole `response_length` (the library cuts a rollout at its longest response: `response_width`)
            tm.OnPolicyTrainer.trims_responses = False
        elif lever == "padding_free":
            pass   # every pass after sampling over the real tokens packed in bins (the reward model's too): the configs' `padding_free`, set where they are made
        elif lever == "glibc_memory":
            pass   # freed CPU memory unmapped and faulted in again, as glibc does by default (the library holds it: `keep_freed_cpu_memory`, set where the config is made)
        elif lever == "shared_prefix":
            pass   # every pass after sampling runs each distinct prompt once (RLOO's and GRPO's k rows of a prompt): the configs' `shared_prefix`
        elif lever == "drawn_micro_batches":
            # a minibatch's rows dealt into micro-batches as drawn (the library deals like rows together: `like_rows`)
            tm.like_rows = lambda *args: None
        elif lever == "no_kept_pass":
            # a separate no-grad policy pass in the rollout (the library keeps the rollout's pass for the update: `first_pass`)
            tm.OnPolicyTrainer.keeps_first_pass = False
        else: sys.exit(f"unknown lever {lever}")


# ---------------------------------------------------------------- child / parent
T0 = time.perf_counter()   # the parent's start: --deadline_s counts from here
OOM_EXIT = 3    # a child's exit status when it ran out of memory (a real CUDA OOM, or its peak over --mem_limit_mib)


def is_oom(e):
    "A CUDA (or CPU allocator) out-of-memory error, by type or by the message PyTorch and cuBLAS give."
    import torch
    return isinstance(e, torch.OutOfMemoryError) or any(m in str(e).lower() for m in ("out of memory", "alloc_failed"))


def child(a):
    quiet()
    if a.device == "cpu": os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.tok_dir)
    cuda = a.device == "cuda"
    clock = Clock(cuda)
    try:
        with tempfile.TemporaryDirectory() as out:
            version = (run_ours if a.side == "ours" else run_trl)(a.algo, a, tok, out, clock)
    except Exception as e:
        if not is_oom(e): raise
        print(f"OOM {type(e).__name__}: {str(e)[:300]}", flush=True)
        sys.exit(OOM_EXIT)
    steps = clock.steps[: len(clock.steps) - bool(a.profile and a.side == "ours")]   # --profile's step is not timed
    if len(steps) != a.warmup + a.steps: sys.exit(f"expected {a.warmup + a.steps} steps, timed {len(steps)}")
    timed = steps[a.warmup:]
    wall = sum(s["total"] for s in timed)
    for s in steps: s["other"] = s["total"] - sum(s.get(p, 0.0) for p in PHASES if p != "other")
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    r = {"side": a.side, "algo": a.algo, "version": version, "batch": a.batch, "micro_batch": a.micro_batch, "lora": a.lora,
         "cps": a.batch * len(timed) / wall if timed else None,
         "tokens_per_s": a.batch * a.response_length * len(timed) / wall if timed else None,
         "peak_mib": peak, "steps": steps, "levers": a.lever or [], "checkpointing": a.checkpointing, **clock.info}
    if cuda: r["peak_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
    # a simulated OOM (to test --max_batch on the CPU, or to ask what fits a smaller GPU): the peak over the cap
    r["oom"] = bool(a.mem_limit_mib and peak > a.mem_limit_mib)
    print("RESULT " + json.dumps(r), flush=True)
    if r["oom"]: sys.exit(OOM_EXIT)


def bandwidth_child(a):
    "Memory bandwidth of this device: a large tensor copied (1 GiB on CUDA, 256 MiB on the CPU), bytes read + written."
    if a.device == "cpu": os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    cuda = a.device == "cuda"
    n = 2**30 if cuda else 2**28
    src = torch.ones(n, dtype=torch.uint8, device=a.device); dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if cuda: torch.cuda.synchronize()
        t = time.perf_counter(); dst.copy_(src)
        if cuda: torch.cuda.synchronize()
        if i >= 3: times.append(time.perf_counter() - t)   # 3 warm-ups
    s = statistics.median(times)
    how = (f"{'device-to-device' if cuda else 'CPU tensor'} copy of {n / 2**20:.0f} MiB, median of 10 after 3 warm-ups, "
           f"counting bytes read + written (2 x {n / 2**20:.0f} MiB); torch threads {torch.get_num_threads()}")
    print("BANDWIDTH " + json.dumps({"bytes_per_s": 2 * n / s, "how": how,
                                     "device": torch.cuda.get_device_name() if cuda else "cpu"}), flush=True)


def measure_bandwidth(a):
    "The bandwidth in a child process: the parent keeps no CUDA context (its memory would be missing from the children's)."
    out = subprocess.run([sys.executable, __file__, "--child", "bandwidth", "--device", a.device],
                         capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("BANDWIDTH ")]
    if out.returncode or not lines: sys.exit(f"bandwidth measurement failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][10:])


def past_deadline(a):
    "--deadline_s has passed: start no new child (a device command must end inside its time limit)."
    return bool(a.deadline_s) and time.perf_counter() - T0 > a.deadline_s


def run_child(a, algo, side, extra_env=None, batch=None, lora=None, warmup=None, steps=None):
    "One (algorithm, side) run in a fresh process: its RESULT with `status` 'ok', or {'status': 'oom' | 'error' | 'skipped', ...}."
    if past_deadline(a): return {"side": side, "algo": algo, "batch": batch or a.batch, "status": "skipped", "child_wall": 0.0}
    batch, lora = batch or a.batch, a.lora if lora is None else lora
    warmup, steps = a.warmup if warmup is None else warmup, a.steps if steps is None else steps
    cmd = [sys.executable, __file__, "--child", side, "--algo", algo, "--tok_dir", a.tok_dir,
           "--model-shape", a.model_shape, "--device", a.device, "--dtype", a.dtype, "--batch", str(batch),
           "--response_length", str(a.response_length), "--epochs", str(a.epochs), "--steps", str(steps),
           "--warmup", str(warmup), "--trl_ppo_path", a.trl_ppo_path, "--checkpointing", a.checkpointing, "--optim", a.optim, "--eos_bias", str(a.eos_bias), "--prompt_words", str(a.prompt_words)] + (["--live_bytes"] if a.live_bytes else []) + (["--micro_batch", str(a.micro_batch)] if a.micro_batch else []) + sum((["--lever", l] for l in a.lever or []), [])
    if lora: cmd.append("--lora")
    if a.mem_limit_mib: cmd += ["--mem_limit_mib", str(a.mem_limit_mib)]
    if a.profile and side == "ours" and not a.max_batch: cmd += ["--profile", a.profile]
    env = {**os.environ, **(extra_env or {}), **(dict(kv.split("=", 1) for kv in a.trl_env or []) if side == "trl" else {})}
    if side == "trl" and algo.startswith("ppo") and a.dtype == "bf16":
        # TRL's PPOTrainer builds its own Accelerator(), which reads the precision that `accelerate launch
        # --mixed_precision bf16` would set; without it bf16=True leaves TRL's PPO in float32 under transformers 5
        env["ACCELERATE_MIXED_PRECISION"] = "bf16"
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    r = json.loads(lines[-1][7:]) if lines else {"side": side, "algo": algo, "batch": batch, "lora": lora}
    r["child_wall"] = time.perf_counter() - t
    oom = out.returncode == OOM_EXIT or any(m in out.stderr for m in ("OutOfMemoryError", "CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED"))
    if out.returncode == 0 and lines: r["status"] = "ok"
    elif oom: r["status"] = "oom"
    else:
        r["status"] = "error"
        print(f"{algo}/{side} failed:\n{out.stdout[-2000:]}\n{out.stderr[-6000:]}", flush=True)
    return r


ALGOS = {  # algorithm -> (our trainer, TRL's trainer)
    "ppo_shared": ("RLHFTrainer, shared critic", "trl.experimental.ppo.PPOTrainer (1.12.0, separate critic)"),
    "ppo_separate": ("RLHFTrainer, separate critic", "trl.experimental.ppo.PPOTrainer (1.12.0, separate critic)"),
    "rloo": ("RLOOTrainer", "trl.RLOOTrainer"),
    "grpo": ("GRPOTrainer", "trl.GRPOTrainer"),
}


def dtype_bytes(a):
    "Bytes per weight read while sampling: 2 under bf16 (the floor of weights kept in bf16; ours and TRL keep float32 weights under autocast, so they read 4 and cast), else 4."
    return 2 if a.dtype == "bf16" else 4


def summarise(res, a, bw=None):
    med = statistics.median
    out = {}
    for algo in a.algos:
        rows = {}
        for side in ("ours", "trl"):
            rs = [r for r in res if r and r.get("status", "ok") == "ok" and r["algo"] == algo and r["side"] == side]
            if not rs: continue
            timed = [s for r in rs for s in r["steps"][a.warmup:]]
            rows[side] = {"cps": med([r["cps"] for r in rs]), "cps_all": [r["cps"] for r in rs],
                          "cps_median_step": a.batch / med([s["total"] for s in timed]),
                          "tokens_per_s": med([r["tokens_per_s"] for r in rs]), "peak_mib": max(r["peak_mib"] for r in rs),
                          "version": rs[0]["version"],
                          "phases_s": {p: med([s.get(p, 0.0) for s in timed]) for p in PHASES + ["total"]}}
            for k in ("trainable_params", "policy_params", "reference"):
                if k in rs[0]: rows[side][k] = rs[0][k]
            if "peak_reserved_mib" in rs[0]: rows[side]["peak_reserved_mib"] = max(r["peak_reserved_mib"] for r in rs)
            if "live_peak_mib" in rs[0]: rows[side]["live_peak_mib"] = max(r["live_peak_mib"] for r in rs)
            # generation per decoding step (the whole batch advances one token) beside the bandwidth floor: the
            # policy's weights read once per token, policy params x bytes per weight / measured bandwidth
            g = rows[side]["gen_ms_per_token"] = rows[side]["phases_s"]["generation"] / a.response_length * 1e3
            if bw and "policy_params" in rs[0]:
                f = rows[side]["floor_ms_per_token"] = rs[0]["policy_params"] * dtype_bytes(a) / bw["bytes_per_s"] * 1e3
                rows[side]["gen_over_floor"] = g / f
        out[algo] = rows
    return out


def report(summary, a, meta, bw=None):
    print("\n" + meta)
    if bw: print(f"bandwidth {bw['bytes_per_s'] / 1e9:.0f} GB/s ({bw['device']}: {bw['how']}); floor per token = policy "
                 f"params x {dtype_bytes(a)} B ({'bf16' if dtype_bytes(a) == 2 else 'fp32'}) / bandwidth")
    mem = "peak GPU MiB (max_memory_allocated)" if a.device == "cuda" else "peak RSS MiB"
    for algo, rows in summary.items():
        if not rows: print(f"{algo}: every side failed"); continue
        sides = [s for s in ("ours", "trl") if s in rows]
        names = {"ours": f"ours = {ALGOS[algo][0]}", "trl": f"TRL {rows['trl']['version']} = {ALGOS[algo][1]}" if "trl" in rows else ""}
        print(f"\n{algo}: " + ", ".join(names[s] for s in sides) + (" (LoRA)" if getattr(a, "lora", False) else ""))
        both = len(sides) == 2
        print(f"{'':<24}" + "".join(f"{('TRL' if s == 'trl' else s):>12}" for s in sides) + (f"{'ours/TRL':>10}" if both else ""))
        lines = [("cps", "completions/s"), ("cps_median_step", "  (batch/median step)"), ("tokens_per_s", "tokens/s"),
                 ("peak_mib", mem[:24]), ("peak_reserved_mib", "  (reserved)"),
                 ("live_peak_mib", "training's live MiB"), ("trainable_params", "trainable params (M)"),
                 ("gen_ms_per_token", "generation ms/token"), ("floor_ms_per_token", "  floor ms/token"),
                 ("gen_over_floor", "  generation/floor")]
        for k, label in lines:
            if not all(k in rows[s] for s in sides): continue
            v = [rows[s][k] / (1e6 if k == "trainable_params" else 1) for s in sides]
            print(f"{label:<24}" + "".join(f"{x:>12.3f}" if k.endswith("per_token") else f"{x:>12.2f}" for x in v)
                  + (f"{v[0] / v[1]:>10.2f}" if both and v[1] else ""))
        if all("reference" in rows[s] for s in sides): print("reference: " + ", ".join(f"{s} {rows[s]['reference']}" for s in sides))
        print(f"median step phases, s:")
        for p in PHASES + ["total"]:
            x = [rows[s]["phases_s"][p] for s in sides]
            print(f"  {p:<22}" + "".join(f"{v:>12.3f}" for v in x) + (f"{(x[0] / x[1] if x[1] > 1e-9 else float('nan')):>10.2f}" if both else ""))
    print()
    for algo, rows in summary.items():
        if len(rows) == 2: print(f"{algo} ratio={rows['ours']['cps'] / rows['trl']['cps']:.2f}")


# ---------------------------------------------------------------- largest batch that fits
def search_max_batch(a, algo, side, lora):
    "Largest completions per step whose first full training step runs without running out of memory: doubling from --batch (halving when --batch itself fails), then bisection (multiples of k for RLOO/GRPO)."
    k = RLOO_K if algo in ("rloo", "grpo") else 1
    probes, t0 = [], time.perf_counter()
    def probe(b):
        r = run_child(a, algo, side, batch=b, lora=lora, warmup=1, steps=0)
        probes.append({"batch": b, "status": r["status"], "peak_mib": r.get("peak_mib"), "wall_s": r["child_wall"]})
        print(f"  {algo:<13}{side:<5}{'LoRA' if lora else 'full':<5} batch {b:>5}: {r['status']:<5} peak "
              f"{(r.get('peak_mib') or float('nan')):9.0f} MiB  ({r['child_wall']:.0f} s)", flush=True)
        return r
    def over_budget(): return past_deadline(a) or (a.max_batch_budget_s and time.perf_counter() - t0 > a.max_batch_budget_s)
    ok, fail, b = {}, None, a.batch
    while True:                                    # doubling
        r = probe(b)
        if r["status"] in ("error", "skipped"): fail = r["status"]; break
        if r["status"] == "oom":
            fail = b
            if ok or b // 2 < k or over_budget(): break
            b = b // 2 // k * k; continue          # the first probe failed: halve until one fits
        ok[b] = r["peak_mib"]
        if b * 2 > a.max_batch_cap or over_budget() or isinstance(fail, int): break
        b *= 2
    bisections = 0
    while ok and isinstance(fail, int) and bisections < a.bisect and not over_budget():   # bisection
        lo = max(ok); mid = (lo + fail) // 2 // k * k
        if mid <= lo: break
        r = probe(mid); bisections += 1
        if r["status"] in ("error", "skipped"): fail = r["status"] if r["status"] == "error" else fail; break
        if r["status"] == "oom": fail = mid
        else: ok[mid] = r["peak_mib"]
    lo = max(ok) if ok else None
    return {"algo": algo, "side": side, "mode": "LoRA" if lora else "full FT", "largest": lo,
            "peak_mib": ok.get(lo), "first_failing": fail, "exact": isinstance(fail, int) and lo is not None and fail - lo <= k,
            "probes": probes, "wall_s": time.perf_counter() - t0}


def report_max_batch(rows, a, meta):
    print("\n" + meta)
    print(f"largest batch (completions per step) whose first training step fits; a failing probe = "
          f"{'CUDA out of memory' if a.device == 'cuda' else 'out of memory'}"
          + (f" or a peak over --mem_limit_mib {a.mem_limit_mib:g}" if a.mem_limit_mib else ""))
    mem = "peak GPU MiB" if a.device == "cuda" else "peak RSS MiB"
    print(f"{'algo':<14}{'side':<6}{'mode':<9}{'largest':>8}{'fails at':>10}{mem:>14}{'probes':>8}{'s':>7}")
    for r in rows:
        print(f"{r['algo']:<14}{r['side']:<6}{r['mode']:<9}{str(r['largest']):>8}{str(r['first_failing'] or '-'):>10}"
              f"{(r['peak_mib'] or float('nan')):>14.0f}{len(r['probes']):>8}{r['wall_s']:>7.0f}")
    by = {(r["algo"], r["mode"], r["side"]): r for r in rows}
    for (algo, mode, side), r in by.items():
        t = by.get((algo, mode, "trl"))
        if side == "ours" and t and r["largest"] and t["largest"]:
            print(f"{algo} {mode} max_batch ours/TRL={r['largest'] / t['largest']:.2f}")


def max_batch(a, meta_fn, save):
    rows = a.max_batch_rows = []
    modes = a.modes or (["lora"] if a.lora else ["full"])
    for mode in modes:
        for algo in a.algos:
            for side in a.sides:
                rows.append(search_max_batch(a, algo, side, mode == "lora")); save(rows)
    report_max_batch(rows, a, meta_fn())


def floor(a):
    "Our PPO step (shared critic) against its floor at this size: `ppo_floor.floor_step` beside `_common.Timers`."
    quiet()
    if a.device == "cpu": os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    sys.path.insert(0, str(HERE))
    from _common import Timers, length_reward, median
    from ppo_floor import floor_step
    from transformers import AutoTokenizer
    from instruct_goose import Agent, RLHFConfig, RLHFTrainer, create_reference_model
    from instruct_goose.data import encode_prompts
    from instruct_goose.loop import TrainLoop
    apply_levers(a.lever)
    tok = AutoTokenizer.from_pretrained(a.tok_dir)
    policy, _, _ = build_models(a.model_shape, tok, a.response_length, value=False)
    config = RLHFConfig(output_dir=tempfile.mkdtemp(), learning_rate=1e-5, lr_scheduler_type="constant",
                        per_device_train_batch_size=a.batch, num_mini_batches=1, num_ppo_epochs=a.epochs,
                        response_length=a.response_length, total_episodes=a.batch * 10_000, num_sample_generations=0,
                        disable_tqdm=True, seed=0, mixed_precision="bf16" if a.dtype == "bf16" else "no")
    trainer = RLHFTrainer(Agent(policy), create_reference_model(policy), config, processing_class=tok,
                          reward_funcs=length_reward, train_dataset=prompts_dataset())
    trainer.check_ready()
    loop = trainer.loop = TrainLoop(config)
    loop.register(trainer.kl_ctl)
    agent = loop.accelerator.unwrap_model(loop.setup_optimizer(trainer.model, 10_000 * a.epochs))
    trainer.ref_model.to(loop.device)
    prompts = trainer.train_dataset[:a.batch]["prompt"]
    timers = Timers(trainer)
    dev = loop.device
    f_agent = copy.deepcopy(agent).train()
    f_ref = copy.deepcopy(trainer.ref_model)
    f_opt = torch.optim.AdamW([q for q in f_agent.parameters() if q.requires_grad], lr=1e-5, fused=True)  # as the library and TRL
    q_ids, q_mask = (t.to(dev) for t in encode_prompts(tok, prompts, config.max_prompt_length))
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if a.dtype == "bf16" else (lambda: torch.autocast("cpu", enabled=False))
    lib, flo = [], []
    for i in range(a.warmup + a.reps):
        def lib_step():
            sync()
            with loop.accelerator.autocast(): r = timers.step(agent, prompts)
            sync(); return r
        def floor_s():
            sync()
            with autocast(): r = floor_step(f_agent, f_ref, f_opt, q_ids, q_mask, a.response_length, a.epochs, tok.pad_token_id, a.lean)
            sync(); return r
        if i % 2 == 0: L = lib_step(); F_ = floor_s()
        else: F_ = floor_s(); L = lib_step()
        if i >= a.warmup: lib.append(L); flo.append(F_)
    keys = ["generate", "score", "rollout stats", "PPO epochs (fwd+bwd)", "optimizer", "logging", "total"]
    print(f"PPO step vs floor: {a.model_shape}, {a.device} {a.dtype}, batch {a.batch}, response {a.response_length}, "
          f"{a.epochs} epochs; medians of {a.reps} after {a.warmup} warm-up; levers {a.lever or 'none'}; "
          f"torch threads {torch.get_num_threads()}; lean floor: {a.lean}. Note: phase timers are not synchronised inside a step on GPU.")
    print(f"{'phase':<22}{'library ms':>12}{'floor ms':>10}{'lib/floor':>10}")
    table = {}
    for k in keys:
        lm = median([r[k] for r in lib]) * 1e3
        fm = median([r.get(k, 0.0) for r in flo]) * 1e3
        table[k] = (lm, fm)
        print(f"{k:<22}{lm:>12.1f}{fm:>10.1f}{(lm / fm if fm else float('nan')):>10.2f}")
    ratios = [l["total"] / f["total"] for l, f in zip(lib, flo)]
    print(f"step/floor ratio: median {median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")
    if a.json:
        Path(a.json).write_text(json.dumps({"levers": a.lever or [], "table_ms": table, "ratios": ratios,
                                            "args": {k: v for k, v in vars(a).items() if k != "child"}}, indent=1))




def library_info():
    "The library measured: its folder, sha1 of its *.py, and the git commit (LIBRARY_COMMIT overrides: a device machine's copy of the tree has no .git) and whether the tree differs from it."
    import hashlib, instruct_goose
    pkg = Path(instruct_goose.__file__).parent
    info = {"path": str(pkg), "sha1_py": hashlib.sha1(b"".join(f.read_bytes() for f in sorted(pkg.glob("*.py")))).hexdigest()[:10]}
    git = lambda *x: subprocess.run(["git", "-C", str(pkg.parent), *x], capture_output=True, text=True)
    head = git("rev-parse", "HEAD")
    if os.environ.get("LIBRARY_COMMIT"):
        info["commit"], info["commit_from"] = os.environ["LIBRARY_COMMIT"], "LIBRARY_COMMIT"
        info["dirty"] = os.environ.get("LIBRARY_DIRTY", "unknown")
    elif head.returncode == 0:
        info["commit"], info["commit_from"] = head.stdout.strip(), "git"
        changed = git("status", "--porcelain", "--untracked-files=no", "--", "instruct_goose", "nbs").stdout.split("\n")
        info["dirty"] = any(l.strip() for l in changed)   # library or notebook files changed since that commit
    else: info["commit"], info["dirty"] = "unknown (no git here, LIBRARY_COMMIT unset)", "unknown"
    return info


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", "--model_shape", dest="model_shape", choices=list(SHAPES), default="gpt2-small")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast (mixed precision) on both sides")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    p.add_argument("--sides", nargs="+", default=["ours", "trl"], choices=["ours", "trl"], help="run only these sides (e.g. a lever on ours alone)")
    p.add_argument("--batch", type=int, default=8, help="completions per step (RLOO/GRPO: batch/4 prompts x k=4); --max_batch: the first probe")
    p.add_argument("--response_length", type=int, default=64)
    p.add_argument("--micro_batch", type=int, help="rows per micro-batch on both sides, batch / micro_batch of them accumulated into one optimizer step a rollout (default: the whole batch in one)")
    p.add_argument("--eos_bias", type=float, default=0.0, help="a bias on the policy's EOS logit, both sides: completions that stop early (a random policy almost never stops)")
    p.add_argument("--prompt_words", type=int, default=0, help="words of instructions before each prompt, both sides: long prompts, as a real task's (RLOO/GRPO run each k times: --lever shared_prefix)")
    p.add_argument("--epochs", type=int, default=4, help="PPO epochs per rollout (RLOO: 1, as TRL's num_iterations=1)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--reps", type=int, default=1, help="runs per (algorithm, side), alternating ours/TRL")
    p.add_argument("--lora", action="store_true", help="peft LoRA on both sides (r 16, alpha 32, no dropout, attention + MLP projections), through each trainer's peft_config")
    p.add_argument("--max_batch", action="store_true", help="for each (algorithm, side): the largest batch whose first training step fits (doubling from --batch, then bisection)")
    p.add_argument("--modes", nargs="+", choices=["full", "lora"], help="--max_batch: full fine-tuning and/or LoRA (default: lora with --lora, else full)")
    p.add_argument("--mem_limit_mib", type=float, help="a probe whose peak (GPU allocated, or RSS on the CPU) exceeds this counts as out of memory")
    p.add_argument("--bisect", type=int, default=3, help="--max_batch: bisection probes after the doubling, at most")
    p.add_argument("--max_batch_cap", type=int, default=4096, help="--max_batch: stop doubling past this batch")
    p.add_argument("--max_batch_budget_s", type=float, help="--max_batch: no new probe of an (algorithm, side, mode) after this many seconds")
    p.add_argument("--profile", metavar="DIR", help="our side: one step more, untimed, its generation and update under torch.profiler; the tables (by self CUDA time on a GPU) go to DIR")
    p.add_argument("--deadline_s", type=float, help="start no new child process after this many seconds (runs not started are 'skipped'); the JSON is written after every child")
    p.add_argument("--trl_ppo_path", default=os.environ.get("TRL_PPO_PATH", "/tmp/trl112"),
                   help="a --target install of trl==1.12.0 (for PPO; RLOO uses the installed TRL)")
    p.add_argument("--tok_dir", help="a tokenizer folder: loaded when it holds one of the shape's vocabulary, else one is trained and saved there (none given: trained into a temporary folder)")
    p.add_argument("--checkpointing", default="none", choices=["none", "full", "selective"],
                   help="gradient checkpointing: none on either side (default); full on both (TRL 1.x's default; TRL 1.12's PPO never turns it on); "
                        "selective on ours (gradient_checkpointing_policy='selective': matmul outputs kept), none on TRL's, which has no such policy")
    p.add_argument("--optim", default="adamw_torch_fused", help="🤗's optimizer name on both sides, e.g. adamw_8bit (bitsandbytes: 2 bytes of moments a parameter instead of 8); the phase tables time only AdamW's step as 'optimizer' (TRL's PPO windows too): for memory and --max_batch")
    p.add_argument("--live_bytes", action="store_true",
                   help="count the training's tensor bytes with LiveBytes (a CPU stand-in for torch.cuda.max_memory_allocated, less the weights built before training; slows the run: memory only)")
    p.add_argument("--lever", action="append", help="apply a library lever to our side: logprobs_fused, no_checks, static_cache, own_decoder, compiled_decoder, continuous_batching, padding_free, shared_prefix; or take one back: unpacked, no_kept_pass, unfused, hf_generate, dynamic_cache, untrimmed, drawn_micro_batches, glibc_memory")
    p.add_argument("--trl_env", action="append", metavar="KEY=VALUE", help="an environment variable for TRL's processes only, e.g. GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647 (glibc's malloc as the library sets it on the CPU)")
    p.add_argument("--floor", action="store_true", help="our PPO step against its floor instead of the TRL comparison")
    p.add_argument("--lean", action="store_true", help="--floor: the floor with the library's levers (packed sampling on the CPU, no separate old-logprob pass)")
    p.add_argument("--params", action="store_true", help="only build the shape's policy on the meta device and print its parameter count")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--report", help="only print the tables from a file written by --json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--algo", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.json: Path(a.json).parent.mkdir(parents=True, exist_ok=True)   # e.g. bench/results/<date>_<what>/
    global PROMPT_WORDS, MAX_PROMPT
    PROMPT_WORDS, MAX_PROMPT = a.prompt_words, MAX_PROMPT + 3 * a.prompt_words   # (a word is 1-3 tokens of the bench's tokenizer)
    if a.child == "bandwidth": return bandwidth_child(a)
    if a.child: a.side = a.child; return child(a)
    if a.report:                        # print the tables again from a file written by --json
        d = json.loads(Path(a.report).read_text())
        for k, v in d["args"].items(): setattr(a, k, v)
        if "max_batch" in d: return report_max_batch(d["max_batch"], a, d["meta"])
        return report(summarise(d["runs"], a, d.get("bandwidth")), a, d["meta"], d.get("bandwidth"))
    if a.params: return print_params(a.model_shape)
    if a.micro_batch is not None and (a.micro_batch < 1 or a.batch % a.micro_batch):
        p.error(f"--micro_batch must divide --batch ({a.batch}), got {a.micro_batch}")
    if {"rloo", "grpo"} & set(a.algos) and a.batch % RLOO_K:
        p.error(f"--batch must be a multiple of k={RLOO_K} for rloo and grpo, got {a.batch}")
    if a.modes and not a.max_batch: p.error("--modes is for --max_batch (use --lora for a LoRA comparison)")
    quiet()
    tmp, vocab = None, SHAPES[a.model_shape]["vocab"]
    if not a.tok_dir: tmp = tempfile.TemporaryDirectory(); a.tok_dir = tmp.name
    if not (Path(a.tok_dir) / "tokenizer.json").exists():   # trained once into --tok_dir, then loaded from there
        t = time.perf_counter(); build_tokenizer(vocab, a.tok_dir)
        print(f"tokenizer: {vocab} tokens trained in {time.perf_counter() - t:.1f} s into {a.tok_dir}", flush=True)
    else:
        from transformers import AutoTokenizer
        if len(AutoTokenizer.from_pretrained(a.tok_dir)) != vocab:
            sys.exit(f"--tok_dir {a.tok_dir} has {len(AutoTokenizer.from_pretrained(a.tok_dir))} tokens, the {a.model_shape} shape wants {vocab}")
    if a.floor: return floor(a)
    import torch, transformers   # no CUDA call in the parent: its context would take GPU memory from the children
    lib = library_info()
    library = (f"instruct_goose {lib['commit'][:12]} ({'dirty' if lib['dirty'] is True else 'clean' if lib['dirty'] is False else 'dirty: ' + str(lib['dirty'])}) "
               f"from {lib['path']} (sha1 of *.py {lib['sha1_py']})")
    bw = measure_bandwidth(a)
    machine = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    if a.device == "cuda": machine = bw["device"] + ", " + machine
    t0 = time.perf_counter()
    def meta_text():
        return (f"{a.model_shape} on {a.device} ({machine}), {a.dtype}{', LoRA r16' if a.lora and not a.max_batch else ''}; "
                f"torch {torch.__version__}, transformers {transformers.__version__}; batch {a.batch}, response "
                f"{a.response_length} tokens{f' (EOS logit +{a.eos_bias})' if a.eos_bias else ''}{f', micro-batches of {a.micro_batch}' if a.micro_batch else ''}, PPO {a.epochs} epochs x 1 minibatch, RLOO/GRPO k={RLOO_K} x {a.batch // RLOO_K} prompts, "
                + (f"1 epoch; one training step per probe (a fresh process), first batch {a.batch}, at most {a.bisect} bisections; "
                   if a.max_batch else f"1 epoch; {a.warmup} warm-up + {a.steps} timed steps x {a.reps} runs per side; ")
                + f"levers on ours: {a.lever or 'none'}; " + (f"TRL's environment: {' '.join(a.trl_env)}; " if getattr(a, "trl_env", None) else "")
                + f"gradient checkpointing: {a.checkpointing}; "
                f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; whole bench {time.perf_counter() - t0:.0f} s; {library}")
    args = {k: v for k, v in vars(a).items() if k not in ("child", "tok_dir", "report", "json", "algo")}
    def save(partial, **d):   # after every child too: a run stopped at its time limit keeps what it measured
        if a.json: Path(a.json).write_text(json.dumps({"meta": meta_text(), "partial": partial, "library": lib, "bandwidth": bw, "args": args, **d}, indent=1))
    if a.max_batch:
        max_batch(a, meta_text, lambda rows: save(True, max_batch=rows))
        return save(False, max_batch=a.max_batch_rows)
    res, trl_ppo = [], {}
    for rep in range(a.reps):
        for algo in a.algos:
            order = ("ours", "trl") if (rep + a.algos.index(algo)) % 2 == 0 else ("trl", "ours")
            for side in (s for s in order if s in a.sides):
                if side == "trl" and algo.startswith("ppo") and rep in trl_ppo:
                    # TRL's PPO has one (separate) critic: the run for ppo_shared and for ppo_separate is the same one
                    r = {**trl_ppo[rep], "algo": algo, "reused_from": trl_ppo[rep]["algo"]}
                else: r = run_child(a, algo, side)
                if side == "trl" and algo.startswith("ppo") and r["status"] == "ok": trl_ppo.setdefault(rep, r)
                if r["status"] == "ok":
                    print(f"rep {rep} {algo:<13}{side:<5} {r['cps']:7.2f} completions/s  peak {r['peak_mib']:8.0f} MiB  "
                          f"(run {r['child_wall']:.0f} s{', the ' + r['reused_from'] + ' run' if 'reused_from' in r else ''}, "
                          f"load {os.getloadavg()[0]:.1f})", flush=True)
                else: print(f"rep {rep} {algo:<13}{side:<5} {r['status']}", flush=True)
                res.append(r)
                save(True, runs=res)
    summary = summarise(res, a, bw)
    report(summary, a, meta_text(), bw)
    save(False, summary=summary, runs=res)


def print_params(shape):
    "The shape's policy built on the meta device (no memory, no tokenizer): its config and parameter count."
    import torch
    from transformers import AutoModelForCausalLM
    class Tok:   # what model_config reads of a tokenizer
        pad_token_id, eos_token_id, bos_token_id = 0, 1, 1
        def __len__(self): return SHAPES[shape]["vocab"]
    cfg = model_config(shape, Tok())
    with torch.device("meta"): m = AutoModelForCausalLM.from_config(cfg)
    emb = m.get_input_embeddings().weight.numel()
    tied = m.get_output_embeddings().weight is m.get_input_embeddings().weight
    print(f"{shape}: {type(m).__name__}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads / {getattr(cfg, 'num_key_value_heads', cfg.num_attention_heads)} KV heads, "
          f"MLP {getattr(cfg, 'intermediate_size', None) or 4 * cfg.hidden_size}, vocabulary {cfg.vocab_size}, tied embeddings {tied}")
    print(f"parameters {n_params(m):,} ({n_params(m) / 1e9:.3f} B; embeddings {emb:,}, the rest {n_params(m) - emb:,}); "
          f"bf16 weights {n_params(m) * 2 / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
