"""DSpine step ÷ DFlash step: what the adjacent injection costs inside the engine (issue 12 part 2).

    python benchmarks/engine/bench_draft_step.py --output results/engine-draft-step-h200.json
    python benchmarks/engine/bench_draft_step.py --device cpu --tiny --output /tmp/draft-step.json   # smoke

Random weights, no checkpoint: an engine target of each shape (bf16 on CUDA, fp32 on the CPU) and
two drafts over it that differ only in ``injection`` — DFlash (``none``) and DSpine (``residual``,
the shipped / recipe rank: 128 for SmolLM2, full rank for Qwen3-8B; gates non-zero). Shapes:

* ``smollm2``: target SmolLM2-135M (30 layers, hidden 576, 9/3 heads, head_dim 64, vocab 49152),
  3 draft layers, block 16;
* ``qwen3-8b``: target Qwen3-8B (36 layers, hidden 4096, 32/8 heads, head_dim 128, vocab 151936),
  5 draft layers, block 16.

For each shape and batch size (1, 8), with a ``--context``-token context per row: the whole
speculative step (draft block + verify + accept + commit + context append; one CUDA graph replay
per step) and the draft alone (block forward + lm_head; its own graph). DFlash and DSpine are timed
in the same run, interleaved and in alternating order over ``--reps`` rounds, each round
``--iters`` replays between CUDA events; the first ``--warmup`` rounds are dropped; medians over
the rest. Writes JSON: per shape and batch ``dflash_step_ms``, ``dspine_step_ms``,
``dspine_step_over_dflash_step``, the same three for the draft alone, and at the top level
``dspine_step_over_dflash_step`` = the largest ratio over shapes and batch sizes (the issue's
target is ≤ 1.03). ``--kv`` adds a third draft with ``injection = kv`` (keys ``dspine_kv_*``), the variant that led
the injection study (results/smollm2-variants-h200.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.config import DSpineConfig  # noqa: E402
from dspine.model import DSpineDraftModel  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine  # noqa: E402
from infer.model import EngineTarget, ModelArgs  # noqa: E402

TARGETS = {
    "smollm2": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                    max_position_embeddings=8192, tie_word_embeddings=True, qk_norm=False, qkv_bias=False),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                     max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True, qkv_bias=False),
    "tiny": dict(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                 num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                 max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True, qkv_bias=False),
}
DRAFTS = {"smollm2": dict(layers=3, rank=128), "qwen3-8b": dict(layers=5, rank=0), "tiny": dict(layers=2, rank=8)}


def random_target(a: ModelArgs, layer_ids, dev, dtype, impl) -> EngineTarget:
    """An EngineTarget of shape ``a`` with random weights (norms 1, the rest N(0, 0.02²)), made on ``dev``."""
    with torch.device("meta"):
        t = EngineTarget(a, layer_ids, impl)
    state = {name: torch.ones(p.shape, device=dev, dtype=dtype) if name.endswith("norm")
             else 0.02 * torch.randn(p.shape, device=dev, dtype=dtype)
             for name, p in t.named_parameters()}
    t.load_state_dict(state, assign=True)
    return t


def random_draft(a: ModelArgs, layers: int, injection: str, rank: int, dev, dtype) -> DSpineDraftModel:
    cfg = DSpineConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                       num_hidden_layers=layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                       head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, rope_theta=a.rope_theta, block_size=16,
                       num_target_layers=a.num_layers, max_position_embeddings=a.max_position_embeddings,
                       dflash_config={"mask_token_id": a.vocab_size - 1, "target_layer_ids": None},
                       dspine_config={"injection": injection, "injection_rank": rank})
    torch.manual_seed(0)
    with torch.device(dev):
        draft = DSpineDraftModel(cfg).to(dtype).eval()
    for layer in draft.layers:
        if layer.adjacent is not None and injection == "residual":
            torch.nn.init.normal_(layer.adjacent.gate, std=0.1)  # a trained gate is non-zero
    return draft


def random_setup(device: str, shape: str):
    """The benchmarks' random-weight pair on ``device``: bf16 + Triton on CUDA, fp32 + torch on the CPU; the
    target of ``TARGETS[shape]`` and a DSpine draft (residual injection) of ``DRAFTS[shape]``.
    Returns ``(dev, dtype, impl, ModelArgs, draft spec dict, draft, target)``.
    Raises SystemExit: a CUDA device asked for where torch sees none."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device (use --device cpu --tiny for the smoke run)")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    impl = "triton" if cuda else "torch"
    a = ModelArgs(**TARGETS[shape])
    d = DRAFTS[shape]
    draft = random_draft(a, d["layers"], "residual", d["rank"], dev, dtype)
    target = random_target(a, draft.config.target_layer_ids, dev, dtype, impl)
    return dev, dtype, impl, a, d, draft, target


def graphed(fn, dev):
    """``fn`` as a CUDA graph replay (after two eager warm-up calls on its own stream, which the capture
    uses too); eager on the CPU. The caller keeps alive every tensor ``fn`` reads: the graph holds
    raw addresses only."""
    if dev.type != "cuda":
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    return graph.replay


