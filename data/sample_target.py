"""Sample training rows from a base-LM target: ``python -m data.sample_target``.

    python -m data.sample_target --target PATH --num N --max-new-tokens T \\
        --temperature 1.0 --seed S --out FILE.jsonl [--batch-size 64]

Each of the N sequences starts at the target's BOS token and continues with tokens sampled from
the target itself (softmax at ``temperature``, no top-k/top-p) until EOS or T new tokens; this is
self-distillation data for base LMs such as stories260K. Rows are
``{"id", "input_ids", "loss_mask"}`` with loss_mask 1 on every generated token (EOS included) and
0 on BOS: the tokens the target generates at inference (docs/contracts.md). The output is written
to a temporary file and renamed at the end; an existing output is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from dspine.io import sigterm_as_ctrl_c
from dspine.paths import check_output_file


def sample_rows(target, bos: int, eos: set[int], num: int, max_new_tokens: int, temperature: float, seed: int,
                batch_size: int = 64) -> list[dict]:
    """``num`` rows sampled from ``target`` (a :class:`dspine.target.TargetAdapter`) starting at ``bos``.

    Sampling is a plain loop over the target's KV cache with one ``torch.Generator`` seeded by
    ``seed``, so the rows depend only on (target, seed, num, batch_size, max_new_tokens, temperature).
    Raises ValueError for a temperature that is not a finite number > 0."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"--temperature {temperature}: must be a finite number > 0 (sampled data needs randomness)")
    gen = torch.Generator(device=target.device).manual_seed(seed)
    rows = []
    with torch.inference_mode():
        for start in range(0, num, batch_size):
            B = min(batch_size, num - start)
            ids = torch.full((B, 1), bos, dtype=torch.long, device=target.device)
            done = torch.zeros(B, dtype=torch.bool, device=target.device)
            out = target(ids, use_cache=True, features=False)
            cache, new = out.past_key_values, []
            for t in range(max_new_tokens):
                probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
                tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
                new.append(torch.where(done, torch.full_like(tok, -1), tok))
                done |= torch.isin(tok, torch.tensor(sorted(eos), device=tok.device))
                if bool(done.all()) or t == max_new_tokens - 1:
                    break
                out = target(tok[:, None], position_ids=torch.full((B, 1), t + 1, device=tok.device),
                             past_key_values=cache, use_cache=True, features=False)
                cache = out.past_key_values
            gen_ids = torch.stack(new, 1).tolist()
            for b, seq in enumerate(gen_ids):
                seq = [x for x in seq if x >= 0]
                rows.append({"id": f"sample-{start + b}", "input_ids": [bos] + seq, "loss_mask": [0] + [1] * len(seq)})
    return rows


@sigterm_as_ctrl_c()  # SIGTERM (a scheduler's stop) takes the Ctrl-C path below
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.sample_target", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target folder, Hub id or .gguf file")
    ap.add_argument("--num", type=int, required=True, help="number of sequences")
    ap.add_argument("--max-new-tokens", type=int, required=True, help="tokens sampled after BOS (at most)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", required=True, help="output .jsonl (must not exist)")
    args = ap.parse_args(argv)

    from dspine.target import load_target

    out = Path(args.out)
    try:  # the output and the flags before sampling, not after it
        if out.exists():
            raise ValueError(f"{out} already exists; refusing to overwrite (choose another --out)")
        check_output_file("--out", out, False)
        for name in ("num", "max_new_tokens", "batch_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
        if not (math.isfinite(args.temperature) and args.temperature > 0):
            raise ValueError(f"--temperature {args.temperature}: must be a finite number > 0")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        target = load_target(args.target, dtype=args.dtype, device=device)
        cfg, gen_cfg = target.config, getattr(target.model, "generation_config", None)
        bos = getattr(gen_cfg, "bos_token_id", None) if gen_cfg is not None else None
        bos = bos if bos is not None else cfg.bos_token_id
        if bos is None:
            raise ValueError(f"target {args.target} has no bos_token_id to start from")
        ctx = getattr(cfg, "max_position_embeddings", None)
        if ctx is not None and 1 + args.max_new_tokens > ctx:  # the BOS token, then the samples
            raise ValueError(f"--max-new-tokens {args.max_new_tokens}: the BOS token plus {args.max_new_tokens} samples "
                             f"exceed target {args.target}'s context of {ctx} positions; give at most {ctx - 1}")
        eos = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(gen_cfg, "eos_token_id", None)
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        rows = sample_rows(target, int(bos), eos, args.num, args.max_new_tokens, args.temperature, args.seed,
                           args.batch_size)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the rows are written only once all are sampled
        print(f"\ndata.sample_target: interrupted; nothing was written to {out} (the same command starts over)",
              file=sys.stderr)
        return 130
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if out.exists():  # appeared while sampling: still never overwrite
        tmp.unlink()
        print(f"error: {out} appeared while sampling; refusing to overwrite", file=sys.stderr)
        return 2
    os.replace(tmp, out)
    tokens = sum(len(r["input_ids"]) for r in rows)
    print(f"wrote {out}: {len(rows)} rows, {tokens} tokens ({tokens / len(rows):.1f} per row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
