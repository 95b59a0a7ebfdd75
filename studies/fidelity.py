"""Fidelity head to head: the LDS of multi-stage influence vs TRAK, kronfluence and dattri on pretrain → finetune tasks.

For each task (``fidelity_tasks.TASKS``: digits Case 1 and Case 2, Fashion-MNIST Case 1) and re-training protocol
(``warm``, ``scratch``), M random halves S_j of the pretraining set are drawn (seeded), both stages re-trained on
each (``scratch``: once per seed, outputs averaged over seeds as TRAK does), and every method's per-test scores —
all computed on the same trained chains — are ranked against the re-trained test losses:

    LDS(t) = Spearman_j( Σ_{i∈S_j} score_i(t), test loss_t(S_j) ),   reported as mean_t ± sem_t (q test points).

Scores are in influkit's sign (positive = up-weighting raises the test loss); each peer's is converted by its
documented sign (``fidelity_methods``). Ensembles (K = 5) average the scores of 5 chains trained from different
initializations (``influkit.Ensemble``; TRAK and dattri ensemble through their own multi-checkpoint APIs).

Resumable: every re-training, trained member and method score matrix is cached under ``results/fidelity/cache``
(keyed by task + config digest, protocol, subset, seed); a second run reuses them.

    python -m studies.fidelity retrain --task digits-case1 --protocol warm --subsets 100
    python -m studies.fidelity retrain --task digits-case1 --protocol scratch --seeds 0 1
    python -m studies.fidelity score --task digits-case1 --members 5
    python -m studies.fidelity check --task digits-case1     # the peers' wiring vs an explicit Hessian
    python -m studies.fidelity table --task digits-case1     # every cached task: tables, plot, README
    python -m studies.fidelity retrain --task digits-case1 --protocol replay --subsets 50   # fidelity_replay
    python -m studies.fidelity retrain --task digits-case1 --protocol replay --subsets 50 --methods \
        "unrolled exact metagradient (replay)" "unrolled exact metagradient at the midpoint (w = 1 − f/2)"
    python -m studies.fidelity linearity --task fashion-case1   # why replay LDS falls with the drop size
    python -m studies.fidelity additive --task fashion-case1 --fraction 0.05   # the best additive ranking
    python -m studies.fidelity retrain --task minilm-dapt --subsets 120  # optional: pretrained MiniLM
    python -m studies.fidelity committed --task digits-case1 --protocol warm --methods "influkit default ..."
    python -m studies.fidelity unrolled --task digits-case1   # + the unrolled rows (warm and scratch)

``--methods`` with the replay protocol computes only the named rows and takes the others from the committed
``replay_<task>.json``.
``committed``: LDS (K = 1) of the named methods against the re-trainings committed in
``results/fidelity/<task>_<protocol>_outputs.csv.gz`` (no re-training; member 0 is trained if not cached).
``unrolled``: the exact metagradient and the approximate unrolling (``fidelity_unrolled``: which recorded run each
protocol's rows differentiate) scored against those committed outputs, once today's code is checked to reproduce
them; their rows go into the committed tables, and README_results.md and lds_vs_seconds.png are re-rendered from
the committed tables of every task.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from studies.fidelity_minilm import TASK_NAME as MINILM
from studies.fidelity_tasks import PROTOCOLS, TASKS, Task, cached_retrain, subsets_for

RESULTS = Path(__file__).resolve().parent / "results" / "fidelity"
CACHE = RESULTS / "cache"


def retrain_all(task: Task, protocol: str, m: int, seeds: list[int], progress: bool = True) -> torch.Tensor:
    """(M, S, q) outputs of re-training on each subset with each seed (warm: one deterministic run, seed 0)."""
    subsets = subsets_for(task, m)
    seeds = [0] if protocol == "warm" else seeds
    jobs = [(j, s) for s in seeds for j in range(m)]  # seed-major: a first full seed is usable early
    outs = {}
    for j, s in tqdm(jobs, desc=f"{task.config.name} {protocol}", disable=not progress, mininterval=30):
        outs[j, s] = cached_retrain(task, subsets, j, protocol, s)
    return torch.stack([torch.stack([outs[j, s] for s in seeds]) for j in range(m)])


def committed_outputs(task: Task, protocol: str) -> tuple[torch.Tensor, torch.Tensor]:
    """((M, q) re-trained test losses averaged over seeds, (M,) subset ids) from the committed gzip CSV."""
    import pandas as pd

    frame = pd.read_csv(RESULTS / f"{task.config.name}_{protocol}_outputs.csv.gz")
    table = frame.groupby(["subset", "test"]).loss.mean().unstack("test").sort_index()
    return torch.tensor(table.to_numpy()), torch.tensor(table.index.to_numpy())


def committed_lds(task: Task, protocol: str, m: int, methods: list[str]) -> None:
    """Print (and append to results/fidelity/committed_lds.txt) each method's K = 1 LDS on the committed outputs."""
    import os

    from studies.fidelity_methods import method_scores
    from influkit.validation import lds_per_query

    outputs, ids = committed_outputs(task, protocol)
    masks = subsets_for(task, m)[ids].numpy()
    for method in methods:
        scores, seconds = method_scores(task, method, 1)
        per_query = lds_per_query(scores, masks, outputs.numpy())
        valid = per_query[torch.isfinite(torch.as_tensor(per_query)).numpy()]
        line = (f"{task.config.name} {protocol} | {method} | LDS {valid.mean():.3f} ± "
                f"{valid.std(ddof=1) / valid.size ** 0.5:.3f} (M = {len(ids)}, q = {valid.size}) | {seconds:.1f} s | "
                f"load {os.getloadavg()[0]:.1f}")
        print(line, flush=True)
        with open(RESULTS / "committed_lds.txt", "a") as fh:
            fh.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("retrain", "score", "check", "table", "committed", "unrolled", "linearity",
                                           "additive"))
    parser.add_argument("--task", choices=sorted(TASKS) + [MINILM], required=True)
    parser.add_argument("--protocol", choices=(*PROTOCOLS, "replay"), default="warm",
                        help="replay: the recorded run replayed with dropped examples weighted 0 (fidelity_replay.py)")
    parser.add_argument("--subsets", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--methods", nargs="*", default=None)
    parser.add_argument("--fraction", type=float, default=0.05, help="additive: the replay drop fraction examined")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.task == MINILM:  # optional real pretrained transformer (studies/fidelity_minilm.py)
        from studies.fidelity_minilm import run

        return run(args.step, args.subsets, args.methods, progress=not args.no_progress)
    task = Task(TASKS[args.task], CACHE)
    start = time.perf_counter()
    if args.step == "linearity":  # the replayed run's response along drop sets vs its linear prediction
        from studies.fidelity_replay import linearity

        linearity(task, {0.01: 20, 0.05: args.subsets, 0.1: 20}, RESULTS, progress=not args.no_progress)
    elif args.step == "additive":  # how well any per-example score can rank the replay's drop sets
        from studies.fidelity_replay import additive_ceiling

        additive_ceiling(task, args.fraction, RESULTS, progress=not args.no_progress)
    elif args.protocol == "replay":  # records, scores and replays in one step (fidelity_replay.py)
        from studies.fidelity_replay import run_replay_protocol

        run_replay_protocol(task, args.subsets, RESULTS, progress=not args.no_progress, methods=args.methods)
    elif args.step == "retrain":
        for k in range(args.members):
            task.member(k)
        out = retrain_all(task, args.protocol, args.subsets, args.seeds, progress=not args.no_progress)
        print(f"{args.task} {args.protocol}: outputs {tuple(out.shape)} in {time.perf_counter() - start:.0f} s")
    elif args.step == "score":
        from studies.fidelity_methods import score_all

        score_all(task, args.members, args.methods, progress=not args.no_progress)
    elif args.step == "check":
        from studies.fidelity_methods import check_peers

        check_peers(task)
    elif args.step == "committed":
        committed_lds(task, args.protocol, args.subsets, args.methods or [])
    elif args.step == "unrolled":
        from studies.fidelity_report import committed_tables, write_summary
        from studies.fidelity_unrolled import add_rows

        add_rows(task, PROTOCOLS, RESULTS, args.subsets)
        write_summary(committed_tables(list(TASKS), RESULTS), RESULTS)
    else:
        from studies.fidelity_report import write_tables

        tasks = [Task(TASKS[name], CACHE) for name in TASKS if (CACHE / name).exists()]
        write_tables(task, args.subsets, args.seeds, RESULTS, tasks)


if __name__ == "__main__":
    main()
