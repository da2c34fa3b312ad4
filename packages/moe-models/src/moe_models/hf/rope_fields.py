"""config.json's rotary fields (``rope_parameters``, or the legacy ``rope_scaling`` / ``rope_theta``) <-> ModelConfig:
the common reading every family starts from (default rope and YaRN), kept apart from the family registry so that a
family's own reading can build on it."""

from __future__ import annotations

from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.family import required, unsupported


def rope_from_hf(
    hf: dict[str, Any], family: str, *, mla: bool = False, default_theta: float = 10_000.0
) -> dict[str, Any]:
    """The rotary fields of config.json's ``rope_parameters`` (or the legacy ``rope_scaling`` / ``rope_theta``):
    default rope or YaRN, full or partial width. ``mla``: the family's attention is multi-latent (it alone reads
    ``mscale_all_dim``, and it has no partial rotary); ``default_theta``: transformers' base when config.json gives
    none."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise unsupported("rope_parameters", params, "per-layer-type rope parameters; give one global dict")
    theta = params.get("rope_theta", hf.get("rope_theta")) or default_theta
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    out: dict[str, Any] = {"rotary_base": float(theta)}
    if partial not in (None, 1, 1.0):
        if mla:
            raise unsupported("partial_rotary_factor", partial, "MLA rotates qk_rope_head_dim: remove it")
        out["rotary_percent"] = float(partial)
    if rope_type == "default":
        return out | {"rope_type": "rope"}
    if rope_type != "yarn":
        raise unsupported("rope_parameters.rope_type", rope_type, "use 'default' or 'yarn'")
    if params.get("attention_factor") is not None:
        raise unsupported("rope_parameters.attention_factor", params["attention_factor"], "remove it (derived)")
    max_pos = required(hf, "max_position_embeddings")
    original = params.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or max_pos
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    if mscale_all_dim and not mla:
        # only DeepSeek's (MLA) attention multiplies its softmax scale by mscale(factor, mscale_all_dim)**2
        raise unsupported("rope_parameters.mscale_all_dim", mscale_all_dim, f"{family} ignores it; remove it")
    return out | {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(params.get("factor") or max_pos / original),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(params.get("beta_fast") or 32.0),
        "beta_slow": float(params.get("beta_slow") or 1.0),
        "mscale": float(params.get("mscale") or 0.0),
        "mscale_all_dim": mscale_all_dim,
        "rope_yarn_truncate": bool(params.get("truncate", True)),
    }


def rope_to_hf(c: ModelConfig) -> dict[str, Any]:
    """config.json's ``rope_parameters`` of ``c``: default rope or YaRN, full or partial width."""
    rope: dict[str, Any] = {"rope_theta": c.rotary_base, "rope_type": "default"}
    rope |= {"partial_rotary_factor": c.rotary_percent} if c.rotary_percent != 1 else {}
    if c.rope_type == "yarn":
        rope |= {
            "rope_type": "yarn",
            "factor": c.rotary_scaling_factor,
            "original_max_position_embeddings": c.original_max_position_embeddings,
            "beta_fast": c.beta_fast,
            "beta_slow": c.beta_slow,
            "truncate": c.rope_yarn_truncate,
        }
        rope |= {"mscale": c.mscale} if c.mscale else {}
        rope |= {"mscale_all_dim": c.mscale_all_dim} if c.mscale_all_dim else {}
    return rope
