"""Verify width on the reference (CPU) backend: tok/s and τ of the shipped SmolLM2 draft per width.

    python benchmarks/reference/verify_width.py --output results/smollm2-cpu-verify-width.json

On a CPU the target's forward costs grow with the tokens it verifies, so the full 16-slot verify of
a block draft can cost more than the tokens it saves; a narrower verify keeps most of τ (the draft's
acceptance falls with the slot) at a fraction of the cost. Loads the default target (the SmolLM2
GGUF of ``python -m infer.fetch``) and the shipped draft once, then decodes the same prompts
autoregressively and at each ``--widths`` value, round-robin in alternating order over ``--rounds``
rounds (the first round is a warm-up and dropped); reports the median tok/s per configuration, τ,
and the speedup over autoregressive decoding. Greedy output is checked equal to the autoregressive
output at every width (lossless). Writes JSON to ``--output``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.checkpoint import load_draft  # noqa: E402
from dspine.io import atomic_write_json  # noqa: E402
from dspine.paths import load_tokenizer, resolve_model_path  # noqa: E402
from dspine.prompts import encode_prompt  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.reference import ReferenceDecoder  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from dspine.target import TargetSpec, load_target  # noqa: E402
from infer.datasets import load_eval_prompts  # noqa: E402
from infer.generate import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402

README_PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 8, 6, 4, 3, 2])
    ap.add_argument("--gsm8k", type=int, default=2, help="GSM8K prompts beside the README's prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the first one dropped as warm-up")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 2:
        raise SystemExit("--rounds must be >= 2 (the first round is a warm-up)")
    if args.threads:
        torch.set_num_threads(args.threads)
    path, gguf = resolve_model_path(args.target, None, need_config=True)
    spec = TargetSpec.from_pretrained(path, gguf)
    tok = load_tokenizer(path, gguf)
    texts = [README_PROMPT] + [p.turns[0] for p in load_eval_prompts("gsm8k", args.gsm8k)] if args.gsm8k else [
        README_PROMPT]
    prompts = [encode_prompt(tok, t) for t in texts]
    target = load_target(path, gguf, dtype=torch.float32)
    draft = load_draft(args.draft, dtype=target.dtype)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    configs = ["ar"] + [f"w{w}" for w in args.widths]

    def run(name: str):
        dec = ReferenceDecoder(target, None, spec.eos_ids) if name == "ar" else ReferenceDecoder(
            target, draft, spec.eos_ids, verify_size=int(name[1:]))
        return dec.generate(prompts, params)

    times = {c: [] for c in configs}
    outs, taus = {}, {}
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else configs[::-1]:
            res = run(c)
            outs[c], taus[c] = res.token_ids, res.stats.tau
            if r > 0:
                times[c].append(res.tok_per_s)
            print(f"round {r} {c}: {res.tok_per_s:.1f} tok/s, tau {res.stats.tau:.2f}", flush=True)
    ar = statistics.median(times["ar"])
    rows = {c: {"tok_per_s": statistics.median(times[c]), "tau": taus[c], "speedup": statistics.median(times[c]) / ar,
                "equal_to_ar": outs[c] == outs["ar"]} for c in configs}
    best = max(args.widths, key=lambda w: rows[f"w{w}"]["tok_per_s"])
    out = {**provenance(sys.argv), "device": "cpu", "threads": torch.get_num_threads(),
           "args": {k: v for k, v in vars(args).items() if k != "output"}, "num_prompts": len(prompts),
           "results": rows, "best_width": best, "best_speedup": rows[f"w{best}"]["speedup"]}
    print(json.dumps({c: {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for c, r in rows.items()}))
    if args.output:
        atomic_write_json(Path(args.output), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
