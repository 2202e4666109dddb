"""Exact-mode kernels against the fast path at Qwen3-8B shapes (issue 13): the row-invariant GEMM
``dspine.ops.linear`` over candidate tile configurations vs cuBLAS, and ``verify_attention``
exact vs fast.

    python benchmarks/kernels/bench_linear.py --output results/exact-kernels-h200.json
    python benchmarks/kernels/bench_linear.py --cross --output results/exact-kernels-cross-h200.json
    python benchmarks/kernels/bench_linear.py --tiny        # CPU smoke test (Triton interpreter)

For each configuration (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), each weight of a Qwen3-8B
layer (qkv 6144×4096, o 4096×4096, gate_up 24576×4096, down 4096×12288) and the lm_head
(151936×4096), and M = 1, 8, 16, 128 rows (AR bs1, AR bs8, verify bs1, verify bs8): the CUDA-graph
time (``triton.testing.do_bench_cudagraph``, median, µs) of the kernel and of ``F.linear``, and a
row-invariance check (each row of the M-row result equals the same row computed alone, bitwise).
``per_token_step`` sums 36 layers + lm_head per M: the GEMM time of one target forward, exact ÷
cuBLAS. The best configuration (lowest worst ratio over M) is printed; set it as
``dspine.ops.linear.config``'s choice (or try it end to end with bench_exact.py --linear-config).
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
from dspine.ops import linear as lin  # noqa: E402
from dspine.ops.verify_attention import verify_attention  # noqa: E402
from dspine.provenance import provenance  # noqa: E402

SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
PER_STEP = {"qkv": 36, "o": 36, "gate_up": 36, "down": 36, "lm_head": 1}
MS = (1, 8, 16, 128)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, split]): split > 1 sums K in that many chunks
# (spread over programs up to M = SPLIT_PROGRAMS_MAX_M, else in one program: timed both ways)
CONFIGS = [
    (64, 32, 128, 4, 3),
    (64, 64, 128, 4, 3),
    (64, 32, 256, 4, 3),
    (64, 32, 128, 4, 5),
    (64, 64, 128, 4, 4),
    (64, 32, 256, 4, 4),
    (64, 64, 64, 4, 6),
    (64, 128, 64, 4, 4),
    (64, 64, 256, 8, 3),
    (64, 128, 128, 8, 3),
    (16, 64, 128, 4, 4),
    (16, 32, 256, 4, 4),
    (64, 32, 128, 4, 4, 2),
    (64, 32, 128, 4, 4, 4),
    (64, 64, 128, 4, 4, 2),
    (64, 64, 128, 4, 4, 4),
    (64, 32, 256, 4, 3, 4),
    (64, 64, 256, 4, 3, 2),
    (16, 64, 128, 4, 4, 4),
    (16, 32, 256, 4, 4, 2),
]
# --cross: tile configurations (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), 16-, 64- and 128-row tiles,
# each run with every split of CROSS_SPLITS; their outputs compared bitwise within a split
CROSS_TILES = [
    (16, 64, 128, 4, 4),
    (16, 32, 256, 4, 4),
    (16, 64, 64, 4, 6),
    (64, 64, 128, 4, 4),
    (64, 64, 256, 4, 3),
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 64, 128, 8, 3),
    (128, 128, 128, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 3),
]
CROSS_SPLITS = (1, 4)
TINY_CROSS_TILES = [(16, 32, 64, 4, 2), (64, 32, 32, 4, 2)]
TINY_SHAPES = {"a": (96, 300)}
TINY_MS = (1, 3, 16)
TINY_CONFIGS = [(64, 32, 128, 4, 3), (16, 32, 64, 4, 2, 3)]


def us(fn, cuda: bool) -> float:
    """Median µs: CUDA-graph replays on the GPU, wall clock of one call on the CPU."""
    fn()
    if cuda:
        import triton.testing

        torch.cuda.synchronize()
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median")
    t = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - t)


@torch.inference_mode()
def run(args) -> dict:
    cuda = torch.cuda.is_available()  # --tiny on a GPU machine: the tiny shapes on the GPU (compiled kernels)
    dev = "cuda" if cuda else "cpu"
    shapes, ms, configs = (
        (TINY_SHAPES, TINY_MS, TINY_CONFIGS) if args.tiny or not cuda else (SHAPES, MS, CONFIGS)
    )
    g = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"linear": [], "per_token_step": {}, "attention": []}
    cublas: dict = {}
    for name, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).bfloat16()
        x = torch.randn(max(ms), K, device=dev, generator=g).bfloat16()
        for m in ms:
            cublas[(name, m)] = us(lambda m=m, x=x, w=w: torch.nn.functional.linear(x[:m], w), cuda)
        for cfg in configs:
            try:
                full = lin.linear_triton(x, w, cfg=cfg)
                split = len(cfg) == 6 and cfg[5] > 1
                # rows do not depend on M, and the two ways of running a split (K chunks over programs or
                # in one program) give the same bits
                invariant = all(
                    torch.equal(lin.linear_triton(x[:m], w, cfg=cfg, split_programs=sp), full[:m])
                    for m in ms
                    for sp in ((False, True) if split else (None,))
                ) and all(
                    torch.equal(lin.linear_triton(x[r : r + 1], w, cfg=cfg)[0], full[r])
                    for r in (0, max(ms) - 1)
                )
                for m in ms:
                    t = {
                        sp: us(
                            lambda m=m, x=x, w=w, cfg=cfg, sp=sp: lin.linear_triton(
                                x[:m], w, cfg=cfg, split_programs=sp
                            ),
                            cuda,
                        )
                        for sp in ((False, True) if split else (False,))
                    }
                    best = min(t, key=t.get)
                    res["linear"].append(
                        {
                            "weight": name,
                            "N": N,
                            "K": K,
                            "M": m,
                            "config": list(cfg),
                            "us": t[best],
                            "split_programs": best,
                            "us_by_split_programs": {str(k): v for k, v in t.items()},
                            "cublas_us": cublas[(name, m)],
                            "ratio": t[best] / cublas[(name, m)],
                            "row_invariant": invariant,
                        }
                    )
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record and go on
                res["linear"].append(
                    {"weight": name, "config": list(cfg), "error": f"{type(e).__name__}: {e}"[:300]}
                )
        ok_rows = [r for r in res["linear"] if r["weight"] == name and "us" in r and r["row_invariant"]]
        if ok_rows:  # this weight's best configuration: lowest worst ratio over M
            cands = {tuple(r["config"]) for r in ok_rows}
            worst = {
                c: max(r["ratio"] for r in ok_rows if tuple(r["config"]) == c)
                for c in cands
                if sum(tuple(r["config"]) == c for r in ok_rows) == len(ms)
            }
            if worst:
                c = min(worst, key=worst.get)
                res.setdefault("best_by_weight", {})[name] = {
                    "config": list(c),
                    "worst_ratio": worst[c],
                    "by_m": {
                        f"M{r['M']}": {"ratio": r["ratio"], "split_programs": r["split_programs"]}
                        for r in ok_rows
                        if tuple(r["config"]) == c
                    },
                }
                print(
                    f"{name} {N}x{K}: best {c} worst ratio {worst[c]:.3f} "
                    + " ".join(
                        f"M{r['M']}:{r['ratio']:.3f}{'s' if r['split_programs'] else ''}"
                        for r in ok_rows
                        if tuple(r["config"]) == c
                    ),
                    flush=True,
                )
    for cfg in configs:
        rows = [r for r in res["linear"] if r["config"] == list(cfg) and "us" in r]
        if len(rows) != len(shapes) * len(ms):
            continue
        key = ",".join(map(str, cfg))
        res["per_token_step"][key] = {}
        for m in ms:
            ex = sum(PER_STEP.get(r["weight"], 1) * r["us"] for r in rows if r["M"] == m)
            cb = sum(PER_STEP.get(r["weight"], 1) * r["cublas_us"] for r in rows if r["M"] == m)
            res["per_token_step"][key][f"M{m}"] = {"exact_us": ex, "cublas_us": cb, "ratio": ex / cb}
        ok = all(r["row_invariant"] for r in rows)
        worst = max(v["ratio"] for v in res["per_token_step"][key].values())
        res["per_token_step"][key]["row_invariant"], res["per_token_step"][key]["worst_ratio"] = ok, worst
        print(
            f"config {key:>18}: "
            + "  ".join(f"M{m} {res['per_token_step'][key][f'M{m}']['ratio']:.3f}" for m in ms)
            + f"  invariant={ok}",
            flush=True,
        )
    if len(res.get("best_by_weight", {})) == len(shapes):  # every weight on its own best configuration
        res["per_token_step_best_by_weight"] = {}
        for m in ms:
            ex = cb = 0.0
            for name, b in res["best_by_weight"].items():
                r = next(
                    r
                    for r in res["linear"]
                    if r["weight"] == name and r.get("M") == m and r["config"] == b["config"]
                )
                ex += PER_STEP.get(name, 1) * r["us"]
                cb += PER_STEP.get(name, 1) * r["cublas_us"]
            res["per_token_step_best_by_weight"][f"M{m}"] = {
                "exact_us": ex,
                "cublas_us": cb,
                "ratio": ex / cb,
            }
        print(
            "per-weight best: "
            + "  ".join(f"{k} {v['ratio']:.3f}" for k, v in res["per_token_step_best_by_weight"].items())
        )
    good = {k: v for k, v in res["per_token_step"].items() if v["row_invariant"]}
    if good:
        res["best_config"] = min(good, key=lambda k: good[k]["worst_ratio"])
        print(
            f"best (lowest worst ratio over M): {res['best_config']}  {good[res['best_config']]['worst_ratio']:.3f}"
        )
    # attention: exact vs fast, Qwen3-8B heads
    big = cuda and not args.tiny
    B_T = ((1, 1), (1, 16), (8, 1), (8, 16)) if big else ((1, 1), (2, 4))
    Hkv, G, D, S = (8, 4, 128, args.ctx) if big else (2, 2, 32, 300)
    for B, T in B_T:
        q = torch.randn(B, T, Hkv * G, D, device=dev, generator=g).bfloat16()
        k = torch.randn(B, Hkv, S + 64, D, device=dev, generator=g).bfloat16()
        v = torch.randn(B, Hkv, S + 64, D, device=dev, generator=g).bfloat16()
        lens = torch.full((B,), S - T, dtype=torch.int32, device=dev)
        t = {
            mode: us(
                lambda e=mode == "exact", q=q, k=k, v=v, lens=lens: verify_attention(
                    q, k, v, lens, D**-0.5, exact=e
                ),
                cuda,
            )
            for mode in ("fast", "exact")
        }
        res["attention"].append(
            {
                "B": B,
                "T": T,
                "S": S,
                "fast_us": t["fast"],
                "exact_us": t["exact"],
                "ratio": t["exact"] / t["fast"],
            }
        )
        print(
            f"verify_attention B{B} T{T} S{S}: fast {t['fast']:.1f} us, exact {t['exact']:.1f} us "
            f"({t['exact'] / t['fast']:.2f}x)",
            flush=True,
        )
    return res


@torch.inference_mode()
def cross(args) -> dict:
    """Tile configurations against each other: bitwise equal outputs within a split (the tiles change
    only where the sums run), and the time of each at each M, K chunks over programs and not."""
    cuda = torch.cuda.is_available()  # --tiny on a GPU machine: the tiny shapes on the GPU (compiled kernels)
    dev = "cuda" if cuda else "cpu"
    shapes, ms, tiles = (
        (TINY_SHAPES, TINY_MS, TINY_CROSS_TILES) if args.tiny or not cuda else (SHAPES, MS, CROSS_TILES)
    )
    g = torch.Generator(device=dev).manual_seed(0)
    rows, summary = [], {}
    for name, (N, K) in shapes.items():
        w = (torch.randn(N, K, device=dev, generator=g) / K**0.5).bfloat16()
        x = torch.randn(max(ms), K, device=dev, generator=g).bfloat16()
        cub = {m: us(lambda m=m, x=x, w=w: torch.nn.functional.linear(x[:m], w), cuda) for m in ms}
        for split in CROSS_SPLITS:
            ref = None
            for tile in tiles:
                cfg = (*tile, split)
                try:
                    full = lin.linear_triton(x, w, cfg=cfg, split_programs=False)
                    ref = full if ref is None else ref
                    equal = torch.equal(full, ref) and all(
                        torch.equal(lin.linear_triton(x[:m], w, cfg=cfg, split_programs=True), ref[:m])
                        for m in ms
                    )
                    t = {
                        f"M{m}/{sp}": us(
                            lambda m=m, sp=sp, x=x, w=w, cfg=cfg: lin.linear_triton(
                                x[:m], w, cfg=cfg, split_programs=sp
                            ),
                            cuda,
                        )
                        for m in ms
                        for sp in ((False, True) if split > 1 else (False,))
                    }
                    rows.append(
                        {
                            "weight": name,
                            "N": N,
                            "K": K,
                            "split": split,
                            "tile": list(tile),
                            "bits_equal_to_first_tile": equal,
                            "us": t,
                        }
                    )
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: record and go on
                    rows.append(
                        {
                            "weight": name,
                            "split": split,
                            "tile": list(tile),
                            "error": f"{type(e).__name__}: {e}"[:300],
                        }
                    )
            ok = [r for r in rows if r["weight"] == name and r["split"] == split and "us" in r]
            best = {}
            if not ok:  # every tile of this split failed (errors recorded in rows)
                summary[f"{name}/split{split}"] = {"all_bits_equal": False, "tiles_run": 0, "best_by_m": {}}
                print(f"{name}/split{split}: no tile ran", flush=True)
                continue
            for m in ms:
                k, r = min(
                    ((k, r) for r in ok for k in r["us"] if k.startswith(f"M{m}/")),
                    key=lambda kr: kr[1]["us"][kr[0]],
                )
                best[f"M{m}"] = {
                    "tile": r["tile"],
                    "split_programs": k.endswith("True"),
                    "us": r["us"][k],
                    "cublas_us": cub[m],
                    "ratio": r["us"][k] / cub[m],
                }
            key = f"{name}/split{split}"
            extra = {}
            if (
                split == 1 and ok
            ):  # cuBLAS against the one-pass kernel at every M up to 2 x max(ms): same bits?
                x2 = torch.randn(2 * max(ms), K, device=dev, generator=g).bfloat16()
                ref2 = lin.linear_triton(x2, w, cfg=(*ok[0]["tile"], 1), split_programs=False)
                agree = [
                    m
                    for m in range(1, x2.shape[0] + 1)
                    if torch.equal(torch.nn.functional.linear(x2[:m], w), ref2[:m])
                ]
                extra["cublas_agrees_m"] = ranges(agree)
            summary[key] = {
                **extra,
                "all_bits_equal": all(r["bits_equal_to_first_tile"] for r in ok),
                "tiles_run": len(ok),
                "best_by_m": best,
            }
            print(
                f"{key:>18}: equal={summary[key]['all_bits_equal']} ({len(ok)} tiles) "
                + "  ".join(
                    f"{m} {b['ratio']:.3f} {tuple(b['tile'])}{'s' if b['split_programs'] else ''}"
                    for m, b in best.items()
                ),
                flush=True,
            )
    return {"cross": rows, "cross_summary": summary, "tuned": tuned_file(rows, summary, ms)}


def ranges(ms: list[int]) -> list[list[int]]:
    """Sorted integers as inclusive [lo, hi] runs: [1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    out: list[list[int]] = []
    for m in sorted(ms):
        if out and m == out[-1][1] + 1:
            out[-1][1] = m
        else:
            out.append([m, m])
    return out


def tuned_file(rows: list[dict], summary: dict, ms) -> dict:
    """dspine.ops.linear's tuned-tile file from a --cross run: 16-row-and-wider tiles mixed by M only if
    every tile gave the same bits as the others in every split; per weight, the split whose best tiles
    have the lowest worst time ratio to cuBLAS over M, counting cuBLAS itself at the large M where it
    gave the one-pass kernel's bits (``cublas_m``, split 1)."""
    mixed = bool(summary) and all(v["all_bits_equal"] for v in summary.values())
    small_ms = [m for m in ms if m <= lin.SMALL_M]
    large_ms = [m for m in ms if m > lin.SMALL_M]
    weights = {}
    for name in dict.fromkeys(r["weight"] for r in rows):
        choices = []
        for split in CROSS_SPLITS:
            ok = [r for r in rows if r["weight"] == name and r["split"] == split and "us" in r]
            if not ok:
                continue
            cub = {m: summary[f"{name}/split{split}"]["best_by_m"][f"M{m}"]["cublas_us"] for m in ms}

            def best(
                group, ok=ok, cub=cub
            ):  # the tile, and chunks over programs, with the lowest worst ratio
                opts = []
                for r in ok:
                    for sp in (False, True):
                        keys = [f"M{m}/{sp}" for m in group]
                        if all(k in r["us"] for k in keys):
                            opts.append((max(r["us"][f"M{m}/{sp}"] / cub[m] for m in group), r["tile"], sp))
                return min(opts)

            # split 1: where cuBLAS gave the kernel's bits (every large M of the sweep), the exact path runs
            # cuBLAS there, at cuBLAS's time (ratio 1)
            agree = summary[f"{name}/split{split}"].get("cublas_agrees_m", []) if split == 1 else []
            cub_large = bool(large_ms) and all(lin.in_ranges(m, agree) for m in large_ms)
            if mixed and small_ms and large_ms:
                s_, l_ = best(small_ms), best(large_ms)
                if cub_large and l_[0] > 1.0:
                    l_ = (1.0, l_[1], l_[2])
                choices.append((max(s_[0], l_[0]), split, s_, l_, agree))
            else:
                a = best(list(ms))
                if cub_large and small_ms:
                    s_ = best(small_ms)
                    a = (max(s_[0], 1.0), a[1], a[2]) if s_[0] <= a[0] else a
                choices.append((a[0], split, a, a, agree))
        if choices:
            worst, split, s_, l_, agree = min(choices, key=lambda c: c[0])
            r0 = next(r for r in rows if r["weight"] == name and "N" in r)
            # the chosen small tile's mean time over cuBLAS's at M <= SMALL_M: < 1 puts the fast path on it
            ok = [
                r
                for r in rows
                if r["weight"] == name and r["split"] == split and "us" in r and r["tile"] == s_[1]
            ]
            cub = summary[f"{name}/split{split}"]["best_by_m"]
            small_ratio = (
                (
                    sum(ok[0]["us"][f"M{m}/{s_[2]}"] / cub[f"M{m}"]["cublas_us"] for m in small_ms)
                    / len(small_ms)
                )
                if ok and small_ms
                else None
            )
            weights[f"{r0['N']},{r0['K']}"] = {
                "split": split,
                "small": s_[1],
                "large": l_[1],
                "programs": {"small": s_[2], "large": l_[2]},
                "worst_ratio_to_cublas": worst,
                "weight": name,
            }
            if small_ratio is not None:
                weights[f"{r0['N']},{r0['K']}"]["small_ratio_to_cublas"] = small_ratio
            if agree:
                weights[f"{r0['N']},{r0['K']}"]["cublas_m"] = agree
    return {"mixed_row_tiles": mixed, "weights": weights, "versions": lin.versions()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--ctx", type=int, default=1024, help="attention: cache positions before the new tokens")
    ap.add_argument(
        "--cross", action="store_true", help="tile configurations against each other (bitwise, time)"
    )
    ap.add_argument(
        "--write-tuned",
        default=None,
        metavar="FILE",
        help="--cross: write the tuned-tile file (dspine/ops/tuned/linear-<GPU>.json) here",
    )
    args = ap.parse_args(argv)
    if args.write_tuned and not args.cross:
        ap.error("--write-tuned needs --cross")
    res = {**provenance(), **(cross(args) if args.cross else run(args))}
    if args.write_tuned:
        Path(args.write_tuned).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            Path(args.write_tuned),
            {
                "source": "benchmarks/kernels/bench_linear.py --cross",
                **{k: res[k] for k in ("gpu", "date", "commit") if k in res},
                **res["tuned"],
            },
            indent=1,
        )
        print(f"wrote {args.write_tuned}: mixed_row_tiles={res['tuned']['mixed_row_tiles']}")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(Path(args.output), res, indent=1, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
