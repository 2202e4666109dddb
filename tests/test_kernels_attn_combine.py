"""combine_partials (flash-decoding's second pass) against an fp64 merge of the same partials.

Error budget: max |out − ref64| ≤ 2 · (error of the torch reference path at the same output dtype)
+ a small floor. ``out`` is a strided view into a NaN-filled buffer, so an unwritten element or a
write outside the view fails the test. The ordered (exact-mode) kernel must also give the same bits
as the one-row-per-program kernel it replaced, kept below for that comparison.
"""

import tests.kernel_env  # noqa: F401,I001  (must precede the kernel imports)

import pytest
import torch

from dspine.ops._common import tl, triton
from dspine.ops.attn_combine import _combine_blocks, combine_partials
from tests.test_kernels_attention import DEVICES

FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3}

CASES = [
    # B, Hkv, G, T, NS, D, out dtype
    (2, 2, 4, 5, 3, 128, torch.bfloat16),  # G·T = 20: a partial second row block
    (1, 3, 2, 7, 1, 64, torch.float32),  # one split
    (2, 1, 4, 1, 2, 80, torch.bfloat16),  # decode (G·T = 4), D not a power of two
    (1, 2, 4, 16, 7, 128, torch.float32),
    (1, 8, 4, 16, 3, 128, torch.bfloat16),  # Qwen3-8B's batch-8 spec step, one batch row
    (1, 1, 2, 3, 64, 64, torch.float32),  # 64 splits: 2 rows per program
    (1, 2, 1, 3, 64, 256, torch.bfloat16),  # tile too wide for 2 rows: 1 row per program
    (2, 1, 2, 3, 3, 8, torch.float32),
]


def make_partials(B, Hkv, G, T, NS, D, seed=0):
    """Partials as a split-K attention writes them: m in the log2 domain, l ≥ 1 (the max scores 1),
    about a third of the (split, row) pairs empty (m = −1e30, l = 0, acc = 0), split NS − 1 empty
    for every row (a split past the rows' lengths), and every row with a visible key somewhere."""
    g = torch.Generator().manual_seed(seed)
    TG = G * T
    m = torch.randn(B * Hkv, NS, TG, generator=g) * 8
    l = 1 + 20 * torch.rand(B * Hkv, NS, TG, generator=g)
    acc = torch.randn(B * Hkv, NS, TG, D, generator=g) * l[..., None]
    empty = torch.rand(B * Hkv, NS, TG, generator=g) < 0.35
    if NS > 1:
        empty[:, NS - 1] = True
    empty[:, 0] &= empty[:, 1:].sum(1) < NS - 1  # some split of every row stays visible
    m[empty], l[empty], acc[empty] = -1.0e30, 0.0, 0.0
    return acc, m, l


def merge64(acc, m, l, B, T, Hq):
    """The module docstring's formula in fp64, unpacked to [B, T, Hq, D]."""
    acc, m, l = acc.double(), m.double(), l.double()
    w = torch.exp2(m - m.amax(dim=1, keepdim=True))
    o = (acc * w[..., None]).sum(1) / (l * w).sum(1)[..., None]  # [B·Hkv, G·T, D]
    BH, TG, D = o.shape
    Hkv = BH // B
    return o.view(B, Hkv, T, Hq // Hkv, D).permute(0, 2, 1, 3, 4).reshape(B, T, Hq, D)


def strided_out(B, T, Hq, D, dtype, device):
    """A NaN-filled [B, T, Hq, D] view with free strides (padded heads and head dim) and its buffer."""
    buf = torch.full((B, T + 1, Hq + 3, D + 5), float("nan"), dtype=dtype, device=device)
    return buf[:, 1:, 2 : 2 + Hq, :D], buf


def assert_only_view_written(buf, view):
    rest = torch.ones_like(buf, dtype=torch.bool)
    rest[:, 1:, 2 : 2 + view.shape[2], : view.shape[3]] = False
    assert buf[rest].isnan().all(), "wrote outside out"
    assert not view.isnan().any(), "left elements of out unwritten"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ordered", [False, True], ids=["fast", "ordered"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}Hkv{c[1]}G{c[2]}T{c[3]}NS{c[4]}D{c[5]}{str(c[6])[6:]}")
