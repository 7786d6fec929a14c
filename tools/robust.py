"""The robustness run: every notebook, top to bottom, on stand-ins for "another machine".

A notebook is right when its asserts hold on runs other than the one that stored its outputs.
This script executes every notebook under perturbations and reports each cell that fails:

    seed+1000, seed+2000, seed+3000   every seed the kernel sets is shifted by the offset (a
                                      start-up file of every Python process wraps torch.manual_seed,
                                      torch.Generator.manual_seed, random.seed, random.Random and
                                      NumPy's seeding), so each training is another run, while
                                      the notebooks and their stored outputs stay as they are;
                                      outputs are not compared, asserts count
    cpu=default, cpu=avx2             ATEN_CPU_CAPABILITY: PyTorch's other vectorised kernels,
                                      which round differently; nbval strict (the outputs are
                                      compared with the stored ones, and asserts count)
    dropout=mkl                       PyTorch's CPU Bernoulli (nn.Dropout, F.dropout, a scalar
                                      bernoulli_) takes Intel MKL's stream on Intel CPUs and its
                                      own generator elsewhere, so a dropout mask printed on one
                                      machine differs on the other: a start-up file draws every
                                      such mask from another stream (one seed taken from the
                                      generator, as the MKL path does); nbval strict
    oldest                            the oldest supported environment (compat/oldest.txt, made
                                      by `make test-compat COMPAT=oldest`); asserts count

    python tools/robust.py [NN ...] [--only NAME,NAME] [--jobs 2] [--out tools/robust]

writes tools/robust.md (a table: notebook x perturbation, with times) and tools/robust.json,
and exits 1 if any cell failed. Each perturbation runs in its own scratch copy, one notebook
after another (notebook 12 loads the checkpoint that 11 saved there); `--jobs` perturbations
run side by side, one process each. All of it takes about two hours on two quiet cores: too
long for CI, run it (`make robust`) before you resolve an issue that touches a notebook.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from course import NOTEBOOKS
from course import ROOT
from course import sources

from notebooks import nbval_in_scratch
from notebooks import scratch_copy

SEED_OFFSETS = (1000, 2000, 3000)
CAPABILITIES = ("default", "avx2")
PERTURBATIONS = (
    *(f"seed+{o}" for o in SEED_OFFSETS),
    *(f"cpu={c}" for c in CAPABILITIES),
    "dropout=mkl",
    "oldest",
)
OLDEST_PYTHON = ROOT / ".venv-compat" / "oldest" / "bin" / "python"
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"

# The start-up file for a seed offset (written as sitecustomize.py, see environment()).
SEED_HOOK = '''\
"""Shift every seed this kernel sets by COURSE_SEED_OFFSET (tools/robust.py)."""
import os as _os
import random as _random

import numpy as _np
import torch as _torch

_OFFSET = int(_os.environ["COURSE_SEED_OFFSET"])


def _shift(seed):
    return None if seed is None else int(seed) + _OFFSET


_torch_manual_seed = _torch.manual_seed
_torch.manual_seed = _torch.random.manual_seed = lambda seed: _torch_manual_seed(_shift(seed))


class _ShiftedGenerator(_torch.Generator):
    def manual_seed(self, seed):
        return super().manual_seed(_shift(seed))


_torch.Generator = _ShiftedGenerator

_random_seed = _random.seed
_random.seed = lambda a=None, version=2: _random_seed(
    _shift(a) if isinstance(a, int) else a, version
)


class _ShiftedRandom(_random.Random):
    def seed(self, a=None, version=2):
        super().seed(_shift(a) if isinstance(a, int) else a, version)


_random.Random = _ShiftedRandom
_np_seed, _np_default_rng = _np.random.seed, _np.random.default_rng
_np.random.seed = lambda seed=None: _np_seed(_shift(seed))
_np.random.default_rng = lambda seed=None: _np_default_rng(
    _shift(seed) if isinstance(seed, int) else seed
)
'''


# The start-up file for dropout=mkl: a CPU Bernoulli with a scalar probability draws one seed
# from the generator and its mask from another stream, as ATen's MKL path does on Intel CPUs.
DROPOUT_HOOK = '''\
"""Draw CPU dropout masks from another stream, as an Intel CPU would (tools/robust.py)."""
import zlib as _zlib

import torch as _torch
import torch.nn.functional as _F

_bernoulli_ = _torch.Tensor.bernoulli_


def _other_stream_bernoulli_(self, p=0.5, *, generator=None):
    # torch.compile traces the code it runs: under it (whose inductor draws its own numbers
    # anyway) ATen's bernoulli_ is left as it is, so that the hook puts no break in a graph.
    if (
        not isinstance(p, (int, float))
        or self.device.type != "cpu"
        or _torch.compiler.is_compiling()
    ):
        return _bernoulli_(self, p, generator=generator)
    # As the MKL path, take one seed from the generator and draw the mask from a stream of its
    # own; the seed comes from the generator's state (which then moves on), not from a tensor
    # operator, and the mask from ATen's own bernoulli_, so a profile sees the operators that an
    # Intel CPU's run shows, and only the numbers differ.
    source = _torch.default_generator if generator is None else generator
    seed = _zlib.crc32(source.get_state().numpy().tobytes()) ^ 0x5DEECE66D
    source.manual_seed(seed)
    other = _torch.Generator().manual_seed(seed ^ 0x2545F491)
    return _bernoulli_(self, p, generator=other)


_torch.Tensor.bernoulli_ = _other_stream_bernoulli_
_dropout = _F.dropout


def _other_stream_dropout(input, p=0.5, training=True, inplace=False):
    on_cpu = input.device.type == "cpu" and not _torch.compiler.is_compiling()
    if not (training and 0 < p < 1 and on_cpu):
        return _dropout(input, p, training, inplace)
    out = input * _torch.empty_like(input).bernoulli_(1 - p) / (1 - p)
    return input.copy_(out) if inplace else out


_F.dropout = _other_stream_dropout
'''


def environment(perturbation: str, folder: Path) -> dict[str, str]:
    """The environment variables that make `perturbation` (on top of tools/kernel.env)."""
    if perturbation.startswith("seed+"):
        # As sitecustomize.py on PYTHONPATH, the hook runs at the start of every Python process
        # the run starts: the kernel, and the worker processes a notebook launches itself
        # (notebook 15's DDP ranks, which must draw what the kernel's own replica draws).
        site = folder / "site"
        site.mkdir(parents=True)
        (site / "sitecustomize.py").write_text(SEED_HOOK)
        path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        return {"COURSE_SEED_OFFSET": perturbation[5:], "PYTHONPATH": path}
    if perturbation == "dropout=mkl":
        site = folder / "site"
        site.mkdir(parents=True)
        (site / "sitecustomize.py").write_text(DROPOUT_HOOK)
        path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        return {"PYTHONPATH": path}
    if perturbation.startswith("cpu="):
        return {"ATEN_CPU_CAPABILITY": perturbation[4:]}
    return {}


def cell_index(notebook: Path, code_cell: int) -> int:
    """The .ipynb index (all cells, from 0) of code cell number `code_cell` (from 0)."""
    cells = nbformat.read(notebook, as_version=4).cells
    return [i for i, c in enumerate(cells) if c.cell_type == "code"][code_cell]


def error_text(output) -> str:
    """'Name: message', and the line that raised (an assert's message is often empty)."""
    plain = [re.sub(r"\x1b\[[0-9;]*m", "", frame) for frame in output.get("traceback", [])]
    # The arrow's width depends on the line number: "----> 2", "---> 40", "--> 100".
    lines = [m for frame in plain for m in re.findall(r"^\s*-+> ?(\d+.*)$", frame, re.M)]
    where = f" at `line {lines[-1].strip()}`" if lines else ""
    return f"{output.ename}: {output.evalue}{where}"[:300]


def execute_all(paths: list[Path], log) -> dict:
    """Run each notebook in one scratch folder, in order, errors allowed: every failing cell."""
    from course import KERNELSPEC
    from course import read_py
    from nbclient import NotebookClient

    results = {}
    with scratch_copy("course-robust-") as folder:
        for path in paths:
            nb = read_py(path)
            nb.metadata["kernelspec"] = KERNELSPEC
            start = time.perf_counter()
            client = NotebookClient(
                nb,
                timeout=900,
                kernel_name="python3",
                allow_errors=True,
                record_timing=True,
                resources={"metadata": {"path": str(folder)}},
            )
            client.execute()
            failures, slowest = [], (0.0, -1)
            for index, cell in enumerate(nb.cells):
                timing = cell.metadata.get("execution", {})
                if "iopub.execute_input" in timing and "shell.execute_reply" in timing:
                    from datetime import datetime

                    took = datetime.fromisoformat(timing["shell.execute_reply"].rstrip("Z")) - (
                        datetime.fromisoformat(timing["iopub.execute_input"].rstrip("Z"))
                    )
                    slowest = max(slowest, (took.total_seconds(), index))
                for out in cell.get("outputs", []):
                    if out.output_type == "error":
                        failures.append({"cell": index, "error": error_text(out)})
            seconds = round(time.perf_counter() - start, 1)
            results[path.stem] = {"seconds": seconds, "failures": failures}
            log(
                f"{path.stem}: {len(failures)} failing cells, {seconds:.0f} s "
                f"(slowest cell [{slowest[1]}], {slowest[0]:.0f} s)"
            )
            for failure in failures:
                log(f"    [{failure['cell']}] {failure['error'][:200]}")
    return results


def nbval_all(paths: list[Path], log) -> dict:
    """nbval strict on each notebook in a scratch folder; every failing cell from JUnit XML."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="course-robust-junit-") as tmp:
        junit = Path(tmp) / "junit.xml"
        nbval_in_scratch([p.with_suffix(".ipynb") for p in paths], jobs=1, junit=junit, quiet=True)
        for case in ET.parse(junit).iter("testcase"):
            stem = Path(case.get("classname", "").replace(".", "/")).name or case.get("file", "")
            stem = next((p.stem for p in paths if p.stem in (case.get("classname") or "")), stem)
            entry = results.setdefault(stem, {"seconds": 0.0, "failures": []})
            entry["seconds"] = round(entry["seconds"] + float(case.get("time", 0)), 1)
            problem = case.find("failure")
            if problem is None:
                problem = case.find("error")
            if problem is not None:
                number = int(case.get("name", "Cell -1").split()[-1])
                text = (problem.get("message") or problem.text or "").strip().splitlines()
                where = cell_index(NOTEBOOKS / f"{stem}.ipynb", number) if number >= 0 else -1
                entry["failures"].append({"cell": where, "error": " ".join(text[-3:])[:300]})
    for stem, entry in results.items():
        log(f"{stem}: {len(entry['failures'])} failing cells, {entry['seconds']:.0f} s")
        for failure in entry["failures"]:
            log(f"    [{failure['cell']}] {failure['error'][:200]}")
    return results


def worker(perturbation: str, paths: list[Path], out: Path) -> int:
    """One perturbation: set up its environment, run, write the results as JSON."""
    import torch

    def log(line: str) -> None:
        print(f"[{perturbation}] {line}", flush=True)

    with tempfile.TemporaryDirectory(prefix="course-robust-env-") as tmp:
        os.environ.update(environment(perturbation, Path(tmp)))
        start = time.perf_counter()
        run = nbval_all if perturbation.startswith(("cpu=", "dropout=")) else execute_all
        results = run(paths, log)
    record = {
        "perturbation": perturbation,
        "torch": torch.__version__,
        "seconds": round(time.perf_counter() - start, 1),
        "notebooks": results,
    }
    out.write_text(json.dumps(record, indent=1))
    return 0


def report(records: list[dict], stems: list[str]) -> str:
    """The markdown table (notebook x perturbation) and every failing cell below it."""
    cpu = platform.processor() or platform.machine()
    header = " | ".join(f"{r['perturbation']} (torch {r['torch']})" for r in records)
    lines = [
        f"Command: `python tools/robust.py --jobs 2` ({cpu}, {os.cpu_count()} cores, one thread "
        "per kernel). Each entry: failing cells / seconds.",
        "",
        f"| notebook | {header} |",
        "|---|" + "---|" * len(records),
    ]
    for stem in stems:
        row = []
        for r in records:
            entry = r["notebooks"].get(stem)
            if entry is None:
                row.append("not run")
                continue
            failed = len(entry["failures"])
            verdict = f"**{failed} failed**" if failed else "ok"
            row.append(f"{verdict} / {entry['seconds']:.0f} s")
        lines.append(f"| {stem} | " + " | ".join(row) + " |")
    totals = " | ".join(f"{r['seconds'] / 60:.0f} min" for r in records)
    lines.append(f"| total time | {totals} |")
    failures = [
        (r["perturbation"], stem, f)
        for r in records
        for stem, entry in r["notebooks"].items()
        for f in entry["failures"]
    ]
    lines += ["", "Failing cells (`.ipynb` index, from 0):" if failures else "No cell failed."]
    lines += [f"- {p}: {stem} [{f['cell']}] {f['error']}" for p, stem, f in failures]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="number prefixes (default: all)")
    parser.add_argument("--only", default=",".join(PERTURBATIONS), help="perturbations to run")
    parser.add_argument("--jobs", type=int, default=2, help="perturbations side by side")
    parser.add_argument("--out", type=Path, default=ROOT / "tools" / "robust")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    paths = sources(ns.notebooks)
    if ns.worker:
        return worker(ns.worker, paths, ns.result)

    chosen = [p for p in ns.only.split(",") if p]
    unknown = set(chosen) - set(PERTURBATIONS)
    if unknown:
        raise SystemExit(f"unknown perturbations {sorted(unknown)}; known: {PERTURBATIONS}")
    if "oldest" in chosen and not OLDEST_PYTHON.exists():
        raise SystemExit("the oldest profile is not installed: make .venv-compat/oldest/.installed")

    with tempfile.TemporaryDirectory(prefix="course-robust-") as tmp:

        def run(perturbation: str) -> dict:
            python = OLDEST_PYTHON if perturbation == "oldest" else MAIN_PYTHON
            result = Path(tmp) / f"{perturbation}.json"
            command = [str(python), __file__, *ns.notebooks, "--worker", perturbation,
                       "--result", str(result)]  # fmt: skip
            subprocess.run(command, check=True, cwd=ROOT)
            return json.loads(result.read_text())

        with ThreadPoolExecutor(ns.jobs) as pool:
            records = list(pool.map(run, chosen))

    stems = [p.stem for p in paths]
    text = report(records, stems)
    ns.out.with_suffix(".md").write_text(text)
    ns.out.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    print(text)
    failed = any(e["failures"] for r in records for e in r["notebooks"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
