"""influkit on several processes (torch.distributed, gloo) and streamed scoring at m = 10⁶, and the measured
per-example costs of the multi-stage paper's CIFAR-10 CNN from which benchmarks/README.md projects GPU runs.

Parts (every process runs single-threaded, like the other benchmarks):

``scaling``  A Case 1 chain on real Fashion-MNIST (Debian's ``dataset-fashion-mnist``; synthetic images if it
             is not installed): pretraining a 784→128→64 tanh MLP embedding with a 5-class head on 6,000
             images of classes 0–4 (p = 109,061), finetuning a new head on 2,000 images of classes 5–9 with the
             embedding fixed, 100 test images. Both stages are trained briefly with Adam in the parent, the
             weights written to a temporary directory, and the same job (``Chain.fit`` with a K-FAC
             preconditioner on the pretraining stage, ``Chain.query`` with MINRES at a fixed number of
             iterations, ``Query.scores(out=DIR)`` of all pretraining images) is run in one process and under
             ``torchrun --standalone --nproc_per_node=2``. ``influkit.distributed``'s collectives are wrapped
             to time them and count their bytes; a separate microbenchmark times one pretraining HVP and a bare
             all-reduce of its size.
``rss``      Peak RSS of ``query.scores(out=DIR, chunk_size=2048)`` over m synthetic pretraining examples
             generated from their index by a map-style Dataset (never materialized), m up to 10⁶, each m in a
             fresh process (peak total RSS from ``ru_maxrss``; anonymous and file-backed parts, RssAnon and
             RssFile of /proc/self/status, sampled every 10 ms while scoring).
``cifar``    The multi-stage paper's CIFAR-10 CNN (Table A; p = 904,790 pretraining, 781,508 finetuned head):
             forward FLOPs per image, and on this CPU the seconds per example of a forward pass, a pretraining
             HVP (streamed and graph-cached), a Case 1 finetuning HVP over the head, and a per-example gradient.
             The projection (GPU speed from these FLOP counts, NCCL ring all-reduce) is printed at the end.

    python -m benchmarks.bench_distributed                   # all parts, ~15 min on the 2-core machine
    python -m benchmarks.bench_distributed --quick           # ~3 min
    python -m benchmarks.bench_distributed --part rss --m 10000 1000000 [--rss-without-trim]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent
FASHION = Path("/usr/share/datasets/fashion-mnist")


# --------------------------------------------------------------------------------------------- shared pieces
def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def l2(weight: float):
    return lambda params: 0.5 * weight * sum((t**2).sum() for t in params.values())


class Classifier(nn.Module):
    """``head(embedding(x))``; the embedding is the block shared by the two stages."""

    def __init__(self, embedding: nn.Module, head: nn.Module):
        super().__init__()
        self.embedding, self.head = embedding, head

    def forward(self, x):
        return self.head(self.embedding(x))


def mlp(classes: int, widths=(784, 128, 64)) -> Classifier:
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return Classifier(nn.Sequential(*layers), nn.Linear(widths[-1], classes))


def single_thread() -> None:
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class StatusPeaks:
    """Peak RssAnon / RssFile (/proc/self/status, MB) sampled every ``interval`` seconds by a daemon thread."""

    def __init__(self, interval: float = 0.01):
        import threading

        self.peaks = {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _sample(self) -> None:
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                key = line.split(":")[0]
                if key in self.peaks:
                    self.peaks[key] = max(self.peaks[key], int(line.split()[1]) / 1024)
        except OSError:
            self.peaks = {k: float("nan") for k in self.peaks}

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(interval)

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def current_rss_mb() -> float:
    """The resident set now (VmRSS of /proc/self/status; NaN where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def fashion_mnist() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(train images (60000, 784) in [0, 1], labels, test images, labels) from the Debian package, or None."""
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        return None

    def read(name: str, offset: int) -> np.ndarray:
        with gzip.open(FASHION / name) as f:
            return np.frombuffer(f.read(), np.uint8, offset=offset)

    def images(name):
        return torch.tensor(read(name, 16).reshape(-1, 784), dtype=torch.float32) / 255.0

    def labels(name):
        return torch.tensor(read(name, 8), dtype=torch.long)

    return (images("train-images-idx3-ubyte.gz"), labels("train-labels-idx1-ubyte.gz"),
            images("t10k-images-idx3-ubyte.gz"), labels("t10k-labels-idx1-ubyte.gz"))


# --------------------------------------------------------------------------------------------- collectives
class CollectiveMeter:
    """Wraps ``influkit.distributed``'s collectives (influkit calls them as module attributes): per kind, the
    number of calls, the payload bytes (numel · itemsize of the tensor handed to it) and the seconds inside."""

    KINDS = ("all_reduce_", "gather_rows", "barrier", "broadcast_object")

    def __init__(self):
        from influkit import distributed

        self.stats = {k: {"calls": 0, "bytes": 0, "seconds": 0.0} for k in self.KINDS}
        for kind in self.KINDS:
            setattr(distributed, kind, self._wrap(kind, getattr(distributed, kind)))

    def _wrap(self, kind, fn):
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            entry = self.stats[kind]
            entry["seconds"] += time.perf_counter() - start
            entry["calls"] += 1
            if args and torch.is_tensor(args[0]):
                entry["bytes"] += args[0].numel() * args[0].element_size()
            return out

        return wrapped

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.stats))

    def since(self, before: dict) -> dict:
        return {k: {f: self.stats[k][f] - before[k][f] for f in self.stats[k]} for k in self.KINDS}


def sync() -> None:
    """A barrier outside the meter (phase boundaries), so every rank starts a phase together."""
    import torch.distributed as dist

    from influkit import distributed

    if distributed.active():
        dist.barrier()


# --------------------------------------------------------------------------------------------- part: scaling
def scaling_data(workdir: Path, n_pre: int, n_fin: int, n_test: int, log) -> str:
    """Write the data and the briefly trained weights of the scaling job to ``workdir``; returns the data source."""
    from safetensors.torch import save_file

    import influkit as ik
    from influkit.training import train_adam

    loaded = fashion_mnist()
    if loaded is not None:
        x, y, tx, ty = loaded
        source = "Fashion-MNIST (real images, dataset-fashion-mnist)"
    else:  # the package is optional: same shapes, synthetic class-dependent images
        gen = torch.Generator().manual_seed(0)
        centres = torch.rand(10, 784, generator=gen)
        y = torch.randint(0, 10, (70000,), generator=gen)
        x = (centres[y] + 0.3 * torch.randn(70000, 784, generator=gen)).clamp(0, 1)
        x, y, tx, ty = x[:60000], y[:60000], x[60000:], y[60000:]
        source = "synthetic 28×28 images (apt-get install dataset-fashion-mnist for the real ones)"
    pre_mask, fin_mask = y < 5, y >= 5
    px, py = x[pre_mask][:n_pre], y[pre_mask][:n_pre]
    fx, fy = x[fin_mask][:n_fin], y[fin_mask][:n_fin] - 5
    test_mask = ty >= 5
    tx, ty = tx[test_mask][:n_test], ty[test_mask][:n_test] - 5
    torch.manual_seed(0)
    pre_model, fin_model = mlp(5).eval(), mlp(5).eval()
    start = time.perf_counter()
    pre = ik.Stage(pre_model, ce, (px, py), regularizer=l2(1e-4))
    train_adam(pre, steps=300, lr=2e-3, batch_size=128, seed=0)
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    fin = ik.Stage(fin_model, ce, (fx, fy), params="head", regularizer=l2(1e-4))
    train_adam(fin, steps=300, lr=5e-3, batch_size=128, seed=1)
    with torch.no_grad():
        acc = float((fin_model(tx).argmax(1) == ty).float().mean())
    log(f"[scaling] data: {source}; trained in {time.perf_counter() - start:.1f} s (Adam, 300 steps per stage), "
        f"finetuned test accuracy {acc:.3f}")
    save_file({"px": px, "py": py, "fx": fx, "fy": fy, "tx": tx, "ty": ty}, str(workdir / "data.safetensors"))
    save_file({f"pre.{k}": v.contiguous() for k, v in pre_model.state_dict().items()}
              | {f"fin.{k}": v.contiguous() for k, v in fin_model.state_dict().items()}, str(workdir / "weights.safetensors"))
    return source


def scaling_worker(workdir: Path, iterations: int, chunk_size: int, hvp_repeats: int) -> None:
    """One rank of the scaling job (or the only process); writes ``r{world}_rank{rank}.json`` to ``workdir``."""
    single_thread()
    warnings.simplefilter("ignore")
    from safetensors.torch import load_file

    import influkit as ik
    from influkit import distributed

    distributed.initialize(timeout_seconds=900)
    rank, world = distributed.rank(), distributed.world_size()
    meter = CollectiveMeter()
    data, weights = load_file(str(workdir / "data.safetensors")), load_file(str(workdir / "weights.safetensors"))
    pre_model, fin_model = mlp(5).eval(), mlp(5).eval()
    pre_model.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("pre.")})
    fin_model.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("fin.")})
    pre = ik.Stage(pre_model, ce, (data["px"], data["py"]), regularizer=l2(1e-4), batch_size=1024)
    fin = ik.Stage(fin_model, ce, (data["fx"], data["fy"]), params="head", regularizer=l2(1e-4), batch_size=1024)
    solve = [ik.SolveConfig(solver="minres", tol=0.0, max_iter=iterations, damping=1e-3, preconditioner="kfac"),
             ik.SolveConfig(solver="minres", tol=0.0, max_iter=iterations, damping=1e-3)]
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=1)], solve=solve)
    out = workdir / f"scores{world}"
    if rank == 0 and out.exists():
        shutil.rmtree(out)
    phases = {}

    def phase(name, fn):
        sync()
        before, cpu, start = meter.snapshot(), time.process_time(), time.perf_counter()
        value = fn()
        wall = time.perf_counter() - start
        phases[name] = {"wall": wall, "cpu": time.process_time() - cpu, "collectives": meter.since(before)}
        return value

    phase("fit", chain.fit)
    query = phase("query", lambda: chain.query((data["tx"], data["ty"])))
    result = phase("scores", lambda: query.scores(chunk_size=chunk_size, out=out))

    # one pretraining HVP at a time: compute vs all-reduce, calls and bytes per product
    op = chain.operator(0)
    v = torch.randn(op.dim, generator=torch.Generator().manual_seed(0), dtype=op.dtype)
    hvps = []
    for _ in range(hvp_repeats):
        sync()
        before, start = meter.snapshot(), time.perf_counter()
        op.matvec(v)
        hvps.append({"wall": time.perf_counter() - start, "collectives": meter.since(before)})
    # a bare all-reduce of one HVP's payload after a barrier: the transport's own cost, without waiting
    bare = []
    buffer = torch.zeros(op.dim, dtype=op.dtype)
    for _ in range(20):
        sync()
        start = time.perf_counter()
        distributed.all_reduce_(buffer)
        bare.append(time.perf_counter() - start)
    report = {
        "rank": rank, "world": world, "p_pretrain": op.dim, "p_finetune": chain.operator(1).dim,
        "n_pretrain": len(pre), "n_finetune": len(fin), "hvp_path": "graph" if op._use_graph else "streamed",
        "finetune_hvp_path": "graph" if chain.operator(1)._use_graph else "streamed",
        "phases": phases, "solves": query.solves, "hvps": hvps, "bare_all_reduce_s": float(np.median(bare)),
        "chunks": result.diagnostics["chunks"], "peak_rss_mb": peak_rss_mb(), "load_average": os.getloadavg()[0],
        "pretrain_param_tensors": len(chain.plans[0].trained),
    }
    (workdir / f"r{world}_rank{rank}.json").write_text(json.dumps(report, indent=1))
    distributed.shutdown()


def run_scaling(args, log) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    try:
        scaling_data(workdir, args.n_pre, args.n_fin, 100, log)
        worker = [str(Path(__file__).resolve()), "--worker", "scaling", "--workdir", str(workdir),
                  "--iterations", str(args.iterations), "--chunk-size", str(args.chunk_size),
                  "--hvp-repeats", str(args.hvp_repeats)]
        env = os.environ | {"OMP_NUM_THREADS": "1"}
        env.pop("WORLD_SIZE", None)
        torchrun = str(Path(sys.executable).parent / "torchrun")
        launches = {1: [sys.executable, *worker], 2: [torchrun, "--standalone", "--nproc_per_node=2", *worker]}
        reports, launch_wall = {}, {}
        for world, command in launches.items():
            start = time.perf_counter()
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            launch_wall[world] = time.perf_counter() - start
            if proc.returncode != 0:
                raise RuntimeError(f"{world}-process run failed:\n{proc.stderr[-3000:]}")
            reports[world] = [json.loads((workdir / f"r{world}_rank{r}.json").read_text()) for r in range(world)]
            log(f"[scaling] {world} process(es): {launch_wall[world]:.1f} s from launch to exit, load average "
                f"{reports[world][0]['load_average']:.1f} at the end")
        one = np.load(workdir / "scores1" / "values.npy")
        two = np.load(workdir / "scores2" / "values.npy")
        agreement = float(np.abs(one - two).max() / np.abs(one).max())
        scaling_report(reports, launch_wall, agreement, args, log)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def scaling_report(reports: dict, launch_wall: dict, agreement: float, args, log) -> None:
    first = reports[1][0]
    p, n = first["p_pretrain"], first["n_pretrain"]
    log(f"\n## 1 vs 2 processes — Case 1 chain, pretraining p = {p:,} on n = {n:,} images, finetuned head "
        f"p = {first['p_finetune']:,} on {first['n_finetune']:,}; MINRES {args.iterations} iterations per solve "
        f"(tol 0: fixed work), K-FAC-preconditioned on the pretraining stage; float32; one thread per process")
    rows = []
    for name in ("fit", "query", "scores"):
        one = first["phases"][name]
        twos = [r["phases"][name] for r in reports[2]]
        wall2 = max(t["wall"] for t in twos)
        cpu2 = [t["cpu"] for t in twos]
        coll = [sum(t["collectives"][k]["seconds"] for k in CollectiveMeter.KINDS) for t in twos]
        split = one["cpu"] / max(cpu2)
        share = max(coll) / wall2
        if split < 1.25:
            bound = "duplicated work (not sharded)"
        elif share > 0.25:
            bound = "collectives"
        elif min(t["cpu"] / t["wall"] for t in twos) < 0.75:
            bound = "compute, CPU shared with other jobs"
        else:
            bound = "compute"
        rows.append({
            "phase": name, "1 proc s": one["wall"], "2 procs s": wall2, "speed-up": one["wall"] / wall2,
            "1 proc CPU s": one["cpu"], "2 procs CPU s (rank 0/1)": "/".join(f"{c:.2f}" for c in cpu2),
            "work split": split, "in collectives s (rank 0/1)": "/".join(f"{c:.2f}" for c in coll),
            "collective share": share,
            "cpu/wall (1 proc; rank 0/1)": f"{one['cpu'] / one['wall']:.2f}; "
                                           + "/".join(f"{t['cpu'] / t['wall']:.2f}" for t in twos),
            "all-reduce calls": twos[0]["collectives"]["all_reduce_"]["calls"],
            "all-reduce MB": twos[0]["collectives"]["all_reduce_"]["bytes"] / 1e6,
            "bound": bound,
        })
    frame = pd.DataFrame(rows)
    log(frame.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    log("work split = 1-process CPU seconds / the larger rank's CPU seconds (2 = the work is halved); "
        "collective share = the larger rank's seconds inside influkit.distributed's collectives (waiting for the "
        "other rank included) / the phase's wall time; cpu/wall < 1: the process waited (for the other rank, or "
        "for a core held by other jobs on this shared machine).")
    total1 = sum(first["phases"][k]["wall"] for k in ("fit", "query", "scores"))
    total2 = max(sum(r["phases"][k]["wall"] for k in ("fit", "query", "scores")) for r in reports[2])
    cpu1 = sum(first["phases"][k]["cpu"] for k in ("fit", "query", "scores"))
    cpu2 = max(sum(r["phases"][k]["cpu"] for k in ("fit", "query", "scores")) for r in reports[2])
    log(f"fit + query + scores: wall 1 proc {total1:.1f} s, 2 procs {total2:.1f} s, speed-up {total1 / total2:.2f}; "
        f"CPU {cpu1:.1f} s vs {cpu2:.1f} s per rank (work split {cpu1 / cpu2:.2f}); launch to exit (imports, process "
        f"group, data): {launch_wall[1]:.1f} s vs {launch_wall[2]:.1f} s")
    for world in (1, 2):
        solves = reports[world][0]["solves"]
        log(f"{world} proc: " + "; ".join(f"stage {s['stage']} {s['solver']} {s['iterations']} it, {s['products']} HVPs, "
                                          f"{s['seconds']:.2f} s" for s in solves)
            + "; peak RSS per rank " + ", ".join(f"{r['peak_rss_mb']:.0f}" for r in reports[world])
            + f" MB; pretraining HVP path: {reports[world][0]['hvp_path']} over "
            f"{math.ceil(first['n_pretrain'] / world):,} examples per rank")
    if reports[1][0]["hvp_path"] != reports[2][0]["hvp_path"]:
        log("NOTE: the two runs take different HVP paths (graph-cached when a rank holds ≤ 2,048 examples): "
            "per-example costs differ, compare with care.")
    log(f"scores of 2 processes vs 1: max |difference| / max |score| = {agreement:.1e} (float32, summation order)")

    # one pretraining HVP: compute vs all-reduce
    log("\n## one pretraining Hessian-vector product (median of repeats)")
    rows = []
    for world in (1, 2):
        for r in reports[world]:
            hvps = r["hvps"]
            wall = float(np.median([h["wall"] for h in hvps]))
            reduce = float(np.median([h["collectives"]["all_reduce_"]["seconds"] for h in hvps]))
            calls = hvps[0]["collectives"]["all_reduce_"]["calls"]
            payload = hvps[0]["collectives"]["all_reduce_"]["bytes"]
            rows.append({"processes": world, "rank": r["rank"], "HVP s": wall, "inside all_reduce s": reduce,
                         "compute s": wall - reduce, "all_reduce calls": calls, "payload bytes": payload,
                         "sent per rank (ring) bytes": 2 * (world - 1) / world * payload,
                         "bare all-reduce of p floats s": r["bare_all_reduce_s"] if world > 1 else float("nan")})
    log(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    payload = rows[-1]["payload bytes"]
    itemsize = 4
    log(f"bytes per solve iteration (one HVP, k = 1 right-hand side): payload p·k·itemsize = {p:,}·1·{itemsize} = "
        f"{p * itemsize:,} B (measured {payload:,} B in {rows[-1]['all_reduce calls']} all-reduce call(s): the "
        f"streamed HVP reduces each of the {first['pretrain_param_tensors']} parameter tensors separately, the "
        "graph-cached one the flat vector at once); a ring all-reduce "
        f"sends and receives 2(R−1)/R of it per rank: {payload:,} B each way at R = 2. MINRES' own vector updates are "
        "rank-local (every rank holds the same iterate), so nothing else is communicated per iteration.")
    hvp1 = float(np.median([h["wall"] for h in reports[1][0]["hvps"]]))
    hvp2 = max(float(np.median([h["wall"] for h in r["hvps"]])) for r in reports[2])
    bare = max(r["bare_all_reduce_s"] for r in reports[2])
    log(f"per HVP: 1 proc {hvp1 * 1e3:.1f} ms, 2 procs {hvp2 * 1e3:.1f} ms (speed-up {hvp1 / hvp2:.2f}); a bare gloo "
        f"all-reduce of {payload / 1e3:.0f} kB costs {bare * 1e3:.2f} ms ({payload / bare / 1e9:.2f} GB/s): "
        f"{bare / hvp2:.1%} of a 2-process HVP.")


# --------------------------------------------------------------------------------------------- part: rss
class SyntheticExamples(Dataset):
    """m examples generated from their index alone (nothing is stored): label = a multiplicative hash of i mod
    ``classes``, input = the label's centre + hash noise frac(sin(i·f + φ)·43758.55) − 0.5 per coordinate."""

    def __init__(self, m: int, dim: int = 32, classes: int = 8, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.m, self.classes, self.seed = m, classes, seed
        self.centres = torch.randn(classes, dim, generator=gen)
        self.freq = 1.0 + torch.rand(dim, generator=gen, dtype=torch.float64)
        self.phase = 100.0 * torch.rand(dim, generator=gen, dtype=torch.float64)

    def __len__(self) -> int:
        return self.m

    def __getitem__(self, i: int):
        if not 0 <= i < self.m:
            raise IndexError(i)
        label = ((i * 2654435761 + self.seed * 97) % 2**32) % self.classes
        noise = torch.frac(torch.sin(i * self.freq + self.phase) * 43758.5453) - 0.5
        return self.centres[label] + noise.float(), torch.tensor(label)


def rss_worker(m: int, chunk_size: int, out: Path, trim: bool = True) -> dict:
    """Score m streamed synthetic examples into ``out``; peak RSS before and after (a fresh process per m).

    trim=False switches off influkit.scoring's return of freed heap pages (every TRIM_EVERY chunks; for comparison).
    """
    single_thread()
    warnings.simplefilter("ignore")
    import influkit as ik
    import influkit.scoring

    if not trim:
        influkit.scoring._MALLOC_TRIM = None

    torch.manual_seed(0)
    pre_model = mlp(8, (32, 64)).eval()
    fin_model = mlp(4, (32, 64)).eval()
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    pre = ik.Stage(pre_model, ce, SyntheticExamples(m), regularizer=l2(1e-3), batch_size=1024)
    finetune = SyntheticExamples(2000, classes=4, seed=1)
    fin = ik.Stage(fin_model, ce, finetune, params="head", regularizer=l2(1e-3), batch_size=1024)
    solve = ik.SolveConfig(solver="minres", damping=1e-3, tol=1e-6, max_iter=200)
    curvature = [ik.CurvatureConfig(hessian_samples=1000), ik.CurvatureConfig()]
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=1)], solve=solve, curvature=curvature)
    query = chain.query(fin.data.take(torch.arange(100)))
    base = peak_rss_mb()
    start, cpu = time.perf_counter(), time.process_time()
    with StatusPeaks() as status:
        result = query.scores(chunk_size=chunk_size, out=out)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert result.values.shape == (m,) and np.isfinite(float(result.values[-1]))
    return {"m": m, "p": chain.dims[0], "chunks": result.diagnostics["chunks"]["computed"], "seconds": seconds,
            "CPU s": cpu, "examples/s": m / seconds, "examples/CPU s": m / cpu, "RSS before scoring MB": base,
            "peak RSS MB": peak_rss_mb(), "growth MB": peak_rss_mb() - base, "peak anon MB": status.peaks["RssAnon"],
            "peak file MB": status.peaks["RssFile"], "RSS after MB": current_rss_mb()}


