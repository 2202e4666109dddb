"""Offline tree policies at T = 0: the acceptance length τ of token trees built from a block draft, replayed
over the target's own greedy output, on the CPU (issue 16).

    python benchmarks/reference/tree_policy.py --target models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft checkpoints/smollm2-135m-dspine --num-prompts 8 --max-new-tokens 256 \\
        --budgets 16,32,48,64 --output results/tree-policy-cpu.json

At T = 0 a speculative decoder emits the target's greedy output whatever it drafts, so one greedy
continuation per prompt fixes everything: the draft's distributions q ``[K, V]`` at every anchor position of it
(one teacher-forced draft pass, ``DSpineDraftModel.forward_train``, the trainer's forward) and, for any tree,
the accepted depth at that anchor (the deepest node whose path spells the greedy tokens that follow). The
decode is then replayed: from the last prompt position, each step emits accepted + 1 tokens (the bonus
token) and moves on by as many; τ = tokens ÷ steps per prompt, averaged per task as ``infer.bench`` does
(its mean over tasks of each task's pooled tokens ÷ steps).

Policies (best first under a node budget N, root included, W = N - 1 candidates per depth as
``dspine.tree.tree_candidates``): a node's score is the sum of a per-node log weight along its path.
  * ``chain``: the argmax chain of K nodes (``--budgets`` does not apply).
  * ``product``: log q of the node's token (``dspine.tree.build_tree``'s score).
  * ``calibrated``: log p̂, p̂ = σ(a + b·log q) fitted by logistic regression (Platt scaling) per depth and
    per kind of parent (on the chain or off it) on the other half of the prompts (two folds): the
    probability that the node's token is the target's given that its parent's path was, so the best-first
    tree maximizes the expected accepted length 1 + Σ_nodes Π p̂ along the path [the expected-length
    argument of SpecInfer / Sequoia-style tree selection].
Each with the chain forced first (``forced``: ``build_tree(chain_first=True)``, the engine's rule at T > 0, τ
never below the chain's) and without (``free``: ``chain_first=False``, the engine's default at T = 0).

Also reported: the same replay of ``dspine.tree.build_tree`` with the chain first (``builder``) as a check that
the Python best-first here is that rule (``product_forced`` and ``builder`` must agree; tests/test_tree_policy.py
checks both rules against it).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from dspine.paths import check_output_file

TASKS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")


# ------------------------------------------------------------------------------------------- data


def greedy_continuation(target, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """The target's greedy tokens after ``ids`` (at most n, ending with an end token if one came):
    transformers' ``generate`` with ``do_sample=False``."""
    x = torch.tensor([ids])
    with torch.no_grad():
        y = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                  eos_token_id=sorted(eos) or None, pad_token_id=(sorted(eos) or [0])[0],
                                  temperature=None, top_p=None, top_k=None)
    return y[0, len(ids):].tolist()


def load_models(target_path: str, draft_path: str):
    """(target, draft, tokenizer, end tokens) in fp32: the draft checkpoint, the target (HF folder, hub id or .gguf
    file) with the draft's feature layers set, and the target's tokenizer (a .gguf file's own)."""
    from dspine.checkpoint import load_draft
    from dspine.paths import load_tokenizer
    from dspine.target import assert_compatible, load_target

    try:
        draft = load_draft(draft_path, dtype=torch.float32)
        target = load_target(target_path, dtype=torch.float32)
        assert_compatible(target, draft.config)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--target {target_path} / --draft {draft_path}: {e}") from None
    target.set_layer_ids(draft.config.target_layer_ids, draft.config.last_layer_features)
    tp = Path(target_path)
    tok = load_tokenizer(str(tp.parent), tp.name) if tp.suffix == ".gguf" else load_tokenizer(target_path)
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    return target, draft, tok, eos


def draft_q(target, draft, seq: list[int], first: int, chunk: int = 32):
    """Draft distributions ``[A, K, V]`` fp32 for the anchors ``first .. len(seq) - 2`` of ``seq``."""
    from train.loss import block_input_ids

    bs = draft.block_size
    ids = torch.tensor([seq])
    with torch.no_grad():
        feats = target.features(ids)
        parts = []
        for a0 in range(first, len(seq) - 1, chunk):
            anchors = torch.arange(a0, min(a0 + chunk, len(seq) - 1))[None]
            blk = block_input_ids(ids, anchors, bs, draft.config.mask_token_id)
            h = draft(target.embed(blk), feats, anchors, attn="dense")
            n = anchors.shape[1]
            logits = target.lm_head(h.view(n, bs, -1)[:, 1:]).float()
            parts.append(torch.softmax(logits, -1))
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------ trees


