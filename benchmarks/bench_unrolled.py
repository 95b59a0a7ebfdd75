"""Exact metagradients (``ik.unrolled.metagradients``): seconds and memory vs the number of recorded steps.

The digits Case 1 chain of ``fidelity_replay`` (SGD + momentum, batches of 32, q = 100 test points summed into one
measure) with T pretraining steps (finetuning: 100 steps), each configuration in a fresh process so that its peak
resident memory (``ru_maxrss``) is its own. For each T: one training run's seconds (the verifying replay: the same
steps) and the metagradient's, each the fastest of 3 interleaved runs, their ratio, and the growth of the peak
resident memory during the first metagradient, with checkpoints every ⌈√T⌉ steps (the default) and with a
single segment (every step's graph held at once). ``--per-test`` adds the metagradient of the q = 100 per-test losses
in one pass (``per_test=True``, the replay protocol's rows): the first pass (which times the two ways of pulling q
outputs on one step, ``diagnostics["pull"]``) and the faster of it and one repeat, with the way chosen.

    python -m benchmarks.bench_unrolled --steps 64 256 1024
    python -m benchmarks.bench_unrolled --steps 150 --per-test   # the replay protocol's run (150 + 100 steps)
    python -m benchmarks.bench_unrolled --lm   # the LM task's recorded continuation (bench_fidelity_lm's cache)
    git show REV:influkit/unrolled/metagradient.py > /tmp/before.py
    python -m benchmarks.bench_unrolled --lm --baseline /tmp/before.py   # before / after in one run

``--lm``: the LM task's warm-protocol continuation (39 SGD steps of the 210k-parameter LoRA-task decoder,
``bench_fidelity_lm.record_continuation``) — one continuation with ``torch.optim`` and the reverse pass for the sum of
the 20 per-test adjoints of the cached pretraining right-hand side (``pretraining_rhs.pt``, an ``ik.unrolled.Adjoint``;
its values do not change the cost; q = 1), interleaved, the fastest of 3 each, and the 20 per-test adjoints in one
pass (first and repeat). ``--baseline FILE``: another version of ``influkit/unrolled/metagradient.py`` (the rest of
influkit shared) loaded beside this one and timed interleaved with it in the same processes — the fair comparison on
a shared machine whose load moves by 2× within minutes; its peak RSS is not separable ("same process"), the
segment's resident growth (``diagnostics["memory"]``) is per version.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.manifest import saved_output

HERE = Path(__file__).resolve().parent
REPEATS = 3


def _pull(result) -> str:
    """How the per-test pass pulled its steps, per stage (``diagnostics["pull"]``; "-" for code without the trial)."""
    stages = result.diagnostics.get("pull", {}).get("stages")
    return "/".join(stage["pull"] if stage else "reused" for stage in stages) if stages else "-"


def versions(baseline: str | None) -> dict:
    """{label: metagradients}: this tree's, and the baseline's — another version of
    ``influkit/unrolled/metagradient.py`` loaded beside it (the rest of influkit shared), so both run in one process."""
    import influkit as ik

    found = {"this": ik.unrolled.metagradients}
    if baseline:
        spec = importlib.util.spec_from_file_location("influkit.unrolled.baseline_metagradient", baseline)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        module.Adjoint = ik.unrolled.Adjoint  # measures are built with this tree's class
        found["baseline"] = module.metagradients
    return found


def timed(record, measure, per_test: bool, training, found: dict) -> dict:
    """Each version's seconds, interleaved with one training run (``training()``) per repeat, the fastest of
    REPEATS; per test: the first pass (it holds the pull trial where there is one) and the fastest repeat."""
    rows = {label: {"q1": [], "per_test": [], "pull": "-", "growth": None} for label in found}
    train = []
    for repeat in range(REPEATS):
        train.append(training())
        for label, metagradients in found.items():
            start = time.perf_counter()
            result = metagradients(record, measure[0])[0]
            rows[label]["q1"].append(time.perf_counter() - start)
            if repeat == 0:
                rows[label]["growth"] = result.diagnostics["memory"]["segment_resident_growth_bytes"] / 2**20
                rows[label]["replay_error"] = result.diagnostics["replay"]["max_error"]
            if per_test and repeat < 2:
                start = time.perf_counter()
                result = metagradients(record, measure[1], per_test=True)[0]
                rows[label]["per_test"].append(time.perf_counter() - start)
                rows[label]["pull"] = _pull(result) if repeat == 0 else rows[label]["pull"]
                rows[label]["q"] = result.values.shape[1]
    training = min(train)
    out = {}
    for label, row in rows.items():
        q1, columns = min(row["q1"]), row["per_test"]
        out[label] = {"training_s": training, "metagradient_s": q1, "ratio": q1 / training,
                      "first_per_test_s": columns[0] if columns else None,
                      "first_per_test_ratio": columns[0] / training if columns else None,
                      "per_test_s": min(columns[1:]) if columns else None,
                      "per_test_ratio": min(columns[1:]) / training if columns else None, "pull": row["pull"],
                      "segment_growth_MiB": row["growth"], "replay_error": row["replay_error"]}
    return out


def one(steps: int, every: int, per_test: bool, baseline: str | None) -> dict:
    """Record, verify and differentiate one digits configuration in this process; the measured numbers."""
    import studies.fidelity_replay as fr
    from studies.fidelity_tasks import TASKS, Task

    import influkit as ik

    torch.set_num_threads(1)
    task = Task(TASKS["digits-case1"], HERE.parent / "studies" / "results" / "fidelity" / "cache")
    config = task.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pre_model, fin_model = task._model(len(config.pretrain_classes)), task._model(len(config.finetune_classes))
    record = ik.unrolled.Record()
    record.train(task.pretrain_stage(pre_model), fr.PRETRAIN["optimizer"], steps=steps, batch_size=32,
                 checkpoint_every=every)
    record.train(task.finetune_stage(fin_model), fr.FINETUNE["optimizer"], steps=100, batch_size=32, seed=1,
                 link=ik.Link("embedding", case=1), checkpoint_every=min(every, 100))
    error = ik.unrolled.verify(record)  # warms up torch.func's first calls
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = ik.unrolled.metagradients(record, task.split.test)[0]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def training() -> float:
        start = time.perf_counter()
        ik.unrolled.verify(record)
        return time.perf_counter() - start

    rows = timed(record, (task.split.test, task.split.test), per_test, training, versions(baseline))
    common = {"steps": steps, "every": every, "peak_growth_MiB": (after - before) / 2**20,
              "checkpoints_MiB": result.diagnostics["memory"]["checkpoint_bytes"] / 2**20}
    return {label: common | row | {"replay_error": max(row["replay_error"], error)} for label, row in rows.items()}


def lm(baseline: str | None) -> dict:
    """The LM task's line (module docstring), measured in this process."""
    import studies.fidelity_lm as fidelity_lm
    from influkit.params import ParamSpace

    import influkit as ik

    torch.set_num_threads(1)
    task = fidelity_lm.LMTask(progress=False)
    kept = {k: v.clone() for k, v in task.pre.model.state_dict().items()}
    record = fidelity_lm.record_continuation(task, progress=False)
    final = record.runs[0].final
    names = task.chain("identity").plans[0].trained
    rhs = torch.load(fidelity_lm.rhs_path("example"))["rhs"]
    adjoint = ik.unrolled.Adjoint(ParamSpace({n: final[n] for n in names}).unflatten(rhs), batched=True)
    summed = ik.unrolled.Adjoint({n: v.sum(0) for n, v in adjoint.tensors.items()})
    ik.unrolled.verify(record)  # warms up torch.func's first calls
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = ik.unrolled.metagradients(record, summed)[0]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def training() -> float:
        task.pre.model.load_state_dict(kept)
        start = time.perf_counter()
        task.ex.continue_pretraining(task.pre, task.cfg, None, task.cfg.seed + 7)
        seconds = time.perf_counter() - start
        task.pre.model.load_state_dict(kept)
        return seconds

    rows = timed(record, (summed, adjoint), True, training, versions(baseline))
    common = {"steps": record.runs[0].steps, "every": record.runs[0].every, "peak_growth_MiB": (after - before) / 2**20,
              "checkpoints_MiB": result.diagnostics["memory"]["checkpoint_bytes"] / 2**20}
    return {label: common | row for label, row in rows.items()}


