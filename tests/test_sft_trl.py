"""SFT and reward-model options against TRL 1.16 by number, and every field TRL's `SFTConfig` and `RewardConfig` add to
🤗's `TrainingArguments` taken or refused by name.

SFT: the same tiny GPT-2 on both sides (two copies of one set of weights), prompt-completion rows of different lengths.
TRL's `SFTTrainer` collates the rows and its `compute_loss` runs as written; ours encodes the same rows and `nll_sum`
sums the same loss. Each case sets the config fields both read (`loss_type`, `completion_only_loss`); the loss and the
gradient of every parameter must agree to float32 error. Packing: `best_fit_bins` against TRL's own `pack_dataset`.
"""

import copy
import dataclasses
import logging

import pytest
import torch
import transformers
import trl
from datasets import Dataset
from trl import RewardConfig as TRLRewardConfig, SFTConfig as TRLSFTConfig, SFTTrainer as TRLSFTTrainer
from trl.data_utils import pack_dataset

from instruct_goose import (
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
    chat_task_tokenizer,
    router_aux_losses,
    task_tokenizer,
    tiny_causal_lm,
)
from instruct_goose.sft import best_fit_bins
from instruct_goose.agent import Plan

assert trl.__version__ == "1.16.0", trl.__version__

ROWS = [
    {"prompt": "Review: it was", "completion": " a great film, warm and funny."},
    {"prompt": "Review: the plot", "completion": " is fine."},
    {"prompt": "Review: a", "completion": " lovely, moving story with a cast that looks happy to be there."},
    {"prompt": "Review: this movie", "completion": " made me smile."},
]


def _sides(tmp_path, model=None, **options):
    """TRL's trainer and ours on the same weights (`model`, else a new tiny GPT-2) and rows, with the same
    options; TRL's collated batch and ours."""
    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    tok = task_tokenizer()
    model = tiny_causal_lm(tok, seed=0) if model is None else model
    for m in model.modules():  # dropout would draw differently on the two sides
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    data = Dataset.from_list(ROWS)
    args = TRLSFTConfig(
        output_dir=str(tmp_path),
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        max_length=64,
        **options,
    )
    theirs = TRLSFTTrainer(copy.deepcopy(model), args=args, train_dataset=data, processing_class=tok)
    ours = SFTTrainer(
        copy.deepcopy(model),
        SFTConfig(output_dir=str(tmp_path), max_length=64, **options),
        data,
        processing_class=tok,
    )
    inputs = theirs.data_collator([theirs.train_dataset[i] for i in range(len(ROWS))])
    batch, n_tokens = ours.encode(ours.train_dataset[:])
    return theirs, ours, inputs, batch, n_tokens


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"loss_type": "dft"},
        {"completion_only_loss": False},
        {"completion_only_loss": False, "loss_type": "dft"},
    ],
    ids=["nll", "dft", "whole_sequence", "whole_sequence_dft"],
)
def test_loss_and_gradient_equal_trl(tmp_path, options):
    """TRL's `compute_loss` and our `nll_sum` / (its loss tokens) on the same rows: the same tokens, loss and
    gradient."""
    theirs, ours, inputs, batch, n_tokens = _sides(tmp_path, **options)
    ids, mask, loss_mask = batch
    assert torch.equal(inputs["input_ids"], ids) and torch.equal(inputs["attention_mask"], mask)
    # the tokens predicted (none predicts the first)
    assert torch.equal(inputs["labels"][:, 1:] != -100, loss_mask[:, 1:]) and not loss_mask[:, 0].any()
    theirs.model.zero_grad()
    trl_loss = theirs.compute_loss(theirs.model, inputs)
    trl_loss.backward()
    ours.model.zero_grad()
    our_loss = ours.nll_sum(ours.model, batch) / n_tokens
    our_loss.backward()
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5), (
        options,
        our_loss.item(),
        trl_loss.item(),
    )
    trl_grad, our_grad = _grads(theirs.model), _grads(ours.model)
    scale = max(g.abs().max().item() for g in trl_grad.values())
    worst = max((our_grad[n] - g).abs().max().item() for n, g in trl_grad.items())
    assert worst <= 1e-5 * max(scale, 1.0), (options, worst, scale)


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_entropy_and_token_accuracy_equal_trl(tmp_path, padding_free):
    """TRL's logged `entropy` and `mean_token_accuracy` after its `compute_loss`, train and eval, are ours
    (`nll_sum(stats=True)`, `evaluate`), on a model fitted to the rows so that some tokens are right."""
    _, ours, _, batch, n_tokens = _sides(tmp_path)
    model = ours.model
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    # fit the rows: a share of the argmaxes become the labels
    for _ in range(15):
        opt.zero_grad()
        (ours.nll_sum(model, batch) / n_tokens).backward()
        opt.step()
    theirs, ours, inputs, batch, n_tokens = _sides(tmp_path, copy.deepcopy(model))
    _, stats = ours.nll_sum(ours.model, batch, Plan(padding_free=padding_free), stats=True)
    # neither none nor all: the test can tell
    assert 0.2 < stats["mean_token_accuracy"].item() < 1.0, stats
    for mode in ("train", "eval"):
        getattr(theirs.model, mode)()
        with torch.no_grad():
            theirs.compute_loss(theirs.model, inputs)
        for name in ("entropy", "mean_token_accuracy"):
            assert stats[name].item() == pytest.approx(theirs._metrics[mode][name][-1], rel=1e-5), (
                mode,
                name,
            )
    # TRL's running count after one batch
    assert theirs._metrics["train"]["num_tokens"][-1] == int(inputs["attention_mask"].sum())
    ours.eval_dataset = ours.train_dataset
    # one batch: TRL's eval metric is that batch's mean
    evaluated = ours.evaluate(batch_size=len(ROWS))
    for name in ("entropy", "mean_token_accuracy"):
        assert evaluated[f"eval_{name}"] == pytest.approx(theirs._metrics["eval"][name][-1], rel=1e-5), name


