"""Small file helpers shared by the data CLIs and the trainer: crash-safe JSON writes, file digests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def atomic_write_json(path: str | Path, obj, *, indent: int = 2, allow_nan: bool = False) -> None:
    """Writes `obj` as indented JSON through a temp file and a rename, so a reader never sees half a file.

    ``allow_nan=True`` writes NaN/Infinity as Python's json module does (benchmark records); by default
    they are refused.

    Raises:
        ValueError: `obj` holds NaN or infinity and ``allow_nan`` is False (not JSON; nothing is written).
    """
    path = Path(path)
    text = json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=allow_nan)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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



def read_safetensors(folder: Path, device, multimodal: bool = False) -> dict:
    """All tensors ``{name: torch.Tensor}`` of ``model.safetensors`` or the shards of
    ``model.safetensors.index.json``; with ``multimodal`` only the text model's, under its text-model names
    (:func:`dspine.config.text_weight_name`: ``model.language_model.x`` -> ``model.x``), the others never read.

    Raises:
        FileNotFoundError: a missing shard. ValueError: an index without a ``weight_map``.
    """
    from safetensors import safe_open

    from dspine.config import text_weight_name
    from dspine.paths import read_json_object

    index = folder / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.is_file():
        weight_map = read_json_object(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        files = sorted(set(weight_map.values()))
    state = {}
    for f in files:
        path = folder / f
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing target weights")
        with safe_open(str(path), framework="pt", device=str(device)) as tensors:
            for key in tensors.keys():
                name = text_weight_name(key, multimodal)
                if name is not None:
                    state[name] = tensors.get_tensor(key)
    return state
