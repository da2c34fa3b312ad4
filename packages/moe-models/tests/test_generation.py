"""Generation with the key/value cache: the cached logits of every step equal a whole forward of the sequence so far,
and greedy tokens equal transformers' ``generate`` on the same checkpoint, for every family (sliding windows shorter
than the generated text, learned sinks, MLA, a dense layer)."""

from __future__ import annotations

import pytest
import torch
from _hf_reference import hf_from_pretrained, hf_model, randomize_, rel_err, tiny_config

from moe_models import build_model
from moe_models.generation import KVCache, generate
from moe_models.hf import load_pretrained

PROMPT = [3, 17, 42, 5, 9, 33, 1]
NEW_TOKENS = 14  # the windows (6 tokens) are crossed


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
def test_cached_steps_equal_whole_forwards(family: str) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_config(family))
    randomize_(model, 0)
    model.eval()
    gen = torch.Generator().manual_seed(1)
    sequence = torch.randint(0, 64, (1, 20), generator=gen)
    with torch.no_grad():
        whole = model(sequence).logits  # causal: a prefix's logits are the whole sequence's first ones
    with torch.no_grad(), KVCache(model) as cache:
        # a prompt of 7, then one token at a time, then 3 at once: each step's logits as a whole forward gives them
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 12), (12, 20)):
            cached = model(sequence[:, :end], torch.arange(start, end)).logits
            assert rel_err(cached, whole[:, start:end]) < 1e-5, (family, start)
            assert cache.length == end
    assert not model.layers[0].attention.core_attention._forward_pre_hooks  # the cache left the model as it was


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_greedy_tokens_equal_transformers_generate(case: str, tmp_path) -> None:
    ref = hf_model(case)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    ref.generation_config.eos_token_id = None
    want = ref.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, min_new_tokens=NEW_TOKENS
    )[0, len(PROMPT) :].tolist()
    cached = generate(ours, PROMPT, NEW_TOKENS)
    uncached = generate(ours, PROMPT, NEW_TOKENS, use_cache=False)
    assert cached.tokens == uncached.tokens == want
    assert not cached.stopped


def test_stop_tokens_and_sampling() -> None:
    torch.manual_seed(0)
    model = build_model(tiny_config("qwen3_moe"))
    greedy = generate(model, PROMPT, NEW_TOKENS)
    stop = greedy.tokens[3]
    first = greedy.tokens.index(stop)
    stopped = generate(model, PROMPT, NEW_TOKENS, stop_tokens=[stop])
    assert stopped.stopped and stopped.tokens == greedy.tokens[: first + 1]
    one = generate(model, PROMPT, 20, temperature=1.0, generator=torch.Generator().manual_seed(5))
    two = generate(model, PROMPT, 20, temperature=1.0, generator=torch.Generator().manual_seed(5))
    other = generate(model, PROMPT, 20, temperature=1.0, generator=torch.Generator().manual_seed(6))
    assert one == two and one.tokens != other.tokens
    with pytest.raises(ValueError, match="prompt"):
        generate(model, [], 3)


def test_a_model_with_linear_attention_layers_caches_their_states() -> None:
    """Qwen3-Next (three Gated DeltaNet layers, then gated attention; chunks of 4 positions): the cache keeps each
    linear layer's recurrent state and last convolution inputs, so each step computes only its positions (one token:
    shorter than the convolution's history) and its logits equal a whole forward's; greedy tokens with the cache equal
    those of whole forwards, computed here by hand."""
    import dataclasses

    from moe_models.presets import preset

    config = dataclasses.replace(preset("tiny-qwen3-next"), linear_attention_chunk_size=4)
    model = build_model(config, seed=0).eval()
    sequence = torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(sequence).logits
    with torch.no_grad(), KVCache(model) as cache:
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 12), (12, 20)):
            cached = model(sequence[:, :end], torch.arange(start, end)).logits
            assert rel_err(cached, whole[:, start:end]) < 1e-5, start
            assert {state["end"] for state in cache.states.values()} == {end} and cache.length == end
    assert len(cache.states) == 3 and not model.layers[0].attention.segments._forward_hooks
    prompt = [3, 14, 15, 9, 2]
    got = generate(model, prompt, 6).tokens
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt) :]


def test_a_hybrid_pattern_caches_its_mamba_states_and_matches_transformers_generate(tmp_path) -> None:
    """Nemotron-H ("ME*EM-": two Mamba-2 mixers, NoPE attention; chunks of 4 positions): the cache keeps each Mamba
    layer's state and last convolution inputs, so cached steps of 7, 1, 1, 3 and 8 tokens equal whole forwards; greedy
    tokens with the cache equal transformers' ``generate`` on the exported checkpoint."""
    import dataclasses

    from moe_models.hf import save_pretrained
    from moe_models.presets import preset

    config = dataclasses.replace(preset("tiny-nemotron-h"), mamba_chunk_size=4)
    model = build_model(config, seed=0).eval()
    randomize_(model, 0)
    sequence = torch.randint(0, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(sequence).logits
    with torch.no_grad(), KVCache(model) as cache:
        for start, end in ((0, 7), (7, 8), (8, 9), (9, 12), (12, 20)):
            cached = model(sequence[:, :end], torch.arange(start, end)).logits
            assert rel_err(cached, whole[:, start:end]) < 1e-5, start
            assert {state["end"] for state in cache.states.values()} == {end} and cache.length == end
    assert len(cache.states) == 2
    save_pretrained(model, tmp_path / "ours")
    ref, _ = hf_from_pretrained(tmp_path / "ours")
    ref.generation_config.eos_token_id = None
    want = ref.generate(
        torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, min_new_tokens=NEW_TOKENS
    )[0, len(PROMPT) :].tolist()
    assert generate(model, PROMPT, NEW_TOKENS).tokens == want