def tiny_moe(tokenizer):
    "A tiny Qwen3-MoE (4 experts, top 2): a mixture-of-experts model whose config has `output_router_logits`."
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )


@pytest.mark.parametrize("coef", [None, 0.5, 0.0], ids=["config", "given", "off"])
def test_moe_load_balancing_loss_equals_trl(tmp_path, coef):
    """A mixture-of-experts model: TRL's `compute_loss` (NLL + c·L_aux, c by its rule) and ours (`nll_sum` /
    tokens + c·L_aux of `router_aux_losses`): the same loss, gradient and logged `aux_loss`."""
    theirs, ours, inputs, batch, n_tokens = _sides(
        tmp_path, tiny_moe(task_tokenizer()), router_aux_loss_coef=coef
    )
    assert ours.router_aux_loss_coef == theirs.router_aux_loss_coef == {None: 0.001, 0.5: 0.5, 0.0: 0.0}[coef]
    theirs.model.train()
    ours.model.train()
    trl_loss = theirs.compute_loss(theirs.model, inputs)
    trl_loss.backward()
    with router_aux_losses(ours.model, ours.router_aux_loss_coef > 0) as aux:
        our_loss = ours.nll_sum(ours.model, batch) / n_tokens
    assert len(aux) == (coef != 0.0)
    if aux:
        our_loss = our_loss + ours.router_aux_loss_coef * aux[0]
    our_loss.backward()
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5), (our_loss.item(), trl_loss.item())
    if aux:
        assert aux[0].item() == pytest.approx(theirs._metrics["train"]["aux_loss"][-1], rel=1e-5)
    else:
        assert "aux_loss" not in theirs._metrics["train"]
    trl_grad, our_grad = _grads(theirs.model), _grads(ours.model)
    assert trl_grad.keys() == our_grad.keys()
    assert max((our_grad[n] - g).abs().max().item() for n, g in trl_grad.items()) < 1e-5


