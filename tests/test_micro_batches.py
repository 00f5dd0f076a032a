"""Rows dealt like with like: the update's micro-batches (`like_rows`) and the rollout's pieces (`chunked`) by length.

Each micro-batch, and each piece of the passes before the update (`local_rollout_forward_batch_size` rows), is cut to
its own longest prompt and response, so which rows share one decides how much padding the passes read. A minibatch,
and so its gradient, is the same however its rows are dealt (every loss is a mean over the whole minibatch's units),
and a piece's rows get their own numbers whatever piece they are in. Both are dealt by `cheapest_order`. What must hold:

- a run that deals like rows together is the run that deals them as drawn: the same parameters after two steps of SGD
  and the same logged metrics, for PPO (shared and separate critic), RLOO and GRPO (dapo), on GPT-2, Llama and Gemma 2,
  with four accumulated micro-batches and with two minibatches of two, and with `shared_prefix` (rows of one prompt together);
  (but two statistics kept per micro-batch: PPO's `val/ratio_var` and RLOO's `policy/approxkl_avg`);
- its update passes, and its passes before the update (in pieces of 2 rows), read fewer positions in all, and never
  more, than the run dealt as drawn (responses that often stop early here: a sequence bias on the stop token);
- a minibatch that is one micro-batch keeps its order: the rollout's policy pass is reused for it row for row.
"""

import pytest
import torch

import instruct_goose.engine as engine
import instruct_goose.rollout as rollout
from instruct_goose import Agent, task_tokenizer

from test_padding_free import make


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def run(algo, family, tokenizer, tmp_path, dealt, monkeypatch, **more):
    """Train; return the parameters, the logged rows and the positions the policy's passes read, (with gradients,
    without), the sampler's aside."""
    with monkeypatch.context() as m:
        # as drawn, as they are
        if not dealt:
            m.setattr(rollout, "cheapest_order", lambda P, *args: torch.arange(len(P)))
        trainer = make(algo, family, tokenizer, tmp_path / f"dealt{dealt}", False, **more)
        positions = []

        def hook(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            # (🤗 generate's prefill has its cache)
            if ids is not None and ids.shape[1] > 1 and kwargs.get("past_key_values") is None:
                positions.append((torch.is_grad_enabled(), ids.numel()))

        policy = trainer.model.model if isinstance(trainer.model, Agent) else trainer.model
        policy.register_forward_pre_hook(hook, with_kwargs=True)
        trainer.train()
    return (
        {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        trainer.loop.state.history,
        positions,
    )


def assert_same_run(algo, family, tokenizer, tmp_path, monkeypatch, **more):
    dealt, hist_dealt, pos_dealt = run(algo, family, tokenizer, tmp_path, True, monkeypatch, **more)
    drawn, hist_drawn, pos_drawn = run(algo, family, tokenizer, tmp_path, False, monkeypatch, **more)
    for name, p in drawn.items():
        torch.testing.assert_close(
            dealt[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{algo}/{family}/{more} {name}: {m}"
        )
    # the sums in another order: float rounding only
    for row_dealt, row_drawn in zip(hist_dealt, hist_drawn, strict=True):
        for key, value in row_drawn.items():
            # kept per micro-batch, so taken over other groups of rows: PPO's val/ratio_var (the token ratios'
            # variance in each) and
            # RLOO's policy/approxkl_avg (a mean per token in each, weighted by sequences like RLOO's loss)
            # (clipfrac: test_padding_free)
            if isinstance(value, float) and key not in (
                "eps",
                "step_time",
                "val/clipfrac_avg",
                "val/ratio_var",
                "policy/approxkl_avg",
            ):
                assert row_dealt[key] == pytest.approx(value, rel=1e-4, abs=5e-6), (algo, family, more, key)
    assert len(pos_dealt) == len(pos_drawn) > 0
    return [
        (sum(n for g, n in pos_dealt if g == grad), sum(n for g, n in pos_drawn if g == grad))
        for grad in (True, False)
    ]


# one minibatch of four micro-batches
CUTS = [
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, local_rollout_forward_batch_size=2),
    # two minibatches (shuffled) of two
    dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_mini_batches=2),
]


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma2"])
@pytest.mark.parametrize(
    "algo, loss_type", [("ppo", None), ("ppo_separate", None), ("rloo", None), ("grpo", "dapo")]
)
def test_like_rows_train_as_drawn_rows(algo, loss_type, family, tokenizer, tmp_path, monkeypatch):
    read = [
        assert_same_run(
            algo,
            family,
            tokenizer,
            tmp_path / str(i),
            monkeypatch,
            **cut,
            **({} if loss_type is None else dict(loss_type=loss_type)),
        )
        for i, cut in enumerate(CUTS)
    ]
    # the update's passes, then those before it
    for passes in zip(*read):
        assert all(dealt <= drawn for dealt, drawn in passes), read
        # the stop token is favoured: lengths differ
        assert sum(dealt for dealt, _ in passes) < sum(drawn for _, drawn in passes), read


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_like_rows_with_shared_prompts(algo, tokenizer, tmp_path, monkeypatch):
    """With `shared_prefix` the rows of one prompt are dealt together (then by length): the same run as dealt as
    drawn."""
    more = dict(
        shared_prefix=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        local_rollout_forward_batch_size=2,
        **({"loss_type": "dapo"} if algo == "grpo" else {}),
    )
    assert_same_run(algo, "llama", tokenizer, tmp_path, monkeypatch, **more)


def test_one_micro_batch_keeps_its_order(tokenizer, tmp_path, monkeypatch):
    """A minibatch that is one micro-batch is the whole rollout in order: the rollout's pass with gradients is
    reused for it (`first_pass`)."""
    cuts = []
    minibatches = engine.minibatches
    monkeypatch.setattr(engine, "minibatches", lambda *args: cuts.append(minibatches(*args)) or cuts[-1])
    make("grpo", "llama", tokenizer, tmp_path, False).train()
    assert cuts and all(
        [[rows.tolist() for rows in mb] for mb in cut] == [[list(range(len(cut[0][0])))]] for cut in cuts
    ), cuts
