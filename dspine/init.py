"""``python -m dspine.init``: write a new draft folder sized for a target.

    python -m dspine.init --target Qwen/Qwen3-8B --out drafts/qwen3-8b-dspine \\
        [--layers 5 --block-size 16 --injection residual --target-layer-ids 1,9,17,25,33 \\
         --mask-token-id 151669] [--init-from z-lab/Qwen3-8B-DFlash-b16]

Only the target's config and tokenizer are read (no weights). Layer shapes copy the target's
(hidden, intermediate, heads, head_dim, RoPE), as DFlash does.
"""

from __future__ import annotations

import argparse
import sys

import torch

from dspine.checkpoint import load_config, save_draft, warm_start
from dspine.config import DEFAULT_BLOCK_SIZE, DEFAULT_LAYERS, SHAPE_FIELDS, DSpineConfig
from dspine.model import DSpineDraftModel, count_parameters
from dspine.target import TargetSpec, assert_compatible


def adopt_source_layout(args) -> None:
    """Warm start keeps the source draft's layout: unset shape flags take its values, and a flag that
    contradicts it is an error (its weights were trained for that layout). The source's
    ``last_layer_features`` is kept too (its weights were trained on those features)."""
    src = load_config(args.init_from).shape()
    for key in ("layers", "block_size", "target_layer_ids", "mask_token_id", "intermediate_size", "sliding_window"):
        given, value = getattr(args, key), src[key]
        if given is None:
            setattr(args, key, value)
        elif given != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{flag} {given} contradicts the --init-from draft {args.init_from} ({key}={value}); "
                             "drop the flag to keep the source layout")
    args.last_layer_features = src["last_layer_features"]


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from e


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspine.init", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target folder, Hub id or .gguf file")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--out", required=True, help="new draft folder (must not exist or be empty)")
    ap.add_argument("--layers", type=int, default=None,
                    help=f"draft layers (default {DEFAULT_LAYERS}, or the --init-from draft's)")
    ap.add_argument("--block-size", type=int, default=None, help=f"default {DEFAULT_BLOCK_SIZE}, or the --init-from draft's")
    ap.add_argument("--injection", default=None, choices=["residual", "kv", "none"],
                    help="residual (default) | kv | none (none = DFlash)")
    ap.add_argument("--injection-rank", type=int, default=None, help="0 = full rank (default)")
    ap.add_argument("--injection-layers", type=_ints, default=None)
    ap.add_argument("--block-attention", default=None, choices=["bidirectional", "causal"],
                    help="bidirectional (default) | causal")
    ap.add_argument("--target-layer-ids", type=_ints, default=None)
    ap.add_argument("--mask-token-id", type=int, default=None)
    ap.add_argument("--intermediate-size", type=int, default=None)
    ap.add_argument("--sliding-window", type=int, default=None)
    ap.add_argument("--sliding-layers", type=_ints, default=None)
    ap.add_argument("--max-position-embeddings", type=int, default=None)
    ap.add_argument("--init-from", default=None, help="DFlash/DSpine draft folder or Hub id to warm start from")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("layers", "intermediate_size", "max_position_embeddings", "sliding_window"):
        value = getattr(args, name)
        if value is not None and value < 1:  # 0 would silently mean "the default" below
            ap.error(f"--{name.replace('_', '-')} {value}: must be >= 1")
    if args.block_size is not None and args.block_size < 2:
        ap.error(f"--block-size {args.block_size}: must be >= 2 (the anchor + at least one draft slot)")
    if args.injection_rank is not None and args.injection_rank < 0:
        ap.error(f"--injection-rank {args.injection_rank}: must be >= 0 (0 = full rank)")
    if args.injection == "none":  # the DFlash ablation: nothing would read them
        for name in ("injection_rank", "injection_layers"):
            if getattr(args, name) is not None:
                ap.error(f"--{name.replace('_', '-')} shapes the injection, which --injection none leaves out")
    for name in ("target_layer_ids", "injection_layers"):  # --sliding-layers: range-checked with the target
        bad = [i for i in getattr(args, name) or [] if i < 0]
        if bad:
            ap.error(f"--{name.replace('_', '-')}: negative layer index {bad[0]}")

    from pathlib import Path

    from transformers import AutoConfig

    from dspine.paths import hub_errors, resolve_model_path

    out = Path(args.out)
    try:
        if out.exists() and not out.is_dir():
            raise ValueError(f"--out {out} is an existing file; give a new or empty folder")
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"{out} exists and is not empty; refusing to overwrite")
        args.last_layer_features = None  # no flag: post_norm for a new draft, the source's on a warm start
        if args.init_from:
            adopt_source_layout(args)
        path, gguf = resolve_model_path(args.target, args.gguf_file, need_config=True)
        with hub_errors("target", path):
            tcfg = AutoConfig.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))
        spec = TargetSpec.from_pretrained(path, gguf)
        spec.check_supported()
        cfg = DSpineConfig.for_target(tcfg, spec, **{k: getattr(args, k) for k in SHAPE_FIELDS})
        assert_compatible(spec, cfg)
        torch.manual_seed(args.seed)
        model = DSpineDraftModel(cfg)
        kept = warm_start(model, args.init_from) if args.init_from else []
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_draft(model, out, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32,
               metadata={"target": spec.name, "init_from": args.init_from or ""})
    src = f", warm start from {args.init_from} ({len(kept)} injection tensors at init)" if args.init_from else ""
    print(f"wrote {out}: {cfg.num_hidden_layers} layers, block {cfg.block_size}, injection {cfg.injection}, "
          f"target layers {cfg.target_layer_ids}, mask {cfg.mask_token_id}, {count_parameters(model):,} parameters{src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
