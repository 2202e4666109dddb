"""data.regenerate with the real stories260K model on the CPU: counts, resume after a kill, bad rows, backends."""

import json
import os
from pathlib import Path

import pytest
import torch

from data import regenerate as regen
from data.generate import load_generator, resolve_backend
from data.prepare import prepare
from data.shards import done_indices
from dspine.io import folder_lock

SHARED = Path(os.environ.get("DSPINE_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
STORIES = SHARED / "models" / "stories260K" / "hf"
STANDIN = SHARED / "data" / "train" / "perfectblend_standin" / "perfectblend_schema_standin.jsonl"
pytestmark = pytest.mark.skipif(
    not (STORIES.is_dir() and STANDIN.is_file()),
    reason=f"shared stories260K model or stand-in data not found under {SHARED} (set DSPINE_SHARED)",
)

# stories260K has no chat template: prompts are BOS + the turns' text, each assistant turn ends with eos.
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'assistant' %}{{ m.content + eos_token }}{% else %}{{ m.content + '\\n' }}{% endif %}"
    "{% endfor %}"
)
MAX_NEW = 8
CONTEXT = 512  # stories260K max_position_embeddings


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A 260K-parameter model is faster on one thread, and other test processes may share the CPU.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    prepare([f"perfectblend_standin={STANDIN}"], root / "prepared", eval_fraction=0.0, limit=60)
    (root / "plain.jinja").write_text(PLAIN_TEMPLATE)
    return root


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def argv(workdir: Path, out: Path, *extra: str, input_file: Path | None = None) -> list[str]:
    return [
        "--target", str(STORIES), "--input", str(input_file or workdir / "prepared" / "train.jsonl"),
        "--output", str(out), "--chat-template", str(workdir / "plain.jinja"),
        "--max-new-tokens", str(MAX_NEW), "--batch-size", "8", "--limit", "50", "--backend", "hf", *extra,
    ]  # fmt: skip


def run(args: list[str]) -> dict:
    return regen.regenerate(regen.parse_args(args))


def outputs(out: Path) -> dict:
    return {kind: read_jsonl(out / f"{kind}.jsonl") for kind in regen.KINDS}


