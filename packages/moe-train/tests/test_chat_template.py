"""Assistant tokens of a rendered conversation: with ``{% generation %}`` markers against transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` token by token; without them (turn by turn) against
spans written by hand; templates and conversations that cannot be rendered are errors naming the field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moe_train.chat_template import ChatTemplateError, render

# ChatML (Qwen's turn format), with and without the markers around the assistant's text and end-of-turn
MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be kind"},
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "content": "I am fine."},
    {"role": "user", "content": "the answer?"},
    {"role": "assistant", "content": "The answer is 42."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello there, how are you? I am fine. The answer is 42. be kind"] * 20, trainer)
    return tok


def _against_transformers(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=MARKED, eos_token="<|im_end|>")
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    rendered = render(MARKED, messages)
    assert rendered.text == hf.apply_chat_template(messages, tokenize=False)
    encoding = tokenizer.encode(rendered.text)
    assert encoding.ids == list(want["input_ids"])
    assert rendered.token_mask(encoding.offsets) == [bool(m) for m in want["assistant_masks"]]


def test_marked_template_gives_transformers_assistant_mask(tokenizer: Tokenizer) -> None:
    _against_transformers(tokenizer, CONVERSATION)
    rendered = render(MARKED, CONVERSATION)
    assert [rendered.text[s:e] for s, e in rendered.assistant_spans] == [
        "I am fine.<|im_end|>\n",
        "The answer is 42.<|im_end|>\n",
    ]


TEXT = st.text(alphabet="abc ?.\n42", min_size=1, max_size=12)


@settings(max_examples=20, deadline=None)
@given(turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=3), system=st.none() | TEXT)
def test_marked_template_matches_transformers_on_any_conversation(tokenizer: Tokenizer, turns, system) -> None:
    messages = [] if system is None else [{"role": "system", "content": system}]
    for question, answer in turns:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    _against_transformers(tokenizer, messages)


def test_unmarked_template_finds_the_turns_by_rendering_them_one_by_one() -> None:
    rendered = render(PLAIN, CONVERSATION)
    assert rendered.text == render(MARKED, CONVERSATION).text
    # by hand: each answer and its end-of-turn marker, not the "<|im_start|>assistant\n" prompt before it
    want = []
    for answer in ("I am fine.", "The answer is 42."):
        start = rendered.text.index(f"<|im_start|>assistant\n{answer}") + len("<|im_start|>assistant\n")
        want.append((start, start + len(f"{answer}<|im_end|>\n")))
    assert rendered.assistant_spans == tuple(want)
    assert rendered.assistant_spans == render(MARKED, CONVERSATION).assistant_spans


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    # shows the turn count first, as some templates number or date the conversation: no turn's text is a prefix
    numbered = "{{ messages | length }} turns\n" + PLAIN
    with pytest.raises(ChatTemplateError, match="generation") as err:
        render(numbered, CONVERSATION)
    assert err.value.field == "chat_template"


def test_bad_templates_and_messages_name_the_field() -> None:
    with pytest.raises(ChatTemplateError) as err:
        render("{% for m in messages %}", CONVERSATION)
    assert err.value.field == "chat_template"
    strict = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="no tools") as err:
        render(strict, [{"role": "tool", "content": "x"}])
    assert err.value.field == "messages"
    with pytest.raises(ChatTemplateError) as err:
        render(PLAIN, [{"role": "user", "content": "a\ue000b"}])
    assert err.value.field == "messages[0]"


def test_the_template_runs_sandboxed() -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError, match="messages"):
        render(escape, CONVERSATION)
