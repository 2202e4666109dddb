"""data.pack: a tokenize cache -> xz parts -> the same cache (rows, bytes, manifest), and its refusals."""

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from data.pack import PackError, _mask_runs, _unmask_runs, export, import_, main
from train.data import ArrowRows

SCHEMA = pa.schema([("id", pa.string()), ("turns", pa.list_(pa.int32())),
                    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])


def _rows(vocab: int, n: int = 40, seed: int = 0) -> list[dict]:
    """Chat-like rows: a prompt (mask 0), an answer (mask 1), sometimes a trailing 0 or a second answer;
    every 4 rows share a prompt (the recipe's greedy + 3 samples)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = np.random.default_rng(i // 4).integers(0, vocab, 5 + i // 4 % 7).tolist()
        answer = rng.integers(0, vocab, int(rng.integers(1, 60))).tolist()
        mask = [0] * len(prompt) + [1] * len(answer)
        if i % 3 == 1:  # a second turn: unsupervised user text, then another supervised span
            answer += [7, 8] + [9] * (i % 5 + 1)
            mask += [0, 0] + [1] * (i % 5 + 1)
        if i % 5 == 2:  # ends unsupervised (the newline after <|im_end|>)
            answer.append(11)
            mask.append(0)
        rows.append({"id": f"src-{i // 4}", "turns": [1] if i % 3 != 1 else [1, 3],
                     "input_ids": prompt + answer, "loss_mask": mask})
    rows.append({"id": "starts-supervised", "turns": [0], "input_ids": [vocab - 1, 0, 5], "loss_mask": [1, 1, 0]})
    rows.append({"id": "one-token", "turns": [1], "input_ids": [3], "loss_mask": [1]})
    return rows


def _cache(root: Path, rows: list[dict], name: str = "0123456789abcdef") -> Path:
    """A cache folder as data.tokenize writes it (stream of 7-row batches + its json files)."""
    folder = root / name
    folder.mkdir(parents=True)
    with pa.OSFile(str(folder / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, SCHEMA) as writer:
        for start in range(0, len(rows), 7):
            chunk = rows[start : start + 7]
            writer.write_batch(pa.RecordBatch.from_pydict({k: [r[k] for r in chunk] for k in SCHEMA.names}, schema=SCHEMA))
    manifest = {"code_version": 2, "tokenizer_digest": "ab" * 16, "template_digest": "cd" * 16, "max_length": 2048,
                "thinking": False, "assistant_turns": "all"}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    (folder / "summary.json").write_text(json.dumps({"sequences": len(rows), "manifest": manifest}) + "\n")
    (folder / "errors.jsonl").write_text('{"line": 3, "reason": "all_zero_mask"}\n')
    return folder


def _same_cache(a: Path, b: Path) -> None:
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for p in a.iterdir():
        assert (b / p.name).read_bytes() == p.read_bytes(), p.name
    ra, rb = ArrowRows(a), ArrowRows(b)  # what the trainer opens
    assert len(ra) == len(rb) and ra.max_token == (rb.max_token[0], ra.max_token[1].replace(str(b), str(a)))
    assert [ra.row(i) for i in range(len(ra))] == [rb.row(i) for i in range(len(rb))]
    keep = ("data_digest", "tokenizer", "chat_template_digest", "thinking", "tokenized_max_length")
    assert {k: ra.metadata()[k] for k in keep} == {k: rb.metadata()[k] for k in keep}


def test_mask_runs_alternate_from_a_zero_run():
    mask = np.array([0, 0, 1, 1, 0, 1, 1, 1, 0, 1], np.int8)  # sequences [0:5], [5:8], [8:8], [8:10]
    offsets = np.array([0, 5, 8, 8, 10])
    runs, nruns = _mask_runs(mask, offsets)
    assert runs.tolist() == [2, 2, 1, 0, 3, 1, 1]
    assert nruns.tolist() == [3, 2, 0, 2]
    assert _unmask_runs(runs, nruns).tolist() == mask.tolist()


def test_round_trip_is_the_same_cache(tmp_path):
    cache = _cache(tmp_path / "tok", _rows(49152))
    m = export(cache, tmp_path / "pack", part_mib=0.002)  # ~2 KiB parts: several
    assert len(m["parts"]) >= 2 and all(p["bytes"] <= 0.002 * (1 << 20) for p in m["parts"])
    assert m["input_ids_dtype"] == "<u2" and m["sequences"] == 42 and m["cache_name"] == cache.name
    assert m["tokens"] == sum(len(r["input_ids"]) for r in _rows(49152))
    out = import_([tmp_path / "pack"], cache_dir=tmp_path / "unpacked")
    assert out == tmp_path / "unpacked" / cache.name
    _same_cache(cache, out)  # data.arrow byte-identical too
    # the same from the part files named one by one, into an explicit folder
    files = sorted((tmp_path / "pack").iterdir())
    _same_cache(cache, import_(files, out=tmp_path / "again"))


def test_large_vocab_falls_back_to_uint32(tmp_path):
    rows = _rows(151936, n=12)
    assert max(max(r["input_ids"]) for r in rows) >= 1 << 16
    cache = _cache(tmp_path / "tok", rows)
    assert export(cache, tmp_path / "pack")["input_ids_dtype"] == "<u4"
    _same_cache(cache, import_([tmp_path / "pack"], out=tmp_path / "out"))


def test_corrupt_and_missing_parts_are_named(tmp_path, capsys):
    cache = _cache(tmp_path / "tok", _rows(49152))
    export(cache, tmp_path / "pack", part_mib=0.002)
    part = tmp_path / "pack" / "data.tar.xz.001"
    good = part.read_bytes()
    part.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    with pytest.raises(PackError, match=r"part .*data\.tar\.xz\.001 is corrupt"):
        import_([tmp_path / "pack"], out=tmp_path / "out")
    part.unlink()
    assert main(["import", "--parts", str(tmp_path / "pack"), "--out", str(tmp_path / "out")]) == 2
    assert "missing part(s) data.tar.xz.001" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_never_overwrites(tmp_path):
    cache = _cache(tmp_path / "tok", _rows(49152))
    first = export(cache, tmp_path / "pack")
    parts = {p.name: p.read_bytes() for p in (tmp_path / "pack").iterdir()}
    again = export(cache, tmp_path / "pack")  # the same archive: kept, not rewritten
    assert again["skipped"] and again["payload_sha256"] == first["payload_sha256"]
    other = _cache(tmp_path / "tok2", _rows(49152, seed=1))
    with pytest.raises(PackError, match=re.escape(
            f"--out {tmp_path / 'pack'} exists and is not a valid archive identical to this cache (the archive of "
            f"another cache or build); export refuses to overwrite it: delete {tmp_path / 'pack'} and export again")):
        export(other, tmp_path / "pack")
    assert {p.name: p.read_bytes() for p in (tmp_path / "pack").iterdir()} == parts
    (tmp_path / "out").mkdir()
    with pytest.raises(PackError, match="output .*out exists"):
        import_([tmp_path / "pack"], out=tmp_path / "out")
    files = {p.name: p.read_bytes() for p in Path(cache).iterdir() if p.is_file()}
    for out in (cache, Path(cache) / "pack"):  # the old message would have said to delete the cache itself
        with pytest.raises(PackError, match=re.escape(f"--out {out} is the cache folder or inside it (--cache {cache})")):
            export(cache, out)
    assert {p.name: p.read_bytes() for p in Path(cache).iterdir() if p.is_file()} == files


def test_bad_cache_is_refused(tmp_path):
    cache = _cache(tmp_path / "tok", _rows(49152, n=4))
    (cache / "summary.json").unlink()  # a build that did not finish
    with pytest.raises(PackError, match="not a finished data.tokenize cache"):
        export(cache, tmp_path / "pack")
    assert not (tmp_path / "pack").exists()


@pytest.mark.parametrize("name", ["../../evil", "a/b", "..", ".", "", ".hidden", "/abs", 7])
def test_import_refuses_a_cache_name_that_is_not_a_plain_folder_name(tmp_path, name):
    cache = _cache(tmp_path / "tok", _rows(49152, n=4))
    export(cache, tmp_path / "pack")
    manifest = json.loads((tmp_path / "pack" / "pack.json").read_text())
    (tmp_path / "pack" / "pack.json").write_text(json.dumps({**manifest, "cache_name": name}))
    with pytest.raises(PackError, match=re.escape(f"pack.json: cache_name {name!r} is not a plain folder name")):
        import_([tmp_path / "pack"], cache_dir=tmp_path / "a" / "b" / "caches")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack", "tok"]  # nothing written anywhere


@pytest.mark.parametrize("field", ["sequences", "tokens"])
def test_import_checks_the_rebuilt_counts_against_pack_json(tmp_path, field):
    cache = _cache(tmp_path / "tok", _rows(49152, n=4))
    m = export(cache, tmp_path / "pack")
    (tmp_path / "pack" / "pack.json").write_text(json.dumps({**m, field: m[field] + 1}))
    with pytest.raises(PackError, match=re.escape(f"pack.json: field {field!r} is {m[field] + 1} but the rebuilt "
                                                  f"data.arrow holds {m[field]}")):
        import_([tmp_path / "pack"], cache_dir=tmp_path / "unpacked")
    assert list((tmp_path / "unpacked").iterdir()) == []  # the temp folder is gone too


@pytest.mark.parametrize("field,value,msg", [
    ("parts", {"file": "x"}, "field 'parts' must be a non-empty list of {file, bytes, sha256} objects, got "
                             "{\"file\": \"x\"}"),
    ("parts", [{"file": "data.tar.xz.000", "bytes": "12", "sha256": "ab"}], "field 'parts' must be a non-empty list"),
    ("parts", [], "field 'parts' must be a non-empty list of {file, bytes, sha256} objects, got []"),
    ("data_arrow_sha256", 5, "field 'data_arrow_sha256' must be a string, got 5"),
    ("payload_sha256", None, "field 'payload_sha256' must be a string, got null"),
    ("tokens", 1.5, "field 'tokens' must be a whole number, got 1.5")])
def test_a_pack_json_field_of_the_wrong_type_is_named(tmp_path, capsys, field, value, msg):
    """Valid JSON of the wrong type in pack.json: a message naming the file and field, not a traceback (second
    fresh-clone review)."""
    cache = _cache(tmp_path / "tok", _rows(49152, n=4))
    m = export(cache, tmp_path / "pack")
    (tmp_path / "pack" / "pack.json").write_text(json.dumps({**m, field: value}))
    assert main(["import", "--parts", str(tmp_path / "pack"), "--cache-dir", str(tmp_path / "unpacked")]) == 2
    assert f"{tmp_path / 'pack' / 'pack.json'}: {msg}" in capsys.readouterr().err
    assert not (tmp_path / "unpacked").exists() or list((tmp_path / "unpacked").iterdir()) == []


def test_export_onto_a_corrupt_or_differently_split_archive(tmp_path, capsys):
    cache = _cache(tmp_path / "tok", _rows(49152))
    out = tmp_path / "pack"
    assert main(["export", "--cache", str(cache), "--out", str(out), "--part-mib", "0.002"]) == 0
    n_parts = len(json.loads((out / "pack.json").read_text())["parts"])
    capsys.readouterr()
    # another --part-mib: the archive is kept as it is, and the output says so
    assert main(["export", "--cache", str(cache), "--out", str(out), "--part-mib", "15"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"kept (identical archive) {out}: 42 sequences") and len(printed) == 2
    assert printed[1] == (f"note: {out} was kept with its own part size (largest part 2097 bytes), not re-split for "
                          f"--part-mib 15; delete it and export again to re-split")
    assert len(json.loads((out / "pack.json").read_text())["parts"]) == n_parts >= 2
    assert main(["export", "--cache", str(cache), "--out", str(out), "--part-mib", "0.002"]) == 0
    assert "note:" not in capsys.readouterr().out  # the same split: nothing to say
    # a corrupt part of the existing archive: refused, with what to do
    part = out / "data.tar.xz.000"
    part.write_bytes(part.read_bytes()[:-1])
    assert main(["export", "--cache", str(cache), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out} exists and is not a valid archive identical to this cache (part {part} "
                          "is corrupt: 2096 bytes")
    assert err.endswith(f"); export refuses to overwrite it: delete {out} and export again\n")


def test_a_killed_export_or_import_leaves_nothing_for_the_next_run(tmp_path):
    """data.pack builds in `.<name>.tmp-<pid>` beside its output (data.staging.tmp_beside, as data.tokenize): a
    SIGKILLed run's folder is removed by the next export or import of the same name once that process is gone; a
    live process's is left alone."""
    import os
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cache = _cache(tmp_path / "tok", _rows(49152))
    stale = {p: p.with_name(f".{p.name}.tmp-{dead.pid}") for p in (tmp_path / "pack", tmp_path / "unpacked" / cache.name)}
    live = (tmp_path / "pack").with_name(f".pack.tmp-{os.getppid()}")
    for d in [*stale.values(), live]:
        d.mkdir(parents=True)
        (d / "partial").write_text("x")
    export(cache, tmp_path / "pack")
    assert not stale[tmp_path / "pack"].exists() and live.is_dir()
    _same_cache(cache, import_([tmp_path / "pack"], cache_dir=tmp_path / "unpacked"))
    assert not stale[tmp_path / "unpacked" / cache.name].exists()
