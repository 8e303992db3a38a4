"""Serving media items (issue 4): images and audio through `uform.load(...).encode` and `tokens`.

Pins: `encode` of images, audio and text together answers what a Contrastive step's arena answered on the
same items and weights (1e-4 on the CPU); many more media items than a batch holds answer what each alone
answers; a broken item is refused by default with a `MediaError` naming it while the arena stays as it was
(issue 10, item 7), or, under `errors="mask"`, answered invalid in a mask, its row NaN (-128 in I8), with one
`MediaWarning` per model however many items break, every one counted in `Model.notices`; media
token vectors number one per unit (a query's at most `max_query_span`). Samples are other people's files
(scikit-image photographs, pygame recordings; see media_samples.py).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import media_batch, record_mask_kinds, write_fresh_checkpoint
from media_samples import mixed_items, photo_jpeg, recording_wav

from uform import (
    Arena,
    Edges,
    Executor,
    LateInteraction,
    Objective,
    Relations,
    Schedule,
    Trainer,
    TrainerInitVramConfig,
    TrainerStepConfig,
)
from uform.config import resolve
from uform.evaluate import evaluate_retrieval
from uform.media.decode import MediaPolicy, decode_item
from uform.media.limits import MediaError, MediaLimits
from uform.notices import MediaWarning, Notices
from uform.serve import load

torch.set_num_threads(2)

COLUMNS = 128


def config(**overrides: Any) -> TrainerInitVramConfig:
    fields: dict[str, Any] = dict(
        depth=1,
        hidden=128,
        objective=Objective.Contrastive,
        batch=media_batch(COLUMNS),
        schedule=Schedule(steps=20, warmup_steps=1, learning_rate=1e-3),
        seed=9,
    )
    fields.update(overrides)
    return TrainerInitVramConfig(**fields)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A Contrastive media run of two steps, saved, then the arena of its third step; the loaded model."""
    modalities, contents = mixed_items()
    relations = Relations(attract=Edges(offsets=list(range(9)), ids=[1, 0, 3, 2, 5, 4, 7, 6]))
    trainer = Trainer.init_vram(Executor.cpu(), config(), media=MediaPolicy(workers=2))
    path = tmp_path_factory.mktemp("media") / "media.safetensors"
    try:
        for _ in range(2):
            trainer.step(modalities, contents, TrainerStepConfig(relations=relations))
        trainer.save(path)
        arena = trainer.step(modalities, contents, TrainerStepConfig(relations=relations, arena=Arena()))
    finally:
        trainer.close()
    model = load(path, media=MediaPolicy(workers=2))
    yield {"model": model, "arena": arena, "modalities": modalities, "contents": contents, "path": path}
    model.close()


def test_encode_of_media_equals_the_arena_of_a_contrastive_step(served: dict[str, Any]) -> None:
    model = served["model"]
    got = model.encode(served["modalities"], served["contents"])
    assert got.shape == (8, 128)
    assert torch.allclose(got, served["arena"], atol=1e-4, rtol=0)
    # Images and audio do not collapse onto one vector.
    similarity = got @ got.T
    assert float(similarity[~torch.eye(8, dtype=torch.bool)].max()) < 0.9999


def test_units_kept_decoded_hold_memory_of_their_own(served: dict[str, Any]) -> None:
    """The decoders answer views of their shared memory, taken while the views live: an evaluator's model keeps
    its held-out media's units for its whole life, so it copies them out first and the decoders keep their room."""
    model = load(served["path"], media=MediaPolicy(workers=1))
    try:
        model.keep_decoded = True
        first = model.encode(served["modalities"], served["contents"])
        assert torch.equal(model.encode(served["modalities"], served["contents"]), first)  # the second from the cache
        kept = [u for u in model._stage.decoded.values() if not isinstance(u, str)]
        (worker,) = model._stage.decoders._workers
        assert len(kept) == 5 and worker.areas.held == []
        assert all(u.key is None for u in kept)  # serving draws no masks, so its decoders skip the items' keys
        slab = np.frombuffer(worker.helper.slab, dtype=np.uint8)
        assert not any(np.shares_memory(u.values, slab) or np.shares_memory(u.positions, slab) for u in kept)
        del slab
    finally:
        model.close()


