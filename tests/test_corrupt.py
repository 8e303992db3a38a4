"""Text span corruption (docs/design.md §5, masked text): exact coverage, the MASK / random / kept split."""

from __future__ import annotations

import hashlib
from statistics import NormalDist

import numpy as np
import pytest

from uform import vocab
from uform.config import Masking
from uform.data.corrupt import corrupt_text, cover_spans
from uform.data.keyed import keyed_rng, keyed_states, words
from uform.enums import Modality


def runs(mask: np.ndarray) -> np.ndarray:
    """Lengths of the maximal runs of True in a 1-D bool mask."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)


# --------------------------------------------------------------------------------------------------
# cover_spans


@pytest.mark.parametrize("mean_span", [1.0, 3.0, 16.0, 100.0])
def test_cover_spans_exact_count(mean_span: float) -> None:
    rng = np.random.default_rng(int(mean_span))
    for length in [*range(0, 40), 63, 64, 65, 200, 1000]:
        counts = {0, length, length // 2, 1 if length else 0, max(length - 1, 0), int(rng.integers(0, length + 1))}
        for count in sorted(counts):
            covered = cover_spans(length, count, mean_span, rng)
            assert covered.dtype == bool and covered.shape == (length,)
            assert int(covered.sum()) == count, (length, count)


def test_cover_spans_draws_are_pinned() -> None:
    """The masks and the generator's state after them (two words taken for the key), as the counter-keyed
    layout of 2026-12-02 draws them: a change here changes every run's corruption from that version on."""
    digest = hashlib.sha256()
    cases = [(200, 30, 16.0, 1), (200, 30, 3.0, 2), (7, 6, 16.0, 3), (50, 49, 1.0, 4), (300, 45, 0.5, 5)]
    for length, count, mean, seed in [*cases, (1, 1, 16.0, 6), (10, 0, 16.0, 7)]:
        rng = np.random.default_rng(seed)
        mask = cover_spans(length, count, mean, rng)
        digest.update(np.packbits(mask).tobytes())
        digest.update(rng.integers(0, 1 << 62).tobytes())
    assert digest.hexdigest()[:32] == "ea7286cbdc297bb367d84f4de3382038"


def test_cover_spans_deterministic() -> None:
    a = cover_spans(500, 120, 8.0, np.random.default_rng(42))
    b = cover_spans(500, 120, 8.0, np.random.default_rng(42))
    c = cover_spans(500, 120, 8.0, np.random.default_rng(43))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("mean_span", [3.0, 16.0])
def test_cover_spans_mean_span(mean_span: float) -> None:
    """Runs of covered positions in long segments average about token_mean_span (SpanBERT's geometric spans).

    At 10 % coverage neighbouring spans rarely merge or overlap, so the mean run is close to the mean span.
    """
    rng = np.random.default_rng(2024)
    lengths = np.concatenate([runs(cover_spans(8192, 819, mean_span, rng)) for _ in range(8)])
    assert len(lengths) > 200
    assert 0.8 * mean_span <= lengths.mean() <= 1.3 * mean_span, lengths.mean()
    if mean_span > 1:
        assert lengths.min() == 1 and lengths.max() > 2 * mean_span  # spread, not a fixed span


PROFILE_ALPHA = 1e-4
"""The chance that a correct `cover_spans` fails a position-profile case at some seed (Bonferroni over the
case's positions)."""


@pytest.mark.parametrize(
    "length, probability, mean_span",
    [(20, 0.15, 16.0), (100, 0.15, 16.0), (7, 0.3, 3.0), (40, 0.5, 4.0), (33, 0.15, 1.0)],
)
def test_cover_spans_every_position_equally_likely(length: int, probability: float, mean_span: float) -> None:
    """Over independent keyed draws, each position is covered with chance exactly k / n: its count over T
    draws is Binomial(T, k / n), so every position must lie within z binomial standard errors of T k / n,
    z set by PROFILE_ALPHA over the n positions (issue 10: position 0 of 20-byte texts was covered 41% of the
    time, the last byte 1%)."""
    trials = 20_000
    count = round(probability * length)
    share = count / length
    # One step of `trials` segments, each its own item's keyed stream (the trainer's path, all drawn at once).
    masking = Masking(token_mask_probability=probability, token_mean_span=mean_span)
    tokens = np.zeros((trials, length), dtype=np.int64)
    keys = keyed_states(31, 1, 2, list(range(trials)))[:, :2]
    _, covered = corrupt_text(tokens, [(t, 0, length) for t in range(trials)], masking, keys)
    assert (covered.sum(axis=1) == count).all()
    hits = covered.sum(axis=0).astype(np.float64)
    z = NormalDist().inv_cdf(1 - PROFILE_ALPHA / (2 * length))
    tolerance = z * np.sqrt(share * (1 - share) / trials)
    worst = int(np.argmax(np.abs(hits / trials - share)))
    assert abs(hits[worst] / trials - share) <= tolerance, (worst, hits[worst] / trials, share, tolerance)


