"""instruct_goose against TRL at the size people train: a GPT-2-small-shaped (or ~0.5B Qwen2-shaped) model.

Algorithms: PPO with the critic sharing the policy's trunk (`ppo_shared`), PPO with a separate critic trunk
(`ppo_separate`), RLOO (`rloo`), GRPO (`grpo`). TRL's side: TRL 1.16's `RLOOTrainer` and `GRPOTrainer`; for PPO, `trl.experimental.ppo.PPOTrainer` from TRL 1.12.0, the last release that ships it
(TRL 1.13 dropped it), loaded from `--trl_ppo_path` (`pip install --no-deps --target DIR trl==1.12.0`). TRL's PPO has
only a separate critic, so `ppo_shared` compares our shared-trunk PPO with TRL's (separate) PPO, and `ppo_separate` is
the like-for-like comparison.

Models: random weights from a config (same seed on both sides): `gpt2-small` = GPT-2 with 12 layers, 768 wide,
12 heads, a 32,000-token vocabulary; `0.5b` = Qwen2-0.5B's shape (24 layers, 896 wide, 14 heads / 2 KV heads, MLP 4864,
151,936 tokens, tied embeddings). The tokenizer is a byte-level BPE trained with `instruct_goose.train_tokenizer` to
exactly that vocabulary size on the task's text plus generated pseudo-words, so every id the random policy samples
decodes to text. The reward model (and TRL's / our separate critic) is a 1-label sequence classifier of the same shape.
A random policy almost never samples EOS, so every response runs the full `--response_length` tokens.

Each (algorithm, side) runs in its own subprocess (fresh peak-memory counters), alternating ours/TRL with the order
swapped every repetition. Per step: a phase breakdown measured by wrapping each side's own functions (synchronising
the GPU at each boundary): generation, scoring (decode/re-tokenize + reward model), rollout forwards (no-grad
logprobs/values/reference + advantages), update (forward + backward of the epochs), optimizer (grad clip + AdamW step
+ zero_grad), other (the rest: logging, stats, data). Completions/s over the steps after `--warmup`.
The last lines are `<algorithm> ratio=X.XX` (ours/TRL completions/s).

    OMP_NUM_THREADS=2 .venv/bin/python bench/real_size.py --trl_ppo_path /tmp/trl112 --json bench/real_size_cpu.json
    python3 bench/real_size.py --device cuda --dtype bf16 --model-shape 0.5b --trl_ppo_path /tmp/trl112
    .venv/bin/python bench/real_size.py --floor --reps 3      # our PPO step against its floor, with --lever ...
"""
import argparse, copy, json, os, random, resource, statistics, subprocess, sys, tempfile, time, warnings
from pathlib import Path

