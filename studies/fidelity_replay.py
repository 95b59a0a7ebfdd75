"""The **replay** LDS protocol: attribute the training that ran, and check it against the same run replayed.

A task's chain is trained once, recorded (``influkit.unrolled.Record``): pretraining, then finetuning from its
result (Case 1: head only, shared block fixed; Case 2: everything, with α‖W − W̄‖²), both with SGD + heavy-ball
momentum on seeded mini-batches of 32 and the task's L2 in the objective, from member 0's initialization — stopped
after 150 + 100 steps, away from a stationary point (‖∇‖ ≈ 0.04). (With Adam pretraining the run is far less
linear in the data weights: on digits Case 1, dropping one example changed the summed test loss with Pearson 0.71
to −score over 15 examples, against 0.999 with SGD + momentum; see the README.) For each drop fraction
f ∈ {1 %, 5 %, 10 %, 50 %}, M random sets D_j of ⌊f·n⌋ pretraining examples are dropped by **replaying** the record with w_z = 0 for z ∈ D_j (same
initialization, batch order and learning rates; deterministic, so the noise ceiling is 1), and each method's
per-test scores rank the replayed test losses:

    LDS(t) = Spearman_j( Σ_{z∉D_j} score_z(t), test loss_t(replay without D_j) ),   mean ± sem over test points t.

Methods, all on the recorded final models: the exact metagradient (``ik.unrolled.metagradients``, per test point),
the same at the mean midpoint of each fraction's removals (``at``: pretraining weights 1 − f/2, one pass per
fraction; −Σ_{z∈D} score_z is exact for a response quadratic in w at the midpoint (1 + 1_D̄)/2), the same at the
drop sets' mean weights 1 − f (``MEAN``: what the LDS ranks is the response's part linear in the drop mask, and for
a response quadratic in w the gradient at the masks' mean carries it exactly — see ``mean_weight``), the approximate
unrolling (``ik.unrolled.approximate``: 5 segments per stage, dense Hessian at each segment's end; EK-FAC fitted
there, SOURCE's curvature at scale; EK-FAC completed by each stage's top 20 Hessian eigenpairs, ``top=20``, and by
the top 20 of its Gauss-Newton matrix, ``top_curvature="gauss-newton"``),
influkit's influence functions on the same chain (exact, Gauss-Newton, EK-FAC, Arnoldi, identity), which assume the
stages sit at minima, and — where installed (/work/bench-venv) — the single-stage peers TRAK, kronfluence and dattri
as ``fidelity_methods`` wires them (K = 1). The metagradient's seconds are reported beside one training run's (its
ratio; MAGIC's is 2–3×). Replayed outputs are cached under ``results/fidelity/cache/<task>/replay``.
``--methods`` computes only the named rows; the others are taken from the committed ``replay_<task>.json`` (the
table says which).

    python studies/fidelity.py retrain --task digits-case1 --protocol replay --subsets 50
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

import influkit as ik
from studies.fidelity_methods import INFLUKIT as INFLUENCE
from studies.fidelity_tasks import Task
from influkit import Chain, Link
from influkit.unrolled import SGD, Record
from influkit.validation.lds import lds_per_query

FRACTIONS = (0.01, 0.05, 0.1, 0.5)
PRETRAIN = {"optimizer": SGD(lr=0.05, momentum=0.9), "steps": 150, "batch_size": 32}
FINETUNE = {"optimizer": SGD(lr=0.05, momentum=0.9), "steps": 100, "batch_size": 32}
APPROXIMATE_SEGMENTS = 5
EXACT = "unrolled exact metagradient (replay)"
MIDPOINT = "unrolled exact metagradient at the midpoint (w = 1 − f/2)"
MEAN = "unrolled exact metagradient at the mean weights (w = 1 − f)"
APPROXIMATE = f"unrolled approximate ({APPROXIMATE_SEGMENTS} segments per stage, dense Hessian)"
APPROXIMATE_MEAN = f"{APPROXIMATE} at the mean weights (w = 1 − f)"
TOP = 20
"""Eigenpairs per stage in the rows whose EK-FAC segments are completed by them (``approximate(top=)``)."""
APPROXIMATE_EKFAC = f"unrolled approximate ({APPROXIMATE_SEGMENTS} segments per stage, EK-FAC)"
APPROXIMATE_EKFAC_TOP = (f"unrolled approximate ({APPROXIMATE_SEGMENTS} segments per stage, EK-FAC + top {TOP} "
                         "Hessian)")
APPROXIMATE_EKFAC_TOP_GN = (f"unrolled approximate ({APPROXIMATE_SEGMENTS} segments per stage, EK-FAC + top {TOP} "
                            "Gauss-Newton)")
APPROXIMATE_SETTINGS = {APPROXIMATE: {"curvature": "hessian"}, APPROXIMATE_EKFAC: {"curvature": "ekfac", "top": 0},
                        APPROXIMATE_EKFAC_TOP: {"curvature": "ekfac", "top": TOP, "top_curvature": "hessian"},
                        APPROXIMATE_EKFAC_TOP_GN: {"curvature": "ekfac", "top": TOP, "top_curvature": "gauss-newton"}}
"""``ik.unrolled.approximate``'s settings of each approximate row at w = 1 (with ``segments=APPROXIMATE_SEGMENTS``),
here and in ``fidelity_unrolled``."""
SUBSET_SEED = 0


PRETRAIN_LR = {"fashion-case1": 0.02}
"""Per-task pretraining learning rates. On Fashion-MNIST, SGD + momentum at lr 0.05 is chaotic: the trained model
depends on the data weights so irregularly that dropping one example changed the summed test loss with Pearson
0.15 to the exact derivative's prediction (15 examples; 0.94 at lr 0.02), and every method's replay LDS was ≤ 0.2
(exact metagradient 0.05 at 1 %: ``results/fidelity/replay_fashion-case1_pretrain-lr0.05.md``)."""


def pretrain_optimizer(task: Task) -> SGD:
    """The recorded pretraining optimizer of ``task`` (PRETRAIN's, with the task's learning rate if it has one)."""
    optimizer = PRETRAIN["optimizer"]
    lr = PRETRAIN_LR.get(task.config.name, optimizer.lr)
    return SGD(lr=lr, momentum=optimizer.momentum, nesterov=optimizer.nesterov, weight_decay=optimizer.weight_decay)


def settings_digest(task: Task) -> str:
    """16 hex characters naming the task and the recorded training (cache keys carry it)."""
    settings = {"task": task.config.digest(), "pre": repr(PRETRAIN), "fin": repr(FINETUNE)}
    if task.config.name in PRETRAIN_LR:
        settings["pre_lr"] = PRETRAIN_LR[task.config.name]
    text = json.dumps(settings, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def record_task(task: Task) -> Record:
    """Train and record the task's chain from member 0's initialization (module docstring)."""
    config = task.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pre_model = task._model(len(config.pretrain_classes))
        fin_model = task._model(len(config.finetune_classes))
    record = Record()
    record.train(task.pretrain_stage(pre_model), pretrain_optimizer(task), steps=PRETRAIN["steps"],
                 batch_size=PRETRAIN["batch_size"], seed=0)
    record.train(task.finetune_stage(fin_model), FINETUNE["optimizer"], steps=FINETUNE["steps"],
                 batch_size=FINETUNE["batch_size"], seed=1, link=Link("embedding", case=config.case, alpha=config.alpha))
    return record


def drop_sets(n: int, fraction: float, m: int) -> torch.Tensor:
    """(m, n) bool *kept* masks: each drops ⌊fraction·n⌋ (at least 1) seeded random examples."""
    gen = torch.Generator().manual_seed(SUBSET_SEED + int(round(fraction * 1e4)))
    size = max(1, int(fraction * n))
    keep = torch.ones(m, n, dtype=torch.bool)
    for j in range(m):
        keep[j, torch.randperm(n, generator=gen)[:size]] = False
    return keep


def replayed_outputs(task: Task, record: Record, keep: torch.Tensor, fraction: float, progress: bool) -> torch.Tensor:
    """(M, q) test losses of the record replayed with each dropped set weighted 0 (cached)."""
    directory = task.directory / "replay"
    directory.mkdir(parents=True, exist_ok=True)
    digest = settings_digest(task)
    rows = []
    for j in tqdm(range(keep.shape[0]), desc=f"{task.config.name} replay {fraction:g}", disable=not progress,
                  mininterval=30):
        mask_hash = hashlib.sha256(keep[j].numpy().tobytes()).hexdigest()[:8]
        path = directory / f"drop{fraction:g}_{j:04d}_{digest}_{mask_hash}.safetensors"
        if path.exists():
            rows.append(load_file(path)["outputs"])
            continue
        start = time.perf_counter()
        out = ik.unrolled.outputs(record, task.split.test, keep[j].double())
        save_file({"outputs": out.contiguous()}, str(path), metadata={"seconds": f"{time.perf_counter() - start:.3f}"})
        rows.append(out)
    return torch.stack(rows)


def method_scores(task: Task, record: Record, wanted, fractions) -> dict[str, tuple]:
    """{method: ((n, q) scores in influkit's sign — or {fraction: scores} for the midpoint row —, seconds, facts)}
    on the recorded final models, for the methods in ``wanted``."""
    out = {}
    if EXACT in wanted:
        start = time.perf_counter()
        results = ik.unrolled.metagradients(record, task.split.test, per_test=True)
        seconds = time.perf_counter() - start
        diag = results[0].diagnostics
        out[EXACT] = (results[0].values.numpy(), seconds,
                      {"replay error (segment ends vs checkpoints)": diag["replay"]["max_error"],
                       "checkpoints MiB": diag["memory"]["checkpoint_bytes"] / 2**20,
                       "one segment's graphs, resident growth MiB": diag["memory"]["segment_resident_growth_bytes"] / 2**20})
        start = time.perf_counter()
        summed = ik.unrolled.metagradients(record, task.split.test)
        out[EXACT][2]["seconds, summed measure (q = 1)"] = time.perf_counter() - start
        out[EXACT][2]["check: per-test columns sum to q = 1"] = float(
            (torch.as_tensor(out[EXACT][0]).sum(1) - summed[0].values).abs().max())
    exact = lambda at: ik.unrolled.metagradients(record, task.split.test, per_test=True, at=at)  # noqa: E731
    if MIDPOINT in wanted:
        out[MIDPOINT] = scores_at(exact, record, fractions, midpoint_weight)
    if MEAN in wanted:
        out[MEAN] = scores_at(exact, record, fractions, mean_weight)
    if APPROXIMATE_MEAN in wanted:
        out[APPROXIMATE_MEAN] = scores_at(lambda at: ik.unrolled.approximate(
            record, task.split.test, segments=APPROXIMATE_SEGMENTS, per_test=True, at=at), record, fractions, mean_weight)
    for name, settings in APPROXIMATE_SETTINGS.items():
        if name in wanted:
            start = time.perf_counter()
            approximate = ik.unrolled.approximate(record, task.split.test, segments=APPROXIMATE_SEGMENTS,
                                                  per_test=True, **settings)
            out[name] = (approximate[0].values.numpy(), time.perf_counter() - start, {})
    pre, fin = (run.stage for run in record.runs)
    for name, (solve, curvature) in INFLUENCE.items():
        if name not in wanted:
            continue
        start = time.perf_counter()
        try:
            chain = Chain([pre, fin], [record.runs[1].link], solve=solve, curvature=curvature)
            result = chain.query(task.split.test, per_test=True).scores()
            values = result.values[torch.argsort(result.index)].double().numpy()
            out[name] = (values, time.perf_counter() - start, {})
        except Exception as exc:  # a method that fails is reported, the others still run
            print(f"{task.config.name} | {name} | FAILED: {type(exc).__name__}: {exc}", flush=True)
    return out


def midpoint_weight(fraction: float) -> float:
    """1 − f/2: the mean over drop sets D of the midpoint (1 + 1_D̄)/2 of the path from w = 1 to the drop."""
    return 1 - fraction / 2


def mean_weight(fraction: float) -> float:
    """1 − f, the drop masks' mean. With w_D = 1 − m_D (m_D the mask, E m = f·1, e = m − f·1) and a response
    quadratic in w, y(w_D) = y(1) − g(1)ᵀm + ½ mᵀHm; linearizing at w̄ = 1 − c·1 predicts y(w̄) − g(w̄)ᵀ(m − c·1),
    g(w̄) = g(1) − cH1, which leaves the residual (f − c)·1ᵀHe + ½ eᵀHe + const. The LDS ranks drop sets, so only
    the residual's part linear in e hurts it: zero at c = f. (The midpoint c = f/2 is exact for each set's
    difference y(w_D) − y(1), not for its rank.)"""
    return 1 - fraction


def scores_at(method, record: Record, fractions, weight_of) -> tuple[dict, float, dict]:
    """({fraction f: (n, q) pretraining scores of ``method(at)`` at pretraining weights ``weight_of(f)``, finetuning
    as recorded}, seconds of one pass (mean over the fractions; each re-runs the record at its weights first),
    facts)."""
    n = len(record.runs[0].stage)
    values, seconds = {}, []
    for fraction in fractions:
        start = time.perf_counter()
        at = [torch.full((n,), weight_of(fraction), dtype=torch.float64)] + [None] * (len(record) - 1)
        result = method(at)[0]
        values[fraction] = result.values.numpy()
        seconds.append(time.perf_counter() - start)
    facts = {"seconds per fraction (one pass each)": [round(s, 2) for s in seconds]}
    if "replay" in result.diagnostics:  # the exact pass checks its recomputed segment ends
        facts["replay error (segment ends vs checkpoints)"] = result.diagnostics["replay"]["max_error"]
    return values, float(np.mean(seconds)), facts


def peer_scores(task: Task, record: Record, wanted) -> dict[str, tuple[np.ndarray, float, dict]]:
    """The single-stage peers of ``fidelity_methods`` (TRAK, kronfluence, dattri; K = 1, their conversions to influkit's
    sign) on the recorded final models, for those in ``wanted``: the task's member 0 is the record's chain for the
    call. Empty when the peers are not installed (they live in /work/bench-venv)."""
    from studies.fidelity_methods import PEERS

    if not set(PEERS) & set(wanted):
        return {}
    try:
        from studies.fidelity_methods import PEER_FUNCTIONS, PEERS, import_peers

        import_peers()
    except ImportError as exc:
        print(f"{task.config.name} | peers skipped: {exc}", flush=True)
        return {}
    out, saved = {}, task._members.get(0)
    task._members[0] = tuple(run.stage for run in record.runs)
    try:
        for name in (p for p in PEERS if p in wanted):
            start = time.perf_counter()
            try:
                out[name] = (np.asarray(PEER_FUNCTIONS[name](task, [0]), dtype=np.float64), time.perf_counter() - start, {})
            except Exception as exc:  # a peer that fails is reported, the others still run
                print(f"{task.config.name} | {name} | FAILED: {type(exc).__name__}: {exc}", flush=True)
    finally:
        if saved is None:
            task._members.pop(0)
        else:
            task._members[0] = saved
    return out


def all_methods() -> list[str]:
    """Every row of the replay table, in its order."""
    from studies.fidelity_methods import PEERS

    return [EXACT, MIDPOINT, MEAN, APPROXIMATE, APPROXIMATE_MEAN, APPROXIMATE_EKFAC, APPROXIMATE_EKFAC_TOP,
            APPROXIMATE_EKFAC_TOP_GN, *INFLUENCE,
            *PEERS]


def run_replay_protocol(task: Task, m: int, results: Path, fractions=FRACTIONS, progress: bool = True,
                        methods: list[str] | None = None) -> dict:
    """Record, score, replay at every fraction; write ``replay_<task>.md/.json`` and the LDS-vs-drop plot.

    methods: the rows to compute (default all); the others are read from the committed ``replay_<task>.json``."""
    torch.set_num_threads(1)
    wanted = all_methods() if methods is None else list(methods)
    unknown = [name for name in wanted if name not in all_methods()]
    if unknown:
        raise SystemExit(f"unknown replay methods {unknown}; choose among {all_methods()}")
    record = record_task(task)
    training = sum(run.seconds for run in record.runs)
    verify_start = time.perf_counter()
    error = ik.unrolled.verify(record)
    replay_seconds = time.perf_counter() - verify_start
    scores = method_scores(task, record, wanted, fractions) | peer_scores(task, record, wanted)
    n = len(task.split.pretrain[0])
    table, seconds = {}, {name: s for name, (_, s, _) in scores.items()}
    paired = {}
    for fraction in fractions:
        keep = drop_sets(n, fraction, m)
        actual = replayed_outputs(task, record, keep, fraction, progress).numpy()
        per_query = {}
        for name, (values, _, _) in scores.items():
            values = values[fraction] if isinstance(values, dict) else values
            per_query[name] = lds_per_query(values, keep.numpy(), actual)
            valid = per_query[name][np.isfinite(per_query[name])]
            table[name, fraction] = (float(valid.mean()), float(valid.std(ddof=1) / np.sqrt(valid.size)))
        for rule in (MIDPOINT, MEAN):
            if EXACT in per_query and rule in per_query:
                gain = per_query[rule] - per_query[EXACT]
                gain = gain[np.isfinite(gain)]
                paired.setdefault(rule, {})[f"{fraction:g}"] = \
                    f"{gain.mean():+.3f} ± {gain.std(ddof=1) / np.sqrt(gain.size):.3f}"
    facts = {"task": task.config.name, "M": m, "n": n, "q": len(task.split.test[0]),
             "one training run, seconds (the verifying replay: same steps, warm)": replay_seconds,
             "first training run, seconds (recorded, includes torch.func warm-up)": training,
             "replay error (verify, max |Δ| over every checkpoint)": error,
             "steps": [run.steps for run in record.runs], "optimizers": [repr(run.optimizer) for run in record.runs],
             "test loss (recorded run, summed)": float(ik.unrolled.outputs(record, task.split.test).sum()),
             "load average": ", ".join(f"{v:.1f}" for v in os.getloadavg())}
    for rule, gains in paired.items():
        facts[f"{rule} − exact LDS, paired over test points (mean ± sem), per drop fraction"] = gains
    if EXACT in scores:  # the row's seconds are q per-test metagradients in one pass; MAGIC's 2–3× is for one measure
        one = scores[EXACT][2]["seconds, summed measure (q = 1)"]
        facts["exact metagradient's seconds: the row differentiates the q per-test losses in one reverse pass; one "
              "summed measure (q = 1, MAGIC's setting)"] = f"{one:.2f} s = {one / replay_seconds:.2f}× one training run"
    names, training = list(scores), {name: replay_seconds for name in scores}
    if methods is not None:
        committed = committed_rows(task, results, m, fractions, table, seconds, training)
        names = [name for name in all_methods() if name in scores or name in committed]
        if committed:
            facts["rows from the committed json (not re-run here; their seconds and × training as committed)"] = \
                sorted(committed, key=names.index)
    details = {name: facts_ for name, (_, _, facts_) in scores.items()}
    write(task.config.name, table, seconds, training, names, details, facts, results, fractions)
    return {"table": table, "facts": facts, "scores": scores}


def committed_rows(task: Task, results: Path, m: int, fractions, table: dict, seconds: dict,
                   training: dict) -> list[str]:
    """Add to ``table``/``seconds``/``training`` (the one-run seconds each row's ratio divides by) the rows of the
    committed replay_<task>.json that were not computed (same M and fractions, else none); returns their names."""
    path = results / f"replay_{task.config.name}.json"
    if not path.exists():
        return []
    payload = json.loads(path.read_text())
    if payload["facts"]["M"] != m or payload["fractions"] != list(fractions):
        print(f"{path.name}: committed M or fractions differ; its rows are not taken", flush=True)
        return []
    taken = [name for name in payload["lds"] if name not in seconds]
    for name in taken:
        for fraction in fractions:
            table[name, fraction] = tuple(payload["lds"][name][f"{fraction:g}"])
        seconds[name] = payload["seconds"][name]
        training[name] = payload["training_seconds"].get(name) if "training_seconds" in payload else \
            payload["facts"]["one training run, seconds (the verifying replay: same steps, warm)"]
    return taken


def write(task: str, table: dict, seconds: dict, training: dict, names: list[str], details: dict, facts: dict,
          results: Path, fractions) -> None:
    """results/fidelity/replay_<task>.md (table + facts) and .json; the plot of every task written so far.

    training: {row: seconds of one training run measured in the same run as the row's seconds (its ratio's divisor)}."""
    lines = [f"### {task}, replay protocol (M = {facts['M']} per fraction, q = {facts['q']})", "",
             "| method | " + " | ".join(f"drop {f:.0%}" for f in fractions) + " | seconds | × training |",
             "|---|" + "---|" * (len(fractions) + 2)]
    for name in names:
        cells = [f"{table[name, f][0]:.3f} ± {table[name, f][1]:.3f}" for f in fractions]
        lines.append(f"| {name} | " + " | ".join(cells) +
                     f" | {seconds[name]:.2f} | {seconds[name] / training[name]:.2f} |")
    lines += ["", *(f"- {k}: {v}" for k, v in facts.items()),
              *(f"- {name}: {k}: {v}" for name, facts_ in details.items() for k, v in facts_.items())]
    (results / f"replay_{task}.md").write_text("\n".join(lines) + "\n")
    payload = {"facts": facts, "fractions": list(fractions),
               "lds": {name: {f"{f:g}": table[name, f] for f in fractions} for name in names},
               "seconds": {name: seconds[name] for name in names},
               "training_seconds": {name: training[name] for name in names}, "details": details}
    (results / f"replay_{task}.json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(lines), flush=True)
    plot(results)


def plot(results: Path) -> None:
    """replay_lds_vs_drop.png: LDS (± sem) vs drop fraction per method, one panel per task with results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = [path for path in sorted(results.glob("replay_*.json")) if not path.stem.endswith("_linearity")]
    if not files:
        return
    payloads = [json.loads(path.read_text()) for path in files]
    every = list(dict.fromkeys(name for payload in payloads for name in payload["lds"]))  # one color per method
    colors = [*plt.cm.tab20.colors, *plt.cm.tab20b.colors]
    legend_rows = -(-len(every) // 4)  # the shared legend below the panels, 4 columns
    columns = min(4, len(files))
    grid_rows = -(-len(files) // columns)
    height = 3.8 * grid_rows + 0.16 * legend_rows
    fig, axes = plt.subplots(grid_rows, columns, figsize=(5.5 * columns, height), squeeze=False)
    for ax in axes.flat[len(files):]:
        ax.set_visible(False)
    for ax, payload in zip(axes.flat, payloads):
        fractions = payload["fractions"]
        for name, cells in payload["lds"].items():
            mean = [cells[f"{f:g}"][0] for f in fractions]
            sem = [cells[f"{f:g}"][1] for f in fractions]
            ours = name.startswith(("unrolled", "influkit"))
            ax.errorbar(fractions, mean, yerr=sem, marker="o" if ours else "s", capsize=2, label=name,
                        color=colors[every.index(name) % len(colors)], ls="-" if ours else "--", lw=2 if name in (EXACT, MIDPOINT, MEAN) else 1)
        ax.set_xscale("log")
        ax.set_xticks(fractions, [f"{f:.0%}" for f in fractions])
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylim(-0.2, 1.02)
        ax.set_xlabel("fraction of pretraining examples dropped")
        ax.set_ylabel("LDS (mean ± sem over test points)")
        ax.set_title(f"{payload['facts']['task']}, replay (M = {payload['facts']['M']})", fontsize=9)
    legend = {label: handle for ax in axes.flat for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, (0.16 * legend_rows + 0.3) / height, 1, 1))
    fig.savefig(results / "replay_lds_vs_drop.png", dpi=120)
    plt.close(fig)


LINEARITY_SCALES = (0.1, 1.0, -1.0)
"""t of the weights w = 1 − t·1_D along a drop set D: 1 drops D (the protocol), 0.1 a tenth of the way, −1 doubles D."""


def linearity(task: Task, sets: dict[float, int], results: Path, progress: bool = True) -> dict:
    """Why the exact metagradient's replay LDS falls as more is dropped: the replayed response along each drop set.

    For the first m drop sets D_j of each fraction (``drop_sets``; m = sets[fraction]), the record is replayed with
    w = 1 − t·1_{D_j} for t in LINEARITY_SCALES; Δ_t = outputs(w) − outputs(1) per test point, against the
    metagradient's linear prediction t·p_j, p_j = −Σ_{z∈D_j} score_z. Δ_t = t·p + t²·Q + O(t³), so the measured
    second-order term is Q ≈ (Δ_1 + Δ_{−1}) / 2. Reported per fraction and t: LDS(t) = mean_tests Spearman_j(p, Δ_t)
    (t = 1: the protocol's LDS on these sets), the nonlinear share ρ(t) = median over tests of
    std_j(Δ_t − t·p) / std_j(t·p) (quadratic: ρ ∝ t), the LDS that p + Q would reach at t = 1 (how much of the gap
    the second-order term explains), and Spearman over tests of per-test LDS(1) with std_j(p) (is it the tests whose
    loss barely moves?). Writes results/fidelity/replay_<task>_linearity.md and .json.
    """
    from scipy.stats import spearmanr

    torch.set_num_threads(1)
    record = record_task(task)
    test = task.split.test
    score = ik.unrolled.metagradients(record, test, per_test=True)[0].values.double()
    base = ik.unrolled.outputs(record, test)
    n = len(task.split.pretrain[0])
    rows, cache = [], task.directory / "replay"
    cache.mkdir(parents=True, exist_ok=True)
    for fraction, m in sets.items():
        dropped = ~drop_sets(n, fraction, m)
        predicted = -(dropped.double() @ score).numpy()  # (m, q): p_j
        delta = {}
        for t in LINEARITY_SCALES:
            outs = []
            for j in tqdm(range(m), desc=f"{task.config.name} {fraction:g} t={t:g}", disable=not progress,
                          mininterval=30):
                path = cache / f"linearity{fraction:g}_t{t:g}_{j:04d}_{settings_digest(task)}.safetensors"
                if path.exists():
                    outs.append(load_file(path)["outputs"])
                    continue
                out = ik.unrolled.outputs(record, test, 1.0 - t * dropped[j].double())
                save_file({"outputs": out.contiguous()}, str(path))
                outs.append(out)
            delta[t] = (torch.stack(outs) - base).numpy()
        quadratic = (delta[1.0] + delta[-1.0]) / 2
        row = {"fraction": fraction, "dropped": int(dropped[0].sum()), "M": m}
        for t in (0.1, 1.0):
            row[f"LDS(t={t:g})"] = _mean_spearman(predicted, delta[t])
            residual, linear = delta[t] - t * predicted, t * predicted
            row[f"nonlinear share ρ(t={t:g})"] = float(np.median(residual.std(0) / linear.std(0)))
        row["LDS of p + Q at t = 1"] = _mean_spearman(predicted + quadratic, delta[1.0])
        row["ρ after p + Q at t = 1"] = float(np.median((delta[1.0] - predicted - quadratic).std(0) / predicted.std(0)))
        per_test = np.array([spearmanr(predicted[:, i], delta[1.0][:, i])[0] for i in range(predicted.shape[1])])
        row["Spearman_tests(LDS(1), std p)"] = float(spearmanr(per_test, predicted.std(0))[0])
        row["LDS(1) on the half of tests with larger std p"] = float(
            np.nanmean(per_test[predicted.std(0) >= np.median(predicted.std(0))]))
        rows.append(row)
        print(row, flush=True)
    keys = list(rows[0])
    lines = [f"### {task.config.name}: linearity of the replayed run in the dropped weights (exact metagradient)", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |"
              for r in rows]
    lines += ["", f"q = {len(test[0])} test points, n = {n}; {linearity.__doc__.split(chr(10) + chr(10))[0]}",
              "Load average " + ", ".join(f"{v:.1f}" for v in os.getloadavg()) + "."]
    (results / f"replay_{task.config.name}_linearity.md").write_text("\n".join(lines) + "\n")
    (results / f"replay_{task.config.name}_linearity.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines), flush=True)
    return {"rows": rows}


def _mean_spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over columns (test points) of Spearman_rows(a, b), NaN columns skipped."""
    return float(np.nanmean(_spearman_per_test(a, b)))


def _spearman_per_test(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman_rows(a[:, i], b[:, i]) for every column i (test point)."""
    from scipy.stats import spearmanr

    return np.array([spearmanr(a[:, i], b[:, i])[0] for i in range(a.shape[1])])


ADDITIVE_SETS = 4000
"""Replayed drop sets the linear datamodel of ``additive_ceiling`` is fitted on (its own seed, not the protocol's)."""
ADDITIVE_RIDGE = (0.1, 1.0, 10.0, 100.0, 1000.0)
"""Ridge penalties the datamodel chooses among, on a held-out fifth of its fitting sets."""


def additive_ceiling(task: Task, fraction: float, results: Path, sets: int = ADDITIVE_SETS,
                     progress: bool = True) -> dict:
    """How close can a per-example score come to ranking the replay protocol's drop sets of one fraction?

    A score ranks a set D by Σ_{z∈D} (its prediction is additive in the drop mask m); the protocol's LDS rewards
    nothing else. For a response quadratic in the weights, y(1 − m) = y(1) + aᵀm + ½ mᵀHm, the gradient at the
    masks' mean (``MEAN``, w̄ = 1 − f) leaves const + ½ δᵀHδ with δ = m − f·1, whose additive part is the diagonal
    ½(1 − 2f) Σ_{z∈D} H_zz (m_z² = m_z); the rest, ½ Σ_{z≠z'} H_zz' δ_z δ_z', is interaction between the dropped
    examples, which no additive score ranks. The best additive predictions measured here, on the protocol's M = 50
    sets of ``fraction``:

    - ``leave one out``: n replays, each dropping one example: Δ_z = −g_z + ½ H_zz + …, ranked as Σ_{z∈D} Δ_z;
    - ``mean rule + diagonal``: the mean rule plus ½(1 − 2f) H_zz with ½ H_zz = Δ_z + g_z from those replays;
    - ``linear datamodel``: ridge regression of the replayed changes of ``sets`` other random drop sets of the same
      size on their masks (Ilyas et al.'s datamodels, fitted on the replay itself), penalty chosen on a held-out
      fifth; fitted on a quarter, half and all of them, to show whether more sets would still help;
    - ``mean rule + datamodel of its residual``: the same regression on what the mean rule leaves.

    Writes results/fidelity/replay_<task>_additive<f>.md and .json; replays cached beside the protocol's.
    """
    torch.set_num_threads(1)
    record = record_task(task)
    test = task.split.test
    n = len(task.split.pretrain[0])
    base = ik.unrolled.outputs(record, test)
    start = time.perf_counter()
    gradient = ik.unrolled.metagradients(record, test, per_test=True)[0].values.double()
    at = [torch.full((n,), mean_weight(fraction), dtype=torch.float64)] + [None] * (len(record) - 1)
    mean_rule = ik.unrolled.metagradients(record, test, per_test=True, at=at)[0].values.double()
    seconds = {"two metagradient passes (q per-test losses each)": time.perf_counter() - start}
    start = time.perf_counter()
    ik.unrolled.outputs(record, test, torch.ones(n, dtype=torch.float64))
    seconds["one replay (the replays are cached)"] = time.perf_counter() - start
    single = _replayed_changes(task, record, base, torch.eye(n, dtype=torch.float64), "loo", progress)
    gen = torch.Generator().manual_seed(SUBSET_SEED + 12345)
    size = max(1, int(fraction * n))
    masks = torch.zeros(sets, n, dtype=torch.float64)
    for j in range(sets):
        masks[j, torch.randperm(n, generator=gen)[:size]] = 1
    changes = _replayed_changes(task, record, base, masks, f"datamodel{fraction:g}", progress).numpy()

    dropped = (~drop_sets(n, fraction, 50)).double()
    actual = (replayed_outputs(task, record, ~dropped.bool(), fraction, progress) - base).numpy()
    m = dropped.numpy()
    half_diagonal = (single + gradient).numpy()  # Δ_z = −g_z + ½ H_zz
    rows = {"exact metagradient at w = 1": -(m @ gradient.numpy()),
            "mean rule (w = 1 − f)": -(m @ mean_rule.numpy()),
            "leave one out, summed": m @ single.numpy(),
            "mean rule + diagonal ½(1 − 2f)H_zz": -(m @ mean_rule.numpy()) + (1 - 2 * fraction) * (m @ half_diagonal)}
    X = masks.numpy()
    for count in (sets // 4, sets // 2, sets):
        rows[f"linear datamodel, {count} sets"] = m @ _ridge(X[:count], changes[:count])
    residual = changes + X @ mean_rule.numpy()
    rows[f"mean rule + datamodel of its residual, {sets} sets"] = -(m @ mean_rule.numpy()) + m @ _ridge(X, residual)
    table = {}
    for name, prediction in rows.items():
        per_test = _spearman_per_test(prediction, actual)
        per_test = per_test[np.isfinite(per_test)]
        table[name] = (float(per_test.mean()), float(per_test.std(ddof=1) / np.sqrt(per_test.size)))
    facts = {"task": task.config.name, "fraction": fraction, "dropped per set": size, "n": n, "q": len(test[0]),
             "M (protocol sets ranked)": 50, "seconds": {k: round(v, 2) for k, v in seconds.items()},
             "load average": ", ".join(f"{v:.1f}" for v in os.getloadavg())}
    lines = [f"### {task.config.name}: the best additive ranking of {fraction:g} drops on the replay protocol", "",
             "| prediction of each drop set's change | LDS ± sem |", "|---|---|"]
    lines += [f"| {name} | {mean:.3f} ± {sem:.3f} |" for name, (mean, sem) in table.items()]
    lines += ["", inspect.cleandoc(additive_ceiling.__doc__).split("\n\n")[1], "", json.dumps(facts)]
    stem = f"replay_{task.config.name}_additive{fraction:g}"
    (results / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (results / f"{stem}.json").write_text(json.dumps({"table": table, "facts": facts}, indent=1) + "\n")
    print("\n".join(lines), flush=True)
    return {"table": table, "facts": facts}


def _replayed_changes(task: Task, record: Record, base: torch.Tensor, masks: torch.Tensor, name: str,
                      progress: bool, chunk: int = 500) -> torch.Tensor:
    """(len(masks), q) change of the test losses when the record is replayed with weights 1 − mask, cached per
    ``chunk`` masks (a longer run reuses a shorter one's)."""
    directory = task.directory / "replay"
    directory.mkdir(parents=True, exist_ok=True)
    parts = []
    for start in range(0, len(masks), chunk):
        block = masks[start:start + chunk]
        path = directory / f"{name}_{start}-{start + len(block)}_{settings_digest(task)}.safetensors"
        if not path.exists():
            rows = [ik.unrolled.outputs(record, task.split.test, 1 - mask) - base
                    for mask in tqdm(block, desc=f"{task.config.name} {name} {start}", disable=not progress,
                                     mininterval=30)]
            save_file({"changes": torch.stack(rows).contiguous()}, str(path))
        parts.append(load_file(path)["changes"])
    return torch.cat(parts)


def _ridge(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """(n, q) ridge coefficients of Y on X (both centred), the penalty of ADDITIVE_RIDGE whose fit on four fifths
    ranks the held-out fifth best (mean Spearman over columns)."""
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    fit = lambda rows, alpha: np.linalg.solve(  # noqa: E731
        Xc[rows].T @ Xc[rows] + alpha * np.eye(X.shape[1]), Xc[rows].T @ Yc[rows])
    cut = len(X) * 4 // 5
    best = max(ADDITIVE_RIDGE, key=lambda alpha: _mean_spearman(Xc[cut:] @ fit(slice(0, cut), alpha), Yc[cut:]))
    return fit(slice(None), best)
