"""Small file helpers shared by the data CLIs, the trainer and the model loaders: crash-safe JSON writes, file
digests, safetensors folders (one reader for drafts and targets)."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import signal
import sys
import threading
import types
from pathlib import Path


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """Within the block (or the decorated function), SIGTERM (``kill``, a scheduler's stop) raises KeyboardInterrupt
    as Ctrl-C does, so the CLI's Ctrl-C handler keeps what is finished and says so; the previous handler comes back
    after it. Off the main thread (where signals cannot be set) nothing changes. Yields a namespace: ``terminated``
    becomes True on a SIGTERM; while the caller sets ``hold`` True a SIGTERM only sets it (nothing is raised)."""
    stop = types.SimpleNamespace(terminated=False, hold=False)

    def interrupt(signum, frame):
        stop.terminated = True
        if not stop.hold:
            raise KeyboardInterrupt

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, interrupt) if main else None
    try:
        yield stop
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def folder_lock(out: Path, hold: bool = True):
    """Holds an exclusive lock on the folder ``out`` (flock of the folder itself: no file is left, and the kernel drops
    it when the process ends, SIGKILL included); BlockingIOError where another process holds it. ``hold`` False: none."""
    fd = os.open(out, os.O_RDONLY)
    try:
        if hold:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise BlockingIOError(f"{out}: another run is writing this folder; wait for it to end, or choose "
                                      "another output folder") from None
        yield
    finally:
        os.close(fd)


def atomic_write_json(path: str | Path, obj, *, indent: int = 2, allow_nan: bool = False) -> None:
    """Writes `obj` as indented JSON through a temp file and a rename, so a reader never sees half a file.

    ``allow_nan=True`` writes NaN/Infinity as Python's json module does (benchmark records); by default
    they are refused.

    Raises:
        ValueError: `obj` holds NaN or infinity and ``allow_nan`` is False (not JSON; nothing is written).
    """
    write_json_new(path, obj, indent=indent, allow_nan=allow_nan, replace=True)


def write_json_new(path: str | Path, obj, *, indent: int = 2, allow_nan: bool = False, replace: bool = False,
                   what: str | None = None) -> Path:
    """Writes `obj` as :func:`atomic_write_json` does, but never over a file: where ``path`` exists (say another run's
    results, written since this run checked the name) the first free ``STEM.N.SUFFIX`` beside it (N = 2, 3, ...) is
    taken instead, and with ``what`` (e.g. "this run's results are") a note on stderr says where they went. The name
    is claimed with a hard link of the finished temp file, so two writers never get the same one and a reader never
    sees half a file. ``replace``: the caller may replace ``path`` (it was there at the start and ``--overwrite`` was
    given): written over it as :func:`atomic_write_json` does. Returns the path written."""
    path = Path(path)
    text = json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=allow_nan)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    for old in path.parent.glob(f"{glob.escape(path.name)}.*.tmp"):  # a killed writer's (SIGKILL) temp file
        pid = old.name[len(path.name) + 1:-4]
        if pid.isdigit() and not pid_alive(int(pid)):
            old.unlink(missing_ok=True)
    try:  # the temp file is removed however this ends, a Ctrl-C during its write included
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return path
        for n in range(1, 10_000):
            out = path if n == 1 else path.with_name(f"{path.stem}.{n}{path.suffix}")
            try:
                os.link(tmp, out)
            except FileExistsError:
                continue
            except OSError:  # no hard links on this file system (FAT, some network mounts): claim the name, then write
                try:
                    with open(out, "x", encoding="utf-8") as f:
                        f.write(text + "\n")
                except FileExistsError:
                    continue
            if out != path and what is not None:
                print(f"note: {path} was written by someone else during this run and is left as it was; {what} in "
                      f"{out}", file=sys.stderr)
            return out
        raise FileExistsError(f"{path}: no free name beside it")
    finally:
        tmp.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (signal 0; a process of another user counts as alive): the
    writer of a temp file or staging folder named after it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def file_digest(path: str | Path, algorithm: str = "blake2b") -> str:
    """Hex digest of a file's contents, read in 1 MiB blocks: blake2b-128 (the default; data and cache
    digests) or any other ``hashlib`` algorithm by name (e.g. "sha256" for published checksums)."""
    h = hashlib.blake2b(digest_size=16) if algorithm == "blake2b" else hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def default_file_mode(path: str | Path) -> None:
    """Give a written file the mode a plain ``open`` would (0666 minus the umask).

    safetensors writes its files 0600; a draft or converted target on a shared machine should be
    readable by the other users the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model or draft folder: ``model.safetensors``, else the shards that
    ``model.safetensors.index.json`` lists (sorted, each once; not checked for existence).

    Raises:
        FileNotFoundError: neither file. ValueError: an index without a ``weight_map`` of name -> shard file."""
    from dspine.paths import read_json_object

    single = folder / WEIGHTS
    if single.is_file():
        return [single]
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        weight_map = read_json_object(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        return [folder / s for s in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{folder}: no {WEIGHTS} (or {WEIGHTS_INDEX})")


def open_each_weight_file(folder: Path, read, device="cpu") -> None:
    """Call ``read(handle)`` on a ``safetensors.safe_open`` handle (tensors on ``device``) of every file of
    :func:`weight_files`.

    Raises:
        FileNotFoundError: no weights file, or a shard listed in the index is missing.
        ValueError: a bad index, or a truncated or corrupt file (named)."""
    from safetensors import SafetensorError, safe_open

    for f in weight_files(folder):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: shard listed in {WEIGHTS_INDEX} is missing")
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as fh:
                read(fh)
        # the file's own errors only: out of (GPU) memory while reading a tensor is not a corrupt file
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from e


def read_safetensors(folder: Path, device="cpu", multimodal: bool = False) -> dict:
    """All tensors ``{name: torch.Tensor}`` (on ``device``) of the folder's safetensors file(s)
    (:func:`weight_files`); with ``multimodal`` only the text model's, under its text-model names
    (:func:`dspine.config.text_weight_name`: ``model.language_model.x`` -> ``model.x``), the others never read.

    Raises: as :func:`open_each_weight_file`."""
    from dspine.config import text_weight_name

    state = {}

    def take(fh) -> None:
        for key in fh.keys():
            name = text_weight_name(key, multimodal)
            if name is not None:
                state[name] = fh.get_tensor(key)

    open_each_weight_file(folder, take, device)
    return state
