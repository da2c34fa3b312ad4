"""What a HuggingFace model family is to the mapping: its names in config.json and in the checkpoint, and its two
config conversions. One :class:`HFFamily` per family; :mod:`moe_models.hf.config_map` holds the registry.

A conversion from config.json reads the dict through :class:`ReadFields`, which records every key it was asked for,
so that a key the family's mapping never looked at (and does not list as inert) is refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moe_models.config import ModelConfig
from moe_models.hf.errors import HFCheckpointError

_REQUIRED = object()

# keys of every transformers config that say nothing about the computed logits (generation, tokenizer ids, bookkeeping)
GENERIC_INERT = frozenset(
    {
        "_name_or_path",
        "_attn_implementation_autoset",
        "add_cross_attention",
        "architectures",
        "auto_map",
        "bad_words_ids",
        "begin_suppress_tokens",
        "bos_token_id",
        "chunk_size_feed_forward",
        "cross_attention_hidden_size",
        "decoder_start_token_id",
        "diversity_penalty",
        "do_sample",
        "dtype",
        "early_stopping",
        "encoder_no_repeat_ngram_size",
        "eos_token_id",
        "exponential_decay_length_penalty",
        "finetuning_task",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "id2label",
        "is_decoder",
        "is_encoder_decoder",
        "label2id",
        "length_penalty",
        "max_length",
        "min_length",
        "model_type",
        "no_repeat_ngram_size",
        "num_beam_groups",
        "num_beams",
        "num_return_sequences",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "output_scores",
        "pad_token_id",
        "prefix",
        "problem_type",
        "pruned_heads",
        "remove_invalid_values",
        "repetition_penalty",
        "return_dict",
        "return_dict_in_generate",
        "sep_token_id",
        "suppress_tokens",
        "task_specific_params",
        "temperature",
        "tf_legacy_loss",
        "tie_encoder_decoder",
        "tokenizer_class",
        "top_k",
        "top_p",
        "torch_dtype",
        "torchscript",
        "transformers_version",
        "typical_p",
        "use_bfloat16",
        "use_cache",
        "chunk_size",
    }
)


class ReadFields(dict):
    """A config.json dict that records the keys read through ``[]``, ``get`` and ``in``."""

    def __init__(self, values: dict[str, Any]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


def required(hf: dict[str, Any], key: str, default: Any = _REQUIRED) -> Any:
    """``hf[key]``, or ``default``; a one-line error naming the key when it is missing and required."""
    value = hf.get(key, default)
    if value is _REQUIRED:
        raise HFCheckpointError(f"config.json has no {key!r}: add it (see the model's transformers config class)")
    return value


def unsupported(key: str, value: Any, why: str) -> HFCheckpointError:
    """The error for a config.json value the stack cannot reproduce."""
    return HFCheckpointError(f"config.json {key}={value!r} is not supported: {why}")


def require(ok: bool, field: str, value: Any, family: str, why: str) -> None:
    """Refuse to write a ModelConfig ``field`` that ``family``'s checkpoints cannot hold."""
    if not ok:
        raise HFCheckpointError(f"ModelConfig {field}={value!r} cannot be written as a {family} checkpoint: {why}")


def leading_dense_layers(c: ModelConfig) -> tuple[int, bool]:
    """(the dense layers before the first MoE layer, whether every later layer is MoE): config.json's
    ``first_k_dense_replace`` where the second holds."""
    pattern = c.moe_layer_pattern()
    first = pattern.index(1) if 1 in pattern else c.num_layers
    return first, pattern == [0] * first + [1] * (c.num_layers - first)


def require_dense_first(c: ModelConfig) -> int:
    """``first_k_dense_replace`` of ``c``, refusing a layer pattern with a dense layer after a MoE one."""
    first, dense_first = leading_dense_layers(c)
    why = "dense layers first, then MoE (first_k_dense_replace)"
    require(dense_first, "moe_layer_freq", c.moe_layer_freq, c.family, why)
    return first


