"""Build the documentation site into _site/ without Quarto (which `nbdev_docs` needs): `python dev/docs.py`.

1. Every notebook is processed by nbdev's own processors (`FilterDefaults`, what `nbdev_proc_nbs` runs), with one
   change: where nbdev executes only the cells `show_doc` needs (`exec_show_docs`), `exec_all` runs every code cell
   in order in the same execnb shell, in nbs/ as `nbdev_test` does, one notebook per process (at most
   `--workers` at a time). So the pages show what each chapter computes: printed tensors, rich tables (as tables),
   matplotlib figures (as PNG files). A cell marked `#| eval: false` is not run (nor by `nbdev_test`); the page
   says so, with the reason written after the marker (`#| eval: false  # needs a GPU`).
   The processed, executed notebook is cached in build/docs-cache/ under a hash of the notebook, the library's
   source and `EXEC_VERSION`, so a build only runs the notebooks that changed since the last one; the notebooks
   in git stay output-free. A notebook that fails is reported with its cell and traceback, shown on its page as
   a failure box (which `docs_check.py` rejects), never cached, and makes the build exit 1 once the site is built.
2. `notebook_to_markdown` turns each processed notebook into a Markdown page under build/docs/docs/.
3. MkDocs with the Material theme builds _site/ from those pages. KaTeX, taken from the npm registry, is copied
   into the site, so the equations render with no network; no font, script or style comes from a CDN.
   _site/docs-manifest.json lists each page's notebook, group and build time, for `docs_check.py`.

`--no-execute` runs only what nbdev runs (imports, exports, `show_doc`), for a quick look at the text; `--stale-ok`
takes each notebook's last cached run even if the notebook or the library changed since (to work on the rendering).
"""
import argparse
import base64
import configparser
import hashlib
import html
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal, get_args, get_origin

import yaml

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "docs"    # generated mkdocs.yml and docs/*.md
SITE = ROOT / "_site"
STATIC = ROOT / "docs_src"         # hand-written files copied to the site's assets/
KATEX = "0.16.47"
CACHE = ROOT / "build" / "docs-cache"   # executed notebooks, by hash (build/ is git-ignored)
EXEC_VERSION = "2"                  # bump when exec_all or the shell's formatters change what a notebook gives
NB_TIMEOUT = 900                    # seconds one notebook may take before the build gives up on it

# The navigation, in reading order: (notebook, title in the sidebar). The page file is the notebook's `output-file`.
CHAPTERS = [
    ("index", "Overview"), ("00_core", "Core"), ("01_losses", "Losses"), ("02_data", "Data"), ("02b_toy", "Toy models and tasks"),
    ("03_agent", "Agent"), ("03a_decoding", "Decoding"), ("03b_generation", "Generation"), ("04_reward", "Reward"), ("04b_rewards", "Reward helpers (TRL's)"), ("04c_reward_eval", "Reward models you can trust"), ("05_loop", "Loop"), ("05b_levers", "Memory levers"), ("06_sft", "SFT and reward modelling"),
    ("07_rollout", "Rollout"), ("07b_completions", "Completions you can read"), ("08_onpolicy", "On-policy engine"), ("08b_ppo", "PPO"), ("09_rloo", "RLOO"), ("09b_grpo", "GRPO"), ("09c_dpo", "DPO"), ("09d_tools", "Tools"), ("10_cli", "CLI"),
    ("14_scaling", "Scaling up"),
]
TUTORIALS = [
    ("11_tutorial_pipeline", "InstructGPT's three stages"), ("12_tutorial_reward", "Training a reward model"),
    ("13_tutorial_your_own", "Your own model, data and reward"), ("15_tutorial_rloo", "RLOO: no critic"),
    ("16_tutorial_grpo", "GRPO: a checkable reward"), ("17_tutorial_dpo", "DPO: preferences without RL"),
    ("18_tutorial_from_trl", "From a TRL script"), ("19_tutorial_overoptimisation", "Over-optimisation, shown"),
    ("20_tutorial_tools", "Tools: a calculator"),
]
LAST = [("99_package", "The package")]


def settings() -> configparser.SectionProxy:
    config = configparser.ConfigParser(delimiters=["="])
    config.read(ROOT / "settings.ini", encoding="utf-8")
    return config["DEFAULT"]


