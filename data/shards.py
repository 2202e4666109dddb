"""Per-rank append-only record shards: resume bookkeeping, a file barrier, and the ordered merge.

Each rank r appends records to `{kind}.rank{r}.jsonl` in the output folder. Every record is one JSON
line that starts with `{"index": N,` (N = input row index), so shards can be scanned for done rows
without parsing whole records. Shards from an earlier run with another world size stay valid: done
rows are read from all shards, and the merge takes them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from data.rows import atomic_write_json

INDEX_PREFIX = re.compile(rb'\{"index": (\d+),')


def shard_path(out: Path, kind: str, rank: int) -> Path:
    return out / f"{kind}.rank{rank}.jsonl"


def done_indices(out: Path) -> set[int]:
    """Input indices already recorded in any shard (all ranks, any earlier world size)."""
    done = set()
    for path in out.glob("*.rank*.jsonl"):
        with open(path, "rb") as f:
            for line in f:
                # A partial last line (killed writer) has no newline: that row is not done.
                if line.endswith(b"\n") and (m := INDEX_PREFIX.match(line)):
                    done.add(int(m.group(1)))
    return done


def write_marker(out: Path, rank: int, world: int) -> None:
    """Records that `rank` of a `world`-process run has recorded all its rows."""
    atomic_write_json(out / f"done.rank{rank}.json", {"world_size": world})


def clear_markers(out: Path) -> None:
    """Removes every rank's marker (rank 0, holding the folder lock, at the start of a run: before the other ranks
    pass the first barrier, so never those of another launch's run in progress)."""
    for path in out.glob("done.rank*.json"):
        path.unlink(missing_ok=True)


def wait_for_ranks(out: Path, world: int, poll_s: float = 5.0) -> None:
    """Blocks until every rank wrote its marker: a file barrier, so a slow rank never hits a
    collective timeout."""
    last_note = time.monotonic()
    while True:
        missing = [r for r in range(world) if not _marker_ok(out / f"done.rank{r}.json", world)]
        if not missing:
            return
        if time.monotonic() - last_note > 60:
            print(f"rank 0: waiting for ranks {missing} to finish", file=sys.stderr)
            last_note = time.monotonic()
        time.sleep(poll_s)


def _marker_ok(path: Path, world: int) -> bool:
    try:
        return json.loads(path.read_text())["world_size"] == world
    except (OSError, ValueError, KeyError):
        return False


def merge_shards(
    out: Path, kinds: tuple[str, ...], n_rows: int, on_record: Callable[[str, dict], None]
) -> dict:
    """Merges all `{kind}.rank*.jsonl` into `{kind}.jsonl` in input order, for every kind.

    Only (index, file, offset, size) tuples are held in memory; records are copied by seeking.
    Each merged file is written to a temp name and renamed once all kinds are complete.

    Args:
        n_rows: input rows; every index in [0, n_rows) must be recorded exactly once over all kinds.
        on_record: called with (kind, parsed record) for each record, in output order (for summaries).
    Returns:
        {kind: number of records}.
    Raises:
        ValueError: a corrupt record or a row recorded twice (the message names the shard and what to remove), or
            rows without any record.
    """
    seen = bytearray(n_rows)
    counts = {}
    try:
        for kind in kinds:
            files = sorted(out.glob(f"{kind}.rank*.jsonl"))
            entries = []
            for file_no, path in enumerate(files):
                with open(path, "rb") as f:
                    offset = 0
                    for line in f:
                        m = INDEX_PREFIX.match(line)
                        if not line.endswith(b"\n") or not m:
                            raise ValueError(f"{path}: corrupt record at byte {offset} (not a whole record line); "
                                             f"cut the file to its first {offset} bytes (or delete it to regenerate "
                                             "its rows) and run the same command again")
                        index = int(m.group(1))
                        if index >= n_rows or seen[index]:
                            raise ValueError(f"{path}: input row {index} recorded twice or out of range (shards of "
                                             "another run in this folder?)")
                        seen[index] = 1
                        entries.append((index, file_no, offset, len(line)))
                        offset += len(line)
            entries.sort()
            with contextlib.ExitStack() as opened:
                handles = [opened.enter_context(open(p, "rb")) for p in files]
                dst = opened.enter_context(open(out / f"{kind}.jsonl.tmp", "wb"))
                for _, file_no, offset, size in entries:
                    src = handles[file_no]
                    src.seek(offset)
                    line = src.read(size)
                    dst.write(line)
                    on_record(kind, json.loads(line))
            counts[kind] = len(entries)
        missing = n_rows - sum(seen)
        if missing:
            first = [i for i in range(n_rows) if not seen[i]][:5]
            raise ValueError(f"{missing} input rows have no record yet (first: {first}); re-run to finish them")
    except BaseException:  # an error or a Ctrl-C: no half-written merge stays (the shards do: a rerun merges)
        for kind in kinds:
            (out / f"{kind}.jsonl.tmp").unlink(missing_ok=True)
        raise
    for kind in kinds:
        os.replace(out / f"{kind}.jsonl.tmp", out / f"{kind}.jsonl")
    return counts


def remove_shards(out: Path) -> None:
    """Deletes shards and markers (after the merged files and the summary are written)."""
    for path in [*out.glob("*.rank*.jsonl"), *out.glob("done.rank*.json")]:
        path.unlink(missing_ok=True)  # another rank's Ctrl-C path may remove them too (data.regenerate.main)
