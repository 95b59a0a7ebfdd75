"""The shape of the package, measured: ways in, largest functions, settings, import graphs, layer tables, where stage
inheritance and re-training are written, hard dependencies, examples.

    python -m benchmarks.bench_house [--root CHECKOUT] [--repeats 3] [--against OTHER_CHECKOUT]

Everything is measured on the checkout at ``--root`` (default: this one): signatures and dataclass fields by
importing that checkout's influkit in a fresh subprocess, everything else by reading its source (``ast``; nothing
else is imported), so the same script measures an older commit (``git worktree add --detach /tmp/before <commit>``).
``--against``: time ``import influkit`` of both checkouts alternately (same load), and print both.

How each count is made (the rules are the measurement; the listings under each count name what was found):

- *parameters*: the named parameters of a signature (not ``self``); ``+kw`` when it also takes ``**kwargs``.
- *lines*: ``def`` line to last line of the function, docstring included.
- *core modules importing transformers*: a module of influkit's core (``scripts/import_graph.py``'s ``is_core``)
  with an ``import transformers...`` or a string naming a transformers module (a ``sys.modules`` lookup).
- *stage inheritance*: a function that writes the Case 2 proximal term (α times a squared difference) or copies /
  shifts a shared block into another stage's parameters (``copy_``/``add_`` in a loop over inherited, shared or
  mapped names); counted per module.
- *re-training engines*: classes named ``*Recipe*``/``*Retrain*`` or with a ``retrain`` method.
- *layer tables*: the modules whose code (not docstrings, not constructor calls) names two or more torch layer
  types (``nn.Linear``, ``nn.Conv2d``, ...), grouped by package: one package of per-type modules is one table.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ENTRY_POINTS = {  # label: "module:qualified name"
    "ik.influence": "influkit:influence",
    "ik.score": "influkit:score",
    "ik.self_influence": "influkit:self_influence",
    "ik.solve": "influkit:solve",
    "ssl.hypergradient": "influkit.ssl:hypergradient",
    "ssl.train_ssl": "influkit.ssl:train_ssl",
    "fit_curvature": "influkit.factored.fit:fit_curvature",
    "ik.Chain": "influkit:Chain",
    "Chain.query": "influkit:Chain.query",
    "Query.scores": "influkit:Query.scores",
}
SETTINGS = {"ik.SolveConfig": "influkit:SolveConfig", "ik.CurvatureConfig": "influkit:CurvatureConfig",
            "ssl.SSLConfig": "influkit.ssl:SSLConfig"}
SOLVE_KEYWORDS = ("solver", "method", "damping", "tol", "max_iter", "hessian_samples", "seed", "solve", "curvature")
LAYER_TYPES = {"Linear", "Conv1d", "Conv2d", "Embedding", "LayerNorm", "RMSNorm", "Conv1D"}

PROBE = r"""
import dataclasses, importlib, inspect, json, sys
import influkit
heavy = [m for m in ("h5py", "pandas", "scipy", "matplotlib", "sklearn", "transformers") if m in sys.modules]

def resolve(path):
    module, _, name = path.partition(":")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj

entry, settings = {}, {}
for label, path in json.loads(sys.argv[1]).items():
    obj = resolve(path)
    if obj is None:
        continue
    sig = inspect.signature(obj)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    default = None
    for key in ("solver", "method", "solve"):
        if key in sig.parameters and sig.parameters[key].default is not inspect.Parameter.empty:
            d = sig.parameters[key].default
            if key == "solve" and d is None:  # None means SolveConfig()
                d = influkit.SolveConfig()
            default = f"{key}={getattr(d, 'solver', d)!r}"
            break
    var = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    lines = None if inspect.isclass(obj) else len(inspect.getsourcelines(obj)[0])
    entry[label] = {"parameters": len([p for p in params if p.kind not in var]), "names": [p.name for p in params],
                    "kwargs": any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params), "default": default,
                    "lines": lines}
for label, path in json.loads(sys.argv[2]).items():
    obj = resolve(path)
    if obj is not None:
        settings[label] = [f.name for f in dataclasses.fields(obj)]
