"""Tool calls in rollouts (the tools chapter): the tool-result mask of a scripted multi-turn sample against a hand-written one,
tool tokens that change neither loss nor gradient (GRPO with its KL term, RLOO), the same numbers packed (`padding_free`) or with the prompt run once (`shared_prefix`),
the error paths end to end, and TRL's tool-calling GRPO example with only the import changed."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessor

from instruct_goose import (
    GRPOConfig,
    GRPOTrainer,
    PolicyPass,
    RLOOConfig,
    RLOOTrainer,
    task_tokenizer,
    tiny_causal_lm,
)
from instruct_goose.data import encode_prompts
from instruct_goose.tools import generate_with_tools, with_tool_template

from conftest import run_example

ROOT = Path(__file__).resolve().parents[1]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of whole numbers with + - *.

    Args:
        expression: the expression, e.g. 12*34
    """
    if set(expression) - set("0123456789+-* "):
        raise ValueError(f"cannot evaluate {expression!r}")
    return str(eval(expression, {"__builtins__": {}}, {}))


def boom(x: int) -> str:
    """Always raises.

    Args:
        x: anything
    """
    raise RuntimeError("boom")


def sleepy(x: int) -> str:
    """Sleeps far too long.

    Args:
        x: anything
    """
    time.sleep(30)
    return "late"