def test_fifty_rows_add_up_and_resume_after_kill_matches(workdir, monkeypatch, capsys):
    full = workdir / "full"
    summary = run(argv(workdir, full))
    files = outputs(full)
    assert summary["input_rows"] == 50 and summary["adds_up"]
    assert [len(files[k]) for k in regen.KINDS] == [summary["results"], summary["errors"], summary["skipped"]]
    indices = sorted(r["index"] for k in regen.KINDS for r in files[k])
    assert indices == list(range(50))  # every row exactly once
    assert [r["index"] for r in files["results"]] == sorted(
        r["index"] for r in files["results"]
    )  # input order
    assert sorted(p.name for p in full.iterdir()) == [
        "errors.jsonl",
        "results.jsonl",
        "run_args.json",
        "skipped.jsonl",
        "summary.json",
    ]

    # Independent check of the context rule and of the regenerated conversations.
    from data.chat import encode, render
    from dspine.paths import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    inputs = read_jsonl(workdir / "prepared" / "train.jsonl")[:50]
    skipped = {r["index"] for r in files["skipped"]}
    for i, row in enumerate(inputs):
        first_prompt = [t for t in row["conversations"] if t["role"] != "assistant"][:1]
        too_long = (
            len(encode(tok, render(tok, PLAIN_TEMPLATE, first_prompt, True, False))) + MAX_NEW > CONTEXT
        )
        assert (i in skipped) == too_long
    assert skipped and all(r["reason"] == "prompt_too_long" for r in files["skipped"])
    turns = 0
    for res in files["results"]:
        src = inputs[res["index"]]["conversations"]
        users = [t["content"] for t in src if t["role"] == "user"]
        conv = res["conversations"]
        n = len(res["finish_reason"])
        assert [t["role"] for t in conv] == ["user", "assistant"] * n
        assert [t["content"] for t in conv if t["role"] == "user"] == users[:n]
        assert n == len(users) or "stopped" in res
        assert len(res["generated_token_ids"]) == n and res["num_generated_tokens"] == sum(
            map(len, res["generated_token_ids"])
        )
        for ids, reason, answer in zip(res["generated_token_ids"], res["finish_reason"], conv[1::2]):
            assert (reason == "length") == (len(ids) == MAX_NEW) and 2 not in ids  # eos never in the answer
            assert answer["content"] == tok.decode(ids)
        turns += n
    assert turns > len(files["results"])  # some stand-in rows are multi-turn
    length = sum(r["finish_reason"].count("length") for r in files["results"])
    assert summary["generated_turns"] == turns and summary["truncation_rate"] == pytest.approx(length / turns)

    # Killed after 3 of 7 batches (test hook), with a half-written record at the end of a shard.
    killed = workdir / "killed"
    monkeypatch.setenv(regen.STOP_AFTER_ENV, "3")
    with pytest.raises(RuntimeError, match="stopping after 3 batches"):
        run(argv(workdir, killed))
    monkeypatch.delenv(regen.STOP_AFTER_ENV)
    assert not (killed / "results.jsonl").exists() and not (killed / "summary.json").exists()
    assert len(done_indices(killed)) == 24
    with open(killed / "results.rank0.jsonl", "ab") as f:
        f.write(b'{"index": 30, "id": "perfectblend_standin:0000')
    # Changed generation arguments in the same folder are refused, naming the argument.
    with pytest.raises(ValueError, match=r"max_new_tokens: 8 \(stored\) != 9"):
        run(argv(workdir, killed, "--max-new-tokens", "9"))
    resumed = run(argv(workdir, killed))
    assert outputs(killed) == files  # same ids, same generated token ids, same order
    timing = ("wall_s", "resumed", "generated_tokens_per_s")  # this invocation's clock, not the data
    assert resumed["resumed"] is True and summary["resumed"] is False and "generated_tokens_per_s" not in resumed
    assert {k: v for k, v in resumed.items() if k not in timing} == {k: v for k, v in summary.items() if k not in timing}
    # A finished output is left alone.
    before = {p.name: p.read_bytes() for p in killed.iterdir()}
    capsys.readouterr()
    assert regen.main(argv(workdir, killed)) == 0
    assert "already finished" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in killed.iterdir()} == before


class FakeState:
    """Stands in for accelerate.PartialState to run one rank of a data-parallel job in-process."""

    def __init__(self, rank: int, world: int):
        self.process_index, self.num_processes = rank, world
        self.is_main_process = rank == 0
        self.device = torch.device("cpu")

    def wait_for_everyone(self):
        pass


def test_data_parallel_shards_merge_and_world_size_change(workdir, monkeypatch):
    out = workdir / "dp"
    args = argv(workdir, out, "--limit", "20")
    # Rank 1 of 2 finishes its rows; rank 0 is killed after one batch; the job resumes on 1 process.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("accelerate.PartialState", lambda **kw: FakeState(1, 2))
    assert run(args) == {}
    assert {
        r["index"] for r in read_jsonl(out / "results.rank1.jsonl") + read_jsonl(out / "skipped.rank1.jsonl")
    } == set(range(1, 20, 2))
    monkeypatch.setattr("accelerate.PartialState", lambda **kw: FakeState(0, 2))
    monkeypatch.setenv(regen.STOP_AFTER_ENV, "1")
    with pytest.raises(RuntimeError):
        run(args)
    monkeypatch.delenv(regen.STOP_AFTER_ENV)
    assert len(done_indices(out)) == 10 + 8
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr("accelerate.PartialState", lambda **kw: FakeState(0, 1))
    summary = run(args)
    assert summary["adds_up"] and summary["input_rows"] == 20
    files = outputs(out)
    assert sorted(r["index"] for k in regen.KINDS for r in files[k]) == list(range(20))
    assert not list(out.glob("*.rank*"))  # shards and markers removed after the merge


