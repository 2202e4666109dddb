"""Lossless check for sliding-window and hybrid targets (issue 14), tiny random fp32 configs.

    TRITON_PRINT_AUTOTUNING=1 python benchmarks/engine/hybrid_lossless.py --output results/hybrid-h200.json  # GPU
    python benchmarks/engine/hybrid_lossless.py --device cpu --num-prompts 2 --max-new-tokens 24 --output /tmp/h.json

Configs (built here, random weights, vocab 256; ``--configs`` picks some): ``swa`` = Qwen3 with
``sliding_window`` 8 (layer 0 full, layers 1-3 sliding); ``qwen3_5`` / ``qwen3_next`` (MoE, 4 experts, top
2) = three gated delta-rule layers (2 key / 4 value heads of 16, as in ``tests/test_hybrid_engine.py``) +
one gated full-attention layer with partial rotary, norm weights randomised. Reference = transformers'
greedy ``generate`` (fp32, autoregressive, its own torch code on ``--reference-device``, default the CPU)
of prompts of 12..60 tokens (longer than the window), run through :func:`tests.helpers.call_without_fla`:
with fla-core installed, transformers would bind its gated delta rule to fla's Triton kernels (TF32
products for fp32 inputs, autotuned at first use), and the reference must not share the engine's kernel
library. Compared against it, for every config:
* the engine (Triton kernels on the GPU, fla-core's gated delta rule for the linear layers; torch on
  the CPU; CUDA graphs off and on) with an untrained draft and with an oracle draft (reference
  continuation, every 4th position corrupted: long accepts, rollbacks of the KV cache and of the
  recurrent / conv states), batch 1 and 4;
* the reference decoder with the oracle draft.

Where the time goes: every part (build, reference, reference decoder, first gated delta-rule calls, each
engine load and run) prints a line when it starts and its wall clock when it ends (flushed, so a killed
run shows where it was) and lands in ``timings``. The "gated delta rule (triton)" parts (hybrid configs,
CUDA) time fla-core's first calls before the reference decoder (transformers, bound to fla in this
process) and the engine run, and compare them with the torch reference
(``gated_delta_max_abs_diff_vs_torch``): the chunked kernel at B = 1 for two prompt lengths and at B = 4
for a 16-token verify, then the recurrent kernel. fla's autotune keys hold head counts, head dims, chunk
size and (cumsum only) the batch, never the sequence length T (``do_not_specialize=['T']``): the first
chunked call autotunes every kernel of the chunked forward (about 60 configs on an H200, each compiled),
the second length nothing, a new batch size the 4 cumsum configs. Padding prompt / verify lengths to a
few buckets would therefore save nothing. ``TRITON_PRINT_AUTOTUNING=1`` prints each kernel's autotune
time; Triton's on-disk caches make a second process on the same machine skip the compiles and the
autotuning (same shapes, same ``TRITON_F32_DEFAULT``).

Fixed fla kernel configs: this script sets ``FLA_CACHE_MODE=default`` and ``FLA_CONFIG_DIR`` to
``benchmarks/engine/fla_configs`` (fla-core's own override mechanism; one JSON file per kernel) unless the
environment sets them: the six autotuned kernels of fla's chunked forward then compile one config each
instead of autotuning about 60. The check needs correct kernels, not the fastest ones; for sm_90, ieee,
compiled on a 2-core CPU, the 30 autotune configs of four of them took 452 s, the six fixed ones 11 s
(TF32: 132 s for the 30). A kernel without a file there autotunes as before; speed benchmarks never set
these variables. ``FLA_CACHE_MODE=disabled`` restores autotuning.

fp32 exactness: most of fla's ``tl.dot`` calls take Triton's default precision, TF32 for fp32 inputs; this
script sets ``TRITON_F32_DEFAULT=ieee`` unless the environment sets it (recorded in ``env``). fla's
fused K K^T + triangular-solve kernel asks for TF32 explicitly on TF32 GPUs, so its fp32 path is not
exact fp32 either way (the max deviation from the torch reference is recorded). ieee fp32 dots compile to
FMA loops: for sm_90, compiled on a CPU, 3-7x the compile time of the TF32 form.
``ar_fraction_of_floor`` and ``oracle_speedup_tau7`` at a 27B-class hybrid shape are not measured here
(``bench_hybrid.py``). Writes ``lossless`` = [{config, path, compared, identical}] with provenance after
every finished config (a killed run keeps them; ``complete`` is true only at the end). Exits 1 when an
output differs.
"""

from __future__ import annotations

import os
from pathlib import Path

