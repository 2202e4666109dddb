"""Sweep verify_attention's launch parameters on the GPU (CUDA-graph device time, µs).

    python benchmarks/kernels/tune_attention.py [--output sweep.json] [--combine]

Calls the kernel directly with each (BLOCK_N, num_warps, num_stages, programs-per-SM target) at
Qwen3-8B shapes, checks each result against the default launcher, and prints the best per shape.
``--combine`` sweeps the split-K combine instead (rows per program × num_warps, both modes) at
batch 8's spec and decode shapes and batch 1's spec shape (results/combine-sweep-h200.json: ``rows``
with the command, GPU, date and commit); BLOCK_R = 1 is the former one-row-per-program launch.
Used to pick the defaults in dspine/ops/verify_attention.py and attn_combine.py; not part of the
test suite.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.kernels.bench_kernels import random_partials  # noqa: E402
from dspine.ops import attn_combine as ac  # noqa: E402
from dspine.ops import verify_attention as va  # noqa: E402
from dspine.ops.attn_combine import combine_partials_torch, combine_partials_triton  # noqa: E402


def launch(q, k, v, cache_len, scale, bn, warps, stages, per_sm):
    import triton

    B, T, Hq, D = q.shape
    _, Hkv, S, _ = k.shape
    G = Hq // Hkv
    bm, _, bd, _, _ = va._attn_blocks(D, q.dtype, G * T)
    num_mb = triton.cdiv(G * T, bm)
    base = B * Hkv * num_mb
    target = per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    ns = max(1, min(64, triton.cdiv(S, max(256, bn)), triton.cdiv(target, base)))
    ns, chunk = va._split_plan(base, S, bn, q.device, ns)
    out = torch.empty_like(q)
    pa = torch.empty(B * Hkv, ns, G * T, D, device=q.device, dtype=torch.float32)
    pm = torch.empty(B * Hkv, ns, G * T, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    va._verify_attn_kernel[(base, ns)](
        q, k, v, cache_len, out, pa, pm, pl, scale * va._LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        Hkv, S, T, chunk, ns,
        G=G, D=D, NUM_MB=num_mb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, SPLIT=ns > 1, PREC="tf32",
        WINDOW=0, num_warps=warps, num_stages=stages, PDL=False,
    )
    if ns > 1:
        combine_partials_triton(pa, pm, pl, out)
    return out


def sweep_combine():
    """The combine at Qwen3-8B's engine shapes (D = 128, G = 4): batch 8 (B·Hkv = 64, NS = 3) with G·T = 64
    (spec, T = 16) and 4 (decode); batch 1 (B·Hkv = 8, NS = 17) with G·T = 64 (spec)."""
    import triton.testing

    results = []
    for BH, NS, TG in ((64, 3, 64), (64, 3, 4), (8, 17, 64)):
        G = 4
        pa, pm, pl = random_partials(BH, NS, TG, 128)
        out = torch.empty(BH // 8, TG // G, 32, 128, device="cuda", dtype=torch.bfloat16)
        ref = combine_partials_torch(pa, pm, pl, torch.empty_like(out)).float()
        bench = lambda fn: 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
        for ordered in (False, True):
            default = bench(functools.partial(combine_partials_triton, pa, pm, pl, out, ordered))
            timed = {}
            for br, warps in itertools.product([1, 2, 4, 8, 16, 32], [1, 2, 4, 8]):
                if br > TG or (not ordered and br * triton.next_power_of_2(NS) * 128 > 32768):
                    continue  # rows that do not exist; unordered tiles past 128 fp32 per thread at 8 warps
                try:
                    out.fill_(float("nan"))
                    run = functools.partial(combine_partials_triton, pa, pm, pl, out, ordered, block_r=br,
                                            num_warps=warps)
                    ok = (run().float() - ref).abs().max().item() < 2e-2
                    t = bench(run)
                except Exception as e:  # e.g. out of registers
                    results.append(dict(BH=BH, TG=TG, NS=NS, ordered=ordered, br=br, warps=warps, error=str(e)[:200]))
                    continue
                results.append(dict(BH=BH, TG=TG, NS=NS, ordered=ordered, br=br, warps=warps, us=t, ok=ok))
                if ok:
                    timed[br, warps] = t
            (br, warps), best = min(timed.items(), key=lambda kv: kv[1])
            per_row = timed.get((1, 1 if ordered else 4), float("nan"))  # the former launch's num_warps
            dflt = ac._combine_blocks(NS, TG, 128, ordered)
            print(f"combine B·Hkv={BH} G·T={TG} NS={NS} {'ordered' if ordered else 'fast'}: default {default:.1f} us "
                  f"(BLOCK_R={dflt[0]}, warps={dflt[3]}), one row per program {per_row:.1f} us, "
                  f"best {best:.1f} us at BLOCK_R={br} warps={warps}", flush=True)
            results.append(dict(BH=BH, TG=TG, NS=NS, ordered=ordered, default_us=default, per_row_us=per_row,
                                default_block_r=dflt[0], default_warps=dflt[3]))
    return results


def main():
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default=None)
    ap.add_argument("--combine", action="store_true", help="sweep the split-K combine only")
    args = ap.parse_args()
    if args.combine:
        from dspine.provenance import provenance

        results = {**provenance(), "rows": sweep_combine()}
        if args.output:
            Path(args.output).write_text(json.dumps(results, indent=1))
        return
    shapes = [(1, 8192, 1), (1, 8192, 16), (8, 8192, 1), (8, 8192, 16), (8, 2048, 16), (1, 2048, 16)]
    grid = list(itertools.product([32, 64, 128], [4, 8], [2, 3, 4], [1, 2, 4]))
    results = []
    for B, S, T in shapes:
        q = torch.randn(B, T, 32, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, 8, S, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cl = torch.full((B,), S - T, dtype=torch.int32, device="cuda")
        ref = va.verify_attention(q, k, v, cl, 128 ** -0.5)
        default = 1e3 * triton.testing.do_bench_cudagraph(
            functools.partial(va.verify_attention, q, k, v, cl, 128 ** -0.5), rep=30, return_mode="median")
        best = None
        for bn, warps, stages, per_sm in grid:
            try:
                out = launch(q, k, v, cl, 128 ** -0.5, bn, warps, stages, per_sm)
                ok = (out.float() - ref.float()).abs().max().item() < 2e-2
                fn = functools.partial(launch, q, k, v, cl, 128 ** -0.5, bn, warps, stages, per_sm)
                t = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
            except Exception as e:  # e.g. out of shared memory
                results.append(dict(B=B, S=S, T=T, bn=bn, warps=warps, stages=stages, per_sm=per_sm,
                                    error=str(e)[:200]))
                continue
            results.append(dict(B=B, S=S, T=T, bn=bn, warps=warps, stages=stages, per_sm=per_sm, us=t, ok=ok))
            if ok and (best is None or t < best[0]):
                best = (t, bn, warps, stages, per_sm)
        print(f"B{B} S{S} T{T}: default {default:.1f} us; best {best[0]:.1f} us at "
              f"BLOCK_N={best[1]} warps={best[2]} stages={best[3]} programs/SM={best[4]}", flush=True)
        results.append(dict(B=B, S=S, T=T, default_us=default, best=best))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
