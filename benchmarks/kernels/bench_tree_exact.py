"""Exact tree attention (``tree_attention(exact=True)``) against the fast tree attention and the exact chain.

    python benchmarks/kernels/bench_tree_exact.py --output results/tree-exact-h200.json
    python benchmarks/kernels/bench_tree_exact.py --tiny      # CPU smoke test (Triton interpreter)

Per head shape (SmolLM2-135M: 9 query / 3 kv heads of 64; Qwen3-8B: 32 / 8 of 128), batch 1, 8 and 32, a context of
600 committed tokens and trees of 16 and 32 nodes (random parents, depth up to 15 as the engine's block of 16
allows): the median µs of one call as a CUDA-graph replay (``do_bench_cudagraph``, as inside the engine's captured
step) of the fast tree kernel (``exact=False``), the exact one (``exact=True``, paths given: the engine computes
them once per step) and, for reference, ``verify_attention(exact=True)`` over a chain of the same width. ``equal``:
every node of the exact call has the bits of the 1-token exact step of its path (checked on 4 nodes per row).
``--tiny``: small shapes on the CPU (host clock, median of 3).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.kernel_env  # noqa: E402,F401  (TRITON_INTERPRET=1 without CUDA, before the kernel modules)
from benchmarks.kernels.bench_lm_head import us  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops._common import triton  # noqa: E402
from dspine.ops.tree_attention import tree_attention, tree_paths  # noqa: E402
from dspine.ops.verify_attention import verify_attention  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.tree import ancestor_bits, ancestor_mask  # noqa: E402

HEADS = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}
SHAPES = dict(batch=(1, 8, 32), nodes=(16, 32), context=600, depth=15)
TINY = dict(batch=(1, 2), nodes=(6,), context=70, depth=3)


def random_tree(B: int, T: int, max_depth: int, g: torch.Generator) -> torch.Tensor:
    """parent [B, T] int64: node i's parent drawn among the earlier nodes no deeper than ``max_depth`` − 1."""
    parent = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        depth = [0]
        for i in range(1, T):
            ok = [j for j in range(i) if depth[j] < max_depth]
            p = ok[int(torch.randint(0, len(ok), (1,), generator=g))]
            parent[b, i] = p
            depth.append(depth[p] + 1)
    return parent


@torch.inference_mode()
def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.tiny
    dev = "cuda" if cuda else "cpu"
    shapes = SHAPES if cuda else TINY
    g = torch.Generator().manual_seed(0)
    res: dict = {"triton": triton.__version__, "context": shapes["context"], "max_depth": shapes["depth"],
                 "timer": "do_bench_cudagraph median" if cuda else "host clock, median of 3", "rows": []}  # fmt: skip
    for name, (Hq, Hkv, D) in HEADS.items():
        if not cuda:
            Hq, Hkv, D = 4, 2, 16
        for B in shapes["batch"]:
            for T in shapes["nodes"]:
                L = shapes["context"]
                S = L + T + 8
                q = torch.randn(B, T, Hq, D, generator=g).to(dev, torch.bfloat16)
                k = torch.randn(B, Hkv, S, D, generator=g).to(dev, torch.bfloat16)
                v = torch.randn(B, Hkv, S, D, generator=g).to(dev, torch.bfloat16)
                anc = ancestor_mask(random_tree(B, T, shapes["depth"], g))
                bits, depth = ancestor_bits(anc).to(dev), (anc.sum(-1) - 1).to(dev)
                lens = torch.full((B,), L, dtype=torch.int32, device=dev)
                path = tree_paths(bits, depth)
                scale = D**-0.5
                exact = tree_attention(q, k, v, lens, bits, scale, exact=True, depth=depth, path=path)
                equal = True
                for b in range(B):
                    for t in torch.randperm(T, generator=g)[:4].tolist():
                        src = L + path[b, t, : int(depth[b, t]) + 1].long()
                        k1, v1 = k[b : b + 1].clone(), v[b : b + 1].clone()
                        k1[:, :, L : L + len(src)], v1[:, :, L : L + len(src)] = k[b : b + 1, :, src], v[b : b + 1, :, src]
                        one = verify_attention(q[b : b + 1, t : t + 1].contiguous(), k1, v1, lens[b : b + 1] + int(depth[b, t]),
                                               scale, exact=True)  # fmt: skip
                        equal &= torch.equal(one[0, 0].view(torch.int16), exact[b, t].view(torch.int16))
                tree = partial(tree_attention, q, k, v, lens, bits, scale)
                row = {"heads": name, "B": B, "T": T, "equal": bool(equal), "fast_us": us(tree, cuda),
                       "exact_us": us(partial(tree, exact=True, depth=depth, path=path), cuda),
                       "exact_chain_us": us(partial(verify_attention, q, k, v, lens, scale, exact=True), cuda)}  # fmt: skip
                row["exact_over_fast"] = row["exact_us"] / row["fast_us"]
                res["rows"].append(row)
                print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)  # fmt: skip
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = ap.parse_args(argv)
    res = {**provenance(argv if argv is None else [__file__, *argv]), **run(args)}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.output), res, indent=1, allow_nan=True)
    return 0 if all(r["equal"] for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
