"""The shape of the package: entry points' parameters and default solvers, import time, largest modules, circles.

    python -m benchmarks.bench_house [--root CHECKOUT] [--repeats 5] [--against OTHER_CHECKOUT]

Everything is measured on the checkout at ``--root`` (default: this one), in fresh subprocesses, so the same
script measures an older commit (``git archive <commit> | tar -x -C /tmp/before``). Prints one table per question.
``--against``: time ``import influkit`` of both checkouts alternately (same load), and print both.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ENTRY_POINTS = {
    "ik.influence": "influkit.influence",
    "ik.score": "influkit.score",
    "ik.self_influence": "influkit.self_influence",
    "ik.solve": "influkit.solve",
    "ssl.hypergradient": "influkit.ssl.hypergradient",
    "ssl.train_ssl": "influkit.ssl.train_ssl",
    "ik.Chain": "influkit.Chain",
    "Chain.query": "influkit.Chain.query",
    "Query.scores": "influkit.Query.scores",
}
SOLVE_KEYWORDS = ("solver", "method", "damping", "tol", "max_iter", "hessian_samples", "seed", "solve")

PROBE = r"""
import inspect, json, sys, importlib
import influkit
heavy = [m for m in ("h5py", "pandas", "scipy", "matplotlib", "sklearn", "transformers") if m in sys.modules]
out = {}
for label, path in json.loads(sys.argv[1]).items():
    obj = influkit
    for part in path.split(".")[1:]:
        obj = getattr(obj, part)
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
    kinds = inspect.Parameter.VAR_KEYWORD
    out[label] = {"parameters": len([p for p in params if p.kind != kinds]), "names": [p.name for p in params],
                  "default": default, "deprecated": any(p.kind == kinds for p in params)}
print(json.dumps({"entry": out, "heavy": heavy}))
"""


def _python() -> str:
    return sys.executable


def import_seconds(root: Path, repeats: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of ``python -c "import influkit"`` in a fresh process, ``repeats`` times. CPU time (user +
    system of the child) depends much less on what else the machine runs than wall time does."""
    times = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([_python(), "-c", "import influkit"], cwd=root, check=True, env=_env(root))
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append((wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
    return times


def _env(root: Path) -> dict:
    return os.environ | {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}


def _describe(times: list[tuple[float, float]]) -> str:
    walls, cpus = sorted(w for w, _ in times), sorted(c for _, c in times)
    return (f"wall best {walls[0]:.3f} s / median {walls[len(walls) // 2]:.3f} s, CPU best {cpus[0]:.3f} s / "
            f"median {cpus[len(cpus) // 2]:.3f} s ({len(times)} runs)")


def largest_modules(root: Path, k: int = 5) -> list[tuple[str, int]]:
    sizes = [(str(p.relative_to(root)), sum(1 for _ in p.open())) for p in (root / "influkit").rglob("*.py")]
    return sorted(sizes, key=lambda s: -s[1])[:k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", default=None, help="another checkout to time `import influkit` against")
    args = parser.parse_args()
    root = Path(args.root).resolve()
    probe = subprocess.run([_python(), "-c", PROBE, json.dumps(ENTRY_POINTS)], cwd=root, env=_env(root),
                           capture_output=True, text=True, check=True)
    info = json.loads(probe.stdout.strip().splitlines()[-1])
    print(f"checkout {root}  ({subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=root, capture_output=True, text=True).stdout.strip()})")
    print(f"load average: {os.getloadavg()[0]:.2f}")
    print("\nentry point           params  default solver        solve keywords in the signature")
    for label, row in info["entry"].items():
        solve = [n for n in row["names"] if n in SOLVE_KEYWORDS]
        old = " (+ deprecated aliases via **kwargs)" if row.get("deprecated") else ""
        print(f"{label:20s}  {row['parameters']:6d}  {str(row['default']):20s}  {', '.join(solve)}{old}")
    times, other = [], []
    for _ in range(args.repeats):  # alternate, so both see the same machine load
        times += import_seconds(root, 1)
        if args.against:
            other += import_seconds(Path(args.against).resolve(), 1)
    print(f"\nimport influkit: {_describe(times)}; heavy modules loaded by `import influkit`: "
          f"{', '.join(info['heavy']) or 'none'}")
    if other:
        print(f"  {args.against}, timed alternately: {_describe(other)}; ratio of best CPU "
              f"{min(c for _, c in times) / min(c for _, c in other):.2f}")
    print("\nlargest modules (lines)")
    for path, lines in largest_modules(root):
        print(f"  {lines:5d}  {path}")
    walker = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"  # this checkout's, on --root
    graphs = subprocess.run([sys.executable, str(walker), "--root", str(root)], capture_output=True, text=True, check=True)
    print("\nimport graphs (circles of influkit and benchmarks, core → outside-the-core arrows, sys.path edits)\n"
          + graphs.stdout.rstrip())


if __name__ == "__main__":
    main()
