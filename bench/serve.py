"""The embeddings server under load: requests per second and latency percentiles of `uform serve`'s
`POST /v1/embeddings` on localhost, and how many requests each model call carried.

A freshly initialised network at the given geometry (default: the reference geometry of docs/design.md §1, depth
12 x hidden 512, 64 rows x 1024 columns, 256 segments) is written as a trainer checkpoint and served by
`python -m uform serve` in a process of its own (CUDA when there is one: compiled, FlexAttention, bf16 autocast;
`--device cpu` passes `--cpu`), on a free loopback port. One asyncio client then keeps `--concurrency` requests
in flight over as many keep-alive connections, `--requests` in all after `--warmup` untimed ones, each of
`--inputs` texts of `--text-bytes` bytes (slices of CPython's pydoc topics), asking `--encoding-format` (base64
by default, as OpenAI's client asks) at `--dimensions` (default the full width). The client is the bench's own
few lines of HTTP/1.1 (`--client httpx` for httpx, one client a connection), so that it outruns the server.
Every answer is checked (status 200, one vector per input, of the asked width). Prints requests/s, inputs/s,
p50 / p99 latency, the model calls the timed requests rode (from the server's /health: requests per call near
`--concurrency` when the batcher gathers what waits, near 1 when requests reach it one by one) and the CPU time
a request cost each process (the server's includes its model calls); writes bench-serve.json under $OUT (or
the current folder). The client shares the host with the server.

  python bench/serve.py                      # the reference geometry, on the GPU when there is one
  python bench/serve.py --device cpu --depth 1 --hidden 128 --rows 4 --columns 256 --segments 64 \\
      --requests 2048 --warmup 128 --concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

# Run as a script, the checkout's uform wins over an installed one; its sibling `common` is found when loaded too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # sibling modules, not a package
    add_geometry,
    random_checkpoint,
    stat_cpu_seconds,
    topic_slices,
    write_json,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(args: argparse.Namespace, path: str) -> tuple[subprocess.Popen, str]:
    """`python -m uform serve` on a free loopback port; answers the process and its URL once it listens."""
    command = [sys.executable, "-m", "uform", "serve", path, "--port", "0", "--log-level", "warning"]
    command += ["--cpu"] if args.device == "cpu" else []
    command += [] if args.batch_wait_ms is None else ["--batch-wait-ms", str(args.batch_wait_ms)]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)
    assert process.stdout is not None
    deadline = threading.Timer(args.startup_timeout, process.kill)  # a server that never listens is killed
    deadline.start()
    line = process.stdout.readline()  # printed once the model is loaded, warmed up (compiled) and listening
    deadline.cancel()
    if "listening on " not in line:
        process.kill()
        raise RuntimeError(f"uform serve did not start (exit {process.wait()}): {line!r}")
    return process, line.split("listening on ")[1].split("/v1")[0]


class Connection:
    """One keep-alive HTTP/1.1 connection: the bench's own client, a request written and its answer read by
    Content-Length in a few tens of microseconds of Python, so that one client process outruns the server it
    measures (httpx spends about a millisecond a request, and its pool of 64 connections several: it was the
    bottleneck of the first figures)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host.encode()

    @classmethod
    async def open(cls, url: str) -> Connection:
        host, _, port = url.removeprefix("http://").rpartition(":")
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """Answers the status and the body of `POST path` with a JSON `body`."""
        head = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        self.writer.write(head % (path.encode(), self.host, len(body)) + body)
        lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(
            (int(v) for k, _, v in (h.partition(b":") for h in lines[1:]) if k.lower() == b"content-length"), -1
        )
        if length < 0:
            raise RuntimeError(f"an answer without Content-Length: {lines!r}")
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


class HttpxConnection:
    """The same through httpx (`--client httpx`): one `AsyncClient` of one connection each, since httpcore's
    pool walks all its connections for each request it queues or releases (encode/httpcore#1035)."""

    def __init__(self, url: str) -> None:
        import httpx

        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        self.client = httpx.AsyncClient(base_url=url, limits=limits, timeout=600, verify=False)

    @classmethod
    async def open(cls, url: str) -> HttpxConnection:
        return cls(url)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        answer = await self.client.post(path, content=body, headers={"content-type": "application/json"})
        return answer.status_code, answer.content

    async def close(self) -> None:
        await self.client.aclose()


async def drive(
    url: str, bodies: list[bytes], concurrency: int, width: int, inputs: int, client: str = "http"
) -> tuple[list[float], float]:
    """Sends every body over `concurrency` connections, one request in flight on each; answers each request's
    seconds (its answer checked) and the seconds from the first send to the last answer."""
    kind = Connection if client == "http" else HttpxConnection
    connections = [await kind.open(url) for _ in range(concurrency)]
    latencies: list[float] = []
    next_body = iter(bodies)

    async def worker(connection: Connection | HttpxConnection) -> None:
        for body in next_body:  # shared: each body is sent once, by whichever worker is free
            t0 = time.perf_counter()
            status, answer = await connection.post("/v1/embeddings", body)
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"status {status}: {answer[:500]!r}")
            data = json.loads(answer)["data"]
            if len(data) != inputs or _width(data[0]["embedding"]) != width:
                raise RuntimeError(f"answered {len(data)} vectors of width {_width(data[0]['embedding'])}")

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in connections))
        seconds = time.perf_counter() - t0
    finally:
        for c in connections:
            await c.close()
    return latencies, seconds


