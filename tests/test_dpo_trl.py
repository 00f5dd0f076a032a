"""DPO against TRL 1.16 by number: TRL's own `DPOTrainer._compute_loss` and our `DPOTrainer.pair_loss_sum` on the same batch.

The same tiny GPT-2 policy on both sides (two copies of one set of weights), a reference with other weights, pairs of
different lengths. TRL's trainer is built once (with `use_weighting=True`, so that its fused LM head also returns the
WPO statistic) and each case sets the attributes its `_compute_loss` reads (`loss_types`, `loss_weights`,
`label_smoothing`, `f_divergence_type`, `f_alpha_divergence_coef`, `ld_alpha`, `use_weighting`, `args.discopop_tau`):
TRL's loss code runs as written, only its constructor's checks are skipped. Ours gets a fresh `DPOConfig` per case,
so our checks run. Loss and the gradient of every policy parameter must agree to float32 error.
"""

import copy
import dataclasses
import logging

import pytest
import torch
import transformers
import trl
from datasets import Dataset
from trl.trainer.dpo_trainer import DPOConfig as TRLDPOConfig, DPOTrainer as TRLDPOTrainer

from instruct_goose import task_tokenizer, tiny_causal_lm
from instruct_goose.dpo import DPOConfig, DPOTrainer

assert trl.__version__ == "1.16.0", trl.__version__

PAIRS = [
    {"prompt": "Review: it was", "chosen": " a great film, warm and funny.", "rejected": " dull."},
    {
        "prompt": "Review: the plot",
        "chosen": " is fine.",
        "rejected": " drags on and on, and the cast looks bored.",
    },
    {"prompt": "Review: a", "chosen": " lovely, moving story.", "rejected": " mess."},
    {
        "prompt": "Review: this movie",
        "chosen": " made me smile all the way through.",
        "rejected": " is too long.",
    },
]

ALL_TYPES = [
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]
SMOOTHING = {"robust": 0.1, "aot": 0.1, "aot_unpaired": 0.1, "exo_pair": 1e-3}
CASES = {t: dict(loss_type=[t], label_smoothing=SMOOTHING.get(t, 0.0)) for t in ALL_TYPES}
CASES |= {
    "mpo": dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    "ipo+robust+aot": dict(
        loss_type=["ipo", "robust", "aot"], loss_weights=[0.5, 1.0, 2.0], label_smoothing=0.2
    ),
    "forward_kl": dict(f_divergence_type="forward_kl"),
    "js_divergence": dict(f_divergence_type="js_divergence", loss_type=["sigmoid_norm"]),
    "alpha_divergence": dict(
        f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3, loss_type=["hinge"]
    ),
    "ld_alpha": dict(ld_alpha=0.5, loss_type=["sigmoid", "sft"]),
    "use_weighting": dict(use_weighting=True, loss_type=["sigmoid", "bco_pair"]),
    "discopop_tau": dict(loss_type=["discopop"], discopop_tau=0.2),
    # ours only: the same numbers
    "activation_offloading": dict(activation_offloading=True, loss_type=["apo_down"]),
}


@pytest.fixture(scope="module")
def sides(tmp_path_factory):
    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    tok = task_tokenizer()
    policy, ref = tiny_causal_lm(tok, seed=0), tiny_causal_lm(tok, seed=1)
    data = Dataset.from_list(PAIRS)
    out = str(tmp_path_factory.mktemp("trl"))
    args = TRLDPOConfig(
        output_dir=out,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        beta=0.1,
        use_weighting=True,
        max_length=256,
        disable_dropout=True,
    )
    theirs = TRLDPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=args,
        train_dataset=data,
        processing_class=tok,
    )
    ours = DPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=DPOConfig(output_dir=out, max_prompt_length=None),
        processing_class=tok,
        train_dataset=data,
    )
    inputs = theirs.data_collator([theirs.train_dataset[i] for i in range(len(PAIRS))])
    batch, _ = ours.encode(ours.train_dataset[:])
    return theirs, ours, inputs, batch


