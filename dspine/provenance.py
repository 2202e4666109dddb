"""Provenance for result files: the exact command, device, date and the commit measured."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """``HEAD`` of the repo (``+dirty`` when tracked files differ), or $DSPINE_COMMIT when git is absent."""
    if os.environ.get("DSPINE_COMMIT"):
        return os.environ["DSPINE_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it: ``python -m pkg.mod ...`` for package modules."""
    argv = list(sys.argv if argv is None else argv)
    head = argv[0] if argv else ""
    p = Path(head).resolve()
    try:
        rel = p.relative_to(REPO)
    except ValueError:
        rel = None
    if rel is not None and rel.suffix == ".py" and rel.parts[0] in ("dspine", "infer", "train", "data"):
        if rel.parts[0] == "train" and rel.name == "distill.py":
            first = ["accelerate", "launch", str(rel)]
        else:
            first = ["python", "-m", ".".join(rel.with_suffix("").parts)]
    elif rel is not None and rel.suffix == ".py":
        first = ["python", str(rel)]
    else:
        first = [head]
    return " ".join(shlex.quote(a) for a in first + argv[1:])


def utc_now() -> str:
    """The UTC date and time to the second, ISO 8601 (a result file's ``date``)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# Environment variables that change what the engine runs (kernels, launches), recorded with a result when set: the
# command line alone does not show them.
ENGINE_ENV = ("DSPINE_PDL", "DSPINE_FUSE_NORM", "DSPINE_FUSE_ACT", "TRITON_F32_DEFAULT", "DSPINE_PLAN_LOG")


def provenance(argv: list[str] | None = None) -> dict:
    """command, GPU name (None on the CPU), UTC date, git commit, torch and python versions, and ``env``: those of
    :data:`ENGINE_ENV` that are set (the key only when one is)."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    env = {k: os.environ[k] for k in ENGINE_ENV if os.environ.get(k)}
    return {
        "command": command_line(argv),
        "gpu": gpu,
        "device": gpu or platform.processor() or platform.machine(),
        "date": utc_now(),
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        **({"env": env} if env else {}),
    }