def test_cover_spans_spans_are_geometric_before_clipping() -> None:
    """Where spans are rarely cut (long segments, low coverage), a run's length is geometric with the mean
    span: P(length 1) = 1 / mean and P(length >= 2 mean) = (1 - 1/mean)^(2 mean - 1), each within five
    binomial standard errors (only a segment's last span and the one the circle's cut splits are not whole
    draws: two in about 125 here)."""
    mean = 4.0
    rng = np.random.default_rng(8)
    lengths = np.concatenate([runs(cover_spans(20_000, 500, mean, rng)) for _ in range(40)])
    for observed, expected in (
        (float(np.mean(lengths == 1)), 1 / mean),
        (float(np.mean(lengths >= 2 * mean)), (1 - 1 / mean) ** (2 * mean - 1)),
    ):
        error = np.sqrt(expected * (1 - expected) / len(lengths))
        assert abs(observed - expected) <= 5 * error, (observed, expected)


def test_cover_spans_mean_one_is_scattered() -> None:
    covered = cover_spans(10_000, 1000, 1.0, np.random.default_rng(1))
    assert runs(covered).mean() < 1.2


# --------------------------------------------------------------------------------------------------
# corrupt_text


def random_spans(rng: np.random.Generator, rows: int, columns: int) -> list[tuple[int, int, int]]:
    """Disjoint (row, first column, length) spans, as content parts of packed segments (gaps between)."""
    spans = []
    for r in range(rows):
        c = 0
        while c < columns:
            c += int(rng.integers(0, 3))  # a prefix or padding
            n = int(rng.integers(0, columns - c + 1)) if c < columns else 0
            if rng.random() < 0.3:
                n = min(n, int(rng.integers(0, 4)))
            if c + n > columns:
                break
            spans.append((r, c, n))
            c += n
            if rng.random() < 0.2:
                break
    return spans


def generators(seed: int, spans: list) -> np.ndarray:
    """One key per span ([S, 2] uint64), as the trainer keys one stream per item."""
    return np.random.default_rng(seed).integers(0, 2**64, size=(len(spans), 2), dtype=np.uint64)


MASKINGS = [
    (0.15, 3.0, 0.8, 0.1),
    (0.5, 1.0, 0.8, 0.1),
    (1.0, 16.0, 0.8, 0.1),
    (0.3, 4.0, 1.0, 0.0),
    (0.3, 4.0, 0.0, 1.0),
    (0.3, 4.0, 0.0, 0.0),
    (0.45, 2.0, 0.5, 0.5),
    (0.07, 8.0, 0.33, 0.33),
]


