"The demo's PPO run, assembled from the math core alone, learns its task."

import importlib.util
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "examples" / "bandit_ppo.py"


def load_demo():
    spec = importlib.util.spec_from_file_location("bandit_ppo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reward_rises_towards_the_optimum():
    history = load_demo().train(steps=25, verbose=False)
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    # a uniform policy over 7 tokens scores about 0 (few honks, often no <eos>); the optimum is 5
    assert first < 1.5, history
    assert last > 4.0, history
