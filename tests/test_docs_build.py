"tools/docs.py turns a processed notebook into a Markdown page (no nbdev_proc_nbs, no MkDocs: runs in well under a second)."
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("docs", Path(__file__).resolve().parents[1] / "tools" / "docs.py")
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

NB = {"cells": [
    {"cell_type": "raw", "metadata": {}, "source": [
        "---\n", "description: 'Pure functions on tensors, each beside its equation.'\n", "output-file: losses.html\n",
        "title: 'Losses: KL penalty and PPO'\n", "\n", "---\n", "\n"]},
    {"cell_type": "markdown", "metadata": {}, "source": [
        "## The clipped PPO objective\n", "\n", "$$L^{CLIP}(\\phi) = \\hat{\\mathbb{E}}_t[\\min(\\rho_t \\hat A_t, \\cdot)]$$\n",
        "\n", "[`PPOLoss`](https://instruct-goose.github.io/instruct_goose/losses.html#ppoloss) with $\\epsilon$."]},
    {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": [
        "#| code-fold: show\n", "#| code-summary: \"Exported source\"\n", "class PPOLoss(nn.Module):\n", "    pass"]},
    {"cell_type": "code", "metadata": {}, "execution_count": 3, "source": [
        "#| echo: false\n", "#| output: asis\n", "show_doc(PPOLoss.forward)"],
     "outputs": [{"output_type": "execute_result", "execution_count": 3, "metadata": {},
                  "data": {"text/markdown": SHOW_DOC_MD, "text/plain": "<nbdev.showdoc.BasicMarkdownRenderer>"}}]},
    {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
     "source": "loss_fn = PPOLoss(epsilon=0.2)"},
]}


def test_notebook_to_markdown():
    md = docs.notebook_to_markdown(NB, pages={"losses", "core"}, url=URL)
    # the raw front matter becomes the page's metadata, its title and its description
    assert md.startswith("---\ndescription: Pure functions on tensors, each beside its equation.\ntitle: 'Losses: KL penalty and PPO'\n---\n")
    assert "\n# Losses: KL penalty and PPO\n" in md
    assert "Pure functions on tensors, each beside its equation.\n{ .page-description }" in md
    # no directive line and no show_doc call is left; `echo: false` shows only the output
    assert "#|" not in md and "show_doc(" not in md and "code-fold" not in md
    # exported code sits in an open box titled by its code-summary; example code is a plain python block
    assert '???+ abstract "Exported source"\n\n    ```python\n    class PPOLoss(nn.Module):\n        pass\n    ```' in md
    assert "```python\nloss_fn = PPOLoss(epsilon=0.2)\n```" in md
    # the show_doc markdown is kept: source link with its attributes, heading with nbdev's anchor, shapes, docstring
    assert '[source](https://github.com/instruct-goose/instruct_goose/blob/main/instruct_goose/losses.py#L132){target="_blank"' in md
    assert "### PPOLoss.forward { #ppoloss.forward .api }" in md
    assert "```python\ndef forward(\n    advantages:Float[Tensor, 'batch resp'], # Â_t from compute_gae\n)->tuple:" in md
    assert "clipfrac)\n```\n\n*Call self as a function.*" in md
    # markdown cells are kept as they are, math included; links to documented names point at this site's pages
    assert "$$L^{CLIP}(\\phi) = \\hat{\\mathbb{E}}_t[\\min(\\rho_t \\hat A_t, \\cdot)]$$" in md
    assert "[`PPOLoss`](losses.md#ppoloss) with $\\epsilon$." in md
    assert md.index("## The clipped PPO objective") < md.index("class PPOLoss") < md.index("### PPOLoss.forward") < md.index("loss_fn =")


def test_directives_and_hidden_cells():
    assert docs.directives('#| code-summary: "Exported source"\n#| hide\nx = 1') == {"code-summary": "Exported source", "hide": ""}
    cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "source": "#| hide\nsecret = 1"},
             {"cell_type": "code", "metadata": {}, "outputs": [], "source": "#| include: false\nsecret = 2"}]
    assert "secret" not in docs.notebook_to_markdown({"cells": cells})


def test_a_name_documented_twice_gets_a_second_anchor():
    cell = NB["cells"][3]
    md = docs.notebook_to_markdown({"cells": [cell, cell]})
    assert "### PPOLoss.forward { #ppoloss.forward .api }" in md and "### PPOLoss.forward { #ppoloss.forward-1 .api }" in md
