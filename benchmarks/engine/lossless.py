"""Lossless check of the CUDA engine (the engine issue's acceptance run).

    python benchmarks/engine/lossless.py --prepare PROMPTS.json --stories DIR --qwen3-tokenizer DIR --eval-dir DIR
    python benchmarks/engine/lossless.py --prompts PROMPTS.json --stories DIR --output FILE     # on the GPU

For stories260K and a tiny random Qwen3 (built here on the real Qwen3 tokenizer): 64 prompts from
the five eval sets (mixed lengths), greedy decoding with the engine at batch 1 and batch 8, CUDA
graphs off and on, fp32 and bf16, with two drafts:
* ``random``: an untrained draft (non-zero injection gates) — mostly rejected proposals;
* ``oracle``: proposes the reference continuation with every 4th slot corrupted, on the device
  (graph-capturable) — long accepted prefixes, rollbacks, ragged acceptance across the batch.
Every output is compared with the reference (transformers, fp32, autoregressive) token by token;
for each differing prompt the first divergence is reported with the reference top-2 logit margin
there; only bf16 near-ties may differ, and every one is listed.

``--exact`` (issue 13): the engines run in exact mode and each configuration also decodes without
the draft; the speculative output must equal that engine AR output on every prompt, fp32 and bf16
(``identical_to_engine_ar``); any difference makes the exit status 1 (after the JSON is written).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dspine.checkpoint import save_draft  # noqa: E402
from dspine.paths import load_tokenizer  # noqa: E402
from dspine.prompts import encode_prompt  # noqa: E402
from dspine.provenance import provenance  # noqa: E402
from dspine.reference import ReferenceDecoder  # noqa: E402
from dspine.sampling import SamplingParams  # noqa: E402
from dspine.target import load_target  # noqa: E402
from infer.datasets import load_eval_prompts  # noqa: E402
from infer.engine import load_engine  # noqa: E402


def install_device_oracle(engine, reference: list[list[int]], every: int = 4):
    """Make the engine's draft propose ``reference[prompt][pos + k]`` (every ``every``-th slot by
    position corrupted), computed on the device from the slot lengths: CUDA-graph safe."""
    dev, V = engine.device, engine.target.args.vocab_size
    width = max(len(r) for r in reference) + 64
    ref = torch.zeros(engine.max_batch, width, dtype=torch.long, device=dev)
    admit = engine._admit

    def _admit(s, items, params, spec, kv, dc, seeds, *rest):
        admit(s, items, params, spec, kv, dc, seeds, *rest)
        for b, _ in items:
            seq = reference[engine.slot_owner[b]]  # set by Engine.generate before admission
            row = torch.zeros(width, dtype=torch.long)
            row[: len(seq)] = torch.tensor(seq)
            ref[b].copy_(row.to(dev))

    def draft_logits(block, cache):
        B, bs = block.shape
        lengths = cache.lengths
        k = torch.arange(1, bs, device=dev)
        pos = lengths[:, None].long() + k  # [B, K]
        tok = ref[:B].gather(1, pos.clamp(max=width - 1))
        bad = (pos % every) == 0
        tok = torch.where(bad, (tok + 1) % V, tok)
        logits = torch.zeros(B, bs - 1, V, device=dev, dtype=engine.target.embed.dtype)
        return logits.scatter_(2, tok[..., None], 10.0)[:, : engine.verify_size - 1]

    engine._admit = _admit
    engine.draft_logits = draft_logits


def first_divergence(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def margin_at(target, prompt: list[int], want: list[int], i: int) -> float:
    """Reference (fp32) top-2 logit margin at generated position i."""
    ids = torch.tensor([prompt + want[:i]], device=target.device)
    with torch.no_grad():
        logits = target(ids, features=False).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def build_tiny_qwen3(out: Path) -> Path:
    """A tiny random Qwen3 with the real vocabulary (151,936 rows) and EOS ids (no tokenizer needed)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                      rope_theta=1e6, tie_word_embeddings=False, eos_token_id=151645, pad_token_id=151643,
                      initializer_range=0.1)
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


