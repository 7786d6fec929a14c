"""Run, link and check the course's notebooks.

    python tools/notebooks.py execute [NN ...]   execute notebooks/NN_*.py in a fresh kernel and
                                                 store the outputs in the paired .ipynb
    python tools/notebooks.py figures [NN ...]   execute without storing outputs (refreshes
                                                 figures/ only)
    python tools/notebooks.py links              write the GitHub location from pyproject.toml
                                                 into every Colab link and Colab install line
    python tools/notebooks.py check              pairs in sync, links right, hygiene (fast)

The .py file (jupytext percent format) is the source; the .ipynb holds the same cells plus
their outputs, which nbval compares in CI. Outputs are only ever stored by `execute`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import tomllib
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
ALLOWED_NOTEBOOK_METADATA = {"kernelspec", "language_info", "widgets"}
ALLOWED_CELL_METADATA = {"tags"}
KNOWN_TAGS = {"nbval-ignore-output", "nbval-skip", "raises-exception", "hide-input"}
COLAB_LINK = re.compile(r"https://colab\.research\.google\.com/github/[^)\s\"']+")
INSTALL_URL = re.compile(r"git\+https://github\.com/[^\s\"']+")
# Environment of every kernel that produces or checks stored outputs (the Makefile exports the
# same): one thread per kernel, so that reductions add up in the same order every time and two
# nbval workers share two cores without oversubscribing them.
KERNEL_ENV = {
    "PYTHONHASHSEED": "0",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def settings() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["course"]


def colab_url(notebook: Path) -> str:
    s = settings()
    return (
        f"https://colab.research.google.com/github/{s['github_repo']}/blob/{s['branch']}"
        f"/notebooks/{notebook.stem}.ipynb"
    )


def install_url() -> str:
    s = settings()
    return f"git+https://github.com/{s['github_repo']}@{s['branch']}"


def sources(selection: list[str] | None = None) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    if selection:
        paths = [p for p in paths if any(p.name.startswith(s) for s in selection)]
        if not paths:
            raise SystemExit(f"no notebook matches {selection}")
    return paths


def clean_metadata(nb: nbformat.NotebookNode) -> None:
    widgets = nb.metadata.get("widgets")
    nb.metadata = nbformat.from_dict(
        {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}}
    )
    if widgets:
        nb.metadata["widgets"] = widgets
    for cell in nb.cells:
        tags = cell.metadata.get("tags")
        cell.metadata = nbformat.from_dict({"tags": tags} if tags else {})
        cell.pop("id", None)
        if cell.cell_type == "code":
            for output in cell.outputs:
                output.get("metadata", {}).pop("execution", None)
    nb.nbformat, nb.nbformat_minor = 4, 4


def execute(paths: list[Path], store: bool = True) -> None:
    from nbclient import NotebookClient

    os.environ.update(KERNEL_ENV)
    for path in paths:
        nb = jupytext.read(path)
        nb.metadata["kernelspec"] = KERNELSPEC
        start = time.perf_counter()
        client = NotebookClient(
            nb,
            timeout=1800,
            kernel_name="python3",
            resources={"metadata": {"path": str(NOTEBOOKS)}},
            store_widget_state=True,
            record_timing=False,
        )
        client.execute()
        seconds = time.perf_counter() - start
        if store:
            clean_metadata(nb)
            nbformat.write(nb, path.with_suffix(".ipynb"))
            # The .py is the source: keep it the newer file so `jupytext --sync` reads it.
            os.utime(path)
        print(f"{path.stem}: executed in {seconds:.1f} s" + ("" if store else " (not stored)"))


def write_links() -> None:
    text = README.read_text()
    if readme_with_table(text) != text:
        README.write_text(readme_with_table(text))
        print("updated the table of notebooks in README.md")
    for py in sources():
        text = py.read_text()
        new = COLAB_LINK.sub(colab_url(py), text)
        new = INSTALL_URL.sub(install_url(), new)
        if new != text:
            py.write_text(new)
            print(f"updated links in {py.name}")
        ipynb = py.with_suffix(".ipynb")
        if ipynb.exists():
            nb = nbformat.read(ipynb, as_version=4)
            changed = False
            for cell in nb.cells:
                fixed = INSTALL_URL.sub(install_url(), COLAB_LINK.sub(colab_url(py), cell.source))
                if fixed != cell.source:
                    cell.source, changed = fixed, True
            if changed:
                nbformat.write(nb, ipynb)
                os.utime(py)
                print(f"updated links in {ipynb.name}")


README = ROOT / "README.md"
TABLE_START, TABLE_END = "<!-- notebooks:start -->", "<!-- notebooks:end -->"


def readme_table() -> str:
    """The README's table of notebooks, made from their title cells."""
    rows = ["| # | notebook | what you build | |", "|---|---|---|---|"]
    for py in sources():
        nb = jupytext.read(py)
        first = nb.cells[0].source if nb.cells else ""
        title = re.match(r"#\s*\d\d\s*·\s*(.+)", first.splitlines()[0] if first else "")
        build = re.search(r"\*\*What you will build:\*\*\s*(.+?)(?:\n\n|$)", first, re.S)
        summary = " ".join(build.group(1).split()) if build else ""
        name = title.group(1).strip() if title else py.stem
        rows.append(
            f"| {py.name[:2]} | [{name}](notebooks/{py.stem}.ipynb) | {summary} "
            f"| [Colab]({colab_url(py)}) |"
        )
    return "\n".join(rows)