def doc_url() -> str:
    "Where nbdev thinks the docs live; its links to documented names start with this."
    cfg = settings()
    return cfg["doc_host"].rstrip("/") + cfg["doc_baseurl"].rstrip("/") + "/"


# ---------------------------------------------------------------- executing a notebook (in its own process)

def skip_reason(source: str) -> str | None:
    "Why a cell is not run in the docs build: the comment after `#| eval: false`, or None if it runs."
    m = re.search(r"^#\|\s*eval:\s*false\b[ \t]*(?:#[ \t]*(.*))?$", source, re.MULTILINE | re.IGNORECASE)
    if not m: return None
    return (m[1] or "").strip() or "marked `#| eval: false`, so neither the docs build nor `nbdev_test` runs it"


def rich_table_markdown(table) -> str:
    "A rich `Table` as a Markdown table (its title above it), so the page shows a real table, not box-drawing text."
    from rich.text import Text
    plain = lambda c: (c.plain if isinstance(c, Text) else Text.from_markup(str(c)).plain if isinstance(c, str) else str(c))
    cell = lambda c: plain(c).replace("|", "\\|").replace("\n", "<br>") or " "
    align = {"left": ":--", "center": ":-:", "right": "--:"}
    cols = table.columns
    rows = ["| " + " | ".join(cell(c.header) for c in cols) + " |",
            "| " + " | ".join(align.get(c.justify, "---") for c in cols) + " |"]
    rows += ["| " + " | ".join(cell(c) for c in row) + " |" for row in zip(*(list(c.cells) for c in cols))]
    title = f"**{plain(table.title)}**\n{{ .table-title }}\n\n" if table.title else ""
    return title + "\n".join(rows)


def show_doc_markdown(renderer) -> str:
    """nbdev's `show_doc` Markdown, with what its renderer gets wrong here put right: a class is shown as `class
    Name(`, not `def Name(`; `**kwargs` is not `kwargs:VAR_KEYWORD`; a `Literal` keeps its values; module paths
    are dropped from annotations (`PreTrainedModel`); a `@patch` method under a decorator such as `@contextmanager` is
    headed `Class.name`, as nbdev's links expect; and the source link gets its line when nbdev's is `#LNone`."""
    md, sym = renderer._repr_markdown_(), renderer.sym
    if inspect.isclass(sym): md = re.sub(r"^(```python\s*\n)(?:async )?def ", r"\1class ", md, count=1, flags=re.MULTILINE)
    md = re.sub(r"\b(\w+):VAR_KEYWORD\b", r"**\1", md)
    md = re.sub(r"\b(\w+):VAR_POSITIONAL\b", r"*\1", md)
    for name, param in (renderer.sig.parameters.items() if renderer.sig else ()):
        if get_origin(param.annotation) is Literal:
            values = ", ".join(map(repr, get_args(param.annotation)))
            md = re.sub(rf"(?<!\w){name}:Literal(?!\[)", lambda m: f"{name}:Literal[{values}]", md, count=1)
    md = re.sub(r"\b[a-z_]\w*(?:\.[a-z_]\w*)+\.([A-Z]\w*)", r"\1", md)
    md = re.sub(r"\(\n\s*\n\)", "()", md)                                              # no parameters but `self`
    params = list(renderer.sig.parameters.values()) if renderer.sig else []
    if "." not in renderer.nm and params and params[0].name == "self" and inspect.isclass(params[0].annotation):
        owner = params[0].annotation.__name__                     # a @patch method nbdev names without its class
        md = re.sub(rf"^(#+) {re.escape(renderer.nm)}[ \t]*$", rf"\1 {owner}.{renderer.nm}", md, count=1, flags=re.MULTILINE)
    if "#LNone)" in md:
        try: line = f"#L{inspect.getsourcelines(inspect.unwrap(sym))[1]}"
        except (TypeError, OSError): line = ""
        md = md.replace("#LNone)", f"{line})")
    return md


