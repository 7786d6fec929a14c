"""The course's own tooling: the exporter, the notebook checks, nbval in strict mode."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import course  # noqa: E402
import deps  # noqa: E402
import export  # noqa: E402
import preflight  # noqa: E402

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


def test_an_earlier_notebook_may_add_to_a_module_that_a_later_one_documents(tmp_path):
    """11 writes greedy decoding into `decoding`; 12 opens its part with the module's docstring."""
    early = (
        "# %%\n#| default_exp t\n\n# %%\n#| export gen\nimport math\n\n\n"
        "def first():\n    return math.pi\n"
    )
    late = (
        '# %%\n#| default_exp gen\n\n# %%\n#| export\n"""Generation."""\n\nimport math\n\n\n'
        "def second():\n    return first()\n"
    )
    paths = [write(tmp_path, early, "11_a.py"), write(tmp_path, late, "12_b.py")]
    text, names = export.render_module(export.collect(paths)["gen"])
    assert names == ["first", "second"]
    body = text.split("\n", 4)[-1]  # after the generated header
    assert body.lstrip().startswith('"""Generation."""') and text.count('"""Generation."""') == 1
    assert text.count("import math") == 1
    namespace: dict = {}
    exec(compile(text, "gen.py", "exec"), namespace)
    assert namespace["second"]() == namespace["first"]()


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


