"""The `uform` command line: a thin layer that parses argv and calls the library.

    uform demo [--steps N] [--depth N] [--hidden N] [--seed N] [--cpu] [--quiet] [--save PATH]
    uform version

`main(argv)` answers the exit status instead of exiting, so it can be called in-process (as the tests
do); the console script and `python -m uform` pass its answer to `sys.exit`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import __version__
from .demo import DEFAULTS, run_demo
from .runtime.executor import Executor

__all__ = ["build_parser", "main"]


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uform", description="uform: one multimodal transformer tower, trained and served."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="train a small model on CPython's documentation and print held-out retrieval before and after",
        description="Trains a small tower on paragraphs of CPython's pydoc topics and prints held-out "
        "recall@1, recall@10 and MRR before and after training. Uses the first GPU when there is one.",
    )
    demo.add_argument("--steps", type=_positive, default=DEFAULTS["steps"], help="optimizer steps (%(default)s)")
    demo.add_argument("--depth", type=_positive, default=DEFAULTS["depth"], help="transformer blocks (%(default)s)")
    demo.add_argument(
        "--hidden", type=_positive, default=DEFAULTS["hidden"], help="embedding width, a multiple of 128 (%(default)s)"
    )
    demo.add_argument("--rows", type=_positive, default=DEFAULTS["rows"], help="rows per step (%(default)s)")
    demo.add_argument("--columns", type=_positive, default=DEFAULTS["columns"], help="bytes per row (%(default)s)")
    demo.add_argument(
        "--segments", type=_positive, default=DEFAULTS["segments"], help="items per step, two per pair (%(default)s)"
    )
    demo.add_argument(
        "--learning-rate", type=float, default=DEFAULTS["learning_rate"], help="peak learning rate (%(default)s)"
    )
    demo.add_argument("--seed", type=_natural, default=DEFAULTS["seed"], help="seed of every draw (%(default)s)")
    demo.add_argument("--max-paragraphs", type=_positive, default=None, help="use only this many paragraphs (all)")
    demo.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--save", metavar="PATH", default=None, help="save the trained run there, load it back and evaluate it too"
    )

    commands.add_parser("version", help="print the library's version", description="Prints uform's version.")
    return parser


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

    try:
        run_demo(
            steps=args.steps,
            depth=args.depth,
            hidden=args.hidden,
            rows=args.rows,
            columns=args.columns,
            segments=args.segments,
            learning_rate=args.learning_rate,
            seed=args.seed,
            max_paragraphs=args.max_paragraphs,
            executor=Executor.cpu() if args.cpu else None,
            progress=not args.quiet,
            checkpoint=args.save,
        )
    except ValueError as error:
        print(f"uform demo: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nuform demo: interrupted", file=sys.stderr)
        return 130
    return 0
