"""DPO end to end: 1 vs 2 CPU processes (torchrun, gloo), SIGKILL and resume, the `goose dpo` command.

The chapter (nbs/09c_dpo.ipynb) holds the hand-checked losses, log 2 at policy = reference, cached vs on-the-fly
reference and padding invariance; here is what needs separate processes.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import run_here

SCRIPT = '''
import json, os, sys, torch
from instruct_goose.toy import load_task
from instruct_goose.dpo import DPOConfig, DPOTrainer
policy, out, accumulation, precompute, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
resume = sys.argv[6] if len(sys.argv) > 6 else None
config = DPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation, max_steps=steps,
                   learning_rate=1e-3, save_steps=2, disable_tqdm=True, precompute_ref_log_probs=precompute,
                   resume_from_checkpoint=resume)
trainer = DPOTrainer(policy, args=config, train_dataset=load_task("preferences").select(range(64)))
trainer.train()
rank = os.environ.get("RANK", "0")
torch.save(trainer.model.state_dict(), f"{out}/weights{rank}.pt")
json.dump(trainer.loop.state.history, open(f"{out}/history{rank}.json", "w"))
'''

COMPARED = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "grad_norm",
    "learning_rate",
    "epoch",
)


def _env(out):
    return {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "HF_DATASETS_CACHE": f"{out}-cache",
    }


def _command(script, policy_dir, out, processes=1, accumulation=1, precompute=False, steps=6, resume=None):
    args = [str(script), str(policy_dir), str(out), str(accumulation), "1" if precompute else "0", str(steps)]
    args += [resume] if resume else []
    if processes == 1:
        return [sys.executable] + args
    return [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc_per_node",
        str(processes),
    ] + args


def _run(command, out):
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_env(out))
    assert result.returncode == 0, result.stderr[-8000:]
    return torch.load(out / "weights0.pt"), json.loads((out / "history0.json").read_text())


def _run_here(command, out):
    "A 1-process command's script in this process (`run_here`)."
    assert run_here(Path(command[1]), *command[2:], env={"ACCELERATE_USE_CPU": "true"}) == 0
    return torch.load(out / "weights0.pt"), json.loads((out / "history0.json").read_text())


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("dpo") / "train_dpo.py"
    path.write_text(SCRIPT)
    return path


def _same(weights_a, history_a, weights_b, history_b, eps=1e-5):
    for name, a in weights_a.items():
        torch.testing.assert_close(weights_b[name], a, atol=eps, rtol=0, msg=name)
    assert [r["step"] for r in history_a] == [r["step"] for r in history_b]
    for ra, rb in zip(history_a, history_b):
        for key in COMPARED:
            assert rb[key] == pytest.approx(ra[key], abs=eps), (ra["step"], key)


# precomputed reference: in the full set
@pytest.mark.parametrize("precompute", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_one_and_two_processes_train_alike(script, policy_dir, tmp_path, precompute):
    """2 processes x 1 micro-batch = 1 process x 2 micro-batches of 4 pairs: the same weights and statistics, to
    1e-5."""
    one = _run_here(_command(script, policy_dir, tmp_path / "one", 1, 2, precompute), tmp_path / "one")
    two = _run(_command(script, policy_dir, tmp_path / "two", 2, 1, precompute), tmp_path / "two")
    assert len(one[1]) == 6 and set(COMPARED) <= set(one[1][-1])
    _same(*one, *two)


# the DPO chapter resumes a killed run in-process on every make test; this is the subprocess version
@pytest.mark.slow
def test_killed_run_resumes_to_the_same_result(script, policy_dir, tmp_path):
    """SIGKILL after the first checkpoint, resume from the latest: the weights and history of the uninterrupted
    run."""
    steps = 40
    straight = _run(_command(script, policy_dir, tmp_path / "straight", steps=steps), tmp_path / "straight")
    killed = tmp_path / "killed"
    process = subprocess.Popen(
        _command(script, policy_dir, killed, steps=steps),
        env=_env(killed),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 300
    while not (killed / "checkpoint-2").is_dir() and time.time() < deadline and process.poll() is None:
        time.sleep(0.005)
    assert process.poll() is None, "the run finished before it could be killed"
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not (killed / f"checkpoint-{steps}").exists()
    resumed = _run(_command(script, policy_dir, killed, steps=steps, resume="latest"), killed)
    _same(*straight, *resumed, eps=1e-6)


def test_goose_dpo_on_own_pairs_with_implicit_prompts(policy_dir, tmp_path, goose_here):
    """goose dpo on a JSONL of chosen/rejected texts: trains, logs TRL's names, saves a model plain 🤗 classes
    load."""
    rows = [
        {"chosen": f"Review: film {i} was great fun.", "rejected": f"Review: film {i} was dull."}
        for i in range(16)
    ]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = goose_here(
        "dpo",
        "--model",
        str(policy_dir),
        "--dataset",
        "pairs.jsonl",
        "--max_steps",
        "3",
        "--warmup_steps",
        "0",
        "--per_device_train_batch_size",
        "4",
        "--output_dir",
        "out",
        "--disable_tqdm",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    history = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3] and set(COMPARED) <= set(history[0])
    assert history[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)  # step 1: policy = reference, log 2
    # own data: the task's pairs are never mixed in
    assert "eval_loss" not in history[-1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(policy_dir).config.vocab_size


def test_goose_dpo_refuses_rows_without_pairs(policy_dir, tmp_path, goose_here):
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    result = goose_here(
        "dpo", "--model", str(policy_dir), "--dataset", "bad.jsonl", "--output_dir", "out", cwd=tmp_path
    )
    assert result.returncode == 2 and "needs the columns" in result.stderr, result.stderr[-2000:]


def test_lora_dpo_from_peft_config_trains_adapters_only_against_the_adapter_off_base(policy_dir, tmp_path):
    """DPOTrainer(path, peft_config=LoraConfig(...)) as in TRL: the reference is the same weights with the
    adapters off (no copy);"""
    " only adapters move, the base stays as saved, and the loss falls from log 2."
    peft = pytest.importorskip("peft")
    from instruct_goose.agent import AdapterOffReference
    from instruct_goose.toy import load_task
    from instruct_goose.dpo import DPOConfig, DPOTrainer

    pairs = load_task("preferences").select(range(64))
    trainer = DPOTrainer(
        str(policy_dir),
        args=DPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=8,
            max_steps=16,
            learning_rate=1e-2,
            warmup_steps=0,
            disable_tqdm=True,
        ),
        train_dataset=pairs,
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    )
    assert isinstance(trainer.model, peft.PeftModel) and isinstance(trainer.ref_model, AdapterOffReference)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    # zero-initialised adapters: policy = reference
    assert trainer.evaluate(dataset=pairs)["eval_loss"] == pytest.approx(0.6931472, abs=1e-6)
    trainer.train()
    after = trainer.evaluate(dataset=pairs)
    # the loss falls (0.57 and 0.94 when written)
    assert after["eval_loss"] < 0.65 and after["eval_rewards/accuracies"] > 0.75, after
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all("lora_" in n for n in changed), sorted(changed)[:5]
    base = AutoModelForCausalLM.from_pretrained(policy_dir).state_dict()
    for name, p in trainer.model.get_base_model().state_dict().items():  # the base weights are the saved ones
        if "lora_" not in name:
            torch.testing.assert_close(p, base[name.replace(".base_layer", "")], rtol=0, atol=0, msg=name)


def test_callbacks_hear_each_log_and_can_stop_the_run(policy_dir, tmp_path):
    """DPOTrainer(..., callbacks=[...]) passes 🤗 TrainerCallbacks to the loop: on_log sees TRL's names,
    should_training_stop ends the run."""
    from transformers import TrainerCallback
    from instruct_goose.toy import load_task
    from instruct_goose.dpo import DPOConfig, DPOTrainer

    class StopAfter2(TrainerCallback):
        logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(logs)

        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    trainer = DPOTrainer(
        str(policy_dir),
        args=DPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            max_steps=5,
            logging_steps=1,
            disable_tqdm=True,
        ),
        train_dataset=load_task("preferences").select(range(16)),
        callbacks=[StopAfter2],
    )
    trainer.train()
    assert [r["step"] for r in StopAfter2.logs] == [1, 2] and set(COMPARED) <= set(StopAfter2.logs[0])
    assert StopAfter2.logs[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)


def test_goose_pipeline_with_dpo(tmp_path, goose_here):
    """goose pipeline --algo dpo: SFT -> DPO -> eval (gold judge for both columns, no reward model), with its
    plot and summary."""
    result = goose_here(
        "pipeline",
        "--algo",
        "dpo",
        "--output_dir",
        "run",
        "--sft_steps",
        "3",
        "--dpo_steps",
        "2",
        "--disable_tqdm",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "run"
    assert not (run / "rm").exists() and (run / "dpo_curves.png").is_file()
    assert [r["step"] for r in map(json.loads, (run / "dpo" / "metrics.jsonl").read_text().splitlines())] == [
        1,
        2,
    ]
    metrics = json.loads((run / "summary.json").read_text())["metrics"]
    assert metrics["eval/reward"] == metrics["eval/gold"] and "eval/kl" in metrics


def test_model_init_kwargs_and_dataset_num_proc_are_honoured(policy_dir, tmp_path):
    """TRL's model_init_kwargs load the policy (and a reference named by path) as asked; dataset_num_proc
    tokenises in processes alike."""
    from instruct_goose.toy import load_task
    from instruct_goose.dpo import DPOConfig, DPOTrainer

    pairs = load_task("preferences").select(range(8))
    config = DPOConfig(
        output_dir=str(tmp_path), model_init_kwargs={"dtype": torch.float64}, dataset_num_proc=2
    )
    trainer = DPOTrainer(str(policy_dir), ref_model=str(policy_dir), args=config, train_dataset=pairs)
    assert (
        trainer.model.dtype == torch.float64 and next(trainer.ref_model.parameters()).dtype == torch.float64
    )
    plain = DPOTrainer(str(policy_dir), args=DPOConfig(output_dir=str(tmp_path)), train_dataset=pairs)
    assert plain.model.dtype == torch.float32
    assert plain.train_dataset["chosen_ids"] == trainer.train_dataset["chosen_ids"]


RAGGED = [
    {"prompt": "Review: a", "chosen": " mess.", "rejected": " lovely."},
    {"prompt": "Review: it", "chosen": " was dull.", "rejected": " was fine."},
    {
        "prompt": "Review: the plot",
        "chosen": " drags on and on, and the cast looks bored all the way to the end.",
        "rejected": " is fine.",
    },
]


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_padding_free_bins_give_the_padded_loss_and_gradient(family, tmp_path):
    """padding_free packs whole sequences into bins (every real token once, none split across bins, short ones
    sharing a bin) and gives the padded batch's DPO loss and gradient."""
    import copy
    from datasets import Dataset
    from _families import BY_NAME, build_causal
    from instruct_goose.toy import task_tokenizer
    from instruct_goose.agent import pack_bins, pack_layout
    from instruct_goose.dpo import DPOConfig, DPOTrainer

    tok = task_tokenizer()
    policy, ref = build_causal(BY_NAME[family], tok, seed=0), build_causal(BY_NAME[family], tok, seed=1)
    trainer = DPOTrainer(
        policy,
        ref_model=ref,
        args=DPOConfig(output_dir=str(tmp_path), max_length=256),
        processing_class=tok,
        train_dataset=Dataset.from_list(RAGGED),
    )
    batch, n_pairs = trainer.encode(trainer.train_dataset[:])
    ids, mask = batch[0], batch[1]
    lengths = mask.sum(1)
    bins = pack_bins(lengths.tolist(), int(lengths.max()))
    # short sequences share bins
    assert sorted(i for b in bins for i in b) == list(range(len(ids))) and len(bins) < len(ids)
    slot, position, segment = pack_layout(mask)
    real = mask.bool()
    # every real token in exactly one slot
    assert len(slot.unique()) == int(real.sum())
    row = torch.repeat_interleave(torch.arange(len(ids)), lengths)
    # in its own sequence's segment
    assert torch.equal(segment.flatten()[slot], row)
    # a sequence is contiguous in one bin
    for r in range(len(ids)):
        where = slot[row == r]
        assert len(set((where // segment.shape[1]).tolist())) == 1 and torch.equal(
            where.diff(), torch.ones(len(where) - 1, dtype=where.dtype)
        )
    assert (segment == -1).sum() == segment.numel() - real.sum()  # the rest are pads
    # real tokens first in each bin
    assert ((segment >= 0).int().diff(dim=1) <= 0).all()
    results = []
    for padding_free in (False, True):
        trainer.args = DPOConfig(
            output_dir=str(tmp_path),
            max_length=256,
            padding_free=padding_free,
            loss_type=["sigmoid", "sft"],
            use_weighting=True,
        )
        model = trainer.model
        model.zero_grad()
        loss_sum, stats = trainer.pair_loss_sum(model, batch)
        (loss_sum / n_pairs).backward()
        results.append((loss_sum.item(), stats, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (padded, padded_stats, padded_grad), (packed, packed_stats, packed_grad) = results
    assert packed == pytest.approx(padded, rel=1e-6, abs=1e-6)
    for key, value in padded_stats.items():
        assert float(packed_stats[key].detach()) == pytest.approx(
            float(value.detach()), rel=1e-5, abs=1e-6
        ), key
    scale = max(g.abs().max().item() for g in padded_grad.values())
    assert scale > 0 and max(
        (packed_grad[n] - g).abs().max().item() for n, g in padded_grad.items()
    ) <= 1e-5 * max(scale, 1.0)


@pytest.mark.parametrize("padding_free", [False, True])
def test_soft_capped_logits_give_the_logits_paths_loss_statistics_and_gradient(
    padding_free, tmp_path, monkeypatch
):
    """Gemma 2 soft-caps its logits after the output layer: DPO in chunks (the capping applied to each, WPO's
    weight and the logged mean logit included) gives the loss, statistics and gradient of the whole logits."""
    from datasets import Dataset
    from _families import BY_NAME, build_causal
    import instruct_goose.agent as agent_module
    from instruct_goose.toy import task_tokenizer
    from instruct_goose.dpo import DPOConfig, DPOTrainer

    tok = task_tokenizer()
    policy, ref = build_causal(BY_NAME["gemma2"], tok, seed=0), build_causal(BY_NAME["gemma2"], tok, seed=1)
    # the family's final_logit_softcapping (30)
    assert agent_module._output_layer(policy).after is not None
    trainer = DPOTrainer(
        policy,
        ref_model=ref,
        processing_class=tok,
        train_dataset=Dataset.from_list(RAGGED),
        args=DPOConfig(
            output_dir=str(tmp_path),
            max_length=256,
            padding_free=padding_free,
            loss_type=["sigmoid", "sft"],
            use_weighting=True,
        ),
    )
    batch, n_pairs = trainer.encode(trainer.train_dataset[:])
    results = []
    for chunked in (True, False):
        if not chunked:
            monkeypatch.setattr(agent_module, "_output_layer", lambda model: None)
        trainer.model.zero_grad()
        loss_sum, stats = trainer.pair_loss_sum(trainer.model, batch)
        (loss_sum / n_pairs).backward()
        results.append(
            (loss_sum.item(), stats, {n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        )
    (ours, our_stats, our_grad), (theirs, their_stats, their_grad) = results
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6)
    assert "logits/chosen" in their_stats
    for key, value in their_stats.items():
        assert float(our_stats[key].detach()) == pytest.approx(float(value.detach()), rel=1e-4, abs=1e-5), key
    scale = max(g.abs().max().item() for g in their_grad.values())
    assert (
        scale > 0 and max((our_grad[n] - g).abs().max().item() for n, g in their_grad.items()) <= 1e-4 * scale
    )


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "gemma2"])
def test_shared_prompts_give_the_padded_loss_and_gradient(family, tmp_path):
    """shared_prefix runs each pair's prompt once for both completions (two passes: the prompts, then the
    completions reading their keys and values) and gives the padded batch's DPO loss, statistics and gradient;
    LD-DPO's weights, WPO and the sft term included; Gemma 2's soft-capped logits too."""
    from unittest import mock
    from datasets import Dataset
    from _families import BY_NAME, build_causal
    import instruct_goose.agent as agent_module
    from instruct_goose.toy import task_tokenizer
    from instruct_goose.dpo import DPOConfig, DPOTrainer

    tok = task_tokenizer()
    policy, ref = build_causal(BY_NAME[family], tok, seed=0), build_causal(BY_NAME[family], tok, seed=1)
    config = lambda shared: DPOConfig(
        output_dir=str(tmp_path),
        max_length=256,
        shared_prefix=shared,
        loss_type=["sigmoid", "sft"],
        use_weighting=True,
        ld_alpha=0.5,
    )
    trainer = DPOTrainer(
        policy,
        ref_model=ref,
        args=config(False),
        processing_class=tok,
        train_dataset=Dataset.from_list(RAGGED),
    )
    batch, n_pairs = trainer.encode(trainer.train_dataset[:])
    results, calls, forward = [], [], agent_module.shared_prompt_forward
    for shared in (False, True):
        trainer.args = config(shared)
        trainer.model.zero_grad()
        with mock.patch.object(
            agent_module, "shared_prompt_forward", lambda *a, **k: calls.append(shared) or forward(*a, **k)
        ):
            loss_sum, stats = trainer.pair_loss_sum(trainer.model, batch)
        (loss_sum / n_pairs).backward()
        results.append(
            (loss_sum.item(), stats, {n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        )
    # the policy's and the reference's passes shared
    assert calls and all(calls)
    (padded, padded_stats, padded_grad), (ours, our_stats, our_grad) = results
    assert ours == pytest.approx(padded, rel=1e-5, abs=1e-6)
    for key, value in padded_stats.items():
        assert float(our_stats[key].detach()) == pytest.approx(float(value.detach()), rel=1e-4, abs=1e-5), key
    scale = max(g.abs().max().item() for g in padded_grad.values())
    assert scale > 0 and max(
        (our_grad[n] - g).abs().max().item() for n, g in padded_grad.items()
    ) <= 1e-5 * max(scale, 1.0)
