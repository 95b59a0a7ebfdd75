"""The import graphs of influkit and of the benchmarks package, read from the source (nothing is imported): circles,
arrows from core to methods, and ``sys.path`` edits.

    python scripts/import_graph.py            # print both graphs' circles and forbidden arrows
    python scripts/import_graph.py --check    # exit 1 if there is any (tests/test_imports.py runs this)

An arrow A → B means module A imports module B, at module level or inside a function (``lazy``); a bare
``import sibling`` inside a package (a script importing the file beside it) counts as an arrow to that sibling.
influkit splits into the **core** (the gradient path every method shares) and the **method and application
packages** built on it (and the presets and tools: influence, multistage, training, jobs, cli); the core imports
nothing outside itself, and no set of modules may import each other in a circle. The benchmarks are a package
(``python -m studies.fidelity ...``): no circle, and no module edits ``sys.path`` to find its siblings.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

PACKAGE = "influkit"
PACKAGES = (PACKAGE, "benchmarks", "studies")  # the graphs checked
# The import contract: the core, the gradient path every method shares, named module by module (a subpackage named
# here is core with all its modules). Every other module of influkit is a method or an integration built on it.
CORE = ("adjoint", "auto", "chain", "contraction", "curvature", "data", "distributed", "ensemble", "errors", "extras",
        "factored", "files", "fitted", "gradients", "influence", "krylov", "layers", "links", "memory", "multistage",
        "operators", "pairwise", "params", "per_token", "philox", "progress", "proximal", "results", "scoring", "solvers", "stage",
        "stationarity", "store", "training", "vectorize")


def modules(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def part(module: str) -> str | None:
    """Which side of the contract ``module`` is on: "core", "method" (methods and integrations), or None (the
    package itself, which re-exports both)."""
    names = module.split(".")
    if names[0] != PACKAGE or len(names) == 1:
        return None
    return "core" if names[1] in CORE else "method"


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (annotation-only imports never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and getattr(child.test, "id", getattr(child.test, "attr", None)) == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def edges(root: Path, package: str = PACKAGE) -> list[tuple[str, str, bool]]:
    """(importer, imported, lazy) for every import of one module of ``package`` by another."""
    known = modules(root, package)
    out = set()
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        top_level = {id(node) for node in tree.body}
        for node in _runtime_nodes(tree):
            lazy = id(node) not in top_level
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module) if node.level else node.module or ""
                # `from pkg import sub` imports the module pkg.sub when it is one, else a name of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                sibling = f"{name.rpartition('.')[0]}.{target}"
                if not node_is_relative(node) and target not in known and sibling in known:
                    target = sibling  # `import common` beside it: a script-style sibling import
                while target and target not in known:  # `import influkit.a.b` → the deepest known module
                    target = target.rpartition(".")[0]
                if target and target.startswith(package) and target != name:
                    out.add((name, target, lazy))
    # an arrow imported both ways counts as eager
    eager = {(a, b) for a, b, lazy in out if not lazy}
    return sorted((a, b, lazy) for a, b, lazy in out if not (lazy and (a, b) in eager))


def node_is_relative(node: ast.AST) -> bool:
    return isinstance(node, ast.ImportFrom) and node.level > 0


def path_edits(root: Path, package: str) -> list[str]:
    """The modules of ``package`` that change ``sys.path`` (a call of one of its methods: insert, append, ...)."""
    found = []
    for name, path in modules(root, package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if target is not None and isinstance(target, ast.Attribute) and target.attr == "path" and \
                    getattr(target.value, "id", None) == "sys":
                found.append(name)
                break
    return found


def is_core(module: str) -> bool:
    return part(module) == "core"


def is_method(module: str) -> bool:
    """A module of the methods or the integrations: built on the core, loaded on first use."""
    return part(module) == "method"


def circles(graph: list[tuple[str, str, bool]], *, include_lazy: bool = True) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan). A submodule importing its own
    package (``from . import x`` in ``pkg/a.py``) is not counted: Python has that package half-built already."""
    adjacency: dict[str, set[str]] = {}
    for a, b, lazy in graph:
        if lazy and not include_lazy:
            continue
        if a.startswith(b + "."):  # a submodule importing its own package (__init__): not a circle at import time
            continue
        adjacency.setdefault(a, set()).add(b)
        adjacency.setdefault(b, set())
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(adjacency[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(adjacency):
        if v not in index:
            visit(v)
    return found


def core_arrows(graph: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    """Imports from a core module (``CORE``) to a method or an integration. Data flows one way."""
    return [(a, b, lazy) for a, b, lazy in graph if is_core(a) and not is_core(b) and b != PACKAGE]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--check", action="store_true", help="exit 1 on any circle, core → method arrow or sys.path edit")
    args = parser.parse_args(argv)
    root, bad = Path(args.root), 0
    for package in PACKAGES:
        if not (root / package).is_dir():
            continue
        graph = edges(root, package)
        found = circles(graph)
        edits = path_edits(root, package) if package != PACKAGE else []  # influkit.jobs loads a user's factory file
        arrows = core_arrows(graph) if package == PACKAGE else []
        print(f"{package}: {len(modules(root, package))} modules, {len(graph)} arrows "
              f"({sum(lazy for *_, lazy in graph)} inside functions)")
        print(f"  import circles: {len(found)}")
        for comp in found:
            print("    " + " ⇄ ".join(comp))
        if package == PACKAGE:
            print(f"  core → outside-the-core arrows: {len(arrows)}")
            for a, b, lazy in arrows:
                print(f"    {a} → {b}" + (" (inside a function)" if lazy else ""))
        if package != PACKAGE:
            print(f"  sys.path edits: {len(edits)}" + "".join(f"\n    {m}" for m in edits))
        bad += len(found) + len(arrows) + len(edits)
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
