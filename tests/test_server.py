"""The embeddings server (issue 15, item 4): `uform.server` under uvicorn on a loopback port, driven by the
official `openai` client and by raw HTTP (httpx).

Pins: `/v1/embeddings` answers `Model.encode`'s vectors (single, batched, every Matryoshka width, float and
base64), whatever `model` the request names; 200 concurrent requests through a pool of 16 clients each answer
their own vectors; malformed JSON, wrong types, unknown fields, token ids, oversized bodies and lists are 4xx
naming the field and the server keeps serving; media items travel as data URLs, a broken one is a 400 naming
its index (never a vector) and costs no other request its answer; `/v1/maxsim` answers `Model.maxsim` of the
query and document token vectors, and a model without a token head says so (404); a full queue is 503; the
batcher gathers waiting requests of one key into one call; `serve_http` and `uform serve` print where they
listen and stop cleanly on SIGINT and SIGTERM.
"""

from __future__ import annotations

import base64
import gc
import importlib.util
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch
from conftest import media_batch
from PIL import Image

from uform import Contrastive, LateInteraction, Objective, Schedule
from uform import TrainerInitVramConfig as Config
from uform.batching import Batcher, Busy
from uform.config import resolve, to_json
from uform.exporting import export
from uform.media.decode import MediaPolicy
from uform.model.network import Network
from uform.replica.checkpoint import write_checkpoint
from uform.serve import Model, load
from uform.server import Limits, Server, create_app, serve_http

torch.set_num_threads(2)

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["a small cat sleeps", "the red bus stops", "rain on a window", "a kitten is napping", "héllo wörld ✓"]
LIMITS = Limits(max_body_bytes=256 * 1024, max_inputs=32, max_queued=4096)


def write_model(path: Path, **overrides: Any) -> Path:
    """A trainer checkpoint of a freshly initialised tiny network (depth 1, hidden 128): Contrastive with
    Matryoshka widths 32 and 64, images in 16-pixel patches, audio; keywords replace config fields."""
    fields: dict[str, Any] = dict(
        depth=1,
        hidden=128,
        objective=Objective.Contrastive,
        contrastive=Contrastive(matryoshka_dimensions=(32, 64)),
        batch=media_batch(),
        schedule=Schedule(steps=10, warmup_steps=1),
        seed=5,
    )
    fields.update(overrides)
    config = resolve(Config(**fields))
    network = Network(config)
    network.initialize(config.seed)
    tensors = {f"weights.{k}": v for k, v in network.state_dict().items()}
    write_checkpoint(
        path, tensors, {"uform.format": "uform.trainer.1", "uform.config": to_json(config), "uform.step": "0"}
    )
    return path


