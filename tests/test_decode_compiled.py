"""`decode(compile=True)` with inductor, the compiler a GPU would use: its fused kernels sample the tokens the eager step
samples and draw the probabilities the trainers score. Marked slow (inductor's compilation: 25 s for both
families on 2 CPU cores); chapter 03a checks the tracing, the reuse and the compilation count with a backend that runs each graph as
it is, and tests/test_decode_cuda.py would time nothing: the speed is `bench/decode_speed.py --device cuda --compiled`.

    python3 -m pytest tests/test_decode_compiled.py -m slow -q
"""

import pytest
import torch

from instruct_goose import Agent, decoding, encode_prompts, task_tokenizer, tiny_causal_lm
from instruct_goose.decoding import drawing_with

from test_decode_cuda import PROMPTS, by_argmax


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_inductor_samples_the_eager_steps_tokens_and_the_scored_p(arch):
    tokenizer = task_tokenizer()
    agent = Agent(tiny_causal_lm(tokenizer, arch=arch, seed=0).eval())
    q, m = encode_prompts(tokenizer, PROMPTS)
    # no row stops: one batch size, one compilation
    never = agent.model.config.vocab_size
    runs = {}
    for compile in (False, True):
        drawn = []
        with drawing_with(lambda p: drawn.append(p) or by_argmax(p)):
            ids = decoding.decode(
                agent.model,
                q,
                m,
                10,
                never,
                tokenizer.pad_token_id,
                graphs=True,
                compile=compile,
                temperature=0.7,
            )
        runs[compile] = ids, torch.stack(drawn, 1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.equal(runs[True][0], runs[False][0])
    r = runs[True][0]
    scored = agent.response_stats(
        q, m, r, torch.ones_like(r, dtype=torch.bool), temperature=0.7, entropy="skip"
    ).logprobs
    assert (runs[True][1].log() - scored).abs().max().item() <= 1e-5
    torch._dynamo.reset()
