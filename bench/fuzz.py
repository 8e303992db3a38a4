"""The large fuzz campaign (issue 10): random step calls, valid and not, against a tiny CPU trainer and its
twin, each checked against the model of the rules in tests/fuzz_calls.py (CI runs the same at a minute's
size: tests/test_fuzz.py).

    python bench/fuzz.py --calls 5000 --seed 0 [--p-bad 0.08] [--out DIR]

Prints, and writes as DIR/bench-fuzz.json: calls, accepted, refused, refusals naming no field (with up to
ten examples), problems (a verdict unlike the model's, a refusal that is no ValueError / TypeError or names
none of the fields the model says are broken, a trainer unlike its twin after a call; up to ten shown),
and the wall time. Exits 1 when any refusal names no field or any problem was seen.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from fuzz_calls import Campaign, RandomSource, draw_call, fuzz_run  # noqa: E402

from uform import Executor, Trainer  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p-bad", type=float, default=0.08, help="the chance each field of a call is broken")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    executor = Executor.cpu()
    trainer, twin = (Trainer.init_vram(executor, fuzz_run()) for _ in range(2))
    campaign = Campaign(trainer, twin)
    source = RandomSource(args.seed)
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dropped and cut items are expected here; they are not findings
            for _ in range(args.calls):
                campaign.run(draw_call(source, args.p_bad))
    finally:
        trainer.close()
        twin.close()
    results = {
        "calls": args.calls,
        "seed": args.seed,
        "p_bad": args.p_bad,
        "accepted": campaign.tally["accepted"],
        "refused": campaign.tally["refused"] + campaign.tally["refused with another error"],
        "refused_naming_no_field": len(campaign.unnamed),
        "unnamed_examples": campaign.unnamed[:10],
        "problems": len(campaign.problems),
        "problem_examples": campaign.problems[:10],
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench-fuzz.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    answer = main()
    sys.exit(1 if answer["refused_naming_no_field"] or answer["problems"] else 0)