def test_the_same_batch(sides):
    "TRL's collator and ours build the same token ids, attention mask and loss tokens."
    theirs, ours, inputs, batch = sides
    ids, mask, loss_mask, _ = batch
    assert torch.equal(inputs["input_ids"], ids) and torch.equal(inputs["attention_mask"], mask)
    assert torch.equal(inputs["completion_mask"][:, 1:].bool(), loss_mask[:, 1:])


def test_entropy_token_accuracy_and_num_tokens_are_trls(sides):
    """TRL's `entropy` (both completions), `mean_token_accuracy` (the chosen ones) and `num_tokens` after its
    loss on the batch are what our loss reports, on a policy fitted to the chosen completions so that some
    tokens are right."""
    theirs, ours, inputs, batch = sides
    ids, mask, loss_mask, _ = batch
    fitted = copy.deepcopy(ours.model)
    opt = torch.optim.Adam(fitted.parameters(), lr=3e-3)
    chosen = slice(0, len(PAIRS))
    # raise π(chosen): a share of its argmaxes become the labels
    for _ in range(6):
        opt.zero_grad()
        (-ours.score(fitted, ids[chosen], mask[chosen], loss_mask[chosen]).logps.sum()).backward()
        opt.step()
    settings = theirs.loss_types, theirs.loss_weights, theirs.use_weighting
    theirs.loss_types, theirs.loss_weights, theirs.use_weighting = ["sigmoid"], [1.0], False
    kept = copy.deepcopy(theirs.model.state_dict())
    # TRL's model carries its fused head: load the weights into it
    theirs.model.load_state_dict(fitted.state_dict())
    # TRL's mode is its own model's
    theirs._metrics["train"].clear()
    theirs._total_train_tokens = 0
    theirs.model.train()
    with torch.no_grad():
        theirs._compute_loss(theirs.model, inputs, return_outputs=False)
    theirs.loss_types, theirs.loss_weights, theirs.use_weighting = settings
    # the module's other tests compare from the shared weights
    theirs.model.load_state_dict(kept)
    our_policy = copy.deepcopy(fitted).train()
    ours.args = DPOConfig(output_dir=ours.args.output_dir, max_prompt_length=None)
    with torch.no_grad():
        _, stats = ours.pair_loss_sum(our_policy, batch)
    got = theirs._metrics["train"]
    # the test can tell right from wrong
    assert 0.2 < stats["mean_token_accuracy"].item() < 1.0, stats["mean_token_accuracy"]
    for name in ("entropy", "mean_token_accuracy"):
        assert stats[name].item() == pytest.approx(got[name][-1], rel=1e-5), (
            name,
            stats[name].item(),
            got[name][-1],
        )
    assert int(stats["num_tokens"]) == got["num_tokens"][-1] == int(inputs["attention_mask"].sum())


def _trl_loss(trainer, inputs, case):
    settings = {
        "loss_type": ["sigmoid"],
        "loss_weights": None,
        "label_smoothing": 0.0,
        "f_divergence_type": "reverse_kl",
        "f_alpha_divergence_coef": 0.5,
        "ld_alpha": None,
        "use_weighting": False,
        "discopop_tau": 0.05,
        **case,
    }
    trainer.loss_types, trainer.loss_weights = (
        settings["loss_type"],
        settings["loss_weights"] or [1.0] * len(settings["loss_type"]),
    )
    for name in (
        "label_smoothing",
        "f_divergence_type",
        "f_alpha_divergence_coef",
        "ld_alpha",
        "use_weighting",
    ):
        setattr(trainer, name, settings[name])
    trainer.args.discopop_tau = settings["discopop_tau"]
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def _our_loss(trainer, batch, case):
    trainer.args = DPOConfig(output_dir=trainer.args.output_dir, max_prompt_length=None, **case)
    trainer.model.zero_grad()
    loss_sum, _ = trainer.pair_loss_sum(trainer.model, batch)
    loss = loss_sum / len(PAIRS)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trl(sides, case):
    theirs, ours, inputs, batch = sides
    trl_loss, trl_grad = _trl_loss(theirs, inputs, CASES[case])
    our_loss, our_grad = _our_loss(ours, batch, CASES[case])
    assert our_loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-6), (case, our_loss, trl_loss)
    scale = max(g.abs().max().item() for g in trl_grad.values())
    worst = max((our_grad[n] - g).abs().max().item() for n, g in trl_grad.items())
    assert scale > 0 and worst <= 1e-5 * max(scale, 1.0), (case, worst, scale)
    print(
        f"{case}: loss {our_loss:.6f} vs {trl_loss:.6f}, |Δloss| {abs(our_loss - trl_loss):.2e}, max |Δgrad| "
        f"{worst:.2e} (max |grad| {scale:.2e})"
    )


