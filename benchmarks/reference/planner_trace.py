"""The verify-budget planner replayed over a real draft's acceptance at T = 0, on the CPU (issue 16).

    python benchmarks/reference/planner_trace.py record --target models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft checkpoints/smollm2-135m-dspine --num-prompts 16 --max-new-tokens 512 \\
        --output results/planner-trace16-cpu.json [--resume]
    python benchmarks/reference/planner_trace.py replay results/planner-trace16-cpu.json \\
        --costs results/planner-exact2-h200-T0-c1.json,results/planner-sizes-h200-T0-c8.json \\
        [--plan-trees 32/64,16/32,32] [--times measured,table] [--output results/planner-replay16-cpu.json]

``record``: at T = 0 a lossless decoder emits the target's greedy output whatever it verifies, so one greedy
continuation per prompt fixes, at every anchor position ``a`` of it, what each verify mode would commit there
(``benchmarks/reference/tree_policy.py``: one teacher-forced draft pass gives the draft's distributions ``q [A, K, V]``
at every anchor). Per anchor it stores

- ``chain``: accepted draft tokens of the chain (the argmax tokens up to the first miss), at most K = block − 1;
- ``tree<N>``: accepted depth of the engine's best-first tree of N nodes (``dspine.tree.build_tree(chain_first=False)``,
  verified by ``dspine.ops.tree_verify.verify_tree_greedy``), and ``pair<N>``: the chain nodes on its accepted path
  (what ``infer.engine.Engine._decode_planned`` gives the planner as the chain's paired observation);
- ``conf``: the draft's chain confidence ``dspine.ops.plan_stats.chain_confidence`` of the argmax probabilities (what the engine
  gives the planner after a speculative step at T = 0).

Each prompt's row also holds its ``task``, ``id``, ``prompt_tokens`` and ``tokens`` (the output's length A). The trace
is written once, at the end, never over an existing file. Ctrl-C writes the prompts recorded so far, marked
``"interrupted": true`` (exit status 130); ``record ... --resume`` with the same arguments and that trace as
``--output`` records the rest: it refuses a missing or complete trace and one whose stored settings (target, draft,
tasks, num_prompts, max_new_tokens, budgets, block_size) or kept prompts (task, id, prompt_tokens, in record's order)
differ from this run's, naming the first field that does; it keeps the trace's prompts, records the others and writes
the whole trace over it atomically, rows in the order of a run never interrupted (a Ctrl-C again writes what it has,
marked, to be resumed again). ``seconds`` sums the runs' times, ``resumed`` counts the runs that resumed it and
``earlier_runs`` keeps each earlier run's command, date and commit; ``replay`` reads the rows alone, so it reads a
resumed trace as one never interrupted.

``replay``: drives ``infer.planner.StepPlanner`` over each task's prompts as ``Engine._decode_planned`` does at the
concurrency of the ``--costs`` run (:func:`batch_ms`: queue and refills, the pipelined observation, paired chain
tokens, confidence, the drain rule, the idle step in which a finish is seen), a warm-up pass per task and the
planner's memory across tasks as ``infer.bench`` keeps it. Step times are constants per mode from that H200 run
(:func:`step_times`; ``--times measured``: its planner labels' online estimates, ``table``: their start-up table).
Against it, on the same content and step times: every fixed mode and, at concurrency 1, the clairvoyant schedule
(dynamic programming over positions: the least time to emit the whole output choosing the mode at every step knowing
what each commits: an upper bound no causal planner reaches). Throughput per task is pooled tokens ÷ pooled step
milliseconds of its prompts (prefill and admission are not modelled); the mean is over tasks, as ``infer.bench``
reports.

Not a GPU measurement. What it isolates is the planner's choices: the content is one greedy output (the engine's exact
mode decodes the same), the step times are constants, and the draft runs in fp32 on the CPU (bf16 on the GPU
accepts somewhat differently).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import deque
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from benchmarks.reference import tree_policy as tp
from dspine.io import write_json_new
from dspine.paths import check_output_file

# ------------------------------------------------------------------------------------------------ record


def anchor_table(q: torch.Tensor, greedy: torch.Tensor, anchors: torch.Tensor, budgets: list[int]) -> dict:
    """What each verify mode commits at every anchor of one greedy output.

    Args:
        q: ``[A, K, V]`` fp32 draft distributions of depths 1..K at the A anchors.
        greedy: ``[A, K]`` int64, the greedy token at depth d + 1 after each anchor, -1 past the output's end.
        anchors: ``[A]`` int64, the anchor tokens (the tree roots).
        budgets: tree sizes N (nodes, root included).
    Returns ``{"chain": [A], "conf": [A], "tree<N>": [A], "pair<N>": [A]}`` as lists (module docstring).
    """
    from dspine.ops.plan_stats import chain_confidence
    from dspine.ops.tree_verify import verify_tree_greedy
    from dspine.tree import build_tree

    A, K, _ = q.shape
    top = q.max(-1)
    hit = (top.indices == greedy).int()
    out = {"chain": hit.cumprod(-1).sum(-1).tolist(),
           "conf": [round(float(c), 5) for c in chain_confidence(top.values)]}
    rows = torch.arange(A)
    for N in budgets:
        tree = build_tree(anchors, q, N, chain_first=False)
        argmax = torch.cat([greedy, greedy.new_full((A, 1), -1)], 1).gather(1, tree.depth)
        cur, depth, _ = verify_tree_greedy(tree.tokens, tree.parent, tree.depth, tree.anc, argmax, impl="torch")
        on_path = tree.anc[rows, cur]  # [A, N]: the accepted node's path, root included
        out[f"tree{N}"] = depth.tolist()
        out[f"pair{N}"] = ((on_path & tree.chain).sum(-1) - 1).tolist()
    return out


def record(args) -> int:
    """The ``record`` subcommand (module docstring): every argument and task checked before the models load; the
    trace written once at the end, never over an existing file. Ctrl-C writes the prompts recorded so far, with
    ``"interrupted": true`` (exit status 130). With ``--resume``, ``--output`` is such a trace: checked against these
    settings (:func:`check_resumable`), its prompts kept and the rest recorded, the whole trace written over it."""
    out_path = Path(args.output)
    old = read_resumable(out_path) if args.resume else None  # before the tasks load: a missing or complete file
    budgets, items = tp.check_run_args(args, resume=args.resume)  # every argument and task before the models load
    if old is not None:
        check_resumable(old, out_path, args, budgets, items)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    target, draft, tok, eos = tp.load_models(args.target, args.draft)
    prompts = []
    if old is not None:
        check_resumable_models(old, out_path, draft, tok, items)
        prompts = list(old["trace"]["prompts"])
    held = len(prompts)
    try:
        _record_prompts(args, items, budgets, target, draft, tok, eos, prompts, t0)
    except KeyboardInterrupt:  # the prompts recorded so far are complete: keep them, marked
        if len(prompts) == held:
            left = f"{out_path} is left as it was" if old is not None else "nothing was written"
            print(f"\ninterrupted: no prompt was recorded; {left}", file=sys.stderr)
            return 130
        where = _write_trace(args, out_path, draft, budgets, items, prompts, t0, old, interrupted=True)
        print(f"\ninterrupted: wrote the {len(prompts)} prompt(s) recorded to {where} (\"interrupted\": true; "
              "--resume records the rest)", file=sys.stderr)
        return 130
    _write_trace(args, out_path, draft, budgets, items, prompts, t0, old)
    return 0


def read_resumable(path: Path) -> dict:
    """``{"trace": the trace, "stat": (mtime_ns, size)}`` of an interrupted trace to resume (``--resume --output
    path``). Raises SystemExit naming ``path`` for a missing or unreadable file, one that is not a trace of record,
    and a complete one (nothing to resume)."""
    if not path.is_file():
        raise SystemExit(f"--resume: {path} is no file (give --output an interrupted trace of record)")
    try:
        st = path.stat()
        trace = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--resume: {path}: {e}") from None
    if (not isinstance(trace, dict) or not isinstance(trace.get("prompts"), list) or "interrupted" not in trace
            or not all(isinstance(row, dict) for row in trace["prompts"])):
        raise SystemExit(f"--resume: {path} is not a trace written by planner_trace.py record")
    if not trace["interrupted"]:
        raise SystemExit(f"--resume: {path} is a complete trace (\"interrupted\": false): nothing to resume")
    return {"trace": trace, "stat": (st.st_mtime_ns, st.st_size)}


def check_resumable(old: dict, path: Path, args, budgets: list[int], items: dict) -> None:
    """Refuse (SystemExit naming ``path`` and the first field that differs) to resume a trace recorded with other
    settings than these: every setting record stores (``tasks`` only where stored: traces before ``--resume`` lack
    it), then its prompts: each a prompt of record's order (task, and its ``id`` where stored) at its place."""
    trace = old["trace"]
    given = {"target": args.target, "draft": args.draft, "tasks": list(items), "num_prompts": args.num_prompts,
             "max_new_tokens": args.max_new_tokens, "budgets": budgets}
    for key, value in given.items():
        if (key in trace or key != "tasks") and trace.get(key) != value:
            raise SystemExit(f"--resume: {path} was recorded with {key} {trace.get(key)!r}, not {value!r}: resume it "
                             "with its own settings")
    order = [item for task_items in items.values() for item in task_items]
    if len(trace["prompts"]) > len(order):
        raise SystemExit(f"--resume: {path} holds {len(trace['prompts'])} prompts, more than these settings give "
                         f"({len(order)})")
    for i, (row, item) in enumerate(zip(trace["prompts"], order)):
        if row.get("task") != item.task or row.get("id", item.id) != item.id:
            raise SystemExit(f"--resume: {path}: prompts[{i}] is {row.get('task')} {row.get('id', '')} where "
                             f"record's order has {item.task} {item.id}: resume it with its own settings")


