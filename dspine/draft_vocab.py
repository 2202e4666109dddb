"""A draft vocabulary: the token ids the draft may propose, a frequency-ranked subset of the target's.

Why: the draft has no LM head of its own; it runs the target's (docs/method.md §2). At batch 1 that head
is a large share of a speculative step's weight reads: Qwen3-8B's is 151,936 x 4096 bf16 = 1.24 GB,
against 2.27 GB for five draft layers and the fc that mixes the target features (1.13 B parameters) and
15.14 GB for one target forward without the embedding table, so at that shape a spec step reads
(15.14 + 2.27 + 1.24) / 15.14 = 1.232 x an AR step's bytes before any overhead. SmolLM2-135M's tied head
is 49,152 x 576 = 57 MB of its 270 MB. With a draft vocabulary of the N most frequent answer tokens the
draft computes logits ``h · W[ids]ᵀ`` over N rows only (N = 32,768 at Qwen3-8B shape: 0.27 GB, a spec
step then reads 1.17 x an AR step's bytes). The idea is FR-Spec's (Zhao et al. 2025, "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"); EAGLE-3
trains its draft over such a subset.

Lossless whatever the subset: the target verifies every proposal. A draft that would have proposed a
token outside the subset proposes the best one inside; at T > 0 the draft distribution q is the softmax
over the subset (q = 0 outside), and the acceptance rule min(1, p/q) with the residual max(0, p − q)
keeps the target's distribution for any q (docs/method.md §5). What it can cost is τ: the share of the
target's tokens outside the subset (``coverage`` below says how large it was on the counted data).

File: safetensors with one tensor ``token_ids`` (int64 [N], ascending, distinct) and string metadata
``format`` = ``dspine-draft-vocab``; ``python -m data.draft_vocab`` adds ``size``, ``vocab_size`` (with
``--vocab-size``: the loaders refuse the file for a target of another size), ``coverage`` (counted tokens
inside the subset / all counted tokens), ``counted_tokens``, ``counted`` (answer or all tokens), ``keep``,
``source`` and ``source_digest`` (the rows it was counted on), and, when it had the tokenizer, ``tokenizer``
and ``tokens_digest`` (:func:`tokens_digest`: the ids' token strings). A vocabulary counted with another
tokenizer of the same size passes the ``vocab_size`` check but names other tokens: ``infer.generate``,
``infer.bench`` and ``infer.engine.load_engine`` compare ``tokens_digest`` with the target's tokenizer
(:func:`check_tokens`) and refuse such a file. ``infer.generate`` / ``infer.bench --draft-vocab FILE`` use it.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["DRAFT_VOCAB_HELP", "FORMAT", "MIN_SIZE", "select_draft_vocab", "check_draft_vocab", "spread_logits",
           "head_rows", "save_draft_vocab", "load_draft_vocab", "tokens_digest", "check_tokens", "unchecked_note",
           "describe"]

FORMAT = "dspine-draft-vocab"
DRAFT_VOCAB_HELP = ("a draft vocabulary (python -m data.draft_vocab; dspine.draft_vocab): the draft proposes only "
                    "these tokens and computes its logits over their rows of the target's head (fewer bytes per "
                    "step; lossless, may lower tau). Default (or none): the whole vocabulary")
MIN_SIZE = 64  # the largest token tree takes up to 64 candidates per depth (dspine.tree)


def select_draft_vocab(counts: torch.Tensor, size: int, keep=()) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent ids of ``counts`` (int64 [V], occurrences per token id; ties: the lower
    id first), with every id of ``keep`` (e.g. the end-of-sequence ids) in it.

    Returns (ids int64 [size] ascending, coverage = counts[ids].sum() / counts.sum(); 1.0 when nothing was
    counted). Raises ValueError for a size outside ``MIN_SIZE..V`` or a ``keep`` id outside 0..V-1, or more
    ``keep`` ids than ``size``.
    """
    counts = torch.as_tensor(counts, dtype=torch.int64).flatten()
    V = counts.numel()
    if not MIN_SIZE <= int(size) <= V:
        raise ValueError(f"draft vocabulary size {size}: must be in {MIN_SIZE}..{V} (the vocabulary's size)")
    keep = sorted({int(k) for k in keep})
    bad = [k for k in keep if not 0 <= k < V]
    if bad:
        raise ValueError(f"keep ids {bad} are outside the vocabulary 0..{V - 1}")
    if len(keep) > size:
        raise ValueError(f"{len(keep)} keep ids do not fit a draft vocabulary of {size}")
    # rank by (count desc, id asc): a stable sort of the ids by descending count
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = torch.zeros(V, dtype=torch.bool)
    if keep:
        chosen[torch.tensor(keep)] = True
    rest = order[~chosen[order]][: int(size) - len(keep)]
    chosen[rest] = True
    ids = chosen.nonzero()[:, 0]
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 1.0
    return ids, coverage


