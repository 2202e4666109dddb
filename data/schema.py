"""The normalized conversation row that every data step reads and writes.

A row is one JSON object::

    {"id": "perfectblend_standin:000123",
     "conversations": [{"role": "system" | "user" | "assistant", "content": str}, ...],
     "source": "perfectblend_standin"}

Later steps add fields (`finish_reason`, `num_generated_tokens`, ...) and keep the ones they do not
know. A bad row never stops a run: it raises `RowError`, and the caller logs it as skipped or as an
error with `code` (a short category counted in summaries) and the message (the detail).
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")


class RowError(ValueError):
    """A row that cannot be used.

    Args:
        code: short category for summaries, e.g. "bad_json", "unknown_role", "prompt_too_long".
        message: what is wrong, naming the file, row, field or value.
        raw: the offending input (parsed object or line text), kept for skipped.jsonl.
    """

    def __init__(self, code: str, message: str, raw=None):
        super().__init__(message)
        self.code = code
        self.raw = raw


def check_turns(turns) -> list[dict]:
    """Checks the turn list of a row: a non-empty list of {"role", "content"} with known roles.

    Returns:
        the turns as plain `{"role", "content"}` dicts (extra keys dropped).
    Raises:
        RowError: "empty_conversation", "bad_field" (not a list / not a dict / content not a
            string), "unknown_role", "empty_content" (system or user turn; an assistant turn may be
            empty, e.g. a target answer that stopped at once).
    """
    if not isinstance(turns, list):
        raise RowError("bad_field", f"'conversations' must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise RowError("empty_conversation", "the conversation has no turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("bad_field", f"turn {i} is a {type(turn).__name__}, not an object")
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise RowError("unknown_role", f"turn {i} has unknown role {role!r} (expected one of {ROLES})")
        if not isinstance(content, str):
            raise RowError("bad_field", f"turn {i} ({role}): 'content' must be a string, not {type(content).__name__}")
        # An empty answer can be the target's own (it stopped at once); empty prompts are never useful.
        if role != "assistant" and not content.strip():
            raise RowError("empty_content", f"turn {i} ({role}) has empty content")
        out.append({"role": role, "content": content})
    return out


def check_conversation(turns) -> list[dict]:
    """Checks a conversation for training use (stricter than `check_turns`).

    Rules: no empty turn, an optional system turn first, then user and assistant turns alternating, starting with
    a user turn. The last turn may be a user turn (a prompt still to be answered).

    Raises:
        RowError: the `check_turns` codes, plus "no_user_turn", "misplaced_system", "bad_turn_order".
    """
    turns = check_turns(turns)
    for i, turn in enumerate(turns):
        if not turn["content"].strip():
            raise RowError("empty_content", f"turn {i} ({turn['role']}) has empty content")
    if not any(t["role"] == "user" for t in turns):
        raise RowError("no_user_turn", "the conversation has no user turn")
    offset = 1 if turns[0]["role"] == "system" else 0
    for i, turn in enumerate(turns[offset:]):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn["role"] == "system":
            raise RowError("misplaced_system", f"a system turn is only allowed first (found at turn {i + offset})")
        if turn["role"] != expected:
            raise RowError(
                "bad_turn_order",
                f"turn {i + offset} is {turn['role']!r}, expected {expected!r} (user and assistant must alternate)",
            )
    return turns


def check_row(row) -> tuple[str, list[dict]]:
    """Checks a normalized row and returns `(id, turns)`.

    Raises:
        RowError: "bad_field" / "missing_field" for a missing or non-string id or missing
            conversations, plus the `check_turns` codes.
    """
    if not isinstance(row, dict):
        raise RowError("bad_field", f"row is a {type(row).__name__}, not an object", raw=row)
    row_id = row.get("id")
    if not isinstance(row_id, str) or not row_id:
        raise RowError("missing_field", "row has no string 'id'", raw=row)
    if "conversations" not in row:
        raise RowError("missing_field", f"row {row_id}: missing field 'conversations'", raw=row)
    try:
        return row_id, check_turns(row["conversations"])
    except RowError as e:
        raise RowError(e.code, f"row {row_id}: {e}", raw=row) from None