def test_padding_free_gives_trl_padded_loss(tmp_path):
    """`padding_free=True` (sequences end to end in bins, a block-diagonal mask) gives TRL's padded loss and
    gradient."""
    theirs, ours, inputs, batch, n_tokens = _sides(tmp_path)
    trl_loss = theirs.compute_loss(theirs.model, inputs)
    trl_loss.backward()
    our_loss = ours.nll_sum(ours.model, batch, Plan(padding_free=True)) / n_tokens
    our_loss.backward()
    assert our_loss.item() == pytest.approx(trl_loss.item(), rel=1e-5)
    trl_grad, our_grad = _grads(theirs.model), _grads(ours.model)
    assert max((our_grad[n] - g).abs().max().item() for n, g in trl_grad.items()) < 1e-5


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_bins_are_trls(seed):
    """`best_fit_bins` groups sequences as TRL 1.16's `pack_dataset(strategy='bfd')` does: the same bins, in the
    same order."""
    g = torch.Generator().manual_seed(seed)
    # ties, full bins and the smallest
    lengths = torch.randint(1, 48, (300,), generator=g).tolist() + [48, 48, 1, 1]
    data = Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
    packed = pack_dataset(data, seq_length=48, strategy="bfd", map_kwargs={"batch_size": len(lengths)})
    theirs = [
        [row[0] for row in _split(ids, sizes)]
        for ids, sizes in zip(packed["input_ids"], packed["seq_lengths"])
    ]
    assert best_fit_bins(lengths, 48) == theirs


def _split(ids, sizes):
    out, start = [], 0
    for n in sizes:
        out.append(ids[start : start + n])
        start += n
    return out


def _walk(ours_class, theirs_class, non_default, refused):
    fields = {f.name for f in dataclasses.fields(theirs_class)} - {
        f.name for f in dataclasses.fields(transformers.TrainingArguments)
    }
    assert fields == set(non_default), fields ^ set(non_default)
    got = []
    for name, value in non_default.items():
        try:
            config = ours_class(**{name: value})
        except ValueError as e:
            assert f"`{name}`" in str(e) and "\n" not in str(e), (name, str(e))
            got.append(name)
            continue
        assert getattr(config, name) == value, name
    assert set(got) == refused, got


def test_every_sft_field_trl_adds_is_taken_or_refused_by_name():
    """Each field TRL 1.16's SFTConfig adds to TrainingArguments: our SFTConfig takes it, or refuses it in one
    line naming it."""
    _walk(
        SFTConfig,
        TRLSFTConfig,
        {
            "model_init_kwargs": {"dtype": "float32"},
            "trust_remote_code": True,
            "router_aux_loss_coef": 0.01,
            "chat_template_path": "chat.jinja",
            "dataset_text_field": "content",
            "dataset_kwargs": {"skip_prepare_dataset": True},
            "dataset_num_proc": 2,
            "eos_token": "<|im_end|>",
            "max_length": 512,
            "truncation_mode": "keep_end",
            "shuffle_dataset": True,
            "packing": True,
            "packing_strategy": "wrapped",
            "padding_free": True,
            "pad_to_multiple_of": 8,
            "eval_packing": False,
            "completion_only_loss": False,
            "assistant_only_loss": False,
            "loss_type": "dft",
            "activation_offloading": True,
            "pad_token": "<pad>",
        },
        {"dataset_num_proc", "truncation_mode", "packing_strategy", "pad_token"},
    )


def test_every_reward_field_trl_adds_is_taken_or_refused_by_name():
    """Each field TRL 1.16's RewardConfig adds to TrainingArguments: our RewardConfig takes it, or refuses it in
    one line naming it."""
    _walk(
        RewardConfig,
        TRLRewardConfig,
        {
            "model_init_kwargs": {"dtype": "float32"},
            "trust_remote_code": True,
            "chat_template_path": "chat.jinja",
            "disable_dropout": False,
            "dataset_num_proc": 2,
            "eos_token": "<eos>",
            "max_length": 512,
            "pad_to_multiple_of": 8,
            "center_rewards_coefficient": 0.01,
            "activation_offloading": True,
            "pad_token": "<pad>",
        },
        {"dataset_num_proc", "eos_token", "pad_token"},
    )


