"""verify_attention and draft_attention against an independent fp64 softmax reference.

Error budget: max |out − ref64| ≤ 2 · (error of plain torch attention computed in the same dtype)
+ a small floor. Unused cache rows and the output are NaN-poisoned, so a stale read or an
unwritten element fails the test.
"""

import tests.kernel_env as env  # noqa: I001  (must precede the kernel imports)

import pytest
import torch

from dspine.ops.draft_attention import draft_attention
from dspine.ops.verify_attention import verify_attention

CPU = pytest.param("cpu", marks=pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP)))
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")])
DEVICES = [CPU, CUDA]
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 2e-4}


def attend(q, keys, values, vis, scale):
    """q [B, T, Hq, D]; keys/values [B, Hkv, NK, D]; vis [B, T, NK] -> [B, T, Hq, D], in q's dtype
    arithmetic (fp64 for the reference, bf16/fp32 for torch's own error)."""
    G = q.shape[2] // keys.shape[1]
    k = keys.nan_to_num(0.0).repeat_interleave(G, dim=1)  # poisoned rows are never visible
    v = values.nan_to_num(0.0).repeat_interleave(G, dim=1)
    s = torch.einsum("bthd,bhnd->bthn", q, k) * scale
    s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bthn,bhnd->bthd", p, v)


def check_budget(out, q, keys, values, vis, scale):
    assert not out.isnan().any(), "output has unwritten (NaN) elements"
    ref = attend(q.double(), keys.double(), values.double(), vis, scale)
    own = attend(q, keys, values, vis, scale)  # plain torch at this dtype
    err = (out.double() - ref).abs().max().item()
    err_torch = (own.double() - ref).abs().max().item()
    assert err <= 2 * err_torch + FLOOR[q.dtype], f"err {err:.3g} vs torch's own {err_torch:.3g}"
    return err, err_torch


# ----------------------------------------------------------------------------- verify

VERIFY_CASES = [
    # B, T, Hq, Hkv, D, cache lengths (one per row), dtype
    (5, 16, 4, 1, 64, [1, 17, 123, 431, 2049], torch.bfloat16),
    (5, 1, 8, 1, 128, [1, 17, 123, 431, 2049], torch.float32),
    (3, 16, 8, 1, 8, [0, 17, 431], torch.bfloat16),
    (2, 3, 2, 2, 80, [123, 5], torch.float32),
    (2, 7, 4, 1, 128, [17, 431], torch.bfloat16),
    (1, 16, 8, 1, 64, [300], torch.float32),  # G·T = 128 rows in one tile
    (2, 20, 8, 1, 16, [40, 3], torch.bfloat16),  # G·T = 160: several row blocks
]


def make_verify(B, T, Hq, Hkv, D, lens, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = max(lens) + T + 5
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    cache_len = torch.tensor(lens, dtype=torch.int32)
    j = torch.arange(S)
    unwritten = j[None, :] >= (cache_len[:, None] + T)
    k[unwritten[:, None, :, None].expand_as(k)] = float("nan")  # stale rows must never be read
    v[unwritten[:, None, :, None].expand_as(v)] = float("nan")
    vis = j[None, None, :] <= (cache_len[:, None, None] + torch.arange(T)[None, :, None])  # [B, T, S]
    return [x.to(device) for x in (q, k, v, cache_len)], vis.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: f"B{c[0]}T{c[1]}G{c[2] // c[3]}D{c[4]}{str(c[6])[6:]}")
def test_verify_attention(case, device):
    B, T, Hq, Hkv, D, lens, dtype = case
    (q, k, v, cache_len), vis = make_verify(B, T, Hq, Hkv, D, lens, dtype, device)
    scale = D ** -0.5
    for splits in (None, 1, 3):
        out = torch.full_like(q, float("nan"))
        verify_attention(q, k, v, cache_len, scale, out=out, num_splits=splits)
        check_budget(out, q, k, v, vis, scale)


def test_verify_attention_torch_impl():
    (q, k, v, cache_len), vis = make_verify(3, 16, 8, 2, 64, [0, 17, 123], torch.bfloat16, "cpu")
    check_budget(verify_attention(q, k, v, cache_len, 0.125, impl="torch"), q, k, v, vis, 0.125)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [(3, 16, 4, 2, 16, [0, 9, 70], torch.float32, 8),
                                  (2, 1, 4, 1, 32, [5, 131], torch.bfloat16, 16),
                                  (2, 5, 2, 2, 16, [40, 3], torch.float32, 1)],
                         ids=lambda c: f"T{c[1]}W{c[7]}{str(c[6])[6:]}")