def test_a_second_run_on_a_folder_in_use_is_refused(workdir, capsys):
    """Two runs on one --output both appended to results.rank0.jsonl: rows recorded twice, a folder no rerun could
    merge (newcomer review); one that finds the folder locked by a run in progress is refused and writes nothing."""
    out = workdir / "busy"
    assert run(argv(workdir, out, "--limit", "4"))["results"] == 4
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with folder_lock(out):  # a run in progress (flock: another open of the folder, in this process too, is refused)
        assert regen.main(argv(workdir, out, "--limit", "4")) == 2
    assert f"error: {out}: another run is writing this folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert regen.main(argv(workdir, out, "--limit", "4")) == 0 and "already finished" in capsys.readouterr().out


def test_a_refused_launch_leaves_the_running_launchs_markers(workdir, monkeypatch):
    """Another launch's rank 1 removed its done.rank1.json before the barrier its rank 0 (refused: the folder is
    locked) never reached, so the running launch's rank 0 waited for it forever (reviewer); only the lock holder clears
    markers, an earlier run's stale ones included."""
    out = workdir / "markers"
    args = argv(workdir, out, "--limit", "6")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("accelerate.PartialState", lambda **kw: FakeState(1, 2))
    assert run(args) == {}  # the running launch's rank 1 is done; its rank 0 still writes (holds the lock)
    marker = (out / "done.rank1.json").read_bytes()

    class RefusedRankZero(FakeState):
        def wait_for_everyone(self):
            raise RuntimeError("rank 0 left the group")  # it was refused the folder lock

    monkeypatch.setattr("accelerate.PartialState", lambda **kw: RefusedRankZero(1, 2))
    with folder_lock(out), pytest.raises(RuntimeError, match="rank 0 left the group"):
        run(args)
    assert (out / "done.rank1.json").read_bytes() == marker

    class CheckedBarrier(FakeState):  # a later launch's rank 0; its rank 1 has no rows left and writes its marker
        def wait_for_everyone(self):
            assert not (out / "done.rank1.json").exists()  # the earlier run's marker is cleared before the barrier
            (out / "done.rank1.json").write_bytes(marker)

    monkeypatch.setattr("accelerate.PartialState", lambda **kw: CheckedBarrier(0, 2))
    summary = run(args)
    assert summary["input_rows"] == 6 and summary["adds_up"] and not list(out.glob("done.rank*.json"))


def test_bad_rows_are_skipped_or_errors_with_reasons(workdir):
    good = {
        "id": "g:0",
        "conversations": [
            {"role": "user", "content": "Once upon a time"},
            {"role": "assistant", "content": "old"},
        ],
    }
    lines = [
        json.dumps(good).encode(),
        b'{"id": "broken", "conversations": [',
        b'{"id": "bytes", "conversations": "\xff"}',
        b'{"id": "surrogate", "conversations": [{"role": "user", "content": "x \\udc00"}]}',
        json.dumps({"id": "nofield"}).encode(),
        json.dumps({"conversations": [{"role": "user", "content": "no id"}]}).encode(),
        json.dumps({"id": "role", "conversations": [{"role": "narrator", "content": "x"}]}).encode(),
        json.dumps({"id": "empty", "conversations": []}).encode(),
        json.dumps(
            {"id": "sys", "conversations": [{"role": "system", "content": "Only a system turn"}]}
        ).encode(),
        json.dumps(
            {"id": "long", "conversations": [{"role": "user", "content": "the dog ran " * 200}]}
        ).encode(),
    ]
    data = workdir / "bad.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    out = workdir / "bad-out"
    summary = run(argv(workdir, out, input_file=data))
    assert (
        summary["input_rows"] == 10
        and summary["results"] == 1
        and summary["skipped"] == 9
        and summary["adds_up"]
    )
    assert summary["skipped_reasons"] == {
        "bad_json": 1,
        "bad_utf8": 2,
        "missing_field": 2,
        "unknown_role": 1,
        "empty_conversation": 1,
        "no_user_turn": 1,
        "prompt_too_long": 1,
    }
    (res,) = read_jsonl(out / "results.jsonl")
    assert res["id"] == "g:0" and res["conversations"][1]["content"] != "old"
    long = next(r for r in read_jsonl(out / "skipped.jsonl") if r["id"] == "long")
    assert "exceeds the context of 512" in long["detail"]