@pytest.mark.parametrize("probability, mean_span, replace, random", MASKINGS)
@pytest.mark.parametrize("seed", range(12))
def test_corrupt_text_invariants(
    probability: float, mean_span: float, replace: float, random: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rows, columns = int(rng.integers(1, 5)), int(rng.integers(4, 200))
    tokens = rng.integers(0, 256, size=(rows, columns)).astype(np.int64)
    spans = random_spans(rng, rows, columns)
    inside = np.zeros((rows, columns), dtype=bool)
    for r, c0, n in spans:
        inside[r, c0 : c0 + n] = True
    tokens[~inside] = rng.choice([vocab.PAD, vocab.MODALITY_MARKER[Modality.Text]], size=int((~inside).sum()))
    masking = Masking(
        token_mask_probability=probability, token_mean_span=mean_span, replace_fraction=replace, random_fraction=random
    )
    before = tokens.copy()
    inputs, covered = corrupt_text(tokens, spans, masking, generators(seed + 100, spans))
    assert np.array_equal(tokens, before), "corrupt_text must not write into its input"
    assert inputs.shape == tokens.shape and covered.shape == tokens.shape and covered.dtype == bool

    # Exactly round(p * n) covered positions in each span, none outside the spans.
    assert not np.any(covered & ~inside)
    for r, c0, n in spans:
        assert int(covered[r, c0 : c0 + n].sum()) == round(probability * n), (r, c0, n)

    # Uncovered positions keep their token; covered ones show MASK or a byte.
    assert np.array_equal(inputs[~covered], tokens[~covered])
    shown = inputs[covered]
    assert np.all((shown == vocab.MASK) | ((shown >= 0) & (shown < vocab.BYTES)))
    # Per span: the original text never holds MASK, so MASK counts the replaced share exactly (its share of the
    # span's k covered positions, rounded down or up); a random byte may equal the original (and a kept byte
    # always does), so changed bytes bound the random share from below.
    for r, c0, n in spans:
        part = covered[r, c0 : c0 + n]
        k = int(part.sum())
        seen, original = inputs[r, c0 : c0 + n][part], tokens[r, c0 : c0 + n][part]
        n_mask = int((seen == vocab.MASK).sum())
        assert int(np.floor(replace * k)) <= n_mask <= int(np.ceil(replace * k)), (k, n_mask)
        n_changed = int(((seen != vocab.MASK) & (seen != original)).sum())
        assert n_changed <= min(int(np.ceil(random * k)), k - n_mask)


def test_corrupt_text_split_statistics() -> None:
    """On a big step the random share shows up: about (255/256) of round(random * P) bytes change."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 256, size=(8, 2048)).astype(np.int64)
    spans = [(r, 0, 2048) for r in range(8)]
    masking = Masking(token_mask_probability=0.15, token_mean_span=16.0, replace_fraction=0.8, random_fraction=0.1)
    inputs, covered = corrupt_text(tokens, spans, masking, generators(0, spans))
    total = int(covered.sum())
    assert total == 8 * round(0.15 * 2048)
    changed = int(((inputs != vocab.MASK) & (inputs != tokens)).sum())
    expected = 0.1 * total * 255 / 256
    assert abs(changed - expected) < 5 * np.sqrt(expected / 256) + len(spans)
    assert abs(int((inputs == vocab.MASK).sum()) - 0.8 * total) <= len(spans)


def test_corrupt_text_shares_are_exact_in_expectation_on_short_items() -> None:
    """Three-byte captions: 0.8 x 3 and 0.1 x 3 are no whole numbers, yet the shares come out right on average
    (rounding each item to nearest would show no random byte at all)."""
    tokens = np.full((1, 4000), 65, dtype=np.int64)
    spans = [(0, 4 * i, 3) for i in range(1000)]
    masking = Masking(token_mask_probability=1.0, token_mean_span=1.0, replace_fraction=0.8, random_fraction=0.1)
    inputs, covered = corrupt_text(tokens, spans, masking, generators(3, spans))
    assert int(covered.sum()) == 3000
    assert abs(int((inputs == vocab.MASK).sum()) - 2400) < 100
    assert abs(int(((inputs != vocab.MASK) & (inputs != 65)).sum()) - 300 * 255 / 256) < 60


def test_corrupt_text_deterministic() -> None:
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, 256, size=(3, 300)).astype(np.int64)
    spans = [(0, 1, 299), (1, 1, 100), (1, 102, 150), (2, 2, 10)]
    masking = Masking(token_mask_probability=0.2, token_mean_span=5.0, replace_fraction=0.8, random_fraction=0.1)
    a = corrupt_text(tokens, spans, masking, generators(77, spans))
    b = corrupt_text(tokens, spans, masking, generators(77, spans))
    c = corrupt_text(tokens, spans, masking, generators(78, spans))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def test_corrupt_text_a_span_draws_alone() -> None:
    """A span's corruption depends on its own generator only: the same span among other spans, or moved to
    another row and column, comes out the same (what makes a step the same for any number of processes)."""
    rng = np.random.default_rng(4)
    text = rng.integers(0, 256, size=120)
    masking = Masking(token_mask_probability=0.3, token_mean_span=4.0, replace_fraction=0.8, random_fraction=0.1)
    alone = np.full((1, 130), vocab.PAD, dtype=np.int64)
    alone[0, 1:121] = text
    keyed = generators(11, [0, 0, 0])
    a, covered_a = corrupt_text(alone, [(0, 1, 120)], masking, keyed[1:2])
    crowded = rng.integers(0, 256, size=(3, 300)).astype(np.int64)
    crowded[2, 150:270] = text
    spans = [(0, 0, 200), (2, 150, 120), (1, 5, 90)]
    b, covered_b = corrupt_text(crowded, spans, masking, keyed)
    assert np.array_equal(a[0, 1:121], b[2, 150:270])
    assert np.array_equal(covered_a[0, 1:121], covered_b[2, 150:270])


def test_corrupt_text_no_spans() -> None:
    tokens = np.full((2, 8), vocab.PAD, dtype=np.int64)
    masking = Masking(token_mask_probability=0.15, token_mean_span=16.0, replace_fraction=0.8, random_fraction=0.1)
    inputs, covered = corrupt_text(tokens, [], masking, [])
    assert not covered.any() and np.array_equal(inputs, tokens)
    inputs, covered = corrupt_text(tokens, [(0, 1, 0), (1, 0, 3)], masking, generators(0, [0, 0]))
    assert not covered.any()  # round(0.15 * 3) == 0


def _splitmix64(seed: int, count: int, skip: int = 0) -> list[int]:
    """Vigna's SplitMix64, as its reference C code steps it: the state advanced by the golden gamma, then mixed
    (`skip` outputs passed over by advancing the state skip gammas at once, which is what stepping does)."""
    out, mask = [], (1 << 64) - 1
    state = (seed + skip * 0x9E3779B97F4A7C15) & mask
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


def test_words_are_splitmix64() -> None:
    """A key whose increment is SplitMix64's gamma gives SplitMix64's own sequence from the key's first word (its
    well-known first outputs from seed 0 among them); the stream of a purpose starts 2^32 words further on."""
    gamma = 0x9E3779B97F4A7C15
    assert words(np.array([0, gamma], dtype=np.uint64), 0, np.arange(3)).tolist() == [
        0xE220A8397B1DCDAF,
        0x6E789E6AA1B965F4,
        0x06C45D188009454F,
    ]
    rng = np.random.default_rng(0)
    for seed in rng.integers(0, 2**64, size=5, dtype=np.uint64).tolist():
        key = np.array([seed, gamma], dtype=np.uint64)
        assert words(key, 0, np.arange(6)).tolist() == _splitmix64(seed, 6)
        assert _splitmix64(seed, 3, skip=3) == _splitmix64(seed, 6)[3:]
        assert words(key, 1, np.arange(2)).tolist() == _splitmix64(seed, 2, skip=1 << 32)


def test_corrupt_text_draws_are_pinned() -> None:
    """A step's inputs and covered positions from fixed keys, as the counter-keyed draws of 2026-12-02 give them:
    a change here changes every run's corruption from that version on."""
    rng = np.random.default_rng(12)
    tokens = rng.integers(0, 256, size=(3, 300)).astype(np.int64)
    spans = [(0, 1, 299), (1, 1, 100), (1, 102, 150), (2, 2, 10), (2, 20, 3)]
    masking = Masking(token_mask_probability=0.2, token_mean_span=5.0, replace_fraction=0.8, random_fraction=0.1)
    keys = keyed_states(42, 7, 2, [11, 12, 13, 14, 15])[:, :2]
    inputs, covered = corrupt_text(tokens, spans, masking, keys)
    digest = hashlib.sha256(inputs.astype("<i8").tobytes() + np.packbits(covered).tobytes()).hexdigest()
    assert digest[:32] == "e4b479e3a463bb4ed51d6170e51bead8"


