"""Exact metagradients (``ik.unrolled.metagradients``): seconds and memory vs the number of recorded steps.

The digits Case 1 chain of ``fidelity_replay`` (SGD + momentum, batches of 32, q = 100 test points summed into one
measure) with T pretraining steps (finetuning: 100 steps), each configuration in a fresh process so that its peak
resident memory (``ru_maxrss``) is its own. For each T: one training run's seconds (the verifying replay: the same
steps) and the metagradient's, each the fastest of 3 interleaved runs, their ratio, and the growth of the peak
resident memory during the first metagradient, with checkpoints every ⌈√T⌉ steps (the default) and with a
single segment (every step's graph held at once). ``--per-test`` adds the metagradient of the q = 100 per-test losses
in one pass (``per_test=True``, the replay protocol's rows) and its ratio.

    python -m benchmarks.bench_unrolled --steps 64 256 1024
    python -m benchmarks.bench_unrolled --steps 150 --per-test   # the replay protocol's run (150 + 100 steps)
    python -m benchmarks.bench_unrolled --lm   # the LM task's recorded continuation (bench_fidelity_lm's cache)

``--lm``: the LM task's warm-protocol continuation (39 SGD steps of the 210k-parameter LoRA-task decoder,
``bench_fidelity_lm.record_continuation``) — one continuation with ``torch.optim`` (warm, the faster of 2), and the
reverse pass for the 20 per-test adjoints of the cached pretraining right-hand side (``pretraining_rhs.pt``, an
``ik.unrolled.Adjoint``; its values do not change the cost) and for their sum (q = 1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPEATS = 3


def _pull(result) -> str:
    """How the per-test pass pulled its steps, per stage (``diagnostics["pull"]``; "-" for code without the trial)."""
    stages = result.diagnostics.get("pull", {}).get("stages")
    return "/".join(stage["pull"] if stage else "reused" for stage in stages) if stages else "-"


def one(steps: int, every: int, per_test: bool) -> dict:
    """Record, verify and differentiate one configuration in this process; the measured numbers."""
    import benchmarks.fidelity_replay as fr
    from benchmarks.fidelity_tasks import TASKS, Task

    import influkit as ik

    torch.set_num_threads(1)
    task = Task(TASKS["digits-case1"], HERE / "results" / "fidelity" / "cache")
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
    training, seconds, columns, pull = [], [], [], "-"
    for _ in range(REPEATS):  # interleaved, the fastest of each: the machine is shared
        start = time.perf_counter()
        ik.unrolled.verify(record)
        training.append(time.perf_counter() - start)
        start = time.perf_counter()
        ik.unrolled.metagradients(record, task.split.test)
        seconds.append(time.perf_counter() - start)
        if per_test:
            start = time.perf_counter()
            result = ik.unrolled.metagradients(record, task.split.test, per_test=True)[0]
            columns.append(time.perf_counter() - start)
            pull = _pull(result) if len(columns) == 1 else pull  # the first pass holds the pull trial
    training, seconds = min(training), min(seconds)
    memory = result.diagnostics["memory"]
    return {"steps": steps, "every": every, "training_s": training, "metagradient_s": seconds,
            "ratio": seconds / training, "per_test_s": min(columns[1:]) if columns else None,
            "per_test_ratio": min(columns[1:]) / training if columns else None, "pull": pull,
            "first_per_test_s": columns[0] if columns else None,
            "first_per_test_ratio": columns[0] / training if columns else None,
            "peak_growth_MiB": (after - before) / 2**20,
            "checkpoints_MiB": memory["checkpoint_bytes"] / 2**20, "replay_error": error,
            "segment_replay_error": result.diagnostics["replay"]["max_error"]}


def lm() -> dict:
    """The LM task's line (module docstring), measured in this process."""
    import benchmarks.bench_fidelity_lm as fidelity_lm
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
    one_measure = ik.unrolled.metagradients(record, summed)[0]
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    training, seconds, columns, pull = [], [], [], "-"
    for repeat in range(REPEATS):  # interleaved, the fastest of each: the machine is shared
        task.pre.model.load_state_dict(kept)
        start = time.perf_counter()
        task.ex.continue_pretraining(task.pre, task.cfg, None, task.cfg.seed + 7)
        training.append(time.perf_counter() - start)
        start = time.perf_counter()
        ik.unrolled.metagradients(record, summed)
        seconds.append(time.perf_counter() - start)
        if repeat < 2:  # the per-test pass: the first (with the pull trial where there is one) and a repeat
            start = time.perf_counter()
            result = ik.unrolled.metagradients(record, adjoint, per_test=True)[0]
            columns.append(time.perf_counter() - start)
            pull = _pull(result) if repeat == 0 else pull
    task.pre.model.load_state_dict(kept)
    training = min(training)
    memory = one_measure.diagnostics["memory"]
    return {"steps": record.runs[0].steps, "every": record.runs[0].every, "training_s": training,
            "metagradient_s": min(seconds), "ratio": min(seconds) / training, "q": result.values.shape[1],
            "per_test_s": columns[1], "per_test_ratio": columns[1] / training, "pull": pull,
            "first_per_test_s": columns[0], "first_per_test_ratio": columns[0] / training,
            "peak_growth_MiB": (after - before) / 2**20, "checkpoints_MiB": memory["checkpoint_bytes"] / 2**20,
            "replay_error": max(result.diagnostics["replay"]["max_error"],
                                one_measure.diagnostics["replay"]["max_error"])}


