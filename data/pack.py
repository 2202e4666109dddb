"""Pack a `data.tokenize` cache folder into a few small xz parts, and rebuild it from them.

    python -m data.pack export --cache CACHE_FOLDER --out ARCHIVE_DIR [--part-mib 15] [--preset 6]
    python -m data.pack import --parts ARCHIVE_DIR|FILE... (--out CACHE_FOLDER | --cache-dir DIR)

For GPU sessions that return only a few small files: one session tokenizes and exports, the next
carries the parts in and imports them instead of regenerating (scripts/smollm2/recipe.sh, stages
`pack` and `unpack`).

Archive folder: `pack.json` (format, cache folder name, sizes, sha256 of every part and of the
uncompressed payload, sha256 of the original `data.arrow`) and parts `data.tar.xz.000`, `.001`, ...
(each <= --part-mib MiB; `cat data.tar.xz.* | xz -d | tar t` lists the payload). The payload is a tar
(mtime 0, so the same cache gives the same bytes) of little-endian integer arrays, each uint16 when
its largest value allows, else uint32:

    lengths      [sequences]  tokens per sequence
    input_ids    [tokens]     all sequences' ids, concatenated
    mask_runs    [runs]       loss_mask as run lengths per sequence, alternating 0-run, 1-run, ...,
                              starting with a 0-run (0 long when the sequence starts supervised)
    mask_nruns   [sequences]  runs per sequence
    turns, turns_lengths      the `turns` column, flattened (when the cache has it)
    row_ids.json              the `id` column (when the cache has it)
    schema.arrow             the Arrow schema; header.json: dtypes, sizes, record-batch row counts
    files/NAME               every other file of the cache verbatim (manifest.json, summary.json,
                              errors.jsonl): the trainer's data digest is the manifest's file digest

Import writes the Arrow stream with the original schema and record-batch sizes, so with the same
pyarrow the rebuilt `data.arrow` is byte-identical (checked against the recorded sha256 and reported).

The 4 answers per prompt of the recipe repeat each prompt 4 times, 1/4 of the ids apart; the xz
dictionary is sized to cover the whole payload (<= 256 MiB) so the repeats cost almost nothing.
Measured on 2.0 M tokens of SmolLM2-tokenized stand-in conversations laid out as the recipe's (4 answers
per prompt, 40% prompt tokens), 2 shared CPU cores: preset 6 gives 0.51 byte/token in 2.8 s (0.73 with a
256 KiB dictionary that misses the repeats, 0.65 when every prompt is distinct); preset 3 0.58 in 1.2 s,
preset 0 0.62 in 0.4 s; presets 7-9 only enlarge the dictionary, which is set here anyway. Import: 0.4 s.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from data.staging import tmp_beside

FORMAT = "dspine-pack-v1"
MANIFEST = "pack.json"
PART_PREFIX = "data.tar.xz."
DATA_FILE = "data.arrow"  # data.tokenize.DATA_FILE (not imported: data.tokenize pulls in transformers)
COLUMNS = ("id", "turns", "input_ids", "loss_mask")


class PackError(ValueError):
    """A bad cache, archive or output path; the message names the file or field."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    # dspine.io.file_digest(path, "sha256") computes the same; not imported so that `python -m data.pack`
    # stays free of the dspine package's torch import (~3 s on start-up)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _narrow(values: np.ndarray) -> np.ndarray:
    """Non-negative integers as uint16 when they fit, else uint32 (little-endian)."""
    top = int(values.max()) if values.size else 0
    if values.size and int(values.min()) < 0:
        raise PackError(f"negative value {int(values.min())} in an integer column")
    if top >= 1 << 32:
        raise PackError(f"value {top} does not fit in uint32")
    return values.astype("<u2" if top < 1 << 16 else "<u4")


# ------------------------------------------------------------------------------------------ encode


