"""Every public name of every module is documented with `show_doc` in exactly one notebook cell (docs_check.py
checks the built site)."""

import importlib
import json
import re
from pathlib import Path

import pytest

import instruct_goose

NBS = Path(__file__).resolve().parents[1] / "nbs"
SHOW_DOC = re.compile(r"^show_doc\(([\w.]+)", re.MULTILINE)


def show_doc_cells() -> dict[str, list[str]]:
    "{name: [notebook, ...]}, one entry per show_doc(name) call in the notebooks."
    where = {}
    for path in sorted(NBS.glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                for name in SHOW_DOC.findall("".join(cell["source"])):
                    where.setdefault(name, []).append(path.name)
    return where


def documented() -> set[str]:
    return set(show_doc_cells())


def public_modules():
    return sorted(
        p.stem for p in Path(instruct_goose.__file__).parent.glob("*.py") if not p.stem.startswith("_")
    )


@pytest.mark.parametrize("module", public_modules())
def test_every_public_name_has_show_doc(module):
    names = importlib.import_module(f"instruct_goose.{module}").__all__
    missing = sorted(set(names) - documented())
    assert not missing, f"instruct_goose.{module}: no show_doc(...) cell for {missing}"


@pytest.mark.parametrize("module", public_modules())
def test_no_public_name_is_documented_twice(module):
    where = show_doc_cells()
    twice = {
        n: where[n]
        for n in importlib.import_module(f"instruct_goose.{module}").__all__
        if len(where.get(n, [])) > 1
    }
    assert not twice, f"instruct_goose.{module}: documented more than once (one API entry per name): {twice}"


def test_package_exports_every_module():
    # the command line stays in its own module
    for module in set(public_modules()) - {"cli"}:
        for name in importlib.import_module(f"instruct_goose.{module}").__all__:
            assert getattr(instruct_goose, name, None) is not None, (
                f"instruct_goose.{name} (from {module}) is not exported at top level"
            )
