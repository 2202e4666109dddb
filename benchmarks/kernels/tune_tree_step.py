"""Sweep the launch parameters of the tree step's kernels on the GPU (CUDA-graph device time, µs; issue 16).

    python benchmarks/kernels/tune_tree_step.py --output results/tune-tree-step-h200.json
    python benchmarks/kernels/tune_tree_step.py --tiny       # CPU smoke test (Triton interpreter, host clock)

Three parts, each against the launcher's default (``default_us``) with the result checked against it:

* ``attention``: ``tree_attention`` (and ``verify_attention`` for the chain) at SmolLM2-135M's heads (9 query,
  3 kv, head dim 64; a 600-token context in a 2,176-row cache, as in infer.bench) and Qwen3-8B's (32 / 8 / 128;
  512 in 640, as in bench_engine.py), batch 1 and 8, 16 and 32 query rows: every (BLOCK_M, BLOCK_N,
  num_warps, num_stages) of the grid below, with the default split rule and with splits of 64 and 128
  keys (``num_splits`` = cache rows / chunk).
* ``build``: ``build_tree_triton``'s num_warps at N = 16, 32, 64 (K 15, V 49,152, batch 1 and 8).
* ``candidates``: the per-depth candidates, torch (``dspine.tree.tree_candidates``) against the two Triton
  launches (``dspine.ops.tree_build.candidates_triton``) + torch's log, at V = 49,152 and 151,936.

Used to pick the shape rules of dspine/ops/verify_attention.py and tree_build.py; not part of the test suite.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.kernel_env  # noqa: E402,F401  (TRITON_INTERPRET=1 without CUDA, before the kernel modules)
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops.tree_attention import tree_attention  # noqa: E402
from dspine.ops.tree_build import build_tree_triton, candidates_triton  # noqa: E402
from dspine.ops.verify_attention import verify_attention  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.tree import ancestor_bits, build_tree, tree_candidates  # noqa: E402

HEADS = {"smollm2": (9, 3, 64, 600, 2176), "qwen3-8b": (32, 8, 128, 512, 640)}  # Hq, Hkv, D, context, cache rows
TINY_HEADS = {"tiny": (4, 2, 16, 40, 64)}


def timer(cuda: bool):
    if cuda:
        import triton.testing

        def t(fn):
            fn()
            torch.cuda.synchronize()
            return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")

        return t

    def t(fn):
        fn()
        s = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - s)

    return t


def tree_bits_for(B, T, dev, g):
    q = torch.softmax(3 * torch.randn(B, 15, 64, generator=g), -1)
    tree = build_tree(torch.zeros(B, dtype=torch.long), q, T)
    return ancestor_bits(tree.anc).to(dev)


def attention_call(op, q, k, v, clen, bits):
    """call(blocks=None, splits=None) -> the op's output with that launch plan."""

    def call(blocks=None, splits=None):
        if op == "tree":
            return tree_attention(q, k, v, clen, bits, None, "triton", num_splits=splits, blocks=blocks)
        return verify_attention(q, k, v, clen, None, "triton", num_splits=splits, blocks=blocks)

    return call


