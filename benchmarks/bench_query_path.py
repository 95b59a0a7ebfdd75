"""The test set's way through ``Chain.query``, measured by running it: which modules it enters, in which order, and
how often a call climbs back up the import floors.

    python -m benchmarks.bench_query_path [--out benchmarks/results/bench_query_path]

A module's *floor* is read from the import graph (``scripts/import_graph.py``, module-level arrows inside influkit):
a module that imports nothing of influkit is floor 1, any other one floor above the highest it imports. The run
traces (``sys.setprofile``) every call into an influkit function that receives the test inputs — the tensor itself,
a view or slice of it, or a tuple holding one — while a fitted two-stage chain queries a test set (the fit is done
first, outside the trace). The caller of such a call is the nearest influkit frame below it. Counted:

- *stays*: the runs of consecutive calls in one module (a move to another module starts a new stay);
- *climbs back up*: calls from a module into one on a higher floor (a lower module calling back into one that
  imports it, through a function or object it was handed);
- *returns*: stays in a module the trip had already left.

Written: ``path.md`` (the stays in order, with floors and functions, then the counts) and its MANIFEST entry.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "influkit"


def floors() -> dict[str, int]:
    """{module: floor} of influkit's import graph (module-level arrows; a package's own __init__ left out)."""
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    import_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(import_graph)

    arrows: dict[str, set[str]] = {}
    for a, b, lazy in import_graph.edges(ROOT):
        if not lazy and a != b:
            arrows.setdefault(a, set()).add(b)
    modules = set(import_graph.modules(ROOT))
    memo: dict[str, int] = {}

    def floor(m: str, seen=()) -> int:
        if m not in memo:
            below = [b for b in arrows.get(m, ()) if b in modules and b not in seen and not m.startswith(b + ".")]
            memo[m] = 1 + max((floor(b, seen + (m,)) for b in below), default=0)
        return memo[m]

    return {m: floor(m) for m in modules}


def _module(frame) -> str | None:
    path = Path(frame.f_code.co_filename)
    if PACKAGE_DIR not in path.parents:
        return None
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _holds(value, storage: int, depth: int = 0) -> bool:
    if torch.is_tensor(value):
        while torch._C._functorch.is_functorch_wrapped_tensor(value):  # inside grad/vmap: the tensor it wraps
            value = torch._C._functorch.get_unwrapped(value)
        return value.numel() > 0 and value.untyped_storage().data_ptr() == storage
    if isinstance(value, (tuple, list)) and depth < 2:
        return any(_holds(v, storage, depth + 1) for v in value[:4])
    return False


def trace(query, inputs: torch.Tensor) -> list[tuple[str, str, str | None]]:
    """(module, function, caller module) of every influkit call that receives ``inputs`` while ``query()`` runs."""
    storage = inputs.untyped_storage().data_ptr()
    calls = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = _module(frame)
        if module is None or not any(_holds(v, storage) for v in frame.f_locals.values()):
            return
        caller = frame.f_back
        while caller is not None and _module(caller) is None:
            caller = caller.f_back
        calls.append((module, frame.f_code.co_qualname, None if caller is None else _module(caller)))

    sys.setprofile(profile)
    try:
        query()
    finally:
        sys.setprofile(None)
    return calls


def stays(calls, floor: dict[str, int]) -> tuple[list[dict], dict]:
    """The calls grouped into stays, and the counts (stays, modules, climbs back up, returns)."""
    out: list[dict] = []
    climbs = 0
    for module, function, caller in calls:
        if caller is not None and caller != module and floor.get(module, 0) > floor.get(caller, 0):
            climbs += 1
            if out and out[-1]["module"] == module:
                out[-1]["climbs"] += 1
        if not out or out[-1]["module"] != module:
            out.append({"module": module, "floor": floor.get(module, 0), "functions": [], "climbs": 0,
                        "from": caller})
            if caller is not None and caller != module and floor.get(module, 0) > floor.get(caller, 0):
                out[-1]["climbs"] = 1
        if function not in out[-1]["functions"]:
            out[-1]["functions"].append(function)
    seen, returns = set(), 0
    for stay in out:
        returns += stay["module"] in seen
        seen.add(stay["module"])
    return out, {"stays": len(out), "modules": len(seen), "climbs back up": climbs, "returns": returns}


def chain_and_test():
    """A two-stage Case 1 chain (an MLP embedding pretrained, a head finetuned), fitted, and a test set."""
    import influkit as ik
    from influkit.training import train_to_stationarity

    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)

    class Net(nn.Module):
        def __init__(self, classes):
            super().__init__()
            self.embedding = nn.Sequential(nn.Linear(8, 6), nn.Tanh())
            self.head = nn.Linear(6, classes)

        def forward(self, x):
            return self.head(self.embedding(x))

    def ce(out, y):
        return nn.functional.cross_entropy(out, y, reduction="none")

    def l2(params):
        return 1e-2 * sum((p ** 2).sum() for p in params.values())

    teacher = torch.randn(8, 3)
    x_pre, x_fin, x_test = torch.randn(120, 8), torch.randn(80, 8), torch.randn(30, 8)
    pre = ik.Stage(Net(3), ce, (x_pre, (x_pre @ teacher).argmax(-1)), regularizer=l2)
    train_to_stationarity(pre)
    model = Net(2)
    model.embedding.load_state_dict(pre.model.embedding.state_dict())
    fin = ik.Stage(model, ce, (x_fin, (x_fin @ teacher[:, :2]).argmax(-1)), params="head", regularizer=l2)
    train_to_stationarity(fin)
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=1)], progress=False).fit()
    return chain, (x_test, (x_test @ teacher[:, :2]).argmax(-1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_query_path")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    floor = floors()
    chain, test = chain_and_test()
    calls = trace(lambda: chain.query(test), test[0])
    route, counts = stays(calls, floor)
    lines = ["# The test set's way through Chain.query", "",
             "A fitted two-stage Case 1 chain (MLP embedding → head, float64) queried with 30 test examples; every "
             "influkit call that receives the test inputs (or a view of them), grouped into stays.", "",
             "| # | module | floor | functions | climbs back up into it |", "|---|---|---|---|---|"]
    for i, stay in enumerate(route, 1):
        lines.append(f"| {i} | `{stay['module']}` | {stay['floor']} | {', '.join(stay['functions'])} | "
                     f"{stay['climbs']} |")
    lines += ["", "| count | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in counts.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "path.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from benchmarks.manifest import record

    record(args.out, ["path.md"], "python -m benchmarks.bench_query_path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
