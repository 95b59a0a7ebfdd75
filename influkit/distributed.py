"""Running the same calls on several processes with ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Nothing here is needed on one process: when ``torch.distributed`` is not initialized every function is the
identity. When it is (``torchrun``, or :func:`initialize`), influkit splits its work deterministically:

- stage data for Hessian-vector products: rank r of R takes the r-th contiguous slice of the (sampled)
  example indices, computes its share of (1/n) Σ_i ∇²ℓ_i·v, rank 0 adds the regularizer's share, and the
  products are summed with ``all_reduce`` — every rank then holds the same H·v;
- examples to score: chunk c of ``chunk_size`` rows belongs to rank c mod R; the rows are gathered in order.

Results therefore depend on the number of ranks only through floating-point summation order. Collectives
that fail (another rank raised and closed its connection, or the timeout given to :func:`initialize`
passed) raise :class:`DistributedError` naming the rank, instead of hanging.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .errors import InfluenceError


class DistributedError(InfluenceError, RuntimeError):
    """A collective operation failed: usually another rank raised first (see its traceback) or timed out."""


def active() -> bool:
    """True when ``torch.distributed`` is initialized with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def shard(indices: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of ``indices`` (all of them on one process); slices are disjoint and cover all."""
    size, r = world_size(), rank()
    n = indices.shape[0]
    return indices[(n * r) // size : (n * (r + 1)) // size]


def local_device() -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def initialize(timeout_seconds: float = 600.0) -> bool:
    """Join the process group that ``torchrun`` describes in the environment (gloo on CPU, NCCL on GPU).

    Returns True if a group with more than one process is running. A collective that waits longer than
    ``timeout_seconds`` (e.g. because another rank died) raises instead of hanging.
    """
    if active() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return active()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_device())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))
    return active()


def shutdown() -> None:
    """Leave the process group (after a job; harmless when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _collective(what: str, fn, *args):
    try:
        return fn(*args)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise DistributedError(
            f"rank {rank()} of {world_size()}: {what} failed ({str(exc).splitlines()[0][:200]}); another rank "
            "probably raised first or stopped — see its error. Every rank must make the same influkit calls."
        ) from exc


def all_reduce_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; returns it."""
    if active():
        _collective("all_reduce", dist.all_reduce, tensor)
    return tensor


def barrier() -> None:
    if active():
        _collective("barrier", dist.barrier)


def broadcast_object(value):
    """Rank 0's ``value`` on every rank."""
    if not active():
        return value
    box = [value]
    _collective("broadcast", dist.broadcast_object_list, box, 0)
    return box[0]


def gather_objects(value) -> list:
    """Every rank's (picklable) ``value``, in rank order, on every rank (``[value]`` on one process)."""
    if not active():
        return [value]
    out = [None] * world_size()
    _collective("all_gather_object", dist.all_gather_object, out, value)
    return out


def gather_rows(block: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Concatenate every rank's ``block`` (rank r has ``counts[r]`` rows) in rank order, on every rank."""
    if not active():
        return block
    width = max(counts)
    padded = torch.zeros(width, *block.shape[1:], dtype=block.dtype, device=block.device)
    padded[: block.shape[0]] = block
    parts = [torch.empty_like(padded) for _ in counts]
    _collective("all_gather", dist.all_gather, parts, padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts)])
