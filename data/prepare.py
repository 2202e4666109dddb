"""Normalize prompt sources into one conversation JSONL with a deterministic train/eval split.

    python -m data.prepare --input SRC [SRC ...] --output DIR [--format auto] [--eval-fraction 0.01]
                           [--seed 0] [--limit N] [--split train] [--overwrite]

SRC is a local .jsonl/.json/.parquet file, a folder of them, or a Hub dataset id streamed with
`datasets` (e.g. mlabonne/open-perfectblend). Prefix `NAME=` to choose the source name used in row
ids (default: the file stem, folder name, or the last part of the Hub id).

DIR receives `train.jsonl` and `eval.jsonl` (normalized rows, see `data.schema`), `skipped.jsonl`
(rows that could not be used, with the reason) and `summary.json`, written last: its presence marks
a finished output, which is never overwritten without --overwrite. A run that keeps no row writes
nothing (its temporary files are removed), so a corrected retry into the same DIR is not refused.

Row ids are `<source>:<row index>` (index over all rows read from that source, bad ones included),
so they stay stable across runs. Exact duplicate conversations (same turns, any source) keep their
first occurrence. A row goes to eval iff blake2b(seed:id) < eval_fraction, independent of order.
Memory stays bounded: rows stream through, and the duplicate filter keeps 16-byte digests only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from data.formats import FORMATS, detect_format, to_conversation
from data.rows import EXIT_STATUS, atomic_write_json, dumps, iter_hub, iter_local
from data.schema import RowError
from dspine.io import folder_lock, sigterm_as_ctrl_c

OUTPUTS = ("train.jsonl", "eval.jsonl", "skipped.jsonl")
SUMMARY = "summary.json"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
NAME = re.compile(r"[\w.-]+")


class NoRowKept(Exception):
    """No row of any source was kept; carries the summary (counts and skip reasons), nothing was written."""

    def __init__(self, summary: dict):
        super().__init__("no row was kept")
        self.summary = summary


def parse_source(spec: str) -> tuple[str, str, bool]:
    """Splits an --input value into (name, location, is_hub).

    Raises:
        FileNotFoundError: neither a local path nor a Hub dataset id.
    """
    name, sep, location = spec.partition("=")
    if not sep or not NAME.fullmatch(name):
        name, location = "", spec
    if not location.strip():  # Path("") is the working directory: never read it by accident
        raise FileNotFoundError(f"input {spec!r}: no path after the name (NAME=PATH)")
    path = Path(location)
    if path.exists():
        return name or (path.name if path.is_dir() else path.stem), location, False
    if HUB_ID.fullmatch(location):
        return name or location.split("/")[-1], location, True
    raise FileNotFoundError(f"input {location!r}: no such file or folder, and not a Hub dataset id (owner/name)")


def eval_split(row_id: str, seed: int, fraction: float) -> bool:
    """True iff the row belongs to eval: a hash of (seed, id) mapped to [0, 1) is below `fraction`."""
    digest = hashlib.blake2b(f"{seed}:{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuses to write over finished (or foreign) output unless `overwrite`.

    Raises:
        FileExistsError: naming the folder and the files found.
    """
    found = [name for name in (*OUTPUTS, SUMMARY) if (out / name).exists()]
    if not found or overwrite:
        return
    if SUMMARY in found:
        raise FileExistsError(
            f"{out} already holds a finished prepare output ({', '.join(found)}); refusing to overwrite it. "
            "Pass --overwrite to replace it or choose another --output."
        )
    raise FileExistsError(
        f"{out} already holds {', '.join(found)} (no summary.json: an unfinished run?); pass --overwrite to replace them"
    )


