"""The same learning per step as TRL 1.16: our GRPO and RLOO trainers beside TRL's own, end to end, on fixed completions.

Both sides start from the same saved tiny GPT-2, read the same prompts in dataset order, and are handed the SAME
completions: ours through `generate_responses`, TRL's through its `_generate_single_turn`, both replaced by one
function of (prompt tokens, the completion's place in its group, the generation's count). The same reward function
scores the decoded texts. The shuffles of the rows into optimizer steps (our `minibatches`, TRL's
`shuffle_sequence_dict`) are made the identity on both sides, so each optimizer step sees the same rows. Then the
gradient at every optimizer step (after clipping, read by a callback's `on_pre_optimizer_step` on both sides), the
weights after training and the logged metrics under TRL's names must be equal to float error, at TRL's defaults
(Adam, linear schedule, `max_grad_norm` 1.0 or off, `loss_type` "dapo", `scale_rewards` "group") for several
`gradient_accumulation_steps` / `steps_per_generation` / `num_iterations`.

What is deliberately not TRL's, and so kept out of these settings: dropout (ours is always off; TRL's
`disable_dropout` defaults to False, set True here); the prompts all have the same number of tokens, because TRL's
scoring passes (π_θ, π_old, π_ref) call the model without position ids, so a left-padded row is scored at positions
shifted by its padding while 🤗 `generate` sampled it at mask positions (trl#6800 names it for Online DPO; RoPE models
are unaffected, GPT-2's learned positions are not): `test_padded_prompts_are_trl_with_mask_positions` shows that this
is the only difference; "bnpo" (ours a token mean over the optimizer step's batch, TRL's over each micro-batch) and
the entropy bonus (the same) differ from TRL only where micro-batches hold different numbers of tokens.
"""

import math

import pytest
import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

import instruct_goose
from instruct_goose import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer, task_tokenizer, tiny_causal_lm

G, LENGTH = 4, 6
# seven tokens each: no padding (see the module's note)
PROMPTS = ["a bird fly", "we all swim", "the dog ran", "the cow ate"]
PADDED = ["the cat sat", "a dog ran far", "birds fly", "fish swim in the sea"]
# logged under the same TRL name on both sides, with the same meaning
GRPO_KEYS = (
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "rewards/score/mean",
    "rewards/score/std",
    "entropy",
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "num_tokens",
    "policy_loss",
    "entropy_coef",
    "epoch",
)
RLOO_KEYS = tuple(k for k in GRPO_KEYS if k not in ("policy_loss", "entropy_coef"))


@pytest.fixture(scope="module")
def tokenizer():
    tok = task_tokenizer()
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    "The tiny GPT-2 saved once: both sides load it (TRL loads its reference from the same path)."
    path = tmp_path_factory.mktemp("tiny")
    tiny_causal_lm(tokenizer, n_layer=2, hidden_size=32, seed=0).save_pretrained(path)
    return str(path)


def completion(prompt: list[int], j: int, call: int, tok) -> list[int]:
    "A fixed completion of 1–6 tokens for the j-th sample of `prompt` in generation `call`: stopped, or cut off."
    g = torch.Generator().manual_seed(hash((tuple(prompt), j, call)) % 2**31)
    n = int(torch.randint(1, LENGTH + 1, (1,), generator=g))
    special = {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id}
    ids = [t for t in torch.randint(0, len(tok), (3 * LENGTH,), generator=g).tolist() if t not in special]
    if n == LENGTH and j % 2:
        # cut off without a stop token
        return ids[:LENGTH]
    return ids[: min(n, LENGTH - 1)] + [tok.eos_token_id]


def score(prompts, completions, **kwargs):
    "The same reward on both sides: length and letters of the decoded text."
    return [len(c) / 10 + sum(map(ord, c)) % 7 / 7 for c in completions]


def score_flat_late(prompts, completions, **kwargs):
    "`score`, but every completion of the last two prompts scores 1: groups with no spread in their scores."
    return [1.0 if p in PROMPTS[2:] else r for p, r in zip(prompts, score(prompts, completions))]


class Gradients(TrainerCallback):
    "Every optimizer step's gradient, after clipping, before the step (🤗's event, which our loop fires too)."

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def samples_of(prompts: list[list[int]], call: int, tok) -> list[list[int]]:
    "The fixed completions of a generation, each prompt's j-th in the order they come."
    seen, out = {}, []
    for p in prompts:
        j = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
        out.append(completion(p, j, call, tok))
    return out


def ours_generate(tok):
    "`generate_responses` handing out the fixed completions, padded after their end."
    calls = [0]

    def generate(model, ids, mask, max_new_tokens, stop, pad, *args, **kwargs):
        rows = samples_of([r[m.bool()].tolist() for r, m in zip(ids, mask)], calls[0], tok)
        calls[0] += 1
        out = torch.full((len(rows), max_new_tokens), pad)
        real = torch.zeros(len(rows), max_new_tokens, dtype=torch.bool)
        for i, row in enumerate(rows):
            out[i, : len(row)], real[i, : len(row)] = torch.tensor(row), True
        return out, real

    return generate


