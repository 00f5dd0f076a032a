"Fixtures shared by the test files."
import subprocess

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


@pytest.fixture
def goose_here(capsys, monkeypatch):
    "`goose` run in this process through `main`, as a `CompletedProcess` (returncode, stdout, stderr): the same command without ~10 s of start-up."
    from instruct_goose.cli import main
    def run(*args, cwd=None):
        if cwd is not None: monkeypatch.chdir(cwd)
        capsys.readouterr()
        try: main(list(args)); code = 0
        except SystemExit as e: code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["goose", *args], code, out.out, out.err)
    return run