def test_verify_attention_window(case, device):
    """Sliding window: a query at p sees keys p-w+1 .. p (transformers' mask); the kernel (every split
    count) and the torch reference against the fp64 reference, and against each other."""
    B, T, Hq, Hkv, D, lens, dtype, w = case
    (q, k, v, cache_len), vis = make_verify(B, T, Hq, Hkv, D, lens, dtype, device)
    pos = cache_len[:, None, None].long() + torch.arange(T, device=q.device)[None, :, None]
    vis = vis & (torch.arange(k.shape[2], device=q.device)[None, None, :] > pos - w)
    assert not vis.all(dim=-1).any()  # the window cuts every row of these cases
    ref = verify_attention(q, k, v, cache_len, 0.25, impl="torch", window=w)
    check_budget(ref, q, k, v, vis, 0.25)
    for splits in (None, 1, 3):
        out = torch.full_like(q, float("nan"))
        verify_attention(q, k, v, cache_len, 0.25, out=out, num_splits=splits, window=w)
        check_budget(out, q, k, v, vis, 0.25)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="window=0"):
        verify_attention(q, k, v, cache_len, 0.25, window=0)


def test_verify_attention_decode_equals_causal_block():
    """T = 1 decode at length L+t must equal row t of a T-token verify at length L."""
    if not (env.TRITON_CPU or env.HAS_CUDA):
        pytest.skip(str(env.TRITON_CPU_SKIP))
    (q, k, v, cache_len), _ = make_verify(2, 5, 4, 2, 64, [9, 30], torch.float32, "cpu")
    dev = "cpu" if env.INTERPRET else "cuda"
    q, k, v, cache_len = (x.to(dev) for x in (q, k, v, cache_len))
    full = verify_attention(q, k, v, cache_len, 0.125, impl="triton")
    for t in range(5):
        one = verify_attention(q[:, t:t + 1].contiguous(), k, v, cache_len + t, 0.125)
        torch.testing.assert_close(one[:, 0], full[:, t], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- draft

DRAFT_CASES = [
    # B, T, Hq, Hkv, D, ctx lengths, window, C, causal, extra, dtype
    (4, 16, 4, 1, 64, [0, 17, 123, 431], None, 440, False, False, torch.bfloat16),
    (4, 16, 4, 1, 64, [0, 17, 123, 431], None, 440, False, True, torch.float32),
    (3, 16, 8, 1, 8, [1, 17, 123], None, 130, True, True, torch.bfloat16),
    (3, 5, 2, 2, 128, [0, 123, 431], 64, 100, True, False, torch.float32),  # ring, wrapped
    (3, 16, 4, 1, 80, [5, 64, 1000], 64, 64, True, True, torch.bfloat16),  # ring, C == window
    (1, 16, 8, 1, 64, [2049], 2048, 2048, True, False, torch.bfloat16),  # long sliding window
    (2, 3, 1, 1, 16, [0, 7], None, 8, False, True, torch.float32),
]


def make_draft(B, T, Hq, Hkv, D, lens, window, C, causal, extra, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)
    P = max(lens) + 1
    q = rnd(B, T, Hq, D)
    k_pos, v_pos = rnd(B, Hkv, P, D), rnd(B, Hkv, P, D)  # K/V of every context position
    k_blk, v_blk = rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)
    k_ext, v_ext = (rnd(B, T, Hkv, D), rnd(B, T, Hkv, D)) if extra else (None, None)
    if extra:  # row 0 has no extra key; the engine's fused kv path never writes it
        k_ext[:, 0], v_ext[:, 0] = float("nan"), float("nan")
    # the cache as the engine would hold it: NaN where nothing was ever written
    k_ctx = torch.full((B, Hkv, C, D), float("nan"), dtype=dtype)
    v_ctx = torch.full((B, Hkv, C, D), float("nan"), dtype=dtype)
    for b, n in enumerate(lens):
        for j in range(n):  # in order, so a ring slot keeps the latest position
            slot = j % C if window is not None else j
            k_ctx[b, :, slot], v_ctx[b, :, slot] = k_pos[b, :, j], v_pos[b, :, j]
    # reference key list: [context positions 0..P-1, block keys 0..T-1, extra rows 0..T-1]
    t = torch.arange(T)[None, :, None]
    j = torch.arange(P)[None, None, :]
    n = torch.tensor(lens)[:, None, None]
    vis_c = j < n
    if window is not None:
        vis_c = vis_c & ((n + t - j) < window)
    s = torch.arange(T)[None, None, :]
    vis_b = (s <= t) if causal else torch.ones(1, T, T, dtype=torch.bool)
    keys, values = [k_pos, k_blk.transpose(1, 2)], [v_pos, v_blk.transpose(1, 2)]
    vis = [vis_c.expand(B, T, P), vis_b.expand(B, T, T)]
    if extra:
        keys.append(k_ext.transpose(1, 2))
        values.append(v_ext.transpose(1, 2))
        vis.append(((s == t) & (t >= 1)).expand(B, T, T))
    ref_inputs = (torch.cat(keys, 2).to(device), torch.cat(values, 2).to(device), torch.cat(vis, 2).to(device))
    ctx_len = torch.tensor(lens, dtype=torch.int32)
    args = [x.to(device) if x is not None else None for x in (q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, k_ext, v_ext)]
    return args, ref_inputs