def test_importing_the_package_loads_no_plotting_or_scoring_library():
    """matplotlib, sacrebleu and num2words load when viz or translation is first used."""
    code = (
        "import sys, transformer_from_scratch as tfs\n"
        "heavy = ('matplotlib', 'sacrebleu', 'num2words')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert 'plot_attention' in dir(tfs) and 'plot_attention' in tfs.__all__\n"
        "from transformer_from_scratch import plot_attention, TranslationDataset\n"
        "assert plot_attention is tfs.viz.plot_attention\n"
        "assert TranslationDataset is tfs.translation.TranslationDataset\n"
        "assert all(m in sys.modules for m in heavy)\n"
        "try:\n    tfs.no_such_name\n"
        "except AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
        "else:\n    raise AssertionError('no AttributeError')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


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


# ---------------------------------------------------------------- the editing loop, both ways
def _digest(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*_*.*"))}


@pytest.fixture
def clone(tmp_path) -> Path:
    """A repository-like folder with pyproject.toml and two notebook pairs, as a clone has them."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "notebooks").mkdir()
    for stem in ("00_setup", "05_masking"):
        for suffix in (".py", ".ipynb"):
            shutil.copy(ROOT / "notebooks" / f"{stem}{suffix}", tmp_path / "notebooks")
    return tmp_path


def test_swallowed_list_items_are_found_as_a_markdown_renderer_sees_them():
    continued = "   The rest of answer 1, after a code cell.\n2. Answer two.\n3. Answer three."
    assert notebooks.swallowed_list_items(continued) == ["2. Answer two.", "3. Answer three."]
    assert notebooks.swallowed_list_items(continued.replace("\n2.", "\n\n2.")) == []
    assert notebooks.swallowed_list_items("1. one\n   more of one\n2. two") == []  # a list
    assert notebooks.swallowed_list_items("In the year\n2017. it was") == []  # a year, not a list


def test_check_catches_a_list_folded_into_a_paragraph(pair):
    ipynb = pair.with_suffix(".ipynb")
    nb = nbformat.read(ipynb, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("   the end of answer 1\n2. answer two"))
    nbformat.write(nb, ipynb)
    assert any("does not start a list item" in p for p in notebooks.problems_in(pair))


@pytest.mark.parametrize("newer", [".py", ".ipynb"])
def test_sync_changes_nothing_whichever_file_is_newer(clone, newer):
    """`make sync` on a fresh clone: jupytext --sync in either direction is the identity."""
    before = _digest(clone / "notebooks")
    for path in (clone / "notebooks").glob(f"*{newer}"):
        stat = path.stat()
        os.utime(path, (stat.st_atime + 60, stat.st_mtime + 60))
    jupytext = Path(sys.executable).parent / "jupytext"
    pairs = sorted(str(p) for p in (clone / "notebooks").glob("*.ipynb"))
    subprocess.run([str(jupytext), "--quiet", "--sync", *pairs], check=True, cwd=clone)
    assert _digest(clone / "notebooks") == before


def test_saving_from_jupyterlab_rewrites_the_pair_byte_for_byte(clone):
    """JupyterLab saves through jupytext's contents manager: opening and saving changes nothing."""
    import asyncio

    from jupytext import AsyncTextFileContentsManager

    before = _digest(clone / "notebooks")
    manager = AsyncTextFileContentsManager(root_dir=str(clone))

    async def open_and_save(path: str) -> None:
        model = await manager.get(path)
        await manager.save(model, path)

    for path in ("notebooks/00_setup.ipynb", "notebooks/05_masking.py"):
        asyncio.run(open_and_save(path))
        assert _digest(clone / "notebooks") == before, f"saving {path} changed the pair"


def test_each_py_is_what_jupytext_writes_from_its_ipynb():
    for py in notebooks.sources():
        nb = nbformat.read(py.with_suffix(".ipynb"), as_version=4)
        assert course.py_text(nb) == py.read_text(), f"{py.name}: run `make links`"


def test_check_catches_a_py_laid_out_otherwise(pair):
    """One blank line less between two cells: the cells are equal, the round trip is not."""
    text = pair.read_text()
    assert "\n\n\n# %%" in text
    pair.write_text(text.replace("\n\n\n# %%", "\n\n# %%", 1))
    assert any("laid out as jupytext writes it" in p for p in notebooks.problems_in(pair))


def test_check_catches_a_stale_setup_cell_and_jupytext_metadata(pair):
    ipynb = pair.with_suffix(".ipynb")
    nb = nbformat.read(ipynb, as_version=4)
    setup = next(c for c in nb.cells if c.cell_type == "code")
    setup.source = setup.source.replace("capture_output=True", "check=True")
    nb.metadata.pop("jupytext")
    nbformat.write(nb, ipynb)
    pair.write_text(course.py_text(nb))
    found = "\n".join(notebooks.problems_in(pair))
    assert "the first code cell must be the setup cell" in found
    assert "notebook metadata 'jupytext'" in found


def test_check_allows_only_source_hidden_as_jupyter_metadata(pair):
    ipynb = pair.with_suffix(".ipynb")
    nb = nbformat.read(ipynb, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    code[1].metadata["jupyter"] = {"source_hidden": True}
    code[2].metadata["jupyter"] = {"outputs_hidden": True}
    nbformat.write(nb, ipynb)
    pair.write_text(course.py_text(nb))
    found = notebooks.problems_in(pair)
    assert len(found) == 1 and "only `jupyter` metadata allowed" in found[0], found


def test_setup_cell_fails_with_a_clear_message_when_pip_fails(monkeypatch):
    """On Colab, a failed install ends in one sentence that says what to do, not pip's trace."""
    import types

    calls = []

    def failing_run(command, **kwargs):
        calls.append(command)
        return types.SimpleNamespace(returncode=1, stderr="ERROR: Repository not found.\n")

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "run", failing_run)
    with pytest.raises(RuntimeError) as err:
        exec(course.setup_cell(), {})
    assert calls and calls[0][1:4] == ["-m", "pip", "install"]
    message = str(err.value)
    assert "Repository not found" in message and "make fork REPO=owner/name" in message


def test_fork_points_every_link_at_the_fork(tmp_path):
    """`make fork REPO=...` rewrites pyproject, the Colab links, the setup cells and README."""
    for folder in ("tools", "notebooks"):
        (tmp_path / folder).mkdir()
    for name in ("course.py", "notebooks.py", "deps.py", "export.py", "kernel.env"):
        shutil.copy(ROOT / "tools" / name, tmp_path / "tools")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path)
    for suffix in (".py", ".ipynb"):
        shutil.copy(ROOT / "notebooks" / f"00_setup{suffix}", tmp_path / "notebooks")
    result = subprocess.run(
        [sys.executable, "tools/notebooks.py", "fork", "ada/course", "--branch", "dev"],
        cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert 'github_repo = "ada/course"' in (tmp_path / "pyproject.toml").read_text()
    for path in [tmp_path / "README.md", *(tmp_path / "notebooks").iterdir()]:
        text = path.read_text()
        assert "transformer-from-scratch/transformer-from-scratch" not in text, path.name
        assert "github/ada/course/blob/dev/notebooks/00_setup.ipynb" in text, path.name
    assert (
        "git+https://github.com/ada/course@dev" in (tmp_path / "notebooks/00_setup.py").read_text()
    )
    bad = subprocess.run([sys.executable, "tools/notebooks.py", "fork", "not a repo"],
                         cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode != 0 and "owner/name" in bad.stderr


def test_exported_definitions_name_their_notebook(tmp_path):
    modules = export.collect([write(tmp_path, NOTEBOOK)])
    text, _ = export.render_module(modules["things"])
    taught = "# Taught in notebook 99 · A test notebook"
    assert f"{taught}\nclass Circle" in text
    assert f"{taught}\ndef unit()" in text
    assert "    # The method's own comment" in text and f"    {taught}" not in text  # same notebook
    later = write(
        tmp_path,
        "# %% [markdown]\n# # 98 · A later notebook\n\n# %%\n#| export things\n"
        "@add_to_class(Circle)\ndef diameter(self):\n    return 2 * self.r\n",
        name="98_later.py",
    )
    both = export.collect([tmp_path / "99_things.py", later])
    text, _ = export.render_module(both["things"])
    assert "    # Taught in notebook 98 · A later notebook\n    def diameter(self):" in text


# ---------------------------------------------------------------- prerequisites
def test_preflight_finds_a_named_browser_and_says_how_to_install_one(tmp_path, monkeypatch):
    fake = tmp_path / "chrome"
    fake.write_text("")
    monkeypatch.setenv("COURSE_CHROMIUM", str(fake))
    assert preflight.find_chromium() == str(fake)
    monkeypatch.setenv("COURSE_CHROMIUM", str(tmp_path / "missing"))
    assert preflight.find_chromium() is None
    monkeypatch.setattr(preflight, "find_chromium", lambda: None)
    monkeypatch.setattr(preflight.shutil, "which", lambda name: None)
    monkeypatch.setattr(preflight, "vendor_cached", lambda: False)
    found = "\n".join(preflight.missing())
    assert "apt-get install chromium" in found or "brew install --cask chromium" in found
    assert "playwright install chromium" in found and "COURSE_CHROMIUM" in found
    assert "npm" in found


def test_run_and_twice_report_a_cell_that_fails(tmp_path):
    """`make test-compat` and `make twice` exit non-zero, naming the notebook, on an error."""
    for folder in ("tools", "notebooks"):
        (tmp_path / folder).mkdir()
    for name in ("course.py", "notebooks.py", "kernel.env"):
        shutil.copy(ROOT / "tools" / name, tmp_path / "tools")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "notebooks" / "01_fine.py").write_text("# %%\nx = [1]\n\n# %%\nx.append(2)\n")
    # 02 passes once; on the second "Run All" its first cell meets what its last cell left.
    (tmp_path / "notebooks" / "02_once.py").write_text(
        "# %%\nassert 'later' not in globals()\n\n# %%\nlater = 1\n"
    )
    # 03 survives Run All twice, but not its second cell re-run after the third rebinds x.
    (tmp_path / "notebooks" / "03_rebound.py").write_text(
        "# %%\nx = 1\n\n# %%\nassert x == 1\n\n# %%\nx = 'rebound'\n"
    )
    run = [sys.executable, "tools/notebooks.py"]
    ok = subprocess.run([*run, "run"], cwd=tmp_path, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    twice = subprocess.run([*run, "twice"], cwd=tmp_path, capture_output=True, text=True)
    assert twice.returncode == 1
    assert "01_fine: ran twice" in twice.stdout and "02_once: run 2: FAILED" in twice.stdout
    assert "03_rebound: each cell again, last first: FAILED in cell 1" in twice.stdout


# ---------------------------------------------------------------- how the library is built
def _definitions_by_notebook() -> dict[tuple[str, str], int]:
    """(module, name) -> the number of the notebook whose export cell defines it."""
    defined: dict[tuple[str, str], int] = {}
    for path in course.sources():
        number = int(path.name[:2])
        for module, chunk in _export_chunks(path):
            for name in export.defined_names(chunk) - _imported_names(chunk):
                defined.setdefault((module, name), number)
    return defined


def _export_chunks(path: Path):
    default = None
    for cell in course.read_py(path).cells:
        if cell.cell_type != "code":
            continue
        directives, code = export.split_directives(cell.source)
        for kind, arg in directives:
            if kind == "default_exp":
                default = arg
            else:
                yield arg or default, code


def _imported_names(code: str) -> set[str]:
    tree = ast.parse(code)
    return {
        (a.asname or a.name).split(".")[0]
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for a in node.names
    }


def test_every_notebook_imports_only_what_it_or_an_earlier_notebook_writes():
    defined = _definitions_by_notebook()
    modules_from = {}
    for (module, _), number in defined.items():
        modules_from[module] = min(number, modules_from.get(module, 99))
    late = []
    for path in course.sources():
        number = int(path.name[:2])
        for cell in course.read_py(path).cells:
            if cell.cell_type != "code":
                continue
            for module, names in deps.package_imports(
                ast.parse(export.split_directives(cell.source)[1])
            ):
                if modules_from.get(module, 99) > number:
                    late.append(f"{path.name}: module {module} (first written in a later notebook)")
                for name in names:
                    if defined.get((module, name), 99) > number:
                        late.append(f"{path.name}: {module}.{name}")
    assert late == [], "imports of what a later notebook writes:\n" + "\n".join(late)


def test_the_package_has_no_import_cycle_and_the_readme_shows_it():
    depth = deps.layers_of(deps.graph())  # raises on a cycle
    assert (
        depth["checks"] == 0
        and depth["tokens"] < depth["model"]
        and depth["tokens"] < depth["data"]
    )
    assert "model" not in deps.graph()["data"], (
        "data must not depend on model (special ids: tokens)"
    )
    assert deps.table() in course.README.read_text(), (
        "README's library table is stale: tools/deps.py"
    )


def test_a_local_name_is_not_imported_from_another_module():
    """A function's local `batches` must not become an import of another module's `batches`."""
    code = "def f(xs):\n    batches = []\n    batches.append(xs)\n    return batches, Circle\n"
    providers = {"later": {"batches"}, "shapes": {"Circle"}}
    imports = export.package_imports(code, "mine", providers)
    assert imports == ["from transformer_from_scratch.shapes import Circle"]


# ---------------------------------------------------------------- the robustness run
def test_the_seed_hook_shifts_every_seed_the_kernel_sets(tmp_path):
    """tools/robust.py's start-up file: each seeding call draws what seed + offset would."""
    import robust

    probe = (
        "import random, numpy as np, torch\n"
        "print(torch.manual_seed(3).initial_seed(),"
        " torch.Generator().manual_seed(4).initial_seed(),"
        " torch.randn(1, generator=torch.Generator().manual_seed(5)).item())\n"
        "random.seed(6); print(random.random(), random.Random(7).random())\n"
        "np.random.seed(8); print(np.random.rand(), np.random.default_rng(9).random())\n"
    )
    hook = tmp_path / "hook.py"
    hook.write_text(robust.SEED_HOOK)

    def run(offset: int) -> list[str]:
        env = {**os.environ, "COURSE_SEED_OFFSET": str(offset)}
        code = f"exec(open({str(hook)!r}).read())\n" + probe
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    import random

    import numpy as np
    import torch

    shifted = run(1000)
    assert shifted[:2] == ["1003", "1004"]
    assert float(shifted[2]) == torch.randn(1, generator=torch.Generator().manual_seed(1005)).item()
    random.seed(1006)
    assert float(shifted[3]) == random.random()
    assert float(shifted[4]) == random.Random(1007).random()
    np.random.seed(1008)  # noqa: NPY002 (the legacy global stream is what the hook wraps)
    assert float(shifted[5]) == np.random.rand()  # noqa: NPY002
    assert float(shifted[6]) == np.random.default_rng(1009).random()
    assert run(0)[:2] == ["3", "4"]  # offset 0: the seeds as written


def test_the_dropout_hook_draws_other_masks_with_the_same_law(tmp_path):
    """dropout=mkl's start-up file: F.dropout, nn.Dropout and a scalar bernoulli_ draw masks from
    another stream than PyTorch's own (which is torch.rand's on a non-Intel CPU), keep a share
    1 - p and scale the survivors by 1 / (1 - p); a tensor of probabilities is left alone; and a
    profile sees the operator an Intel CPU's run shows (bernoulli_), with no other draws."""
    import robust

    probe = (
        "import torch, torch.nn.functional as F\n"
        "torch.manual_seed(0); y = F.dropout(torch.ones(20000), 0.1, True)\n"
        "torch.manual_seed(0); own = torch.rand(20000) >= 0.1\n"
        "torch.manual_seed(0); z = torch.nn.Dropout(0.1)(torch.ones(20000))\n"
        "torch.manual_seed(0); b = torch.empty(20000).bernoulli_(0.5)\n"
        "torch.manual_seed(0); t = torch.empty(8).bernoulli_(torch.full((8,), 0.5))\n"
        "torch.manual_seed(0); t0 = torch.empty(8).bernoulli_(torch.full((8,), 0.5))\n"
        "off = F.dropout(torch.ones(3), 0.5, False).sum().item()\n"
        "from torch.profiler import profile\n"
        "with profile() as prof: F.dropout(torch.ones(100), 0.1, True)\n"
        "ops = {e.key for e in prof.key_averages()}\n"
        "print(torch.equal(y != 0, own), round((y != 0).float().mean().item(), 2),"
        " torch.allclose(y[y != 0], torch.tensor(1 / 0.9)), torch.equal(y, z),"
        " round(b.mean().item(), 1), torch.equal(t, t0), off,"
        " 'aten::bernoulli_' in ops, bool(ops & {'aten::uniform_', 'aten::random_'}))\n"
    )
    hook = tmp_path / "sitecustomize.py"
    hook.write_text(robust.DROPOUT_HOOK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "False",
        "0.9",
        "True",
        "True",
        "0.5",
        "True",
        "3.0",
        "True",
        "False",
    ]
    assert robust.environment("dropout=mkl", tmp_path / "env")["PYTHONPATH"].startswith(
        str(tmp_path / "env" / "site")
    )


def test_robust_reports_each_failing_cell_with_the_line_that_raised():
    import robust

    output = nbformat.from_dict(
        {
            "output_type": "error",
            "ename": "AssertionError",
            "evalue": "",
            "traceback": ["\x1b[0;32m----> 3\x1b[0m \x1b[38;5;28;01massert\x1b[39;00m x > 1\n"],
        }
    )
    assert robust.error_text(output) == "AssertionError:  at `line 3 assert x > 1`"
    # Past line 9 the arrow is one dash shorter, so that the numbers line up.
    output.traceback = ["Cell In[4], line 40\n     39 y = 2\n---> 40 assert y > 3\n     41 z\n"]
    assert robust.error_text(output) == "AssertionError:  at `line 40 assert y > 3`"
    record = {
        "perturbation": "seed+1000",
        "torch": "2.13.0",
        "seconds": 60.0,
        "notebooks": {"01_a": {"seconds": 5.0, "failures": [{"cell": 7, "error": "E"}]}},
    }
    table = robust.report([record], ["01_a", "02_b"])
    assert "| 01_a | **1 failed** / 5 s |" in table and "| 02_b | not run |" in table
    assert "- seed+1000: 01_a [7] E" in table


def test_nbval_runs_a_copy_so_the_repository_stays_as_it_was(tmp_path):
    """Figures and checkpoints of a notebook under test land in a scratch folder."""
    code = (
        "from transformer_from_scratch.utils import find_figures_dir\n"
        "folder = find_figures_dir()\n"
        "(folder / 'nbval_probe.txt').write_text('written under test')\n"
        f"print(str(folder).startswith({str(ROOT)!r}))"
    )
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(code, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="False\n")]
    nb.cells = [cell]
    nb.metadata["kernelspec"] = notebooks.KERNELSPEC
    path = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, path)
    assert notebooks.nbval_in_scratch([path], jobs=1, quiet=True) == 0
    assert not (ROOT / "figures" / "nbval_probe.txt").exists()


def test_a_notebook_that_loads_a_checkpoint_runs_after_the_one_that_saves_it():
    names = ["00_a", "11_training", "12_generation", "13_t", "15_t", "16_gpt", "17_llm"]
    units = notebooks.nbval_units([Path(f"{n}.ipynb") for n in names])
    stems = [[path.stem for path in unit] for unit in units]
    assert ["11_training", "12_generation"] in stems and ["16_gpt", "17_llm"] in stems
    assert sorted(sum(stems, [])) == names  # each notebook once
    assert stems[0] == ["11_training", "12_generation"] and stems[-1] == ["00_a"]  # longest first
    # Alone, 12 is a unit of its own (it trains the model again), and a chain of three holds.
    assert [[p.stem for p in u] for u in notebooks.nbval_units([Path("12_g.ipynb")])] == [["12_g"]]
    chain = notebooks.nbval_units([Path(f"{n}.ipynb") for n in ["01_a", "02_b", "03_c"]],
                                  after={"02": "01", "03": "02"})  # fmt: skip
    assert [[p.stem for p in u] for u in chain] == [["01_a", "02_b", "03_c"]]


def test_nbval_lanes_run_a_reader_after_its_writer(tmp_path):
    """With two lanes, the notebook that reads a file runs after the one that writes it, in the
    same scratch folder, while a third runs beside them; the merged report holds every cell."""

    def write_notebook(name: str, code: str, printed: str) -> Path:
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell(code, execution_count=1)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed + "\n")]
        nb.cells = [cell]
        nb.metadata["kernelspec"] = notebooks.KERNELSPEC
        path = tmp_path / f"{name}.ipynb"
        nbformat.write(nb, path)
        return path

    # The writer waits (up to 15 s) for the reader to have started before it writes: side by
    # side, the reader then looks before the file exists, however slowly kernels start.
    writer = write_notebook(
        "97_writer",
        "import os, time\n"
        "end = time.time() + 15\n"
        "while not os.path.exists('reading.txt') and time.time() < end:\n"
        "    time.sleep(0.05)\n"
        "open('made.txt', 'w').write('x')\n"
        "print('ok')",
        "ok",
    )
    reader = write_notebook(
        "98_reader",
        "import os\nopen('reading.txt', 'w').close()\nprint(os.path.exists('made.txt'))",
        "True",
    )
    other = write_notebook("99_other", "print(2 + 2)", "4")
    paths = [writer, reader, other]
    junit = tmp_path / "junit.xml"
    assert notebooks.nbval_in_scratch(paths, 2, junit, quiet=True, after={"98": "97"}) == 0
    assert len(list(ET.parse(junit).iter("testcase"))) == 3
    # Without the pairing the reader starts beside the writer, finds no file and fails.
    assert notebooks.nbval_in_scratch(paths[:2], 2, quiet=True, after={}) != 0