def test_many_media_items_answer_what_each_alone_answers(served: dict[str, Any]) -> None:
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=2))
    try:
        modalities = served["modalities"] * 3
        contents = served["contents"] * 3
        model.window = 5  # windows cut across the call, as a long call's would
        together = model.encode(modalities, contents)
        alone = torch.cat([model.encode([m], [c]) for m, c in zip(modalities[:8], contents[:8], strict=True)])
        assert torch.allclose(together, alone.repeat(3, 1), atol=1e-5, rtol=0)
        assert torch.allclose(together[:8], served["arena"], atol=1e-4, rtol=0)
    finally:
        model.close()


def test_media_in_wide_rows_answer_what_the_run_rows_answer(served: dict[str, Any]) -> None:
    """Rows wider than the run's (`Model.packing`, FlexAttention's on CUDA), forced on the dense path: more
    media items a batch, the same answers."""
    model = load(served["path"], rows=4, segments=8, media=MediaPolicy(workers=2))
    try:
        modalities, contents = served["modalities"] * 2, served["contents"] * 2
        model.packing = (1, 4 * model.columns)
        got = model.encode(modalities, contents)
        assert torch.allclose(got, served["arena"].repeat(2, 1), atol=1e-4, rtol=0)
        assert torch.allclose(got, served["model"].encode(modalities, contents), atol=1e-5, rtol=0)
    finally:
        model.close()


def test_the_next_window_decodes_while_this_one_is_packed(served: dict[str, Any]) -> None:
    """The host stage's decoding runs a window ahead of its packing (issue 12, serving): the first window's
    first batch is packed only once the second window's decoding has begun, so this call would hang (and fail
    at the wait's deadline) if the windows decoded one after the other on the packing thread."""
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=2))
    try:
        model.window = 4
        decoding, packing = model._stage.decode, model._stage.prepare
        second_began = threading.Event()
        threads: set[str] = set()

        def decode(job: Any, setting: Any, window: range) -> Any:
            threads.add(threading.current_thread().name)
            if window.start == model.window:
                second_began.set()
            return decoding(job, setting, window)

        def prepare(*args: Any) -> Any:
            assert second_began.wait(30), "the second window did not start decoding while the first was packed"
            return packing(*args)

        model._stage.decode, model._stage.prepare = decode, prepare  # type: ignore[method-assign]
        modalities, contents = served["modalities"] * 2, served["contents"] * 2
        got = model.encode(modalities, contents)
        assert torch.allclose(got[:8], served["arena"], atol=1e-4, rtol=0)
        assert threads and all(name.startswith("uform-serve-decode") for name in threads)
        # A broken item of a later window raises naming it, and no decoding thread outlives the call.
        broken = list(contents)
        broken[9] = b"not an image"
        modalities[9] = "image"
        with pytest.raises(MediaError, match=r"^contents\[9\]: "):
            model.encode(modalities, broken)
        assert not [t for t in threading.enumerate() if t.name.startswith("uform-serve-decode")]
    finally:
        model.close()


def test_a_broken_item_raises_naming_it_before_any_vector(served: dict[str, Any]) -> None:
    """Issue 10, item 7: the default answers no vector for a broken item (it answered a zero row)."""
    model = served["model"]
    with pytest.raises(MediaError, match=r"^contents\[0\]: ") as caught:
        model.encode(["image"], [b"not an image"])
    assert caught.value.item == 0 and isinstance(caught.value, ValueError)
    arena = Arena()
    kept = model.encode(["text"], ["kept"], arena=arena).clone()
    broken = served["contents"][0][:200]  # a JPEG cut short
    contents = [b"fine text", broken, served["contents"][2], b"not an image at all"]
    with pytest.raises(MediaError, match=r"^contents\[1\]: cannot decode the JPEG image"):
        model.encode(["text", "image", "audio", "image"], contents, arena=arena)
    assert torch.equal(arena.embeddings, kept) and arena.present.tolist() == [True]


