"""Time every Triton kernel in dspine/ops against its torch reference (CUDA only).

    python benchmarks/kernels/bench_kernels.py --output results/kernels_h200.json [--quick]

Shapes are Qwen3-8B's (Hq 32, Hkv 8, head_dim 128, hidden 4096, vocab 151936, block 16).
Times are medians in microseconds of triton.testing.do_bench (eager: includes the Python launch
overhead whenever the GPU work is shorter) and of do_bench_cudagraph (device time, as the engine
runs them inside CUDA graphs); speedup and GB/s use the graph times. GB/s counts the bytes each
kernel must move at least (its docstring's memory traffic), to read against the H200's ~4.3 TB/s
copy bandwidth. Every path is warmed up (compiled) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.ops.accept import accept_greedy, accept_sample, commit_step  # noqa: E402
from dspine.ops.attn_combine import combine_partials  # noqa: E402
from dspine.ops.draft_attention import draft_attention  # noqa: E402
from dspine.ops.rmsnorm import rms_norm  # noqa: E402
from dspine.ops.rope import qk_norm_rope_cache, rope_tables  # noqa: E402
from dspine.ops.verify_attention import verify_attention  # noqa: E402

HQ, HKV, D, HIDDEN, VOCAB, BS = 32, 8, 128, 4096, 151936, 16
DT = torch.bfloat16


def bench(fn):
    """(eager µs, CUDA-graph µs): medians of do_bench (includes Python launch overhead when the
    GPU work is shorter than it) and of do_bench_cudagraph (device time, as in the engine)."""
    import triton.testing

    fn()  # compile / warm up outside the timing
    torch.cuda.synchronize()
    eager = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    try:
        graph = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception:  # not capturable: report eager only
        graph = float("nan")
    return eager, graph


def case_verify(B, S, T):
    dev = "cuda"
    q = torch.randn(B, T, HQ, D, device=dev, dtype=DT)
    k = torch.randn(B, HKV, S, D, device=dev, dtype=DT)
    v = torch.randn_like(k)
    cache_len = torch.full((B,), S - T, dtype=torch.int32, device=dev)
    nbytes = 2 * B * HKV * S * D * 2 + 2 * q.numel() * 2
    run = lambda impl: (lambda: verify_attention(q, k, v, cache_len, D ** -0.5, impl=impl))
    return f"verify_attention B{B} S{S} T{T}", run, nbytes


def random_partials(BH: int, NS: int, TG: int, D: int, device="cuda"):
    """Split-K partials in attn_combine's layout (acc ``[BH, NS, TG, D]``, m and l ``[BH, NS, TG]``, fp32):
    log2-domain maxima around 0 ± 8, sums 1..21 and accumulators scaled by their sum, as the attention
    kernels leave them (also benchmarks/kernels/tune_attention.py --combine)."""
    pm = 8 * torch.randn(BH, NS, TG, device=device)
    pl = 1 + 20 * torch.rand_like(pm)
    pa = torch.randn(BH, NS, TG, D, device=device) * pl[..., None]
    return pa, pm, pl


def case_combine(B, T, NS):
    """The split-K second pass of verify_attention on its own (NS = 3: batch 8 at 132 SMs)."""
    TG = HQ // HKV * T
    pa, pm, pl = random_partials(B * HKV, NS, TG, D)
    out = torch.empty(B, T, HQ, D, device="cuda", dtype=DT)
    nbytes = B * HKV * TG * (NS * (D + 2) * 4 + D * 2)
    run = lambda impl: (lambda: combine_partials(pa, pm, pl, out, impl=impl))
    return f"combine_partials B{B} T{T} NS{NS}", run, nbytes


def case_draft(B, C, window):
    dev = "cuda"
    q = torch.randn(B, BS, HQ, D, device=dev, dtype=DT)
    kc = torch.randn(B, HKV, C, D, device=dev, dtype=DT)
    vc = torch.randn_like(kc)
    kb, vb, ke, ve = (torch.randn(B, BS, HKV, D, device=dev, dtype=DT) for _ in range(4))
    ctx_len = torch.full((B,), C if window is None else 3 * C + 5, dtype=torch.int32, device=dev)
    seen = C if window is None else window - 1
    nbytes = 2 * B * HKV * (seen + 2 * BS) * D * 2 + 2 * q.numel() * 2
    run = lambda impl: (lambda: draft_attention(q, kc, vc, ctx_len, kb, vb, D ** -0.5, window=window,
                                                causal=window is not None, k_extra=ke, v_extra=ve, impl=impl))
    name = f"draft_attention B{B} ctx{C}" + (f" ring w{window}" if window else " +extra")
    return name, run, nbytes


def case_rms(N, residual):
    x = torch.randn(N, HIDDEN, device="cuda", dtype=DT)
    r = torch.randn_like(x) if residual else None
    w = torch.rand(HIDDEN, device="cuda", dtype=DT)
    nbytes = N * HIDDEN * 2 * (4 if residual else 2)
    run = lambda impl: (lambda: rms_norm(x, w, 1e-6, residual=r, impl=impl))
    return f"rms_norm N{N} H{HIDDEN}" + (" +res" if residual else ""), run, nbytes


def case_rope(N):
    dev = "cuda"
    q = torch.randn(N, HQ, D, device=dev, dtype=DT)
    k, v = torch.randn(N, HKV, D, device=dev, dtype=DT), torch.randn(N, HKV, D, device=dev, dtype=DT)
    qw, kw = torch.rand(D, device=dev, dtype=DT), torch.rand(D, device=dev, dtype=DT)
    cos, sin = rope_tables(D, 40960, 1e6, dev)
    pos = torch.arange(N, device=dev) + 1000
    kc = torch.zeros(8, HKV, 4096, D, device=dev, dtype=DT)
    vc = torch.zeros_like(kc)
    bi = torch.arange(N, device=dev) % 8
    cp = torch.arange(N, device=dev) // 8
    nbytes = 2 * (q.numel() + 2 * k.numel()) * 2
    run = lambda impl: (lambda: qk_norm_rope_cache(q, k, v, qw, kw, 1e-6, cos, sin, pos, kc, vc, bi, cp, impl=impl))
    return f"qk_norm_rope_cache N{N}", run, nbytes


def case_accept_greedy(B):
    K = BS - 1
    d = torch.randint(0, 4, (B, K), device="cuda")
    t = torch.randint(0, 4, (B, K + 1), device="cuda")
    run = lambda impl: (lambda: accept_greedy(d, t, impl=impl))
    return f"accept_greedy B{B} K{K}", run, d.numel() * 8 + t.numel() * 8


def case_accept_sample(B):
    K, V = BS - 1, VOCAB
    pt = torch.softmax(torch.randn(B, K + 1, V, device="cuda"), -1)
    pd = torch.softmax(torch.randn(B, K, V, device="cuda"), -1)
    d = torch.randint(0, V, (B, K), device="cuda")
    u = torch.rand(B, K, device="cuda")
    e = torch.empty(B, V, device="cuda").exponential_()
    run = lambda impl: (lambda: accept_sample(d, pt, pd, u, e, impl=impl))
    return f"accept_sample B{B} K{K} V{V}", run, B * V * 4 * 3


def case_commit(B):
    K1 = BS
    blk = torch.randint(0, 100, (B, K1), device="cuda")
    num = torch.randint(0, K1, (B,), device="cuda", dtype=torch.int32)
    bonus = torch.randint(0, 100, (B,), device="cuda")
    out = torch.zeros(B, 4096, dtype=torch.int64, device="cuda")
    eos = torch.tensor([151643, 151645], device="cuda")

    def run(impl):
        def fn():  # fresh state each call so rows never finish
            olen = torch.zeros(B, dtype=torch.int32, device="cuda")
            mx = torch.full((B,), 4096, dtype=torch.int32, device="cuda")
            done = torch.zeros(B, dtype=torch.bool, device="cuda")
            hist = torch.zeros(B, K1 + 1, dtype=torch.int32, device="cuda")
            commit_step(blk, num, bonus, out, olen, mx, done, eos, hist, impl=impl)
        return fn

    return f"commit_step B{B} (incl. 4 state allocs)", run, B * K1 * 8 * 2


def cases(quick: bool):
    caches = [512, 8192] if quick else [512, 2048, 8192]
    for B in (1, 8):
        for S in caches:
            for T in (1, 16):
                yield case_verify(B, S, T)
    for T in (1, 16):
        yield case_combine(8, T, 3)
    for B in (1, 8):
        for C in caches:
            yield case_draft(B, C, None)
        yield case_draft(B, 2048, 2048)
    for N in (1, 16, 128, 4096):
        for res in (False, True):
            yield case_rms(N, res)
    for N in (16, 128):
        yield case_rope(N)
    for B in (1, 8):
        yield case_accept_greedy(B)
        yield case_accept_sample(B)
        yield case_commit(B)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="fewer cache sizes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU")
    import triton

    rows = []
    print(f"{'case':<42}{'triton us':>10}{'graph us':>10}{'torch us':>10}{'graph us':>10}{'speedup':>9}{'GB/s':>7}")
    for name, run, nbytes in cases(args.quick):
        try:
            t_tri, g_tri = bench(run("triton"))
        except Exception as e:  # report and go on: one broken kernel should not hide the rest
            rows.append(dict(case=name, error=f"{type(e).__name__}: {e}"[:500]))
            print(f"{name:<42} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        try:
            t_ref, g_ref = bench(run("torch"))
        except torch.cuda.OutOfMemoryError:
            t_ref = g_ref = float("nan")
        torch.cuda.empty_cache()
        best_tri = g_tri if g_tri == g_tri else t_tri
        best_ref = g_ref if g_ref == g_ref else t_ref
        gbs = nbytes / (best_tri * 1e-6) / 1e9
        rows.append(dict(case=name, triton_us=t_tri, triton_graph_us=g_tri, torch_us=t_ref,
                         torch_graph_us=g_ref, speedup_graph=best_ref / best_tri, min_bytes=nbytes,
                         triton_gb_s=gbs))
        print(f"{name:<42}{t_tri:>10.1f}{g_tri:>10.1f}{t_ref:>10.1f}{g_ref:>10.1f}"
              f"{best_ref / best_tri:>8.1f}x{gbs:>7.0f}", flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), dtype=str(DT), timer="medians of triton.testing.do_bench (eager) and do_bench_cudagraph (graph)")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
