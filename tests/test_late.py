"""Late interaction: MaxSim against a brute force, the term against a naive per-pair reference, sides,
spans and capacities through packing, and the term through the network and the trainer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import COLUMNS, ROWS, SEGMENTS, make_config, naive_row_loss, pair_relations, snapshot
from conftest import TEXTS as CAPTIONS

import uform
from uform import (
    Arena,
    BatchShape,
    Edges,
    LateInteraction,
    LateInteractionSide,
    Modality,
    Objective,
    PairLossForm,
    Relations,
    Schedule,
    TrainerStepConfig,
    TrainerStepStats,
)
from uform.config import resolve
from uform.data.batch import prepare
from uform.losses import late
from uform.losses.late import (
    block_layout,
    chunk_elements,
    late_interaction_term,
    maxsim,
    maxsim_chunk,
    maxsim_geometry,
    maxsim_row,
    scatter_rows,
)
from uform.model.inputs import to_device
from uform.serve import Model

FORMS = [PairLossForm.Sigmoid, PairLossForm.Balanced, PairLossForm.Ranked]
Q, D, N, QD = (
    LateInteractionSide.Query,
    LateInteractionSide.Document,
    LateInteractionSide.None_,
    LateInteractionSide.QueryAndDocument,
)


def _unit(rows: int, width: int, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    return (x / x.norm(dim=1, keepdim=True)).float()


# --------------------------------------------------------------------------------------------------
# MaxSim


def brute_maxsim(queries: torch.Tensor, documents: torch.Tensor, document_of: torch.Tensor, columns: int):
    """The dense [Qt, Dt] similarity, masked per column, reduced by torch.max (whose gradient goes to the
    argmax); an empty column scores 0."""
    similarity = queries @ documents.T  # [Qt, Dt]
    out = []
    for d in range(columns):
        mine = document_of == d
        if not bool(mine.any()):
            out.append(queries.new_zeros(queries.shape[0]))
            continue
        out.append(similarity[:, mine].max(dim=1).values)
    return torch.stack(out, dim=1)  # [Qt, Dd]


def _maxsim_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    queries = _unit(11, 8, g)
    documents = _unit(17, 8, g)
    columns = 5
    # Column 3 stays empty; tokens tagged `columns` are capacity padding.
    document_of = torch.tensor([0, 0, 1, 5, 2, 2, 2, 0, 4, 4, 1, 5, 5, 2, 0, 4, 1])
    return queries, documents, document_of, columns


@pytest.mark.parametrize("chunk", [None, 1, 3, 4, 11, 100])
def test_maxsim_matches_the_brute_force_forward_and_backward(chunk) -> None:
    queries, documents, document_of, columns = _maxsim_case()
    upstream = torch.randn(11, columns, generator=torch.Generator().manual_seed(5))
    grads = []
    values = []
    for fn in (
        lambda q, d: maxsim(q, d, document_of, columns, chunk),
        lambda q, d: brute_maxsim(q, d, document_of, columns),
    ):
        q = queries.clone().requires_grad_(True)
        d = documents.clone().requires_grad_(True)
        out = fn(q, d)
        (out * upstream).sum().backward()
        values.append(out.detach())
        grads.append((q.grad, d.grad))
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-6)
    assert torch.equal(values[0][:, 3], torch.zeros(11)), "an empty column scores 0"
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-6)
    padding = document_of == columns
    assert torch.equal(grads[0][1][padding], torch.zeros(int(padding.sum()), 8)), "padding takes no gradient"


def test_maxsim_sends_a_tie_to_the_lowest_token() -> None:
    queries = torch.tensor([[1.0, 0.0]], requires_grad=True)
    documents = torch.tensor([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], requires_grad=True)
    out = maxsim(queries, documents, torch.tensor([0, 0, 0]), 1)
    out.sum().backward()
    assert out.item() == 1.0
    assert documents.grad is not None
    assert torch.equal(documents.grad, torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]))


def test_maxsim_chunks_stay_bounded_at_the_reference_geometry() -> None:
    """At the reference geometry (docs/design.md §1: 64 x 1024 rows, 256 segments, span 64) a chunk holds at most 2^25 floats (2^27 on
    CUDA) in any intermediate: the block layout's 4336 blocks of 16 slots (65536 tokens, each of 256 columns padded up to
    whole blocks) and a grid of 64 blocks per column (1023 tokens at most past a prefix)."""
    late = resolve(
        uform.TrainerInitVramConfig(
            depth=12,
            hidden=512,
            batch=BatchShape(max_rows_per_device=64, max_segments_per_device=256, max_columns_per_row=1024),
            late_interaction=LateInteraction(weight=1.0),
            schedule=uform.Schedule(steps=10),
        )
    ).late_interaction
    qt, dt, dd, width = (
        late.max_query_tokens_per_device,
        late.max_document_tokens_per_device,
        late.max_documents_per_device,
        late.width,
    )
    assert (qt, dt, dd, width) == (16384, 65536, 256, 128)
    assert maxsim_geometry(dt, dd, 16, 1023) == (4336, 64)
    row = maxsim_row(dt, dd, width, 16, 1023)
    chunk = maxsim_chunk(qt, row)
    assert row == 4336 * 16 and chunk * row <= 1 << 25
    assert math.ceil(qt / chunk) == 34
    cuda = maxsim_chunk(qt, row, chunk_elements(torch.device("cuda")))  # 512 MiB: a quarter of the chunks
    assert cuda * row <= 1 << 27 and math.ceil(qt / cuda) == 9


def reference_layout(document_of: list[int], columns: int, block: int) -> tuple[list[int], list[list[int]], list[bool]]:
    """The block layout written out: each column's tokens in token order, then copies of its last token up to
    a whole block; columns one after the other; unused slots Dt; the grid repeats a column's last block."""
    slot_token: list[int] = []
    grid: list[list[int]] = []
    firsts, counts = [], []
    for d in range(columns):
        mine = [u for u, c in enumerate(document_of) if c == d]
        firsts.append(len(slot_token) // block)
        counts.append(-(-len(mine) // block))
        slot_token += mine + [mine[-1]] * (-len(mine) % block) if mine else []
    blocks, width = maxsim_geometry(len(document_of), columns, block)
    assert len(slot_token) <= blocks * block
    slot_token += [len(document_of)] * (blocks * block - len(slot_token))
    for first, count in zip(firsts, counts, strict=True):
        grid.append([min(first + min(k, max(count - 1, 0)), blocks - 1) for k in range(width)])
    return slot_token, grid, [count == 0 for count in counts]


# Column lengths 5, 0 (empty), 4, 8, 1, 13, 0, 3 with padding between and after; at block 4 these are a column
# longer than a block, one exactly a block, one that ends exactly on a block boundary after two, one of a single
# token and one of three blocks and a part; the shuffled version tags the same tokens out of order.
LENGTHS = [5, 0, 4, 8, 1, 13, 0, 3]
CONTIGUOUS = [c for c, n in enumerate(LENGTHS) for _ in range(n)] + [len(LENGTHS)] * 6
SHUFFLED = [CONTIGUOUS[i] for i in np.random.default_rng(4).permutation(len(CONTIGUOUS))]


@pytest.mark.parametrize("block", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("document_of", [CONTIGUOUS, SHUFFLED], ids=["contiguous", "shuffled"])
def test_block_layout_places_every_column_in_whole_blocks(block: int, document_of: list[int]) -> None:
    columns = len(LENGTHS)
    layout = block_layout(torch.tensor(document_of), columns, block)
    slot_token, grid, empty = reference_layout(document_of, columns, block)
    assert layout.slot_token.tolist() == slot_token
    assert layout.grid.tolist() == grid
    assert layout.empty.tolist() == empty == [n == 0 for n in LENGTHS]
    # The grid narrows to the longest column when told; too small a bound is refused (checked in eager CPU calls).
    tight = block_layout(torch.tensor(document_of), columns, block, longest=max(LENGTHS))
    assert tight.grid.shape == (columns, -(-max(LENGTHS) // block))
    assert torch.equal(tight.grid, layout.grid[:, : tight.grid.shape[1]])
    with pytest.raises(ValueError, match="longest"):
        block_layout(torch.tensor(document_of), columns, block, longest=max(LENGTHS) - 1)


@pytest.mark.parametrize("block", [2, 3, 4])
def test_block_capacity_holds_the_worst_layout(block: int) -> None:
    """Nb = floor((Dt + Dd (B - 1)) / B) holds every column padded to whole blocks, e.g. Dd single tokens."""
    for lengths in ([1] * 7 + [0] * 3, [1] * 10, [3, 3, 3, 1], [10]):
        document_of = [c for c, n in enumerate(lengths) for _ in range(n)]
        dt = len(document_of)
        used = sum(-(-n // block) for n in lengths)
        assert used <= maxsim_geometry(dt, len(lengths), block)[0]
        layout = block_layout(torch.tensor(document_of), len(lengths), block)
        assert sorted(set(layout.slot_token.tolist()) - {dt}) == list(range(dt))


def _long_case(document_of: list[int], width: int = 6, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    queries = _unit(9, width, g)
    queries[7:] = 0  # capacity padding, zeroed as the network zeroes it: every similarity ties at 0
    documents = _unit(len(document_of), width, g)
    documents[torch.tensor(document_of) == len(LENGTHS)] = 0
    return queries, documents, torch.tensor(document_of), len(LENGTHS)


def _forward_backward(fn, queries, documents, upstream):
    q = queries.clone().requires_grad_(True)
    d = documents.clone().requires_grad_(True)
    out = fn(q, d)
    (out * upstream).sum().backward()
    return out.detach(), q.grad, d.grad


@pytest.mark.parametrize("block", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("longest", [None, 13])
@pytest.mark.parametrize("chunk", [None, 2])
@pytest.mark.parametrize("document_of", [CONTIGUOUS, SHUFFLED], ids=["contiguous", "shuffled"])
def test_maxsim_blocks_match_the_brute_force(block: int, longest, chunk, document_of: list[int]) -> None:
    """Columns longer than a block, exactly a block, ending on a block boundary, empty, padding, padded (tying)
    query tokens, tags in and out of order: forward and both gradients equal the brute force."""
    queries, documents, of, columns = _long_case(document_of)
    upstream = torch.randn(9, columns, generator=torch.Generator().manual_seed(2))
    mine = _forward_backward(
        lambda q, d: maxsim(q, d, of, columns, chunk, longest=longest, block=block), queries, documents, upstream
    )
    theirs = _forward_backward(lambda q, d: brute_maxsim(q, d, of, columns), queries, documents, upstream)
    torch.testing.assert_close(mine[0], theirs[0], rtol=0, atol=1e-6)
    assert torch.equal(mine[0][:, [1, 6]], torch.zeros(9, 2)), "an empty column scores 0"
    torch.testing.assert_close(mine[1], theirs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine[2], theirs[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", [1, 2, 4])
def test_a_tie_across_blocks_goes_to_the_lowest_token(block: int) -> None:
    """Column 0's best vector sits at tokens 1, 3 and 5 (different blocks for block 1 and 2, one block for 4)
    and column 1's at 7 and 8: each query's gradient reaches the first of them only."""
    e0, e1 = [1.0, 0.0], [0.0, 1.0]
    half = [0.6, 0.8]
    documents = torch.tensor([half, e0, half, e0, half, e0, e1, e1, e1], requires_grad=True)
    document_of = torch.tensor([0, 0, 0, 0, 0, 0, 2, 1, 1])
    queries = torch.tensor([e0, e1])
    out = maxsim(queries, documents, document_of, 2, block=block)
    assert torch.equal(out, torch.tensor([[1.0, 0.0], [0.8, 1.0]]))
    out.sum().backward()
    assert documents.grad is not None
    expected = torch.zeros(9, 2)
    expected[1] = torch.tensor(e0)  # query 0's best in column 0
    expected[0] = torch.tensor(e1)  # query 1's best in column 0 is the first 0.8, token 0
    expected[7] = torch.tensor(e0) + torch.tensor(e1)  # both queries' best in column 1 (a tie at 0 for query 0)
    assert torch.equal(documents.grad, expected)


def test_half_precision_selection_is_exact_on_half_representable_vectors() -> None:
    """Vectors that float16 holds exactly: products are exact and float32 sums them, so the float16 path
    (emulated on the CPU) equals the brute force like the float32 one."""
    queries, documents, of, columns = _long_case(CONTIGUOUS, width=16, seed=5)
    queries, documents = queries.half().float(), documents.half().float()
    upstream = torch.randn(9, columns, generator=torch.Generator().manual_seed(6))
    mine = _forward_backward(
        lambda q, d: maxsim(q, d, of, columns, block=4, precision="float16"), queries, documents, upstream
    )
    theirs = _forward_backward(lambda q, d: brute_maxsim(q, d, of, columns), queries, documents, upstream)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_half_precision_selection_answers_a_real_similarity(precision: str) -> None:
    """On vectors half precision does not hold, the selected token is a near maximum: `best` is that token's
    float32 similarity (never above the true maximum) and the gradient goes to that same token."""
    g = torch.Generator().manual_seed(7)
    queries, documents = _unit(64, 32, g), _unit(300, 32, g)
    document_of = torch.arange(300) // 20  # 15 columns of 20 tokens
    similarity = queries @ documents.T
    best = maxsim(queries, documents, document_of, 15, block=4, precision=precision)
    truth = brute_maxsim(queries, documents, document_of, 15)
    tolerance = 2e-3 if precision == "float16" else 2e-2
    assert bool((best <= truth + 1e-6).all()) and bool((best >= truth - tolerance).all())
    for d in range(15):
        mine = similarity[:, document_of == d]  # [64, 20]
        assert bool(((mine - best[:, d : d + 1]).abs() < 1e-6).any(dim=1).all()), "best is one token's similarity"
    # Backward: d best[t, d] / d q_t is the selected token's vector, whose similarity is best[t, d].
    q = queries.clone().requires_grad_(True)
    for t, d in ((0, 0), (5, 3), (63, 14)):
        (grad,) = torch.autograd.grad(maxsim(q, documents, document_of, 15, block=4, precision=precision)[t, d], q)
        torch.testing.assert_close(float(grad[t] @ queries[t]), float(best[t, d]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("by_sorting", [True, False])
def test_scatter_rows_sums_each_destination(by_sorting: bool) -> None:
    """Both ways of summing the document gradient equal a loop, repeated destinations, dropped ones (index ==
    size) and entries of weight 0 included."""
    g = torch.Generator().manual_seed(8)
    index = torch.randint(0, 6, (7, 5), generator=g)
    index[0] = 3  # a hot destination
    index[1, :2] = 6  # dropped
    index[2, :3] = 3
    weight = torch.randn(7, 5, generator=g)
    weight[2, :2] = 0  # adds nothing: moved to a spare row
    rows = torch.randn(7, 4, generator=g)
    expected = torch.zeros(7, 4)
    for t in range(7):
        for j in range(5):
            expected[int(index[t, j])] += weight[t, j] * rows[t]
    out = scatter_rows(index, weight, rows, 6, by_sorting)
    torch.testing.assert_close(out, expected[:6], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit's, from inside the inductor
# The sorted scatter's case is traced whole (dynamo and AOT autograd, forward and backward) without the inductor's
# C++ build, which took ~25 s of CI's two cores: the trainer compiles only on CUDA, whose kernels tests/test_cuda.py
# compiles; the index_add case still goes through the CPU inductor.
@pytest.mark.parametrize(
    ("precision", "sorted_scatter", "backend"), [("float32", None, "aot_eager"), ("float16", False, "inductor")]
)
def test_maxsim_compiles_whole(monkeypatch, precision: str, sorted_scatter, backend: str) -> None:
    """torch.compile(fullgraph=True), as the trainer compiles the step: no graph break, the eager answer; with
    the CPU's sorted scatter and with CUDA's index_add (and float16 selection, emulated here)."""
    monkeypatch.setattr(late, "SORTED_SCATTER", sorted_scatter)
    queries, documents, of, columns = _long_case(CONTIGUOUS)
    # float16 holds these exactly, so the answer does not depend on whether the CPU inductor keeps the
    # rounding (it elides a float16 round trip inside a fused kernel; on CUDA the GEMM reads float16 buffers).
    queries, documents = queries.half().float(), documents.half().float()
    upstream = torch.randn(9, columns, generator=torch.Generator().manual_seed(9))

    def fn(q, d):
        return maxsim(q, d, of, columns, longest=13, block=4, precision=precision)

    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    mine = _forward_backward(compiled, queries, documents, upstream)
    theirs = _forward_backward(fn, queries, documents, upstream)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# The term against a naive reference


def reference_late(
    queries: torch.Tensor,
    query_slot: list[int],
    documents: torch.Tensor,
    document_of: list[int],
    groups: list[int],
    log_t: torch.Tensor,
    bias: torch.Tensor,
    z: np.ndarray,
    w: np.ndarray,
    form: PairLossForm,
) -> tuple[torch.Tensor, int]:
    """docs/design.md §5 literally: per query row and document column, sum over the row's tokens of the max
    over the column's tokens; then the pair form per anchor, one scalar at a time."""
    slots, columns = z.shape
    total = queries.new_zeros(())
    anchors = 0
    for i in range(slots):
        mine = [t for t, s in enumerate(query_slot) if s == i]
        if not mine:
            continue
        positives, negatives = [], []
        for j in range(columns):
            theirs = [u for u, c in enumerate(document_of) if c == j]
            if not theirs or z[i, j] == 0 or w[i, j] == 0:
                continue
            score = queries.new_zeros(())
            for t in mine:
                score = score + torch.stack([torch.dot(queries[t], documents[u]) for u in theirs]).max()
            logit = torch.exp(log_t[groups[i]]) * score + bias[groups[i]]
            (positives if z[i, j] > 0 else negatives).append((logit, float(w[i, j])))
        row = naive_row_loss(positives, negatives, form)
        if row is not None:
            anchors += 1
            total = total + row
    return total, anchors


def _term_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    slots, columns, width = 6, 5, 8
    query_slot = [0, 0, 0, 2, 2, 3, 6, 6, 5, 5, 5, 5]  # slot 1 and 4 hold no query; 6 = padding
    document_of = [0, 0, 1, 1, 1, 2, 5, 3, 3, 0, 5]  # column 4 empty; 5 = padding
    queries = _unit(len(query_slot), width, g)
    documents = _unit(len(document_of), width, g)
    z = rng.choice([-1, 0, 1], size=(slots, columns), p=[0.5, 0.2, 0.3]).astype(np.float32)
    z[5] = [1, -1, -1, 0, 0]
    w = np.where(z != 0, rng.uniform(0.5, 2.0, size=z.shape), 0).astype(np.float32)
    z[:, 4] = 0  # the empty column and the rows without a query are never scored (the host names no
    z[[1, 4]] = 0  # pair there)
    w[z == 0] = 0
    groups = [0, 1, 1, 0, 1, 0]
    log_t = torch.tensor([0.3, -0.2])
    bias = torch.tensor([-0.5, 0.4])
    return queries, query_slot, documents, document_of, groups, log_t, bias, z, w


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_late_term_matches_the_naive_reference(form: PairLossForm, seed: int) -> None:
    queries, query_slot, documents, document_of, groups, log_t, bias, z, w = _term_case(seed)
    results = []
    for kind in ("module", "reference"):
        leaves = [x.clone().requires_grad_(True) for x in (queries, documents, log_t, bias)]
        q, d, lt, b = leaves
        if kind == "module":
            total, anchors = late_interaction_term(
                q,
                torch.tensor(query_slot),
                d,
                torch.tensor(document_of),
                torch.tensor(groups),
                lt,
                b,
                torch.from_numpy(z),
                torch.from_numpy(w),
                form,
                chunk=4,
            )
            anchors = int(anchors)
        else:
            total, anchors = reference_late(q, query_slot, d, document_of, groups, lt, b, z, w, form)
        total.backward()
        results.append(
            (total.detach(), anchors, [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves])
        )
    (mine, my_anchors, my_grads), (theirs, their_anchors, their_grads) = results
    assert my_anchors == their_anchors > 0
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("queries", "documents", "log_t", "bias"), my_grads, their_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    if form == PairLossForm.Ranked:
        assert torch.equal(my_grads[3], torch.zeros(2)), "the bias cancels under Ranked: an exact zero gradient"


def test_ranked_with_a_static_bound_equals_the_read_bound() -> None:
    queries, query_slot, documents, document_of, groups, log_t, bias, z, w = _term_case(0)
    args = (
        queries,
        torch.tensor(query_slot),
        documents,
        torch.tensor(document_of),
        torch.tensor(groups),
        log_t,
        bias,
        torch.from_numpy(z),
        torch.from_numpy(w),
        PairLossForm.Ranked,
    )
    most = int((z > 0).sum(axis=1).max())
    read, _ = late_interaction_term(*args)
    bound, _ = late_interaction_term(*args, positives=1 << max(0, most - 1).bit_length())
    torch.testing.assert_close(read, bound, rtol=1e-6, atol=0)


def test_derived_is_ranked_for_tokens() -> None:
    late = resolve(make_config(late_interaction=LateInteraction(weight=1.0))).late_interaction
    assert late.pair_loss == PairLossForm.Ranked
    assert (late.width, late.inverse_temperature, late.bias, late.max_query_span) == (128, 1.0, 0.0, 64)


# --------------------------------------------------------------------------------------------------
# Sides, spans and capacities through packing

TEXTS = ["hello world", "abc", "the quick brown fox", "jumps", "over a lazy dog", "", "a document"]
SIDES = [Q, D, N, QD, Q, Q, D]
SPAN = 4


def _late_config(**late: float | int) -> uform.TrainerInitVramConfig:
    return make_config(
        objective=Objective.Contrastive,  # nothing corrupted: the tokens are the items' bytes
        late_interaction=LateInteraction(weight=1.0, width=16, max_query_span=SPAN, **late),  # type: ignore[arg-type]
        batch=BatchShape(max_rows_per_device=ROWS, max_segments_per_device=SEGMENTS, max_columns_per_row=COLUMNS),
    )


def _prepare(config, texts=TEXTS, sides=SIDES, relations=None):
    return prepare(
        resolve(config),
        [Modality.Text] * len(texts),
        [t.encode() for t in texts],
        bags=None,
        groups=None,
        sides=list(sides),
        relations=relations,
        step=1,
    )


def test_sides_and_spans_are_honoured() -> None:
    batch = _prepare(_late_config())
    assert batch.dropped == 0
    late = batch.late
    layout = batch.layout
    flat = batch.tokens.reshape(-1)
    S, Dd = SEGMENTS, resolve(_late_config()).late_interaction.max_documents_per_device
    queries: dict[int, list[int]] = {}
    for index, slot in zip(late["query_index"].tolist(), late["query_slot"].tolist(), strict=True):
        if slot < S:
            queries.setdefault(int(layout.item_of_slot[slot]), []).append(int(flat[index]))
    documents: dict[int, list[int]] = {}
    for index, column in zip(late["document_index"].tolist(), late["document_of"].tolist(), strict=True):
        if column < Dd:
            documents.setdefault(column, []).append(int(flat[index]))
    # Document columns follow slot order over the document-side items that hold a token.
    document_items = [int(i) for i in layout.item_of_slot if i >= 0 and SIDES[i] in (D, QD) and TEXTS[i]]
    column_item = dict(enumerate(document_items))
    # A query contributes its first SPAN bytes past the prefix; an empty query contributes nothing.
    assert queries == {i: list(TEXTS[i].encode()[:SPAN]) for i in (0, 3, 4)}
    # A document contributes every byte past its prefix; None items and empty items take no part.
    assert {column_item[c]: v for c, v in documents.items()} == {i: list(TEXTS[i].encode()) for i in (1, 3, 6)}
    assert len(documents) == 3
    # Query tokens are packed first, padding after; so are document tokens.
    used = int((late["query_slot"] < S).sum())
    assert used == 4 + 4 + 4 and np.all(late["query_slot"][used:] == S)
    used = int((late["document_of"] < Dd).sum())
    assert used == 3 + 5 + 10 and np.all(late["document_of"][used:] == Dd)


def test_pairs_resolve_through_the_relations_and_the_negatives() -> None:
    # Item 0 (query) attracts 1, repels 6; item 3 (query and document) attracts 6; Ambient fills the rest.
    relations = uform.Relations(
        attract=uform.Edges(offsets=[0, 1, 1, 1, 2, 2, 2, 2], ids=[1, 6]),
        repel=uform.Edges(offsets=[0, 1, 1, 1, 1, 1, 1, 1], ids=[6]),
    )
    batch = _prepare(_late_config(), relations=relations)
    layout = batch.layout
    z, w = batch.late["z"], batch.late["w"]
    document_items = [int(i) for i in layout.item_of_slot if i >= 0 and SIDES[i] in (D, QD) and TEXTS[i]]
    expected_z = np.zeros_like(z)
    for slot, item in enumerate(layout.item_of_slot.tolist()):
        if item < 0 or SIDES[item] not in (Q, QD) or not TEXTS[item]:
            continue
        for column, doc in enumerate(document_items):
            if doc == item:
                continue  # a QueryAndDocument item never scores itself
            named = {(0, 1): 1, (0, 6): -1, (3, 6): 1}
            expected_z[slot, column] = named.get((item, doc), -1)
    assert np.array_equal(z, expected_z)
    assert np.array_equal(w, np.abs(expected_z))
    assert batch.late_positives == 1


@pytest.mark.parametrize(
    ("limits", "texts", "sides", "dropped"),
    [
        # Query token rows: 3 queries of 4 tokens into 10 rows: one is dropped whole.
        ({"max_query_tokens_per_device": 10}, ["aaaaaa", "bbbbbb", "cccccc", "dd"], [Q, Q, Q, D], 1),
        # Documents: 2 columns for 3 documents.
        ({"max_documents_per_device": 2}, ["aaaaaa", "bbbbbb", "cccccc", "dd"], [D, D, D, Q], 1),
        # Document token rows: 12 rows for documents of 6 + 6 + 6 tokens (and a query that takes none).
        ({"max_document_tokens_per_device": 12}, ["aaaaaa", "bbbbbb", "cccccc", "dd"], [D, QD, D, Q], 1),
        # Within capacity nothing is dropped.
        ({"max_query_tokens_per_device": 12}, ["aaaaaa", "bbbbbb", "cccccc", "dd"], [Q, Q, Q, D], 0),
    ],
)
def test_capacity_overflow_is_dropped_whole_and_counted(make_trainer, limits, texts, sides, dropped: int) -> None:
    config = _late_config(**limits)
    batch = _prepare(config, texts, sides)
    assert batch.dropped == dropped
    late = resolve(config).late_interaction
    assert int((batch.late["query_slot"] < SEGMENTS).sum()) <= late.max_query_tokens_per_device
    assert int((batch.late["document_of"] < late.max_documents_per_device).sum()) <= late.max_document_tokens_per_device
    # Through the trainer: the dropped items are missing from the arena and counted in the stats.
    trainer = make_trainer(config)
    stats, arena = TrainerStepStats(), Arena()
    trainer.step(["text"] * len(texts), texts, TrainerStepConfig(sides=sides, stats=stats, arena=arena))
    assert stats.dropped == dropped == int((~arena.present).sum())
    assert np.isfinite(stats.late_interaction_loss)


# --------------------------------------------------------------------------------------------------
# Through the network and the trainer


def _network_terms(trainer, texts, sides, relations):
    batch = _prepare(trainer.config, texts, sides, relations)  # the config is resolved already: resolving is a no-op
    inputs = to_device(
        batch.host_tensors(False),
        torch.device("cpu"),
        trainer.network.rotary,
        attention="dense",
        dtype=torch.float32,
        dynamic=False,
    )
    return batch, inputs


@pytest.mark.parametrize("form", FORMS)
def test_the_network_term_equals_the_reference_over_its_own_token_vectors(make_trainer, form) -> None:
    """The term `Network.losses` answers equals the naive reference fed with the token head's vectors at
    every item's own positions (found from the layout, not from the batch's late arrays)."""
    trainer = make_trainer(late_interaction=LateInteraction(weight=1.0, width=16, max_query_span=SPAN, pair_loss=form))
    relations = pair_relations(3, 7)
    sides = [Q, Q, QD, D, D, D, N]
    texts = [*CAPTIONS, "no"]
    batch, inputs = _network_terms(trainer, texts, sides, relations)
    assert batch.dropped == 0
    network = trainer.network
    terms, _ = network.losses(inputs, None, batch.positives, batch.late_positives)
    with torch.no_grad():
        states = network.states(inputs)
        vectors = network.token_head(states)  # [R, C, W]
    layout = batch.layout
    prefix = 2
    query_vectors, query_slot, document_vectors, document_of = [], [], [], []
    columns = 0
    for slot, item in enumerate(layout.item_of_slot.tolist()):
        if item < 0:
            continue
        r, c0, n = int(layout.row[item]), int(layout.column[item]), int(layout.length[item])
        tokens = vectors[r, c0 + prefix : c0 + n]
        if sides[item] in (Q, QD):
            query_vectors.append(tokens[:SPAN])
            query_slot += [slot] * len(tokens[:SPAN])
        if sides[item] in (D, QD):
            document_vectors.append(tokens)
            document_of += [columns] * len(tokens)
            columns += 1
    assert batch.late["z"].shape[1] == SEGMENTS and columns == 4
    groups = [0] * SEGMENTS
    t = trainer.network.late_temperatures
    expected, anchors = reference_late(
        torch.cat(query_vectors),
        query_slot,
        torch.cat(document_vectors),
        document_of,
        groups,
        t.log_inverse_temperature.detach(),
        t.bias.detach(),
        batch.late["z"],
        batch.late["w"],
        form,
    )
    assert int(terms["late_interaction"].count) == anchors == 3
    torch.testing.assert_close(terms["late_interaction"].sum.detach(), expected, rtol=1e-5, atol=1e-6)
    totals = network.total(terms)
    assert float(totals["late_interaction_loss"].detach()) == pytest.approx(float(expected) / anchors, rel=1e-5)


def test_late_interaction_trains_its_head_and_temperatures(make_trainer) -> None:
    trainer = make_trainer(late_interaction=LateInteraction(weight=1.0, width=16, pair_loss=PairLossForm.Sigmoid))
    before = snapshot(trainer)
    stats = TrainerStepStats()
    trainer.step(["text"] * 6, CAPTIONS, TrainerStepConfig(relations=pair_relations(3), sides=[QD] * 6, stats=stats))
    after = snapshot(trainer)
    for name in ("weights.token_head.projection.weight", "weights.late_temperatures.log_inverse_temperature"):
        assert not torch.equal(before[name], after[name]), name
    assert stats.late_interaction_loss > 0


def test_no_sides_score_nothing(make_trainer) -> None:
    """Every item None (the default): the late term has no anchors and reports zero."""
    trainer = make_trainer(late_interaction=LateInteraction(weight=1.0, width=16))
    stats = TrainerStepStats()
    trainer.step(["text"] * 6, CAPTIONS, TrainerStepConfig(relations=pair_relations(3), stats=stats))
    assert stats.late_interaction_loss == 0.0
    assert stats.loss == pytest.approx(stats.contrastive_loss + stats.masked_text_loss, rel=1e-6)


def test_weight_scales_the_reported_term(make_trainer) -> None:
    """The stat is the weighted term: the same first step at weights 1 and 0.25 reports 4 : 1."""
    reports = []
    for weight in (1.0, 0.25):
        trainer = make_trainer(late_interaction=LateInteraction(weight=weight, width=16))
        stats = TrainerStepStats()
        trainer.step(
            ["text"] * 6,
            CAPTIONS,
            TrainerStepConfig(relations=pair_relations(3), sides=[Q, Q, Q, D, D, D], stats=stats),
        )
        reports.append(stats)
    assert reports[0].late_interaction_loss > 0
    assert reports[1].late_interaction_loss == pytest.approx(0.25 * reports[0].late_interaction_loss, rel=1e-6)
    for stats in reports:
        assert stats.loss == pytest.approx(
            stats.contrastive_loss + stats.masked_text_loss + stats.late_interaction_loss, rel=1e-6
        )


def test_media_units_are_token_vectors(make_trainer) -> None:
    """An image document's token rows are its units (the positions its unit embeddings land at), and the
    late term's gradient reaches the image input."""
    from uform.media.units import Units

    trainer = make_trainer(
        late_interaction=LateInteraction(weight=1.0, width=16),
        batch=BatchShape(
            max_rows_per_device=ROWS,
            max_segments_per_device=SEGMENTS,
            max_columns_per_row=COLUMNS,
            image=uform.ImageShape(patch_side=4),
        ),
    )
    rng = np.random.default_rng(0)
    grid = (1, 2, 3)
    positions = np.array([(0, r, c) for r in range(2) for c in range(3)], dtype=np.int64)
    units = {
        1: Units(values=rng.integers(0, 256, (6, 64), dtype=np.uint8), positions=positions, grid=grid, truncated=False)
    }
    modalities = [Modality.Text, Modality.Image, Modality.Text]
    batch = prepare(
        trainer.config,
        modalities,
        [b"a query", b"", b"a text document"],
        bags=None,
        groups=None,
        sides=[Q, D, D],
        relations=uform.Relations(attract=uform.Edges(offsets=[0, 1, 1, 1], ids=[1])),
        step=1,
        units=units,
    )
    late = batch.late
    image_column = 0 if batch.layout.slot[1] < batch.layout.slot[2] else 1
    mine = late["document_index"][late["document_of"] == image_column]
    assert np.array_equal(np.sort(mine), np.sort(batch.media["image"]["index"][:6]))
    inputs = to_device(
        batch.host_tensors(False),
        torch.device("cpu"),
        trainer.network.rotary,
        attention="dense",
        dtype=torch.float32,
        dynamic=False,
    )
    terms, _ = trainer.network.losses(inputs, None, batch.positives, batch.late_positives)
    assert int(terms["late_interaction"].count) == 1
    trainer.network.zero_grad(set_to_none=True)
    terms["late_interaction"].sum.backward()
    grads = [p.grad for p in trainer.network.media["image"].parameters()]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_served_tokens_reproduce_the_trainers_late_term(make_trainer) -> None:
    """Serving answers the vectors the trainer scored: the late term rebuilt from `Model.tokens` and
    `Model.maxsim` (Ranked, by hand) equals the trainer's `late_interaction_loss` for the same items, before
    the step's update (Contrastive objective: no corruption, so the forward is the same)."""
    trainer = make_trainer(
        objective=Objective.Contrastive,
        batch=BatchShape(max_rows_per_device=4, max_segments_per_device=16, max_columns_per_row=128),
        late_interaction=LateInteraction(weight=1.0, width=16, max_query_span=5),
        schedule=Schedule(steps=20, warmup_steps=1, learning_rate=3e-3),
    )
    k = 4
    queries = [f"question {i}: what is {'abc'[i % 3]}?" for i in range(k)]
    documents = [f"answer {i}, about {'abc'[i % 3]}; " * 2 for i in range(k)]  # within a row
    texts = queries + documents
    sides = [LateInteractionSide.Query] * k + [LateInteractionSide.Document] * k
    ids = [[k + i] for i in range(k)] + [[] for _ in range(k)]
    relations = Relations(
        attract=Edges(offsets=np.cumsum([0] + [len(x) for x in ids]).tolist(), ids=[j for x in ids for j in x])
    )
    config = TrainerStepConfig(relations=relations, sides=sides)
    for _ in range(3):  # move the weights and temperatures off their initial values
        trainer.step(["text"] * len(texts), texts, config)

    model = Model.from_trainer(trainer)
    try:
        q = model.tokens(["text"] * k, queries, LateInteractionSide.Query)
        d = model.tokens(["text"] * k, documents, LateInteractionSide.Document)
        scores = model.maxsim(q, d).double()  # [k, k]
    finally:
        model.close()
    assert np.diff(q[1]).tolist() == [5] * k  # each query: its first max_query_span tokens
    assert np.diff(d[1]).tolist() == [len(x) for x in documents]
    t = trainer.network.late_temperatures
    assert t is not None
    logits = scores * t.log_inverse_temperature.detach().double().exp()[0] + t.bias.detach().double()[0]
    expected = 0.0
    for i in range(k):
        positive = logits[i, i]
        negatives = torch.cat([logits[i, :i], logits[i, i + 1 :]])
        margin = negatives - positive  # softplus written out, exact in float64 (F.softplus's threshold is not)
        expected += float((margin.clamp_min(0) + torch.log1p(torch.exp(-margin.abs()))).mean())
    stats = TrainerStepStats()
    trainer.step(["text"] * len(texts), texts, TrainerStepConfig(relations=relations, sides=sides, stats=stats))
    assert stats.dropped == 0
    assert stats.late_interaction_loss == pytest.approx(expected / k, rel=1e-4)