def _mask_runs(mask: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat 0/1 mask [tokens] + sequence offsets [sequences+1] -> (run lengths, runs per sequence)."""
    n = len(offsets) - 1
    total = int(offsets[-1])
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(n, np.int64)
    starts = np.zeros(total, bool)
    starts[1:] = mask[1:] != mask[:-1]
    starts[offsets[:-1][np.diff(offsets) > 0]] = True  # every non-empty sequence starts a run
    first = np.flatnonzero(starts)
    runs = np.diff(np.append(first, total))
    seq = np.searchsorted(offsets, first, side="right") - 1  # sequence of each run
    # a sequence that starts supervised gets a 0-long 0-run first, so runs alternate 0, 1, 0, ...
    lead = first[(mask[first] == 1) & (first == offsets[seq])]
    runs = np.insert(runs, np.searchsorted(first, lead), 0)
    nruns = np.bincount(seq, minlength=n) + np.bincount(np.searchsorted(offsets, lead, side="right") - 1, minlength=n)
    return runs, nruns


def _unmask_runs(runs: np.ndarray, nruns: np.ndarray) -> np.ndarray:
    """Inverse of `_mask_runs`: the flat int8 mask [tokens]."""
    first = np.cumsum(nruns) - nruns
    k = np.arange(len(runs)) - np.repeat(first, nruns)  # run index within its sequence
    return np.repeat((k & 1).astype(np.int8), runs)


def _list_column(table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column -> (flat values int64, offsets int64 [rows+1])."""
    import pyarrow.compute as pc

    col = table.column(name)
    if col.null_count:
        raise PackError(f"column {name!r} has {col.null_count} null rows")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int64)
    return values, np.concatenate([[0], np.cumsum(lengths)])


def build_payload(cache: Path) -> tuple[bytes, dict]:
    """Reads a cache folder -> (uncompressed tar payload, summary fields for pack.json).

    Raises:
        PackError: not a finished data.tokenize cache (no data.arrow / summary.json), a subfolder in
            it, an unknown or null column, or input_ids / loss_mask of different lengths.
    """
    import pyarrow as pa

    arrow = cache / DATA_FILE
    if not arrow.is_file() or not (cache / "summary.json").is_file():
        raise PackError(f"{cache}: not a finished data.tokenize cache (needs {DATA_FILE} and summary.json)")
    with pa.memory_map(str(arrow)) as source:
        reader = pa.ipc.open_stream(source)
        batches = list(reader)
        schema = reader.schema
    table = pa.Table.from_batches(batches, schema)
    extra = [c for c in schema.names if c not in COLUMNS]
    if extra or "input_ids" not in schema.names or "loss_mask" not in schema.names:
        raise PackError(f"{arrow}: columns {schema.names}; expected input_ids, loss_mask and optionally id, turns")
    for field in schema:
        want = pa.types.is_string(field.type) if field.name == "id" else (
            pa.types.is_list(field.type) and pa.types.is_integer(field.type.value_type))
        if not want:
            raise PackError(f"{arrow}: column {field.name!r} is {field.type}, expected "
                            f"{'a string' if field.name == 'id' else 'a list of integers'}")
    ids, offsets = _list_column(table, "input_ids")
    mask, mask_offsets = _list_column(table, "loss_mask")
    if not np.array_equal(offsets, mask_offsets):
        row = int(np.flatnonzero(np.diff(offsets) != np.diff(mask_offsets))[0])
        raise PackError(f"{arrow} row {row}: input_ids and loss_mask differ in length")
    if mask.size and not np.isin(mask, (0, 1)).all():
        raise PackError(f"{arrow}: field 'loss_mask' holds values other than 0/1")
    runs, nruns = _mask_runs(mask, offsets)
    arrays = {"lengths": np.diff(offsets), "input_ids": ids, "mask_runs": runs, "mask_nruns": nruns}
    members: dict[str, bytes] = {}
    if "turns" in schema.names:
        turns, turn_offsets = _list_column(table, "turns")
        arrays["turns"], arrays["turns_lengths"] = turns, np.diff(turn_offsets)
    if "id" in schema.names:
        members["row_ids.json"] = json.dumps(table.column("id").to_pylist()).encode()
    header = {"format": FORMAT, "sequences": len(offsets) - 1, "tokens": int(offsets[-1]),
              "batch_rows": [b.num_rows for b in batches], "dtypes": {}}
    for name, values in arrays.items():
        try:
            narrow = _narrow(values)
        except PackError as e:
            raise PackError(f"{arrow}: {name}: {e}") from None
        header["dtypes"][name] = narrow.dtype.str
        members[f"{name}.bin"] = narrow.tobytes()
    members["schema.arrow"] = schema.serialize().to_pybytes()
    for path in sorted(cache.iterdir()):
        if path.name == DATA_FILE:
            continue
        if not path.is_file():
            raise PackError(f"{path}: a subfolder or special file in the cache; only plain files are packed")
        members[f"files/{path.name}"] = path.read_bytes()
    members = {"header.json": json.dumps(header, sort_keys=True).encode(), **members}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    info = {"sequences": header["sequences"], "tokens": header["tokens"], "input_ids_dtype": header["dtypes"]["input_ids"],
            "data_arrow_sha256": _file_sha256(arrow)}
    return buf.getvalue(), info