def prepare(
    inputs: list[str],
    output: str | Path,
    fmt: str = "auto",
    eval_fraction: float = 0.01,
    seed: int = 0,
    limit: int | None = None,
    split: str = "train",
    overwrite: bool = False,
) -> dict:
    """Reads every source, writes train/eval/skipped JSONL and summary.json into `output`.

    Args:
        inputs: source specs (see module doc).
        fmt: "auto" (detected per source from its first usable row) or one of `FORMATS`.
        eval_fraction: expected fraction of kept rows in eval.jsonl, in [0, 1].
        limit: read at most this many rows from each source.
        split: split name for Hub sources.
    Returns:
        the summary dict (also saved as summary.json).
    Raises:
        FileExistsError: `output` holds earlier output and not `overwrite`.
        NoRowKept: every row was skipped or a duplicate (or there were none); nothing was written.
        FileNotFoundError / ValueError: a source cannot be found or read, duplicate source names,
            bad arguments.
    """
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: expected auto or one of {FORMATS}")
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"--eval-fraction {eval_fraction}: must be in [0, 1]")
    sources = [parse_source(s) for s in inputs]
    names = Counter(name for name, _, _ in sources)
    if dup := [n for n, c in names.items() if c > 1]:
        raise ValueError(f"source names {dup} appear more than once: give them distinct names with NAME=PATH")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--output {out} is an existing file; give a folder")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out):  # a second run on this folder is refused: both wrote the same .tmp files
        check_output_dir(out, overwrite)

        tmp = {name: out / f"{name}.tmp" for name in OUTPUTS}
        seen: set[bytes] = set()
        per_source = {}
        # Plain buffered writes: durability comes from the rename at the end, not from per-row fsync.
        writers = {name: open(path, "w", encoding="utf-8") for name, path in tmp.items()}
        try:
            for name, location, is_hub in sources:
                rows = iter_hub(location, split) if is_hub else iter_local(location)
                per_source[name] = _prepare_source(name, location, rows, fmt, writers, seen, eval_fraction, seed, limit)
            for w in writers.values():
                w.close()
            total = Counter()
            for stats in per_source.values():
                total.update({k: stats[k] for k in ("read", "kept", "train", "eval", "duplicates", "skipped")})
            summary = {
                "total": dict(total),
                "sources": per_source,
                "eval_fraction": eval_fraction,
                "seed": seed,
                "limit": limit,
                "consistent": total["read"] == total["kept"] + total["duplicates"] + total["skipped"],
            }
            if not total["kept"]:
                # Nothing to train on: leave nothing that looks finished (or unfinished), so a corrected
                # retry into the same folder is not refused; an earlier finished output stays as it was.
                raise NoRowKept(summary)
        except BaseException:
            # a failed source, or no row kept, leaves no partial .tmp files behind (the finished outputs are untouched)
            for w in writers.values():
                w.close()
            for path in tmp.values():
                path.unlink(missing_ok=True)
            if created and not any(out.iterdir()):  # nor an empty folder of its own (a bad input, Ctrl-C)
                out.rmdir()
            raise
        # Finish: drop the old summary first so a crash mid-rename never leaves a "finished" marker
        # next to a mix of old and new files; summary.json is written last.
        (out / SUMMARY).unlink(missing_ok=True)
        for name, path in tmp.items():
            os.replace(path, out / name)
        atomic_write_json(out / SUMMARY, summary)
        return summary