def test_a_lenient_call_answers_a_mask_and_no_real_looking_row(served: dict[str, Any]) -> None:
    model = served["model"]
    model.notices = Notices()  # this test reads the model's first media warning
    broken = served["contents"][0][:200]
    modalities = ["text", "image", "audio", "image"]
    contents = [b"fine text", broken, served["contents"][2], b"not an image at all"]
    arena = Arena()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, valid = model.encode(modalities, contents, arena=arena, errors="mask")
    messages = [str(w.message) for w in caught if issubclass(w.category, MediaWarning)]
    assert len(messages) == 1, messages
    assert messages[0].startswith("uform: skipped 2 media items") and "contents[1] (image): " in messages[0]
    assert "contents[3] (image): " in messages[0]
    assert valid.tolist() == [True, False, True, False] and arena.present.tolist() == valid.tolist()
    assert torch.isnan(got[[1, 3]]).all() and torch.isfinite(got[[0, 2]]).all()
    assert got is arena.embeddings
    good = model.encode(["text", "audio"], [contents[0], contents[2]])
    assert torch.allclose(got[[0, 2]], good, atol=1e-5)
    assert model.notices.count("media") == 2
    # I8 has no NaN: an invalid row holds -128, which no real row (clamped to [-127, 127]) takes.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eight, valid = model.encode(modalities, contents, outputs_scalar="i8", errors="mask")
    assert not [w for w in caught if issubclass(w.category, MediaWarning)]  # shown once per model
    assert (eight[[1, 3]] == -128).all() and int(eight[[0, 2]].min()) >= -127
    assert model.notices.count("media") == 4


def test_many_broken_items_of_a_call_warn_once_and_count_every_one(served: dict[str, Any]) -> None:
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=1))
    try:
        model.window = 3  # broken items across several windows of the call
        count = 7
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, valid = model.encode(["image"] * count + ["text"], [b"not an image"] * count + [b"x"], errors="mask")
        assert len([w for w in caught if issubclass(w.category, MediaWarning)]) == 1
        assert valid.tolist() == [False] * count + [True]
        assert model.notices.count("media") == count
    finally:
        model.close()


def test_errors_is_checked(served: dict[str, Any]) -> None:
    model = served["model"]
    with pytest.raises(ValueError, match=r"errors: expected one of \('raise', 'mask'\), got 'skip'"):
        model.encode(["text"], ["a"], errors="skip")
    with pytest.raises(TypeError, match="errors"):
        model.encode(["text"], ["a"], errors=None)


def test_a_broken_item_under_strict_raises_and_changes_nothing(served: dict[str, Any]) -> None:
    model = load(served["path"], media=MediaPolicy(workers=1, strict=True))
    try:
        arena = Arena()
        kept = model.encode(["text"], ["kept"], arena=arena).clone()
        with pytest.raises(MediaError, match=r"^contents\[2\]: "):
            model.encode(["text", "image", "image"], ["a", served["contents"][0], b"\x89PNG broken"], arena=arena)
        assert torch.equal(arena.embeddings, kept)
        # An item over a limit is refused by name as well.
        small = load(served["path"], media=MediaPolicy(workers=1, strict=True, limits=MediaLimits(max_bytes=100)))
        with pytest.raises(MediaError, match=r"^contents\[0\]: "):
            small.encode(["image"], [served["contents"][0]])
        small.close()
    finally:
        model.close()