def engine_importable() -> bool:
    try:
        import infer.engine  # noqa: F401
    except Exception:
        return False
    return True


BACKEND_PARAMS = [
    "hf",
    pytest.param(
        "engine", marks=pytest.mark.skipif(not engine_importable(), reason="infer.engine not importable")
    ),
]


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_backend_matches_reference_greedy_and_stops_at_eos(backend):
    ref = json.loads((STORIES.parent / "greedy_200.json").read_text())["greedy_token_ids"]
    gen = load_generator(
        backend, str(STORIES), None, stop_ids=[2], pad_id=0, device="cpu", max_context=CONTEXT
    )
    # Batch of two prompts of different lengths: padding must not change the BOS-only row.
    out = gen.generate([[1], [1] + ref[:5]], max_new_tokens=40, temperature=0, top_p=1, top_k=0, seed=0)
    assert out[0].token_ids == ref[:40] and out[0].finish_reason == "length"
    assert out[1].token_ids == ref[5:45]
    # A stop token ends the answer at its first occurrence and is not part of it.
    stop = ref[10]
    gen = load_generator(
        backend, str(STORIES), None, stop_ids=[stop], pad_id=0, device="cpu", max_context=CONTEXT
    )
    (res,) = gen.generate([[1]], max_new_tokens=40, temperature=0, top_p=1, top_k=0, seed=0)
    assert res.token_ids == ref[: ref.index(stop)] and res.finish_reason == "stop"


@pytest.mark.skipif(not engine_importable(), reason="infer.engine not importable")
def test_engine_backend_gives_the_same_output_as_hf(workdir, capsys):
    outs = {}
    for backend in ("hf", "engine"):
        summary = run(argv(workdir, workdir / f"backend-{backend}", "--limit", "16", "--backend", backend,
                           *(["--profile"] if backend == "engine" else [])))
        assert summary["backend"] == backend
        outs[backend] = outputs(workdir / f"backend-{backend}")
    assert outs["engine"] == outs["hf"]
    # --profile: one line with the loop's tokens, equal to the generated tokens (EOS included per stop)
    line = next(x for x in capsys.readouterr().err.splitlines() if "engine loop:" in x)
    results = outs["engine"]["results"]
    tokens = sum(r["num_generated_tokens"] for r in results) + sum(
        r["finish_reason"].count("stop") for r in results)
    assert f" {tokens} tokens in " in line and "ms/step" in line


def test_backend_resolution():
    if not torch.cuda.is_available():
        assert resolve_backend("auto") == "hf"
    assert resolve_backend("engine") == "engine" and resolve_backend("hf") == "hf"
    with pytest.raises(ValueError, match="--backend 'vllm'"):
        resolve_backend("vllm")


class PickyGenerator:
    """Generator stub: answers [7, 8, 2...] but fails on any prompt holding token `bad`."""

    def __init__(self, bad: int):
        self.bad, self.calls = bad, []

    def generate(self, prompts, max_new_tokens, temperature, top_p, top_k, seed):
        self.calls.append(len(prompts))
        if any(self.bad in p for p in prompts):
            raise RuntimeError("device-side assert")
        return [regen.Generation([7, 8], "stop") for _ in prompts]


