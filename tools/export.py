"""Write the library in src/ from the notebooks' export cells.

Directives, on the first lines of a code cell (nbdev's spelling):

    #| default_exp attention     this notebook exports to transformer_from_scratch/attention.py
    #| export                    this cell goes into the notebook's default module
    #| export masks              this cell goes into transformer_from_scratch/masks.py

A method taught in its own cell with ``@add_to_class(SomeClass)`` is moved into the body
of ``SomeClass`` in the exported module, so src/ reads as ordinary, complete classes.

Every exported definition is preceded by a comment naming the notebook that teaches it
(``# Taught in notebook 03 · Multi-head attention``), as d2l's "Defined in" does; a method
folded into a class from a later notebook names its own notebook.

Usage:
    python tools/export.py            write src/ from notebooks/*.py
    python tools/export.py --check    exit 1 (with a diff) if src/ differs from the export

nbdev's exporter was not used: it needs its own project settings, writes an index module
(_modidx.py) into the package, and does not fold add_to_class methods back into classes.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from course import ROOT
from course import notebook_info
from course import read_py
from course import sources

PACKAGE = "transformer_from_scratch"
SRC = ROOT / "src" / PACKAGE
DIRECTIVE = re.compile(r"^#\|\s*(default_exp|export)\b\s*(\S*)\s*$")
MODULE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Helper modules the top-level package does not re-export (import them by their full name):
# input checks, measuring, PyTorch twins for parity checks, and the torchrun script (`python -m`
# warns when the package has imported the module beforehand).
NOT_REEXPORTED = {"checks", "distributed", "measure", "reference"}
# Re-exported modules that import a plotting or scoring library (matplotlib; sacrebleu and
# num2words): the package loads them on first use (PEP 562), so `import transformer_from_scratch`
# stays light and works where those libraries are missing.
LAZY = ("viz", "translation")


class ExportError(ValueError):
    pass


@dataclass
class Chunk:
    code: str  # one export cell, directives stripped
    taught_in: str  # "notebook 03 · Multi-head attention"


@dataclass
class Module:
    name: str
    sources: list[str] = field(default_factory=list)  # notebooks it comes from, in order
    chunks: list[Chunk] = field(default_factory=list)


def split_directives(source: str) -> tuple[list[tuple[str, str]], str]:
    """Return the cell's leading ``#|`` directives and the code after them."""
    lines = source.splitlines()
    directives = []
    while lines and lines[0].startswith("#|"):
        match = DIRECTIVE.match(lines[0])
        if match:
            directives.append((match.group(1), match.group(2)))
        lines.pop(0)
    return directives, "\n".join(lines).strip("\n")


def collect(notebook_paths: list[Path]) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in notebook_paths:
        nb = read_py(path)
        try:
            info = notebook_info(nb, path.name)
            taught_in = f"notebook {info['number']:02d} · {info['title']}"
        except ValueError:
            taught_in = f"notebooks/{path.name}"
        default = None
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            directives, code = split_directives(cell.source)
            for kind, arg in directives:
                where = f"{path.name}, cell {index}"
                if kind == "default_exp":
                    if not MODULE_NAME.match(arg):
                        raise ExportError(f"{where}: bad module name {arg!r} in default_exp")
                    default = arg
                    continue
                target = arg or default
                if target is None:
                    raise ExportError(f"{where}: '#| export' before any '#| default_exp'")
                if not MODULE_NAME.match(target):
                    raise ExportError(f"{where}: bad module name {target!r}")
                module = modules.setdefault(target, Module(target))
                rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
                if rel not in module.sources:
                    module.sources.append(rel)
                module.chunks.append(Chunk(code, taught_in))
    return modules


def _decorated_class(fn: ast.FunctionDef) -> str | None:
    for dec in fn.decorator_list:
        if (
            isinstance(dec, ast.Call)
            and isinstance(dec.func, ast.Name)
            and dec.func.id == "add_to_class"
            and len(dec.args) == 1
            and isinstance(dec.args[0], ast.Name)
        ):
            return dec.args[0].id
    return None


PROVENANCE = "# Taught in "