def refuse_unless(hf: dict[str, Any], key: str, allowed: Any, default: Any, why: str) -> None:
    """Refuse ``hf[key]`` (``default`` when absent) unless it is ``allowed`` (a value, or a tuple of values)."""
    value = hf.get(key, default)
    values = allowed if isinstance(allowed, tuple) else (allowed,)
    if value not in values:
        raise unsupported(key, value, why)


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's rope dict: ``rope_parameters``, else the legacy ``rope_scaling``, else none (empty)."""
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def default_rotary_base(hf: dict[str, Any], theta: float) -> dict[str, float]:
    """``{"rotary_base": theta}`` (the config class's default) when config.json gives no rope_theta, in its rope dict
    or at the top level; else nothing (the rope mapping reads the theta given)."""
    if rope_parameters(hf).get("rope_theta", hf.get("rope_theta")) is None:
        return {"rotary_base": theta}
    return {}


def compact(pattern: list[int]) -> int | list[int]:
    """A per-layer 0/1 list as Megatron's int N (every N-th layer is 1) when it is one, else the list."""
    if not any(pattern):
        return pattern
    for n in range(1, len(pattern) + 1):
        if pattern == [int((i + 1) % n == 0) for i in range(len(pattern))]:
            return n
    return pattern


@dataclass(frozen=True)
class CheckpointNames:
    """Where a family's checkpoints keep a decoder layer's tensors (under ``model.layers.{i}.``)."""

    moe_block: str = "mlp"
    dense_mlp: str = "mlp"  # a dense layer's MLP (gate_proj / up_proj / down_proj under it)
    # the routed experts stored as our fused tensors: experts.gate_up_proj [E, H, 2F] (gate columns, then up) and
    # experts.down_proj [E, F, H] (Llama 4); otherwise one gate/up/down projection per expert
    experts_fused: bool = False
    router: str = "gate"  # under the MoE block
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    expert_bias: str = "gate.e_score_correction_bias"  # under the MoE block
    # transformers' router holds the expert bias even when the family's routing does not use it (written as zeros)
    expert_bias_always: bool = False
    expert_bias_2d: bool = False  # stored [1, E] (ERNIE 4.5's moe_statics), ours [E]
    shared_experts: str = "shared_experts"  # under the MoE block
    shared_expert_gate: str = "shared_expert_gate"  # under the MoE block
    sinks: str = "sinks"  # under self_attn: the learned attention-sink logits (Flint: softmax_offset)
    q_norm: str = "q_norm"  # under self_attn
    k_norm: str = "k_norm"
    # a Gated DeltaNet's input projection as Qwen3.5 stores it: in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, each
    # over all heads in head order; otherwise Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped by key head
    linear_in_proj_split: bool = False


@dataclass(frozen=True)
class HFFamily:
    """A family: ``from_hf`` maps config.json (a :class:`ReadFields`) to ModelConfig fields beyond the common ones,
    ``to_hf`` a ModelConfig to its config.json fields beyond the common ones (raising HFCheckpointError for what the
    family cannot hold); ``inert`` are config.json keys of the family that do not change the logits."""

    name: str
    architecture: str
    model_type: str
    from_hf: Callable[[ReadFields], dict[str, Any]]
    to_hf: Callable[[ModelConfig], dict[str, Any]]
    names: CheckpointNames = field(default_factory=CheckpointNames)
    aliases: tuple[str, ...] = ()  # other model_types read as this family (Kimi-K2: deepseek_v3)
    inert: frozenset[str] = frozenset()
    mla: bool = False  # the attention is multi-latent (its config.json fields differ)
    # the family's checkpoints may carry layers past num_hidden_layers that transformers does not build (MiniMax-M2's
    # MTP modules): their tensors are left unread rather than refused
    layers_past_the_last_ignored: bool = False
    # checkpoint tensors transformers does not read either (a regular expression searched in each name: ERNIE 4.5's
    # MTP block), left unread rather than refused
    unread_key_pattern: str | None = None
    # the family's own reading of the rotary fields (rope_parameters: NTK-alpha, llama3...), instead of the common one
    # (default rope and YaRN); called with the config.json dict and the family name
    rope_from_hf: Callable[[ReadFields, str], dict[str, Any]] | None = None
    # config.json as the family's transformers config class reads it, before the mapping does (Nemotron-H: the number
    # of layers is the length of its layer pattern, whatever num_hidden_layers says)
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None