def check_resumable_models(old: dict, path: Path, draft, tok, items: dict) -> None:
    """After the models load: the draft's block size and every kept prompt's length in tokens are the trace's
    (another checkpoint under the same folder, another tokenizer or prompt text); SystemExit naming ``path`` and the
    field otherwise."""
    from dspine.prompts import encode_prompt

    trace = old["trace"]
    if trace.get("block_size") != draft.block_size:
        raise SystemExit(f"--resume: {path} was recorded with block_size {trace.get('block_size')!r}, not "
                         f"{draft.block_size} (the draft's): resume it with its own draft")
    order = [item for task_items in items.values() for item in task_items]
    for i, (row, item) in enumerate(zip(trace["prompts"], order)):
        n = len(encode_prompt(tok, item.turns[0]))
        if row.get("prompt_tokens") != n:
            raise SystemExit(f"--resume: {path}: prompts[{i}] ({item.task} {item.id}) has prompt_tokens "
                             f"{row.get('prompt_tokens')!r}, not {n}: resume it with its own prompts")


def _record_prompts(args, items, budgets, target, draft, tok, eos, prompts: list, t0: float) -> None:
    """Record the prompts of ``items`` after the first ``len(prompts)`` (in order: task by task), appending each
    finished row to ``prompts``."""
    from dspine.prompts import encode_prompt

    K = draft.block_size - 1
    order = [item for task_items in items.values() for item in task_items]
    for item in order[len(prompts):]:
        ids = encode_prompt(tok, item.turns[0])
        gen = tp.greedy_continuation(target, ids, args.max_new_tokens, eos)
        seq = ids + gen
        base = len(ids) - 1
        q = tp.draft_q(target, draft, seq, base)  # [A, K, V], A = len(gen)
        A = q.shape[0]
        pos = base + torch.arange(A)[:, None] + torch.arange(1, K + 1)[None]
        seq_t = torch.tensor(seq + [-1] * (K + 1))
        greedy = seq_t[pos]
        row = {"task": item.task, "id": item.id, "prompt_tokens": len(ids), "tokens": len(gen),
               **anchor_table(q, greedy, torch.tensor(seq[base: base + A]), budgets)}
        prompts.append(row)
        print(f"{item.task}: prompt {len(ids)} + {len(gen)} tokens, chain tau "
              f"{tp.replay(row['chain'], len(gen))[0] / tp.replay(row['chain'], len(gen))[1]:.2f} "
              f"({time.time() - t0:.0f} s)", flush=True)