def _definitions(tree: ast.Module) -> list[ast.stmt]:
    """Top-level statements that define a name (not imports, not a docstring)."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
    return [node for node in tree.body if isinstance(node, kinds)]


def _first_line(node: ast.stmt, lines: list[str], floor: int) -> int:
    """0-based first line of node, counting its decorators and the comments right above it."""
    start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))]) - 1
    while start > floor and lines[start - 1].lstrip().startswith("#"):
        start -= 1
    return start


def mark_provenance(chunk: Chunk) -> str:
    """The chunk's code with a "# Taught in ..." line above each top-level definition."""
    tree = ast.parse(chunk.code)
    lines = chunk.code.splitlines()
    starts, floor = set(), 0
    for node in _definitions(tree):
        folded = isinstance(node, ast.FunctionDef) and _decorated_class(node) is not None
        if not folded:  # a folded method gets its line in fold_methods, if it needs one
            starts.add(_first_line(node, lines, floor))
        floor = node.end_lineno
    out = []
    for number, line in enumerate(lines):
        if number in starts:
            out.append(PROVENANCE + chunk.taught_in)
        out.append(line)
    return "\n".join(out)


def fold_methods(chunks: list[Chunk], module: str) -> list[str]:
    """Move ``@add_to_class(C)`` functions into the body of class ``C``."""
    out: list[str] = []
    class_index: dict[str, int] = {}
    class_home: dict[str, str] = {}
    for chunk in chunks:
        code = mark_provenance(chunk)
        tree = ast.parse(code)
        lines = code.splitlines()
        kept: list[str] = []
        cursor = 0
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and (cls := _decorated_class(node)):
                if cls not in class_index:
                    raise ExportError(
                        f"{module}: add_to_class({cls}) for {node.name!r}, but class {cls} "
                        "is not exported to the same module before it"
                    )
                start = _first_line(node, lines, cursor)
                kept.extend(lines[cursor:start])
                decorator_lines = {d.lineno for d in node.decorator_list}
                body = [
                    line
                    for number, line in enumerate(lines[start : node.end_lineno], start=start + 1)
                    if number not in decorator_lines
                ]
                if chunk.taught_in != class_home[cls]:
                    body.insert(0, PROVENANCE + chunk.taught_in)
                method = textwrap.indent("\n".join(body), "    ")
                target = class_index[cls]
                out[target] = out[target].rstrip("\n") + "\n\n" + method
                cursor = node.end_lineno
        kept.extend(lines[cursor:])
        rest = "\n".join(kept).strip("\n")
        if rest:
            out.append(rest)
            # A class defined in this chunk lives at the index just appended.
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    class_index[node.name] = len(out) - 1
                    class_home[node.name] = chunk.taught_in
    return out