def test_generation_and_template_failures_become_errors():
    from data.chat import encode
    from dspine.paths import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    bad_token = encode(tok, "zebra")[-1]
    rows = [
        (0, {"id": "a", "conversations": [{"role": "user", "content": "A cat sat."}]}),
        (1, {"id": "b", "conversations": [{"role": "user", "content": "A zebra"}]}),
        (
            2,
            {
                "id": "c",
                "conversations": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "x"},
                    {"role": "user", "content": "More"},
                ],
            },
        ),
    ]
    args = regen.parse_args(["--target", "t", "--input", "i", "--output", "o", "--max-new-tokens", "4"])
    gen = PickyGenerator(bad_token)
    out = regen.regenerate_batch(rows, tok, PLAIN_TEMPLATE, gen, args, max_context=CONTEXT)
    # The failing batch is retried row by row: only the row with the bad prompt is lost.
    assert [e["id"] for e in out["errors"]] == ["b"] and "device-side assert" in out["errors"][0]["error"]
    assert sorted(r["id"] for r in out["results"]) == ["a", "c"]
    c = next(r for r in out["results"] if r["id"] == "c")
    assert [t["role"] for t in c["conversations"]] == ["user", "assistant", "user", "assistant"]
    assert c["finish_reason"] == ["stop", "stop"] and c["generated_token_ids"] == [[7, 8], [7, 8]]
    assert gen.calls == [3, 1, 1, 1, 1]  # batch, three single retries, then turn 2 of row c
    # A template that raises is an error for that row, not a crash.
    strict = (
        "{% if messages | length > 1 %}{{ raise_exception('one turn only') }}{% endif %}" + PLAIN_TEMPLATE
    )
    out = regen.regenerate_batch(rows, tok, strict, PickyGenerator(-1), args, max_context=CONTEXT)
    assert [e["id"] for e in out["errors"]] == ["c"] and "one turn only" in out["errors"][0]["error"]
    # When every row fails alone as well, the cause is not the data: the run stops instead.
    with pytest.raises(RuntimeError, match="failed for all 2 rows"):
        regen.regenerate_batch(rows[:2], tok, PLAIN_TEMPLATE, PickyGenerator(1), args, max_context=CONTEXT)


def test_max_new_tokens_beyond_context_is_refused_before_writing(workdir, capsys):
    out = workdir / "too-long"
    assert regen.main(argv(workdir, out, "--max-new-tokens", "100000000")) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 100000000" in err and f"context of {CONTEXT} tokens" in err
    assert "the model's max_position_embeddings" in err and not out.exists()  # nothing written, no run_args.json
    assert regen.main(argv(workdir, out, "--max-new-tokens", "64", "--max-context", "64")) == 2
    err = capsys.readouterr().err
    assert "--max-new-tokens 64" in err and "context of 64 tokens (--max-context)" in err
    assert not out.exists()
    # --max-context past the target's positions: answers decoded at untrained positions (was 1,024 tokens per answer)
    assert regen.main(argv(workdir, out, "--max-new-tokens", "1024", "--max-context", "4096")) == 2
    assert f"--max-context 4096 exceeds the {CONTEXT} positions of target {STORIES}" in capsys.readouterr().err
    assert not out.exists()
    # The corrected rerun into the same folder runs.
    summary = run(argv(workdir, out, "--limit", "4"))
    assert summary["input_rows"] == 4 and summary["adds_up"] and (out / "run_args.json").is_file()


def test_a_tokenizer_larger_than_the_targets_vocabulary_is_refused_before_writing(workdir, capsys):
    """--tokenizer of another model (Qwen3's 151,669 tokens for stories260K's 512 rows): one line before anything is
    written; it was a traceback of an embedding IndexError from every batch, with shards left behind."""
    out = workdir / "other-tokenizer"
    assert regen.main(argv(workdir, out, "--tokenizer", str(SHARED / "models" / "qwen3-tokenizer"))) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tokenizer ") and err.count("\n") == 1, err
    assert f"has 151669 tokens > the 512 embedding rows of target {STORIES}" in err and not out.exists()


