"""Loss masks from chat templates (golden spans with the real Qwen3 tokenizer) and the tokenized cache."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from data.chat import CHATML
from data.schema import RowError
from data.tokenize import build_tokenized, load_tokenized, main, tokenize_conversation

SHARED = Path(os.environ.get("DSPINE_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
QWEN3 = SHARED / "models" / "qwen3-tokenizer"
STORIES = SHARED / "models" / "stories260K" / "hf"
pytestmark = pytest.mark.skipif(
    not QWEN3.is_dir(), reason=f"shared Qwen3 tokenizer not found at {QWEN3} (set DSPINE_SHARED)"
)

IM_START, IM_END, THINK, END_THINK = 151644, 151645, 151667, 151668

# ChatML with a default system prompt when the row has none (the SmolLM2 template family does this).
CHATML_DEFAULT_SYSTEM = (
    "{%- if messages[0]['role'] != 'system' -%}{{ '<|im_start|>system\\nYou are a test assistant.<|im_end|>\\n' }}{%- endif -%}"
    + CHATML
)

SYSTEM = {"role": "system", "content": "You answer in one line."}
THREE_TURNS = [
    SYSTEM,
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And times 3?"},
    {"role": "assistant", "content": "That makes 12.\nDone."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]


@pytest.fixture(scope="module")
def qwen3():
    from dspine.paths import load_tokenizer

    return load_tokenizer(str(QWEN3))


@pytest.fixture(scope="module")
def qwen3_template(qwen3):
    return qwen3.chat_template


def supervised_spans(tok, seq) -> list[str]:
    """Decoded runs of consecutive supervised tokens."""
    spans, run = [], []
    for token, m in zip(seq["input_ids"], seq["loss_mask"]):
        if m:
            run.append(token)
        elif run:
            spans.append(tok.decode(run))
            run = []
    if run:
        spans.append(tok.decode(run))
    return spans


def unsupervised_ids(seq) -> list[int]:
    return [t for t, m in zip(seq["input_ids"], seq["loss_mask"]) if not m]


def test_qwen3_single_turn_non_thinking(qwen3, qwen3_template):
    conv = [
        SYSTEM,
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue, like the sky."},
    ]
    (seq,) = tokenize_conversation(conv, qwen3, qwen3_template, thinking=False, row_id="r0")
    assert supervised_spans(qwen3, seq) == ["Blue, like the sky.<|im_end|>"]
    assert len(seq["input_ids"]) == len(seq["loss_mask"])
    # The empty think block, role headers, system and user text are in the sequence but unsupervised.
    text = qwen3.decode(seq["input_ids"])
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nBlue" in text
    assert text.endswith("<|im_end|>\n")
    off = unsupervised_ids(seq)
    assert THINK in off and END_THINK in off and IM_START in off
    assert seq["loss_mask"][-1] == 0  # the newline after <|im_end|>
    assert seq["input_ids"][-2] == IM_END and seq["loss_mask"][-2] == 1


def test_qwen3_single_turn_thinking(qwen3, qwen3_template):
    answer = "<think>\nThe user wants a color.\n</think>\n\nBlue."
    conv = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": answer}]
    (seq,) = tokenize_conversation(conv, qwen3, qwen3_template, thinking=True, row_id="r1")
    # In thinking mode the target generates the think block itself: it is supervised.
    assert supervised_spans(qwen3, seq) == [answer + "<|im_end|>"]
    prompt = qwen3.decode(unsupervised_ids(seq))
    assert prompt == "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n\n"


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_three_turns_one_sequence_per_turn(qwen3, qwen3_template, thinking):
    answers = ["2+2 is 4.", "That makes 12.\nDone.", "You're welcome."]
    conv = [dict(t) for t in THREE_TURNS]
    if thinking:  # earlier turns carry reasoning that the template strips from later prompts
        for pos, answer in zip((2, 4, 6), answers):
            conv[pos]["content"] = f"<think>\nreason {pos}\n</think>\n\n{answer}"
    seqs = tokenize_conversation(conv, qwen3, qwen3_template, thinking=thinking, row_id="r3")
    # Qwen3 re-renders earlier turns differently, so each turn is its own sequence.
    assert [s["turns"] for s in seqs] == [[2], [4], [6]]
    for seq, pos, answer in zip(seqs, (2, 4, 6), answers):
        expected = conv[pos]["content"] if thinking else answer
        assert supervised_spans(qwen3, seq) == [expected + "<|im_end|>"]
        prompt = qwen3.decode(unsupervised_ids(seq))
        assert "You answer in one line." in prompt and "<|im_start|>user\n" in prompt
        # The supervised turn's prompt is exactly the generation prompt the target saw.
        gen_prompt = qwen3.apply_chat_template(
            conv[:pos], tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        n = len(qwen3(gen_prompt, add_special_tokens=False)["input_ids"])
        assert qwen3.decode(seq["input_ids"][:n]) == gen_prompt
        assert not any(seq["loss_mask"][:n]) and seq["loss_mask"][n] == 1
    if thinking:  # the template dropped turn 2's reasoning from turn 4's prompt: never supervised there
        assert "reason 2" not in qwen3.decode(seqs[1]["input_ids"])


def test_qwen3_last_turn_only(qwen3, qwen3_template):
    (seq,) = tokenize_conversation(
        THREE_TURNS, qwen3, qwen3_template, thinking=False, assistant_turns="last", row_id="r"
    )
    assert seq["turns"] == [6]
    assert supervised_spans(qwen3, seq) == ["You're welcome.<|im_end|>"]


@pytest.mark.parametrize("template", [CHATML, CHATML_DEFAULT_SYSTEM], ids=["chatml", "chatml-default-system"])
def test_chatml_three_turns_one_sequence(qwen3, template):
    conv = THREE_TURNS[1:]  # no system turn
    (seq,) = tokenize_conversation(conv, qwen3, template, thinking=False, row_id="c")
    assert seq["turns"] == [1, 3, 5]
    assert supervised_spans(qwen3, seq) == [
        "2+2 is 4.<|im_end|>",
        "That makes 12.\nDone.<|im_end|>",
        "You're welcome.<|im_end|>",
    ]
    off = qwen3.decode(unsupervised_ids(seq))
    assert off.count("<|im_start|>assistant\n") == 3 and "<think>" not in off
    assert ("You are a test assistant." in off) == (template == CHATML_DEFAULT_SYSTEM)
    # Every <|im_end|> after an answer is supervised, every other one is not.
    ends = [m for t, m in zip(seq["input_ids"], seq["loss_mask"]) if t == IM_END]
    assert sum(ends) == 3 and len(ends) == 3 + 3 + (template == CHATML_DEFAULT_SYSTEM)


def test_length_finish_reason_leaves_end_of_turn_unsupervised(qwen3):
    conv = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1 2 3 4"}]
    (seq,) = tokenize_conversation(conv, qwen3, CHATML, thinking=False, finish_reasons=["length"], row_id="L")
    assert supervised_spans(qwen3, seq) == ["1 2 3 4"]


def test_all_zero_mask_and_other_row_errors(qwen3, qwen3_template):
    conv = [{"role": "user", "content": "word " * 50}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(ValueError, match="row long-1: loss mask is all zero.*max_length 20"):
        tokenize_conversation(conv, qwen3, qwen3_template, thinking=False, max_length=20, row_id="long-1")
    # Truncation from the right keeps the prefix; a partly kept answer still counts.
    full = tokenize_conversation(conv, qwen3, qwen3_template, thinking=False, row_id="x")[0]
    cut = tokenize_conversation(
        conv, qwen3, qwen3_template, thinking=False, max_length=len(full["input_ids"]) - 2, row_id="x"
    )[0]
    assert (
        cut["input_ids"] == full["input_ids"][:-2]
        and cut["truncated"]
        and sum(cut["loss_mask"]) == sum(full["loss_mask"]) - 1
    )
    # An empty answer cut by max_new_tokens has nothing the target generated.
    empty = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    with pytest.raises(RowError, match="row e: loss mask is all zero"):
        tokenize_conversation(empty, qwen3, CHATML, thinking=False, finish_reasons=["length"], row_id="e")
    with pytest.raises(RowError, match="row p: no assistant turn"):
        tokenize_conversation(conv[:1], qwen3, qwen3_template, thinking=False, row_id="p")


def test_template_not_prefix_consistent_is_an_error(qwen3):
    # Renders the generation prompt with a marker that the finished conversation does not have.
    bad = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\nSure! '")
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(RowError, match="row b: chat template is not prefix-consistent"):
        tokenize_conversation(conv, qwen3, bad, thinking=False, row_id="b")


def test_token_straddling_a_turn_edge_is_an_error(qwen3):
    # The generation prompt ends with a space that byte-level BPE glues to the answer's first word.
    spaced = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\nReply: '").replace(
        "'<|im_start|>' + message['role'] + '\\n' + message['content']",
        "'<|im_start|>' + message['role'] + '\\n' + ('Reply: ' if message['role'] == 'assistant' else '') + message['content']",
    )
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert "Reply: Hello" in qwen3.apply_chat_template(conv, chat_template=spaced, tokenize=False)
    with pytest.raises(RowError, match="row s: token 'ĠHello' spans the edge of an assistant turn"):
        tokenize_conversation(conv, qwen3, spaced, thinking=False, row_id="s")


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260K not found at {STORIES}")
def test_sentencepiece_tokenizer_masks_follow_offsets():
    # SentencePiece tokenizes a piece alone with a leading "▁"; masks must come from the whole text.
    from dspine.paths import load_tokenizer

    tok = load_tokenizer(str(STORIES))
    plain = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m.role == 'assistant' %}{{ m.content + eos_token }}{% else %}{{ m.content + '\\n' }}{% endif %}"
        "{% endfor %}"
    )
    conv = [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": "Lily went out."},
        {"role": "user", "content": "Then?"},
        {"role": "assistant", "content": "She played."},
    ]
    (seq,) = tokenize_conversation(conv, tok, plain, thinking=False, row_id="sp")
    assert seq["turns"] == [1, 3]
    assert supervised_spans(tok, seq) == ["Lily went out.</s>", "She played.</s>"]
    text = "<s>Once upon a time\nLily went out.</s>Then?\nShe played.</s>"
    assert seq["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------ cache


def write_rows(path: Path, rows: list, extra_lines: list[bytes] = ()) -> Path:
    with open(path, "wb") as f:
        for row in rows:
            f.write(json.dumps(row).encode() + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")
    return path


def conv_row(i: int, n_words: int = 3) -> dict:
    return {
        "id": f"t:{i:06d}",
        "conversations": [
            {"role": "user", "content": f"Question {i}: " + "word " * n_words},
            {"role": "assistant", "content": f"Answer number {i}."},
        ],
    }


def test_cache_key_and_reuse(tmp_path, qwen3):
    data = write_rows(tmp_path / "rows.jsonl", [conv_row(i) for i in range(6)])
    cache = tmp_path / "cache"
    a = build_tokenized(data, str(QWEN3), cache, max_length=64, thinking=False, assistant_turns="all")
    assert build_tokenized(data, str(QWEN3), cache, 64, False, "all") == a  # same inputs: reused
    ds = load_tokenized(a)
    assert len(ds) == 6 and ds[3]["id"] == "t:000003"
    assert supervised_spans(qwen3, ds[3]) == ["Answer number 3.<|im_end|>"]

    b = build_tokenized(data, str(QWEN3), cache, max_length=32, thinking=False)
    tpl = tmp_path / "chatml.jinja"
    tpl.write_text(CHATML)
    c = build_tokenized(data, str(QWEN3), cache, 64, False, chat_template=str(tpl))
    tpl.write_text(CHATML.replace("message['content']", "message['content'] | trim"))
    d = build_tokenized(data, str(QWEN3), cache, 64, False, chat_template=str(tpl))
    e = build_tokenized(data, str(QWEN3), cache, 64, True)
    f = build_tokenized(data, str(QWEN3), cache, 64, False, assistant_turns="last")
    # Same size and mtime-independent: a content edit of one character must change the key.
    text = data.read_text().replace("Answer number 5.", "Answer number 6.")
    data.write_text(text)
    g = build_tokenized(data, str(QWEN3), cache, 64, False)
    keys = [p.name for p in (a, b, c, d, e, f, g)]
    assert len(set(keys)) == len(keys)
    assert sorted(p.name for p in cache.iterdir()) == sorted(keys)  # no temp folders left over
    # A rebuilt cache reflects the new content.
    assert supervised_spans(qwen3, load_tokenized(g)[5]) == ["Answer number 6.<|im_end|>"]


def test_cache_reports_bad_rows_and_cli(tmp_path, capsys):
    rows = [conv_row(0), conv_row(1, n_words=200), conv_row(2)]
    bad = [
        b'{"id": "broken", "conversations": [',
        b'{"id": "bytes", "conversations": "\xff\xfe"}',
        b'{"id": "surrogate", "conversations": [{"role": "user", "content": "\\ud83d"}]}',
        json.dumps({"id": "norole", "conversations": [{"role": "robot", "content": "x"}]}).encode(),
        json.dumps({"id": "empty", "conversations": []}).encode(),
        json.dumps({"id": "nofield"}).encode(),
        json.dumps({"id": "prompt-only", "conversations": [{"role": "user", "content": "hi"}]}).encode(),
    ]
    data = write_rows(tmp_path / "rows.jsonl", rows, bad)
    assert main(["--input", str(data), "--tokenizer", str(QWEN3), "--max-length", "100"]) == 0
    out = capsys.readouterr().out
    assert "10 rows -> 2 sequences" in out
    (folder,) = (tmp_path / "tokenized").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rows"] == 10 and summary["rows_ok"] == 2 and summary["errors"] == 8
    assert summary["error_reasons"] == {
        "all_zero_mask": 1,
        "bad_json": 1,
        "bad_utf8": 2,
        "unknown_role": 1,
        "empty_conversation": 1,
        "missing_field": 1,
        "no_assistant_turn": 1,
    }
    ds = load_tokenized(folder)
    assert ds["id"] == ["t:000000", "t:000002"]
    assert summary["tokens"] == sum(len(x) for x in ds["input_ids"])
    assert summary["supervised_tokens"] == sum(sum(m) for m in ds["loss_mask"])
    errors = [json.loads(line) for line in (folder / "errors.jsonl").read_text().splitlines()]
    assert {e["id"] for e in errors} >= {"t:000001", "norole", "empty", "prompt-only"}


def test_thinking_mode_must_match_regeneration(tmp_path):
    data = write_rows(tmp_path / "results.jsonl", [conv_row(0)])
    (tmp_path / "run_args.json").write_text(json.dumps({"enable_thinking": False}))
    with pytest.raises(ValueError, match="enable_thinking=False"):
        build_tokenized(data, str(QWEN3), tmp_path / "cache", 64, thinking=True)


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260K not found at {STORIES}")
def test_tokenizer_without_template_needs_one(tmp_path):
    data = write_rows(tmp_path / "rows.jsonl", [conv_row(0)])
    with pytest.raises(ValueError, match="has no chat template; pass --chat-template"):
        build_tokenized(data, str(STORIES), tmp_path / "cache", 64, thinking=False)


@pytest.mark.parametrize("missing", ["pyarrow", "datasets"])
def test_missing_train_extra_is_named_before_anything_is_created(tmp_path, capsys, monkeypatch, missing):
    import sys

    data = write_rows(tmp_path / "rows.jsonl", [conv_row(0)], [])
    cache = tmp_path / "cache"
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` now raises ImportError
    assert main(["--input", str(data), "--tokenizer", str(QWEN3), "--max-length", "64", "--cache-dir", str(cache)]) == 2
    assert capsys.readouterr().err == (
        f"error: data.tokenize needs the package {missing!r}, which is not installed: pip install -e \".[train]\"\n"
    )
    assert not cache.exists()  # no <key>.tmp-NNN/ folder left behind


def test_failed_build_leaves_no_temp_folder(tmp_path, monkeypatch):
    import data.tokenize

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    data_file = write_rows(tmp_path / "rows.jsonl", [conv_row(0)], [])
    monkeypatch.setattr(data.tokenize, "_write_cache", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        build_tokenized(data_file, str(QWEN3), tmp_path / "cache", 64, False)
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_killed_builds_temp_folder_is_removed_by_the_next_build(tmp_path):
    """SIGKILL runs no cleanup: the next build of the same cache removes `.<key>.tmp-<pid>` when that process is gone
    and leaves a live process's (a build running beside it) and other keys' alone (newcomer review, 2026-12-05)."""
    import subprocess

    data_file = write_rows(tmp_path / "rows.jsonl", [conv_row(0)], [])
    cache = tmp_path / "cache"
    first = build_tokenized(data_file, str(QWEN3), cache, 64, False)
    key = first.name
    shutil.rmtree(first)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    stale, live, other = (cache / f".{key}.tmp-{dead.pid}", cache / f".{key}.tmp-{os.getppid()}",
                          cache / f".otherkey.tmp-{dead.pid}")
    for d in (stale, live, other):
        d.mkdir()
        (d / "data.arrow").write_bytes(b"partial")
    assert build_tokenized(data_file, str(QWEN3), cache, 64, False) == first
    assert not stale.exists() and live.exists() and other.exists()


def test_ctrl_c_removes_the_dot_temp_folder_and_exits_130(tmp_path, monkeypatch, capsys):
    import data.tokenize

    seen = []

    def interrupted(folder, *args, **kwargs):
        seen.append(folder.name)
        (folder / "data.arrow").write_bytes(b"partial")
        raise KeyboardInterrupt

    data_file = write_rows(tmp_path / "rows.jsonl", [conv_row(0)], [])
    cache = tmp_path / "cache"
    monkeypatch.setattr(data.tokenize, "_write_cache", interrupted)
    assert main(["--input", str(data_file), "--tokenizer", str(QWEN3), "--max-length", "64",
                 "--cache-dir", str(cache)]) == 130
    assert capsys.readouterr().err == f"data.tokenize: interrupted; no cache written to {cache}\n"
    (name,) = seen
    assert name.startswith(".") and name.endswith(f".tmp-{os.getpid()}")  # `ls -d cache/*/` skips it
    assert list(cache.iterdir()) == []


def test_tokenize_says_the_input_has_no_rows(qwen3_tokenizer_dir, tmp_path, capsys):
    from data import tokenize

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert tokenize.main(["--input", str(empty), "--tokenizer", str(qwen3_tokenizer_dir), "--max-length", "32"]) == 1
    err = capsys.readouterr().err
    assert f"{empty} has no rows" in err and "every row failed" not in err
