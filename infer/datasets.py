"""Evaluation prompts for the five tasks of the DSpine tables, from the Hub or local files.

Each task name maps to a Hub dataset (the rows the reference evaluation uses) and to its file in
a local folder laid out like ``../shared/data/eval`` (``--data-dir``, env ``DSPINE_EVAL_DIR``, or
``$DSPINE_SHARED/data/eval``). The prompt format per task is the usual zero-shot chat prompt of
spec-decoding evaluations: math asks for step-by-step reasoning with a boxed answer, code asks
for a Python solution; MT-Bench has two user turns (the second sees the model's first answer).
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."

TASKS = {
    # name: (hub id, hub config, hub split, local relative path)
    "gsm8k": ("openai/gsm8k", "main", "test", "gsm8k/test.jsonl"),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "math500/test.jsonl"),
    "humaneval": ("openai/openai_humaneval", None, "test", "humaneval/HumanEval.jsonl.gz"),
    "mbpp": ("google-research-datasets/mbpp", "sanitized", "test", "mbpp/sanitized-mbpp.json"),
    "mt-bench": ("HuggingFaceH4/mt_bench_prompts", None, "train", "mt_bench/question.jsonl"),
}
ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "math-500": "math500", "math": "math500"}


@dataclass
class EvalPrompt:
    task: str
    id: str
    turns: list[str]  # user turns (MT-Bench has two)


def task_name(name: str) -> str:
    """Canonical task name. Raises ValueError listing the known tasks."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in TASKS:
        raise ValueError(f"unknown dataset {name!r}; known: {', '.join(TASKS)}")
    return key


def default_eval_dir() -> Path:
    """``$DSPINE_EVAL_DIR``, else ``$DSPINE_SHARED/data/eval``, else ``shared/data/eval`` beside the repository (an
    empty variable counts as unset). Raises FileNotFoundError naming ``DSPINE_SHARED`` when it is set to a folder
    that does not exist (not a reason to go to the Hub)."""
    if os.environ.get("DSPINE_EVAL_DIR"):
        return Path(os.environ["DSPINE_EVAL_DIR"])
    if os.environ.get("DSPINE_SHARED"):
        shared = Path(os.environ["DSPINE_SHARED"])
        if not shared.is_dir():
            raise FileNotFoundError(f"DSPINE_SHARED={shared}: no such folder (unset it to use the Hub)")
        return shared / "data" / "eval"
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _hub_rows(task: str) -> list[dict]:
    from datasets import load_dataset

    hub, config, split, _ = TASKS[task]
    return [dict(r) for r in load_dataset(hub, config, split=split)]


def _format(task: str, i: int, r: dict) -> EvalPrompt:
    if task == "gsm8k":
        return EvalPrompt(task, str(i), [r["question"] + MATH_SUFFIX])
    if task == "math500":
        return EvalPrompt(task, str(r.get("unique_id", i)), [r["problem"] + MATH_SUFFIX])
    if task == "humaneval":
        text = ("Complete the following Python function. Return the whole function in one ```python code block."
                f"\n\n```python\n{r['prompt']}```")
        return EvalPrompt(task, r["task_id"], [text])
    if task == "mbpp":
        tests = "\n".join(r["test_list"])
        text = (f"You are an expert Python programmer, and here is your task: {r['prompt']} "
                f"Your code should pass these tests:\n\n{tests}")
        return EvalPrompt(task, str(r["task_id"]), [text])
    turns = r.get("turns") or r.get("prompt")
    return EvalPrompt(task, str(r.get("question_id", i)), list(turns))


def load_eval_rows(name: str, data_dir: str | Path | None = None) -> list[dict]:
    """Every raw row of a task (MBPP: the test split), from ``data_dir`` or the Hub.

    Raises ValueError (unknown task) or FileNotFoundError: a ``data_dir`` that is not a folder (a folder the caller
    named is never replaced by the Hub), or neither source reachable."""
    task = task_name(name)
    if data_dir and not Path(data_dir).is_dir():
        raise FileNotFoundError(f"eval folder {data_dir}: no such folder")
    folder = Path(data_dir) if data_dir else default_eval_dir()
    local = folder / TASKS[task][3]
    if local.is_file():
        rows = _read_rows(local)
    else:
        try:
            rows = _hub_rows(task)
        except Exception as e:  # offline, missing datasets package, ...
            raise FileNotFoundError(f"{task}: no local file {local} and the Hub copy {TASKS[task][0]} failed ({e})") from e
    if task == "mbpp":
        rows = [r for r in rows if 11 <= int(r["task_id"]) <= 510]
    return rows


# Fields of a raw row whose text a training set must not contain (question and reference answer).
REFERENCE_FIELDS = {
    "gsm8k": ("question", "answer"),
    "math500": ("problem", "solution"),
    "humaneval": ("prompt", "canonical_solution"),
    "mbpp": ("prompt", "code"),
    "mt-bench": ("turns", "prompt"),
}


def reference_texts(name: str, row: dict) -> list[str]:
    """The question and reference-answer texts of one raw row (for contamination checks)."""
    out = []
    for key in REFERENCE_FIELDS[task_name(name)]:
        value = row.get(key)
        out += [str(v) for v in value] if isinstance(value, list) else ([str(value)] if value else [])
    return out


def interleave(lists: list[list]) -> list:
    """The lists' items taken in turn (the first of each, then the second of each, ...), a shorter list dropping out
    when it ends: every task's prompts in one stream whose batches mix them (``infer.bench --mix``,
    ``planner_trace.py replay --mix``)."""
    return [x[i] for i in range(max(map(len, lists), default=0)) for x in lists if i < len(x)]


def load_eval_prompts(name: str, num: int | None = None, data_dir: str | Path | None = None) -> list[EvalPrompt]:
    """The first ``num`` prompts of a task (all when None), from ``data_dir`` or the Hub.

    MBPP keeps the test split (task ids 11..510). Raises ValueError (unknown task) or
    FileNotFoundError when neither the local file nor the Hub is reachable.
    """
    task = task_name(name)
    if num is not None and num < 1:
        raise ValueError(f"number of prompts {num}: must be >= 1 (or None for all)")
    rows = load_eval_rows(task, data_dir)
    prompts = [_format(task, i, r) for i, r in enumerate(rows)]
    return prompts if num is None else prompts[:num]
