"""One constructor for PPO, RLOO and GRPO (issue 17): TRL's keywords, the seed's positional contract, the old names as
aliases, one-line errors for the old argument orders, `model` as a path / causal LM / Agent, `peft_config` from Python,
and 🤗 callbacks through an on-policy run."""

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, TrainerCallback

from instruct_goose import (
    Agent,
    AdapterOffReference,
    GRPOConfig,
    GRPOTrainer,
    RLHFConfig,
    RLHFTrainer,
    RLOOConfig,
    RLOOTrainer,
    create_reference_model,
    task_tokenizer,
    tiny_causal_lm,
)
from instruct_goose.loop import read_metrics

TRAINERS = {
    "ppo": (RLHFTrainer, RLHFConfig),
    "rloo": (RLOOTrainer, RLOOConfig),
    "grpo": (GRPOTrainer, GRPOConfig),
}
PROMPTS = [{"prompt": p} for p in ("the film was", "I thought it", "a goose", "the plot")] * 4


def length(prompts, completions):
    return [len(c) / 10 for c in completions]


def config(algo, tmp_path, **overrides):
    "A tiny run: 2 steps of 4 responses (2 prompts × 2 samples for RLOO/GRPO), 6 tokens each."
    settings = dict(
        output_dir=str(tmp_path / algo),
        per_device_train_batch_size=4,
        max_steps=2,
        disable_tqdm=True,
        num_sample_generations=0,
        learning_rate=1e-2,
        num_ppo_epochs=1,
        logging_steps=1,
    )
    settings |= dict(max_completion_length=6, num_generations=2) if algo != "ppo" else dict(response_length=6)
    if algo == "grpo":
        settings.pop("num_ppo_epochs")
    return TRAINERS[algo][1](**{**settings, **overrides})


def trl_script(algo, model, tmp_path, **extra):
    "The same keyword script for the three trainers, as TRL users write it."
    trainer_class, _ = TRAINERS[algo]
    return trainer_class(
        model=model,
        args=config(algo, tmp_path),
        processing_class=task_tokenizer(),
        train_dataset=PROMPTS,
        eval_dataset=PROMPTS[:2],
        reward_funcs=[length],
        **extra,
    )


@pytest.mark.parametrize("algo", TRAINERS)
def test_one_keyword_script_trains_every_on_policy_trainer(algo, tmp_path):
    trainer = trl_script(algo, tiny_causal_lm(task_tokenizer(), seed=0), tmp_path)
    assert trainer.eval_dataset.num_rows == 2 and trainer.callbacks == []
    trainer.train()
    assert [row["step"] for row in read_metrics(tmp_path / algo)] == [1, 2]


def test_positional_seed_contract_and_old_names(tmp_path):
    model = tiny_causal_lm(task_tokenizer(), seed=0)
    agent = Agent(model)
    reference = create_reference_model(agent)
    seed = RLHFTrainer(
        agent,
        reference,
        config("ppo", tmp_path),
        tokenizer=task_tokenizer(),
        reward_model=length,
        train_dataset=PROMPTS,
    )
    assert seed.model is agent and seed.ref_model is reference and seed.config.response_length == 6
    assert seed.tokenizer is not None and seed.reward_model.functions == [length]
    old = RLOOTrainer(
        model, None, config=config("rloo", tmp_path), tokenizer=task_tokenizer(), reward_model=length
    )
    assert old.config.rloo_k == 2 and old.samples_per_prompt == 2
    with pytest.raises(TypeError, match="`config` is the old name of `args`: give only `args`"):
        RLHFTrainer(agent, args=RLHFConfig(), config=RLHFConfig())
    with pytest.raises(TypeError, match="`reward_model` is the old name of `reward_funcs`"):
        GRPOTrainer(model, reward_funcs=length, reward_model=length)


def test_old_argument_orders_fail_in_one_line(tmp_path):
    tok, model = task_tokenizer(), tiny_causal_lm(task_tokenizer(), seed=0)
    cases = [  # RLOO's old order; TRL's GRPOTrainer(model, reward_funcs); a config of another algorithm
        (
            lambda: RLOOTrainer(config("rloo", tmp_path), tok, model, None, length, PROMPTS),
            r"RLOOTrainer\(model, ref_model=None, args=None, processing_class=None, train_dataset=None, "
            r".*the "
            r"config goes in `args=`",
        ),
        (
            lambda: GRPOTrainer(model, length),
            r"GRPOTrainer's second argument is `ref_model` \(a model or None\), got a function: rewards go "
            r"in reward_funcs=",
        ),
        (lambda: GRPOTrainer(model, [length], GRPOConfig()), "got a list: rewards go in reward_funcs="),
        (
            lambda: RLOOTrainer(model, args=config("grpo", tmp_path)),
            "`args` must be a RLOOConfig, got a GRPOConfig",
        ),
    ]
    for make, message in cases:
        with pytest.raises(TypeError, match=message) as caught:
            make()
        assert "\n" not in str(caught.value)


