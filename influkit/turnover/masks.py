"""Instance-specific dropout masks that are regenerated on demand, never stored.

Every bit is a pure function of (seed, layer id, example id, unit index), computed with the counter-based
generator Philox4x32-10 (:mod:`influkit.philox`) (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) written in
int64 tensor arithmetic on 32-bit words. No product ever exceeds 2**48 (32x32-bit multiplies are split into
16-bit limbs), so there is no signed overflow and no floating point: the bits are identical on every device
and every PyTorch build. A unit is kept when its 32-bit word is below ``round(keep_rate * 2**32)``.

Two generators share the interface ``keep(ids, layer_id, n_units, keep_rate) -> bool (len(ids), n_units)``:

- :class:`VolatileMasks` (Kobayashi et al. 2020, §3.3): one Philox word per (example, unit); memory is
  O(B·d) for a batch of B examples, nothing persists.
- :class:`HashedMasks` (appendix C): a codebook of K masks with keep rate q^(1/k) (itself volatile, cached
  per width), and k hashed rows per example whose logical AND keeps a unit with probability q. Memory O(K·d).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InputError
from ..philox import random_words

# Counter word 3 separates the streams of one seed: layer id times 4 plus a purpose tag.
_TAG_VOLATILE = 0
_TAG_CODEBOOK = 1
_TAG_ROWS = 2


def keep_threshold(keep_rate: float) -> int:
    """Returns the integer threshold t = round(keep_rate · 2^32): a uniform 32-bit word w keeps iff w < t."""
    if not 0.0 < keep_rate < 1.0:
        raise InputError(f"keep_rate must lie strictly between 0 and 1, got {keep_rate}.")
    return round(keep_rate * 2**32)


def _check_ids(ids: torch.Tensor) -> torch.Tensor:
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"example ids must be a 1-D integer tensor, got dtype {ids.dtype}, shape {tuple(ids.shape)}.")
    if ids.numel() and int(ids.min()) < 0:
        raise InputError("example ids must be non-negative; pass indices into the training data.")
    return ids.to(torch.int64)


@dataclass(frozen=True)
class VolatileMasks:
    """Per-example dropout masks generated from (seed, layer id, example id, unit) on every call."""

    seed: int = 0

    def keep(self, ids: torch.Tensor, layer_id: int, n_units: int, keep_rate: float) -> torch.Tensor:
        """Returns the boolean keep mask (len(ids), n_units) on ``ids.device``; each bit is Bernoulli(keep_rate).

        Bit (e, j) = [random_words(e)_j < round(keep_rate·2^32)] in the stream 4·layer_id of ``seed``.
        """
        ids = _check_ids(ids)
        words = random_words(ids, n_units, seed=self.seed, stream=4 * layer_id + _TAG_VOLATILE)
        return words < keep_threshold(keep_rate)

    def state_bytes(self) -> int:
        """Returns the bytes held between calls: always 0 (masks are volatile)."""
        return 0


@dataclass
class HashedMasks:
    """Per-example masks composed as the AND of k rows of a shared codebook of K masks (appendix C).

    The codebook is split into k blocks of K // k rows; hash j of an example picks one row of block j, so the
    k rows are always distinct and an example's keep rate is exactly q in expectation:
    P(keep) = (q^(1/k))^k = q. Distinct masks available: (K // k)^k. The codebook rows are themselves
    volatile masks (stream tag 1, independent of the layer), cached per (width, keep rate, device), so
    one codebook serves every layer of that width; row hashes use the layer id, so layers differ.
    """

    seed: int = 0
    codebook_size: int = 1024
    n_hashes: int = 3
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.n_hashes < 1 or self.codebook_size < self.n_hashes:
            raise InputError(
                f"need 1 <= n_hashes <= codebook_size, got n_hashes={self.n_hashes}, "
                f"codebook_size={self.codebook_size}."
            )

    def codebook(self, n_units: int, keep_rate: float, device: torch.device | str = "cpu") -> torch.Tensor:
        """Returns the boolean codebook (codebook_size, n_units) whose bits are Bernoulli(keep_rate^(1/k))."""
        key = (n_units, keep_rate, str(torch.device(device)))
        if key not in self._cache:
            rows = torch.arange(self.codebook_size, dtype=torch.int64, device=device)
            words = random_words(rows, n_units, seed=self.seed, stream=_TAG_CODEBOOK)
            self._cache[key] = words < keep_threshold(keep_rate ** (1.0 / self.n_hashes))
        return self._cache[key]

    def rows(self, ids: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Returns the codebook rows (len(ids), k) of each example: row j = j·(K//k) + (word_j mod K//k)."""
        ids = _check_ids(ids)
        block = self.codebook_size // self.n_hashes
        words = random_words(ids, self.n_hashes, seed=self.seed, stream=4 * layer_id + _TAG_ROWS)
        offsets = torch.arange(self.n_hashes, dtype=torch.int64, device=ids.device) * block
        return words % block + offsets

    def keep(self, ids: torch.Tensor, layer_id: int, n_units: int, keep_rate: float) -> torch.Tensor:
        """Returns the boolean keep mask (len(ids), n_units): the AND of the example's k codebook rows."""
        book = self.codebook(n_units, keep_rate, ids.device)
        picked = book[self.rows(ids, layer_id)]  # (B, k, n_units)
        return picked.all(dim=1)

    def state_bytes(self) -> int:
        """Returns the bytes held by the cached codebooks (K·d bytes per width in use)."""
        return sum(book.numel() * book.element_size() for book in self._cache.values())
