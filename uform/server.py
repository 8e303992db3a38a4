"""An embeddings server over a served `Model`: `create_app(model)` is the ASGI app (Starlette), `Server` runs it
with uvicorn on a socket of its own in a background thread, and `serve_http(path)` loads a model and serves it
until SIGINT or SIGTERM (what `uform serve` calls). Needs the `serve` extra: `pip install "uform[serve]"`.

Routes: `POST /v1/embeddings` (OpenAI's shape, so OpenAI's clients work; the body's format is `uform.wire`'s),
`POST /v1/maxsim` (late-interaction scores, for a model that trained a token head), `GET /v1/models`,
`GET /health`. Every request's items go through one `Batcher`: concurrent requests of the same kind ride one
model call (up to the model's `segments` items), one call at a time on its worker thread, so a burst of small
requests fills the model's fixed capacities instead of running one by one; under load a call waits a little
(`Limits.batch_wait_ms`) for the requests the last one answered to come back.

Refusals are answered, never raised through: a body past `max_body_bytes` is 413 before it is read whole;
malformed JSON, a wrong type, an unknown field, too many inputs, a width the model lacks, a broken media item
(named by its index, its reason from the decoder) are 400 naming the field; a full queue is 503. Media are
embedded under `errors="mask"`, so one broken item in a shared call costs only its own request an answer.

Usage is counted in uform's tokens, which are bytes: `prompt_tokens` is the UTF-8 bytes of the texts the model
read (a text longer than a row counts the bytes kept); media items are counted apart (`usage.media_items`),
and texts cut to a row in `usage.truncated_inputs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from . import vocab
from .batching import Batcher, BatcherClosed, Busy
from .data.batch import MEDIA_KINDS, media_features
from .enums import LateInteractionSide, Modality
from .media.limits import MediaError
from .runtime.executor import Executor
from .serve import Model, load
from .wire import (
    Item,
    RequestError,
    embedding_response,
    error_body,
    parse_body,
    parse_embedding_request,
    parse_maxsim_request,
)

__all__ = ["Limits", "Server", "create_app", "model_name", "serve_http"]


@dataclass(frozen=True)
class Limits:
    """What one request may carry and how much may wait."""

    max_body_bytes: int = 32 * 2**20
    """Largest request body, in bytes (base64 media make bodies large: 32 MiB holds a 24 MB file)."""
    max_inputs: int = 2048
    """Most items one request carries (OpenAI's limit for its embeddings endpoint)."""
    max_queued: int = 16384
    """Most items waiting for the model at once; a request past it is answered 503."""
    batch_wait_ms: int | None = None
    """Under load, the most milliseconds a model call waits, just after the last one, for as many items of its
    kind as that call carried (never longer than it ran; an idle server runs a request at once). 0: never;
    None: 50 on a compiled model (whose every call runs its full capacity, so a fuller call is free), 0 on an
    eager one (whose call costs what it holds, so waiting only idles it)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_inputs", "max_queued"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"limits.{name}: must be a positive int, got {value!r}")
        wait = self.batch_wait_ms
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int) or wait < 0):
            raise ValueError(f"limits.batch_wait_ms: must be None or an int of at least 0, got {wait!r}")
        if self.max_queued < self.max_inputs:
            raise ValueError(
                f"limits.max_queued ({self.max_queued}) must hold one whole request (max_inputs {self.max_inputs})"
            )


_COMPILED_WAIT_MS = 50
"""`Limits.batch_wait_ms` on a compiled model: above the ~10-30 ms a burst of 64 answered clients takes to send
its next requests, below one call of the reference geometry on an H200 (30-40 ms)."""

_BROKEN = object()
"""An item the model could not embed (a media item that failed to decode or broke a limit)."""


class _Calls:
    """The batcher's `run`: one model call over the gathered items of a key: ("encode", width) or ("tokens",
    side) answer each item's vectors, or `_BROKEN` for a media item the model could not embed; ("reason", 0)
    answers why each (broken) item fails, in the decoder's words."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def __call__(self, key: tuple[str, Any], items: list[Item]) -> list[Any]:
        verb, arg = key
        modalities = [item.modality for item in items]
        contents = [item.content for item in items]
        if verb == "reason":
            return [self._reason(item) for item in items]
        if verb == "encode":
            vectors, valid = self.model.encode(modalities, contents, arg, errors="mask")  # [N, W] f32, [N]
            answers: list[Any] = list(vectors.numpy())
        else:
            data, offsets, valid = self.model.tokens(modalities, contents, arg, errors="mask")  # [T, W], [N + 1]
            answers = [data[offsets[i] : offsets[i + 1]] for i in range(len(items))]
        for i in np.flatnonzero(~np.asarray(valid)).tolist():
            answers[i] = _BROKEN
        return answers

    def _reason(self, item: Item) -> str:
        # The masked call keeps no reasons; the broken item alone, asked to raise, says why. A call of its own
        # (key "reason"), so the requests that shared the broken item's call are answered without waiting for it.
        try:
            self.model.encode([item.modality], [item.content], errors="raise")
        except MediaError as error:
            return error.reason
        return "could not be embedded (its decoding failed or ran past the time limit)"


