"""HF checkpoint I/O without transformers: sharding, expert-subset reads, atomic saves, errors, dtypes, configs."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from _hf_reference import assert_import_refused, input_ids, tiny_config, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_models.hf import (
    HFCheckpointError,
    config_from_hf,
    config_to_hf,
    load_pretrained,
    read_state_dict,
    save_pretrained,
)
from moe_models.hf import files as hf_files

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _rewrite(ckpt, edit) -> None:
    """Applies ``edit`` to the tensors of a single-file checkpoint."""
    tensors = load_file(ckpt / "model.safetensors")
    edit(tensors)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_round_trip(family, tmp_path):
    model = tiny_model(family)
    save_pretrained(model, tmp_path / "ckpt", max_shard_size="40KB")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (tmp_path / "ckpt" / "model.safetensors").exists()
    assert shards == sorted(p.name for p in (tmp_path / "ckpt").glob("model-*-of-*.safetensors"))
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for s in shards for t in load_file(tmp_path / "ckpt" / s).values()
    )
    back = load_pretrained(tmp_path / "ckpt")
    assert back.config == model.config
    _assert_same_state(model.state_dict(), back.state_dict())
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)


class _RecordingSlice:
    def __init__(self, inner, key: str, log: list) -> None:
        self.inner, self.key, self.log = inner, key, log

    def get_shape(self):  # metadata only: reads no tensor data
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.log.append((self.key, index))
        return self.inner[index]


class _RecordingFile:
    def __init__(self, inner, log: list) -> None:
        self.inner, self.log = inner, log

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, key: str):
        self.log.append((key, None))
        return self.inner.get_tensor(key)

    def get_slice(self, key: str):
        return _RecordingSlice(self.inner.get_slice(key), key, self.log)


@pytest.fixture
def read_log(monkeypatch) -> list:
    """(tensor name, index or None for whole) of every tensor-data read through safetensors."""
    log: list = []
    real = hf_files.safe_open

    @contextlib.contextmanager
    def recording_open(*args, **kwargs):
        with real(*args, **kwargs) as f:
            yield _RecordingFile(f, log)

    monkeypatch.setattr(hf_files, "safe_open", recording_open)
    return log


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])  # per-expert tensors / fused [E, ...] tensors
def test_expert_subset_reads_only_owned_experts(family, tmp_path, read_log):
    model = tiny_model(family)
    save_pretrained(model, tmp_path / "ckpt")
    owned = [3, 0, 1] if family == "gpt_oss" else [5, 1, 2]
    full = model.state_dict()
    part = read_state_dict(tmp_path / "ckpt", model.config, experts=owned)

    assert part.keys() == full.keys()
    for name, tensor in part.items():
        if ".mlp.experts." in name:
            assert torch.equal(tensor, full[name][owned]), name
        else:  # routers, shared experts, attention...: whole
            assert torch.equal(tensor, full[name]), name

    expert_reads = [(key, index) for key, index in read_log if ".experts." in key and ".shared_experts." not in key]
    assert expert_reads
    if family == "gpt_oss":  # fused tensors: only slices of owned rows
        assert all(index is not None for _, index in expert_reads)
        rows = {r for _, index in expert_reads for r in range(index.start, index.stop)}
        assert rows == set(owned)
    else:  # per-expert tensors: the others' names are never read
        read_ids = {int(key.split(".experts.")[1].split(".")[0]) for key, _ in expert_reads}
        assert read_ids == set(owned)


def test_transformers_fused_expert_layout_is_read(tmp_path):
    model = tiny_model("qwen3_moe")
    save_pretrained(model, tmp_path / "ckpt")
    e = model.config.num_moe_experts

    def fuse(tensors):  # transformers 5's in-memory layout: [E, 2F, H] gate rows first, [E, H, F]
        prefix = "model.layers.0.mlp.experts"
        gate = [tensors.pop(f"{prefix}.{i}.gate_proj.weight") for i in range(e)]
        up = [tensors.pop(f"{prefix}.{i}.up_proj.weight") for i in range(e)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        tensors[f"{prefix}.down_proj"] = torch.stack([tensors.pop(f"{prefix}.{i}.down_proj.weight") for i in range(e)])

    _rewrite(tmp_path / "ckpt", fuse)
    _assert_same_state(model.state_dict(), load_pretrained(tmp_path / "ckpt").state_dict())
    part = read_state_dict(tmp_path / "ckpt", model.config, experts=[6, 2])
    assert torch.equal(
        part["layers.0.mlp.experts.w_down_EFH"], model.state_dict()["layers.0.mlp.experts.w_down_EFH"][[6, 2]]
    )


def test_pickle_checkpoints_are_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(tiny_config("qwen3_moe"))))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(HFCheckpointError, match=r"pickle.*pytorch_model\.bin.*safetensors"):
        load_pretrained(tmp_path)


@pytest.fixture
def qwen_ckpt(tmp_path):
    model = tiny_model("qwen3_moe")
    save_pretrained(model, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_missing_tensor_is_named(qwen_ckpt):
    _rewrite(qwen_ckpt, lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    with pytest.raises(HFCheckpointError, match=r"lacks 1 tensor.*model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight"):
        load_pretrained(qwen_ckpt)


def test_unexpected_tensor_is_named(qwen_ckpt):
    _rewrite(qwen_ckpt, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(HFCheckpointError, match=r"does not use: model\.layers\.0\.mlp\.extra\.weight"):
        load_pretrained(qwen_ckpt)


def test_shape_mismatch_is_named(qwen_ckpt):
    _rewrite(qwen_ckpt, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    with pytest.raises(HFCheckpointError, match=r"model\.norm\.weight has shape \[31\], the config needs \[32\]"):
        load_pretrained(qwen_ckpt)


def test_unknown_architecture_lists_supported(qwen_ckpt):
    config = json.loads((qwen_ckpt / "config.json").read_text())
    config |= {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (qwen_ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFCheckpointError, match=r"'llama'.*LlamaForCausalLM.*not supported.*qwen3_moe"):
        load_pretrained(qwen_ckpt)


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window"),
        ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3_moe", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
        # transformers renormalises a single weight to 1, Megatron-Core keeps its sigmoid score
        ("deepseek_v3", {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}, "norm_topk_prob"),
        ("deepseek_v3", {"n_routed_experts": 8, "n_group": 8, "topk_group": 2, "num_experts_per_tok": 2}, "n_group"),
        ("gpt_oss", {"swiglu_limit": 8.0}, "swiglu_limit"),
        ("mixtral", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "mscale_all_dim": 1.0}}, "mscale_all_dim"),
    ],
)
def test_unsupported_config_fields_are_named(family, change, field):
    hf = config_to_hf(tiny_config(family)) | change
    assert_import_refused(hf, rf"\S*{field}\S*")


def test_unrepresentable_model_config_is_named():
    with pytest.raises(HFCheckpointError, match=r"^ModelConfig qk_layernorm=False.*qwen3_moe") as err:
        config_to_hf(tiny_config("qwen3_moe", qk_layernorm=False))
    assert "model." not in str(err.value)  # moe-train alone adds its section prefixes


def test_invalid_mapped_config_is_named():
    hf = config_to_hf(tiny_config("deepseek_v3")) | {"num_experts_per_tok": 20, "n_group": 1}
    with pytest.raises(HFCheckpointError, match=r"invalid model config: moe_router_topk=20: .*number of experts \(8\)"):
        config_from_hf(hf)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(family):
    config = tiny_config(family)
    assert config_from_hf(config_to_hf(config)) == config


def test_kimi_k2_model_type_is_deepseek_v3():
    hf = config_to_hf(tiny_config("deepseek_v3")) | {"model_type": "kimi_k2"}
    assert config_from_hf(hf) == tiny_config("deepseek_v3")


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2"])
@pytest.mark.parametrize("norm", [True, False])
def test_norm_topk_prob_round_trips(model_type, norm):
    """norm_topk_prob <-> moe_router_sigmoid_norm_topk (false: raw sigmoid weights, still scaled)."""
    config = tiny_config("deepseek_v3", moe_router_sigmoid_norm_topk=norm)
    hf = config_to_hf(config)
    assert hf["norm_topk_prob"] is norm and hf["routed_scaling_factor"] == 2.5
    assert config_from_hf(hf | {"model_type": model_type}) == config
    absent = {k: v for k, v in hf.items() if k != "norm_topk_prob"}
    assert config_from_hf(absent).moe_router_sigmoid_norm_topk is True  # transformers' default


def test_topk1_exports_what_the_router_computes():
    """With one expert per token the router's weight is the (scaled) sigmoid score either way (Megatron-Core), which
    transformers computes only with norm_topk_prob false; read back, the model is the same."""
    config = tiny_config("deepseek_v3", moe_router_topk=1, moe_router_num_groups=None, moe_router_group_topk=None)
    hf = config_to_hf(config)
    assert hf["norm_topk_prob"] is False
    back = config_from_hf(hf)
    assert back.router_config().topk == 1 and back.moe_router_sigmoid_norm_topk is False


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    model = tiny_model("gpt_oss")
    calls = []

    def failing_save(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(*args, **kwargs)

    monkeypatch.setattr(hf_files, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, tmp_path / "ckpt", max_shard_size=20_000)
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_non_empty_directory(tmp_path):
    model = tiny_model("mixtral")
    (tmp_path / "ckpt").mkdir()
    save_pretrained(model, tmp_path / "ckpt")  # an empty directory is fine
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_pretrained(model, tmp_path / "ckpt")
    other = tiny_model("mixtral", seed=1)
    save_pretrained(other, tmp_path / "ckpt", overwrite=True)
    _assert_same_state(other.state_dict(), load_pretrained(tmp_path / "ckpt").state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_tied_embeddings(tmp_path):
    model = tiny_model("qwen3_moe", share_embeddings_and_output_weights=True)
    save_pretrained(model, tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["tie_word_embeddings"] is True
    back = load_pretrained(tmp_path / "ckpt")
    assert back.lm_head.weight is back.embed_tokens.weight
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)


def test_bf16_load_keeps_expert_bias_fp32(tmp_path):
    model = tiny_model("deepseek_v3")
    save_pretrained(model, tmp_path / "ckpt")
    back = load_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    for name, tensor in back.state_dict().items():
        assert tensor.dtype == (torch.float32 if name.endswith("expert_bias") else torch.bfloat16), name
    ids = input_ids()
    with torch.no_grad():
        ref, low = model(ids).logits, back(ids).logits.float()
    assert (low - ref).abs().max() / ref.abs().max() < 0.05
    save_pretrained(back, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_config_mtp_without_tensors_loads_without_mtp(tmp_path):
    model = tiny_model("deepseek_v3")
    save_pretrained(model, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="no MTP tensors"):
        back = load_pretrained(tmp_path / "ckpt")
    assert back.config.mtp_num_layers is None


# deepseek-ai/DeepSeek-V3's config.json as published (legacy rope_scaling / rope_theta), minus quantization
DEEPSEEK_V3_PUBLISHED = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_published_legacy_config_format():
    c = config_from_hf(DEEPSEEK_V3_PUBLISHED)
    assert (c.rope_type, c.rotary_base, c.rotary_scaling_factor, c.mscale, c.mscale_all_dim) == ("yarn", 1e4, 40, 1, 1)
    assert c.original_max_position_embeddings == 4096 and c.rope_yarn_truncate and c.rotary_interleaved
    assert c.moe_layer_freq == [0] * 3 + [1] * 58 and c.moe_shared_expert_intermediate_size == 2048
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert c.mtp_num_layers == 1 and c.moe_router_enable_expert_bias and c.moe_router_score_function == "sigmoid"
    fp8 = DEEPSEEK_V3_PUBLISHED | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}
    with pytest.raises(HFCheckpointError, match=r"quantization_config\.quant_method='fp8'.*dequantize"):
        config_from_hf(fp8)


def test_deepseek_without_expert_bias_writes_zeros(tmp_path):
    model = tiny_model("deepseek_v3", moe_router_enable_expert_bias=False)
    save_pretrained(model, tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias"), torch.zeros(8))
    back = load_pretrained(tmp_path / "ckpt")  # transformers' DeepSeek always has the bias: ours now too
    assert back.config.moe_router_enable_expert_bias
    ids = input_ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, back(ids).logits)