def _prepare_source(name, location, rows, fmt, writers, seen, eval_fraction, seed, limit) -> dict:
    stats = Counter()
    reasons, origins = Counter(), Counter()
    source_fmt = None if fmt == "auto" else fmt
    for index, row in enumerate(tqdm(rows, desc=name, unit=" rows", mininterval=2.0, file=sys.stderr)):
        if limit is not None and index >= limit:
            break
        stats["read"] += 1
        row_id = f"{name}:{index:06d}"
        try:
            if isinstance(row, RowError):
                raise row
            # auto: the first usable row fixes the format, so a later broken row is reported as
            # "missing field X" instead of "unknown format".
            row_fmt = source_fmt or detect_format(row)
            turns, origin = to_conversation(row, row_fmt)
            source_fmt = row_fmt
        except RowError as e:
            stats["skipped"] += 1
            reasons[e.code] += 1
            raw = e.raw if e.raw is not None else row
            skipped = {"id": row_id, "source": name, "reason": e.code, "detail": str(e), "row": raw}
            writers["skipped.jsonl"].write(dumps(skipped) + "\n")
            continue
        text = json.dumps(turns, ensure_ascii=False, separators=(",", ":"))
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()  # equal: a duplicate conversation
        if digest in seen:
            stats["duplicates"] += 1
            continue
        seen.add(digest)
        record = {"id": row_id, "conversations": turns, "source": name}
        if origin is not None:
            record["origin"] = origin
            origins[origin] += 1
        part = "eval" if eval_split(row_id, seed, eval_fraction) else "train"
        stats[part] += 1
        stats["kept"] += 1
        writers[f"{part}.jsonl"].write(dumps(record) + "\n")
    result = {k: stats[k] for k in ("read", "kept", "train", "eval", "duplicates", "skipped")}
    result.update(input=location, format=source_fmt, skipped_reasons=dict(reasons))
    if origins:
        result["origins"] = dict(origins)
    return result


def format_summary(summary: dict) -> str:
    """Human-readable table of a prepare summary."""
    lines = [f"{'source':<28}{'read':>9}{'kept':>9}{'train':>9}{'eval':>8}{'dups':>7}{'skipped':>9}  reasons"]
    rows = [*summary["sources"].items(), ("TOTAL", summary["total"])]
    for name, s in rows:
        lines.append(f"{name:<28}{s['read']:>9}{s['kept']:>9}{s['train']:>9}{s['eval']:>8}{s['duplicates']:>7}"
                     f"{s['skipped']:>9}  {s.get('skipped_reasons', '')}")
    lines.append(f"read = kept + duplicates + skipped: {summary['consistent']}")
    return "\n".join(lines)


@sigterm_as_ctrl_c()  # SIGTERM (a scheduler's stop) takes the Ctrl-C path below
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.prepare", description=__doc__.split("\n")[0],
                                epilog=EXIT_STATUS)
    p.add_argument("--input", nargs="+", required=True, metavar="SRC", help="[NAME=]path or Hub dataset id")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--format", default="auto", choices=("auto", *FORMATS))
    p.add_argument("--eval-fraction", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="salt of the train/eval split hash")
    p.add_argument("--limit", type=int, default=None, help="read at most N rows per source")
    p.add_argument("--split", default=None, help="split of Hub sources (default train; refused without one)")
    p.add_argument("--overwrite", action="store_true", help="replace a finished output in DIR")
    args = p.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit {args.limit}: must be >= 1")
    if not 0 <= args.eval_fraction < 1:
        p.error(f"--eval-fraction {args.eval_fraction}: must be in [0, 1)")
    try:
        if args.split is not None and not any(parse_source(spec)[2] for spec in args.input):
            raise ValueError(f"--split {args.split} selects the split of a Hub dataset, and no --input is one "
                             "(local files are read whole)")
        summary = prepare(
            args.input,
            args.output,
            args.format,
            args.eval_fraction,
            args.seed,
            args.limit,
            args.split or "train",
            args.overwrite,
        )
    except KeyboardInterrupt:  # the partial .tmp files are gone (prepare), finished outputs untouched
        print(f"\ndata.prepare: interrupted; nothing was written to {args.output} (the same command starts over)",
              file=sys.stderr)
        return 130
    except NoRowKept as e:
        print(format_summary(e.summary))
        print(f"error: no row was kept (see the skip reasons above); nothing was written to {args.output}",
              file=sys.stderr)
        return 1
    except (FileExistsError, FileNotFoundError, BlockingIOError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, OSError) as e:  # a Hub source without network, a permission problem
        print(f"error: could not read an input ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"wrote {args.output}/{{train,eval,skipped}}.jsonl and {SUMMARY}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