def measured(args: list[str]) -> dict:
    """One configuration (``--one`` or ``--lm-one``) in a fresh process: {version: numbers}."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_unrolled", *args], env=env, cwd=HERE.parent,
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--per-test", action="store_true", help="also the q = 100 per-test metagradient")
    parser.add_argument("--lm", action="store_true", help="the LM task's continuation instead (module docstring)")
    parser.add_argument("--baseline", metavar="FILE", help="another version of influkit/unrolled/metagradient.py, "
                        "timed interleaved with this one in the same processes (module docstring)")
    parser.add_argument("--one", type=int, nargs=2, metavar=("STEPS", "EVERY"), help=argparse.SUPPRESS)
    parser.add_argument("--lm-one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one or args.lm_one:
        print(json.dumps(lm(args.baseline) if args.lm_one else one(*args.one, args.per_test, args.baseline)))
        return
    with saved_output(HERE / "results" / "bench_unrolled", "bench_unrolled" + ("_lm" if args.lm else "") + ("_per_test" if args.per_test else "") + ("_baseline" if args.baseline else "") + ".txt"):
        with open("/proc/loadavg") as handle:
            print(f"load average before: {handle.read().split()[:3]}", flush=True)
        extra = args.per_test or args.lm
        q = "20" if args.lm else "100"
        print(f"| code | {'task' if args.lm else 'T (pretraining steps)'} | checkpoint every | one training run s | "
              f"metagradient (q = 1) s | ratio |" + (f" per test (q = {q}): first s | ratio | repeat s | ratio | pull |"
                                                      if extra else "") +
              " peak RSS growth MiB | segment's resident growth MiB | checkpoints MiB | replay error |")
        print("|---" * (10 + 5 * extra) + "|")
        baseline = ["--baseline", args.baseline] if args.baseline else []
        configs = [("LM warm continuation", ["--lm-one"])] if args.lm else \
            [(str(steps), ["--one", str(steps), str(every)] + ["--per-test"] * args.per_test)
             for steps in args.steps for every in (math.ceil(math.sqrt(steps)), steps)]
        for name, command in configs:
            for label, row in measured(command + baseline).items():
                extra_cells = (f" {row['first_per_test_s']:.2f} | {row['first_per_test_ratio']:.2f} | "
                               f"{row['per_test_s']:.2f} | {row['per_test_ratio']:.2f} | {row['pull']} |") if extra else ""
                peak = f"{row['peak_growth_MiB']:.1f}" if label == "this" else "(same process)"
                print(f"| {label} | {name} | {row['every']} | {row['training_s']:.2f} | {row['metagradient_s']:.2f} | "
                      f"{row['ratio']:.2f} |{extra_cells} {peak} | {row['segment_growth_MiB']:.1f} | "
                      f"{row['checkpoints_MiB']:.3f} | {row['replay_error']:.1e} |", flush=True)
        with open("/proc/loadavg") as handle:
            print(f"load average after: {handle.read().split()[:3]}", flush=True)


if __name__ == "__main__":
    main()
