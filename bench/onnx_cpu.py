"""CPU encode throughput: onnxruntime running `uform export --onnx`'s graph against the PyTorch path (`uform.load`).

A freshly initialised network at the given geometry is written as a trainer checkpoint, exported with `--onnx`,
then the same items are encoded by `Model.encode` (eager, f32, dense attention; `torch.set_num_threads`) and by
`onnx_encoder.OnnxEncoder` (onnxruntime's CPU provider, the same number of intra-op threads), both packing the
same way. Figures are the best of `--repeats` calls after one warm-up; the two answers' least cosine is printed
as a check. Writes bench-onnx-cpu.json under $OUT (or the current folder).

  python bench/onnx_cpu.py                       # depth 4 x hidden 256, 16 rows x 256 columns, 2 threads
  python bench/onnx_cpu.py --depth 1 --hidden 128 --rows 2 --columns 128 --segments 8 --texts 16 --images 4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import random_checkpoint, topic_slices, write_json  # sibling modules, not a package
from encode import jpegs, timed


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--columns", type=int, default=256)
    parser.add_argument("--segments", type=int, default=64)
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--text-bytes", type=int, default=60)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--image-side", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bench-onnx-cpu.json")
    args = parser.parse_args(argv)
    import uform as u
    from uform.media.decode import MediaPolicy
    from uform.onnx_encoder import OnnxEncoder

    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"geometry": vars(args), "torch": torch.__version__}
    items = {"text": topic_slices(args.texts, args.text_bytes), "image": jpegs(args.images, args.image_side)}
    with tempfile.TemporaryDirectory() as folder:
        exported = os.path.join(folder, "model")
        u.export(random_checkpoint(args, os.path.join(folder, "bench.safetensors")), exported, onnx=True)
        media = MediaPolicy(workers=1)
        with u.load(exported, media=media) as model, OnnxEncoder(exported, threads=args.threads, media=media) as graph:
            for kind, contents in items.items():
                if not contents:
                    continue
                modalities = [kind] * len(contents)
                row: dict[str, Any] = {"items": len(contents)}
                for name, encoder in (("torch", model), ("onnxruntime", graph)):
                    _, best = timed(lambda e=encoder, m=modalities, c=contents: e.encode(m, c), args.repeats)
                    row[f"{name}_items_per_s"] = len(contents) / best
                cosine = (model.encode(modalities, contents) * graph.encode(modalities, contents)).sum(1).min()
                row["least_cosine"] = float(cosine)
                row["speedup"] = row["onnxruntime_items_per_s"] / row["torch_items_per_s"]
                results[kind] = row
                print(
                    f"{kind:<6} torch {row['torch_items_per_s']:>9,.1f}/s  onnxruntime "
                    f"{row['onnxruntime_items_per_s']:>9,.1f}/s  x{row['speedup']:.2f}  (least cosine {cosine:.6f})",
                    flush=True,
                )
    write_json("bench-onnx-cpu.json", results, args.out)
    return results


if __name__ == "__main__":
    main()
