"""Lossless check for sliding-window and hybrid targets (issue 14), tiny random fp32 configs.

    python benchmarks/engine/hybrid_lossless.py --output results/hybrid-h200.json            # on the GPU
    python benchmarks/engine/hybrid_lossless.py --device cpu --num-prompts 2 --max-new-tokens 24 --output /tmp/h.json

Configs (built here, random weights, vocab 256): ``swa`` = Qwen3 with ``sliding_window`` 8 (layer 0 full,
layers 1-3 sliding); ``qwen3_5`` / ``qwen3_next`` (MoE, 4 experts, top 2) = three gated delta-rule layers
+ one gated full-attention layer with partial rotary, norm weights randomised. Reference =
transformers' greedy ``generate`` (fp32, autoregressive) of prompts of 12..60 tokens (longer than the
window). Compared against it, for every config:
* the engine (Triton kernels on the GPU, fla-core's gated delta rule for the linear layers; torch on
  the CPU; CUDA graphs off and on) with an untrained draft and with an oracle draft (reference
  continuation, every 4th position corrupted: long accepts, rollbacks of the KV cache and of the
  recurrent / conv states), batch 1 and 4;
* the reference decoder with the oracle draft.
``ar_fraction_of_floor`` and ``oracle_speedup_tau7`` at a 27B-class hybrid shape are not measured here.
Writes ``lossless`` = [{config, path, compared, identical}] with provenance.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.lossless import install_device_oracle  # noqa: E402
from dspine.checkpoint import save_draft  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.reference import ReferenceDecoder  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from dspine.target import load_target  # noqa: E402
from infer.engine import load_engine  # noqa: E402
from tests.helpers import oracle_reference_decoder, random_draft  # noqa: E402

V = 256


def build(kind: str, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    common = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.1,
                  pad_token_id=0, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False)
    linear = dict(linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4)
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


def hf_greedy(path: Path, prompts, max_new: int, device) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    outs = []
    for p in prompts:
        ids = model.generate(torch.tensor([p], device=device), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, pad_token_id=0)
        outs.append(ids[0, len(p):].tolist())
    return outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (eager, torch kernels)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--work", default="/tmp/dspine-hybrid-lossless")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch sees no CUDA GPU; use --device cpu for a smoke test")
    dev, cuda = torch.device(args.device), args.device == "cuda"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, V, (int(n),), generator=g).tolist()
               for n in torch.randint(12, 61, (args.num_prompts,), generator=g)]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    lossless, runs = [], []
    for kind in ("swa", "qwen3_5", "qwen3_next"):
        t0 = time.perf_counter()
        path = build(kind, work)
        want = hf_greedy(path, prompts, args.max_new_tokens, dev)
        refs = [p + w for p, w in zip(prompts, want)]
        target = load_target(str(path), dtype="fp32", device=dev)
        draft = random_draft(target, block_size=16, mask=1).to(dev)
        dec = oracle_reference_decoder(ReferenceDecoder(target, draft, []), refs, corrupt=0.15)
        got = dec.generate(prompts, params)
        same = sum(a == b for a, b in zip(got.token_ids, want))
        lossless.append({"config": kind, "path": "reference decoder, oracle draft", "compared": len(prompts),
                         "identical": same})
        runs.append({"config": kind, "path": "reference", "tau": got.stats.tau, "identical": same})
        # every config runs in the engine
        ddir = save_draft(draft, work / f"draft-{kind}")
        same_engine, compared = 0, 0
        for graphs in (False, True) if cuda else (False,):
            for draft_kind, batch in (("random", 4), ("oracle", 1), ("oracle", 4)):
                eng, _ = load_engine(str(path), None, str(ddir), device=dev, dtype=torch.float32, max_batch=batch,
                                     max_seq=max(map(len, prompts)) + args.max_new_tokens + 32,
                                     cuda_graphs=graphs, eos_token_ids=[])
                if draft_kind == "oracle":
                    install_device_oracle(eng, refs)
                res = eng.generate(prompts, params, concurrency=batch)
                same = sum(a == b for a, b in zip(res.token_ids, want))
                same_engine, compared = same_engine + same, compared + len(prompts)
                runs.append({"config": kind, "path": "engine", "impl": eng.impl, "cuda_graphs": graphs,
                             "cuda_graphs_used": eng.cuda_graphs,
                             "draft": draft_kind, "batch": batch, "tau": res.stats.tau, "identical": same})
                print(f"{kind} engine graphs={graphs} {draft_kind} batch={batch}: identical {same}/{len(prompts)} "
                      f"tau {res.stats.tau:.2f}", flush=True)
        lossless.append({"config": kind, "path": "engine", "compared": compared, "identical": same_engine})
        print(f"{kind}: reference identical {lossless[-2]['identical']}/{len(prompts)}, engine "
              f"{same_engine}/{compared} ({time.perf_counter() - t0:.0f} s)", flush=True)
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    out = {**provenance(), "gpu": gpu, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "lossless": lossless, "runs": runs, "ar_fraction_of_floor": None, "oracle_speedup_tau7": None,
           "not_measured": "ar_fraction_of_floor / oracle_speedup_tau7 need the 27B-class hybrid benchmark"}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    bad = [x for x in lossless if x["identical"] != x["compared"]]
    print(f"lossless: {lossless}\n{'OK' if not bad else f'DIFFERENT: {bad}'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
