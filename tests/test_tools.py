"""The course's own tooling: the exporter, the notebook checks, nbval in strict mode."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import export  # noqa: E402

import notebooks  # noqa: E402

NOTEBOOK = """# %% [markdown]
# # 99 · A test notebook

# %%
#| default_exp things

# %%
#| export
\"\"\"Things, for the exporter's tests.\"\"\"

import math


class Circle:
    def __init__(self, r):
        self.r = r


# %%
# A teaching cell: not exported.
Circle(1)

# %%
#| export
import torch  # an import in a later cell moves to the top of the module


# The method's own comment travels with it.
@add_to_class(Circle)
def area(self):
    return math.pi * self.r**2


def unit() -> Circle:
    return Circle(torch.ones(()).item())
"""


def write(tmp_path: Path, text: str, name: str = "99_things.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_export_folds_methods_and_hoists_imports(tmp_path):
    modules = export.collect([write(tmp_path, NOTEBOOK)])
    text, names = export.render_module(modules["things"])
    assert names == ["Circle", "unit"]
    assert text.index("import torch") < text.index("class Circle")
    assert '"""Things, for the exporter\'s tests."""' in text
    assert "add_to_class" not in text and "Circle(1)" not in text
    assert "    # The method's own comment travels with it.\n    def area(self):" in text
    namespace: dict = {}
    exec(compile(text, "things.py", "exec"), namespace)
    assert abs(namespace["unit"]().area() - 3.14159) < 1e-4


def test_export_needs_a_default_module(tmp_path):
    path = write(tmp_path, "# %%\n#| export\nx = 1\n")
    with pytest.raises(export.ExportError, match="before any '#| default_exp'"):
        export.collect([path])


def test_export_rejects_a_method_for_an_unknown_class(tmp_path):
    path = write(
        tmp_path,
        "# %%\n#| default_exp m\n\n# %%\n#| export\n@add_to_class(Nope)\ndef f(self):\n    pass\n",
    )
    with pytest.raises(export.ExportError, match="class Nope"):
        export.render_module(export.collect([path])["m"])


def test_export_rejects_bad_module_names(tmp_path):
    path = write(tmp_path, "# %%\n#| default_exp Bad-Name\n")
    with pytest.raises(export.ExportError, match="bad module name"):
        export.collect([path])


def test_src_matches_the_notebooks():
    assert export.main(["--check"]) == 0, "src/ is stale: run `make export`"


def test_every_notebook_pair_is_clean():
    problems = [p for path in notebooks.sources() for p in notebooks.problems_in(path)]
    assert problems == []


@pytest.fixture
def pair(tmp_path) -> Path:
    """A copy of notebook 00's pair, to break in different ways."""
    for suffix in (".py", ".ipynb"):
        shutil.copy(ROOT / "notebooks" / f"00_setup{suffix}", tmp_path / f"00_setup{suffix}")
    return tmp_path / "00_setup.py"


def test_check_passes_on_a_clean_copy(pair):
    assert notebooks.problems_in(pair) == []


def test_check_catches_drift_in_the_py(pair):
    pair.write_text(pair.read_text().replace("print(counter.n)", "print(counter.n + 1)"))
    assert any("differs" in p for p in notebooks.problems_in(pair))


def test_check_catches_drift_in_the_ipynb(pair):
    ipynb = pair.with_suffix(".ipynb")
    nb = nbformat.read(ipynb, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("an extra cell"))
    nbformat.write(nb, ipynb)
    assert any("cells but" in p for p in notebooks.problems_in(pair))


def test_check_catches_unexecuted_cells_stderr_and_metadata(pair):
    ipynb = pair.with_suffix(".ipynb")
    nb = nbformat.read(ipynb, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[2].execution_count = None
    code[3].outputs.append(nbformat.v4.new_output("stream", name="stderr", text="warning!\n"))
    nb.metadata["colab"] = {"provenance": []}
    code[4].metadata["collapsed"] = True
    nbformat.write(nb, ipynb)
    found = "\n".join(notebooks.problems_in(pair))
    assert "execution counts" in found
    assert "stores stderr" in found
    assert "['colab']" in found
    assert "['collapsed']" in found


def test_nbval_is_strict(tmp_path):
    """A stored output that the code no longer prints must fail the notebook run."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(6 * 7)", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="41\n")]
    nb.cells = [cell]
    nb.metadata["kernelspec"] = notebooks.KERNELSPEC
    path = tmp_path / "stale.ipynb"
    nbformat.write(nb, path)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
               "--nbval-current-env", "--rootdir", str(tmp_path), str(path)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "41" in result.stdout and "42" in result.stdout
    cell.outputs[0].text = "42\n"
    nbformat.write(nb, path)
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:]
