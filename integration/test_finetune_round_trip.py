"""The fine-tuning round trip a user makes, through the ``moe-train`` command: a HuggingFace checkpoint (a tiny
Qwen3-MoE and a tiny GPT-OSS, random weights, saved by transformers with a ChatML tokenizer) -> LoRA on synthetic
conversations -> ``moe-train generate`` -> ``moe-train export --peft`` and ``--hf`` -> transformers and PEFT.

The run must learn the conversations (the answer loss ends below 10% of where it started, and greedy generation gives a
trained answer back); PEFT's ``PeftModel.from_pretrained`` on the transformers base model and the merged export both
give our logits within 1e-4; transformers' greedy ``generate`` on the merged export gives ``moe-train generate``'s
tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _conversations import CHATML, write_jsonl, write_tokenizer

from moe_train import cli
from moe_train.export import load_trained_model
from moe_train.generate import answer

# the conversations to learn: one question and its answer each
PAIRS = [(3, 4), (1, 8), (6, 2), (9, 9), (0, 5), (7, 3), (2, 2), (5, 6)]
QUESTION, ANSWER = "what is {a} plus {b}?", "{a} plus {b} is {c}."
VOCAB = 320
NEW_TOKENS = 12
# GPT-OSS's clamped SwiGLU and sinks diverge at Qwen3-MoE's rate
LEARNING_RATES = {"qwen3_moe": "0.03", "gpt_oss": "0.01"}


def _hf_config(family: str, eos: int):
    from transformers import GptOssConfig, Qwen3MoeConfig

    small = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    small |= {"head_dim": 16, "num_hidden_layers": 2, "eos_token_id": eos, "tie_word_embeddings": False}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **small,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=512,
        )
    return GptOssConfig(
        **small,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
    )


def _base_checkpoint(family: str, root: Path) -> Path:
    """A random transformers model saved with its tokenizer (tokenizer.json, the chat template) in one directory."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tokenizer_dir = write_tokenizer(root / "tokenizer", CHATML)
    eos = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id("<|im_end|>")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(family, eos), dtype=torch.float32)
    _unit_scale_(model)
    base = root / "base"
    model.save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, base / name)
    return base


@torch.no_grad()
def _unit_scale_(model: torch.nn.Module) -> None:
    """Weights of unit-scale outputs (HF's init, std 0.02, caps a frozen output layer's logits near 1, too little to
    learn anything with adapters alone), as a pre-trained model has."""
    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if param.ndim >= 2:
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(noise if "embed_tokens" in name else noise / param.shape[-1] ** 0.5)


def _chat(a: int, b: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": QUESTION.format(a=a, b=b)},
        {"role": "assistant", "content": ANSWER.format(a=a, b=b, c=a + b)},
    ]


def _train(base: Path, root: Path, lr: str) -> Path:
    data = write_jsonl(root / "chat.jsonl", [{"messages": _chat(a, b)} for a, b in PAIRS])
    run = root / "run"
    args = [
        "train",
        "--model.from_hf", str(base),
        "--data.format", "chat",
        "--data.source", str(data),
        "--data.seq_len", "64",
        "--data.cache_dir", str(root / "cache"),
        "--peft.method", "lora",
        "--peft.rank", "8",
        "--peft.alpha", "16",
        "--train.steps", "200",
        "--train.global_batch_size", "4",
        "--train.lr", lr,
        "--train.min_lr", str(float(lr) / 10),
        "--train.warmup_steps", "5",
        "--run.dtype", "fp32",
        "--run.log_interval", "20",
        "--run.output_dir", str(run),
    ]  # fmt: skip
    assert cli.main(args) == 0
    return run


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp(request.param)
    base = _base_checkpoint(request.param, root)
    run = _train(base, root, LEARNING_RATES[request.param])
    return {"family": request.param, "root": root, "base": base, "run": run}


def test_lora_learns_the_conversations(trained: dict) -> None:
    records = [json.loads(line) for line in (trained["run"] / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0]["loss"], records[-1]["loss"]
    print(f"{trained['family']}: answer loss {first:.3f} -> {last:.3f}")
    assert last < 0.1 * first
    a, b = PAIRS[0]
    said = answer(trained["run"], QUESTION.format(a=a, b=b), chat=True, max_new_tokens=NEW_TOKENS)
    assert said.stopped and said.text == ANSWER.format(a=a, b=b, c=a + b) + "<|im_end|>"


def _prompt_ids(trained: dict) -> torch.Tensor:
    a, b = PAIRS[1]
    said = answer(trained["run"], QUESTION.format(a=a, b=b), chat=True, max_new_tokens=1)
    return torch.tensor([said.prompt_tokens + said.tokens])


def test_peft_and_merged_exports_give_our_logits(trained: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, merged = trained["root"] / "adapter", trained["root"] / "merged"
    assert cli.main(["export", str(trained["run"]), "--peft", str(adapter)]) == 0
    assert cli.main(["export", str(trained["run"]), "--hf", str(merged)]) == 0
    ids = _prompt_ids(trained)
    _, ours = load_trained_model(trained["run"])
    with torch.no_grad():
        want = ours.float()(ids).logits
        base = AutoModelForCausalLM.from_pretrained(trained["base"], dtype=torch.float32).eval()
        untouched = base(ids).logits
        via_peft = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        via_merged = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(ids).logits
    scale = want.abs().max()
    assert (untouched - want).abs().max() / scale > 1e-2  # the adapters changed the model
    assert (via_peft - want).abs().max() / scale < 1e-4
    assert (via_merged - want).abs().max() / scale < 1e-4


def test_generate_equals_transformers_greedy(trained: dict, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    merged = trained["root"] / "merged-for-generate"
    assert cli.main(["export", str(trained["run"]), "--hf", str(merged)]) == 0
    a, b = PAIRS[2]
    prompt = QUESTION.format(a=a, b=b)
    capsys.readouterr()
    assert cli.main(["generate", str(trained["run"]), "--prompt", prompt, "--chat", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    said = answer(trained["run"], prompt, chat=True, max_new_tokens=NEW_TOKENS)
    assert said.text in printed
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    # our HF export names no end-of-text token (no eos_token_id in config.json): given here as a user would
    eos = said.tokens[-1]
    assert said.stopped and said.text.endswith("<|im_end|>")
    out = model.generate(
        torch.tensor([said.prompt_tokens]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos
    )
    theirs = out[0, len(said.prompt_tokens) :].tolist()
    assert theirs == said.tokens, f"{theirs} != {said.tokens}"