@pytest.mark.parametrize("coef", [None, 0.5], ids=["config", "given"])
def test_moe_load_balancing_loss_equals_trl(tmp_path, coef):
    """A mixture-of-experts policy (tiny Qwen3-MoE): TRL's `_compute_loss` (DPO + c·L_aux of the policy's pass)
    and ours (`pair_loss_sum` / pairs + its c·L_aux term): the same loss, gradient and logged `aux_loss`."""
    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    tok = task_tokenizer()
    torch.manual_seed(0)
    policy = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        # a reference that differs, so the DPO loss is not log 2
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    data = Dataset.from_list(PAIRS)
    theirs = TRLDPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        train_dataset=data,
        processing_class=tok,
        args=TRLDPOConfig(
            output_dir=str(tmp_path),
            bf16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            report_to="none",
            beta=0.1,
            max_length=256,
            disable_dropout=True,
            router_aux_loss_coef=coef,
        ),
    )
    ours = DPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        train_dataset=data,
        processing_class=tok,
        args=DPOConfig(output_dir=str(tmp_path), max_prompt_length=None, router_aux_loss_coef=coef),
    )
    assert ours.router_aux_loss_coef == theirs.router_aux_loss_coef == (0.001 if coef is None else coef)
    inputs = theirs.data_collator([theirs.train_dataset[i] for i in range(len(PAIRS))])
    batch, _ = ours.encode(ours.train_dataset[:])
    theirs.model.train()
    ours.model.train()
    trl_loss = theirs._compute_loss(theirs.model, inputs, return_outputs=False)
    trl_loss.backward()
    loss_sum, stats, term = ours.pair_loss_sum(ours.model, batch)
    our_loss = loss_sum / len(PAIRS) + term
    our_loss.backward()
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5), (our_loss.item(), trl_loss.item())
    assert stats["aux_loss"].item() == pytest.approx(theirs._metrics["train"]["aux_loss"][-1], rel=1e-5)
    trl_grad = {n: p.grad for n, p in theirs.model.named_parameters() if p.grad is not None}
    our_grad = {n: p.grad for n, p in ours.model.named_parameters() if p.grad is not None}
    assert trl_grad.keys() == our_grad.keys()
    assert max((our_grad[n] - g).abs().max().item() for n, g in trl_grad.items()) < 1e-5


def test_padding_free_gives_trl_padded_losses(sides):
    """padding_free=True (one row, no pad token, a block-diagonal mask) gives TRL's padded loss and gradient (TRL
    1.16 itself falls back to padding)."""
    theirs, ours, inputs, batch = sides
    for case in (
        dict(loss_type=["sigmoid", "ipo"]),
        dict(loss_type=["nca_pair", "bco_pair"], use_weighting=True),
    ):
        trl_loss, trl_grad = _trl_loss(theirs, inputs, case)
        our_loss, our_grad = _our_loss(ours, batch, {**case, "padding_free": True})
        assert our_loss == pytest.approx(trl_loss, rel=1e-5), (case, our_loss, trl_loss)
        assert max((our_grad[n] - g).abs().max().item() for n, g in trl_grad.items()) < 1e-5


