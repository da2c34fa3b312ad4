"""A conversation rendered by the tokenizer's own chat template, with the characters and tokens of the assistant's
turns: what answer-only fine-tuning puts labels on (a first piece of issue 33; not yet wired into the data path).

Templates are jinja, as transformers renders them: a sandboxed environment (templates come with checkpoints from
anywhere), ``trim_blocks`` / ``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now`` and a ``tojson``
that keeps non-ASCII text. The assistant's part of the text comes from the template's ``{% generation %}`` blocks
where it has them; otherwise the conversation is rendered turn by turn and each assistant turn is the text its
message adds to the rendering of the turns before it (with the generation prompt, which the model is not asked to
produce): what follows the prompt up to the next turn, its end-of-turn marker included. A template for which neither
works is a :class:`ChatTemplateError`.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.sandbox

# private-use characters framing each {% generation %} block's output while rendering; removed before anything sees it
_OPEN, _CLOSE = "\ue000", "\ue001"


class ChatTemplateError(ValueError):
    """A conversation or template that cannot be rendered with its assistant turns: ``field`` names what to change."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class RenderedConversation:
    text: str
    assistant_spans: tuple[tuple[int, int], ...]  # [start, end) character ranges of the assistant's turns

    def token_mask(self, offsets: Sequence[tuple[int, int]]) -> list[bool]:
        """For tokens with these ``[start, end)`` character offsets into :attr:`text`: whether each is the
        assistant's (it begins inside an assistant span)."""
        return [any(start <= begin < end for start, end in self.assistant_spans) for begin, _ in offsets]


class _Generation(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}``: the assistant's text, framed by the two markers."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_frame"), [], [], body).set_lineno(lineno)

    def _frame(self, caller: Callable[[], str]) -> str:
        return f"{_OPEN}{caller()}{_CLOSE}"


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):  # type: ignore[no-untyped-def]
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template ``source``, compiled once per text."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError("chat_template", f"not a jinja template ({err.message}, line {err.lineno})") from None


def _render_framed(template: jinja2.Template, messages: Sequence[Mapping[str, Any]], **context: Any) -> str:
    try:
        return template.render(messages=list(messages), **context)
    except jinja2.TemplateError as err:
        raise ChatTemplateError("messages", f"the chat template refused them: {err}") from None


def _unframe(framed: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """The text without the generation markers, and the non-empty spans they framed."""
    pieces, spans, start, length = [], [], 0, 0
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", framed):
        if piece == _OPEN:
            start = length
        elif piece == _CLOSE:
            if length > start:
                spans.append((start, length))
        else:
            pieces.append(piece)
            length += len(piece)
    return "".join(pieces), tuple(spans)


def render(template_source: str, messages: Sequence[Mapping[str, Any]], **context: Any) -> RenderedConversation:
    """``messages`` (``{"role": ..., "content": ...}`` mappings) rendered by the template, with the assistant's
    spans; ``context`` goes to the template as it is (``bos_token``, ``eos_token``, ``tools``...)."""
    for index, message in enumerate(messages):
        if any(_OPEN in str(v) or _CLOSE in str(v) for v in message.values()):
            raise ChatTemplateError(f"messages[{index}]", "contains a private-use character U+E000 / U+E001")
    template = compile_template(template_source)
    framed = _render_framed(template, messages, add_generation_prompt=False, **context)
    text, spans = _unframe(framed)
    if _OPEN in framed:  # the template marks the assistant's text itself
        return RenderedConversation(text, spans)
    return RenderedConversation(text, _spans_turn_by_turn(template, messages, text, context))


def render_prompt(template_source: str, messages: Sequence[Mapping[str, Any]], **context: Any) -> str:
    """``messages`` rendered with the generation prompt after them: the text a model continues with its answer."""
    framed = _render_framed(compile_template(template_source), messages, add_generation_prompt=True, **context)
    return _unframe(framed)[0]


def _spans_turn_by_turn(
    template: jinja2.Template, messages: Sequence[Mapping[str, Any]], text: str, context: Mapping[str, Any]
) -> tuple[tuple[int, int], ...]:
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt, _ = _unframe(_render_framed(template, messages[:index], add_generation_prompt=True, **context))
        through, _ = _unframe(_render_framed(template, messages[: index + 1], add_generation_prompt=False, **context))
        if not (text.startswith(prompt) and text.startswith(through) and len(through) > len(prompt)):
            raise ChatTemplateError(
                "chat_template",
                f"the assistant turn messages[{index}] is not the text its message adds to the turns before it "
                "(the template renders earlier turns differently once later ones follow); use a template with "
                "{% generation %} markers around the assistant's text",
            )
        spans.append((len(prompt), len(through)))
    return tuple(spans)
