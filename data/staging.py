"""The folder a data tool builds its output in before renaming it into place.

Standard library only (``dspine.io`` included): ``python -m data.pack`` imports it without torch.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from dspine.io import pid_alive


@contextlib.contextmanager
def tmp_beside(out: Path):
    """Yields ``.<name>.tmp-<pid>`` beside ``out``, new and empty (parents created): the folder a data tool builds
    ``out`` in before renaming it into place (a dot name: ``ls -d folder/*/`` skips it and nothing opens it as output).
    The same name's leftovers of processes that are gone (SIGKILL runs no cleanup) are removed first; one of another
    live process (a concurrent build) is left. Removed with its contents when the block raises (Ctrl-C included)."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    for old in out.parent.glob(f".{out.name}.tmp-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

