"""rms_norm and qk_norm_rope_cache against Hugging Face's op sequence and an fp64 reference.

Two checks per case: (1) structure — equal to the HF modules' arithmetic written out here
(Qwen3RMSNorm; rotate_half / apply_rotary_pos_emb), bit for bit except for rare one-ulp
differences from the fp32 mean's summation order; (2) accuracy — max error against fp64 within
2× the error of that same HF arithmetic at the dtype, plus a small floor.
"""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import math

import pytest
import torch

from dspine.ops.rmsnorm import rms_norm, shift_rms_norm
from dspine.ops.rope import qk_norm_rope_cache, rope_tables

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])
DEVICES = [CPU, CUDA]
DTYPES = [torch.bfloat16, torch.float32]
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}


def hf_rms_norm(x, weight, eps):
    """transformers' Qwen3RMSNorm.forward, weight in the activation dtype."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf_rope(x, positions, base):
    """HF default rope for x [N, H, D] at positions [N]: fp32 angles, cos/sin cast to x's dtype."""
    D = x.shape[-1]
    inv_freq = (1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))).to(x.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
    return (x * cos) + (rotate_half(x) * sin)


def ulp_diff_ok(a, b):
    """Same arithmetic up to summation order: bf16 equal or one ulp (of the row's largest
    element, because rope's difference x1·c − x2·s can cancel) apart in <= 1% of the elements;
    fp32 within 8 such ulp (its rsqrt input moves by a few ulp with the order)."""
    if torch.equal(a, b):
        return True
    eps = torch.finfo(a.dtype).eps
    ulps, frac = (1, 0.01) if a.dtype != torch.float32 else (8, 1.0)
    diff = (a.double() - b.double()).abs()
    tol = ulps * eps * a.double().abs().amax(-1, keepdim=True) + 1e-30
    return bool((diff <= tol).all()) and (diff > 0).double().mean().item() <= frac


# ----------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 8), (3, 5, 100), (4, 4096), (2, 5120)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(shape, dtype, device, with_residual):
    g = torch.Generator().manual_seed(1)
    H = shape[-1]
    x = (torch.randn(*shape, generator=g) * 3).to(dtype).to(device)
    res = torch.randn(*shape, generator=g).to(dtype).to(device) if with_residual else None
    w = (torch.rand(H, generator=g) + 0.5).to(dtype).to(device)
    eps = 1e-6
    out = torch.full_like(x, float("nan"))
    got = rms_norm(x, w, eps, residual=res, out=out)
    if with_residual:
        y, r = got
        assert torch.equal(r, res + x), "residual sum must be torch's own dtype add"
    else:
        y, r = got, x
    assert y is out and not y.isnan().any()
    hf = hf_rms_norm(r, w, eps)
    assert ulp_diff_ok(y, hf), (y.float() - hf.float()).abs().max()
    r64 = r.double()
    ref = w.double() * r64 / torch.sqrt(r64.pow(2).mean(-1, keepdim=True) + eps)
    err = (y.double() - ref).abs().max().item()
    err_hf = (hf.double() - ref).abs().max().item()
    assert err <= 2 * err_hf + FLOOR[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_torch_impl_is_hf(dtype):
    g = torch.Generator().manual_seed(2)
    x, res = torch.randn(6, 300, generator=g).to(dtype), torch.randn(6, 300, generator=g).to(dtype)
    w = torch.rand(300, generator=g).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-5, impl="torch"), hf_rms_norm(x, w, 1e-5))
    y, r = rms_norm(x, w, 1e-5, residual=res, impl="torch")
    assert torch.equal(r, res + x) and torch.equal(y, hf_rms_norm(res + x, w, 1e-5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_scaled_residual(dtype, device):
    """r = residual + scale ⊙ x: the DSpine injection's gate, applied inside the next layer's norm."""
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(9, 100, generator=g).to(dtype).to(device), torch.randn(9, 100, generator=g).to(dtype).to(device)
    w, s = (torch.rand(100, generator=g) + 0.5).to(dtype).to(device), torch.randn(100, generator=g).to(dtype).to(device)
    for impl in ("torch", "triton"):
        y, r = rms_norm(x, w, 1e-6, residual=res, scale=s, impl=impl)
        assert torch.equal(r, res + s * x), impl  # torch's own dtype mul then add
        assert ulp_diff_ok(y, hf_rms_norm(res + s * x, w, 1e-6)), impl
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, scale=s, impl="torch")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_residual_out_into_a_column_block(dtype, device):
    """``residual_out``: the sum lands in a strided column block of a wider buffer (the engine target's draft
    features), equal to the fresh sum, the rest of the buffer untouched, and the returned residual is that block."""
    g = torch.Generator().manual_seed(4)
    x, res = torch.randn(7, 96, generator=g).to(dtype).to(device), torch.randn(7, 96, generator=g).to(dtype).to(device)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype).to(device)
    for impl in ("torch", "triton"):
        buf = torch.full((7, 3 * 96), 7.0, dtype=dtype, device=device)
        block = buf[:, 96:192]
        y, r = rms_norm(x, w, 1e-6, residual=res, impl=impl, residual_out=block)
        want_y, want_r = rms_norm(x, w, 1e-6, residual=res, impl=impl)
        assert r.data_ptr() == block.data_ptr() and torch.equal(block, res + x), impl
        assert torch.equal(y, want_y) and torch.equal(r, want_r), impl
        assert (buf[:, :96] == 7).all() and (buf[:, 192:] == 7).all(), impl
        # and as the next norm's residual input (row stride 3·H)
        y2, r2 = rms_norm(x, w, 1e-6, residual=block, impl=impl)
        assert torch.equal(r2, res + x + x) and torch.equal(y2, rms_norm(x, w, 1e-6, residual=want_r, impl=impl)[0])
    with pytest.raises(ValueError, match="residual_out"):
        rms_norm(x, w, 1e-6, impl="torch", residual_out=torch.empty_like(x))  # no residual
    with pytest.raises(ValueError, match="residual_out"):
        rms_norm(x, w, 1e-6, residual=res, impl="torch", residual_out=torch.empty(7, 95, dtype=dtype, device=device))
    x3, r3 = x.view(7, 1, 96), res.view(7, 1, 96)
    for impl in ("torch", "triton"):  # rows not one stride apart (3-D and strided): refused, not written to a copy
        with pytest.raises(ValueError, match="rows one stride apart"):
            rms_norm(x3, w, 1e-6, residual=r3, impl=impl,
                     residual_out=torch.empty(7, 2, 192, dtype=dtype, device=device)[:, :1, :96])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_shift_rms_norm(dtype, device, with_residual, bs):
    """Output row t of a block = RMSNorm(row t-1), zeros at slot 0; the training module's numerics."""
    from dspine.model import AdjacentInjection, RMSNorm

    g = torch.Generator().manual_seed(4)
    N, H = 3 * bs, 100
    x = (torch.randn(N, H, generator=g) * 3).to(dtype).to(device)
    res = torch.randn(N, H, generator=g).to(dtype).to(device) if with_residual else None
    norm = RMSNorm(H, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
        r_want = x if res is None else res + x
        want = norm(AdjacentInjection.previous(r_want[None], bs))[0]
    ref, r_ref = shift_rms_norm(x, norm.weight.detach(), 1e-6, bs, residual=res, impl="torch")
    assert torch.equal(ref, want) and torch.equal(r_ref, r_want)
    got, r_got = shift_rms_norm(x, norm.weight.detach(), 1e-6, bs, residual=res, impl="triton")
    assert torch.equal(r_got, r_want) and not got.isnan().any()
    assert torch.equal(got.view(3, bs, H)[:, 0], torch.zeros_like(got.view(3, bs, H)[:, 0]))
    assert ulp_diff_ok(got, want), (got.float() - want.float()).abs().max()
    with pytest.raises(ValueError, match="whole blocks"):
        shift_rms_norm(x[:-1], norm.weight.detach(), 1e-6, bs + 2, impl="torch")


# ----------------------------------------------------------------------------- rope


def test_rope_tables_match_hf_and_fp64():
    D, P, base = 128, 4096, 1e6
    cos, sin = rope_tables(D, P, base, "cpu")
    assert cos.shape == (P, D // 2) and cos.dtype == torch.float32
    one = torch.ones(P, 1, D)
    hf = hf_rope(one.float(), torch.arange(P), base)[:, 0]  # x = 1: cos − sin | cos + sin
    assert torch.equal(hf[:, : D // 2], cos - sin) and torch.equal(hf[:, D // 2:], cos + sin)
    theta = base ** (-2.0 * torch.arange(D // 2, dtype=torch.float64) / D)
    ang = torch.arange(P, dtype=torch.float64)[:, None] * theta[None, :]
    # fp32 angles are off by up to ~p·θ·2^-24: the same error HF has
    assert (cos.double() - ang.cos()).abs().max().item() < 1e-6 * P
    assert (sin.double() - ang.sin()).abs().max().item() < 1e-6 * P


ROPE_CASES = [
    # N, Hq, Hkv, D, with q, qk-norm (Qwen3) or not (Llama)
    (7, 8, 2, 8, True, True),
    (5, 32, 8, 128, True, True),
    (9, 8, 1, 64, True, False),
    (4, 2, 2, 128, False, True),  # draft context cache: q = None
    (3, 4, 4, 80, True, True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: f"N{c[0]}G{c[1] // c[2]}D{c[3]}q{int(c[4])}n{int(c[5])}")
def test_qk_norm_rope_cache(case, dtype, device):
    N, Hq, Hkv, D, with_q, with_norm = case
    B, S, P, base, eps = 3, 40, 5000, 1e6, 1e-6
    g = torch.Generator().manual_seed(3)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)
    q = rnd(N, Hq, D) if with_q else None
    k, v = rnd(N, Hkv, D) * 2, rnd(N, Hkv, D)
    qw = (torch.rand(D, generator=g) + 0.5).to(dtype).to(device) if with_norm and with_q else None
    kw = (torch.rand(D, generator=g) + 0.5).to(dtype).to(device) if with_norm else None
    positions = torch.randint(0, P, (N,), generator=g).to(device)
    slots = torch.randperm(B * S, generator=g)[:N]
    batch_idx, cache_pos = (slots // S).int().to(device), (slots % S).int().to(device)
    cos, sin = rope_tables(D, P, base, device)
    k_cache = torch.full((B, Hkv, S, D), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    q_out = torch.full_like(q, float("nan")) if with_q else None
    got = qk_norm_rope_cache(q, k, v, qw, kw, eps, cos, sin, positions, k_cache, v_cache,
                             batch_idx, cache_pos, q_out=q_out)

    def expected(x, w):
        xn = hf_rms_norm(x, w, eps) if w is not None else x
        return hf_rope(xn, positions, base), xn

    def ref64(xn):  # exact rotation of the (HF-normed) input
        th = base ** (-2.0 * torch.arange(D // 2, dtype=torch.float64, device=device) / D)
        a = positions.double()[:, None, None] * th
        x1, x2 = xn.double()[..., : D // 2], xn.double()[..., D // 2:]
        return torch.cat([x1 * a.cos() - x2 * a.sin(), x2 * a.cos() + x1 * a.sin()], -1)

    k_hf, k_n = expected(k, kw)
    written = torch.zeros(B, S, dtype=torch.bool, device=device)
    written[batch_idx.long(), cache_pos.long()] = True
    assert k_cache.permute(0, 2, 1, 3)[~written].isnan().all(), "rows not addressed must be untouched"
    k_got = k_cache[batch_idx.long(), :, cache_pos.long()]
    assert torch.equal(v_cache[batch_idx.long(), :, cache_pos.long()], v)
    outs = [(k_got, k_hf, k_n)]
    if with_q:
        assert got is q_out
        q_hf, q_n = expected(q, qw)
        outs.append((got, q_hf, q_n))
    else:
        assert got is None
    for y, hf, xn in outs:
        assert not y.isnan().any()
        assert ulp_diff_ok(y, hf), (y.float() - hf.float()).abs().max()
        ref = ref64(xn)
        err = (y.double() - ref).abs().max().item()
        err_hf = (hf.double() - ref).abs().max().item()
        # fp32 angles at p < 5000 carry ~p·2^-24 ≈ 3e-4 rad of error in both HF and the kernel
        assert err <= 2 * err_hf + FLOOR[dtype] + 4 * P * 2.0 ** -24 * math.sqrt(2)


def test_qk_norm_rope_cache_torch_impl_is_hf():
    g = torch.Generator().manual_seed(4)
    N, Hq, Hkv, D = 6, 8, 2, 64
    q, k, v = (torch.randn(N, h, D, generator=g).bfloat16() for h in (Hq, Hkv, Hkv))
    qw, kw = (torch.rand(D, generator=g).bfloat16() + 0.5 for _ in range(2))
    pos = torch.randint(0, 1000, (N,), generator=g)
    cos, sin = rope_tables(D, 1000, 1e6)
    kc, vc = torch.zeros(2, Hkv, 8, D, dtype=torch.bfloat16), torch.zeros(2, Hkv, 8, D, dtype=torch.bfloat16)
    bi, cp = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 2, 5, 6, 7])
    q_out = qk_norm_rope_cache(q, k, v, qw, kw, 1e-6, cos, sin, pos, kc, vc, bi, cp, impl="torch")
    assert torch.equal(q_out, hf_rope(hf_rms_norm(q, qw, 1e-6), pos, 1e6))
    assert torch.equal(kc[bi, :, cp], hf_rope(hf_rms_norm(k, kw, 1e-6), pos, 1e6))
    assert torch.equal(vc[bi, :, cp], v)
