"""The output layer's written-out backward on a GPU (chapter 00, "The backward, written out"), skipped without CUDA;
`bench/gpu_run.sh tests` runs it. Under CUDA bf16 autocast: the gradients of `logprobs_from_hidden` are those of autograd
through the plain formula (one chunk and several), and the entropy is summed in float32 (CUDA autocasts
`torch.linalg.vecdot` as it does matmul, pytorch/pytorch#108165, so a bf16 sum would be ~1e-3 off); Gemma 2's soft-capping
after the layer (`after`) gives the capped logits' log-probabilities bit for bit, and their gradients to bf16 rounding."""

import pytest
import torch
import torch.nn.functional as F

from instruct_goose.core import entropy_from_logits, logprobs_from_hidden

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
V, H = 5000, 64


def plain_logprobs(h, W, b, labels, T):
    "log π(label) by autograd through the plain formula, from the whole batch's logits."
    z = F.linear(h, W, b).float() / T
    return z.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(z, -1)


# one chunk (its log p kept); three (recomputed in the backward)
@pytest.mark.parametrize("chunk", [None, 37])
def test_head_gradients_under_cuda_autocast(chunk):
    g = torch.Generator().manual_seed(0)
    h0, W0, b0 = (
        torch.randn(96, H, generator=g),
        torch.randn(V, H, generator=g) * 0.1,
        torch.randn(V, generator=g),
    )
    labels, weights = torch.randint(0, V, (96,), generator=g).cuda(), torch.randn(96, generator=g).cuda()
    results = []
    for ours in (True, False):
        h, W, b = (x.cuda().requires_grad_() for x in (h0, W0, b0))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp = (
                logprobs_from_hidden(h[None], W, b, labels[None], 0.7, "no_grad", chunk)[0][0]
                if ours
                else plain_logprobs(h, W, b, labels, 0.7)
            )
        (lp * weights).sum().backward()
        results.append((lp, h.grad, W.grad, b.grad))
    for got, expected in zip(*results):
        assert (
            got.dtype == expected.dtype and (got - expected).abs().max() <= 1e-6 + 2e-2 * expected.abs().max()
        )


def test_entropy_is_summed_in_float32_under_cuda_autocast():
    g = torch.Generator().manual_seed(3)
    h, W = torch.randn(1, 8, H, generator=g).cuda(), (torch.randn(V, H, generator=g) * 0.1).cuda()
    labels = torch.randint(0, V, (1, 8), generator=g).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        entropy = logprobs_from_hidden(h, W, None, labels, entropy="no_grad")[1]
        z = F.linear(h, W).float()  # the bf16 logits, as float32
        from_logits = entropy_from_logits(3 * z)
    assert (entropy.double() - torch.special.entr(z.double().softmax(-1)).sum(-1)).abs().max() < 1e-4
    assert torch.equal(from_logits, entropy_from_logits(3 * z))  # the same numbers as without autocast


@pytest.mark.parametrize("chunk", [None, 37])
def test_soft_capped_head_under_cuda_autocast(chunk):
    g = torch.Generator().manual_seed(1)
    h0, W0 = torch.randn(96, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    labels = torch.randint(0, V, (96,), generator=g).cuda()
    cap = lambda z: torch.tanh(z / 3.0) * 3.0
    results = []
    for ours in (True, False):
        h, W = (x.cuda().requires_grad_() for x in (h0, W0))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if ours:
                lp, ent = (
                    x[0]
                    for x in logprobs_from_hidden(
                        h[None], W, None, labels[None], 0.7, "grad", chunk, after=cap
                    )
                )
            else:
                z = cap(F.linear(h, W)).float() / 0.7
                lp, ent = (
                    z.log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1),
                    entropy_from_logits(z[None])[0],
                )
        (lp.exp().sum() + ent.sum()).backward()
        results.append((lp, h.grad, W.grad))
    (lp, *ours), (ref_lp, *theirs) = results
    assert (lp - ref_lp).abs().max() <= 1e-5  # the same bf16 operations on the same numbers
    for got, expected in zip(ours, theirs):
        assert (got - expected).abs().max() <= 1e-6 + 3e-2 * expected.abs().max()
