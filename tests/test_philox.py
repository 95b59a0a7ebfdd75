"""influkit.philox: Philox4x32 against Random123's published known-answer vectors and a pure-integer reference.

The known answers are the ``philox4x32`` lines of Random123's ``kat_vectors`` (Salmon et al., SC 2011): counter
words, key words, output words, for 7 and 10 rounds. The reference below is the specification on Python's
unbounded integers, independent of the tensor code's 16-bit limbs.
"""

from __future__ import annotations

import pytest
import torch

import influkit as ik
from influkit.philox import _mulhilo, philox4x32, random_words

M32 = 0xFFFFFFFF
PI_COUNTER, PI_KEY = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
KNOWN_ANSWERS = [  # (rounds, counter, key, output): Random123 kat_vectors, philox4x32
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (M32,) * 4, (M32, M32), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, PI_COUNTER, PI_KEY, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, PI_COUNTER, PI_KEY, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def philox_reference(ctr, key, rounds=10):
    """Philox4x32 on plain Python integers (the specification)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
    return c0, c1, c2, c3


@pytest.mark.parametrize("rounds,ctr,key,want", KNOWN_ANSWERS)
def test_known_answer_vectors(rounds, ctr, key, want):
    got = philox4x32(tuple(torch.tensor([c]) for c in ctr), key, rounds=rounds)
    assert tuple(int(w) for w in got) == want
    assert philox_reference(ctr, key, rounds) == want  # the reference is the specification


def test_mulhilo_is_exact_on_32_bit_words():
    gen = torch.Generator().manual_seed(0)
    words = torch.cat([torch.tensor([0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32]),
                       torch.randint(0, 2**32, (2000,), generator=gen, dtype=torch.int64)])
    for multiplier in (0xD2511F53, 0xCD9E8D57, M32):
        high, low = _mulhilo(multiplier, words)
        exact = [multiplier * w for w in words.tolist()]
        assert high.tolist() == [e >> 32 for e in exact] and low.tolist() == [e & M32 for e in exact]


def test_batched_counters_equal_the_reference_and_are_distinct():
    gen = torch.Generator().manual_seed(1)
    counter = tuple(torch.randint(0, 2**32, (512,), generator=gen, dtype=torch.int64) for _ in range(4))
    key = (0x12345678, 0x9ABCDEF0)
    out = torch.stack(philox4x32(counter, key), dim=1)
    for i in range(0, 512, 37):
        assert tuple(out[i].tolist()) == philox_reference(tuple(int(c[i]) for c in counter), key)
    # a bijection of the counter for a fixed key: distinct counters, distinct outputs
    consecutive = torch.stack(philox4x32((torch.arange(4096), *(torch.zeros(4096, dtype=torch.int64),) * 3), key), 1)
    assert len({tuple(row) for row in consecutive.tolist()}) == 4096
    assert ((out >= 0) & (out <= M32)).all()


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_random_words_equal_pure_python_integer_hash(seed):
    ids = torch.tensor([0, 1, 17, 2**31 + 5, 2**33 + 1])
    stream = 4 * 3 + 0
    words = random_words(ids, 10, seed=seed, stream=stream)
    assert words.dtype == torch.int64 and words.shape == (5, 10)
    for row, e in enumerate(ids.tolist()):
        for j in range(10):
            ctr = (j // 4, e & M32, e >> 32, stream)
            want = philox_reference(ctr, (seed & M32, (seed >> 32) & M32))[j % 4]
            assert int(words[row, j]) == want


def test_random_words_are_a_pure_function_of_their_arguments():
    ids = torch.tensor([3, 2**32 + 3, 5])
    first = random_words(ids, 7, seed=11, stream=2)
    assert torch.equal(first, random_words(ids.clone(), 7, seed=11, stream=2))  # no hidden state
    assert torch.equal(first, random_words(ids, 12, seed=11, stream=2)[:, :7])  # a longer draw extends it
    assert torch.equal(first[[2, 0]], random_words(ids[[2, 0]], 7, seed=11, stream=2))  # per example, any order
    assert not torch.equal(first[0], first[1])  # the id's high word counts
    for other in (random_words(ids, 7, seed=12, stream=2), random_words(ids, 7, seed=11, stream=3)):
        assert (other != first).all()
    bits = (random_words(torch.arange(2000), 8, seed=0, stream=0)[..., None] >> torch.arange(32)) & 1
    assert abs(bits.double().mean().item() - 0.5) < 0.005  # 512,000 bits, σ of the mean ≈ 0.0007


def test_stream_outside_32_bits_is_refused():
    with pytest.raises(ik.InputError, match="stream must lie in"):
        random_words(torch.arange(3), 4, seed=0, stream=2**32)
    with pytest.raises(ik.InputError, match="stream must lie in"):
        random_words(torch.arange(3), 4, seed=0, stream=-1)