def create_app(model: Model, *, name: str | None = None, limits: Limits | None = None) -> Starlette:
    """The ASGI app serving `model` (which stays the caller's to close). `name` is what answers name the model
    (default: the checkpoint's file or folder name); `limits` bound requests (`Limits`)."""
    if not isinstance(model, Model):
        raise TypeError(f"model: expected a uform Model (uform.load(path)), got {type(model).__name__}")
    limits = Limits() if limits is None else limits
    if not isinstance(limits, Limits):
        raise TypeError(f"limits: expected a Limits, got {type(limits).__name__}")
    served = name if name is not None else model_name(model)
    if not isinstance(served, str) or not served:
        raise ValueError(f"name: expected a non-empty string, got {served!r}")
    if model.media.strict:  # strict makes a masked call raise: one broken item would fail its call's neighbours
        raise ValueError(
            "model: loaded with MediaPolicy(strict=True); the server answers a broken media item to its own request "
            "alone, which needs the default policy (uform.load(path) without strict)"
        )
    widths = model.matryoshka_dimensions
    late = model.config.late_interaction.weight > 0
    live = media_features(model.config)
    modalities = [Modality.Text, *(m for m, kind in MEDIA_KINDS.items() if kind in live)]
    wait = limits.batch_wait_ms
    linger = (_COMPILED_WAIT_MS if model.compiled else 0) / 1e3 if wait is None else wait / 1e3
    batcher: Batcher = Batcher(_Calls(model), capacity=model.segments, max_queued=limits.max_queued, linger=linger)
    created = int(os.path.getmtime(model.path)) if model.path and os.path.exists(model.path) else 0

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        batcher.close()

    async def refused(request: Request, error: RequestError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error_body(error), status_code=error.status, headers=headers)

    async def failed(request: Request, error: Exception) -> JSONResponse:  # a bug of ours, logged by uvicorn
        body = {"error": {"message": f"internal error: {type(error).__name__}: {error}", "type": "server_error"}}
        return JSONResponse(body, status_code=500)

    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(error_body(RequestError(error.status_code, None, message)), status_code=error.status_code)

    async def run(key: tuple[str, Any], items: list[Item]) -> list[Any]:
        try:
            future = batcher.submit(key, items)
        except Busy as error:
            raise RequestError(503, None, f"the server is busy ({error}); retry later") from None
        except BatcherClosed:
            raise RequestError(503, None, "the server is shutting down") from None
        try:
            return await asyncio.wrap_future(future)
        except BatcherClosed:
            raise RequestError(503, None, "the server is shutting down") from None

    async def refuse_broken(items: list[Item], answers: list[Any], field: str, listed: bool) -> None:
        """A 400 naming the first item the model could not embed, with its reason (and how many more)."""
        broken = [i for i, answer in enumerate(answers) if answer is _BROKEN]
        if not broken:
            return
        (reason,) = await run(("reason", 0), [items[broken[0]]])
        where = f"{field}[{broken[0]}]" if listed else field
        more = f" (and {len(broken) - 1} more items could not be embedded)" if len(broken) > 1 else ""
        raise RequestError(400, where, f"{where}: {reason}{more}")

    async def embeddings(request: Request) -> JSONResponse:
        raw = await _read_body(request, limits.max_body_bytes)
        body = await _off_loop(len(raw), parse_body, raw)
        checked = await _off_loop(
            len(raw), parse_embedding_request, body, widths=widths, modalities=modalities, max_inputs=limits.max_inputs
        )
        answers = await run(("encode", checked.width), checked.items)
        await refuse_broken(checked.items, answers, "input", isinstance(body["input"], list))
        vectors = np.stack(answers)  # [N, W] f32
        usage = _usage(checked.items, model.columns - _prefix_length(late, LateInteractionSide.None_))
        return await _off_loop(vectors.size * 4, _answer, vectors, checked.encoding_format, served, usage)

    async def maxsim(request: Request) -> JSONResponse:
        if not late:
            raise RequestError(
                404,
                None,
                f"/v1/maxsim: the model {served!r} trained no token head (its run's late_interaction.weight is 0); "
                "late-interaction scores need a model that trained late interaction",
            )
        raw = await _read_body(request, limits.max_body_bytes)
        body = await _off_loop(len(raw), parse_body, raw)
        checked = await _off_loop(
            len(raw), parse_maxsim_request, body, modalities=modalities, max_inputs=limits.max_inputs
        )
        queries, documents = await asyncio.gather(
            run(("tokens", LateInteractionSide.Query), checked.queries),
            run(("tokens", LateInteractionSide.Document), checked.documents),
        )
        await refuse_broken(checked.queries, queries, "queries", True)
        await refuse_broken(checked.documents, documents, "documents", True)
        scores = await run_in_threadpool(model.maxsim, _tape(queries), _tape(documents))  # [Q, N]
        room = model.columns - _prefix_length(late, LateInteractionSide.Query)
        usage = _usage([*checked.queries, *checked.documents], room)
        return JSONResponse({"object": "maxsim", "model": served, "scores": scores.tolist(), "usage": usage})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_card(model, served, created, modalities, late)]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "model": served,
                "queued": batcher.queued,
                "calls": batcher.calls,
                "requests": batcher.requests,
            }
        )

    routes = [
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/maxsim", maxsim, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {RequestError: refused, HTTPException: http_error, Exception: failed}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)  # type: ignore[arg-type]
    app.state.batcher = batcher
    app.state.model = model
    return app


_ON_LOOP_BYTES = 1 << 16
"""Bodies and answers up to this size are parsed and written on the event loop; larger ones in a thread, so
one large request does not stall the others' I/O."""


async def _off_loop(size: int, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if size <= _ON_LOOP_BYTES:
        return call(*args, **kwargs)
    return await run_in_threadpool(call, *args, **kwargs)


def _answer(vectors: np.ndarray, encoding_format: str, served: str, usage: dict[str, int]) -> JSONResponse:
    return JSONResponse(embedding_response(vectors, encoding_format, served, usage))  # rendered here, once


def model_name(model: Model) -> str:
    """The name a served model answers to: an exported model's folder name (given the folder or its
    `model.safetensors`), else the checkpoint's file name without `.safetensors`."""
    if not model.path:
        return "uform"
    path = os.path.abspath(model.path)
    if os.path.basename(path) == "model.safetensors" and not os.path.isdir(path):
        path = os.path.dirname(path)
    base = os.path.basename(path)
    return (base if os.path.isdir(path) else base.removesuffix(".safetensors")) or "uform"


def _card(model: Model, name: str, created: int, modalities: Sequence[Modality], late: bool) -> dict[str, Any]:
    # OpenAI's model object, with what a uform model serves beside it.
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "uform",
        "dimensions": list(model.matryoshka_dimensions),
        "modalities": [m.name.lower() for m in modalities],
        "late_interaction": late,
        "max_text_bytes": model.columns - _prefix_length(late, LateInteractionSide.None_),
        "step": model.step,
    }


def _prefix_length(late: bool, side: LateInteractionSide) -> int:
    return len(vocab.prefix(Modality.Text, side if late else None))


def _usage(items: Sequence[Item], room: int) -> dict[str, int]:
    texts = [len(item.content) for item in items if item.modality == Modality.Text]
    read = sum(min(n, room) for n in texts)
    return {
        "prompt_tokens": read,
        "total_tokens": read,
        "media_items": len(items) - len(texts),
        "truncated_inputs": sum(n > room for n in texts),
    }


def _tape(answers: Sequence[Any]) -> tuple[Any, np.ndarray]:
    """Per-item token vectors back into a (data [T, W], offsets [N + 1]) tape."""
    counts = [len(a) for a in answers]
    return torch.cat(list(answers)), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) once it passes `limit` bytes: by its Content-Length before reading anything,
    else while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, None, f"body: {int(declared)} bytes, more than this server's limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, None, f"body: more than this server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# --------------------------------------------------------------------------------------------------
