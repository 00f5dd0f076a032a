"""`forward` gives the same log-probabilities, entropies and last hidden states on every layout, for every family.

`forward(model, batch, plan)` is the one way the trainers run a model on tokens they learn from; its layouts are
private branches: padded rows, the real tokens packed in bins (`Plan(padding_free=True)`) and each distinct prompt
run once (`Plan(shared_prefix=True)`). Where each expected value comes from:

- the padded layout is checked against a plain loop: each row alone, without any padding, through `model(...)`,
  its logits divided by T, `log_softmax` gathered at the next token, the entropy summed over the vocabulary by hand,
  and `hidden_states[-1]`;
- the packed and shared-prefix layouts are then checked against the padded one, at every real response token;
- the same tokens given as whole sequences and a loss mask (`TokenBatch.from_sequences`, what SFT and DPO pass) give
  the same numbers, row after row, on every layout.

Rows: three prompts (9, 5 and 2 real tokens, left-padded), each twice, and six right-padded responses; sliding
windows of 4 tokens (shorter than the rows) where a family has them. BLOOM (ALiBi: positions from the mask, no
`position_ids`) cannot be packed: `packed_forward` refuses it by name.
"""

import pytest
import torch
import torch.nn.functional as F

from instruct_goose import task_tokenizer
from instruct_goose.agent import Plan, TokenBatch, disable_dropout, forward

from _families import BY_NAME, CAUSAL, build_causal

T = 0.7
LAYOUTS = {"packed": Plan(padding_free=True), "shared prefix": Plan(shared_prefix=True)}


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer()


def rows(tokenizer, P=9, R=7):
    torch.manual_seed(0)
    qm = torch.ones(3, P, dtype=torch.long)
    qm[1, :4] = 0
    qm[2, :7] = 0
    q = torch.randint(5, len(tokenizer), (3, P)) * qm + tokenizer.pad_token_id * (1 - qm)
    rm = (torch.arange(R) < torch.tensor([7, 2, 5, 1, 7, 3])[:, None]).long()
    r = torch.randint(5, len(tokenizer), (6, R)) * rm + tokenizer.pad_token_id * (1 - rm)
    return q.repeat_interleave(2, 0), qm.repeat_interleave(2, 0), r, rm


@torch.no_grad()
def by_hand(model, q, qm, r, rm):
    "Each row alone, no padding: (log π(y_t), entropy, last hidden state) at its real response tokens, row after row."
    lps, ents, states = [], [], []
    for b in range(len(q)):
        prompt, response = q[b][qm[b].bool()], r[b][rm[b].bool()]
        out = model(input_ids=torch.cat([prompt, response])[None], output_hidden_states=True)
        at = slice(len(prompt) - 1, len(prompt) + len(response) - 1)
        z = out.logits[0, at].float() / T
        log_p = z.log_softmax(-1)
        lps.append(log_p.gather(-1, response[:, None])[:, 0])
        ents.append(-(log_p.exp() * log_p).sum(-1))
        states.append(out.hidden_states[-1][0, at])
    return torch.cat(lps), torch.cat(ents), torch.cat(states)


def close(ours, theirs):
    torch.testing.assert_close(ours.detach().float(), theirs.detach().float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", [f.name for f in CAUSAL])
def test_every_layout_gives_the_plain_loops_numbers(family, tokenizer):
    model = disable_dropout(build_causal(BY_NAME[family], tokenizer, seed=0)).eval()
    if getattr(model.config, "sliding_window", None) is not None:
        model.config.sliding_window = 4
    q, qm, r, rm = rows(tokenizer)
    real = rm.bool()
    expected = by_hand(model, q, qm, r, rm)

    responses = TokenBatch.from_responses(q, qm, r, rm)
    padded = forward(model, responses, temperature=T, entropy="no_grad", hidden=True)
    for ours, theirs in zip(padded[:3], expected):
        close(ours[real], theirs)

    width = q.shape[1]
    sequences = TokenBatch.from_sequences(
        responses.input_ids, responses.attention_mask, F.pad(real, (width, 0))
    )
    for name, plan in {"padded": Plan(), **LAYOUTS}.items():
        if family == "bloom" and plan.padding_free:
            with pytest.raises(ValueError, match="`padding_free` needs a model that takes `position_ids`"):
                forward(model, responses, plan, temperature=T)
            continue
        laid_out = forward(model, responses, plan, temperature=T, entropy="no_grad", hidden=True)
        flat = forward(model, sequences, plan, temperature=T, entropy="no_grad", hidden=True)
        for ours, of_rows, theirs in zip(laid_out[:3], flat[:3], padded[:3]):
            close(ours[real], theirs[real])
            close(of_rows, theirs[real])
        assert flat.row.tolist() == real.nonzero()[:, 0].tolist(), name
