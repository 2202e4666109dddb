"""Prompt encoding shared by ``infer.generate``, ``infer.bench`` and the data tools."""

from __future__ import annotations


def encode_prompt(tokenizer, text: str, *, chat: bool = True, system: str | None = None,
                  enable_thinking: bool = False, history: list[dict] | None = None) -> list[int]:
    """Token ids for one user turn.

    With a chat template (and ``chat``): ``[system?] + history + user`` rendered with the
    assistant header appended (``enable_thinking`` is passed to Qwen3's template). Without one:
    BOS (if the tokenizer has one) + the plain text.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + list(history or [])
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            enable_thinking=enable_thinking)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return list(ids)
    ids = tokenizer.encode(text, add_special_tokens=False) if text else []
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + ids
