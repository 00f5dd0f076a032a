"""GRPO with and without a calculator tool on two-digit multiplication (the tools tutorial's longer run).

    PYTHONPATH=. OMP_NUM_THREADS=1 python examples/tools_calculator.py --sft-steps 400 --grpo-steps 30 --seed 0

Prints held-out accuracy (greedy and sampled) and tool calls per answer: after SFT on worked calls, after GRPO with the
tool, after GRPO without it.
"""
import argparse, contextlib, copy, io, json, logging, tempfile, time

import torch
from transformers.utils import logging as hf_logging

from instruct_goose import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer, arithmetic_task, tiny_causal_lm, train_tokenizer
from instruct_goose.data import encode_prompts
from instruct_goose.tools import Toolbox, generate_with_tools, with_tool_template


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of whole numbers with + - *.

    Args:
        expression: the expression, e.g. 12*34
    """
    if not expression or set(expression) - set("0123456789+-* "): raise ValueError(f"cannot evaluate {expression!r}")
    return str(eval(expression, {"__builtins__": {}}, {}))


def correct(completions, answer, **kwargs) -> list[float]:
    "1 when the last assistant turn is exactly the answer."
    return [float(c[-1]["content"].strip() == str(a)) for c, a in zip(completions, answer)]


def worked_call(prompt: str, answer: str) -> list[dict]:
    "A demonstration: the user's problem, the assistant's call, the tool's result, the answer."
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": prompt.rstrip("=")}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "name": "calculator", "content": answer},
            {"role": "assistant", "content": answer}]


def make_tokenizer(box: Toolbox, rows) -> "PreTrainedTokenizerFast":
    "Merges learned from the template's words (every number one digit, so digits stay one token each), ChatML, tool-call tokens, the tool template."
    text = ('<|im_start|>system\ntools: calculator(expression)<|im_end|>\n<|im_start|>user\n7*7=<|im_end|>\n<|im_start|>assistant\n'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "7*7"}}</tool_call><|im_end|>\n<|im_start|>tool\n7<|im_end|>\n')
    return with_tool_template(train_tokenizer([text] * 50 + ["0123456789+-*="], vocab_size=360))


@torch.no_grad()
def accuracy(model, tokenizer, box: Toolbox | None, data, greedy: bool, seed: int = 0) -> dict:
    "Held-out accuracy and tool calls per answer, sampled with `box`'s tools (None: no tools)."
    prompts = [[{"role": "user", "content": p}] for p in data["prompt"]]
    render = (lambda p: tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)) if box is None else (lambda p: box.prompt_text(tokenizer, p))
    ids, mask = encode_prompts(tokenizer, [render(p) for p in prompts])
    torch.manual_seed(seed)
    extra = {"do_sample": False} if greedy else {}
    tools = box.tools if box is not None else [calculator]
    out = generate_with_tools(model.eval(), tokenizer, ids, mask, tools, 100, tokenizer.eos_token_id, tokenizer.pad_token_id,
                              max_tool_calling_iterations=1 if box is not None else 0, **extra)
    scores = correct(out.conversations, data["answer"])
    return {"accuracy": sum(scores) / len(scores), "calls": out.num_tool_calls.float().mean().item(), "sample": out.conversations[0]}


def main(sft_steps: int, grpo_steps: int, seed: int, n_demos: int, quiet: bool = True):
    hf_logging.disable_progress_bar(); logging.getLogger("accelerate").setLevel(logging.ERROR)
    work, box = tempfile.mkdtemp(), Toolbox([calculator], max_tool_calling_iterations=1)
    task = arithmetic_task(2000, seed=seed, max_operand=99, ops="*")
    held_out, train = task.select(range(100)), task.select(range(100, 2000))
    tokenizer = make_tokenizer(box, train)
    demos = train.select(range(n_demos))
    prompt_texts = [box.prompt_text(tokenizer, [{"role": "user", "content": p}]) for p in demos["prompt"]]
    wholes = [tokenizer.apply_chat_template([{"role": "user", "content": p}] + worked_call(p, a), tools=box.schemas, tokenize=False)
              for p, a in zip(demos["prompt"], demos["answer"])]
    sft_rows = [{"prompt": h, "completion": w[len(h):].removesuffix("<|im_end|>\n")} for h, w in zip(prompt_texts, wholes)]
    t = time.perf_counter()
    sft = SFTTrainer(tiny_causal_lm(tokenizer, seed=seed, max_positions=192),
                     args=SFTConfig(output_dir=f"{work}/sft", learning_rate=3e-3, per_device_train_batch_size=32, max_steps=sft_steps,
                                    warmup_steps=10, max_length=160, logging_steps=10**6, disable_tqdm=True, seed=seed),
                     train_dataset=sft_rows, processing_class=tokenizer)
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext(): sft.train()
    sft_model = sft.model
    results = {"sft_seconds": time.perf_counter() - t, "after SFT": accuracy(sft_model, tokenizer, box, held_out, False),
               "after SFT, no tool": accuracy(sft_model, tokenizer, None, held_out, False)}
    for k in ("sft_seconds", "after SFT", "after SFT, no tool"): print(k, json.dumps(results[k], default=str)[:300], flush=True)
    rows = [{"prompt": [{"role": "user", "content": p}], "answer": a} for p, a in zip(train["prompt"], train["answer"])]
    for label, tools in (("with the tool", [calculator]), ("without it", None)):
        args = GRPOConfig(output_dir=f"{work}/{label.replace(' ', '_')}", num_generations=8, per_device_train_batch_size=32, max_completion_length=100,
                          max_prompt_length=64, learning_rate=1e-3, max_steps=grpo_steps, num_sample_generations=0, disable_tqdm=True,
                          seed=seed, max_tool_calling_iterations=1 if tools else None, logging_steps=1)
        trainer = GRPOTrainer(copy.deepcopy(sft_model), reward_funcs=correct, args=args, train_dataset=rows, processing_class=tokenizer, tools=tools)
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext(): trainer.train()
        results[f"GRPO {label}"] = {**accuracy(trainer.model, tokenizer, box if tools else None, held_out, False),
                                    "seconds": time.perf_counter() - t, "reward": [r["reward"] for r in trainer.loop.state.history]}
        print(f"GRPO {label}", json.dumps(results[f"GRPO {label}"], default=str)[:600], flush=True)
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--sft-steps", type=int, default=400); p.add_argument("--grpo-steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0); p.add_argument("--demos", type=int, default=300)
    a = p.parse_args()
    main(a.sft_steps, a.grpo_steps, a.seed, a.demos)
