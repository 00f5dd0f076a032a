"""Check the built site in a headless Chromium: `python dev/docs_check.py [SITE]` (after `python dev/docs.py`).

_site/ is served on 127.0.0.1 and every page is opened with Debian's /usr/bin/chromium, driven by Playwright
(never `playwright install`). Checks, one line each: no console error, failed request or request leaving the
site on any page; the math is typeset by KaTeX with no raw `$`, `\\(` or `\\[` left in the text; the API entries
of `Agent`, `AgentObjective`, `RLHFTrainer.compute_loss` and `PPOLoss` are shown with their jaxtyping shapes;
every navigation and internal link resolves (HTTP 200, and the anchor exists); every tutorial page shows at least
one rendered image and one table (the count of images and tables is printed for every page); no page shows a
Python traceback or a failed cell; every public name (the `__all__` of each instruct_goose module) has exactly one
API entry on the site. Screenshots of the overview, of the PPO loss and of the top of the pipeline and RLOO
tutorials (their curves and before/after table) go to _site/screenshots/. Exits 1 if any check fails.
"""
import importlib
import json
import pkgutil
import re
import sys
import threading
import urllib.error
import urllib.request
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urldefrag, urlparse

from playwright.sync_api import TimeoutError as PlaywrightTimeout, sync_playwright

SITE = Path(__file__).resolve().parents[1] / "_site"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
API = {"agent.html": ["Agent", "AgentObjective"], "ppo.html": ["RLHFTrainer.compute_loss"], "losses.html": ["PPOLoss"]}
CLASSES = {"Agent", "AgentObjective", "PPOLoss"}                 # their entries read `class Name(`, not `def Name(`
SHAPE = re.compile(r"\b(?:Float|Int|Bool|Shaped|Num)\[Tensor, '[^']*'\]")
RAW_MATH = re.compile(r"\$\$|\$[^\s$][^$\n]*\$|\\\(|\\\[")

# The page's text as a reader sees it, minus code and typeset math (KaTeX keeps the TeX source in hidden MathML).
VISIBLE_TEXT = """() => { const b = document.body.cloneNode(true);
  b.querySelectorAll("script, style, pre, code, .katex").forEach(e => e.remove()); return b.textContent; }"""
TYPESET = "[...document.querySelectorAll('.arithmatex')].every(e => e.querySelector('.katex, .katex-error'))"
MATH = """() => ({ spans: document.querySelectorAll(".arithmatex").length,
  typeset: [...document.querySelectorAll(".arithmatex")].filter(e => e.querySelector(".katex")).length,
  errors: document.querySelectorAll(".katex-error").length })"""
LINKS = """() => ({ nav: [...document.querySelectorAll("nav.md-nav a[href]")].map(a => a.href),
  content: [...document.querySelectorAll("article a[href]")].map(a => a.href),
  ids: [...document.querySelectorAll("[id]")].map(e => e.id) })"""
# The text of an API entry: its heading down to the next heading that is not one of its methods.
API_ENTRY = """(name) => { const id = name.toLowerCase(), h = document.getElementById(id);
  if (!h) return null; let text = h.textContent, el = h.nextElementSibling;
  while (el && !(/^H[1-3]$/.test(el.tagName) && !el.id.startsWith(id + "."))) { text += "\\n" + el.textContent; el = el.nextElementSibling; }
  return text; }"""

# Images that loaded and tables, in the page's content; whether the page shows an error or a traceback.
OUTPUTS = """() => { const a = document.querySelector("article");
  const imgs = [...a.querySelectorAll("img")];
  return { images: imgs.filter(i => i.complete && i.naturalWidth > 0).length, broken: imgs.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(-60)),
    tables: a.querySelectorAll("table").length,
    errors: a.querySelectorAll(".admonition.failure, .cell-error").length,
    traceback: /Traceback \(most recent call last\)/.test(a.textContent),
    api: [...a.querySelectorAll("h2.api, h3.api, h4.api")].map(h => h.textContent.replace(/\u00b6\s*$/, "").trim()) }; }"""
# The top of a tutorial: its title down to the end of the "What you will get" box, with what the box holds.
PREVIEW = """() => { const box = document.querySelector("article .admonition.abstract");
  if (!box) return null; const h1 = document.querySelector("article h1");
  const imgs = [...box.querySelectorAll("img")];
  return { top: h1.getBoundingClientRect().top + scrollY, bottom: box.getBoundingClientRect().bottom + scrollY,
    images: imgs.filter(i => i.complete && i.naturalWidth > 0).length, tables: box.querySelectorAll("table").length,
    title: box.querySelector(".admonition-title").textContent }; }"""
TUTORIAL_SHOTS = {"tutorial_pipeline.html": "tutorial-pipeline.png", "tutorial_rloo.html": "tutorial-rloo.png"}

failures = []


def report(name: str, ok: bool, detail: str = ""):
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f": {detail}" if detail else ""), flush=True)
    if not ok: failures.append(name)


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args): pass


class Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):             # Chromium drops spare connections: not an error
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)): super().handle_error(request, client_address)


def serve(site: Path) -> tuple[ThreadingHTTPServer, str]:
    server = Server(("127.0.0.1", 0), partial(Quiet, directory=str(site)))               # port 0: a free one
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r: return r.status
    except urllib.error.HTTPError as e: return e.code


def open_page(page, url: str, base: str) -> list[str]:
    "Load `url`; the console errors, failed requests and requests leaving the site it caused."
    problems = []
    on_console = lambda m: m.type == "error" and problems.append(f"console: {m.text.splitlines()[0]}")
    on_error = lambda e: problems.append(f"page error: {e}")
    on_failed = lambda r: problems.append(f"request failed: {r.url} ({r.failure})")
    on_response = lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}")
    on_request = lambda r: (not r.url.startswith(base) and not r.url.startswith(("data:", "blob:"))
                            and problems.append(f"request outside the site: {r.url}"))
    handlers = [("console", on_console), ("pageerror", on_error), ("requestfailed", on_failed),
                ("response", on_response), ("request", on_request)]
    for event, fn in handlers: page.on(event, fn)
    page.goto(url, wait_until="networkidle")
    try: page.wait_for_function(TYPESET, timeout=10_000)                      # the math check says what is left
    except PlaywrightTimeout: pass
    for event, fn in handlers: page.remove_listener(event, fn)
    return problems


def check_api(page, name: str, html: str):
    text = page.evaluate(API_ENTRY, name)
    shapes = sorted(dict.fromkeys(SHAPE.findall(text or "")), key=lambda s: not s.startswith("Float"))
    visible = text is not None and page.locator(f'[id="{name.lower()}"]').is_visible()
    kind = "class" if name in CLASSES else "def"
    as_kind = bool(text) and re.search(rf"\b{kind} {re.escape(name.split('.')[-1])}\(", text) is not None
    report(f"api {html} {name}", visible and bool(shapes) and as_kind,
           f"`{kind} {name.split('.')[-1]}(` shown with {', '.join(shapes[:2])}" if visible and shapes and as_kind
           else "no visible entry" if not visible else "no shape annotation" if not shapes else f"not shown as `{kind} {name}(`")


def screenshot_ppo(page, path: Path):
    "The PPOLoss entry and, above it, the last display equation before its heading (with its paragraph) in one view."
    box = page.evaluate("""() => { const h = document.getElementById("ppoloss");
        const eqs = [...document.querySelectorAll("div.arithmatex")].filter(e => e.compareDocumentPosition(h) & Node.DOCUMENT_POSITION_FOLLOWING);
        const eq = eqs[eqs.length - 1], sig = h.nextElementSibling, start = eq.previousElementSibling || eq;
        const top = start.getBoundingClientRect().top + scrollY, bottom = sig.getBoundingClientRect().bottom + scrollY;
        return { top, bottom, eq: eq.querySelector("annotation").textContent.trim() }; }""")
    return screenshot_box(page, box, path)


def screenshot_box(page, box: dict, path: Path) -> dict:
    "A screenshot of the page region from box['top'] to box['bottom'] (page coordinates), in one view."
    header = 64                                                                 # Material's fixed header
    page.set_viewport_size({"width": 1280, "height": max(900, int(box["bottom"] - box["top"]) + header + 48)})
    page.evaluate(f"window.scrollTo(0, {box['top'] - header - 16})")
    page.wait_for_timeout(300)
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": 1280, "height": 900})
    return box


def screenshot_preview(page, path: Path) -> dict | None:
    "The tutorial's title, description and its 'What you will get' box (curves and before/after table) in one view."
    box = page.evaluate(PREVIEW)
    return screenshot_box(page, box, path) if box else None


def public_names() -> dict[str, str]:
    "{name: module} for every name in the `__all__` of an instruct_goose module."
    import instruct_goose
    names = {}
    for m in pkgutil.iter_modules(instruct_goose.__path__):
        if m.name.startswith("_"): continue
        for name in getattr(importlib.import_module(f"instruct_goose.{m.name}"), "__all__", []): names.setdefault(name, m.name)
    return names


def check_api_once(entries: dict[str, list[str]]):
    "Every public name has exactly one API entry (heading) on the whole site."
    where = {}
    for html, names in entries.items():
        for name in names: where.setdefault(name, []).append(html)
    names = public_names()
    missing = sorted(n for n in names if n not in where)
    twice = {n: where[n] for n in names if len(where.get(n, [])) > 1}
    detail = (f"{len(names)} public names, each with one API entry" if not (missing or twice) else
              "; ".join([f"no entry for {', '.join(f'{n} ({names[n]})' for n in missing[:8])}"] * bool(missing)
                        + [f"{n} documented {len(w)} times ({', '.join(w)})" for n, w in list(twice.items())[:8]]))
    report("every public name documented once", not (missing or twice), detail)