def public_names(code: str) -> list[str]:
    names = []
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names += [t.id for t in elts if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_") and n != "__all__"]


def header(sources: list[str]) -> str:
    lines = ["# Generated by `make export` from:"]
    lines += [f"#   {source}" for source in sources]
    lines.append("# Do not edit it: edit the notebook (or its .py pair), then run `make export`.")
    return "\n".join(lines)


def hoist_imports(chunks: list[str], module: str = "") -> tuple[str | None, list[str], list[str]]:
    """Split chunks into (module docstring, import statements, the rest).

    Several notebooks may export into one module (layers: 06, 07, 08); their imports all move
    to the top of the file so that it reads, and lints, as one module. A later notebook that
    adds to a module imports the earlier part from the package; that import of the module
    itself is dropped. The module's docstring is the first chunk's that opens with one (an
    earlier notebook may add to a module before the notebook that introduces it: 11 writes
    greedy decoding into `decoding`, whose docstring is notebook 12's).
    """
    itself = f"{PACKAGE}.{module}"
    docstring, imports, bodies = None, [], []
    for chunk in chunks:
        tree = ast.parse(chunk)
        lines = chunk.splitlines()
        drop: set[int] = set()
        for i, node in enumerate(tree.body):
            span = range(node.lineno - 1, node.end_lineno)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                statement = "\n".join(lines[k] for k in span)
                if isinstance(node, ast.ImportFrom) and node.module == itself:
                    drop.update(span)
                    continue
                if statement not in imports:
                    imports.append(statement)
                drop.update(span)
            elif (
                docstring is None  # the first chunk that opens with a docstring gives the module's
                and i == 0
                and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                docstring = "\n".join(lines[k] for k in span)
                drop.update(span)
        rest = "\n".join(line for k, line in enumerate(lines) if k not in drop).strip("\n")
        if rest:
            bodies.append(rest)
    return docstring, imports, bodies


def ruff_tidy(text: str, filename: str) -> str:
    """Sort imports and format with the pinned ruff, so src/ is stable and lint-clean."""
    ruff = [sys.executable, "-m", "ruff"]
    stdin = ["--stdin-filename", filename, "-"]
    fixed = subprocess.run(
        [*ruff, "check", "--select", "I", "--fix", "--quiet", "--exit-zero", *stdin],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    return subprocess.run(
        [*ruff, "format", "--quiet", *stdin],
        input=fixed,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout


def defined_names(code: str) -> set[str]:
    """Every name a module's top level binds: definitions, assignments and imports."""
    names: set[str] = set()
    for node in ast.parse(code).body:
        if isinstance(node, ast.FunctionDef) and _decorated_class(node):
            continue  # a method taught in its own cell: it is folded into its class
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names.add(leaf.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def locally_bound(tree: ast.AST) -> set[str]:
    """Names bound anywhere below the top level (arguments, assignments, loop targets, nested
    definitions): a function's local `batches` is not another module's `batches`."""
    names = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    names |= {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)
    }
    names |= {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    return names


def package_imports(code: str, module: str, providers: dict[str, set[str]]) -> list[str]:
    """Imports of the names `code` uses that another module of the package defines.

    A notebook cell exported to module M may use a class the notebook itself defined for
    another module (notebook 08 writes layers.DecoderBlock and, in `reference`, code that uses
    it). Importing it in the cell would replace the notebook's own class by the package's, so
    the import is written here instead.
    """
    tree = ast.parse(code)
    bound = defined_names(code) | locally_bound(tree)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - bound
    wanted: dict[str, list[str]] = {}
    for name in sorted(used):
        homes = [m for m, names in providers.items() if m != module and name in names]
        if len(homes) > 1:
            raise ExportError(f"{module}: {name!r} is defined in {homes}: import it explicitly")
        if homes:
            wanted.setdefault(homes[0], []).append(name)
    return [f"from {PACKAGE}.{m} import {', '.join(ns)}" for m, ns in sorted(wanted.items())]


def render_module(
    module: Module, providers: dict[str, set[str]] | None = None
) -> tuple[str, list[str]]:
    docstring, imports, bodies = hoist_imports(
        fold_methods(module.chunks, module.name), module.name
    )
    code = "\n\n\n".join(bodies)
    imports += package_imports("\n".join(imports) + "\n" + code, module.name, providers or {})
    names = public_names(code)
    parts = [header(module.sources)]
    if docstring:
        parts.append(docstring)
    parts += ["\n".join(imports), code, "__all__ = " + _list_literal(names)]
    text = "\n\n".join(p for p in parts if p) + "\n"
    ast.parse(text)  # fail here, not at import time, on a broken export
    return ruff_tidy(text, f"src/{PACKAGE}/{module.name}.py"), names


def _list_literal(names: list[str]) -> str:
    quoted = [f'"{n}"' for n in names]
    one_line = "[" + ", ".join(quoted) + "]"
    if len(one_line) <= 80:
        return one_line
    return "[\n" + "".join(f"    {q},\n" for q in quoted) + "]"


def _isort_key(name: str) -> tuple[int, str]:
    # isort's "force_sort_within_sections" order, as ruff checks it: CONSTANTS, Classes, functions.
    kind = 0 if name.isupper() else 1 if name[:1].isupper() else 2
    return kind, name


def render_init(modules: dict[str, Module], exported: dict[str, list[str]]) -> str:
    sources = sorted({s for m in modules.values() for s in m.sources})
    lines = [
        header(sources),
        "",
        '"""The Transformer from scratch: the library that the course\'s notebooks build."""',
        "",
        "from importlib.metadata import PackageNotFoundError, version",
        "",
    ]
    reexported = [n for n in modules if exported[n] and n not in NOT_REEXPORTED]  # course order
    eager = [n for n in reexported if n not in LAZY]
    lazy = [n for n in reexported if n in LAZY]
    lines.append(f"from . import {', '.join(eager)}")
    for name in eager:
        lines.append(f"from .{name} import {', '.join(sorted(exported[name], key=_isort_key))}")
    lazy_names = {symbol: name for name in lazy for symbol in exported[name]}
    lines += [
        "",
        "try:",
        f'    __version__ = version("{PACKAGE.replace("_", "-")}")',
        "except PackageNotFoundError:  # imported from a source tree that is not installed",
        '    __version__ = "0+unknown"',
        "",
        "# Modules that import plotting or scoring libraries load on first use (PEP 562), and",
        "# so do their names: `import transformer_from_scratch` loads no matplotlib, no sacrebleu.",
        f"_LAZY_MODULES = {tuple(lazy)!r}",
        f"_LAZY_NAMES = {lazy_names!r}",
        "",
        "",
        "def __getattr__(name: str):",
        "    import importlib",
        "",
        "    if name in _LAZY_MODULES:",
        '        return importlib.import_module(f".{name}", __name__)',
        "    if name in _LAZY_NAMES:",
        '        module = importlib.import_module(f".{_LAZY_NAMES[name]}", __name__)',
        "        return getattr(module, name)",
        '    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")',
        "",
        "",
        "def __dir__() -> list[str]:",
        "    return sorted({*globals(), *_LAZY_MODULES, *_LAZY_NAMES})",
        "",
        "",
        "# Every module's public names, in course order (each module lists its own in __all__),",
        "# then those of the modules loaded on first use.",
        "__all__ = [" + ", ".join(f"*{name}.__all__" for name in eager) + ", *_LAZY_NAMES]",
        "",
    ]
    return ruff_tidy("\n".join(lines), f"src/{PACKAGE}/__init__.py")


def build(notebook_paths: list[Path]) -> dict[Path, str]:
    modules = collect(notebook_paths)
    providers = {
        name: set().union(*(defined_names(c.code) for c in module.chunks)) - {"__all__"}
        for name, module in modules.items()
    }
    for name, module in modules.items():  # imported names are not definitions
        for chunk in module.chunks:
            for node in ast.parse(chunk.code).body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    providers[name] -= {(a.asname or a.name).split(".")[0] for a in node.names}
    files: dict[Path, str] = {}
    exported: dict[str, list[str]] = {}
    seen: dict[str, str] = {}
    for name, module in modules.items():
        files[SRC / f"{name}.py"], exported[name] = render_module(module, providers)
        for symbol in exported[name] if name not in NOT_REEXPORTED else []:
            if symbol in seen:
                raise ExportError(f"{symbol!r} is exported by both {seen[symbol]} and {name}")
            seen[symbol] = name
    files[SRC / "__init__.py"] = render_init(modules, exported)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    notebooks = sources()
    try:
        files = build(notebooks)
    except (ExportError, SyntaxError) as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 2
    on_disk = {p: p.read_text() for p in SRC.glob("*.py")}
    stale = sorted(p for p in set(files) | set(on_disk) if files.get(p) != on_disk.get(p))
    if args.check:
        for path in stale:
            rel = path.relative_to(ROOT)
            diff = difflib.unified_diff(
                on_disk.get(path, "").splitlines(),
                files.get(path, "").splitlines(),
                f"{rel} (in src/)",
                f"{rel} (exported from the notebooks)",
                lineterm="",
            )
            print("\n".join(list(diff)[:60]))
        if stale:
            print(
                f"src/ is stale in {len(stale)} file(s): run `make export` "
                "(and never edit src/ by hand).",
                file=sys.stderr,
            )
            return 1
        print(f"src/ matches the export of {len(notebooks)} notebooks.")
        return 0
    SRC.mkdir(parents=True, exist_ok=True)
    for path in stale:
        if path in files:
            path.write_text(files[path])
            print(f"wrote {path.relative_to(ROOT)}")
        else:
            path.unlink()
            print(f"removed {path.relative_to(ROOT)} (no notebook exports it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
