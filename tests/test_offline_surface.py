"""The offline trainers (SFT, reward, DPO) as TRL 1.16's users call them: 🤗's `evaluate(eval_dataset=...)` and a
dict of eval sets, `compute_metrics` with 🤗's `EvalPrediction`, SFT's `formatting_func`, TRL's tokenized rows, a
streaming `IterableDataset` with `max_steps`, and the tokenizer loaded from a model object's checkpoint.

Every expected number is computed here another way (by hand from the model's own outputs, or from the same rows
given as text); the comparisons with TRL itself are in test_sft_trl.py and test_dpo_trl.py.
"""

import warnings

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict
from transformers import AutoModelForCausalLM

from instruct_goose import (
    DPOConfig,
    DPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
    task_tokenizer,
    tiny_causal_lm,
)

TEXTS = [
    {"text": "Review: it was a great film, warm and funny."},
    {"text": "Review: the plot is fine."},
    {"text": "Review: a lovely, moving story."},
    {"text": "Review: this movie made me smile."},
]
PAIRS = [
    {"prompt": "Review: it was", "chosen": " a great film.", "rejected": " dull."},
    {"prompt": "Review: the plot", "chosen": " is fine.", "rejected": " drags on and on."},
    {"prompt": "Review: a", "chosen": " lovely story.", "rejected": " mess."},
    {"prompt": "Review: this movie", "chosen": " made me smile.", "rejected": " is too long."},
]


@pytest.fixture(scope="module")
def tok():
    return task_tokenizer()


def _sft(tok, tmp_path, data=TEXTS, eval_dataset=None, **options):
    config = SFTConfig(
        output_dir=str(tmp_path), disable_tqdm=True, report_to="none", save_strategy="no", **options
    )
    return SFTTrainer(tiny_causal_lm(tok, seed=0), config, data, eval_dataset, tok)


def _reward(tok, tmp_path, data=PAIRS, eval_dataset=None, **kwargs):
    config = RewardConfig(
        output_dir=str(tmp_path), disable_tqdm=True, report_to="none", save_strategy="no", normalize=False
    )
    return RewardTrainer(tiny_causal_lm(tok, seed=0), config, data, eval_dataset, tok, **kwargs)


def _dpo(tok, tmp_path, data=PAIRS, eval_dataset=None, **kwargs):
    config = DPOConfig(output_dir=str(tmp_path), disable_tqdm=True, report_to="none", save_strategy="no")
    return DPOTrainer(
        tiny_causal_lm(tok, seed=0), tiny_causal_lm(tok, seed=1), config, tok, data, eval_dataset, **kwargs
    )


# --- evaluate(eval_dataset=...), as 🤗's Trainer has it -------------------------------------------------------


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo"])
def test_evaluate_a_given_set_equals_the_held_one(tok, tmp_path, kind):
    "A set given to `evaluate` is prepared as the constructor prepares one: the same metrics as when held."
    make, data = {"sft": (_sft, TEXTS), "reward": (_reward, PAIRS), "dpo": (_dpo, PAIRS)}[kind]
    held = make(tok, tmp_path, data, data).evaluate()
    given = make(tok, tmp_path, data).evaluate(eval_dataset=data)
    assert given == held
    assert held["eval_loss"] > 0
    # 🤗's prefix
    prefixed = make(tok, tmp_path, data).evaluate(data, metric_key_prefix="test")
    assert prefixed == {k.replace("eval_", "test_", 1): v for k, v in held.items()}


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo"])
@pytest.mark.parametrize("form", ["dict", "DatasetDict", "streams"])
def test_a_dict_of_eval_sets_is_evaluated_set_by_set(tok, tmp_path, kind, form):
    """A dict of eval sets, at construction or given to `evaluate`: each set's metrics named `eval_<key>_<name>`,
    equal to that set evaluated alone (🤗's rule)."""
    make, data = {"sft": (_sft, TEXTS), "reward": (_reward, PAIRS), "dpo": (_dpo, PAIRS)}[kind]
    one, two = Dataset.from_list(data[:2]), Dataset.from_list(data[2:])
    sets = {"one": one, "two": two}
    if form == "DatasetDict":
        sets = DatasetDict(sets)
    if form == "streams":
        sets = {k: d.to_iterable_dataset() for k, d in sets.items()}
    alone = {k: make(tok, tmp_path, data).evaluate(eval_dataset=d) for k, d in (("one", one), ("two", two))}
    expected = {f"eval_{k}_{name[5:]}": v for k, m in alone.items() for name, v in m.items()}
    assert make(tok, tmp_path, data, sets).evaluate() == expected
    assert make(tok, tmp_path, data).evaluate(eval_dataset=sets) == expected
    # a key of the held dict: that set, under the prefix given (🤗 passes `eval_<key>` itself)
    assert make(tok, tmp_path, data, sets).evaluate("two") == alone["two"]


