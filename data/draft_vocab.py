"""Count the answer tokens of training rows and write a draft vocabulary: ``python -m data.draft_vocab``.

    python -m data.draft_vocab --data SOURCES --size N --output FILE.safetensors \\
        [--vocab-size V] [--keep ID,ID,...] [--all-tokens] [--tokenizer PATH]

    python -m data.draft_vocab --data /data/cache1,/data/cache2 --size 32768 --vocab-size 151936 \\
        --keep 151643,151645 --output runs/qwen3-8b/draft_vocab.safetensors

SOURCES is what the trainer's ``train`` key takes (a ``.jsonl`` file of rows, a ``data.tokenize`` cache
folder, or a comma-separated list of them; :func:`train.data.open_sources`). Every row's token ids are
counted at its answer positions (``loss_mask`` 1), or at every position with ``--all-tokens``; the N most
frequent ids (ties: the lower id first), with every ``--keep`` id (e.g. the end-of-sequence ids), are written
by :func:`dspine.draft_vocab.save_draft_vocab` (file format: the docstring of ``dspine/draft_vocab.py``),
with metadata size, coverage (counted tokens inside the subset / all counted tokens), counted_tokens,
source, source_digest, counted ("answer tokens" or "all tokens"), keep and, with ``--vocab-size``, vocab_size
(the engine then refuses the file for a target of another vocabulary size). With the tokenizer the rows were
tokenized with (``--tokenizer``, or the ``data.tokenize`` cache's own when it loads here: a local path, or a Hub id
from the local cache) it also records ``tokenizer`` and ``tokens_digest`` (:func:`dspine.draft_vocab.tokens_digest`),
so that a target whose tokenizer names other tokens with the same ids refuses the file; without one it says so on
stderr and writes neither. Where the cache's manifest records ``tokenizer_digest``, the tokenizer must match it
(another ``--tokenizer`` is refused).

Why answer tokens: the draft proposes only the tokens the target generates, which are the answer positions
of the rows (the positions the draft is trained on); prompt tokens (system prompts, user text, the chat
template) are never proposed, and counting them would spend the subset on ids the draft never needs.

V (the vocabulary the ids index) is ``--vocab-size`` when given (pass the target's ``vocab_size``: then a
``--keep`` id that never occurs is still in range), else the largest counted id + 1. N must be in
``MIN_SIZE..V``. An existing ``--output`` is never overwritten; it and its folder are checked before counting.
Errors are one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from dspine.io import sigterm_as_ctrl_c

FLUSH_TOKENS = 1 << 22  # ids buffered between two bincounts (32 MiB of int64)


class DraftVocabError(ValueError):
    """A bad flag value, data source or output path; the message names it."""


def parse_keep(text: str | None, vocab_size: int | None = None) -> list[int]:
    """``"1,2, 3"`` -> ``[1, 2, 3]`` (sorted, distinct); None or "" -> [].

    Raises DraftVocabError naming the value: not an integer, negative, or >= ``vocab_size`` (when given)."""
    if not text:
        return []
    out = set()
    for part in text.split(","):
        try:
            k = int(part.strip())
        except ValueError:
            raise DraftVocabError(f"--keep {text}: {part.strip()!r} is not an integer token id") from None
        if k < 0 or (vocab_size is not None and k >= vocab_size):
            if vocab_size is None:
                raise DraftVocabError(f"--keep {text}: token id {k} is negative")
            raise DraftVocabError(f"--keep {text}: token id {k} is outside 0..{vocab_size - 1} (--vocab-size {vocab_size})")
        out.add(k)
    return sorted(out)


def _where(rows, i: int) -> str:
    """``row i of --data``, or for a list of sources ``row k of PART`` (train.data.ConcatRows.locate)."""
    from train.data import ConcatRows

    if not isinstance(rows, ConcatRows):
        return f"row {i} of --data"
    j, k = rows.locate(i)
    return f"row {k} of {rows.paths[j]}"


def count_tokens(rows, all_tokens: bool = False, vocab_size: int | None = None) -> tuple[np.ndarray, int]:
    """(counts int64 [max counted id + 1, or vocab_size when given], number of rows) of ``rows`` (a
    :mod:`train.data` row source): occurrences of each token id at the answer positions (loss_mask 1), or
    at every position with ``all_tokens``. One numpy conversion per row, one bincount per FLUSH_TOKENS ids.

    Raises DraftVocabError for a counted id >= ``vocab_size`` (naming the id and the row)."""
    counts = np.zeros(vocab_size or 0, np.int64)
    buf: list[np.ndarray] = []
    buffered = 0

    def flush():
        nonlocal counts, buf, buffered
        if buf:
            c = np.bincount(np.concatenate(buf), minlength=len(counts))
            if len(c) > len(counts):
                c[: len(counts)] += counts
                counts = c
            else:
                counts += c
        buf, buffered = [], 0

    for i in range(len(rows)):
        row = rows.row(i)
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        if not all_tokens:
            ids = ids[np.asarray(row["loss_mask"]) == 1]
        if not ids.size:
            continue
        if vocab_size is not None and int(ids.max()) >= vocab_size:
            where = _where(rows, i)
            raise DraftVocabError(f"token id {int(ids.max())} in {where} is outside --vocab-size "
                                  f"{vocab_size} (0..{vocab_size - 1}); rows tokenized for another target?")
        buf.append(ids)
        buffered += ids.size
        if buffered >= FLUSH_TOKENS:
            flush()
    flush()
    return counts, len(rows)


def build(
    data: str,
    size: int,
    output: str | Path,
    vocab_size: int | None = None,
    keep: str | None = None,
    all_tokens: bool = False,
    tokenizer: str | None = None,
) -> dict:
    """Count ``data`` and write the draft vocabulary ``output``; returns its metadata (as written), plus
    ``coverage_value``, ``ids_of`` (V) and ``note`` (why no tokens_digest was written, or None).

    ``tokenizer``: the tokenizer the rows were tokenized with (a folder, a .gguf file or a Hub id), for the file's
    ``tokens_digest``; None takes the data.tokenize cache's tokenizer when it loads here (:func:`_tokenizer`).

    Raises DraftVocabError (flag values, output path, empty data, a ``tokenizer`` that does not load),
    FileNotFoundError / ValueError from the row readers (a missing or corrupt source)."""
    from dspine.draft_vocab import MIN_SIZE, save_draft_vocab, select_draft_vocab, tokens_digest
    from dspine.paths import check_output_file
    from train.data import open_sources, split_sources

    # every check that needs no counting first: a bad flag must not cost a pass over the data
    if vocab_size is not None and vocab_size < MIN_SIZE:
        raise DraftVocabError(f"--vocab-size {vocab_size}: must be >= {MIN_SIZE} (the smallest draft vocabulary)")
    if size < MIN_SIZE or (vocab_size is not None and size > vocab_size):
        want = f"in {MIN_SIZE}..{vocab_size} (--vocab-size)" if vocab_size is not None else f">= {MIN_SIZE}"
        raise DraftVocabError(f"--size {size}: must be {want}")
    keep_ids = parse_keep(keep, vocab_size)
    if len(keep_ids) > size:
        raise DraftVocabError(f"--keep {keep}: {len(keep_ids)} ids do not fit --size {size}")
    if not str(output).strip():
        raise DraftVocabError("--output: give the path of the .safetensors file to write")
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise DraftVocabError(f"--output {output} exists; a draft vocabulary is never overwritten (remove it "
                              "or choose another name)")
    try:
        check_output_file("--output", out, overwrite=False)
    except ValueError as e:
        raise DraftVocabError(str(e)) from None
    try:
        for part in split_sources(data):
            if not Path(part).exists():
                raise FileNotFoundError(f"{part}: no such file or folder")
        rows = open_sources(data)
    except (FileNotFoundError, ValueError) as e:
        raise DraftVocabError(f"--data: {e}") from None
    if len(rows) == 0:
        raise DraftVocabError(f"--data {data}: no rows")
    # the tokenizer files' digest the data.tokenize manifest records (one cache, or a list's first: its parts agree)
    part = rows.parts[0] if hasattr(rows, "parts") else rows
    recorded_digest = (getattr(part, "manifest", None) or {}).get("tokenizer_digest")
    tok, tok_path, note = _tokenizer(tokenizer, rows.metadata().get("tokenizer"), recorded_digest)

    counts, _ = count_tokens(rows, all_tokens, vocab_size)
    counted = "all tokens" if all_tokens else "answer tokens"
    total = int(counts.sum())
    if total == 0:
        hint = "" if all_tokens else " (no position has loss_mask 1; --all-tokens counts every position)"
        raise DraftVocabError(f"--data {data}: {len(rows)} rows but no {counted} to count{hint}")
    V = len(counts)
    if vocab_size is None:
        if size > V:
            raise DraftVocabError(f"--size {size}: larger than the {V} token ids seen (largest counted id "
                                  f"{V - 1}); pass --vocab-size (the target's vocab_size)")
        bad = [k for k in keep_ids if k >= V]
        if bad:
            raise DraftVocabError(f"--keep {keep}: token id {bad[0]} is outside the counted ids 0..{V - 1}; pass "
                                  "--vocab-size (the target's vocab_size)")
    import torch

    ids, coverage = select_draft_vocab(torch.from_numpy(counts), size, keep_ids)
    meta = rows.metadata()
    metadata = {
        "size": int(ids.numel()),
        "coverage": f"{coverage:.6g}",
        "counted_tokens": total,
        "source": meta["data"],
        "source_digest": meta["data_digest"],
        "counted": counted,
        "keep": ",".join(map(str, keep_ids)),
    }
    if vocab_size is not None:  # the target's size, which the loaders check (not guessed from the largest id)
        metadata["vocab_size"] = vocab_size
    if tok is not None:  # the ids' token strings, which the loaders compare with the target's tokenizer
        metadata["tokenizer"] = tok_path
        metadata["tokens_digest"] = tokens_digest(tok, ids)
    if out.exists():  # appeared while counting: still never overwrite
        raise DraftVocabError(f"--output {output} appeared while counting; a draft vocabulary is never overwritten")
    save_draft_vocab(out, ids, metadata)
    return {**metadata, "coverage_value": coverage, "ids_of": V, "note": note}


def _one_line(e: Exception) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return lines[0] if lines else type(e).__name__


def _tokenizer(given: str | None, recorded: str | None, recorded_digest: str | None = None):
    """(tokenizer or None, its path, note or None): ``--tokenizer`` when given (it must load), else the row
    source's recorded tokenizer when it loads here (a local path, or a Hub id from the local cache only); the note says why
    there is none. When the rows' manifest records the tokenizer's file digest (``recorded_digest``), the tokenizer
    used must have the same one: a different ``--tokenizer`` is refused, a recorded relative path that names another
    tokenizer from this folder gives no tokens_digest (a note)."""
    from transformers import AutoTokenizer

    from data.tokenize import tokenizer_digest
    from dspine.paths import load_tokenizer

    if given is not None:
        if not given.strip():
            raise DraftVocabError("--tokenizer: give the tokenizer's folder, .gguf file or Hub id")
        try:
            tok = load_tokenizer(given)
            digest = tokenizer_digest(given, tok) if recorded_digest else None
        except Exception as e:  # a broken tokenizer file raises KeyError, TypeError, ... from the library
            raise DraftVocabError(f"--tokenizer {given}: {_one_line(e)}") from None
        if recorded_digest and digest != recorded_digest:
            raise DraftVocabError(
                f"--tokenizer {given}: not the tokenizer the rows were tokenized with (the data.tokenize manifest "
                f"records {recorded} with tokenizer_digest {recorded_digest}, this one has {digest}); give the "
                "tokenizer data.tokenize was given")
        return tok, given, None
    if not recorded:
        return None, None, ("the rows record no tokenizer: the file has no tokens_digest, so a target whose tokenizer "
                            "names other tokens with the same ids is not detected (pass --tokenizer)")
    try:  # a Hub id only from the local cache: no network wait for a tokenizer nobody asked for
        tok = (load_tokenizer(recorded) if Path(recorded).exists()
               else AutoTokenizer.from_pretrained(recorded, local_files_only=True))
        digest = tokenizer_digest(recorded, tok) if recorded_digest else None
    except Exception as e:  # not here (a path of another machine, a Hub id not cached) or broken
        return None, None, (f"the rows' tokenizer {recorded} did not load here ({_one_line(e)}): the file has no "
                            "tokens_digest (pass --tokenizer)")
    if recorded_digest and digest != recorded_digest:
        return None, None, (f"the rows' tokenizer {recorded} names another tokenizer here (tokenizer_digest {digest}, "
                            f"the manifest's {recorded_digest}; a relative path?): the file has no tokens_digest "
                            "(pass --tokenizer)")
    return tok, recorded, None


@sigterm_as_ctrl_c()  # SIGTERM (a scheduler's stop) takes the Ctrl-C path
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.draft_vocab", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--data",
        required=True,
        help="rows: a .jsonl file, a data.tokenize cache folder, or a "
        "comma-separated list of them (the trainer's train key)",
    )
    ap.add_argument("--size", type=int, required=True, help="number of token ids in the draft vocabulary")
    ap.add_argument("--output", required=True, help="the .safetensors file to write (must not exist)")
    ap.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="the target's vocab_size (default: the largest counted id + 1)",
    )
    ap.add_argument("--keep", default=None, help="comma-separated token ids always included (e.g. the EOS ids)")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer the rows were tokenized with (folder, .gguf or Hub id), recorded as a digest of the "
        "ids' tokens that the engine checks against the target's (default: the data.tokenize cache's, if it is here)",
    )
    ap.add_argument(
        "--all-tokens",
        action="store_true",
        help="count every position, not only the answer tokens (loss_mask 1)",
    )
    args = ap.parse_args(argv)
    try:
        m = build(args.data, args.size, args.output, args.vocab_size, args.keep, args.all_tokens, args.tokenizer)
    except (DraftVocabError, FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # save_draft_vocab writes a temporary file and links it: nothing half-written stays
        print(f"interrupted: {args.output} not written", file=sys.stderr)
        return 130
    if m["note"]:
        print(f"note: {m['note']}", file=sys.stderr)
    print(f"wrote {args.output}: {m['size']} token ids of {m['ids_of']}, coverage "
          f"{100 * m['coverage_value']:.3f}% of {m['counted_tokens']} counted {m['counted']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
