"""Chat templates: choosing one, rendering conversations, and the target's end-of-turn token.

Rendering goes through the tokenizer's `apply_chat_template` (Jinja, as the serving engines do);
text is then encoded with `add_special_tokens=False`, because a chat template writes its own BOS /
control tokens into the text. System and user text is plain text: a control-token string typed in it
stays ordinary text (`dspine.prompts`, the same rule as at inference).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

# A plain ChatML template (the format, written here): every turn is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt is "<|im_start|>assistant\n".
CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# ChatML for a tokenizer without the ChatML control tokens (a base LM such as stories260K): the target
# cannot end a turn with a one-token "<|im_end|>", so its turns end with the tokenizer's eos token.
CHATML_EOS = CHATML.replace("'<|im_end|>\\n'", "eos_token + '\\n'")
BUILTIN_TEMPLATES = {"chatml": CHATML}

# End-of-turn markers of common template families, looked up in the template text; a template that
# uses none of them ends turns with the tokenizer's eos token.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")


def resolve_chat_template(spec: str | None, tokenizer) -> str:
    """Returns the Jinja chat template text to use.

    Args:
        spec: None (the tokenizer's own template), a builtin name (`chatml`; for a tokenizer without
            a one-token `<|im_end|>`, e.g. a base LM, the ChatML variant that ends turns with its eos
            token), or a path to a file holding the template (a `.json` file may hold it under
            "chat_template").
    Raises:
        ValueError: no template given and the tokenizer has none, or an unreadable template file.
    """
    if spec is None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one is used for chat
            template = template.get("default")
        if not template:
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                             f"pass --chat-template (a file, or one of {sorted(BUILTIN_TEMPLATES)})")
        return template
    if spec == "chatml" and _single_token_id(tokenizer, "<|im_end|>") is None:
        if tokenizer.eos_token is None:
            raise ValueError("--chat-template chatml: the tokenizer has neither a <|im_end|> token nor an eos token "
                             "to end a turn with")
        return CHATML_EOS
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--chat-template {spec!r}: not a file and not a builtin ({sorted(BUILTIN_TEMPLATES)})")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        import json

        try:
            text = json.loads(text)["chat_template"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: expected a JSON object with a 'chat_template' string ({e})") from None
    return text


def template_digest(template: str) -> str:
    """Short blake2b hex digest of a template's text (for run arguments and cache keys)."""
    return hashlib.blake2b(template.encode("utf-8"), digest_size=8).hexdigest()


def render(
    tokenizer, template: str, turns: list[dict], add_generation_prompt: bool, enable_thinking: bool
) -> str:
    """Renders turns with the chat template.

    `enable_thinking` is passed to every template: Qwen3's reads it (False appends the empty
    `<think>\\n\\n</think>\\n\\n` to the generation prompt); others ignore it.
    """
    return tokenizer.apply_chat_template(
        turns,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        enable_thinking=enable_thinking,
    )


def encode(tokenizer, text: str, turns: list[dict] | None = None, render_turns=None) -> list[int]:
    """Token ids of rendered text, without adding BOS/EOS (the template wrote them if it wants them).

    With ``turns`` (what ``text`` renders), their system/user text stays plain text; ``render_turns`` (turns ->
    str, the rendering that gave ``text``) locates that text exactly (``dspine.prompts.plain_spans``).
    """
    from dspine.prompts import encode_text, plain_spans

    return encode_text(tokenizer, text, plain_spans(tokenizer, text, turns, render_turns) if turns else ())


def end_of_turn_token(tokenizer, template: str) -> str:
    """The token string that ends an assistant turn under `template`.

    Raises:
        ValueError: none of the known markers is in the template and the tokenizer has no eos token.
    """
    for marker in END_OF_TURN_MARKERS:
        if marker in template and _single_token_id(tokenizer, marker) is not None:
            return marker
    if tokenizer.eos_token is None:
        raise ValueError(
            "cannot tell the end-of-turn token: the template uses no known marker and the tokenizer has no eos"
        )
    return tokenizer.eos_token


def stop_token_ids(tokenizer, template: str, generation_config=None) -> list[int]:
    """Token ids that end generation: the template's end-of-turn token, the tokenizer's eos, and the
    model's generation_config eos ids (Qwen3 lists both `<|im_end|>` and `<|endoftext|>`)."""
    eot = _single_token_id(tokenizer, end_of_turn_token(tokenizer, template))
    candidates = [eot, tokenizer.eos_token_id]
    if generation_config is not None and generation_config.eos_token_id is not None:
        eos = generation_config.eos_token_id
        candidates += eos if isinstance(eos, list) else [eos]
    return list(dict.fromkeys(int(t) for t in candidates if t is not None))  # in order, each once


def _single_token_id(tokenizer, text: str) -> int | None:
    ids = encode(tokenizer, text)
    return ids[0] if len(ids) == 1 else None