def readme_with_table(text: str) -> str:
    start, end = text.index(TABLE_START), text.index(TABLE_END)
    return text[: start + len(TABLE_START)] + "\n" + readme_table() + "\n" + text[end:]


# ---------------------------------------------------------------- checks
def problems_in(py: Path) -> list[str]:
    """Everything wrong with one pair, as messages; empty when the pair is fine."""
    found: list[str] = []
    ipynb = py.with_suffix(".ipynb")
    if not ipynb.exists():
        return [f"{ipynb.name} is missing: run `make execute NB={py.name[:2]}`"]
    text_nb = jupytext.read(py)
    nb = nbformat.read(ipynb, as_version=4)
    name = ipynb.name

    # 1. The pair holds the same cells (drift in either direction fails, whatever the mtimes).
    a = [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in text_nb.cells]
    b = [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]
    if a != b:
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                found.append(f"{name}: cell {i} differs from {py.name}: run `make sync`")
                break
        else:
            found.append(f"{name}: {len(b)} cells but {py.name} has {len(a)}: run `make sync`")

    # 2. Metadata: nothing from Colab, editors or jupytext's own bookkeeping.
    extra = set(nb.metadata) - ALLOWED_NOTEBOOK_METADATA
    if extra:
        found.append(f"{name}: notebook metadata {sorted(extra)} should not be stored")
    if nb.metadata.get("kernelspec", {}).get("name") != "python3":
        found.append(f"{name}: kernelspec must be python3")
    for i, cell in enumerate(nb.cells):
        extra = set(cell.metadata) - ALLOWED_CELL_METADATA
        if extra:
            found.append(f"{name}: cell {i} metadata {sorted(extra)} should not be stored")
        unknown = set(cell.metadata.get("tags", [])) - KNOWN_TAGS
        if unknown:
            found.append(f"{name}: cell {i} has unknown tags {sorted(unknown)}")

    # 3. Executed in order, 1..N; no errors, no stderr.
    code = [c for c in nb.cells if c.cell_type == "code"]
    counts = [c.execution_count for c in code]
    if counts != list(range(1, len(code) + 1)):
        found.append(f"{name}: execution counts {counts} are not 1..{len(code)}: `make execute`")
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "error":
                found.append(f"{name}: cell {i} stores an error ({out.ename})")
            if out.output_type == "stream" and out.name == "stderr":
                found.append(f"{name}: cell {i} stores stderr: {out.text[:80]!r}")
            data = out.get("data", {})
            if "image/svg+xml" in data:
                found.append(f"{name}: cell {i} stores an SVG figure (nbval compares its text)")
            if re.search(r" at 0x[0-9a-f]{6,}", data.get("text/plain", "") + out.get("text", "")):
                found.append(f"{name}: cell {i} prints a memory address")
            if re.search(r"^\[<matplotlib\.", data.get("text/plain", "")):
                found.append(f"{name}: cell {i} shows a matplotlib repr: assign to _")

    # 4. Anatomy: title with a Colab link first, then the setup cell.
    first = nb.cells[0] if nb.cells else None
    if not first or first.cell_type != "markdown" or not first.source.startswith("# "):
        found.append(f"{name}: the first cell must be the markdown title ('# NN · Title')")
    elif colab_url(py) not in first.source:
        found.append(f"{name}: the title cell lacks the Open-in-Colab link: `make sync`")
    setup = code[0].source if code else ""
    if "google.colab" not in setup or install_url() not in setup:
        found.append(f"{name}: the first code cell must be the setup cell with the Colab install")
    for i, cell in enumerate(nb.cells):
        if re.search(r"\bTODO\b|\bFIXME\b|\bTBD\b", cell.source):
            found.append(f"{name}: cell {i} has placeholder text")
    return found


def check(paths: list[Path]) -> int:
    problems = [p for path in paths for p in problems_in(path)]
    orphans = [p.name for p in NOTEBOOKS.glob("*.ipynb") if not p.with_suffix(".py").exists()]
    problems += [f"{o}: no .py pair" for o in orphans]
    text = README.read_text()
    if readme_with_table(text) != text:
        problems.append("README.md: the table of notebooks is stale: run `make links`")
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{len(paths)} notebook pairs: in sync, executed in order, clean.")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["execute", "figures", "links", "check"])
    parser.add_argument("notebooks", nargs="*", help="number prefixes, e.g. 01 02")
    args = parser.parse_args()
    if args.command == "execute":
        execute(sources(args.notebooks))
    elif args.command == "figures":
        execute(sources(args.notebooks), store=False)
    elif args.command == "links":
        write_links()
    elif args.command == "check":
        return check(sources(args.notebooks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
