"""Tiny transformers reference models of the four families, with every parameter and buffer randomised (HF init
leaves norms at one and biases, sinks and DeepSeek's expert bias at zero, which would hide mapping mistakes), and the
parity harness every family's tests share: ``both_ways`` (transformers -> ours -> transformers; ``both_ways_within``
asserts a tolerance), ``moves_logits`` (a config change that must move the logits, so a case exercises its feature;
``assert_exercised`` over a list of them), the MTP checks ``mtp_round_trip`` and ``mtp_block_left_unread``, and the
refusal checks ``assert_import_refused`` and ``assert_export_refused``. What families of one lineage share is in
``_hf_family_cases``."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest
import torch
from torch import nn

SEQ_LEN = 16
WINDOW = 6  # sliding window smaller than SEQ_LEN, so the mask matters
# DeepSeek-style YaRN (with both mscales), as the multi-latent-attention families' tiny configs use it
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.9,
    "mscale_all_dim": 1.1,
}


def _small(**overrides):
    base = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "max_position_embeddings": 256}
    return base | overrides


def hf_config(case: str):
    """A tiny transformers config for a parity case (family plus the variant under test)."""
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    if case.startswith("qwen3_moe"):
        return Qwen3MoeConfig(
            **_small(),
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=case.endswith("norm_topk"),
        )
    if case == "mixtral":
        return MixtralConfig(
            **_small(),
            num_hidden_layers=2,
            num_key_value_heads=2,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
        )
    if case == "kimi_k2":  # the DeepSeek-V3 architecture: half the heads, 1.5x the experts, one group
        kimi = {"num_attention_heads": 2, "num_key_value_heads": 2, "n_routed_experts": 24, "n_shared_experts": 1}
        routing = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}
        base = hf_config("deepseek_v3")
        return base.__class__(**(base.to_dict() | kimi | routing))
    if case.startswith("deepseek_v3"):
        return DeepseekV3Config(
            **_small(),
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=48,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_routed_experts=16,
            n_shared_experts=2,
            num_experts_per_tok=2 if case.endswith("top2") else 4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            q_lora_rank=None if case.endswith("no_q_lora") else 16,
            norm_topk_prob=not case.endswith("no_norm_topk"),  # false: raw sigmoid weights, times the scaling
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            rope_interleave=True,
            rope_parameters=dict(YARN_ROPE),
            num_nextn_predict_layers=0,
        )
    if case == "gpt_oss":
        return GptOssConfig(
            **_small(max_position_embeddings=131072),  # yarn: 32 x the default 4096 original context
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=24,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=WINDOW,
        )
    raise ValueError(case)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int) -> None:
    """Every floating parameter and persistent buffer to random values of O(1) activations."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    for name, t in tensors.items():
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if t.ndim >= 2:
            value = noise if "embed_tokens" in name else noise / math.sqrt(t.shape[-1])
        elif "norm" in name or "layernorm" in name:
            value = 1.0 + 0.2 * noise
        elif "correction_bias" in name or "expert_bias" in name:
            value = 0.1 * noise  # sigmoid scores spread about 0.2: a bias of this size changes the choice
        else:
            value = 0.5 * noise  # biases, sinks
        t.copy_(value.to(t.dtype))


def hf_from_config(config, seed: int = 0):
    """A randomised transformers model of a transformers config, in eval mode, eager attention, fp32."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed)
    return model.eval()


def hf_model(case: str, seed: int = 0):
    """A randomised transformers model of the case, in eval mode, eager attention."""
    return hf_from_config(hf_config(case), seed)


def hf_from_pretrained(path):
    """transformers' model of a checkpoint (eager attention, fp32, eval mode) and its loading info."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def input_ids(vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The model's (main) logits for ``ids``, without autograd."""
    with torch.no_grad():
        return model(ids).logits


@dataclasses.dataclass
class BothWays:
    """What ``both_ways`` found: our model, the inputs, transformers' logits and the two relative errors."""

    ours: nn.Module
    ids: torch.Tensor
    ref_logits: torch.Tensor
    load_err: float  # our model loaded from transformers' checkpoint
    trip_err: float  # transformers' model loaded from our checkpoint


