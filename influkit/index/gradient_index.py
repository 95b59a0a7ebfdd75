"""``GradientIndex``: a stage's per-example gradients, compressed and written to disk once, scored against any query.

Built once from a stage (a pretraining stage: its model at the checkpoint and its data), the index holds for
every example z one row c(z) of D numbers, the compressed gradient ∇ℓ(z) (:mod:`.projections`), stored by default
as int8 with one float32 scale per row (:mod:`.quantization`: each score within a stated bound of the unquantized
row's). A
:class:`~influkit.chain.Query` of any chain whose stage 1 is that stage — a new finetuned head (Case 1), a
finetuned encoder (Case 2), a LoRA adapter, a new test set, summed or per test point — gives the adjoint s on
stage 1's trained parameters; the index compresses it the same way to s̃ (D × k) and

    I(z, T) ≈ −c(z)ᵀ s̃      for every z at once: one matrix product over the shards

(the chain's sign convention: I(z, T) = −∇ℓ(z)ᵀ s, positive = harmful; ``removal`` = −values/m). With identity
projections (``projection="identity"``) the rows are the exact per-example gradients and so are the scores.
Whitened (``IndexConfig(whiten=True, damping=λ)`` with the stage's fitted curvature C), c(z) compresses
(C + λI)^{-1/2} ∇ℓ(z) and s̃ compresses (C + λI)^{1/2} s, the same score −⟨∇ℓ(z), s⟩ split evenly between the two
sides, so the compression's error is relative to the whitened norms (:mod:`.projections`).
:meth:`GradientIndex.top` re-scores the candidates exactly (contraction, :meth:`Query.scores` on those rows only).

Before scoring, the query's stage 1 is checked against the index: the checkpoint (every value of its model's
state), the trained parameter names and the data (the digest of each shard's examples); any difference is an
:class:`~influkit.errors.IndexMismatchError`. Under ``torch.distributed`` a build's shards are split over the ranks
(each writes its own, disjoint) and a query is computed on every rank.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import distributed, files
from ..errors import IndexMismatchError, InputError
from ..per_token import TokenScores, token_losses_of
from ..results import InfluenceResult
from ..scoring import Rows, rank_chunks, release_freed_memory
from ..stage import Stage
from .layout import Layout
from .projections import FlatBlock, KroneckerBlock
from .quantization import dequantize, quantize, score_error_bound, split, stored_width
from .shards import FORMAT, PROJECTIONS, PROJECTIONS_KIND, VERSION, ShardFiles, checkpoint_fingerprint, data_digest

DTYPES = {"int8": torch.int8, "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}
DEFAULT_DIM = 4000  # numbers per example at most: int8 with the row's float32 scale, ≤ 4,004 bytes a row
CHUNK_BYTES = 1 << 27  # an int8 index is dequantized this many bytes of float rows at a time


@dataclass(frozen=True)
class IndexConfig:
    """How an index is built.

    The default is the whitened eigen-pair selection (``projection="eigenpairs", whiten=True``) of at most 4,000
    numbers per example stored as int8 with a float32 scale per row (≤ 4,004 bytes per example): it needs the
    stage's fitted factored curvature (``factored=`` of :meth:`GradientIndex.build`) and ``damping``;
    ``IndexConfig(projection="random", whiten=False)`` needs neither.

    dim: numbers per example in all, at most (the dimension rule of :mod:`.projections` shares them among the layers
    and gives D ≤ dim); the default 4,000 with int8 rows stores D + 4 ≤ 4,004 bytes per example;
    projection: "eigenpairs" (whitened only: the entries (i, j) of the layers' whitened eigenbasis blocks of most
    whitened energy E/(E + λ) over all layers), "eigenbasis" (per side of each layer, the eigenvectors of the fitted
    K-FAC/EK-FAC curvature with the most gradient energy — whitened energy Σ E/(E + λ) when whitened), "random" (LoGra-style random Kronecker
    projections, seeded by ``seed``) or "identity" (exact, uncompressed: D = the number of trained parameters);
    whiten: store P (C + λI)^{-1/2} ∇ℓ(z) and compress a query's adjoint s to P (C + λI)^{1/2} s (:mod:`.projections`),
    C the ``factored`` curvature, λ = ``damping`` (chosen from C alone, e.g. 0.1 · C's mean eigenvalue, and given to
    every later chain's stage-1 solve, so that the query side is (C + λI)^{-1/2} u for its s = (C + λI)⁻¹ u); exact
    uncompressed whatever λ;
    dtype: the rows' dtype on disk: "int8" (symmetric round-to-nearest, one float32 scale per row, D + 4 bytes; the
    scores' error bound in :mod:`.quantization`), "float16", "bfloat16", "float32" or "float64"; None (the default):
    "int8" for a compressed index, the trained parameters' dtype for ``projection="identity"`` (exact). The rows are
    computed, and an int8 index's queries compressed and its rows dequantized, in the trained parameters' dtype
    (a float dtype: in that dtype); shard_size: rows per shard
    file; batch_size: examples per forward/backward (8: on a CPU a batch that stays near the caches; the forward and
    backward dominate, as in contraction scoring, :data:`influkit.scoring.CPU_CHUNK_BYTES`).
    """

    dim: int = DEFAULT_DIM
    projection: str = "eigenpairs"
    seed: int = 0
    whiten: bool = True
    damping: float | None = None
    dtype: str | None = None
    shard_size: int = 4096
    batch_size: int = 8

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"dtype must be one of {sorted(DTYPES)} or None, got {self.dtype!r}.")
        if self.shard_size < 1 or self.batch_size < 1:
            raise InputError("shard_size and batch_size must be ≥ 1.")
        if self.damping is not None and not self.damping >= 0:
            raise InputError(f"damping must be ≥ 0 (the λ stage 1 is solved with), got {self.damping!r}.")

    def summary(self) -> dict:
        return asdict(self)

    def storage(self, parameters: torch.dtype) -> torch.dtype:
        """The rows' dtype on disk for trained parameters of dtype ``parameters`` (``dtype``, None resolved)."""
        if self.dtype is not None:
            return DTYPES[self.dtype]
        return parameters if self.projection == "identity" else torch.int8


class GradientIndex:
    """An index on disk in ``directory`` (open one with :meth:`open`, make one with :meth:`build`)."""

    def __init__(self, directory: str | Path):
        self.files = ShardFiles(directory)
        if not self.files.exists():
            raise InputError(f"{directory} holds no gradient index; build one with GradientIndex.build(stage, directory).")
        self.manifest = self.files.read_manifest()
        self._layouts: dict[int, Layout] = {}

    @classmethod
    def open(cls, directory: str | Path) -> "GradientIndex":
        """The index in ``directory``."""
        return cls(directory)

    @staticmethod
    def exists(directory: str | Path) -> bool:
        """Whether ``directory`` holds an index (its manifest)."""
        return ShardFiles(directory).exists()

    def __repr__(self) -> str:
        m = self.manifest
        return (f"GradientIndex({self.directory}, {self.n_rows} rows × {self.width}, {m['config']['projection']}, "
                f"{len(m['shards'])} shards)")

    @property
    def directory(self) -> Path:
        return self.files.directory

    @property
    def n_rows(self) -> int:
        return sum(s["stop"] - s["start"] for s in self.manifest["shards"])

    @property
    def width(self) -> int:
        """D: numbers per example."""
        return int(self.manifest["width"])

    @property
    def dtype(self) -> torch.dtype:
        """The rows' dtype on disk."""
        return DTYPES[self.manifest["dtype"]]

    @property
    def quantized(self) -> bool:
        """Whether the rows are stored as int8 with a scale per row (:mod:`.quantization`)."""
        return self.dtype == torch.int8

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the rows are computed in, and queries compressed and int8 rows dequantized in."""
        return DTYPES[self.manifest["compute_dtype"]]

    @property
    def stored_width(self) -> int:
        """Columns of a stored row: D, or D + 4 for int8 (the row's float32 scale's bytes)."""
        return stored_width(self.width) if self.quantized else self.width

    @property
    def bytes_per_example(self) -> int:
        """Bytes of one row on disk (an int8 row's scale included)."""
        return self.stored_width * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def complete(self) -> bool:
        """Whether every planned shard is on disk."""
        return all(self.files.has(c, s["stop"] - s["start"], self.stored_width)
                   for c, s in enumerate(self.manifest["shards"]))

    # ---- building
    @classmethod
    def build(cls, stage: Stage, directory: str | Path, config: IndexConfig = IndexConfig(), *, factored=None,
              progress: bool = True) -> "GradientIndex":
        """Index every example of ``stage`` (its trained parameters, at its model's current values) in ``directory``.

        A directory that already holds this index (same checkpoint, settings and data) is resumed: only the shards
        not on disk are computed. One that holds another index is refused (:class:`IndexMismatchError`); to add
        examples use :meth:`append`. ``factored``: a fitted :class:`~influkit.factored.FactoredCurvature` of the
        stage (``projection="eigenpairs"`` or ``"eigenbasis"``, ``whiten=True``). Under ``torch.distributed`` every rank calls it; the shards are split."""
        files_ = ShardFiles(directory)
        if distributed.rank() == 0:
            if files_.exists():
                manifest = files_.read_manifest()
                _check(manifest, stage, stage.param_names, config)
                if sum(s["stop"] - s["start"] for s in manifest["shards"]) != len(stage):
                    raise IndexMismatchError(
                        f"{directory} indexes {sum(s['stop'] - s['start'] for s in manifest['shards'])} examples, the "
                        f"stage has {len(stage)}: add new examples with GradientIndex.open(dir).append(stage), or "
                        "build into a new directory.")
            else:
                parameters = next(iter(stage.state()[n] for n in stage.param_names)).dtype
                dtype = config.storage(parameters)
                compute = dtype if dtype.is_floating_point else parameters
                layout = Layout.plan(stage, stage.param_names, projection=config.projection, dim=config.dim,
                                     seed=config.seed, dtype=compute, factored=factored, whiten=config.whiten,
                                     damping=config.damping)
                files_.directory.mkdir(parents=True, exist_ok=True)
                files.write(files_.directory / PROJECTIONS, PROJECTIONS_KIND, layout.tensors(), {"blocks": layout.describe()})
                files_.write_manifest({
                    "format": FORMAT, "version": VERSION, "checkpoint": checkpoint_fingerprint(stage, stage.param_names),
                    "names": list(stage.param_names), "config": config.summary(), "width": layout.width,
                    "dtype": str(dtype).removeprefix("torch."),
                    "compute_dtype": str(compute).removeprefix("torch."), "blocks": layout.describe(),
                    "shards": _plan_shards(stage, 0, len(stage), config.shard_size)})
        distributed.barrier()
        index = cls(directory)
        index._fill(stage, progress)
        return index

    def append(self, stage: Stage, *, progress: bool = True) -> "GradientIndex":
        """Index the examples of ``stage`` past those already indexed (its data: the indexed examples, unchanged and
        in order, then the new ones), without recomputing any row. Refused for another checkpoint or changed data.
        Resumable like :meth:`build`. Returns self."""
        config = IndexConfig(**self.manifest["config"])
        if distributed.rank() == 0:
            _check(self.manifest, stage, stage.param_names, config)
            if len(stage) < self.n_rows:
                raise IndexMismatchError(f"the stage has {len(stage)} examples, fewer than the {self.n_rows} indexed; "
                                         "append needs the indexed examples first, then the new ones.")
            if len(stage) > self.n_rows:
                self.manifest["shards"] += _plan_shards(stage, self.n_rows, len(stage), config.shard_size)
                self.files.write_manifest(self.manifest)
        distributed.barrier()
        self.manifest = self.files.read_manifest()
        self._fill(stage, progress)
        return self

    def _fill(self, stage: Stage, progress: bool) -> None:
        """Compute and write this rank's planned shards that are not on disk (rank r: the r-th contiguous range)."""
        layout = self.layout(stage)
        shards = self.manifest["shards"]
        batch = self.manifest["config"]["batch_size"]
        mine, _ = rank_chunks(len(shards), 1)
        todo = [c for c in mine if not self.files.has(c, shards[c]["stop"] - shards[c]["start"], self.stored_width)]
        bar = tqdm(total=sum(shards[c]["stop"] - shards[c]["start"] for c in todo), desc="indexing",
                   disable=not progress or distributed.rank() != 0, leave=False)
        for c in todo:
            start, stop = shards[c]["start"], shards[c]["stop"]
            rows = torch.empty(stop - start, self.width, dtype=self.compute_dtype)
            for s in range(start, stop, batch):
                x, y = stage.data.take(torch.arange(s, min(stop, s + batch)))
                rows[s - start : s - start + x.shape[0]] = layout.rows(x, y, self.compute_dtype).detach().cpu()
                bar.update(x.shape[0])
            self.files.put(c, quantize(rows) if self.quantized else rows.to(self.dtype))
            del rows
            release_freed_memory()
        bar.close()
        distributed.barrier()

    # ---- checking and layout
    def check(self, stage: Stage, names=None, *, checkpoint: bool = True, data: bool = True) -> None:
        """Raise :class:`IndexMismatchError` unless ``stage`` (its trained ``names``, with ``checkpoint`` its model's
        values, with ``data`` its examples) is the one indexed, with every shard on disk."""
        _check(self.manifest, stage, list(stage.param_names if names is None else names), None,
               checkpoint=checkpoint, data=data)
        if not self.complete:
            raise IndexMismatchError(f"{self.directory}: some shards are missing (an interrupted build); run the same "
                                     "GradientIndex.build (or append) again to finish it.")

    def layout(self, stage: Stage) -> Layout:
        """The row layout on ``stage``'s model with the stored projections."""
        if id(stage) not in self._layouts:
            tensors, meta = files.read(self.directory / PROJECTIONS, PROJECTIONS_KIND)
            layout = Layout.plan(stage, self.manifest["names"], projection="identity", dim=1, seed=0,
                                 dtype=self.compute_dtype)
            for i, block in enumerate(layout.blocks):
                if isinstance(block, KroneckerBlock):
                    block.p_out, block.p_in = tensors.get(f"block{i}.p_out"), tensors.get(f"block{i}.p_in")
                    block.q_out, block.q_in = tensors.get(f"block{i}.q_out"), tensors.get(f"block{i}.q_in")
                    block.scale = tensors.get(f"block{i}.scale")
                    block.pairs = tensors.get(f"block{i}.pairs")
                    block.basis = meta["blocks"][i].get("basis") if i < len(meta["blocks"]) else block.basis
                elif isinstance(block, FlatBlock):
                    block.projection = tensors.get(f"block{i}.projection")
                    block.scale = tensors.get(f"block{i}.scale")
            if layout.describe() != meta["blocks"]:
                raise IndexMismatchError(f"{self.directory}: the model's layers differ from those the index was built "
                                         "on (another architecture or other trained parameters).")
            for block in layout.blocks:
                for name, t in block.tensors().items():
                    setattr(block, name, t.to(stage.device))
            self._layouts[id(stage)] = layout
        return self._layouts[id(stage)]

    def shards(self):
        """(start, rows) of every shard in order, rows memory-mapped; an int8 index's dequantized (σ q, in
        :attr:`compute_dtype`) from the memory map a chunk of rows at a time (start: the chunk's first row)."""
        for c, shard in enumerate(self.manifest["shards"]):
            stored = self.files.get(c)
            if not self.quantized:
                yield shard["start"], stored
                continue
            step = self._chunk_rows(self.compute_dtype)
            for lo in range(0, stored.shape[0], step):
                yield shard["start"] + lo, dequantize(stored[lo : lo + step], self.compute_dtype)

    def _chunk_rows(self, dtype: torch.dtype) -> int:
        """Rows of an int8 index converted to ``dtype`` at a time: CHUNK_BYTES of converted rows."""
        return max(1, CHUNK_BYTES // (self.width * torch.empty(0, dtype=dtype).element_size()))

    def products(self, s: torch.Tensor, *, progress: bool = True) -> torch.Tensor:
        """(n_rows, k) every row's product with the columns ``s`` (D, k): cᵀ s for stored rows c, σ (qᵀ s) for int8
        rows — q converted to :attr:`compute_dtype` a chunk at a time in one reused buffer, so a query's memory does
        not grow with the number of chunks."""
        out, bar = [], tqdm(total=self.n_rows, desc="index scores", disable=not progress, leave=False)
        buffer = None
        for c, shard in enumerate(self.manifest["shards"]):
            stored = self.files.get(c)
            if not self.quantized:
                out.append(stored @ s)
            else:
                values, scale = split(stored)
                step = self._chunk_rows(s.dtype)
                if buffer is None:
                    buffer = torch.empty(min(step, self.n_rows), self.width, dtype=s.dtype)
                for lo in range(0, values.shape[0], step):
                    chunk = buffer[: min(step, values.shape[0] - lo)].copy_(values[lo : lo + step])
                    out.append((chunk @ s) * scale[lo : lo + step, None].to(s.dtype))
            bar.update(shard["stop"] - shard["start"])
        bar.close()
        return torch.cat(out) if out else torch.empty(0, s.shape[1], dtype=s.dtype)

    def matrix(self) -> torch.Tensor:
        """All rows (n_rows, D) in memory (for small indexes and tests), dequantized for int8."""
        return torch.cat([rows for _, rows in self.shards()]) if self.manifest["shards"] else \
            torch.empty(0, self.width, dtype=self.compute_dtype)

    def scales(self) -> torch.Tensor:
        """(n_rows,) float32 the int8 rows' scales σ (:mod:`.quantization`)."""
        if not self.quantized:
            raise InputError(f"{self.directory} stores {self.manifest['dtype']} rows, not int8 rows with scales.")
        return torch.cat([split(self.files.get(c))[1] for c in range(len(self.manifest["shards"]))])

    def error_bound(self, query) -> torch.Tensor:
        """The bound on |int8 index score − the score of the unquantized rows| of every row for ``query``, shaped
        like :meth:`scores`' values: (σ_i / 2) ‖s̃‖₁ per row i and query column (:mod:`.quantization`)."""
        bound = score_error_bound(self.scales(), self.directions(query).cpu())
        return bound.to(query.s.dtype) if query.per_test else bound.reshape(-1).to(query.s.dtype)

    # ---- queries
    def directions(self, query) -> torch.Tensor:
        """(D, k) the query's adjoint s on stage 1, compressed like the rows (k = 1, or the test points)."""
        plan = query.chain.plans[0]
        return self.layout(plan.stage).directions(query.s, self.compute_dtype)

    def scores(self, query, *, check_data: bool = True, progress: bool = True) -> InfluenceResult:
        """I(z, T) ≈ −c(z)ᵀ s̃ of every indexed example for a :class:`~influkit.chain.Query` whose chain's stage 1 is
        the indexed stage (checked; ``check_data=False`` skips hashing its examples again): (m,) summed, or (m, n_test)
        per test point; an int8 index's −σ q(z)ᵀ s̃, within :meth:`error_bound` of the unquantized rows' scores.
        ``removal`` = −values/m as for any result."""
        plan = query.chain.plans[0]
        start = time.perf_counter()
        self.check(plan.stage, plan.trained, data=False)
        fingerprinted = time.perf_counter()
        if check_data:
            self.check(plan.stage, plan.trained, checkpoint=False)
        checked = time.perf_counter()
        s = self.directions(query).cpu()
        compressed = time.perf_counter()
        values = -self.products(s, progress=progress).to(query.s.dtype)
        seconds = dict(query.seconds) | {"index_checkpoint": fingerprinted - start, "index_data": checked - fingerprinted,
                                         "index_check": checked - start, "index_directions": compressed - checked,
                                         "index_product": time.perf_counter() - compressed}
        return InfluenceResult(
            values=values if query.per_test else values.reshape(-1), n_train=len(plan.stage),
            method=f"{query.chain.method} (gradient index)",
            diagnostics={"stages": query.stages, "solves": query.solves, "seconds": seconds,
                         "settings": query.settings() | {"index": self.describe()}})

    def top(self, query, k: int = 10, *, candidates: int | None = None, harmful: bool = True, column: int | None = None,
            ann: bool = False, chunk_size: int | None = None, progress: bool = True) -> InfluenceResult:
        """The k most harmful (``harmful=False``: helpful) examples, ranked by exact scores: the index proposes
        ``candidates`` rows (default max(4k, 100)) by its scores — summed over the test points, or of test point
        ``column`` — and :meth:`Query.scores` re-scores exactly those rows by contraction. ``ann``: the candidates
        from an approximate inner-product search (faiss HNSW, :mod:`.ann`) instead of scoring every row. The result's
        rows are the k examples (``index``: their ids), ``diagnostics["index"]`` the candidates' index scores.
        progress: bars over the index's product and the re-scoring (``False``: nothing printed)."""
        if k < 1:
            raise InputError(f"k must be ≥ 1, got {k}.")
        m = self.n_rows
        candidates = min(m, candidates or max(4 * k, 100))
        plan = query.chain.plans[0]
        start = time.perf_counter()
        if ann:
            from .ann import search

            self.check(plan.stage, plan.trained)
            s = self.directions(query).cpu()
            direction = s[:, column] if column is not None else s.sum(1)
            ids = search(self, direction if not harmful else -direction, candidates)
            approx = -(self._rows_at(ids) @ direction)
        else:
            approx_all = self.scores(query, progress=progress)
            key = approx_all.values if not approx_all.per_test else \
                approx_all.values[:, column] if column is not None else approx_all.values.sum(1)
            ids = key.argsort(descending=harmful)[:candidates]
            approx = key[ids]
        proposed = time.perf_counter()
        exact = query.scores(ids, chunk_size=chunk_size, progress=progress)
        key = exact.values if not exact.per_test else \
            exact.values[:, column] if column is not None else exact.values.sum(1)
        order = key.argsort(descending=harmful)[:k]
        diagnostics = dict(exact.diagnostics)
        diagnostics["index"] = self.describe() | {
            "candidates": ids.tolist(), "candidate_scores": approx.tolist(), "ann": ann,
            "seconds": {"candidates": proposed - start, "rescoring": time.perf_counter() - proposed}}
        return InfluenceResult(values=exact.values[order], n_train=len(plan.stage), index=exact.index[order],
                               method=f"{query.chain.method} (gradient index top-{k}, re-scored)",
                               diagnostics=diagnostics)

    def token_scores(self, query, z=None, *, chunk_size: int | None = None, progress: bool = False) -> TokenScores:
        """Per-token index scores −c_t(z)ᵀ s̃ of stage-1 sequences ``z`` (indices, default all; e.g. the ids of
        :meth:`top`): c_t(z) the compressed gradient of token term ℓ_t (:mod:`influkit.per_token`), computed with the
        index's projections, so Σ_t c_t(z) = c(z) and the tokens sum to the score of the unquantized row (an int8
        index's :meth:`scores` are within :meth:`error_bound` of that). Values (n, L), or (n, L, n_test) per test
        point. Not stored: each chunk of ``chunk_size`` sequences (default :attr:`IndexConfig.batch_size`) takes one
        forward and backward per token position."""
        plan = query.chain.plans[0]
        stage = plan.stage
        self.check(stage, plan.trained, data=False)
        split = token_losses_of(stage.loss)
        rows = Rows.of(stage, z)
        layout = self.layout(stage)
        s = self.directions(query).to(stage.device)
        chunk_size = int(chunk_size or self.manifest["config"].get("batch_size") or 8)
        start = time.perf_counter()
        blocks = []
        for c in tqdm(range(-(-len(rows) // chunk_size)), desc="index token scores", disable=not progress, leave=False):
            x, y = rows.take(c * chunk_size, (c + 1) * chunk_size)
            with torch.no_grad():
                width = split(stage.outputs(stage.trained(), x), y).shape[1]
            columns = []
            for t in range(width):  # the layout's rows on the stage whose loss is token term t
                at_t = copy.copy(layout)
                at_t.stage = stage.with_(loss=lambda outputs, targets, t=t: split(outputs, targets)[:, t])
                columns.append(-(at_t.rows(x, y, self.compute_dtype) @ s))
            blocks.append(torch.stack(columns, dim=1))
        values = torch.cat(blocks).to(query.s.dtype)
        return TokenScores(values if query.per_test else values[..., 0], rows.ids,
                           f"{query.chain.method} (gradient index, per token)",
                           {"seconds": time.perf_counter() - start, "chunk_size": chunk_size, "index": self.describe()})

    def _rows_at(self, ids: torch.Tensor) -> torch.Tensor:
        """(len(ids), D) the rows of examples ``ids`` (int8 rows: only those dequantized)."""
        out = torch.empty(ids.shape[0], self.width, dtype=self.compute_dtype)
        for c, shard in enumerate(self.manifest["shards"]):
            hit = (ids >= shard["start"]) & (ids < shard["stop"])
            if hit.any():
                stored = self.files.get(c)[ids[hit] - shard["start"]]
                out[hit] = dequantize(stored, self.compute_dtype) if self.quantized else stored.to(self.compute_dtype)
        return out

    def describe(self) -> dict:
        """The index's settings, size and layout summary (JSON-friendly)."""
        return {"directory": str(self.directory), "rows": self.n_rows, "width": self.width,
                "dtype": self.manifest["dtype"], "compute_dtype": self.manifest["compute_dtype"],
                "bytes_per_example": self.bytes_per_example,
                "config": self.manifest["config"], "checkpoint": self.manifest["checkpoint"],
                "blocks": len(self.manifest["blocks"])}


def _plan_shards(stage: Stage, start: int, stop: int, size: int) -> list[dict]:
    return [{"start": s, "stop": min(stop, s + size), "data": data_digest(stage, s, min(stop, s + size))}
            for s in range(start, stop, size)]


def _check(manifest: dict, stage: Stage, names, config: IndexConfig | None, *, checkpoint: bool = True,
           data: bool = True) -> None:
    """IndexMismatchError naming what differs between the index's manifest and ``stage`` (and ``config``)."""
    where = "the index"
    if list(names) != manifest["names"]:
        raise IndexMismatchError(f"{where} holds gradients over other parameters ({len(manifest['names'])} names, "
                                 f"e.g. {manifest['names'][:3]}) than the stage trains ({list(names)[:3]}...); "
                                 "build an index for these parameters.")
    if checkpoint and checkpoint_fingerprint(stage, names) != manifest["checkpoint"]:
        raise IndexMismatchError(f"{where} was built at another checkpoint: the stage model's parameter or buffer "
                                 "values differ from those indexed. Load the indexed checkpoint, or build a new index.")
    if config is not None and config.summary() != manifest["config"]:
        changed = sorted(k for k, v in config.summary().items() if manifest["config"].get(k) != v)
        raise IndexMismatchError(f"{where} was built with other settings ({', '.join(changed)} differ); pass the "
                                 "same IndexConfig, or build into a new directory.")
    if data:
        indexed = sum(s["stop"] - s["start"] for s in manifest["shards"])
        if config is None and indexed != len(stage):
            raise IndexMismatchError(f"{where} holds {indexed} examples, the stage {len(stage)}: append the new "
                                     "examples (GradientIndex.append) or query with the indexed data.")
        for shard in manifest["shards"]:
            if shard["stop"] > len(stage) or data_digest(stage, shard["start"], shard["stop"]) != shard["data"]:
                raise IndexMismatchError(f"{where} was built on other data: examples {shard['start']}–{shard['stop'] - 1} "
                                         "of the stage differ from those indexed (values or order). Build a new index.")