def test_model_as_path_causal_lm_or_agent(policy_dir, tmp_path):
    for algo in TRAINERS:
        trainer_class, _ = TRAINERS[algo]
        from_path = trainer_class(
            str(policy_dir), args=config(algo, tmp_path / "path"), reward_funcs=length, train_dataset=PROMPTS
        )
        # loaded from the path: processing_class=None
        assert from_path.tokenizer is not None
        lm = from_path.model.model if algo == "ppo" else from_path.model
        assert type(lm).__name__ == "GPT2LMHeadModel"
        # a path-loaded tokenizer samples (prompts padded left)
        from_path.train()
        agent = Agent(tiny_causal_lm(task_tokenizer(), seed=0))
        from_agent = trainer_class(
            agent, args=config(algo, tmp_path / "agent"), processing_class=task_tokenizer()
        )
        assert (from_agent.model is agent) if algo == "ppo" else (from_agent.model is agent.model)
    ppo = RLHFTrainer(AutoModelForCausalLM.from_pretrained(policy_dir), args=config("ppo", tmp_path / "lm"))
    # a value head is added to a causal LM
    assert isinstance(ppo.model, Agent)
    # beta = 0: no reference
    assert GRPOTrainer(str(policy_dir), args=config("grpo", tmp_path / "g")).ref_model is None


def lora_parameters(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_peft_config_trains_adapters_only_against_the_adapter_off_base(algo, tmp_path):
    peft = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    torch.manual_seed(0)
    trainer = trl_script(algo, tiny_causal_lm(task_tokenizer(), seed=0), tmp_path, peft_config=peft)
    assert isinstance(trainer.ref_model, AdapterOffReference)
    before = lora_parameters(trainer.model)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = lora_parameters(trainer.model)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    expected = {n for n in before if "lora_" in n or n.startswith("value_head")}
    assert moved == expected == trainable, (sorted(moved ^ expected)[:4], sorted(trainable ^ expected)[:4])
    lm = trainer.model.model if algo == "ppo" else trainer.model
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad(), lm.disable_adapter():
        base = lm(input_ids=ids).logits
    # π_ref: the adapters off, no second copy
    torch.testing.assert_close(trainer.ref_model(input_ids=ids).logits, base)


class Steps(TrainerCallback):
    "Records what the callbacks hear, and stops the run after `stop_at` steps."

    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("begin", state.global_step, state.max_steps))

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step_begin", state.global_step))

    # the gradients are there to read
    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.events.append(
            (
                "pre_optimizer",
                all(p.grad is not None for group in optimizer.param_groups for p in group["params"]),
            )
        )

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.events.append(("optimizer", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", state.global_step, logs["step"]))

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step", state.global_step))
        if state.global_step == self.stop_at:
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("end", state.global_step, len(state.log_history)))


@pytest.mark.parametrize("algo", TRAINERS)
def test_callbacks_see_each_step_and_can_stop_the_run(algo, tmp_path):
    steps = Steps(stop_at=1)
    trainer_class, _ = TRAINERS[algo]
    trainer = trainer_class(
        tiny_causal_lm(task_tokenizer(), seed=0),
        args=config(algo, tmp_path, max_steps=3, num_mini_batches=2),
        processing_class=task_tokenizer(),
        train_dataset=PROMPTS,
        reward_funcs=length,
        callbacks=[steps],
    )
    # returns normally: no TrainingInterrupted
    trainer.train()
    # 2 minibatches: 2 optimizer steps in step 1
    optimizer_steps = [("pre_optimizer", True), ("optimizer", 0)] * 2
    assert steps.events == [
        ("begin", 0, 3),
        ("step_begin", 0),
        *optimizer_steps,
        ("log", 1, 1),
        ("step", 1),
        ("save", 1),
        ("end", 1, 1),
    ]
    assert sorted(p.name for p in (tmp_path / algo).glob("checkpoint-*")) == ["checkpoint-1"]
    # the model is saved as at the end of a run
    assert (tmp_path / algo / "model.safetensors").is_file()


def test_cli_and_yaml_take_either_name(tmp_path, capsys):
    from instruct_goose.cli import GRPOCommand, RLOOCommand, parse_config

    flags = parse_config(RLOOCommand, ["--rloo_k", "2", "--beta", "0.1"], "goose rloo")
    assert (flags.num_generations, flags.rloo_k, flags.kl_coef, flags.beta) == (2, 2, 0.1, 0.1)
    settings = tmp_path / "rloo.yaml"
    # YAML 1.1 reads 1e-2 as text
    settings.write_text("num_generations: 2\nmax_completion_length: '8'\nkl_coef: 1e-2\n")
    yaml = parse_config(RLOOCommand, ["--config", str(settings)], "goose rloo")
    assert (yaml.rloo_k, yaml.response_length, yaml.beta) == (2, 8, 0.01)
    grpo = parse_config(GRPOCommand, ["--num_ppo_epochs", "2"], "goose grpo")
    # GRPO's defaults: no KL term
    assert (grpo.num_iterations, grpo.beta, grpo.kl_coef) == (2, 0.0, 0.0)
    with pytest.raises(SystemExit):
        parse_config(
            RLOOCommand, ["--num_generations", "3", "--rloo_k", "8"], "goose rloo"
        )  # both off the default
    assert "`num_generations`=3 and `rloo_k`=8 name one setting twice" in capsys.readouterr().err


def test_trl_ppo_names_value_model_and_token_id_prompts(tmp_path):
    """TRL's PPO script: PPOConfig/PPOTrainer, a separate value_model, prompts given as token ids, a 🤗 classifier
    as reward, save_model."""
    from transformers import AutoModelForSequenceClassification, GPT2Config
    from instruct_goose import PPOConfig, PPOTrainer, RewardModel

    tok = task_tokenizer()
    assert PPOConfig is RLHFConfig and PPOTrainer is RLHFTrainer
    # a 🤗 GPT2ForSequenceClassification
    classifier = RewardModel(tiny_causal_lm(tok, seed=1)).model
    value_model = AutoModelForSequenceClassification.from_config(GPT2Config(**classifier.config.to_dict()))
    ids = [{"input_ids": tok(row["prompt"]).input_ids} for row in PROMPTS]
    trainer = PPOTrainer(
        args=config("ppo", tmp_path),
        processing_class=tok,
        model=tiny_causal_lm(tok, seed=0),
        reward_funcs=classifier,
        value_model=value_model,
        train_dataset=ids,
    )
    # the text back, tokenized again by the trainer
    assert list(trainer.train_dataset["prompt"]) == [row["prompt"] for row in PROMPTS]
    # values from the separate critic's trunk
    assert trainer.model.value_model is not None
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    trained = trainer.model.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in saved.state_dict().items())
    assert (tmp_path / "saved" / "value_head.safetensors").is_file()
    with pytest.raises(ValueError, match="has its critic already"):
        PPOTrainer(Agent(tiny_causal_lm(tok, seed=0)), value_model=value_model)


