"""The counter-based hash behind ``dspine.sampling``'s noise, in one place for the sampler and the fused race
kernel (``dspine.ops.race``): SplitMix64's increment and finalizer on int64 tensors [Steele, Lea & Flood 2014],
and the map of a 64-bit key to a 23-bit uniform in (0, 1)."""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)  # SplitMix64 increment [Steele, Lea & Flood 2014]
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (wrapping products, logical right shifts)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _M1
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _M2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


UNIT_BITS = 23  # m + 0.5 < 2^23 needs 24 significant bits: exact in fp32, so u < 1 strictly


def _to_unit(key: torch.Tensor) -> torch.Tensor:
    """``(m + 0.5) / 2^23`` with ``m`` the key's low 23 bits: fp32 in [2^-24, 1 - 2^-24], every value exact.

    With 24 bits, ``m + 0.5`` for m = 2^24 - 1 rounds to 2^24 in fp32, so ``u`` was 1.0 and the race's
    noise ``-log u`` was ±0: that token's score ``p / E`` became -inf (torch) or +inf (the Triton kernel)."""
    return ((key & ((1 << UNIT_BITS) - 1)).float() + 0.5) * (1.0 / (1 << UNIT_BITS))