def test_num_tokens_is_trls(tmp_path):
    """One training step over all the rows: our logged `num_tokens` is TRL's count after its loss on the same
    rows."""
    theirs, ours, inputs, batch, _ = _sides(tmp_path)
    theirs.model.train()
    with torch.no_grad():
        theirs.compute_loss(theirs.model, inputs)
    (
        ours.args.per_device_train_batch_size,
        ours.args.max_steps,
        ours.args.logging_steps,
        ours.args.save_strategy,
    ) = len(ROWS), 1, 1, "no"
    ours.train()
    assert (
        ours.loop.state.history[0]["num_tokens"]
        == theirs._metrics["train"]["num_tokens"][-1]
        == int(batch[1].sum())
    )


def test_a_batch_without_loss_tokens_logs_zero(tmp_path):
    """TRL logs 0 for the entropy and accuracy of a batch without loss tokens; ours too, not NaN (a mean over
    nothing)."""
    _, ours, _, batch, _ = _sides(tmp_path)
    ids, mask, loss_mask = batch
    loss, stats = ours.nll_sum(ours.model, (ids, mask, torch.zeros_like(loss_mask)), stats=True)
    assert loss.item() == 0 and {k: v.item() for k, v in stats.items()} == {
        "entropy": 0.0,
        "mean_token_accuracy": 0.0,
    }


def _trl_packed_bins(tmp_path, rows, **options):
    """TRL 1.16's packed training set as bins of row token ids (`seq_lengths` splits each example), sorted: TRL
    shuffles the bins again after packing."""
    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    tok = task_tokenizer()
    args = TRLSFTConfig(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", packing=True, **options
    )
    packed = TRLSFTTrainer(
        tiny_causal_lm(tok, seed=0), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    ).train_dataset
    return sorted(
        [
            tuple(map(tuple, _split(ids, sizes)))
            for ids, sizes in zip(packed["input_ids"], packed["seq_lengths"])
        ]
    )


def _our_packed_bins(tmp_path, rows, **options):
    tok = task_tokenizer()
    ours = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        SFTConfig(output_dir=str(tmp_path), packing=True, **options),
        rows,
        processing_class=tok,
    )
    (ids, mask, _), _ = ours.encode(ours.train_dataset[:])
    row_ids = [tuple(r[m.bool()].tolist()) for r, m in zip(ids, mask)]
    return sorted([tuple(row_ids[i] for i in b) for b in ours.pack(ours.train_dataset)])


def test_shuffled_packing_is_trls(tmp_path):
    """`shuffle_dataset=True` with `packing`: the rows shuffled with `seed` before best-fit decreasing, so the
    bins hold TRL 1.16's rows (ties in length fall otherwise)."""
    words = ["good", "bad", "fine", "dull", "warm", "slow"]
    rows = [
        {
            "prompt": "Review:",
            "completion": " " + " ".join(words[(i + k) % 6] for k in range(1 + i % 3)) + ".",
        }
        for i in range(40)
    ]
    for seed in (0, 1):
        theirs = _trl_packed_bins(tmp_path, rows, max_length=24, shuffle_dataset=True, seed=seed)
        assert _our_packed_bins(tmp_path, rows, max_length=24, shuffle_dataset=True, seed=seed) == theirs, (
            seed
        )
    assert _our_packed_bins(tmp_path, rows, max_length=24) == _trl_packed_bins(tmp_path, rows, max_length=24)
    # the test can tell: unshuffled rows fall otherwise
    assert _our_packed_bins(tmp_path, rows, max_length=24) != theirs


