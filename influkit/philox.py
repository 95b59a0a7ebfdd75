"""Counter-based random words: Philox4x32-10 in exact int64 tensor arithmetic.

Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC 2011). Every word is a pure function of
(seed, stream, example id, word index): no generator state, the same bits on every device, PyTorch build and
number of processes. 32x32-bit multiplies are split into 16-bit limbs, so no product exceeds 2**48 (no signed
overflow, no floating point). Used by turn-over dropout's masks and the factored curvature's sampled labels.
"""

from __future__ import annotations

import torch

from .errors import InputError

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85


def _mulhilo(multiplier: int, word: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (high, low) 32-bit halves of ``multiplier * word`` for 32-bit words held in int64.

    With word = h·2^16 + l: P = M·l + (M·h)·2^16, each partial product < 2^48, so
    high = ((M·l >> 16) + M·h) >> 16 and low = (M·l + ((M·h mod 2^16) << 16)) mod 2^32 are exact.
    """
    low_part = multiplier * (word & _MASK16)
    high_part = multiplier * (word >> 16)
    high = ((low_part >> 16) + high_part) >> 16
    low = (low_part + ((high_part & _MASK16) << 16)) & _MASK32
    return high, low


def philox4x32(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[int, int],
    rounds: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the four 32-bit output words (int64 tensors) of Philox4x32 for broadcastable counter words.

    One round: (hi0, lo0) = M0·c0, (hi1, lo1) = M1·c2, c ← (hi1 ⊕ c1 ⊕ k0, lo1, hi0 ⊕ c3 ⊕ k1, lo0), and the
    key is bumped by the Weyl constants (W0, W1) between rounds. With 10 rounds this reproduces Random123's
    known-answer vectors; for a fixed key the map is a bijection of the 128-bit counter.
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for r in range(rounds):
        if r:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def random_words(ids: torch.Tensor, n_words: int, *, seed: int, stream: int) -> torch.Tensor:
    """Returns uniform 32-bit words (int64, shape (len(ids), n_words)), a pure function of their arguments.

    Word j of example e is output word j mod 4 of Philox4x32-10 at counter (j // 4, e mod 2^32, e >> 32,
    stream) under key (seed mod 2^32, seed >> 32 mod 2^32); ``stream`` must be below 2^32.
    """
    if not 0 <= stream <= _MASK32:
        raise InputError(f"stream must lie in [0, 2**32), got {stream}; use a smaller layer id.")
    ids = ids.to(torch.int64).reshape(-1, 1)
    blocks = -(-n_words // 4)
    block = torch.arange(blocks, dtype=torch.int64, device=ids.device).reshape(1, -1)
    zeros = torch.zeros_like(ids)
    counter = (block + zeros, ids & _MASK32, (ids >> 32) & _MASK32, zeros + stream)
    words = philox4x32(counter, (seed & _MASK32, (seed >> 32) & _MASK32))
    return torch.stack(words, dim=-1).reshape(ids.shape[0], blocks * 4)[:, :n_words]