def attention(args, cuda, dev, t) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads = HEADS if cuda else TINY_HEADS
    grid = dict(bm=(32, 64, 128), bn=(32, 64), warps=(2, 4, 8), stages=(2, 3), chunk=(None, 64, 128))
    if not cuda:
        grid = dict(bm=(16,), bn=(16,), warps=(4,), stages=(2,), chunk=(None, 16))
    for (name, (Hq, Hkv, D, ctx, S)), B, (op, T) in itertools.product(
            heads.items(), (1, 8) if cuda else (1,), (("verify", 16), ("tree", 16), ("tree", 32))):
        if name == "qwen3-8b" and B == 8:
            continue
        q = torch.randn(B, T, Hq, D, generator=g).to(dev, dtype)
        k = torch.randn(B, Hkv, S, D, generator=g).to(dev, dtype)
        v = torch.randn(B, Hkv, S, D, generator=g).to(dev, dtype)
        clen = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        bits = tree_bits_for(B, T, dev, g)
        call = attention_call(op, q, k, v, clen, bits)
        want = call()
        default = t(call)
        best = (default, "default")
        rows_g = Hq // Hkv * T
        for bm, bn, warps, stages, chunk in itertools.product(*grid.values()):
            if bm > max(32, 1 << (rows_g - 1).bit_length()) or (warps == 8 and bm < 64):
                continue
            splits = None if chunk is None else -(-S // chunk)
            fn = lambda blocks=(bm, bn, warps, stages), splits=splits, call=call: call(blocks, splits)  # noqa: E731
            try:
                got = fn()
                ok = torch.allclose(got.float(), want.float(), atol=2e-2 if cuda else 1e-4, rtol=0)
                us = t(fn)
            except Exception as e:  # out of shared memory, say
                rows.append({"shape": name, "B": B, "op": op, "T": T, "bm": bm, "bn": bn, "warps": warps,
                             "stages": stages, "chunk": chunk, "error": repr(e)[:200]})
                continue
            rows.append({"shape": name, "B": B, "op": op, "T": T, "bm": bm, "bn": bn, "warps": warps, "stages": stages,
                         "chunk": chunk, "us": us, "default_us": default, "ok": ok})
            if ok and us < best[0]:
                best = (us, f"bm{bm} bn{bn} w{warps} s{stages} chunk{chunk}")
        print(f"attention {name} B{B} {op} T{T}: default {default:.2f} us, best {best[0]:.2f} us ({best[1]})", flush=True)
    return rows


def build(args, cuda, dev, t) -> list[dict]:
    rows = []
    K, V = (15, 49152) if cuda else (3, 50)
    g = torch.Generator().manual_seed(1)
    for B, N in itertools.product((1, 8) if cuda else (1,), (16, 32, 64) if cuda else (5, 9)):
        q = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1).to(dev)
        a = torch.arange(B, device=dev)
        want = build_tree_triton(a, q, N)
        case = []
        for w in (1, 2, 4, 8) if cuda else (4,):
            got = build_tree_triton(a, q, N, num_warps=w)
            ok = all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("tokens", "parent", "bits"))
            case.append({"B": B, "N": N, "warps": w, "us": t(lambda q=q, a=a, N=N, w=w: build_tree_triton(
                a, q, N, num_warps=w)), "ok": ok})
        rows += case
        print(f"build B{B} N{N}: " + ", ".join(f"w{r['warps']} {r['us']:.1f}" for r in case), flush=True)
    return rows


def candidates(args, cuda, dev, t) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(2)
    shapes = itertools.product((1, 8), (49152, 151936), (16, 32, 64)) if cuda else [(1, 3000, 9)]
    for B, V, N in shapes:
        K = 15 if cuda else 3
        q = torch.softmax(3 * torch.randn(B, K, V, generator=g), -1).to(dev)
        chain = q.argmax(-1)
        a = torch.zeros(B, dtype=torch.long, device=dev)
        W = min(N - 1, V)
        ref = tree_candidates(a, q, N, chain)
        cand, qv = candidates_triton(q, chain, W)
        ok = torch.equal(cand, ref[0]) and torch.equal(qv.log(), ref[1])
        torch_us = t(lambda a=a, q=q, N=N, chain=chain: tree_candidates(a, q, N, chain))
        fused_us = t(lambda q=q, chain=chain, W=W: candidates_triton(q, chain, W)[1].log())
        rows.append({"B": B, "V": V, "N": N, "torch_us": torch_us, "fused_us": fused_us, "ok": ok})
        print(f"candidates B{B} V{V} N{N}: torch {torch_us:.1f} us, fused {fused_us:.1f} us, equal {ok}", flush=True)
    return rows


@torch.inference_mode()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--parts", default="candidates,build,attention")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    t = timer(cuda)
    res = {**provenance(argv if argv is None else [__file__, *argv]),
           "timer": "do_bench_cudagraph median, us" if cuda else "host clock, us"}
    for part in args.parts.split(","):
        res[part] = {"attention": attention, "build": build, "candidates": candidates}[part](args, cuda, dev, t)
        if args.output:
            atomic_write_json(args.output, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
