"""Copies scikit-image's and pygame's sample-data folders into one folder, for a machine without them.

The media tests (tests/media_samples.py) and bench/decode.py read real media shipped inside those two PyPI
packages; the GPU machine has neither, and both wheels are too large to carry beside PyAV. This copies just
their data folders (about 8 MiB) into FOLDER/skimage and FOLDER/pygame; point UFORM_SAMPLE_MEDIA at FOLDER
there. Usage: python bench/sample_media.py FOLDER
"""

from __future__ import annotations

import importlib.resources
import pathlib
import shutil
import sys


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    folder = pathlib.Path(sys.argv[1])
    sources = {"skimage": ("skimage", "data"), "pygame": ("pygame", "examples/data")}
    for name, (package, sub) in sources.items():
        source = pathlib.Path(str(importlib.resources.files(package) / sub))
        shutil.copytree(source, folder / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(f"copied {size / 2**20:.1f} MiB of sample media into {folder}")


if __name__ == "__main__":
    main()
