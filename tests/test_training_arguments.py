"""Every field of 🤗 `transformers.TrainingArguments` (which TRL's configs inherit) on every config: set to a value other
than 🤗's default, it is honoured (the config holds it, under TRL's name where transformers 5 renamed it, and the run
follows it) or refused by name. Never accepted and
ignored. The counts per config are printed (`pytest -s`)."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import TrainingArguments

from instruct_goose import DPOConfig, GRPOConfig, RewardConfig, RLHFConfig, RLOOConfig, SFTConfig
from instruct_goose.training_config import _HF_NOT_RUN as HF_NOT_RUN, _HF_RENAMED as HF_RENAMED

from conftest import with_bitsandbytes

CONFIGS = {
    SFTConfig: {},
    RewardConfig: {},
    RLHFConfig: {},
    RLOOConfig: {},
    GRPOConfig: {"num_generations": 2},
    DPOConfig: {},
}
CHOICES = {
    "lr_scheduler_type": "cosine",
    "optim": "adamw_torch",
    "eval_strategy": "epoch",
    "save_strategy": "epoch",
    "logging_strategy": "epoch",
    "hub_strategy": "end",
    "include_num_input_tokens_seen": "all",
    "log_level": "info",
    "log_level_replica": "info",
    "train_sampling_strategy": "sequential",
    "debug": "underflow_overflow",
    "report_to": ["none"],
    "gradient_checkpointing_kwargs": {"use_reentrant": True},
    "lr_scheduler_kwargs": {},
    "activation_checkpointing_kwargs": {"use_reentrant": True},
    "deepspeed": {"zero_optimization": {"stage": 2}},
    "fsdp": "full_shard",
    "include_for_metrics": ["inputs"],
    "label_names": ["labels"],
    "output_dir": "elsewhere",
    "resume_from_checkpoint": "latest",
    "run_name": "my-run",
}
SAME_AS = {"report_to": "none"}  # what the config holds for a value given in 🤗's other form


def hf_fields() -> dict:
    "🤗's TrainingArguments fields and their defaults."
    out = {}
    for f in dataclasses.fields(TrainingArguments):
        if not f.init:
            continue
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def other_value(name, default):
    "A value of the field's kind that is not 🤗's default."
    if name in CHOICES:
        return CHOICES[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return 2 if default != 2 else 3
    if isinstance(default, float):
        return 0.5 if default in (0.0, 0.5) else default / 2
    if isinstance(default, str):
        return default + "-other"
    return {
        "greater_is_better": True,
        "tf32": True,
        "gradient_checkpointing": True,
        "disable_tqdm": True,
        "activation_checkpointing": True,
    }.get(name, 2 if name.endswith(("_steps", "_limit", "_factor", "seed")) else "other")


def classify(config_class, name, value):
    """'honoured' (the config holds the value), 'ours' (the value is how this library runs), 'refused'
    (ValueError naming it), else what went wrong."""
    try:
        config = config_class(**CONFIGS[config_class], **{name: value})
    except ValueError as e:
        return "refused" if f"`{name}`" in str(e) else f"refused without naming it: {e}"
    if name in HF_NOT_RUN and HF_NOT_RUN[name][0] == value:
        return "ours"
    # transformers 5's new names are held under TRL's
    held = getattr(config, HF_RENAMED.get(name, name), "<missing>")
    return "honoured" if held == SAME_AS.get(name, value) else f"accepted and ignored (holds {held!r})"


@pytest.mark.parametrize("config_class", list(CONFIGS), ids=lambda c: c.__name__)
def test_every_training_argument_is_honoured_or_refused(config_class):
    verdicts = {
        name: classify(config_class, name, other_value(name, default))
        for name, default in hf_fields().items()
    }
    wrong = {n: v for n, v in verdicts.items() if v not in ("honoured", "ours", "refused")}
    assert not wrong, wrong
    counts = {k: sum(v == k for v in verdicts.values()) for k in ("honoured", "ours", "refused")}
    print(f"{config_class.__name__}: {len(verdicts)} fields: {counts}")
    assert counts["honoured"] >= 30


def test_defaults_of_hf_fields_are_accepted():
    """A TRL script passing 🤗's defaults (push_to_hub=False, dataloader_num_workers=0, …) runs: those are how
    this library runs."""
    quiet = {n: v for n, (v, _) in HF_NOT_RUN.items()}
    GRPOConfig(num_generations=2, **quiet)
    SFTConfig(**quiet)


def test_honoured_fields_change_the_run(tmp_path):
    """optim (AdamW, and 🤗's SGD with optim_args), weight decay's groups, the Adam settings, the schedule's
    kwargs, save_strategy and eval_strategy 'no', data_seed: each seen in the run."""
    from instruct_goose import SFTTrainer, load_task, task_tokenizer, tiny_causal_lm

    tok = task_tokenizer()

    def run(out, **kw):
        args = SFTConfig(
            output_dir=str(tmp_path / out),
            max_steps=2,
            per_device_train_batch_size=4,
            max_length=64,
            disable_tqdm=True,
            learning_rate=1e-3,
            **kw,
        )
        trainer = SFTTrainer(
            tiny_causal_lm(tok, seed=0),
            args=args,
            train_dataset=load_task("sft").select(range(16)),
            eval_dataset=load_task("sft").select(range(4)),
            processing_class=tok,
        )
        trainer.train()
        return trainer

    a = run(
        "a",
        optim="adamw_torch",
        adam_beta1=0.5,
        adam_epsilon=1e-6,
        save_strategy="no",
        eval_strategy="no",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": 1e-4},
    )
    group = a.loop.optimizer.optimizer.param_groups[0]
    assert (group["betas"][0], group["eps"], bool(group.get("fused"))) == (0.5, 1e-6, False)
    assert math.isclose(a.loop.scheduler.get_last_lr()[0], 1e-4)  # the cosine ends at min_lr
    # save_strategy="no": no checkpoint
    assert not list((tmp_path / "a").glob("checkpoint-*"))
    # eval_strategy="no": no evaluation
    assert not any("eval_loss" in row for row in a.loop.state.history)
    d = run(
        "d", optim="sgd", optim_args="momentum=0.9", weight_decay=0.1, save_strategy="no", eval_strategy="no"
    )
    # 🤗's SGD, 🤗's two weight-decay groups
    opt = d.loop.optimizer.optimizer
    assert type(opt).__name__ == "SGD" and [(g["momentum"], g["weight_decay"]) for g in opt.param_groups] == [
        (0.9, 0.1),
        (0.9, 0.0),
    ]
    no_decay = {id(p) for p in opt.param_groups[1]["params"]}
    assert all(
        (id(p) in no_decay) == (n.endswith("bias") or ".ln_" in n)
        for n, p in d.loop.prepared.named_parameters()
    )
    b, c = run("b", data_seed=1), run("c", data_seed=2)
    # another data order, same weights
    assert b.loop.state.history[0]["loss"] != c.loop.state.history[0]["loss"]
    assert "eval_loss" in b.loop.state.history[-1] and list((tmp_path / "b").glob("checkpoint-*"))


EIGHT_BIT = """
import tempfile, torch
from instruct_goose import SFTConfig, SFTTrainer, load_task, task_tokenizer, tiny_causal_lm
tok = task_tokenizer()
with tempfile.TemporaryDirectory() as d:
    args = SFTConfig(output_dir=d, max_steps=2, per_device_train_batch_size=4, max_length=64, disable_tqdm=True, learning_rate=1e-3,
                     optim="adamw_8bit", weight_decay=0.01, save_strategy="no")
    trainer = SFTTrainer(tiny_causal_lm(tok, seed=0), args=args, train_dataset=load_task("sft").select(range(16)), processing_class=tok)
    trainer.train()
opt, model = trainer.loop.optimizer.optimizer, trainer.loop.prepared
assert type(opt).__module__.startswith("bitsandbytes") and trainer.loop.state.step == 2, (type(opt), trainer.loop.state.step)
moments = [opt.state[w]["state1"].dtype for w in (model.transformer.h[0].mlp.c_fc.weight, model.transformer.wte.weight)]
assert moments == [torch.uint8, torch.float32], moments      # one byte a moment; 32-bit for the embedding, as 🤗
assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
print("8-bit ok")
"""


def test_adamw_8bit_runs_with_one_byte_moments():
    """optim='adamw_8bit' (bitsandbytes): an SFT run steps with one-byte moments, 32-bit for the embedding.
    bitsandbytes lives apart from the venv (`make install` puts it in .venv/bnb: peft imports it whenever it
    is installed, +2 s a process), so this runs in its own process with it on the path."""
    out = subprocess.run(
        [sys.executable, "-c", EIGHT_BIT],
        capture_output=True,
        text=True,
        env=with_bitsandbytes(dict(os.environ)),
        timeout=600,
    )
    assert out.returncode == 0 and "8-bit ok" in out.stdout, out.stderr[-3000:]


def _halving(params, lr=1e-3):
    """A torch AdamW and a schedule that halves its learning rate after each optimizer step, as a user would give
    them (🤗's `optimizers`)."""
    optimizer = torch.optim.AdamW(params, lr=lr)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _steps_given(trainer, optimizer, steps):
    "The run stepped the given optimizer `steps` times on the given schedule, over every trainable parameter."
    assert trainer.loop.optimizer.optimizer is optimizer
    trainable = [p for p in trainer.loop.prepared.parameters() if p.requires_grad]
    assert len(optimizer.state) == len(trainable) and all(
        optimizer.state[p]["step"] == steps for p in trainable
    )
    assert math.isclose(trainer.loop.scheduler.get_last_lr()[0], 1e-3 * 0.5**steps)


def test_every_trainer_steps_the_optimizer_it_is_given(tmp_path):
    """🤗's `optimizers=(optimizer, lr_scheduler)` on SFT, reward, DPO, GRPO, RLOO and PPO (given an `Agent`), and
    `optimizer_cls_and_kwargs` on SFT and reward (TRL 1.16's signatures): the run steps them; an optimizer
    that leaves PPO's value head out stops in one line."""
    from instruct_goose import (
        Agent,
        DPOTrainer,
        GRPOTrainer,
        RewardModel,
        RewardTrainer,
        RLHFTrainer,
        RLOOTrainer,
        SFTTrainer,
        load_task,
        task_tokenizer,
        tiny_causal_lm,
    )

    tok = task_tokenizer()
    small = dict(max_steps=2, per_device_train_batch_size=4, disable_tqdm=True, save_strategy="no")
    rl = dict(
        per_device_train_batch_size=4,
        total_episodes=8,
        response_length=4,
        max_prompt_length=16,
        disable_tqdm=True,
        num_sample_generations=0,
        save_strategy="no",
    )
    reward = lambda prompts, completions: [len(c) / 10 for c in completions]

    model = tiny_causal_lm(tok, seed=0)
    optimizer, schedule = _halving(model.parameters())
    trainer = SFTTrainer(
        model,
        SFTConfig(output_dir=str(tmp_path / "sft"), max_length=64, **small),
        load_task("sft").select(range(16)),
        processing_class=tok,
        optimizers=(optimizer, schedule),
    )
    trainer.train()
    _steps_given(trainer, optimizer, 2)
    trainer = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        SFTConfig(output_dir=str(tmp_path / "sft2"), max_length=64, weight_decay=0.1, **small),
        load_task("sft").select(range(16)),
        processing_class=tok,
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    )
    trainer.train()
    # the given class and arguments over 🤗's weight-decay groups
    sgd = trainer.loop.optimizer.optimizer
    assert type(sgd) is torch.optim.SGD and [
        (g["momentum"], g["weight_decay"]) for g in sgd.param_groups
    ] == [(0.9, 0.1), (0.9, 0.0)]

    rm = RewardModel(tiny_causal_lm(tok, seed=0), tokenizer=tok)
    trainer = RewardTrainer(
        rm,
        RewardConfig(output_dir=str(tmp_path / "rm"), max_length=64, **small),
        load_task("preferences").select(range(16)),
        optimizer_cls_and_kwargs=(torch.optim.RMSprop, {"lr": 1e-3}),
    )
    trainer.train()
    # the given class, over every trainable parameter, stepped twice
    rms = trainer.loop.optimizer.optimizer
    assert type(rms) is torch.optim.RMSprop and all(
        rms.state[p]["step"] == 2 for p in trainer.loop.prepared.parameters() if p.requires_grad
    )

    model = tiny_causal_lm(tok, seed=0)
    optimizer, schedule = _halving(model.parameters())
    trainer = DPOTrainer(
        model,
        args=DPOConfig(output_dir=str(tmp_path / "dpo"), max_length=64, **small),
        processing_class=tok,
        train_dataset=load_task("preferences").select(range(16)),
        optimizers=(optimizer, schedule),
    )
    trainer.train()
    _steps_given(trainer, optimizer, 2)

    for name, cls, config in (
        ("grpo", GRPOTrainer, GRPOConfig(num_generations=2, **rl)),
        ("rloo", RLOOTrainer, RLOOConfig(num_generations=2, **rl)),
    ):
        model = tiny_causal_lm(tok, seed=0)
        optimizer, schedule = _halving(model.parameters())
        config.output_dir = str(tmp_path / name)
        trainer = cls(
            model,
            args=config,
            processing_class=tok,
            reward_funcs=reward,
            train_dataset=load_task("prompts"),
            optimizers=(optimizer, schedule),
        )
        trainer.train()
        _steps_given(
            trainer, optimizer, trainer.loop.state.step * config.num_ppo_epochs * config.num_mini_batches
        )

    agent = Agent(tiny_causal_lm(tok, seed=0))
    optimizer, schedule = _halving(agent.parameters())
    trainer = RLHFTrainer(
        agent,
        args=RLHFConfig(output_dir=str(tmp_path / "ppo"), num_ppo_epochs=1, **rl),
        processing_class=tok,
        reward_funcs=reward,
        train_dataset=load_task("prompts"),
        optimizers=(optimizer, schedule),
    )
    trainer.train()
    _steps_given(trainer, optimizer, trainer.loop.state.step)
    # a causal LM: the trainer makes the value head, which the optimizer cannot hold
    policy = tiny_causal_lm(tok, seed=0)
    trainer = RLHFTrainer(
        policy,
        args=RLHFConfig(output_dir=str(tmp_path / "ppo2"), **rl),
        processing_class=tok,
        reward_funcs=reward,
        train_dataset=load_task("prompts"),
        optimizers=_halving(policy.parameters()),
    )
    with pytest.raises(
        ValueError,
        match=r"leaves out 2 of the model's \d+ trainable parameters \(value_head.weight, ...\).*PPO: build "
        r"the "
        r"`Agent`",
    ):
        trainer.train()


def test_fractional_intervals_in_an_on_policy_run(tmp_path):
    """🤗's fraction form of `logging_steps`/`save_steps` in a GRPO run of 4 steps: 0.5 is every 2 steps (rows and
    checkpoints at 2 and 4); `logging_first_step` adds a row at step 1."""
    from instruct_goose import GRPOTrainer, load_task, task_tokenizer, tiny_causal_lm

    tok = task_tokenizer()
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=4,
        response_length=4,
        disable_tqdm=True,
        num_sample_generations=0,
        logging_steps=0.5,
        save_steps="0.5",
        logging_first_step=True,
    )
    trainer = GRPOTrainer(
        tiny_causal_lm(tok, seed=0),
        args=config,
        processing_class=tok,
        train_dataset=load_task("prompts"),
        reward_funcs=lambda prompts, completions: [len(c) / 10 for c in completions],
    )
    trainer.train()
    assert [row["step"] for row in trainer.loop.state.history] == [1, 2, 4]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_eval_on_start_in_an_on_policy_run(tmp_path):
    """🤗's `eval_on_start` in GRPO: a row at step 0 with the held-out evaluation of the starting policy, then the
    run's rows; without an eval set, one line."""
    from instruct_goose import GRPOTrainer, load_task, task_tokenizer, tiny_causal_lm

    tok = task_tokenizer()

    def trainer(out, eval_dataset):
        config = GRPOConfig(
            output_dir=str(tmp_path / out),
            per_device_train_batch_size=4,
            num_generations=2,
            max_steps=2,
            response_length=4,
            disable_tqdm=True,
            num_sample_generations=0,
            eval_on_start=True,
            eval_strategy="no",
        )
        return GRPOTrainer(
            tiny_causal_lm(tok, seed=0),
            args=config,
            processing_class=tok,
            train_dataset=load_task("prompts"),
            eval_dataset=eval_dataset,
            reward_funcs=lambda prompts, completions: [len(c) / 10 for c in completions],
        )

    run = trainer("a", load_task("prompts", "eval").select(range(8)))
    run.train()
    history = run.loop.state.history
    assert [row["step"] for row in history] == [0, 1, 2] and any(k.startswith("eval/") for k in history[0])
    # eval_strategy="no": the start only
    assert not any(k.startswith("eval/") for k in history[2])
    with pytest.raises(ValueError, match=r"`eval_on_start`=True needs an `eval_dataset`"):
        trainer("b", None).train()