def run_rss(args, log) -> None:
    log(f"\n## peak RSS of streamed scoring vs m (Case 1 chain, 32→64 tanh embedding, 8-class pretraining head: p = 2,632; "
        f"pretraining Hessian on 1,000 sampled examples, MINRES to 1e-6; scores(out=DIR, chunk_size={args.rss_chunk}); "
        "examples generated per index by a map-style Dataset; one fresh process per m)")
    def measure(trim: bool) -> pd.DataFrame:
        rows = []
        for m in args.m:
            out = Path(tempfile.mkdtemp(prefix="bench_distributed_rss_"))
            try:
                proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "rss", "--m", str(m),
                                       "--rss-chunk", str(args.rss_chunk), "--workdir", str(out / "scores")]
                                      + ([] if trim else ["--no-trim"]),
                                      capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr[-3000:])
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]) | {"load": os.getloadavg()[0]})
            finally:
                shutil.rmtree(out, ignore_errors=True)
            log(f"  m = {m:,}: {rows[-1]['seconds']:.1f} s, peak RSS {rows[-1]['peak RSS MB']:.0f} MB "
                f"(anonymous {rows[-1]['peak anon MB']:.0f}, file-backed {rows[-1]['peak file MB']:.0f})")
        frame = pd.DataFrame(rows)
        log(frame.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        return frame

    if args.rss_without_trim:
        log("### for comparison: freed heap pages never returned (influkit.scoring._MALLOC_TRIM = None)")
        before = measure(trim=False)
        slope = np.polyfit(before["m"], before["peak anon MB"] * 2**20, 1)[0]
        log(f"without the trim, peak anonymous RSS grows by {slope:.1f} bytes per example (least squares over m)")
        log("### influkit as shipped (freed heap pages returned every influkit.scoring.TRIM_EVERY chunks and after the last)")
    frame = measure(trim=True)
    if len(frame) > 1:
        slopes = {col: np.polyfit(frame["m"], frame[col] * 2**20, 1)[0] for col in ("peak RSS MB", "peak anon MB", "peak file MB")}
        log(f"peak RSS grows by {slopes['peak RSS MB']:.1f} bytes per example (least squares over m; anonymous "
            f"{slopes['peak anon MB']:.1f}, file-backed {slopes['peak file MB']:.1f}); from m = {frame['m'].iloc[0]:,} to "
            f"{frame['m'].iloc[-1]:,} it changes by {frame['peak RSS MB'].iloc[-1] - frame['peak RSS MB'].iloc[0]:+.1f} MB "
            f"(RSS after scoring: {frame['RSS after MB'].iloc[0]:.0f} → {frame['RSS after MB'].iloc[-1]:.0f} MB). What is "
            "O(m) is held on disk: chunks, then values.npy/index.npy appended with plain writes and memory-mapped only "
            "for the result (pages resident when read); the row ids of all examples are ranges, hashed in 2²⁰-row "
            "pieces, never an O(m) array. The peak above the baseline is one chunk's buffers (chunk_size · p gradient "
            "floats); influkit.scoring returns freed heap pages every TRIM_EVERY chunks (glibc malloc_trim) — compare the "
            "table without it (--rss-without-trim), where the fragmented heap grows by tens of MB with m.")


# --------------------------------------------------------------------------------------------- part: cifar
def cifar_cnn(classes: int) -> Classifier:
    """The multi-stage paper's CIFAR-10 model (Table A): CONV 32 3×3 → CONV 64 4×4 → MAX-POOL 2×2 → CONV 128 2×2 →
    MAX-POOL → CONV 128 2×2 → MAX-POOL (the embedding; no padding assumed: 32→30→27→13→12→6→5→2, 512 features),
    then FC 1500 → FC ``classes``; tanh everywhere except the output."""
    embedding = nn.Sequential(
        nn.Conv2d(3, 32, 3), nn.Tanh(), nn.Conv2d(32, 64, 4), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 2), nn.Tanh(), nn.MaxPool2d(2), nn.Conv2d(128, 128, 2), nn.Tanh(), nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return Classifier(embedding, nn.Sequential(nn.Linear(512, 1500), nn.Tanh(), nn.Linear(1500, classes)))


def forward_flops(model: nn.Module, x: torch.Tensor) -> float:
    """FLOPs (2 per multiply-add) of one forward pass per example, counted on the Conv2d and Linear layers."""
    macs = []

    def hook(module, inputs, output):
        per_output = module.in_channels // module.groups * math.prod(module.kernel_size) if isinstance(module, nn.Conv2d) \
            else module.in_features
        macs.append(output[0].numel() * per_output)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x[:1])
    for h in handles:
        h.remove()
    return 2.0 * sum(macs)