def _filters(preset: int, size: int) -> list[dict]:
    # dictionary >= the payload (power of 2, 1-256 MiB): a prompt repeated a quarter of the payload
    # later is still in reach (preset 6 alone has 8 MiB; 16 M uint16 ids are 32 MB)
    dict_size = min(max(1 << 20, 1 << max(size - 1, 1).bit_length()), 256 << 20)
    return [{"id": lzma.FILTER_LZMA2, "preset": preset, "dict_size": dict_size}]


def export(cache: str | Path, out: str | Path, part_mib: float = 15, preset: int = 6) -> dict:
    """Writes the archive of `cache` to the folder `out` (atomically); returns its pack.json.

    An existing `out` holding a valid archive of the same payload is kept as it is, its part size
    included (returned with "skipped": True, and "own_part_size": True when `part_mib` would split
    it otherwise).

    Raises:
        PackError: `out` is `cache` or inside it, bad cache (see `build_payload`), part_mib <= 0, preset outside 0-9, or `out` exists
            and is not a valid archive of this same payload (a missing or corrupt part, another
            payload, an unreadable pack.json): never overwritten; the message says to delete it.
    """
    cache, out = Path(cache), Path(out)
    c, o = cache.resolve(), out.resolve()
    if o == c or c in o.parents:
        raise PackError(f"--out {out} is the cache folder or inside it (--cache {cache}): give a folder outside it")
    if not part_mib > 0:
        raise PackError(f"--part-mib {part_mib}: must be > 0")
    if preset not in range(10):
        raise PackError(f"--preset {preset}: expected 0-9")
    t0 = time.perf_counter()
    payload, info = build_payload(cache)
    digest = _sha256(payload)
    step = int(part_mib * (1 << 20))
    if out.exists():
        try:
            if not out.is_dir():
                raise PackError("a file, not an archive folder")
            old = _read_manifest(out / MANIFEST)
            if old.get("payload_sha256") != digest:
                raise PackError("the archive of another cache or build")
            check_parts(out, old)
        except PackError as e:
            raise PackError(f"--out {out} exists and is not a valid archive identical to this cache ({e}); "
                            f"export refuses to overwrite it: delete {out} and export again") from None
        sizes = [p["bytes"] for p in old["parts"]]
        same_split = not sizes or (all(b == step for b in sizes[:-1]) and sizes[-1] <= step)
        return {**old, "skipped": True, "own_part_size": not same_split}
    t1 = time.perf_counter()
    packed = lzma.compress(payload, format=lzma.FORMAT_XZ, filters=_filters(preset, len(payload)))
    t2 = time.perf_counter()
    parts = [packed[i : i + step] for i in range(0, len(packed), step)]
    manifest = {"format": FORMAT, "cache_name": cache.name, **info, "payload_bytes": len(payload),
                "payload_sha256": digest, "compressed_bytes": len(packed), "xz_preset": preset,
                "xz_dict_size": _filters(preset, len(payload))[0]["dict_size"],
                "parts": [{"file": f"{PART_PREFIX}{i:03d}", "bytes": len(p), "sha256": _sha256(p)}
                          for i, p in enumerate(parts)],
                "seconds": {"read": round(t1 - t0, 2), "compress": round(t2 - t1, 2)}}
    with tmp_beside(out) as tmp:
        for part, data in zip(manifest["parts"], parts):
            (tmp / part["file"]).write_bytes(data)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        os.rename(tmp, out)
    return manifest


# ------------------------------------------------------------------------------------------ decode


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackError(f"{path}: unreadable archive manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PackError(f"{path}: format {got!r}, expected {FORMAT!r}")
    parts = manifest.get("parts")
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("file"), str) and isinstance(p.get("sha256"), str)
            and type(p.get("bytes")) is int for p in parts) or not parts:
        raise PackError(f"{path}: field 'parts' must be a non-empty list of {{file, bytes, sha256}} objects, got "
                        f"{json.dumps(parts)[:80]}")
    for key, kind in (("payload_sha256", str), ("data_arrow_sha256", str), ("sequences", int),
                      ("tokens", int)):  # cache_name: _plain_name checks it
        if type(manifest.get(key)) is not kind:
            raise PackError(f"{path}: field {key!r} must be {'a string' if kind is str else 'a whole number'}, "
                            f"got {json.dumps(manifest.get(key))[:80]}")
    return manifest


