"""A serving model's host stage in processes of its own (`load(host_processes=N)`, `uform.runtime.serve_host`).

Pins: through one process, `encode`, `tokens` and `text_choose` answer bitwise what the in-process host stage
answers on the same batches; a call dealt to two processes, or cut into parts that fit a small input area (an
item larger than the area crossing the pipe), answers what each item alone answers; a broken item is named by
the caller's index from any share or part, under `errors="raise"`, `errors="mask"` and a strict policy; a killed
process fails its call with `ServeHostError` and the next call starts a new one; the processes never load torch,
and `close` ends them and their decoders; the argument is checked. Samples are other people's files (scikit-image
photographs, pygame recordings; see media_samples.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import descendants, media_batch, wait_gone, write_fresh_checkpoint
from media_samples import mixed_items

from uform import (
    LateInteraction,
    LateInteractionSide,
    Objective,
    Schedule,
    TrainerInitVramConfig,
)
from uform.media.decode import MediaPolicy
from uform.media.limits import MediaError
from uform.runtime.serve_host import SLOTS, ServeHostError
from uform.serve import load

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A fresh Joint run with late interaction over images and audio; its model served here and through one host
    process, both two items a batch in windows of five (many batches, windows cut across the call)."""
    config = TrainerInitVramConfig(
        depth=1,
        hidden=128,
        objective=Objective.Joint,
        late_interaction=LateInteraction(weight=1.0, width=16, max_query_span=7),
        batch=media_batch(),
        schedule=Schedule(steps=20, warmup_steps=1, learning_rate=1e-3),
        seed=11,
    )
    path = tmp_path_factory.mktemp("host") / "joint.safetensors"
    write_fresh_checkpoint(path, config)
    here = load(path, rows=1, segments=2, media=MediaPolicy(workers=1), host_processes=0)
    away = load(path, rows=1, segments=2, media=MediaPolicy(workers=1), host_processes=1)
    for model in (here, away):
        model.window = 5
    modalities, contents = mixed_items()
    modalities, contents = modalities * 3, contents * 3
    yield {"here": here, "away": away, "path": path, "modalities": modalities, "contents": contents}
    here.close()
    away.close()


def family(model: Any) -> set[int]:
    """The model's host processes and everything under them (their decoders' fork server, the decoders)."""
    pids = set(model.host_pids)
    return pids | {d for pid in pids for d in descendants(pid)}


def test_one_host_process_answers_bitwise_what_the_serving_process_answers(served: dict[str, Any]) -> None:
    here, away = served["here"], served["away"]
    modalities, contents = served["modalities"], served["contents"]
    assert torch.equal(away.encode(modalities, contents), here.encode(modalities, contents))
    assert len(away.host_pids) == 1 and here.host_pids == []
    sides = [LateInteractionSide.Query, LateInteractionSide.Document] * (len(contents) // 2)
    (a, a_offsets), (b, b_offsets) = away.tokens(modalities, contents, sides), here.tokens(modalities, contents, sides)
    assert torch.equal(a, b) and (a_offsets == b_offsets).all() and len(a) > 0
    texts = [c for m, c in zip(modalities, contents, strict=True) if m == "text"] + [b"x" * 300]  # one cut
    choices = [b"ab", b"xyz", b"q"] * 3 + [b"01"]
    p, q = away.text_choose(texts, choices), here.text_choose(texts, choices)
    assert (p[0] == q[0]).all() and (p[1] == q[1]).all()


def test_two_processes_and_parts_answer_what_each_item_alone_answers(served: dict[str, Any]) -> None:
    here = served["here"]
    modalities, contents = served["modalities"] * 2, served["contents"] * 2
    alone = torch.cat([here.encode([m], [c]) for m, c in zip(modalities[:8], contents[:8], strict=True)])
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=2), host_processes=2)
    try:
        model.window = 5
        together = model.encode(modalities, contents)
        assert len(model._stage.serve_host.processes) == 2 and model._stage.serve_host.decoders == 1
        assert torch.allclose(together, alone.repeat(6, 1), atol=1e-5, rtol=0)
        # An input area of 2,000 bytes: the call goes in many parts, and each WAV, larger, alone through the pipe.
        assert all(len(c) > 2000 for m, c in zip(modalities, contents, strict=True) if m == "audio")
        model._stage.serve_host.input_bytes = 2000
        assert torch.allclose(model.encode(modalities, contents), together, atol=1e-5, rtol=0)
        # A call shorter than two windows goes to one process.
        model._stage.serve_host.input_bytes = 1 << 30
        assert torch.allclose(model.encode(modalities[:9], contents[:9]), together[:9], atol=1e-5, rtol=0)
    finally:
        model.close()