def _write_trace(args, out_path: Path, draft, budgets, items, prompts, t0: float, old: dict | None = None,
                 interrupted: bool = False) -> Path:
    """Write the trace; returns where. A new one never goes over a file (one written since the start stays, and
    this goes beside it); a resumed one (``old``: :func:`read_resumable`) replaces the trace it resumed, atomically,
    unless that file changed since it was read (then it goes beside it). ``seconds`` adds the earlier runs';
    ``resumed`` counts the runs that resumed it and ``earlier_runs`` keeps each earlier run's command, date, commit
    and the trace's seconds and prompts when it stopped."""
    from dspine.provenance import provenance

    before = old["trace"] if old is not None else {}
    earlier = before.get("earlier_runs", []) + ([{k: before.get(k) for k in ("command", "date", "commit", "seconds")}
                                                 | {"prompts": len(before["prompts"])}] if old is not None else [])
    report = {
        **provenance([sys.argv[0]] + (args.argv if args.argv is not None else sys.argv[1:])),
        "target": args.target, "draft": args.draft, "tasks": list(items), "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens, "block_size": draft.block_size, "budgets": budgets,
        "seconds": round(before.get("seconds", 0.0) + time.time() - t0, 1), "interrupted": interrupted,
        "resumed": before.get("resumed", 0) + (old is not None), "earlier_runs": earlier, "prompts": prompts,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    same = False  # the resumed trace, unchanged since it was read: written over
    if old is not None:
        try:
            st = out_path.stat()
            same = (st.st_mtime_ns, st.st_size) == old["stat"]
        except OSError:
            pass
    return write_json_new(out_path, report, indent=None, allow_nan=True, replace=same, what="this trace is")


# ------------------------------------------------------------------------------------------------ replay


def committed(row: dict, mode, p: int) -> int:
    """Tokens a step of ``mode`` (``("ar", 1)``, ``("chain", n)``, ``("tree", N)``) commits at anchor ``p`` of a
    recorded prompt: accepted + 1 (the bonus), at most the mode's verify size and the tokens left."""
    left = row["tokens"] - p
    if mode[0] == "ar":
        return 1
    acc = row["chain"][p] if mode[0] == "chain" else row[f"tree{mode[1]}"][p]
    return min(acc + 1, mode[1], left)


def fixed_ms(row: dict, mode, true_ms: dict) -> tuple[int, float, int]:
    """(tokens, milliseconds, steps) of decoding a recorded prompt with ``mode`` at every step (the first token
    comes from the prefill, not counted)."""
    p, ms, steps = 1, 0.0, 0
    while p < row["tokens"]:
        p += committed(row, mode, p)
        ms += true_ms[mode]
        steps += 1
    return row["tokens"] - 1, ms, steps


def clairvoyant_ms(row: dict, modes, true_ms: dict) -> float:
    """Least milliseconds to decode a recorded prompt choosing the mode at every step knowing what each commits
    (dynamic programming from the end: ``best[p] = min_m ms(m) + best[p + committed(m, p)]``)."""
    A = row["tokens"]
    best = [0.0] * (A + 1)
    for p in range(A - 1, 0, -1):
        best[p] = min(true_ms[m] + best[p + committed(row, m, p)] for m in modes)
    return best[1] if A > 1 else 0.0


def batch_ms(rows: list[dict], B: int, true_ms: dict, verify: int, max_new: int, planner=None, mode=None,
             drain_every: int | None = None, plan_drain: bool = True, pair_trees: bool = True) -> tuple[int, float, int]:
    """(tokens, milliseconds, steps) of decoding recorded prompts at concurrency ``B``, either with one fixed
    ``mode`` at every step or with ``planner`` (a ``StepPlanner``), the way ``Engine._decode_planned`` runs it:

    - the prompts queue and take free slots in order; a request's first token comes from its prefill (not timed;
      a prompt whose output is that one token never decodes and is left out);
    - the host launches step k, then reads the snapshot taken after step k - 1: the planner chooses step k having
      observed steps up to k - 2, and a request that finishes in step k - 1 is seen after step k is launched, so its
      row idles in step k (which runs even when no other row is live) and its slot is refilled before step k + 1
      (one free slot is enough at B <= 16);
    - every step runs all B rows (a step's time is the mode's at batch B, idle rows included);
    - the observation of step j: the mean over its rows of their committed tokens; its time, except when a refill
      came between its launch and the snapshot that closes it (that interval holds a prefill); after a tree step
      the chain's paired tokens (mean of ``min(chain nodes on the accepted path + 1, chain size, committed)``) and, with
      ``pair_trees``, every smaller planner tree's (its recorded tokens at that anchor, capped by the step's); after a
      chain step every narrower planner chain's (the step's tokens capped at its width); after a speculative step but
      a narrower chain's the rows' mean confidence, given to the next choice (``None`` after any other observation);
    - with ``plan_drain`` (``Engine.plan_drain``) once the queue is empty, from the second choice on, every
      ``drain_every`` choices (default ``Engine.PLAN_DRAIN_EVERY``): the drain rule's state per
      slot holding a request or statistics, as of the last snapshot read: ``(max_new - committed, chain tokens, chain
      steps, chain tokens²)`` (its chain-equivalent tokens: chain steps, a narrower chain's but under drain model
      ``"own"``, and the chain nodes of tree steps;
      ``max_new - 1`` for a request admitted since; 0 for one finished by then).
    """
    if drain_every is None:
        from infer.engine import Engine

        drain_every = Engine.PLAN_DRAIN_EVERY
    rows = [r for r in rows if r["tokens"] > 1]
    chains = [m for m in planner.table if m[0] == "chain"] if planner is not None else []
    cap = max((m[1] for m in chains), default=0)
    # trees paired inside a larger tree's step, smallest first (Engine._decode_planned: plan_nested)
    nested = sorted(m for m in planner.table if m[0] == "tree") if planner is not None and pair_trees else []
    queue = deque(range(len(rows)))
    owner: list = [None] * B
    pos = [0] * B  # next anchor of the slot's request after the steps launched; its committed tokens = pos
    seen = [0] * B  # the same as of the last snapshot read (what the engine's drain knows)
    stats = [[0, 0, 0] for _ in range(B)]  # chain-equivalent tokens, steps, tokens² (the drain rule)
    launched: deque = deque()  # [mode, {slot: (owner, committed, paired, conf, finished)}, timed]
    predicted, drain_age, ms, steps, first = None, 0, 0.0, 0, True

    def live(b):
        return owner[b] is not None and pos[b] < rows[owner[b]]["tokens"]

    def admit() -> bool:
        took = False
        for b in range(B):
            if owner[b] is None and queue:
                owner[b], pos[b], seen[b], stats[b], took = queue.popleft(), 1, 1, [0, 0, 0], True
        return took

    admit()
    while any(o is not None for o in owner) or launched:
        did = any(o is not None for o in owner)  # the host launches while it knows of a request not finished
        if did:
            if planner is None:
                m = mode
            else:
                drain = None
                if plan_drain and not queue and not first and drain_age % drain_every == 0:
                    # every slot in slot order, as the engine gives them (drain model "persist" matches by position)
                    drain = [(max_new - seen[b] if owner[b] is not None and seen[b] < rows[owner[b]]["tokens"] else 0,
                              *stats[b]) for b in range(B)]
                m = planner.choose(predicted, drain)
                if drain is not None or drain_age:
                    drain_age += 1
            first = False
            step = {}
            for b in range(B):
                if live(b):
                    r = rows[owner[b]]
                    n = committed(r, m, pos[b])
                    pair = min(r[f"pair{m[1]}"][pos[b]] + 1, n) if m[0] == "tree" else None
                    # the smaller planner trees inside this one: their accepted path is this tree's within their nodes
                    inner = {t: min(committed(r, t, pos[b]), n) for t in nested if m[0] == "tree" and t[1] < m[1]}
                    step[b] = (owner[b], n, pair, r["conf"][pos[b]], pos[b] + n >= r["tokens"], inner)
                    pos[b] += n
            launched.append([m, step, True])
            ms += true_ms[m]
            steps += 1
        if len(launched) > 1 or (launched and not did):  # step k - 1 after step k is launched; the rest at the end
            m0, step, timed = launched.popleft()
            for b, v in step.items():
                if owner[b] == v[0]:
                    seen[b] += v[1]
            if planner is not None:
                predicted = None
                if step:
                    planner.observe(m0, sum(v[1] for v in step.values()) / len(step),
                                    true_ms[m0] if timed else None, len(step))
                    if m0[0] != "ar":
                        narrow = m0[0] == "chain" and m0[1] < cap  # a chain below the planner's widest
                        if m0[0] == "tree":
                            for c in chains:
                                if min(verify - 1, m0[1] - 1) >= c[1] - 1:
                                    x = sum(min(v[2], c[1]) for v in step.values()) / len(step)
                                    planner.observe_paired(c, x, len(step))
                            for t in nested:
                                if t[1] < m0[1]:
                                    planner.observe_paired(t, sum(v[5][t] for v in step.values()) / len(step),
                                                           len(step))
                        else:  # a chain's first n slots are the chain of n (Engine._decode_planned)
                            for c in sorted(c for c in chains if c[1] < m0[1]):
                                planner.observe_paired(c, sum(min(v[1], c[1]) for v in step.values()) / len(step),
                                                       len(step))
                        for b, v in step.items():
                            if narrow and planner.drain_model == "own":
                                continue  # "own" reads a request against the full chain (Engine._decode_planned)
                            d = v[1] if m0[0] == "chain" else min(v[2], cap or v[2])
                            stats[b][0] += d
                            stats[b][1] += 1
                            stats[b][2] += d * d
                        if not narrow:  # a narrow chain's confidence: not given
                            predicted = {k: sum(v[3] for v in step.values()) / len(step)
                                         for k in planner.table if k[0] != "ar"}
                else:
                    planner.skip()
            # requests that finished in that step are seen now: their slots are refilled before the next step, and
            # the step in flight is observed without a time (its closing snapshot comes after the prefill)
            for b, v in step.items():
                if v[4] and owner[b] == v[0]:
                    owner[b] = None
            if admit() and launched:
                launched[-1][2] = False
    return sum(r["tokens"] - 1 for r in rows), ms, steps


class NoStepTime(SystemExit):
    """A planner mode the ``--costs`` run has no step time for: ``replay`` skips that point and records why."""


def load_json(path: str, what: str) -> dict:
    """A JSON object from ``path``; SystemExit naming the file (and ``what`` it should be) if it is missing or not
    a JSON object."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file ({what})") from None
    except (OSError, ValueError) as e:
        raise SystemExit(f"{path}: not readable as JSON ({what}): {e}") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a JSON object ({what})")
    return data


def step_times(path: str, label: str) -> tuple[dict, dict]:
    """:func:`_step_times`, with a file of another structure refused by name instead of a traceback."""
    try:
        return _step_times(path, label)
    except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise SystemExit(f"{path}: not an infer.bench result this tool can read ({type(e).__name__}: {e})") from None


def _step_times(path: str, label: str) -> tuple[dict, dict]:
    """(start-up table, measured step ms) per mode from an ``infer.bench`` JSON of the device.

    Every label with ``planner_choices`` (a ``budget=auto`` run) gives its modes' ``step_ms`` (the start-up table)
    and ``measured_ms`` (the online estimate after its steps), pooled over tasks weighted by steps; ``label``'s own
    values take precedence. At concurrency 1 a fixed tree label (``verify: tree``) of a size no planner ran gives its
    time as its seconds per verify step scaled by the nearest measured tree's ratio of measured ms to that tree's
    fixed label's seconds per step (prefill and admissions cancel out). At higher concurrency a fixed label's
    ``verify_steps`` count request steps, not engine steps, so no time is derived there. Raises SystemExit naming
    the file and field for a file that is not an infer.bench result or has no planner ``label``."""
    import re

    run = load_json(path, "--costs: an infer.bench --output-json result")
    tasks = run.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise SystemExit(f"{path}: no 'tasks' list: not an infer.bench --output-json result")
    run_args = run.get("args") or {}
    conc = int(run_args.get("max_batch") or run_args.get("concurrency") or 1)  # the batch its steps ran at
    pooled: dict = {}  # (is label, mode) -> [Σ w·measured, Σ w, Σ w·table]
    per_step: dict = {}  # fixed tree size -> [seconds, verify steps], pooled over tasks
    found = False
    for ti, task in enumerate(tasks):
        for name, d in (task.get("drafts") or {}).items():
            where = f"{path}: tasks[{ti}].drafts.{name}"
            if "planner_choices" in d:
                found |= name == label
                for k, v in d["planner_choices"].items():
                    m = re.fullmatch(r"([a-z]+)(\d*)", k)
                    if m is None or not isinstance(v, dict) or "step_ms" not in v or "measured_ms" not in v:
                        raise SystemExit(f"{where}.planner_choices.{k}: expected a mode name with step_ms and measured_ms")
                    mode = (m.group(1), int(m.group(2) or 1))
                    if v["measured_ms"] is None:
                        continue
                    if not (float(v["measured_ms"]) > 0 and float(v["step_ms"]) > 0):
                        raise SystemExit(f"{where}.planner_choices.{k}: step_ms and measured_ms must be positive")
                    w = max(int(v.get("steps") or 0), 1)
                    acc = pooled.setdefault((name == label, mode), [0.0, 0, 0.0])
                    acc[0] += w * v["measured_ms"]
                    acc[1] += w
                    acc[2] += w * v["step_ms"]
            elif d.get("verify") == "tree" and isinstance(d.get("verified_tokens_per_step"), int):
                if d.get("verify_steps") and d.get("seconds"):
                    acc = per_step.setdefault(d["verified_tokens_per_step"], [0.0, 0])
                    acc[0] += d["seconds"]
                    acc[1] += d["verify_steps"]
    if not found:
        names = sorted({n for t in tasks for n, d in (t.get("drafts") or {}).items() if "planner_choices" in d})
        raise SystemExit(f"{path}: no label {label!r} with planner_choices (labels run with budget=auto: "
                         f"{', '.join(names) or 'none'}; choose one with --label)")
    table, measured = {}, {}
    for (_own, mode), (x, w, t) in sorted(pooled.items(), key=lambda kv: kv[0][0]):  # the label's last: it wins
        measured[mode], table[mode] = x / w, t / w
    if conc == 1:
        for N, (sec, n) in per_step.items():
            mode = ("tree", N)
            ref = min((m for m in measured if m[0] == "tree" and m[1] in per_step), key=lambda m: abs(m[1] - N),
                      default=None)
            if mode not in measured and ref is not None:
                rs, rn = per_step[ref[1]]
                measured[mode] = (sec / n) / (rs / rn) * measured[ref]
                table[mode] = measured[mode] * table[ref] / measured[ref]
    return table, measured


def replay_point(trace: dict, costs: str, label: str, plan_trees: str, concurrency: int | None = None,
                 plan_drain: bool = True, times: str = "measured", pair_trees: bool = True, plan_chains: str = "none",
                 repeat: int = 1, mix: bool = False, **planner_args) -> dict:
    """One point: the planner (trees ``plan_trees``, infer.planner.parse_plan_trees; ``planner_args`` to
    ``StepPlanner``), every fixed mode with a step time and (at concurrency 1) the clairvoyant schedule over
    ``trace``, with the step times of the ``infer.bench`` JSON ``costs`` at ``concurrency`` (default: that run's).
    Per task tok/s, pooled over its prompts; the mean over tasks. ``times``: the true step time of a mode is the
    run's online estimate after its steps (``"measured"``: what the planner saw, flushes and host waits included)
    or its start-up table (``"table"``: graph replays of the bare step). Raises SystemExit naming the file for a tree
    the trace did not record, :class:`NoStepTime` for a planner mode without a step time or a concurrency the run
    did not measure. ``pair_trees``: a tree step gives the smaller planner trees' tokens too (``batch_ms``).
    ``plan_chains``: the planner's chains narrower than the trace's block (infer.planner.parse_plan_chains, ``"none"``:
    the full chain only, the replay before 2026-12-07; the engine's default is ``Engine.PLAN_CHAINS`` below its verify
    width), each also a fixed mode. ``repeat``: each task's prompts decoded ``repeat`` times over (copies queued
    after the originals), so that a trace of few prompts fills a batch of a larger run's concurrency: the batch then
    holds each recorded acceptance ``repeat`` times, less spread than as many distinct prompts."""
    from infer.datasets import interleave
    from infer.planner import StepPlanner, parse_plan_chains, parse_plan_trees

    run_args = load_json(costs, "--costs: an infer.bench --output-json result").get("args") or {}
    if not isinstance(run_args, dict):
        raise SystemExit(f"{costs}: 'args' is not an object: not an infer.bench --output-json result")
    try:
        # the batch its steps ran at: infer.bench's max_batch, below --concurrency when no task had as many prompts
        run_conc = int(run_args.get("max_batch") or run_args.get("concurrency") or 1)
    except (TypeError, ValueError):
        raise SystemExit(f"{costs}: args.concurrency={run_args.get('concurrency')!r} is not an integer") from None
    B = concurrency or run_conc
    if B != run_conc:
        raise NoStepTime(f"{costs}: its step times are at concurrency {run_conc}, not {B}")
    table, true_ms = step_times(costs, label)
    if times == "table":
        true_ms = dict(table)
    recorded = [("tree", N) for N in trace["budgets"]]
    verify, max_new = trace["block_size"], trace["max_new_tokens"]
    narrow = [("chain", n) for n in parse_plan_chains(plan_chains)]
    if any(n >= verify for _, n in narrow):
        raise SystemExit(f"--plan-chains {plan_chains}: each width must be below the trace's block of {verify}")
    plan = [("ar", 1), *narrow, ("chain", verify)] + [("tree", N) for N in parse_plan_trees(plan_trees)]
    not_recorded = [m for m in plan if m[0] == "tree" and m not in recorded]
    if not_recorded:
        raise SystemExit(f"--plan-trees {plan_trees}: the trace records trees {trace['budgets']}, not "
                         f"{[n for _, n in not_recorded]} (record with --budgets holding them)")
    missing = [m for m in plan if m not in true_ms]
    if missing:
        raise NoStepTime(f"{costs}: no step time for {missing} at concurrency {run_args.get('concurrency', 1)} "
                         "(a planner label of that run must have run it, or at concurrency 1 a fixed tree of that size)")
    fixed = [m for m in [("ar", 1), *narrow, ("chain", verify)] + recorded if m in true_ms]
    tasks: dict = {}
    for _ in range(repeat):
        for row in trace["prompts"]:
            if row["tokens"] > 1:  # a prompt whose output is its prefill's token alone never decodes
                tasks.setdefault(row["task"], []).append(row)
    if not tasks:
        raise SystemExit("the trace has no prompt with more than one output token")
    if mix:  # one stream with the tasks' prompts taken in turn: every batch mixes them, as a server's does
        tasks = {"mixed": interleave(list(tasks.values()))}
    short = {t: len(r) for t, r in tasks.items() if len(r) < B}
    if short:  # Engine.generate runs min(concurrency, prompts) slots: step times of another batch size
        raise NoStepTime(f"{costs}: concurrency {B}, but the trace has fewer decoding prompts for {short}: the engine "
                         "would run a smaller batch, whose step times that run did not measure")
    per_task, cost_state, token_state, counts = {}, None, None, {}
    for task, rows in tasks.items():
        out = {}
        for m in fixed:
            tok, x, _ = batch_ms(rows, B, true_ms, verify, max_new, mode=m)
            out[f"{m[0]}{m[1]}"] = tok / x * 1e3
        if B == 1:
            tok = sum(r["tokens"] - 1 for r in rows)
            idle = min(true_ms[m] for m in fixed)  # the step in which a finish is seen: the cheapest mode
            out["clairvoyant"] = tok / sum(clairvoyant_ms(r, fixed, true_ms) + idle for r in rows) * 1e3
        # infer.bench runs every task once untimed first; the engine carries its planner's cost model and
        # acceptance from one call to the next, and infer.bench restores the acceptance after the warm-up pass, so
        # the timed pass learns from the tasks before it, not from its own prompts (infer.planner, "Across calls")
        before = token_state
        for _pass in ("warmup", "timed"):
            planner = StepPlanner({m: table[m] for m in plan}, **planner_args)
            if cost_state is not None:
                planner.load_cost_state(cost_state)
            if before is not None:
                planner.load_token_state(before)
            tok, x, _ = batch_ms(rows, B, true_ms, verify, max_new, planner=planner, plan_drain=plan_drain,
                                 pair_trees=pair_trees)
            cost_state, token_state = planner.cost_state(), planner.token_state()
        out["planner"] = tok / x * 1e3
        for m, n in planner.choices.items():
            counts[f"{m[0]}{m[1]}"] = counts.get(f"{m[0]}{m[1]}", 0) + n
        per_task[task] = out
    mean = {k: sum(t[k] for t in per_task.values()) / len(per_task) for k in next(iter(per_task.values()))}
    best = max((k for k in mean if k not in ("planner", "clairvoyant")), key=mean.get)
    return {
        "costs": costs, "concurrency": B, "plan_trees": plan_trees, "plan_chains": plan_chains, "repeat": repeat, "mix": mix,
        "plan_drain": plan_drain, "times": times,
        "pair_trees": pair_trees,
        "exact": bool(run_args.get("exact")),
        "fixed_without_step_time": [f"{m[0]}{m[1]}" for m in [("chain", verify)] + recorded if m not in true_ms],
        "true_ms": {f"{m[0]}{m[1]}": round(v, 4) for m, v in sorted(true_ms.items())},
        "table_ms": {f"{m[0]}{m[1]}": round(v, 4) for m, v in sorted(table.items())},
        "tok_per_s": mean, "best_fixed": best, "planner_over_best_fixed": mean["planner"] / mean[best],
        "planner_over_ar": mean["planner"] / mean["ar1"],
        "clairvoyant_over_best_fixed": mean["clairvoyant"] / mean[best] if "clairvoyant" in mean else None,
        "planner_steps_timed": counts, "per_task_tok_per_s": per_task,
    }


def model_list(text: str, flag: str, allowed) -> list[str]:
    """``"a,b,a"`` -> ``["a", "b"]`` (in order, no repeats): a comma-separated flag of planner models. Raises
    SystemExit naming ``flag``, the text and the ``allowed`` values for one outside them."""
    items = list(dict.fromkeys(x.strip() for x in text.split(",")))
    if any(x not in allowed for x in items):
        raise SystemExit(f"{flag} {text!r}: {', '.join(allowed)}, comma-separated")
    return items


def given_once(items: list[str], flag: str, key=lambda x: x) -> list[str]:
    """``items`` of a comma-separated flag, each given once (``key``: what makes two the same); SystemExit naming
    ``flag`` and the repeated item otherwise: a repeat would compute and write the same point twice."""
    seen: dict = {}
    for x in items:
        if key(x) in seen:
            raise SystemExit(f"{flag}: {x!r} repeats {seen[key(x)]!r} (the same point twice)")
        seen[key(x)] = x
    return items


def replay(args) -> int:
    """The ``replay`` subcommand (module docstring): all inputs read and checked before any point is computed; one
    point per (step-time source, costs file, tree set); points the run cannot time are skipped with the reason."""
    from dspine.provenance import provenance
    from infer.planner import (
        DRAIN_MODELS,
        PLAN_STATES,
        parse_conf_slope,
        parse_plan_chains,
        parse_plan_trees,
    )

    out_path = Path(args.output) if args.output is not None else None
    if out_path is not None:  # a folder, an existing file without --overwrite, a parent that is no writable folder
        try:
            check_output_file("--output", args.output, args.overwrite)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    replaces = out_path is not None and out_path.exists()  # with --overwrite: replaced; any other file never is
    # 1,024 copies of one prompt fill a batch of 1,024; --repeat 1e9 built rows, silent, until out of memory
    if not 1 <= args.repeat <= 1024:
        raise SystemExit(f"--repeat {args.repeat}: must be 1 to 1024")
    if args.concurrency is not None and args.concurrency < 1:
        raise SystemExit(f"--concurrency {args.concurrency}: must be at least 1")
    costs_list = [c.strip() for c in args.costs.split(",") if c.strip()]
    trees_list = [t.strip() for t in args.plan_trees.split(",")]
    if not costs_list:
        raise SystemExit("--costs: give at least one infer.bench JSON")
    for t in trees_list:
        try:
            parse_plan_trees(t)
        except ValueError as e:
            raise SystemExit(f"--plan-trees: {e}") from None
    given_once(costs_list, "--costs", lambda c: Path(c).resolve())
    given_once(trees_list, "--plan-trees", lambda t: tuple(sorted(parse_plan_trees(t))))
    try:
        parse_plan_chains(args.plan_chains)
    except ValueError as e:
        raise SystemExit(f"--plan-chains: {e}") from None
    try:
        slopes = list(dict.fromkeys(parse_conf_slope(x.strip()) for x in args.conf_slope.split(",")))  # no repeats
    except ValueError as e:
        raise SystemExit(f"--conf-slope: {e}") from None
    if out_path is not None:
        inputs = {Path(x).resolve() for x in [args.trace, *costs_list]}
        if out_path.resolve() in inputs:
            raise SystemExit(f"--output {out_path} is one of the inputs: choose another file")
    trace = load_json(args.trace, "a trace written by planner_trace.py record")
    if not trace.get("prompts") or not trace.get("budgets") or not trace.get("block_size"):
        raise SystemExit(f"{args.trace}: needs non-empty 'prompts', 'budgets' and 'block_size' "
                         "(a trace written by planner_trace.py record)")
    if trace.get("interrupted"):
        print(f"note: {args.trace} is an interrupted recording: {len(trace['prompts'])} prompt(s), not "
              f"{trace.get('num_prompts')} per task", file=sys.stderr)
    keys = ["task", "tokens", "chain", "conf"] + [f"{k}{n}" for n in trace["budgets"] for k in ("tree", "pair")]
    for i, row in enumerate(trace["prompts"]):
        bad = [k for k in keys if k not in row] or [
            k for k in keys[2:] if not isinstance(row[k], list) or len(row[k]) != row["tokens"]]
        if bad:
            raise SystemExit(f"{args.trace}: prompts[{i}] lacks or mis-sizes {bad} (a trace written by record)")
    for costs in costs_list:  # every file readable before any point is computed
        step_times(costs, args.label)
    times_list = [t.strip() for t in args.times.split(",")]
    if not times_list or any(t not in ("measured", "table") for t in times_list):
        raise SystemExit(f"--times {args.times!r}: measured, table or both, comma-separated")
    given_once(times_list, "--times")
    drain_models = model_list(args.drain_model, "--drain-model", DRAIN_MODELS)
    pairs = [x.strip() for x in args.pair_trees.split(",")]
    if not pairs or any(x not in ("on", "off") for x in pairs):
        raise SystemExit(f"--pair-trees {args.pair_trees!r}: on, off or both, comma-separated")
    given_once(pairs, "--pair-trees")
    for spec in args.tree_like or []:
        try:
            big, small = (int(x) for x in spec.split("="))
        except ValueError:
            raise SystemExit(f"--tree-like {spec!r}: expected N=M, two tree sizes of the trace") from None
        if big not in trace["budgets"] or small not in trace["budgets"] or small >= big:
            raise SystemExit(f"--tree-like {spec}: the trace records trees {trace['budgets']}; give N=M with M < N of them")
        for row in trace["prompts"]:  # the larger tree commits what the smaller one does (and pairs its chain alike)
            row[f"tree{big}"], row[f"pair{big}"] = list(row[f"tree{small}"]), list(row[f"pair{small}"])
    points, skipped = [], []
    states = model_list(args.state, "--state", PLAN_STATES)
    knobs = (slopes, pairs, drain_models, states)
    firsts = (times_list[0], *(k[0] for k in knobs))
    for times, costs, plan_trees, slope, pair, dm, st in itertools.product(times_list, costs_list, trees_list, *knobs):
        try:
            pt = replay_point(trace, costs, args.label, plan_trees, args.concurrency, args.plan_drain, times,
                              pair_trees=pair == "on", plan_chains=args.plan_chains, repeat=args.repeat,
                              mix=args.mix, conf_slope=slope, drain_model=dm, state=st)
        except NoStepTime as e:
            if (times, slope, pair, dm, st) == firsts:  # a skip is reported once per costs file and tree set
                print(f"skipped: {e}", flush=True)
                skipped.append({"costs": costs, "plan_trees": plan_trees, "why": str(e)})
            continue
        points.append(pt)
        pt["conf_slope"], pt["drain_model"], pt["state"] = slope, dm, st
        print(f"{times} {costs} c{pt['concurrency']} trees {plan_trees} conf_slope {slope} pair_trees {pair} "
              f"drain_model {dm} state {st}: "
              f"planner / best fixed ({pt['best_fixed']}) "
              f"{pt['planner_over_best_fixed']:.4f}, / AR {pt['planner_over_ar']:.3f}; clairvoyant / best "
              f"{pt['clairvoyant_over_best_fixed'] or float('nan'):.4f}; steps {pt['planner_steps_timed']}", flush=True)
    if not points:
        raise SystemExit("every point was skipped (reasons above): no result written")
    report = {
        **provenance([sys.argv[0]] + (args.argv if args.argv is not None else sys.argv[1:])),
        "simulated": True, "trace": args.trace, "trace_commit": trace.get("commit"),
        "trace_interrupted": bool(trace.get("interrupted")), "tree_like": args.tree_like or [],
        "trace_prompts_per_task": trace.get("num_prompts"), "max_new_tokens": trace.get("max_new_tokens"),
        "points": points, "skipped": skipped,
    }
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # over a file there at the start only with --overwrite; one written since goes beside it, with a note
        write_json_new(out_path, report, indent=1, allow_nan=True, replace=replaces, what="these points are")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="greedy outputs and per-anchor acceptance of every mode (slow: the models run)")
    tp.add_run_args(r, num_prompts=6, max_new_tokens=512, budgets="16,32,64", budgets_help="tree sizes to record")
    r.add_argument("--resume", action="store_true",
                   help="--output is an interrupted trace of record with these settings: keep its prompts, record "
                        "the rest and write the whole trace over it")
    r = sub.add_parser("replay", help="the planner, the fixed modes and the clairvoyant schedule over a trace")
    r.add_argument("trace", help="a JSON written by record")
    r.add_argument("--costs", required=True,
                   help="infer.bench JSON(s) of the device with a planner label, comma-separated: one point each")
    r.add_argument("--label", default="p", help="the planner's label in --costs")
    r.add_argument("--concurrency", type=int, default=None,
                   help="requests decoded together (default: the --costs run's; its step times are at that batch)")
    r.add_argument("--plan-trees", default="16/32",
                   help="the planner's tree sizes (infer.planner.parse_plan_trees), comma-separated: one point each")
    r.add_argument("--plan-chains", default="none",
                   help="the planner's chains narrower than the trace's block, e.g. 2/4/8 (infer.planner."
                        "parse_plan_chains; default none: the full chain only); each is a fixed mode too")
    r.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="decode each task's prompts K times over (a trace of 16 prompts a task at a concurrency-64 "
                        "run's step times: --repeat 4); 1 to 1024, default 1")
    r.add_argument("--times", default="measured",
                   help="true step time per mode: the run's online estimate after its steps (measured) or its start-up "
                        "table of bare graph replays (table); 'measured,table' gives every point under both")
    r.add_argument("--conf-slope", default="auto",
                   help="the planner's conf_slope (infer.planner.parse_conf_slope: auto, or 0..2 with 1 the rule before "
                        "2026-12-05), comma-separated: one point each")
    r.add_argument("--plan-drain", action=argparse.BooleanOptionalAction, default=True,
                   help="the drain rule once no prompt is queued (Engine.plan_drain; default on)")
    r.add_argument("--drain-model", default="persist",
                   help="the planner's drain model (infer.planner.DRAIN_MODELS; default persist, the engine's), "
                        "comma-separated: one point each")
    r.add_argument("--state", default="steps",
                   help="the planner's state (infer.planner.PLAN_STATES; default steps, the engine's), comma-separated: "
                        "one point each (the step times here are constants: kv's term has no context to price, "
                        "rows_kv's request weights act)")
    r.add_argument("--pair-trees", default="on",
                   help="a tree step gives the planner the smaller planner trees' tokens as paired observations "
                        "(Engine.plan_nested; default on); 'on,off' gives every point under both")
    r.add_argument("--tree-like", action="append", metavar="N=M",
                   help="replay tree N with tree M's recorded acceptance, applied in the order given (a draft whose "
                        "larger tree gains nothing at a higher step price); repeatable")
    r.add_argument("--mix", action="store_true",
                   help="one task 'mixed': the tasks' prompts taken in turn, so every batch mixes them (a server's "
                        "traffic; infer.bench runs each task alone)")
    r.add_argument("--output", default=None)
    r.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    args.argv = argv
    return record(args) if args.cmd == "record" else replay(args)


if __name__ == "__main__":
    raise SystemExit(main())
