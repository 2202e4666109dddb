"""Engine speed at Qwen3-8B shape with random bf16 weights (the engine issue's benchmark).

    python benchmarks/engine/bench_engine.py --output results/engine-h200.json [--tiny]

Measures, after warm-up, with CUDA events around graph replays:
* the two ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 GEMM;
* ``bandwidth_floor_tok_per_s`` = measured copy bandwidth ÷ weight bytes (AR at batch 1 must
  read every weight once per token; docs/method.md §7);
* ``ar_tok_per_s``: the engine's autoregressive decode, 512-token prompt, 256 new tokens (with
  ``ar_loop_profile``, the decode loop's ``Engine.loop_profile``, ``ar_decode_ms_per_step``, and on CUDA
  ``ar_device_step_ms_in_loop`` / ``ar_device_loop_ms_per_step``: each step of that loop timed on the device,
  and the device's span of the loop, per step: the first against ``ar_step_ms`` says whether steps run slower
  in the loop, the second against ``ar_decode_ms_per_step`` how much of the loop lies outside it);
* ``spec_weight_bytes_over_ar``: the weights a speculative step reads at batch 1 (target without its embedding
  table, draft, the head's rows for ``draft_vocab_size`` tokens) over an AR step's: the bandwidth floor of
  the next figure (``--draft-vocab-size N``: the draft's logits over N rows only, ``dspine.draft_vocab``);
* ``spec_step_over_ar_step``: one speculative step (draft block 16 + verify 16 + accept + commit +
  draft context append) over one AR step, both graph replays;
* ``oracle_speedup_tau7``: a benchmark-only oracle that accepts exactly 6 draft tokens per step
  (τ = 7) against the engine's own AR, end to end over 256 tokens (the median of ``--oracle-reps`` runs; each
  run's tok/s in ``oracle_tok_per_s_runs``; the last block of 256 tokens is cut short, so its τ is 6.89);
* ``fuse_norm`` / ``fuse_act`` / ``fused_rows``: the fusions the run used (``--fuse-norm``, ``--fuse-act``) and the
  step row counts (of 1, 8, 16, 128) at which the target's norms ride in its linear layers
  (``EngineTarget.fuse_norms``). ``--ab-fusion N`` measures what they are worth instead of one run: off (both
  off) and on (``fuse_norm`` auto, ``FUSE_ACT`` on), alternated N times in one process (``ab_fusion``: every run,
  per-variant medians and on ÷ off);
* ``hf_generate_tok_per_s``: transformers ``generate`` on the same weights, same prompt
  (``--skip-peers`` leaves out this and the compiled peer below).
The same numbers at batch 8. At batch 1 only, the stronger peer:
* ``compiled_hf_tok_per_s``: transformers ``generate`` with a static cache, whose decode step
  transformers compiles with ``torch.compile`` (its auto-compile on CUDA, mode "reduce-overhead":
  CUDA graphs), same weights and prompt, greedy. Decode tokens/s like the engine's AR figure:
  (N − n) tokens over t(N) − t(n) for two generations of N and n new tokens (the short one ended
  by a stopping criterion, so both use one cache size and one compiled graph), both after the
  compilation warm-up (excluded; about 45 s at Qwen3-8B shape on the H200). A failed compile
  records ``compiled_hf_error`` instead. ``--compiled-hf-only`` measures this peer alone.
Writes JSON with the command, GPU, date and commit.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.config import DSpineConfig  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.model import DSpineDraftModel  # noqa: E402
from dspine.ops import linear as lin  # noqa: E402
from dspine.paths import output_arg  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine  # noqa: E402
from infer.model import EngineTarget, ModelArgs  # noqa: E402

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
            tie_word_embeddings=False)


FUSE_NORM_CHOICES = ("auto", "on", "off")
FUSE_NORM_HELP = ("the target's RMSNorms folded into its linear layers (infer.model.EngineTarget.fuse_norms): auto "
                  "(where the fast path runs Triton GEMVs), on, off (a separate norm kernel); default: "
                  "DSPINE_FUSE_NORM, else off")
FUSE_ACT_HELP = ("SiLU-mul applied in the down projection's load (dspine.ops.linear.FUSE_ACT): on, off; default: "
                 "DSPINE_FUSE_ACT, else off")


def apply_fusion_args(args, target: EngineTarget) -> dict:
    """Set ``--fuse-norm`` on the target and ``--fuse-act`` on dspine.ops.linear (each where given) and return what
    a step runs: ``fuse_norm``, ``fuse_act`` and ``fused_rows``, the step row counts of (1, 8, 16, 128) at which the
    target's norms are folded (``EngineTarget.fuse_norms``; empty where the mode is off or does not apply)."""
    if args.fuse_norm is not None:
        target.fuse_norm = args.fuse_norm
    if args.fuse_act is not None:
        lin.FUSE_ACT = args.fuse_act == "on"
    return {"fuse_norm": target.fuse_norm, "fuse_act": lin.fuse_act(), "fused_rows": fused_rows(target)}