def health(url: str) -> dict[str, Any]:
    """The server's `GET /health`: its model calls and answered requests so far."""
    import httpx

    return httpx.get(f"{url}/health", timeout=60).json()


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process `pid` has used (Linux's /proc; NaN elsewhere)."""
    try:
        return stat_cpu_seconds(f"/proc/{pid}/stat")
    except OSError:
        return math.nan


def _width(embedding: Any) -> int:
    return len(embedding) if isinstance(embedding, list) else len(base64.b64decode(embedding)) // 4  # f32


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    add_geometry(parser)
    parser.add_argument("--requests", type=int, default=4096, help="timed requests")
    parser.add_argument("--warmup", type=int, default=256, help="untimed requests first")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--inputs", type=int, default=1, help="texts per request")
    parser.add_argument("--text-bytes", type=int, default=128)
    parser.add_argument("--dimensions", type=int, default=0, help="Matryoshka width asked (0: the full width)")
    parser.add_argument("--encoding-format", choices=("float", "base64"), default="base64")
    parser.add_argument(
        "--client", choices=("http", "httpx"), default="http", help="the bench's own HTTP/1.1 client, or httpx"
    )
    parser.add_argument(
        "--batch-wait-ms", type=int, default=None, help="the server's --batch-wait-ms (default: the server's own)"
    )
    parser.add_argument("--startup-timeout", type=float, default=1800, help="seconds the server may take to listen")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench-serve.json")
    args = parser.parse_args(argv)
    width = args.dimensions or args.hidden
    texts = [
        t.decode("utf-8", "replace") for t in topic_slices(args.warmup + args.requests * args.inputs, args.text_bytes)
    ]
    fields: dict[str, Any] = {"model": "bench", "encoding_format": args.encoding_format}
    if args.dimensions:
        fields["dimensions"] = args.dimensions

    def bodies(start: int, count: int) -> list[bytes]:
        group = [texts[start + i * args.inputs : start + (i + 1) * args.inputs] for i in range(count)]
        return [json.dumps({**fields, "input": g}).encode() for g in group]

    results: dict[str, Any] = {"geometry": vars(args), "torch": torch.__version__}
    results["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench-serve.safetensors")
        random_checkpoint(args, path, patch_side=0, widths=tuple(w for w in (64, 128, 256) if w < args.hidden))
        t0 = time.perf_counter()
        process, url = start_server(args, path)
        results["startup_s"] = time.perf_counter() - t0
        try:
            asyncio.run(drive(url, bodies(0, args.warmup), args.concurrency, width, args.inputs, args.client))
            timed = bodies(args.warmup, args.requests)
            before, server_cpu, client_cpu = health(url), cpu_seconds(process.pid), time.process_time()
            answered, seconds = asyncio.run(drive(url, timed, args.concurrency, width, args.inputs, args.client))
            server_cpu, client_cpu = cpu_seconds(process.pid) - server_cpu, time.process_time() - client_cpu
            after = health(url)
            latencies = np.array(answered)
        finally:
            process.terminate()
            process.wait(120)
    results.update(
        requests=args.requests,
        seconds=seconds,
        requests_per_s=args.requests / seconds,
        inputs_per_s=args.requests * args.inputs / seconds,
        p50_ms=float(np.percentile(latencies, 50) * 1e3),
        p99_ms=float(np.percentile(latencies, 99) * 1e3),
        mean_ms=float(latencies.mean() * 1e3),
        model_calls=after["calls"] - before["calls"],
        # CPU time a request costs each side (all threads; the server's includes its model calls).
        server_cpu_ms_per_request=server_cpu / args.requests * 1e3,
        client_cpu_ms_per_request=client_cpu / args.requests * 1e3,
    )
    # The key diagnostic: how many requests (and inputs) each model call carried; near `concurrency` when the
    # batcher gathers what waits, near 1 when requests reach it one at a time.
    results["requests_per_call"] = args.requests / max(1, results["model_calls"])
    results["inputs_per_call"] = results["requests_per_call"] * args.inputs
    print(
        f"{args.requests} requests of {args.inputs} x {args.text_bytes} bytes, {args.concurrency} in flight: "
        f"{results['requests_per_s']:,.1f} requests/s ({results['inputs_per_s']:,.1f} inputs/s), "
        f"p50 {results['p50_ms']:.1f} ms, p99 {results['p99_ms']:.1f} ms, {results['model_calls']} model calls "
        f"({results['requests_per_call']:.1f} requests a call); CPU a request: server "
        f"{results['server_cpu_ms_per_request']:.2f} ms, client {results['client_cpu_ms_per_request']:.2f} ms "
        f"(server start {results['startup_s']:.1f} s)",
        flush=True,
    )
    write_json("bench-serve.json", results, args.out)
    return results


if __name__ == "__main__":
    main()