class Script(LogitsProcessor):
    """Forces each prompt's k-th assistant turn to `turns[user text][k]` followed by the end of turn (the
    chapter's `Script`)."""

    def __init__(self, tokenizer, turns):
        self.tok = tokenizer
        self.turns = {
            k: [tokenizer(t, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for t in v]
            for k, v in turns.items()
        }
        self.header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        for b, row in enumerate(input_ids.tolist()):
            text = self.tok.decode(row)
            script = next(v for k, v in self.turns.items() if f"user\n{k}<|im_end|>" in text)
            starts = [
                j + len(self.header) for j in range(len(row)) if row[j : j + len(self.header)] == self.header
            ]
            turn = script[min(len(starts) - 1, len(script) - 1)]
            forced[b, turn[min(len(row) - starts[-1], len(turn) - 1)]] = 0.0
        return forced


@pytest.fixture(scope="module")
def tok():
    return with_tool_template(task_tokenizer())


def ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def call(name, **arguments):
    return '<tool_call>' + json.dumps({"name": name, "arguments": arguments}) + '</tool_call>'


def scripted(tok, turns, tools, budget=160, **kwargs):
    "Sample the scripted prompts with the real tool loop; (samples, query ids, query mask)."
    prompts = [[{"role": "user", "content": k}] for k in turns]
    from instruct_goose.tools import tool_schemas

    texts = [
        tok.apply_chat_template(p, tools=tool_schemas(tools), tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    q_ids, q_mask = encode_prompts(tok, texts)
    out = generate_with_tools(
        tiny_causal_lm(tok, max_positions=320),
        tok,
        q_ids,
        q_mask,
        tools,
        budget,
        tok.eos_token_id,
        tok.pad_token_id,
        logits_processor=[Script(tok, turns)],
        **kwargs,
    )
    return out, q_ids, q_mask


def test_mask_of_a_two_call_sample_is_the_hand_written_one(tok):
    """Two rounds of calls, then an answer: 1 on the model's three turns, 0 on the two tool turns, 1 on the
    padding (TRL pads it with 1)."""
    first, second = call("calculator", expression="12*34"), call("calculator", expression="408+1")
    out, _, _ = scripted(tok, {"12*34+1=": [first, second, "409"]}, [calculator])
    eos, turn = (
        [tok.eos_token_id],
        lambda content: ids(tok, f"\n<|im_start|>tool\n{content}<|im_end|>\n<|im_start|>assistant\n"),
    )
    model_1, tool_1, model_2, tool_2, model_3 = (
        ids(tok, first) + eos,
        turn("408"),
        ids(tok, second) + eos,
        turn("409"),
        ids(tok, "409") + eos,
    )
    n = len(model_1 + tool_1 + model_2 + tool_2 + model_3)
    hand = (
        [1] * len(model_1)
        + [0] * len(tool_1)
        + [1] * len(model_2)
        + [0] * len(tool_2)
        + [1] * len(model_3)
        + [1] * (160 - n)
    )
    assert out.tool_mask[0].int().tolist() == hand
    assert out.response_ids[0, :n].tolist() == model_1 + tool_1 + model_2 + tool_2 + model_3
    assert out.response_mask[0].sum() == n and out.num_tool_calls.tolist() == [2]
    assert [m["role"] for m in out.conversations[0]] == [
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]


def test_every_error_path_reaches_the_model_and_the_run_goes_on(tok):
    turns = {
        "a": [call("boom", x=1), "ok"],
        "b": [call("sleepy", x=1), "ok"],
        "c": ['<tool_call>{"name": calculator}</tool_call>', "ok"],
        "d": [call("abacus", x=1), "ok"],
        "e": [call("calculator", expr="1"), "ok"],
    }
    start = time.perf_counter()
    out, _, _ = scripted(tok, turns, [calculator, boom, sleepy], tool_timeout=0.2)
    # the sleeping tool did not hold the rollout
    assert time.perf_counter() - start < 20
    results = [c[1]["content"] for c in out.conversations]
    assert results[0] == "{'error': 'boom'}"
    assert results[1] == "{'error': 'Tool sleepy ran past its time limit of 0.2 s.'}"
    assert results[2].startswith("{'error': 'malformed tool call (not JSON")
    assert results[3] == "{'error': 'Tool abacus not found.'}"
    assert "unexpected keyword argument 'expr'" in results[4]
    assert (
        out.num_tool_failures.tolist() == [1] * 5
        and [c[-1]["content"] for c in out.conversations] == ["ok"] * 5
    )


def _trainer(kind, tok, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "12*34="}]}] * 2
    reward = lambda completions, **kwargs: [float(len(c)) for c in completions]
    common = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=96,
        num_sample_generations=0,
        disable_tqdm=True,
        max_tool_calling_iterations=1,
    )
    if kind == "grpo":
        args = GRPOConfig(beta=0.1, loss_type="grpo", entropy_coef=0.01, **common)
    else:
        args = RLOOConfig(token_level_kl=True, **common)
    trainer_class = GRPOTrainer if kind == "grpo" else RLOOTrainer
    return trainer_class(
        tiny_causal_lm(tok, max_positions=320),
        args=args,
        processing_class=tok,
        reward_funcs=reward,
        train_dataset=rows,
        tools=[calculator],
    )


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_tool_tokens_change_neither_loss_nor_gradient(kind, tok, tmp_path):
    """A rollout with a tool turn: perturbing the policy's log-probabilities and entropy, π_old and π_ref on the
    tool tokens leaves the loss and the gradient as they were."""
    trainer = _trainer(kind, tok, tmp_path)
    out, q_ids, q_mask = scripted(
        tok, {"12*34=": [call("calculator", expression="12*34"), "408"]}, [calculator], budget=96
    )
    from instruct_goose.rollout import Samples

    n = len(q_ids)
    samples = Samples(
        q_ids.repeat(2, 1),
        q_mask.repeat(2, 1),
        out.response_ids.repeat(2, 1),
        out.response_mask.repeat(2, 1),
        torch.tensor([1.0, 0.0] * n),
        [],
        [],
        torch.tensor([[1.0, 0.0] * n]),
        out.tool_mask.repeat(2, 1),
    )
    # the scripted rollout in place of sampling
    trainer.sample_and_score = lambda *a, **k: samples
    rollout, _ = trainer.sample_rollout(
        trainer.model, {"prompt": [[{"role": "user", "content": "12*34="}]]}, seed=0
    )
    tool = samples.response_mask & ~samples.tool_mask
    assert tool.sum() > 10 and torch.equal(rollout.loss_mask, samples.response_mask & samples.tool_mask)
    policy = trainer.model.train()
    # (log π, entropy) of the sampled tokens
    base = [x.detach() for x in trainer.policy_pass(policy, rollout)[:2]]

    def loss_and_grad(kept, part):
        kept = [x.clone().requires_grad_(True) for x in kept]
        losses, _ = trainer.micro_batch_loss(policy, part, 0, kept=PolicyPass(*kept))
        total = sum(losses.values())
        total.backward()
        # RLOO: no entropy term
        return total.detach(), torch.stack([torch.zeros_like(x) if x.grad is None else x.grad for x in kept])

    loss, grad = loss_and_grad(base, rollout)
    noisy = [x + torch.randn_like(x) * 5 * tool for x in base]
    perturbed = rollout[torch.arange(len(rollout))]
    for name in ("logprobs", "ref_logprobs"):
        if hasattr(perturbed, name):
            setattr(perturbed, name, getattr(perturbed, name) + 3.0 * tool)
    loss2, grad2 = loss_and_grad(noisy, perturbed)
    assert torch.allclose(loss, loss2, atol=1e-6), (loss, loss2)
    assert torch.allclose(grad, grad2, atol=1e-7)
    assert grad[:, tool].abs().max() == 0 and grad[0][~tool & samples.response_mask].abs().max() > 0
    # the entropy bonus reaches the entropy
    if kind == "grpo":
        assert grad[1][~tool & samples.response_mask].abs().max() > 0