print(json.dumps({"entry": entry, "settings": settings, "heavy": heavy}))
"""


def _env(root: Path) -> dict:
    return os.environ | {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}


def import_seconds(root: Path, repeats: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of ``python -c "import influkit"`` in a fresh process, ``repeats`` times. CPU time (user +
    system of the child) depends much less on what else the machine runs than wall time does."""
    times = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import influkit"], cwd=root, check=True, env=_env(root))
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append((wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
    return times


def _describe(times: list[tuple[float, float]]) -> str:
    walls, cpus = sorted(w for w, _ in times), sorted(c for _, c in times)
    return (f"wall best {walls[0]:.3f} s / median {walls[len(walls) // 2]:.3f} s, CPU best {cpus[0]:.3f} s / "
            f"median {cpus[len(cpus) // 2]:.3f} s ({len(times)} runs)")


def _import_graph():
    """This checkout's ``scripts/import_graph.py`` as a module (it is a script, not part of a package)."""
    path = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sources(root: Path, folder: str) -> dict[str, ast.Module]:
    """{path relative to root: parsed tree} of every .py file under ``root/folder``."""
    return {str(p.relative_to(root)): ast.parse(p.read_text(), str(p)) for p in sorted((root / folder).rglob("*.py"))}


def _walk_named(tree: ast.AST, stack=()):
    """(qualified name of the enclosing function/class, node) for every node of ``tree``."""
    for child in ast.iter_child_nodes(tree):
        inner = stack + (child.name,) if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else stack
        yield ".".join(inner), child
        yield from _walk_named(child, inner)


def largest_functions(root: Path, folder: str, k: int) -> list[tuple[int, str]]:
    """The k longest functions and methods under ``folder`` (lines, ``path:qualified name``)."""
    found = []
    for path, tree in _sources(root, folder).items():
        for name, node in _walk_named(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node.end_lineno - node.lineno + 1, f"{path}:{name}"))
    return sorted(found, reverse=True)[:k]


def largest_modules(root: Path, k: int = 5) -> list[tuple[str, int]]:
    sizes = [(str(p.relative_to(root)), sum(1 for _ in p.open())) for p in (root / "influkit").rglob("*.py")]
    return sorted(sizes, key=lambda s: -s[1])[:k]


def core_transformers(root: Path, graph) -> list[str]:
    """Core modules that import transformers or look a transformers module up by name."""
    found = []
    for name, path in graph.modules(root).items():
        if not graph.is_core(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = []
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                named = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = [node.value]
            if any(n == "transformers" or n.startswith("transformers.") for n in named):
                found.append(f"{name} (line {node.lineno})")
                break
    return found


def _proximal_term(node: ast.AST) -> bool:
    """α · (… (a − b) ** 2 …): the Case 2 proximal penalty."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return False
    if not any("alpha" in ast.unparse(side) for side in (node.left, node.right)):
        return False
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) and isinstance(n.left, ast.BinOp)
               and isinstance(n.left.op, ast.Sub) for n in ast.walk(node))


def _block_copy(node: ast.AST) -> bool:
    """A loop over inherited / shared / mapped names that copies or shifts parameters in place."""
    if not (isinstance(node, ast.For) and any(k in ast.unparse(node.iter) for k in ("inherited", "mapping", "shared"))):
        return False
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("copy_", "add_")
               for n in ast.walk(node))


def inheritance_places(root: Path, folder: str) -> list[str]:
    """``path:function (proximal term | block copy)`` for each function that writes how a stage receives the block."""
    if not (root / folder).is_dir():
        return []
    found = []
    for path, tree in _sources(root, folder).items():
        for name, node in _walk_named(tree):
            for test, what in ((_proximal_term, "proximal term"), (_block_copy, "block copy")):
                if test(node):
                    found.append(f"{path}:{name or '<module>'} ({what}, line {node.lineno})")
    return found


def retraining_engines(root: Path) -> list[str]:
    found = []
    for path, tree in _sources(root, "influkit").items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {m.name for m in node.body if isinstance(m, ast.FunctionDef)}
                if "Recipe" in node.name or "Retrain" in node.name or "retrain" in methods:
                    found.append(f"{path}:{node.name}")
    return found


def layer_tables(root: Path) -> dict[str, dict[str, list[str]]]:
    """{package or top-level module: {module: layer types it names in code}} for groups naming two or more types."""
    groups: dict[str, dict[str, list[str]]] = {}
    for path, tree in _sources(root, "influkit").items():
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        types = sorted({n.attr for n in ast.walk(tree)
                        if isinstance(n, ast.Attribute) and n.attr in LAYER_TYPES and id(n) not in called})
        if types:
            parts = Path(path).parts
            group = "/".join(parts[:2]) if len(parts) > 2 else path  # influkit/<subpackage> or influkit/<module>.py
            groups.setdefault(group, {})[path] = types
    return {g: mods for g, mods in groups.items() if len({t for ts in mods.values() for t in ts}) >= 2}


def hard_dependencies(root: Path) -> list[str]:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]


def scripts(root: Path, folder: str) -> tuple[int, int, int, int, str]:
    """(files, of them directly in the folder, total lines, largest lines, largest path) of the .py files."""
    files = sorted((root / folder).rglob("*.py")) if (root / folder).is_dir() else []
    if not files:
        return 0, 0, 0, 0, "-"
    sizes = [(sum(1 for _ in p.open()), str(p.relative_to(root))) for p in files]
    top = max(sizes)
    return len(files), sum(p.parent == root / folder for p in files), sum(s for s, _ in sizes), top[0], top[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", default=None, help="another checkout to time `import influkit` against")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    graph = _import_graph()
    probe = subprocess.run([sys.executable, "-c", PROBE, json.dumps(ENTRY_POINTS), json.dumps(SETTINGS)], cwd=root,
                           env=_env(root), capture_output=True, text=True, check=True)
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    print(f"checkout {root}  ({commit.stdout.strip()}); load average {os.getloadavg()[0]:.2f}")

    print("\n## ways in: named parameters (+kw: also **kwargs), lines, default solver")
    print("entry point          params  lines  default solver        solve/curvature keywords in the signature")
    for label, row in info["entry"].items():
        solve = [n for n in row["names"] if n in SOLVE_KEYWORDS]
        params = f"{row['parameters']}{'+kw' if row['kwargs'] else ''}"
        lines = "-" if row["lines"] is None else row["lines"]
        print(f"{label:20s}  {params:>5s}  {lines:>5}  {str(row['default']):20s}  {', '.join(solve)}")

    print("\n## settings dataclasses: fields")
    for label in SETTINGS:
        fields = info["settings"].get(label)
        print(f"{label:20s}  " + ("absent" if fields is None else f"{len(fields):2d}  {', '.join(fields)}"))

    print("\n## largest functions (lines)")
    for lines, name in largest_functions(root, "influkit", 6):
        print(f"  {lines:5d}  {name}")
    lines, name = largest_functions(root, "influkit/factored", 1)[0]
    print(f"largest function of influkit/factored (the curvature fit): {lines} lines, {name}")

    print("\n## largest modules (lines)")
    for path, lines in largest_modules(root):
        print(f"  {lines:5d}  {path}")

    found = core_transformers(root, graph)
    print(f"\n## core modules that import transformers (or look it up in sys.modules): {len(found)}")
    for line in found:
        print(f"    {line}")

    print("\n## places that implement stage inheritance (functions; modules in brackets)")
    for folder in ("influkit", "examples", "studies", "benchmarks"):
        places = inheritance_places(root, folder)
        modules = sorted({p.split(":")[0] for p in places})
        print(f"{folder + '/':13s} {len(places)} functions in {len(modules)} module(s)")
        for place in places:
            print(f"    {place}")

    engines = retraining_engines(root)
    print(f"\n## re-training engines in influkit/: {len(engines)}")
    for engine in engines:
        print(f"    {engine}")

    tables = layer_tables(root)
    print(f"\n## layer tables in influkit/ (module-type dispatch naming ≥ 2 layer types): {len(tables)}")
    for group, mods in tables.items():
        print(f"    {group}: " + "; ".join(f"{Path(m).name} {', '.join(t)}" for m, t in mods.items()))

    deps = hard_dependencies(root)
    print(f"\n## hard dependencies (pyproject [project] dependencies): {len(deps)}\n    {', '.join(deps)}")
    print(f"heavy modules loaded by `import influkit`: {', '.join(info['heavy']) or 'none'}")

    print("\n## examples and studies: .py files (directly in the folder), lines, largest")
    for folder in ("examples", "studies"):
        count, flat, total, top, top_path = scripts(root, folder)
        print(f"{folder + '/':13s} {count:3d} files ({flat} flat)  {total:6,d} lines  largest {top} ({top_path})")

    times, other = [], []
    for _ in range(args.repeats):  # alternate, so both see the same machine load
        times += import_seconds(root, 1)
        if args.against:
            other += import_seconds(Path(args.against).resolve(), 1)
    print(f"\nimport influkit: {_describe(times)}")
    if other:
        print(f"  {args.against}, timed alternately: {_describe(other)}; ratio of best CPU "
              f"{min(c for _, c in times) / min(c for _, c in other):.2f}")

    walker = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"  # this checkout's, on --root
    graphs = subprocess.run([sys.executable, str(walker), "--root", str(root)], capture_output=True, text=True, check=True)
    print("\n## import graphs (circles of influkit and benchmarks, core → outside-the-core arrows, sys.path edits)\n"
          + graphs.stdout.rstrip())


if __name__ == "__main__":
    main()