def _locate(parts: list[str | Path]) -> tuple[dict, dict[str, Path]]:
    """`--parts` (one archive folder, or pack.json + part files) -> (manifest, part name -> path)."""
    paths = [Path(p) for p in parts]
    if len(paths) == 1 and paths[0].is_dir():
        paths = sorted(paths[0].iterdir())
    for p in paths:
        if not p.exists():
            raise PackError(f"--parts {p}: no such file or folder")
    manifests = [p for p in paths if p.name == MANIFEST]
    if len(manifests) != 1:
        raise PackError(f"--parts: expected one {MANIFEST} among {[str(p) for p in paths]}, found {len(manifests)}")
    return _read_manifest(manifests[0]), {p.name: p for p in paths}


def check_parts(folder_or_files, manifest: dict) -> list[bytes]:
    """Reads and checks every part of `manifest` -> their bytes, in order.

    Raises:
        PackError: naming a missing part, or a part whose size or sha256 differs from the manifest.
    """
    found = ({p.name: p for p in Path(folder_or_files).iterdir()} if isinstance(folder_or_files, (str, Path))
             else folder_or_files)
    missing = [p["file"] for p in manifest["parts"] if p["file"] not in found]
    if missing:
        raise PackError(f"missing part(s) {', '.join(missing)} of {len(manifest['parts'])} "
                        f"(cache {manifest.get('cache_name')}); carry every {PART_PREFIX}* file with {MANIFEST}")
    out = []
    for part in manifest["parts"]:
        data = found[part["file"]].read_bytes()
        if len(data) != part["bytes"] or _sha256(data) != part["sha256"]:
            raise PackError(f"part {found[part['file']]} is corrupt: {len(data)} bytes, sha256 {_sha256(data)[:16]}..., "
                            f"expected {part['bytes']} bytes, sha256 {part['sha256'][:16]}...")
        out.append(data)
    return out


def _array(members: dict, header: dict, name: str) -> np.ndarray:
    return np.frombuffer(members[f"{name}.bin"], dtype=header["dtypes"][name]).astype(np.int64)


