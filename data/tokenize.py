"""Tokenize conversations with a chat template into `input_ids` + `loss_mask` for the trainer.

    python -m data.tokenize --input FILE --tokenizer PATH --max-length N [--cache-dir DIR]
        [--chat-template FILE|chatml] [--enable-thinking] [--assistant-turns all|last] [--num-proc 1]

loss_mask[i] = 1 iff token i is one the target generates at inference: assistant content and its
end-of-turn token (`<|im_end|>` for ChatML/Qwen3). Never system/user text, role headers
(`<|im_start|>assistant\\n`), the newline after `<|im_end|>`, or the empty `<think>\\n\\n</think>\\n\\n`
that Qwen3's non-thinking generation prompt inserts (it is part of the prompt, not generated).
A turn whose `finish_reason` is "length" (cut by max_new_tokens) gets no end-of-turn supervision:
the target never generated one there.

How the mask is found: for assistant turn k, the template renders P_k = the conversation before
it plus the generation prompt, and E_k = the conversation up to and including it; the supervised
text is E_k[len(P_k):] up to and including the end-of-turn token. P_k must be a prefix of E_k
(else the template is not prefix-consistent and the row is an error). The whole text is tokenized
once and the mask follows the token character offsets; the tokens before each supervised span
must equal the tokenization of P_k alone (the prompt the target was given), and no token may
straddle a span edge, else the row is an error. (Tokenizing pieces separately would not do:
SentencePiece tokenizers add a leading "▁" to every piece.)

Multi-turn choice: the supervised tokens of every turn are exactly what the target generates for
that turn given its own prompt P_k. Turns share one sequence when E_k is a prefix of P_{k+1}
(ChatML: all turns in one sequence). Qwen3's template re-renders earlier assistant turns without
their `<think>` block (thinking mode: the reasoning is dropped; non-thinking: the empty think block
is dropped), so for Qwen3 E_k is not a prefix of P_{k+1} and each assistant turn becomes its own
sequence (its prompt holding the earlier turns as the template renders them, unsupervised). That
costs more tokens for long chats but never supervises text the target did not produce.

The cache (`build_tokenized`) is an Arrow file read with `datasets.Dataset.from_file` (memory
mapped, random access by index), in a folder named by a hash of everything that changes its
content: tokenizer file contents, template text, max length, thinking mode, assistant turns, the
input file's content hash and CODE_VERSION.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path

from data.chat import end_of_turn_token, render, resolve_chat_template
from data.rows import CHAT_TEMPLATE_HELP, EXIT_STATUS, batched, dumps, parse_jsonl_line
from data.schema import RowError, check_row
from data.staging import tmp_beside
from dspine.io import atomic_write_json, file_digest, sigterm_as_ctrl_c
from dspine.paths import load_tokenizer, read_json_object
from dspine.prompts import encode_text, plain_spans

# Bump when a change here changes the tokenized output; old caches then stop matching.
# 2: control-token strings in system/user text are plain text (dspine.prompts).
CODE_VERSION = 2
ASSISTANT_TURNS = ("all", "last")
DATA_FILE = "data.arrow"
SUMMARY = "summary.json"
# Tokenizer files whose contents define the tokenization (hashed into the cache key).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def tokenize_conversation(
    turns: list[dict],
    tokenizer,
    template: str,
    *,
    thinking: bool,
    assistant_turns: str = "all",
    max_length: int | None = None,
    finish_reasons: list[str] | None = None,
    row_id: str = "?",
) -> list[dict]:
    """Tokenizes one conversation into training sequences with loss masks.

    Args:
        turns: checked turns `[{"role", "content"}]` (see `data.schema`).
        template: chat template text (see `data.chat.resolve_chat_template`).
        thinking: Qwen3 `enable_thinking` (False: the empty think block is in the prompt).
        assistant_turns: "all" supervises every assistant turn, "last" only the last one.
        max_length: keep the first max_length tokens of each sequence (right truncation).
        finish_reasons: per assistant turn, "stop" or "length" (from data.regenerate); None = all "stop".
        row_id: named in errors.
    Returns:
        sequences, each {"input_ids": list[int], "loss_mask": list[int] (0/1, same length),
        "turns": list[int] (indices into `turns` of the assistant turns it supervises),
        "truncated": bool}. Sequences left with no supervised token after truncation are dropped.
    Raises:
        RowError (a ValueError), naming the row id: "no_assistant_turn", "template" (render failed or
        not prefix-consistent), "no_end_of_turn", "token_mismatch" (a token crosses a turn edge, or
        the prompt tokenizes differently alone), "all_zero_mask" (nothing left to supervise).
    """
    if assistant_turns not in ASSISTANT_TURNS:
        raise ValueError(f"assistant_turns {assistant_turns!r}: expected one of {ASSISTANT_TURNS}")
    positions = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
    if not positions:
        raise RowError("no_assistant_turn", f"row {row_id}: no assistant turn to supervise")
    reasons = finish_reasons or ["stop"] * len(positions)
    if len(reasons) != len(positions):
        raise RowError("bad_field", f"row {row_id}: {len(reasons)} finish reasons for {len(positions)} assistant turns")
    if not any(t["role"] == "user" for t in turns[: positions[0]]):
        raise RowError("bad_turn_order", f"row {row_id}: assistant turn {positions[0]} has no user turn before it "
                       "(nothing prompted it; a conversation starts with a user turn)")
    chosen = list(zip(positions, reasons))
    if assistant_turns == "last":
        chosen = chosen[-1:]
    eot = end_of_turn_token(tokenizer, template)

    # Group turns into sequences: a turn joins the previous sequence iff the text up to the end of
    # the previous turn is a prefix of this turn's prompt (see module doc).
    groups: list[list[tuple[int, int]]] = []  # per sequence: supervised (start, end) char spans
    texts: list[str] = []  # per sequence: its full text
    rendered: list[list[dict]] = []  # per sequence: the turns its text renders
    seq_turns: list[list[int]] = []
    for pos, reason in chosen:
        prompt = _render(tokenizer, template, turns[:pos], True, thinking, row_id)
        full = _render(tokenizer, template, turns[: pos + 1], False, thinking, row_id)
        if not full.startswith(prompt):
            raise RowError(
                "template",
                f"row {row_id}: chat template is not prefix-consistent at turn {pos}: the rendered conversation "
                f"does not start with the generation prompt (prompt ends {prompt[-60:]!r})",
            )
        completion = full[len(prompt) :]
        cut = completion.rfind(eot)
        if cut < 0:
            raise RowError("no_end_of_turn", f"row {row_id}: no end-of-turn token {eot!r} after assistant turn {pos}")
        end = len(prompt) + cut + (len(eot) if reason != "length" else 0)
        if groups and prompt.startswith(texts[-1]):
            groups[-1].append((len(prompt), end))
            texts[-1] = full
            rendered[-1] = turns[: pos + 1]
            seq_turns[-1].append(pos)
        else:
            groups.append([(len(prompt), end)])
            texts.append(full)
            rendered.append(turns[: pos + 1])
            seq_turns.append([pos])

    sequences = []
    for spans, text, shown, seq in zip(groups, texts, rendered, seq_turns):
        ids, mask = _tokenize_spans(tokenizer, text, spans, row_id, shown,
                                    lambda t: render(tokenizer, template, t, False, thinking))
        truncated = max_length is not None and len(ids) > max_length
        if truncated:
            ids, mask = ids[:max_length], mask[:max_length]
        if any(mask):
            sequences.append({"input_ids": ids, "loss_mask": mask, "turns": seq, "truncated": truncated})
    if not sequences:
        limit = f" within max_length {max_length} (prompt too long)" if max_length is not None else ""
        raise RowError("all_zero_mask", f"row {row_id}: loss mask is all zero: no supervised token{limit}")
    return sequences


def _render(tokenizer, template, turns, add_generation_prompt, thinking, row_id) -> str:
    try:
        return render(tokenizer, template, turns, add_generation_prompt, thinking)
    except Exception as e:  # jinja errors, raise_exception() in templates
        raise RowError("template", f"row {row_id}: chat template failed: {type(e).__name__}: {e}") from None


def _tokenize_spans(
    tokenizer, text: str, spans: list[tuple[int, int]], row_id, turns: list[dict] | None = None, again=None
) -> tuple[list[int], list[int]]:
    """Tokenizes the whole `text` once; mask 1 on tokens whose characters lie inside a span.

    Checks, per span, that the tokens before it equal the tokenization of the prompt text alone
    (what the target was fed at inference), and that no token straddles a span edge. The
    system/user text of `turns` (what `text` renders; `again`: turns -> the same rendering) is plain text, as at
    inference (`dspine.prompts`).
    """
    try:
        plain = plain_spans(tokenizer, text, turns, again) if turns else []
    except ValueError as e:
        raise RowError("template", f"row {row_id}: {e}") from None
    ids, offsets = encode_text(tokenizer, text, plain, offsets=True)
    mask = [0] * len(ids)
    for start, end in spans:
        first = None
        for i, (s, e) in enumerate(offsets):
            if s < start < e or s < end < e:
                raise RowError(
                    "token_mismatch",
                    f"row {row_id}: token {tokenizer.convert_ids_to_tokens(ids[i])!r} spans the edge of an "
                    "assistant turn; the loss mask cannot follow it",
                )
            if start <= s < end or (s == e == start and start < end):
                mask[i] = 1
                first = i if first is None else first
        before = [(a, b) for a, b in plain if b <= start]
        if first is not None and ids[:first] != encode_text(tokenizer, text[:start], before):
            raise RowError(
                "token_mismatch",
                f"row {row_id}: the tokens before an assistant turn differ from the tokenized prompt alone "
                "(the template is not prefix-consistent at token level)",
            )
    return ids, mask


def check_template(tokenizer, template: str, thinking: bool) -> None:
    """Fails fast on a template that cannot give masks, using a small two-turn conversation.

    Raises:
        ValueError: the template is not prefix-consistent or puts no end-of-turn token after answers.
    """
    probe = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye"},
    ]
    try:
        tokenize_conversation(probe, tokenizer, template, thinking=thinking, row_id="template-check")
    except RowError as e:
        raise ValueError(f"chat template unusable for loss masks: {e}") from None


# ------------------------------------------------------------------------------------------ cache


def tokenizer_digest(tokenizer_path: str, tokenizer=None) -> str:
    """Hash of the tokenizer files' contents (a Hub id or a .gguf is saved to a temp folder first: ``tokenizer``,
    that path's tokenizer already loaded, saves loading it again)."""
    h = hashlib.blake2b(digest_size=16)
    folder = Path(tokenizer_path)
    tmp = None
    if not folder.is_dir():
        tmp = tempfile.mkdtemp(prefix="dspine-tok-")
        (tokenizer if tokenizer is not None else load_tokenizer(tokenizer_path)).save_pretrained(tmp)
        folder = Path(tmp)
    try:
        names = sorted(n for n in TOKENIZER_FILES if (folder / n).is_file())
        if not names:
            raise ValueError(f"{tokenizer_path}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
        for name in names:
            h.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return h.hexdigest()


def cache_manifest(input_jsonl, tokenizer_path, max_length, thinking, assistant_turns, template) -> dict:
    """Everything the cached content depends on; the cache folder is named by its hash."""
    return {
        "code_version": CODE_VERSION,
        "input": str(input_jsonl),
        "input_digest": file_digest(input_jsonl),
        "tokenizer": str(tokenizer_path),
        "tokenizer_digest": tokenizer_digest(tokenizer_path),
        "template_digest": hashlib.blake2b(template.encode(), digest_size=16).hexdigest(),
        "max_length": max_length,
        "thinking": thinking,
        "assistant_turns": assistant_turns,
    }


def require_train_extra() -> None:
    """Checks the optional packages the cache needs (pyarrow writes it, datasets reads it).

    Raises:
        ImportError: naming the missing package and the install command.
    """
    for name in ("pyarrow", "datasets"):
        try:
            __import__(name)
        except ImportError:
            raise ImportError(
                f"data.tokenize needs the package {name!r}, which is not installed: "
                'pip install -e ".[train]"'
            ) from None


def build_tokenized(
    input_jsonl: str | Path,
    tokenizer_path: str,
    cache_dir: str | Path,
    max_length: int,
    thinking: bool,
    assistant_turns: str = "all",
    chat_template: str | None = None,
    num_proc: int = 1,
) -> Path:
    """Tokenizes a conversation JSONL into a cache folder (reused if it already exists).

    Args:
        input_jsonl: rows with "id" and "conversations" (data.prepare or data.regenerate output);
            an optional "finish_reason" list marks assistant turns cut by max_new_tokens.
        tokenizer_path: local tokenizer folder or Hub id.
        cache_dir: parent folder; the cache goes to `cache_dir/<key>/`.
        max_length: sequence length cap in tokens (right truncation).
        thinking: Qwen3 enable_thinking; must match the regeneration mode.
        chat_template: template file or builtin name; None = the tokenizer's own.
        num_proc: worker processes for tokenization.
    Returns:
        the cache folder: `data.arrow` (columns id: str, turns: list[int32], input_ids: list[int32],
        loss_mask: list[int8]), `summary.json`, `manifest.json`, `errors.jsonl`. The build goes to
        `cache_dir/.<key>.tmp-<pid>/` (removed on any error, Ctrl-C included) and is renamed when
        finished; `summary.json` is written last, so it marks a finished cache.
    Raises:
        ValueError: bad arguments, unusable template, or thinking mode differing from the
            run_args.json of a data.regenerate output folder holding the input.
        ImportError: pyarrow or datasets (the `train` extra) is not installed.
    """
    require_train_extra()  # before anything is created in cache_dir
    if assistant_turns not in ASSISTANT_TURNS:
        raise ValueError(f"assistant_turns {assistant_turns!r}: expected one of {ASSISTANT_TURNS}")
    if max_length < 1:
        raise ValueError(f"--max-length {max_length}: must be >= 1")
    # a draft trained on the other thinking mode than the data was generated in collapses (design §8.8)
    run_args = Path(input_jsonl).parent / "run_args.json"
    stored = read_json_object(run_args, "data.regenerate run arguments").get("enable_thinking") \
        if run_args.is_file() else None
    if stored is not None and stored != thinking:
        raise ValueError(f"{input_jsonl} was regenerated with enable_thinking={stored} ({run_args}) but tokenization "
                         f"asks thinking={thinking}")
    tokenizer = load_tokenizer(tokenizer_path)
    template = resolve_chat_template(chat_template, tokenizer)
    check_template(tokenizer, template, thinking)
    manifest = cache_manifest(input_jsonl, tokenizer_path, max_length, thinking, assistant_turns, template)
    # the paths are informative only: the same content under another path is the same cache
    keyed = {k: v for k, v in manifest.items() if k not in ("input", "tokenizer")}
    final = Path(cache_dir) / hashlib.blake2b(json.dumps(keyed, sort_keys=True).encode(), digest_size=8).hexdigest()
    if (final / SUMMARY).exists():
        return final
    settings = (tokenizer_path, template, thinking, assistant_turns, max_length)
    # a killed build's leftover is removed, and never picked or opened as a cache; a failed build leaves no stray temp
    # folder in cache_dir
    with tmp_beside(final) as tmp:
        summary = _write_cache(tmp, Path(input_jsonl), tokenizer, settings, num_proc)
        summary["manifest"] = manifest
        atomic_write_json(tmp / "manifest.json", manifest)
        atomic_write_json(tmp / SUMMARY, summary)
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished the same key first: its cache is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_tokenized(path: str | Path):
    """Opens a cache folder as a memory-mapped `datasets.Dataset` (columns: id, turns, input_ids, loss_mask)."""
    from datasets import Dataset

    return Dataset.from_file(str(Path(path) / DATA_FILE))


# Worker state: set once per process by _init_worker, used by _tokenize_lines.
_WORKER: dict = {}


def _init_worker(tokenizer_path, template, thinking, assistant_turns, max_length, tokenizer=None):
    _WORKER.update(
        tokenizer=tokenizer or load_tokenizer(tokenizer_path),
        template=template,
        thinking=thinking,
        assistant_turns=assistant_turns,
        max_length=max_length,
    )


def _init_pool_worker(*settings):
    # Ctrl-C reaches the whole process group; the parent alone handles it (one message, no worker tracebacks).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(*settings)


def _tokenize_lines(lines: list[tuple[int, bytes, str]]) -> list[tuple]:
    """Tokenizes (line number, raw line, file name) items -> ("ok", id, sequences, truncated) or ("error", record)."""
    w = _WORKER
    out = []
    for lineno, raw, where in lines:
        row_id = None
        try:
            row = parse_jsonl_line(raw, f"{where}:{lineno}")
            row_id = row.get("id")  # named in the error record even if the row is broken
            row_id, turns = check_row(row)
            reasons = row.get("finish_reason")
            seqs = tokenize_conversation(
                turns,
                w["tokenizer"],
                w["template"],
                thinking=w["thinking"],
                assistant_turns=w["assistant_turns"],
                finish_reasons=reasons if isinstance(reasons, list) else None,
                row_id=row_id,
                max_length=w["max_length"],
            )
        except RowError as e:
            out.append(("error", {"line": lineno, "id": row_id, "reason": e.code, "detail": str(e)}))
            continue
        wanted = sum(t["role"] == "assistant" for t in turns) if w["assistant_turns"] == "all" else 1
        dropped = wanted - sum(len(seq["turns"]) for seq in seqs)
        out.append(("ok", row_id, seqs, sum(seq.pop("truncated") for seq in seqs), dropped))
    return out


def _read_chunks(path: Path, size: int = 256):
    with open(path, "rb") as f:
        yield from batched(((lineno, raw, path.name) for lineno, raw in enumerate(f, 1) if raw.strip()), size)


def _write_cache(folder: Path, input_jsonl: Path, tokenizer, settings, num_proc: int) -> dict:
    import multiprocessing

    import pyarrow as pa
    from tqdm import tqdm

    schema = pa.schema(
        [
            ("id", pa.string()),
            ("turns", pa.list_(pa.int32())),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
        ]
    )
    stats, reasons = Counter(), Counter()
    first_errors = []
    pool = None
    if num_proc > 1:
        pool = multiprocessing.get_context("spawn").Pool(num_proc, _init_pool_worker, settings)
        results = pool.imap(_tokenize_lines, _read_chunks(input_jsonl))
    else:
        _init_worker(*settings, tokenizer=tokenizer)
        results = map(_tokenize_lines, _read_chunks(input_jsonl))
    finished = False
    try:
        with (
            pa.OSFile(str(folder / DATA_FILE), "wb") as sink,
            pa.ipc.new_stream(sink, schema) as writer,
            open(folder / "errors.jsonl", "w", encoding="utf-8") as errors,
        ):
            for chunk in tqdm(results, desc="tokenize", unit=" chunks", mininterval=2.0, file=sys.stderr):
                batch = {name: [] for name in schema.names}  # id, turns, input_ids, loss_mask
                for item in chunk:
                    stats["rows"] += 1
                    if item[0] == "error":
                        stats["errors"] += 1
                        reasons[item[1]["reason"]] += 1
                        errors.write(dumps(item[1]) + "\n")
                        if len(first_errors) < 20:
                            first_errors.append(item[1])
                        continue
                    _, row_id, seqs, truncated, dropped = item
                    stats["truncated_sequences"] += truncated
                    stats["dropped_turns"] += dropped
                    for seq in seqs:
                        for name, column in batch.items():
                            column.append(row_id if name == "id" else seq[name])
                        stats["sequences"] += 1
                        stats["tokens"] += len(seq["input_ids"])
                        stats["supervised_tokens"] += sum(seq["loss_mask"])
                if batch["id"]:
                    writer.write_batch(pa.RecordBatch.from_pydict(batch, schema=schema))
        finished = True
    finally:
        if pool is not None:
            # on an error or Ctrl-C stop the workers now: close + join would first tokenize every queued chunk
            pool.close() if finished else pool.terminate()
            pool.join()
    return {
        "rows": stats["rows"],
        "rows_ok": stats["rows"] - stats["errors"],
        "sequences": stats["sequences"],
        "tokens": stats["tokens"],
        "supervised_tokens": stats["supervised_tokens"],
        "supervised_fraction": stats["supervised_tokens"] / stats["tokens"] if stats["tokens"] else 0.0,
        "truncated_sequences": stats["truncated_sequences"],
        "dropped_turns": stats["dropped_turns"],
        "errors": stats["errors"],
        "error_reasons": dict(reasons),
        "first_errors": first_errors,
    }


def format_summary(summary: dict, path: Path) -> str:
    return (
        f"{path}: {summary['rows']} rows -> {summary['sequences']} sequences, {summary['tokens']} tokens, "
        f"supervised fraction {summary['supervised_fraction']:.3f}\n"
        f"truncated sequences {summary['truncated_sequences']}, turns dropped by max length in kept rows {summary['dropped_turns']} (a row with none left is an error: all_zero_mask), "
        f"errors {summary['errors']} {summary['error_reasons']}"
    )


@sigterm_as_ctrl_c()  # SIGTERM (a scheduler's stop) takes the Ctrl-C path below
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.tokenize", description=__doc__.split("\n")[0],
                                epilog=EXIT_STATUS)
    p.add_argument("--input", required=True, help="conversation JSONL (data.prepare / data.regenerate output)")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder or Hub id (the target's)")
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--cache-dir", default=None, help="default: <input folder>/tokenized")
    p.add_argument("--chat-template", default=None, help=CHAT_TEMPLATE_HELP)
    p.add_argument("--enable-thinking", action="store_true", help="Qwen3 thinking mode (default: off)")
    p.add_argument("--assistant-turns", default="all", choices=ASSISTANT_TURNS)
    p.add_argument("--num-proc", type=int, default=1)
    args = p.parse_args(argv)
    if args.num_proc < 1:
        p.error(f"--num-proc {args.num_proc}: must be >= 1")
    cache_dir = args.cache_dir or str(Path(args.input).parent / "tokenized")
    try:
        if not Path(args.input).is_file():
            raise ValueError(f"--input {args.input}: no such file")
        if Path(cache_dir).exists() and not Path(cache_dir).is_dir():
            raise ValueError(f"--cache-dir {cache_dir} is an existing file; give a folder")
        path = build_tokenized(
            args.input, args.tokenizer, cache_dir, args.max_length, args.enable_thinking,
            args.assistant_turns, args.chat_template, args.num_proc,
        )  # fmt: skip
    except (ValueError, OSError, ImportError) as e:  # OSError includes FileNotFoundError
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # build_tokenized removes its temp folder; this catches a second Ctrl-C during that removal
        for tmp in Path(cache_dir).glob(f".*.tmp-{os.getpid()}"):
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"data.tokenize: interrupted; no cache written to {cache_dir}", file=sys.stderr)
        return 130
    summary = json.loads((path / SUMMARY).read_text())
    print(format_summary(summary, path))
    if not summary.get("rows"):
        print(f"error: {args.input} has no rows; nothing to train on", file=sys.stderr)
        return 1
    if not summary.get("sequences"):
        first = (summary.get("first_errors") or [{}])[0].get("detail", "")
        print(f"error: {path} holds no sequence: every row of {args.input} failed ({first}; all in "
              f"{path / 'errors.jsonl'}); nothing to train on", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