TRL_FIELDS = {f.name for f in dataclasses.fields(TRLDPOConfig)} - {
    f.name for f in dataclasses.fields(transformers.TrainingArguments)
}
# a value other than the default for every field TRL 1.16's DPOConfig adds (with the companions it needs)
NON_DEFAULT = {
    "model_init_kwargs": {"dtype": "float32"},
    "trust_remote_code": True,
    "router_aux_loss_coef": 0.01,
    "disable_dropout": False,
    "dataset_num_proc": 2,
    "max_length": 512,
    "truncation_mode": "keep_end",
    "padding_free": True,
    "pad_to_multiple_of": 8,
    "precompute_ref_log_probs": True,
    "precompute_ref_batch_size": 4,
    "loss_type": ["ipo"],
    "loss_weights": [0.5],
    "ld_alpha": 0.5,
    "f_divergence_type": "forward_kl",
    "f_alpha_divergence_coef": 0.3,
    "label_smoothing": {"label_smoothing": 0.1, "loss_type": ["robust"]},
    "beta": 0.2,
    "use_weighting": True,
    "discopop_tau": 0.1,
    "activation_offloading": True,
    "sync_ref_model": True,
    "ref_model_mixup_alpha": 0.5,
    "ref_model_sync_steps": 8,
    "pad_token": "<pad>",
}
REFUSED = {"pad_token"}


def test_every_field_trl_adds_is_taken_or_refused_by_name():
    """Each of the 25 fields TRL 1.16's DPOConfig adds to TrainingArguments: our DPOConfig takes it, or refuses
    it in one line naming it."""
    assert TRL_FIELDS == set(NON_DEFAULT), TRL_FIELDS ^ set(NON_DEFAULT)
    taken, refused = [], []
    for name, value in NON_DEFAULT.items():
        settings = value if isinstance(value, dict) and name in value else {name: value}
        try:
            config = DPOConfig(**settings)
        except ValueError as e:
            assert f"`{name}`" in str(e) and "\n" not in str(e), (name, str(e))
            refused.append(name)
            continue
        assert getattr(config, name) == settings[name], name
        taken.append(name)
    assert set(refused) == REFUSED, refused
    print(f"taken {len(taken)}, refused {len(refused)}: {refused}")


def test_evaluate_gives_trls_twelve_metrics_and_eval_prediction(tmp_path):
    """TRL 1.16's `DPOTrainer.evaluate()` and ours on the same policy, reference and pairs, in two batches of two
    (TRL's mean over batches is then ours over pairs): its 12 evaluation metrics to float32 error, and the
    `EvalPrediction` its `compute_metrics` receives (each batch's logits, chosen rows then rejected, and their
    input ids) the same arrays."""
    import numpy as np

    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    tok = task_tokenizer()
    policy, ref = tiny_causal_lm(tok, seed=0), tiny_causal_lm(tok, seed=1)
    data, seen = Dataset.from_list(PAIRS), {}
    metrics = lambda side: lambda p: seen.__setitem__(side, p) or {"my_metric": 0.5}
    args = TRLDPOConfig(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        max_length=256,
        per_device_eval_batch_size=2,
    )
    theirs = TRLDPOTrainer(
        copy.deepcopy(policy),
        ref_model=copy.deepcopy(ref),
        args=args,
        train_dataset=data,
        eval_dataset=data,
        processing_class=tok,
        compute_metrics=metrics("trl"),
    )
    ours = DPOTrainer(
        copy.deepcopy(policy),
        copy.deepcopy(ref),
        DPOConfig(output_dir=str(tmp_path / "ours"), max_length=256, per_device_eval_batch_size=2),
        tok,
        data,
        data,
        compute_metrics=metrics("ours"),
    )
    with pytest.warns(FutureWarning):  # TRL 1.16 deprecates the logits it passes to `compute_metrics`
        trl_metrics = theirs.evaluate()
    our_metrics = ours.evaluate()
    names = [
        k
        for k in trl_metrics
        if k not in ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")
    ]
    assert len(names) == 13 and set(names) == set(our_metrics), (names, sorted(our_metrics))
    for name in names:
        assert our_metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=1e-6), name
    # the policy differs from its reference: the rewards are not all 0
    assert abs(our_metrics["eval_rewards/margins"]) > 1e-3
    np.testing.assert_allclose(seen["ours"].predictions, seen["trl"].predictions, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(seen["ours"].label_ids, seen["trl"].label_ids)