def test_a_stream_through_two_host_processes_answers_each_calls_bits(served: dict[str, Any]) -> None:
    modalities, contents = served["modalities"], served["contents"]
    calls = [
        (modalities, contents),
        (["image", "text", "image"], [b"not an image", b"fine", contents[0]]),
        (modalities[:4], contents[:4]),
    ]
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=2), host_processes=2)
    try:
        model.window = 5
        streamed = list(model.encode_stream(calls, errors="mask"))
        assert len(model._stage.serve_host.processes) == 2
        for (got, valid), (m, c) in zip(streamed, calls, strict=True):
            want, ok = model.encode(m, c, errors="mask")  # each call alone, through the same two processes
            assert torch.equal(valid, ok) and torch.equal(got[valid], want[ok]) and got[~valid].isnan().all()
        assert streamed[1][1].tolist() == [False, True, True]
    finally:
        model.close()


def test_a_broken_item_is_named_by_the_callers_index_from_any_process(served: dict[str, Any]) -> None:
    here = served["here"]
    modalities, contents = list(served["modalities"] * 2), list(served["contents"] * 2)
    contents[38] = contents[38][:200]  # an image item of the second share, cut short
    contents[44] = b"not an image"  # another one
    contents[24] = b"not an image either"  # the second share's first item: its first window reports it
    contents[22] = b"nor this"  # the first share's last window: the call's first broken item
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=2), host_processes=2)
    strict = load(served["path"], media=MediaPolicy(workers=2, strict=True), host_processes=2)
    try:
        model.window = 5
        # The second share's report is held until the first share is done, so the raise names the first item.
        with pytest.raises(MediaError, match=r"^contents\[22\]: ") as caught:
            model.encode(modalities, contents)
        assert caught.value.item == 22
        fixed = [*contents[:22], served["contents"][22], *contents[23:]]
        with pytest.raises(MediaError, match=r"^contents\[24\]: "):
            model.encode(modalities, fixed)
        got, valid = model.encode(modalities, contents, errors="mask")
        want, expected = here.encode(modalities, contents, errors="mask")
        assert (valid == expected).all() and (~valid).nonzero().flatten().tolist() == [22, 24, 38, 44]
        assert torch.isnan(got[~valid]).all() and torch.allclose(got[valid], want[valid], atol=1e-5, rtol=0)
        # A strict policy raises in a process's decoding; the error crosses with the item by the caller's index,
        # the second share's held until the first share is done.
        strict.window = 4
        with pytest.raises(MediaError, match=r"^contents\[22\]: "):
            strict.encode(modalities, contents)
        with pytest.raises(MediaError, match=r"^contents\[44\]: "):
            strict.encode(["text"] * 40 + modalities[40:], [b"t"] * 40 + contents[40:])
        assert len(strict._stage.serve_host.processes) == 2
    finally:
        model.close()
        strict.close()


