"Fixtures shared by the test files."

import os
import runpy
import subprocess
import sys
from pathlib import Path

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


def with_bitsandbytes(env: dict) -> dict:
    """`env` with bitsandbytes on `PYTHONPATH`: `make install` keeps it apart from the venv, in .venv/bnb (peft
    imports it whenever it is installed, 2 s more for every process)."""
    bnb = Path(__file__).resolve().parents[1] / ".venv" / "bnb"
    assert (bnb / "bitsandbytes").is_dir(), (
        f"{bnb} has no bitsandbytes: run `make install` (it installs bitsandbytes==0.50.2 there)"
    )
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(bnb), env.get("PYTHONPATH")]))}


def exit_code(stop: SystemExit) -> int:
    """The status a process would exit with after `stop`: its code, 0 for None, 1 for a message (as
    `sys.exit('text')`)."""
    return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)


@pytest.fixture
def goose_here(capsys, monkeypatch):
    """`goose` run in this process through `main`, as a `CompletedProcess` (returncode, stdout, stderr): the same
    command without ~10 s of start-up."""
    from instruct_goose.cli import main

    def run(*args, cwd=None):
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as stop:
            code = exit_code(stop)
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["goose", *args], code, out.out, out.err)

    return run


def run_here(script: Path, *args, env: dict | None = None) -> int:
    """A training script run in this process as its subprocess twin would run it (`env` added to the environment,
    one intra-op thread as the subprocesses get with OMP_NUM_THREADS=1), for the reference run a subprocess
    run is compared with: no second interpreter to start (~10 s of imports on 2 cores)."""
    import torch
    from unittest import mock

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.dict(os.environ, env or {}):
            return run_example(script, *args)
    finally:
        torch.set_num_threads(threads)


def run_example(script: Path, *args) -> int:
    """Run a script as `python script args` would, in this process (its folder first on `sys.path`, `sys.argv`
    its own); returns its exit code."""
    argv, path = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = [str(script), *map(str, args)], [str(script.parent)]
    try:
        runpy.run_path(str(script), run_name="__main__")
        return 0
    except SystemExit as stop:
        return exit_code(stop)
    finally:
        sys.argv, sys.path[:] = argv, path