def _reward_sides(tmp_path, pairs, tok, max_length):
    """TRL 1.16's RewardTrainer and ours on the same pairs: the token ids of each kept pair's chosen and rejected
    as TRL counts them."""
    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    model_dir = tmp_path / "lm"
    tiny_causal_lm(tok, seed=0).save_pretrained(model_dir)
    args = trl.RewardConfig(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_length=max_length
    )
    kept = trl.RewardTrainer(
        str(model_dir), args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok
    ).train_dataset
    theirs = [(tuple(c), tuple(r)) for c, r in zip(kept["chosen_ids"], kept["rejected_ids"])]
    with pytest.warns(UserWarning, match="pairs have a chosen or rejected text longer than max_length"):
        ours = RewardTrainer(
            tiny_causal_lm(tok, seed=0),
            RewardConfig(output_dir=str(tmp_path), max_length=max_length),
            processing_class=tok,
            train_dataset=pairs,
        ).train_dataset
    return theirs, ours


@pytest.mark.parametrize("prompt", [None, "Review:"], ids=["implicit_prompt", "explicit_prompt"])
def test_reward_pairs_kept_are_trls_text(tmp_path, prompt):
    """TRL 1.16 leaves out a text pair whose prompt + chosen or prompt + rejected, with the EOS it appends, is
    longer than `max_length`: ours keeps the same pairs, at the boundary too."""
    tok = task_tokenizer()
    n = lambda text: len(tok(text + tok.eos_token).input_ids)
    base = "Review: it was a fine film"
    # " film" is one token: lengths rise one at a time
    texts = [base + "." + " film" * k for k in range(6)]
    # texts[3] fits exactly, texts[4] only without TRL's EOS
    limit = n(texts[3])
    assert [n(t) - limit for t in texts] == [-3, -2, -1, 0, 1, 2]
    pairs = [
        {"chosen": texts[i], "rejected": texts[j]}
        for i, j in ((0, 1), (3, 2), (4, 0), (1, 5), (2, 3), (3, 4))
    ]
    if prompt:
        pairs = [
            {"prompt": prompt, "chosen": p["chosen"][len(prompt) :], "rejected": p["rejected"][len(prompt) :]}
            for p in pairs
        ]
    theirs, ours = _reward_sides(tmp_path, pairs, tok, limit)
    assert len(theirs) == len(ours) == 3, (len(theirs), len(ours))
    eos = tok.eos_token
    counted = [
        (tuple(tok(p + c + eos).input_ids), tuple(tok(p + r + eos).input_ids))
        for p, c, r in zip(ours["prompt"], ours["chosen"], ours["rejected"])
    ]
    assert counted == theirs


def test_reward_pairs_kept_are_trls_chat(tmp_path):
    "Conversational pairs: TRL counts the chat template's tokens, no EOS appended; ours keeps the same pairs."
    tok = chat_task_tokenizer()
    turn = lambda text: [{"role": "assistant", "content": text}]
    prompt = [{"role": "user", "content": "Review: it was"}]
    replies = [" a fine film." + " film" * k for k in range(6)]
    lengths = [
        len(tok.apply_chat_template(prompt + turn(r), tokenize=True, return_dict=True)["input_ids"])
        for r in replies
    ]
    pairs = [
        {"prompt": prompt, "chosen": turn(replies[i]), "rejected": turn(replies[j])}
        for i, j in ((0, 1), (3, 2), (4, 0), (1, 5))
    ]
    theirs, ours = _reward_sides(tmp_path, pairs, tok, lengths[3])
    assert len(theirs) == len(ours) == 2, (len(theirs), len(ours))
    assert [len(c) for c, _ in theirs] == [lengths[0], lengths[3]]
    assert [len(tok(p + c).input_ids) for p, c in zip(ours["prompt"], ours["chosen"])] == [
        lengths[0],
        lengths[3],
    ]