# Running it


class Server:
    """uvicorn serving `app` on `host`:`port` (0: a free port) from a thread of its own; `start` returns once
    it listens, `url` says where, `stop` shuts it down gracefully (requests in flight are answered).
    `access_log` logs a line per request at `log_level` info."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", access_log: bool = False
    ) -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port: expected an int in [0, 65535], got {port!r}")
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError:
            self._socket.close()
            raise
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        """The port it listens on (the one the system chose when asked for 0)."""
        # No line per request unless asked (`access_log`): at thousands of requests a second its formatting and
        # writing cost a third of what the server spends on a request.
        config = uvicorn.Config(
            app, log_level=log_level, access_log=access_log, lifespan="on", timeout_graceful_shutdown=30
        )
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._main, name="uform-http", daemon=True)
        self._failed: BaseException | None = None

    @property
    def url(self) -> str:
        """Where it listens, as `http://host:port`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> Server:
        """Starts serving; returns once the server listens (raises if it could not start in `timeout` s)."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {self.url}: {self._failed or 'timed out'}")
            time.sleep(0.01)
        return self

    def request_stop(self) -> None:
        """Asks the server to stop (it finishes the requests in flight); returns at once."""
        self._uvicorn.should_exit = True

    def stop(self, timeout: float = 60.0) -> None:
        """Stops taking connections, answers the requests in flight, shuts the app down and joins."""
        self._uvicorn.should_exit = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._socket.close()

    def force_stop(self) -> None:
        """Stops without waiting for requests in flight (a second Ctrl-C)."""
        self._uvicorn.force_exit = True
        self._uvicorn.should_exit = True

    def wait(self, poll: float = 0.2) -> None:
        """Blocks until the server has stopped (in short waits, so the main thread still sees signals)."""
        while self._thread.is_alive():
            self._thread.join(poll)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _main(self) -> None:
        # Off the main thread uvicorn installs no signal handlers: serve_http owns them.
        try:
            self._uvicorn.run(sockets=[self._socket])
        except BaseException as error:  # read by `start`
            self._failed = error


def serve_http(
    model: str | os.PathLike | Model,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    executor: Executor | None = None,
    name: str | None = None,
    limits: Limits | None = None,
    log_level: str = "info",
    access_log: bool = False,
    rows: int = 0,
    segments: int = 0,
    jpeg: str = "host",
    ready: Callable[[str, Model], None] | None = None,
) -> None:
    """Serves `model` (a path `uform.load` reads, or a loaded `Model`) over HTTP on `host`:`port` until
    SIGINT or SIGTERM, then answers the requests in flight and returns (a second SIGINT stops at once).
    A model loaded here (on `executor`, one forward of `rows` and `segments`, JPEGs decoded where `jpeg` says, as
    `uform.load` takes them) is
    warmed up first (compiled on CUDA) and closed at the end; `ready(url, model)` is called once the server
    listens; `access_log` logs a line per request. Must run on the main thread (it takes the signals). While it
    serves, the objects alive when it started are frozen out of the garbage collector's scans (`gc.freeze`)."""
    owned = not isinstance(model, Model)
    served = model if isinstance(model, Model) else load(model, executor, rows=rows, segments=segments, jpeg=jpeg)
    try:
        if owned:
            _warm_up(served)
        app = create_app(served, name=name, limits=limits)
        try:
            server = Server(app, host, port, log_level=log_level, access_log=access_log)
        except BaseException:  # the port taken, say: the app never ran, so its batcher stops here
            app.state.batcher.close()
            raise
        stops = 0

        def on_signal(signum: int, frame: Any) -> None:
            nonlocal stops
            stops += 1
            if stops > 1:
                server.force_stop()
            else:
                server.request_stop()

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        # What is alive now (torch, the model, a compiled forward's graphs: hundreds of thousands of objects) is
        # moved out of the collector's sight: a full collection scanned it all every ~1,400 requests, a stop of
        # the whole server of ~150 ms on the CPU (the requests' p99), longer after torch.compile.
        gc.collect()
        gc.freeze()
        try:
            server.start()
            if ready is not None:
                ready(server.url, served)
            server.wait()
        finally:
            server.stop()
            gc.unfreeze()
            for s, handler in previous.items():
                signal.signal(s, handler)
    finally:
        if owned:
            served.close()


def _warm_up(model: Model) -> None:
    """One call of each verb the server uses, so the first request does not pay for compiling."""
    model.encode(["text"], ["warm up"])
    if model.config.late_interaction.weight > 0:
        model.tokens(["text"], ["warm up"], LateInteractionSide.Query)
