"""What the course's tools share: where things are, the settings, how a notebook is read.

Imported by tools/notebooks.py, tools/export.py, tools/build_site.py and the tests; one home for
the GitHub location, the kernel environment, the title-cell parser and the canonical .py text.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import jupytext
import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
README = ROOT / "README.md"
PYPROJECT = ROOT / "pyproject.toml"
KERNEL_ENV_FILE = ROOT / "tools" / "kernel.env"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
TITLE = re.compile(r"#\s*(\d\d)\s*·\s*(.+)")
SUMMARY = re.compile(r"\*\*What you will build:\*\*\s*(.+?)(?:\n\n|$)", re.S)


def settings() -> dict:
    """The [tool.course] table of pyproject.toml: github_repo, branch, package."""
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["tool"]["course"]


def kernel_env() -> dict[str, str]:
    """KEY=VALUE pairs of tools/kernel.env (the Makefile includes the same file)."""
    env = {}
    for line in KERNEL_ENV_FILE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def sources(selection: list[str] | None = None, folder: Path = NOTEBOOKS) -> list[Path]:
    """The notebooks' .py files in course order, or those whose names start with `selection`."""
    paths = sorted(folder.glob("[0-9][0-9]_*.py"))
    if selection:
        paths = [p for p in paths if any(p.name.startswith(s) for s in selection)]
        if not paths:
            raise SystemExit(f"no notebook matches {selection}")
    return paths


def colab_url(notebook: Path) -> str:
    s = settings()
    return (
        f"https://colab.research.google.com/github/{s['github_repo']}/blob/{s['branch']}"
        f"/notebooks/{notebook.stem}.ipynb"
    )


def install_url() -> str:
    s = settings()
    return f"git+https://github.com/{s['github_repo']}@{s['branch']}"


# The first code cell of every notebook: `make links` writes it, `make check` compares it.
SETUP_CELL = """\
# Setup. On Colab, install the course's package (Colab's own torch is kept as it is).
import sys

if "google.colab" in sys.modules:
    import subprocess

    PACKAGE = "transformer-from-scratch @ {install_url}"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", PACKAGE], capture_output=True, text=True
    )
    if pip.returncode != 0:
        raise RuntimeError(
            f"Could not install the course's package {{PACKAGE!r}}. pip said:\\n"
            f"{{pip.stderr.strip()[-800:]}}\\n"
            "Opened from a fork? Point the notebooks at it with `make fork REPO=owner/name`, "
            "push, and open the notebook from the fork (README, 'Forks')."
        )"""


def setup_cell() -> str:
    return SETUP_CELL.format(install_url=install_url())


def notebook_info(nb: nbformat.NotebookNode, name: str) -> dict:
    """Number, title and the 'What you will build' summary, read from the title cell."""
    first = nb.cells[0].source if nb.cells else ""
    match = TITLE.match(first.splitlines()[0] if first else "")
    if not match:
        raise ValueError(f"{name}: the first line must be '# NN · Title'")
    summary = SUMMARY.search(first)
    return {
        "number": int(match.group(1)),
        "title": match.group(2).strip(),
        "summary": " ".join(summary.group(1).split()) if summary else "",
    }


def jupytext_metadata() -> dict:
    """The metadata filters that JupyterLab's jupytext records in a notebook when it saves it.

    Storing them in every .ipynb up front makes a save from JupyterLab (and `jupytext --sync`
    in either direction) rewrite the pair byte for byte.
    """
    with open(PYPROJECT, "rb") as f:
        config = tomllib.load(f)["tool"]["jupytext"]
    keys = ("cell_metadata_filter", "notebook_metadata_filter")
    return {key: config[key] for key in keys}


def jupytext_config():
    return jupytext.config.load_jupytext_config(str(NOTEBOOKS))


def py_text(nb: nbformat.NotebookNode) -> str:
    """The .py (percent format) that jupytext writes for `nb` with the course's settings.

    This is the only layout of a .py that survives a round trip: jupytext --sync in either
    direction then changes nothing (it records "lines_to_next_cell" for any other spacing).
    """
    return jupytext.writes(nb, fmt="py:percent", config=jupytext_config())


def read_py(path: Path) -> nbformat.NotebookNode:
    return jupytext.read(path, config=jupytext_config())