@pytest.mark.parametrize("name", ["SFTConfig", "RewardConfig", "DPOConfig"])
def test_trl_defaults_pad_auto_and_max_length_none_are_taken(tmp_path, name):
    """TRL 1.16's `pad_to_multiple_of` default ("auto": no padding off Neuron) and `max_length=None` (no limit):
    each supervised config takes them with TRL's meaning."""
    from instruct_goose import DPOConfig

    ours_class = {"SFTConfig": SFTConfig, "RewardConfig": RewardConfig, "DPOConfig": DPOConfig}[name]
    theirs = getattr(trl, name)(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", bf16=False, max_length=None
    )
    # TRL's default
    assert {f.name: f.default for f in dataclasses.fields(getattr(trl, name))}["pad_to_multiple_of"] == "auto"
    ours = ours_class(output_dir=str(tmp_path), pad_to_multiple_of="auto", max_length=None)
    assert (
        (ours.pad_to_multiple_of, ours.max_length)
        == (theirs.pad_to_multiple_of, theirs.max_length)
        == (None, None)
    )


# ChatML (`CHATML_TEMPLATE`, the same text) with TRL's `{% generation %}` markers around each assistant turn
# and its end:
# TRL 1.16's `assistant_only_loss` reads its mask from them; ours finds the same turns by rendering
# (`chat_spans`).
GENERATION_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif "
    "%}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_user, _assistant = (
    (lambda text: {"role": "user", "content": text}),
    (lambda text: {"role": "assistant", "content": text}),
)
# TRL's four SFT row formats; the conversations have an assistant turn before the last, so the options differ
SFT_FORMS = {
    "text": [{"text": "Review: it was a great film."}, {"text": "Review: the plot is fine."}],
    "prompt_completion": [
        {"prompt": "Review: it was", "completion": " a great film."},
        {"prompt": "Review: the plot", "completion": " is fine."},
    ],
    "chat_prompt_completion": [
        {
            "prompt": [_user("Review: it"), _assistant("was good."), _user("And the plot?")],
            "completion": [_assistant("It is fine.")],
        },
        {"prompt": [_user("Review: the film")], "completion": [_assistant("made me smile.")]},
    ],
    "messages": [
        {
            "messages": [
                _user("Review: it"),
                _assistant("was good."),
                _user("And the plot?"),
                _assistant("It is fine."),
            ]
        },
        {"messages": [_user("Review: the film"), _assistant("made me smile.")]},
    ],
}
_UNSET = object()


