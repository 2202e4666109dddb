"""A quick structural check of a GGUF file before transformers parses it.

transformers reads a GGUF with ``struct``/NumPy and, on a truncated or corrupt file, fails deep
inside with a ``struct.error`` or a reshape error that names neither the file nor the problem.
:func:`check_gguf` walks the header (magic, version, metadata, tensor infos, as in the GGUF spec of
ggml ``docs/gguf.md``) and checks that the tensor data it describes fits in the file, in ~0.1 s
without reading the weights.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from pathlib import Path

# GGUF metadata value types -> struct format (8 = string, 9 = array, handled apart)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def read(self, n: int, what: str) -> bytes:
        pos = self.f.tell()
        if n < 0 or pos + n > self.size:
            raise ValueError(f"the file ends inside {what} (needs {n} bytes at offset {pos} of {self.size})")
        return self.f.read(n)

    def unpack(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.read(struct.calcsize(fmt), what))[0]

    def skip(self, n: int, what: str) -> None:
        pos = self.f.tell()
        if n < 0 or pos + n > self.size:
            raise ValueError(f"the file ends inside {what} (needs {n} bytes at offset {pos} of {self.size})")
        self.f.seek(pos + n)

    def string(self, what: str) -> bytes:
        return self.read(self.unpack("Q", what), what)

    def value(self, vtype: int, what: str):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.unpack("I", what), self.unpack("Q", what)
            if etype in _SCALAR:  # fixed-size elements: skip them at once
                self.skip(count * struct.calcsize(_SCALAR[etype]), what)
            else:
                for _ in range(count):
                    self.value(etype, what)
            return None
        raise ValueError(f"unknown metadata value type {vtype} in {what}")


def _tensor_bytes(ggml_type: int, dims: list[int], name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise ValueError(f"tensor {name!r} has an unknown ggml type {ggml_type}") from None
    return math.prod(dims) // block * type_size


def _check(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size)
        if r.read(4, "the magic number") != b"GGUF":
            raise ValueError("no GGUF magic number at the start")
        version = r.unpack("I", "the header")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version} (2 and 3 are supported)")
        n_tensors, n_kv = r.unpack("Q", "the header"), r.unpack("Q", "the header")
        alignment = 32  # GGUF default unless general.alignment says otherwise
        for i in range(n_kv):
            key = r.string(f"metadata entry {i}")
            value = r.value(r.unpack("I", f"metadata entry {i}"), f"metadata {key.decode(errors='replace')!r}")
            if key == b"general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        end = 0
        for i in range(n_tensors):
            name = r.string(f"tensor info {i}").decode(errors="replace")
            n_dims = r.unpack("I", f"tensor info {name!r}")
            dims = [r.unpack("Q", f"tensor info {name!r}") for _ in range(n_dims)]
            ggml_type, offset = r.unpack("I", f"tensor info {name!r}"), r.unpack("Q", f"tensor info {name!r}")
            end = max(end, offset + _tensor_bytes(ggml_type, dims, name))
        data_start = -(-f.tell() // alignment) * alignment
        if data_start + end > size:
            raise ValueError(f"the tensor data needs {data_start + end:,} bytes but the file has {size:,} "
                             f"(truncated: {100 * size / (data_start + end):.0f}% present)")


@functools.lru_cache(maxsize=16)
def _check_cached(path: str, size: int, mtime_ns: int) -> str | None:
    try:
        _check(Path(path))
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        return str(e)
    return None


class GGUFPackageMissing(ImportError, ValueError):
    """A GGUF file was given and the ``gguf`` package is not installed (:func:`check_gguf`)."""


def check_gguf(path: str | Path) -> None:
    """Raise ``ValueError`` naming ``path`` when it is not a complete GGUF file.

    Checks the magic number, the version (2 or 3), that every metadata entry and tensor info lies
    inside the file, and that the tensor data they describe ends inside the file. The result is
    cached per (path, size, mtime), so every loader of a CLI can call it.

    Raises:
        ValueError: "{path}: truncated or corrupt GGUF file (<reason>)".
        FileNotFoundError: no such file.
        GGUFPackageMissing: the ``gguf`` package (its quantization table; transformers reads GGUF files with it
            too) is not installed, naming ``path`` and the install command; a ValueError, so every CLI reports it as
            one error line like other bad input, and an ImportError.
    """
    p = Path(path)
    st = p.stat()
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise GGUFPackageMissing(f"{os.fspath(path)}: reading a GGUF file needs the gguf package, a dependency of "
                                 "dspine: pip install 'gguf>=0.10'") from e
    problem = _check_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)
    if problem is not None:
        raise ValueError(f"{os.fspath(path)}: truncated or corrupt GGUF file ({problem}); download it again "
                         "(the default target: python -m infer.fetch)")


_METADATA: dict = {}  # (realpath, size, mtime_ns) -> transformers' metadata parse of that file
_METADATA_KEEP = 4


def memo_gguf_metadata() -> bool:
    """Parse each GGUF file's metadata once per process in transformers.

    ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(path, return_tensors=False)`` reads the whole
    metadata (SmolLM2-135M: 49k tokenizer strings, ~3-4 s on one CPU core) and ``infer.generate`` calls it five
    times for one target (three configs, two tokenizers) before the one parse with the tensors. This wraps it so that
    a metadata-only parse of an unchanged file (same path, size and mtime) returns a deep copy of the first one:
    the same values as a new parse. Parses with the tensors, or with other arguments, go to transformers as before.
    Idempotent; returns whether the wrapper is in place (False when transformers has no such function).
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        return False
    real = getattr(gguf_utils, "load_gguf_checkpoint", None)
    if real is None:
        return False
    if getattr(real, "_dspine_memo", False):
        return True

    @functools.wraps(real)
    def load_gguf_checkpoint(gguf_checkpoint_path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or any(v is not None for v in kwargs.values()):
            return real(gguf_checkpoint_path, return_tensors, *args, **kwargs)
        import copy

        st = os.stat(gguf_checkpoint_path)
        key = (os.path.realpath(gguf_checkpoint_path), st.st_size, st.st_mtime_ns)
        if key not in _METADATA:
            while len(_METADATA) >= _METADATA_KEEP:
                _METADATA.pop(next(iter(_METADATA)))
            _METADATA[key] = real(gguf_checkpoint_path, return_tensors=False)
        return copy.deepcopy(_METADATA[key])

    load_gguf_checkpoint._dspine_memo = True
    gguf_utils.load_gguf_checkpoint = load_gguf_checkpoint
    return True
