"""``moe-train generate``: what a trained model says to a prompt.

The checkpoint's model (:func:`moe_train.export.load_trained_model`) continues the prompt with
:func:`moe_models.generation.generate` (a key/value cache; greedy unless ``--temperature``), in the tokens of the run's
own tokenizer. ``--chat`` renders the prompt as a user turn with the run's chat template and its generation prompt, as
``apply_chat_template(..., add_generation_prompt=True)`` does, and stops at the end-of-turn token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import torch

from moe_models.generation import generate
from moe_train.chat_template import ChatTemplateError, render_prompt
from moe_train.checkpoint import read_meta
from moe_train.config import ConfigError, DataConfig
from moe_train.conversation_tokens import chat_template, template_context
from moe_train.export import load_trained_model, resolve_checkpoint
from moe_train.tokenization import Tokenizer, default_tokenizer, load_tokenizer


@dataclass(frozen=True)
class Answer:
    prompt_tokens: list[int]
    tokens: list[int]  # the new tokens, the stop token included when one ended them
    text: str  # the new tokens decoded (special tokens written out)
    stopped: bool  # the end-of-text (or end-of-turn) token ended it; else --max-new-tokens did


def run_tokenizer(checkpoint: Path) -> tuple[DataConfig, Tokenizer]:
    """The ``data`` section and the tokenizer of the run that wrote ``checkpoint``."""
    config = read_meta(resolve_checkpoint(checkpoint).path)["config"]
    known = {f.name for f in fields(DataConfig)}
    data = DataConfig(**{k: v for k, v in config["data"].items() if k in known})
    return data, load_tokenizer(default_tokenizer(data, config.get("model_from_hf", "")), data.eos_token)


def answer(
    checkpoint: Path, prompt: str, *, chat: bool, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
) -> Answer:
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if temperature < 0:
        raise ConfigError(f"--temperature {temperature}: must be >= 0 (0 = greedy)")
    data, tokenizer = run_tokenizer(checkpoint)
    text = prompt
    if chat:
        if not tokenizer.name:
            raise ConfigError("--chat: the run used byte-level tokens, which have no chat template; drop --chat")
        try:
            messages = [{"role": "user", "content": prompt}]
            text = render_prompt(chat_template(data, tokenizer), messages, **template_context(tokenizer))
        except ChatTemplateError as err:
            raise ConfigError(f"--chat: {err}") from None
    # special tokens the template wrote (<|im_start|>...) are read as themselves
    ids = [int(i) for i in tokenizer.encode_batch([text])[0]]
    if not ids:
        raise ConfigError("--prompt '': give some text to continue")
    _, model = load_trained_model(checkpoint)
    stop = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    out = generate(
        model.float(),
        ids,
        max_new_tokens,
        temperature=temperature,
        stop_tokens=stop,
        generator=torch.Generator().manual_seed(seed),
    )
    return Answer(ids, out.tokens, tokenizer.decode(out.tokens), out.stopped)
