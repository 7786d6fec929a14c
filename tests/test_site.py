"""The static site: built from the stored notebooks, opened in headless Chromium, offline.

Checks, on the index and on every notebook page: no request leaves the machine, math is
typeset (no raw TeX left in the text), every image loaded, saved widgets render, no script
errors. Screenshots go to test-artifacts/site/ for a person to look at.
"""

from __future__ import annotations

import functools
import http.server
import re
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build_site  # noqa: E402
import preflight  # noqa: E402

ARTIFACTS = ROOT / "test-artifacts" / "site"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# The flags that keep Chromium from calling home on a machine without a network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "site"
    build_site.build(out)
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output clean
        pass


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    chromium = preflight.find_chromium()
    if chromium is None:
        pytest.fail("the site test needs a Chromium: `python tools/preflight.py` says how")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Visit:
    """One page load with every request and console message recorded."""

    def __init__(self, browser, url: str):
        self.external: list[str] = []
        self.errors: list[str] = []
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        self.page.on("console", self._console)
        self.page.on("response", self._response)
        self.page.goto(url, wait_until="load")
        self.page.wait_for_load_state("networkidle")

    def _route(self, route):
        url = route.request.url
        host = urlparse(url).hostname
        if url.startswith("data:") or host == "127.0.0.1":
            route.continue_()
        else:
            self.external.append(url)
            route.abort()

    def _console(self, msg):
        # A failed load is reported by _response with its URL; other errors are kept.
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            self.errors.append(f"console: {msg.text}")

    def _response(self, response):
        if response.status >= 400 and not response.url.endswith("/favicon.ico"):
            self.errors.append(f"HTTP {response.status}: {response.url}")

    def broken_images(self) -> list[str]:
        return self.page.evaluate(
            "[...document.images].filter(i => !(i.complete && i.naturalWidth > 0))"
            ".map(i => i.src.slice(0, 80))"
        )

    def close(self):
        self.context.close()


def test_site_has_every_notebook(site):
    index = (site / "index.html").read_text()
    for nb in NOTEBOOKS:
        assert f"notebooks/{nb.stem}.html" in index
        assert (site / "notebooks" / f"{nb.stem}.html").exists()
    assert (site / "_static" / "mathjax" / "MathJax.js").exists()
    assert (site / "_static" / "html-manager" / "embed-amd.js").exists()
    assert (site / "_static" / "require.js").exists()


def test_no_page_names_a_cdn(site):
    for page in [site / "index.html", *(site / "notebooks").glob("*.html")]:
        text = page.read_text()
        for host in build_site.CDN_HOSTS:
            assert host not in text, f"{page.name} names {host}"
        for src in re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?://[^"]+)"', text):
            pytest.fail(f"{page.name} loads {src}")


def wait_for_math(page) -> int:
    """Wait until MathJax 2 has typeset the page; return how many formulas it rendered."""
    page.wait_for_function("window.MathJax && MathJax.Hub", timeout=20_000)
    page.evaluate("new Promise(done => MathJax.Hub.Queue(() => done(true)))")
    return page.eval_on_selector_all(".MathJax_CHTML, .MJXc-display", "e => e.length")


def test_index_in_chromium(browser, server):
    visit = Visit(browser, f"{server}/index.html")
    try:
        assert wait_for_math(visit.page) > 0
        text = visit.page.inner_text("body")
        assert "$" not in text and "`" not in text, "raw markdown left in the summaries"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        visit.page.screenshot(path=str(ARTIFACTS / "index.png"), full_page=True)
        assert visit.external == []
        assert visit.errors == []
        assert visit.broken_images() == []
        links = visit.page.eval_on_selector_all("ol.nb a", "els => els.map(e => e.href)")
        assert len(links) == len(NOTEBOOKS)
    finally:
        visit.close()


def _has_math(nb) -> bool:
    return any(c.cell_type == "markdown" and "$" in c.source for c in nb.cells)


def _widget_states(nb) -> dict:
    """The saved widget models of a notebook (model id -> state)."""
    saved = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    return saved.get("state", {})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_page_in_chromium(browser, server, path):
    nb = nbformat.read(path, as_version=4)
    visit = Visit(browser, f"{server}/notebooks/{path.stem}.html")
    page = visit.page
    try:
        if _has_math(nb):
            assert wait_for_math(page) > 0, "math was not typeset"
        text = page.eval_on_selector_all(
            ".jp-MarkdownOutput", "els => els.map(e => e.innerText).join('\\n')"
        )
        assert "$$" not in text, "raw display math left in the page"
        assert not re.search(r"\\(frac|sqrt|mathrm|sum)\b", text), "raw TeX left in the page"
        if "widgets" in nb.metadata:
            page.wait_for_selector(".jupyter-widgets", timeout=20_000)
            models = {w["model_name"] for w in _widget_states(nb).values()}
            if any("Slider" in name for name in models):  # interact() sliders, not only tqdm bars
                assert page.locator(".widget-slider, .widget-hslider").count() > 0
            widget = page.locator(".jupyter-widgets").first
            widget.scroll_into_view_if_needed()
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{path.stem}-widget.png"))
        hidden = sum(bool(c.metadata.get("jupyter", {}).get("source_hidden")) for c in nb.cells)
        assert page.locator(".celltag_hide-input").count() == hidden
        if hidden:  # figure code is collapsed, and one click shows it
            cell = page.locator(".celltag_hide-input").first
            code = cell.locator(".jp-Cell-inputWrapper")
            assert not code.is_visible()
            cell.locator("button.show-code").click()
            assert code.is_visible()
        assert visit.broken_images() == []
        assert visit.external == [], f"requests left the machine: {visit.external[:5]}"
        assert visit.errors == []
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{path.stem}.png"))
    finally:
        visit.close()