def both_ways(
    reference,
    tmp_dir: Path,
    seed: int = 0,
    *,
    label: str | None = None,
    edit_config_json: Callable[[dict], dict] | None = None,
    unexpected_keys_ok: bool = False,
    worst: dict[str, float] | None = None,
) -> BothWays:
    """Logit parity with transformers both ways: transformers' model -> its checkpoint -> ``load_pretrained``, and
    ours -> ``save_pretrained`` -> transformers' ``from_pretrained``.

    ``reference``: a transformers config (a randomised model of it is built, ``hf_from_config(reference, seed)``) or
    an already randomised transformers model. ``edit_config_json`` rewrites transformers' config.json before we read
    it. Asserts that transformers loads our checkpoint with no missing, mismatched or (unless ``unexpected_keys_ok``)
    unexpected keys, and that our config.json, read back directly and through transformers' config, is our config.
    The tolerance on the two errors is the caller's to assert. ``label``: prints the errors under it; ``worst``: a
    record of the largest errors so far ("load", "round trip"), updated here."""
    from moe_models.hf import config_from_hf, load_pretrained, save_pretrained

    tmp_dir = Path(tmp_dir)
    ref = reference if isinstance(reference, nn.Module) else hf_from_config(reference, seed)
    ids = input_ids(ref.config.vocab_size, seed)
    ref_logits = logits(ref, ids)
    ref.save_pretrained(tmp_dir / "hf")
    if edit_config_json is not None:
        config_json = tmp_dir / "hf" / "config.json"
        config_json.write_text(json.dumps(edit_config_json(json.loads(config_json.read_text()))))
    ours = load_pretrained(tmp_dir / "hf")
    load_err = rel_err(logits(ours, ids), ref_logits)

    save_pretrained(ours, tmp_dir / "ours")
    back, info = hf_from_pretrained(tmp_dir / "ours")
    bad_keys = ("missing_keys", "mismatched_keys") + (() if unexpected_keys_ok else ("unexpected_keys",))
    assert not any(info[k] for k in bad_keys), info
    trip_err = rel_err(logits(back, ids), ref_logits)
    assert config_from_hf(json.loads((tmp_dir / "ours" / "config.json").read_text())) == ours.config
    assert config_from_hf(back.config.to_dict()) == ours.config

    if worst is not None:
        for name, err in (("load", load_err), ("round trip", trip_err)):
            worst[name] = max(worst.get(name, 0.0), err)
    if label is not None:
        so_far = "" if worst is None else f" (worst so far {worst})"
        print(f"\nHF parity {label}: load {load_err:.2e}, round trip {trip_err:.2e}{so_far}")
    return BothWays(ours, ids, ref_logits, load_err, trip_err)


def both_ways_within(
    reference, tmp_dir: Path, seed: int = 0, *, tolerance: float, quiet: bool = False, **kwargs
) -> BothWays:
    """``both_ways(reference, tmp_dir, seed, **kwargs)``, asserting both errors below ``tolerance``; ``quiet``: with
    transformers' warnings silenced."""
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        r = both_ways(reference, tmp_dir, seed, **kwargs)
    assert r.load_err < tolerance, f"load error {r.load_err:.2e} over {tolerance:.0e}"
    assert r.trip_err < tolerance, f"round trip error {r.trip_err:.2e} over {tolerance:.0e}"
    return r


def moves_logits(ours, ids: torch.Tensor, ref_logits: torch.Tensor, *, strict: bool = True, **change) -> float:
    """The error against ``ref_logits`` once ``change`` is applied to our model's config, with its weights loaded
    (``strict``: the changed model has exactly the same weights; else those that fit). A feature a case exercises
    moves it far off (> 1e-3)."""
    from moe_models import build_model

    altered = build_model(dataclasses.replace(ours.config, **change))
    altered.load_state_dict(ours.state_dict(), strict=strict)
    return rel_err(logits(altered.eval(), ids), ref_logits)


def assert_exercised(
    r: BothWays,
    case: str,
    changes: Iterable[dict] | Mapping[str, dict],
    *,
    strict: bool = False,
    moved_by: float = 1e-3,
    label: str | None = None,
) -> None:
    """Each of ``changes`` (to our model's config, ``moves_logits``; a mapping names them) moves the logits of ``r``
    more than ``moved_by`` off transformers': ``case`` exercises what each changes. ``label``: prints each move."""
    named = changes.items() if isinstance(changes, Mapping) else ((change, change) for change in changes)
    for name, change in named:
        moved = moves_logits(r.ours, r.ids, r.ref_logits, strict=strict, **change)
        if label is not None:
            print(f"{label}: {change} moves the logits by {moved:.2e}")
        assert moved > moved_by, f"{case} does not exercise {name}"


