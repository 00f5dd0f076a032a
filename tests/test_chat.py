"""Conversations end to end for the supervised stages (issue 17): chat SFT with `assistant_only_loss` trains only
on the assistant's tokens, a chat reward model learns, LoRA from Python keeps the reward head trainable and
saves the adapter, and the trainers take TRL's keywords."""

import copy

import pytest
import torch

from instruct_goose.toy import chat_task_tokenizer, load_task, task_tokenizer, tiny_causal_lm
from instruct_goose.reward import RewardModel
from instruct_goose.sft import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

TWO_TURNS = [
    {"role": "user", "content": "Review: The film"},
    {"role": "assistant", "content": " was good."},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": " was bad."},
]


def llama3_tokenizer():
    """The task tokenizer with a Llama-3-style template: header tokens around the role, `<|eot_id|>` closing a
    turn, no newline after it."""
    tok = copy.deepcopy(task_tokenizer())
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
        "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ "
        "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    )
    return tok


@pytest.mark.parametrize(
    "make_tokenizer, expected, turns",
    [
        # ChatML: <|im_start|> u s er Ċ Review : ĠThe Ġfilm <|im_end|> Ċ (0-10), <|im_start|> as s is t a nt Ċ
        # (11-18),
        # Ġwas Ġg o o d . <|im_end|> Ċ (19-26), the user's turn (27-37), the assistant's header (38-45), Ġwas
        # Ġbad
        # . <|im_end|> Ċ (46-50)
        (
            chat_task_tokenizer,
            list(range(19, 27)) + list(range(46, 51)),
            [" was good.<|im_end|>\n", " was bad.<|im_end|>\n"],
        ),
        # Llama 3: <eos> (0), the user's turn (1-12), the assistant's header <|start_header_id|> as s is t a
        # nt
        # <|end_header_id|> Ċ Ċ (13-22),
        # Ġwas Ġg o o d . <|eot_id|> (23-29), the user's turn (30-41), the assistant's header (42-51), Ġwas
        # Ġbad .
        # <|eot_id|> (52-55)
        (
            llama3_tokenizer,
            list(range(23, 30)) + list(range(52, 56)),
            [" was good.<|eot_id|>", " was bad.<|eot_id|>"],
        ),
    ],
)
def test_chat_sft_loss_mask_is_the_assistant_turns(make_tokenizer, expected, turns, tmp_path):
    tok = make_tokenizer()
    trainer = SFTTrainer(
        tiny_causal_lm(tok),
        args=SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True),
        train_dataset=[{"messages": TWO_TURNS}],
        processing_class=tok,
    )
    (ids, mask, loss_mask), n_tokens = trainer.encode(trainer.train_dataset[:1])
    assert loss_mask[0].nonzero().flatten().tolist() == expected and n_tokens == len(expected)
    runs = [[expected[0]]]  # the runs of consecutive positions: one per assistant turn
    for a, b in zip(expected, expected[1:]):
        runs[-1].append(b) if b == a + 1 else runs.append([b])
    assert [tok.decode(ids[0, run]) for run in runs] == turns
    # nothing appended after the template's text (no EOS): the template ends the turn
    assert ids.shape[1] == expected[-1] + 1


def test_chat_sft_lowers_the_held_out_loss(tmp_path):
    tok = chat_task_tokenizer()
    demos, held_out = load_task("sft", chat=True).train_test_split(test_size=32, seed=0).values()
    config = SFTConfig(
        output_dir=str(tmp_path),
        learning_rate=3e-3,
        per_device_train_batch_size=16,
        max_steps=40,
        warmup_steps=4,
        disable_tqdm=True,
        assistant_only_loss=True,
    )
    steps = []
    counter = type(
        "Counter",
        (),
        {"on_step_end": lambda self, args, state, control, **kw: steps.append(state.global_step)},
    )()
    trainer = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        args=config,
        train_dataset=demos,
        eval_dataset=held_out,
        processing_class=tok,
        callbacks=[counter],
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    # from about ln 514 = 6.24 (uniform guessing)
    assert 5.5 < before < 7.0 and after < 0.65 * before, (before, after)
    assert steps == list(range(1, 41))  # the callbacks reach the loop


@pytest.mark.slow
def test_chat_reward_model_beats_chance(tmp_path):
    tok = chat_task_tokenizer()
    sft_trainer = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        args=SFTConfig(
            output_dir=str(tmp_path / "sft"),
            learning_rate=3e-3,
            per_device_train_batch_size=16,
            max_steps=40,
            warmup_steps=4,
            disable_tqdm=True,
            assistant_only_loss=True,
        ),
        train_dataset=load_task("sft", chat=True),
        processing_class=tok,
    )
    sft_trainer.train()
    sft = sft_trainer.model
    config = RewardConfig(
        output_dir=str(tmp_path / "rm"),
        learning_rate=1e-3,
        per_device_train_batch_size=32,
        max_steps=20,
        warmup_steps=2,
        disable_tqdm=True,
    )
    trainer = RewardTrainer(
        sft,
        args=config,
        train_dataset=load_task("preferences", chat=True),
        eval_dataset=load_task("preferences", "eval", chat=True),
        processing_class=tok,
    )
    start = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    end = trainer.evaluate()["eval_accuracy"]
    assert end > 0.75 and end > start, (start, end)
    # a plain 🤗 sequence classifier and the chat tokenizer
    reloaded = RewardModel.from_pretrained(tmp_path / "rm")
    assert reloaded.tokenizer.chat_template == tok.chat_template


