"""The embeddings server under load: requests per second and latency percentiles of `uform serve`'s
`POST /v1/embeddings` on localhost.

A freshly initialised network at the given geometry (default: the reference geometry of docs/design.md §1, depth
12 x hidden 512, 64 rows x 1024 columns, 256 segments) is written as a trainer checkpoint and served by
`python -m uform serve` in a process of its own (CUDA when there is one: compiled, FlexAttention, bf16 autocast;
`--device cpu` passes `--cpu`), on a free loopback port. One asyncio client (httpx) then keeps `--concurrency`
requests in flight, `--requests` in all after `--warmup` untimed ones, each of `--inputs` texts of `--text-bytes`
bytes (slices of CPython's pydoc topics), asking `--encoding-format` (base64 by default, as OpenAI's client
asks) at `--dimensions` (default the full width). Every answer is checked (status 200, one vector per input, of
the asked width). Prints requests/s, inputs/s and p50 / p99 latency, and writes bench-serve.json under $OUT (or
the current folder). The client shares the host with the server: on a machine of few cores it takes a share
of the CPU the server's host side would use.

  python bench/serve.py                      # the reference geometry, on the GPU when there is one
  python bench/serve.py --device cpu --depth 1 --hidden 128 --rows 4 --columns 128 --segments 16 \\
      --text-bytes 100 --requests 64 --concurrency 8 --warmup 8
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
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
from common import add_geometry, random_checkpoint, topic_slices, write_json  # sibling modules, not a package

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_server(args: argparse.Namespace, path: str) -> tuple[subprocess.Popen, str]:
    """`python -m uform serve` on a free loopback port; answers the process and its URL once it listens."""
    command = [sys.executable, "-m", "uform", "serve", path, "--port", "0", "--log-level", "warning"]
    command += ["--cpu"] if args.device == "cpu" else []
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


async def drive(url: str, bodies: list[bytes], concurrency: int, width: int, inputs: int) -> list[float]:
    """Sends every body with at most `concurrency` in flight; answers each request's seconds (checked)."""
    import httpx

    latencies: list[float] = []
    next_body = iter(bodies)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:

        async def worker() -> None:
            for body in next_body:  # shared: each body is sent once, by whichever worker is free
                t0 = time.perf_counter()
                answer = await client.post("/v1/embeddings", content=body, headers={"content-type": "application/json"})
                latencies.append(time.perf_counter() - t0)
                if answer.status_code != 200:
                    raise RuntimeError(f"status {answer.status_code}: {answer.text[:500]}")
                data = answer.json()["data"]
                if len(data) != inputs or _width(data[0]["embedding"]) != width:
                    raise RuntimeError(f"answered {len(data)} vectors of width {_width(data[0]['embedding'])}")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


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
            asyncio.run(drive(url, bodies(0, args.warmup), args.concurrency, width, args.inputs))
            timed = bodies(args.warmup, args.requests)
            t0 = time.perf_counter()
            latencies = np.array(asyncio.run(drive(url, timed, args.concurrency, width, args.inputs)))
            seconds = time.perf_counter() - t0
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
    )
    print(
        f"{args.requests} requests of {args.inputs} x {args.text_bytes} bytes, {args.concurrency} in flight: "
        f"{results['requests_per_s']:,.1f} requests/s ({results['inputs_per_s']:,.1f} inputs/s), "
        f"p50 {results['p50_ms']:.1f} ms, p99 {results['p99_ms']:.1f} ms (server start {results['startup_s']:.1f} s)",
        flush=True,
    )
    write_json("bench-serve.json", results, args.out)
    return results


if __name__ == "__main__":
    main()