def check_draft_vocab(ids, vocab_size: int | None, where: str = "draft vocabulary") -> torch.Tensor:
    """``ids`` as the engine takes them: int64 [N] ascending, N in MIN_SIZE..vocab_size, every id in
    0..vocab_size-1, no repeats (``vocab_size`` None: no upper bound). ``where`` names the source in errors
    (a file path).

    Raises ValueError naming ``where`` and the first offending value."""
    t = torch.as_tensor(ids)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{where}: token_ids must be a 1-D integer tensor (got {tuple(t.shape)} {t.dtype})")
    t = t.to(torch.int64).cpu()
    out = t[(t < 0) | (t >= vocab_size)] if vocab_size is not None else t[t < 0]
    if out.numel():
        bound = "0.." if vocab_size is None else f"the target's vocabulary 0..{vocab_size - 1}"
        raise ValueError(f"{where}: token id {int(out[0])} is outside {bound}")
    s = torch.sort(t).values
    dup = s[1:][s[1:] == s[:-1]]
    if dup.numel():
        raise ValueError(f"{where}: token id {int(dup[0])} appears more than once")
    if t.numel() < MIN_SIZE or (vocab_size is not None and t.numel() > vocab_size):
        most = "" if vocab_size is None else f"..{vocab_size}"
        raise ValueError(f"{where}: {t.numel()} token ids; need {MIN_SIZE}{most}"
                         + ("" if vocab_size is None else " (the target's vocabulary)"))
    return s