def test_prompt_length_check_counts_the_tool_schemas(tok, tmp_path):
    """The context check renders prompts as sampling does, the tools' schemas included: a prompt that fits only
    without them is refused."""
    from instruct_goose.data import prompt_text

    trainer = _trainer("grpo", tok, tmp_path)
    prompt = [{"role": "user", "content": "12*34="}]
    with_schemas, plain = (
        len(tok(text, add_special_tokens=False).input_ids)
        for text in (trainer.prompt_texts([prompt])[0], prompt_text(tok, prompt))
    )
    assert with_schemas > plain + 10 and "calculator" in trainer.prompt_texts([prompt])[0]
    # room for the plain prompt, not for the one sampling reads
    trainer.args.response_length = 320 - (with_schemas + plain) // 2
    with pytest.raises(ValueError, match=f"the longest prompt has {with_schemas} tokens"):
        trainer.check_prompt_lengths()


def test_trl_tool_calling_example_runs_with_the_import_changed(tok, tmp_path):
    """examples/trl_style/grpo_tools.py: TRL's agent-training example (tools=[multiply]) on a tiny model whose
    chat template renders tools."""
    tok.save_pretrained(tmp_path / "model")
    tiny_causal_lm(tok, max_positions=320).save_pretrained(tmp_path / "model")
    assert (
        run_example(
            ROOT / "examples/trl_style/grpo_tools.py",
            "--model_name_or_path",
            tmp_path / "model",
            "--output_dir",
            tmp_path / "out",
            "--max_steps",
            2,
        )
        == 0
    )
    assert (tmp_path / "out" / "model.safetensors").exists()
    script = (ROOT / "examples/trl_style/grpo_tools.py").read_text()
    assert (
        "from instruct_goose import GRPOConfig, GRPOTrainer   # TRL: from trl import GRPOConfig, GRPOTrainer"
        in script
    )