def per_example_seconds(fn, sizes: tuple[int, int], repeat: int) -> tuple[float, float]:
    """(seconds per example, seconds per call) from the best-of-``repeat`` times at two batch sizes (a line),
    after one untimed call per size. Times are this process's CPU seconds (``time.process_time``; one thread):
    on a shared machine the wall clock also counts the time other processes hold the core."""
    times = []
    for b in sizes:
        fn(b)
        best = float("inf")
        for _ in range(repeat):
            start = time.process_time()
            fn(b)
            best = min(best, time.process_time() - start)
        times.append(best)
    slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
    return slope, max(times[0] - slope * sizes[0], 0.0)


def run_cifar(args, log) -> dict:
    import influkit as ik
    from influkit.curvature import HessianOperator, ProductSettings, hvp
    from influkit.gradients import project_per_example_grads

    single_thread()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    sizes = (args.cifar_batch // 4, args.cifar_batch)
    n = sizes[1]
    gen = torch.Generator().manual_seed(0)
    x, y2, y8 = torch.randn(n, 3, 32, 32, generator=gen), torch.randint(0, 2, (n,), generator=gen), torch.randint(0, 8, (n,), generator=gen)
    pre_model, fin_model = cifar_cnn(2).eval(), cifar_cnn(8).eval()
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    pre = ik.Stage(pre_model, ce, (x, y2), batch_size=n)
    fin = ik.Stage(fin_model, ce, (x, y8), params="head", batch_size=n)
    flops = forward_flops(pre_model, x)
    p_pre, p_head = pre.num_trained, fin.num_trained
    p_embedding = sum(t.numel() for t in pre_model.embedding.parameters())
    log(f"\n## the multi-stage paper's CIFAR-10 CNN on this CPU (float32, 1 thread, random 3×32×32 inputs; per-example "
        f"cost = CPU-time slope between batches of {sizes[0]} and {sizes[1]}, best of {args.repeat})")
    log(f"p: embedding {p_embedding:,}, pretraining model (2 classes) {p_pre:,}, finetuned head (8 classes) {p_head:,}; "
        f"forward {flops / 1e6:.1f} MFLOP per image")

    def forward(b):
        with torch.no_grad():
            pre_model(x[:b])

    def streamed(stage, names):
        def run(b):
            tangents = {k: torch.randn_like(v) for k, v in stage.state().items() if k in names}
            hvp(stage, tangents, indices=torch.arange(b))
        return run

    def graph(stage, names):
        ops = {}

        def run(b):
            if b not in ops:  # build the graph once per size, outside the timing of later repeats
                ops[b] = HessianOperator(stage, names, product=ProductSettings(cache_graph=True), samples=b)
                ops[b].matvec(torch.randn(ops[b].dim))
            ops[b].matvec(torch.randn(ops[b].dim))
        return run

    def example_grads(b):
        project_per_example_grads(pre, x[:b], y2[:b], torch.randn(p_pre, 1), chunk_size=b)

    head = fin.param_names
    measured = {}
    for name, fn in (("forward", forward), ("pretraining HVP, streamed", streamed(pre, pre.param_names)),
                     ("pretraining HVP, graph-cached", graph(pre, pre.param_names)),
                     ("finetuning HVP over the head (Case 1), streamed", streamed(fin, head)),
                     ("finetuning HVP over the head (Case 1), graph-cached", graph(fin, head)),
                     ("per-example gradient (scoring)", example_grads)):
        measured[name] = per_example_seconds(fn, sizes, args.repeat)
    cpu_flops = flops / measured["forward"][0]
    rows = [{"operation": k, "ms per example": v[0] * 1e3, "× forward": v[0] / measured["forward"][0],
             "ms per call (intercept)": v[1] * 1e3} for k, v in measured.items()]
    log(pd.DataFrame(rows).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    log(f"this CPU core runs the forward pass at {cpu_flops / 1e9:.1f} GFLOP/s")
    costs = {k: v[0] for k, v in measured.items()}
    projection(costs, cpu_flops, p_pre, p_head, log)
    return costs


# --------------------------------------------------------------------------------------------- projection
GPU = {"name": "V100 (the paper's GPU)", "peak_flops": 15.7e12, "efficiency": 0.4}
LINKS = {  # bandwidth per rank of the ring (bytes/s), latency per ring step (s)
    "intra-node NVLink (NCCL)": (100e9, 5e-6),
    "inter-node 100 Gb/s InfiniBand (NCCL)": (12.5e9, 10e-6),
}
GPU_CALL_OVERHEAD = 5e-3  # s per HVP batch / scoring chunk on a GPU: kernel launches of the double-backward graph, Python
GRAPH_LIMIT, BATCH = 2048, 1024  # influkit's rule: cache the gradient graph when a rank's examples ≤ max(batch_size, 2048)


def ring_seconds(payload: float, ranks: int, calls: int) -> float:
    """All-reduce time 2(R−1)/R · bytes / bandwidth + 2(R−1) · latency per call (ring; R ≤ 8 on NVLink, else IB)."""
    if ranks == 1:
        return 0.0
    bandwidth, latency = LINKS["intra-node NVLink (NCCL)" if ranks <= 8 else "inter-node 100 Gb/s InfiniBand (NCCL)"]
    return 2 * (ranks - 1) / ranks * payload / bandwidth + calls * 2 * (ranks - 1) * latency


def projection(costs: dict, cpu_flops: float, p_pre: int, p_head: int, log) -> None:
    """Wall time of the multi-stage paper's CIFAR-10 job on R GPUs, from the CPU costs scaled by FLOP throughput."""
    gpu_flops = GPU["peak_flops"] * GPU["efficiency"]
    speed = gpu_flops / cpu_flops

    def solve(n: int, ranks: int, iterations: int, hvps_per_iteration: int, kind: str, p: int, tensors: int) -> dict:
        local = math.ceil(n / ranks)
        path = "graph-cached" if local <= GRAPH_LIMIT else "streamed"
        compute = local * costs[f"{kind}, {path}"] / speed + (1 if path == "graph-cached" else math.ceil(local / BATCH)) * GPU_CALL_OVERHEAD
        comm = ring_seconds(4.0 * p, ranks, 1 if path == "graph-cached" else tensors)
        per = compute + comm
        return {"path": path, "compute": compute, "comm": comm, "total": per * iterations * hvps_per_iteration}

    def scoring(m: int, ranks: int) -> float:
        local = math.ceil(m / ranks)
        return local * costs["per-example gradient (scoring)"] / speed + math.ceil(local / 512) * GPU_CALL_OVERHEAD

    log(f"\n## projection for GPUs (a model, not a measurement): {GPU['name']} at {GPU['efficiency']:.0%} of its "
        f"{GPU['peak_flops'] / 1e12:.1f} TFLOP/s float32 peak = {gpu_flops / 1e12:.1f} TFLOP/s, i.e. {speed:.0f}× this "
        f"CPU core's measured forward throughput, applied to every measured per-example cost; {GPU_CALL_OVERHEAD * 1e3:.0f} ms "
        f"fixed per HVP batch and per scoring chunk; ring all-reduce 2(R−1)/R·bytes/B + 2(R−1)·α per call with "
        + "; ".join(f"{k}: B = {b / 1e9:.1f} GB/s, α = {a * 1e6:.0f} µs" for k, (b, a) in LINKS.items())
        + " (R ≤ 8: one node; R = 64: 8 nodes, the slower link bounds the ring); graph-cached HVPs when a rank holds "
        f"≤ {GRAPH_LIMIT} examples, else streamed in batches of {BATCH} (influkit's rule)")
    settings = {
        "brief: H over all 50,000 pretraining images, MINRES 200 + 200 it, score 50,000": dict(
            n_hessian=50_000, n_finetune=5_000, iterations=200, hvps=1, m=50_000),
        "paper's run: H on 1,000 sampled, CG on H² (2 HVPs/it) 200 + 200 it, score 10,000 (bird+frog)": dict(
            n_hessian=1_000, n_finetune=5_000, iterations=200, hvps=2, m=10_000),
    }
    rows = []
    for label, s in settings.items():
        for ranks in (1, 8, 64):
            fin = solve(s["n_finetune"], ranks, s["iterations"], s["hvps"], "finetuning HVP over the head (Case 1)", p_head, 4)
            pre = solve(s["n_hessian"], ranks, s["iterations"], s["hvps"], "pretraining HVP", p_pre, 12)
            score = scoring(s["m"], ranks)
            total = fin["total"] + pre["total"] + score
            rows.append({"setting": label[:60], "GPUs": ranks, "finetune solve s": fin["total"], "pretrain solve s": pre["total"],
                         "pretrain path": pre["path"], "pretrain it: compute ms": pre["compute"] * 1e3,
                         "pretrain it: all-reduce ms": pre["comm"] * 1e3, "scoring s": score, "total s": total})
    frame = pd.DataFrame(rows)
    log(frame.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    paper = frame[(frame["GPUs"] == 1) & frame["setting"].str.startswith("paper")]["total s"].iloc[0]
    log(f"calibration: the paper reports 230 s on one V100 for its run; this model gives {paper:.0f} s "
        f"(ratio {230 / paper:.2f}: the GPU-efficiency and overhead assumptions are within that factor).")


# --------------------------------------------------------------------------------------------- main
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("all", "scaling", "rss", "cifar"), default="all")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (~3 min)")
    parser.add_argument("--n-pre", type=int, default=6000, help="pretraining images of the scaling job")
    parser.add_argument("--n-fin", type=int, default=2000, help="finetuning images of the scaling job")
    parser.add_argument("--iterations", type=int, default=20, help="MINRES iterations per solve (fixed)")
    parser.add_argument("--chunk-size", type=int, default=256, help="scoring chunk of the scaling job")
    parser.add_argument("--hvp-repeats", type=int, default=5)
    parser.add_argument("--m", type=int, nargs="+", default=[10_000, 100_000, 300_000, 1_000_000])
    parser.add_argument("--rss-chunk", type=int, default=2048)
    parser.add_argument("--rss-without-trim", action="store_true",
                        help="rss part: also measure with influkit.scoring's malloc_trim switched off, for comparison")
    parser.add_argument("--no-trim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cifar-batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--worker", choices=("scaling", "rss"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "scaling":
        scaling_worker(args.workdir, args.iterations, args.chunk_size, args.hvp_repeats)
        return
    if args.worker == "rss":
        print(json.dumps(rss_worker(args.m[0], args.rss_chunk, args.workdir, trim=not args.no_trim)))
        return
    if args.quick:
        args.n_pre, args.n_fin, args.iterations, args.hvp_repeats = 5000, 1000, 8, 3
        args.m = [10_000, 100_000]
        args.cifar_batch, args.repeat = 32, 2
    from benchmarks.common import Tee, banner, setup

    setup(1)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    log = Tee()
    banner(log, "bench_distributed: 1 vs 2 processes, streamed scoring memory, CIFAR-10 CNN costs and GPU projection")
    log(f"# load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other engineers' jobs share them)")
    if args.part in ("all", "scaling"):
        run_scaling(args, log)
    if args.part in ("all", "rss"):
        run_rss(args, log)
    if args.part in ("all", "cifar"):
        run_cifar(args, log)
    name = "bench_distributed" + ("_quick" if args.quick else "") + ("" if args.part == "all" else f"_{args.part}")
    log(f"\nwrote benchmarks/results/bench_distributed/{name}.txt")
    log.save(name)


if __name__ == "__main__":
    main()
