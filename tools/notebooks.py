"""Run, link and check the course's notebooks.

    python tools/notebooks.py execute [NN ...]   execute notebooks/NN_*.py in a fresh kernel and
                                                 store the outputs in the paired .ipynb
    python tools/notebooks.py figures [NN ...]   execute without storing outputs (refreshes
                                                 figures/ only)
    python tools/notebooks.py run [NN ...]       execute copies in a scratch folder: nothing in
                                                 the repository changes (compatibility runs)
    python tools/notebooks.py nbval [NN ...] [--jobs J]
                                                 nbval strict on copies in a scratch folder
                                                 (the repository stays as it was)
    python tools/notebooks.py twice [NN ...]     "Run All" twice in one kernel, then each cell
                                                 again from the last to the first, as a JupyterLab
                                                 reader might: every cell must survive a re-run
    python tools/notebooks.py links              write the GitHub location from pyproject.toml
                                                 into every Colab link and setup cell
    python tools/notebooks.py fork OWNER/NAME [--branch B]
                                                 point pyproject.toml and every link at a fork
    python tools/notebooks.py check              pairs in sync, links right, hygiene (fast)

The .py file (jupytext percent format) is the source; the .ipynb holds the same cells plus
their outputs, which nbval compares in CI. Outputs are only ever stored by `execute`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import nbformat
from course import KERNELSPEC
from course import NOTEBOOKS
from course import PYPROJECT
from course import README
from course import ROOT
from course import colab_url
from course import jupytext_metadata
from course import kernel_env
from course import notebook_info
from course import py_text
from course import read_py
from course import settings
from course import setup_cell
from course import sources

ALLOWED_NOTEBOOK_METADATA = {"kernelspec", "language_info", "widgets", "jupytext"}
ALLOWED_CELL_METADATA = {"tags", "jupyter"}
# `jupyter={"source_hidden": true}` collapses a cell's code in JupyterLab (and, through
# tools/build_site.py, on the site): for cells that only draw a figure.
HIDDEN = {"source_hidden": True}
KNOWN_TAGS = {"nbval-ignore-output", "nbval-skip", "raises-exception"}
COLAB_LINK = re.compile(r"https://colab\.research\.google\.com/github/[^)\s\"']+")
TABLE_START, TABLE_END = "<!-- notebooks:start -->", "<!-- notebooks:end -->"
LIBRARY_START, LIBRARY_END = "<!-- library:start -->", "<!-- library:end -->"


def clean_metadata(nb: nbformat.NotebookNode) -> None:
    widgets = nb.metadata.get("widgets")
    nb.metadata = nbformat.from_dict(
        {
            "jupytext": jupytext_metadata(),
            "kernelspec": KERNELSPEC,
            "language_info": {"name": "python"},
        }
    )
    if widgets:
        nb.metadata["widgets"] = widgets
    for cell in nb.cells:
        kept = {k: cell.metadata[k] for k in ALLOWED_CELL_METADATA if cell.metadata.get(k)}
        cell.metadata = nbformat.from_dict(kept)
        cell.pop("id", None)
        if cell.cell_type == "code":
            for output in cell.outputs:
                output.get("metadata", {}).pop("execution", None)
    nb.nbformat, nb.nbformat_minor = 4, 4


def execute_one(path: Path, workdir: Path, timeout: int = 1800) -> nbformat.NotebookNode:
    """Execute the notebook `path` (a .py) in a fresh kernel whose working folder is `workdir`."""
    from nbclient import NotebookClient

    nb = read_py(path)
    nb.metadata["kernelspec"] = KERNELSPEC
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
        store_widget_state=True,
        record_timing=False,
    )
    client.execute()
    return nb


def store_kernel_env() -> dict[str, str]:
    """The CPU kernel that stores outputs: PyTorch's AVX2 one wherever the CPU has AVX2.

    PyTorch picks the widest vector kernel a CPU offers (AVX-512 on newer x86 machines), and each
    rounds differently, so a training run in notebooks 11-15 ends elsewhere on another CPU, and
    the numbers the prose quotes from "the stored run" would change with the machine that last
    ran `make execute`. With AVX2, which every x86-64 CPU since 2013 has, any such machine
    stores the same run. (nbval and `make robust` still run the native and the other kernels.)
    """
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:  # not Linux: leave PyTorch's own choice
        return {}
    return {"ATEN_CPU_CAPABILITY": "avx2"} if "avx2" in flags else {}


def execute(paths: list[Path], store: bool = True) -> None:
    os.environ.update(kernel_env())
    os.environ.update(store_kernel_env())
    for path in paths:
        start = time.perf_counter()
        nb = execute_one(path, NOTEBOOKS)
        seconds = time.perf_counter() - start
        if store:
            clean_metadata(nb)
            nbformat.write(nb, path.with_suffix(".ipynb"))
        print(f"{path.stem}: executed in {seconds:.1f} s" + ("" if store else " (not stored)"))


@contextlib.contextmanager
def scratch_copy(prefix: str) -> Iterator[Path]:
    """A scratch folder with its own pyproject.toml and figures/, so that save_figure and the
    checkpoints of notebooks 11-12 write there and the repository stays as it is."""
    os.environ.update(kernel_env())
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        scratch = Path(folder)
        (scratch / "notebooks").mkdir()
        (scratch / "figures").mkdir()
        shutil.copy(PYPROJECT, scratch / "pyproject.toml")
        yield scratch / "notebooks"


# A notebook that loads a checkpoint an earlier one saves (12 loads 11's model, 17 loads 16's)
# runs right after it in the same lane, so that it loads the checkpoint, as a reader going through
# the course does, instead of training the model again (minutes). Under pytest-xdist's
# `--dist loadfile` the two usually ran side by side, and the second trained it again.
AFTER = {"12": "11", "17": "16"}
# About how many seconds each notebook takes under nbval, one thread each, two side by side
# (`make nbval` on 2 cores, 2026-12-05: 11 and 12 together 654 s, 16 and 17 595 s, 15 325 s, 13
# 189 s, 14 68 s): only to start the longest first, so that the lanes end together. A wrong
# guess costs balance, never correctness; unlisted notebooks count 20 s.
NBVAL_SECONDS = {"11": 500, "12": 150, "13": 190, "14": 70, "15": 330, "16": 480, "17": 120}


def nbval_units(notebooks: list[Path], after: dict[str, str] = AFTER) -> list[list[Path]]:
    """The notebooks grouped into units that one pytest process runs in order: a notebook joins
    the unit of the notebook it loads a checkpoint from (`after`) when that one runs too. The
    units come longest first (`NBVAL_SECONDS`), each in course order."""
    units: dict[str, list[Path]] = {}
    for path in notebooks:  # in course order, so that an earlier notebook has its unit already
        prefix = path.name[:2]
        first = after.get(prefix)
        while first in after and first not in units:  # a chain: 17 after 16 after ...
            first = after[first]
        units.setdefault(first if first in units else prefix, []).append(path)

    def seconds(unit: list[Path]) -> int:
        return sum(NBVAL_SECONDS.get(path.name[:2], 20) for path in unit)

    return sorted(units.values(), key=seconds, reverse=True)  # stable: ties keep course order


def nbval_in_scratch(
    notebooks: list[Path],
    jobs: int = 2,
    junit: Path | None = None,
    quiet: bool = False,
    after: dict[str, str] = AFTER,
) -> int:
    """nbval strict on copies of `notebooks` (.ipynb) in a scratch folder; 0 when every cell
    passed, else the first failing pytest exit code.

    The copies run where their figures, checkpoints and data land in the scratch folder, so a
    test run leaves the repository as it was (another machine draws other pixels), and no
    checkpoint left by an earlier run is loaded. With `jobs` > 1, `jobs` lanes take the units of
    `nbval_units` (longest first) as they come free, one pytest process per unit, so a notebook
    that loads an earlier one's checkpoint finds it; each unit's report is printed as it ends.
    """
    with scratch_copy("course-nbval-") as folder:
        for notebook in notebooks:
            shutil.copy(notebook, folder / notebook.name)
        command = [
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "nbval_patience",
            "--nbval", "--nbval-current-env", "--nbval-sanitize-with",
            str(ROOT / "tests" / "nbval_sanitize.cfg"), "--rootdir", str(folder.parent),
        ]  # fmt: skip
        if quiet:
            command += ["-q", "--no-header"]
        tools = str(Path(__file__).resolve().parent)  # where nbval_patience.py lives
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [tools, os.environ.get("PYTHONPATH")])),
        }
        if jobs <= 1:
            if junit is not None:
                command += ["--junitxml", str(junit)]
            command += [str(folder / notebook.name) for notebook in notebooks]
            return subprocess.run(command, cwd=folder.parent, env=env).returncode

        units = nbval_units(notebooks, after)
        names = [", ".join(path.stem for path in unit) for unit in units]
        reports = [folder.parent / f"junit-{i}.xml" for i in range(len(units))]
        started = time.perf_counter()
        lock = threading.Lock()  # one unit's lines at a time

        def run_unit(i: int) -> int:
            with lock:  # whole lines: print writes the text and its newline apart
                print(f"nbval: started {names[i]}", flush=True)
            start = time.perf_counter()
            done = subprocess.run(
                command + ["--junitxml", str(reports[i])]
                + [str(folder / path.name) for path in units[i]],
                cwd=folder.parent, env=env, capture_output=True, text=True,
            )  # fmt: skip
            with lock:  # one unit's report at a time
                print(f"\n===== nbval: {names[i]}: exit code {done.returncode}, "
                      f"{time.perf_counter() - start:.0f} s =====")  # fmt: skip
                print(done.stdout + done.stderr, end="", flush=True)
            return done.returncode

        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            codes = list(pool.map(run_unit, range(len(units))))
        failed = [name for name, code in zip(names, codes, strict=True) if code]
        print(f"\nnbval: {len(units)} units on {jobs} lanes in "
              f"{time.perf_counter() - started:.0f} s; "
              + (f"FAILED: {'; '.join(failed)}" if failed else "all passed"))  # fmt: skip
        if junit is not None:
            merged = ET.Element("testsuites")
            for report in reports:
                if report.exists():
                    root = ET.parse(report).getroot()
                    merged.extend(root.iter("testsuite") if root.tag == "testsuites" else [root])
            ET.ElementTree(merged).write(junit)
        return next((code for code in codes if code), 0)


def report_failure(what: str, err: Exception, lines: int = 20) -> None:
    print(what)
    print("\n".join("    " + line for line in str(err).strip().splitlines()[-lines:]))


def run_elsewhere(paths: list[Path]) -> int:
    """Execute every notebook top to bottom in a scratch copy; report each; 1 if any failed.

    Outputs are not compared: this is the compatibility run (another torch, Colab's pins),
    where only errors count.
    """
    from nbclient.exceptions import CellExecutionError

    failed = []
    with scratch_copy("course-run-") as folder:
        for path in paths:
            start = time.perf_counter()
            shutil.copy(path, folder / path.name)
            try:
                execute_one(folder / path.name, folder)
            except CellExecutionError as err:
                failed.append(path.stem)
                report_failure(
                    f"{path.stem}: FAILED after {time.perf_counter() - start:.1f} s", err
                )
                continue
            print(f"{path.stem}: ran in {time.perf_counter() - start:.1f} s", flush=True)
    import torch

    print(f"torch {torch.__version__}: {len(paths) - len(failed)} of {len(paths)} notebooks ran")
    return 1 if failed else 0


def run_twice(paths: list[Path]) -> int:
    """Run All, Run All again, then re-run each code cell alone from the last to the first, in
    one kernel: what a reader does in JupyterLab. A cell that fails on the second pass depends
    on the state later cells leave; one that fails on the third, on a name a later cell rebinds.
    1 if any cell failed."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    failed = 0
    with scratch_copy("course-twice-") as folder:
        for path in paths:
            nb = read_py(path)
            nb.metadata["kernelspec"] = KERNELSPEC
            resources = {"metadata": {"path": str(folder)}}
            client = NotebookClient(nb, timeout=1800, kernel_name="python3", resources=resources)
            code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
            passes = {"run 1": code, "run 2": code, "each cell again, last first": code[::-1]}
            start = time.perf_counter()
            with client.setup_kernel():
                for label, cells in passes.items():
                    try:
                        for index, cell in cells:
                            client.execute_cell(cell, index)
                    except CellExecutionError as err:
                        failed += 1
                        report_failure(f"{path.stem}: {label}: FAILED in cell {index}", err, 12)
                        break
                else:
                    print(f"{path.stem}: ran twice, then cell by cell backwards, in "
                          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return 1 if failed else 0


# ---------------------------------------------------------------- links, fork, README table
def linked(nb: nbformat.NotebookNode, py: Path) -> bool:
    """Write the Colab link into the title cell and the setup cell; True if anything changed."""
    changed = nb.metadata.get("jupytext") != jupytext_metadata()
    nb.metadata["jupytext"] = jupytext_metadata()
    if nb.cells and nb.cells[0].cell_type == "markdown":
        fixed = COLAB_LINK.sub(colab_url(py), nb.cells[0].source)
        changed |= fixed != nb.cells[0].source
        nb.cells[0].source = fixed
    code = [c for c in nb.cells if c.cell_type == "code"]
    if code and "google.colab" in code[0].source and code[0].source != setup_cell():
        code[0].source, changed = setup_cell(), True
    return changed


def write_links() -> None:
    """The GitHub location from pyproject.toml into README's table, every title and setup cell.

    Works on pairs that are in sync (`make sync` runs jupytext first): the .ipynb is updated and
    the .py is written from it, so the pair stays byte-for-byte what jupytext would write.
    """
    text = README.read_text()
    if readme_with_table(text) != text:
        README.write_text(readme_with_table(text))
        print("updated the table of notebooks in README.md")
    for py in sources():
        ipynb = py.with_suffix(".ipynb")
        if not ipynb.exists():
            nb = read_py(py)
            if linked(nb, py):
                py.write_text(py_text(nb))
                print(f"updated links in {py.name}")
            continue
        nb = nbformat.read(ipynb, as_version=4)
        if cells_of(read_py(py)) != cells_of(nb):
            raise SystemExit(f"{py.name} and {ipynb.name} differ: run `make sync` first")
        if linked(nb, py):
            nbformat.write(nb, ipynb)
            print(f"updated links in {ipynb.name}")
        if py.read_text() != py_text(nb):
            py.write_text(py_text(nb))
            print(f"rewrote {py.name} as jupytext writes it")


def fork(repo: str, branch: str) -> None:
    """Point [tool.course] at another GitHub repository, then rewrite every link."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", repo):
        raise SystemExit(f"REPO must look like owner/name, got {repo!r}")
    if not re.fullmatch(r"[A-Za-z0-9_./-]+", branch):
        raise SystemExit(f"not a branch name: {branch!r}")
    text = PYPROJECT.read_text()
    table = re.search(r"(?ms)^\[tool\.course\]\n.*?(?=^\[|\Z)", text)
    new_table = re.sub(r'(?m)^github_repo = ".*"$', f'github_repo = "{repo}"', table.group(0))
    new_table = re.sub(r'(?m)^branch = ".*"$', f'branch = "{branch}"', new_table)
    PYPROJECT.write_text(text[: table.start()] + new_table + text[table.end() :])
    assert settings()["github_repo"] == repo and settings()["branch"] == branch
    write_links()
    print(f"the notebooks now install from and link to github.com/{repo} ({branch})")


def readme_table() -> str:
    """The README's table of notebooks, made from their title cells."""
    rows = ["| # | notebook | what you build | |", "|---|---|---|---|"]
    for py in sources():
        info = notebook_info(read_py(py), py.name)
        rows.append(
            f"| {py.name[:2]} | [{info['title']}](notebooks/{py.stem}.ipynb) | {info['summary']} "
            f"| [Colab]({colab_url(py)}) |"
        )
    return "\n".join(rows)


def between(text: str, start_mark: str, end_mark: str, inner: str) -> str:
    start, end = text.index(start_mark), text.index(end_mark)
    return text[: start + len(start_mark)] + "\n" + inner + "\n" + text[end:]


def readme_with_table(text: str) -> str:
    """README with its table of notebooks and its table of the library's modules made anew."""
    import deps

    text = between(text, TABLE_START, TABLE_END, readme_table())
    return between(text, LIBRARY_START, LIBRARY_END, deps.table())


# ---------------------------------------------------------------- checks
def cells_of(nb: nbformat.NotebookNode) -> list[tuple]:
    """Type, source and metadata of every cell; jupytext's record of blank lines left out (the
    layout check reports those)."""
    return [
        (c.cell_type, c.source, {k: v for k, v in c.metadata.items() if k != "lines_to_next_cell"})
        for c in nb.cells
    ]


def problems_in(py: Path) -> list[str]:
    """Everything wrong with one pair, as messages; empty when the pair is fine."""
    found: list[str] = []
    ipynb = py.with_suffix(".ipynb")
    if not ipynb.exists():
        return [f"{ipynb.name} is missing: run `make execute NB={py.name[:2]}`"]
    text_nb = read_py(py)
    nb = nbformat.read(ipynb, as_version=4)
    name = ipynb.name

    # 1. The pair holds the same cells, metadata included (drift either way fails, whatever the
    #    file times), and the .py is exactly what jupytext writes from the .ipynb: then
    #    `jupytext --sync` is the identity in both directions, on a fresh clone too.
    a, b = cells_of(text_nb), cells_of(nb)
    if a != b:
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                found.append(f"{name}: cell {i} differs from {py.name}: run `make sync`")
                break
        else:
            found.append(f"{name}: {len(b)} cells but {py.name} has {len(a)}: run `make sync`")
    elif py.read_text() != py_text(nb):
        found.append(
            f"{py.name} is not laid out as jupytext writes it (blank lines between cells): "
            "run `make links`"
        )

    # 2. Metadata: nothing from Colab, editors or jupytext's own bookkeeping.
    extra = set(nb.metadata) - ALLOWED_NOTEBOOK_METADATA
    if extra:
        found.append(f"{name}: notebook metadata {sorted(extra)} should not be stored")
    if nb.metadata.get("jupytext") != jupytext_metadata():
        found.append(
            f"{name}: notebook metadata 'jupytext' must be {jupytext_metadata()} (what "
            "JupyterLab records on save): `make links`"
        )
    if nb.metadata.get("kernelspec", {}).get("name") != "python3":
        found.append(f"{name}: kernelspec must be python3")
    for i, cell in enumerate(nb.cells):
        extra = set(cell.metadata) - ALLOWED_CELL_METADATA
        if extra:
            found.append(f"{name}: cell {i} metadata {sorted(extra)} should not be stored")
        if cell.metadata.get("jupyter", HIDDEN) != HIDDEN:
            found.append(f"{name}: cell {i}: the only `jupyter` metadata allowed is {HIDDEN}")
        if cell.metadata.get("jupyter") and cell.cell_type != "code":
            found.append(f"{name}: cell {i}: only code cells can have their source hidden")
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
        found.append(f"{name}: the title cell lacks the Open-in-Colab link: `make links`")
    if not code or code[0].source != setup_cell():
        found.append(f"{name}: the first code cell must be the setup cell: `make links`")
    for i, cell in enumerate(nb.cells):
        if re.search(r"\bTODO\b|\bFIXME\b|\bTBD\b", cell.source):
            found.append(f"{name}: cell {i} has placeholder text")
        if cell.cell_type == "markdown":
            for line in swallowed_list_items(cell.source):
                found.append(
                    f"{name}: cell {i}: {line[:40]!r} does not start a list item (CommonMark: a "
                    "list that interrupts a paragraph must start at 1): add a blank line before it"
                )
    return found


def swallowed_list_items(markdown: str) -> list[str]:
    """Lines like '2. ...' that a Markdown renderer folds into the paragraph above them.

    CommonMark lets an ordered list interrupt a paragraph only if it starts at 1, so a solutions
    list continued after a code cell ('   (text of item 1)' then '2. ...') renders as one run-on
    paragraph in JupyterLab and on the site. Found with the parser JupyterLab's renderer follows."""
    from markdown_it import MarkdownIt  # jupytext's dependency

    found, stack = [], []
    for token in MarkdownIt("commonmark").parse(markdown):
        if token.type == "paragraph_open":
            stack.append(token)
        elif token.type == "paragraph_close":
            stack.pop()
        elif token.type == "inline" and stack:
            found += [line for line in token.content.split("\n")[1:]
                      if re.match(r"\s*\d{1,2}[.)]\s", line)]  # fmt: skip
    return found


def check(paths: list[Path]) -> int:
    problems = [p for path in paths for p in problems_in(path)]
    orphans = [p.name for p in NOTEBOOKS.glob("*.ipynb") if not p.with_suffix(".py").exists()]
    problems += [f"{o}: no .py pair" for o in orphans]
    text = README.read_text()
    if readme_with_table(text) != text:
        problems.append("README.md: a table (notebooks or library) is stale: run `make links`")
    for p in problems:
        print(p, file=sys.stderr)
    if not problems:
        print(f"{len(paths)} notebook pairs: in sync both ways, executed in order, clean.")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "command",
        choices=["execute", "figures", "run", "nbval", "twice", "links", "fork", "check"],
    )
    parser.add_argument("--jobs", type=int, default=2, help="for nbval: notebooks run side by side")
    parser.add_argument("args", nargs="*", help="number prefixes (e.g. 01 02), or OWNER/NAME")
    parser.add_argument("--branch", default="main", help="for fork: the branch to link to")
    ns = parser.parse_intermixed_args()  # "nbval --jobs 2 12": numbers after an option too
    if ns.command == "execute":
        execute(sources(ns.args))
    elif ns.command == "figures":
        execute(sources(ns.args), store=False)
    elif ns.command == "run":
        return run_elsewhere(sources(ns.args))
    elif ns.command == "nbval":
        return nbval_in_scratch([p.with_suffix(".ipynb") for p in sources(ns.args)], ns.jobs)
    elif ns.command == "twice":
        return run_twice(sources(ns.args))
    elif ns.command == "links":
        write_links()
    elif ns.command == "fork":
        if len(ns.args) != 1:
            raise SystemExit("usage: notebooks.py fork OWNER/NAME [--branch BRANCH]")
        fork(ns.args[0], ns.branch)
    elif ns.command == "check":
        return check(sources(ns.args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
