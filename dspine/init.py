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

from dspine.checkpoint import save_draft, warm_start
from dspine.config import DSpineConfig, default_target_layer_ids
from dspine.model import DSpineDraftModel, count_parameters
from dspine.target import TargetSpec, assert_compatible


def _target_field(cfg, name, default=None):
    v = getattr(cfg, name, None)
    return default if v is None else v


def default_mask_token_id(spec: TargetSpec) -> int:
    """First embedding row that the tokenizer never produces (Qwen3: 151669).

    Raises:
        ValueError: the target vocabulary has no unused row; pass ``--mask-token-id``.
    """
    if spec.tokenizer_len is not None and spec.tokenizer_len < spec.vocab_size:
        return spec.tokenizer_len
    raise ValueError(
        f"target {spec.name}: every one of its {spec.vocab_size} embedding rows is a real token; "
        "choose an unused token for --mask-token-id (not pad/eos)"
    )


def draft_config_for(target_config, spec: TargetSpec, *, layers: int = 5, block_size: int = 16,
                     injection: str = "residual", injection_rank: int = 0, injection_layers=None,
                     block_attention: str = "bidirectional", target_layer_ids=None, mask_token_id=None,
                     intermediate_size: int | None = None, sliding_window: int | None = None,
                     sliding_layers=None, max_position_embeddings: int | None = None,
                     last_layer_features: str = "post_norm") -> DSpineConfig:
    """A :class:`DSpineConfig` whose layer shapes follow ``target_config``.

    Raises:
        ValueError: a ``sliding_layers`` index outside ``[0, layers)``.
    """
    H = int(target_config.hidden_size)
    heads = int(target_config.num_attention_heads)
    head_dim = _target_field(target_config, "head_dim", H // heads)
    layer_types = ["full_attention"] * layers
    bad = [i for i in sliding_layers or [] if not 0 <= i < layers]
    if bad:
        raise ValueError(f"--sliding-layers {bad} outside [0, {layers}) for a draft of {layers} layers")
    for i in sliding_layers or []:
        layer_types[i] = "sliding_attention"
    return DSpineConfig(
        vocab_size=spec.vocab_size,
        hidden_size=H,
        intermediate_size=intermediate_size or int(target_config.intermediate_size),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(_target_field(target_config, "num_key_value_heads", heads)),
        head_dim=int(head_dim),
        max_position_embeddings=max_position_embeddings or int(spec.max_position_embeddings or 40960),
        rms_norm_eps=float(_target_field(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=spec.rope_theta or 1e6,
        layer_types=layer_types,
        sliding_window=sliding_window,
        block_size=block_size,
        num_target_layers=spec.num_layers,
        dflash_config={
            "mask_token_id": default_mask_token_id(spec) if mask_token_id is None else int(mask_token_id),
            "target_layer_ids": list(target_layer_ids) if target_layer_ids else default_target_layer_ids(spec.num_layers, layers),
        },
        dspine_config={"injection": injection, "injection_rank": injection_rank, "injection_layers": injection_layers,
                       "block_attention": block_attention, "last_layer_features": last_layer_features},
    )


def adopt_source_layout(args) -> str:
    """Warm start keeps the source draft's layout: unset shape flags take its values, and a flag that
    contradicts it is an error (its weights were trained for that layout). Returns the source's
    ``last_layer_features`` (its weights were trained on those features)."""
    from dspine.checkpoint import load_config

    src = load_config(args.init_from)
    layout = {
        "layers": src.num_hidden_layers, "block_size": src.block_size, "target_layer_ids": src.target_layer_ids,
        "mask_token_id": src.mask_token_id, "intermediate_size": src.intermediate_size,
        "sliding_window": src.sliding_window,
    }
    for key, value in layout.items():
        given = getattr(args, key)
        if given is None:
            setattr(args, key, value)
        elif given != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{flag} {given} contradicts the --init-from draft {args.init_from} ({key}={value}); "
                             "drop the flag to keep the source layout")
    return src.last_layer_features


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
    ap.add_argument("--layers", type=int, default=None, help="draft layers (default 5, or the --init-from draft's)")
    ap.add_argument("--block-size", type=int, default=None, help="default 16, or the --init-from draft's")
    ap.add_argument("--injection", default="residual", help="residual | kv | none (none = DFlash)")
    ap.add_argument("--injection-rank", type=int, default=0, help="0 = full rank")
    ap.add_argument("--injection-layers", type=_ints, default=None)
    ap.add_argument("--block-attention", default="bidirectional", help="bidirectional | causal")
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

    from pathlib import Path

    from transformers import AutoConfig

    from dspine.paths import hub_errors
    from dspine.target import resolve_model_path

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out {out} is an existing file; give a new or empty folder", file=sys.stderr)
        return 2
    if out.exists() and any(out.iterdir()):
        print(f"error: {out} exists and is not empty; refusing to overwrite", file=sys.stderr)
        return 2
    try:
        last_layer = adopt_source_layout(args) if args.init_from else "post_norm"
        args.layers = 5 if args.layers is None else args.layers
        args.block_size = 16 if args.block_size is None else args.block_size
        path, gguf = resolve_model_path(args.target, args.gguf_file, need_config=True)
        with hub_errors("target", path):
            tcfg = AutoConfig.from_pretrained(path, **({"gguf_file": gguf} if gguf else {}))
        spec = TargetSpec.from_pretrained(path, gguf)
        cfg = draft_config_for(
            tcfg, spec, layers=args.layers, block_size=args.block_size, injection=args.injection,
            injection_rank=args.injection_rank, injection_layers=args.injection_layers,
            block_attention=args.block_attention, target_layer_ids=args.target_layer_ids,
            mask_token_id=args.mask_token_id, intermediate_size=args.intermediate_size,
            sliding_window=args.sliding_window, sliding_layers=args.sliding_layers,
            max_position_embeddings=args.max_position_embeddings, last_layer_features=last_layer,
        )
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