def main():
    global SITE
    if len(sys.argv) > 1: SITE = Path(sys.argv[1]).resolve()                   # another built site
    pages = sorted(p.name for p in SITE.glob("*.html") if p.name != "404.html")
    if not pages: sys.exit(f"no pages in {SITE}: run `make docs` first")
    (SITE / "screenshots").mkdir(exist_ok=True)
    server, base = serve(SITE)
    links, ids, math_pages, counts, api_entries = {}, {}, 0, {}, {}
    manifest_file = SITE / "docs-manifest.json"
    manifest = json.loads(manifest_file.read_text())["pages"] if manifest_file.exists() else {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            for html in pages:
                problems = open_page(page, base + html, base)
                report(f"load {html}", not problems, "; ".join(problems[:3]))
                math = page.evaluate(MATH)
                raw = sorted(set(RAW_MATH.findall(page.evaluate(VISIBLE_TEXT))))
                ok = math["typeset"] == math["spans"] and not math["errors"] and not raw
                math_pages += math["typeset"] > 0
                report(f"math {html}", ok, f"{math['typeset']}/{math['spans']} typeset by KaTeX, {math['errors']} errors"
                       + (f", raw TeX in the text: {raw[:3]}" if raw else ""))
                for name in API.get(html, []): check_api(page, name, html)
                out = page.evaluate(OUTPUTS)
                counts[html], api_entries[html] = (out["images"], out["tables"]), out["api"]
                report(f"outputs {html}", not out["errors"] and not out["traceback"] and not out["broken"],
                       f"{out['images']} images, {out['tables']} tables" + (f", {out['errors']} failed cells" if out["errors"] else "")
                       + (", a Python traceback" if out["traceback"] else "") + (f", broken images {out['broken'][:2]}" if out["broken"] else ""))
                if manifest.get(html, {}).get("group") == "Tutorials":
                    report(f"tutorial {html} shows a plot and a table", out["images"] >= 1 and out["tables"] >= 1,
                           f"{out['images']} images, {out['tables']} tables")
                if html in TUTORIAL_SHOTS:
                    box = screenshot_preview(page, SITE / "screenshots" / TUTORIAL_SHOTS[html])
                    report(f"screenshot {TUTORIAL_SHOTS[html]}", bool(box and box["images"] and box["tables"]),
                           f"title down to '{box['title']}': {box['images']} plot(s), {box['tables']} table(s)" if box
                           else "no 'What you will get' box on the page")
                found = page.evaluate(LINKS)
                ids[html] = set(found["ids"])
                for kind in ("nav", "content"):
                    for url in found[kind]:
                        if url.startswith(base): links.setdefault(url, (kind, html))
                if html == "index.html": page.screenshot(path=str(SITE / "screenshots" / "index.png"))
                if html == "losses.html":
                    box = screenshot_ppo(page, SITE / "screenshots" / "losses-ppo.png")
                    report("screenshot losses-ppo.png", "CLIP" in box["eq"], f"equation {box['eq'][:45]!r}… down to the PPOLoss signature")
            browser.close()
        report("screenshot index.png", (SITE / "screenshots" / "index.png").exists())
        missing_shots = [h for h in TUTORIAL_SHOTS if h not in pages]
        report("tutorial screenshots taken", not missing_shots, f"no page {', '.join(missing_shots)}" if missing_shots else
               ", ".join(f"screenshots/{s}" for s in TUTORIAL_SHOTS.values()))
        report("every page in the manifest", not manifest or set(manifest) <= set(pages),
               "docs-manifest.json lists every page" if manifest else "no docs-manifest.json (built by an older dev/docs.py)")
        check_api_once(api_entries)
        print(f"\n{'page':<28} {'images':>6} {'tables':>6}  group")
        for html, (n_img, n_tab) in counts.items():
            print(f"{html:<28} {n_img:>6} {n_tab:>6}  {manifest.get(html, {}).get('group', '')}")
        print()
        report("math is typeset somewhere", math_pages >= 10, f"KaTeX on {math_pages} of {len(pages)} pages")
        for kind in ("nav", "content"):
            bad = []
            for url, (_, source) in ((u, v) for u, v in links.items() if v[0] == kind):
                target, fragment = urldefrag(url)
                name = urlparse(target).path.rsplit("/", 1)[-1] or "index.html"
                code = status(target)
                if code != 200: bad.append(f"{url} from {source}: HTTP {code}")
                elif fragment and fragment not in ids.get(name, ()): bad.append(f"{url} from {source}: no #{fragment}")
            n = sum(v[0] == kind for v in links.values())
            report(f"{kind} links resolve", not bad, f"{n} distinct links, HTTP 200 and anchor present" if not bad else "; ".join(bad[:5]))
    finally:
        server.shutdown()
    print(f"{len(failures)} check(s) failed" if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