def exec_all_processor():
    "`exec_all`: nbdev's `exec_show_docs` processor, widened to run every code cell (made here: nbdev is imported late)."
    from nbdev.processors import exec_show_docs

    class exec_all(exec_show_docs):
        "Run every code cell in one shell; skip `#| eval: false` cells (noting why) and stop at the first error."
        def begin(self):
            super().begin()
            fmt = self.k.display_formatter.formatters["text/markdown"]
            fmt.for_type_by_name("rich.table", "Table", rich_table_markdown)
            fmt.for_type_by_name("nbdev.showdoc", "BasicMarkdownRenderer", show_doc_markdown)
            self.nb.metadata["docs"] = {"error": None, "seconds": 0.0}
            self.start = time.perf_counter()

        def __call__(self, cell):
            info = self.nb.metadata["docs"]
            if cell.cell_type != "code" or not cell.source.strip() or "nbdev_export" + "(" in cell.source: return
            if info["error"]: return
            if cell.directives_.get("eval:", [""])[0].lower() == "false": return     # the page says why (docs_skip)
            self.k.cell(cell)
            if self.k.exc:
                info["error"] = {"cell": cell.idx_, "source": cell.source,
                                 "error": f"{type(self.k.exc).__name__}: {self.k.exc}"}

        def end(self):
            super().end()
            self.nb.metadata["docs"]["seconds"] = round(time.perf_counter() - self.start, 1)

    return exec_all


def add_show_docs_once():
    """nbdev 2.4's `add_show_docs` adds a `show_doc` cell after each exported definition that has none, but it compares a
    `@patch` method's bare name with the `Class.name` of an explicit `show_doc`, so such a method got two entries. This
    one compares the names nbdev itself gives (`showdoc_nm`). It uses nbdev's private helpers, here only."""
    from nbdev.showdoc import showdoc_nm
    from nbdev.processors import Processor, _def_types, _get_nm, _show_docs, _want_doc, cell_lang, mk_cell
    from fastcore.foundation import L
    from fastcore.basics import concat

    class add_show_docs(Processor):
        def begin(self):
            nb = self.nb
            exports = L(cell for cell in nb.cells if _want_doc(cell))
            shown = {_get_nm(t) for t in _show_docs(L(nb.cells).map(lambda c: c.parsed_()).concat())}
            for cell in reversed(exports):
                if cell_lang(cell) != "python": raise ValueError(f"{cell.metadata.language} can't export:\n{cell.source}")
                trees = cell.parsed_() or []
                names = [showdoc_nm(o) for o in concat(trees) if isinstance(o, _def_types) and (o.name[0] != "_" or o.name[:2] == "__")]
                for name in [n for n in names if n not in shown]:
                    new_cell = mk_cell(f"show_doc({name})")
                    new_cell.has_sd = True
                    nb.cells.insert(cell.idx_ + 1, new_cell)
            nb.has_docs_ = shown or exports

    return add_show_docs


def process_notebook(src: Path, dst: Path, execute: bool = True):
    "What `nbdev_proc_nbs` does to one notebook, running every cell when `execute`; the result is written to `dst`."
    from execnb.nbio import read_nb, write_nb
    from nbdev.processors import FilterDefaults, add_show_docs, exec_show_docs
    replace = {add_show_docs: add_show_docs_once(), **({exec_show_docs: exec_all_processor()} if execute else {})}

    class DocsFilter(FilterDefaults):
        def base_procs(self): return [replace.get(p, p) for p in super().base_procs()]

    nb = read_nb(src)
    for cell in nb.cells:                         # processing strips the `#|` lines: what the page needs goes to metadata
        if cell.cell_type != "code": continue
        if (reason := skip_reason(cell.source)): cell.metadata["docs_skip"] = reason
        if re.search(r"^#\|\s*docs:\s*preview\s*$", cell.source, re.MULTILINE): cell.metadata["docs_preview"] = True
    os.environ["IN_TEST"] = "1"                                                  # as nbdev_test and nbdev_proc_nbs do
    os.chdir(src.parent)
    DocsFilter()(nb)
    write_nb(nb, dst)


