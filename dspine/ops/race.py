"""The exponential race of ``dspine.sampling.sample`` over a dense distribution, noise made in the kernel.

Op: ``token[r] = argmax_v probs[r, v] / E[r, v]`` with ``E = -log u`` and ``u`` the counter-based
uniform of token v (``dspine.sampling.uniforms``: SplitMix64 of the row's position key + v·golden,
23 bits -> ``(m + 0.5) / 2^23``, exact in fp32 and < 1); the lowest v among equal maxima, as ``torch.argmax``. This is
``sample(probs, seeds, stream, positions)`` without candidate ids (plain temperature sampling) [the
race: gpt-fast ``multinomial_sample_one_no_sync``; SplitMix64: Steele, Lea & Flood 2014].

Layouts: probs ``[R, V]`` fp32, unit stride over V; keys ``[R]`` int64 (``sampling._position_keys``,
one per row); returns ``[R]`` int64. Grid: (R,), each program loops over V in BLOCK tiles.
Memory traffic: reads R·V·4 bytes and nothing else; the torch path materialises the int64 hash
chain (about 16 passes over R·V·8 bytes) and the fp32 noise.
Numerics: the hash is integer arithmetic (the same bits); ``log`` is libdevice's ``logf`` and the
division ``div_rn``, the functions torch's CUDA kernels compile to, so on a GPU the token equals the
torch path's bit for bit (tests/test_kernels_race.py, ``gpu``). The Triton interpreter has no
libdevice: it uses ``tl.log`` (NumPy's), which may differ by an ulp, so there only a near-tie could
pick another token.
"""

from __future__ import annotations

import os

import torch

from ._common import pick_impl, tl, triton

try:
    from triton.language.extra import libdevice
except ImportError:  # CPU-only install (no triton) or an older layout: the torch path only
    libdevice = None

__all__ = ["race"]

BLOCK = 1024


@triton.jit
def _race_kernel(P, Keys, Out, V, stride_p, golden, m1, m2, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    key = tl.load(Keys + r)
    best = tl.full([BLOCK], -1.0, tl.float32)  # scores are >= 0: any real entry beats -1
    best_i = tl.zeros([BLOCK], tl.int64)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK).to(tl.int64)
        ok = v < V
        p = tl.load(P + r * stride_p + v, mask=ok, other=0.0)
        z = key + v * golden
        z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * m1  # logical shifts: arithmetic shift, then mask
        z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * m2
        z = z ^ ((z >> 31) & 0x1FFFFFFFF)
        u = ((z & 0x7FFFFF).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # counter_hash._to_unit, UNIT_BITS 23
        if LIBDEVICE:
            e = -libdevice.log(u)
        else:  # the interpreter has no libdevice
            e = -tl.log(u)
        s = tl.where(ok, tl.math.div_rn(p, e), -1.0)
        better = s > best  # strict: within a lane the lower id keeps a tie
        best = tl.where(better, s, best)
        best_i = tl.where(better, v, best_i)
    top = tl.max(best, axis=0)
    idx = tl.min(tl.where(best == top, best_i, V), axis=0)  # across lanes: the lowest id of the maxima
    tl.store(Out + r, tl.minimum(idx, V - 1))  # an all-NaN row: a valid id (the non-finite check raises)


def race_triton(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    from dspine.counter_hash import _GOLDEN, _M1, _M2

    if libdevice is None:
        raise RuntimeError("race: impl='triton' needs triton.language.extra.libdevice; use impl='torch'")
    R, V = probs.shape
    p = probs if probs.stride(-1) == 1 else probs.contiguous()
    out = torch.empty(R, dtype=torch.int64, device=probs.device)
    if R > 0:
        _race_kernel[(R,)](p, keys.contiguous(), out, V, p.stride(0), _GOLDEN, _M1, _M2, BLOCK=BLOCK,
                           LIBDEVICE=os.environ.get("TRITON_INTERPRET", "0") != "1", num_warps=4)
    return out


def race_torch(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    from dspine.counter_hash import _GOLDEN, _mix64, _to_unit

    u = _to_unit(_mix64(keys[:, None] + torch.arange(probs.shape[-1], device=probs.device) * _GOLDEN))
    return (probs / -torch.log(u)).argmax(-1)


def race(probs: torch.Tensor, keys: torch.Tensor, impl: str = "torch") -> torch.Tensor:
    """``argmax_v probs[r, v] / E[r, v]`` (module docstring): probs ``[R, V]`` fp32, keys ``[R]`` int64 ->
    tokens ``[R]`` int64. Raises ValueError on shapes or dtypes."""
    fn = pick_impl(impl, race_triton, race_torch)
    if probs.dim() != 2 or probs.dtype != torch.float32 or keys.shape != probs.shape[:1] or keys.dtype != torch.int64:
        raise ValueError(f"race needs probs [R, V] fp32 and keys [R] int64, got probs {tuple(probs.shape)} "
                         f"{probs.dtype} and keys {tuple(keys.shape)} {keys.dtype}")
    return fn(probs, keys)