# before any kernel is compiled and before fla-core is imported (module docstring); the caller's values win
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
os.environ.setdefault("FLA_CACHE_MODE", "default")
os.environ.setdefault("FLA_CONFIG_DIR", str(Path(__file__).resolve().parent / "fla_configs"))

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.lossless import install_device_oracle  # noqa: E402
from dspine.checkpoint import save_draft  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.reference import ReferenceDecoder  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from dspine.target import load_target  # noqa: E402
from infer.engine import load_engine  # noqa: E402
from tests.helpers import HYBRID_TEXT, call_without_fla, oracle_reference_decoder, random_draft  # noqa: E402

V = 256
CONFIGS = ("swa", "qwen3_5", "qwen3_next")


def build(kind: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    common = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.1,
                  pad_token_id=0, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    # the linear layers of tests/test_hybrid_engine.py: the same fla-core kernel shapes, so that pytest after this
    # script on one machine finds the fp32 kernels compiled and autotuned in Triton's cache
    linear = {k: v for k, v in HYBRID_TEXT.items() if k.startswith("linear_")}
    cfg = {"swa": lambda: Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, rope_theta=1e4,
                                      **common),
           "qwen3_5": lambda: Qwen3_5TextConfig(**linear, **common),
           "qwen3_next": lambda: Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                                 shared_expert_intermediate_size=64, **linear, **common)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if kind != "swa":  # zero-centred RMSNorm weights start at 0: randomise them so the engine's fold is checked
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.2)
    model.save_pretrained(out / kind)
    return out / kind