def test_run_that_regenerates_nothing_does_not_pin_its_arguments(workdir, capsys):
    out = workdir / "nothing"
    empty = workdir / "empty.jsonl"
    empty.write_bytes(b"")
    assert regen.main(argv(workdir, out, input_file=empty)) == 2  # refused before writing (newcomer review)
    assert f"{empty} has no rows (only blank lines, or empty): nothing to regenerate" in capsys.readouterr().err
    assert not out.exists()
    # Every row unusable: the skip records stay readable, nothing is marked finished or pinned.
    invalid = workdir / "invalid.jsonl"
    invalid.write_text('{"id": "x"}\n{"id": "y", "conversations": []}\n')
    assert regen.main(argv(workdir, out, "--max-new-tokens", "9", input_file=invalid)) == 1
    assert "no row was regenerated (2 skipped, 0 failed" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["errors.jsonl", "skipped.jsonl"]
    assert [(r["id"], r["reason"]) for r in read_jsonl(out / "skipped.jsonl")] == [
        ("x", "missing_field"),
        ("y", "empty_conversation"),
    ]
    # A rerun with other arguments and good input is not refused, and then pins its arguments.
    summary = run(argv(workdir, out, "--limit", "4"))
    assert summary["input_rows"] == 4 and summary["results"] > 0 and summary["adds_up"]
    assert json.loads((out / "run_args.json").read_text())["max_new_tokens"] == MAX_NEW
    assert sorted(p.name for p in out.iterdir()) == [
        "errors.jsonl", "results.jsonl", "run_args.json", "skipped.jsonl", "summary.json",
    ]  # fmt: skip


def test_a_corrupt_shard_record_is_a_clear_error_that_says_how_to_recover(workdir, tmp_path, monkeypatch, capsys):
    """A shard line that is not a whole record (here the tail of a record cut by a newline) is a ValueError naming
    the shard, the byte and the way out, and the CLI prints it as one error line, exit 2 (newcomer review: an
    uncaught RuntimeError traceback on every rerun)."""
    from data.shards import merge_shards

    first = b'{"index": 0, "id": "a"}\n'
    (tmp_path / "results.rank0.jsonl").write_bytes(first + b'"id": "x"}\n')
    match = rf"results.rank0.jsonl: corrupt record at byte {len(first)} .*cut the file to its first {len(first)} bytes"
    with pytest.raises(ValueError, match=match):
        merge_shards(tmp_path, ("results",), 2, lambda kind, record: None)

    def merge(*a, **kw):
        raise ValueError("x.rank0.jsonl: corrupt record at byte 7")

    monkeypatch.setattr(regen, "merge_shards", merge)
    assert regen.main(argv(workdir, workdir / "corrupt", "--limit", "2")) == 2
    assert "error: x.rank0.jsonl: corrupt record at byte 7" in capsys.readouterr().err


def test_ctrl_c_after_the_summary_is_the_normal_end_and_one_in_the_merge_leaves_no_partial_file(workdir, monkeypatch,
                                                                                                capsys):
    """A Ctrl-C in the merge exits 130 with the shards kept and no half-written file (was: results.jsonl.tmp stayed);
    the same command then finishes with the uninterrupted run's outputs. A SIGTERM (the decorator's Ctrl-C) that
    lands after this run wrote summary.json, while the shards are removed, is the normal end: exit 0, the summary
    printed, the shards gone (was: 130 and "interrupted" for a finished folder, its shards left)."""
    import signal

    full = workdir / "late-full"
    assert regen.main(argv(workdir, full, "--limit", "20")) == 0
    printed, want = capsys.readouterr().out, outputs(full)
    assert "input rows 20 = results" in printed and want["results"]

    real_count, calls = regen._count, []

    def count(kind, record, stats):  # the third record merged: results.jsonl.tmp holds two
        calls.append(kind)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_count(kind, record, stats)

    cut = workdir / "late-merge"
    monkeypatch.setattr(regen, "_count", count)
    assert regen.main(argv(workdir, cut, "--limit", "20")) == 130
    assert f"data.regenerate: interrupted; the batches written to {cut} are kept" in capsys.readouterr().err
    assert sorted(p.name for p in cut.iterdir()) == [
        "done.rank0.json", "errors.rank0.jsonl", "results.rank0.jsonl", "run_args.json", "skipped.rank0.jsonl",
    ]  # fmt: skip
    monkeypatch.setattr(regen, "_count", real_count)
    assert regen.main(argv(workdir, cut, "--limit", "20")) == 0
    assert capsys.readouterr().out == printed and outputs(cut) == want

    real_remove = regen.remove_shards

    def late_sigterm(out):  # finish() wrote summary.json: only the shards' removal is left
        monkeypatch.setattr(regen, "remove_shards", real_remove)
        assert (out / regen.SUMMARY).is_file()
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt")

    late = workdir / "late-summary"
    monkeypatch.setattr(regen, "remove_shards", late_sigterm)
    assert regen.main(argv(workdir, late, "--limit", "20")) == 0
    out, err = capsys.readouterr()
    assert out == printed and "interrupted" not in err and "Traceback" not in err
    assert sorted(p.name for p in late.iterdir()) == sorted(p.name for p in full.iterdir()) and outputs(late) == want
    assert regen.remove_shards is real_remove  # the removal ran once more, in main's Ctrl-C path

    def early_sigterm(args):  # before this run's end in a folder finished earlier: still an interruption
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(regen, "regenerate", early_sigterm)
    assert regen.main(argv(workdir, late, "--limit", "20")) == 130
    assert f"data.regenerate: interrupted; the batches written to {late} are kept" in capsys.readouterr().err


