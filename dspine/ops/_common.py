"""Small helpers shared by the kernel files: optional Triton import and block-size choices.

Triton is optional: every op has an ``impl="torch"`` path that must run on a CPU-only install.
When Triton is missing, ``triton.jit`` becomes the identity and ``tl.constexpr`` a placeholder, so
the kernel files still import; calling ``impl="triton"`` then raises.
"""

from __future__ import annotations

import functools
import os
import types

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    from triton.runtime.errors import OutOfResources
    try:  # programmatic dependent launch (Hopper+): Triton >= 3.3
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

        HAS_GDC = True
    except ImportError:
        HAS_GDC = False
except ImportError:  # CPU-only install: the torch references still work
    HAS_TRITON = False
    triton = types.SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f))
    tl = types.SimpleNamespace(constexpr=object)
    HAS_GDC = False

    class OutOfResources(Exception):  # noqa: N818  (triton's name) - never raised without triton
        pass

__all__ = ["HAS_TRITON", "OutOfResources", "triton", "tl", "env_choice", "next_pow2", "block_d", "num_sms", "dot_precision", "check_impl",
           "pick_impl", "tile_counters", "PDL", "pdl_kwargs", "pdl_enter", "pdl_mode_for_hidden", "set_pdl_auto"]


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Environment variable ``name``, stripped and lower-cased (unset or empty: ``default``).

    Raises:
        ValueError: a value outside ``choices``, naming the variable and the choices.
    """
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"environment variable {name}={os.environ.get(name)!r}: use one of {', '.join(choices)} "
                         f"(default {default})")
    return value


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def block_d(head_dim: int) -> int:
    """Padded head dim for tl.dot: a power of two and >= 16 (D = 8, 80, 96 are masked)."""
    return max(16, next_pow2(head_dim))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (host-side property, no sync); 4 for the interpreter."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 inputs (Triton's default is TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_impl(impl: str) -> None:
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    if impl == "triton" and not HAS_TRITON:
        raise RuntimeError("impl='triton' needs the triton package; use impl='torch'")


def pick_impl(impl: str, triton_fn, torch_fn):
    """An op's ``triton_fn`` or ``torch_fn`` by ``impl``, checked first (:func:`check_impl`'s errors)."""
    check_impl(impl)
    return triton_fn if impl == "triton" else torch_fn


# Arrival counters of the kernels whose last program of a tile finishes what the tile's split programs began
# (``linear``'s fused reduce): one int32 per tile, zero between launches (the last program resets its tile's),
# one buffer per (device, stream), since launches on one stream never overlap. Buffers are never freed: a CUDA
# graph captured with one keeps its address.
_COUNTERS: dict[tuple, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
_MIN_COUNTERS = 1 << 14


def tile_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least ``n`` tile counters for launches on ``device``'s current stream, or
    None where none can be made now (a CUDA graph is being captured on a stream that has none or too few:
    the caller then takes its unfused path). Grown to the next power of two (at least 16,384) when too small;
    the old buffer is kept alive for graphs that hold its address."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        key = ("cuda", idx, torch.cuda.current_stream(idx).cuda_stream)
    else:
        key = (device.type, device.index, 0)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _RETIRED.append(buf)
    buf = torch.zeros(max(_MIN_COUNTERS, next_pow2(n)), dtype=torch.int32, device=device)
    _COUNTERS[key] = buf
    return buf


# Programmatic dependent launch (PDL): the engine's step is a chain of small kernels, each of which used to start
# only after the previous one had drained and its launch had gone through (a few hundred kernel boundaries per
# Qwen3-8B AR step). A kernel launched with ``launch_pdl`` may be scheduled while its predecessor in the stream
# still runs; its programs call :func:`pdl_enter` first, which waits until the predecessor has completed and its
# writes are visible (``griddepcontrol.wait``) before any load of an input or store of an output. Modes
# (``DSPINE_PDL``, read at import, or set ``PDL``):
#   0  off;
#   1  after the wait, let the successor be scheduled at once (``griddepcontrol.launch_dependents``), so that one
#      kernel waits ahead of the running one;
#   2  wait only: the successor is scheduled as this kernel's programs exit (its launch hides in their tail);
#   3  mode 1 for a launch over one row (a batch-1 decode's GEMVs, norms, attention), mode 2 otherwise.
# Unset (``auto``, the default): :data:`PDL_AUTO_MODE`, which ``infer.engine.Engine`` sets per target
# (:func:`pdl_mode_for_hidden`: 3 for a target of hidden size >= PDL_MIN_HIDDEN, else 0; 0 before any engine).
# On the H200 (results/engine-pdl-h200.json, per mode; the README's engine section) modes 1-3 speed up the Qwen3-8B
# shape's AR step and oracle loop, mode 1 slows the 16-row verify step (waiting programs hold SM slots that its
# many-program GEMMs need), and triggering before the wait was worse still (every later kernel's programs parked on
# the SMs); at SmolLM2-135M's shape (hidden 576) the speculative step of 2-4 us kernels got slower: off below 2048. The
# arithmetic is untouched, so the bits are the same in every mode (tests/test_pdl.py). The wait is transitive (a
# predecessor completes only after its own wait), and a kernel launched without the attribute (torch's,
# cuBLAS's) waits for everything before it as usual. Sources: PTX ISA, "griddepcontrol" (sm_90); CUDA
# programming guide, "Programmatic Dependent Launch and Synchronization".
_PDL_ENV = os.environ.get("DSPINE_PDL", "").strip().lower()
_PDL_OK = _PDL_ENV in ("", "auto", "0", "1", "2", "3")
PDL: int | None = int(_PDL_ENV) if _PDL_OK and _PDL_ENV not in ("", "auto") else None
PDL_AUTO_MODE = 0
PDL_MIN_HIDDEN = 2048


def _check_pdl_env() -> None:
    """Raise ValueError for a DSPINE_PDL that is not auto/0/1/2/3 (checked where PDL would act, an engine or a CUDA
    launch, not at import: the CPU paths and ``--help`` work whatever it says)."""
    if not _PDL_OK:
        raise ValueError(f"environment variable DSPINE_PDL={os.environ.get('DSPINE_PDL')!r}: use auto (the default), "
                         "0 (off), 1, 2 or 3 (dspine/ops/_common.py)")


def pdl_mode_for_hidden(hidden_size: int) -> int:
    """The ``auto`` mode for a target of this hidden size: 3 when ``hidden_size >= PDL_MIN_HIDDEN``, else 0
    (measured on the H200: a gain at Qwen3-8B's 4096, a loss at SmolLM2's 576; module comment above)."""
    return 3 if hidden_size >= PDL_MIN_HIDDEN else 0


def set_pdl_auto(hidden_size: int) -> int:
    """Set :data:`PDL_AUTO_MODE` for a target of this hidden size (``infer.engine.Engine`` calls it before it
    captures any graph) and return the mode launches will use (:data:`PDL` wins when set).

    Raises:
        ValueError: ``DSPINE_PDL`` set to something other than auto, 0, 1, 2 or 3.
    """
    global PDL_AUTO_MODE
    _check_pdl_env()
    PDL_AUTO_MODE = pdl_mode_for_hidden(hidden_size)
    return PDL_AUTO_MODE if PDL is None else PDL


@functools.cache
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_kwargs(device: torch.device, rows: int | None = None) -> dict:
    """Launch options for a kernel that calls :func:`pdl_enter`: ``{"launch_pdl": True, "PDL": mode}`` on a CUDA
    device of compute capability 9.0 or newer when the mode (:data:`PDL`, or :data:`PDL_AUTO_MODE` when unset)
    is not 0 and Triton has ``gdc_wait``, with ``mode`` 1 or 2 (mode 3 picks 1 when ``rows``, the launch's rows or tokens, is 1, else 2); ``{"PDL": 0}``
    otherwise (the CPU interpreter, older GPUs: the kernel then skips both instructions).

    Raises:
        ValueError: on a CUDA device, ``DSPINE_PDL`` set to something other than auto, 0, 1, 2 or 3.
    """
    mode = PDL_AUTO_MODE if PDL is None else int(PDL)
    if mode == 3:
        mode = 1 if rows == 1 else 2
    if device.type == "cuda":
        _check_pdl_env()
    if mode and HAS_GDC and device.type == "cuda":
        if _pdl_capable(device.index if device.index is not None else torch.cuda.current_device()):
            return {"launch_pdl": True, "PDL": mode}
    return {"PDL": 0}


if HAS_TRITON:

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """First statement of a kernel launched with :func:`pdl_kwargs`: wait for the previous kernel's completion
        and memory, then (``PDL == 1``) let the next kernel be scheduled (module comment above). No-op at 0."""
        if PDL > 0:
            gdc_wait()
            if PDL == 1:
                gdc_launch_dependents()

else:

    def pdl_enter(PDL):  # pragma: no cover - the torch paths never call it
        raise RuntimeError("pdl_enter needs triton")