def test_a_leased_batch_keeps_its_bits_until_released_and_a_stop_ends_the_wait_for_it(served: dict[str, Any]) -> None:
    """The host processes' batches are read in place (`Prepared.release`): an area is not written again while its
    batch is held, a released area takes the call's next batch, and a stopped call whose batches were dropped
    unreleased ends instead of waiting for them; the model's next call runs (`HostStage.release_leases`)."""
    modalities, contents = served["modalities"] * 2, served["contents"] * 2
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=1), host_processes=1)
    try:
        model.window = 5
        job = model._encode_job(modalities, contents, None, (), "mask")
        stop = threading.Event()
        messages = model._stage.batches(job, model._pipeline.setting(), stop)
        held: list[tuple[Any, dict[str, torch.Tensor]]] = []
        while len(held) < SLOTS:  # every area holds a batch, none released
            kind, value = next(messages)
            if kind == "batch":
                assert value.release is not None
                held.append((value, {k: t.clone() for k, t in value.tensors.items()}))
        seen: list[Any] = []
        waiting = threading.Thread(target=lambda: seen.append(next(messages, None)))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not seen  # no area is free: the next batch waits for a release
        for prepared, bits in held:  # nothing was written over a held batch
            assert all(torch.equal(prepared.tensors[k], t) for k, t in bits.items())
        held[0][0].release(None)
        waiting.join(30)
        assert not waiting.is_alive() and seen[0] is not None  # the released area took the next message
        waiting = threading.Thread(target=lambda: seen.append(next(messages, None)))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and len(seen) == 1  # every area held again
        stop.set()  # the held batches dropped unreleased: the call ends rather than wait for them
        waiting.join(30)
        assert not waiting.is_alive() and seen[1] is None
        messages.close()
        model._stage.release_leases()
        # In parts (an input area of 2,000 bytes), a part's end opens the next, whose first batch waits for an area
        # still held: a stop ends that wait too.
        model._stage.serve_host.input_bytes = 2000
        stop = threading.Event()
        messages = model._stage.batches(job, model._pipeline.setting(), stop)
        kept: list[Any] = []
        waiting = threading.Thread(target=lambda: kept.extend(messages))  # every batch held, none released
        waiting.start()
        deadline = time.monotonic() + 30
        while not any(kind == "batch" for kind, _ in kept) and time.monotonic() < deadline:
            time.sleep(0.01)  # the first batch, however slow the machine
        assert waiting.is_alive() and 0 < sum(kind == "batch" for kind, _ in kept) <= SLOTS
        stop.set()
        waiting.join(30)
        assert not waiting.is_alive()
        model._stage.release_leases()
        model._stage.serve_host.input_bytes = 1 << 30
        got, valid = model.encode(modalities[:12], contents[:12], errors="mask")
        want, ok = served["here"].encode(modalities[:12], contents[:12], errors="mask")
        assert torch.equal(valid, ok) and torch.equal(got[valid], want[ok])
    finally:
        model.close()


def test_a_killed_process_fails_its_call_and_the_next_call_starts_a_new_one(served: dict[str, Any]) -> None:
    here = served["here"]
    modalities, contents = served["modalities"] * 2, served["contents"] * 2
    model = load(served["path"], rows=1, segments=2, media=MediaPolicy(workers=1), host_processes=1)
    try:
        model.window = 5
        first = model.encode(modalities[:8], contents[:8])
        gone = family(model)
        assert len(gone) >= 3  # the host process, its decoders' fork server, a decoder
        (process,) = model._stage.serve_host.processes

        def kill(done: int, total: int) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)

        with pytest.raises(ServeHostError, match=r"serving host process \(pid \d+\) (died \(signal 9\)|is gone)"):
            model.encode(modalities, contents, progress=kill)  # 24 batches: most not yet asked for at the kill
        assert not wait_gone(gone), "the killed host process left processes behind"
        again = model.encode(modalities, contents)
        assert torch.allclose(again[:8], first, atol=1e-5, rtol=0)
        assert torch.allclose(again, here.encode(modalities, contents), atol=1e-5, rtol=0)
        assert model._stage.serve_host.processes[0].pid != process.pid
    finally:
        model.close()


def test_the_processes_never_load_torch_and_close_ends_them(served: dict[str, Any]) -> None:
    model = served["away"]
    model.encode(served["modalities"], served["contents"])
    pids = family(model)
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            assert "libtorch" not in (Path("/proc") / str(pid) / "maps").read_text(), pid
    model.close()
    assert model._stage.serve_host is None and not wait_gone(pids), "close left host processes behind"
    # A call of texts alone packs in this process: no host process starts for it.
    assert torch.equal(model.encode(["text"], ["still usable"]), served["here"].encode(["text"], ["still usable"]))
    assert model._stage.serve_host is None


def test_the_argument_and_where_the_host_stage_runs(served: dict[str, Any]) -> None:
    path = served["path"]
    for bad, error in ((True, TypeError), ("2", TypeError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(error, match="host_processes"):
            load(path, host_processes=bad)
    cpu = load(path)
    assert cpu.host_processes == 0  # the CPU's default: its forward runs without the interpreter lock
    cpu.close()
    # A model that keeps decoded units (an evaluator's) decodes in this process, whose memory keeps them.
    model = load(path, media=MediaPolicy(workers=1), host_processes=1)
    try:
        model.keep_decoded = True
        got = model.encode(served["modalities"][:8], served["contents"][:8])
        assert model._stage.serve_host is None and model._stage.decoders is not None and len(model._stage.decoded) == 5
        want = served["here"].encode(served["modalities"][:8], served["contents"][:8])  # two items a batch, not 8
        assert torch.allclose(got, want, atol=1e-5, rtol=0)
    finally:
        model.close()
