"""Prints the requirements of the decoder tests, one a line, from pyproject.toml: the media libraries and
numpy (no torch, no safetensors: the decoder tests import neither) and the test extra's sample-media
packages and pytest.

`newest` leaves every bound as pyproject writes it, so pip resolves the newest release admitted; `oldest`
pins each media library and numpy to the lower bound pyproject admits (`>=X` becomes `==X`). The test tools
are left unpinned in both: they are not what is under test.
"""

import re
import sys
import tomllib
from pathlib import Path

_DECODING = ("numpy", "pillow", "simplejpeg", "av", "soundfile", "soxr")
_TOOLS = ("pytest", "scikit-image", "pygame")


def main(end: str) -> None:
    if end not in ("newest", "oldest"):
        raise SystemExit(f"usage: media_requirements.py newest|oldest, got {end!r}")
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    specs = {}
    for spec in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        specs[re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower()] = spec
    for name in _DECODING:
        spec = specs[name]
        if end == "oldest":
            lower = re.fullmatch(rf"{re.escape(name)}\s*>=\s*([0-9.]+)(\s*,.*)?", spec, re.IGNORECASE)
            if lower is None:
                raise SystemExit(f"pyproject.toml: {spec!r} has no lower bound (>=X) to test")
            spec = f"{name}=={lower.group(1)}"
        print(spec)
    for name in _TOOLS:
        print(specs[name])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) == 2 else "")
