"""LoRA adapters exported as a PEFT adapter directory, checked against peft's own loading onto the transformers model
of the base checkpoint: PEFT's logits are ours (fused 3-D expert parameters included), the expert adapters really
change them, and our merged weights saved as HF give the same logits through transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # the reference implementation: in the dev group, so a missing one fails here
from _hf_reference import hf_model, input_ids, rel_err
from safetensors.torch import load_file, save_file

from moe_models import build_model
from moe_models.hf import load_pretrained, peft_adapter_state, save_peft_adapter, save_pretrained
from moe_models.lora import add_lora_, merged_state_dict

peft = pytest.importorskip("peft")

TOLERANCE = 1e-4
RANK, ALPHA = 8, 16.0


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)


def _randomise_adapters_(model: torch.nn.Module, seed: int = 1) -> None:
    # B starts at zero, which would hide every mapping mistake; sized so each update is comparable to its weight
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "deepseek_v3"])
def exported(request, tmp_path_factory):
    """(case, base checkpoint, our adapted model, adapter directory)."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf_model(request.param).save_pretrained(tmp / "base")
    ours = load_pretrained(tmp / "base")
    names = add_lora_(ours, RANK, ALPHA)
    assert any(n.endswith("mlp.experts") for n in names) and any(".attention." in n for n in names)
    _randomise_adapters_(ours)
    with torch.no_grad():  # as aux-loss-free balancing moves DeepSeek-V3's expert bias in training, adapters or not
        for name, buffer in ours.named_buffers():
            if name.endswith("expert_bias"):
                buffer.add_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(2)))
    save_peft_adapter(ours, ours.config, tmp / "adapter", base_model_name_or_path=str(tmp / "base"))
    return request.param, tmp / "base", ours.eval(), tmp / "adapter"


def test_peft_loads_the_adapter_onto_transformers_and_gives_our_logits(exported):
    case, base, ours, adapter = exported
    ids = input_ids()
    want = _logits(ours, ids)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["target_parameters"] and config["target_modules"]
    assert config["base_model_name_or_path"] == str(base)

    plain = _logits(_hf(base).eval(), ids)
    assert rel_err(plain, want) > 1e-2, "the adapters change nothing: the test could not fail"
    model = peft.PeftModel.from_pretrained(_hf(base), adapter).eval()
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert len(wrappers) == len(config["target_parameters"])  # every parameter adapted, none by PEFT's renaming
    err = rel_err(_logits(model, ids), want)
    print(f"\nPEFT adapter {case}: {err:.2e}")
    assert err < TOLERANCE


def test_the_expert_adapters_matter(exported, tmp_path):
    _, base, ours, adapter = exported
    ids = input_ids()
    tensors = load_file(adapter / "adapter_model.safetensors")
    experts = [k for k in tensors if ".mlp.experts." in k]
    assert experts
    for key in experts:
        tensors[key] = torch.zeros_like(tensors[key])
    (tmp_path / "adapter").mkdir()
    save_file(tensors, tmp_path / "adapter" / "adapter_model.safetensors", {"format": "pt"})
    (tmp_path / "adapter" / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    model = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").eval()
    assert rel_err(_logits(model, ids), _logits(ours, ids)) > 1e-3


def test_merged_weights_saved_as_hf_give_our_logits(exported, tmp_path):
    case, _, ours, _ = exported
    merged = build_model(ours.config)
    merged.load_state_dict(merged_state_dict(ours))
    save_pretrained(merged, tmp_path / "merged")
    ids = input_ids()
    err = rel_err(_logits(_hf(tmp_path / "merged").eval(), ids), _logits(ours, ids))
    print(f"\nmerged HF {case}: {err:.2e}")
    assert err < TOLERANCE


def test_what_peft_cannot_express_is_one_line_naming_it(tmp_path):
    from _hf_reference import tiny_model

    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        peft_adapter_state(model, model.config)
    add_lora_(model, 8, 16.0, targets=("*attention.q_proj",))
    add_lora_(model, 16, 16.0, targets=("*mlp.experts",))
    with pytest.raises(ValueError, match=r"one rank and one alpha.*r=8, alpha=16.*r=16, alpha=16"):
        save_peft_adapter(model, model.config, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())

    tied = tiny_model("qwen3_moe", share_embeddings_and_output_weights=True)
    add_lora_(tied, 8, 16.0, targets=("lm_head",))
    with pytest.raises(ValueError, match="lm_head: transformers' qwen3_moe model has no module of its own"):
        peft_adapter_state(tied, tied.config)