def fused_rows(target: EngineTarget) -> list[int]:
    """The step row counts of (1, 8, 16, 128) at which the target's norms are folded now (``fuse_norms``)."""
    return [m for m in (1, 8, 16, 128) if target.fuse_norms(m)]


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs (CUDA events; wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return times[len(times) // 2]


def ceilings(dev) -> dict:
    if dev.type != "cuda":
        return {"copy_bw_GBps": None, "bf16_gemm_tflops": None}
    n = 2 * 1024**3  # 4 GiB of bf16: far beyond the 60 MB L2
    bufs = [torch.randn(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)]
    ms = timed(lambda: bufs[1].copy_(bufs[0]), 10)
    bw = 2 * n * 2 / (ms / 1e3) / 1e9
    bufs.clear()
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    ms = timed(lambda: a @ b, 10)
    return {"copy_bw_GBps": bw, "bf16_gemm_tflops": 2 * 8192**3 / (ms / 1e3) / 1e12}


def build(shape: dict, dev, dtype, layers: int, block: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**shape)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in bf16 directly: no 32 GB fp32 copy of the 8B weights
    try:
        with torch.device(dev):
            hf = Qwen3ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    a = ModelArgs.from_hf_config(cfg)
    dcfg = DSpineConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                        num_hidden_layers=layers, num_attention_heads=a.num_heads, num_key_value_heads=a.num_kv_heads,
                        head_dim=a.head_dim, block_size=block, num_target_layers=a.num_layers,
                        max_position_embeddings=a.max_position_embeddings, rope_theta=a.rope_theta,
                        dflash_config={"mask_token_id": a.vocab_size - 1, "target_layer_ids": None})
    with torch.device(dev):
        dm = DSpineDraftModel(dcfg).to(dtype)
    return hf, dm


DRAFT_VOCAB_SIZE_HELP = ("the draft's logits over this many rows of the head (dspine.draft_vocab; a fixed random set; "
                         "0 = the whole vocabulary)")


def random_draft_vocab(vocab_size: int, n: int) -> torch.Tensor | None:
    """``--draft-vocab-size n``: n ids of 0..vocab_size-1 (int64 [n]) from a fixed seed, or None for n = 0 (the
    whole vocabulary). Which ids does not change a step's cost, so every benchmark takes this one set."""
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(2))[:n] if n else None


def check_draft_vocab_size(ap: argparse.ArgumentParser, n: int, vocab_size: int) -> None:
    """argparse error unless ``--draft-vocab-size`` is 0 or in 64..vocab_size."""
    if n and not 64 <= n <= vocab_size:
        ap.error(f"--draft-vocab-size={n}: 0 (the whole vocabulary) or 64..{vocab_size} (the vocabulary)")


def weight_bytes(target: EngineTarget) -> tuple[int, int]:
    total = sum(p.numel() * p.element_size() for p in target.parameters())
    return total, total - target.embed.numel() * target.embed.element_size()


