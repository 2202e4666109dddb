"""Converters from the prompt-source formats to normalized turns (see `data.schema`).

| format       | row                                                                   |
|--------------|-----------------------------------------------------------------------|
| perfectblend | {"conversations": [{"from": "human"/"gpt", "value"}], "source"}       |
| sharegpt     | {"conversations": [{"from", "value"}]} (+ optional "chosen" turn)     |
| openai       | {"messages": [{"role", "content"}]}                                   |
| alpaca       | {"instruction", "input", "output"} (+ optional "system", "history")   |
| gsm8k        | {"question", "answer"}                                                |

Open-PerfectBlend is ShareGPT with a per-row `source` string naming the upstream subset; it is
kept as `origin` so the row's `source` can name the input it came from.
"""

from __future__ import annotations

from data.schema import RowError, check_conversation

FORMATS = ("perfectblend", "sharegpt", "openai", "alpaca", "gsm8k")

# ShareGPT speaker names seen in public dumps; anything else (tool, function_call, observation...)
# is an unknown role and the row is skipped rather than guessed.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def detect_format(row: dict) -> str:
    """Guesses the format of a row from its keys.

    Raises:
        RowError: "unknown_format" naming the keys found.
    """
    if "conversations" in row:
        return "perfectblend" if isinstance(row.get("source"), str) else "sharegpt"
    if "messages" in row:
        return "openai"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "question" in row and "answer" in row:
        return "gsm8k"
    raise RowError("unknown_format", f"cannot tell the format from the keys {sorted(row)}; pass --format")


def _field(row: dict, name: str, kind=str):
    if name not in row or row[name] is None:
        raise RowError("missing_field", f"missing field {name!r}")
    if not isinstance(row[name], kind):
        raise RowError("bad_field", f"field {name!r} must be a {kind.__name__}, got {type(row[name]).__name__}")
    return row[name]


def _sharegpt_turn(turn, i: int) -> dict:
    if not isinstance(turn, dict):
        raise RowError("bad_field", f"turn {i} is a {type(turn).__name__}, not an object")
    for key in ("from", "value"):
        if key not in turn:
            raise RowError("missing_field", f"turn {i}: missing field {key!r}")
    speaker = turn["from"]
    if speaker not in SHAREGPT_ROLES:
        raise RowError("unknown_role", f"turn {i} has unknown speaker 'from': {speaker!r}")
    return {"role": SHAREGPT_ROLES[speaker], "content": turn["value"]}


def _from_sharegpt(row: dict) -> list[dict]:
    turns = [_sharegpt_turn(t, i) for i, t in enumerate(_field(row, "conversations", list))]
    # Preference rows (e.g. dpo_en_demo) end on a user turn and keep the answer in "chosen".
    chosen = row.get("chosen")
    if isinstance(chosen, dict) and turns and turns[-1]["role"] == "user":
        turns.append(_sharegpt_turn(chosen, len(turns)))
    return turns


def _from_openai(row: dict) -> list[dict]:
    turns = []
    for i, msg in enumerate(_field(row, "messages", list)):
        if not isinstance(msg, dict):
            raise RowError("bad_field", f"message {i} is a {type(msg).__name__}, not an object")
        for key in ("role", "content"):
            if key not in msg:
                raise RowError("missing_field", f"message {i}: missing field {key!r}")
        if msg["role"] not in OPENAI_ROLES:
            raise RowError("unknown_role", f"message {i} has unknown role {msg['role']!r}")
        content = msg["content"]
        if isinstance(content, list):  # a list of parts: only text parts carry over
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RowError("bad_field", f"turn {i}: content has non-text parts")
            content = "".join(p.get("text", "") for p in content)
        turns.append({"role": OPENAI_ROLES[msg["role"]], "content": content})
    return turns


def _from_alpaca(row: dict) -> list[dict]:
    instruction, output = _field(row, "instruction"), _field(row, "output")
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise RowError("bad_field", f"field 'input' must be a string, got {type(extra).__name__}")
    turns = []
    system = row.get("system")
    if isinstance(system, str) and system.strip():
        turns.append({"role": "system", "content": system})
    # LLaMA-Factory's alpaca variant carries earlier turns as [[query, answer], ...].
    for i, pair in enumerate(row.get("history") or []):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise RowError("bad_field", f"history[{i}] must be a [query, answer] pair")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    return turns + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]


def _from_gsm8k(row: dict) -> list[dict]:
    return [
        {"role": "user", "content": _field(row, "question")},
        {"role": "assistant", "content": _field(row, "answer")},
    ]


CONVERTERS = {
    "perfectblend": _from_sharegpt,
    "sharegpt": _from_sharegpt,
    "openai": _from_openai,
    "alpaca": _from_alpaca,
    "gsm8k": _from_gsm8k,
}


def to_conversation(row: dict, fmt: str) -> tuple[list[dict], str | None]:
    """Converts one source row to checked turns.

    Args:
        row: the source row.
        fmt: one of `FORMATS`.
    Returns:
        (turns, origin): turns as `[{"role", "content"}]` (see `check_conversation`), origin = the
        row's own "source" string for PerfectBlend rows, else None.
    Raises:
        RowError: missing/bad fields, unknown roles, empty content, bad turn order.
    """
    if fmt not in CONVERTERS:
        raise ValueError(f"unknown format {fmt!r} (expected one of {FORMATS})")
    turns = check_conversation(CONVERTERS[fmt](row))
    origin = row.get("source") if fmt == "perfectblend" and isinstance(row.get("source"), str) else None
    return turns, origin
