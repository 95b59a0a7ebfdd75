"""One memory budget, in bytes, from which every phase sizes its batches (``Chain(..., memory=)``).

The budget: ``memory=`` bytes, or by default :data:`DEFAULT_SHARE` (half) of what is free — ``MemAvailable`` of
``/proc/meminfo`` (psutil's ``available`` where that file is missing) for a model on the CPU, the free memory
``torch.cuda.mem_get_info`` reports for a model on CUDA. It bounds the memory a phase *adds* on top of the model,
its data and the solver's vectors, which exist whatever the batch size. It is a ceiling, not a target: on a
shared machine several processes each take their half of what is free when they start. A computation of several
phases that keeps state between them (the approximate unrolling's pieces) counts it with :class:`Held`: with
``memory=`` each phase gets the budget minus what is held then (:func:`remaining`), so ``memory=`` bounds what
the whole computation adds; the default needs no such count, being taken from what is free when each phase starts.

**The default does not fill it.** Without ``memory=``, a phase's batch holds at most
max(:data:`DEFAULT_EXAMPLES`, ⌊:data:`DEFAULT_WORKING` / (SAFETY · bytes per example)⌋) examples
(:func:`default_count`). Larger batches buy no throughput on a CPU, only resident memory (measured by
``benchmarks/bench_transformer.py``, results in ``benchmarks/results/bench_transformer/``). Tiny examples
(digits, small MLPs) still go in one batch (256 MiB of them). ``memory=`` lifts the cap: then
the batches fill the given budget.

A phase's cost per example is **measured**, not guessed: the caller runs the phase's computation once inside a
:class:`Probe`, on a probe batch of :data:`PROBE_EXAMPLES` examples under ``torch.autograd.graph.saved_tensors_hooks`` and adds up
the distinct storages autograd keeps for the backward pass (the activations: what grows with the batch), plus
the outputs; the model's parameters and buffers, which exist anyway, are not counted. Transient buffers of the
backward pass itself (gradients flowing through one layer at a time, temporaries of the kernels) are not saved
tensors; :data:`SAFETY` covers them (``tests/test_memory.py`` checks resident growth during scoring against the estimate).
A batch then holds
``floor(budget / (SAFETY · bytes per example))`` examples (:func:`fit_count`); a budget too small for one example
raises :class:`MemoryBudgetError` with the bytes one example needs.

The chosen sizes are returned as small dicts, which the phases put in their diagnostics
(``res.diagnostics["memory"]``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .errors import MemoryBudgetError

DEFAULT_SHARE = 0.5
DEFAULT_EXAMPLES = 8  # without memory=: a batch holds at most this many examples ...
DEFAULT_WORKING = 256 * 2**20  # ... or, for small examples, as many as fit these bytes (× SAFETY)
PROBE_EXAMPLES = 2
SAFETY = 2.0
MiB = 2**20


def available_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes free now: CUDA's free memory on a CUDA device, else ``MemAvailable`` (or psutil's ``available``)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return 4 * 2**30  # neither source: assume a small machine


def resolve(memory: int | float | None, device: torch.device | str = "cpu") -> int:
    """The budget in bytes: ``memory`` itself, or DEFAULT_SHARE of what is free when it is None (every phase
    receives the budget as an argument: ``Chain(memory=)`` passes its own to each)."""
    if memory is None:
        return int(DEFAULT_SHARE * available_bytes(device))
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory > 0:
        raise MemoryBudgetError(f"memory must be a positive number of bytes (e.g. 4 * 2**30), got {memory!r}.")
    return int(memory)


def given(memory: int | float | None) -> bool:
    """Whether a budget was asked for (else the default rule applies: :func:`default_count`)."""
    return memory is not None


def default_count(per_example: int, least: int = DEFAULT_EXAMPLES) -> int:
    """The most examples a batch holds under the default budget: max(``least``, DEFAULT_WORKING / (SAFETY · per)),
    ``least`` = DEFAULT_EXAMPLES (1 for a phase held to the working memory alone, e.g. the Chain's stationarity check)."""
    return max(least, int(DEFAULT_WORKING // max(int(SAFETY * per_example), 1)))


def _storage_key(t: torch.Tensor):
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # tensors without storage (functorch wrappers): count each
        return ("id", id(t))


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


class SavedBytes:
    """Context manager: the bytes of distinct storages autograd saves for backward inside it (``.total``),
    leaving out the ``exclude`` tensors' storages (parameters and buffers)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self.skip = {_storage_key(t) for t in exclude}
        self.seen: set = set()
        self.total = 0

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.total += _nbytes(t)
        return t

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count result tensors too (outputs kept after the phase)."""
        for t in tensors:
            if torch.is_tensor(t):
                self._pack(t)

    def __enter__(self) -> "SavedBytes":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class Probe:
    """Context manager around a phase the caller runs on a probe batch of ``examples`` examples: ``per_example``
    (after the block) is the bytes per example autograd saved for backward inside it, plus the tensors handed to
    :meth:`keep` (outputs the phase keeps). The model's parameters and buffers, which exist anyway, are not counted,
    nor ``exclude`` (parameter values the phase passes in place of the model's own). The caller sizes its batches
    from it; nothing here runs the phase.
    """

    def __init__(self, model: torch.nn.Module, examples: int = PROBE_EXAMPLES, exclude: Iterable[torch.Tensor] = ()):
        self.examples = examples
        self._saved = SavedBytes(list(model.parameters()) + list(model.buffers()) + list(exclude))
        self.per_example = 0

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count ``tensors`` too: what the phase keeps after it ends."""
        self._saved.add(tensors)

    def __enter__(self) -> "Probe":
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        self.per_example = -(-self._saved.total // max(self.examples, 1))


def probe_bytes(run: Callable[[int], Iterable[torch.Tensor] | None], model: torch.nn.Module,
                examples: int = PROBE_EXAMPLES, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Measured bytes per example of ``run(examples)``, a phase handed over as a callable (:class:`Probe` around it):
    saved activations + the tensors ``run`` returns (or None). Where the caller can run the phase itself, it uses
    :class:`Probe` directly."""
    with Probe(model, examples, exclude) as probe:
        probe.keep(run(examples) or ())
    return probe.per_example


def fit_count(budget: int, per_example: int, phase: str, *, most: int | None = None, fixed: int = 0,
              default: bool = False, least: int = DEFAULT_EXAMPLES) -> int:
    """How many examples a batch of ``phase`` holds: ⌊(budget − fixed) / (SAFETY · per_example)⌋, at most ``most``,
    and with ``default`` (no budget was given, :func:`given`) at most :func:`default_count` (per_example, ``least``).

    Raises MemoryBudgetError when not even one fits.
    """
    need = max(int(SAFETY * per_example), 1)
    count = (budget - fixed) // need
    if count < 1:
        raise MemoryBudgetError(
            f"{phase} needs about {need + fixed:,} bytes ({(need + fixed) / MiB:.1f} MiB) for one example "
            f"({SAFETY:g} × {per_example:,} measured bytes per example" + (f" + {fixed:,} fixed" if fixed else "")
            + f"), but the memory budget is {budget:,} bytes ({budget / MiB:.1f} MiB); raise memory= or shorten "
            "the sequences."
        )
    if default:
        count = min(count, default_count(per_example, least))
    return int(min(count, most)) if most is not None else int(count)


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors of a (nested) dict / list / tuple of tensors."""
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in tensors_in(item)]
    return []


def remaining(memory: int | float | None, held: int, phase: str) -> int | None:
    """The budget of a phase of a computation that already holds ``held`` bytes it allocated since it began (state
    kept across its phases): ``memory − held`` for a given budget, so ``memory=`` bounds what the whole computation
    adds, held state included; None stays None — the default budget is a share of what is free when the phase
    starts, which already leaves out what the process holds. Raises MemoryBudgetError when nothing is left."""
    if memory is None:
        return None
    left = resolve(memory) - int(held)
    if left <= 0:
        raise MemoryBudgetError(
            f"{phase} has no memory left: the computation already holds {held:,} bytes ({held / MiB:.1f} MiB) of the "
            f"{int(memory):,}-byte budget; raise memory=.")
    return left


class Held:
    """Bytes a computation holds across its phases beyond what existed when it began (:func:`remaining`): each
    storage counted once (views and tensors shared between held objects are not counted twice), the storages of
    ``before`` (tensors that existed already, e.g. a record's checkpoints) never."""

    def __init__(self, before=()):
        self._before = {_storage_key(t) for t in tensors_in(before)}
        self._held: dict = {}

    @property
    def bytes(self) -> int:
        return sum(self._held.values())

    def hold(self, *trees) -> None:
        for t in tensors_in(trees):
            key = _storage_key(t)
            if key not in self._before:
                self._held[key] = _nbytes(t)

    def drop(self, *trees) -> None:
        for t in tensors_in(trees):
            self._held.pop(_storage_key(t), None)

    def left(self, memory: int | float | None, phase: str) -> int | None:
        """The budget of the next phase: :func:`remaining` (memory, what is held)."""
        return remaining(memory, self.bytes, phase)


def plan(budget: int, per_example: int, phase: str, *, most: int | None = None, fixed: int = 0,
         default: bool = False, least: int = DEFAULT_EXAMPLES) -> dict:
    """The diagnostics record of a sizing decision: {phase, budget, bytes_per_example, batch, default}."""
    return {"phase": phase, "budget": int(budget), "bytes_per_example": int(per_example), "fixed_bytes": int(fixed),
            "batch": fit_count(budget, per_example, phase, most=most, fixed=fixed, default=default, least=least),
            "default": bool(default)}