SCRIPT = '''
import json, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from instruct_goose import GRPOConfig, GRPOTrainer
policy, out, accumulation = sys.argv[1], sys.argv[2], int(sys.argv[3])
resume = sys.argv[4] if len(sys.argv) > 4 else None

def calc(x: str) -> str:
    """Evaluate a product.

    Args:
        x: the product, e.g. 2*3
    """
    a, b = x.split("*")
    return str(int(a) * int(b))

calls = []
def reward(completions, num_tool_calls, **kwargs):
    calls.append(sum(num_tool_calls))
    return [len(c[-1]["content"]) / 10 + n for c, n in zip(completions, num_tool_calls)]

tokenizer, model = AutoTokenizer.from_pretrained(policy), AutoModelForCausalLM.from_pretrained(policy)
rows = [{"prompt": [{"role": "user", "content": f"{a}*{b}="}]} for a in range(2, 10) for b in range(2, 6)]
args = GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation, num_generations=2,
                  max_completion_length=96, local_rollout_forward_batch_size=4, num_iterations=2, beta=0.05, max_steps=4,
                  save_steps=int(os.environ.get("SAVE_STEPS", "2")), logging_steps=1, num_sample_generations=0, disable_tqdm=True,
                  learning_rate=1e-3, max_tool_calling_iterations=1, resume_from_checkpoint=resume)
trainer = GRPOTrainer(model, args=args, processing_class=tokenizer, reward_funcs=reward, train_dataset=rows, tools=[calc])
trainer.train()
rank = os.environ.get("RANK", "0")
torch.save(trainer.model.state_dict(), f"{out}/weights{rank}.pt")
json.dump({"history": trainer.loop.state.history, "calls": calls}, open(f"{out}/result{rank}.json", "w"))
'''


@pytest.fixture(scope="module")
def caller_dir(tmp_path_factory):
    """A tiny model SFT'd to open every answer with a call of `calc` on its problem, saved with the training
    script."""
    from instruct_goose import SFTConfig, SFTTrainer

    where = tmp_path_factory.mktemp("caller")
    tok = with_tool_template(task_tokenizer())
    schema = [{"type": "function", "function": {"name": "calc", "parameters": {"properties": {"x": {}}}}}]
    problems = [f"{a}*{b}=" for a in range(2, 10) for b in range(2, 10)]
    heads = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], tools=schema, tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    rows = [{"prompt": h, "completion": call("calc", x=p.rstrip("="))} for h, p in zip(heads, problems)]
    sft = SFTTrainer(
        tiny_causal_lm(tok, seed=0),
        args=SFTConfig(
            output_dir=str(where / "sft"),
            learning_rate=3e-3,
            per_device_train_batch_size=16,
            # 240 steps: ~80 % of its answers are well-formed calls (80 steps: ~8 %, so a 4-step
            # run could see none)
            max_steps=240,
            logging_steps=10**6,
            disable_tqdm=True,
        ),
        train_dataset=rows,
        processing_class=tok,
    )
    sft.train()
    model = sft.model
    model.save_pretrained(where / "model")
    tok.save_pretrained(where / "model")
    (where / "train.py").write_text(SCRIPT)
    return where


def _run_tools(caller_dir, out, processes, accumulation, resume=None, save_steps=2, background=False):
    env = {
        **os.environ,
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "SAVE_STEPS": str(save_steps),
    }
    script = [str(caller_dir / "train.py"), str(caller_dir / "model"), str(out), str(accumulation)] + (
        [resume] if resume else []
    )
    command = (
        [sys.executable] + script
        if processes == 1
        else [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node",
            str(processes),
        ]
        + script
    )
    if background:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    return torch.load(out / "weights0.pt"), json.loads((out / "result0.json").read_text())


def _same(a, b, what, eps=1e-6):
    worst = max((a[0][k] - b[0][k]).abs().max().item() for k in a[0])
    assert worst <= eps, f"{what}: weights differ by {worst}"
    for row_a, row_b in zip(a[1]["history"], b[1]["history"]):
        for key in ("reward", "kl", "entropy", "grad_norm", "lr"):
            if key in row_a:
                assert abs(row_a[key] - row_b[key]) <= eps * max(1, abs(row_a[key])), (
                    what,
                    key,
                    row_a[key],
                    row_b[key],
                )


