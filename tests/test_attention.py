"""Document-masked attention: `block_tables` against FlexAttention's own `create_block_mask`, and the flex and
dense paths against each other (outputs and gradients), down to a whole `Network.losses`.

FlexAttention runs eagerly on CPU (an unfused reference that reads only the mask_mod, not the block tables),
but torch refuses its backward on CPU ("FlexAttention does not support backward on CPU"); gradient checks
of the flex path therefore run where a CUDA device is present and are skipped on CPU with that reason.
The block tables, which only the compiled CUDA kernel reads, are pinned exactly against create_block_mask.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from uform.config import BatchShape, Masking, TrainerInitVramConfig, resolve
from uform.config import Schedule as ScheduleConfig
from uform.data.batch import prepare
from uform.data.blocks import equal_length, gathered_shape, uniform_length
from uform.enums import Modality, Objective
from uform.model.attention import (
    BLOCK,
    DocumentMask,
    allow_backward_tiles,
    attend,
    block_tables,
    document_mask,
    flex_block,
    gather_rows,
    scatter_rows,
)
from uform.model.inputs import to_device
from uform.model.network import Network

flex_attention_module = pytest.importorskip("torch.nn.attention.flex_attention")
create_block_mask = flex_attention_module.create_block_mask
BlockMask = flex_attention_module.BlockMask

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def flex_backward_refusal(device: str) -> str | None:
    """Why this torch cannot differentiate FlexAttention on `device`, or None when it can."""
    x = torch.zeros(1, 1, BLOCK, 64, device=device, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flex_attention_module.flex_attention(x, x, x).sum().backward()
    except NotImplementedError as error:
        return f"torch {torch.__version__} refuses FlexAttention's backward on {device}: {error}"
    return None


# --------------------------------------------------------------------------------------------------
# Layouts as prepare builds them: slot ids in (row, column) order, padding = S at the end of every row


def random_layout(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    segments = np.empty((rows, columns), dtype=np.int64)
    slot = 0
    row_ends = []
    for r in range(rows):
        kind = rng.integers(0, 5)
        if kind == 0:
            end = 0  # all padding
        elif kind == 1:
            end = columns  # no padding
        else:
            end = int(rng.integers(1, columns))
        c = 0
        while c < end:
            style = rng.integers(0, 3)
            if style == 0:
                n = int(rng.integers(1, 8))  # tiny
            elif style == 1:
                n = int(rng.integers(1, BLOCK + 1))
            else:
                n = int(rng.integers(BLOCK, 3 * BLOCK))  # spans tiles
            n = min(n, end - c)
            segments[r, c : c + n] = slot
            slot += 1
            c += n
        row_ends.append(end)
    capacity = slot + int(rng.integers(0, 4))
    for r, end in enumerate(row_ends):
        segments[r, end:] = capacity  # padding carries S, the largest id
    return segments


def layouts() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = [random_layout(rng, int(rng.integers(1, 4)), BLOCK * int(rng.integers(1, 6))) for _ in range(40)]
    # Edge cases: one segment per row, one per tile with boundaries on tile edges, every position its own.
    out.append(np.array([[0] * 256, [1] * 256]))
    out.append(np.repeat(np.arange(4), BLOCK)[None, :])
    out.append(np.arange(256)[None, :])
    out.append(np.array([[0] * 127 + [1] * 2 + [2] * 127]))
    out.append(np.full((2, 384), 5))
    return out


def ragged_layouts() -> list[np.ndarray]:
    """Rows whose width C is not a multiple of the tile: the last tile is cut short."""
    rng = np.random.default_rng(1)
    out = [random_layout(rng, int(rng.integers(1, 4)), int(rng.integers(4, 5 * BLOCK))) for _ in range(12)]
    out.append(np.zeros((1, 200), dtype=np.int64))
    out.append(np.array([[0] * 130 + [1] * 70]))
    out.append(np.zeros((2, 100), dtype=np.int64))
    return out


LAYOUTS = layouts()
RAGGED = ragged_layouts()
MONOTONE = LAYOUTS + RAGGED


def other_ids(seed: int) -> np.ndarray:
    """Ids that do not grow along a row: padding at NO_SEGMENT (-1), or shuffled segment ids."""
    rng = np.random.default_rng(100 + seed)
    seg = random_layout(rng, 2, BLOCK * int(rng.integers(1, 5)))
    if seed % 2 == 0:
        return np.where(seg == seg.max(), -1, seg)
    ids = np.unique(seg)
    return rng.permutation(ids)[np.searchsorted(ids, seg)]


def same_segment_mod(segments: torch.Tensor):
    def mask_mod(b, h, q, k):
        return segments[b, q] == segments[b, k]

    return mask_mod


def tile_sets(tables: dict[str, np.ndarray], r: int, t: int) -> tuple[set[int], set[int]]:
    """(partial, full) key tiles of query tile t in row r."""
    partial = tables["kv_indices"][r, 0, t, : tables["kv_num_blocks"][r, 0, t]]
    full = tables["full_kv_indices"][r, 0, t, : tables["full_kv_num_blocks"][r, 0, t]]
    return set(partial.tolist()), set(full.tolist())


@pytest.mark.parametrize("block", [BLOCK, 64])
@pytest.mark.parametrize("index", range(len(MONOTONE)))
def test_block_tables_match_create_block_mask(index: int, block: int) -> None:
    seg = MONOTONE[index]
    rows, columns = seg.shape
    tables = block_tables(seg, block)
    mod = same_segment_mod(torch.from_numpy(seg))
    reference = create_block_mask(mod, rows, None, columns, columns, device="cpu", BLOCK_SIZE=block)
    tiles = -(-columns // block)
    for name, num, idx in (
        ("partial", reference.kv_num_blocks, reference.kv_indices),
        ("full", reference.full_kv_num_blocks, reference.full_kv_indices),
    ):
        prefix = "" if name == "partial" else "full_"
        ours_num, ours_idx = tables[f"{prefix}kv_num_blocks"], tables[f"{prefix}kv_indices"]
        assert ours_num.shape == (rows, 1, tiles) and ours_idx.shape == (rows, 1, tiles, tiles)
        assert ours_num.dtype == np.int32 and ours_idx.dtype == np.int32
        assert np.array_equal(ours_num, num.numpy()), name
        for r in range(rows):
            for t in range(tiles):
                n = int(ours_num[r, 0, t])
                assert sorted(ours_idx[r, 0, t, :n].tolist()) == sorted(idx[r, 0, t, :n].tolist()), (name, r, t)


@pytest.mark.parametrize("index", range(len(MONOTONE)))
def test_the_query_tables_are_the_transposed_key_tables(index: int) -> None:
    """document_mask hands backward the key tables as its query tables (the mask is symmetric) instead of
    transposing them: they must list, tile by tile, what `BlockMask.from_kv_blocks` computes by transposing."""
    seg = torch.from_numpy(MONOTONE[index])
    carried = {k: torch.from_numpy(v) for k, v in block_tables(MONOTONE[index]).items()}
    ours = document_mask(seg, "flex", carried).block
    reference = BlockMask.from_kv_blocks(
        carried["kv_num_blocks"],
        carried["kv_indices"],
        carried["full_kv_num_blocks"],
        carried["full_kv_indices"],
        BLOCK_SIZE=BLOCK,
        seq_lengths=(seg.shape[1], seg.shape[1]),
    )
    for num, idx, ref_num, ref_idx in (
        (ours.q_num_blocks, ours.q_indices, reference.q_num_blocks, reference.q_indices),
        (ours.full_q_num_blocks, ours.full_q_indices, reference.full_q_num_blocks, reference.full_q_indices),
    ):
        assert torch.equal(num, ref_num)
        rows, _, tiles = num.shape
        for r in range(rows):
            for t in range(tiles):
                n = int(num[r, 0, t])
                assert idx[r, 0, t, :n].tolist() == sorted(ref_idx[r, 0, t, :n].tolist()), (r, t)
    assert ours.BLOCK_SIZE == (BLOCK, BLOCK) and ours.seq_lengths == (seg.shape[1], seg.shape[1])


def test_block_tables_have_c_order_strides() -> None:
    """Every table has plain C-order strides, the head axis of size 1 included: the compiled CUDA kernel reads
    the wrong blocks from a table whose size-1 axis has stride 0 (as `x[:, None]` makes), values unchanged."""
    for seg in (LAYOUTS[0], RAGGED[0], np.zeros((3, 512), dtype=np.int64)):
        for name, table in block_tables(seg).items():
            t = torch.from_numpy(table)
            assert t.stride() == torch.empty(t.shape).stride(), name
            for carried in (t.to("cpu", copy=True), t.contiguous()):
                assert carried.stride() == torch.empty(t.shape).stride(), name
        mask = document_mask(torch.from_numpy(seg), "flex").block
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            table = getattr(mask, name)
            assert table.stride() == torch.empty(table.shape).stride(), name


def check_tile_classes(seg: np.ndarray, exact: bool) -> None:
    """From the dense mask: a full tile pair is whole and all True, a skipped one all False; with `exact`
    (ids growing along rows) a partial one holds some True and is not a whole all-True tile."""
    rows, columns = seg.shape
    tiles = -(-columns // BLOCK)
    tables = block_tables(seg)
    dense = seg[:, :, None] == seg[:, None, :]
    for r in range(rows):
        for qt in range(tiles):
            partial, full = tile_sets(tables, r, qt)
            assert not partial & full
            for kt in range(tiles):
                tile = dense[r, qt * BLOCK : (qt + 1) * BLOCK, kt * BLOCK : (kt + 1) * BLOCK]
                if kt in full:
                    assert tile.shape == (BLOCK, BLOCK) and tile.all()
                elif kt in partial:
                    if exact:
                        assert tile.any() and not (tile.shape == (BLOCK, BLOCK) and tile.all())
                else:
                    assert not tile.any(), (r, qt, kt)


@pytest.mark.parametrize("index", range(len(MONOTONE)))
def test_block_tables_semantics(index: int) -> None:
    check_tile_classes(MONOTONE[index], exact=True)


@pytest.mark.parametrize("seed", range(6))
def test_block_tables_stay_correct_for_other_ids(seed: int) -> None:
    """Padding at NO_SEGMENT or unordered ids: never a skipped tile that holds a visible pair."""
    check_tile_classes(other_ids(seed), exact=False)


def test_tables_of_another_tile_side_are_refused() -> None:
    """A mask read at 128-wide tiles from tables built at 64 (or the other way round) would skip the wrong tiles
    without a word; document_mask refuses the pair instead."""
    seg = torch.from_numpy(LAYOUTS[0])
    for built, read in ((64, BLOCK), (BLOCK, 64)):
        carried = {k: torch.from_numpy(v) for k, v in block_tables(seg.numpy(), built).items()}
        with pytest.raises(ValueError, match="another tile side"):
            document_mask(seg, "flex", carried, read)
        sides = document_mask(seg, "flex", carried, built).block.BLOCK_SIZE
        assert tuple(sides) == (built, built)


def test_flex_block_off_hopper_is_the_default_tile() -> None:
    assert flex_block(torch.device("cpu")) == BLOCK


def test_backward_tiles_are_added_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's Hopper default for the backward (64/128/128/64) divides no 64-wide sparse tile: the candidates
    gain one config of 64-wide tiles, once, however often it is asked, and keep the shipped ones."""
    heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    shipped = heuristics.CUDAConfigHeuristic().get_flex_attn_bwd_configs(64, torch.bfloat16)
    assert allow_backward_tiles(64) and allow_backward_tiles(64)
    configs = heuristics.CUDAConfigHeuristic().get_flex_attn_bwd_configs(64, torch.bfloat16)
    sixty_four = [c for c in configs if (c.block_m1, c.block_n1, c.block_m2, c.block_n2) == (64, 64, 64, 64)]
    assert len(sixty_four) == 1
    assert all(c in configs for c in shipped)