HERE = Path(__file__).parent
SHAPES = {
    "gpt2-small": dict(arch="gpt2", n_layer=12, hidden=768, heads=12, vocab=32000),
    "0.5b": dict(arch="qwen2", n_layer=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "tiny": dict(arch="gpt2", n_layer=2, hidden=64, heads=4, vocab=2000),          # for checking the script only
}
PHASES = ["generation", "scoring", "rollout forwards", "update (fwd+bwd)", "optimizer", "other"]
LR, KL_COEF, RLOO_K, MAX_PROMPT = 3e-6, 0.05, 4, 64


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


def model_config(shape, tok):
    s = SHAPES[shape]
    special = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                   bos_token_id=tok.bos_token_id)
    if s["arch"] == "gpt2":
        from transformers import GPT2Config
        return GPT2Config(n_layer=s["n_layer"], n_embd=s["hidden"], n_head=s["heads"], n_positions=512, **special)
    from transformers import Qwen2Config
    return Qwen2Config(num_hidden_layers=s["n_layer"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"],
                       max_position_embeddings=512, tie_word_embeddings=True, **special)


def build_models(shape, tok):
    "(policy, value classifier, reward classifier): random weights, fixed seeds, identical on both sides."
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
    cfg = model_config(shape, tok)
    torch.manual_seed(0); policy = AutoModelForCausalLM.from_config(cfg)
    cls_cfg = copy.deepcopy(cfg); cls_cfg.num_labels = 1
    torch.manual_seed(1); value = AutoModelForSequenceClassification.from_config(cls_cfg)
    torch.manual_seed(2); reward = AutoModelForSequenceClassification.from_config(cls_cfg)
    policy.generation_config.pad_token_id = tok.pad_token_id
    return policy, value, reward


def prompts_dataset():
    from instruct_goose import load_task
    return load_task("prompts")


# ---------------------------------------------------------------- phase clock
class Clock:
    "Per-step phase seconds; `wrap` adds a function's time to a phase (GPU synchronised at both ends)."
    def __init__(self, cuda):
        self.cuda, self.steps, self.cur, self.marks, self.t_end = cuda, [], {}, {}, []

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


# ---------------------------------------------------------------- our side
def run_ours(algo, a, tok, out, clock):
    import torch
    import instruct_goose.onpolicy as tm
    from instruct_goose import (Agent, GRPOConfig, GRPOTrainer, RLHFConfig, RLHFTrainer, RLOOConfig, RLOOTrainer,
                                RewardModel, create_reference_model)
    from instruct_goose.loop import TrainLoop
    from instruct_goose.onpolicy import OnPolicyTrainer
    policy, value, reward = build_models(a.model_shape, tok)
    apply_levers(a.lever)   # before the trainer: it fuses the models' activations when it takes them
    steps = a.warmup + a.steps
    common = dict(output_dir=out, per_device_train_batch_size=a.batch, response_length=a.response_length,
                  learning_rate=LR, kl_coef=KL_COEF, seed=0, total_episodes=a.batch * steps, num_sample_generations=0,
                  disable_tqdm=True, mixed_precision="bf16" if a.dtype == "bf16" else "no", temperature=1.0,
                  max_prompt_length=MAX_PROMPT, save_steps=0)
    rm = RewardModel(reward, tokenizer=tok)
    if algo.startswith("ppo"):
        # TRL's PPO does not clip gradients: max_grad_norm=0 (no clipping) here too
        cfg = RLHFConfig(**common, num_ppo_epochs=a.epochs, num_mini_batches=1, max_grad_norm=0.0, vf_coef=0.1,
                         cliprange=0.2, cliprange_value=0.2, gamma=1.0, lam=0.95)
        agent = Agent(policy, value_model=value if algo == "ppo_separate" else None)
        tr, cls = RLHFTrainer(agent, create_reference_model(policy), cfg, processing_class=tok, reward_funcs=rm,
                              train_dataset=prompts_dataset()), RLHFTrainer
    elif algo == "rloo":
        cfg = RLOOConfig(**common, num_generations=RLOO_K, num_ppo_epochs=1, num_mini_batches=1, max_grad_norm=1.0)
        tr, cls = RLOOTrainer(policy, create_reference_model(policy), cfg, processing_class=tok, reward_funcs=rm,
                              train_dataset=prompts_dataset()), RLOOTrainer
    else:   # GRPO: β = KL_COEF (k3 in the loss, so both sides run a reference), DAPO token averaging, group scaling
        cfg = GRPOConfig(**common, num_generations=RLOO_K, num_iterations=1, num_mini_batches=1, max_grad_norm=1.0,
                         loss_type="dapo", scale_rewards="group")
        assert cfg.beta == KL_COEF and cfg.max_completion_length == a.response_length, (cfg.beta, cfg.max_completion_length)
        tr, cls = GRPOTrainer(policy, create_reference_model(policy), cfg, processing_class=tok, reward_funcs=rm,
                              train_dataset=prompts_dataset()), GRPOTrainer
    # measure training, not the writing of the final checkpoint and model (TRL's side saves nothing: save_strategy="no")
    TrainLoop.save_checkpoint = lambda self: None
    Agent.save_pretrained = lambda self, *x, **k: None
    type(policy).save_pretrained = lambda self, *x, **k: None
    tm.generate_responses = clock.wrap("generation", tm.generate_responses)
    sas = {}
    OnPolicyTrainer.sample_and_score = clock.wrap("_sas", OnPolicyTrainer.sample_and_score)
    cls.sample_rollout = clock.wrap("_rollout", cls.sample_rollout)
    cls.update = clock.wrap("_update", cls.update)
    patch_optimizer(clock)
    log = TrainLoop.log
    def log_and_mark(self, *x, **k):
        r = log(self, *x, **k); clock.step_end(); return r
    TrainLoop.log = log_and_mark
    clock.t0 = clock.now()
    tr.train()
    for s in clock.steps:   # nested wrappers -> exclusive phases
        s["scoring"] = s.pop("_sas") - s.get("generation", 0)
        s["rollout forwards"] = s.pop("_rollout") - s["generation"] - s["scoring"]
        s["update (fwd+bwd)"] = s.pop("_update") - s.get("optimizer", 0)
    return torch.__version__


# ---------------------------------------------------------------- TRL's side
def run_trl(algo, a, tok, out, clock):
    cuda = a.device == "cuda"
    if algo.startswith("ppo"):
        sys.path.insert(0, a.trl_ppo_path)          # TRL 1.12.0: the last release with experimental PPO
    import torch, trl
    from datasets import Dataset
    from transformers import TrainerCallback
    policy, value, reward = build_models(a.model_shape, tok)
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
        cfg = PPOConfig(output_dir=out, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                        num_mini_batches=1, num_ppo_epochs=a.epochs, response_length=a.response_length,
                        total_episodes=a.batch * steps, learning_rate=LR, kl_coef=KL_COEF, kl_estimator="k1",
                        cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, temperature=1.0,
                        whiten_rewards=False, stop_token="eos", missing_eos_penalty=None, num_sample_generations=0,
                        local_rollout_forward_batch_size=64, report_to="none", save_strategy="no", seed=0,
                        use_cpu=not cuda, bf16=a.dtype == "bf16", logging_steps=1, disable_tqdm=True,
                        dataloader_num_workers=0, lr_scheduler_type="linear")
        st = {}
        step = torch.optim.AdamW.step   # patched before the trainer exists: its LR scheduler captures the function
        def step_marked(*x, **k):
            r = step(*x, **k); st["last_opt"] = time.perf_counter(); return r
        torch.optim.AdamW.step = step_marked
        tr = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=copy.deepcopy(policy).eval(),
                        reward_model=reward, value_model=value, train_dataset=ds, eval_dataset=ds, callbacks=[Mark()])
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
        shared = dict(output_dir=out, per_device_train_batch_size=a.batch, num_generations=RLOO_K,
                      steps_per_generation=1, num_iterations=1, max_completion_length=a.response_length,
                      learning_rate=LR, beta=KL_COEF, seed=0, max_steps=steps, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=not cuda, bf16=a.dtype == "bf16", temperature=1.0, top_p=1.0,
                      top_k=0, disable_dropout=True, epsilon=0.2, max_grad_norm=1.0,
                      lr_scheduler_type="linear", disable_tqdm=True, dataloader_num_workers=0,
                      gradient_checkpointing=False)   # TRL 1.x's default is True; ours recomputes nothing (added 2026-11-24)
        if algo == "rloo": cfg, Trainer = RLOOConfig(**shared, normalize_advantages=False), RLOOTrainer
        else: cfg, Trainer = GRPOConfig(**shared, loss_type="dapo", scale_rewards="group"), GRPOTrainer
        policy.save_pretrained(f"{out}/policy")   # with beta > 0 TRL loads its reference from the policy's path
        tr = Trainer(model=f"{out}/policy", reward_funcs=reward, reward_processing_classes=tok, args=cfg,
                     train_dataset=ds, processing_class=tok, callbacks=[Mark()])
        C = type(tr)
        C._generate_single_turn = clock.wrap("generation", C._generate_single_turn)
        C._generate = clock.wrap("_gen_all", C._generate)
        C._calculate_rewards = clock.wrap("_rewards", C._calculate_rewards)
        C._generate_and_score_completions = clock.wrap("_gas", C._generate_and_score_completions)
        C.compute_loss = clock.wrap("update (fwd+bwd)", C.compute_loss)
        import accelerate
        accelerate.Accelerator.backward = clock.wrap("update (fwd+bwd)", accelerate.Accelerator.backward)
    clock.t0 = clock.now()
    tr.train()
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
    "Experiments on the library, applied in our child only; each is the change proposed in bench/README.md."
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
        elif lever == "unpacked":
            # the 🤗 default linear layers while sampling on the CPU (the library packs them for oneDNN: `packed_linears`)
            gen = gm.generate_responses
            def generate_unpacked(*x, **k): return gen(*x, packed=False, **k)
            tm.generate_responses = generate_unpacked
        elif lever == "hf_generate":
            # 🤗 `generate` samples, as before `decode` (the library's own decoding loop, on by default on the CPU)
            gen = gm.generate_responses
            def generate_hf(*x, **k): return gen(*x, **{**k, "own_decoder": False})
            tm.generate_responses = generate_hf
        elif lever == "unfused":
            # GPT-2's GELU as 🤗 writes it, seven tensor operations (the library runs PyTorch's fused kernel: `fuse_activations`)
            import instruct_goose.loop as lm
            lm._WRITTEN_OUT_GELUS = ()
        elif lever == "no_kept_pass":
            # a separate no-grad policy pass in the rollout (the library keeps the rollout's pass for the update: `first_pass`)
            tm.OnPolicyTrainer.keeps_first_pass = False
        else: sys.exit(f"unknown lever {lever}")


