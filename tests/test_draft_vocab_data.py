"""data.draft_vocab (count answer tokens -> a draft vocabulary file) and dspine.draft_vocab's checks.

The rows below give hand-countable answer tokens (loss_mask 1):
ids 10..79 once each (70), id 90 five times, id 95 three times: 78 answer tokens, largest id 95.
Prompt tokens (loss_mask 0): id 0 102 times, id 1 50 times: 230 tokens in all.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from data import draft_vocab as cli
from data.draft_vocab import main
from dspine.draft_vocab import (
    FORMAT,
    MIN_SIZE,
    check_draft_vocab,
    load_draft_vocab,
    save_draft_vocab,
    select_draft_vocab,
)
from train.data import JsonlRows

REPO = Path(__file__).resolve().parents[1]

ROWS = [
    {"input_ids": [0] * 50 + [1] * 25 + list(range(10, 45)), "loss_mask": [0] * 75 + [1] * 35},
    {
        "input_ids": [0] * 50 + [1] * 25 + list(range(45, 80)) + [90] * 5 + [0],
        "loss_mask": [0] * 75 + [1] * 40 + [0],
    },
    {"input_ids": [95, 95, 0, 95], "loss_mask": [1, 1, 0, 1]},
    {"input_ids": [], "loss_mask": []},
]
ANSWER_TOTAL, ALL_TOTAL = 78, 230


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cache(folder: Path, manifest: dict) -> Path:
    """A data.tokenize cache folder of ROWS (data.arrow, then ``manifest`` as manifest.json, summary.json last)."""
    import pyarrow as pa

    folder.mkdir()
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    with pa.OSFile(str(folder / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(pa.RecordBatch.from_pydict({k: [r[k] for r in ROWS] for k in schema.names}, schema=schema))
    (folder / "manifest.json").write_text(json.dumps(manifest) + "\n")
    (folder / "summary.json").write_text(json.dumps({"sequences": len(ROWS)}) + "\n")
    return folder


@pytest.fixture
def rows_file(tmp_path) -> Path:
    return _jsonl(tmp_path / "rows.jsonl", ROWS)


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _refused(capsys, *argv) -> str:
    """Run main, expect exit code 2 and a one-line error; return it."""
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


# ------------------------------------------------------------------------------------------ CLI


def test_answer_tokens_with_keep_and_vocab_size(rows_file, tmp_path, capsys):
    """Ties (ids 10..79, once each) go to the lower id; a --keep id that never occurs (5) takes one place."""
    out = tmp_path / "sub" / "vocab.safetensors"  # a missing parent folder is created
    rc, stdout, err = _run(
        capsys, "--data", rows_file, "--size", 64, "--output", out, "--vocab-size", 100, "--keep", "5"
    )
    assert rc == 0 and err.startswith("note: the rows record no tokenizer: the file has no tokens_digest"), err
    assert err.count("\n") == 1 and "tokens_digest" not in load_draft_vocab(out)[1]
    ids, meta = load_draft_vocab(out, vocab_size=100)
    want = [5, *range(10, 71), 90, 95]
    assert ids.dtype == torch.int64 and ids.tolist() == want
    coverage = (5 + 3 + 61) / ANSWER_TOTAL
    assert meta == {
        "format": FORMAT,
        "size": "64",
        "coverage": f"{coverage:.6g}",
        "counted_tokens": "78",
        "vocab_size": "100",
        "source": str(rows_file),
        "source_digest": JsonlRows(rows_file).metadata()["data_digest"],
        "counted": "answer tokens",
        "keep": "5",
    }
    assert float(meta["coverage"]) == pytest.approx(coverage, rel=1e-6)
    assert stdout.count("\n") == 1
    for part in ("64 token ids", f"{100 * coverage:.3f}%", "78 counted answer tokens", str(out)):
        assert part in stdout, (part, stdout)
    # the selection is select_draft_vocab's on the same counts
    counts = torch.zeros(100, dtype=torch.int64)
    counts[10:80] = 1
    counts[90], counts[95] = 5, 3
    ref, ref_cov = select_draft_vocab(counts, 64, [5])
    assert ref.tolist() == want and ref_cov == coverage


def test_vocab_size_defaults_to_largest_counted_id(rows_file, tmp_path, capsys):
    out = tmp_path / "v.safetensors"
    rc, _, err = _run(capsys, "--data", rows_file, "--size", 64, "--output", out)
    assert rc == 0, err
    ids, meta = load_draft_vocab(out)
    assert ids.tolist() == [*range(10, 72), 90, 95]
    # no --vocab-size: the ids index 0..95, but the target's size is unknown, so none is recorded (a loader would
    # otherwise refuse the file for the real target's larger vocabulary)
    assert "vocab_size" not in meta and meta["keep"] == "" and meta["counted"] == "answer tokens"
    assert load_draft_vocab(out, vocab_size=1000)[0].tolist() == ids.tolist()
    assert meta["coverage"] == f"{(5 + 3 + 62) / ANSWER_TOTAL:.6g}"
    # and the whole counted vocabulary: coverage 1
    rc, _, err = _run(capsys, "--data", rows_file, "--size", 96, "--output", tmp_path / "all.safetensors")
    assert rc == 0, err
    ids, meta = load_draft_vocab(tmp_path / "all.safetensors")
    assert ids.tolist() == list(range(96)) and meta["coverage"] == "1"


def test_all_tokens_counts_the_prompts_too(rows_file, tmp_path, capsys):
    answer, every = tmp_path / "answer.safetensors", tmp_path / "all.safetensors"
    assert _run(capsys, "--data", rows_file, "--size", 64, "--output", answer)[0] == 0
    rc, stdout, err = _run(capsys, "--data", rows_file, "--size", 64, "--output", every, "--all-tokens")
    assert rc == 0, err
    ids, meta = load_draft_vocab(every)
    assert ids.tolist() == [0, 1, *range(10, 70), 90, 95]  # the prompt's 0 and 1 push out 70 and 71
    assert ids.tolist() != load_draft_vocab(answer)[0].tolist()
    coverage = (102 + 50 + 5 + 3 + 60) / ALL_TOTAL
    assert meta["counted"] == "all tokens" and meta["counted_tokens"] == str(ALL_TOTAL)
    assert meta["coverage"] == f"{coverage:.6g}" and "vocab_size" not in meta
    assert f"{100 * coverage:.3f}% of 230 counted all tokens" in stdout


def test_comma_separated_sources_count_their_union(tmp_path, capsys):
    a, b = _jsonl(tmp_path / "a.jsonl", ROWS[:2]), _jsonl(tmp_path / "b.jsonl", ROWS[2:])
    out = tmp_path / "v.safetensors"
    rc, _, err = _run(capsys, "--data", f"{a},{b}", "--size", 64, "--output", out, "--vocab-size", 100)
    assert rc == 0, err
    ids, meta = load_draft_vocab(out, 100)
    assert ids.tolist() == [*range(10, 72), 90, 95]
    assert meta["source"] == f"{a},{b}" and meta["counted_tokens"] == "78"
    assert len(meta["source_digest"]) == 64  # ConcatRows: sha256 of the parts' digests


def test_tokenize_cache_folder(tmp_path, capsys):
    """A data.tokenize cache folder (data.arrow + manifest.json + summary.json) counts as its rows do."""
    from dspine.io import file_digest

    folder = _cache(tmp_path / "cache", {"max_length": 2048})
    out = tmp_path / "v.safetensors"
    rc, _, err = _run(capsys, "--data", folder, "--size", 64, "--output", out, "--keep", "5")
    assert rc == 0, err
    ids, meta = load_draft_vocab(out)
    assert ids.tolist() == [5, *range(10, 71), 90, 95] and meta["counted_tokens"] == "78"
    assert meta["source"] == str(folder) and meta["source_digest"] == file_digest(folder / "manifest.json")


def test_count_tokens_flushes_and_grows(rows_file, monkeypatch):
    """Bincounts of a few ids at a time (the counts array grows as larger ids come) sum to the exact counts."""
    want = np.zeros(96, np.int64)
    want[10:80], want[90], want[95] = 1, 5, 3
    counts, n = cli.count_tokens(JsonlRows(rows_file))
    assert n == 4 and counts.tolist() == want.tolist()
    monkeypatch.setattr(cli, "FLUSH_TOKENS", 3)
    assert cli.count_tokens(JsonlRows(rows_file))[0].tolist() == want.tolist()
    counts = cli.count_tokens(JsonlRows(rows_file), all_tokens=True, vocab_size=120)[0]
    want[0], want[1] = 102, 50
    assert len(counts) == 120 and counts[:96].tolist() == want.tolist() and not counts[96:].any()


def test_existing_output_is_refused_before_counting(rows_file, tmp_path, capsys):
    out = tmp_path / "v.safetensors"
    out.write_bytes(b"finished work")
    err = _refused(capsys, "--data", rows_file, "--size", 64, "--output", out)
    assert f"--output {out} exists" in err and "never overwritten" in err
    assert out.read_bytes() == b"finished work"
    # checked before the data is even opened: a missing --data is not what is reported
    err = _refused(capsys, "--data", tmp_path / "missing.jsonl", "--size", 64, "--output", out)
    assert "--output" in err and "missing.jsonl" not in err
    assert out.read_bytes() == b"finished work"


def test_output_that_cannot_be_written(rows_file, tmp_path, capsys):
    err = _refused(capsys, "--data", rows_file, "--size", 64, "--output", tmp_path)
    assert f"--output {tmp_path} is a folder" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    err = _refused(capsys, "--data", rows_file, "--size", 64, "--output", blocker / "v.safetensors")
    assert "--output" in err and "cannot create it" in err
    if os.path.isdir("/proc/self"):  # root may write anywhere but here
        err = _refused(capsys, "--data", rows_file, "--size", 64, "--output", "/proc/v.safetensors")
        assert "--output /proc/v.safetensors: cannot create it" in err


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--size", "63"], ["--size 63", f"{MIN_SIZE}"]),
        (["--size", "101", "--vocab-size", "100"], ["--size 101", "64..100"]),
        (["--size", "97"], ["--size 97", "96 token ids seen", "--vocab-size"]),  # V = largest id + 1 = 96
        (["--size", "64", "--vocab-size", "10"], ["--vocab-size 10"]),
    ],
)
def test_size_errors(rows_file, tmp_path, capsys, extra, needles):
    out = tmp_path / "v.safetensors"
    err = _refused(capsys, "--data", rows_file, "--output", out, *extra)
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()


def test_counted_id_outside_vocab_size(rows_file, tmp_path, capsys):
    out = tmp_path / "v.safetensors"
    err = _refused(capsys, "--data", rows_file, "--size", 64, "--output", out, "--vocab-size", 90)
    assert "token id 90 in row 1" in err and "--vocab-size 90" in err
    assert not out.exists()
    # a prompt id outside it is not counted, so not an error: answer ids go up to 95, prompt ids to 1
    assert _run(capsys, "--data", rows_file, "--size", 64, "--output", out, "--vocab-size", 96)[0] == 0


@pytest.mark.parametrize(
    ("keep", "extra", "needles"),
    [
        ("5,x", [], ["--keep 5,x", "'x' is not an integer"]),
        ("1.5", [], ["'1.5' is not an integer"]),
        ("-1", [], ["--keep -1: token id -1 is negative"]),
        ("3,100", ["--vocab-size", "100"], ["token id 100 is outside 0..99"]),
        ("96", [], ["token id 96 is outside the counted ids 0..95", "--vocab-size"]),
        (",".join(map(str, range(65))), ["--vocab-size", "100"], ["65 ids do not fit --size 64"]),
    ],
)
def test_bad_keep(rows_file, tmp_path, capsys, keep, extra, needles):
    out = tmp_path / "v.safetensors"
    err = _refused(capsys, "--data", rows_file, "--size", 64, "--output", out, "--keep", keep, *extra)
    for needle in needles:
        assert needle in err, (needle, err)
    assert not out.exists()


def test_missing_empty_or_unsupervised_data(tmp_path, capsys):
    out = tmp_path / "v.safetensors"
    err = _refused(capsys, "--data", tmp_path / "nope.jsonl", "--size", 64, "--output", out)
    assert "--data" in err and "nope.jsonl" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "no rows" in _refused(capsys, "--data", empty, "--size", 64, "--output", out)
    prompts = _jsonl(
        tmp_path / "prompts.jsonl",
        [{"input_ids": list(range(70)), "loss_mask": [0] * 70}, {"input_ids": [], "loss_mask": []}],
    )
    err = _refused(capsys, "--data", prompts, "--size", 64, "--output", out, "--vocab-size", 100)
    assert "2 rows but no answer tokens" in err and "--all-tokens" in err
    assert not out.exists()
    rc, stdout, err = _run(capsys, "--data", prompts, "--size", 64, "--output", out, "--all-tokens")
    assert rc == 0 and "coverage 91.429% of 70" in stdout  # 64 of 70 ids that occur once each
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    err = _refused(capsys, "--data", corrupt, "--size", 64, "--output", tmp_path / "w.safetensors")
    assert "corrupt.jsonl:1" in err and "loss_mask" in err


def test_help_runs_as_a_module():
    r = subprocess.run(
        [sys.executable, "-m", "data.draft_vocab", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    for flag in ("--data", "--size", "--output", "--vocab-size", "--keep", "--all-tokens"):
        assert flag in r.stdout


# ------------------------------------------------------------------------------- dspine.draft_vocab


def test_select_ranks_by_count_then_lower_id():
    counts = torch.zeros(200, dtype=torch.int64)
    counts[138:199] = 2  # 61 ids, count 2
    counts[199] = 9
    counts[[120, 7, 3]] = 1  # tied at the boundary: the lower ids win
    total = 9 + 2 * 61 + 3
    ids, coverage = select_draft_vocab(counts, 64)  # 199, 138..198, then 2 of the 3 count-1 ids
    assert ids.tolist() == [3, 7, *range(138, 200)] and coverage == (total - 1) / total
    # a keep id with no count (0) takes a place: one count-1 id less
    ids, coverage = select_draft_vocab(counts, 64, keep=[0])
    assert ids.tolist() == [0, 3, *range(138, 200)] and coverage == (total - 2) / total
    # room for every counted id: the rest are count-0 ids, the lowest first; a keep id chosen anyway (150)
    ids, coverage = select_draft_vocab(counts, 70, keep=[0, 150])
    assert ids.tolist() == [0, 1, 2, 3, 4, 5, 7, 120, *range(138, 200)] and coverage == 1.0
    with pytest.raises(ValueError, match=r"size 63: must be in 64\.\.200"):
        select_draft_vocab(counts, 63)
    with pytest.raises(ValueError, match=r"keep ids \[200\]"):
        select_draft_vocab(counts, 64, keep=[200])
    assert select_draft_vocab(torch.zeros(64, dtype=torch.int64), 64)[1] == 1.0  # nothing counted


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([*range(63), 5], "token id 5 appears more than once"),
        ([*range(63), 1000], "token id 1000 is outside the target's vocabulary 0..99"),
        ([*range(63), -1], "token id -1 is outside"),
        (
            torch.arange(128).reshape(2, 64),
            r"token_ids must be a 1-D integer tensor \(got \(2, 64\) torch.int64\)",
        ),
        (
            torch.arange(64, dtype=torch.float32),
            r"token_ids must be a 1-D integer tensor \(got \(64,\) torch.float32\)",
        ),
        (list(range(63)), "63 token ids; need 64..100"),
    ],
)
def test_check_draft_vocab_refusals(ids, match):
    with pytest.raises(ValueError, match=f"^where.safetensors: {match}"):
        check_draft_vocab(ids, 100, where="where.safetensors")


def test_check_draft_vocab_sorts():
    ids = list(range(64))[::-1]
    assert check_draft_vocab(ids, 64).tolist() == list(range(64))


def test_save_refuses_existing_and_load_round_trip(tmp_path):
    path = tmp_path / "v.safetensors"
    save_draft_vocab(path, torch.arange(64) * 2, {"size": 64})
    ids, meta = load_draft_vocab(path)
    assert ids.tolist() == list(range(0, 128, 2)) and meta == {"format": FORMAT, "size": "64"}
    with pytest.raises(ValueError, match="token id 100 is outside the target's vocabulary 0..99"):
        load_draft_vocab(path, vocab_size=100)
    with pytest.raises(FileExistsError, match="not overwritten"):
        save_draft_vocab(path, torch.arange(64), {})
    assert load_draft_vocab(path)[0].tolist() == ids.tolist()


def test_load_refuses_other_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_draft_vocab(tmp_path / "nope.safetensors")
    plain = tmp_path / "plain.safetensors"
    save_file({"token_ids": torch.arange(64)}, str(plain))  # no format metadata
    with pytest.raises(ValueError, match=f"{plain}: metadata format=None, expected '{FORMAT}'"):
        load_draft_vocab(plain)
    other = tmp_path / "other.safetensors"
    save_file({"token_ids": torch.arange(64)}, str(other), metadata={"format": "something-else"})
    with pytest.raises(ValueError, match=f"{other}: metadata format='something-else'"):
        load_draft_vocab(other)
    no_ids = tmp_path / "no_ids.safetensors"
    save_file({"ids": torch.arange(64)}, str(no_ids), metadata={"format": FORMAT})
    with pytest.raises(ValueError, match=f"{no_ids}: no tensor 'token_ids'"):
        load_draft_vocab(no_ids)
    text = tmp_path / "rows.jsonl"
    text.write_text('{"input_ids": [1], "loss_mask": [1]}\n')
    with pytest.raises(ValueError, match=f"{text}: not a safetensors file"):
        load_draft_vocab(text)


def test_save_keeps_its_format_tag_and_checks_the_ids(tmp_path):
    """A caller's own ``format`` key cannot replace the tag the loader needs; ids are checked before writing
    (nothing is left behind), stored ascending; a folder given to the loader is named as one."""
    from dspine.draft_vocab import load_draft_vocab, save_draft_vocab

    f = tmp_path / "v.safetensors"
    save_draft_vocab(f, torch.arange(99, 29, -1), {"format": "x", "vocab_size": 100})
    ids, meta = load_draft_vocab(f, 100)
    assert meta["format"] == "dspine-draft-vocab" and torch.equal(ids, torch.arange(30, 100))
    with pytest.raises(ValueError, match="token id 5 appears more than once"):
        save_draft_vocab(tmp_path / "dup.safetensors", torch.full((64,), 5), {})
    with pytest.raises(ValueError, match="token id 100 is outside the target's vocabulary 0..99"):
        save_draft_vocab(tmp_path / "big.safetensors", torch.arange(37, 101), {"vocab_size": 100})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.safetensors"]
    with pytest.raises(ValueError, match="is a folder"):
        load_draft_vocab(tmp_path)


def test_size_missing_data_and_the_part_of_a_source_list_are_named(rows_file, tmp_path, capsys):
    """A --size below the minimum without --vocab-size says the bound; a missing --data path is called missing;
    an id beyond --vocab-size in the second of two sources names that file and its row."""
    out = tmp_path / "v.safetensors"
    assert "--size 63: must be >= 64" in _refused(capsys, "--data", rows_file, "--size", 63, "--output", out)
    missing = tmp_path / "nope.jsonl"
    assert f"--data: {missing}: no such file or folder" in _refused(
        capsys, "--data", missing, "--size", 64, "--output", out)
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [1, 1]}) + "\n"
                   + json.dumps({"input_ids": [3, 7000], "loss_mask": [0, 1]}) + "\n")
    err = _refused(capsys, "--data", f"{rows_file},{big}", "--size", 64, "--output", out, "--vocab-size", 100)
    assert f"token id 7000 in row 1 of {big} is outside --vocab-size 100" in err


# ------------------------------------------------------------------------------------------ tokenizer digest


class _Renamed:
    """A tokenizer whose ids name other tokens than ``tok``'s: id i is tok's token of id i + 1 (same vocab size)."""

    def __init__(self, tok):
        self.tok = tok

    def convert_ids_to_tokens(self, ids):
        return self.tok.convert_ids_to_tokens([(i + 1) % len(self.tok) for i in ids])


def test_tokenizer_digest_is_recorded_and_checked(rows_file, stories_dir, tmp_path, capsys):
    """--tokenizer records the ids' token strings' digest; the same tokenizer passes check_tokens, one whose ids
    name other tokens (same size) is refused by file name; a file without the digest passes unchecked."""
    from dspine.draft_vocab import check_tokens, tokens_digest
    from dspine.paths import load_tokenizer

    out = tmp_path / "v.safetensors"
    rc, stdout, err = _run(capsys, "--data", rows_file, "--size", 64, "--output", out, "--vocab-size", 512,
                           "--tokenizer", stories_dir)
    assert rc == 0 and err == "", err
    ids, meta = load_draft_vocab(out, vocab_size=512)
    tok = load_tokenizer(str(stories_dir))
    assert meta["tokenizer"] == str(stories_dir) and meta["tokens_digest"] == tokens_digest(tok, ids)
    assert len(meta["tokens_digest"]) == 32
    check_tokens(out, ids, meta, tok)  # the same tokenizer: passes
    assert tokens_digest(_Renamed(tok), ids) != meta["tokens_digest"]
    with pytest.raises(ValueError, match=f"{out}: its token ids name other tokens in the target's tokenizer") as e:
        check_tokens(out, ids, meta, _Renamed(tok))
    assert str(stories_dir) in str(e.value)
    check_tokens(out, ids, {k: v for k, v in meta.items() if k != "tokens_digest"}, _Renamed(tok))  # no digest
    check_tokens(out, ids, meta, None)  # no tokenizer at hand


def test_tokenizer_from_the_cache_manifest(stories_dir, tmp_path, capsys):
    """A data.tokenize cache whose manifest names a tokenizer path that exists here gets the digest without
    --tokenizer; one naming a path that is not here gets a note and no digest; a --tokenizer that does not load
    is refused before counting, naming the flag."""
    from dspine.draft_vocab import tokens_digest
    from dspine.paths import load_tokenizer

    def cache(name, tokenizer):
        return _cache(tmp_path / name, {"max_length": 2048, "tokenizer": tokenizer})

    here = cache("here", str(stories_dir))
    rc, _, err = _run(capsys, "--data", here, "--size", 64, "--output", tmp_path / "a.safetensors")
    assert rc == 0 and err == "", err
    ids, meta = load_draft_vocab(tmp_path / "a.safetensors")
    assert meta["tokens_digest"] == tokens_digest(load_tokenizer(str(stories_dir)), ids)

    gone = cache("gone", str(tmp_path / "no-such-tokenizer"))
    rc, _, err = _run(capsys, "--data", gone, "--size", 64, "--output", tmp_path / "b.safetensors")
    assert rc == 0 and err.startswith(f"note: the rows' tokenizer {tmp_path / 'no-such-tokenizer'} did not load "
                                      "here (") and "the file has no tokens_digest" in err, err
    assert "tokens_digest" not in load_draft_vocab(tmp_path / "b.safetensors")[1]

    err = _refused(capsys, "--data", here, "--size", 64, "--output", tmp_path / "c.safetensors",
                   "--tokenizer", tmp_path / "missing-tok")
    assert err.startswith(f"error: --tokenizer {tmp_path / 'missing-tok'}: "), err
    assert not (tmp_path / "c.safetensors").exists()


def test_empty_output_and_an_interrupt(rows_file, tmp_path, capsys, monkeypatch):
    """An empty --output is refused by name; Ctrl-C while counting leaves no file and no traceback."""
    err = _refused(capsys, "--data", rows_file, "--size", 64, "--output", "")
    assert err.startswith("error: --output: give the path of the .safetensors file to write"), err

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "count_tokens", interrupted)
    out = tmp_path / "v.safetensors"
    rc, stdout, err = _run(capsys, "--data", rows_file, "--size", 64, "--output", out)
    assert rc == 130 and stdout == "" and err.endswith(f"interrupted: {out} not written\n"), err
    assert not out.exists() and list(tmp_path.iterdir()) == [rows_file]


def test_tokenizer_must_be_the_rows_tokenizer(stories_dir, tmp_path, capsys):
    """With a manifest tokenizer_digest: --tokenizer of another tokenizer is refused (naming both); a recorded
    relative path that names another tokenizer from here gives a note and no tokens_digest; a tokenizer whose files
    are broken is one error line (--tokenizer) or a note (recorded)."""
    from data.tokenize import tokenizer_digest
    from tests.conftest import shared_path

    def cache(name, tokenizer, digest):
        return _cache(tmp_path / name, {"tokenizer": tokenizer, "tokenizer_digest": digest})

    stories = cache("stories", str(stories_dir), tokenizer_digest(str(stories_dir)))
    qwen = str(shared_path("models", "qwen3-tokenizer"))
    err = _refused(capsys, "--data", stories, "--size", 64, "--output", tmp_path / "a.safetensors", "--tokenizer", qwen)
    assert err.startswith(f"error: --tokenizer {qwen}: not the tokenizer the rows were tokenized with"), err
    assert str(stories_dir) in err
    rc, _, err = _run(capsys, "--data", stories, "--size", 64, "--output", tmp_path / "b.safetensors",
                      "--tokenizer", stories_dir)
    assert rc == 0 and err == "" and "tokens_digest" in load_draft_vocab(tmp_path / "b.safetensors")[1]

    moved = cache("moved", qwen, tokenizer_digest(str(stories_dir)))  # the recorded path now names another tokenizer
    rc, _, err = _run(capsys, "--data", moved, "--size", 64, "--output", tmp_path / "c.safetensors")
    assert rc == 0 and err.startswith(f"note: the rows' tokenizer {qwen} names another tokenizer here"), err
    assert "tokens_digest" not in load_draft_vocab(tmp_path / "c.safetensors")[1]

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    err = _refused(capsys, "--data", stories, "--size", 64, "--output", tmp_path / "d.safetensors",
                   "--tokenizer", broken)
    assert err.startswith(f"error: --tokenizer {broken}: "), err
    rc, _, err = _run(capsys, "--data", cache("broken-rec", str(broken), None), "--size", 64,
                      "--output", tmp_path / "e.safetensors")
    assert rc == 0 and err.startswith(f"note: the rows' tokenizer {broken} did not load here ("), err
    assert err.count("\n") == 1


def test_vocab_size_metadata_is_compared_as_a_number(tmp_path):
    """'049152' is 49152; a vocab_size that is not an integer is refused by name."""
    f = tmp_path / "v.safetensors"
    save_file({"token_ids": torch.arange(64)}, str(f), metadata={"format": FORMAT, "vocab_size": "0512"})
    assert load_draft_vocab(f, vocab_size=512)[0].numel() == 64
    g = tmp_path / "w.safetensors"
    save_file({"token_ids": torch.arange(64)}, str(g), metadata={"format": FORMAT, "vocab_size": "lots"})
    with pytest.raises(ValueError, match=f"{g}: metadata vocab_size='lots' is not an integer"):
        load_draft_vocab(g, vocab_size=512)


def test_the_cli_module_imports_without_torch_and_sigterm_takes_the_ctrl_c_path(monkeypatch, tmp_path, capsys):
    """``import data.draft_vocab`` (and so ``--help``) loads neither torch nor transformers (``import dspine`` is light:
    when it loaded both, the module took 3.7 s instead of 0.06 s). A SIGTERM during the work exits 130 with the Ctrl-C
    line."""
    import signal

    code = "import sys, data.draft_vocab; print('torch' in sys.modules, 'transformers' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False"], r.stderr
    monkeypatch.setattr(cli, "build", lambda *a: os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "v.safetensors"
    assert main(["--data", str(tmp_path), "--size", "8", "--output", str(out)]) == 130
    assert f"interrupted: {out} not written" in capsys.readouterr().err
