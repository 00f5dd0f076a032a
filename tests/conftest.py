"Fixtures shared by the test files."
import pytest

from instruct_goose import task_tokenizer, tiny_causal_lm


@pytest.fixture(scope="session")
def policy_dir(tmp_path_factory):
    "A tiny GPT-2 on the task's tokenizer, saved like a checkpoint from the Hub (read-only for the tests)."
    path = tmp_path_factory.mktemp("policy")
    tokenizer = task_tokenizer()
    tiny_causal_lm(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
