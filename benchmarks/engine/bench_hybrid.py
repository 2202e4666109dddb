"""Engine speed at a 27B-class hybrid (``qwen3_5_text``) layout with random bf16 weights (issue 14).

    python benchmarks/engine/bench_hybrid.py --output results/hybrid-bench-h200.json        # H200
    python benchmarks/engine/bench_hybrid.py --tiny --output /tmp/hb.json                  # CPU smoke test

Layout (``LAYOUT_27B``, our scaling of the Qwen3.5 text layout to about 27B parameters): 64 layers,
every 4th a gated full-attention layer (24 heads, 4 KV heads, head_dim 256, partial rotary 0.25), the
others gated delta-rule layers (16 key heads, 48 value heads, head dims 128, conv 4), hidden 5120,
SwiGLU 17408, vocab 248320, untied. Draft: an untrained 5-layer DSpine draft (hidden 5120, 32 / 8
heads, block 16; docs/method.md §3).

Measures at batch 1, after warm-up (CUDA graphs when they capture, else eager; recorded):
* ``ar_tok_per_s``: autoregressive decode tokens / decode seconds, ``--prompt``-token prompt;
* ``bandwidth_floor_tok_per_s``: measured copy bandwidth (read + write) ÷ bytes one AR step must move:
  every weight except the embedding table, the KV cache of the attention layers at the mean context,
  and the linear layers' fp32 recurrent state and conv state, each read and written once;
  ``ar_fraction_of_floor`` = ar_tok_per_s ÷ that floor;
* ``oracle_speedup_tau7``: the engine with a benchmark-only oracle that accepts exactly 6 draft tokens
  per step (τ = 7; output not the target's) over its own AR, end to end;
* ``ar_step_ms`` / ``spec_step_ms``: one replay of each step.
Writes JSON with provenance.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine.bench_engine import ceilings, timed  # noqa: E402
from dspine.config import DSpineConfig  # noqa: E402
from dspine.model import DSpineDraftModel  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from infer.engine import Engine  # noqa: E402
from infer.model import EngineTarget, ModelArgs  # noqa: E402

LAYOUT_27B = dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                  num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
DRAFT_27B = dict(layers=5, heads=32, kv_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, max_position_embeddings=4096,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
DRAFT_TINY = dict(layers=2, heads=4, kv_heads=2, head_dim=32)


@torch.no_grad()
def random_target(layout: dict, dev, dtype, impl: str, layer_ids) -> EngineTarget:
    """An EngineTarget of ``layout`` built on the device with random weights (no HF state: no second copy):
    matrices N(0, 0.02), norm weights 1 (the fold of HF's zero init), A_log = log U(1, 16), dt_bias 1."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    a = ModelArgs.from_hf_config(Qwen3_5TextConfig(**layout))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            t = EngineTarget(a, layer_ids, impl)
    finally:
        torch.set_default_dtype(default)
    for name, p in t.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in leaf or leaf == "dt_bias":
            p.fill_(1.0)
        elif leaf == "A_log":
            p.uniform_(1.0, 16.0).log_()
        else:
            p.normal_(0.0, 0.02)
    return t


def step_bytes(t: EngineTarget, context: int) -> dict:
    """Bytes one AR step at batch 1 moves at ``context`` cached positions (module docstring)."""
    a = t.args
    weights = sum(p.numel() * p.element_size() for p in t.parameters()) - t.embed.numel() * t.embed.element_size()
    el = t.embed.element_size()
    n_att = sum(k == "attention" for k in a.layer_kinds)
    n_lin = len(a.layer_kinds) - n_att
    kv = n_att * 2 * a.num_kv_heads * a.head_dim * context * el
    conv = 2 * a.lin_k_heads * a.lin_k_dim + a.lin_v_heads * a.lin_v_dim
    state = n_lin * 2 * (a.lin_v_heads * a.lin_k_dim * a.lin_v_dim * 4 + conv * (a.conv_kernel - 1) * el)
    return {"weights": weights, "kv_cache": kv, "linear_states_read_write": state, "total": weights + kv + state}


def run(args) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    impl = "triton" if dev.type == "cuda" else "torch"
    layout, dshape = (TINY, DRAFT_TINY) if args.tiny else (LAYOUT_27B, DRAFT_27B)
    res: dict = {**provenance(), "shape": "tiny" if args.tiny else "qwen3_5 27B-class", "layout": layout,
                 "dtype": str(dtype), "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "block_size": 16}
    res["ceilings"] = ceilings(dev)
    H = layout["hidden_size"]
    dcfg = DSpineConfig(vocab_size=layout["vocab_size"], hidden_size=H, intermediate_size=layout["intermediate_size"],
                        num_hidden_layers=dshape["layers"], num_attention_heads=dshape["heads"],
                        num_key_value_heads=dshape["kv_heads"], head_dim=dshape["head_dim"], block_size=16,
                        num_target_layers=layout["num_hidden_layers"],
                        max_position_embeddings=layout["max_position_embeddings"], rope_theta=1e7,
                        dflash_config={"mask_token_id": layout["vocab_size"] - 1, "target_layer_ids": None})
    with torch.device(dev):
        draft = DSpineDraftModel(dcfg).to(dtype)
    target = random_target(layout, dev, dtype, impl, dcfg.target_layer_ids)
    res["target_parameters"] = sum(p.numel() for p in target.parameters())
    res["draft_parameters"] = sum(p.numel() for p in draft.parameters())
    moved = step_bytes(target, args.prompt + args.new_tokens // 2)
    res["ar_step_bytes"] = moved
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, layout["vocab_size"] - 2, (args.prompt,), generator=g).tolist()]
    max_seq = args.prompt + args.new_tokens + 64
    greedy = SamplingParams(max_new_tokens=args.new_tokens)
    eng = Engine(target, draft, [-1], max_batch=1, max_seq=max_seq, max_new_cap=args.new_tokens)
    eng.generate(prompts, SamplingParams(max_new_tokens=8), use_draft=False)  # warm-up + capture
    ar = eng.generate(prompts, greedy, use_draft=False)
    res["ar_tok_per_s"] = ar.num_tokens / (ar.elapsed_s - ar.prefill_s)
    res["ar_step_ms"] = timed(eng._runner(1, greedy, spec=False), args.iters)
    res["spec_step_ms"] = timed(eng._runner(1, greedy, spec=True), args.iters)
    res["cuda_graphs"] = eng.cuda_graphs
    del eng
    oracle = Engine(target, draft, [-1], max_batch=1, max_seq=max_seq, max_new_cap=args.new_tokens, force_accept=6)
    oracle.generate(prompts, SamplingParams(max_new_tokens=16))
    orc = oracle.generate(prompts, greedy)
    res["oracle_tau"] = orc.stats.tau
    res["oracle_tok_per_s"] = orc.num_tokens / (orc.elapsed_s - orc.prefill_s)
    res["oracle_speedup_tau7"] = res["oracle_tok_per_s"] / res["ar_tok_per_s"]
    res["cuda_graphs_oracle"] = oracle.cuda_graphs
    bw = res["ceilings"]["copy_bw_GBps"]
    if bw:
        res["bandwidth_floor_tok_per_s"] = bw * 1e9 / moved["total"]
        res["ar_fraction_of_floor"] = res["ar_tok_per_s"] / res["bandwidth_floor_tok_per_s"]
    else:
        res["bandwidth_floor_tok_per_s"] = res["ar_fraction_of_floor"] = None
    if dev.type == "cuda":
        res["peak_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9
    for k in ("ar_tok_per_s", "bandwidth_floor_tok_per_s", "ar_fraction_of_floor", "oracle_tau", "oracle_speedup_tau7",
              "ar_step_ms", "spec_step_ms", "cuda_graphs"):
        v = res[k]
        print(f"{k}: {v:.4g}" if isinstance(v, float) and math.isfinite(v) else f"{k}: {v}", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny layout (CPU smoke test)")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is there")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    with torch.inference_mode():
        res = run(args)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