def test_the_best_model_is_the_one_saved(tmp_path):
    """🤗's `load_best_model_at_end` on SFT (metric eval_loss) and GRPO (metric 'score': eval/score): the model
    trained, returned and saved to `output_dir` is the one whose evaluation was best, by evaluating it again,
    and its weights are those of that step's checkpoint."""
    from safetensors.torch import load_file
    from instruct_goose import GRPOTrainer, SFTTrainer, load_task, task_tokenizer, tiny_causal_lm

    tok = task_tokenizer()
    args = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=6,
        per_device_train_batch_size=4,
        max_length=64,
        disable_tqdm=True,
        learning_rate=0.05,
        eval_steps=1,
        save_steps=1,
        save_total_limit=1,
        load_best_model_at_end=True,
    )
    sft = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        args=args,
        train_dataset=load_task("sft").select(range(24)),
        eval_dataset=load_task("sft").select(range(8)),
        processing_class=tok,
    )
    sft.train()
    model = sft.model
    evals = [row["eval_loss"] for row in sft.loop.state.history]
    best = sft.loop.state.best
    # the best is not the last here
    assert (best["value"], best["step"]) == (min(evals), 1 + evals.index(min(evals))) and best["step"] < 6, (
        evals
    )
    assert math.isclose(sft.evaluate()["eval_loss"], best["value"], rel_tol=1e-6)
    assert [p.name for p in (tmp_path / "sft").glob("checkpoint-*")] == [f"checkpoint-{best['step']}"]
    saved = load_file(tmp_path / "sft" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)

    config = GRPOConfig(
        output_dir=str(tmp_path / "grpo"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=4,
        response_length=4,
        learning_rate=0.05,
        disable_tqdm=True,
        num_sample_generations=0,
        eval_steps=1,
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    grpo = GRPOTrainer(
        tiny_causal_lm(tok, seed=0),
        args=config,
        processing_class=tok,
        train_dataset=load_task("prompts"),
        eval_dataset=load_task("prompts", "eval").select(range(8)),
        reward_funcs=lambda prompts, completions: [len(c) / 10 for c in completions],
    )
    grpo.train()
    scores = [row["eval_score"] for row in grpo.loop.state.history]
    best = grpo.loop.state.best
    assert config.greater_is_better and (best["name"], best["value"]) == ("eval/score", max(scores)), scores
    assert math.isclose(grpo.evaluate()["eval/score"], best["value"], rel_tol=1e-6)


def test_auto_find_batch_size_keeps_the_step(tmp_path):
    """🤗's `auto_find_batch_size` on SFT and DPO: a policy that runs out of memory above a number of rows a
    forward trains in smaller micro-batches to the weights (to 1e-6) and losses of micro-batches that fit;
    GRPO refuses it in one line."""
    import warnings
    from instruct_goose import DPOTrainer, SFTTrainer, load_task, task_tokenizer, tiny_causal_lm

    tok = task_tokenizer()

    def policy(most_rows):
        model = tiny_causal_lm(tok, seed=0)
        # dropout draws other masks for other micro-batch shapes: off, to compare
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0

        def out_of_memory(module, args):
            if args[0].shape[0] > most_rows:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

        if most_rows:
            model.get_input_embeddings().register_forward_pre_hook(out_of_memory)
        return model

    small = dict(
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_length=64,
        disable_tqdm=True,
        # SGD: a step linear in the gradient (AdamW divides float noise by itself where a gradient is
        # ~0)
        learning_rate=0.1,
        optim="sgd",
        save_strategy="no",
        auto_find_batch_size=True,
    )
    runs = {}
    for name, most_rows in (("fits", None), ("tight", 2)):
        sft = SFTTrainer(
            policy(most_rows),
            SFTConfig(output_dir=str(tmp_path / f"sft-{name}"), **small),
            load_task("sft").select(range(24)),
            processing_class=tok,
        )
        # a pair is 2 rows
        dpo = DPOTrainer(
            policy(most_rows and 2 * most_rows),
            args=DPOConfig(output_dir=str(tmp_path / f"dpo-{name}"), **small),
            processing_class=tok,
            train_dataset=load_task("preferences").select(range(24)),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in (sft, dpo):
                t.train()
            runs[name] = [(t.model, t.loop) for t in (sft, dpo)]
        assert sum(
            "out of memory with micro-batches of 4 rows; trying 2" in str(w.message) for w in caught
        ) == (2 if most_rows else 0)
    for (fits, fits_loop), (tight, tight_loop) in zip(runs["fits"], runs["tight"]):
        assert (fits_loop.micro_batch_size, tight_loop.micro_batch_size) == (None, 2)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(fits.parameters(), tight.parameters()))
        assert all(
            math.isclose(a["loss"], b["loss"], rel_tol=1e-5)
            for a, b in zip(fits_loop.state.history, tight_loop.state.history)
        )
    with pytest.raises(ValueError, match="`auto_find_batch_size`=True is not"):
        GRPOConfig(num_generations=2, auto_find_batch_size=True)


def test_eval_steps_unset_is_every_logging_step(tmp_path):
    """🤗's `eval_strategy`='steps' with `eval_steps` unset (None) or 0: an evaluation every `logging_steps`, at
    steps 1, 2, 3, 4 of 4 with logging_steps=1 (2 and 4 with 2), as 🤗's `TrainingArguments` sets it (with
    `eval_strategy` unset, ours: once, at the end); 🤗's `save_total_limit`=None keeps every checkpoint."""
    from transformers import TrainerCallback
    from instruct_goose import SFTTrainer, load_task, task_tokenizer, tiny_causal_lm

    tok = task_tokenizer()

    class Evaluations(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_evaluate(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    def evaluated_at(out, **kw):
        seen = Evaluations()
        args = SFTConfig(
            output_dir=str(tmp_path / out),
            max_steps=4,
            per_device_train_batch_size=4,
            max_length=64,
            disable_tqdm=True,
            **{"eval_strategy": "steps", **kw},
        )
        SFTTrainer(
            tiny_causal_lm(tok, seed=0),
            args=args,
            train_dataset=load_task("sft").select(range(16)),
            eval_dataset=load_task("sft").select(range(4)),
            processing_class=tok,
            callbacks=[seen],
        ).train()
        return seen.steps

    assert evaluated_at("none", logging_steps=1, eval_steps=None, save_steps=1, save_total_limit=None) == [
        1,
        2,
        3,
        4,
    ]
    assert sorted(p.name for p in (tmp_path / "none").glob("checkpoint-*")) == [
        f"checkpoint-{s}" for s in (1, 2, 3, 4)
    ]
    assert evaluated_at("zero", logging_steps=2, eval_steps=0, save_strategy="no") == [2, 4]
    # not asked for: once, at the end
    assert evaluated_at("unset", logging_steps=1, save_strategy="no", eval_strategy=None) == [4]


def test_none_of_hf_and_trl_is_honoured_or_refused_by_name():
    """🤗's `eval_steps`=None and `save_total_limit`=None are its defaults on every config; TRL's
    `max_completion_length`=None and `num_generations`=None have no meaning here: refused by name, with the
    value to give."""
    for config_class, base in CONFIGS.items():
        c = config_class(
            **base, eval_strategy="steps", eval_steps=None, save_total_limit=None, logging_steps=3
        )
        assert (c.eval_steps, c.save_total_limit) == (3, None), config_class
        # `eval_strategy` unset: ours, once at the end
        c = config_class(**base, eval_steps=None, logging_steps=3)
        assert (c.eval_strategy, c.eval_steps) == (None, 0), config_class
    for config_class in (RLOOConfig, GRPOConfig):
        for name in ("max_completion_length", "num_generations"):
            with pytest.raises(
                ValueError, match=rf"^`{name}` must be a number, got None \(its default: \d+\)$"
            ):
                config_class(**{name: None})


def test_dict_fields_given_as_json(tmp_path):
    """🤗/TRL's JSON text for a dict field (`_VALID_DICT_FIELDS`) is read as the dict on every config, and reaches
    the run: `lr_scheduler_kwargs` ends a cosine at its min_lr, `model_init_kwargs` loads SFT's, the reward
    model's and DPO's models in bfloat16; other text is refused by name."""
    from instruct_goose import (
        DPOTrainer,
        RewardTrainer,
        SFTTrainer,
        load_task,
        task_tokenizer,
        tiny_causal_lm,
    )

    tok = task_tokenizer()
    for config_class, base in CONFIGS.items():
        c = config_class(
            **base,
            lr_scheduler_kwargs='{"min_lr": 1e-4}',
            gradient_checkpointing_kwargs='{"use_reentrant": "false"}',
        )
        assert (c.lr_scheduler_kwargs, c.gradient_checkpointing_kwargs) == (
            {"min_lr": 1e-4},
            {"use_reentrant": False},
        ), config_class
        with pytest.raises(ValueError, match=r"^`lr_scheduler_kwargs` must be a dict, or its JSON text"):
            config_class(**base, lr_scheduler_kwargs="min_lr=1e-4")
    assert SFTConfig(dataset_kwargs='{"skip_prepare_dataset": true}').dataset_kwargs == {
        "skip_prepare_dataset": True
    }
    with pytest.raises(ValueError, match=r"`dataset_kwargs` takes only TRL's 'skip_prepare_dataset'"):
        # parsed, then checked by key
        SFTConfig(dataset_kwargs='{"num_proc": 2}')
    args = SFTConfig(
        output_dir=str(tmp_path / "cosine"),
        max_steps=2,
        per_device_train_batch_size=4,
        max_length=64,
        disable_tqdm=True,
        learning_rate=1e-3,
        save_strategy="no",
        eval_strategy="no",
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs='{"min_lr": 1e-4}',
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs='{"use_reentrant": false}',
    )
    sft = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        args=args,
        train_dataset=load_task("sft").select(range(16)),
        processing_class=tok,
    )
    sft.train()
    assert math.isclose(sft.loop.scheduler.get_last_lr()[0], 1e-4)
    path = tmp_path / "model"
    tiny_causal_lm(tok, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    pairs = load_task("preferences").select(range(8))
    for trainer, config_class, data in (
        (SFTTrainer, SFTConfig, load_task("sft").select(range(8))),
        (RewardTrainer, RewardConfig, pairs),
        (DPOTrainer, DPOConfig, pairs),
    ):
        made = trainer(
            str(path),
            args=config_class(
                output_dir=str(tmp_path / config_class.__name__), model_init_kwargs='{"dtype": "bfloat16"}'
            ),
            train_dataset=data,
        )
        model = made.reward_model if trainer is RewardTrainer else made.model
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, config_class


def test_run_name_reaches_every_tracker_that_names_runs(tmp_path, monkeypatch):
    """🤗's `run_name` reaches Accelerate's `init_trackers` under each tracker's own keyword (wandb/trackio
    `name`, mlflow `run_name`, clearml `task_name`, swanlab `experiment_name`, dvclive `exp_name`, comet an
    `ExperimentConfig`); tensorboard and aim take none. No tracker is installed: Accelerate's are stood in
    for."""
    import types
    import accelerate
    import instruct_goose.training_config as config_module
    from instruct_goose.loop import TrainLoop

    calls = []
    plain_init = accelerate.Accelerator.__init__
    # none is installed here
    monkeypatch.setattr(config_module, "check_tracker", lambda name: name)
    monkeypatch.setattr(
        accelerate.Accelerator, "__init__", lambda self, *a, log_with=None, **k: plain_init(self, *a, **k)
    )
    monkeypatch.setattr(
        accelerate.Accelerator,
        "init_trackers",
        lambda self, project, config=None, init_kwargs=None: calls.append(init_kwargs),
    )
    monkeypatch.setitem(
        sys.modules,
        "comet_ml",
        types.SimpleNamespace(ExperimentConfig=lambda name: ("ExperimentConfig", name)),
    )
    expected = {
        "wandb": {"name": "my-run"},
        "trackio": {"name": "my-run"},
        "mlflow": {"run_name": "my-run"},
        "clearml": {"task_name": "my-run"},
        "swanlab": {"experiment_name": "my-run"},
        "dvclive": {"exp_name": "my-run"},
        "comet_ml": {"experiment_config": ("ExperimentConfig", "my-run")},
        "tensorboard": None,
        "aim": None,
    }
    for tracker, kwargs in expected.items():
        TrainLoop(SFTConfig(output_dir=str(tmp_path / tracker), report_to=tracker, run_name="my-run"))
        assert calls.pop() == ({tracker: kwargs} if kwargs else {}), tracker


def test_trl_parser_reads_every_config():
    """TRL's own scripts parse their config with `TrlParser` (🤗's `HfArgumentParser`), which rewrites each
    dataclass field's `type` in place (`int | None` -> `int`): every config parses with its defaults and with
    flags (a number, a JSON dict, DPO's loss list) to the config made directly, and is made directly again
    after. In a child process: the rewritten fields would reach the other tests."""
    script = r'''
import json, sys
from dataclasses import asdict
from trl import TrlParser
from instruct_goose import DPOConfig, GRPOConfig, RewardConfig, RLHFConfig, RLOOConfig, SFTConfig
CONFIGS = {SFTConfig: {}, RewardConfig: {}, RLHFConfig: {}, RLOOConfig: {}, GRPOConfig: {"num_generations": 2}, DPOConfig: {}}
for C, base in CONFIGS.items():
    flags = ["--output_dir", "out", *[x for k, v in base.items() for x in (f"--{k}", str(v))]]
    given = ["--save_total_limit", "2", "--lr_scheduler_kwargs", '{"num_cycles": 0.5}']
    (parsed,) = TrlParser((C,)).parse_args_and_config(flags)
    (with_flags,) = TrlParser((C,)).parse_args_and_config(flags + given + (["--loss_type", "sigmoid", "sft"] if C is DPOConfig else []))
    direct = C(output_dir="out", **base)
    assert asdict(parsed) == asdict(direct), C.__name__
    extra = dict(save_total_limit=2, lr_scheduler_kwargs={"num_cycles": 0.5}, **({"loss_type": ["sigmoid", "sft"]} if C is DPOConfig else {}))
    assert asdict(with_flags) == asdict(C(output_dir="out", **base, **extra)), C.__name__
    print(C.__name__, "ok")
'''
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [w for c in CONFIGS for w in (c.__name__, "ok")]


def test_hf_unset_max_steps_is_taken():
    """🤗's default `max_steps`=-1 (not set), as a TRL config dump spells it, is 0 here (from the epochs or
    episodes) on every config; other negative numbers are refused by name."""
    for config_class, base in CONFIGS.items():
        assert config_class(**base, max_steps=-1).max_steps == 0, config_class
        with pytest.raises(ValueError, match="`max_steps` must be"):
            config_class(**base, max_steps=-2)
