"""data.format chat / prompt_completion, from the config to the streams the trainer reads: the record format, the
template, the cache entry, the validation split, the conversations longer than a window (data.truncation)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from moe_train.config import ConfigError, DataConfig
from moe_train.conversation_cache import RecordFormat, Split, conversation_entry
from moe_train.conversation_stream import ConversationStream
from moe_train.conversation_tokens import Encoder, chat_template, resolved_loss_on, template_context, template_origin
from moe_train.conversations import TOO_LONG, chat_messages, messages_fields, prompt_completion
from moe_train.packing import valid_documents
from moe_train.sources import Source, resolve_source
from moe_train.tokenization import Tokenizer


@dataclass(frozen=True)
class Conversations:
    train: ConversationStream
    valid: ConversationStream | None
    fingerprint: str
    skipped: dict[str, int]  # reason -> records or conversations left out


def _missing(data: DataConfig, source: Source, where: str, fields: list[str]) -> ConfigError:
    have = ", ".join(fields) or "none"
    if data.format == "chat":
        wanted = " or ".join(repr(f) for f in messages_fields(data.messages_field))
        return ConfigError(
            f"data.messages_field={data.messages_field!r}: {where} has no field {wanted} (fields: {have}); set "
            f"data.messages_field to the field holding the turns ({source.describe()})"
        )
    return ConfigError(
        f"data.prompt_field={data.prompt_field!r} / data.completion_field={data.completion_field!r}: {where} lacks "
        f"one of them (fields: {have}); set both to the fields holding the prompt and the answer ({source.describe()})"
    )


def record_format(data: DataConfig, loss_on: str) -> RecordFormat:
    missing = partial(_missing, data)
    if data.format == "chat":
        fields = messages_fields(data.messages_field)
        parse = partial(
            chat_messages,
            messages_field=data.messages_field,
            need_assistant=loss_on == "assistant",
            decode_errors=data.decode_errors,
        )
        return RecordFormat(parse, {"messages_fields": list(fields)}, fields, False, missing)
    fields = (data.prompt_field, data.completion_field)
    parse = partial(
        prompt_completion,
        prompt_field=data.prompt_field,
        completion_field=data.completion_field,
        decode_errors=data.decode_errors,
    )
    return RecordFormat(parse, {"fields": list(fields)}, fields, True, missing)


def encoder(data: DataConfig, tokenizer: Tokenizer) -> Encoder:
    """The tokenizer, checked to be one that chat data can use, with the format's template and labels."""
    if not tokenizer.name:
        raise ConfigError(
            f"data.tokenizer={data.tokenizer!r}: data.format={data.format} needs a tokenizer (byte-level ids have no "
            "chat template or special tokens); name a tokenizer.json or its directory with data.tokenizer"
        )
    if tokenizer.encode_offsets is None:
        raise ConfigError(
            f"data.tokenizer={tokenizer.name!r}: a slow (Python) transformers tokenizer gives no character offsets, "
            f"which data.format={data.format} needs to find the labelled tokens; give a directory with a tokenizer.json"
        )
    loss_on = resolved_loss_on(data)
    if data.format == "prompt_completion":
        return Encoder(tokenizer, data.format, loss_on)
    template = chat_template(data, tokenizer)
    return Encoder(
        tokenizer, data.format, loss_on, template, template_context(tokenizer), template_origin(data, tokenizer)
    )


def _fitting(split: Split, seq_len: int, truncation: str, skipped: dict[str, int]) -> Split:
    """The conversations of at most ``seq_len`` tokens; a longer one is an error (data.truncation=error) or
    counted."""
    long = np.flatnonzero(split.lengths > seq_len)
    if not len(long):
        return split
    if truncation == "error":
        first = int(long[0])
        raise ConfigError(
            f"{split.where(first)}: the conversation is {int(split.lengths[first])} tokens, longer than "
            f"data.seq_len={seq_len}; raise data.seq_len, shorten the record, or set --data.truncation skip to count "
            f"and skip such conversations ({len(long)} of {len(split)})"
        )
    skipped[TOO_LONG] = skipped.get(TOO_LONG, 0) + len(long)
    return split.take(split.lengths <= seq_len)


def prepare_conversations(
    data: DataConfig, tokenizer: Tokenizer, cache_dir: Path, seed: int, log: Callable[[str], None] | None
) -> Conversations:
    """The streams of data.format chat / prompt_completion. Every mistake is a one-line ConfigError."""
    enc = encoder(data, tokenizer)
    train_source = resolve_source(data.source, data.text_field, "data.source", data.decode_errors)
    valid_source = (
        resolve_source(data.valid_source, data.text_field, "data.valid_source", data.decode_errors)
        if data.valid_source
        else None
    )
    entry = conversation_entry(
        cache_dir, train_source, valid_source, enc, record_format(data, enc.loss_on), data.bad_records, log
    )
    train, valid = entry.train, entry.valid
    held_out = 0
    if valid is None and data.valid_fraction:
        held_out = valid_documents(len(train), data.valid_fraction)
        if held_out >= len(train):
            raise ConfigError(
                f"data.valid_fraction={data.valid_fraction}: holding out {held_out} of the {len(train)} conversations "
                "leaves none to train on; lower it or add conversations"
            )
        train, valid = train.take(slice(0, len(train) - held_out)), train.take(slice(len(train) - held_out, None))
    skipped = entry.skipped
    train = _fitting(train, data.seq_len, data.truncation, skipped)
    valid = _fitting(valid, data.seq_len, data.truncation, skipped) if valid is not None else None
    for split, what in ((train, "data.source"), (valid, "validation data")):
        if split is not None and not len(split):
            raise ConfigError(
                f"data.seq_len={data.seq_len}: every conversation of the {what} is longer (data.truncation=skip "
                "skipped them all); raise data.seq_len"
            )
    assert tokenizer.eos_id is not None
    stream = partial(ConversationStream, seq_len=data.seq_len, seed=seed, packing=data.packing, pad_id=tokenizer.eos_id)
    held = (
        f"data.valid_source={data.valid_source!r}"
        if data.valid_source
        else f"data.valid_fraction={data.valid_fraction}"
    )
    fingerprint = hashlib.sha256(f"{entry.meta['fingerprint']} {held_out}".encode()).hexdigest()
    return Conversations(
        train=stream(train, what="training conversations"),
        valid=stream(valid, what=f"validation conversations ({held})") if valid is not None else None,
        fingerprint=fingerprint,
        skipped=skipped,
    )
