"""dev/docs.py turns a processed notebook into a Markdown page (no nbdev_proc_nbs, no MkDocs: runs in well
under a second)."""

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("docs", Path(__file__).resolve().parents[1] / "dev" / "docs.py")
docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs)

URL = "https://instruct-goose.github.io/instruct_goose/"
SHOW_DOC_MD = """---

[source](https://github.com/instruct-goose/instruct_goose/blob/main/instruct_goose/losses.py#L132){target="_blank" style="float:right; font-size:smaller"}

### PPOLoss.forward

```python

def forward(
    advantages:Float[Tensor, 'batch resp'], # Â_t from [`compute_gae`](https://instruct-goose.github.io/instruct_goose/losses.html#compute_gae)
)->tuple: # (loss, policy_loss, value_loss, ratios, clipfrac)


```

*Call self as a function.*"""

NB = {
    "cells": [
        {
            "cell_type": "raw",
            "metadata": {},
            "source": [
                "---\n",
                "description: 'Pure functions on tensors, each beside its equation.'\n",
                "output-file: losses.html\n",
                "title: 'Losses: KL penalty and PPO'\n",
                "\n",
                "---\n",
                "\n",
            ],
        },
        {
            "cell_type": "markdown",
            "metadata": {},
            "source": [
                "## The clipped PPO objective\n",
                "\n",
                "$$L^{CLIP}(\\phi) = \\hat{\\mathbb{E}}_t[\\min(\\rho_t \\hat A_t, \\cdot)]$$\n",
                "\n",
                "[`PPOLoss`](https://instruct-goose.github.io/instruct_goose/losses.html#ppoloss) with "
                "$\\epsilon$.",
            ],
        },
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": [
                "#| code-fold: show\n",
                "#| code-summary: \"Exported source\"\n",
                "class PPOLoss(nn.Module):\n",
                "    pass",
            ],
        },
        {
            "cell_type": "code",
            "metadata": {},
            "execution_count": 3,
            "source": ["#| echo: false\n", "#| output: asis\n", "show_doc(PPOLoss.forward)"],
            "outputs": [
                {
                    "output_type": "execute_result",
                    "execution_count": 3,
                    "metadata": {},
                    "data": {
                        "text/markdown": SHOW_DOC_MD,
                        "text/plain": "<nbdev.showdoc.BasicMarkdownRenderer>",
                    },
                }
            ],
        },
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "loss_fn = PPOLoss(epsilon=0.2)",
        },
    ]
}


def test_notebook_to_markdown():
    md = docs.notebook_to_markdown(NB, pages={"losses", "core"}, url=URL)
    # the raw front matter becomes the page's metadata, its title and its description
    assert md.startswith(
        "---\ndescription: Pure functions on tensors, each beside its equation.\ntitle: 'Losses: KL penalty "
        "and PPO'\n---\n"
    )
    assert "\n# Losses: KL penalty and PPO\n" in md
    assert "Pure functions on tensors, each beside its equation.\n{ .page-description }" in md
    # no directive line and no show_doc call is left; `echo: false` shows only the output
    assert "#|" not in md and "show_doc(" not in md and "code-fold" not in md
    # exported code sits in an open box titled by its code-summary; example code is a plain python block
    assert (
        '???+ abstract "Exported source"\n\n    ```python\n    class PPOLoss(nn.Module):\n        pass\n    '
        '```'
    ) in md
    assert "```python\nloss_fn = PPOLoss(epsilon=0.2)\n```" in md
    # the show_doc markdown is kept: source link with its attributes, heading with nbdev's anchor, shapes,
    # docstring
    assert (
        '[source](https://github.com/instruct-goose/instruct_goose/blob/main/instruct_goose/losses.py#L132){target="_blank"'
        in md
    )
    assert "### PPOLoss.forward { #ppoloss.forward .api }" in md
    assert (
        "```python\ndef forward(\n    advantages:Float[Tensor, 'batch resp'], # Â_t from "
        "compute_gae\n)->tuple:"
    ) in md
    assert "clipfrac)\n```\n\n*Call self as a function.*" in md
    # markdown cells are kept as they are, math included; links to documented names point at this site's pages
    assert "$$L^{CLIP}(\\phi) = \\hat{\\mathbb{E}}_t[\\min(\\rho_t \\hat A_t, \\cdot)]$$" in md
    assert "[`PPOLoss`](losses.md#ppoloss) with $\\epsilon$." in md
    assert (
        md.index("## The clipped PPO objective")
        < md.index("class PPOLoss")
        < md.index("### PPOLoss.forward")
        < md.index("loss_fn =")
    )


def test_directives_and_hidden_cells():
    assert docs.directives('#| code-summary: "Exported source"\n#| hide\nx = 1') == {
        "code-summary": "Exported source",
        "hide": "",
    }
    cells = [
        {"cell_type": "code", "metadata": {}, "outputs": [], "source": "#| hide\nsecret = 1"},
        {"cell_type": "code", "metadata": {}, "outputs": [], "source": "#| include: false\nsecret = 2"},
    ]
    assert "secret" not in docs.notebook_to_markdown({"cells": cells})


def test_a_name_documented_twice_gets_a_second_anchor():
    cell = NB["cells"][3]
    md = docs.notebook_to_markdown({"cells": [cell, cell]})
    assert (
        "### PPOLoss.forward { #ppoloss.forward .api }" in md
        and "### PPOLoss.forward { #ppoloss.forward-1 .api }" in md
    )