def test_a_finished_folder_with_shards_left_by_a_kill_loses_them_on_the_same_command(workdir, monkeypatch, capsys):
    """A run killed (SIGKILL: no Ctrl-C path runs) after it wrote summary.json but before the shards were removed:
    the same command says the folder is finished and removes them, leaving the uninterrupted run's files (was: the
    shards stayed for good; every rerun said "already finished" and left them)."""
    full = workdir / "kill-full"
    assert regen.main(argv(workdir, full, "--limit", "8")) == 0
    killed = workdir / "kill-after-summary"
    monkeypatch.setattr(regen, "remove_shards", lambda out: None)  # the kill: summary.json written, shards kept
    assert regen.main(argv(workdir, killed, "--limit", "8")) == 0
    assert [p.name for p in killed.glob("*.rank0.json*")] != []
    monkeypatch.undo()
    capsys.readouterr()
    assert regen.main(argv(workdir, killed, "--limit", "8")) == 0
    assert f"{killed} is already finished; nothing to do" in capsys.readouterr().out
    assert sorted(p.name for p in killed.iterdir()) == sorted(p.name for p in full.iterdir()) == [
        "errors.jsonl", "results.jsonl", "run_args.json", "skipped.jsonl", "summary.json"]
    assert outputs(killed) == outputs(full)


def test_a_run_with_no_result_interrupted_while_it_unpins_never_lends_its_shards_to_other_arguments(workdir,
                                                                                                   monkeypatch):
    """A run that regenerated no row removes its shards and then unpins its arguments (run_args.json), so a Ctrl-C
    or kill between the two never leaves shards without the arguments that made them: a corrected rerun (another
    --max-context) is refused by name instead of taking the old run's 'prompt_too_long' records as done rows (was:
    run_args.json went first, and the corrected rerun regenerated nothing, in silence)."""
    out = workdir / "nores"

    def interrupted(folder):  # a SIGTERM as the shards' removal starts
        raise KeyboardInterrupt

    monkeypatch.setattr(regen, "remove_shards", interrupted)
    assert regen.main(argv(workdir, out, "--limit", "8", "--max-context", "9")) == 130  # every prompt too long
    monkeypatch.undo()
    assert regen.main(argv(workdir, out, "--limit", "8", "--max-context", "512")) == 2  # not 1: no row regenerated
    assert regen.main(argv(workdir, out, "--limit", "8", "--max-context", "9")) == 1  # the same command unpins it
    assert not (out / regen.RUN_ARGS).exists() and list(out.glob("*.rank*")) == []
    assert regen.main(argv(workdir, out, "--limit", "8", "--max-context", "512")) == 0
    assert len(outputs(out)["results"]) == 8