def test_notebook_numbers_may_follow_an_option():
    # `make nbval NB=12` runs `notebooks.py nbval --jobs 2 12`: argparse's plain parse_args
    # refused the number after the option ("unrecognized arguments: 12").
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "notebooks.py"), "nbval", "--jobs", "1", "99"],
        capture_output=True,
        text=True,
    )
    assert "unrecognized arguments" not in done.stderr
    assert "no notebook matches ['99']" in done.stderr + done.stdout


def test_the_seed_offset_reaches_the_processes_a_notebook_starts(tmp_path):
    # Notebook 15's DDP ranks are processes of their own: a hook in the kernel alone left
    # their seeds as written, so their model differed from the kernel's replica.
    import robust

    env = {**os.environ, **robust.environment("seed+1000", tmp_path)}
    code = "import torch; print(torch.manual_seed(3).initial_seed())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["1003"]


def test_nbval_runs_wait_longer_for_a_cells_last_messages(monkeypatch):
    """nbval's 5-second wait for each message after a cell's reply is raised for our runs."""
    import nbval_patience

    class Cell:  # stands in for nbval's IPyNbCell
        output_timeout = 5

    class Other:  # a test item that is not a notebook cell
        pass

    cells = [Cell(), Other()]
    nbval_patience.pytest_collection_modifyitems(cells)
    assert cells[0].output_timeout == nbval_patience.OUTPUT_TIMEOUT >= 30
    assert not hasattr(cells[1], "output_timeout")
    seen = {}

    def fake_run(command, cwd, env):
        seen.update(command=command, env=env)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(notebooks.subprocess, "run", fake_run)
    notebooks.nbval_in_scratch([notebooks.NOTEBOOKS / "00_setup.ipynb"], jobs=1)
    assert seen["command"][seen["command"].index("-p", 4) + 1] == "nbval_patience"
    assert str(Path(nbval_patience.__file__).parent) in seen["env"]["PYTHONPATH"].split(os.pathsep)