def hf_greedy(path: str, prompts: list[list[int]], max_new: int, device: str) -> list[list[int]]:
    """transformers' greedy continuations (``max_new`` tokens each, fp32, one prompt at a time, no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p], device=device), max_new_tokens=max_new, min_new_tokens=max_new,
                                 do_sample=False, pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


@contextmanager
def part(timings: dict, kind: str, name: str, cuda: bool):
    """Print ``[kind] name`` at the start and its wall clock (s, GPU work included) at the end; record it."""
    print(f"[{kind}] {name} ...", flush=True)
    t0 = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
    timings[name] = round(time.perf_counter() - t0, 2)
    print(f"[{kind}] {name}: {timings[name]:.1f} s", flush=True)


def fla_first_calls(path: Path, dev, impl: str, prompt_lens: list[int], batch: int, width: int, timings: dict,
                    kind: str) -> dict:
    """Time the first calls of the gated delta rule (impl "triton": fla-core; "torch" for the CPU smoke test)
    at the linear-layer shapes of the model in ``path`` (module docstring), fp32, random inputs: chunked at
    B = 1 for the longest and the shortest prompt length, chunked at B = ``batch`` for a ``width``-token
    verify, recurrent at B = ``batch``. Returns {call: max |impl - torch reference|} over outputs and final
    states."""
    from transformers import AutoConfig

    from dspine.ops.gated_delta import gated_delta_rule

    cfg = AutoConfig.from_pretrained(path)
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    gen = torch.Generator().manual_seed(0)
    errs = {}
    for B, T in ((1, max(prompt_lens)), (1, min(prompt_lens)), (batch, width), (batch, 1)):
        x = lambda *s: torch.randn(*s, generator=gen).to(dev)
        args = (x(B, T, Hk, Dk), x(B, T, Hk, Dk), x(B, T, Hv, Dv), -torch.rand(B, T, Hv, generator=gen).to(dev),
                torch.rand(B, T, Hv, generator=gen).to(dev), 0.1 * x(B, Hv, Dk, Dv))
        name = f"gated delta rule ({impl}) {'recurrent' if T == 1 else 'chunked'} B={B} T={T}"
        with part(timings, kind, name, dev.type == "cuda"):
            o, s = gated_delta_rule(*args, impl=impl)
        o_ref, s_ref = gated_delta_rule(*args, impl="torch")
        errs[name] = max((o - o_ref).abs().max().item(), (s - s_ref).abs().max().item())
    return errs


def write(path: Path, out: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (eager, torch kernels)")
    ap.add_argument("--reference-device", default="cpu", help="device of transformers' reference (default cpu)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--work", default="/tmp/dspine-hybrid-lossless")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.configs.split(",") if k.strip()]
    if not kinds or any(k not in CONFIGS for k in kinds) or len(set(kinds)) < len(kinds):
        raise SystemExit(f"error: --configs {args.configs!r}: pick each at most once from {', '.join(CONFIGS)}")
    for name in ("num_prompts", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if "cuda" in (args.device, args.reference_device) and not torch.cuda.is_available():
        raise SystemExit("error: a cuda device was asked for but torch sees no CUDA GPU; use --device cpu for a "
                         "smoke test")
    dev, cuda = torch.device(args.device), args.device == "cuda"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (int(n),), generator=g).tolist()
               for n in torch.randint(12, 61, (args.num_prompts,), generator=g)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    out = {**provenance(), "gpu": torch.cuda.get_device_name() if cuda else "cpu", "configs": kinds,
           "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "reference": f"transformers generate, fp32, {args.reference_device}, without fla-core",
           "env": {k: os.environ.get(k) for k in ("TRITON_F32_DEFAULT", "FLA_CACHE_MODE", "FLA_CONFIG_DIR")},
           "complete": False,
           "lossless": [], "runs": [], "timings": {}, "gated_delta_max_abs_diff_vs_torch": {},
           "ar_fraction_of_floor": None, "oracle_speedup_tau7": None,
           "not_measured": "ar_fraction_of_floor / oracle_speedup_tau7 need the 27B-class hybrid benchmark"}
    lossless, runs = out["lossless"], out["runs"]
    t_start = time.perf_counter()
    for kind in kinds:
        t0, tm = time.perf_counter(), out["timings"].setdefault(kind, {})
        with part(tm, kind, "build", cuda):
            path = build(kind, work)
        with part(tm, kind, f"transformers reference ({args.reference_device}, child without fla-core)", cuda):
            want = call_without_fla("benchmarks.engine.hybrid_lossless:hf_greedy", str(path), prompts,
                                    args.max_new_tokens, args.reference_device)
        refs = [p + w for p, w in zip(prompts, want)]
        if kind != "swa":  # before the reference decoder (transformers + fla here), which would autotune fla
            out["gated_delta_max_abs_diff_vs_torch"][kind] = fla_first_calls(
                path, dev, "triton" if cuda else "torch", [len(p) for p in prompts], 4, 16, tm, kind)
        with part(tm, kind, "reference decoder", cuda):
            target = load_target(str(path), dtype="fp32", device=dev)
            draft = random_draft(target, block_size=16, mask=1).to(dev)
            dec = oracle_reference_decoder(ReferenceDecoder(target, draft, []), refs, corrupt=0.15)
            got = dec.generate(prompts, params)
        same = sum(a == b for a, b in zip(got.token_ids, want))
        lossless.append({"config": kind, "path": "reference decoder, oracle draft", "compared": len(prompts),
                         "identical": same})
        runs.append({"config": kind, "path": "reference", "tau": got.stats.tau, "identical": same})
        ddir = save_draft(draft, work / f"draft-{kind}")
        same_engine, compared = 0, 0
        for graphs in (False, True) if cuda else (False,):
            for draft_kind, batch in (("random", 4), ("oracle", 1), ("oracle", 4)):
                run = f"engine graphs={graphs} {draft_kind} batch={batch}"
                with part(tm, kind, f"{run} load", cuda):
                    eng, _ = load_engine(str(path), None, str(ddir), device=dev, dtype=torch.float32,
                                         max_batch=batch, max_seq=max(map(len, prompts)) + args.max_new_tokens + 32,
                                         cuda_graphs=graphs, eos_token_ids=[])
                if draft_kind == "oracle":
                    install_device_oracle(eng, refs)
                with part(tm, kind, f"{run} generate", cuda):
                    res = eng.generate(prompts, params, concurrency=batch)
                same = sum(a == b for a, b in zip(res.token_ids, want))
                same_engine, compared = same_engine + same, compared + len(prompts)
                runs.append({"config": kind, "path": "engine", "impl": eng.impl, "cuda_graphs": graphs,
                             "cuda_graphs_used": eng.cuda_graphs,
                             "draft": draft_kind, "batch": batch, "tau": res.stats.tau, "identical": same})
                print(f"[{kind}] {run}: identical {same}/{len(prompts)} tau {res.stats.tau:.2f}", flush=True)
        lossless.append({"config": kind, "path": "engine", "compared": compared, "identical": same_engine})
        tm["total"] = round(time.perf_counter() - t0, 2)
        print(f"[{kind}] reference decoder identical {lossless[-2]['identical']}/{len(prompts)}, engine "
              f"{same_engine}/{compared} ({tm['total']:.0f} s)", flush=True)
        write(output, out)  # each finished config is kept if a later one is killed
    out["complete"], out["total_s"] = True, round(time.perf_counter() - t_start, 2)
    write(output, out)
    bad = [x for x in lossless if x["identical"] != x["compared"]]
    print(f"lossless: {lossless}\n{'OK' if not bad else f'DIFFERENT: {bad}'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