def ms_per_call(fn, iters: int, dev) -> float:
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e3 / iters


def interleaved(fns: dict, iters: int, reps: int, warmup: int, dev) -> dict:
    """Median ms per call of each fn, timed round-robin in alternating order; warm-up rounds dropped."""
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(warmup + reps):
        for name in names if r % 2 == 0 else names[::-1]:
            ms = ms_per_call(fns[name], iters, dev)
            if r >= warmup:
                times[name].append(ms)
    return {k: statistics.median(v) for k, v in times.items()}


@torch.inference_mode()
def run_shape(shape: str, args, dev, dtype, impl) -> dict:
    a = ModelArgs(**TARGETS[shape])
    d = DRAFTS[shape]
    drafts = {"dflash": random_draft(a, d["layers"], "none", 0, dev, dtype),
              "dspine": random_draft(a, d["layers"], "residual", d["rank"], dev, dtype)}
    if args.kv:  # the kv injection (one extra key/value per query from the previous slot)
        drafts["dspine_kv"] = random_draft(a, d["layers"], "kv", 0, dev, dtype)
    target = random_target(a, drafts["dflash"].config.target_layer_ids, dev, dtype, impl)
    out = {"draft_layers": d["layers"], "dspine_injection_rank": d["rank"]}
    g = torch.Generator().manual_seed(1)
    greedy = SamplingParams(max_new_tokens=16)
    for B in args.batch:
        prompts = [torch.randint(0, a.vocab_size - 2, (args.context,), generator=g).tolist() for _ in range(B)]
        steps, blocks, engines = {}, {}, []
        for name, draft in drafts.items():
            eng = Engine(target, draft, [-1], max_batch=B, max_seq=args.context + 64, max_new_cap=16)
            engines.append(eng)  # a graph replays into its engine's caches: keep every engine alive
            out["pdl_mode"] = eng.pdl_mode  # programmatic dependent launch (dspine.ops._common; DSPINE_PDL)
            eng.generate(prompts, greedy)  # admits the rows (context ≈ args.context), compiles, captures
            steps[name] = eng._runner(B, greedy, spec=True)  # idle rows: the full step's work, state unchanged
            s = eng._slots_for(B)
            if not args.step_only:
                _, dc = eng._cache_view(B)
                blocks[name] = graphed(lambda eng=eng, s=s, dc=dc: eng.draft_logits(s.draft_block, dc), dev)
        step_ms = interleaved(steps, args.iters, args.reps, args.warmup, dev)
        row = {"dflash_step_ms": step_ms["dflash"]}
        for name in (n for n in drafts if n != "dflash"):
            row[f"{name}_step_ms"] = step_ms[name]
            row[f"{name}_step_over_dflash_step"] = step_ms[name] / step_ms["dflash"]
        if blocks:
            draft_ms = interleaved(blocks, args.iters, args.reps, args.warmup, dev)
            row["dflash_draft_ms"] = draft_ms["dflash"]
            for name in (n for n in drafts if n != "dflash"):
                row[f"{name}_draft_ms"] = draft_ms[name]
                row[f"{name}_draft_over_dflash_draft"] = draft_ms[name] / draft_ms["dflash"]
        out[f"batch{B}"] = row
        print(f"{shape} batch {B}: " + ", ".join(f"{k}={v:.4f}" for k, v in row.items()), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="one tiny shape instead of SmolLM2 + Qwen3-8B (CPU smoke test)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=512, help="context tokens per row")
    ap.add_argument("--iters", type=int, default=50, help="replays per timing")
    ap.add_argument("--reps", type=int, default=10, help="timed rounds per variant (alternating order)")
    ap.add_argument("--warmup", type=int, default=2, help="rounds dropped before timing")
    ap.add_argument("--kv", action="store_true",
                    help="also time a DSpine draft with the kv injection (dspine_kv_* keys)")
    ap.add_argument("--step-only", action="store_true",
                    help="time the whole step only (skip the draft-alone graphs)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = "triton" if dev.type == "cuda" else "torch"
    res: dict = {**provenance(), "dtype": str(dtype), "impl": impl, "cuda_graphs": dev.type == "cuda",
                 "context": args.context, "iters": args.iters, "reps": args.reps, "warmup_rounds": args.warmup}
    shapes = ["tiny"] if args.tiny else ["smollm2", "qwen3-8b"]
    res["shapes"] = {shape: run_shape(shape, args, dev, dtype, impl) for shape in shapes}
    for name in ("dspine", "dspine_kv") if args.kv else ("dspine",):
        res[f"{name}_step_over_dflash_step"] = max(r[f"batch{B}"][f"{name}_step_over_dflash_step"]
                                                   for r in res["shapes"].values() for B in args.batch)
    text = json.dumps(res, indent=1)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    print(f"dspine_step_over_dflash_step (max over shapes and batch sizes) = {res['dspine_step_over_dflash_step']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