def test_dense_mask_is_same_segment() -> None:
    seg = torch.from_numpy(LAYOUTS[0])
    mask = document_mask(seg, "dense")
    assert mask.kind == "dense" and mask.dense is not None and mask.dense.dtype == torch.bool
    assert torch.equal(mask.dense[:, 0], seg[:, :, None] == seg[:, None, :])
    with pytest.raises(ValueError, match="flex"):
        document_mask(seg, "sparse")


# --------------------------------------------------------------------------------------------------
# attend: flex vs dense


def attention_case(
    seed: int, device: str, rows: int = 2, heads: int = 2, columns: int = 256, width: int = 64, padding: str = "S"
):
    """Random q, k, v and a layout; `padding` "S" as prepare builds it, or "NO_SEGMENT" (-1)."""
    rng = np.random.default_rng(seed)
    layout = random_layout(rng, rows, columns)
    if padding == "NO_SEGMENT":
        layout = np.where(layout == layout.max(), -1, layout)
    seg = torch.from_numpy(layout).to(device)
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, columns, width, generator=generator).to(device) for _ in range(3))
    return seg, q, k, v


def flex_masks(seg: torch.Tensor, block: int = BLOCK) -> list:
    """The flex mask as document_mask computes it, and from host tables carried to the device (the trainer's way)."""
    carried = {k: torch.from_numpy(v).to(seg.device) for k, v in block_tables(seg.cpu().numpy(), block).items()}
    return [document_mask(seg, "flex", block=block), document_mask(seg, "flex", carried, block)]


