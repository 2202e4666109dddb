"""Drop training rows that overlap the evaluation sets, and duplicate prompts.

    python -m data.decontaminate --input runs/x/prepared/train.jsonl --output runs/x/clean \\
        [--eval-dir DIR] [--tasks gsm8k,math500,humaneval,mbpp,mt-bench] [--ngram 13]

A row is *contaminated* when any n-gram of its text (every turn, prompt and original answer) equals
an n-gram of an eval item's question or reference answer (`infer.datasets.reference_texts`). Text
is compared as lowercase alphanumeric words (punctuation and whitespace ignored), with n = 13 words
as in the GPT-3 contamination study (Brown et al. 2020, appendix C); an eval text shorter than n
words is matched as a whole if it has at least 8 (shorter ones, such as HumanEval's `return x + y`,
are generic code, not contamination). A row whose first user turn repeats an earlier row's (same words) is a
*duplicate*: regeneration would give it the same answer.

DIR receives `train.jsonl` (kept rows, input order), `dropped.jsonl` (each dropped row with its
`reason` and the matching task, item id and words), and `summary.json` (rows read / kept /
contaminated per task / duplicates; kept + dropped = read). A finished DIR is never overwritten:
a second run with the same arguments prints the summary, with other arguments it is refused. An
input without a single valid row (empty, or every line invalid) is an error: no summary.json and
no train.jsonl are written (dropped.jsonl keeps the reasons), so a corrected rerun is not refused.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

from data.rows import JsonlAppender, atomic_write_json, file_digest, iter_jsonl
from data.schema import RowError, check_row
from dspine.io import folder_lock
from dspine.paths import read_json_object

DEFAULT_TASKS = "gsm8k,math500,humaneval,mbpp,mt-bench"
MIN_WHOLE = 8  # eval texts shorter than this (and than n) are not matched
_WORD = re.compile(r"[a-z0-9]+")


class NoValidRows(Exception):
    """The input holds no valid row (it is empty or every line is invalid); nothing final was written."""


def words(text: str) -> list[str]:
    """Lowercase alphanumeric words of ``text``."""
    return _WORD.findall(text.lower())


def _key(ws) -> int:
    # Python's tuple hash: 64-bit, consistent within the process (the index never leaves it)
    return hash(tuple(ws))


class EvalIndex:
    """Hashed n-grams of every eval text: ``key -> (task, item id, words)``."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"--ngram {n}: must be >= 1")
        self.n = n
        self.grams: dict[int, tuple[str, str, str]] = {}
        self.short_lengths: set[int] = set()  # lengths of eval texts shorter than n, matched whole
        self.items: Counter = Counter()

    def add(self, task: str, item_id: str, text: str) -> None:
        ws = words(text)
        if not ws:
            return
        self.items[task] += 1
        if len(ws) < min(self.n, MIN_WHOLE):
            return
        if len(ws) < self.n:
            self.short_lengths.add(len(ws))
            self.grams.setdefault(_key(ws), (task, item_id, " ".join(ws)))
            return
        for i in range(len(ws) - self.n + 1):
            g = ws[i : i + self.n]
            self.grams.setdefault(_key(g), (task, item_id, " ".join(g)))

    def match(self, text: str) -> tuple[str, str, str] | None:
        """The first eval n-gram found in ``text`` (task, item id, words), or None."""
        ws = words(text)
        for n in (self.n, *sorted(self.short_lengths)):
            for i in range(len(ws) - n + 1):
                hit = self.grams.get(_key(ws[i : i + n]))
                if hit is not None:
                    return hit
        return None


def build_index(tasks: list[str], n: int, eval_dir: str | None) -> EvalIndex:
    """The index over every row of ``tasks`` (raises FileNotFoundError / ValueError naming the task)."""
    from infer.datasets import load_eval_rows, reference_texts, task_name

    index = EvalIndex(n)
    for name in tasks:
        task = task_name(name)
        for i, row in enumerate(load_eval_rows(task, eval_dir)):
            item = str(row.get("task_id", row.get("unique_id", row.get("question_id", i))))
            for text in reference_texts(task, row):
                index.add(task, item, text)
    return index