def test_a_dict_of_eval_sets_is_logged_while_training(tok, tmp_path):
    "Training with a dict of eval sets logs each set's metrics, and `metric_for_best_model` may name one."
    trainer = _sft(
        tok,
        tmp_path,
        TEXTS,
        {"one": TEXTS[:2], "two": TEXTS[2:]},
        max_steps=2,
        per_device_train_batch_size=2,
        eval_strategy="steps",
        eval_steps=1,
    )
    trainer.train()
    rows = [r for r in trainer.state.log_history if "eval_one_loss" in r]
    assert len(rows) == 2 and all("eval_two_loss" in r for r in rows)
    assert rows[-1]["eval_two_loss"] == pytest.approx(trainer.evaluate()["eval_two_loss"], rel=1e-6)


def test_evaluate_keeps_its_old_arguments_and_refuses_a_model_first(tok, tmp_path):
    trainer = _sft(tok, tmp_path, TEXTS, TEXTS)
    other = tiny_causal_lm(tok, seed=3)
    by_hand = trainer.eval_metrics(trainer.eval_dataset, other)["loss"]
    assert trainer.evaluate(model=other, dataset=TEXTS, batch_size=1)["eval_loss"] == pytest.approx(by_hand)
    with pytest.raises(TypeError, match="pass the model as `model=`"):
        trainer.evaluate(other)
    with pytest.raises(ValueError, match="leave it None"):
        trainer.evaluate(ignore_keys=["past_key_values"])


# --- compute_metrics, with 🤗's EvalPrediction ------------------------------------------------------------------