@pytest.mark.slow
def test_tools_two_processes_equal_one(caller_dir, tmp_path):
    """GRPO with tools (the model calls them: counted in every rollout), 1 process × 2 micro-batches against 2
    processes × 1."""
    one = _run_tools(caller_dir, tmp_path / "one", 1, 2)
    two = _run_tools(caller_dir, tmp_path / "two", 2, 1)
    assert sum(one[1]["calls"]) > 0, "the model never called the tool: the test would prove nothing"
    assert len(one[1]["history"]) == len(two[1]["history"]) == 4
    _same(one, two, "1 process vs 2")


@pytest.mark.slow
def test_tools_killed_run_resumes_to_the_same_result(caller_dir, tmp_path):
    """SIGKILL after the first checkpoint, resume: the weights and the logged metrics equal those of the run
    never stopped."""
    import signal

    straight = _run_tools(caller_dir, tmp_path / "straight", 1, 2, save_steps=1)
    process = _run_tools(caller_dir, tmp_path / "killed", 1, 2, save_steps=1, background=True)
    deadline = time.time() + 600
    while not (tmp_path / "killed" / "checkpoint-1").is_dir():
        assert process.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    time.sleep(0.3)
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not (tmp_path / "killed" / "checkpoint-4").exists(), "killed too late to test a resume"
    resumed = _run_tools(caller_dir, tmp_path / "killed", 1, 2, resume="latest", save_steps=1)
    assert sum(straight[1]["calls"]) > 0
    _same(straight, resumed, "straight vs killed and resumed")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("eps", "step_time")} for r in rows]
    assert strip(straight[1]["history"]) == strip(resumed[1]["history"])


@pytest.mark.parametrize("flag", ["padding_free", "shared_prefix"])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_padding_free_reads_tool_turns_as_padded(kind, flag, tok, tmp_path):
    """With `padding_free`, or `shared_prefix` (the two rows share their prompt), a rollout with a tool turn (its
    result tokens real context inside the response) gives the padded rollout's and micro-batch's numbers: log
    π and entropy on every real token, and each loss term."""
    from instruct_goose.rollout import Samples

    trainer = _trainer(kind, tok, tmp_path)
    out, q_ids, q_mask = scripted(
        tok, {"12*34=": [call("calculator", expression="12*34"), "408"]}, [calculator], budget=96
    )
    samples = Samples(
        q_ids.repeat(2, 1),
        q_mask.repeat(2, 1),
        out.response_ids.repeat(2, 1),
        out.response_mask.repeat(2, 1),
        torch.tensor([1.0, 0.0]),
        [],
        [],
        torch.tensor([[1.0, 0.0]]),
        out.tool_mask.repeat(2, 1),
    )
    # tool tokens, and padding
    assert (samples.response_mask & ~samples.tool_mask).sum() > 10 and (~samples.response_mask).any()
    trainer.sample_and_score = lambda *a, **k: samples
    policy, real, results = trainer.model.train(), samples.response_mask, []
    import instruct_goose.agent as agent
    from unittest import mock

    shared, forward = [], agent.shared_prompt_forward
    for packed in (False, True):
        setattr(trainer.args, flag, packed)
        torch.manual_seed(0)
        with mock.patch.object(
            agent, "shared_prompt_forward", lambda *a, **k: shared.append(packed) or forward(*a, **k)
        ):
            rollout, _ = trainer.sample_rollout(
                policy, {"prompt": [[{"role": "user", "content": "12*34="}]]}, seed=0
            )
            current = trainer.policy_pass(policy, rollout)
            losses, _ = trainer.micro_batch_loss(policy, rollout, 0)
        results.append(([x[real].detach() for x in current[:2]], {k: v.detach() for k, v in losses.items()}))
    # the prompt ran once in each pass
    assert shared == ([True] * len(shared) if flag == "shared_prefix" else []) and (
        shared or flag == "padding_free"
    )
    (padded, padded_losses), (packed, packed_losses) = results
    for a, b in zip(padded, packed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert padded_losses.keys() == packed_losses.keys()
    for k in padded_losses:
        torch.testing.assert_close(packed_losses[k], padded_losses[k], rtol=1e-5, atol=1e-6)