def png(seed: int, size: tuple[int, int] = (40, 24)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()


def data_url(content: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(content).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A late-interaction model (token width 16, queries of at most 8 vectors) served on a free loopback port."""
    path = write_model(
        tmp_path_factory.mktemp("served") / "tiny.safetensors",
        late_interaction=LateInteraction(weight=1.0, width=16, max_query_span=8),
    )
    model = load(path, media=MediaPolicy(workers=1))
    with Server(create_app(model, limits=LIMITS)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        http = httpx.Client(base_url=server.url, timeout=60)
        yield {"model": model, "server": server, "client": client, "http": http, "path": path}
        http.close()
        client.close()
    model.close()


def vectors(answer: Any) -> np.ndarray:
    return np.array([d.embedding for d in answer.data], dtype=np.float32)


def assert_still_serving(context: dict[str, Any]) -> None:
    health = context["http"].get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    got = vectors(context["client"].embeddings.create(model="x", input=TEXTS[0], encoding_format="float"))
    want = context["model"].encode(["text"], TEXTS[:1]).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


# ---- the OpenAI client ----------------------------------------------------------------------------


def test_a_single_input_answers_model_encode_and_names_the_served_model(served: dict[str, Any]) -> None:
    answer = served["client"].embeddings.create(model="text-embedding-3-small", input=TEXTS[4], encoding_format="float")
    assert answer.model == "tiny" and answer.object == "list" and len(answer.data) == 1
    assert answer.data[0].index == 0 and len(answer.data[0].embedding) == 128
    np.testing.assert_allclose(vectors(answer), served["model"].encode(["text"], TEXTS[4:]).numpy(), atol=1e-6, rtol=0)
    # uform's tokens are bytes: the usage counts the UTF-8 bytes read (é, ö two each, ✓ three).
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == len(TEXTS[4].encode()) == 17


def test_batched_inputs_at_every_matryoshka_width(served: dict[str, Any]) -> None:
    model = served["model"]
    for width in (32, 64, 128):
        answer = served["client"].embeddings.create(model="m", input=TEXTS, dimensions=width, encoding_format="float")
        assert [d.index for d in answer.data] == list(range(len(TEXTS)))
        got = vectors(answer)
        assert got.shape == (len(TEXTS), width)
        np.testing.assert_allclose(got, model.encode(["text"] * len(TEXTS), TEXTS, width).numpy(), atol=1e-6, rtol=0)
    with pytest.raises(openai.BadRequestError) as refused:
        served["client"].embeddings.create(model="m", input=TEXTS, dimensions=48)
    body = refused.value.body
    assert body["param"] == "dimensions" and "48" in body["message"] and "32, 64, 128" in body["message"]


def test_base64_is_little_endian_float32_and_the_default_client_decodes_it(served: dict[str, Any]) -> None:
    client, model = served["client"], served["model"]
    want = model.encode(["text"] * 3, TEXTS[:3], 64).numpy()
    raw = client.embeddings.create(model="m", input=TEXTS[:3], dimensions=64, encoding_format="base64")
    got = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in raw.data])
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    # Without encoding_format the client asks for base64 itself and decodes it into floats.
    np.testing.assert_allclose(
        vectors(client.embeddings.create(model="m", input=TEXTS[:3], dimensions=64)), want, atol=1e-6
    )


def test_a_burst_of_200_concurrent_requests_each_answers_its_own_vectors(served: dict[str, Any]) -> None:
    model, client = served["model"], served["client"]
    rng = np.random.default_rng(0)
    pool = [f"request text {i}: " + "lorem ipsum " * (i % 7) for i in range(40)]
    requests = [
        ([pool[j] for j in rng.choice(40, size=int(rng.integers(1, 4)), replace=False)], int(w))
        for w in rng.choice([32, 64, 128], 200)
    ]
    want = {w: dict(zip(pool, model.encode(["text"] * 40, pool, w).numpy(), strict=True)) for w in (32, 64, 128)}

    def ask(request: tuple[list[str], int]) -> np.ndarray:
        texts, width = request
        return vectors(client.embeddings.create(model="m", input=texts, dimensions=width, encoding_format="float"))

    with ThreadPoolExecutor(16) as workers:
        answers = list(workers.map(ask, requests, timeout=300))
    for (texts, width), got in zip(requests, answers, strict=True):
        np.testing.assert_allclose(got, np.stack([want[width][t] for t in texts]), atol=1e-5, rtol=0)
    assert_still_serving(served)


def test_models_and_health(served: dict[str, Any]) -> None:
    listed = served["client"].models.list().data
    assert [m.id for m in listed] == ["tiny"] and listed[0].owned_by == "uform"
    card = served["http"].get("/v1/models").json()["data"][0]
    assert card["dimensions"] == [32, 64, 128] and card["modalities"] == ["text", "image", "audio"]
    assert card["late_interaction"] is True and card["max_text_bytes"] == 128 - 2  # modality and side markers
    health = served["http"].get("/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny" and health["queued"] == 0


# ---- refusals ---------------------------------------------------------------------------------------

BAD_BODIES = [
    (b'{"input": "a", ', 400, None, "malformed JSON"),
    (b"\xff\xfe", 400, None, "body"),
    (b'["a"]', 400, None, "expected a JSON object, got an array"),
    (b'{"model": "m"}', 400, "input", "input: required"),
    (b'{"input": 5}', 400, "input", "input: expected a string or a list of items, got a number"),
    (b'{"input": []}', 400, "input", "input: an empty list"),
    (b'{"input": ""}', 400, "input", "empty string"),
    (b'{"input": [1, 2, 3]}', 400, "input", "token-id arrays are not supported"),
    (b'{"input": ["a", [1, 2]]}', 400, "input[1]", "token-id arrays are not supported"),
    (b'{"input": ["a", null]}', 400, "input[1]", "input[1]: expected a string or an item object, got null"),
    (b'{"input": "a", "dimensions": "64"}', 400, "dimensions", "expected an integer, got a string"),
    (b'{"input": "a", "dimensions": true}', 400, "dimensions", "expected an integer, got a boolean"),
    (b'{"input": "a", "encoding_format": "hex"}', 400, "encoding_format", "'float' or 'base64'"),
    (b'{"input": "a", "dimension": 64}', 400, "dimension", "dimension: unknown field"),
    (b'{"input": "a", "model": 5}', 400, "model", "model: expected a string"),
    (b'{"input": [{"type": "picture", "data": "x"}]}', 400, "input[0].type", "'text', 'image', 'video' or 'audio'"),
    (b'{"input": [{"type": "image"}]}', 400, "input[0].data", "required for an image item"),
    (b'{"input": [{"type": "text", "text": 3}]}', 400, "input[0].text", "expected a string, got a number"),
    (b'{"input": [{"type": "image", "data": "https://example.com/a.png"}]}', 400, "input[0].data", "fetches no URLs"),
    (b'{"input": [{"type": "image", "data": "data:image/png,abc"}]}', 400, "input[0].data", "must be base64"),
    (b'{"input": [{"type": "image", "data": "data:image/png;base64,@@@"}]}', 400, "input[0].data", "not valid base64"),
    (b'{"input": [{"type": "video", "data": "data:video/mp4;base64,AAAA"}]}', 400, "input[0].type", "no video items"),
    (
        b'{"input": ["a", {"type": "image", "data": "data:image/png;base64,AAAA", "url": 1}]}',
        400,
        "input[1].url",
        "unknown",
    ),
    (json.dumps({"input": ["x"] * 33}).encode(), 400, "input", "33 items, at most 32"),
    (b"[" * 100_000 + b"]" * 100_000, 400, None, "nested too deeply"),
    (b'{"input": "a", "dimensions": 1' + b"0" * 5000 + b"}", 400, None, "unreadable JSON"),
    (json.dumps({"input": "x" * 300_000}).encode(), 413, None, "limit of 262144"),
]


@pytest.mark.parametrize(("body", "status", "param", "words"), BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_requests_are_4xx_naming_the_field(
    served: dict[str, Any], body: bytes, status: int, param: str | None, words: str
) -> None:
    answer = served["http"].post("/v1/embeddings", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if param is not None:
        assert error["message"].startswith(param.split("[")[0]), error


def test_the_server_keeps_serving_after_every_refusal_and_streams_are_bounded_too(served: dict[str, Any]) -> None:
    http = served["http"]
    # A body without Content-Length (chunked) is cut off at the limit while it streams in.
    chunks = (b'{"input": "' + b"x" * 65536 for _ in range(8))
    answer = http.post("/v1/embeddings", content=chunks)
    assert answer.status_code == 413 and "limit of 262144" in answer.json()["error"]["message"]
    assert http.get("/v1/embeddings").status_code == 405
    assert http.post("/v2/embeddings", content=b"{}").json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError, match="token-id arrays"):
        served["client"].embeddings.create(model="m", input=[[1, 2, 3]])
    assert_still_serving(served)


# ---- media ------------------------------------------------------------------------------------------


def test_media_items_as_data_urls_and_a_broken_one_named_by_its_index(served: dict[str, Any]) -> None:
    model, http = served["model"], served["http"]
    images = [png(1), png(2, (64, 48))]
    sound = io.BytesIO()
    soundfile.write(sound, 0.5 * np.sin(np.linspace(0, 400, 4000)), 16000, format="WAV")
    body = {
        "input": [
            TEXTS[0],
            {"type": "image", "data": data_url(images[0])},
            {"type": "text", "text": TEXTS[1]},
            {"type": "image", "data": data_url(images[1], "image/anything")},
            {"type": "audio", "data": data_url(sound.getvalue(), "audio/wav")},
        ],
        "encoding_format": "float",
    }
    answer = http.post("/v1/embeddings", json=body)
    assert answer.status_code == 200, answer.text
    got = np.array([d["embedding"] for d in answer.json()["data"]], dtype=np.float32)
    kinds = ["text", "image", "text", "image", "audio"]
    want = model.encode(kinds, [TEXTS[0], images[0], TEXTS[1], images[1], sound.getvalue()]).numpy()
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    usage = answer.json()["usage"]
    assert usage["media_items"] == 3 and usage["prompt_tokens"] == len(TEXTS[0]) + len(TEXTS[1])

    broken = {
        "input": [{"type": "image", "data": data_url(images[0])}, {"type": "image", "data": data_url(images[1][:200])}]
    }
    good = {"input": [{"type": "image", "data": data_url(images[1])}], "encoding_format": "float"}
    with ThreadPoolExecutor(2) as workers:  # side by side, so they may share one model call
        refused, answered = workers.map(lambda b: http.post("/v1/embeddings", json=b), [broken, good])
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "input[1]" and error["message"].startswith("input[1]: ") and "PNG" in error["message"]
    assert "embedding" not in refused.text and "more items" not in error["message"]
    two = {"input": ["fine", {"type": "image", "data": data_url(b"not an image")}, broken["input"][1]]}
    error = http.post("/v1/embeddings", json=two).json()["error"]
    assert error["param"] == "input[1]" and error["message"].endswith("(and 1 more items could not be embedded)")
    np.testing.assert_allclose(np.array(answered.json()["data"][0]["embedding"]), want[3], atol=1e-5, rtol=0)
    assert_still_serving(served)


# ---- late interaction ------------------------------------------------------------------------------


def test_maxsim_answers_model_maxsim_of_the_token_vectors(served: dict[str, Any]) -> None:
    model = served["model"]
    queries = ["what is a tower", "a cat?"]
    documents = ["a tower is a tall building", "cats sleep a lot", "a bridge spans a river"]
    answer = served["http"].post("/v1/maxsim", json={"model": "any", "queries": queries, "documents": documents})
    assert answer.status_code == 200, answer.text
    got = np.array(answer.json()["scores"], dtype=np.float32)
    want = model.maxsim(model.tokens(["text"] * 2, queries, "query"), model.tokens(["text"] * 3, documents, "document"))
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-5, rtol=0)
    assert answer.json()["model"] == "tiny"
    refused = served["http"].post("/v1/maxsim", json={"queries": queries, "documents": "a tower"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "documents"


def test_maxsim_on_a_model_without_a_token_head_says_so(tmp_path: Path) -> None:
    model = load(write_model(tmp_path / "plain.safetensors"))
    with Server(create_app(model, name="plain")) as server:
        answer = httpx.post(f"{server.url}/v1/maxsim", json={"queries": ["a"], "documents": ["b"]}, timeout=60)
        assert answer.status_code == 404 and "trained no token head" in answer.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/embeddings", json={"input": "a"}, timeout=60).json()["model"] == "plain"
    model.close()


# ---- batching and the bounded queue ----------------------------------------------------------------


def test_the_batcher_gathers_waiting_requests_of_one_key_into_one_call() -> None:
    gate, calls = threading.Event(), []

    def run(key: str, items: list[int]) -> list[int]:
        calls.append((key, list(items)))
        if items == [0]:
            gate.wait(30)  # the first call holds the worker while the others queue
        return [10 * i for i in items]

    with Batcher(run, capacity=5, max_queued=8) as batcher:
        first = batcher.submit("a", [0])
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:  # the worker takes the first request at once
            time.sleep(0.01)
        waiting = [
            batcher.submit("a", [1, 2]),
            batcher.submit("b", [3]),
            batcher.submit("a", [4, 5]),
            batcher.submit("a", [6, 7]),
        ]
        try:
            assert batcher.queued == 7
            with pytest.raises(Busy, match="7 items are waiting, at most 8"):
                batcher.submit("a", [8, 9])
        finally:
            gate.set()
        assert first.result(30) == [0]
        assert [f.result(30) for f in waiting] == [[10, 20], [30], [40, 50], [60, 70]]
    # Oldest first, each call gathering the later requests of its key that fit (capacity 5 items).
    assert calls == [("a", [0]), ("a", [1, 2, 4, 5]), ("b", [3]), ("a", [6, 7])]


def test_a_busy_batcher_waits_for_the_requests_its_last_call_answered() -> None:
    # Clients answered by one call send their next requests a little apart; without waiting, the first would
    # start a call of its own and the rest wait out that call (at a fixed capacity a call costs the same
    # whatever it holds: half the answers a second). Here the next wave's first request waits for the others.
    calls: list[list[str]] = []
    started, release, long_call = threading.Event(), threading.Event(), threading.Event()

    def run(key: str, items: list[str]) -> list[str]:
        calls.append(list(items))
        started.set()
        if items == ["held"]:
            release.wait(30)  # the worker is busy while the first wave queues
        elif len(items) == 4 and items[0].startswith("first"):
            long_call.wait(1.0)  # a call of about a second: the next one may wait that long at most
        return items

    with Batcher(run, capacity=8, max_queued=64, linger=30.0) as batcher:
        held = batcher.submit("a", ["held"])
        assert started.wait(30)
        first = [batcher.submit("a", [f"first{i}"]) for i in range(4)]
        release.set()
        assert held.result(30) == ["held"] and [f.result(30) for f in first] == [[f"first{i}"] for i in range(4)]
        started.clear()
        second = [batcher.submit("a", ["second0"])]
        started.wait(0.3)  # a batcher that does not wait has started a call of one item by now
        second += [batcher.submit("a", [f"second{i}"]) for i in range(1, 4)]
        assert [f.result(30) for f in second] == [[f"second{i}"] for i in range(4)]
    assert calls == [["held"], [f"first{i}" for i in range(4)], [f"second{i}" for i in range(4)]]
    assert (batcher.calls, batcher.requests, batcher.items) == (3, 9, 9)


def test_an_idle_batcher_runs_a_lone_request_at_once() -> None:
    # A lone request waits for no company after a lone call, nor longer than the last call took: after a
    # quick call of four items, one item runs at once (a wait of `linger` would time out the results here).
    with Batcher(lambda key, items: items, capacity=8, max_queued=64, linger=30.0) as batcher:
        for i in range(5):
            assert batcher.submit("a", [i]).result(10) == [i]
        assert batcher.submit("a", [1, 2, 3, 4]).result(10) == [1, 2, 3, 4]
        assert batcher.submit("a", [5]).result(10) == [5]
    for bad, error in ((-1.0, ValueError), (math.inf, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="linger"):
            Batcher(lambda key, items: items, capacity=1, max_queued=1, linger=bad)


def test_a_full_queue_is_503_and_the_server_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = load(write_model(tmp_path / "small.safetensors"))
    gate, entered = threading.Event(), threading.Event()
    encode = model.encode

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(30)
        return encode(*args, **kwargs)

    monkeypatch.setattr(model, "encode", held)
    with Server(create_app(model, limits=Limits(max_inputs=4, max_queued=4))) as server, ThreadPoolExecutor(2) as pool:
        post = lambda texts: httpx.post(f"{server.url}/v1/embeddings", json={"input": texts}, timeout=60)  # noqa: E731
        running = pool.submit(post, ["one"])
        assert entered.wait(30)
        queued = pool.submit(post, ["a", "b", "c"])
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health", timeout=60).json()["queued"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        full = post(["d", "e"])
        assert full.status_code == 503 and full.headers["retry-after"] == "1"
        assert "busy" in full.json()["error"]["message"]
        gate.set()
        assert running.result(60).status_code == 200 and queued.result(60).status_code == 200
        assert post(["d", "e"]).status_code == 200
    model.close()


# ---- running it ------------------------------------------------------------------------------------


def test_serve_http_prints_where_it_listens_and_stops_on_sigint(tmp_path: Path) -> None:
    path = write_model(tmp_path / "run.safetensors")
    seen: dict[str, Any] = {}

    def ready(url: str, model: Model) -> None:
        def ask_then_interrupt() -> None:
            try:
                seen["answer"] = httpx.post(f"{url}/v1/embeddings", json={"input": "a cat"}, timeout=60).json()
            finally:  # stops serve_http whatever the answer was
                os.kill(os.getpid(), signal.SIGINT)

        seen["url"] = url
        seen["frozen"] = gc.get_freeze_count()
        threading.Thread(target=ask_then_interrupt, daemon=True).start()

    previous = signal.getsignal(signal.SIGINT)
    serve_http(path, port=0, log_level="warning", ready=ready)  # returns once SIGINT has stopped it
    assert signal.getsignal(signal.SIGINT) is previous
    # While serving, what was alive at the start (torch, the model) is out of the collector's sight (a full
    # collection scanning it paused the whole server); afterwards the heap is as it was.
    assert seen["frozen"] > 100_000 and gc.get_freeze_count() == 0
    assert seen["url"].startswith("http://127.0.0.1:") and len(seen["answer"]["data"][0]["embedding"]) == 128
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{seen['url']}/health", timeout=5)


@pytest.mark.parametrize("access_log", [False, True])
def test_uform_serve_exits_cleanly_on_sigterm(tmp_path: Path, access_log: bool) -> None:
    # At the info level, a line per request only when asked (`--access-log`): it costs the server a third more.
    path = write_model(tmp_path / "cli.safetensors")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "uform", "serve", str(path), "--port", "0", "--cpu", "--log-level", "info"]
    command += ["--access-log"] if access_log else []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    deadline = threading.Timer(120, process.kill)  # bounds the blocking reads below
    deadline.start()
    try:
        line = process.stdout.readline()  # the process prints one line once it listens (or exits)
        assert "listening on http://127.0.0.1:" in line, line + process.stderr.read()
        url = line.split("listening on ")[1].split("/v1")[0]
        assert httpx.get(f"{url}/health", timeout=60).json()["model"] == "cli"
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        deadline.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, err
    request = '"GET /health HTTP/1.1" 200'
    expected = ["uform serve: stopped"]
    lines = [line for line in out.strip().splitlines() if request not in line]
    assert lines == expected and (request in out) == access_log, out


def test_uform_serve_refuses_what_it_cannot_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from uform.cli import main

    assert main(["serve", str(tmp_path / "missing.safetensors"), "--cpu"]) == 2
    assert "uform serve:" in capsys.readouterr().err
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    assert main(["serve", str(tmp_path / "junk.safetensors"), "--cpu"]) == 2
    assert "junk.safetensors" in capsys.readouterr().err
    assert main(["serve", "x", "--port", "70000"]) == 2
    capsys.readouterr()
    with socket.socket() as taken:  # a port another process listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", str(write_model(tmp_path / "ok.safetensors")), "--port", port, "--cpu"]) == 2
    assert "uform serve:" in capsys.readouterr().err


def test_the_serve_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tiny = "--device cpu --depth 1 --hidden 128 --rows 2 --columns 128 --segments 8 --text-bytes 40 --inputs 2"
    results = bench.main(f"{tiny} --requests 24 --concurrency 4 --warmup 4 --dimensions 64 --out {tmp_path}".split())
    assert results["requests"] == 24 and results["requests_per_s"] > 0 and results["p99_ms"] >= results["p50_ms"] > 0
    assert 1 <= results["model_calls"] <= 24 and results["requests_per_call"] == 24 / results["model_calls"]
    assert results["inputs_per_call"] == 2 * results["requests_per_call"]
    assert json.loads((tmp_path / "bench-serve.json").read_text())["requests"] == 24
    results = bench.main(
        f"{tiny} --requests 8 --concurrency 2 --warmup 2 --client httpx --batch-wait-ms 0 --out {tmp_path}".split()
    )
    assert results["requests"] == 8 and results["model_calls"] >= 1


def test_a_failing_call_is_a_500_for_its_requests_alone_and_the_server_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load(write_model(tmp_path / "flaky.safetensors"))
    encode = model.encode

    def flaky(modalities: Any, contents: Any, *args: Any, **kwargs: Any) -> Any:
        if b"boom" in contents:
            raise RuntimeError("the device fell over")
        return encode(modalities, contents, *args, **kwargs)

    monkeypatch.setattr(model, "encode", flaky)
    with Server(create_app(model)) as server:
        failed = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["boom"]}, timeout=60)
        assert failed.status_code == 500 and "the device fell over" in failed.json()["error"]["message"]
        answer = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["fine"]}, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["data"]) == 1
    model.close()


def test_create_app_refuses_what_it_cannot_serve_honestly(tmp_path: Path) -> None:
    path = write_model(tmp_path / "strict.safetensors")
    with load(path, media=MediaPolicy(strict=True)) as strict, pytest.raises(ValueError, match="strict=True"):
        create_app(strict)
    with pytest.raises(TypeError, match="model: expected a uform Model"):
        create_app(str(path))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queued"):
        Limits(max_inputs=10, max_queued=5)
    for wait in (-1, 0.5, True):
        with pytest.raises(ValueError, match=r"limits\.batch_wait_ms"):
            Limits(batch_wait_ms=wait)  # type: ignore[arg-type]
    # A call waits for company by default only on a compiled model, whose every call runs its full capacity.
    for compiled, wait, linger in ((False, 7, 0.007), (False, 0, 0.0), (False, None, 0.0), (True, None, 0.05)):
        with load(path, compiled=compiled) as model:
            batcher = create_app(model, limits=Limits(batch_wait_ms=wait)).state.batcher
            batcher.close()  # the app never ran, so its lifespan did not close it
            assert batcher.linger == linger


def test_an_exported_model_folder_is_served_as_its_checkpoint_under_the_folder_name(tmp_path: Path) -> None:
    folder = export(write_model(tmp_path / "run.safetensors"), tmp_path / "my-embedder")
    texts = ["a red circle", "a blue square"]
    with load(tmp_path / "run.safetensors") as checkpoint:
        want = checkpoint.encode(["text"] * 2, texts, 64).numpy()
    for path in (folder, os.path.join(folder, "model.safetensors")):
        with load(path) as model, Server(create_app(model)) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
            answer = client.embeddings.create(model="x", input=texts, dimensions=64)
            assert answer.model == "my-embedder" and client.models.list().data[0].id == "my-embedder"
            np.testing.assert_array_equal(vectors(answer), want)  # the export's weights are the checkpoint's
            client.close()
