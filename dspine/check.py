"""``python -m dspine.check --target PATH --draft PATH [--max-context N]``

Prints the draft/target compatibility table and exits 1 on any mismatch (2 on unreadable input).
Reads configs, tokenizer and the draft weights' headers (names and shapes), no tensor data.
"""

from __future__ import annotations

import argparse
import sys

from dspine.checkpoint import check_weights, load_config
from dspine.target import TargetSpec, check_compat, format_table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspine.check", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target folder, Hub id or .gguf file")
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--draft", required=True, help="draft folder or Hub id")
    ap.add_argument("--max-context", type=int, default=None, help="context length you plan to serve")
    args = ap.parse_args(argv)
    if args.max_context is not None and args.max_context < 1:
        ap.error(f"--max-context {args.max_context}: must be >= 1")
    try:
        spec = TargetSpec.from_pretrained(args.target, args.gguf_file)
        cfg = load_config(args.draft)
        check_weights(args.draft)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = check_compat(spec, cfg, args.max_context)
    print(f"target: {spec.name}\ndraft:  {args.draft} (injection={cfg.injection}, block_size={cfg.block_size}, "
          f"last-layer features {cfg.last_layer_features})\n")
    print(format_table(rows))
    bad = [r for r in rows if not r.ok]
    print(f"\n{'OK' if not bad else f'{len(bad)} mismatch(es)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