def best_first(weights: list[list[list[float]]], budget: int, forced: bool):
    """Nodes of a best-first tree: list of (depth, path of candidate columns) for ``budget - 1`` nodes.

    weights[d][flag][j]: log weight of candidate column j at depth d + 1 under a parent on the chain
    (flag 0) or off it (flag 1), non-increasing in j. Column 0 is the chain token; the chain is the path of
    zeros. Lazy expansion: a popped node offers its next sibling and its first child."""
    K = len(weights)
    W = len(weights[0][0])
    M = budget - 1
    nodes = []
    heap: list = []
    counter = 0

    def push(score, path, flag):
        nonlocal counter
        d = len(path) - 1
        if d >= K or path[-1] >= W:
            return
        w = weights[d][flag][path[-1]]
        if w == float("-inf"):
            return
        heapq.heappush(heap, (-(score + w), counter, score, tuple(path), flag))
        counter += 1

    if forced:
        score = 0.0
        for d in range(min(K, M)):
            path = (0,) * (d + 1)
            nodes.append(path)
            push(score, list(path[:-1]) + [1], 0)  # the chain parent's first other child
            score += weights[d][0][0]
        # the deepest chain node's child is the next chain node (or beyond K): nothing more from the chain
    else:
        push(0.0, [0], 0)
    while heap and len(nodes) < M:
        _, _, parent_score, path, flag = heapq.heappop(heap)
        d = len(path) - 1
        w = weights[d][flag][path[-1]]
        nodes.append(path)
        push(parent_score, list(path[:-1]) + [path[-1] + 1], flag)  # next sibling
        child_flag = 0 if (flag == 0 and path[-1] == 0) else 1
        push(parent_score + w, list(path) + [0], child_flag)  # first child
    return nodes


def accepted_depth(nodes, match) -> int:
    """Deepest node whose every column is the greedy token's column at its depth (match[d]: column or -1)."""
    best = 0
    for path in nodes:
        if all(match[i] == c for i, c in enumerate(path)):
            best = max(best, len(path))
    return best


def replay(acc: list[int], remaining: int) -> tuple[int, int]:
    """(tokens, steps) of decoding ``remaining`` greedy tokens with per-position accepted depths acc."""
    p, steps, tokens = 0, 0, 0
    while p < remaining:
        a = min(acc[p], remaining - p - 1)
        steps += 1
        tokens += a + 1
        p += a + 1
    return tokens, steps


# ---------------------------------------------------------------------------------------- calibration


def fit_platt(x: torch.Tensor, y: torch.Tensor, iters: int = 200) -> tuple[float, float]:
    """σ(a + b·x) by Newton's method on the log loss (x = log q, y ∈ {0, 1}); small ridge for stability."""
    if len(x) == 0:
        return -5.0, 0.0
    X = torch.stack([torch.ones_like(x), x], 1).double()
    yv = y.double()
    w = torch.zeros(2, dtype=torch.float64)
    for _ in range(iters):
        p = torch.sigmoid(X @ w)
        g = X.T @ (p - yv) + 1e-3 * w
        H = X.T @ (X * (p * (1 - p))[:, None]) + 1e-3 * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(H, g)
        w -= step
        if step.abs().max() < 1e-9:
            break
    return float(w[0]), float(w[1])


def calibration_samples(rows, K: int):
    """Per (depth, parent flag): log q of every candidate under the greedy path's parent, and whether it is
    the greedy token. rows: (logq [A, K, W], match [A, K] columns or -1, valid [A, K] bool)."""
    xs = {(d, f): [] for d in range(K) for f in (0, 1)}
    ys = {(d, f): [] for d in range(K) for f in (0, 1)}
    for logq, match, valid in rows:
        A = logq.shape[0]
        for a in range(A):
            on_chain = True
            for d in range(K):
                if not valid[a, d]:
                    break
                f = 0 if on_chain else 1
                lq = logq[a, d]
                live = lq > float("-inf")
                xs[(d, f)].append(lq[live])
                ys[(d, f)].append((torch.arange(len(lq)) == match[a, d])[live].float())
                if match[a, d] < 0:
                    break  # the greedy token is not a candidate: no deeper parent in any tree
                on_chain = on_chain and match[a, d] == 0
    return {k: (torch.cat(xs[k]) if xs[k] else torch.zeros(0), torch.cat(ys[k]) if ys[k] else torch.zeros(0))
            for k in xs}