def run_target(name, path, draft_dir, prompts, max_new, eos, report, device="cuda", exact=False):
    target = load_target(str(path), dtype="fp32", device=device)
    want = ReferenceDecoder(target, None, eos).generate(prompts, SamplingParams(max_new_tokens=max_new)).token_ids
    refs = [p + w for p, w in zip(prompts, want)]
    cuda = device == "cuda"
    for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        for graphs in (False, True) if cuda else (False,):
            for draft_kind, batch in (("random", 8), ("oracle", 1), ("oracle", 8)):
                t0 = time.perf_counter()
                eng, _ = load_engine(str(path), None, str(draft_dir), device=device, dtype=dtype, max_batch=batch,
                                     max_seq=max(map(len, prompts)) + max_new + 32, cuda_graphs=graphs,
                                     eos_token_ids=eos, exact=exact)
                if draft_kind == "oracle":
                    install_device_oracle(eng, refs)
                got = eng.generate(prompts, SamplingParams(max_new_tokens=max_new), concurrency=batch)
                diffs = []
                for j, (g, w) in enumerate(zip(got.token_ids, want)):
                    i = first_divergence(g, w)
                    if i is not None:
                        diffs.append({"prompt": j, "position": i,
                                      "ref_top2_margin": margin_at(target, prompts[j], w, i) if i < len(w) else None})
                row = {"target": name, "dtype": str(dtype).split(".")[-1], "cuda_graphs": graphs,
                       "draft": draft_kind, "batch": batch, "prompts": len(prompts),
                       "identical": len(prompts) - len(diffs), "differences": diffs, "tau": got.stats.tau,
                       "exact": exact, "seconds": time.perf_counter() - t0}
                if exact:  # the engine's own AR output, same mode: must be equal bit for bit
                    ar = eng.generate(prompts, SamplingParams(max_new_tokens=max_new), concurrency=batch,
                                      use_draft=False).token_ids
                    row["ar_differences"] = [{"prompt": j, "position": first_divergence(g, a)}
                                             for j, (g, a) in enumerate(zip(got.token_ids, ar)) if g != a]
                    row["identical_to_engine_ar"] = len(prompts) - len(row["ar_differences"])
                    row["seconds"] = time.perf_counter() - t0
                report.append(row)
                print(f"{name:9} {row['dtype']:8} graphs={graphs!s:5} {draft_kind:6} batch={row['batch']} "
                      f"identical {row['identical']}/{len(prompts)} tau={row['tau']:.2f} "
                      f"margins={[round(d['ref_top2_margin'] or -1, 5) for d in diffs]}"
                      + (f" == engine AR {row['identical_to_engine_ar']}/{len(prompts)}" if exact else ""), flush=True)
                del eng


def prepare_prompts(args) -> dict:
    """Token ids of the first turns of ``num_prompts`` eval prompts for both targets (CPU step)."""
    per_task = -(-args.num_prompts // 5)
    texts = []
    for task in ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench"):
        texts += [p.turns[0] for p in load_eval_prompts(task, per_task, args.eval_dir)]
    texts = texts[: args.num_prompts]
    return {
        "stories": [encode_prompt(load_tokenizer(args.stories), t, chat=False)[:300] for t in texts],
        "qwen3-tiny": [encode_prompt(load_tokenizer(args.qwen3_tokenizer), t, chat=True)[:300] for t in texts],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stories", required=True)
    ap.add_argument("--qwen3-tokenizer", default=None)
    ap.add_argument("--eval-dir", default=None)
    ap.add_argument("--prepare", default=None, help="write the prompt token ids to this JSON and stop")
    ap.add_argument("--prompts", default=None, help="prompt token ids written by --prepare")
    ap.add_argument("--work", default="/tmp/dspine-lossless")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--output", default=None)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (eager, torch kernels)")
    ap.add_argument("--exact", action="store_true", help="exact engine mode: spec must equal the engine's own AR")
    args = ap.parse_args(argv)
    if args.prepare:
        Path(args.prepare).write_text(json.dumps(prepare_prompts(args)))
        return 0
    from tests.helpers import random_draft

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts_by_target = json.loads(Path(args.prompts).read_text())
    report: list[dict] = []
    qwen_dir = build_tiny_qwen3(work / "tiny-qwen3")
    for name, path, eos, mask in (("stories", Path(args.stories), [2], 0), ("qwen3-tiny", qwen_dir, [151645], 151669)):
        prompts = prompts_by_target[name][: args.num_prompts]
        target = load_target(str(path), dtype="fp32")
        draft = random_draft(target, block_size=16, mask=mask)
        ddir = save_draft(draft, work / f"draft-{name}")
        run_target(name, path, ddir, prompts, args.max_new_tokens, eos, report, args.device, args.exact)
    total = sum(r["prompts"] for r in report)
    same = sum(r["identical"] for r in report)
    fp32_diffs = sum(len(r["differences"]) for r in report if r["dtype"] == "float32")
    summary = {"outputs": total, "identical": same, "fp32_differences": fp32_diffs}
    if args.exact:
        summary["identical_to_engine_ar"] = sum(r["identical_to_engine_ar"] for r in report)
    out = {**provenance(), "runs": report, "summary": summary}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=1))
    print(f"identical {same}/{total}; fp32 differences {fp32_diffs}")
    if args.exact:
        print(f"exact mode: speculative == engine AR on {summary['identical_to_engine_ar']}/{total}")
        if summary["identical_to_engine_ar"] != total:
            print("error: exact mode: speculative output differs from the engine's AR output", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