def notebook_key(path: Path) -> str:
    "The cache key of a notebook's executed outputs: its bytes, the library's source, and the executor's version."
    h = hashlib.sha256(f"{EXEC_VERSION}\n".encode())
    for f in [path] + sorted((ROOT / settings()["lib_path"]).rglob("*.py")):
        h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f.name).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def run_notebooks(names: list[str], workers: int, execute: bool = True, nbs: Path = ROOT / "nbs", cache: Path = CACHE,
                  tmp: Path = BUILD / "proc", stale_ok: bool = False) -> dict[str, dict]:
    """Each notebook of `nbs` executed and processed, from the cache when its key is there: {name: {"path",
    "seconds", "cached", "error"}}. Up to `workers` notebooks run at once, each in its own Python process.
    `stale_ok` takes a notebook's last cached run even when the notebook or the library changed since."""
    cache.mkdir(parents=True, exist_ok=True)
    if tmp.exists(): shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    results, todo, running = {}, [], []
    for name in names:
        key = f"{name}-{notebook_key(nbs / f'{name}.ipynb')}" if execute else None
        cached = cache / f"{key}.ipynb" if key else None
        if cached and not cached.exists() and stale_ok and (old := sorted(cache.glob(f"{name}-*.ipynb"))):
            print(f"docs: {name}.ipynb changed (or the library did) since its cached run; --stale-ok takes that run")
            cached = old[-1]
        if cached and cached.exists():
            results[name] = {"path": cached, "cached": True, "stale": not cached.stem.endswith(key),
                             **json.loads(cached.read_text(encoding="utf-8"))["metadata"]["docs"]}
        else: todo.append((name, key))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}   # as `make test` runs them
    while todo or running:
        while todo and len(running) < workers:
            name, key = todo.pop(0)
            out, log = tmp / f"{name}.ipynb", tmp / f"{name}.log"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--process", str(nbs / f"{name}.ipynb"), str(out)]
            if not execute: cmd.append("--no-execute")
            with open(log, "w") as f: proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            running.append((name, key, out, log, proc, time.perf_counter()))
        time.sleep(0.2)
        for job in list(running):
            name, key, out, log, proc, start = job
            seconds = time.perf_counter() - start
            if proc.poll() is None and seconds < NB_TIMEOUT: continue
            if proc.poll() is None: proc.kill(); proc.wait()
            running.remove(job)
            if proc.returncode == 0 and out.exists():
                info = json.loads(out.read_text(encoding="utf-8"))["metadata"].get("docs", {"error": None})
                info["seconds"] = round(seconds, 1)
            else:
                tail = log.read_text(errors="replace")[-3000:]
                info = {"error": {"cell": None, "source": "", "error": f"processing failed (exit {proc.returncode}, "
                                  f"{seconds:.0f} s)\n{tail}"}, "seconds": round(seconds, 1)}
            results[name] = {"path": out if out.exists() else None, "cached": False, **info}
            if not info["error"] and key:
                nb = json.loads(out.read_text(encoding="utf-8"))
                nb["metadata"]["docs"] = info
                for old in cache.glob(f"{name}-*.ipynb"): old.unlink()
                (cache / f"{key}.ipynb").write_text(json.dumps(nb), encoding="utf-8")
            state = "FAILED" if info["error"] else "ran"
            print(f"docs: {name}.ipynb {state} in {seconds:.1f} s", flush=True)
    return results


# ---------------------------------------------------------------- one notebook -> one Markdown page

def directives(source: str) -> dict[str, str]:
    "The cell's `#| key: value` lines (`#| hide` gives {'hide': ''})."
    out = {}
    for line in source.splitlines():
        if line.startswith("#|"):
            key, _, value = line[2:].strip().partition(":")
            out[key.strip()] = value.strip().strip("\"'")
    return out


def without_directives(source: str) -> str:
    return "\n".join(line for line in source.splitlines() if not line.startswith("#|")).strip()


def front_matter(source: str) -> dict:
    "The YAML between the `---` lines of nbdev's first (raw) cell."
    m = re.match(r"\s*---\s*\n(.*?)\n---", source, re.DOTALL)
    return (yaml.safe_load(m[1]) or {}) if m else {}


def outside_code(md: str, fn, in_code=None) -> str:
    "Apply `fn` to the text outside ``` fences (and `in_code` to the fences themselves)."
    parts = re.split(r"(^```.*?^```[ \t]*$)", md, flags=re.DOTALL | re.MULTILINE)
    return "".join((in_code or (lambda s: s))(p) if i % 2 else fn(p) for i, p in enumerate(parts))