def test_media_tokens_are_one_per_unit(tmp_path: Path) -> None:
    span = 7
    run = resolve(config(late_interaction=LateInteraction(weight=1.0, width=16, max_query_span=span)))
    path = tmp_path / "late-media.safetensors"
    write_fresh_checkpoint(path, run)
    model = load(path, media=MediaPolicy(workers=1))
    try:
        image, sound = photo_jpeg("astronaut.png", (64, 48)), recording_wav(0.2)
        b = run.batch
        units = [
            len(decode_item("image", image, dict(vars(b.image)), COLUMNS - 2, MediaLimits())),
            len(decode_item("audio", sound, dict(vars(b.audio)), COLUMNS - 2, MediaLimits())),
        ]
        assert units == [12, 10]
        data, offsets = model.tokens(["image", "audio", "text"], [image, sound, b"abc"], "document")
        assert np.diff(offsets).tolist() == [12, 10, 3] and data.shape == (25, 16)
        data, offsets = model.tokens(["image", "audio", "text"], [image, sound, b"abc"], "query")
        assert np.diff(offsets).tolist() == [span, span, 3]
        with pytest.raises(MediaError, match=r"^contents\[0\]: "):
            model.tokens(["image", "text"], [b"broken", b"abc"], "document")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            data, offsets, valid = model.tokens(["image", "text"], [b"broken", b"abc"], "document", errors="mask")
        assert np.diff(offsets).tolist() == [0, 3] and valid.tolist() == [False, True] and data.shape == (3, 16)
        assert len([w for w in caught if issubclass(w.category, MediaWarning)]) == 1
    finally:
        model.close()


def test_evaluate_retrieval_refuses_a_broken_item(served: dict[str, Any]) -> None:
    """The metrics never score a stand-in vector (a zero row scored 0 against every query, silently)."""
    documents = (["image", "text"], [b"not an image", b"a cat looks up"])
    with pytest.raises(MediaError, match=r"^contents\[0\]: "):
        evaluate_retrieval(served["model"], ["a cat"], documents, [1])


def test_a_stream_of_calls_answers_what_each_call_answers_bitwise(served: dict[str, Any]) -> None:
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=2))
    try:
        model.window = 3  # windows cut across each call, as a long call's would
        mods, contents = served["modalities"], served["contents"]
        calls = [
            (mods, contents),
            (["text", "image", "audio"], [b"fine text", contents[0][:200], contents[2]]),  # a JPEG cut short
            (mods[:3], contents[:3]),
        ]
        alone = [model.encode(m, c, 64, outputs_scalar="f16", errors="mask") for m, c in calls]
        model.notices = Notices()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            streamed = list(model.encode_stream(calls, 64, outputs_scalar="f16", errors="mask"))
        assert len(streamed) == 3
        for (got, valid), (want, ok) in zip(streamed, alone, strict=True):
            assert torch.equal(valid, ok) and got.dtype == torch.float16 and got.shape == want.shape
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bitwise, the NaN rows too
        assert streamed[1][1].tolist() == [True, False, True]
        messages = [str(w.message) for w in caught if issubclass(w.category, MediaWarning)]
        assert len(messages) == 1 and "contents[1] (image): " in messages[0]  # each call's own index
        assert model.notices.count("media") == 1
    finally:
        model.close()


def test_a_stream_prepares_the_next_calls_while_its_caller_holds_an_answer(served: dict[str, Any]) -> None:
    model = served["model"]
    asked = threading.Event()

    def calls() -> Iterator[tuple[list[str], list[bytes]]]:
        yield ["text"], [b"the first"]
        yield ["image"], [served["contents"][0]]
        asked.set()  # the model asks for the third call once the second is prepared
        yield ["text"], [b"the third"]

    stream = model.encode_stream(calls())
    first = next(stream)
    # The caller holds the first answer; the preparing thread went on through the second call, without it.
    assert asked.wait(60)
    rest = list(stream)
    assert len(rest) == 2 and not model._pipeline.lock.locked()
    assert torch.equal(first, model.encode(["text"], [b"the first"]))
    assert torch.equal(rest[0], model.encode(["image"], [served["contents"][0]]))


def test_a_refused_or_broken_call_raises_after_the_calls_before_it(served: dict[str, Any]) -> None:
    model = served["model"]

    def calls(second: tuple[list[str], list[bytes]]) -> Iterator[tuple[list[str], list[bytes]]]:
        yield ["text"], [b"fine"]
        yield second
        raise AssertionError("a call after a failed one is never asked for")

    stream = model.encode_stream(calls((["sound"], [b"x"])))
    assert next(stream).shape == (1, 128)
    with pytest.raises(ValueError, match=r"^calls\[1\]: modalities\[0\]"):
        next(stream)
    stream = model.encode_stream(calls((["text", "image"], [b"fine", b"not an image"])))  # errors="raise"
    assert next(stream).shape == (1, 128)
    with pytest.raises(MediaError, match=r"^contents\[1\]: ") as caught:
        next(stream)
    assert caught.value.item == 1 and not model._pipeline.lock.locked()
    stream = model.encode_stream(iter([(["text"], [b"a"])] * 5))
    next(stream)
    stream.close()  # a stream closed early gives the model back
    assert not model._pipeline.lock.locked() and model.encode(["text"], [b"a"]).shape == (1, 128)