# ------------------------------------------------------------------------------------------- main


def add_run_args(ap: argparse.ArgumentParser, num_prompts: int, max_new_tokens: int, budgets: str,
                 budgets_help: str | None = None) -> None:
    """The arguments of a CPU replay over the target's greedy outputs (this tool, planner_trace.py record): target,
    draft, tasks, prompts, tokens, tree budgets, threads, output; the defaults differ per tool."""
    ap.add_argument("--target", required=True, help="HF folder or .gguf file of the target")
    ap.add_argument("--draft", required=True, help="draft checkpoint folder")
    ap.add_argument("--datasets", default=",".join(TASKS))
    ap.add_argument("--data-dir", default=None, help="eval sets (default: infer.datasets' default)")
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--budgets", default=budgets, help=budgets_help)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--output", required=True)


def check_run_args(args, resume: bool = False) -> tuple[list[int], dict[str, list]]:
    """Check the arguments of :func:`add_run_args` before any model loads: the tree budgets (each in [2, 64], none
    repeated), the counts, the output path (never an existing file; with ``resume`` an existing one, which the
    caller checks) and every task's prompts, which are loaded here. Returns (budgets, {task: prompts}); raises
    ``SystemExit`` naming the flag and value."""
    from infer.datasets import load_eval_prompts, task_name

    out_path = Path(args.output)
    if out_path.exists() and not resume:
        raise SystemExit(f"{out_path} exists: choose another --output (finished results are never overwritten)")
    try:
        check_output_file("--output", out_path, resume)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not all(b.isdigit() for b in args.budgets.split(",")):  # int() would take a sign or spaces
        raise SystemExit(f"--budgets {args.budgets!r}: give comma-separated integers in [2, 64]")
    budgets = [int(b) for b in args.budgets.split(",")]
    if not budgets or any(not 2 <= b <= 64 for b in budgets) or len(set(budgets)) != len(budgets):
        raise SystemExit(f"--budgets {args.budgets}: each must be in [2, 64], none repeated")
    if args.max_new_tokens < 1 or args.num_prompts < 1 or args.threads < 0:
        raise SystemExit(f"--max-new-tokens {args.max_new_tokens}, --num-prompts {args.num_prompts} (each at least 1) "
                         f"and --threads {args.threads} (0 or more)")
    if args.data_dir is not None and not Path(args.data_dir).is_dir():  # a typo, not a reason to try the Hub
        raise SystemExit(f"--data-dir {args.data_dir}: no such folder")
    items = {}
    for name in args.datasets.split(","):
        try:
            task = task_name(name)  # canonical: "GSM8K" is gsm8k, and its results go under that key
            if task in items:
                raise ValueError("given twice")
            items[task] = list(load_eval_prompts(task, args.num_prompts, args.data_dir))
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"--datasets {name!r} (--data-dir {args.data_dir}): {e}") from None
    return budgets, items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(ap, num_prompts=8, max_new_tokens=256, budgets="16,32,48,64")
    args = ap.parse_args(argv)
    budgets, items = check_run_args(args)  # before the run, not after it
    out_path = Path(args.output)
    if args.threads:
        torch.set_num_threads(args.threads)

    from dspine.ops.tree_verify import verify_tree_greedy
    from dspine.prompts import encode_prompt
    from dspine.tree import build_tree

    t0 = time.time()
    target, draft, tok, eos = load_models(args.target, args.draft)
    K = draft.block_size - 1
    Wmax = max(budgets) - 1

    # per prompt: task, greedy length, q's top-Wmax (log q, sorted), chain-first candidates, greedy columns
    prompts = []
    for task, task_items in items.items():
        for item in task_items:
            ids = encode_prompt(tok, item.turns[0])
            gen = greedy_continuation(target, ids, args.max_new_tokens, eos)
            seq = ids + gen
            q = draft_q(target, draft, seq, len(ids) - 1)  # [A, K, V], A = len(gen)
            A = q.shape[0]
            vals, cand = q.topk(Wmax, dim=-1)  # column 0 = argmax (ties: topk's; the chain token)
            gt = torch.full((A, K), -1, dtype=torch.long)
            base = len(ids) - 1
            for a in range(A):
                for d in range(K):
                    p = base + a + d + 1
                    if p < len(seq):
                        gt[a, d] = seq[p]
            valid = gt >= 0
            hit = cand == gt[..., None]
            match = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(gt, -1))
            anchors = torch.tensor(seq[base: base + A])
            builder = {}
            for N in budgets:
                tree = build_tree(anchors, q, N)
                # the target's argmax at a node of depth d is the greedy token at depth d + 1 (-1: past the end)
                argmax = torch.cat([gt, gt.new_full((A, 1), -1)], 1).gather(1, tree.depth)
                builder[N] = verify_tree_greedy(tree.tokens, tree.parent, tree.depth, tree.anc, argmax,
                                                impl="torch")[1].tolist()
            prompts.append({"task": task, "A": A, "logq": vals.clamp(min=1e-30).log(), "match": match,
                            "valid": valid, "builder": builder})
            print(f"{task} {item.id if hasattr(item, 'id') else ''}: prompt {len(ids)} + {A} tokens "
                  f"({time.time() - t0:.0f} s)", flush=True)

    folds = [list(range(0, len(prompts), 2)), list(range(1, len(prompts), 2))]
    calib = {}
    for fi, fold in enumerate(folds):
        train = [prompts[i] for i in range(len(prompts)) if i not in fold]
        samples = calibration_samples([(p["logq"], p["match"], p["valid"]) for p in train], K)
        # b >= 0: the weight non-increasing in the column (the lazy expansion of best_first needs it)
        calib[fi] = {k: (a, max(b, 0.0)) for k, (a, b) in ((k, fit_platt(*v)) for k, v in samples.items())}

    def weight_table(p, policy, fi):
        """[A][K][2][Wmax] log weights (nested lists) of one prompt under a policy."""
        lq = p["logq"]  # [A, K, Wmax]
        if policy == "product":
            return torch.stack([lq, lq], 2).tolist()
        ab = torch.tensor([[calib[fi][(d, f)] for f in (0, 1)] for d in range(K)])  # [K, 2, 2]
        return torch.nn.functional.logsigmoid(ab[None, :, :, 0, None] + ab[None, :, :, 1, None] * lq[:, :, None]).tolist()

    per_task: dict = {}
    fold_of = {i: fi for fi, fold in enumerate(folds) for i in fold}
    for i, p in enumerate(prompts):
        A = p["A"]
        match = p["match"].tolist()
        chain_acc = []
        for a in range(A):
            n = 0
            for d in range(K):
                if match[a][d] == 0:
                    n += 1
                else:
                    break
            chain_acc.append(n)
        entries = {"chain": replay(chain_acc, A)}
        tables = {policy: weight_table(p, policy, fold_of[i]) for policy in ("product", "calibrated")}
        for N in budgets:
            entries[f"builder_N{N}"] = replay(p["builder"][N], A)
            for policy in ("product", "calibrated"):
                table = tables[policy]
                for forced in (True, False):
                    acc = []
                    for a in range(A):
                        nodes = best_first([[row[:N - 1] for row in dep] for dep in table[a]], N, forced)
                        acc.append(accepted_depth(nodes, match[a]))
                    entries[f"{policy}_{'forced' if forced else 'free'}_N{N}"] = replay(acc, A)
        t = per_task.setdefault(p["task"], {})
        for k, (tk, st) in entries.items():
            a = t.setdefault(k, [0, 0])
            a[0] += tk
            a[1] += st
        print(f"prompt {i}: " + ", ".join(f"{k} {tk / st:.2f}" for k, (tk, st) in entries.items()), flush=True)

    keys = list(next(iter(per_task.values())).keys())
    tau = {k: sum(per_task[t][k][0] / per_task[t][k][1] for t in per_task) / len(per_task) for k in keys}
    from dspine.provenance import provenance

    report = {
        **provenance([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
        "target": args.target, "draft": args.draft, "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens, "budgets": budgets,
        "mean_tau": tau,
        "tau_over_chain": {k: v / tau["chain"] for k, v in tau.items()},
        "per_task_tau": {t: {k: v[0] / v[1] for k, v in per_task[t].items()} for t in per_task},
        "calibration": {str(fi): {f"d{d + 1}_{'chain' if f == 0 else 'off'}": c[(d, f)] for d in range(K) for f in (0, 1)}
                        for fi, c in calib.items()},
        "seconds": time.time() - t0,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=1) + "\n")
    for k in keys:
        print(f"{k:28s} tau {tau[k]:.3f}  x chain {tau[k] / tau['chain']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