def local_links(md: str, pages: set[str], url: str = "") -> str:
    "Links to a page of this site (`losses.html#ppoloss`, nbdev's absolute doc links, `01_losses.ipynb`) point at its .md file."
    def fix(m): return f"]({m[1]}.md{m[2] or ''})" if m[1] in pages else m[0]
    md = re.sub(rf"\]\((?:{re.escape(url)})?([\w-]+)\.html(#[^)\s]*)?\)", fix, md)
    md = re.sub(r"\]\((?:\./)?(?:\d+[a-z]?_)?([\w-]+)\.ipynb(#[^)\s]*)?\)", fix, md)      # a sibling notebook: its page
    return github_links(md)


def api_markdown(md: str, pages: set[str], url: str) -> str:
    "A show_doc entry: headings keep nbdev's anchors (`#ppoloss.forward`) and get class `api`; links in code become names."
    def headings(text):
        text = local_links(text, pages, url)
        return re.sub(r"^(#{2,4}) ([^{\n]+?)[ \t]*$", lambda m: f"{m[1]} {m[2]} {{ #{m[2].strip('`').lower()} .api }}",
                      text, flags=re.MULTILINE)
    def code(fence):
        fence = re.sub(r"\[`([^`\]]+)`\]\([^)\s]*\)", r"\1", fence)                 # [`name`](url) -> name
        return re.sub(r"\n\s*\n(?=```[ \t]*$)", "\n", re.sub(r"^(```\w*)\n\s*\n", r"\1\n", fence))  # no blank edges
    return outside_code(md, headings, code)


def unique_ids(md: str) -> str:
    "A name documented twice on a page gets `#name`, then `#name-1`, as Pandoc would number them."
    seen = {}
    def number(m):
        n = seen[m[1]] = seen.get(m[1], -1) + 1
        return f"{{ #{m[1]}{f'-{n}' if n else ''} .api }}"
    return outside_code(md, lambda text: re.sub(r"\{ #(\S+) \.api \}[ \t]*$", number, text, flags=re.MULTILINE))


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROGRESS = re.compile(r"\[\d+:\d+(?:<[^,\]]*)?, [^\]]*\]\s*$")   # tqdm's `[00:00<00:00, 80.6it/s]`, `[00:00, 2346 examples/s]`


def plain_text(text: str) -> str:
    "Terminal text as a page shows it: no colour codes, a line rewritten with `\r` only as it ended, no progress bars."
    lines = (line.rsplit("\r", 1)[-1] for line in ANSI.sub("", text).rstrip().split("\n"))
    return "\n".join(line for line in lines if not PROGRESS.search(line)).strip("\n")


def text_block(text: str, kind: str = "output") -> str:
    "An output as a fenced text block with class `cell-output` (or `cell-stderr`), told apart from the code above it."
    if not (text := plain_text(text)): return ""
    fence = "`" * max(3, max((len(m) for m in re.findall(r"`{3,}", text)), default=0) + 1)
    return f"{fence}{{ .text .cell-{kind} }}\n{text}\n{fence}"


def output_markdown(output: dict, pages: set[str], url: str, images: dict | None = None, stem: str = "page") -> str:
    """One output of a code cell: Markdown as it is (show_doc entries, rich tables), images as PNG files (or data URIs
    when `images` is None), HTML as HTML, text in a text block; an error in a failure box with its traceback."""
    data, kind = output.get("data", {}), output.get("output_type")
    text = lambda v: "".join(v) if isinstance(v, list) else v
    if kind == "error":
        tb = plain_text("\n".join(output.get("traceback", [])) or f"{output.get('ename')}: {output.get('evalue')}")
        return f'!!! failure "This cell raised {output.get("ename", "an error")} when the docs were built"\n\n' + indent(text_block(tb, "error"))
    if kind == "stream":
        return text_block(text(output["text"]), "stderr" if output.get("name") == "stderr" else "output")
    if "text/markdown" in data: return api_markdown(text(data["text/markdown"]).strip(), pages, url)
    if "image/png" in data:
        png, size = text(data["image/png"]).strip(), output.get("metadata", {}).get("image/png", {})
        width = f'{{ width="{size["width"]}" }}' if "width" in size else ""
        if images is None: return f"![](data:image/png;base64,{png}){width}"
        name = f"{stem}-{len(images) + 1}.png"
        images[name] = base64.b64decode(png)
        return f"![figure {len(images)} of this page](images/{name}){width}"
    if "text/html" in data: return f'<div class="cell-html" markdown="0">\n{text(data["text/html"]).strip()}\n</div>'
    if "text/plain" in data: return text_block(text(data["text/plain"]))
    return ""


def indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())


def preview(cells: list[tuple[dict, list[str]]]) -> list[str]:
    "The outputs of the cells marked `#| docs: preview`, shown again under the page's description: what the reader will get."
    shown = [md for _, outs in cells for md in outs]
    if not shown: return []
    return ['!!! abstract "What you will get"\n\n' + indent("\n\n".join(shown)) + "\n\n"
            + indent("*Made by the cells below, run when these docs were built.*")]


def notebook_to_markdown(nb: dict, pages: set[str] = frozenset(), url: str = "", images: dict | None = None,
                         stem: str = "page") -> str:
    """One processed notebook as a Markdown page: its front matter gives the title and description, markdown cells
    are kept, code cells become ```python blocks without their `#|` lines (`code-fold` ones in an open "Exported
    source" box) followed by their outputs, `echo: false` cells show only their output, show_doc output is kept as
    Markdown, and a cell not run in the docs build says why. The outputs of `#| docs: preview` cells open the page
    too, and the page ends with how long its notebook took to run."""
    meta, parts, previews = {}, [], []
    for i, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "raw":
            if i == 0: meta = front_matter(source)
            continue
        if cell["cell_type"] == "markdown":
            parts.append(outside_code(source.strip(), lambda s: local_links(s, pages, url)))
            continue
        d = directives(source)
        if "hide" in d or d.get("include") == "false": continue
        code = without_directives(source)
        if code and d.get("echo") != "false":
            block = f"```python\n{code}\n```"
            if d.get("code-fold") in ("show", "true"):
                summary = d.get("code-summary", "Code").replace('"', "'")
                block = f'???{"+" if d["code-fold"] == "show" else ""} abstract "{summary}"\n\n{indent(block)}'
            parts.append(block)
        if cell.get("metadata", {}).get("docs_skip"):
            parts.append(f'!!! note "Not run when these docs were built"\n\n    {cell["metadata"]["docs_skip"]}')
        if d.get("output") != "false":
            outs = [md for md in (output_markdown(o, pages, url, images, stem) for o in cell.get("outputs", [])) if md]
            parts += outs
            if d.get("docs") == "preview" or cell.get("metadata", {}).get("docs_preview"): previews.append((cell, outs))
    run = nb.get("metadata", {}).get("docs")
    if run and not run.get("error") and run.get("seconds") is not None:
        parts.append(f"---\n\n*The outputs on this page were computed when the docs were built: the notebook ran in "
                     f"{run['seconds']:.0f} s.*\n{{ .docs-run }}")
    body = unique_ids("\n\n".join(parts))
    title = meta.get("title", "")
    head = yaml.safe_dump({k: meta[k] for k in ("title", "description") if k in meta}, allow_unicode=True, width=10**6)
    intro = [f"# {title}"] if title else []
    if meta.get("description"): intro.append(f"{meta['description']}\n{{ .page-description }}")
    return f"---\n{head}---\n\n" + "\n\n".join(intro + preview(previews) + [body]) + "\n"


# ---------------------------------------------------------------- the site

def nav_entries() -> list[tuple[str, str, str]]:
    "(notebook, nav title, group) for every notebook; ones missing from the lists above go after the chapters."
    known = {nb for nb, _ in CHAPTERS + TUTORIALS + LAST}
    extra = sorted(p.stem for p in (ROOT / "nbs").glob("*.ipynb") if p.stem not in known)
    for nb in extra: print(f"docs: {nb}.ipynb is not in dev/docs.py's navigation; added after the chapters")
    missing = [nb for nb, _ in CHAPTERS + TUTORIALS + LAST if not (ROOT / "nbs" / f"{nb}.ipynb").exists()]
    for nb in missing: print(f"docs: {nb}.ipynb is in dev/docs.py's navigation but not in nbs/; left out")
    entries = ([(nb, t, "") for nb, t in CHAPTERS] + [(nb, "", "") for nb in extra]
               + [(nb, t, "Tutorials") for nb, t in TUTORIALS] + [(nb, t, "") for nb, t in LAST])
    return [e for e in entries if e[0] not in missing]