def test_a_streams_arguments_are_checked_before_anything_runs(served: dict[str, Any]) -> None:
    model = served["model"]
    with pytest.raises(ValueError, match=r"^width: must lie in \[1, hidden = 128\], got 129"):
        model.encode_stream([], 129)
    with pytest.raises(ValueError, match="errors"):
        model.encode_stream([], errors="ignore")
    with pytest.raises(ValueError, match="outputs_scalar"):
        model.encode_stream([], outputs_scalar="f64")
    for calls in (5, "text", {"text": b"x"}):
        with pytest.raises(TypeError, match=r"^calls: expected an iterable of"):
            model.encode_stream(calls)
    with pytest.raises(TypeError, match=r"^calls\[0\]: expected a \(modalities, contents\) pair, got str"):
        next(model.encode_stream(["text"]))
    assert list(model.encode_stream([])) == [] and not model._pipeline.lock.locked()


def test_a_call_from_inside_a_stream_is_refused_not_a_hang(served: dict[str, Any]) -> None:
    model = served["model"]
    stream = model.encode_stream([(["text"], [b"a"]), (["text"], [b"b"])])
    next(stream)
    with pytest.raises(RuntimeError, match=r"^Model: a call while this thread's own call or encode_stream"):
        model.encode(["text"], [b"c"])
    with pytest.raises(RuntimeError, match=r"^Model: close while"):
        model.close()
    assert len(list(stream)) == 1 and not model._pipeline.lock.locked()
    seen = []

    def progress(done: int, total: int) -> bool:
        with pytest.raises(RuntimeError, match="still running"):  # a progress callback that calls the model
            model.encode(["text"], [b"d"])
        seen.append(done)
        return True

    assert model.encode(["text"], [b"e"], progress=progress).shape == (1, 128) and seen == [1]


def test_images_of_one_size_through_the_gathered_attention_answer_what_dense_answers(tmp_path: Path) -> None:
    """Serving's gathered attention (`model.attention`, kind "gathered") through the whole serving path on the CPU:
    a model set to the flex path as on CUDA (wide rows, the full capacity packed, here with FlexAttention's eager
    reference and no compile), its batches of 192² images (145 positions each, which straddle tiles) all gathered
    and sent by the host process without block tables, answers what the dense path answers; a call that mixes in a
    text keeps the block mask and its tables. (tests/test_cuda.py runs it compiled, in bf16.)"""
    path = tmp_path / "serve.safetensors"
    write_fresh_checkpoint(path, resolve(config(depth=2, batch=media_batch(256), seed=5)))
    names = ("astronaut.png", "coffee.png", "chelsea.png")
    images = [photo_jpeg(names[i % 3], (192, 192)) for i in range(9)]
    modalities = ["image"] * len(images)
    dense = load(path, media=MediaPolicy(workers=2))
    flex = load(path, media=MediaPolicy(workers=2), host_processes=1)
    kinds = record_mask_kinds(flex)
    try:
        flex.attention, flex.compiled, flex.packing = "flex", True, (1, 4 * flex.columns)
        want = dense.encode(modalities, images)
        got = flex.encode(modalities, images)
        assert len(kinds) >= 2 and set(kinds) == {"gathered"}, kinds
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        kinds.clear()
        mixed = flex.encode(["text", *modalities[:3]], [b"a caption", *images[:3]])
        assert set(kinds) == {"flex +tables"}, kinds
        torch.testing.assert_close(mixed[1:], want[:3], atol=1e-5, rtol=0)
    finally:
        dense.close()
        flex.close()
