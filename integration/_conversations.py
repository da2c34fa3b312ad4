"""Synthetic chat data for the fine-tuning tests: a small byte-level BPE tokenizer with a ChatML template (Qwen's turn
format, with ``{% generation %}`` markers) saved as a tokenizer directory, and JSONL conversations of very different
lengths whose answers follow from their questions (so a model can learn them)."""

from __future__ import annotations

import json
import random
from pathlib import Path

CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone")


def _turn(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(10), rng.randrange(10)
    return f"what is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def conversations(count: int, seed: int = 0) -> list[dict]:
    """``count`` conversations of 1 to 3 turns, some with a system message of 0 to 6 words: 25 to
    110 tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": " ".join(rng.choices(WORDS, k=rng.randrange(7)))})
        for _ in range(rng.choice((1, 1, 2, 3))):
            question, answer = _turn(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        out.append({"messages": messages})
    return out


def write_tokenizer(directory: Path, template: str = CHATML) -> Path:
    """A byte-level BPE tokenizer (about 300 ids) with ChatML's special tokens and ``template``, as a directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(WORDS)] + [
        f"{q} {a} system user assistant" for q, a in map(_turn, [random.Random(i) for i in range(200)])
    ]
    tok.train_from_iterator(corpus * 5, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