def write_pages(entries, results: dict[str, dict]) -> tuple[list, dict]:
    "The Markdown pages, their images and the navigation; also {page.html: what docs_check.py needs to know}."
    docs = BUILD / "docs"
    if docs.exists(): shutil.rmtree(docs)
    (docs / "images").mkdir(parents=True)
    notebooks = {nb: json.loads(results[nb]["path"].read_text(encoding="utf-8")) for nb, _, _ in entries if results[nb]["path"]}
    files = {nb: Path(front_matter("".join(n["cells"][0]["source"])).get("output-file", f"{nb}.html")).stem
             for nb, n in notebooks.items()}
    pages, url, nav, groups, manifest = set(files.values()), doc_url(), [], {}, {}
    for nb, title, group in entries:
        if nb not in notebooks: continue
        images = {}
        (docs / f"{files[nb]}.md").write_text(notebook_to_markdown(notebooks[nb], pages, url, images, files[nb]),
                                              encoding="utf-8")
        for name, png in images.items(): (docs / "images" / name).write_bytes(png)
        run = results[nb]
        manifest[f"{files[nb]}.html"] = {"notebook": f"nbs/{nb}.ipynb", "group": group, "seconds": run.get("seconds"),
                                          "cached": run["cached"], "error": bool(run.get("error"))}
        entry = {title or front_matter("".join(notebooks[nb]["cells"][0]["source"])).get("title", nb): f"{files[nb]}.md"}
        if not group: nav.append(entry)
        else:
            if group not in groups: groups[group] = []; nav.append({group: groups[group]})
            groups[group].append(entry)
    return nav, manifest


def github_links(md: str) -> str:
    "Links to files of the repository (`nbs/11_tutorial_pipeline.ipynb`, `examples/`) go to them on GitHub."
    base = settings()["git_url"].rstrip("/") + "/blob/" + settings()["branch"] + "/"
    return re.sub(r"\]\((?:\.\./)?((?:nbs|examples|configs|bench|tests|dev)/[^)\s]*)\)", lambda m: f"]({base}{m[1]})", md)