def test_nbval_patience_starts_a_dying_kernel_again(monkeypatch):
    import nbval.kernel
    import nbval_patience

    calls = []

    def dies_twice(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) < 3:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "km", "kc"

    monkeypatch.setattr(nbval_patience, "_start_new_kernel", dies_twice)
    monkeypatch.setattr(nbval.kernel, "start_new_kernel", nbval.kernel.start_new_kernel)
    nbval_patience.pytest_configure(None)
    assert nbval.kernel.start_new_kernel is nbval_patience.start_new_kernel
    assert nbval.kernel.start_new_kernel(kernel_name="k") == ("km", "kc") and len(calls) == 3
    calls.clear()

    def always_dies(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Kernel died before replying to kernel_info")

    monkeypatch.setattr(nbval_patience, "_start_new_kernel", always_dies)
    with pytest.raises(RuntimeError, match="kernel_info"):
        nbval_patience.start_new_kernel()
    assert len(calls) == nbval_patience.KERNEL_STARTS  # it gives up, with nbval's error


def test_gpt_reference_schedule_is_nanogpts_and_its_recipe_is_notebook_16s():
    """tools/gpt_reference.py: nanoGPT's get_lr (linear warm-up from lr/(warmup+1), cosine to
    min_lr at decay_iters, flat after), and the course run it records is notebook 16's CPU run."""
    import gpt_reference

    lr = gpt_reference.nanogpt_lr
    assert lr(0, 1e-3, 100, 2000, 1e-4) == pytest.approx(1e-3 / 101)
    assert lr(99, 1e-3, 100, 2000, 1e-4) == pytest.approx(1e-3 * 100 / 101)
    assert lr(100, 1e-3, 100, 2000, 1e-4) == pytest.approx(1e-3)
    assert lr(1050, 1e-3, 100, 2000, 1e-4) == pytest.approx(5.5e-4)
    assert lr(2000, 1e-3, 100, 2000, 1e-4) == pytest.approx(1e-4)
    assert lr(2500, 1e-3, 100, 2000, 1e-4) == 1e-4
    source = (ROOT / "notebooks" / "16_gpt.py").read_text()
    recipe = re.search(r'"cpu": LMRecipe\(([^)]*)\)', source).group(1)
    size = re.search(r'"cpu": dict\(([^)]*)\)', source).group(1)
    assert eval(f"dict({recipe})") == gpt_reference.COURSE_RECIPE
    assert eval(f"dict({size}, fast=True)") == gpt_reference.COURSE_SIZE
    assert "fast=True, **SIZES[SCALE]" in source


def test_notebook_16_quotes_the_committed_reference_run():
    """Notebook 16 copies tools/gpt_reference.json (Colab has no tools/): the copy must be the
    file's numbers, rounded as the notebook prints them."""
    source = (ROOT / "notebooks" / "16_gpt.py").read_text()
    literal = re.search(r"^REFERENCE = \{.*?^\}  # fmt: skip$", source, re.S | re.M).group(0)
    quoted = eval(literal.split("=", 1)[1].split("  # fmt: skip")[0])
    measured = json.loads((ROOT / "tools" / "gpt_reference.json").read_text())
    assert quoted["threads"] == measured["threads"]
    runs = {"nanogpt_2000", "nanogpt_6000", "course"}
    assert set(quoted) - {"threads"} == set(measured["runs"]) == runs
    for name, run in measured["runs"].items():
        copy = quoted[name]
        assert copy["step"] == run["step"] and copy["tokens_per_step"] == run["tokens_per_step"]
        assert copy["seconds"] == pytest.approx(run["seconds"], abs=0.051)
        assert copy["val_loss"] == pytest.approx(run["val_loss"], abs=5.1e-5)
        assert copy["full_val_loss"] == pytest.approx(run["full_val_loss"], abs=5.1e-5)
    import gpt_reference

    assert measured["runs"]["course"]["recipe"] == gpt_reference.COURSE_RECIPE


def test_notebook_17_quotes_the_committed_ablation_study():
    """Notebook 17 copies tools/llm_ablation.json (Colab has no tools/): the copy must be the
    file's numbers, rounded as the notebook prints them, and the study must have run the
    library's rows and recipe with at least two seeds."""
    import dataclasses

    from transformer_from_scratch.llm import ABLATION_RECIPE
    from transformer_from_scratch.llm import ABLATION_ROWS

    source = (ROOT / "notebooks" / "17_llm.py").read_text()
    literal = re.search(r"^STUDY = \{.*?^\}  # fmt: skip$", source, re.S | re.M).group(0)
    quoted = eval(literal.split("=", 1)[1].split("  # fmt: skip")[0])
    measured = json.loads((ROOT / "tools" / "llm_ablation.json").read_text())
    for key in ("command", "machine", "torch", "threads_per_run"):
        assert quoted[key] == measured[key]
    key = lambda run: (run["row"], run["seed"])  # noqa: E731
    assert sorted(map(key, quoted["runs"])) == sorted(map(key, measured["runs"]))
    copies = {key(run): run for run in quoted["runs"]}
    for run in measured["runs"]:
        copy = copies[key(run)]
        assert (copy["parameters"], copy["d_ff"]) == (run["parameters"], run["d_ff"])
        assert copy["val_bits"] == pytest.approx(run["val_bits"], abs=5.1e-5)
        assert copy["seconds_per_step"] == pytest.approx(run["seconds_per_step"], abs=5.1e-4)
    assert measured["recipe"] == json.loads(json.dumps(dataclasses.asdict(ABLATION_RECIPE)))
    assert {run["row"] for run in measured["runs"]} == set(ABLATION_ROWS)
    assert len({run["seed"] for run in measured["runs"]}) >= 2