# ---------------------------------------------------------------- child / parent
def child(a):
    quiet()
    if a.device == "cpu": os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.tok_dir)
    cuda = a.device == "cuda"
    clock = Clock(cuda)
    with tempfile.TemporaryDirectory() as out:
        version = (run_ours if a.side == "ours" else run_trl)(a.algo, a, tok, out, clock)
    steps = clock.steps
    if len(steps) != a.warmup + a.steps: sys.exit(f"expected {a.warmup + a.steps} steps, timed {len(steps)}")
    timed = steps[a.warmup:]
    wall = sum(s["total"] for s in timed)
    for s in steps: s["other"] = s["total"] - sum(s.get(p, 0.0) for p in PHASES if p != "other")
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"side": a.side, "algo": a.algo, "version": version, "cps": a.batch * len(timed) / wall,
                                  "tokens_per_s": a.batch * a.response_length * len(timed) / wall,
                                  "peak_mib": peak, "steps": steps, "levers": a.lever or []}))


def run_child(a, algo, side, extra_env=None):
    cmd = [sys.executable, __file__, "--child", side, "--algo", algo, "--tok_dir", a.tok_dir,
           "--model-shape", a.model_shape, "--device", a.device, "--dtype", a.dtype, "--batch", str(a.batch),
           "--response_length", str(a.response_length), "--epochs", str(a.epochs), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--trl_ppo_path", a.trl_ppo_path] + sum((["--lever", l] for l in a.lever or []), [])
    env = {**os.environ, **(extra_env or {})}
    if side == "trl" and algo.startswith("ppo") and a.dtype == "bf16":
        # TRL's PPOTrainer builds its own Accelerator(), which reads the precision that `accelerate launch
        # --mixed_precision bf16` would set; without it bf16=True leaves TRL's PPO in float32 under transformers 5
        env["ACCELERATE_MIXED_PRECISION"] = "bf16"
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not lines:
        print(f"{algo}/{side} failed:\n{out.stdout[-2000:]}\n{out.stderr[-6000:]}", flush=True)
        return None
    r = json.loads(lines[-1][7:]); r["child_wall"] = time.perf_counter() - t
    return r


ALGOS = {  # algorithm -> (our trainer, TRL's trainer)
    "ppo_shared": ("RLHFTrainer, shared critic", "trl.experimental.ppo.PPOTrainer (1.12.0, separate critic)"),
    "ppo_separate": ("RLHFTrainer, separate critic", "trl.experimental.ppo.PPOTrainer (1.12.0, separate critic)"),
    "rloo": ("RLOOTrainer", "trl.RLOOTrainer"),
    "grpo": ("GRPOTrainer", "trl.GRPOTrainer"),
}


def summarise(res, a):
    med = statistics.median
    out = {}
    for algo in a.algos:
        rows = {}
        for side in ("ours", "trl"):
            rs = [r for r in res if r and r["algo"] == algo and r["side"] == side]
            if not rs: continue
            timed = [s for r in rs for s in r["steps"][a.warmup:]]
            rows[side] = {"cps": med([r["cps"] for r in rs]), "cps_all": [r["cps"] for r in rs],
                          "cps_median_step": a.batch / med([s["total"] for s in timed]),
                          "tokens_per_s": med([r["tokens_per_s"] for r in rs]), "peak_mib": max(r["peak_mib"] for r in rs),
                          "version": rs[0]["version"],
                          "phases_s": {p: med([s.get(p, 0.0) for s in timed]) for p in PHASES + ["total"]}}
        out[algo] = rows
    return out


def report(summary, a, meta):
    print("\n" + meta)
    mem = "peak GPU MiB (max_memory_allocated)" if a.device == "cuda" else "peak RSS MiB"
    for algo, rows in summary.items():
        if len(rows) < 2: print(f"{algo}: a side failed"); continue
        o, t = rows["ours"], rows["trl"]
        print(f"\n{algo}: ours = {ALGOS[algo][0]}, TRL {t['version']} = {ALGOS[algo][1]}")
        print(f"{'':<22}{'ours':>10}{'TRL':>10}{'ours/TRL':>10}")
        for k, label in (("cps", "completions/s"), ("cps_median_step", "  (batch/median step)"),
                         ("tokens_per_s", "tokens/s"), ("peak_mib", mem[:22])):
            print(f"{label:<22}{o[k]:>10.2f}{t[k]:>10.2f}{o[k] / t[k]:>10.2f}")
        print(f"median step phases, s:")
        for p in PHASES + ["total"]:
            x, y = o["phases_s"][p], t["phases_s"][p]
            print(f"  {p:<20}{x:>10.3f}{y:>10.3f}{(x / y if y > 1e-9 else float('nan')):>10.2f}")
    print()
    for algo, rows in summary.items():
        if len(rows) == 2: print(f"{algo} ratio={rows['ours']['cps'] / rows['trl']['cps']:.2f}")


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
    policy, _, _ = build_models(a.model_shape, tok)
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", "--model_shape", dest="model_shape", choices=list(SHAPES), default="gpt2-small")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast (mixed precision) on both sides")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    p.add_argument("--batch", type=int, default=8, help="completions per step (RLOO: batch/4 prompts x k=4)")
    p.add_argument("--response_length", type=int, default=64)
    p.add_argument("--epochs", type=int, default=4, help="PPO epochs per rollout (RLOO: 1, as TRL's num_iterations=1)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--reps", type=int, default=1, help="runs per (algorithm, side), alternating ours/TRL")
    p.add_argument("--trl_ppo_path", default=os.environ.get("TRL_PPO_PATH", "/tmp/trl112"),
                   help="a --target install of trl==1.12.0 (for PPO; RLOO uses the installed TRL)")
    p.add_argument("--tok_dir", help="a tokenizer saved by an earlier run (else one is trained)")
    p.add_argument("--lever", action="append", help="apply a library lever to our side: logprobs_fused, no_checks, static_cache; or take one back: unpacked, no_kept_pass, unfused, hf_generate")
    p.add_argument("--floor", action="store_true", help="our PPO step against its floor instead of the TRL comparison")
    p.add_argument("--lean", action="store_true", help="--floor: the floor with the library's levers (packed sampling on the CPU, no separate old-logprob pass)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--report", help="only print the tables from a file written by --json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--algo", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child: a.side = a.child; return child(a)
    if a.report:                        # print the tables again from a file written by --json
        d = json.loads(Path(a.report).read_text())
        for k, v in d["args"].items(): setattr(a, k, v)
        return report(summarise(d["runs"], a), a, d["meta"])
    quiet()
    tmp = None
    if not a.tok_dir:
        tmp = tempfile.TemporaryDirectory(); a.tok_dir = tmp.name
        t = time.perf_counter(); build_tokenizer(SHAPES[a.model_shape]["vocab"], a.tok_dir)
        print(f"tokenizer: {SHAPES[a.model_shape]['vocab']} tokens trained in {time.perf_counter() - t:.1f} s", flush=True)
    if a.floor: return floor(a)
    import torch, transformers, hashlib, instruct_goose
    pkg = Path(instruct_goose.__file__).parent
    library = f"instruct_goose from {pkg} (sha1 of *.py {hashlib.sha1(b''.join(f.read_bytes() for f in sorted(pkg.glob('*.py')))).hexdigest()[:10]})"
    machine = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    if a.device == "cuda": machine = torch.cuda.get_device_name() + ", " + machine
    t0 = time.perf_counter()
    res = []
    for rep in range(a.reps):
        for algo in a.algos:
            for side in (("ours", "trl") if (rep + a.algos.index(algo)) % 2 == 0 else ("trl", "ours")):
                r = run_child(a, algo, side)
                if r:
                    print(f"rep {rep} {algo:<13}{side:<5} {r['cps']:7.2f} completions/s  peak {r['peak_mib']:8.0f} MiB  "
                          f"(run {r['child_wall']:.0f} s, load {os.getloadavg()[0]:.1f})", flush=True)
                res.append(r)
    summary = summarise(res, a)
    meta = (f"{a.model_shape} on {a.device} ({machine}), {a.dtype}; torch {torch.__version__}, transformers "
            f"{transformers.__version__}; batch {a.batch}, response {a.response_length} tokens, PPO {a.epochs} epochs x 1 "
            f"minibatch, RLOO/GRPO k={RLOO_K} x {a.batch // RLOO_K} prompts, 1 epoch; {a.warmup} warm-up + {a.steps} timed steps "
            f"x {a.reps} runs per side; levers on ours: {a.lever or 'none'}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; "
            f"whole bench {time.perf_counter() - t0:.0f} s; {library}")
    report(summary, a, meta)
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "args": {k: v for k, v in vars(a).items() if k not in ("child", "tok_dir", "report", "json")},
                                            "summary": summary, "runs": res}, indent=1))


if __name__ == "__main__":
    main()
