"""Conversations to token ids and a per-token "labelled" mask: the chat template the run renders with, and what the
model learns to produce (data.loss_on).

The template is ``data.chat_template`` (a jinja file) or the tokenizer's own: ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of named templates of which "default" is the one transformers uses) or a
``chat_template.jinja`` beside it. It sees the tokenizer's named special tokens (``bos_token``, ``eos_token``...) as
transformers passes them. The rendered text is tokenised with character offsets and no special tokens added (the
template writes them), and a token is labelled when it begins inside an assistant turn (moe_train.chat_template):
transformers' ``return_assistant_tokens_mask``. A prompt/completion pair is the text prompt + completion, whose
completion tokens and an appended end-of-text token are labelled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_models.hf.files import resolve_inside
from moe_train.chat_template import ChatTemplateError, compile_template, render
from moe_train.config import ConfigError, DataConfig
from moe_train.conversations import NO_LABELS, REFUSED, BadRecord
from moe_train.tokenization import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"  # where transformers 4.50+ saves a tokenizer's template
# the special tokens transformers puts in a template's context (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def resolved_loss_on(data: DataConfig) -> str:
    """data.loss_on with "" made explicit: what the format's labels are for."""
    return data.loss_on or {"chat": "assistant", "prompt_completion": "completion"}.get(data.format, "all")


def _json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def chat_template(data: DataConfig, tokenizer: Tokenizer) -> str:
    """The template's text, checked to compile; a one-line error naming data.chat_template when there is none."""
    if data.chat_template:
        path = Path(data.chat_template).expanduser()
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(
                f"data.chat_template={data.chat_template!r}: cannot read it ({type(err).__name__}: {err}); name a "
                "jinja template file"
            ) from None
    else:
        source = _tokenizer_template(data, tokenizer)
    try:
        compile_template(source)
    except ChatTemplateError as err:
        raise ConfigError(
            f"{template_origin(data, tokenizer)}: {err.reason}; fix it or name another with data.chat_template"
        ) from None
    return source


def _of(tokenizer: Tokenizer) -> str:
    return f"data.tokenizer={tokenizer.name!r}"


def template_origin(data: DataConfig, tokenizer: Tokenizer) -> str:
    """Where the template comes from, as errors name it."""
    return f"data.chat_template={data.chat_template!r}" if data.chat_template else f"the template of {_of(tokenizer)}"


def _tokenizer_template(data: DataConfig, tokenizer: Tokenizer) -> str:
    directory = tokenizer.directory
    if directory is not None:
        found = _json(directory / "tokenizer_config.json").get("chat_template")
        if isinstance(found, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
            if not isinstance(named.get("default"), str):
                raise ConfigError(
                    f"data.chat_template='': the tokenizer's templates are {', '.join(map(str, named))}, none of them "
                    "'default'; save the one to use as a file and name it with data.chat_template"
                )
            return named["default"]
        if isinstance(found, str) and found:
            return found
        if (directory / TEMPLATE_FILE).is_file() and resolve_inside(directory, TEMPLATE_FILE) is not None:
            return (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    raise ConfigError(
        f"data.chat_template='': {_of(tokenizer)} has no chat template (no chat_template in its "
        f"tokenizer_config.json, no {TEMPLATE_FILE}); name a jinja template file with data.chat_template"
    )


def template_context(tokenizer: Tokenizer) -> dict[str, str]:
    """The named special tokens transformers gives a template: tokenizer_config.json's, else special_tokens_map.json's
    (a string or an AddedToken's content; unset ones are left out, so the template sees them undefined)."""
    context: dict[str, str] = {}
    if tokenizer.directory is None:
        return context
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = _json(tokenizer.directory / name)
        for key in SPECIAL_TOKENS:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if key not in context and isinstance(value, str):
                context[key] = value
    return context


@dataclass(frozen=True)
class Encoder:
    """Renders and tokenises records' conversations (chat: lists of messages; prompt_completion: (prompt,
    completion) pairs) into ids and labelled masks."""

    tokenizer: Tokenizer
    format: str  # data.format: chat | prompt_completion
    loss_on: str  # resolved: assistant | completion | all
    template: str = ""  # chat
    context: Mapping[str, str] | None = None  # chat: the template's special tokens
    origin: str = "data.chat_template"  # where the template came from, for errors

    def key(self) -> dict[str, Any]:
        """What decides the ids and masks besides the records, for the cache key."""
        return {
            "format": self.format,
            "loss_on": self.loss_on,
            "template": hashlib.sha256(self.template.encode()).hexdigest(),
            "context": dict(self.context or {}),
            "tokenizer": self.tokenizer.digest,
            "eos_id": self.tokenizer.eos_id,
            "dtype": self.tokenizer.dtype.name,
        }

    def encode(self, items: Sequence[Any]) -> list[tuple[np.ndarray, np.ndarray] | BadRecord]:
        """Each item's (ids, labelled) or why it is a bad record."""
        texts: list[str] = []
        spans: list[tuple[tuple[int, int], ...] | BadRecord] = []
        for item in items:
            try:
                text, span = self._render(item)
            except BadRecord as bad:
                spans.append(bad)
                continue
            texts.append(text)
            spans.append(span)
        assert self.tokenizer.encode_offsets is not None
        encoded = iter(self.tokenizer.encode_offsets(texts) if texts else [])
        return [span if isinstance(span, BadRecord) else self._labelled(*next(encoded), span) for span in spans]

    def _render(self, item: Any) -> tuple[str, tuple[tuple[int, int], ...]]:
        if self.format == "prompt_completion":
            prompt, completion = item
            return prompt + completion, ((len(prompt), len(prompt) + len(completion)),)
        try:
            rendered = render(self.template, item, **(self.context or {}))
        except ChatTemplateError as err:
            if err.field == "chat_template":  # the template, not the record: no record renders
                raise ConfigError(f"{self.origin}: {err.reason}") from None
            if err.field == "messages":
                raise BadRecord(REFUSED, f"the chat template refused the conversation: {err.reason}") from None
            raise BadRecord(REFUSED, f"{err.field} {err.reason}") from None
        except (TypeError, KeyError, AttributeError, ArithmeticError) as err:  # the template tripped on the record
            raise BadRecord(REFUSED, f"the chat template failed on it ({type(err).__name__}: {err})") from None
        return rendered.text, rendered.assistant_spans

    def _labelled(
        self, ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: tuple[tuple[int, int], ...]
    ) -> tuple[np.ndarray, np.ndarray] | BadRecord:
        ids_array = np.asarray(ids, dtype=np.int64)
        if self.loss_on == "all":
            labelled = np.ones(len(ids_array), dtype=np.uint8)
        else:
            starts = np.asarray([begin for begin, _ in offsets], dtype=np.int64)
            labelled = np.zeros(len(ids_array), dtype=np.uint8)
            for start, end in spans:
                labelled |= (starts >= start) & (starts < end)
        if self.format == "prompt_completion":  # the answer ends: the model learns to stop
            eos = self.tokenizer.eos_id
            assert eos is not None
            ids_array = np.append(ids_array, eos)
            labelled = np.append(labelled, np.uint8(1))
        if not labelled[1:].any():  # the first token is never a label: nothing predicts it
            what = "assistant turn" if self.format == "chat" else "completion"
            return BadRecord(
                NO_LABELS,
                f"no token of its {what} is labelled after rendering and tokenising (data.loss_on={self.loss_on}); "
                "drop the record or set --data.loss_on all",
            )
        return ids_array, labelled