def mask_positions(model):
    "TRL's scoring passes with position ids counted over real tokens, as its sampler (🤗 `generate`) counts them."

    def hook(module, args, kwargs):
        if kwargs.get("position_ids") is None and kwargs.get("attention_mask") is not None:
            kwargs["position_ids"] = (kwargs["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
        return args, kwargs

    model.register_forward_pre_hook(hook, with_kwargs=True)


def train_both(
    algo,
    model_dir,
    tok,
    monkeypatch,
    tmp_path,
    B,
    GA,
    S,
    mu,
    gens,
    mgn,
    prompts=PROMPTS,
    trl_pos=False,
    reward=score,
    **extra,
):
    """Train ours and TRL's on the fixed completions: (gradients per optimizer step, final parameters, logged rows)
    for each."""
    monkeypatch.setattr(torch, "randperm", lambda n, *args, **kwargs: torch.arange(n))
    for module in list(vars(instruct_goose).values()):
        if getattr(module, "generate_responses", None) is not None and hasattr(module, "__file__"):
            monkeypatch.setattr(module, "generate_responses", ours_generate(tok))
    data = Dataset.from_dict({"prompt": prompts[: B * S // G * gens]})
    shared = dict(
        per_device_train_batch_size=B,
        gradient_accumulation_steps=GA,
        steps_per_generation=S,
        num_generations=G,
        max_completion_length=LENGTH,
        num_iterations=mu,
        learning_rate=1e-3,
        logging_steps=1,
        shuffle_dataset=False,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **extra,
    )
    ours_config, ours_trainer = (GRPOConfig, GRPOTrainer) if algo == "grpo" else (RLOOConfig, RLOOTrainer)
    theirs_config, theirs_trainer = (
        (trl.GRPOConfig, trl.GRPOTrainer) if algo == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    )
    runs = []
    for side in ("ours", "trl"):
        grads = Gradients()
        if side == "ours":
            args = ours_config(
                output_dir=str(tmp_path / side),
                max_steps=gens,
                max_grad_norm=mgn,
                num_sample_generations=0,
                **shared,
            )
            trainer = ours_trainer(
                model=AutoModelForCausalLM.from_pretrained(model_dir),
                reward_funcs=reward,
                args=args,
                train_dataset=data,
                processing_class=tok,
                callbacks=[grads],
            )
        else:
            args = theirs_config(
                output_dir=str(tmp_path / side),
                # TRL counts optimizer steps, we count generations
                max_steps=gens * S // GA * mu,
                max_grad_norm=mgn or 1e9,
                save_strategy="no",
                use_cpu=True,
                bf16=False,
                gradient_checkpointing=False,
                disable_dropout=True,
                **shared,
            )
            model = AutoModelForCausalLM.from_pretrained(model_dir)
            if trl_pos:
                mask_positions(model)
            trainer = theirs_trainer(
                model=model,
                reward_funcs=reward,
                args=args,
                train_dataset=data,
                processing_class=tok,
                callbacks=[grads],
            )
            calls = [0]

            def single_turn(prompt_ids, *args, **kwargs):
                calls[0] += 1
                rows = samples_of([list(p) for p in prompt_ids], calls[0] - 1, tok)
                return (rows, None) if algo == "grpo" else rows

            trainer._generate_single_turn = single_turn
        trainer.train()
        history = trainer.loop.state.history if side == "ours" else trainer.state.log_history[:-1]
        runs.append((grads.steps, dict(trainer.model.named_parameters()), history))
    return runs


def assert_same_steps(ours, theirs):
    "The same number of optimizer steps, each with the same gradient (float error of a 1e-1 gradient)."
    assert len(ours[0]) == len(theirs[0]) > 0
    for step, (a, b) in enumerate(zip(ours[0], theirs[0])):
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(
                a[name], b[name], rtol=1e-5, atol=2e-6, msg=lambda m: f"{step} {name}: {m}"
            )
    for name, p in theirs[1].items():
        torch.testing.assert_close(ours[1][name], p, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def trl_mean_per_generation(rows: list[dict], per_generation: int) -> list[dict]:
    "TRL logs every optimizer step, we every generation: TRL's rows averaged over each generation's steps."
    out = []
    for i in range(0, len(rows), per_generation):
        block = rows[i : i + per_generation]
        out.append(
            {k: sum(r[k] for r in block) / len(block) for k in block[-1] if isinstance(block[-1][k], float)}
        )
        # the learning rate, epoch and gradient norm of the generation's last step (ours logs the last one)
        out[-1].update({k: block[-1][k] for k in ("learning_rate", "epoch", "grad_norm") if k in block[-1]})
    return out


@pytest.mark.parametrize(
    "B, GA, S, mu, gens, mgn, extra",
    [
        # the bench's shape: one optimizer step per generation, two generations, clipped at 1.0
        (8, 1, 1, 1, 2, 1.0, {}),
        # two optimizer steps per generation, two passes: TRL's dapo divides by the generation's tokens per step
        (4, 1, 2, 2, 1, 0.0, {}),
        # and with two accumulated micro-batches per step
        (4, 2, 4, 2, 1, 0.0, {}),
        # μ = 3 on one step per generation, the KL term
        (8, 1, 1, 3, 2, 0.0, {"beta": 0.04}),
        # per-completion means ("grpo"), two micro-batches, two generations
        (4, 2, 2, 1, 2, 0.0, {"loss_type": "grpo"}),
        # Skywork's adaptive entropy bonus (from 0, a target above every entropy: it rises by 0.005 a step)
        (8, 1, 1, 1, 2, 0.0, {"beta": 0.04, "use_adaptive_entropy": True, "entropy_target": 50.0}),
    ],
)
def test_grpo_step_equals_trl(B, GA, S, mu, gens, mgn, extra, model_dir, tokenizer, monkeypatch, tmp_path):
    ours, theirs = train_both(
        "grpo", model_dir, tokenizer, monkeypatch, tmp_path, B, GA, S, mu, gens, mgn, **extra
    )
    assert_same_steps(ours, theirs)
    per_generation = S // GA * mu
    trl_rows = trl_mean_per_generation(theirs[2], per_generation)
    assert len(ours[2]) == len(trl_rows) == gens
    keys = [k for k in GRPO_KEYS if k in trl_rows[0]]
    if GA > 1 and extra.get("loss_type", "dapo") == "dapo":
        # statistics of several micro-batches: ours weighs each by its tokens (the step's token mean), TRL
        # averages them plainly (as ours does for the per-completion loss types)
        keys = [
            k for k in keys if k not in ("entropy", "kl", "policy_loss") and not k.startswith("clip_ratio/")
        ]
    # the entropy bonus's own rows: TRL logs them only when it is on
    assert ("policy_loss" in keys) == ("use_adaptive_entropy" in extra)
    bad = []
    for row, trl_row in zip(ours[2], trl_rows):
        for k in keys:
            # "kl" is 0 at the first step: absolute
            if row[k] != pytest.approx(trl_row[k], rel=1e-5, abs=1e-6):
                bad.append((k, row[k], trl_row[k]))
    assert not bad, bad
    if "use_adaptive_entropy" in extra:
        # TRL logs the coefficient after each step's update: 0.005, 0.01 (ours logged the one applied: 0, 0.005)
        assert [round(r["entropy_coef"], 6) for r in ours[2]] == [0.005, 0.01]


@pytest.mark.parametrize(
    "B, GA, S, mu, gens, mgn, reward",
    [
        (8, 1, 1, 1, 2, 1.0, score),
        (4, 1, 2, 2, 1, 0.0, score),
        (4, 2, 2, 1, 2, 0.0, score),
        (8, 1, 1, 2, 1, 0.0, score),
        # the second generation's scores have no spread, its rewards after the KL penalty do: TRL's
        # frac_reward_zero_std is 0 there (ours counted the scores: 1)
        (8, 1, 1, 1, 2, 0.0, score_flat_late),
    ],
)
def test_rloo_step_equals_trl(B, GA, S, mu, gens, mgn, reward, model_dir, tokenizer, monkeypatch, tmp_path):
    "RLOO at TRL 1.16's defaults (β = 0.05, the k1 KL summed into the reward, sequence ratios)."
    ours, theirs = train_both(
        "rloo", model_dir, tokenizer, monkeypatch, tmp_path, B, GA, S, mu, gens, mgn, reward=reward
    )
    assert_same_steps(ours, theirs)
    trl_rows = trl_mean_per_generation(theirs[2], S // GA * mu)
    assert len(ours[2]) == len(trl_rows) == gens
    bad = []
    for row, trl_row in zip(ours[2], trl_rows):
        for k in (k for k in RLOO_KEYS if k in trl_row):
            if row[k] != pytest.approx(trl_row[k], rel=1e-5, abs=1e-6):
                bad.append((k, row[k], trl_row[k]))
    assert not bad, bad


@pytest.mark.parametrize("trl_pos", [False, True])
def test_padded_prompts_are_trl_with_mask_positions(trl_pos, model_dir, tokenizer, monkeypatch, tmp_path):
    """Prompts of 5–9 tokens, left-padded: TRL's gradient is not ours, because it scores padded rows at shifted
    positions; with position ids from the mask in TRL's scoring passes it is ours."""
    ours, theirs = train_both(
        "grpo",
        model_dir,
        tokenizer,
        monkeypatch,
        tmp_path,
        8,
        1,
        1,
        1,
        1,
        0.0,
        prompts=PADDED,
        trl_pos=trl_pos,
    )
    if trl_pos:
        assert_same_steps(ours, theirs)
    else:
        gap = max((ours[0][0][n] - theirs[0][0][n]).abs().max().item() for n in ours[0][0])
        assert gap > 1e-2, gap
    assert not math.isnan(ours[2][0]["loss"])