def class_defaults_agree(config_class, model_type: str, given: dict):
    """A config.json holding only ``given`` maps as ``config_class(**given)`` written out (the class's defaults filled
    in) does; returns (ours, theirs): our config of it and transformers'."""
    from moe_models.hf import config_from_hf

    ours = config_from_hf({"model_type": model_type} | given)
    theirs = config_class(**given)
    assert config_from_hf(theirs.to_dict()) == ours
    return ours, theirs


def assert_import_refused(hf: dict, key: str) -> None:
    """``config_from_hf`` refuses ``hf``, its error naming ``config.json {key}=`` (``key``: a regex)."""
    from moe_models.hf import config_from_hf
    from moe_models.hf.errors import HFCheckpointError

    with pytest.raises(HFCheckpointError, match=rf"config\.json {key}="):
        config_from_hf(hf)


def assert_export_refused(ours, change: dict, field: str, family: str) -> None:
    """``config_to_hf`` refuses ``ours`` with ``change`` applied, its error opening ``ModelConfig {field}=`` and
    naming ``family``."""
    from moe_models.hf import config_to_hf
    from moe_models.hf.errors import HFCheckpointError

    altered = dataclasses.replace(ours, **change)
    with pytest.raises(HFCheckpointError, match=f"^ModelConfig {field}=.*{family}"):
        config_to_hf(altered)


def draw_expert_groups(draw, topk: int, experts: int = 8) -> tuple[int, int] | None:
    """For a hypothesis strategy: maybe (groups, group_topk), 2 or 4 groups of ``experts`` with enough chosen to hold
    ``topk`` experts; None when grouping is not drawn or no group_topk fits."""
    from hypothesis import strategies as st

    if not draw(st.booleans()):
        return None
    groups = draw(st.sampled_from([2, 4]))  # 4 or 2 experts a group: transformers scores a group by its top 2
    low = max(1, -(-topk // (experts // groups)))
    if low > min(groups, topk):
        return None
    return groups, draw(st.integers(low, min(groups, topk)))


def draw_rope_parameters(draw, **yarn_extra) -> dict:
    """For a hypothesis strategy: transformers' rope_parameters, theta 1e4 or 1e6, default or YaRN (factor 2 or 4 over
    64 original positions, truncated or not, plus ``yarn_extra``: field name -> strategy of its value)."""
    from hypothesis import strategies as st

    theta = draw(st.sampled_from([10_000.0, 1_000_000.0]))
    if not draw(st.booleans()):
        return {"rope_theta": theta, "rope_type": "default"}
    factor = draw(st.sampled_from([2.0, 4.0]))
    yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 64}
    yarn["truncate"] = draw(st.booleans())
    return {"rope_theta": theta, **yarn} | {name: draw(value) for name, value in yarn_extra.items()}


def mtp_block_left_unread(config, tmp_path: Path, keys: dict, tensors: dict[str, torch.Tensor]) -> float:
    """transformers' randomised model of ``config`` saved with an MTP block it does not build added (``keys`` in
    config.json, ``tensors`` in the checkpoint): our load of it has no MTP layer; returns its logits' error against
    transformers' model (for the caller's tolerance)."""
    from safetensors.torch import load_file, save_file

    from moe_models.hf import load_pretrained

    ref = hf_from_config(config, seed=2)
    ref.save_pretrained(tmp_path)
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps(json.loads(config_json.read_text()) | keys))
    weights = load_file(tmp_path / "model.safetensors") | tensors
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = load_pretrained(tmp_path)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert ours.config.mtp_num_layers is None
    return rel_err(logits(ours, ids), logits(ref, ids))


# tensors of an MTP layer in DeepSeek-V3's layout (a decoder layer with a sigmoid-routed MoE, plus the MTP parts)
MTP_LAYER_KEYS = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
    "embed_tokens.weight",
    "input_layernorm.weight",
    "mlp.gate.e_score_correction_bias",
    "mlp.experts.0.gate_proj.weight",
    "mlp.shared_experts.down_proj.weight",
)


