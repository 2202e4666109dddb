"""Prompt encoding shared by ``infer.generate``, ``infer.bench`` and the data tools (here, at the ground
of the import layering, so that ``data`` and ``infer`` both read it).

Rule for control tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``, ...): only the chat
template (and the target itself) writes them. Text that a person wrote — system and user messages,
and a prompt encoded without a template — is plain text: a control-token string typed in it is
encoded as the ordinary tokens of those characters, so a prompt cannot close its own turn or forge
another role. Assistant turns keep what the target produced. Texts without such strings encode
exactly as ``tokenizer(text, add_special_tokens=False)``.
"""

from __future__ import annotations

PLAIN_ROLES = ("system", "user")


def control_strings(tokenizer) -> list[str]:
    """The strings this tokenizer turns into special tokens (its special tokens and the added tokens
    marked special), longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted((s for s in found if s), key=len, reverse=True)


def plain_spans(tokenizer, text: str, turns: list[dict]) -> list[tuple[int, int]]:
    """Character spans of ``text`` (a rendering of ``turns``) that are plain text: the system/user
    contents that hold a control-token string (the others encode the same either way).

    Raises:
        ValueError: such a content does not appear verbatim in ``text`` (a template that rewrites user text).
    """
    controls = control_strings(tokenizer)
    spans, cursor = [], 0
    for i, turn in enumerate(turns):
        content = turn.get("content")
        if not isinstance(content, str) or not content:
            continue
        start = text.find(content, cursor)
        if turn.get("role") not in PLAIN_ROLES or not any(c in content for c in controls):
            cursor = start + len(content) if start >= 0 else cursor
            continue
        if start < 0:
            raise ValueError(f"turn {i} ({turn['role']}) holds a control-token string but the chat template does not "
                             "render its text verbatim, so it cannot be kept as plain text")
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def encode_text(tokenizer, text: str, plain: list[tuple[int, int]] = (), offsets: bool = False):
    """Token ids of ``text`` without added BOS/EOS; inside the ``plain`` character spans a
    control-token string is ordinary text.

    Returns the ids, or (ids, offset pairs) with ``offsets``. Without plain spans this is exactly
    ``tokenizer(text, add_special_tokens=False)``. With them, the text is cut at the control tokens
    that lie outside the spans (the template's own) and the pieces between are encoded with
    ``split_special_tokens=True`` — the same cut a tokenizer makes at every special token, so text
    around the spans tokenizes as it would without them.
    """
    def enc(piece: str, split: bool):
        kw = {"return_offsets_mapping": True} if offsets else {}
        e = tokenizer(piece, add_special_tokens=False, split_special_tokens=split, **kw)
        return e["input_ids"], e.get("offset_mapping") if offsets else None

    if not plain:
        ids, offs = enc(text, False)
        return (ids, offs) if offsets else ids
    controls = control_strings(tokenizer)
    inside = lambda a, b: any(s < b and a < e for s, e in plain)
    cuts, pos = [], 0  # template control tokens: (start, end, string)
    while pos < len(text):
        hit = min(((text.find(c, pos), c) for c in controls if text.find(c, pos) >= 0), default=None,
                  key=lambda x: (x[0], -len(x[1])))
        if hit is None:
            break
        at, c = hit
        if not inside(at, at + len(c)):
            cuts.append((at, at + len(c), c))
        pos = at + len(c)
    ids, offs, prev = [], [], 0
    for start, end, c in [*cuts, (len(text), len(text), None)]:
        if start > prev:
            piece_ids, piece_offs = enc(text[prev:start], True)
            ids += piece_ids
            if offsets:
                offs += [(a + prev, b + prev) for a, b in piece_offs]
        if c is not None:
            ids.append(tokenizer.convert_tokens_to_ids(c))
            offs.append((start, end))
        prev = end
    return (ids, offs) if offsets else ids


def encode_prompt(tokenizer, text: str, *, chat: bool = True, system: str | None = None,
                  enable_thinking: bool = False, history: list[dict] | None = None) -> list[int]:
    """Token ids for one user turn.

    With a chat template (and ``chat``): ``[system?] + history + user`` rendered with the
    assistant header appended (``enable_thinking`` is passed to Qwen3's template). Without one:
    BOS (if the tokenizer has one) + the plain text. System and user text is plain text (module doc).
    """
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
        messages.append({"role": "user", "content": text})
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=enable_thinking)
        return list(encode_text(tokenizer, rendered, plain_spans(tokenizer, rendered, messages)))
    ids = encode_text(tokenizer, text, [(0, len(text))]) if text else []
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids
