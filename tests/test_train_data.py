"""Trainer data: readers, several sources as one (ConcatRows), per-epoch order, rank split, collation;
data.sample_target."""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch

from data.sample_target import main as sample_main
from tests.test_data_pack import _cache, _rows
from train.data import (
    ArrowRows,
    ConcatRows,
    JsonlRows,
    StepOrder,
    epoch_permutation,
    make_batch,
    open_rows,
    open_sources,
    split_sources,
)
from train.loss import anchor_generator


def test_step_order_disjoint_ranks_and_full_epochs():
    order = StepOrder(n_rows=103, micro_batch_size=2, grad_accum=3, world=4, seed=7)
    assert order.global_batch == 24 and order.steps_per_epoch == 4
    for epoch in range(2):
        seen = []
        for step in range(epoch * 4, epoch * 4 + 4):
            per_rank = [order.rank_rows(step, r) for r in range(4)]
            assert all(len(m) == 3 and all(len(x) == 2 for x in m) for m in per_rank)
            flat = [[i for m in rr for i in m] for rr in per_rank]
            assert len(set(sum(flat, []))) == 24  # ranks disjoint within a step
            seen += sum(flat, [])
        assert len(seen) == len(set(seen)) == 96  # no row twice in an epoch (7 dropped)
    assert order.position(5).epoch == 1 and order.position(5).index == 24
    # deterministic from (seed, epoch); epochs differ
    assert epoch_permutation(103, 7, 0) == epoch_permutation(103, 7, 0) != epoch_permutation(103, 7, 1)
    again = StepOrder(103, 2, 3, 4, 7)
    assert again.rank_rows(6, 2) == order.rank_rows(6, 2)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        StepOrder(10, 2, 3, 4, 7)


def test_make_batch_truncates_pads_and_counts_skipped():
    rows = [
        {"input_ids": list(range(10, 22)), "loss_mask": [0, 0] + [1] * 10},  # 12 tokens, truncated to 8
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 0, 1, 0]},  # no valid anchor
        {"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]},  # anchor 1 only
    ]
    b = make_batch(rows, [5, 6, 7], max_length=8, block_size=4, mask_token_id=99, gamma=7.0, anchors_per_seq=3,
                   generator=anchor_generator(0, 0, 0, 0), pad_to_multiple=1)
    assert b.input_ids.shape == (3, 8) and b.lengths.tolist() == [8, 5, 3]
    assert b.input_ids[0].tolist() == list(range(10, 18))
    assert b.input_ids[2].tolist() == [7, 8, 9, 0, 0, 0, 0, 0]
    assert b.attention_mask[1].tolist() == [1] * 5 + [0] * 3
    assert b.skipped == 1 and b.row_ids == [5, 6, 7] and b.tokens == 16
    assert (b.anchors[1] == -1).all() and b.anchors[2].tolist()[0] == 1
    a0 = b.anchors[0][b.anchors[0] >= 0]
    assert len(a0) == 3 and all(2 <= int(a) <= 6 for a in a0)  # p + 1 < 8 after truncation
    assert b.weights[1].sum() == 0
    # label of slot 1 of row 2's block = token at 2; slot 2 past the end has weight 0
    assert b.labels[2, 1] == 9 and b.weights[2, 1] == 1.0 and b.weights[2, 2] == 0
    padded = make_batch(rows, [5, 6, 7], max_length=8, block_size=4, mask_token_id=99, gamma=7.0, anchors_per_seq=3,
                        generator=anchor_generator(0, 0, 0, 0), pad_to_multiple=512, static_anchors=True)
    assert padded.input_ids.shape == (3, 8) and padded.anchors.shape == (3, 3)  # capped at max_length


def test_jsonl_and_arrow_readers_agree(tmp_path):
    import pyarrow as pa

    rows = [{"id": f"r{i}", "input_ids": list(range(i + 2)), "loss_mask": [0] + [1] * (i + 1)} for i in range(5)]
    jl = tmp_path / "rows.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    # the data.tokenize cache layout: an Arrow stream file data.arrow (+ manifest.json)
    folder = tmp_path / "cache"
    folder.mkdir()
    schema = pa.schema([("id", pa.string()), ("turns", pa.list_(pa.int32())), ("input_ids", pa.list_(pa.int32())),
                        ("loss_mask", pa.list_(pa.int8()))])
    with pa.OSFile(str(folder / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        w.write_table(pa.table({"id": [r["id"] for r in rows], "turns": [[1]] * 5,
                                "input_ids": [r["input_ids"] for r in rows],
                                "loss_mask": [r["loss_mask"] for r in rows]}, schema=schema))
    (folder / "manifest.json").write_text(json.dumps({"max_length": 64, "thinking": False, "template_digest": "x"}))
    (folder / "summary.json").write_text(json.dumps({"sequences": 5}))
    a, b = open_rows(jl), open_rows(folder)
    assert isinstance(a, JsonlRows) and len(a) == len(b) == 5
    for i in (4, 0, 2):
        assert a.row(i) == {"input_ids": rows[i]["input_ids"], "loss_mask": rows[i]["loss_mask"]} == b.row(i)
    assert b.metadata()["thinking"] is False and len(a.metadata()["data_digest"]) == 32
    # taken in the open's one pass over the file: the file's blake2b-128, blank lines included
    assert a.metadata()["data_digest"] == hashlib.blake2b(jl.read_bytes(), digest_size=16).hexdigest()
    with pytest.raises(FileNotFoundError):
        open_rows(tmp_path / "missing.jsonl")


def test_sample_target_rows_and_no_overwrite(tmp_path, stories_dir, capsys):
    out = tmp_path / "s.jsonl"
    args = ["--target", str(stories_dir), "--num", "5", "--max-new-tokens", "12", "--seed", "3", "--batch-size", "2",
            "--out", str(out)]
    assert sample_main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5 and len({r["id"] for r in rows}) == 5
    for r in rows:
        assert r["input_ids"][0] == 1 and r["loss_mask"][0] == 0  # BOS unsupervised
        assert len(r["input_ids"]) == len(r["loss_mask"]) <= 13 and set(r["loss_mask"][1:]) == {1}
    assert len({tuple(r["input_ids"]) for r in rows}) == 5
    before = out.read_bytes()
    assert sample_main(args) == 2
    assert "refusing to overwrite" in capsys.readouterr().err and out.read_bytes() == before
    again = tmp_path / "t.jsonl"
    assert sample_main([*args[:-1], str(again)]) == 0
    assert again.read_bytes() == before  # same seed, same rows


def test_sample_target_matches_target_distribution(stories_dir):
    """The first sampled token follows softmax(target logits at BOS)."""
    from data.sample_target import sample_rows
    from dspine.target import load_target

    target = load_target(str(stories_dir), dtype="fp32")
    rows = sample_rows(target, 1, {2}, 3000, 1, 1.0, seed=0, batch_size=1000)
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([[1]])).logits[0, -1].float(), -1)
    counts = torch.bincount(torch.tensor([r["input_ids"][1] for r in rows]), minlength=p.numel()).float()
    top = p.argsort(descending=True)[:5]
    assert (counts[top] / 3000 - p[top]).abs().max() < 0.03


def _read_all(rows, q):
    inherited = rows._fh
    q.put(([rows.row(i)["input_ids"] for i in range(len(rows))], rows._fh is not inherited))