@pytest.mark.parametrize(
    "assistant_only", [_UNSET, True, False], ids=["aol_default", "aol_true", "aol_false"]
)
@pytest.mark.parametrize(
    "completion_only", [_UNSET, True, False], ids=["col_default", "col_true", "col_false"]
)
@pytest.mark.parametrize("form", list(SFT_FORMS))
def test_loss_tokens_are_trls(tmp_path, form, completion_only, assistant_only):
    """Each data format × `completion_only_loss` × `assistant_only_loss` (given or left at the default): the
    tokens our loss averages over are those TRL 1.16's labels keep (!= -100), or both refuse."""
    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    rows, chat = SFT_FORMS[form], form in ("chat_prompt_completion", "messages")
    tok = chat_task_tokenizer() if chat else task_tokenizer()
    if chat:
        tok.chat_template = GENERATION_CHATML
    options = {
        k: v
        for k, v in (("completion_only_loss", completion_only), ("assistant_only_loss", assistant_only))
        if v is not _UNSET
    }
    model = tiny_causal_lm(tok, seed=0)
    args = TRLSFTConfig(
        output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_length=64, **options
    )
    make_ours = lambda: SFTTrainer(
        copy.deepcopy(model),
        SFTConfig(output_dir=str(tmp_path), max_length=64, **options),
        rows,
        processing_class=tok,
    )
    # TRL: "the dataset is not conversational"
    if options.get("assistant_only_loss") and not chat:
        with pytest.raises(ValueError, match="not conversational"):
            TRLSFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
        with pytest.raises(ValueError, match="`assistant_only_loss=True` needs conversations"):
            make_ours()
        return
    theirs = TRLSFTTrainer(
        copy.deepcopy(model), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    inputs = theirs.data_collator([theirs.train_dataset[i] for i in range(len(rows))])
    ours = make_ours()
    (ids, mask, loss_mask), n_tokens = ours.encode(ours.train_dataset[:])
    assert torch.equal(ids, inputs["input_ids"]) and torch.equal(mask, inputs["attention_mask"])
    # the tokens TRL's shifted loss predicts
    trl_tokens = inputs["labels"][:, 1:] != -100
    assert torch.equal(loss_mask[:, 1:], trl_tokens) and not loss_mask[:, 0].any(), (
        form,
        options,
        n_tokens,
        int(trl_tokens.sum()),
    )
    assert n_tokens == int(trl_tokens.sum())


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_reward_margin_is_trls(tmp_path, chat):
    """A `margin` column, with `center_rewards_coefficient`: TRL 1.16's `compute_loss` is −mean log σ(r_c − r_r −
    m) + c·mean((r_c + r_r)²) on its rewards, and our first step's logged loss is that formula on ours, the
    logged `margin` TRL's mean r_c − r_r."""
    from instruct_goose import load_task

    logging.getLogger("trl").setLevel(logging.ERROR)
    transformers.utils.logging.set_verbosity_error()
    tok = chat_task_tokenizer() if chat else task_tokenizer()
    margins, c = [0.5, 2.0, 0.0, 1.5], 0.1
    pairs = [
        {**p, "margin": m} for p, m in zip(load_task("preferences", chat=chat).select(range(4)), margins)
    ]
    model_dir = tmp_path / "lm"
    tiny_causal_lm(tok, seed=0).save_pretrained(model_dir)
    by_hand = lambda r_c, r_r: (
        -torch.nn.functional.logsigmoid(r_c - r_r - torch.tensor(margins)).mean()
        + c * ((r_c + r_r) ** 2).mean()
    ).item()
    args = trl.RewardConfig(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        center_rewards_coefficient=c,
    )
    theirs = trl.RewardTrainer(
        str(model_dir), args=args, train_dataset=Dataset.from_list(pairs), processing_class=tok
    )
    inputs = theirs.data_collator([theirs.train_dataset[i] for i in range(4)])
    assert inputs["margin"].tolist() == margins
    theirs.model.eval()
    with torch.no_grad():
        trl_loss, out = theirs.compute_loss(theirs.model, inputs, return_outputs=True)
    # TRL's formula
    assert trl_loss.item() == pytest.approx(by_hand(*out.logits.squeeze(-1).chunk(2)), rel=1e-6)
    config = RewardConfig(
        output_dir=str(tmp_path / "ours"),
        per_device_train_batch_size=4,
        max_steps=1,
        center_rewards_coefficient=c,
        save_strategy="no",
        disable_tqdm=True,
        normalize=False,
    )
    ours = RewardTrainer(tiny_causal_lm(tok, seed=0), config, pairs, processing_class=tok)
    # kept through `preference_dataset`
    assert ours.train_dataset["margin"] == margins
    with torch.no_grad():
        r_c, r_r = ours.pair_scores(ours.reward_model.eval(), ours.train_dataset[:])
    ours.train()
    logged = ours.loop.state.history[0]
    assert logged["loss"] == pytest.approx(by_hand(r_c, r_r), rel=1e-5), (logged["loss"], by_hand(r_c, r_r))
    assert logged["margin"] == pytest.approx((r_c - r_r).mean().item(), rel=1e-5)
    without = (-torch.nn.functional.logsigmoid(r_c - r_r).mean() + c * ((r_c + r_r) ** 2).mean()).item()
    # the test can tell: m moves the loss
    assert abs(logged["loss"] - without) > 0.1, (logged["loss"], without)