def head_rows(ids, head: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(ids int64 [N] on head's device, ``head[ids]`` [N, H] contiguous) for a decoder's draft vocabulary, checked by
    :func:`check_draft_vocab` against head's V rows; (None, None) for ``ids`` None or all V ids (nothing to select).

    Raises ValueError as :func:`check_draft_vocab`."""
    if ids is None:
        return None, None
    ids = check_draft_vocab(ids, head.shape[0])
    if ids.numel() == head.shape[0]:
        return None, None
    ids = ids.to(head.device)
    return ids, head.index_select(0, ids).contiguous()


def spread_logits(sub: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits ``sub [..., N]`` over the draft vocabulary ``ids`` (int64 [N], on sub's device) -> ``[..., vocab_size]``
    in sub's dtype: ``sub[..., j]`` at column ``ids[j]``, the dtype's lowest finite value everywhere else (softmax
    gives those tokens probability 0 and argmax never picks them; finite, so a non-finite check of the logits still
    means a broken draft). One fill and one index_copy: graph-capturable, no host sync."""
    full = sub.new_full((*sub.shape[:-1], vocab_size), torch.finfo(sub.dtype).min)
    return full.index_copy_(-1, ids, sub)


def save_draft_vocab(path: str | Path, ids: torch.Tensor, metadata: dict) -> None:
    """Write ``ids`` (checked by :func:`check_draft_vocab`; stored ascending) and ``metadata`` (values stored as
    strings; ``format`` is always :data:`FORMAT`) to a new safetensors file, through a temporary file in the same
    folder and a rename that never replaces an existing file.

    Raises FileExistsError if ``path`` exists (a finished vocabulary is never overwritten), ValueError for ids
    :func:`check_draft_vocab` refuses (``metadata["vocab_size"]`` bounds them when given)."""
    import os
    import tempfile

    from safetensors.torch import save_file

    from dspine.io import default_file_mode

    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists; the draft vocabulary is not overwritten (remove it or pick another path)")
    V = metadata.get("vocab_size")
    ids = check_draft_vocab(ids, int(V) if V is not None else None, where=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({"token_ids": ids.contiguous()}, tmp,
                  metadata={**{str(k): str(v) for k, v in metadata.items()}, "format": FORMAT})
        default_file_mode(tmp)  # safetensors and mkstemp write 0600
        try:
            os.link(tmp, path)  # fails if path appeared meanwhile: a finished file is never replaced
        except OSError as e:  # that, or a filesystem without hard links: then a rename after a last check
            if isinstance(e, FileExistsError) or path.exists():
                raise FileExistsError(f"{path} appeared while it was written; not overwritten") from None
            os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def load_draft_vocab(path: str | Path, vocab_size: int | None = None) -> tuple[torch.Tensor, dict]:
    """(ids int64 [N] ascending, metadata) of a draft vocabulary file (module docstring).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: a folder; not a safetensors draft vocabulary (``format`` metadata missing or other, no
            ``token_ids``); metadata ``vocab_size`` other than ``vocab_size`` (the target's: a vocabulary counted
            with another tokenizer); ids that :func:`check_draft_vocab` refuses (``vocab_size`` None skips the
            range check's upper bound).
    """
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give the draft vocabulary's .safetensors file")
    if not path.is_file():
        raise FileNotFoundError(f"draft vocabulary not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            names = list(f.keys())
            ids = f.get_tensor("token_ids") if "token_ids" in names else None
    except Exception as e:  # safetensors raises its own error types for a file that is not one
        raise ValueError(f"{path}: not a safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: metadata format={meta.get('format')!r}, expected {FORMAT!r} "
                         "(write it with python -m data.draft_vocab)")
    if ids is None:
        raise ValueError(f"{path}: no tensor 'token_ids' (has {names})")
    counted_for = meta.get("vocab_size")
    if counted_for is not None:
        try:
            counted_for = str(int(counted_for))
        except ValueError:
            raise ValueError(f"{path}: metadata vocab_size={counted_for!r} is not an integer") from None
    if vocab_size is not None and counted_for is not None and counted_for != str(vocab_size):
        # another vocabulary size is another tokenizer: its ids would name other tokens here
        raise ValueError(f"{path}: counted for a vocabulary of {counted_for} ids (metadata vocab_size), the target "
                         f"has {vocab_size}; make one from rows tokenized for this target (python -m data.draft_vocab)")
    return check_draft_vocab(ids, vocab_size, where=str(path)), meta


def tokens_digest(tokenizer, ids) -> str:
    """Hex digest (blake2b, 16 bytes) of the token strings ``tokenizer.convert_ids_to_tokens`` gives for ``ids``
    (int [N]), in order, each followed by a NUL byte (an id the tokenizer has no token for counts as the empty
    string). Two tokenizers give the same digest for a vocabulary exactly when its ids name the same tokens in
    both, whatever files or formats (a GGUF, a Hugging Face folder) they were read from."""
    import hashlib

    ids = [int(i) for i in torch.as_tensor(ids).flatten().tolist()]
    try:  # ids past the tokenizer's length (a config vocab_size padded beyond it) are empty strings, not errors
        n = len(tokenizer)
    except TypeError:
        n = None
    known = [i for i in ids if n is None or 0 <= i < n]
    names = dict(zip(known, tokenizer.convert_ids_to_tokens(known)))
    h = hashlib.blake2b(digest_size=16)
    for i in ids:
        h.update((names.get(i) or "").encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def check_tokens(path: str | Path, ids: torch.Tensor, metadata: dict, tokenizer) -> None:
    """Refuse a draft vocabulary whose ids name other tokens in ``tokenizer`` (the target's) than in the tokenizer
    it was counted with: its metadata ``tokens_digest`` against :func:`tokens_digest` of ``ids`` here. A file
    without ``tokens_digest`` (counted without the tokenizer at hand) or no ``tokenizer`` passes unchecked.

    Raises ValueError naming ``path`` and the tokenizer the file was counted with."""
    want = metadata.get("tokens_digest")
    if tokenizer is None or not want:
        return
    got = tokens_digest(tokenizer, ids)
    if got != want:
        raise ValueError(f"{path}: its token ids name other tokens in the target's tokenizer than in the one it was "
                         f"counted with ({metadata.get('tokenizer', 'unrecorded')}; tokens_digest {want}, the "
                         f"target's {got}): make one from rows tokenized for this target (python -m data.draft_vocab)")


def unchecked_note(path: str | Path, metadata: dict) -> str | None:
    """Why a loaded draft vocabulary could not be checked against the target (None when it can): a file with
    neither ``vocab_size`` nor ``tokens_digest`` fits any target whose vocabulary holds its ids, and if it was
    counted with another tokenizer its ids name other tokens (lossless still, but τ falls)."""
    if metadata.get("vocab_size") is None and not metadata.get("tokens_digest"):
        return (f"{path} records neither vocab_size nor tokens_digest, so it is not checked against this target's "
                "tokenizer (python -m data.draft_vocab --vocab-size V --tokenizer PATH records both)")
    return None


def describe(path: str | Path, ids: torch.Tensor, metadata: dict) -> dict:
    """``{"path", "size", "coverage"}`` of a loaded draft vocabulary for a run's JSON (coverage: the file's
    ``coverage`` as a float, None if it has none or it is not a number)."""
    try:
        coverage = float(metadata["coverage"])
    except (KeyError, TypeError, ValueError):
        coverage = None
    return {"path": str(path), "size": int(ids.numel()), "coverage": coverage}