def test_combine_partials(case, ordered, device):
    B, Hkv, G, T, NS, D, dtype = case
    parts = [x.to(device) for x in make_partials(B, Hkv, G, T, NS, D)]
    ref = merge64(*parts, B, T, G * Hkv)
    own = combine_partials(*parts, torch.empty(B, T, G * Hkv, D, dtype=dtype, device=device), impl="torch",
                           ordered=ordered)
    out, buf = strided_out(B, T, G * Hkv, D, dtype, device)
    combine_partials(*parts, out, ordered=ordered)
    assert_only_view_written(buf, out)
    err = (out.double() - ref).abs().max().item()
    err_torch = (own.double() - ref).abs().max().item()
    assert err <= 2 * err_torch + FLOOR[dtype], f"err {err:.3g} vs torch's own {err_torch:.3g}"


def test_combine_budget_can_fail():
    """Dropping one split's weight (here: the last split's l) breaks the budget."""
    B, Hkv, G, T, NS, D, dtype = CASES[3]
    acc, m, l = make_partials(B, Hkv, G, T, NS, D)
    ref = merge64(acc, m, l, B, T, G * Hkv)
    bad = l.clone()
    bad[:, 2] = 0.0
    out = combine_partials(acc, m, bad, torch.empty(B, T, G * Hkv, D, dtype=dtype), impl="torch")
    own = combine_partials(acc, m, l, torch.empty_like(out), impl="torch")
    assert (out.double() - ref).abs().max() > 2 * (own.double() - ref).abs().max() + FLOOR[dtype]


def test_combine_blocks():
    # (rows per program, BLOCK_S, BLOCK_D, warps); the H200 sweep (results/combine-sweep-h200.json) picked
    # 8 rows and 1 warp at the batch-8 spec shape: 2.4 us a call against 12-14 us at 4 warps
    assert _combine_blocks(3, 64, 128, ordered=False) == (8, 4, 128, 1)
    assert _combine_blocks(3, 4, 128, ordered=False) == (4, 4, 128, 1)  # decode: all 4 rows in one program
    assert _combine_blocks(17, 64, 128, ordered=False) == (1, 32, 128, 1)  # batch-1 spec: 17 splits
    assert _combine_blocks(64, 64, 128, ordered=False) == (1, 64, 128, 2)  # 8192 fp32: two warps
    assert _combine_blocks(64, 64, 128, ordered=True) == (4, 64, 128, 4)  # 4 rows: enough programs at batch 1
    assert _combine_blocks(17, 64, 128, ordered=True) == (4, 32, 128, 4)
    assert _combine_blocks(3, 2, 128, ordered=True) == (2, 4, 128, 4)  # fewer rows than 4
    assert _combine_blocks(1, 20, 80, ordered=False) == (16, 2, 128, 1)


# ----------------------------------------------------------------------------- exact mode


@triton.jit
def _per_row_ordered_kernel(
    Acc, M, L, Out,
    stride_ob, stride_ot, stride_oh,
    Hkv, NS, TG,
    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The ordered combine before it was vectorised over rows (one program per row)."""
    pid = tl.program_id(0)
    bh = pid // TG
    r = pid % TG
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    t = r // G
    g = r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    m_run = -1.0e30
    l_run = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, NS):
        off = (bh * NS + s) * TG + r
        m_s = tl.load(M + off)
        l_s = tl.load(L + off)
        a_s = tl.load(Acc + off * D + d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        beta = tl.exp2(m_s - m_new)
        l_run = l_run * alpha + l_s * beta
        acc = acc * alpha + a_s * beta
        m_run = m_new
    out_ptr = Out + b * stride_ob + t * stride_ot + (kvh * G + g) * stride_oh + d
    tl.store(out_ptr, (acc / l_run).to(Out.dtype.element_ty), mask=d_ok)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}Hkv{c[1]}G{c[2]}T{c[3]}NS{c[4]}D{c[5]}{str(c[6])[6:]}")
def test_ordered_combine_bits_equal_per_row_kernel(case, device):
    B, Hkv, G, T, NS, D, dtype = case
    acc, m, l = (x.to(device) for x in make_partials(B, Hkv, G, T, NS, D, seed=1))
    Hq = G * Hkv
    old = torch.empty(B, T, Hq, D, dtype=dtype, device=device)
    _per_row_ordered_kernel[(B * Hkv * G * T,)](
        acc, m, l, old, old.stride(0), old.stride(1), old.stride(2), Hkv, NS, G * T,
        G=G, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=1, enable_fp_fusion=False,
    )
    new, _ = strided_out(B, T, Hq, D, dtype, device)
    combine_partials(acc, m, l, new, ordered=True)
    assert torch.equal(new.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       old.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
