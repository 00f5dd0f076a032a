"""TRL 1.16's sampling and generation-batching options on the on-policy trainers, where cells would read badly.

- `test_top_k_1_rollout_is_greedy_and_scores_the_full_softmax`: GRPO with `top_k=1` samples the argmax of the scoring
  pass at every step, and the loss's π_old (the rollout's log-probabilities, μ = 2) is log softmax(z/T) of that token,
  computed here from the logits: the rule the generation chapter states (TRL's), not the 0 of the truncated distribution.
- `test_each_step_gradient_is_its_rows_as_one_batch`: `steps_per_generation` = 2 optimizer steps per generation, two
  passes; at every optimizer step, for every GRPO loss type (and RLOO), the gradient the engine accumulated over its
  micro-batches equals the gradient of the loss over that step's rows as one batch, at the same parameters (the
  property TRL PR #6024 found broken for dapo/cispo), with completion lengths that differ inside each step.
- `test_evaluation_samples_with_the_options` / `test_num_generations_eval`: evaluation samples with the training's
  options (top_k=1 is the greedy evaluation), `num_generations_eval` completions per prompt (None: G).
- `test_shuffle_dataset_false_takes_rows_in_order`, `test_bad_values_are_one_line_errors`.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from instruct_goose import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer, load_task
from instruct_goose import engine
from instruct_goose.agent import response_logits
from instruct_goose.grpo import _LOSS_TYPES
from instruct_goose.loop import TrainLoop
from instruct_goose.onpolicy import evaluate_policy


def length(prompts, completions):
    return [len(c) / 10 for c in completions]


def _trainer(policy_dir, tmp_path, algo="grpo", reward=length, **overrides):
    config, trainer = (GRPOConfig, GRPOTrainer) if algo == "grpo" else (RLOOConfig, RLOOTrainer)
    args = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=1,
        num_generations=4,
        max_completion_length=8,
        local_rollout_forward_batch_size=8,
        num_sample_generations=0,
        disable_tqdm=True,
        learning_rate=1e-2,
        logging_steps=1,
    )
    return trainer(
        AutoModelForCausalLM.from_pretrained(policy_dir),
        args=config(**{**args, **overrides}),
        processing_class=AutoTokenizer.from_pretrained(policy_dir),
        train_dataset=load_task("prompts").select(range(16)),
        reward_funcs=reward,
    )


def test_top_k_1_rollout_is_greedy_and_scores_the_full_softmax(policy_dir, tmp_path):
    T = 0.7
    trainer = _trainer(policy_dir, tmp_path, top_k=1, temperature=T, num_iterations=2)
    rollout, _ = trainer.sample_rollout(trainer.model, trainer.train_dataset[:2], seed=0)
    ids, mask = rollout.response_ids, rollout.response_mask
    with torch.no_grad():
        logits = response_logits(trainer.model, rollout.query_ids, rollout.query_attention_mask, ids, mask)[0]
    # greedy at every real step
    assert torch.equal(ids[mask], logits.argmax(-1)[mask])
    # log p(token) under the full softmax at T
    by_hand = (logits / T).log_softmax(-1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(rollout.logprobs[mask], by_hand[mask], atol=1e-5, rtol=0)
    # the truncated distribution would give 0
    assert (rollout.logprobs[mask] < -0.1).all()


CUTS = {
    "grpo": dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, steps_per_generation=8),
    "rloo": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=4),
}


@pytest.mark.parametrize("algo, loss_type", [("grpo", t) for t in _LOSS_TYPES] + [("rloo", None)])
def test_each_step_gradient_is_its_rows_as_one_batch(policy_dir, tmp_path, monkeypatch, algo, loss_type):
    eos = AutoTokenizer.from_pretrained(policy_dir).eos_token_id
    extra = dict(loss_type=loss_type, beta=0.04) if algo == "grpo" else {}
    # EOS likely: lengths differ
    trainer = _trainer(
        policy_dir,
        tmp_path,
        algo,
        num_iterations=2,
        generation_kwargs={"sequence_bias": [[[eos], 5.0]]},
        **CUTS[algo],
        **extra,
    )
    assert trainer.args.num_mini_batches == 2 and trainer.args.rollout_size == 8
    cuts, rollouts, diffs = [], [], []
    minibatches = engine.minibatches
    monkeypatch.setattr(engine, "minibatches", lambda *a: cuts.append(minibatches(*a)) or cuts[-1])
    update = type(trainer).update
    trainer.update = lambda model, rollout, loop: (
        rollouts.append(rollout) or update(trainer, model, rollout, loop)
    )
    step = TrainLoop.optimizer_step

    def checked_step(loop, model, stats=None):
        k = len(diffs)
        # this optimizer step's rows
        rows = torch.cat(cuts[k // 2][k % 2])
        part = rollouts[0][rows]
        lengths = part.loss_mask.sum(1)
        # a token mean differs from a mean of means
        assert len(set(lengths.tolist())) > 1, lengths
        engine = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        # the step's rows as one micro-batch
        losses, _ = trainer.micro_batch_loss(model, part, 0)
        sum(losses.values()).backward()
        diffs.append(
            max(
                (e - p.grad).abs().max().item() / (p.grad.abs().max().item() + 1e-12)
                for e, p in zip(engine, model.parameters())
            )
        )
        for e, p in zip(engine, model.parameters()):
            p.grad = e
        return step(loop, model, stats)

    monkeypatch.setattr(TrainLoop, "optimizer_step", checked_step)
    trainer.train()
    # 2 passes × 2 optimizer steps per generation
    assert len(diffs) == 4
    assert max(diffs) < 1e-5, diffs


def test_evaluation_samples_with_the_options(policy_dir):
    tokenizer, model = (
        AutoTokenizer.from_pretrained(policy_dir),
        AutoModelForCausalLM.from_pretrained(policy_dir),
    )
    prompts = list(load_task("prompts")["prompt"][:4])
    greedy = evaluate_policy(model, None, tokenizer, prompts, length, response_length=6, temperature=0)[1]
    top_1 = evaluate_policy(
        model, None, tokenizer, prompts, length, response_length=6, temperature=1.0, sampling=dict(top_k=1)
    )[1]
    sampled = evaluate_policy(model, None, tokenizer, prompts, length, response_length=6, temperature=1.0)[1]
    assert [r["policy"] for r in top_1] == [r["policy"] for r in greedy] != [r["policy"] for r in sampled]


@pytest.mark.parametrize("n_eval, expected", [(None, 4), (3, 3)])
def test_num_generations_eval(policy_dir, tmp_path, n_eval, expected):
    seen = []

    def recording(prompts, completions):
        seen.append(list(prompts))
        return length(prompts, completions)

    trainer = _trainer(policy_dir, tmp_path, reward=recording, num_generations_eval=n_eval)
    trainer.eval_dataset = load_task("prompts").select(range(16, 18))
    trainer.train()
    # the evaluation at the last step
    evaluated = seen[-1]
    assert len(evaluated) == 2 * expected and evaluated == [
        p for p in trainer.eval_dataset["prompt"] for _ in range(expected)
    ]


def test_shuffle_dataset_false_takes_rows_in_order(policy_dir, tmp_path):
    seen = []

    def recording(prompts, completions):
        seen.append(list(prompts))
        return length(prompts, completions)

    trainer = _trainer(
        policy_dir,
        tmp_path,
        reward=recording,
        shuffle_dataset=False,
        max_steps=2,
        per_device_train_batch_size=8,
    )
    trainer.train()
    data = list(trainer.train_dataset["prompt"])
    assert seen == [[p for p in data[s * 2 : (s + 1) * 2] for _ in range(4)] for s in range(2)]


@pytest.mark.parametrize("config", [GRPOConfig, RLOOConfig])
@pytest.mark.parametrize(
    "bad, names",
    [
        (dict(top_p=0.0), "`top_p`"),
        (dict(top_p=1.2), "`top_p`"),
        (dict(top_k=-1), "`top_k`"),
        (dict(min_p=1.5), "`min_p`"),
        (dict(repetition_penalty=0.0), "`repetition_penalty`"),
        (dict(generation_kwargs={"top_k": 5}), "set `top_k` instead"),
        (dict(generation_kwargs={"max_new_tokens": 5}), "max_completion_length"),
        (dict(cache_implementation="paged"), "`cache_implementation`"),
        (
            dict(steps_per_generation=3, gradient_accumulation_steps=2),
            "`steps_per_generation`=3 must be a positive multiple",
        ),
        (dict(generation_batch_size=6), "`generation_batch_size`=6 must be a positive multiple"),
        (dict(generation_batch_size=16, steps_per_generation=2), "set the same thing"),
        (dict(num_generations_eval=0), "`num_generations_eval`"),
    ],
)
def test_bad_values_are_one_line_errors(config, bad, names):
    with pytest.raises(ValueError) as error:
        config(per_device_train_batch_size=4, num_generations=2, **bad)
    assert names in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_chat_template_kwargs_reach_the_template(policy_dir, tmp_path):
    """TRL's `chat_template_kwargs` are variables of the chat template, for training and evaluation prompts
    alike."""
    from instruct_goose.data import CHATML_TEMPLATE

    think = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    conversation = [[{"role": "user", "content": "the movie was"}]]
    rendered = {}
    for kwargs in (None, {"enable_thinking": False}):
        trainer = _trainer(policy_dir, tmp_path, chat_template_kwargs=kwargs)
        trainer.processing_class.chat_template = CHATML_TEMPLATE + think
        samples = trainer.sample_and_score(trainer.model, conversation, seed=0)
        records = evaluate_policy(
            trainer.model,
            None,
            trainer.processing_class,
            conversation,
            length,
            response_length=4,
            chat_template_kwargs=kwargs,
        )[1]
        rendered[bool(kwargs)] = samples.prompts[0], records[0]["prompt"]
    assert (
        rendered[True] == (rendered[False][0] + "<think></think>",) * 2
        and rendered[False][0] == rendered[False][1]
    )
    assert rendered[False][0].endswith("<|im_start|>assistant\n")


def test_ppo_takes_them_from_the_same_engine(tmp_path):
    """PPO samples through the same `sample_and_score`: `top_k=1` is greedy there too, and `steps_per_generation`
    sets its minibatches."""
    from instruct_goose import PPOConfig, PPOTrainer, task_tokenizer, tiny_causal_lm

    tokenizer = task_tokenizer()
    config = PPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        top_k=1,
        response_length=5,
    )
    assert config.num_mini_batches == 2
    trainer = PPOTrainer(
        tiny_causal_lm(tokenizer, seed=0), args=config, processing_class=tokenizer, reward_funcs=length
    )
    policy = trainer.model.model
    samples = trainer.sample_and_score(policy, ["Review: The film", "Review: A goose"], seed=0)
    ids, mask = samples.response_ids, samples.response_mask
    with torch.no_grad():
        logits = response_logits(policy, samples.query_ids, samples.query_attention_mask, ids, mask)[0]
    assert torch.equal(ids[mask], logits.argmax(-1)[mask])


def test_compile_generation_samples_through_the_compiled_step(policy_dir, tmp_path, monkeypatch):
    """`compile_generation=True`: the rollout's tokens come from `decode`'s step as `torch.compile` hands it back
    (here run as it is: the same tokens as without)."""
    from instruct_goose import decoding

    handed = []

    def eager(step, options):  # `_compiled` without inductor: note what was asked, give the step back
        handed.append(options)
        return step

    monkeypatch.setattr(decoding, "_compiled", eager)
    ids = {}
    for on in (False, True):
        trainer = _trainer(policy_dir, tmp_path, compile_generation=on)
        ids[on] = trainer.sample_rollout(trainer.model, trainer.train_dataset[:2], seed=0)[0].response_ids
    # asked once, by the compiled run only
    assert handed == [True], handed
    assert torch.equal(ids[True], ids[False])


def test_num_tokens_counts_prompts_and_completions(policy_dir, tmp_path):
    "GRPO logs TRL's `num_tokens`: the running count of every rollout's real prompt and completion tokens."
    eos = AutoTokenizer.from_pretrained(policy_dir).eos_token_id
    # completions of several lengths
    trainer = _trainer(policy_dir, tmp_path, max_steps=2, generation_kwargs={"sequence_bias": [[[eos], 5.0]]})
    seen, sample = [], trainer.sample_rollout

    def recording(*args, **kwargs):
        rollout, samples = sample(*args, **kwargs)
        seen.append(int(samples.query_attention_mask.sum() + samples.response_mask.sum()))
        # some completions stopped early: padding is not counted
        assert samples.response_mask.sum() < samples.response_mask.numel()
        return rollout, samples

    trainer.sample_rollout = recording
    trainer.train()
    assert [row["num_tokens"] for row in trainer.loop.state.history] == [seen[0], seen[0] + seen[1]]


@pytest.mark.parametrize(
    "algo, precision, switch",
    [("grpo", "bf16", "use_transformers_continuous_batching"), ("rloo", "no", "use_transformers_paged")],
)
def test_continuous_batching_samples_every_rollout(
    policy_dir, tmp_path, monkeypatch, algo, precision, switch
):
    """TRL's switch (or its old name) samples each rollout through 🤗's continuous batching, with the cache sized to the
    batch. Under bf16 mixed precision the engine samples from bf16 copies of the weights, accelerate's autocast wrapper
    set aside for the call and put back; the trained weights stay float32 (TRL 1.16 casts them to bf16 in place for it)."""
    from instruct_goose import generation

    calls, wrappers, engine = [], [], generation._cb_generate

    def noting(model, *args):
        # accelerate's mixed-precision forward, if any
        calls.append(args[-1])
        wrappers.append(vars(model).get("forward"))
        return engine(model, *args)

    monkeypatch.setattr(generation, "_cb_generate", noting)
    trainer = _trainer(policy_dir, tmp_path, algo, mixed_precision=precision, max_steps=2, **{switch: True})
    import threading

    # the output layer's logits in the engine's own thread (training passes run in this one)
    engine_dtypes = []
    trainer.model.lm_head.register_forward_hook(
        lambda module, args, out: (
            engine_dtypes.append(out.dtype)
            if threading.current_thread() is not threading.main_thread()
            else None
        )
    )
    trainer.train()
    assert set(engine_dtypes) == {torch.bfloat16 if precision == "bf16" else torch.float32}, set(
        engine_dtypes
    )
    # one generation a step, TRL's default options
    assert calls == [True, True], calls
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    # accelerate's wrapper given back
    assert vars(trainer.model).get("forward") is wrappers[0] and (wrappers[0] is not None) == (
        precision == "bf16"
    )
    rollout, _ = trainer.sample_rollout(trainer.model, trainer.train_dataset[:2], seed=0)
    ids, real = rollout.response_ids, rollout.response_mask
    eos = trainer.stop_token_id
    # real up to and including the first stop, padding after
    for row, n in zip(ids.tolist(), real.sum(1).tolist()):
        assert eos not in row[: n - 1] and (n == 8 or row[n - 1] == eos), row
    assert ids.shape[1] == int(real.sum(1).max())  # the rollout ends at its longest response
