"""Text-only use never loads the media libraries, and decode workers never load torch."""

from __future__ import annotations

import subprocess
import sys


def _loaded(code: str, modules: tuple[str, ...]) -> list[str]:
    probe = f"import sys\n{code}\nprint(','.join(m for m in {modules!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [m for m in result.stdout.strip().split(",") if m]


def test_a_text_trainer_does_not_import_media_libraries() -> None:
    code = "import uform\nuform.Trainer\nimport uform.data.batch, uform.media.decode"
    assert _loaded(code, ("av", "soundfile", "soxr", "PIL")) == []


def test_the_decode_pool_module_does_not_import_torch() -> None:
    assert _loaded("import uform.media.pool, uform.media.decode", ("torch",)) == []