# ---------------------------------------------------------------- outputs, executed notebooks and the cache


def test_outputs_render_as_a_page_shows_them():
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    images = {}
    figure = docs.output_markdown(
        {
            "output_type": "display_data",
            "metadata": {"image/png": {"width": 300}},
            "data": {"image/png": png + "\n", "text/plain": "<Figure>"},
        },
        set(),
        "",
        images,
        "tutorial",
    )
    assert (
        figure == '![figure 1 of this page](images/tutorial-1.png){ width="300" }'
        and images["tutorial-1.png"][:4] == b"\x89PNG"
    )
    # printed text without colour codes, and a progress bar as it ended; stderr told apart
    assert (
        docs.output_markdown(
            {"output_type": "stream", "name": "stdout", "text": ["\x1b[1mloss\x1b[0m 1.0\n", "10%\r100%\n"]},
            set(),
            "",
        )
        == "```{ .text .cell-output }\nloss 1.0\n100%\n```"
    )
    assert ".cell-stderr" in docs.output_markdown(
        {"output_type": "stream", "name": "stderr", "text": "warning"}, set(), ""
    )
    # an error is a failure box with its traceback, which docs_check.py rejects
    error = docs.output_markdown(
        {
            "output_type": "error",
            "ename": "ValueError",
            "evalue": "bad",
            "traceback": ["Traceback (most recent call last):", "ValueError: bad"],
        },
        set(),
        "",
    )
    assert error.startswith(
        '!!! failure "This cell raised ValueError when the docs were built"\n\n    ```{ .text .cell-error }'
    )


def test_rich_table_becomes_a_markdown_table():
    from rich.table import Table

    table = Table(title="policy vs reference")
    table.add_column("")
    table.add_column("reward", justify="right")
    table.add_row("[bold]gold[/bold] score", "0.5|1")
    assert docs.rich_table_markdown(table) == (
        "**policy vs reference**\n{ .table-title }\n\n|   | reward |\n| :-- | --: |\n| gold score | 0.5\\|1 |"
    )


class Loss:
    "A loss."

    def __init__(self, mode: "Literal['a', 'b']" = "a", **kwargs):
        pass


def test_show_doc_shows_a_class_as_a_class():
    from typing import Literal
    from nbdev.showdoc import show_doc

    Loss.__init__.__annotations__["mode"] = Literal["a", "b"]
    md = docs.show_doc_markdown(show_doc(Loss))
    assert "```python\n\nclass Loss(\n    mode:Literal['a', 'b']='a', **kwargs\n)" in md, md
    assert "def Loss" not in md and "VAR_KEYWORD" not in md and "#LNone" not in md


def test_skipped_cells_and_previews():
    assert docs.skip_reason("#| eval: false  # needs a GPU\nx = 1") == "needs a GPU"
    assert "eval: false" in docs.skip_reason("#| eval: false\nx = 1") and docs.skip_reason("x = 1") is None
    out = {"output_type": "execute_result", "metadata": {}, "data": {"text/markdown": "| a |\n|---|\n| 1 |"}}
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "metadata": {"docs_skip": "needs a GPU"},
                "outputs": [],
                "source": "train_on_gpu()",
            },
            {"cell_type": "code", "metadata": {"docs_preview": True}, "outputs": [out], "source": "table"},
        ],
        "metadata": {"docs": {"error": None, "seconds": 12.3}},
    }
    md = docs.notebook_to_markdown(nb)
    assert (
        '```python\ntrain_on_gpu()\n```\n\n!!! note "Not run when these docs were built"\n\n    needs a GPU'
        in md
    )
    # the table opens the page
    assert md.index('!!! abstract "What you will get"\n\n    | a |') < md.index("```python\ntable")
    assert md.count("| 1 |") == 2 and "the notebook ran in 12 s" in md


TINY = {
    "cells": [
        {"cell_type": "markdown", "metadata": {}, "source": "# Tiny\n\n> A notebook the docs build runs."},
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "print(6 * 7)",
        },
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "#| eval: false  # it would fail\n1 / 0",
        },
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [],
            "execution_count": None,
            "source": "from rich.table import Table\nt = Table(); t.add_column('n'); t.add_row('1')\nt",
        },
    ],
    "metadata": {"kernelspec": {"display_name": "python3", "language": "python", "name": "python3"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}


def test_a_tiny_notebook_is_executed_once_then_taken_from_the_cache(tmp_path):
    """The executor runs in its own process on a copy of settings.ini's folder layout; a second build uses the
    cache."""
    import json, shutil

    shutil.copy(docs.ROOT / "settings.ini", tmp_path / "settings.ini")
    (tmp_path / "nbs").mkdir()
    (tmp_path / "nbs" / "tiny.ipynb").write_text(json.dumps(TINY))
    run = lambda: docs.run_notebooks(
        ["tiny"], 1, nbs=tmp_path / "nbs", cache=tmp_path / "cache", tmp=tmp_path / "proc"
    )
    first = run()["tiny"]
    assert not first["error"] and not first["cached"], first
    md = docs.notebook_to_markdown(json.loads(first["path"].read_text()))
    assert "```{ .text .cell-output }\n42\n```" in md  # printed
    # skipped, with its reason
    assert "Not run when these docs were built\"\n\n    it would fail" in md
    assert "| n |\n| :-- |\n| 1 |" in md  # a rich table as a table
    second = run()["tiny"]
    assert second["cached"] and second["path"].parent == tmp_path / "cache"