def copy_assets():
    "KaTeX from the npm registry (cached in build/katex/) and docs_src/ into the site's assets/."
    assets, cache = BUILD / "docs" / "assets", ROOT / "build" / "katex" / KATEX
    if not (cache / "package" / "dist" / "katex.min.js").exists():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "pack", "--silent", f"katex@{KATEX}", "--pack-destination", str(cache)],
                       check=True, stdout=subprocess.DEVNULL)
        with tarfile.open(cache / f"katex-{KATEX}.tgz") as tgz:
            tgz.extractall(cache, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    dist, katex = cache / "package" / "dist", assets / "katex"
    (katex / "contrib").mkdir(parents=True)
    for name in ("katex.min.js", "katex.min.css", "contrib/auto-render.min.js"): shutil.copy(dist / name, katex / name)
    shutil.copytree(dist / "fonts", katex / "fonts")
    for f in STATIC.iterdir(): shutil.copy(f, assets / f.name)


def mkdocs_config(nav) -> dict:
    cfg = settings()
    return {
        "site_name": cfg["lib_name"], "site_description": cfg["description"],
        "docs_dir": "docs", "site_dir": str(SITE), "use_directory_urls": False,     # pages are losses.html, as nbdev's
        "theme": {"name": "material", "font": False,                                 # font: false, no Google Fonts
                  "features": ["navigation.sections", "navigation.top", "toc.follow", "content.code.copy"]},
        "plugins": ["search"],
        "markdown_extensions": [
            "tables", "attr_list", "md_in_html", "admonition", "pymdownx.details", "pymdownx.superfences",
            {"pymdownx.highlight": {"pygments_lang_class": True}}, {"pymdownx.arithmatex": {"generic": True}},
            {"toc": {"permalink": True}},
        ],
        "extra_javascript": ["assets/katex/katex.min.js", "assets/katex/contrib/auto-render.min.js", "assets/katex-init.js"],
        "extra_css": ["assets/katex/katex.min.css", "assets/extra.css"],
        "validation": {"omitted_files": "warn", "absolute_links": "info", "unrecognized_links": "warn",
                       "anchors": "warn", "not_found": "warn"},
        "nav": nav,
    }


EXTERNAL_ASSET = re.compile(r"""<(?:script|link|img|iframe|source|embed)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//[^>]*>""", re.I)
CDN = re.compile(r"""(?:https?:)?//[\w.-]*(?:cdn|unpkg|googleapis|gstatic|polyfill)[\w.-]*/[^\s"'<>)]*""", re.I)


def check_offline(site: Path = SITE) -> list[str]:
    "Every page's scripts, styles, fonts and images come from the site itself."
    problems = []
    for html in sorted(site.rglob("*.html")):
        text = html.read_text(encoding="utf-8")
        problems += [f"{html.relative_to(site)}: {m[0][:120]}" for m in EXTERNAL_ASSET.finditer(text)]
        problems += [f"{html.relative_to(site)}: CDN URL {m[0][:120]}" for m in CDN.finditer(text)]
    return problems


def build(workers: int = 2, execute: bool = True, stale_ok: bool = False):
    start = time.perf_counter()
    entries = nav_entries()
    print(f"== docs: processing {'and executing ' if execute else ''}{len(entries)} notebooks "
          f"({workers} at a time; cache: {CACHE.relative_to(ROOT)}/)", flush=True)
    results = run_notebooks([nb for nb, _, _ in entries], workers, execute, stale_ok=stale_ok)
    ran = time.perf_counter() - start
    print("== docs: writing Markdown pages and mkdocs.yml into build/docs/", flush=True)
    nav, manifest = write_pages(entries, results)
    copy_assets()
    config = BUILD / "mkdocs.yml"
    config.write_text(yaml.safe_dump(mkdocs_config(nav), sort_keys=False, allow_unicode=True), encoding="utf-8")
    print("== docs: mkdocs build --strict into _site/", flush=True)
    if SITE.exists(): shutil.rmtree(SITE)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}                           # Material's end-of-life notice
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(config)],
                   check=True, cwd=ROOT, env=env)
    problems = check_offline()
    for p in problems: print("external asset:", p)
    if problems: sys.exit("docs: the built HTML loads something from outside the site")
    total = time.perf_counter() - start
    (SITE / "docs-manifest.json").write_text(json.dumps(
        {"built": datetime.now(timezone.utc).isoformat(timespec="seconds"), "executed": execute,
         "seconds": round(total, 1), "pages": manifest}, indent=1), encoding="utf-8")
    print(f"== docs: {len(list(SITE.glob('*.html')))} pages in _site/, no CDN or external asset in the HTML", flush=True)
    print(f"\n{'notebook':<32} {'run (s)':>8}  state", flush=True)
    for nb, _, _ in entries:
        r = results[nb]
        state = "FAILED" if r.get("error") else "stale cache" if r.get("stale") else "cached" if r["cached"] else "ran"
        print(f"{nb:<32} {r.get('seconds') or 0:>8.1f}  {state}", flush=True)
    n_cached = sum(r["cached"] for r in results.values())
    print(f"== docs: built in {total:.0f} s ({ran:.0f} s processing notebooks; {n_cached} of {len(results)} from the cache)")
    failed = {nb: r["error"] for nb, r in results.items() if r.get("error")}
    for nb, err in failed.items():
        where = f"cell {err['cell']}" if err.get("cell") is not None else "processing"
        source = "".join(err.get("source") or "")
        print(f"\ndocs: {nb}.ipynb failed in {where}: {err['error'][:3000]}" + (f"\n--- the cell:\n{source}" if source else ""))
    if failed: sys.exit(f"docs: {len(failed)} notebook(s) failed: {', '.join(failed)} (the site is built; their pages show the error)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=int(os.environ.get("DOCS_WORKERS", 2)), help="notebooks run at once")
    parser.add_argument("--no-execute", action="store_true", help="run only what nbdev runs for show_doc (no outputs)")
    parser.add_argument("--stale-ok", action="store_true", help="take each notebook's last cached run even if it changed since")
    parser.add_argument("--process", nargs=2, metavar=("NOTEBOOK", "OUT"), help=argparse.SUPPRESS)   # one worker
    args = parser.parse_args()
    if args.process: process_notebook(Path(args.process[0]).resolve(), Path(args.process[1]).resolve(), not args.no_execute)
    else: build(args.workers, not args.no_execute, args.stale_ok)


if __name__ == "__main__":
    main()