def run_draft(args, window, causal, scale, impl="triton", splits=None, out=None):
    q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, k_ext, v_ext = args
    return draft_attention(q, k_ctx, v_ctx, ctx_len, k_blk, v_blk, scale, window=window, causal=causal,
                           k_extra=k_ext, v_extra=v_ext, impl=impl, out=out, num_splits=splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", DRAFT_CASES,
                         ids=lambda c: f"T{c[1]}G{c[2] // c[3]}D{c[4]}w{c[6]}c{int(c[8])}x{int(c[9])}{str(c[10])[6:]}")
def test_draft_attention(case, device):
    B, T, Hq, Hkv, D, lens, window, C, causal, extra, dtype = case
    args, (keys, values, vis) = make_draft(*case, device)
    scale = D ** -0.5
    for splits in (None, 1, 3):
        out = torch.full_like(args[0], float("nan"))
        run_draft(args, window, causal, scale, splits=splits, out=out)
        check_budget(out, args[0], keys, values, vis, scale)


@pytest.mark.parametrize("case", DRAFT_CASES[:5], ids=lambda c: f"w{c[6]}c{int(c[8])}x{int(c[9])}")
def test_draft_attention_torch_impl(case):
    args, (keys, values, vis) = make_draft(*case, "cpu")
    out = run_draft(args, case[6], case[8], 0.2, impl="torch")
    check_budget(out, args[0], keys, values, vis, 0.2)


def test_draft_attention_budget_can_fail():
    """The budget is tight enough to catch a wrong mask (window off by one)."""
    case = DRAFT_CASES[3]
    args, (keys, values, vis) = make_draft(*case, "cpu")
    out = run_draft(args, case[6] + 1, case[8], 0.2, impl="torch")
    with pytest.raises(AssertionError):
        check_budget(out, args[0], keys, values, vis, 0.2)


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")
@pytest.mark.parametrize("T", [1, 16])
def test_verify_attention_qwen3_8b_shapes(T):
    (q, k, v, cache_len), vis = make_verify(2, T, 32, 8, 128, [8100, 777], torch.bfloat16, "cuda")
    check_budget(verify_attention(q, k, v, cache_len, 128 ** -0.5), q, k, v, vis, 128 ** -0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not env.HAS_CUDA, reason="no CUDA")
def test_attention_cuda_graph_replay():
    """Launchers read no device tensor: capture once, change lengths in place, replay."""
    (q, k, v, cache_len), _ = make_verify(2, 16, 8, 2, 128, [300, 1000], torch.bfloat16, "cuda")
    args, _ = make_draft(2, 16, 8, 2, 128, [40, 500], None, 600, False, True, torch.bfloat16, "cuda")
    out_v, out_d = torch.empty_like(q), torch.empty_like(args[0])
    for _ in range(2):  # warm up (compile) outside the capture
        verify_attention(q, k, v, cache_len, 0.1, out=out_v)
        run_draft(args, None, False, 0.1, out=out_d)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_attention(q, k, v, cache_len, 0.1, out=out_v)
        run_draft(args, None, False, 0.1, out=out_d)
    cache_len.copy_(torch.tensor([17, 123], dtype=torch.int32))
    args[3].copy_(torch.tensor([3, 431], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out_v, verify_attention(q, k, v, cache_len, 0.1, impl="torch"), atol=2e-2, rtol=0)
    torch.testing.assert_close(out_d, run_draft(args, None, False, 0.1, impl="torch"), atol=2e-2, rtol=0)


@pytest.mark.skipif(not env.TRITON_CPU, reason=str(env.TRITON_CPU_SKIP))
def test_blocks_override_equals_default_and_is_checked():
    """blocks=(BLOCK_M, BLOCK_N, num_warps, num_stages) (tune_tree_step.py's sweep) gives the default plan's result
    within fp32 rounding; a malformed plan raises a ValueError that names it."""
    from dspine.ops.tree_attention import tree_attention

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, 4, 16, generator=g)
    k, v = torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    clen = torch.tensor([3, 30], dtype=torch.int32)
    bits = torch.tensor([[1, 3, 5, 11, 19]] * 2, dtype=torch.int64)
    want = verify_attention(q, k, v, clen, None, "torch")
    got = verify_attention(q, k, v, clen, None, "triton", blocks=(16, 16, 2, 2), num_splits=3)
    assert torch.allclose(got, want, atol=2e-5)
    want = tree_attention(q, k, v, clen, bits, None, "torch")
    assert torch.allclose(tree_attention(q, k, v, clen, bits, None, "triton", blocks=(32, 16, 4, 1)), want, atol=2e-5)
    for bad in [(8, 16, 4, 2), (16, 16, 3, 2), (16, 16, 4, 0), (16, 16, 4), (16.5, 16, 4, 2), "x"]:
        with pytest.raises(ValueError, match="blocks="):
            verify_attention(q, k, v, clen, None, "triton", blocks=bad)