def decontaminate(input_path: str, output: str, tasks: list[str], n: int, eval_dir: str | None) -> dict:
    """Runs the filter (see the module docstring) and returns the summary.

    Raises:
        FileNotFoundError: the input or an eval set is missing.
        ValueError: DIR is a file, holds the input or holds a finished run with other arguments.
        NoValidRows: the input is empty or every row of it is invalid.
    """
    src = Path(input_path)
    if not src.is_file():
        raise FileNotFoundError(f"--input {src}: no such file")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output {out} is a file, expected a folder")
    if src.resolve().parent == out.resolve():  # an unfinished run starts over by deleting train.jsonl / dropped.jsonl
        raise ValueError(f"--input {src} is inside --output {out}; choose another --output folder")
    args = {"input": str(src.resolve()), "input_digest": file_digest(src), "tasks": tasks, "ngram": n,
            "eval_dir": str(Path(eval_dir).resolve()) if eval_dir else None}
    summary_path = out / "summary.json"
    index = build_index(tasks, n, eval_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out):  # a second run on this folder is refused: it took the files of a run in progress
        if summary_path.exists():
            done = read_json_object(summary_path, "a data.decontaminate summary")
            if done.get("args") != args:
                raise ValueError(f"{out} holds a finished run with other arguments ({done.get('args')}); "
                                 "choose another --output")
            return done
        for name in ("train.jsonl", "dropped.jsonl"):  # a killed run starts over: nothing is final yet
            (out / name).unlink(missing_ok=True)
        seen: set[int] = set()
        stats: Counter = Counter()
        per_task: Counter = Counter()
        # buffered: one durable write per 2,000 rows, not one per row
        keep: list[dict] = []
        drop: list[dict] = []
        first_invalid = None
        with JsonlAppender(out / "train.jsonl") as keep_file, JsonlAppender(out / "dropped.jsonl") as drop_file:
            for i, row in enumerate(iter_jsonl(src)):
                if len(keep) + len(drop) >= 2000:
                    keep_file.write(keep)
                    drop_file.write(drop)
                    keep.clear()
                    drop.clear()
                stats["read"] += 1
                try:
                    if isinstance(row, RowError):
                        raise row
                    _, turns = check_row(row)
                except RowError as e:
                    stats["invalid"] += 1
                    first_invalid = first_invalid or str(e)
                    drop.append({"line": i + 1, "reason": f"invalid: {e.code}", "detail": str(e)})
                    continue
                hit = next(filter(None, (index.match(t["content"]) for t in turns)), None)  # the first turn's match
                if hit:
                    per_task[hit[0]] += 1
                    stats["contaminated"] += 1
                    drop.append({**row, "reason": "contaminated", "eval_task": hit[0], "eval_item": hit[1],
                                 "ngram": hit[2]})
                    continue
                first_user = next((t["content"] for t in turns if t["role"] == "user"), "")
                key = _key(words(first_user))
                if key in seen:
                    stats["duplicates"] += 1
                    drop.append({**row, "reason": "duplicate_prompt"})
                    continue
                seen.add(key)
                stats["kept"] += 1
                keep.append(row)
            keep_file.write(keep)
            drop_file.write(drop)
        if stats["read"] == stats["invalid"]:
            # nothing usable: leave nothing that looks finished (dropped.jsonl only if it names reasons)
            (out / "train.jsonl").unlink()
            if not stats["read"]:
                (out / "dropped.jsonl").unlink()
                if created and not any(out.iterdir()):
                    out.rmdir()
                raise NoValidRows(f"--input {src}: no rows (empty or blank lines only); nothing was written to {out}")
            raise NoValidRows(f"--input {src}: none of its {stats['read']} rows is valid (first: "
                              f"{first_invalid}; all in {out / 'dropped.jsonl'})")
        summary = {
            "args": args,
            "read": stats["read"],
            "kept": stats["kept"],
            "contaminated": stats["contaminated"],
            "contaminated_by_task": {t: per_task[t] for t in index.items},
            "eval_items": dict(index.items),
            "duplicates": stats["duplicates"],
            "invalid": stats["invalid"],
            "adds_up": stats["read"] == stats["kept"] + stats["contaminated"] + stats["duplicates"] + stats["invalid"],
        }
        atomic_write_json(summary_path, summary)
        return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.decontaminate", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="normalized JSONL (data.prepare output)")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--eval-dir", default=None, help="local eval folder (default: $DSPINE_SHARED/data/eval, else the Hub)")
    p.add_argument("--tasks", default=DEFAULT_TASKS)
    p.add_argument("--ngram", type=int, default=13, help="words per n-gram (default 13)")
    args = p.parse_args(argv)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        p.error("--tasks: name at least one task")
    try:
        s = decontaminate(args.input, args.output, tasks, args.ngram, args.eval_dir)
    except (NoValidRows, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, NoValidRows) else 2
    by_task = ", ".join(f"{t} {c}" for t, c in s["contaminated_by_task"].items())
    print(f"read {s['read']}: kept {s['kept']}, contaminated {s['contaminated']} ({by_task}), duplicate prompts "
          f"{s['duplicates']}, invalid {s['invalid']}; adds up: {s['adds_up']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
