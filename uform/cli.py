"""The `uform` command line: a thin layer that parses argv and calls the library.

    uform demo [--part text|image|both] [--steps N] [--image-steps N] [--depth N] [--hidden N] [--seed N]
               [--cpu] [--quiet] [--save PATH]
    uform train CONFIG.toml [--output DIR] [--resume PATH|latest] [--stop-after N] [--set KEY=VALUE ...]
                [--devices 0,1|cpu|cpu:N]            (or under torchrun: one process per device)
    uform plot RUN_DIR [--output FILE_OR_DIR]
    uform export CHECKPOINT OUT_DIR [--onnx]
    uform encode MODEL --input FILE --output FILE [--field NAME=ROLE ...] [--width N] [--dtype f32|f16|bf16|i8]
                 [--batch N] [--cpu] [--quiet] [--jpeg host|device]
    uform serve MODEL [--host 127.0.0.1] [--port 8000] [--cpu] [--name NAME] [--max-inputs N] [--max-body-bytes N]
                [--max-queue N] [--batch-wait-ms N] [--rows N] [--segments N] [--log-level LEVEL] [--access-log]
                [--jpeg host|device]
    uform version

`uform train` exits 0 when done (or stopped by --stop-after), 2 on a refused run, and 128 + the signal (130 for
SIGINT, 143 for SIGTERM) when a signal stopped it after saving at a step boundary.

`main(argv)` answers the exit status instead of exiting, so it can be called in-process (as the tests
do); the console script and `python -m uform` pass its answer to `sys.exit`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

import torch

from . import __version__
from .demo import DEFAULTS, held_out_split, report, run_demo, text_pairs
from .demo_shapes import IMAGE_DEFAULTS, run_image_demo
from .encoding import DEFAULT_BATCH, encode_file
from .exporting import export
from .fitting import fit
from .interrupts import exit_status
from .plotting import plot_run
from .run_config import read_run_config
from .runtime.executor import Executor
from .runtime.mesh import Mesh
from .serve import Model

__all__ = ["build_parser", "devices_of", "main"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _natural(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must lie in [0, 65535] (0: a free port), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uform", description="uform: one multimodal transformer tower, trained and served."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="train a small model on CPython's documentation and on drawn pictures with captions, and print "
        "held-out retrieval before and after",
        description="Trains a small tower on paragraphs of CPython's pydoc topics (the text part) and on pictures "
        "of shapes drawn at run time with captions saying what is where (the image part), and prints held-out "
        "recall and MRR before and after training, with chance. Uses the first GPU when there is one.",
    )
    demo.add_argument(
        "--part", choices=("text", "image", "both"), default="both", help="which part to run (%(default)s)"
    )
    demo.add_argument(
        "--steps", type=_positive, default=DEFAULTS["steps"], help="the text part's optimizer steps (%(default)s)"
    )
    demo.add_argument(
        "--image-steps",
        type=_positive,
        default=IMAGE_DEFAULTS["steps"],
        help="the image part's optimizer steps (%(default)s)",
    )
    demo.add_argument("--depth", type=_positive, default=DEFAULTS["depth"], help="transformer blocks (%(default)s)")
    demo.add_argument(
        "--hidden", type=_positive, default=DEFAULTS["hidden"], help="embedding width, a multiple of 128 (%(default)s)"
    )
    demo.add_argument(
        "--rows", type=_positive, default=DEFAULTS["rows"], help="the text part's rows per step (%(default)s)"
    )
    demo.add_argument(
        "--columns", type=_positive, default=DEFAULTS["columns"], help="the text part's bytes per row (%(default)s)"
    )
    demo.add_argument(
        "--segments",
        type=_positive,
        default=DEFAULTS["segments"],
        help="the text part's items per step, two per pair (%(default)s)",
    )
    demo.add_argument(
        "--learning-rate",
        type=float,
        default=DEFAULTS["learning_rate"],
        help="the text part's peak learning rate (%(default)s)",
    )
    demo.add_argument("--seed", type=_natural, default=DEFAULTS["seed"], help="seed of every draw (%(default)s)")
    demo.add_argument("--max-paragraphs", type=_positive, default=None, help="use only this many paragraphs (all)")
    demo.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--save",
        metavar="PATH",
        default=None,
        help="save the text part's trained run there, load it back and evaluate it too",
    )

    train = commands.add_parser(
        "train",
        help="train on your own data, as a run file (TOML) describes",
        description="Trains the run CONFIG.toml describes ([trainer], [data]) and writes its folder: config.toml, "
        "metrics.jsonl and checkpoints/step-NNNNNNNN.safetensors. SIGINT (Ctrl-C) or SIGTERM finishes the step in "
        "flight, saves there and exits 130 or 143 (128 + the signal; --resume latest continues exactly); a second "
        "signal stops at once. Exits 2 on a refused run file or folder.",
    )
    train.add_argument("config", metavar="CONFIG.toml", help="the run file")
    train.add_argument(
        "--output", metavar="DIR", default=None, help="the run's folder (default: runs/<the file's name>)"
    )
    train.add_argument(
        "--resume", metavar="PATH|latest", default=None, help="continue the run of --output from a checkpoint"
    )
    train.add_argument(
        "--stop-after", metavar="N", type=_positive, default=None, help="take at most N steps, save and exit 0"
    )
    train.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides", help="override a key of the file"
    )
    train.add_argument(
        "--devices",
        metavar="0,1|cpu|cpu:N",
        type=devices_of,
        default=None,
        help="CUDA devices by index, the CPU, or N CPU devices (default: CUDA 0 where there is one, else the CPU)",
    )

    plot = commands.add_parser(
        "plot",
        help="draw a run's curves (losses, learning rate, throughput, evaluations) into a PNG",
        description="Reads RUN_DIR/metrics.jsonl (while the run trains or after) and draws its losses, learning "
        "rate, items per second, held-out evaluations and warnings against the step, into one PNG. Needs "
        "matplotlib (pip install 'uform[plot]').",
    )
    plot.add_argument("run", metavar="RUN_DIR", help="a run's folder (uform train --output)")
    plot.add_argument(
        "--output",
        metavar="FILE_OR_DIR",
        default=None,
        help="the PNG, or a folder for metrics.png (RUN_DIR/metrics.png)",
    )
    export = commands.add_parser(
        "export",
        help="write a trainer checkpoint as a model folder (weights only, config.json, a model card)",
        description="Writes OUT_DIR: model.safetensors (weights only, digest-checked), config.json (the resolved run) "
        "and README.md (a model card), in the layout the Hugging Face hub expects; uform.load(OUT_DIR) serves it.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT", help="a trainer checkpoint (.safetensors)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (new, or empty)")
    export.add_argument("--onnx", action="store_true", help="also write model.onnx, the encode forward (uform[onnx])")

    encode = commands.add_parser(
        "encode",
        help="embed every record of a JSONL, CSV or Parquet file into Parquet or .npy",
        description="Reads the records of --input (media fields name files relative to it) and writes one "
        "embedding per record to --output: Parquet (columns id, embedding; a broken record's embedding is null) or "
        ".npy (the vectors; beside it <name>.ids.txt, one id a line, and <name>.valid.npy, False where a record "
        "could not be embedded and its row is NaN, or -128 under i8).",
    )
    encode.add_argument("model", metavar="MODEL", help="an exported model folder or a trainer checkpoint")
    encode.add_argument("--input", required=True, metavar="FILE", help="records: .jsonl, .csv or .parquet")
    encode.add_argument("--output", required=True, metavar="FILE", help="embeddings: .parquet or .npy")
    encode.add_argument(
        "--field",
        metavar="NAME=ROLE",
        action="append",
        default=[],
        dest="fields",
        help="a field and its role (text, image, video, audio, id, ignore); one item field is embedded per "
        "record (default: text=text, image=image, id=id where present)",
    )
    encode.add_argument("--width", type=_positive, default=None, help="a Matryoshka width (default: the full width)")
    encode.add_argument(
        "--dtype", choices=("f32", "f16", "bf16", "i8"), default="f32", help="scalar type (%(default)s)"
    )
    encode.add_argument("--batch", type=_positive, default=DEFAULT_BATCH, help="records embedded at once (%(default)s)")
    encode.add_argument("--cpu", action="store_true", help="encode on the CPU even when a GPU is present")
    encode.add_argument(
        "--jpeg",
        choices=("host", "device"),
        default="host",
        help="where JPEGs decode: host (Pillow) or device (the GPU's nvJPEG, through torchvision) (%(default)s)",
    )
    encode.add_argument("--quiet", action="store_true", help="no progress bar")

    serve = commands.add_parser(
        "serve",
        help="serve a model's embeddings over HTTP (OpenAI-compatible POST /v1/embeddings)",
        description="Serves MODEL (a checkpoint, or a model folder uform.load reads) over HTTP: POST /v1/embeddings "
        "(OpenAI's shape, media items as base64 data URLs), POST /v1/maxsim (late interaction, when the model "
        "trained it), GET /v1/models, GET /health. Needs the serve extra: pip install 'uform[serve]'. Uses the first "
        "GPU when there is one. SIGINT or SIGTERM stops it after answering the requests in flight.",
    )
    serve.add_argument("model", metavar="MODEL", help="the checkpoint or model folder to serve")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (%(default)s: this machine only)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on, 0 for a free one (%(default)s)")
    serve.add_argument("--cpu", action="store_true", help="serve on the CPU even when a GPU is present")
    serve.add_argument("--name", default=None, help="the model's name in answers (default: the file's name)")
    serve.add_argument("--max-inputs", type=_positive, default=2048, help="most items in one request (%(default)s)")
    serve.add_argument(
        "--max-body-bytes", type=_positive, default=32 * 2**20, help="largest request body (%(default)s bytes)"
    )
    serve.add_argument(
        "--max-queue", type=_positive, default=16384, help="most items waiting; past it, 503 (%(default)s)"
    )
    serve.add_argument(
        "--batch-wait-ms",
        type=_natural,
        default=None,
        help="under load, the most ms a model call waits for as many items as the last one carried (0: never; "
        "default 50 on a compiled model, on the GPU, and 0 on the CPU, where a call costs what it holds)",
    )
    serve.add_argument("--rows", type=_natural, default=0, help="rows of one forward (0: the run's)")
    serve.add_argument("--segments", type=_natural, default=0, help="items of one forward (0: the run's)")
    serve.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (%(default)s)",
    )
    serve.add_argument("--access-log", action="store_true", help="log a line per request (at info)")
    serve.add_argument(
        "--jpeg",
        choices=("host", "device"),
        default="host",
        help="where JPEGs decode: host (Pillow, as training) or device (the GPU's nvJPEG, through torchvision; "
        "pixels within a few levels of the host's) (%(default)s)",
    )

    commands.add_parser("version", help="print the library's version", description="Prints uform's version.")
    return parser


def devices_of(text: str) -> list[int] | int:
    """`--devices`' word, parsed (the executor is made once the run file has been read): "cpu", "cpu:N" or
    CUDA indices "0,1". Answers the CUDA indices as a list, or the count of CPU devices as an int (0: the CPU
    driven in this process)."""
    if text == "cpu":
        return 0
    if text.startswith("cpu:"):
        count = text.removeprefix("cpu:")
        if not count.isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"cpu:N needs a positive count of CPU devices, got {text!r}")
        return int(count) if int(count) > 1 else 0
    parts = text.split(",")
    if not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected cpu, cpu:N or CUDA indices such as 0,1; got {text!r}")
    return [int(p) for p in parts]


def _train(args: argparse.Namespace) -> int:
    try:
        config = read_run_config(args.config, args.overrides)  # every key checked before a device is touched
        output = args.output or os.path.join("runs", os.path.splitext(os.path.basename(args.config))[0])
        executor = mesh = None
        lead = True
        if Mesh.under_torchrun():  # one process per device, each the device LOCAL_RANK (or the CPU)
            if args.devices is not None:
                raise ValueError("--devices: under torchrun every process trains on its own device; leave it out")
            mesh = Mesh.from_env()
            lead = mesh.describe().ranks[0] == 0
        elif isinstance(args.devices, int):
            executor = Executor.cpu(workers=args.devices)
        elif args.devices is not None:
            executor = Executor.for_vram(args.devices)
        try:
            summary = fit(config, output, resume=args.resume, stop_after=args.stop_after, devices=executor, mesh=mesh)
        finally:
            if mesh is not None:
                mesh.close()
                mesh.executor.close()
            if executor is not None:
                executor.close()
    except (ValueError, TypeError, OSError) as error:  # a CheckpointError is a ValueError
        print(f"uform train: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, the last whole checkpoint left in place
        print("\nuform train: interrupted (the last checkpoint written is the one to resume)", file=sys.stderr)
        return exit_status(signal.SIGINT)
    if summary.interrupted is not None:  # stopped at a step boundary and saved there: the shell's 128 + signal
        if lead:
            print(f"uform train: interrupted at step {summary.step}; resume with --resume latest; {summary.output}")
        return exit_status(summary.interrupted)
    state = "done" if summary.step >= summary.steps else f"stopped at step {summary.step} of {summary.steps}"
    if lead:
        print(f"uform train: {state}; {summary.output}")
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        out = export(args.checkpoint, args.out_dir, onnx=args.onnx)
    except (ValueError, TypeError, OSError, ImportError) as error:  # a CheckpointError is a ValueError
        print(f"uform export: {error}", file=sys.stderr)
        return 2
    print(f"uform export: wrote {out}")
    return 0


def _encode(args: argparse.Namespace) -> int:
    fields = None
    if args.fields:
        fields = {}
        for entry in args.fields:
            name, equals, role = entry.partition("=")
            if not equals or not name or not role:
                print(f"uform encode: --field: expected NAME=ROLE, got {entry!r}", file=sys.stderr)
                return 2
            fields[name] = role
    executor = Executor.cpu() if args.cpu else None
    try:
        summary = encode_file(
            args.model,
            args.input,
            args.output,
            fields=fields,
            width=args.width,
            dtype=args.dtype,
            batch=args.batch,
            executor=executor,
            progress=not args.quiet,
            jpeg=args.jpeg,
        )
        for record, reason in summary.failures:
            print(f"uform encode: record {record} not embedded ({reason}); its row is null", file=sys.stderr)
    except (ValueError, TypeError, OSError, ImportError) as error:
        print(f"uform encode: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nuform encode: interrupted (the output was not written)", file=sys.stderr)
        return 130
    finally:
        if executor is not None:
            executor.close()
    print(f"uform encode: {summary.records} records, {summary.failed} not embedded; {summary.output}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from .server import Limits, model_name, serve_http  # the serve extra, for this command alone
    except ImportError as error:
        print(f"uform serve: needs the serve extra (pip install 'uform[serve]'): {error}", file=sys.stderr)
        return 2

    def ready(url: str, model: Model) -> None:
        widths = ", ".join(map(str, model.matryoshka_dimensions))
        print(
            f"uform serve: {args.name or model_name(model)} (depth {model.config.depth}, widths {widths}, "
            f"on {model.device}) listening on {url}/v1 (Ctrl-C stops)",
            flush=True,
        )

    executor = Executor.cpu() if args.cpu or not torch.cuda.is_available() else Executor.for_vram([0])
    try:
        limits = Limits(
            max_body_bytes=args.max_body_bytes,
            max_inputs=args.max_inputs,
            max_queued=args.max_queue,
            batch_wait_ms=args.batch_wait_ms,
        )
        serve_http(
            args.model,
            host=args.host,
            port=args.port,
            executor=executor,
            name=args.name,
            limits=limits,
            log_level=args.log_level,
            access_log=args.access_log,
            rows=args.rows,
            segments=args.segments,
            jpeg=args.jpeg,
            ready=ready,
        )
    except (ValueError, TypeError, OSError) as error:  # a CheckpointError is a ValueError; a port taken, OSError
        print(f"uform serve: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the server listens (loading, warming up); after, SIGINT stops it cleanly
        print("\nuform serve: interrupted", file=sys.stderr)
        return 130
    finally:
        executor.close()
    print("uform serve: stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command named by `argv` (default `sys.argv[1:]`) and answers its exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
    except SystemExit as stop:  # argparse exits on --help and on bad arguments
        return int(stop.code or 0)

    if args.command == "version":
        print(f"uform {__version__}")
        return 0
    if args.command == "train":
        return _train(args)
    if args.command == "plot":
        try:
            print(plot_run(args.run, args.output))
        except (ValueError, OSError, ImportError) as error:
            print(f"uform {error}", file=sys.stderr)  # its messages start "plot: "
            return 2
        return 0
    if args.command == "export":
        return _export(args)
    if args.command == "encode":
        return _encode(args)
    if args.command == "serve":
        return _serve(args)

    if args.save is not None and args.part == "image":
        print("uform demo: --save: saves the text part's run; choose --part text or both", file=sys.stderr)
        return 2
    executor = Executor.cpu() if args.cpu else None
    text = images = None
    try:
        if args.part in ("text", "both"):
            text = run_demo(
                steps=args.steps,
                depth=args.depth,
                hidden=args.hidden,
                rows=args.rows,
                columns=args.columns,
                segments=args.segments,
                learning_rate=args.learning_rate,
                seed=args.seed,
                max_paragraphs=args.max_paragraphs,
                executor=executor,
                progress=not args.quiet,
                checkpoint=args.save,
            )
        if args.part in ("image", "both"):
            images = run_image_demo(
                steps=args.image_steps,
                depth=args.depth,
                hidden=args.hidden,
                seed=args.seed,
                executor=executor,
                progress=not args.quiet,
            )
        if text is not None and images is not None:
            held = len(held_out_split(len(text_pairs(args.seed, args.max_paragraphs)[1]), args.seed)[1])
            print(report(text, images, held))
    except ValueError as error:
        print(f"uform demo: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nuform demo: interrupted", file=sys.stderr)
        return 130
    return 0