def test_reward_lora_trains_the_head_and_saves_the_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    tok = task_tokenizer()
    tiny_causal_lm(tok, seed=0).save_pretrained(tmp_path / "base")  # the base the saved adapter names
    config = RewardConfig(
        output_dir=str(tmp_path / "rm"),
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        max_steps=1,
        disable_tqdm=True,
    )
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"])
    trainer = RewardTrainer(
        str(tmp_path / "base"),
        args=config,
        train_dataset=load_task("preferences").select(range(8)),
        processing_class=tok,
        peft_config=lora,
    )
    assert lora.task_type is None and lora.modules_to_save is None  # the caller's config is left as it was
    trainable = {n for n, p in trainer.reward_model.named_parameters() if p.requires_grad}
    assert any("lora_" in n for n in trainable) and any("score" in n for n in trainable)
    assert not any("wte" in n or "mlp" in n for n in trainable)  # the trunk itself is frozen
    loss, _ = trainer.pair_loss_sum(trainer.reward_model, trainer.train_dataset[:8])
    loss.backward()
    assert trainer.reward_model.head.weight.grad.abs().sum() > 0  # the new head learns
    trainer.train()
    trained = trainer.reward_model
    # the adapter, as TRL saves it
    assert hasattr(trained.model, "peft_config") and (tmp_path / "rm" / "adapter_config.json").is_file()
    reloaded = RewardModel.from_pretrained(tmp_path / "rm")
    texts = [r["prompt"] + r["chosen"] for r in trainer.train_dataset.select(range(4))]
    torch.testing.assert_close(
        reloaded(*reloaded.encode(texts)), trained.eval()(*trained.encode(texts)), atol=1e-5, rtol=1e-5
    )


def test_sft_lora_from_python_and_a_path(tmp_path):
    peft = pytest.importorskip("peft")
    tok = task_tokenizer()
    model = tiny_causal_lm(tok, seed=0)
    model.save_pretrained(tmp_path / "base"), tok.save_pretrained(tmp_path / "base")
    config = SFTConfig(
        output_dir=str(tmp_path / "sft"), max_steps=2, per_device_train_batch_size=4, disable_tqdm=True
    )
    trainer = SFTTrainer(
        str(tmp_path / "base"),
        args=config,
        train_dataset=load_task("sft").select(range(8)),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]),
    )
    assert len(trainer.tokenizer) == len(tok)  # loaded from the path
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} and all(
        "lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad
    )
    trainer.train()
    trained = trainer.model
    assert (tmp_path / "sft" / "adapter_config.json").is_file()  # the adapter, as TRL saves it
    merged = trained.merge_and_unload()
    assert type(merged).__name__ == "GPT2LMHeadModel"  # merged: a plain 🤗 model
    base = dict(model.named_parameters())
    assert any(not torch.equal(p, base[n]) for n, p in merged.named_parameters() if "c_attn" in n)


def test_trainers_take_trl_keywords_and_refuse_the_old_order(tmp_path):
    tok, rows = task_tokenizer(), [{"prompt": "Review: The film", "completion": " was good."}]
    model, config = tiny_causal_lm(tok), SFTConfig(output_dir=str(tmp_path))
    with pytest.raises(
        TypeError,
        match=r"the arguments are SFTTrainer\(model, args, train_dataset, eval_dataset, processing_class, "
        r"peft_config, callbacks, optimizers, optimizer_cls_and_kwargs, compute_metrics, "
        r"preprocess_logits_for_metrics, formatting_func\)",
    ):
        SFTTrainer(model, tok, config, rows)
    with pytest.raises(TypeError, match="`config` is the old name of `args`"):
        SFTTrainer(model, config, rows, processing_class=tok, config=config)
    old = SFTTrainer(model, tokenizer=tok, config=config, train_dataset=rows)
    assert (old.tokenizer, old.config) == (tok, config)
    pairs = [{"prompt": "Review: The film", "chosen": " was good.", "rejected": " was bad."}]
    with pytest.raises(TypeError, match=r"the arguments are RewardTrainer\(model, args,"):
        RewardTrainer(RewardModel(model, tokenizer=tok), pairs)
    callback = type("Seen", (), {"on_step_end": lambda self, *a, **k: None})()
    rm = RewardTrainer(
        model,
        args=RewardConfig(output_dir=str(tmp_path / "rm")),
        train_dataset=pairs,
        processing_class=tok,
        callbacks=[callback],
    )
    assert rm.reward_model.tokenizer is tok and rm.callbacks == [callback]


def test_reward_trainer_seeds_the_new_head():
    """`args.seed` decides a new score head, whatever the global random state (🤗's Trainer seeds in __init__
    too)."""
    from instruct_goose import RewardConfig, RewardTrainer

    tok, heads = task_tokenizer(), []
    base = tiny_causal_lm(tok, seed=0)
    for noise in (1, 2):
        torch.manual_seed(noise)
        trainer = RewardTrainer(copy.deepcopy(base), args=RewardConfig(seed=0), processing_class=tok)
        heads.append(trainer.reward_model.head.weight.detach().clone())
    assert torch.equal(*heads)
