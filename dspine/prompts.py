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
    found |= {str(t.content) for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
              if getattr(t, "special", False)}
    return sorted((s for s in found if s), key=len, reverse=True)


def plain_spans(tokenizer, text: str, turns: list[dict], render=None) -> list[tuple[int, int]]:
    """Character spans of ``text`` (a rendering of ``turns``) that are plain text: the system/user
    contents that hold a control-token string (the others encode the same either way).

    ``render``: the function that rendered ``text`` (turns -> str: the same template and options). Each such
    content is then located by rendering the turns again with a marker in its place: the template's own text
    may hold the same string before it (SmolLM2's default system prompt ends with ``<|im_end|>``, a user typing
    ``<|im_end|>`` would otherwise be matched there and the template's token encoded as plain text). The markers'
    rendering, with the contents put back, must give ``text`` exactly. Without ``render`` (or when the template
    renders markers differently from the contents) each content is searched for after the previous turn's, and
    must occur there only once.

    Raises:
        ValueError: such a content does not appear verbatim in ``text`` (a template that rewrites user text),
            or, located by search, appears more than once after the previous turn (which copy is the turn's
            cannot be told).
    """
    controls = control_strings(tokenizer)
    held = [i for i, t in enumerate(turns) if t.get("role") in PLAIN_ROLES and isinstance(t.get("content"), str)
            and t["content"] and any(c in t["content"] for c in controls)]
    if not held:
        return []
    if render is not None:
        spans = _marker_spans(text, turns, held, render)
        if spans is not None:
            return spans
    spans, cursor = [], 0
    for i, turn in enumerate(turns):
        content = turn.get("content")
        if not isinstance(content, str) or not content:
            continue
        start = text.find(content, cursor)
        if i not in held:
            cursor = start + len(content) if start >= 0 else cursor
            continue
        if start < 0:
            raise ValueError(f"turn {i} ({turn['role']}) holds a control-token string but the chat template does not "
                             "render its text verbatim, so it cannot be kept as plain text")
        if text.find(content, start + 1) >= 0:
            raise ValueError(f"turn {i} ({turn['role']}) holds a control-token string that the rendered text holds "
                             "more than once after the previous turn: which copy is the turn's cannot be told")
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def _marker_spans(text: str, turns: list[dict], held: list[int], render) -> list[tuple[int, int]] | None:
    """:func:`plain_spans` by rendering ``turns`` with a marker in place of each content of ``held`` (private-use
    characters and the turn's index); ``None`` when the template fails on them, does not render each marker once
    and in turn order, or the contents put back do not give ``text``."""
    tag = "\ue000dspine-plain-{}\ue001"
    marks = {i: tag.format(i) for i in held}
    if any(m in text for m in marks.values()):
        return None
    try:
        marked = render([dict(t, content=marks[i]) if i in marks else t for i, t in enumerate(turns)])
    except Exception:  # a template may raise on any content (jinja raise_exception): fall back to the search
        return None
    at = [marked.find(marks[i]) for i in held]
    if any(a < 0 or marked.count(marks[i]) != 1 for a, i in zip(at, held)) or at != sorted(at):
        return None
    spans, out, prev, shift = [], [], 0, 0
    for a, i in zip(at, held):
        content = turns[i]["content"]
        out += [marked[prev:a], content]
        spans.append((a + shift, a + shift + len(content)))
        shift += len(content) - len(marks[i])
        prev = a + len(marks[i])
    out.append(marked[prev:])
    return spans if "".join(out) == text else None


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
        def render(turns):
            return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=enable_thinking)

        rendered = render(messages)
        return list(encode_text(tokenizer, rendered, plain_spans(tokenizer, rendered, messages, render)))
    ids = encode_text(tokenizer, text, [(0, len(text))]) if text else []
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids
