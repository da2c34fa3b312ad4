"""The records of a chat or prompt/completion data set (``data.format``), checked and put in one shape.

A chat record holds its turns in ``data.messages_field`` ("" = ``messages``, else ``conversations``): OpenAI-style
``{"role", "content"}`` messages (roles system, user, assistant, tool) or ShareGPT ``{"from", "value"}`` turns, whose
speakers map to those roles. Keys of an OpenAI message besides role and content (``tool_calls``, ``name``...) go to
the chat template as they are; null ones are dropped, as Parquet and ``datasets`` fill every struct field. A
prompt/completion record holds two strings, ``data.prompt_field`` and ``data.completion_field``.

A record that is not one of these is a :class:`BadRecord`: a reason (the key its skips are counted under, worded to
follow a count: "3 with an unknown role") and a message naming the field and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speakers (and the variants LLaMA-Factory and FastChat write) as roles
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "observation": "tool",
}
DEFAULT_MESSAGES_FIELDS = ("messages", "conversations")

# skip reasons (data.bad_records / data.truncation skip), the keys of PreparedData.skipped
NOT_OBJECT = "not a JSON object"
MISSING = "missing a field"
WRONG_TYPE = "with a field of the wrong type"
EMPTY = "with an empty conversation"
UNKNOWN_ROLE = "with an unknown role"
NO_ASSISTANT = "without an assistant turn"
NO_LABELS = "without a labelled token"
NOT_TEXT = "with an unpaired surrogate"
REFUSED = "refused by the chat template"
TOO_LONG = "longer than data.seq_len"

_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


class BadRecord(Exception):
    """A record that cannot be used: ``reason`` counts it under data.bad_records=skip, ``message`` says what is wrong
    with which field and how to fix it (without the record's location, which the reader adds)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def messages_fields(messages_field: str) -> tuple[str, ...]:
    """The fields a chat record's turns may be in: the configured one, else the defaults in order."""
    return (messages_field,) if messages_field else DEFAULT_MESSAGES_FIELDS


def _text(value: str, field: str, decode_errors: str) -> str:
    """JSON's surrogate escapes (``\\udc80``) decode to lone surrogates, which no tokenizer takes: U+FFFD each with
    data.decode_errors=replace, as the text path does, else a bad record."""
    found = _LONE_SURROGATE.search(value)
    if found is None:
        return value
    if decode_errors == "replace":
        return _LONE_SURROGATE.sub("\ufffd", value)
    raise BadRecord(
        NOT_TEXT,
        f"{field} holds an unpaired surrogate escape (U+{ord(found.group()):04X}, character {found.start()}), which "
        "is not text; fix the record, or set --data.decode_errors replace to replace it with U+FFFD",
    )


def _string(record: Mapping[str, Any], key: str, field: str, fix: str, decode_errors: str) -> str:
    if key not in record or record[key] is None:
        raise BadRecord(MISSING, f"{field} is missing; {fix}")
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord(WRONG_TYPE, f"{field} holds {type(value).__name__}, not a string; {fix}")
    return _text(value, field, decode_errors)


def prompt_completion(
    record: Mapping[str, Any], prompt_field: str, completion_field: str, decode_errors: str = "strict"
) -> tuple[str, str]:
    fix = "give every record one, or set {} to the field that holds it"
    prompt = _string(record, prompt_field, f"field {prompt_field!r}", fix.format("data.prompt_field"), decode_errors)
    completion = _string(
        record, completion_field, f"field {completion_field!r}", fix.format("data.completion_field"), decode_errors
    )
    return prompt, completion


def chat_messages(
    record: Mapping[str, Any], messages_field: str, need_assistant: bool, decode_errors: str = "strict"
) -> list[dict[str, Any]]:
    """The record's turns as ``{"role", "content", ...}`` messages. ``need_assistant``: a conversation without an
    assistant turn is bad (data.loss_on=assistant would find nothing to learn in it)."""
    fields = messages_fields(messages_field)
    name = next((f for f in fields if record.get(f) is not None), None)
    if name is None:
        wanted = " or ".join(repr(f) for f in fields)
        raise BadRecord(
            MISSING,
            f"no field {wanted} (fields: {', '.join(map(str, record)) or 'none'}); set data.messages_field to the "
            "field holding the turns",
        )
    turns = record[name]
    if not isinstance(turns, list):
        raise BadRecord(WRONG_TYPE, f"field {name!r} holds {type(turns).__name__}, not a list of turns; fix the record")
    if not turns:
        raise BadRecord(EMPTY, f"field {name!r} is an empty conversation; drop the record")
    messages = [_message(turn, f"{name}[{index}]", decode_errors) for index, turn in enumerate(turns)]
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRecord(
            NO_ASSISTANT,
            f"field {name!r} has no assistant turn, so data.loss_on=assistant labels nothing in it; drop the record "
            "or set --data.loss_on all",
        )
    return messages


def _message(turn: object, field: str, decode_errors: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise BadRecord(
            WRONG_TYPE, f"{field} holds {type(turn).__name__}, not a {{role, content}} object; fix the record"
        )
    if turn.get("role") is not None or turn.get("from") is None:
        role = turn.get("role")
        if role is None:
            raise BadRecord(MISSING, f"{field} has no 'role' (OpenAI style) or 'from' (ShareGPT style); fix the record")
        if role not in ROLES:
            raise BadRecord(UNKNOWN_ROLE, f"{field}.role={role!r} is not a role ({', '.join(ROLES)}); fix the record")
        content = _string(turn, "content", f"{field}.content", "give every turn its text", decode_errors)
        extra = {k: v for k, v in turn.items() if k not in ("role", "content") and v is not None}
        return {"role": role, "content": content, **extra}
    speaker = turn["from"]
    if not isinstance(speaker, str) or speaker not in SHAREGPT_ROLES:
        raise BadRecord(
            UNKNOWN_ROLE, f"{field}.from={speaker!r} is not a speaker ({', '.join(SHAREGPT_ROLES)}); fix the record"
        )
    content = _string(turn, "value", f"{field}.value", "give every turn its text", decode_errors)
    return {"role": SHAREGPT_ROLES[speaker], "content": content}
