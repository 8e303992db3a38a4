"""The CUDA path: compiled step, FlexAttention, bf16 autocast, fused AdamW. Skipped without a GPU."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import record_mask_kinds, write_fresh_checkpoint

import uform as u
from uform.config import resolve
from uform.data.batch import prepare
from uform.model import cublaslt
from uform.model.attention import block_tables
from uform.model.inputs import to_device
from uform.model.mlp import mlp, up_gelu
from uform.model.network import Network
from uform.model.tower import Block

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def config(objective: u.Objective = u.Objective.Joint, form: u.PairLossForm = u.PairLossForm.Derived):
    return u.TrainerInitVramConfig(
        depth=2,
        hidden=128,
        objective=objective,
        contrastive=u.Contrastive(pair_loss=form),
        batch=u.BatchShape(max_rows_per_device=4, max_segments_per_device=16, max_columns_per_row=256),
        schedule=u.Schedule(steps=50),
        seed=3,
    )


def items(n: int = 16) -> tuple[list[str], u.Relations]:
    texts = [f"item {i} " + "lorem ipsum dolor sit amet " * (1 + i % 5) for i in range(n)]
    relations = u.Relations(attract=u.Edges(offsets=list(range(n + 1)), ids=[i ^ 1 for i in range(n)]))
    return texts, relations


@pytest.mark.parametrize("form", [u.PairLossForm.Sigmoid, u.PairLossForm.Balanced, u.PairLossForm.Ranked])
def test_cuda_training_lowers_the_loss(form: u.PairLossForm) -> None:
    executor = u.Executor.for_vram([0])
    trainer = u.Trainer.init_vram(executor, config(form=form))
    texts, relations = items()
    losses = []
    for _ in range(25):
        stats = u.TrainerStepStats()
        trainer.on(executor).step(["text"] * len(texts), texts, u.TrainerStepConfig(relations=relations, stats=stats))
        assert np.isfinite(stats.loss)
        losses.append(stats.loss)
    assert trainer.attention == "flex" and trainer.replica.mlp == "cublaslt"
    assert np.mean(losses[-5:]) < losses[0]


def test_flex_equals_dense_on_cuda() -> None:
    """FlexAttention with host-made block tables and the dense reference agree on CUDA (fp32)."""
    resolved = resolve(config())
    network = Network(resolved)
    network.initialize(resolved.seed)
    network = network.cuda()
    texts, relations = items()
    batch = prepare(
        resolved,
        [u.Modality.Text] * len(texts),
        [t.encode() for t in texts],
        bags=None,
        groups=None,
        sides=None,
        relations=relations,
        step=1,
    )
    results = []
    for kind in ("flex", "dense"):
        host = batch.host_tensors(pin=False, tables=block_tables(batch.segments) if kind == "flex" else None)
        inputs = to_device(
            host, torch.device("cuda"), network.rotary, attention=kind, dtype=torch.float32, dynamic=False
        )
        network.zero_grad()
        terms, embeddings = network.losses(inputs)
        total = network.total(terms)["loss"]
        total.backward()
        grads = {n: p.grad.detach().clone() for n, p in network.named_parameters() if p.grad is not None}
        results.append((total.detach(), embeddings, grads))
    (flex_loss, flex_embeddings, flex_grads), (dense_loss, dense_embeddings, dense_grads) = results
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(flex_embeddings, dense_embeddings, rtol=1e-3, atol=1e-3)
    assert flex_grads.keys() == dense_grads.keys()
    for name in flex_grads:
        torch.testing.assert_close(flex_grads[name], dense_grads[name], rtol=2e-3, atol=2e-4, msg=name)


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_gelu_in_the_epilogue_matches_the_separate_kernel(compiled: bool) -> None:
    """`mlp.up_gelu` without gradients under bf16 autocast (serving) runs GELU in cuBLASLt's epilogue: the same
    tanh form as the separate kernel with one rounding fewer, so within bf16's rounding of it, yet not bitwise
    equal (which shows the epilogue ran). With gradients it is the separate kernel's, bitwise."""
    torch.manual_seed(0)
    up = torch.nn.Linear(128, 512, bias=False).cuda()
    h = torch.randn(4, 96, 128, device="cuda")
    fused = torch.compile(up_gelu, dynamic=False) if compiled else up_gelu
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with torch.no_grad():
            got = fused(up, h)
            separate = F.gelu(up(h), approximate="tanh")
            reference = F.gelu(h.double() @ up.weight.double().t(), approximate="tanh")  # float64, no rounding
        trained = up_gelu(up, h)
    assert got.dtype == separate.dtype == torch.bfloat16 and got.shape == (4, 96, 512)
    torch.testing.assert_close(got.float(), separate.float(), atol=1e-2, rtol=1.6e-2)
    assert not torch.equal(got, separate)
    # One rounding of the product fewer: never further from the float64 reference than the separate kernel overall.
    assert (got.double() - reference).abs().mean() <= (separate.double() - reference).abs().mean()
    assert torch.equal(trained.detach(), separate)


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_training_mlp_runs_gelu_in_cublaslt_epilogues(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mlp.FusedMLP` (GELU_AUX in the up projection, DGELU in the down projection's input gradient): its output
    and the gradients of the block's input and both weights are within bf16's rounding of the separate kernels',
    on average at least as close to a float64 reference (the epilogues round once where the separate kernels round
    twice), and not bitwise equal, which shows the epilogues ran. The plan timing is made to rank torch's separate
    kernels last, so that the fused kernels run whatever this small shape's timings would have chosen."""
    assert cublaslt.available(torch.device("cuda"))
    library = cublaslt._library()
    assert library is not None
    timed = cublaslt._milliseconds
    monkeypatch.setattr(cublaslt, "_milliseconds", lambda call: math.inf if call.args[0] is None else timed(call))
    monkeypatch.setattr(library, "plans", {})  # no choice made before this test's ranking
    torch.manual_seed(0)
    block = Block(128).cuda()
    h = torch.randn(4, 96, 128, device="cuda")
    grad = torch.randn(4, 96, 128, device="cuda").to(torch.bfloat16)

    def run(fused: bool) -> list[torch.Tensor]:
        block.fused_mlp = fused
        forward = torch.compile(mlp, dynamic=False) if compiled else mlp
        x = h.to(torch.bfloat16).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward(block.up, block.down, x, block.fused_mlp)
        out.backward(grad)
        got = [out.detach(), x.grad, block.up.weight.grad, block.down.weight.grad]
        block.zero_grad(set_to_none=True)
        return got  # type: ignore[return-value]

    fused, separate = run(True), run(False)
    leaves = [t.detach().double().requires_grad_() for t in (h.to(torch.bfloat16), block.up.weight, block.down.weight)]
    bf16 = [leaves[0]] + [w.to(torch.bfloat16).double() for w in leaves[1:]]
    out = F.linear(F.gelu(F.linear(bf16[0], bf16[1]), approximate="tanh"), bf16[2])
    out.backward(grad.double())
    reference = [out.detach()] + [t.grad for t in leaves]
    for f, s, r in zip(fused, separate, reference, strict=True):
        assert f.shape == s.shape and f.dtype == s.dtype
        scale = r.abs().mean()
        assert ((f.double() - s.double()).abs().mean() / scale) < 1e-2
        assert (f.double() - r).abs().mean() <= 1.05 * (s.double() - r).abs().mean()
    assert not torch.equal(fused[1], separate[1])


def test_inputs_copied_on_a_side_stream_are_read_after_they_land() -> None:
    """`to_device(copy_stream=...)`: the copies run on that stream, and what the current stream reads of them
    afterwards is the host's values even while the copy stream is held back (a missing wait would read them
    before they land)."""
    resolved = resolve(config())
    network = Network(resolved).cuda()
    texts, relations = items()
    contents = [t.encode() for t in texts]
    batch = prepare(
        resolved, [u.Modality.Text] * 16, contents, bags=None, groups=None, sides=None, relations=relations, step=1
    )
    host = batch.host_tensors(pin=True, tables=block_tables(batch.segments))
    device = torch.device("cuda")
    side = torch.cuda.Stream(device)
    names = ("tokens", "segments", "positions")
    for _ in range(3):
        with torch.cuda.stream(side):
            # Blocks of the copies' sizes freed holding -7, so a read that does not wait finds -7, not old values.
            poisoned = [torch.full_like(host[name], -7, device=device) for name in names]
            del poisoned
            torch.cuda._sleep(50_000_000)  # ~25 ms of the side stream before its copies start
        inputs = to_device(
            host, device, network.rotary, attention="flex", dtype=torch.float32, dynamic=False, copy_stream=side
        )
        read = {name: getattr(inputs, name).cpu() for name in names}
        for name, value in read.items():
            assert torch.equal(value, host[name]), name
    torch.cuda.synchronize()


def test_cuda_step_matches_cpu_step() -> None:
    """One step's losses on CUDA (bf16 autocast, compiled) stay near the CPU fp32 reference."""
    texts, relations = items()
    results = []
    for executor in (u.Executor.cpu(), u.Executor.for_vram([0])):
        trainer = u.Trainer.init_vram(executor, config())
        stats = u.TrainerStepStats()
        trainer.on(executor).step(["text"] * len(texts), texts, u.TrainerStepConfig(relations=relations, stats=stats))
        results.append(stats)
    cpu, cuda = results
    assert cuda.masked_text_loss == pytest.approx(cpu.masked_text_loss, rel=2e-2)
    assert cuda.contrastive_loss == pytest.approx(cpu.contrastive_loss, rel=2e-2)


def test_cuda_save_and_resume(tmp_path) -> None:
    """2 steps + save + resume + 2 steps lands where 4 straight steps land, as near as two straight runs land
    to each other. The round trip itself is exact (weights and AdamW state on the device, bit for bit); what
    follows is not: CUDA's atomic reductions (the embedding's backward) make runs differ in the last bits, and
    how far that grows in two steps varies a hundredfold between runs (H200, 2026-12-01: the largest weight
    difference of two straight runs was 4e-6 in one run, 5e-5 in the next; AdamW's normalised update grows it
    on near-zero gradients). So distances are taken over all the weights at once, relative to what the last
    two steps moved them: the resumed run must land within 4 times two straight runs' distance, or within a
    tenth of the two steps' own move (a resume that lost its AdamW moments lands 1.06 of it away, on CPU); on
    CPU the same test is bitwise."""
    executor = u.Executor.for_vram([0])
    texts, relations = items()

    def run(trainer: u.Trainer, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            stats = u.TrainerStepStats()
            config = u.TrainerStepConfig(relations=relations, stats=stats)
            trainer.on(executor).step(["text"] * len(texts), texts, config)
            losses.append(stats.loss)
        return losses

    def weights(trainer: u.Trainer) -> list[torch.Tensor]:
        return [w.detach().float().clone() for w in trainer.network.state_dict().values()]

    def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:  # over all the weights at once
        return float(torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True))))

    straight, twin = u.Trainer.init_vram(executor, config()), u.Trainer.init_vram(executor, config())
    straight_losses = run(straight, 2)
    halfway = weights(straight)
    straight_losses += run(straight, 2)
    twin_losses = run(twin, 4)
    first = u.Trainer.init_vram(executor, config())
    run(first, 2)
    path = tmp_path / "run.safetensors"
    first.on(executor).save(path)
    resumed = u.Trainer.init_vram(executor, u.TrainerInitVramConfig(resume=path))
    assert resumed.steps_taken == 2
    for a, b in zip(first.network.state_dict().values(), resumed.network.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(first.network.parameters(), resumed.network.parameters(), strict=True):
        mine, theirs = first.optimizer.state[p], resumed.optimizer.state[q]
        assert mine.keys() == theirs.keys()
        for key in mine:
            assert torch.equal(mine[key].cpu(), theirs[key].cpu()), key
            assert mine[key].device == theirs[key].device, key
    resumed_losses = run(resumed, 2)
    assert resumed_losses == pytest.approx(straight_losses[2:], rel=5e-3)
    assert twin_losses == pytest.approx(straight_losses, rel=5e-3)

    end = weights(straight)
    moved = distance(end, halfway)  # what the last two steps did
    noise, off = distance(end, weights(twin)) / moved, distance(end, weights(resumed)) / moved
    assert off <= max(4 * noise, 0.1), (off, noise)


def test_cuda_serving_matches_cpu_serving(tmp_path) -> None:
    """The served model on CUDA (compiled, FlexAttention, bf16 autocast: `uform.load`'s defaults there) against
    the CPU's f32 on one checkpoint, text and JPEG images over several batches. Stated tolerance of bf16:
    each embedding's cosine with the CPU's >= 0.999 and every value within 2e-2; token vectors likewise;
    choice probabilities within 2e-2. In f32 on CUDA (eager, dense attention): every value within 1e-4."""
    import io

    from PIL import Image

    run = resolve(
        u.TrainerInitVramConfig(
            depth=2,
            hidden=128,
            objective=u.Objective.Joint,
            batch=u.BatchShape(
                max_rows_per_device=4,
                max_segments_per_device=16,
                max_columns_per_row=256,
                max_choices_per_item=4,
                image=u.ImageShape(patch_side=16),
            ),
            late_interaction=u.LateInteraction(weight=1.0, width=32, max_query_span=8),
            schedule=u.Schedule(steps=1),
            seed=4,
        )
    )
    path = tmp_path / "serve.safetensors"
    write_fresh_checkpoint(path, run)

    texts, _ = items(40)
    rng = np.random.default_rng(0)
    images = []
    for side in (32, 48, 64, 96, 200):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (side, side + 16, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        images.append(buffer.getvalue())
    modalities = ["text"] * len(texts) + ["image"] * len(images)
    contents = [t.encode() for t in texts] + images

    cpu = u.load(path)
    cuda = u.load(path, u.Executor.for_vram([0]))
    assert cuda.compiled and cuda.bf16 and cuda.attention == "flex"
    want, got = cpu.encode(modalities, contents), cuda.encode(modalities, contents)
    assert (want * got).sum(-1).min() >= 0.999
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    again = cuda.encode(modalities[::-1], contents[::-1])  # a second call, other batches: no drift
    torch.testing.assert_close(again.flip(0), got, atol=5e-3, rtol=0)

    q_cpu, q_cuda = cpu.tokens(modalities, contents, "query"), cuda.tokens(modalities, contents, "query")
    assert (q_cpu[1] == q_cuda[1]).all()
    assert (q_cpu[0] * q_cuda[0]).sum(-1).min() >= 0.995
    choices = [b"AB", b"xyz", b" .", b"0123"] * 10
    p_cpu, p_cuda = cpu.text_choose(texts, choices)[0], cuda.text_choose(texts, choices)[0]
    np.testing.assert_allclose(p_cuda, p_cpu, atol=2e-2)

    exact = u.load(path, u.Executor.for_vram([0]), precision="f32", compiled=False)
    torch.testing.assert_close(exact.encode(modalities, contents), want, atol=1e-4, rtol=0)
    # The host stage ran in a host process (CUDA's default); in this process the same batches answer every bit.
    assert cuda.host_processes == 2 and len(cuda._stage.serve_host.processes) == 1  # 45 items: one share
    here = u.load(path, u.Executor.for_vram([0]), host_processes=0)
    assert torch.equal(here.encode(modalities, contents), got) and here._stage.serve_host is None
    # The host process's image batches crossed from its output areas, page-locked in place (`page_locks`).
    assert cuda._stage.locks is not None and cuda._stage.locks._extents
    # Calls as one stream (the next prepared and launched behind this one's last batches) answer every bit that
    # each call answers alone.
    calls = [(modalities, contents), (modalities[::-1], contents[::-1]), (modalities[:7], contents[:7])]
    streamed = list(cuda.encode_stream(calls))
    assert torch.equal(streamed[0], got) and torch.equal(streamed[1], again)
    assert torch.equal(streamed[2], cuda.encode(modalities[:7], contents[:7]))
    for model in (cpu, cuda, exact, here):
        model.close()


def test_cuda_page_locks_register_an_area_as_far_as_its_arrays_reach_and_unlock_undoes_it() -> None:
    """`PageLocks` on a shared mapping like a host process's slab: arrays in an area read as page-locked memory
    (so their copies to the GPU are asynchronous and need no staging copy), the registration grows with a batch
    that reaches further, arrays outside the area are left alone, and `unlock` undoes every registration."""
    import mmap

    from uform.page_locks import PageLocks, copies_done

    slab = mmap.mmap(-1, 64 << 20)
    area = 16 << 20
    view = np.frombuffer(slab, dtype=np.uint8)
    small, large, outside = view[area : area + 5000], view[area : area + (3 << 20) + 7], view[:4096]
    small[:] = np.arange(5000) % 251
    locks = PageLocks(torch.device("cuda", 0))
    assert locks.lock(slab, area, 2 * area, [small, outside])
    (extent,) = locks._extents.values()
    assert extent[1] == mmap.PAGESIZE * 2  # 5000 bytes: two pages, no more
    assert torch.from_numpy(small).is_pinned() and not torch.from_numpy(outside).is_pinned()
    assert locks.lock(slab, area, 2 * area, [large])
    (extent,) = locks._extents.values()
    assert extent[1] >= large.nbytes and torch.from_numpy(large).is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_device = torch.from_numpy(small).to("cuda", non_blocking=True)
    copies_done(stream)()  # returns once the copy is done: the area may be written again
    small[:] = 0
    assert torch.equal(on_device.cpu(), torch.from_numpy(np.arange(5000) % 251).to(torch.uint8))
    locks.unlock(slab)
    assert not locks._extents and not torch.from_numpy(small).is_pinned()
    del small, large, outside, view
    slab.close()


def image_checkpoint(path, objective, seed: int):
    """A fresh 2 x 128 checkpoint at `path` for serving images: 4 rows of 256, 16 segments, patch 16."""
    run = resolve(
        u.TrainerInitVramConfig(
            depth=2,
            hidden=128,
            objective=objective,
            batch=u.BatchShape(
                max_rows_per_device=4,
                max_segments_per_device=16,
                max_columns_per_row=256,
                image=u.ImageShape(patch_side=16),
            ),
            schedule=u.Schedule(steps=1),
            seed=seed,
        )
    )
    write_fresh_checkpoint(path, run)
    return path


def test_cuda_serving_gathers_images_of_one_size(tmp_path, monkeypatch) -> None:
    """Images of one size (192² at patch 16: 145 positions, which straddle FlexAttention's tiles) are served through
    the gathered dense attention (`model.attention`, kind "gathered") and answer what the CPU's f32 answers within
    bf16's tolerance (cosine >= 0.999, every value within 2e-2); a host process and this process answer every bit
    alike, and so does a host process whose areas the driver refuses to page-lock (each batch copied out instead);
    a call mixing in texts keeps FlexAttention."""
    import io

    from PIL import Image

    from uform.page_locks import PageLocks

    path = image_checkpoint(tmp_path / "serve.safetensors", u.Objective.Joint, seed=5)
    rng = np.random.default_rng(1)
    images = []
    for _ in range(40):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (192, 192, 3), dtype=np.uint8)).save(buffer, format="JPEG")
        images.append(buffer.getvalue())
    modalities = ["image"] * len(images)

    cpu = u.load(path)
    cuda = u.load(path, u.Executor.for_vram([0]))
    kinds = record_mask_kinds(cuda)
    want, got = cpu.encode(modalities, images), cuda.encode(modalities, images)
    assert kinds and set(kinds) == {"gathered"}, kinds
    assert (want * got).sum(-1).min() >= 0.999
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    here = u.load(path, u.Executor.for_vram([0]), host_processes=0)
    assert torch.equal(here.encode(modalities, images), got)
    with monkeypatch.context() as patched:
        patched.setattr(PageLocks, "lock", lambda self, *args: False)  # the driver refuses every area
        refused = u.load(path, u.Executor.for_vram([0]))
        assert torch.equal(refused.encode(modalities, images), got)
        assert refused._stage.locks is not None and not refused._stage.locks._extents
        refused.close()
    kinds.clear()
    mixed = cuda.encode(["text", *modalities[:5]], [b"a caption of some length", *images[:5]])
    assert set(kinds) == {"flex +tables"}, kinds
    torch.testing.assert_close(mixed[1:], got[:5], atol=2e-2, rtol=0)  # the same images through FlexAttention
    for model in (cpu, cuda, here):
        model.close()


def test_cuda_jpeg_decoded_on_the_device_matches_the_host_decode(tmp_path) -> None:
    """`load(jpeg="device")`: nvJPEG decodes the plain JPEGs (the rest go to the host decoders) to within a few
    levels of Pillow's pixels (stated: max 16, mean 1 of 255, on smooth pictures), so each embedding's cosine with
    the host path's is >= 0.999, eager in f32 and compiled in bf16 alike; the decoder saw the planned JPEGs only."""
    pytest.importorskip("torchvision")
    import io

    from PIL import Image

    from uform import device_pictures

    path = image_checkpoint(tmp_path / "pictures.safetensors", u.Objective.Contrastive, seed=4)

    rng = np.random.default_rng(0)
    images, planned = [], 0
    for k, (width, height) in enumerate([(64, 48), (50, 37), (200, 120), (64, 48), (96, 96), (300, 300), (33, 90)]):
        a, b, c = rng.random((3, 3))
        y, x = np.mgrid[0:height, 0:width] / max(width, height)
        field = a + b * x[..., None] + c * y[..., None]
        pixels = np.clip(field / field.max() * 255 + rng.normal(0, 6, (height, width, 3)), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90, progressive=k == 3)
        images.append(buffer.getvalue())
        planned += k not in (3, 5)  # progressive, and too large for a row: the host's
    # Many pictures of one size over several batches of the compiled model: the GPU decoder writes while the
    # batch before still runs (a picture written into memory that batch still read broke its forward).
    for _ in range(120):
        a, b = rng.random((2, 3))
        y, x = np.mgrid[0:96, 0:128] / 128
        field = a + b * (x + y)[..., None]
        pixels = np.clip(field / field.max() * 255 + rng.normal(0, 6, (96, 128, 3)), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        images.append(buffer.getvalue())
        planned += 1
    modalities = ["image"] * len(images)
    device = torch.device("cuda")
    decode = device_pictures.nvjpeg(device)
    seen: list[int] = []

    def counted(sources: list[torch.Tensor]) -> list[torch.Tensor]:
        seen.append(len(sources))
        return decode(sources)

    for data in images[:3]:
        (picture,) = decode([torch.frombuffer(bytearray(data), dtype=torch.uint8)])
        host = torch.from_numpy(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).copy()).permute(2, 0, 1)
        difference = (picture.cpu().int() - host.int()).abs()
        assert int(difference.max()) <= 16 and float(difference.float().mean()) <= 1.0
    for options in ({"precision": "f32", "compiled": False}, {}):
        host_model = u.load(path, u.Executor.for_vram([0]), **options)
        device_model = u.load(path, u.Executor.for_vram([0]), jpeg="device", **options)
        assert device_model.jpeg_decoder is not None
        device_model.jpeg_decoder = counted
        seen.clear()
        want, got = host_model.encode(modalities, images), device_model.encode(modalities, images)
        assert sum(seen) == planned
        assert (want * got).sum(-1).min() >= 0.999
        for model in (host_model, device_model):
            model.close()


def _late_and_choices_config() -> u.TrainerInitVramConfig:
    base = config()
    return u.TrainerInitVramConfig(
        depth=base.depth,
        hidden=base.hidden,
        objective=base.objective,
        batch=u.BatchShape(
            max_rows_per_device=4, max_segments_per_device=16, max_columns_per_row=256, max_choices_per_item=4
        ),
        late_interaction=u.LateInteraction(weight=0.5, width=32, max_query_span=16),
        choices=u.Choices(weight=1.0),
        schedule=base.schedule,
        seed=base.seed,
    )


def _late_and_choices_step() -> tuple[list[str], u.TrainerStepConfig]:
    texts, relations = items()
    n = len(texts)
    sides: list[Any] = ["query" if i % 2 == 0 else "document" for i in range(n)]
    sides[-1] = u.LateInteractionSide.QueryAndDocument
    choices = [b"yn" if i % 4 == 0 else b"abc" if i % 4 == 1 else b"" for i in range(n)]
    targets = [[0.3, 0.7] if c == b"yn" else [0.2, 0.3, 0.5] if c else [] for c in choices]
    return texts, u.TrainerStepConfig(relations=relations, sides=sides, choices=choices, choice_targets=targets)


def test_cuda_late_interaction_and_choices_match_cpu() -> None:
    """A compiled CUDA step (bf16 autocast, FlexAttention, MaxSim as a custom autograd function) with late
    interaction and choices on reports every term near the CPU fp32 reference, and a few more steps
    lower the loss."""
    texts, step_config = _late_and_choices_step()
    results = []
    trainers = []
    for executor in (u.Executor.cpu(), u.Executor.for_vram([0])):
        trainer = u.Trainer.init_vram(executor, _late_and_choices_config())
        stats = u.TrainerStepStats()
        step_config.stats = stats
        trainer.on(executor).step(["text"] * len(texts), texts, step_config)
        results.append(stats)
        trainers.append((trainer, executor))
    cpu, cuda = results
    assert cpu.late_interaction_loss > 0 and cpu.choices_loss > 0
    assert cuda.masked_text_loss == pytest.approx(cpu.masked_text_loss, rel=2e-2)
    assert cuda.contrastive_loss == pytest.approx(cpu.contrastive_loss, rel=2e-2)
    assert cuda.late_interaction_loss == pytest.approx(cpu.late_interaction_loss, rel=3e-2)
    assert cuda.choices_loss == pytest.approx(cpu.choices_loss, rel=5e-2, abs=5e-3)
    trainer, executor = trainers[1]
    losses = [cuda.loss]
    for _ in range(15):
        stats = u.TrainerStepStats()
        step_config.stats = stats
        trainer.on(executor).step(["text"] * len(texts), texts, step_config)
        assert np.isfinite(stats.loss)
        losses.append(stats.loss)
    assert np.mean(losses[-3:]) < losses[0]


@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_maxsim_matches_the_brute_force(compiled: bool) -> None:
    """MaxSim on CUDA, eager and compiled whole: float32 selection (autocast off) equals a float64 brute force
    on the CPU, forward and gradients; under bf16 autocast (float16 selection, the trainer's step) each value
    is the float32 similarity of a near maximum: never above the maximum, at most 2e-3 below it."""
    from uform.losses.late import maxsim

    g = torch.Generator().manual_seed(0)
    lengths = [5, 0, 16, 32, 1, 47, 0, 300]  # empty, one block, two, a single token, long; then padding
    columns = len(lengths)
    of = torch.tensor([c for c, n in enumerate(lengths) for _ in range(n)] + [columns] * 20)
    q = torch.nn.functional.normalize(torch.randn(200, 64, generator=g), dim=1)
    d = torch.nn.functional.normalize(torch.randn(len(of), 64, generator=g), dim=1)
    d[of == columns] = 0
    upstream = torch.randn(200, columns, generator=g)

    def brute(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        similarity = q @ d.T
        out = [
            similarity[:, of == c].max(dim=1).values if n else q.new_zeros(q.shape[0]) for c, n in enumerate(lengths)
        ]
        return torch.stack(out, dim=1)

    def run(fn: Any, q: torch.Tensor, d: torch.Tensor, device: str) -> tuple[torch.Tensor, ...]:
        q = q.to(device).requires_grad_(True)
        d = d.to(device).requires_grad_(True)
        out = fn(q, d)
        (out.float() * upstream.to(device, out.dtype)).sum().backward()
        return out.detach().cpu(), q.grad.cpu(), d.grad.cpu()  # type: ignore[union-attr]

    expected = [x.float() for x in run(brute, q.double(), d.double(), "cpu")]
    of_cuda = of.cuda()

    def exact(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return maxsim(q, d, of_cuda, columns, longest=300)

    def autocast(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return maxsim(q, d, of_cuda, columns, longest=300)

    if compiled:
        exact = torch.compile(exact, fullgraph=True, dynamic=False)
        autocast = torch.compile(autocast, fullgraph=True, dynamic=False)
    mine = run(exact, q, d, "cuda")
    torch.testing.assert_close(mine[0], expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(mine[1], expected[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(mine[2], expected[2], rtol=1e-4, atol=1e-5)
    values = run(autocast, q, d, "cuda")[0]
    assert values.dtype == torch.float32
    assert bool((values <= expected[0] + 1e-5).all()) and bool((values >= expected[0] - 2e-3).all())
    assert torch.equal(values[:, [1, 6]], torch.zeros(200, 2)), "an empty column scores 0"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_trainer_on_the_second_device_runs_every_thread_there() -> None:
    """CUDA's current device is per thread and a new thread's is device 0: the trainer's own threads must
    start on its device, or its completion events (and a world's gradient flags) are recorded on device 0's
    stream and read before the work they stand for is done. Same steps on devices 0 and 1, same numbers."""
    texts, relations = items()
    runs = []
    for index in (0, 1):
        executor = u.Executor.for_vram([index])
        trainer = u.Trainer.init_vram(executor, config())
        for pool in (trainer.replica._queue, trainer.replica._host, trainer.replica._completion):
            assert pool.submit(torch.cuda.current_device).result() == index
        losses = []
        for _ in range(4):
            stats = u.TrainerStepStats()
            step = u.TrainerStepConfig(relations=relations, stats=stats)
            trainer.on(executor).step(["text"] * len(texts), texts, step)
            losses.append(stats.loss)
        assert next(p.device for p in trainer.network.parameters()) == torch.device("cuda", index)
        runs.append(losses)
        trainer.close()
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-2)


def test_cuda_a_non_finite_step_is_skipped_whole_by_the_compiled_step_and_fused_adamw() -> None:
    """The device decides the skip (the fused AdamW reads the flag; nothing waits for it): a step whose Sigmoid
    loss overflows (relation weights of 1e38) leaves the weights, the moments and Adam's step counters bitwise
    as they were and `steps_taken` unchanged; it is counted and warned about; the next good step applies."""
    import warnings as _warnings

    executor = u.Executor.for_vram([0])
    trainer = u.Trainer.init_vram(executor, config(form=u.PairLossForm.Sigmoid))
    texts, relations = items()
    huge = u.Relations(
        attract=u.Edges(offsets=relations.attract.offsets, ids=relations.attract.ids, weights=[1e38] * len(texts))
    )

    def state() -> dict[str, torch.Tensor]:
        out = {f"w.{k}": v.detach().cpu().clone() for k, v in trainer.network.state_dict().items()}
        for name, p in trainer.network.named_parameters():
            for key, value in trainer.optimizer.state.get(p, {}).items():
                out[f"{key}.{name}"] = torch.as_tensor(value).detach().cpu().clone()
        return out

    def step(relations: u.Relations) -> u.TrainerStepStats:
        stats = u.TrainerStepStats()
        trainer.on(executor).step(["text"] * len(texts), texts, u.TrainerStepConfig(relations=relations, stats=stats))
        return stats

    try:
        assert step(relations).nonfinite == 0
        before = state()
        with _warnings.catch_warnings(record=True) as caught:
            _warnings.simplefilter("always")
            skipped = step(huge)
        assert any(issubclass(w.category, u.NonFiniteWarning) for w in caught)
        assert skipped.nonfinite == 1 and skipped.step == 2 and not np.isfinite(skipped.loss)
        assert trainer.steps_taken == 1
        after = state()
        assert sorted(after) == sorted(before)
        assert [k for k in before if not torch.equal(before[k], after[k])] == []
        good = step(relations)
        assert good.nonfinite == 0 and good.step == 3 and trainer.steps_taken == 2
        assert all(bool(torch.isfinite(v).all()) for v in state().values())
    finally:
        trainer.close()
