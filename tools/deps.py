"""How the library is built: which notebook writes which module, and which modules each imports.

    python tools/deps.py           print the table and write figures/library_dependencies.png

The same graph is checked by tests/test_tools.py: every import points back in course order (a
module, or a notebook, uses only what it or an earlier notebook writes).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from course import ROOT
from course import sources

PACKAGE = "transformer_from_scratch"
SRC = ROOT / "src" / PACKAGE
FIGURE = ROOT / "figures" / "library_dependencies.png"


def written_by() -> dict[str, list[int]]:
    """Module name -> the numbers of the notebooks whose cells it is exported from."""
    import export

    modules = export.collect(sources())
    return {
        name: sorted({int(Path(s).name[:2]) for s in module.sources})
        for name, module in modules.items()
    }


def package_imports(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """(module, names) for every `from transformer_from_scratch[.module] import names`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            module = node.module.removeprefix(PACKAGE).lstrip(".")
            names = [a.name for a in node.names]
            if module:
                found.append((module, names))
            else:  # from transformer_from_scratch import checks, ...
                found += [(name, []) for name in names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.append((alias.name.removeprefix(PACKAGE + "."), []))
    return found


def graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (from the files in src/)."""
    edges = {}
    for path in sorted(SRC.glob("*.py")):
        if path.stem == "__init__":
            continue
        imports = package_imports(ast.parse(path.read_text()))
        edges[path.stem] = {module for module, _ in imports} - {path.stem}
    return edges


def table() -> str:
    notebooks, edges = written_by(), graph()
    order = sorted(edges, key=lambda m: (notebooks.get(m, [99])[0], m))
    rows = ["| module | written in notebooks | imports |", "|---|---|---|"]
    for module in order:
        where = ", ".join(f"{n:02d}" for n in notebooks.get(module, []))
        uses = ", ".join(sorted(edges[module], key=lambda m: (notebooks[m][0], m))) or "—"
        rows.append(f"| `{module}` | {where} | {uses} |")
    return "\n".join(rows)


def layers_of(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's depth: 0 if it imports nothing of the package, else 1 + its deepest import."""
    depth: dict[str, int] = {}

    def visit(module: str, seen: tuple = ()) -> int:
        if module in seen:
            raise ValueError(f"import cycle: {' -> '.join((*seen, module))}")
        if module not in depth:
            uses = edges.get(module, set())
            depth[module] = 1 + max((visit(u, (*seen, module)) for u in uses), default=-1)
        return depth[module]

    for module in edges:
        visit(module)
    return depth


def draw(path: Path = FIGURE) -> Path:
    """Modules in columns by depth (what they build on is to their left), arrows to what they use.

    Arrows into `checks`, which nearly every module uses, are left out to keep the picture
    readable; the caption says so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    notebooks, edges = written_by(), graph()
    depth = layers_of(edges)
    columns: dict[int, list[str]] = {}
    for module in sorted(edges, key=lambda m: (notebooks[m][0], m)):
        columns.setdefault(depth[module], []).append(module)
    where = {
        module: (2.4 * d, -1.0 * j)
        for d, modules in columns.items()
        for j, module in enumerate(modules)
    }
    tallest = max(len(m) for m in columns.values())
    fig, ax = plt.subplots(figsize=(2.0 * len(columns) + 1.0, 0.75 * tallest + 1.2))
    for module, uses in edges.items():
        for used in uses - {"checks"}:
            arrow = FancyArrowPatch(
                where[module], where[used], arrowstyle="-|>", mutation_scale=10, lw=0.8,
                color="#7f7f7f", shrinkA=24, shrinkB=24, connectionstyle="arc3,rad=0.08",
            )  # fmt: skip
            ax.add_patch(arrow)
    for module, (x, y) in where.items():
        label = f"{module}\n" + ", ".join(f"{n:02d}" for n in notebooks[module])
        ax.text(
            x, y, label, ha="center", va="center", fontsize=9, zorder=3,
            bbox=dict(boxstyle="round,pad=0.35", facecolor="#f0f0f0", edgecolor="#525252"),
        )  # fmt: skip
    ax.set_xlim(-1.2, 2.4 * (len(columns) - 1) + 1.2)
    ax.set_ylim(-1.0 * (tallest - 1) - 0.6, 0.6)
    ax.set_axis_off()
    ax.set_title(
        "The package: each module with the notebooks that write it; an arrow points to a module "
        "it imports\n(every module also uses `checks`, notebook 00; those arrows are left out)",
        fontsize=9,
    )
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def main() -> int:
    print(table())
    print(f"wrote {draw().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
