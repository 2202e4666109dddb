"""data.decontaminate: n-gram overlap with the eval sets, duplicate prompts, never overwriting."""

from __future__ import annotations

import json

import pytest

from data.decontaminate import decontaminate, main, words

QUESTION = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
            "for her friends every day with four.")


def _row(i, user, answer="ok"):
    return {"id": f"s:{i}", "source": "s", "conversations": [{"role": "user", "content": user},
                                                            {"role": "assistant", "content": answer}]}


@pytest.fixture
def setup(tmp_path):
    ev = tmp_path / "eval"
    (ev / "gsm8k").mkdir(parents=True)
    (ev / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": QUESTION, "answer": "#### 18"}) + "\n")
    (ev / "mt_bench").mkdir()
    (ev / "mt_bench" / "question.jsonl").write_text(json.dumps(
        {"question_id": 81, "turns": ["Compose an engaging travel blog post about a recent trip to Hawaii.", "Rewrite it."]}) + "\n")
    rows = [
        _row(0, "How many legs do three spiders have?"),
        # 13 consecutive words of the question, other case and punctuation, inside other text
        _row(1, "Solve: SHE eats three -- for breakfast, every morning and bakes muffins for her friends every day!"),
        _row(2, "How many legs do three spiders have ?"),  # same words as row 0: duplicate prompt
        _row(3, "Tell me a joke.", "Sure. Compose an engaging travel blog post about a recent trip to Hawaii, you said?"),
        _row(4, "Rewrite it."),  # a 2-word eval turn is too short to count as contamination
    ]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src, ev, tmp_path / "clean"


def test_words_normalise_case_and_punctuation():
    assert words("She eats -- THREE, for breakfast!") == ["she", "eats", "three", "for", "breakfast"]


def test_drops_overlap_and_duplicates(setup):
    src, ev, out = setup
    s = decontaminate(str(src), str(out), ["gsm8k", "mt-bench"], 13, str(ev))
    kept = [json.loads(x)["id"] for x in (out / "train.jsonl").read_text().splitlines()]
    dropped = {json.loads(x)["id"]: json.loads(x) for x in (out / "dropped.jsonl").read_text().splitlines()}
    assert kept == ["s:0", "s:4"]
    assert dropped["s:1"]["reason"] == "contaminated" and dropped["s:1"]["eval_task"] == "gsm8k"
    assert dropped["s:3"]["eval_task"] == "mt-bench"  # the eval text is shorter than 13 words: matched whole
    assert dropped["s:2"]["reason"] == "duplicate_prompt"
    assert (s["read"], s["kept"], s["contaminated"], s["duplicates"]) == (5, 2, 2, 1)
    assert s["contaminated_by_task"] == {"gsm8k": 1, "mt-bench": 1} and s["adds_up"]


def test_finished_output_is_kept_and_other_args_refused(setup, capsys):
    src, ev, out = setup
    assert main(["--input", str(src), "--output", str(out), "--eval-dir", str(ev), "--tasks", "gsm8k"]) == 0
    before = (out / "train.jsonl").read_bytes()
    assert main(["--input", str(src), "--output", str(out), "--eval-dir", str(ev), "--tasks", "gsm8k"]) == 0
    assert (out / "train.jsonl").read_bytes() == before
    assert main(["--input", str(src), "--output", str(out), "--eval-dir", str(ev), "--tasks", "gsm8k",
                 "--ngram", "8"]) == 2
    assert "other arguments" in capsys.readouterr().err
    assert (out / "train.jsonl").read_bytes() == before
    summary = (out / "summary.json").read_bytes()
    (out / "summary.json").write_text("[1, 2]")  # valid JSON of the wrong type: named, not a traceback
    assert main(["--input", str(src), "--output", str(out), "--eval-dir", str(ev), "--tasks", "gsm8k"]) == 2
    assert (f"{out / 'summary.json'}: expected a JSON object (a data.decontaminate summary), got list [1, 2]"
            in capsys.readouterr().err)
    assert (out / "train.jsonl").read_bytes() == before
    (out / "summary.json").write_bytes(summary)
    # Two runs on one folder: the later one deleted the files of the one in progress, which wrote its summary.json
    # beside the other input's train.jsonl (newcomer review). One that finds the folder held is refused.
    from dspine.io import folder_lock

    (out / "summary.json").unlink()
    with folder_lock(out):  # a run in progress (flock: another open of the folder, in this process too, is refused)
        assert main(["--input", str(src), "--output", str(out), "--eval-dir", str(ev), "--tasks", "gsm8k"]) == 2
    assert f"error: {out}: another run is writing this folder" in capsys.readouterr().err
    assert (out / "train.jsonl").read_bytes() == before and not (out / "summary.json").exists()


def test_missing_input_and_eval_set_are_named(setup, tmp_path, capsys, monkeypatch):
    import infer.datasets

    def offline(task):
        raise ConnectionError("offline")

    monkeypatch.setattr(infer.datasets, "_hub_rows", offline)
    src, ev, out = setup
    assert main(["--input", str(tmp_path / "nope.jsonl"), "--output", str(out), "--eval-dir", str(ev)]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert main(["--input", str(src), "--output", str(out), "--eval-dir", str(ev), "--tasks", "math500"]) == 2
    assert "math500" in capsys.readouterr().err


def test_input_without_a_valid_row_is_an_error_and_leaves_nothing_finished(setup, tmp_path, capsys):
    src, ev, out = setup
    common = ["--output", str(out), "--eval-dir", str(ev), "--tasks", "gsm8k"]
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    assert main(["--input", str(empty), *common]) == 1
    assert f"--input {empty}: no rows" in capsys.readouterr().err
    assert not out.exists()
    invalid = tmp_path / "invalid.jsonl"
    invalid.write_text('{"id": "a"}\nnot json\n')
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)  # 4 newlines: 5 lines of control bytes and bad UTF-8
    for bad, n in ((invalid, 2), (binary, 5)):
        assert main(["--input", str(bad), *common]) == 1
        err = capsys.readouterr().err
        assert f"--input {bad}: none of its {n} rows is valid (first: " in err
        assert sorted(p.name for p in out.iterdir()) == ["dropped.jsonl"]  # no train.jsonl, no summary.json
        dropped = [json.loads(x) for x in (out / "dropped.jsonl").read_text().splitlines()]
        assert [d["line"] for d in dropped] == list(range(1, n + 1)) and all(d["reason"].startswith("invalid: ") for d in dropped)
    # The corrected rerun into the same folder is not refused.
    assert main(["--input", str(src), *common]) == 0
    assert [json.loads(x)["id"] for x in (out / "train.jsonl").read_text().splitlines()] == ["s:0", "s:3", "s:4"]
    assert json.loads((out / "summary.json").read_text())["read"] == 5


def test_output_that_is_a_file_is_refused(setup, tmp_path, capsys):
    src, ev, _ = setup
    existing = tmp_path / "README.md"
    existing.write_text("not a folder\n")
    assert main(["--input", str(src), "--output", str(existing), "--eval-dir", str(ev)]) == 2
    assert capsys.readouterr().err == f"error: --output {existing} is a file, expected a folder\n"
    assert existing.read_text() == "not a folder\n"


def test_an_input_inside_the_output_folder_is_refused_and_kept(setup, capsys):
    """An unfinished output folder is emptied of train.jsonl / dropped.jsonl first: with the input among them it was
    deleted and the run then read it as empty."""
    src, ev, _ = setup
    before = src.read_text()
    assert main(["--input", str(src), "--output", str(src.parent), "--eval-dir", str(ev)]) == 2
    assert capsys.readouterr().err == f"error: --input {src} is inside --output {src.parent}; choose another --output folder\n"
    assert src.read_text() == before