def test_jsonl_rows_reopen_their_file_in_a_forked_worker(tmp_path):
    """A DataLoader worker is a fork: the parent's open handle would share its offset with every worker."""
    import multiprocessing as mp

    path = tmp_path / "rows.jsonl"
    want = [[i, i + 1, i + 2] for i in range(200)]
    path.write_text("".join(json.dumps({"input_ids": x, "loss_mask": [1, 1, 1]}) + "\n" for x in want))
    rows = JsonlRows(path)
    assert rows.row(5)["input_ids"] == want[5]  # the parent opens its handle first
    parent_fh = rows._fh
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_read_all, args=(rows, q)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(rows_read == want and reopened for rows_read, reopened in got) and rows._fh is parent_fh


def _row(ids, mask=None):
    return json.dumps({"input_ids": ids, "loss_mask": [1] * len(ids) if mask is None else mask})


@pytest.mark.parametrize("bad,message", [
    ("{not json", ":4: invalid JSON"),
    ("[1, 2]", ":4: a JSON list, not an object"),
    (json.dumps({"loss_mask": [1, 1]}), ":4: field 'input_ids' is missing"),
    (json.dumps({"input_ids": [1, 2]}), ":4: field 'loss_mask' is missing"),
    (json.dumps({"input_ids": "1 2", "loss_mask": [1, 1]}), ":4: field 'input_ids' is a str, expected a list"),
    (_row([1, 2, 3], [1, 1]), ":4: field 'loss_mask' has 2 values for 3 input_ids"),
    (_row([1, 2.5, 3]), ":4: field 'input_ids' holds 2.5, expected integer token ids"),
    (_row([1, "2", 3]), ":4: field 'input_ids' holds '2', expected integer token ids"),
    (_row([1, -7, 3]), ":4: field 'input_ids' holds token id -7 < 0"),
    (_row([1, 2, 3], [0, 2, 1]), ":4: field 'loss_mask' holds 2, expected 0 or 1"),
    (_row([1, 2, 3], [0, [1], 1]), ":4: field 'loss_mask' holds [1], expected 0 or 1"),
])
def test_jsonl_rows_are_checked_at_open_with_file_line_and_field(tmp_path, bad, message):
    """A corrupt row is found when the file is opened (before step 1), not when the trainer reaches it."""
    path = tmp_path / "rows.jsonl"
    path.write_text(_row([1, 2, 3]) + "\n\n" + _row([4, 5]) + "\n" + bad + "\n" + _row([6, 7]) + "\n")
    with pytest.raises(ValueError) as e:
        JsonlRows(path)
    assert str(e.value).startswith(f"{path}{message}"), str(e.value)


