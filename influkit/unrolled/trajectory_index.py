"""``TrajectoryIndex``: the pretraining side of first-order trajectory scores, computed once and stored per example,
so that a new finetune of the same pretrained run is answered by its own exact replay plus one pass over the index.

First order (:mod:`.firstorder`) carries an adjoint back through every recorded step's own optimizer Jacobian with
the data term's loss curvature dropped: a linear map. So for the indexed stages 0 … b − 1 of a record, the
first-order score of an example z of any of them, for the adjoint λ on stage b − 1's final values, is

    s_z(λ) = ⟨λ, v_z⟩,     v_z = the first-order d θ_final / d w_z   (θ_final: stage b − 1's final values),

and v_z depends neither on what follows (a finetune, a test set) nor on λ. The index stores e_z = C v_z (D numbers)
for a linear compression C (D × p) of the final values, one block per tensor: the identity (``dim=None``: exact,
D = p) or, with ``dim``, k_n rows for tensor n (``dim`` shared equally over the tensors, at most a tensor's size,
the dimension rule of :mod:`influkit.index.projections`), orthonormal over a uniformly random subspace and scaled by
√(p_n / k_n), so E[CᵀC] = I: ⟨C λ, e_z⟩ estimates s_z(λ) without bias, with variance at most
Σ_n (‖λ_n‖² ‖v_{z,n}‖² + ⟨λ_n, v_{z,n}⟩²) / k_n (the Johnson–Lindenstrauss property of Gaussian rows, which
orthonormal rows only lower; 0 on a tensor kept whole). Same sign as :func:`~.firstorder.first_order`:
score = d measure / d w_z, removing z predicts −score.

One stage without a regularizer or proximal term is built in one pass over its examples (:func:`example_rows`:
the first-order carry then acts coordinate by coordinate, so v_z is a sum of each fed example's gradient times
per-step weights from one reverse pass). Otherwise row c_j of C, taken as the adjoint on the final values, gives
⟨c_j, v_z⟩ for every example at once in one first-order pass (:func:`~.firstorder.carry`), so the D columns are D
adjoint sweeps, run ``block`` at a time (one pass carrying that many columns).

A query of a record whose first b stages are the indexed run (checked by fingerprint) and whose later stages are a
new finetune replays those stages exactly (:mod:`.metagradient`) down to the adjoint λ they hand to stage b − 1,
compresses it (C λ) and takes one product with the stored rows; a record of the indexed stages alone (a new test set on the pretrained model) needs only λ.

On disk (``directory``): ``index.safetensors`` (the settings, the indexed stages' fingerprints and sizes) and one
file per block of columns holding each stage's rows of it. A build or an append killed part-way resumes from the
finished block files; under ``torch.distributed`` rank r writes the blocks j ≡ r (mod R), computed by its sweeps
or, in one pass, from the rows its share of the steps gives, summed over the ranks.
:meth:`TrajectoryIndex.append` takes the record continued by later pretraining stages (new examples, new steps):
the new columns come from passes through the new stages alone, each handing stage b − 1 an adjoint μ_j, and the
old stages' rows are carried through them as ⟨C μ_j, e_z⟩ — for an exact index equal to a rebuild up to rounding,
for a compressed one a second estimate of the same kind.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import distributed, files
from ..chain import Measure
from ..errors import IndexMismatchError, InputError, ProjectionNoiseWarning
from ..index.projections import allot, random_projection
from ..results import InfluenceResult
from .boundary import measure_adjoint
from .firstorder import METHOD as FIRST_ORDER_METHOD
from .firstorder import carry, example_gradients, refuse_uncovered
from .journal import stage_fingerprint
from .metagradient import METHOD as EXACT_METHOD
from .metagradient import exact_down_to
from .record import Record
from .replay import deviation, start, unit_weights
from .run import StageRun
from .terms import holding
from .trajectory import moved_frozen

KIND, BLOCK_KIND, NORMS_KIND = "trajectory-index", "trajectory-index-block", "trajectory-index-norms"
MANIFEST, NORMS = "index.safetensors", "norms.safetensors"
NOISE_SHARE = 0.5
"""A compressed index warns (:class:`~influkit.errors.ProjectionNoiseWarning`) where the median of its scores' noise
bound exceeds this share of their median magnitude."""
FORMAT_VERSION = 1
METHOD = "unrolled first-order (trajectory index)"
FINETUNES = ("exact", "first-order")


class Compression:
    """The compression C of tensors named and shaped as ``shapes`` (module docstring): the identity (``dim`` None)
    or per tensor k_n scaled orthonormal random rows, drawn in order from ``seed``."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dim: int | None, seed: int, dtype: torch.dtype):
        self.shapes, self.dtype = shapes, dtype
        sizes = {n: math.prod(s) for n, s in shapes.items()}
        ks = [(sizes[n],) for n in shapes] if dim is None else allot([("flat", (sizes[n],)) for n in shapes], dim)
        generator = torch.Generator().manual_seed(seed)
        self.projections = {n: None if k[0] >= sizes[n] else random_projection(k[0], sizes[n], generator, dtype)
                            for n, k in zip(shapes, ks)}
        self.widths = {n: sizes[n] if p is None else p.shape[0] for n, p in self.projections.items()}

    @property
    def width(self) -> int:
        """D: numbers per example."""
        return sum(self.widths.values())

    def rows(self, start: int, stop: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Rows c_start … c_{stop−1} of C as tensors: {name: (stop − start, *shape)}."""
        count = stop - start
        out = {n: torch.zeros(count, *s, dtype=self.dtype) for n, s in self.shapes.items()}
        offset = 0
        for n, p in self.projections.items():
            lo, hi = max(start, offset), min(stop, offset + self.widths[n])
            if lo < hi:
                flat = out[n].view(count, -1)
                if p is None:
                    flat[torch.arange(lo - start, hi - start), torch.arange(lo - offset, hi - offset)] = 1.0
                else:
                    flat[lo - start:hi - start] = p[lo - offset:hi - offset]
            offset += self.widths[n]
        return {n: v.to(device) for n, v in out.items()}

    def apply(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """(q, D) C λ for λ given as {name: (q, *shape)} (a missing name counts as 0)."""
        q = next(iter(tensors.values())).shape[0]
        parts = []
        for n, p in self.projections.items():
            v = tensors[n].reshape(q, -1).to("cpu", self.dtype) if n in tensors else \
                torch.zeros(q, math.prod(self.shapes[n]), dtype=self.dtype)
            parts.append(v if p is None else v @ p.T)
        return torch.cat(parts, dim=1)


class TrajectoryIndex:
    """A trajectory index on disk in ``directory`` (make one with :meth:`build`, open one with the constructor)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not (self.directory / MANIFEST).is_file():
            raise InputError(f"{directory} holds no trajectory index; build one with "
                             "ik.unrolled.TrajectoryIndex.build(record, directory).")
        self.manifest = files.read(self.directory / MANIFEST, KIND)[1]
        self.blocks = {"computed": 0, "reused": 0}  # of the last build or append in this process
        self._compression: tuple[int, Compression] | None = None

    def __repr__(self) -> str:
        m = self.manifest
        return (f"TrajectoryIndex({self.directory}, stages {m['sizes']} examples, {self.width} numbers each, "
                f"{'exact' if m['dim'] is None else 'compressed'})")

    @property
    def width(self) -> int:
        """D: numbers stored per example."""
        return self.manifest["width"]

    @property
    def complete(self) -> bool:
        return bool(self.manifest["complete"])

    @property
    def bytes_per_example(self) -> int:
        return self.width * torch.empty(0, dtype=_dtype(self.manifest["dtype"])).element_size()

    @classmethod
    def build(cls, record: Record, directory: str | Path, *, stages: int | None = None, dim: int | None = None,
              seed: int = 0, block: int = 64, progress: bool = True) -> TrajectoryIndex:
        """The index of the first ``stages`` stages of ``record`` (default: all) in ``directory``: per example of
        each, e_z = C v_z (module docstring). dim: None (exact: D = the number of final values of the last indexed
        stage) or the numbers per example of a compressed index; seed: its random rows; block: columns per
        first-order sweep (memory: block × (parameters + optimizer state)) and per file. An unfinished build of the
        same record and settings in ``directory`` resumes; a directory holding another index is refused."""
        count = len(record) if stages is None else stages
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(record):
            raise InputError(f"stages must be a whole number in [1, {len(record)}] (how many leading stages of the "
                             f"record to index), got {stages!r}.")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise InputError(f"dim must be None (exact) or a whole number ≥ 1 of numbers per example, got {dim!r}.")
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise InputError(f"block must be a whole number ≥ 1 of columns per pass, got {block!r}.")
        indexed = record.branch(count)
        for run in indexed.runs:
            refuse_uncovered(run)
        final = indexed.runs[-1].final
        dtype = next(iter(final.values())).dtype
        compression = Compression({n: tuple(v.shape) for n, v in final.items()}, dim, seed, dtype)
        manifest = {"version": FORMAT_VERSION, "fingerprints": [stage_fingerprint(run) for run in indexed.runs],
                    "sizes": [len(run.stage) for run in indexed.runs], "names": list(final),
                    "shapes": [list(v.shape) for v in final.values()], "dtype": str(dtype).removeprefix("torch."),
                    "dim": dim, "seed": seed, "block": block, "width": compression.width, "generation": 0,
                    "complete": False}
        directory = Path(directory)
        if (directory / MANIFEST).is_file():
            old = files.read(directory / MANIFEST, KIND)[1]
            if _job(old) != _job(manifest):
                raise IndexMismatchError(f"{directory} holds a trajectory index of another record or other settings "
                                         f"({_differences(old, manifest)}); build into a new directory.")
            if old["complete"]:
                return cls(directory)
        distributed.barrier()
        if distributed.rank() == 0:
            directory.mkdir(parents=True, exist_ok=True)
            files.write(directory / MANIFEST, KIND, {}, manifest)
        distributed.barrier()
        device = next(iter(final.values())).device

        if by_examples(indexed):  # every column in one pass over the examples (each rank: its share of steps)
            rows, norms, error = example_rows(indexed.runs[0], compression, progress)
            if distributed.rank() == 0:
                files.write(directory / NORMS, NORMS_KIND, {"norms": norms},
                            {"job": _job(manifest), "replay_max_error": error})

            def columns(first: int, stop: int) -> list[torch.Tensor]:
                return [rows[:, first:stop]]
        else:
            def columns(first: int, stop: int) -> list[torch.Tensor]:
                scores = carry(indexed, compression.rows(first, stop, device), stop - first, progress=False)[0]
                return scores[:count]

        done = _compute(directory, manifest, columns, progress)
        _finish(directory, manifest)
        index = cls(directory)
        index.blocks = done
        return index

    def append(self, record: Record, *, progress: bool = True) -> TrajectoryIndex:
        """The index extended to the later stages of ``record`` (the indexed run continued: later pretraining stages
        with their own examples and steps), in place (module docstring); an unfinished append of the same record
        resumes. Refused when the record's leading stages are not the indexed run."""
        old = self._require(record)
        b = len(old["fingerprints"])
        if len(record) == b:
            raise InputError("the record holds no stage after the indexed ones; append takes the indexed run "
                             "continued by later recorded stages.")
        for run in record.runs[b:]:
            refuse_uncovered(run)
        final = record.runs[-1].final
        dtype = _dtype(old["dtype"])
        compression = Compression({n: tuple(v.shape) for n, v in final.items()}, old["dim"], old["seed"], dtype)
        before = self.compression()
        rows = self.entries()
        manifest = old | {"fingerprints": old["fingerprints"] + [stage_fingerprint(run) for run in record.runs[b:]],
                          "sizes": old["sizes"] + [len(run.stage) for run in record.runs[b:]],
                          "names": list(final), "shapes": [list(v.shape) for v in final.values()],
                          "width": compression.width, "generation": old["generation"] + 1, "complete": False}
        device = next(iter(final.values())).device

        def columns(start: int, stop: int) -> list[torch.Tensor]:
            scores, handed, _, _ = carry(record, compression.rows(start, stop, device), stop - start, first=b,
                                         progress=False)
            carried = before.apply(handed).T  # (D_old, q): C μ_j
            return [r @ carried.to(r.dtype) for r in rows] + scores[b:]

        done = _compute(self.directory, manifest, columns, progress)
        if distributed.rank() == 0:  # the carried rows' norms are not known: the noise goes unchecked
            (self.directory / NORMS).unlink(missing_ok=True)
        _finish(self.directory, manifest, drop=old)
        self.manifest, self.blocks = files.read(self.directory / MANIFEST, KIND)[1], done
        return self

    def compression(self) -> Compression:
        """The index's C over the last indexed stage's final values (drawn once per generation of the index and
        kept: a query reuses it)."""
        m = self.manifest
        if self._compression is None or self._compression[0] != m["generation"]:
            self._compression = (m["generation"], Compression({n: tuple(s) for n, s in zip(m["names"], m["shapes"])},
                                                              m["dim"], m["seed"], _dtype(m["dtype"])))
        return self._compression[1]

    def entries(self) -> list[torch.Tensor]:
        """Per indexed stage, its (n_k, D) rows e_z."""
        m = self.manifest
        if not m["complete"]:
            raise InputError(f"the trajectory index in {self.directory} is unfinished; run the build (or append) "
                             "again: it resumes.")
        parts = [files.read(self.directory / _block_name(m, j), BLOCK_KIND)[0]
                 for j in range(len(_spans(m)))]
        return [torch.cat([p[f"stage{k}"] for p in parts], dim=1) for k in range(len(m["sizes"]))]

    def scores(self, record: Record, test, *, measure: Measure | None = None, per_test: bool = False,
               finetune: str = "exact", progress: bool = True) -> list[InfluenceResult]:
        """One :class:`InfluenceResult` per stage of ``record``: the indexed stages' first-order scores from the
        index, the later stages' (a new finetune) exact metagradients; values[z] = d measure / d w_z, removal =
        −values.

        record: the indexed run (its leading stages, checked by fingerprint), then any later stages, carried back
        to the adjoint they hand the indexed run (none: the measure is taken on the indexed run's final model).
        finetune: how the later stages are carried — "exact" (their own exact replay, :mod:`.metagradient`) or
        "first-order" (as :func:`~.firstorder.first_order`, whose scores an exact index then reproduces for every
        stage). test, measure, per_test: as :func:`~.metagradient.metagradients` (an :class:`Adjoint` on the
        record's last stage's final values too). diagnostics: seconds (the later stages, the pass over the index),
        the index's width, whether it is exact and its bytes per example."""
        if finetune not in FINETUNES:
            raise InputError(f"finetune must be one of {FINETUNES}, got {finetune!r}.")
        began = time.perf_counter()
        m = self._require(record)
        b = len(m["fingerprints"])
        adjoint, q, outputs = measure_adjoint(record, test, per_test, measure)
        later: list = [None] * len(record)
        if len(record) > b and finetune == "exact":
            later, adjoint = exact_down_to(record, adjoint, q, b, progress)
        elif len(record) > b:
            for run in record.runs[b:]:
                refuse_uncovered(run)
            later, adjoint, _, _ = carry(record, adjoint, q, first=b, progress=progress)
        replayed = time.perf_counter()
        coefficients = self.compression().apply(adjoint).T  # (D, q): C λ
        values = [rows @ coefficients.to(rows.dtype) for rows in self.entries()]
        seconds = {f"{finetune} pass (later stages)": replayed - began, "index pass": time.perf_counter() - replayed}
        diagnostics = {"seconds": seconds, "settings": {"measure_outputs": int(outputs), "per_test": per_test},
                       "index": {"directory": str(self.directory), "width": self.width, "exact": m["dim"] is None,
                                 "bytes_per_example": self.bytes_per_example, "indexed_stages": b,
                                 "noise": self.noise(adjoint, values), "replay": self.replay()}}
        results = []
        for k, run in enumerate(record.runs):
            v = values[k] if k < b else later[k]
            method = METHOD if k < b else EXACT_METHOD if finetune == "exact" else FIRST_ORDER_METHOD
            results.append(InfluenceResult(values=v if per_test else v[:, 0], n_train=len(run.stage),
                                           method=f"{method}, stage {k}",
                                           removal_eps=-1.0, diagnostics=diagnostics | {"stage": k}))
        return results

    def replay(self) -> dict:
        """What the build checked of the record's replay: {"max_error": the largest deviation of the replayed steps
        from the recorded checkpoints (0.0: the run reproduced bit for bit), "checked": what} — or, for an index
        built by sweeps or appended, that it was not kept."""
        if not (self.directory / NORMS).is_file():
            return {"max_error": None, "checked": "not kept (built by column sweeps or appended)"}
        meta = files.read(self.directory / NORMS, NORMS_KIND)[1]
        return {"max_error": meta["replay_max_error"], "checked": "every segment's replayed end vs its checkpoint"}

    def noise(self, adjoint: dict, values: list[torch.Tensor]) -> dict:
        """The projection's noise on the scores ``values`` (per indexed stage, (n_k, q)) of the adjoint λ
        (``{name: (q, *shape)}``), from the build's per-example norms: the standard deviation of ⟨C λ, e_z⟩ around
        ⟨λ, v_z⟩ is at most σ_z = (2 Σ_n ‖λ_n‖² ‖v_{z,n}‖² / k_n)^½ over the compressed tensors n (the variance bound
        of the module docstring, with ⟨λ_n, v_{z,n}⟩² ≤ ‖λ_n‖² ‖v_{z,n}‖²), ‖v_{z,n}‖ bounded by the sum of its steps'
        norms (equal for an example fed once). Returns ``{"bound": "exact" | "unchecked" | "checked", ...}``
        ("unchecked": a build by sweeps or an append keeps no norms; "checked" adds ``median_sd_bound``,
        ``median_abs_score`` and their ratio ``share``); a share above :data:`NOISE_SHARE` warns."""
        m = self.manifest
        if m["dim"] is None:
            return {"bound": "exact"}
        if not (self.directory / NORMS).is_file():
            return {"bound": "unchecked", "why": "built by column sweeps or appended: no per-example norms kept"}
        norms = files.read(self.directory / NORMS, NORMS_KIND)[0]["norms"]  # (n, T) Σ_t ‖u_{z,t,n}‖
        c = self.compression()
        variance = torch.zeros(norms.shape[0], next(iter(adjoint.values())).shape[0], dtype=torch.float64)
        for j, (name, projection) in enumerate(c.projections.items()):
            if projection is not None and name in adjoint:
                lam = adjoint[name].reshape(adjoint[name].shape[0], -1).double().pow(2).sum(1).cpu()
                variance += 2 * norms[:, j:j + 1].double().pow(2) * lam[None, :] / projection.shape[0]
        sd, scores = variance.sqrt(), values[0].detach().double().abs().cpu()
        share = float(sd.median() / scores.median()) if float(scores.median()) > 0 else math.inf
        if share > NOISE_SHARE:
            warnings.warn(f"the trajectory index's random projection (D = {self.width}) adds noise whose bound "
                          f"(median sd {float(sd.median()):.3g}) is {share:.3g}× the median |score| "
                          f"({float(scores.median()):.3g}): its scores are mostly noise. Build with dim=None (exact: "
                          f"{sum(math.prod(v) for v in c.shapes.values())} numbers per example) or a larger dim "
                          f"(the noise falls as 1/√dim).", ProjectionNoiseWarning, stacklevel=3)
        return {"bound": "checked", "median_sd_bound": float(sd.median()),
                "median_abs_score": float(scores.median()), "share": share}

    def _require(self, record: Record) -> dict:
        """The manifest, once the index is complete and ``record``'s leading stages are the indexed run."""
        m = self.manifest
        if not m["complete"]:
            raise InputError(f"the trajectory index in {self.directory} is unfinished; run the build (or append) "
                             "again: it resumes.")
        if len(record) < len(m["fingerprints"]):
            raise IndexMismatchError(f"the index covers {len(m['fingerprints'])} recorded stages; the record holds "
                                     f"{len(record)}. Query with a record that starts with the indexed run.")
        for k, (fingerprint, size) in enumerate(zip(m["fingerprints"], m["sizes"])):
            if len(record.runs[k].stage) != size or stage_fingerprint(record.runs[k]) != fingerprint:
                raise IndexMismatchError(
                    f"stage {k} of the record is not the run the index was built from (its optimizer, learning rates, "
                    f"batches, start or final values differ); a finetune must continue the indexed record itself "
                    f"(the same recorded stages, then its own), or build an index of this record.")
        return m


def by_examples(indexed: Record) -> bool:
    """Whether the index of ``indexed`` is built in one pass over its examples (:func:`example_rows`): one stage
    whose first-order carry is elementwise — SGD / Adam / AdamW, no regularizer R(θ) and no proximal term, whose
    Hessians first order keeps and which would mix the coordinates."""
    run = indexed.runs[0]
    return len(indexed) == 1 and run.stage.regularizer is None and not run.alpha


def example_rows(run: StageRun, compression: Compression,
                 progress: bool) -> tuple[torch.Tensor, torch.Tensor, float]:
    """((n, D) every example's e_z = C v_z of a stage that :func:`by_examples` takes, in one pass; (n, T) per tensor
    Σ_t ‖u_{z,t}‖ ≥ ‖v_z‖ of its steps' terms u_{z,t}, for :meth:`TrajectoryIndex.noise`; the replay's largest
    deviation from the recorded checkpoints, 0.0 where it reproduced the run).

    Without a regularizer the first-order pullback of each step (θ̄_{t+1}, s̄_{t+1}) ↦ (θ̄_t, s̄_t, ḡ'_t) (ḡ'_t the
    cotangent of the clipped gradient) acts coordinate by coordinate, so from θ̄_T = c it is (a_t ⊙ c, b_t ⊙ c,
    e_t ⊙ c), where (a_t, b_t, e_t) is the pullback of the all-ones θ̄_T: one reverse pass with one column. The
    step's clipping (a global norm) is the one coupling, G ↦ J G with J its Jacobian at g_t, so the score
    ⟨J^T(e_t ⊙ c), ∂g_t/∂w_z⟩ = ⟨c, e_t ⊙ J ∂g_t/∂w_z⟩ gives v_z = Σ_{t: z fed} e_t ⊙ J ∂g_t/∂w_z, with
    ∂g_t/∂w_z = ∇ℓ(z; θ_t) / (the micro-batch's divisor × accumulation): the examples' gradients, one backward
    pass each, compressed a micro-batch at a time. Cost: one forward replay (a training step per step), each
    example's gradient once, D·p numbers per example for C; under ``torch.distributed`` rank r takes the examples
    of steps t ≡ r (mod R) and the rows are summed over the ranks."""
    anchors = run.anchors
    final = run.checkpoints[run.steps][0]
    rows = torch.zeros(len(run.stage), compression.width, dtype=compression.dtype)
    norms = torch.zeros(len(run.stage), len(compression.shapes), dtype=torch.float64)  # Σ_t ‖u_{z,t,n}‖
    theta_bar, state_bar, error = {n: torch.ones_like(v) for n, v in final.items()}, None, 0.0
    mine = lambda t: t % distributed.world_size() == distributed.rank()  # noqa: E731
    with holding(run.stage.model, moved_frozen(run)):
        for a, b in tqdm(list(reversed(run.segments())), desc="trajectory index", disable=not progress,
                         leave=False):
            theta, state = run.checkpoints[a]
            if a == 0:
                theta = start(run, anchors)
            if state_bar is None:
                state_bar = {slot: {n: torch.zeros_like(v) for n, v in s.items()} for slot, s in state.items()}
            steps = []
            for t in range(a, b):  # forward: each step's gradient (no graph) and update
                idx, x, y = run.batch(t)
                g = run.gradient(t, theta, anchors, (x, y, unit_weights(run, idx, None, x)), size=idx.numel())
                with torch.no_grad():
                    clipped = run.clipped(t, g)
                    new = run.optimizer.update(theta, state, clipped, run.lrs[t], t + 1)
                steps.append((t, theta, state, g, clipped, new))
                theta, state = new
            error = max(error, deviation((theta, state), run.checkpoints[b]))
            for t, theta_t, state_t, g, clipped, new in reversed(steps):
                with torch.no_grad():
                    theta_bar, state_bar, weights = run.optimizer.pullback(theta_t, state_t, clipped, run.lrs[t],
                                                                           t + 1, new, (theta_bar, state_bar))
                if not mine(t):
                    continue
                idx, x, y = run.batch(t)
                for part, gradients in example_gradients(run, t, theta_t, x, y, idx.numel()):
                    with torch.no_grad():
                        moved = run.clip_tangent(t, g, gradients)
                        values = {n: weights[n] * moved[n] for n in moved}  # e_t ⊙ J ∂g_t/∂w_z
                        rows.index_add_(0, idx[part].cpu(), compression.apply(values))
                        norms.index_add_(0, idx[part].cpu(), torch.stack(
                            [values[n].flatten(1).double().norm(dim=1).cpu() for n in compression.shapes], dim=1))
            del steps
    return distributed.all_reduce_(rows), distributed.all_reduce_(norms), error


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _job(manifest: dict) -> str:
    """What identifies a build's columns: everything in the manifest but its completion."""
    settings = {k: v for k, v in manifest.items() if k != "complete"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _differences(old: dict, new: dict) -> str:
    keys = [k for k in new if k != "complete" and old.get(k) != new[k]]
    return "differs in " + ", ".join("the recorded stages" if k == "fingerprints" else k for k in keys)


def _spans(manifest: dict) -> list[tuple[int, int]]:
    width, block = manifest["width"], manifest["block"]
    return [(a, min(a + block, width)) for a in range(0, width, block)]


def _block_name(manifest: dict, j: int) -> str:
    return f"g{manifest['generation']}-block{j:05d}.safetensors"


def _compute(directory: Path, manifest: dict, columns, progress: bool) -> dict:
    """Write this rank's blocks of columns (j ≡ rank mod ranks) not yet on disk for this job; then wait for every
    rank. {"computed", "reused"}: this rank's blocks."""
    job, done = _job(manifest), {"computed": 0, "reused": 0}
    mine = list(enumerate(_spans(manifest)))[distributed.rank()::distributed.world_size()]
    for j, (start, stop) in tqdm(mine, desc="trajectory index", disable=not progress, leave=False):
        path = directory / _block_name(manifest, j)
        if path.is_file() and files.read(path, BLOCK_KIND)[1].get("job") == job:
            done["reused"] += 1
            continue
        parts = columns(start, stop)
        files.write(path, BLOCK_KIND, {f"stage{k}": v.detach().to("cpu", _dtype(manifest["dtype"]))
                                       for k, v in enumerate(parts)}, {"job": job, "block": j})
        done["computed"] += 1
    distributed.barrier()
    return done


def _finish(directory: Path, manifest: dict, drop: dict | None = None) -> None:
    """Mark the index complete (rank 0), removing the blocks of the generation ``drop`` replaced."""
    if distributed.rank() == 0:
        files.write(directory / MANIFEST, KIND, {}, manifest | {"complete": True})
        if drop is not None:
            for j in range(len(_spans(drop))):
                (directory / _block_name(drop, j)).unlink(missing_ok=True)
    distributed.barrier()