def compiled_hf(hf, prompt: list[int], new_tokens: int, short: int, reps: int) -> dict:
    """Decode tok/s of transformers ``generate`` with a static cache and its compiled decode step, batch 1.

    Returns ``compiled_hf_tok_per_s``, the two generation times (s, median of ``reps``) and whether
    transformers compiled the step; on CUDA a step left uncompiled, or any exception (compile
    errors included), is returned as ``compiled_hf_error`` (type and message) instead of raising."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StopAfter(StoppingCriteria):  # ends the short generation early: both keep one cache size (no recompile)
        def __init__(self, length: int):
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)

    dev = hf.device
    ids = torch.tensor([prompt], device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, cache_implementation="static",
              max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def seconds(n: int) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            out = hf.generate(ids, stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1] + n)]), **kw)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            if out.shape[1] != ids.shape[1] + n:
                raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, asked for {n}")
        return sorted(times)[reps // 2]

    try:
        for _ in range(2):  # compiles (first call) and records the CUDA graphs
            seconds(new_tokens)
        compiled = hasattr(hf, "_compiled_call")  # set by transformers' get_compiled_call
        if dev.type == "cuda" and not compiled:
            raise RuntimeError("transformers did not compile the decode step (its auto-compile criteria failed)")
        t_long, t_short = seconds(new_tokens), seconds(short)
        if t_long <= t_short:
            raise RuntimeError(f"{new_tokens} tokens took {t_long:.3f} s, no longer than {short} tokens: timing noise")
        return {"compiled_hf_tok_per_s": (new_tokens - short) / (t_long - t_short), "compiled_hf_compiled": compiled,
                "compiled_hf_new_tokens": [short, new_tokens], "compiled_hf_generate_s": [t_short, t_long]}
    except Exception as e:  # noqa: BLE001 - the peer is optional: record why it failed, keep the rest
        return {"compiled_hf_tok_per_s": None, "compiled_hf_error": f"{type(e).__name__}: {e}"[:2000]}


@torch.inference_mode()
def measure_batch(args, target, draft, vocab, prompts: list[list[int]], max_seq: int, dev, hf=None) -> dict:
    """One batch size's figures (module docstring): the engine's AR decode, the AR and speculative step replays, the
    τ = 7 oracle end to end (median of ``--oracle-reps``) and, unless ``--skip-peers`` (or no ``hf``), transformers
    ``generate``."""
    B = len(prompts)
    greedy = SamplingParams(max_new_tokens=args.new_tokens)
    row: dict = {}
    eng = Engine(target, draft, [-1], max_batch=B, max_seq=max_seq, max_new_cap=args.new_tokens, draft_vocab=vocab)
    row["pdl_mode"] = eng.pdl_mode  # programmatic dependent launch (dspine.ops._common; DSPINE_PDL)
    # end to end (prefill excluded from tok/s: decode tokens over decode time)
    eng.generate(prompts, SamplingParams(max_new_tokens=min(16, args.new_tokens)), use_draft=False)  # warm-up + capture
    eng.profile_device = True  # device time per step inside the loop (loop_profile: device_step_s, device_loop_s)
    try:
        ar = eng.generate(prompts, greedy, use_draft=False)
    finally:
        eng.profile_device = False
    row["ar_tok_per_s"] = ar.num_tokens / (ar.elapsed_s - ar.prefill_s)
    # where the decode loop's time went (host launch, device wait, host bookkeeping; seconds), against the
    # graph replay timed alone below: the gap between the two is time outside the step
    row["ar_loop_profile"] = {k: v for k, v in eng.loop_profile.items() if isinstance(v, (int, float))}
    n_steps = max(1, eng.loop_profile.get("steps", 1))
    row["ar_decode_ms_per_step"] = 1e3 * (ar.elapsed_s - ar.prefill_s) / n_steps
    if "device_step_s" in eng.loop_profile:  # the same steps timed on the device, and the device's span
        row["ar_device_step_ms_in_loop"] = 1e3 * eng.loop_profile["device_step_s"] / n_steps
        row["ar_device_loop_ms_per_step"] = 1e3 * eng.loop_profile["device_loop_s"] / n_steps
    # per-step graph replays
    ar_step = eng._runner(B, greedy, spec=False)
    spec_step = eng._runner(B, greedy, spec=True)
    row["ar_step_ms"] = timed(ar_step, args.iters)
    row["spec_step_ms"] = timed(spec_step, args.iters)
    row["spec_step_over_ar_step"] = row["spec_step_ms"] / row["ar_step_ms"]
    del eng
    oracle = Engine(target, draft, [-1], max_batch=B, max_seq=max_seq, max_new_cap=args.new_tokens, force_accept=6,
                    draft_vocab=vocab)
    oracle.generate(prompts, SamplingParams(max_new_tokens=min(16, args.new_tokens)))
    # the oracle's decode is short (37 steps of 7 tokens at 256 new tokens: 0.2 s at batch 1), so one run's
    # jitter moved it by 3% between runs of one config (results/engine-draft-vocab-h200.json): median of reps
    runs = [oracle.generate(prompts, greedy) for _ in range(args.oracle_reps)]
    rates = [r.num_tokens / (r.elapsed_s - r.prefill_s) for r in runs]
    row["oracle_tau"] = runs[0].stats.tau  # the same in every run: force_accept fixes the accepted tokens
    row["oracle_tok_per_s"] = statistics.median(rates)  # an even count: the mean of the middle two
    row["oracle_tok_per_s_runs"] = rates
    row["oracle_speedup_tau7"] = row["oracle_tok_per_s"] / row["ar_tok_per_s"]
    row["oracle_speedup_from_steps"] = 7 / row["spec_step_over_ar_step"]
    del oracle
    if not args.skip_peers and hf is not None:  # transformers generate on the same weights
        ids = torch.tensor(prompts, device=dev)
        n_hf = min(args.new_tokens, 32)
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            t = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_hf, min_new_tokens=n_hf,
                        do_sample=False, pad_token_id=0)
            if dev.type == "cuda":
                torch.cuda.synchronize()
        row["hf_generate_tok_per_s"] = B * n_hf / (time.perf_counter() - t)
    return row


def ab_fusion(args, target, draft, vocab, batches: dict, max_seq: int, floor: float | None) -> dict:
    """``--ab-fusion N``: the fusions off (``fuse_norm`` off, ``FUSE_ACT`` off) and on (auto, on: the norms fold only
    at the row counts of each run's ``fused_rows``; SiLU-mul only where the Triton GEMV runs), alternated N times
    in this process over the same target and draft (a fresh engine each time, so each captures its graphs with its
    setting), at each batch size: per variant every run's figures and the medians of the headline ones. One process:
    the 3% between-process spread of the end-to-end oracle (results/engine-draft-vocab-h200.json) stays out of the
    comparison."""
    variants = {"off": ("off", False), "on": ("auto", True)}
    keys = ("ar_tok_per_s", "ar_step_ms", "spec_step_ms", "spec_step_over_ar_step", "oracle_tok_per_s",
            "oracle_speedup_tau7")
    out: dict = {"order": [], "variants": {v: {"fuse_norm": n, "fuse_act": f} for v, (n, f) in variants.items()}}
    runs: dict = {v: {f"batch{B}": [] for B in batches} for v in variants}
    saved = target.fuse_norm, lin.FUSE_ACT
    try:
        for rep in range(args.ab_fusion):
            for v in (variants if rep % 2 == 0 else reversed(list(variants))):  # off, on; then on, off; ...
                target.fuse_norm, lin.FUSE_ACT = variants[v]
                out["order"].append(v)
                for B, prompts in batches.items():
                    row = measure_batch(argparse.Namespace(**{**vars(args), "skip_peers": True}), target, draft,
                                        vocab, prompts, max_seq, target.embed.device)
                    row["fused_rows"] = fused_rows(target)
                    if floor:
                        row["ar_fraction_of_floor"] = row["ar_tok_per_s"] / B / floor
                    runs[v][f"batch{B}"].append(row)
                    print(f"ab {v} rep {rep} batch {B}: " + ", ".join(f"{k}={row[k]:.3f}" for k in keys), flush=True)
                    gc.collect()
    finally:
        target.fuse_norm, lin.FUSE_ACT = saved
    for v in variants:
        out["variants"][v]["runs"] = runs[v]
        for b, rows in runs[v].items():
            out["variants"][v][b] = {k: statistics.median(r[k] for r in rows) for k in (*keys, "ar_fraction_of_floor")
                                     if all(k in r for r in rows)}
    for b in runs["off"]:
        off, on = out["variants"]["off"][b], out["variants"]["on"][b]
        out[f"{b}_on_over_off"] = {k: on[k] / off[k] for k in keys}
    return out


def run(args) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = "triton" if dev.type == "cuda" else "torch"
    shape = TINY if args.tiny else QWEN3_8B
    res: dict = {**provenance(), "shape": "tiny" if args.tiny else "Qwen3-8B", "dtype": str(dtype),
                 "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "block_size": args.block}
    hf, dm = build(shape, dev, dtype, args.draft_layers, args.block)
    a = ModelArgs.from_hf_config(hf.config)
    g = torch.Generator().manual_seed(1)
    prompt1 = torch.randint(0, a.vocab_size - 2, (args.prompt,), generator=g).tolist()
    peer = lambda: compiled_hf(hf, prompt1, args.compiled_new_tokens, 16, args.compiled_reps)
    if args.compiled_hf_only:
        res["batch1"] = peer()
        res["compiled_hf_tok_per_s"] = res["batch1"]["compiled_hf_tok_per_s"]
        return res
    res["ceilings"] = ceilings(dev)
    target = EngineTarget.from_hf_state(a, hf.state_dict(), dev, dtype, dm.config.target_layer_ids, impl)
    res.update(apply_fusion_args(args, target))  # --fuse-norm / --fuse-act (A/B against off)
    draft = dm
    total, no_embed = weight_bytes(target)
    res["weight_bytes"], res["weight_bytes_excl_embedding"] = total, no_embed
    # --draft-vocab-size: the draft's logits over N rows of the head only (dspine.draft_vocab); which N ids does
    # not change the step's cost, so a fixed random set
    V = target.head.shape[0]
    vocab = random_draft_vocab(V, args.draft_vocab_size)
    res["draft_vocab_size"] = args.draft_vocab_size or V
    # weights a speculative step reads at batch 1 over those of an AR step (the floor of spec_step_over_ar_step):
    # the target without its embedding table, plus the draft and the rows of the head it computes
    head_row = target.head[0].numel() * target.head.element_size()
    res["draft_weight_bytes"] = sum(p.numel() * p.element_size() for p in draft.parameters())
    res["head_row_bytes"] = head_row
    res["spec_weight_bytes_over_ar"] = (no_embed + res["draft_weight_bytes"] + res["draft_vocab_size"] * head_row) / no_embed
    bw = res["ceilings"]["copy_bw_GBps"]
    if bw:
        res["bandwidth_floor_tok_per_s"] = bw * 1e9 / total
        res["bandwidth_floor_tok_per_s_excl_embedding"] = bw * 1e9 / no_embed
    max_seq = args.prompt + args.new_tokens + 64
    batches = {B: [prompt1] + [torch.randint(0, a.vocab_size - 2, (args.prompt,), generator=g).tolist()
                               for _ in range(B - 1)] for B in (1, 8)}
    if args.ab_fusion:
        for k in ("fuse_norm", "fuse_act", "fused_rows"):  # each variant records its own
            res.pop(k)
        res["ab_fusion"] = ab_fusion(args, target, draft, vocab, batches, max_seq, res.get("bandwidth_floor_tok_per_s"))
        batches = {}  # the A/B replaces the single run (and the peers)
    for B, prompts in batches.items():
        row = measure_batch(args, target, draft, vocab, prompts, max_seq, dev, hf)
        if bw:
            row["ar_fraction_of_floor"] = row["ar_tok_per_s"] / B / res["bandwidth_floor_tok_per_s"]
        res[f"batch{B}"] = row
        print(f"batch {B}: " + ", ".join(f"{k}={v:.3f}" for k, v in row.items() if isinstance(v, (int, float))), flush=True)
        gc.collect()
    if dev.type == "cuda":
        res["peak_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9
    del target, draft
    gc.collect()
    if "batch1" not in res:  # --ab-fusion: its medians are the result
        return res
    if not args.skip_peers:
        peer_row = peer()  # last: torch.compile's state does not touch the engine's timings
        res["batch1"].update(peer_row)
        print(f"batch 1 compiled transformers: {peer_row}", flush=True)
    # the headline numbers at batch 1
    for k in ("ar_tok_per_s", "spec_step_over_ar_step", "oracle_speedup_tau7", "hf_generate_tok_per_s",
              "compiled_hf_tok_per_s"):
        if k in res["batch1"]:
            res[k] = res["batch1"][k]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file to write (an existing one only with --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--draft-vocab-size", type=int, default=0, help=DRAFT_VOCAB_SIZE_HELP)
    ap.add_argument("--oracle-reps", type=int, default=3, help="end-to-end oracle runs per batch size (median)")
    ap.add_argument("--compiled-hf-only", action="store_true",
                    help="measure only the compiled-transformers peer (batch 1; no engine)")
    ap.add_argument("--compiled-new-tokens", type=int, default=128,
                    help="new tokens of the compiled peer's long generation (the short one has 16)")
    ap.add_argument("--skip-peers", action="store_true",
                    help="engine numbers only: no transformers generate / compiled-transformers peer (their keys are "
                         "left out; about 2 of the ~3 minutes at Qwen3-8B shape)")
    ap.add_argument("--compiled-reps", type=int, default=3, help="timed generations per length (median)")
    ap.add_argument("--fuse-norm", default=None, choices=FUSE_NORM_CHOICES, help=FUSE_NORM_HELP)
    ap.add_argument("--fuse-act", default=None, choices=("on", "off"), help=FUSE_ACT_HELP)
    ap.add_argument("--ab-fusion", type=int, default=0, metavar="N",
                    help="instead of one run: the fusions off and on alternated N times in this process (ab_fusion "
                         "in the JSON: every run and the medians; no peers)")
    args = ap.parse_args(argv)
    if args.ab_fusion < 0:
        ap.error(f"--ab-fusion={args.ab_fusion} must be >= 0")
    if args.ab_fusion and (args.compiled_hf_only or args.fuse_norm or args.fuse_act):
        ap.error("--ab-fusion sets the fusions itself (off, then auto/on): without --fuse-norm, --fuse-act and "
                 "--compiled-hf-only")
    if args.compiled_new_tokens <= 16:
        ap.error(f"--compiled-new-tokens={args.compiled_new_tokens} must exceed the short generation's 16")
    if args.skip_peers and args.compiled_hf_only:
        ap.error("--skip-peers and --compiled-hf-only exclude each other (the second measures only a peer)")
    if args.block < 8:
        ap.error(f"--block={args.block}: the tau = 7 oracle accepts 6 draft tokens a step, so the block needs >= 8 slots")
    check_draft_vocab_size(ap, args.draft_vocab_size, (TINY if args.tiny else QWEN3_8B)["vocab_size"])
    output_arg(ap, args)  # before minutes of measuring: an existing result is not replaced by accident
    if args.oracle_reps < 1:
        ap.error(f"--oracle-reps={args.oracle_reps} must be >= 1")
    if args.new_tokens < 1 or args.prompt < 1:
        ap.error(f"--prompt={args.prompt} and --new-tokens={args.new_tokens} must be >= 1")
    res = run(args)
    text = json.dumps(res, indent=1)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(args.output, res, indent=1, allow_nan=True)  # as printed
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
