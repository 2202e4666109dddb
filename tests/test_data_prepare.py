"""data.prepare: source formats, bad rows, duplicates, ids, the train/eval split and refusing to overwrite."""

import json
import os
from collections import Counter
from pathlib import Path

import pytest

from data.prepare import NoRowKept, eval_split, main, prepare
from tests.conftest import REPO

SHARED = Path(os.environ.get("DSPINE_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
TRAIN = SHARED / "data" / "train"
STANDIN = TRAIN / "perfectblend_standin" / "perfectblend_schema_standin.jsonl"
needs_shared = pytest.mark.skipif(
    not STANDIN.is_file(), reason=f"shared stand-in data not found at {STANDIN} (set DSPINE_SHARED)"
)


def read_jsonl(path: Path) -> list[dict]:
    # Split on "\n" only: str.splitlines() also splits on U+2028 inside strings (the stand-in has some).
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def write_lines(path: Path, lines: list) -> Path:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    return path


@needs_shared
def test_standin_counts_add_up(tmp_path):
    summary = prepare([f"perfectblend_standin={STANDIN}"], tmp_path / "out", eval_fraction=0.05)
    n_lines = sum(1 for line in STANDIN.read_bytes().split(b"\n") if line.strip())
    s = summary["sources"]["perfectblend_standin"]
    assert s["format"] == "perfectblend"
    assert s["read"] == n_lines
    assert s["read"] == s["kept"] + s["duplicates"] + s["skipped"] and summary["consistent"]
    train, evl = read_jsonl(tmp_path / "out" / "train.jsonl"), read_jsonl(tmp_path / "out" / "eval.jsonl")
    skipped = read_jsonl(tmp_path / "out" / "skipped.jsonl")
    assert (len(train), len(evl), len(skipped)) == (s["train"], s["eval"], s["skipped"])
    assert s["kept"] == s["train"] + s["eval"]
    assert Counter(r["reason"] for r in skipped) == Counter(s["skipped_reasons"])
    # Independent count of exact duplicates among the usable rows (same turns, in order).
    raw = read_jsonl(STANDIN)
    skipped_idx = {int(r["id"].split(":")[1]) for r in skipped}
    convs = [json.dumps(r["conversations"]) for i, r in enumerate(raw) if i not in skipped_idx]
    assert s["duplicates"] == len(convs) - len(set(convs)) > 0
    # Per-origin counts of PerfectBlend's own "source" field add up too.
    assert sum(s["origins"].values()) == s["kept"]
    rows = train + evl
    assert len({r["id"] for r in rows}) == len(rows)
    r0 = next(r for r in rows if r["id"] == "perfectblend_standin:000000")
    assert r0["conversations"][0] == {"role": "user", "content": raw[0]["conversations"][0]["value"]}
    assert r0["origin"] == raw[0]["source"] and r0["source"] == "perfectblend_standin"
    # The split follows the id hash, not the order: ~5% in eval.
    assert all(eval_split(r["id"], 0, 0.05) for r in evl) and not any(
        eval_split(r["id"], 0, 0.05) for r in train
    )
    assert 0.03 < len(evl) / len(rows) < 0.07
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary


@needs_shared
def test_real_source_formats(tmp_path):
    inputs = [
        str(TRAIN / "alpaca_demo" / "alpaca_en_demo.json"),
        str(TRAIN / "alpaca_demo" / "dpo_en_demo.json"),
        str(TRAIN / "codealpaca" / "code_alpaca_2k.json"),
        f"gsm8k={TRAIN / 'gsm8k' / 'train.jsonl'}",
    ]
    summary = prepare(inputs, tmp_path / "out", limit=40)
    fmts = {name: s["format"] for name, s in summary["sources"].items()}
    assert fmts == {
        "alpaca_en_demo": "alpaca",
        "dpo_en_demo": "sharegpt",
        "code_alpaca_2k": "alpaca",
        "gsm8k": "gsm8k",
    }
    assert all(s["read"] == 40 for s in summary["sources"].values())
    rows = {
        r["id"]: r
        for r in read_jsonl(tmp_path / "out" / "train.jsonl") + read_jsonl(tmp_path / "out" / "eval.jsonl")
    }
    gsm = read_jsonl(TRAIN / "gsm8k" / "train.jsonl")[7]
    assert rows["gsm8k:000007"]["conversations"] == [
        {"role": "user", "content": gsm["question"]},
        {"role": "assistant", "content": gsm["answer"]},
    ]
    code = json.loads((TRAIN / "codealpaca" / "code_alpaca_2k.json").read_text())[0]
    assert (
        code["input"]
        and rows["code_alpaca_2k:000000"]["conversations"][0]["content"]
        == f"{code['instruction']}\n\n{code['input']}"
    )
    # dpo rows end on a user turn; the chosen answer becomes the assistant turn.
    dpo = json.loads((TRAIN / "alpaca_demo" / "dpo_en_demo.json").read_text())[0]
    conv = rows["dpo_en_demo:000000"]["conversations"]
    assert (
        conv[-1] == {"role": "assistant", "content": dpo["chosen"]["value"]}
        and len(conv) == len(dpo["conversations"]) + 1
    )


def test_a_byte_order_mark_does_not_cost_the_first_row(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    for name, text in (("lines.jsonl", json.dumps(good) + "\n"), ("array.json", json.dumps([good]))):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        s = prepare([str(tmp_path / name)], tmp_path / name.replace(".", "-"), fmt="openai")["sources"][name.split(".")[0]]
        assert s["read"] == 1 and s["kept"] == 1 and s["skipped"] == 0, name


def test_a_json_array_row_with_a_lone_surrogate_is_skipped_by_index(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    src = tmp_path / "rows.json"
    src.write_text('[' + json.dumps(good) + ', {"messages": [{"role": "user", "content": "\\udfff"}]}, "\\ud800"]')
    s = prepare([str(src)], tmp_path / "out", fmt="openai")["sources"]["rows"]
    assert s["read"] == 3 and s["kept"] == 1 and s["skipped_reasons"] == {"bad_utf8": 1, "not_object": 1}
    skipped = read_jsonl(tmp_path / "out" / "skipped.jsonl")
    assert "rows.json[1]: a string holds a lone UTF-16 surrogate ('\\udfff')" in skipped[0]["detail"]
    assert "rows.json[2]: row is a JSON str, not an object" in skipped[1]["detail"]


def test_bad_rows_are_skipped_with_reasons(tmp_path):
    good = {
        "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ]
    }
    lines = [
        good,
        b'{"messages": [{"role": "user", "content": "Hi"}',  # invalid JSON
        b'{"messages": "\xff\xfe"}',  # undecodable bytes
        {"messages": [{"role": "user"}]},  # missing content
        {"messages": [{"role": "tool", "content": "42"}]},  # unknown role
        {"messages": []},  # empty conversation
        {"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"}]},  # order
        {"messages": [{"role": "user", "content": "   "}, {"role": "assistant", "content": "x"}]},  # empty
        [1, 2],  # not an object
        b"",  # blank line: not a row
        good,  # duplicate
        {"messages": [{"role": "user", "content": "Only a prompt"}]},  # kept: regenerate answers it
        b'{"messages": [{"role": "user", "content": "x \\ud800 y"}]}',  # a lone UTF-16 surrogate escape
    ]
    src = write_lines(tmp_path / "chat.jsonl", lines)
    summary = prepare([str(src)], tmp_path / "out", fmt="openai")
    s = summary["sources"]["chat"]
    assert s["read"] == 12 and s["kept"] == 2 and s["duplicates"] == 1 and s["skipped"] == 9
    assert s["skipped_reasons"] == {
        "bad_json": 1,
        "bad_utf8": 2,
        "missing_field": 1,
        "unknown_role": 1,
        "empty_conversation": 1,
        "bad_turn_order": 1,
        "empty_content": 1,
        "not_object": 1,
    }
    skipped = read_jsonl(tmp_path / "out" / "skipped.jsonl")
    assert [r["id"] for r in skipped] == [f"chat:{i:06d}" for i in (*range(1, 9), 11)]
    assert "chat.jsonl:2: invalid JSON" in skipped[0]["detail"] and skipped[0]["row"].startswith(
        '{"messages"'
    )
    assert "not valid UTF-8" in skipped[1]["detail"]
    assert "chat.jsonl:13: a string holds a lone UTF-16 surrogate ('\\ud800')" in skipped[8]["detail"]
    assert "unknown role 'tool'" in skipped[3]["detail"]
    kept = read_jsonl(tmp_path / "out" / "train.jsonl") + read_jsonl(tmp_path / "out" / "eval.jsonl")
    assert sorted(r["id"] for r in kept) == ["chat:000000", "chat:000010"]


def test_auto_format_and_sharegpt_roles(tmp_path):
    sharegpt = write_lines(
        tmp_path / "sg.jsonl",
        [
            {
                "conversations": [
                    {"from": "system", "value": "S"},
                    {"from": "human", "value": "Q"},
                    {"from": "gpt", "value": "A"},
                ]
            },
            {"conversations": [{"from": "human", "value": "Q2"}, {"from": "function_call", "value": "{}"}]},
            {"conversations": [{"from": "human"}]},
        ],
    )
    alpaca = tmp_path / "al.json"
    alpaca.write_text(
        json.dumps(
            [{"instruction": "Do it", "input": "", "output": "Done", "history": [["Before?", "Yes."]]}]
        )
    )
    summary = prepare([str(sharegpt), str(alpaca)], tmp_path / "out", eval_fraction=0.0)
    assert summary["sources"]["sg"]["format"] == "sharegpt" and summary["sources"]["al"]["format"] == "alpaca"
    assert summary["sources"]["sg"]["skipped_reasons"] == {"unknown_role": 1, "missing_field": 1}
    rows = {r["id"]: r["conversations"] for r in read_jsonl(tmp_path / "out" / "train.jsonl")}
    assert rows["sg:000000"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
    ]
    assert [t["content"] for t in rows["al:000000"]] == ["Before?", "Yes.", "Do it", "Done"]


def test_never_overwrites_finished_output(tmp_path, capsys):
    src = write_lines(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)])
    out = tmp_path / "out"
    assert main(["--input", str(src), "--output", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["eval.jsonl", "skipped.jsonl", "summary.json", "train.jsonl"]
    assert main(["--input", str(src), "--output", str(out), "--seed", "1"]) == 2
    assert "already holds a finished prepare output" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # --overwrite replaces it; same arguments give byte-identical files (deterministic).
    assert main(["--input", str(src), "--output", str(out), "--overwrite"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        prepare([str(tmp_path / "missing.jsonl")], tmp_path / "other")
    # Two runs on one folder wrote the same .tmp files: train.jsonl of one beside eval.jsonl of the other, no summary
    # (newcomer review). One that finds the folder held by a run in progress is refused; nothing changes.
    from dspine.io import folder_lock

    with folder_lock(out):  # flock: another open of the folder, in this process too, is refused
        assert main(["--input", str(src), "--output", str(out), "--overwrite"]) == 2
    assert f"error: {out}: another run is writing this folder" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_no_row_kept_writes_nothing_and_a_retry_works(tmp_path, capsys):
    empty = write_lines(tmp_path / "empty.jsonl", [])
    bad = write_lines(tmp_path / "bad.jsonl", [b"{not json", {"unrelated": 1}])
    out = tmp_path / "p3"
    assert main(["--input", f"x={empty}", "--output", str(out)]) == 1
    assert "error: no row was kept" in capsys.readouterr().err
    assert not out.exists()  # the folder this run created is removed again
    out.mkdir()
    assert main(["--input", str(bad), "--output", str(out)]) == 1
    captured = capsys.readouterr()
    assert "bad_json" in captured.out and f"nothing was written to {out}" in captured.err
    assert list(out.iterdir()) == []  # no train/eval/skipped/summary, no .tmp files
    with pytest.raises(NoRowKept) as info:
        prepare([str(bad)], out)
    assert info.value.summary["total"] == {"read": 2, "kept": 0, "train": 0, "eval": 0, "duplicates": 0, "skipped": 2}
    # The corrected retry into the same folder is not refused.
    good = write_lines(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(3)])
    assert main(["--input", str(good), "--output", str(out), "--eval-fraction", "0"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["eval.jsonl", "skipped.jsonl", "summary.json", "train.jsonl"]
    assert [r["id"] for r in read_jsonl(out / "train.jsonl")] == ["q:000000", "q:000001", "q:000002"]
    # A failed run with --overwrite leaves the earlier finished output as it was.
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["--input", str(empty), "--output", str(out), "--overwrite"]) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_ctrl_c_or_a_bad_input_leaves_no_folder_and_a_clear_line(tmp_path, capsys, monkeypatch):
    """A source that fails to read (an unsupported .csv) or Ctrl-C mid-run removes the output folder this run
    created (no partial .tmp files either); Ctrl-C exits 130 with one line instead of a traceback."""
    import data.prepare

    csv = tmp_path / "rows.csv"
    csv.write_text("question,answer\nq,a\n")
    out = tmp_path / "out"
    assert main(["--input", str(csv), "--output", str(out)]) == 2
    assert "error:" in capsys.readouterr().err and not out.exists()
    src = write_lines(tmp_path / "q.jsonl", [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(data.prepare, "_prepare_source", interrupted)
    assert main(["--input", str(src), "--output", str(out)]) == 130
    assert capsys.readouterr().err == f"\ndata.prepare: interrupted; nothing was written to {out} (the same command " \
        "starts over)\n"
    assert not out.exists()
    # SIGTERM (a scheduler's stop) takes the same path (newcomer review: it exited 143 silently, .tmp files left)
    import os
    import signal

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(data.prepare, "_prepare_source", lambda *a, **kw: os.kill(os.getpid(), signal.SIGTERM))
    assert main(["--input", str(src), "--output", str(out)]) == 130
    assert "data.prepare: interrupted; nothing was written" in capsys.readouterr().err and not out.exists()
    assert signal.getsignal(signal.SIGTERM) is before


GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_data_tools_fail_early(stories_dir, tmp_path, capsys):
    from data import prepare, regenerate

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}) + "\n")
    with pytest.raises(SystemExit):
        prepare.main(["--input", str(src), "--output", str(tmp_path / "p"), "--limit", "-3"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n{"conversations": []}\n')
    assert prepare.main(["--input", str(bad), "--output", str(tmp_path / "p2")]) == 1
    assert prepare.main(["--input", str(src), "--output", str(tmp_path / "p3")]) == 0
    # a template that writes no end-of-turn token after an answer is refused before any generation
    # (ChatML itself is accepted for stories260K: tests/test_chat_text.py)
    no_end = tmp_path / "no-end.jinja"
    no_end.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    rc = regenerate.main(["--target", str(stories_dir), "--tokenizer", str(stories_dir), "--chat-template", str(no_end),
                          "--input", str(tmp_path / "p3" / "train.jsonl"), "--output", str(tmp_path / "r")])
    assert rc == 2 and "chat template unusable" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # another tool's finished folder is not mistaken for a finished regeneration
    rc = regenerate.main(["--target", str(stories_dir), "--input", str(tmp_path / "p3" / "train.jsonl"),
                          "--output", str(tmp_path / "p3")])
    assert rc == 2 and "no data.regenerate run wrote" in capsys.readouterr().err


def test_prepare_leaves_no_tmp_files_and_names_the_output(tmp_path, capsys):
    from data import prepare

    txt = tmp_path / "x.txt"
    txt.write_text("hi\n")
    (tmp_path / "empty").mkdir()
    for src in (txt, tmp_path / "empty"):
        out = tmp_path / f"out-{src.name}"
        assert prepare.main(["--input", str(src), "--output", str(out)]) == 2
        assert str(src) in capsys.readouterr().err
        assert not list(out.glob("*.tmp")), list(out.iterdir())
    assert prepare.main(["--input", str(txt), "--output", str(txt)]) == 2
    assert f"--output {txt} is an existing file" in capsys.readouterr().err


@pytest.mark.slow
def test_data_tools_accept_a_gguf_path(tmp_path, capsys, gguf_memo):
    from data import regenerate, tokenize

    if not GGUF.is_file():
        pytest.skip(f"missing {GGUF} (python -m infer.fetch)")
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "conversations": [{"role": "user", "content": "hi there, how are you?"},
                                                            {"role": "assistant", "content": "fine"}]}) + "\n")
    assert tokenize.main(["--input", str(src), "--tokenizer", str(GGUF), "--max-length", "64",
                          "--cache-dir", str(tmp_path / "tok")]) == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert tokenize.main(["--input", str(empty), "--tokenizer", str(GGUF), "--max-length", "64",
                          "--cache-dir", str(tmp_path / "tok")]) == 1
    assert f"{empty} has no rows" in capsys.readouterr().err
    # every row is longer than --max-context: all skipped, so nothing was regenerated -> exit 1
    rc = regenerate.main(["--target", str(GGUF), "--input", str(src), "--output", str(tmp_path / "r"),
                          "--max-context", "8", "--max-new-tokens", "4"])
    assert rc == 1 and "no row was regenerated (1 skipped" in capsys.readouterr().err
    assert not (tmp_path / "r" / "run_args.json").exists()  # a run that regenerated nothing pins nothing
    # the corrected retry (another --max-context) runs in the same folder and records the GGUF path split
    assert regenerate.main(["--target", str(GGUF), "--input", str(src), "--output", str(tmp_path / "r"),
                            "--max-context", "64", "--max-new-tokens", "4"]) == 0
    run_args = json.loads((tmp_path / "r" / "run_args.json").read_text())
    assert (run_args["target"], run_args["gguf_file"]) == (str(GGUF.parent), GGUF.name)
