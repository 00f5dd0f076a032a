"Every public name of every module is documented with `show_doc` in some notebook."
import importlib
import json
import re
from pathlib import Path

import pytest

import instruct_goose

NBS = Path(__file__).resolve().parents[1] / "nbs"
SHOW_DOC = re.compile(r"^show_doc\(([\w.]+)", re.MULTILINE)


def documented() -> set[str]:
    names = set()
    for path in NBS.glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code": names.update(SHOW_DOC.findall("".join(cell["source"])))
    return names


def public_modules():
    return sorted(p.stem for p in Path(instruct_goose.__file__).parent.glob("*.py") if not p.stem.startswith("_"))


@pytest.mark.parametrize("module", public_modules())
def test_every_public_name_has_show_doc(module):
    names = importlib.import_module(f"instruct_goose.{module}").__all__
    missing = sorted(set(names) - documented())
    assert not missing, f"instruct_goose.{module}: no show_doc(...) cell for {missing}"


def test_package_exports_every_module():
    for module in set(public_modules()) - {"cli"}:                    # the command line stays in its own module
        for name in importlib.import_module(f"instruct_goose.{module}").__all__:
            assert getattr(instruct_goose, name, None) is not None, f"instruct_goose.{name} (from {module}) is not exported at top level"
