"""``python -m infer.bench``: acceptance length and throughput on GSM8K, MATH-500, HumanEval, MBPP, MT-Bench.

    python -m infer.bench --target T --draft D --datasets gsm8k,math500,humaneval,mbpp,mt-bench \\
        --num-prompts 80 --max-new-tokens 512 --temperature 0 --concurrency 8 --output-json results/x.json

For each task: the draft run and an autoregressive run of the same engine on the same prompts
(same max tokens and sampling), both after a warm-up of every timed path (design.md §8.16).
Reports τ (bonus token included), accept_at_pos, tok/s and speedup = spec tok/s ÷ AR tok/s, a
table on stdout, a JSON file (with the command, device, date and commit) and a PNG of the
per-position acceptance. MT-Bench runs both turns; the second turn sees the model's own answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dspine.sampling import SamplingParams
from dspine.stats import AcceptStats


class Runner:
    """One decoding backend behind one call: ``run(prompts, params, use_draft) -> (tokens, stats, seconds)``."""

    def __init__(self, args):
        from dspine.target import TargetSpec, load_tokenizer, resolve_model_path

        self.args = args
        path, gguf = resolve_model_path(args.target, args.gguf_file)
        self.tokenizer = load_tokenizer(path, gguf)
        self.spec = TargetSpec.from_pretrained(path, gguf)
        self.backend = args.backend if args.backend != "auto" else ("cuda" if torch.cuda.is_available() else "reference")
        self.eos = sorted(self.spec.eos_ids)
        max_seq = args.max_prompt_tokens + args.max_new_tokens + 64
        if self.backend == "cuda":
            from infer.engine import load_engine

            dtype = {"auto": torch.bfloat16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
            self.engine, _ = load_engine(path, gguf, args.draft, device="cuda", dtype=dtype, max_batch=args.concurrency,
                                         max_seq=max_seq, verify_size=args.block_size,
                                         check_max_context=max_seq - 64, max_new_cap=args.max_new_tokens)
            self.block_size = self.engine.vb
        else:
            from dspine.checkpoint import load_draft
            from dspine.spec import ReferenceDecoder
            from dspine.target import assert_compatible, load_target

            target = load_target(path, gguf, dtype="fp32" if args.dtype == "auto" else args.dtype)
            draft = load_draft(args.draft, dtype=target.dtype) if args.draft else None
            if draft is not None:
                assert_compatible(self.spec, draft.config, max_context=max_seq - 64)
            self.spec_dec = ReferenceDecoder(target, draft, self.eos)
            self.ar_dec = ReferenceDecoder(target, None, self.eos)
            self.block_size = draft.config.block_size if draft else 1

    def run(self, prompts: list[list[int]], params: SamplingParams, use_draft: bool):
        if self.backend == "cuda":
            r = self.engine.generate(prompts, params, concurrency=self.args.concurrency, use_draft=use_draft)
            return r.token_ids, r.stats, r.elapsed_s
        dec = self.spec_dec if use_draft else self.ar_dec
        tokens, stats, secs = [], None, 0.0
        for i in range(0, len(prompts), self.args.concurrency):  # fixed-size batches
            r = dec.generate(prompts[i : i + self.args.concurrency], params)
            tokens += r.token_ids
            stats = r.stats if stats is None else stats.merge(r.stats)
            secs += r.elapsed_s
        return tokens, stats, secs


def encode(runner: Runner, text: str, history=None) -> list[int]:
    from infer.prompts import encode_prompt

    ids = encode_prompt(runner.tokenizer, text, chat=not runner.args.no_chat_template, system=runner.args.system,
                        enable_thinking=runner.args.enable_thinking, history=history)
    if len(ids) > runner.args.max_prompt_tokens:
        ids = ids[-runner.args.max_prompt_tokens :]  # keep the end: the question and the assistant header
    return ids


def run_task(runner: Runner, task: str, params: SamplingParams, do_ar: bool) -> dict:
    from infer.datasets import load_eval_prompts

    items = load_eval_prompts(task, runner.args.num_prompts, runner.args.data_dir)
    out = {"task": task, "num_prompts": len(items)}
    for mode in (["spec", "ar"] if do_ar else ["spec"]) if runner.block_size > 1 else ["ar"]:
        use_draft = mode == "spec"
        histories = [[] for _ in items]
        all_tokens, stats, secs, n_tok = [], None, 0.0, 0
        for turn in range(max(len(x.turns) for x in items)):
            idx = [i for i, x in enumerate(items) if turn < len(x.turns)]
            prompts = [encode(runner, items[i].turns[turn], histories[i]) for i in idx]
            tokens, st, s = runner.run(prompts, params, use_draft)
            for i, toks in zip(idx, tokens):
                text = runner.tokenizer.decode([t for t in toks if t not in runner.spec.eos_ids], skip_special_tokens=True)
                histories[i] += [{"role": "user", "content": items[i].turns[turn]}, {"role": "assistant", "content": text}]
            all_tokens += tokens
            stats = st if stats is None else stats.merge(st)
            secs += s
            n_tok += sum(len(t) for t in tokens)
        out[mode] = {"tok_per_s": n_tok / secs, "num_tokens": n_tok, "seconds": secs, **stats.to_dict()}
        out[mode + "_tokens"] = all_tokens
    if "spec" in out and "ar" in out:
        out["speedup"] = out["spec"]["tok_per_s"] / out["ar"]["tok_per_s"]
        if params.greedy:
            same = sum(a == b for a, b in zip(out["spec_tokens"], out["ar_tokens"]))
            out["greedy_equal_fraction"] = same / len(out["spec_tokens"])
    for mode in ("spec", "ar"):
        out.pop(mode + "_tokens", None)
    return out


def table(rows: list[dict]) -> str:
    head = f"{'task':<10} {'tau':>6} {'acc@1':>6} {'acc@4':>6} {'acc@8':>6} {'spec tok/s':>11} {'AR tok/s':>9} {'speedup':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        s, a = r.get("spec"), r.get("ar")
        acc = (s or {}).get("accept_at_pos", [])
        at = lambda k, acc=acc: f"{acc[k - 1]:.3f}" if len(acc) >= k else "-"
        lines.append(f"{r['task']:<10} {s['tau'] if s else 1.0:>6.2f} {at(1):>6} {at(4):>6} {at(8):>6} "
                     f"{(s or {}).get('tok_per_s', 0):>11.1f} {(a or {}).get('tok_per_s', 0):>9.1f} "
                     f"{r.get('speedup', float('nan')):>8.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r.get("spec"):
            acc = r["spec"]["accept_at_pos"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{r['task']} (τ={r['spec']['tau']:.2f})")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("accept_at_pos[k] (fraction of steps with ≥ k accepted)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--gguf-file", default=None)
    ap.add_argument("--draft", default=None, help="draft folder (omit for AR only)")
    ap.add_argument("--datasets", default="gsm8k,math500,humaneval,mbpp,mt-bench")
    ap.add_argument("--data-dir", default=None, help="local eval folder (default: $DSPINE_SHARED/data/eval, else the Hub)")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt-tokens", type=int, default=1536)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--backend", default="auto", choices=["auto", "cuda", "reference"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enable-thinking", action="store_true")
    ap.add_argument("--system", default=None)
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--no-ar", action="store_true", help="skip the autoregressive baseline")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --output-json)")
    ap.add_argument("--label", default=None, help="name of this configuration in the JSON/plot")
    return ap


def main(argv=None) -> int:
    from dspine.provenance import provenance
    from infer.datasets import task_name

    args = build_parser().parse_args(argv)
    try:
        tasks = [task_name(t) for t in args.datasets.split(",") if t.strip()]
        params = SamplingParams(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed).validate()
        runner = Runner(args)
        # warm-up every timed path (graph capture, kernel compilation) at the timed batch size
        from infer.datasets import load_eval_prompts

        warm = [encode(runner, p.turns[0]) for p in load_eval_prompts(tasks[0], args.concurrency, args.data_dir)]
        wp = SamplingParams(args.temperature, args.top_p, args.top_k, min(32, args.max_new_tokens), args.seed)
        for use_draft in ([True, False] if args.draft else [False]):
            runner.run(warm, wp, use_draft)
        rows = [run_task(runner, t, params, do_ar=not args.no_ar) for t in tasks]
    except (ValueError, FileNotFoundError, FloatingPointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    specs = [r["spec"] for r in rows if "spec" in r]
    summary = {"mean_tau": sum(s["tau"] for s in specs) / len(specs) if specs else 1.0}
    if all("speedup" in r for r in rows) and rows:
        summary["mean_speedup"] = sum(r["speedup"] for r in rows) / len(rows)
    if specs:
        merged = AcceptStats(len(specs[0]["accept_hist"]), [0] + [sum(x) for x in zip(*(s["accept_hist"] for s in specs))])
        summary["pooled_tau"] = merged.tau
    print(table(rows))
    print(f"mean tau {summary['mean_tau']:.3f}" + (f", mean speedup {summary['mean_speedup']:.2f}x" if "mean_speedup" in summary else "")
          + f"  [{runner.backend}, T={args.temperature}, concurrency {args.concurrency}, tau counts the bonus token]")
    result = {**provenance(), "label": args.label, "backend": runner.backend, "args": vars(args), "tasks": rows,
              "summary": summary}
    if args.output_json:
        out = Path(args.output_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        if specs:
            plot(rows, png, args.label or f"{Path(args.draft).name if args.draft else 'AR'}, T={args.temperature}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
