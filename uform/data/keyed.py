"""Keyed draws (docs/design.md §4): every random draw of a step is keyed by (seed, step, stream[, item key]), so an
item draws the same whichever items share its step and whichever device or process prepares it.

Two forms: `keyed_rng`, a numpy PCG64 generator seeded by `SeedSequence([seed, step, stream, *key])` (packing),
and `words`, a counter-based stream of the same seed state (`keyed_states`) that a whole step's items draw from at
once in array calls (text corruption, media masks). This module needs numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def keyed_rng(seed: int, step: int, stream: int, *key: int) -> np.random.Generator:
    """The generator of one (seed, step, stream[, key...]): the same key gives the same draws on any machine."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, step, stream, *key])))


def keyed_states(seed: int, step: int, stream: int, keys: Sequence[int]) -> np.ndarray:
    """[len(keys), 4] uint64: the seed state of each (seed, step, stream, key), what `keyed_rng` seeds PCG64
    with (`SeedSequence([seed, step, stream, key]).generate_state(4, np.uint64)`), the hashing done for all keys
    at once in numpy (`_seed_states`), since a `SeedSequence` each costs about as much as a small item's whole
    draws. Text corruption and media masks key their counter-based streams with them (`words`)."""
    head = [w for part in (seed, step, stream) for w in _words(part)]
    entropy = [head + _words(k) for k in keys]
    out = np.zeros((len(entropy), _POOL), dtype=np.uint64)
    for length in sorted({len(e) for e in entropy}):  # rows of one length hash alike
        rows = [j for j, e in enumerate(entropy) if len(e) == length]
        out[rows] = _seed_states(np.array([entropy[j] for j in rows], dtype=np.uint32))  # [n, 4] uint64
    return out


# numpy's SeedSequence (numpy/random/bit_generator.pyx, O'Neill's seed_seq_fe design): its hashing constants.
_POOL = 4
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_MASK32 = 0xFFFFFFFF


def _words(value: int) -> list[int]:
    """A non-negative int as SeedSequence reads it: 32-bit words, least significant first (0 is one word)."""
    if value < 0:
        raise ValueError(f"keyed_states: a key must be a non-negative int, got {value}")
    out = [value & _MASK32]
    value >>= 32
    while value:
        out.append(value & _MASK32)
        value >>= 32
    return out


def _seed_states(entropy: np.ndarray) -> np.ndarray:
    """[n, 4] uint64: `SeedSequence(row).generate_state(4, np.uint64)` of each row of `entropy` [n, L] uint32,
    every row at once (the hash constants advance alike for rows of one length). uint32 arithmetic wraps, as the
    Cython original's does."""
    count, length = entropy.shape
    shift = np.uint32(16)
    const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal const
        value = value ^ np.uint32(const)
        const = (const * _MULT_A) & _MASK32
        value = value * np.uint32(const)
        return value ^ (value >> shift)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = (np.uint32(_MIX_L) * x - np.uint32(_MIX_R) * y).astype(np.uint32, copy=False)
        return result ^ (result >> shift)

    zero = np.zeros(count, dtype=np.uint32)
    pool = [hashmix(entropy[:, i] if i < length else zero) for i in range(_POOL)]
    for source in range(_POOL):
        for target in range(_POOL):
            if source != target:
                pool[target] = mix(pool[target], hashmix(pool[source]))
    for source in range(_POOL, length):
        for target in range(_POOL):
            pool[target] = mix(pool[target], hashmix(entropy[:, source]))
    const = _INIT_B
    state = np.empty((count, 2 * _POOL), dtype=np.uint32)  # four uint64 words, as eight uint32 ones
    for i in range(2 * _POOL):
        value = pool[i % _POOL] ^ np.uint32(const)
        const = (const * _MULT_B) & _MASK32
        value = value * np.uint32(const)
        state[:, i] = value ^ (value >> shift)
    return state.astype("<u4").view("<u8").astype(np.uint64)


_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def words(keys: np.ndarray, purpose: int, counters: np.ndarray) -> np.ndarray:
    """Random 64-bit words: word `counters` of stream `purpose` of each key, elementwise (keys [..., 2] uint64
    broadcast against counters [...]).

    SplitMix64 (Steele, Lea and Flood 2014, "Fast splittable pseudorandom number generators"): the key's first
    word plus an odd increment (its second word) times the counter, through Stafford's "Mix13" finaliser. Integer
    arithmetic only, so the same key gives the same words on any machine."""
    keys, counters = np.asarray(keys, dtype=np.uint64), np.asarray(counters, dtype=np.uint64)
    x: np.ndarray = (
        keys[..., 0] + (keys[..., 1] | np.uint64(1)) * ((np.uint64(purpose) << np.uint64(32)) + counters) + _GAMMA
    )
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))
