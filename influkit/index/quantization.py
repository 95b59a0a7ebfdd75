"""int8 rows of a gradient index: symmetric round-to-nearest with one float32 scale per row.

A row c (D numbers, computed in the trained parameters' dtype) is stored as D int8 values q and its scale
σ = max_j |c_j| / 127 (rounded to float32 first, and q computed with that float32 value), q_j = round(c_j / σ)
∈ [−127, 127], so that the stored row σ q differs from c by at most half a step in every entry:

    |c_j − σ q_j| ≤ σ / 2.

A query's score of the row is computed as σ · (qᵀ s̃), and its error against the unquantized score cᵀ s̃ is bounded
by Hölder's inequality, per row and per query column:

    |cᵀ s̃ − σ qᵀ s̃| = |Σ_j (c_j − σ q_j) s̃_j| ≤ (σ / 2) ‖s̃‖₁        (:func:`score_error_bound`).

(Rounding errors spread evenly and independently would make the error's typical size σ ‖s̃‖₂ / √12; that is
not a bound.) The row of a shard file is D + 4 bytes: the int8 values, then the scale's four bytes (little-endian
float32), so a shard is one (rows, D + 4) int8 array, written and renamed whole like a float shard.
"""

from __future__ import annotations

import numpy as np
import torch

LEVELS = 127  # symmetric: q ∈ [−127, 127]
SCALE_BYTES = 4  # one float32 per row


def stored_width(width: int) -> int:
    """Bytes (int8 columns) of a stored row of ``width`` numbers: the values and the scale."""
    return width + SCALE_BYTES


def quantize(rows: torch.Tensor) -> torch.Tensor:
    """(n, D + 4) int8: each row's values q = round(c / σ) and its float32 scale σ = max|c| / 127 as four bytes."""
    rows = rows.detach().cpu()
    scale = (rows.abs().amax(dim=1) / LEVELS).to(torch.float32)  # the scale actually stored
    divisor = scale.to(rows.dtype).clamp_min(torch.finfo(rows.dtype).tiny)[:, None]
    values = torch.round(rows / divisor).clamp_(-LEVELS, LEVELS).to(torch.int8)
    tail = torch.from_numpy(scale.numpy().astype("<f4").view(np.int8).reshape(-1, SCALE_BYTES))
    return torch.cat([values, tail], dim=1)


def split(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """((n, D) int8 values, (n,) float32 scales) of stored rows (a memory map or a copy)."""
    values = stored[:, :-SCALE_BYTES]
    tail = np.ascontiguousarray(stored[:, -SCALE_BYTES:].numpy())
    return values, torch.from_numpy(tail.view("<f4").reshape(-1).astype(np.float32))


def dequantize(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(n, D) σ q in ``dtype`` of stored rows."""
    values, scale = split(stored)
    return values.to(dtype) * scale.to(dtype)[:, None]


def score_error_bound(scales: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(n, k) the bound (σ_i / 2) ‖s̃_:k‖₁ on |score error| of rows with ``scales`` (n,) for query columns s̃ (D, k)."""
    return scales.to(s.dtype)[:, None] / 2 * s.abs().sum(0)[None, :]