def measured(tree: str, args: list[str]) -> dict:
    """One measurement (``--one`` or ``--lm-one``) in a fresh process running the influkit of ``tree``."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_unrolled", *args], env=env, cwd=tree,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--per-test", action="store_true", help="also the q = 100 per-test metagradient")
    parser.add_argument("--lm", action="store_true", help="the LM task's continuation instead (module docstring)")
    parser.add_argument("--trees", nargs="+", metavar="LABEL=DIR", default=[f"this={HERE.parent}"],
                        help="source trees to measure, each row once per tree, interleaved (before/after in one run)")
    parser.add_argument("--one", type=int, nargs=2, metavar=("STEPS", "EVERY"), help=argparse.SUPPRESS)
    parser.add_argument("--lm-one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one or args.lm_one:
        print(json.dumps(lm() if args.lm_one else one(*args.one, args.per_test)))
        return
    trees = [tree.split("=", 1) for tree in args.trees]
    with open("/proc/loadavg") as handle:
        print(f"load average before: {handle.read().split()[:3]}", flush=True)
    extra = args.per_test or args.lm
    q = "20" if args.lm else "100"
    print(f"| code | {'task' if args.lm else 'T (pretraining steps)'} | checkpoint every | one training run s | "
          f"metagradient (q = 1) s | ratio |" + (f" per test (q = {q}): first s | ratio | repeat s | ratio | pull |"
                                                  if extra else "") +
          " peak RSS growth MiB | checkpoints MiB | replay error |")
    print("|---" * (9 + 5 * extra) + "|")
    configs = [("LM warm continuation", ["--lm-one"])] if args.lm else \
        [(str(steps), ["--one", str(steps), str(every)] + ["--per-test"] * args.per_test)
         for steps in args.steps for every in (math.ceil(math.sqrt(steps)), steps)]
    for name, command in configs:
        for label, tree in trees:
            row = measured(tree, command)
            extra_cells = (f" {row['first_per_test_s']:.2f} | {row['first_per_test_ratio']:.2f} | "
                           f"{row['per_test_s']:.2f} | {row['per_test_ratio']:.2f} | {row['pull']} |") if extra else ""
            print(f"| {label} | {name} | {row['every']} | {row['training_s']:.2f} | {row['metagradient_s']:.2f} | "
                  f"{row['ratio']:.2f} |{extra_cells} {row['peak_growth_MiB']:.1f} | {row['checkpoints_MiB']:.3f} | "
                  f"{max(row['replay_error'], row.get('segment_replay_error', 0.0)):.1e} |", flush=True)
    with open("/proc/loadavg") as handle:
        print(f"load average after: {handle.read().split()[:3]}", flush=True)


if __name__ == "__main__":
    main()