def test_sft_compute_metrics_gets_the_logits_and_labels(tok, tmp_path):
    """SFT's `EvalPrediction`: the model's logits at every position of each batch (concatenated, a narrower batch
    padded with -100) and labels the ids where the loss reads them, -100 elsewhere; its metrics join the
    evaluation's, prefixed."""
    seen = []
    trainer = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        SFTConfig(output_dir=str(tmp_path), per_device_eval_batch_size=3, report_to="none"),
        TEXTS,
        TEXTS,
        tok,
        compute_metrics=lambda p: seen.append(p) or {"rows": len(p.predictions)},
    )
    metrics = trainer.evaluate()
    assert metrics["eval_rows"] == 4
    (ids, mask, loss_mask), _ = trainer.encode(trainer.eval_dataset[:])
    with torch.no_grad():
        logits = trainer.model.eval()(input_ids=ids, attention_mask=mask).logits
    p = seen[0]
    width = p.predictions.shape[1]
    assert width == ids.shape[1]
    real = mask.bool().numpy()
    np.testing.assert_allclose(p.predictions[real], logits.numpy()[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(p.label_ids, torch.where(loss_mask, ids, -100).numpy())
    # `preprocess_logits_for_metrics`: each batch's predictions as it returns them
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)
    trainer.evaluate()
    assert seen[-1].predictions.shape == p.label_ids.shape


def test_reward_compute_metrics_gets_the_rewards(tok, tmp_path):
    """The reward trainer's `EvalPrediction` is TRL 1.16's: each batch's rewards, (2·batch, 1), chosen then
    rejected, and no labels."""
    seen = []
    trainer = _reward(tok, tmp_path, PAIRS, PAIRS, compute_metrics=lambda p: seen.append(p) or {"my": 0.5})
    trainer.args.per_device_eval_batch_size = 3
    metrics = trainer.evaluate()
    assert metrics["eval_my"] == 0.5
    with torch.no_grad():
        first, second = (
            trainer.pair_scores(trainer.reward_model.eval(), trainer.eval_dataset[:3]),
            trainer.pair_scores(trainer.reward_model, trainer.eval_dataset[3:]),
        )
    expected = torch.cat([*first, *second])[:, None].numpy()
    np.testing.assert_allclose(seen[0].predictions, expected, rtol=1e-6)
    assert seen[0].label_ids == ()


def test_reward_eval_metrics_are_trls_names_by_hand(tok, tmp_path):
    "TRL 1.16's reward eval names, from the rewards by hand (one batch: TRL's mean over batches is that batch's)."
    trainer = _reward(tok, tmp_path, PAIRS, PAIRS)
    metrics = trainer.evaluate()
    with torch.no_grad():
        chosen, rejected = trainer.pair_scores(trainer.reward_model.eval(), trainer.eval_dataset[:])
    both = torch.cat([chosen, rejected])
    by_hand = {
        "eval_loss": -torch.nn.functional.logsigmoid(chosen - rejected).mean().item(),
        "eval_accuracy": (chosen > rejected).float().mean().item(),
        "eval_margin": (chosen - rejected).mean().item(),
        "eval_min_reward": both.min().item(),
        "eval_mean_reward": both.mean().item(),
        "eval_max_reward": both.max().item(),
        "eval_num_tokens": 0.0,
    }
    assert metrics == pytest.approx(by_hand, rel=1e-6)


def test_dpo_compute_metrics_gets_the_logits_and_input_ids(tok, tmp_path):
    "DPO's `EvalPrediction` is TRL 1.16's: each batch's logits, chosen rows then rejected, and the input ids."
    seen = []
    trainer = _dpo(tok, tmp_path, PAIRS, PAIRS, compute_metrics=lambda p: seen.append(p) or {"my": 1.0})
    assert trainer.evaluate()["eval_my"] == 1.0
    (ids, mask, _, _), _ = trainer.encode(trainer.eval_dataset[:])
    with torch.no_grad():
        logits = trainer.model.eval()(input_ids=ids, attention_mask=mask).logits
    real = mask.bool().numpy()
    np.testing.assert_allclose(seen[0].predictions[real], logits.numpy()[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(seen[0].label_ids, ids.numpy())


def test_dpo_eval_metrics_are_trls_twelve(tok, tmp_path):
    "Evaluation logs the 12 names TRL 1.16's DPOTrainer logs (the numbers against TRL: test_dpo_trl.py)."
    names = {
        "eval_loss",
        "eval_entropy",
        "eval_num_tokens",
        "eval_logits/chosen",
        "eval_logits/rejected",
        "eval_mean_token_accuracy",
        "eval_rewards/chosen",
        "eval_rewards/rejected",
        "eval_rewards/accuracies",
        "eval_rewards/margins",
        "eval_logps/chosen",
        "eval_logps/rejected",
    }
    metrics = _dpo(tok, tmp_path, PAIRS, PAIRS).evaluate()
    assert set(metrics) == names
    # by hand: the implicit rewards are β·(log π − log π_ref) of each completion
    assert metrics["eval_rewards/margins"] == pytest.approx(
        metrics["eval_rewards/chosen"] - metrics["eval_rewards/rejected"], abs=1e-6
    )


# --- SFT's formatting_func and TRL's tokenized rows -------------------------------------------------------------


def test_formatting_func_trains_on_the_texts_it_makes(tok, tmp_path):
    "`formatting_func`'s texts are the rows: the same loss as those texts given as text rows."
    rows = [{"head": r["prompt"], "tail": r["chosen"]} for r in PAIRS]
    texts = [{"text": r["head"] + r["tail"]} for r in rows]
    formatted = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        SFTConfig(output_dir=str(tmp_path), report_to="none"),
        rows,
        rows,
        tok,
        formatting_func=lambda row: row["head"] + row["tail"],
    )
    assert formatted.train_dataset["text"] == [t["text"] for t in texts]
    assert formatted.evaluate() == _sft(tok, tmp_path, texts, texts).evaluate()
    with pytest.raises(ValueError, match="must return one text"):
        SFTTrainer(
            tiny_causal_lm(tok),
            SFTConfig(output_dir=str(tmp_path)),
            rows,
            None,
            tok,
            formatting_func=lambda r: [1],
        )
    with pytest.raises(ValueError, match="set `completion_only_loss` to None"):
        SFTTrainer(
            tiny_causal_lm(tok),
            SFTConfig(output_dir=str(tmp_path), completion_only_loss=True),
            rows,
            None,
            tok,
            formatting_func=lambda r: r["head"],
        )


def test_tokenized_sft_rows_are_read_as_trl_reads_them(tok, tmp_path):
    """TRL's tokenized rows: `input_ids` alone is the whole row's loss; `labels` (-100: none) or
    `completion_mask` (with completion_only_loss=True) put it where they say: the same numbers as the text rows
    that tokenize to them (the prompt-completion rows' loss on the completion and EOS)."""
    text_trainer = _sft(tok, tmp_path, [{"prompt": r["prompt"], "completion": r["chosen"]} for r in PAIRS])
    (ids, mask, loss_mask), n = text_trainer.encode(text_trainer.train_dataset[:])
    rows = [
        {"input_ids": i[m.bool()].tolist(), "completion_mask": lm[m.bool()].int().tolist()}
        for i, m, lm in zip(ids, mask, loss_mask)
    ]
    labelled = [
        {
            "input_ids": r["input_ids"],
            "labels": [t if c else -100 for t, c in zip(r["input_ids"], r["completion_mask"])],
        }
        for r in rows
    ]
    expected = text_trainer.evaluate(eval_dataset=text_trainer.train_dataset)
    for data, options in ((rows, {"completion_only_loss": True}), (labelled, {})):
        trainer = _sft(tok, tmp_path, data, **options)
        (t_ids, t_mask, t_loss), t_n = trainer.encode(trainer.train_dataset[:])
        assert torch.equal(t_ids, ids) and torch.equal(t_mask, mask) and torch.equal(t_loss, loss_mask)
        assert trainer.evaluate(eval_dataset=data) == expected
    # without a mask: every token but the first
    whole = _sft(tok, tmp_path, [{"input_ids": r["input_ids"]} for r in rows])
    (_, w_mask, w_loss), w_n = whole.encode(whole.train_dataset[:])
    assert w_n == int(w_mask.sum()) - len(rows)
    # a row left without a loss token within max_length is left out, with a warning
    first = [r["completion_mask"].index(1) for r in rows]
    cut = max(first)
    with pytest.warns(
        UserWarning, match=f"{first.count(cut)} of 4 rows have no loss token within max_length"
    ):
        short = _sft(tok, tmp_path, rows, completion_only_loss=True, max_length=cut)
    assert len(short.train_dataset) == 4 - first.count(cut)


def test_tokenized_reward_pairs_score_as_their_text(tok, tmp_path):
    """TRL's tokenized pairs (`chosen_ids`, `rejected_ids`; the old `chosen_input_ids` with TRL's FutureWarning)
    give the numbers of the text pairs they tokenize."""
    text = [{"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in PAIRS]
    ids = [{f"{c}_ids": tok(r[c]).input_ids for c in ("chosen", "rejected")} for r in text]
    old = [{f"{c}_input_ids": r[f"{c}_ids"] for c in ("chosen", "rejected")} for r in ids]
    expected = _reward(tok, tmp_path, PAIRS, PAIRS).evaluate()
    assert _reward(tok, tmp_path, ids, ids).evaluate() == pytest.approx(expected, rel=1e-6)
    with pytest.warns(FutureWarning, match="will not be supported in v1"):
        renamed = _reward(tok, tmp_path, old, old)
    assert set(renamed.train_dataset.column_names) == {"chosen_ids", "rejected_ids"}
    assert renamed.evaluate() == pytest.approx(expected, rel=1e-6)
    # longer than max_length: left out, as TRL filters them
    longest = [max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in ids]
    limit = sorted(longest)[1]
    with pytest.warns(UserWarning, match="longer than max_length"):
        cut = RewardTrainer(
            tiny_causal_lm(tok, seed=0),
            RewardConfig(output_dir=str(tmp_path), max_length=limit),
            ids,
            None,
            tok,
        )
    assert len(cut.train_dataset) == sum(n <= limit for n in longest) < 4


# --- a streaming IterableDataset with max_steps -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo"])
def test_a_stream_trains_with_max_steps(tok, tmp_path, kind):
    """An `IterableDataset` is read for `max_steps` steps' rows and trained on as the same rows given as a list:
    the same logged losses; without `max_steps` it is refused by name."""
    data = {"sft": TEXTS, "reward": PAIRS, "dpo": PAIRS}[kind]
    losses = []
    for given in (data, Dataset.from_list(data).to_iterable_dataset()):
        config_class = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig}[kind]
        config = config_class(
            output_dir=str(tmp_path / str(len(losses))),
            max_steps=3,
            per_device_train_batch_size=2,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
        )
        model = tiny_causal_lm(tok, seed=0)
        trainer = (
            SFTTrainer(model, config, given, processing_class=tok)
            if kind == "sft"
            else RewardTrainer(model, config, given, processing_class=tok)
            if kind == "reward"
            else DPOTrainer(model, None, config, tok, given)
        )
        trainer.train()
        losses.append([r["loss"] for r in trainer.state.log_history if "loss" in r])
    assert losses[0] == losses[1] and len(losses[0]) == 3
    config = SFTConfig(output_dir=str(tmp_path / "none"))
    with pytest.raises(ValueError, match="set `max_steps`"):
        SFTTrainer(
            tiny_causal_lm(tok), config, Dataset.from_list(TEXTS).to_iterable_dataset(), processing_class=tok
        )


# --- the tokenizer of a model object's checkpoint ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sft", "reward", "dpo"])
def test_a_model_object_brings_its_checkpoints_tokenizer(tok, tmp_path, kind):
    "No `processing_class`: the tokenizer saved beside the checkpoint the model was loaded from (TRL's rule)."
    tiny_causal_lm(tok, seed=0).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    config = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig}[kind](
        output_dir=str(tmp_path / "o")
    )
    data = TEXTS if kind == "sft" else PAIRS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = {"sft": SFTTrainer, "reward": RewardTrainer, "dpo": DPOTrainer}[kind](
            model, args=config, train_dataset=data
        )
    assert trainer.processing_class.get_vocab() == tok.get_vocab()
    # a model built from a config names no checkpoint: the tokenizer is asked for
    with pytest.raises(ValueError, match="names no checkpoint"):
        {"sft": SFTTrainer, "reward": RewardTrainer, "dpo": DPOTrainer}[kind](
            tiny_causal_lm(tok, seed=0), args=config, train_dataset=data
        )
