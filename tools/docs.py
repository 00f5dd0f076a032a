"""Build the documentation site into _site/ without Quarto (which `nbdev_docs` needs): `python tools/docs.py`.

1. nbdev processes the notebooks into _proc/, as `nbdev_proc_nbs` does: `#| hide` cells are dropped and each
   `show_doc(...)` cell carries its API entry (signature, shapes, docstring) as Markdown.
2. `notebook_to_markdown` turns each processed notebook into a Markdown page under build/docs/docs/.
3. MkDocs with the Material theme builds _site/ from those pages. KaTeX, taken from the npm registry, is copied
   into the site, so the equations render with no network; no font, script or style comes from a CDN.
"""
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "docs"    # generated mkdocs.yml and docs/*.md
SITE = ROOT / "_site"
STATIC = ROOT / "docs_src"         # hand-written files copied to the site's assets/
KATEX = "0.16.47"

# The navigation, in reading order: (notebook, title in the sidebar). The page file is the notebook's `output-file`.
CHAPTERS = [
    ("index", "Overview"), ("00_core", "Core"), ("01_losses", "Losses"), ("02_data", "Data"),
    ("03_agent", "Agent"), ("04_reward", "Reward"), ("05_loop", "Loop"), ("06_sft", "SFT and reward modelling"),
    ("08_trainer", "Trainer (PPO)"), ("09_rloo", "RLOO"), ("10_cli", "CLI"), ("14_scaling", "Scaling up"),
]
TUTORIALS = [
    ("11_tutorial_pipeline", "InstructGPT's three stages"), ("12_tutorial_reward", "Training a reward model"),
    ("13_tutorial_your_own", "Your own model, data and reward"),
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
    "Links to a page of this site (`losses.html#ppoloss`, or nbdev's absolute doc links) point at its .md file."
    def fix(m): return f"]({m[1]}.md{m[2] or ''})" if m[1] in pages else m[0]
    return re.sub(rf"\]\((?:{re.escape(url)})?([\w-]+)\.html(#[^)\s]*)?\)", fix, md)


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


def output_markdown(output: dict, pages: set[str], url: str) -> str:
    data = output.get("data", {})
    text = lambda v: "".join(v) if isinstance(v, list) else v
    if "text/markdown" in data: return api_markdown(text(data["text/markdown"]).strip(), pages, url)
    if "image/png" in data: return f"![](data:image/png;base64,{text(data['image/png']).strip()})"
    if "text/plain" in data: return f"```text\n{text(data['text/plain']).rstrip()}\n```"
    if output.get("output_type") == "stream": return f"```text\n{text(output['text']).rstrip()}\n```"
    return ""


def indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())


def notebook_to_markdown(nb: dict, pages: set[str] = frozenset(), url: str = "") -> str:
    """One processed notebook as a Markdown page: its front matter gives the title and description, markdown cells
    are kept, code cells become ```python blocks without their `#|` lines (`code-fold` ones in an open "Exported
    source" box), `echo: false` cells show only their output, and show_doc output is kept as Markdown."""
    meta, parts = {}, []
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
        if d.get("output") != "false":
            parts += [md for md in (output_markdown(o, pages, url) for o in cell.get("outputs", [])) if md]
    body = unique_ids("\n\n".join(parts))
    title = meta.get("title", "")
    head = yaml.safe_dump({k: meta[k] for k in ("title", "description") if k in meta}, allow_unicode=True, width=10**6)
    intro = [f"# {title}"] if title else []
    if meta.get("description"): intro.append(f"{meta['description']}\n{{ .page-description }}")
    return f"---\n{head}---\n\n" + "\n\n".join(intro + [body]) + "\n"


# ---------------------------------------------------------------- the site

def proc_notebooks():
    "What `nbdev_proc_nbs` does, without its attempt to install Quarto (sudo, curl, `pip install -e .` on PATH)."
    from nbdev.serve import proc_nbs
    proc_nbs(force=True)


def nav_entries() -> list[tuple[str, str, str]]:
    "(notebook, nav title, group) for every notebook; ones missing from the lists above go after the chapters."
    known = {nb for nb, _ in CHAPTERS + TUTORIALS + LAST}
    extra = sorted(p.stem for p in (ROOT / "nbs").glob("*.ipynb") if p.stem not in known)
    for nb in extra: print(f"docs: {nb}.ipynb is not in tools/docs.py's navigation; added after the chapters")
    return ([(nb, t, "") for nb, t in CHAPTERS] + [(nb, "", "") for nb in extra]
            + [(nb, t, "Tutorials") for nb, t in TUTORIALS] + [(nb, t, "") for nb, t in LAST])


def write_pages(entries) -> list:
    docs = BUILD / "docs"
    if docs.exists(): shutil.rmtree(docs)
    docs.mkdir(parents=True)
    notebooks = {nb: json.loads((ROOT / "_proc" / f"{nb}.ipynb").read_text(encoding="utf-8")) for nb, _, _ in entries}
    files = {nb: Path(front_matter("".join(n["cells"][0]["source"])).get("output-file", f"{nb}.html")).stem
             for nb, n in notebooks.items()}
    pages, url, nav, groups = set(files.values()), doc_url(), [], {}
    for nb, title, group in entries:
        (docs / f"{files[nb]}.md").write_text(notebook_to_markdown(notebooks[nb], pages, url), encoding="utf-8")
        entry = {title or front_matter("".join(notebooks[nb]["cells"][0]["source"])).get("title", nb): f"{files[nb]}.md"}
        if not group: nav.append(entry)
        else:
            if group not in groups: groups[group] = []; nav.append({group: groups[group]})
            groups[group].append(entry)
    return nav


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


def build():
    print("== docs: processing notebooks into _proc/", flush=True)
    proc_notebooks()
    print("== docs: writing Markdown pages and mkdocs.yml into build/docs/", flush=True)
    nav = write_pages(nav_entries())
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
    print(f"== docs: {len(list(SITE.glob('*.html')))} pages in _site/, no CDN or external asset in the HTML", flush=True)


if __name__ == "__main__":
    build()