@dataclasses.dataclass
class MtpRoundTrip:
    """What ``mtp_round_trip`` found: the randomised model, the inputs, its output and transformers' error."""

    ours: nn.Module
    ids: torch.Tensor
    out: object  # our model's output on ids: logits and mtp_logits
    hf_err: float  # transformers' main logits from our checkpoint, against ours


def mtp_round_trip(config, tmp_dir: Path, mtp_keys: Iterable[str], label: str) -> MtpRoundTrip:
    """A randomised model of ``config`` (one MTP layer) saved to ``tmp_dir / "ckpt"``: the MTP layer is written as
    layer ``num_layers`` (each of ``mtp_keys`` under it) with ``num_nextn_predict_layers`` 1; it loads back as the same
    config, weights, logits and MTP logits; and transformers, which ignores the MTP layer, loads it without missing
    keys (the error of its main logits is returned, for the caller's tolerance)."""
    from safetensors import safe_open

    from moe_models import build_model
    from moe_models.hf import load_pretrained, save_pretrained

    torch.manual_seed(0)
    ours = build_model(config)
    randomize_(ours, seed=1)
    ours.eval()
    ckpt = Path(tmp_dir) / "ckpt"
    save_pretrained(ours, ckpt)

    with safe_open(ckpt / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    for name in mtp_keys:
        assert f"model.layers.{config.num_layers}.{name}" in keys
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 1

    back = load_pretrained(ckpt)
    assert back.config == config
    state, back_state = ours.state_dict(), back.state_dict()
    assert state.keys() == back_state.keys()
    assert all(torch.equal(state[k], back_state[k]) for k in state)
    ids = input_ids()
    with torch.no_grad():
        out, back_out = ours(ids), back(ids)
    assert torch.equal(out.logits, back_out.logits)
    assert len(out.mtp_logits) == 1 and torch.equal(out.mtp_logits[0], back_out.mtp_logits[0])

    # transformers ignores the MTP layer and still computes the main logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, info = hf_from_pretrained(ckpt)
    assert not info["missing_keys"], info
    hf_err = rel_err(logits(hf, ids), out.logits)
    print(f"\nHF parity {label} with MTP (main logits through transformers): {hf_err:.2e}")
    return MtpRoundTrip(ours, ids, out, hf_err)


def tiny_config(family: str, **overrides):
    """A tiny ModelConfig of ``family`` that its HF layout can express (no transformers needed)."""
    from moe_models import ModelConfig

    common = {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_attention_heads": 4, "kv_channels": 8}
    common |= {"num_query_groups": 2, "ffn_hidden_size": 48, "moe_ffn_hidden_size": 24, "num_moe_experts": 8}
    family_fields = {
        "qwen3_moe": {"moe_layer_freq": [1, 0]},
        # all-MoE families: config.json has one intermediate_size, read as both widths
        "mixtral": {"qk_layernorm": False, "window_size": WINDOW, "ffn_hidden_size": 24},
        "deepseek_v3": {
            "qk_layernorm": False,
            "multi_latent_attention": True,
            "num_query_groups": 4,
            "q_lora_rank": 16,
            "kv_lora_rank": 12,
            "qk_head_dim": 8,
            "qk_pos_emb_head_dim": 8,
            "v_head_dim": 8,
            "rotary_interleaved": True,
            "num_layers": 3,
            "moe_layer_freq": [0, 1, 1],
            "moe_shared_expert_intermediate_size": 48,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
            "moe_router_num_groups": 2,
            "moe_router_group_topk": 1,
            "moe_router_topk_scaling_factor": 2.5,
        },
        "gpt_oss": {
            "qk_layernorm": False,
            "add_qkv_bias": True,
            "add_bias_linear": True,
            "softmax_type": "learnable",
            "activation_func": "swiglu_oai",
            "window_size": WINDOW,
            "window_attn_skip_freq": 2,
            "num_moe_experts": 4,
            "ffn_hidden_size": 24,
        },
    }[family]
    return ModelConfig(family=family, **(common | family_fields | overrides))


def tiny_model(family: str, seed: int = 0, **overrides):
    """A randomised model of ``tiny_config(family, **overrides)``, in eval mode."""
    from moe_models import build_model

    torch.manual_seed(seed)
    model = build_model(tiny_config(family, **overrides))
    randomize_(model, seed)
    return model.eval()
