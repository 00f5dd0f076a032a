"""Check the built site in a headless Chromium: `python tools/docs_check.py [SITE]` (after `python tools/docs.py`).

_site/ is served on 127.0.0.1 and every page is opened with Debian's /usr/bin/chromium, driven by Playwright
(never `playwright install`). Checks, one line each: no console error, failed request or request leaving the
site on any page; the math is typeset by KaTeX with no raw `$`, `\\(` or `\\[` left in the text; the API entries
of `Agent`, `AgentObjective`, `RLHFTrainer.compute_loss` and `PPOLoss` are shown with their jaxtyping shapes;
every navigation and internal link resolves (HTTP 200, and the anchor exists). Screenshots of the overview and of
the PPO loss go to _site/screenshots/. Exits 1 if any check fails.
"""
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
API = {"agent.html": ["Agent", "AgentObjective"], "trainer.html": ["RLHFTrainer.compute_loss"], "losses.html": ["PPOLoss"]}
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
    report(f"api {html} {name}", visible and bool(shapes),
           f"shown with {', '.join(shapes[:2])}" if visible and shapes else "no visible entry" if not visible else "no shape annotation")


def screenshot_ppo(page, path: Path):
    "The PPOLoss entry and, above it, the last display equation before its heading (with its paragraph) in one view."
    box = page.evaluate("""() => { const h = document.getElementById("ppoloss");
        const eqs = [...document.querySelectorAll("div.arithmatex")].filter(e => e.compareDocumentPosition(h) & Node.DOCUMENT_POSITION_FOLLOWING);
        const eq = eqs[eqs.length - 1], sig = h.nextElementSibling, start = eq.previousElementSibling || eq;
        const top = start.getBoundingClientRect().top + scrollY, bottom = sig.getBoundingClientRect().bottom + scrollY;
        return { top, bottom, eq: eq.querySelector("annotation").textContent.trim() }; }""")
    header = 64                                                                 # Material's fixed header
    page.set_viewport_size({"width": 1280, "height": max(900, int(box["bottom"] - box["top"]) + header + 48)})
    page.evaluate(f"window.scrollTo(0, {box['top'] - header - 16})")
    page.wait_for_timeout(300)
    page.screenshot(path=str(path))
    page.set_viewport_size({"width": 1280, "height": 900})
    return box


def main():
    global SITE
    if len(sys.argv) > 1: SITE = Path(sys.argv[1]).resolve()                   # another built site
    pages = sorted(p.name for p in SITE.glob("*.html") if p.name != "404.html")
    if not pages: sys.exit(f"no pages in {SITE}: run `make docs` first")
    (SITE / "screenshots").mkdir(exist_ok=True)
    server, base = serve(SITE)
    links, ids, math_pages = {}, {}, 0
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
