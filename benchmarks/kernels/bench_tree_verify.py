"""Tree verification per decode step: the torch walk vs the fused Triton ops (``dspine.ops.tree_verify``).

    python benchmarks/kernels/bench_tree_verify.py --output results/tree-verify-h200.json
    python benchmarks/kernels/bench_tree_verify.py --tiny        # CPU smoke test (Triton interpreter)

What the tree engine's step ran after the target's forward before it called these ops
(``infer/engine.py::Engine._tree_step``): at T > 0 ``dspine.tree.verify_tree`` (a Python loop over the N
nodes, ~15 kernels per node over [B, V]) then ``path_nodes``; at T = 0 ``verify_tree`` with the [B, N, N]
ancestor mask then ``path_nodes`` (the torch side here). The Triton side, which the engine now runs, is
``verify_tree_sample`` (3 launches) or ``verify_tree_greedy`` on the packed ancestor bits (1 launch), both
writing the path. Shapes: B 1 and 8, N 16, 32, 64, K 15, V 49,152 (SmolLM2); trees from
``build_tree`` over random drafts, targets that follow the draft to a per-row degree (paths of every
depth). Times: medians in µs of ``triton.testing.do_bench`` (eager: includes the Python launch overhead)
and ``do_bench_cudagraph`` (replayed as the engine's captured step); on the CPU (``--tiny``) the host
clock, median of 3. ``equal``: the two paths gave the same outputs on these inputs (sampling: may
differ on a near-tie of the fp32 sum, see the op's docstring).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import tests.kernel_env  # noqa: E402,F401  (TRITON_INTERPRET=1 without CUDA, before the kernel modules)
from dspine.io import atomic_write_json  # noqa: E402
from dspine.ops.tree_verify import verify_tree_greedy, verify_tree_sample  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.tree import ancestor_bits, build_tree, path_nodes, verify_tree  # noqa: E402

BS, NS, K, V = (1, 8), (16, 32, 64), 15, 49152
TINY_BS, TINY_NS, TINY_K, TINY_V = (1, 2), (4, 8), 3, 50


def inputs(B, N, K, V, dev, seed=0):
    """A tree of N nodes per row from a random draft and the target after each node."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.softmax(3 * torch.randn(B, K, V, device=dev, generator=g), -1)
    chain = torch.multinomial(q.reshape(B * K, V), 1, generator=g).reshape(B, K)
    tree = build_tree(torch.zeros(B, dtype=torch.long, device=dev), q, N, chain_tokens=chain)
    follow = q[torch.arange(B, device=dev)[:, None], tree.depth.clamp(max=K - 1)]  # the draft one depth on
    mix = torch.rand(B, 1, 1, device=dev, generator=g)
    p = mix * follow + (1 - mix) * torch.softmax(3 * torch.randn(B, N, V, device=dev, generator=g), -1)
    u = torch.rand(B, N, device=dev, generator=g)
    e = torch.empty(B, V, device=dev).exponential_(generator=g)
    return tree, p, q, u, e


def timed(fn, cuda: bool) -> tuple[float, float | None]:
    """(eager µs, CUDA-graph µs or None): medians; on the CPU the host clock (median of 3 after one call)."""
    fn()
    if cuda:
        import triton.testing

        torch.cuda.synchronize()
        eager = 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        graph = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        return eager, graph
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t))
    return sorted(times)[1], None


def pair(B, N, K, V, dev, greedy):
    """(torch step, Triton step) over the same inputs, each returning (last, a, bonus, path)."""
    tree, p, q, u, e = inputs(B, N, K, V, dev)
    kp = min(K, N - 1)
    if greedy:
        ta = p.argmax(-1)
        bits = ancestor_bits(tree.anc)  # made with the tree in the engine (tree attention's masks)

        def ref():
            last, a, bonus = verify_tree(tree, target_argmax=ta)
            return last, a, bonus, path_nodes(tree, last, kp)

        def fused():
            return verify_tree_greedy(tree.tokens, tree.parent, tree.depth, bits, ta, path_depth=kp)
    else:

        def ref():
            last, a, bonus = verify_tree(tree, p_target=p, q=q, u=u, exp_noise=e)
            return last, a, bonus, path_nodes(tree, last, kp)

        def fused():
            return verify_tree_sample(
                tree.tokens, tree.parent, tree.depth, tree.chain, p, q, u, e, path_depth=kp
            )

    return ref, fused, tree


@torch.inference_mode()
def run(args) -> dict:
    cuda = torch.cuda.is_available() and not args.tiny
    dev = "cuda" if cuda else "cpu"
    bs, ns, k, v = (BS, NS, K, V) if cuda else (TINY_BS, TINY_NS, TINY_K, TINY_V)
    cases = [{"B": b, "N": n, "K": k, "V": v} for b in bs for n in ns]
    rows = []
    for c in cases:
        for op in ("sample", "greedy"):
            ref, fused, tree = pair(c["B"], c["N"], k, v, dev, op == "greedy")
            equal = all(torch.equal(x, y) for x, y in zip(ref(), fused()))
            t_ref, g_ref = timed(ref, cuda)
            t_tri, g_tri = timed(fused, cuda)
            row = {
                **c,
                "op": op,
                "torch_us": t_ref,
                "torch_graph_us": g_ref,
                "triton_us": t_tri,
                "triton_graph_us": g_tri,
                "speedup_eager": t_ref / t_tri,
                "speedup_graph": g_ref / g_tri if cuda else None,
                "equal": equal,
                "mean_accepted": float(fused()[1].float().mean()),
                "internal_nodes": float(
                    (tree.parent[:, :, None] == torch.arange(c["N"], device=dev)).any(1).sum(1).float().mean()
                ),
            }
            rows.append(row)
            print(
                f"{op:>6} B={c['B']} N={c['N']:<3} torch {t_ref:9.1f} us"
                + (f" (graph {g_ref:8.1f})" if cuda else "")
                + f"  triton {t_tri:8.1f} us"
                + (f" (graph {g_tri:6.1f})" if cuda else "")
                + f"  equal {equal}",
                flush=True,
            )
    return {
        "backend": dev,
        "cases": cases,
        "rows": rows,
        "timer": "do_bench / do_bench_cudagraph medians (us)" if cuda else "host clock, median of 3 (us)",
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    res = {**provenance(), **run(args)}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.output), res, indent=1, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