def test_keyed_states_are_the_keyed_generators_seeds() -> None:
    """The states hashed at once in numpy are numpy's own SeedSequence states, what `keyed_rng` seeds PCG64 with,
    state for state: keys of every word count (0, one word, 128-bit digests, beyond), steps past 32 bits, any
    stream."""
    rng = np.random.default_rng(5)
    digests = [int.from_bytes(rng.bytes(16), "little") for _ in range(40)]
    keys = [0, 1, 2**32 - 1, 2**32, 2**64 + 3, 2**128 - 1, 2**160 + 7, *digests, digests[0]]
    for seed, step, stream in ((0, 0, 0), (42, 7, 2), (2**40 + 1, 123_456_789_012, 3), (11, 2**32, 1)):
        states = keyed_states(seed, step, stream, keys)
        assert states.shape == (len(keys), 4) and states.dtype == np.uint64
        for key, state in zip(keys, states, strict=True):
            expected = np.random.SeedSequence([seed, step, stream, key]).generate_state(4, np.uint64)
            assert np.array_equal(state, expected), (seed, step, stream, key)
            seeded = keyed_rng(seed, step, stream, key).bit_generator.seed_seq.generate_state(4, np.uint64)
            assert np.array_equal(state, seeded)
    assert keyed_states(1, 2, 3, []).shape == (0, 4)
    with pytest.raises(ValueError, match="non-negative"):
        keyed_states(1, 2, 3, [-1])


def test_a_huge_mean_span_covers_one_run_at_once() -> None:
    """A mean span far past any segment draws one span, cut to the count: one covered run around the circle, and no
    table of the geometric law as long as the mean (it stops past the step's longest count)."""
    masking = Masking(token_mask_probability=0.5, token_mean_span=1e12, replace_fraction=0.8, random_fraction=0.1)
    tokens = np.zeros((3, 1000), dtype=np.int64)
    _, covered = corrupt_text(tokens, [(0, 0, 1000), (1, 0, 999), (2, 0, 7)], masking, generators(8, [0, 0, 0]))
    for r, n in enumerate((1000, 999, 7)):
        row = covered[r, :n]
        assert row.sum() == round(0.5 * n)
        assert len(runs(np.roll(row, -int(np.argmin(row))))) == 1  # one run, once turned past a free position