@pytest.mark.parametrize("algo", ["rloo", "grpo"])
def test_save_model_writes_the_trained_policy(algo, tmp_path):
    trainer = trl_script(algo, tiny_causal_lm(task_tokenizer(), seed=0), tmp_path)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in saved.items())


@pytest.mark.parametrize("algo", ["grpo", "sft"])
def test_train_takes_resume_from_checkpoint_as_hf_trainer_does(algo, tmp_path):
    """🤗's `trainer.train(resume_from_checkpoint=True)`: the newest checkpoint in `output_dir` (a 2-step run
    extended to 3 steps: steps 1-2 restored, step 3 run)."""
    from instruct_goose import SFTConfig, SFTTrainer

    tok = task_tokenizer()

    def make(out, steps):
        if algo == "sft":
            args = SFTConfig(
                output_dir=str(out),
                max_steps=steps,
                save_steps=1,
                per_device_train_batch_size=2,
                disable_tqdm=True,
                learning_rate=1e-2,
                logging_steps=1,
            )
            return SFTTrainer(
                tiny_causal_lm(tok, seed=0),
                args,
                [{"prompt": "a goose", "completion": " says honk"}] * 8,
                processing_class=tok,
            )
        return GRPOTrainer(
            tiny_causal_lm(tok, seed=0),
            args=config(algo, out, max_steps=steps, save_steps=1),
            processing_class=tok,
            train_dataset=PROMPTS,
            reward_funcs=[length],
        )

    make(tmp_path / "stopped", 2).train()
    resumed = make(tmp_path / "stopped", 3)
    resumed.train(resume_from_checkpoint=True)
    assert [row["step"] for row in read_metrics(resumed.args.output_dir)] == [1, 2, 3]
    assert resumed.loop.state.step == 3
    with pytest.raises(TypeError, match="`resume_from_checkpoint` must be True, a checkpoint path or None"):
        make(tmp_path / "bad", 1).train(resume_from_checkpoint=2)
