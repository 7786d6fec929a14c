"""Render the course as a static site that reads offline.

    python tools/build_site.py OUT

writes OUT/index.html (the parts of the course, each notebook with its title and summary),
OUT/notebooks/NN_topic.html (every notebook with its stored outputs), OUT/figures/ and
OUT/_static/ with the vendored JavaScript:

- MathJax 2.7 (the version nbconvert's template is written for), with its TeX web fonts;
- require.js and the Jupyter widgets HTML manager, so saved widget state renders without a
  kernel.

All three come from the npm registry: `npm pack` of the versions pinned in
tools/vendor/package.json, cached in build/vendor/ (npm is needed once).

No page refers to a CDN; tests/test_site.py checks that in headless Chromium.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import nbformat
from course import NOTEBOOKS
from course import ROOT
from course import notebook_info
from nbconvert import HTMLExporter

VENDOR_SPEC = ROOT / "tools" / "vendor" / "package.json"
VENDOR_CACHE = ROOT / "build" / "vendor"
MATHJAX_CONFIG = "TeX-AMS_CHTML-full,Safe"
COURSE_TITLE = "The Transformer from scratch"
PARTS = [
    ("I", "Attention", range(0, 4)),
    ("II", "From a set to a sequence", range(4, 8)),
    ("III", "The Transformer", range(8, 11)),
    ("IV", "Training and generation", range(11, 13)),
    ("V", "Into practice", range(13, 16)),
    ("VI", "From the Transformer to today's language models", range(16, 18)),
]
# Hosts a page must never load from; the browser test also blocks every non-local request.
CDN_HOSTS = ("cdnjs.cloudflare.com", "unpkg.com", "cdn.jsdelivr.net", "googleapis.com")


def npm_tarballs() -> dict[str, Path]:
    """The pinned npm packages as tarballs in build/vendor/, fetched with `npm pack` once."""
    deps = json.loads(VENDOR_SPEC.read_text())["dependencies"]
    VENDOR_CACHE.mkdir(parents=True, exist_ok=True)
    tarballs = {}
    for name, version in deps.items():
        tarball = VENDOR_CACHE / f"{name.lstrip('@').replace('/', '-')}-{version}.tgz"
        if not tarball.exists():
            if shutil.which("npm") is None:
                raise SystemExit("npm is needed once to fetch the site's JavaScript (apt: npm)")
            subprocess.run(
                ["npm", "pack", "--silent", f"{name}@{version}", "--pack-destination", "."],
                cwd=VENDOR_CACHE,
                check=True,
                stdout=subprocess.DEVNULL,
            )
        tarballs[name] = tarball
    return tarballs


def extract(tarball: Path, dest: Path, keep) -> int:
    """Copy the files of an npm tarball for which keep(path inside the package) is true."""
    count = 0
    with tarfile.open(tarball) as tar:
        for member in tar.getmembers():
            inner = member.name.removeprefix("package/")
            if member.isfile() and keep(inner):
                target = dest / inner
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                count += 1
    return count


def _mathjax_file(path: str) -> bool:
    # The packed build only, with the TeX fonts as woff and the English messages.
    if path.startswith(("unpacked/", "test/", "docs/")):
        return False
    if path.startswith("fonts/"):
        return path.startswith("fonts/HTML-CSS/TeX/woff/")
    if path.startswith("localization/"):
        return path.startswith("localization/en/")
    return path.endswith(".js") or path == "LICENSE"


def _widget_file(path: str) -> bool:
    name = path.removeprefix("dist/")
    return (
        path.startswith("dist/")
        and "/" not in name
        and not name.endswith(".map")
        and (not name.startswith("embed.js"))
    )


def vendor(static: Path) -> None:
    tarballs = npm_tarballs()
    extract(tarballs["mathjax"], static / "mathjax", _mathjax_file)
    extract(tarballs["requirejs"], static, lambda p: p == "require.js")
    extract(
        tarballs["@jupyter-widgets/html-manager"],
        static / "html-manager",
        _widget_file,
    )
    # extract() keeps the dist/ folder; the page loads html-manager/embed-amd.js.
    dist = static / "html-manager" / "dist"
    for item in dist.iterdir():
        item.rename(static / "html-manager" / item.name)
    dist.rmdir()


def exporter() -> HTMLExporter:
    exp = HTMLExporter(template_name="lab")
    exp.mathjax_url = f"../_static/mathjax/MathJax.js?config={MATHJAX_CONFIG}"
    exp.require_js_url = "../_static/require.js"
    exp.widget_renderer_url = "../_static/html-manager/embed-amd.js"
    exp.jquery_url = ""
    # The course draws no mermaid diagrams; keep the template from naming a CDN.
    exp.mermaid_js_url = "../_static/no-mermaid.mjs"
    exp.mermaid_layout_elk_js_url = ""
    return exp


def nav(info: dict, prev: dict | None, nxt: dict | None) -> str:
    def link(item: dict | None, arrow: str) -> str:
        if not item:
            return "<span></span>"
        label = f"{item['number']:02d} · {html.escape(item['title'])}"
        text = f"{arrow} {label}" if arrow == "←" else f"{label} {arrow}"
        return f'<a href="{item["stem"]}.html">{text}</a>'

    return (
        '<nav class="course-nav" style="display:flex;justify-content:space-between;gap:1em;'
        "max-width:1100px;margin:0.5em auto;padding:0.5em 1em;font-family:sans-serif;"
        'font-size:14px;border-bottom:1px solid #ddd">'
        f"{link(prev, '←')}"
        f'<a href="../index.html">{html.escape(COURSE_TITLE)}: contents</a>'
        f"{link(nxt, '→')}</nav>"
    )


# Cells whose code only draws a figure carry jupyter={"source_hidden": true}: JupyterLab shows
# them collapsed, and so does the site, with a button that shows the code on demand.
HIDDEN_TAG = "hide-input"
TOGGLE = """
<style>
.celltag_hide-input > .jp-Cell-inputWrapper { display: none; }
.celltag_hide-input.show-input > .jp-Cell-inputWrapper { display: block; }
button.show-code { margin: 0.3em 0 0.3em 6em; font: 12px sans-serif; color: #555;
  background: #f5f5f5; border: 1px solid #ccc; border-radius: 3px; cursor: pointer; }
</style>
<script>
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll(".celltag_hide-input").forEach(function (cell) {
    var button = document.createElement("button");
    button.className = "show-code";
    button.textContent = "▸ show the code of this figure";
    button.addEventListener("click", function () {
      var shown = cell.classList.toggle("show-input");
      button.textContent = (shown ? "▾ hide" : "▸ show") + " the code of this figure";
    });
    cell.insertBefore(button, cell.firstChild);
  });
});
</script>
"""


def tag_hidden_cells(nb: nbformat.NotebookNode) -> int:
    """Tag the cells JupyterLab shows collapsed, so the template marks them; return how many."""
    count = 0
    for cell in nb.cells:
        if cell.metadata.get("jupyter", {}).get("source_hidden"):
            cell.metadata.setdefault("tags", []).append(HIDDEN_TAG)
            count += 1
    return count


def render_notebook(path: Path, out: Path, info: dict, prev, nxt) -> None:
    nb = nbformat.read(path, as_version=4)
    tag_hidden_cells(nb)
    body, _ = exporter().from_notebook_node(nb, resources={"metadata": {"name": info["title"]}})
    body = body.replace("</head>", TOGGLE + "</head>", 1)
    # Links between notebooks point at the rendered pages.
    body = re.sub(r'href="(\d\d_[a-z0-9_]+)\.ipynb', r'href="\1.html', body)
    body = body.replace(
        "<title>", f"<title>{info['number']:02d} · {html.escape(info['title'])} — ", 1
    )
    body = re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + nav(info, prev, nxt), body, count=1)
    for host in CDN_HOSTS:
        if host in body:
            raise SystemExit(f"{path.name}: the rendered page still names {host}")
    (out / f"{path.stem}.html").write_text(body)


def inline_markdown(text: str) -> str:
    """A summary sentence as HTML: code spans and emphasis rendered, $math$ left to MathJax."""
    import mistune

    rendered = mistune.html(text).strip()
    return rendered.removeprefix("<p>").removesuffix("</p>")


def render_index(out: Path, infos: list[dict]) -> None:
    sections = []
    for numeral, name, numbers in PARTS:
        items = [i for i in infos if i["number"] in numbers]
        if not items:
            continue
        rows = "".join(
            f'<li><a href="notebooks/{i["stem"]}.html"><b>{i["number"]:02d} · '
            f"{html.escape(i['title'])}</b></a><br><span>{inline_markdown(i['summary'])}</span></li>"
            for i in items
        )
        sections.append(f"<h2>Part {numeral} — {html.escape(name)}</h2><ol class='nb'>{rows}</ol>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(COURSE_TITLE)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 860px; margin: 2em auto; padding: 0 1em;
       line-height: 1.5; color: #222; }}
h1 {{ margin-bottom: 0.2em; }} h2 {{ margin-top: 1.6em; border-bottom: 1px solid #ddd; }}
ol.nb {{ list-style: none; padding-left: 0; }} ol.nb li {{ margin: 0.8em 0; }}
ol.nb span {{ color: #555; }} a {{ color: #1f5fa8; text-decoration: none; }}
a:hover {{ text-decoration: underline; }}
code {{ font-size: 0.92em; background: #f3f3f3; padding: 0 0.2em; border-radius: 3px; }}
</style>
<script type="text/x-mathjax-config">
MathJax.Hub.Config({{tex2jax: {{inlineMath: [["$", "$"]], processEscapes: true}}}});
</script>
<script src="_static/mathjax/MathJax.js?config={MATHJAX_CONFIG}"></script>
</head><body>
<h1>{html.escape(COURSE_TITLE)}</h1>
<p>The original encoder–decoder Transformer, built one component at a time in PyTorch. Every
notebook is executed in CI; each component is checked against PyTorch's own. These pages show
the stored outputs, so they read without a kernel and without a network connection.</p>
<figure><img src="figures/course_colors.png" alt="The colours used throughout the course"
 style="max-width:420px"></figure>
{"".join(sections)}
</body></html>
"""
    (out / "index.html").write_text(page)


def build(out: Path) -> list[Path]:
    out = out.resolve()
    if out.exists():
        shutil.rmtree(out)
    static = out / "_static"
    (out / "notebooks").mkdir(parents=True)
    static.mkdir()
    vendor(static)
    shutil.copytree(ROOT / "figures", out / "figures")
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    infos = []
    for path in paths:
        info = notebook_info(nbformat.read(path, as_version=4), path.name)
        info["stem"] = path.stem
        infos.append(info)
    for k, (path, info) in enumerate(zip(paths, infos, strict=True)):
        prev = infos[k - 1] if k else None
        nxt = infos[k + 1] if k + 1 < len(infos) else None
        render_notebook(path, out / "notebooks", info, prev, nxt)
    render_index(out, infos)
    return [out / "index.html", *(out / "notebooks" / f"{p.stem}.html" for p in paths)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    pages = build(Path(argv[0]))
    print(f"wrote {len(pages)} pages to {argv[0]}/ (open {argv[0]}/index.html)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