def test_jsonl_and_arrow_rows_report_their_largest_token(tmp_path):
    import pyarrow as pa

    path = tmp_path / "rows.jsonl"
    path.write_text(_row([1, 2]) + "\n\n" + _row([9, 300, 4]) + "\n" + _row([299]) + "\n")
    rows = JsonlRows(path)
    assert rows.max_token == (300, f"{path}:3") and len(rows) == 3 and rows.row(1)["input_ids"] == [9, 300, 4]
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "summary.json").write_text("{}")
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])

    def write(ids, masks):
        with pa.OSFile(str(folder / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
            w.write_table(pa.table({"input_ids": ids, "loss_mask": masks}, schema=schema))

    write([[1, 2], [7, 500, 3], [4]], [[0, 1], [1, 1, 1], [1]])
    assert open_rows(folder).max_token == (500, f"{folder / 'data.arrow'} row 1")
    where = folder / "data.arrow"
    for ids, masks, message in [([[1, 2], [3, 4, 5]], [[0, 1], [1, 1]], f"{where} row 1: field 'loss_mask' has 2 values for 3"),
                                ([[1, 2], [3, -4]], [[0, 1], [1, 1]], f"{where} row 1: field 'input_ids' holds token id -4"),
                                ([[1, 2], [3, 4]], [[0, 1], [1, 3]], f"{where} row 1: field 'loss_mask' holds 3"),
                                ([[1, 2], None], [[0, 1], [1, 1]], f"{where} row 1: field 'input_ids' is missing")]:
        write(ids, masks)
        with pytest.raises(ValueError, match=re.escape(message)):
            open_rows(folder)


def test_open_check_is_fast_for_a_large_cache(tmp_path):
    """40k rows x 400 tokens (the SmolLM2 recipe's cache size): the Arrow check stays in milliseconds."""
    import time

    import pyarrow as pa

    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "summary.json").write_text("{}")
    n, length = 40_000, 400
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    offsets = pa.array(range(0, (n + 1) * length, length), pa.int32())
    ids = pa.ListArray.from_arrays(offsets, pa.array(torch.randint(0, 49152, (n * length,)).numpy()))
    mask = pa.ListArray.from_arrays(offsets, pa.array(torch.ones(n * length, dtype=torch.int8).numpy()))
    with pa.OSFile(str(folder / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        w.write_table(pa.table({"input_ids": ids, "loss_mask": mask}, schema=schema))
    import pyarrow.compute  # noqa: F401  (imported by the check; its one-time import is not the check's cost)
    from datasets import Dataset

    t0 = time.perf_counter()
    Dataset.from_file(str(folder / "data.arrow"))
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = open_rows(folder)
    t_checked = time.perf_counter() - t0
    assert len(rows) == n and rows.max_token[0] < 49152
    assert t_checked < t_plain + 1.0, (t_plain, t_checked)


def test_unfinished_or_truncated_cache_is_refused_by_name(tmp_path):
    """A killed data.tokenize build (data.arrow, no summary.json) and a truncated data.arrow: errors name the path."""
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    cache = tmp_path / "tok" / "0123456789abcdef"
    cache.mkdir(parents=True)
    with pa.OSFile(str(cache / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        for _ in range(4):
            w.write_table(pa.table({"input_ids": [[1, 2, 3]] * 50, "loss_mask": [[0, 1, 1]] * 50}, schema=schema))
    whole = (cache / "data.arrow").read_bytes()
    for folder in (cache, cache.with_name(f"{cache.name}.tmp-123")):  # the second: the old temp folder name
        folder.mkdir(exist_ok=True)
        with pytest.raises(ValueError, match=re.escape(f"{folder}: unfinished data.tokenize cache (no summary.json")):
            open_rows(folder)
    (cache / "summary.json").write_text("{}")
    assert len(open_rows(cache)) == 200
    (cache / "data.arrow").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=re.escape(f"{cache / 'data.arrow'}: truncated or corrupt Arrow file")):
        open_rows(cache)


# ------------------------------------------------------------------------------------- several sources


def _edit_manifest(cache, **fields):
    m = json.loads((cache / "manifest.json").read_text())
    (cache / "manifest.json").write_text(json.dumps({**m, **fields}))


@pytest.fixture
def two_caches(tmp_path):
    """Two data.tokenize caches as data.pack tests write them: 42 rows (ids < 300, 299 in a row) and 12 rows
    (ids < 500, 499 in a row), same tokenizer digest / template / thinking, max_length 2048 and 1024."""
    a = _cache(tmp_path / "tok", _rows(300), name="aaaa")
    b = _cache(tmp_path / "tok", _rows(500, n=10, seed=1), name="bbbb")
    _edit_manifest(b, max_length=1024)
    return a, b


def test_concat_rows_map_across_the_boundary_and_digest_in_order(two_caches):
    a, b = two_caches
    ra, rb = ArrowRows(a), ArrowRows(b)
    rows = open_sources(f"{a},{b}")
    assert isinstance(rows, ConcatRows) and (len(ra), len(rb), len(rows)) == (42, 12, 54)
    for i in (0, 17, 41):
        assert rows.row(i) == ra.row(i)
    for j in (0, 5, 11):  # row 42 is rb's first: the boundary
        assert rows.row(42 + j) == rb.row(j)
    assert rows.row(41)["input_ids"] != rows.row(42)["input_ids"]
    for i in (54, -1):
        with pytest.raises(IndexError, match=f"row {i} outside the 54 rows of {a},{b}"):
            rows.row(i)
    assert [len(rows.row(i)["input_ids"]) for i in range(54)] == (
        [len(ra.row(i)["input_ids"]) for i in range(42)] + [len(rb.row(i)["input_ids"]) for i in range(12)])

    da, db = ra.metadata()["data_digest"], rb.metadata()["data_digest"]
    meta = rows.metadata()
    assert meta == {"data": f"{a},{b}", "data_digest": hashlib.sha256(f"{da}\n{db}".encode()).hexdigest(),
                    "tokenizer": None, "chat_template_digest": "cd" * 16, "thinking": False,
                    "tokenized_max_length": 2048}
    swapped = open_sources(f"{b},{a}").metadata()
    assert swapped["data_digest"] == hashlib.sha256(f"{db}\n{da}".encode()).hexdigest()
    assert len({meta["data_digest"], swapped["data_digest"], da, db}) == 4  # order matters; no part's digest
    assert ra.max_token[0] == 299 and rb.max_token[0] == 499 and rb.max_token[1].startswith(f"{b / 'data.arrow'} row ")
    assert rows.max_token == open_sources(f"{b},{a}").max_token == rb.max_token  # the part's own where


def test_one_source_opens_as_before(two_caches, tmp_path):
    a, _ = two_caches
    one = open_sources(str(a))
    assert type(one) is ArrowRows and one.metadata() == ArrowRows(a).metadata() == open_rows(a).metadata()
    assert one.metadata()["data"] == str(a) and one.max_token == ArrowRows(a).max_token
    jl = tmp_path / "rows.jsonl"
    jl.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    assert type(open_sources(str(jl))) is JsonlRows and open_sources(str(jl)).metadata() == JsonlRows(jl).metadata()
    assert split_sources(str(a)) == [str(a)] and split_sources(f" {a} , {jl}") == [str(a), str(jl)]


def test_concat_rows_refuse_parts_tokenized_differently(two_caches, tmp_path):
    a, b = two_caches
    _edit_manifest(b, tokenizer_digest="ef" * 16)
    with pytest.raises(ValueError, match=re.escape(f"train sources {a} and {b} disagree on tokenizer_digest: "
                                                   f"{'ab' * 16!r} vs {'ef' * 16!r}")):
        open_sources(f"{a},{b}")
    # the same tokenizer files saved at another path are the same tokenizer; the first part's path is reported
    _edit_manifest(a, tokenizer="/x/tok")
    _edit_manifest(b, tokenizer="/y/tok", tokenizer_digest="ab" * 16)
    assert open_sources(f"{a},{b}").metadata()["tokenizer"] == "/x/tok"
    _edit_manifest(b, tokenizer_digest=None)  # no digest on one side: the paths are compared
    with pytest.raises(ValueError, match=re.escape(f"train sources {a} and {b} disagree on tokenizer: '/x/tok' vs '/y/tok'")):
        open_sources(f"{a},{b}")
    _edit_manifest(b, tokenizer="/x/tok", tokenizer_digest="ab" * 16)
    for field, key, value in (("chat_template_digest", "template_digest", "00" * 16), ("thinking", "thinking", True)):
        c = _cache(tmp_path / "other", _rows(300, n=6), name=field)
        _edit_manifest(c, tokenizer="/x/tok", **{key: value})
        with pytest.raises(ValueError, match=re.escape(f"train sources {a} and {c} disagree on {field}: ")):
            open_sources(f"{a},{b},{c}")
    jl = tmp_path / "rows.jsonl"  # a .jsonl records no chat template: it cannot join a cache
    jl.write_text(json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{a} and {jl} disagree on tokenizer: '/x/tok' vs None ({jl} "
                                                   "records no tokenizer: a .jsonl file")):
        open_sources(f"{a},{jl}")


def test_source_lists_refuse_empty_duplicate_and_capture_entries(two_caches, tmp_path, monkeypatch):
    a, b = two_caches
    for spec in (f"{a},,{b}", f"{a},{b},", f",{a}", f"{a}, ,{b}"):
        with pytest.raises(ValueError, match=re.escape(f"{spec!r}: empty entry in the comma-separated list")):
            open_sources(spec)
    with pytest.raises(ValueError, match=re.escape(f"{f'{a},{b},{a}'!r}: {str(a)!r} is listed twice")):
        open_sources(f"{a},{b},{a}")
    monkeypatch.chdir(a.parent)
    with pytest.raises(ValueError, match=re.escape("'aaaa,bbbb,./aaaa/': './aaaa/' is 'aaaa' again")):
        open_sources("aaaa,bbbb,./aaaa/")
    assert len(open_sources("aaaa,bbbb")) == 54  # relative paths
    cap = tmp_path / "feats"  # a train.capture folder (train.data.FORMAT manifest)
    cap.mkdir()
    (cap / "manifest.json").write_text(json.dumps({"format": "dspine-features-v1", "complete": True, "shards": [],
                                                   "num_rows": 0}))
    with pytest.raises(ValueError, match=re.escape(f"{cap} is a train.capture folder, which cannot be one of several")):
        open_sources(f"{a},{cap}")
    with pytest.raises(FileNotFoundError, match=re.escape(f"{tmp_path / 'nope'}: not a .jsonl file")):
        open_sources(f"{a},{tmp_path / 'nope'}")


def test_concat_rows_largest_token_over_the_parts(tmp_path):
    def jsonl(name, rows):
        (tmp_path / name).write_text("".join(json.dumps({"input_ids": r, "loss_mask": [1] * len(r)}) + "\n"
                                             for r in rows))
        return tmp_path / name

    empty1, empty2 = jsonl("e1.jsonl", [[]]), jsonl("e2.jsonl", [[], []])
    full = jsonl("f.jsonl", [[3, 9], [], [12, 4]])
    assert ConcatRows([empty1, empty2]).max_token is None and len(ConcatRows([empty1, empty2])) == 3
    rows = ConcatRows([empty1, full, empty2])
    assert rows.max_token == (12, f"{full}:3") and rows.row(3) == {"input_ids": [12, 4], "loss_mask": [1, 1]}
    meta = rows.metadata()  # .jsonl parts: no tokenization metadata
    assert (meta["tokenizer"], meta["tokenized_max_length"]) == (None, None) and meta["data"] == f"{empty1},{full},{empty2}"


def test_trainer_names_the_part_of_a_source_list(two_caches, tmp_path):
    """open_train_rows / check_trainable with train=a,b: errors and hints name the part."""
    from train.config import ConfigError
    from train.distill import check_trainable, open_train_rows

    a, b = two_caches
    rows = open_train_rows(f"{a},{b}")
    check_trainable(rows, f"{a},{b}")
    (tmp_path / "caches" / "k1").mkdir(parents=True)
    (tmp_path / "caches" / "k1" / "data.arrow").write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"config key 'train': {tmp_path / 'caches'}: not a .jsonl file")
                       + f".*; {tmp_path / 'caches'} holds cache folders: give the <key> subfolder, e.g. "
                       + re.escape(f"{tmp_path / 'caches' / 'k1'} in the train list")):
        open_train_rows(f"{a},{tmp_path / 'caches'}")
    flat = _cache(tmp_path / "tok", [{**r, "loss_mask": [0] * len(r["loss_mask"])} for r in _rows(300, n=4)],
                  name="flat")
    with pytest.raises(ConfigError, match=re.escape(f"config key 'train': none of the first 6 rows of {flat} has two "
                                                    "consecutive supervised tokens")):
        check_trainable(open_train_rows(f"{a},{flat}"), f"{a},{flat}")
