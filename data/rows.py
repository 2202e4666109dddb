"""Streaming row readers and crash-safe writers shared by the data CLIs.

Readers yield one item per input row, in file order: the parsed object, or a `RowError` in its
place, so a bad line is logged with its reason and never stops a run. Nothing here holds a whole
file in memory except `iter_json_array` (a JSON array has to be parsed whole).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

from data.schema import RowError
from dspine.io import atomic_write_json, file_digest  # noqa: F401  (re-exported for the data CLIs)

# Longest raw line text kept in a skipped/error record (a corrupt multi-megabyte line stays readable).
MAX_RAW_CHARS = 10_000
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")
# a JSON escape of a UTF-16 surrogate (\ud800-\udfff): json.loads joins a valid pair into one character and leaves a
# lone one in the string, which no UTF-8 writer or tokenizer takes
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# the data CLIs' exit statuses (their --help epilog)
EXIT_STATUS = ("exit status: 0 done; 1 the input was read but no row was kept (nothing to train on); 2 a bad argument "
               "or an unreadable input; 130 interrupted (Ctrl-C)")
# --chat-template of the data CLIs that render conversations (data.regenerate, data.tokenize; data.chat)
CHAT_TEMPLATE_HELP = ("template file or builtin name (chatml: <|im_end|> ends a turn, or the eos token for a tokenizer "
                      "without it, e.g. a base LM); default: the tokenizer's")


def parse_jsonl_line(raw: bytes, where: str) -> dict:
    """Parses one JSON-lines line (bytes, newline optional) into an object.

    Raises:
        RowError: "bad_utf8" (also for a lone UTF-16 surrogate escape such as ``"\\ud800"``), "bad_json" or
            "not_object", with `where` (e.g. "file.jsonl:12") in the message.
    """
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark (a file saved by some editors)
    except UnicodeDecodeError as e:
        raise RowError(
            "bad_utf8",
            f"{where}: line is not valid UTF-8 ({e.reason} at byte {e.start})",
            raw=raw.decode("utf-8", errors="replace")[:MAX_RAW_CHARS],
        ) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RowError(
            "bad_json", f"{where}: invalid JSON ({e.msg} at column {e.colno})", raw=text[:MAX_RAW_CHARS]
        ) from None
    if not isinstance(obj, dict):
        raise RowError(
            "not_object",
            f"{where}: row is a JSON {type(obj).__name__}, not an object",
            raw=text[:MAX_RAW_CHARS],
        )
    check_surrogates(obj, where, text)
    return obj


def check_surrogates(obj, where: str, text: str | None = None) -> None:
    """Raises RowError "bad_utf8" naming `where` when the parsed row `obj` holds a lone UTF-16 surrogate (a JSON escape
    that no valid pair joined): it could not be written as UTF-8 or tokenized later. `text`, the row's source where
    the caller has it, lets a row without a surrogate escape pass unchecked."""
    if text is not None and _SURROGATE_ESCAPE.search(text) is None:
        return
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise RowError(
            "bad_utf8", f"{where}: a string holds a lone UTF-16 surrogate ({e.object[e.start]!r})",
            raw=(json.dumps(obj) if text is None else text)[:MAX_RAW_CHARS],
        ) from None


def iter_jsonl(path: str | Path) -> Iterator[dict | RowError]:
    """Yields each non-blank line of a JSON-lines file as an object or a `RowError` (blank lines are not rows)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield parse_jsonl_line(raw, f"{path}:{lineno}")
            except RowError as e:
                yield e


def batched(items: Iterable, n: int) -> Iterator[list]:
    """Lists of ``n`` consecutive items of ``items``, the last one shorter (``itertools.batched`` of Python 3.12)."""
    it = iter(items)
    while chunk := list(islice(it, n)):
        yield chunk


def iter_json_array(path: str | Path) -> Iterator[dict | RowError]:
    """Yields the elements of a JSON file holding an array of row objects.

    A `.json` file whose first character is `{` is read as JSON lines instead (a common mislabel).

    Raises:
        ValueError: the file is not valid UTF-8 / JSON, or its top level is not an array.
    """
    with open(path, "rb") as f:
        head = f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()  # after a byte-order mark
    if head.startswith(b"{"):
        yield from iter_jsonl(path)
        return
    try:
        rows = json.loads(Path(path).read_bytes().decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a valid JSON file ({e})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a JSON array of rows at the top level, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if isinstance(row, dict):
            try:
                check_surrogates(row, f"{path}[{i}]")
            except RowError as e:
                yield e
                continue
            yield row
        else:
            yield RowError(
                "not_object", f"{path}[{i}]: row is a JSON {type(row).__name__}, not an object", raw=json.dumps(row)
            )  # raw as JSON text: an element may hold a lone surrogate, which skipped.jsonl could not be written with


def iter_local(path: str | Path) -> Iterator[dict | RowError]:
    """Yields the rows of a local .jsonl/.json/.parquet file, or of all such files in a folder (sorted by path).

    Raises:
        ValueError: unsupported file type, or a folder without data files.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
        if not files:
            raise ValueError(f"{path}: folder holds no {'/'.join(LOCAL_SUFFIXES)} files")
        for file in files:
            yield from iter_local(file)
    elif path.suffix == ".jsonl":
        yield from iter_jsonl(path)
    elif path.suffix == ".json":
        yield from iter_json_array(path)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
    else:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r} (expected one of {LOCAL_SUFFIXES})")


def iter_hub(name: str, split: str = "train") -> Iterator[dict]:
    """Streams the rows of a Hugging Face Hub dataset (`datasets.load_dataset(..., streaming=True)`)."""
    from datasets import load_dataset

    yield from load_dataset(name, split=split, streaming=True)


# ---------------------------------------------------------------------------------------- writing


# Characters that str.splitlines() (and some JSON-lines readers) treat as line breaks although JSON
# allows them raw; escaping them keeps one record per line for every reader.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(record: dict) -> str:
    """One JSON-lines record: UTF-8 text kept as is except line-break characters, no newline."""
    return json.dumps(record, ensure_ascii=False).translate(_LINE_BREAKS)


class JsonlAppender:
    """Appends records to a JSON-lines file; `write` flushes and fsyncs so each call is durable.

    Each `write` issues a single write of whole lines: a crash can leave at most one partial line at
    the end of the file, which `repair_tail` removes on restart.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        repair_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        self._f.write("".join(dumps(r) + "\n" for r in records))
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def repair_tail(path: str | Path) -> bool:
    """Removes a partial last line (no trailing newline, left by a killed writer). Returns True if it cut one."""
    path = Path(path)
    if not path.exists() or path.stat().st_size == 0:
        return False
    with open(path, "rb+") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return False
        # Walk back in blocks to the last newline: the tail after it is the partial line.
        pos, block = size, 1 << 16
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return True
            pos = start
        f.truncate(0)
        return True