FORWARD_CASES = [
    (0, 256, "S"),
    (1, 256, "S"),
    (2, 384, "S"),
    (3, 200, "S"),  # C not a multiple of the tile
    (4, 256, "NO_SEGMENT"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed, columns, padding", FORWARD_CASES)
def test_attend_forward_flex_equals_dense(seed: int, columns: int, padding: str, device: str) -> None:
    seg, q, k, v = attention_case(seed, device, columns=columns, padding=padding)
    dense = attend(q, k, v, document_mask(seg, "dense"))
    for mask in flex_masks(seg):
        assert mask.kind == "flex"
        flex = attend(q, k, v, mask)
        torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    # No NaN anywhere (padding attends to padding), and a segment never sees another one: changing every other
    # segment's keys and values leaves a position's output as it was.
    assert torch.isfinite(dense).all()
    s = seg[0, 0]
    other = (seg != s)[:, None, :, None]
    k2, v2 = torch.where(other, k + 1.0, k), torch.where(other, -v, v)
    dense2 = attend(q, k2, v2, document_mask(seg, "dense"))
    mine = (seg == s)[:, None, :, None].expand_as(dense)
    torch.testing.assert_close(dense2[mine], dense[mine])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed, columns, padding", FORWARD_CASES)
def test_attend_gradients_flex_equal_dense(seed: int, columns: int, padding: str, device: str) -> None:
    refusal = flex_backward_refusal(device)
    if refusal:
        pytest.skip(refusal)
    seg, q, k, v = attention_case(seed, device, columns=columns, padding=padding)
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 9)).to(device)

    def grads(mask):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = attend(*leaves, mask)
        (out * upstream).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    dense_out, dense_grads = grads(document_mask(seg, "dense"))
    for mask in flex_masks(seg):
        flex_out, flex_grads = grads(mask)
        torch.testing.assert_close(flex_out, dense_out, atol=1e-5, rtol=1e-5)
        for a, b in zip(flex_grads, dense_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled FlexAttention kernel needs CUDA here")
@pytest.mark.parametrize("block", [BLOCK, 64])
@pytest.mark.parametrize("columns, padding", [(512, "S"), (200, "S"), (256, "NO_SEGMENT")])
def test_attend_compiled_flex_equals_dense_cuda(columns: int, padding: str, block: int) -> None:
    """The production path: FlexAttention compiled, reading the block tables (skipping tiles), with gradients;
    at the default tile and at Hopper's (`flex_block`), where this GPU runs it."""
    if block != BLOCK and flex_block(torch.device("cuda")) != block:
        pytest.skip(f"the trainer reads tiles of {block} on Hopper only")
    seg, q, k, v = attention_case(5, "cuda", rows=3, heads=2, columns=columns, padding=padding)
    compiled = torch.compile(attend)
    upstream = torch.randn_like(q)

    def grads(fn, mask):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, mask)
        (out * upstream).sum().backward()
        return [out.detach()] + [t.grad for t in leaves]

    expected = grads(attend, document_mask(seg, "dense"))
    for mask in flex_masks(seg, block):
        for a, b in zip(grads(compiled, mask), expected, strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------------
# A whole Network under both paths


def network_case(device: str, lengths: tuple[int, ...] = (150, 40, 63, 200, 9), seed: int = 3):
    """A small network and one Joint step of random texts of `lengths` bytes. The default lengths make segments
    straddle tile boundaries and one row end in padding."""
    config = resolve(
        TrainerInitVramConfig(
            depth=2,
            hidden=128,
            batch=BatchShape(max_rows_per_device=2, max_segments_per_device=8, max_columns_per_row=256),
            objective=Objective.Joint,
            masking=Masking(token_mask_probability=0.3),
            schedule=ScheduleConfig(steps=10),
            seed=3,
        )
    )
    rng = np.random.default_rng(seed)
    contents = [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in lengths]
    batch = prepare(
        config, [Modality.Text] * len(contents), contents, bags=None, groups=None, sides=None, relations=None, step=1
    )
    assert batch.dropped == 0
    network = Network(config)
    network.initialize(config.seed)
    network.to(device)
    return network, batch.host_tensors(pin=False)


def network_terms(
    network: Network, host: dict, kind: str, backward: bool, compiled: bool = False, uniform: bool = False
):
    network.zero_grad(set_to_none=True)
    device = next(network.parameters()).device
    inputs = to_device(
        host, device, network.rotary, attention=kind, dtype=torch.float32, dynamic=False, uniform=uniform
    )
    losses = torch.compile(network.losses, dynamic=False) if compiled else network.losses
    terms, _ = losses(inputs)
    totals = network.total(terms)
    if backward:
        totals["loss"].backward()
    grads = {name: p.grad.detach().clone() for name, p in network.named_parameters() if p.grad is not None}
    values = {f"{k}.{part}": v.detach() for k, term in terms.items() for part, v in term._asdict().items()}
    values.update({k: v.detach() for k, v in totals.items()})
    return values, grads


@pytest.mark.parametrize("device", DEVICES)
def test_network_losses_flex_equal_dense(device: str) -> None:
    network, tensors = network_case(device)
    assert (tensors["segments"] == 8).any()  # a row ends in padding
    with torch.no_grad():
        dense, _ = network_terms(network, tensors, "dense", backward=False)
        flex, _ = network_terms(network, tensors, "flex", backward=False)
    assert float(dense["masked_text.count"]) > 0 and float(dense["contrastive.count"]) > 0
    assert set(flex) == set(dense)
    for name in dense:
        torch.testing.assert_close(flex[name], dense[name], atol=1e-5, rtol=1e-5, msg=name)


NETWORK_GRADIENT_CASES = [
    ("cpu", False),
    pytest.param("cuda", False, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
    pytest.param("cuda", True, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device, compiled", NETWORK_GRADIENT_CASES)
def test_network_gradients_flex_equal_dense(device: str, compiled: bool) -> None:
    """Loss terms and every parameter's gradient; `compiled` runs `losses` under torch.compile, as the trainer."""
    refusal = flex_backward_refusal(device)
    if refusal:
        pytest.skip(refusal)
    network, tensors = network_case(device)
    dense, dense_grads = network_terms(network, tensors, "dense", backward=True)
    flex, flex_grads = network_terms(network, tensors, "flex", backward=True, compiled=compiled)
    for name in ("loss", "masked_text_loss", "contrastive_loss"):
        torch.testing.assert_close(flex[name], dense[name], atol=1e-5, rtol=1e-5, msg=name)
    assert set(flex_grads) == set(dense_grads) and len(dense_grads) == len(list(network.parameters()))
    for name, g in dense_grads.items():
        torch.testing.assert_close(flex_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


# --------------------------------------------------------------------------------------------------
# The uniform path: rows of whole segments of one length, dense with no mask


def uniform_ids(rows: int, columns: int, length: int) -> np.ndarray:
    return np.repeat(np.arange(rows * columns // length), length).reshape(rows, columns)


def test_uniform_length_finds_whole_equal_segments() -> None:
    assert uniform_length(uniform_ids(4, 1024, 256), 16) == 256
    assert uniform_length(uniform_ids(4, 1024, 1024), 4) == 1024
    assert uniform_length(uniform_ids(3, 512, 128), 12 + 5) == 128  # spare slots are fine


@pytest.mark.parametrize(
    "case",
    ["padding", "short", "one id twice", "ragged", "not dividing", "id past the slots", "empty"],
)
def test_uniform_length_refuses_every_other_layout(case: str) -> None:
    segments, slots = uniform_ids(4, 1024, 256), 16
    if case == "padding":  # a last segment's place left empty: padding attends to its row's padding, not uniform
        segments[3, 768:] = slots
    elif case == "short":  # 64-position segments: below UNIFORM_LEAST
        segments, slots = uniform_ids(4, 1024, 64), 64
    elif case == "one id twice":  # a 512-position segment in a row of 256s
        segments[1, 256:512] = segments[1, 0]
    elif case == "ragged":  # the second row splits 300 + 212 + ...
        segments[1, 256:300] = segments[1, 0]
    elif case == "not dividing":
        segments, slots = np.repeat(np.arange(8), 192)[:1000].reshape(1, 1000), 8
    elif case == "id past the slots":
        slots = 15
    else:
        segments = segments[:0]
    assert uniform_length(segments, slots) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_attend_uniform_equals_dense(device: str) -> None:
    """Outputs and every input's gradient of the uniform path against the dense reference, on q, k, v that are
    transposed views of token-major leaves as the tower hands them (and 2 rows x 512 of 128-position segments)."""
    generator = torch.Generator().manual_seed(5)
    segments = torch.from_numpy(uniform_ids(2, 512, 128)).to(device)
    leaves = [torch.randn(2, 512, 4, 16, generator=generator).to(device).requires_grad_() for _ in range(3)]
    weight = torch.randn(2, 4, 512, 16, generator=generator).to(device)
    found = []
    for mask in (document_mask(segments, "dense"), document_mask(segments, "flex", uniform=128)):
        for t in leaves:
            t.grad = None
        out = attend(*(t.transpose(1, 2) for t in leaves), mask)
        (out * weight).sum().backward()
        found.append([out.detach(), *(t.grad.clone() for t in leaves)])
    assert document_mask(segments, "flex", uniform=128).kind == "uniform"
    for a, b in zip(*found, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_a_uniform_claim_that_cannot_hold_is_refused() -> None:
    segments = torch.from_numpy(uniform_ids(2, 512, 128))
    for bad in (64, 200):
        with pytest.raises(ValueError, match="uniform"):
            document_mask(segments, "flex", uniform=bad)


UNIFORM_CASES = [
    ("cpu", False),
    pytest.param("cuda", True, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


@pytest.mark.parametrize("device, compiled", UNIFORM_CASES)
def test_network_takes_the_uniform_path_and_equals_dense(device: str, compiled: bool) -> None:
    """Four 127-byte texts fill two rows of 256 with 128-position segments: the flex path's inputs carry the uniform
    mask, and the loss terms and every parameter's gradient equal the dense path's (compiled, as the trainer, on
    CUDA)."""
    network, tensors = network_case(device, (127,) * 4, seed=4)  # 128 positions each
    place = torch.device(device)
    inputs = to_device(
        tensors, place, network.rotary, attention="flex", dtype=torch.float32, dynamic=False, uniform=True
    )
    assert (inputs.mask.kind, inputs.mask.length) == ("uniform", 128)
    # Unasked (evaluation, serving), the flex path keeps its block mask (on the CPU it builds one only to be read by
    # FlexAttention's eager reference, so the check is where the kernel runs).
    if device == "cuda":
        plain = to_device(tensors, place, network.rotary, attention="flex", dtype=torch.float32, dynamic=False)
        assert plain.mask.kind == "flex"
    dense, dense_grads = network_terms(network, tensors, "dense", backward=True)
    uniform, uniform_grads = network_terms(network, tensors, "flex", backward=True, compiled=compiled, uniform=True)
    assert float(dense["masked_text.count"]) > 0 and float(dense["contrastive.count"]) > 0
    for name in ("loss", "masked_text_loss", "contrastive_loss"):
        torch.testing.assert_close(uniform[name], dense[name], atol=1e-5, rtol=1e-5, msg=name)
    assert set(uniform_grads) == set(dense_grads) and len(dense_grads) == len(list(network.parameters()))
    for name, g in dense_grads.items():
        torch.testing.assert_close(uniform_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


# --------------------------------------------------------------------------------------------------
# The gathered path: segments of one length that do not tile the rows, gathered and attended densely (serving)


def equal_ids(rows: int, columns: int, length: int, per_row: list[int]) -> np.ndarray:
    """`per_row[r]` segments of `length` laid from column 0 of row r, ids in row, column order, padding -1."""
    segments = np.full((rows, columns), -1, dtype=np.int64)
    sid = 0
    for r, count in enumerate(per_row):
        for c in range(count):
            segments[r, c * length : (c + 1) * length] = sid
            sid += 1
    return segments


def slot_counts(segments: np.ndarray, slots: int) -> np.ndarray:
    """Positions per slot [S], as `Batch.counts` holds them (padding, id -1 here, left out)."""
    return np.bincount(segments[segments >= 0], minlength=slots)[:slots]


def test_equal_length_finds_segments_of_one_length_however_rows_hold_them() -> None:
    assert equal_length(slot_counts(equal_ids(3, 1024, 257, [3, 1, 2]), 8)) == (6, 257)
    assert equal_length(slot_counts(equal_ids(2, 512, 128, [4, 4]), 8)) == (8, 128)  # tiling rows too
    ragged = equal_ids(2, 1024, 257, [3, 2])
    ragged[1, 514:600] = 5  # a sixth segment of 86
    assert equal_length(slot_counts(ragged, 8)) == (0, 0)
    assert equal_length(slot_counts(equal_ids(2, 512, 64, [8, 8]), 16)) == (0, 0)  # below UNIFORM_LEAST
    assert equal_length(slot_counts(np.full((2, 64), -1, dtype=np.int64), 4)) == (0, 0)  # padding alone


def test_gathered_shape_leaves_whole_tiles_to_flex_attention() -> None:
    """Serving's host stage and `to_device` read one rule: equal lengths that straddle tiles are gathered."""
    assert gathered_shape(slot_counts(equal_ids(3, 1024, 257, [3, 1, 2]), 8)) == (6, 257)
    assert gathered_shape(slot_counts(equal_ids(2, 512, 128, [4, 4]), 8)) == (0, 0)  # 128 fills tiles of 128
    assert gathered_shape(slot_counts(equal_ids(2, 512, 128, [4, 4]), 8), block=96) == (8, 128)
    assert gathered_shape(slot_counts(equal_ids(2, 512, 64, [8, 8]), 16)) == (0, 0)  # too short to gather at all


@pytest.mark.parametrize("device", DEVICES)
def test_attend_gathered_equals_dense(device: str) -> None:
    """The gathered kind as the tower applies it (`gather_rows`, attention over rows that are each one segment,
    `scatter_rows`) against the dense reference at every segment position (padding's output is zero there, not
    compared), on q, k, v that are transposed views of token-major leaves as the blocks hand them: rows holding 3,
    1 and 2 segments of 257 positions (an image at patch 16 with its prefix). A mask that still holds its index is
    refused by attention itself: it would attend across the segments of a row."""
    generator = torch.Generator().manual_seed(6)
    ids = equal_ids(3, 1024, 257, [3, 1, 2])
    segments = torch.from_numpy(ids).to(device)
    leaves = [torch.randn(3, 1024, 4, 16, generator=generator).to(device) for _ in range(3)]  # [R, C, H, K]
    mask = document_mask(segments, "flex", gathered=equal_length(slot_counts(ids, 8)))
    assert (mask.kind, mask.length, tuple(mask.index.shape)) == ("gathered", 257, (6, 257))
    gathered = [gather_rows(t, mask.index) for t in leaves]  # [N, L, H, K]
    each = DocumentMask("gathered", length=mask.length)
    out = attend(*(t.transpose(1, 2) for t in gathered), each)  # [N, H, L, K]
    got = scatter_rows(out.transpose(1, 2), mask.index, 3, 1024).transpose(1, 2)  # [R, H, C, K]
    want = attend(*(t.transpose(1, 2) for t in leaves), document_mask(segments, "dense"))
    real = torch.from_numpy(ids >= 0).to(device)[:, None, :, None]  # [R, 1, C, 1]
    torch.testing.assert_close(got * real, want * real, atol=2e-5, rtol=1e-4)
    assert not got.masked_select(~real).any()
    with pytest.raises(ValueError, match="gather_rows"):
        attend(*(t.transpose(1, 2) for t in leaves), mask)


def test_a_gathered_claim_that_cannot_hold_is_refused() -> None:
    segments = torch.from_numpy(equal_ids(2, 512, 257, [1, 1]))
    for bad in ((2, 64), (3, 400)):
        with pytest.raises(ValueError, match="gathered"):
            document_mask(segments, "flex", gathered=bad)


@pytest.mark.parametrize("device", DEVICES)
def test_serving_inputs_gather_segments_of_one_length_and_keep_flex_otherwise(device: str) -> None:
    """`to_device(gathered=True)` (serving) on the flex path: segments all of 201 positions take the gathered kind
    and the tower's states equal the dense path's at every segment position; whole-tile lengths (128) and mixed
    lengths keep FlexAttention's block mask; without the flag nothing changes."""
    network, tensors = network_case(device, (200, 200), seed=4)  # 201 positions each: prefix + 200 bytes
    place = torch.device(device)

    def inputs(host: dict, attention: str = "flex", **flags: bool):
        return to_device(host, place, network.rotary, attention=attention, dtype=torch.float32, dynamic=False, **flags)

    gathered = inputs(tensors, gathered=True)
    assert (gathered.mask.kind, gathered.mask.length, tuple(gathered.mask.index.shape)) == ("gathered", 201, (2, 201))
    assert inputs(tensors).mask.kind == "flex"
    real = (tensors["segments"] < tensors["counts"].shape[0]).to(place)[..., None]  # [R, C, 1]; padding: id S
    with torch.no_grad():
        want = network.states(inputs(tensors, "dense")) * real
        torch.testing.assert_close(network.states(gathered) * real, want, atol=2e-5, rtol=1e-4)
    for lengths in ((127,) * 4, (200, 100)):  # 128 positions fill whole tiles; mixed lengths are ragged
        _, host = network_case(device, lengths, seed=4)
        assert inputs(host, gathered=True).mask.kind == "flex"