def write_cache(payload: bytes, folder: Path) -> None:
    """Writes the cache folder contents of a payload (a checked `build_payload` tar) into the empty `folder`.

    Raises:
        PackError: the payload's arrays disagree with its header (sequence or token counts).
    """
    import pyarrow as pa

    with tarfile.open(fileobj=io.BytesIO(payload), mode="r") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    header = json.loads(members["header.json"])
    schema = pa.ipc.read_schema(pa.py_buffer(members["schema.arrow"]))
    lengths = _array(members, header, "lengths")
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    mask = _unmask_runs(_array(members, header, "mask_runs"), _array(members, header, "mask_nruns"))
    ids = _array(members, header, "input_ids").astype(np.int32)
    if len(mask) != len(ids) or len(lengths) != header["sequences"] or len(ids) != header["tokens"]:
        raise PackError(f"payload inconsistent: {len(lengths)} sequences, {len(ids)} ids, {len(mask)} mask values; "
                        f"header says {header['sequences']} sequences, {header['tokens']} tokens")
    columns = {"input_ids": (ids, offsets), "loss_mask": (mask, offsets)}
    if "turns" in schema.names:
        turn_lengths = _array(members, header, "turns_lengths")
        columns["turns"] = (_array(members, header, "turns").astype(np.int32),
                            np.concatenate([[0], np.cumsum(turn_lengths)]).astype(np.int32))
    row_ids = json.loads(members["row_ids.json"]) if "id" in schema.names else None
    with pa.OSFile(str(folder / DATA_FILE), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        start = 0
        for rows in header["batch_rows"]:
            arrays = []
            for field in schema:
                if field.name == "id":
                    arrays.append(pa.array(row_ids[start : start + rows], field.type))
                    continue
                values, offs = columns[field.name]
                o = offs[start : start + rows + 1]
                arrays.append(pa.ListArray.from_arrays(pa.array(o - o[0], pa.int32()),
                                                       pa.array(values[o[0] : o[-1]], field.type.value_type)))
            writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
            start += rows
    for name, data in members.items():
        if name.startswith("files/"):
            (folder / name.removeprefix("files/")).write_bytes(data)


def _plain_name(name) -> str:
    """pack.json's `cache_name` as a folder name under --cache-dir: one plain path component only."""
    if (not isinstance(name, str) or not name or name.startswith(".") or any(c in name for c in "/\\\0")
            or Path(name).name != name):
        raise PackError(f"{MANIFEST}: cache_name {name!r} is not a plain folder name (no path separators, "
                        "not empty, not starting with '.'); refusing to import with --cache-dir (use --out)")
    return name


def _check_counts(arrow: Path, manifest: dict) -> None:
    """The rebuilt `data.arrow` holds pack.json's `sequences` rows and `tokens` input ids (else PackError)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    with pa.memory_map(str(arrow)) as source:
        table = pa.ipc.open_stream(source).read_all()
        got = {"sequences": table.num_rows,
               "tokens": int(pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0)}
    for field, value in got.items():
        if manifest.get(field) != value:
            raise PackError(f"{MANIFEST}: field {field!r} is {manifest.get(field)!r} but the rebuilt {DATA_FILE} "
                            f"holds {value}; the manifest does not describe its parts")


def import_(parts: list[str | Path], out: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """Rebuilds the cache folder from an archive (atomically: temp folder + rename); returns its path.

    Args:
        parts: the archive folder, or its pack.json and part files.
        out: the cache folder to create; or `cache_dir`: its parent (the folder gets the original name,
            so `data.tokenize --cache-dir` of the same input finds it).
    Raises:
        PackError: a missing or corrupt part (named), a payload whose sha256 differs, an existing output,
            a `cache_name` that is not one plain folder name (with `cache_dir`), or rebuilt sequence/token
            counts differing from pack.json's `sequences` / `tokens` (the field named).
    """
    manifest, found = _locate(parts)
    if (out is None) == (cache_dir is None):
        raise PackError("give exactly one of --out and --cache-dir")
    out = Path(out) if out is not None else Path(cache_dir) / _plain_name(manifest.get("cache_name"))
    if out.exists():
        raise PackError(f"output {out} exists; refusing to overwrite it (remove it or give another folder)")
    data = check_parts(found, manifest)
    try:
        payload = lzma.decompress(b"".join(data), format=lzma.FORMAT_XZ)
    except lzma.LZMAError as e:
        raise PackError(f"archive {manifest.get('cache_name')}: xz stream unreadable ({e})") from None
    if _sha256(payload) != manifest["payload_sha256"]:
        raise PackError(f"archive {manifest.get('cache_name')}: payload sha256 differs from {MANIFEST}")
    with tmp_beside(out) as tmp:  # dot name: `ls -d tok-train/*/` skips it; out's parent folders are made
        write_cache(payload, tmp)
        _check_counts(tmp / DATA_FILE, manifest)
        os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.pack", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="cache folder -> archive folder (pack.json + xz parts)")
    e.add_argument("--cache", required=True, help="a data.tokenize cache folder (holds data.arrow)")
    e.add_argument("--out", required=True, help="archive folder to create")
    e.add_argument("--part-mib", type=float, default=15, help="largest part in MiB (default 15)")
    e.add_argument("--preset", type=int, default=6, help="xz preset 0-9 (default 6)")
    i = sub.add_parser("import", help="archive -> cache folder")
    i.add_argument("--parts", nargs="+", required=True, help="the archive folder, or pack.json and its part files")
    where = i.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="cache folder to create")
    where.add_argument("--cache-dir", help="parent folder; the cache keeps its original name")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.command == "export":
            m = export(args.cache, args.out, args.part_mib, args.preset)
            what = "kept (identical archive)" if m.get("skipped") else "wrote"
            print(f"{what} {args.out}: {m['sequences']} sequences, {m['tokens']} tokens, {len(m['parts'])} part(s), "
                  f"{m['compressed_bytes']} bytes ({m['compressed_bytes'] / max(m['tokens'], 1):.3f} bytes/token), "
                  f"{time.perf_counter() - t0:.1f} s")
            if m.get("own_part_size"):
                print(f"note: {args.out} was kept with its own part size (largest part "
                      f"{max(p['bytes'] for p in m['parts'])} bytes), not re-split for --part-mib {args.part_mib:g}; "
                      f"delete it and export again to re-split")
        else:
            out = import_(args.parts, args.out, args.cache_dir)
            m, _ = _locate(args.parts)
            same = _file_sha256(out / DATA_FILE) == m["data_arrow_sha256"]
            print(f"wrote {out}: {m['sequences']} sequences, {m['tokens']} tokens, {time.perf_counter() - t0:.1f} s; "
                  f"{DATA_FILE} {'byte-identical to the original' if same else 'rebuilt (bytes differ: other pyarrow)'}")
    except (PackError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
