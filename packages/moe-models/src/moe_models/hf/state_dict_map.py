"""Tensor-by-tensor mapping between our state dict and a HuggingFace checkpoint of the same ModelConfig.

A plan lists, for every tensor of ours, the HF tensors it is assembled from (with their full on-disk shapes, and
the expert rows to read when only some experts are wanted) and the two layout conversions. The plan alone decides
what is read, so a rank that owns 8 of 256 experts never touches the other 248.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moe_models.config import ModelConfig
from moe_models.hf.config_map import FAMILIES

Tensor = torch.Tensor


@dataclass(frozen=True)
class Source:
    """One HF tensor: its name, its full shape on disk, and the rows of dim 0 to read (None: all)."""

    key: str
    shape: tuple[int, ...]
    rows: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Entry:
    """One tensor of ours and the HF tensors it is made of; ``to_hf`` is None for read-only layouts."""

    ours: str
    sources: tuple[Source, ...]
    to_ours: Callable[[list[Tensor]], Tensor]
    to_hf: Callable[[Tensor], list[Tensor]] | None


@dataclass
class Plan:
    """Every entry of a config, plus the HF tensors written on save only (copies, zeros) and ignored on load."""

    entries: list[Entry] = field(default_factory=list)
    copies: dict[str, str] = field(default_factory=dict)  # HF name -> our tensor it duplicates
    zeros: dict[str, tuple[int, ...]] = field(default_factory=dict)  # HF name -> shape, written as zeros
    ignored: set[str] = field(default_factory=set)  # HF names that may be in a checkpoint and are not read

    def hf_keys(self) -> set[str]:
        """The HF tensors this plan reads."""
        return {s.key for e in self.entries for s in e.sources}


def _first(ts: list[Tensor]) -> Tensor:
    return ts[0]


def _alone(t: Tensor) -> list[Tensor]:
    return [t]


def _transpose(ts: list[Tensor]) -> Tensor:
    return ts[0].transpose(-1, -2)


def _transpose_back(t: Tensor) -> list[Tensor]:
    return [t.transpose(-1, -2)]


def _squeeze_rows(ts: list[Tensor]) -> Tensor:
    return ts[0].squeeze(0)


def _unsqueeze_rows(t: Tensor) -> list[Tensor]:
    return [t.unsqueeze(0)]


def _copy(plan: Plan, ours: str, key: str, shape: tuple[int, ...], rows: tuple[int, ...] | None = None) -> None:
    plan.entries.append(Entry(ours, (Source(key, shape, rows),), _first, _alone))


def _gate_up_to_ours(ts: list[Tensor]) -> Tensor:
    # sources alternate gate, up ([F, H] each) per expert; ours is [H, 2F] per expert, gate columns first
    pairs = [torch.cat([g.T, u.T], dim=1) for g, u in zip(ts[0::2], ts[1::2], strict=True)]
    return torch.stack(pairs)


def _gate_up_to_hf(t_EH2F: Tensor) -> list[Tensor]:
    width = t_EH2F.shape[-1] // 2
    return [part for w_H2F in t_EH2F for part in (w_H2F[:, :width].T, w_H2F[:, width:].T)]


def _down_to_ours(ts: list[Tensor]) -> Tensor:
    return torch.stack([d.T for d in ts])


def _down_to_hf(t_EFH: Tensor) -> list[Tensor]:
    return [w_FH.T for w_FH in t_EFH]


def _shared_gate_up_to_ours(ts: list[Tensor]) -> Tensor:
    return torch.cat([ts[0].T, ts[1].T], dim=1)


def _shared_gate_up_to_hf(t_H2F: Tensor) -> list[Tensor]:
    width = t_H2F.shape[-1] // 2
    return [t_H2F[:, :width].T, t_H2F[:, width:].T]


def _gqa_attention(plan: Plan, c: ModelConfig, ours: str, hf: str) -> None:
    h, q_width, kv_width = c.hidden_size, c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    q_rows = 2 * q_width if c.attention_output_gate else q_width  # per head [q, gate] in both layouts
    for name, rows, cols in (("q_proj", q_rows, h), ("k_proj", kv_width, h), ("v_proj", kv_width, h)):
        _copy(plan, f"{ours}.{name}.weight", f"{hf}.{name}.weight", (rows, cols))
        if c.add_qkv_bias:
            _copy(plan, f"{ours}.{name}.bias", f"{hf}.{name}.bias", (rows,))
    _copy(plan, f"{ours}.o_proj.weight", f"{hf}.o_proj.weight", (h, q_width))
    if c.add_bias_linear:
        _copy(plan, f"{ours}.o_proj.bias", f"{hf}.o_proj.bias", (h,))
    if c.qk_layernorm:
        names = FAMILIES[c.family].names
        q_norm, k_norm = (q_width, kv_width) if c.qk_layernorm_across_heads else (c.kv_channels, c.kv_channels)
        _copy(plan, f"{ours}.q_norm.weight", f"{hf}.{names.q_norm}.weight", (q_norm,))
        _copy(plan, f"{ours}.k_norm.weight", f"{hf}.{names.k_norm}.weight", (k_norm,))
    if c.softmax_type == "learnable":
        _copy(plan, f"{ours}.sinks", f"{hf}.{FAMILIES[c.family].names.sinks}", (c.num_attention_heads,))


def _gated_delta_net_in_proj(
    c: ModelConfig,
) -> tuple[Callable[[list[Tensor]], Tensor], Callable[[Tensor], list[Tensor]]]:
    """Our ``in_proj`` rows, per key head ``[q, k, v, z, b, a]`` of the head and its value heads <-> transformers'
    ``in_proj_qkvz`` (per key head ``[q, k, v, z]``) and ``in_proj_ba`` (per key head ``[b, a]``): each head's rows
    of the one, then of the other."""
    key_heads, per_key = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads
    qkvz = 2 * c.linear_key_head_dim + 2 * per_key * c.linear_value_head_dim

    def to_ours(ts: list[Tensor]) -> Tensor:
        return torch.cat([t.unflatten(0, (key_heads, -1)) for t in ts], dim=1).flatten(0, 1)

    def to_hf(t: Tensor) -> list[Tensor]:
        return [p.flatten(0, 1) for p in t.unflatten(0, (key_heads, -1)).split([qkvz, 2 * per_key], dim=1)]

    return to_ours, to_hf


def _gated_delta_net_split_in_proj(
    c: ModelConfig,
) -> tuple[Callable[[list[Tensor]], Tensor], Callable[[Tensor], list[Tensor]]]:
    """Our ``in_proj`` rows, per key head ``[q, k, v, z, b, a]`` of the head and its value heads <-> Qwen3.5's
    ``in_proj_qkv`` (``[q, k, v]``, each over all heads), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` (over all value
    heads): value head ``j`` is key head ``j // (value heads / key heads)``'s."""
    key_heads, dk = c.linear_num_key_heads, c.linear_key_head_dim
    value = c.linear_num_value_heads * c.linear_value_head_dim
    qkv_parts = [key_heads * dk, key_heads * dk, value]

    def to_ours(ts: list[Tensor]) -> Tensor:
        qkv, z, b, a = ts
        parts = [*qkv.split(qkv_parts), z, b, a]
        return torch.cat([p.unflatten(0, (key_heads, -1)) for p in parts], dim=1).flatten(0, 1)

    def to_hf(t: Tensor) -> list[Tensor]:
        per_head = [n // key_heads for n in (*qkv_parts, value, c.linear_num_value_heads, c.linear_num_value_heads)]
        q, k, v, z, b, a = (p.flatten(0, 1) for p in t.unflatten(0, (key_heads, -1)).split(per_head, dim=1))
        return [torch.cat([q, k, v]), z, b, a]

    return to_ours, to_hf


def _rows_by_group(
    groups: int, parts: list[int]
) -> tuple[Callable[[list[Tensor]], Tensor], Callable[[Tensor], list[Tensor]]]:
    """Our rows (dim 0), per group the group's share of each part in turn, <-> transformers' rows, each part whole
    over all groups in order (``parts``: each part's rows over all groups)."""
    per_group = [n // groups for n in parts]

    def to_ours(ts: list[Tensor]) -> Tensor:
        by_group = [p.unflatten(0, (groups, -1)) for p in ts[0].split(parts)]
        return torch.cat(by_group, dim=1).flatten(0, 1)

    def to_hf(t: Tensor) -> list[Tensor]:
        return [torch.cat([p.flatten(0, 1) for p in t.unflatten(0, (groups, -1)).split(per_group, dim=1)])]

    return to_ours, to_hf


def _gated_delta_net_conv(
    c: ModelConfig,
) -> tuple[Callable[[list[Tensor]], Tensor], Callable[[Tensor], list[Tensor]]]:
    """Our conv channels, per key head ``[q, k, v]`` of the head and its value heads <-> transformers' ``conv1d``
    channels ``[q, k, v]``, each over all heads."""
    key_heads, dk = c.linear_num_key_heads, c.linear_key_head_dim
    return _rows_by_group(
        key_heads, [key_heads * dk, key_heads * dk, c.linear_num_value_heads * c.linear_value_head_dim]
    )


def _gated_delta_net(plan: Plan, c: ModelConfig, ours: str, hf: str) -> None:
    """A Gated DeltaNet layer (``linear_attn`` in transformers' Qwen3-Next and Qwen3.5)."""
    h, key = c.hidden_size, c.linear_num_key_heads * c.linear_key_head_dim
    value, heads = c.linear_num_value_heads * c.linear_value_head_dim, c.linear_num_value_heads
    if FAMILIES[c.family].names.linear_in_proj_split:
        sources = (
            Source(f"{hf}.in_proj_qkv.weight", (2 * key + value, h)),
            Source(f"{hf}.in_proj_z.weight", (value, h)),
            Source(f"{hf}.in_proj_b.weight", (heads, h)),
            Source(f"{hf}.in_proj_a.weight", (heads, h)),
        )
        plan.entries.append(Entry(f"{ours}.in_proj.weight", sources, *_gated_delta_net_split_in_proj(c)))
    else:
        sources = (
            Source(f"{hf}.in_proj_qkvz.weight", (2 * key + 2 * value, h)),
            Source(f"{hf}.in_proj_ba.weight", (2 * heads, h)),
        )
        plan.entries.append(Entry(f"{ours}.in_proj.weight", sources, *_gated_delta_net_in_proj(c)))
    conv = (Source(f"{hf}.conv1d.weight", (2 * key + value, 1, c.linear_conv_kernel_dim)),)
    plan.entries.append(Entry(f"{ours}.conv1d.weight", conv, *_gated_delta_net_conv(c)))
    _copy(plan, f"{ours}.A_log", f"{hf}.A_log", (heads,))
    _copy(plan, f"{ours}.dt_bias", f"{hf}.dt_bias", (heads,))
    _copy(plan, f"{ours}.norm.weight", f"{hf}.norm.weight", (c.linear_value_head_dim,))
    _copy(plan, f"{ours}.out_proj.weight", f"{hf}.out_proj.weight", (h, value))


def _concat_rows(ts: list[Tensor]) -> Tensor:
    return torch.cat(ts)


def _split_rows_in_three(t: Tensor) -> list[Tensor]:
    return list(t.chunk(3))


def _kimi_delta(plan: Plan, c: ModelConfig, ours: str, hf: str) -> None:
    """A Kimi Delta Attention layer as Kimi Linear's checkpoints store it: transformers' ``KimiLinearDeltaAttention``
    tensors, but the convolution apart per q, k and v (``q_conv1d`` ... ; ours is their rows in turn) and the forget
    gate's tensors beside the others (ours under ``forget_gate.``)."""
    h, heads, dim = c.hidden_size, c.linear_num_key_heads, c.linear_key_head_dim
    width = heads * dim
    conv = tuple(Source(f"{hf}.{x}_conv1d.weight", (width, 1, c.linear_conv_kernel_dim)) for x in "qkv")
    plan.entries.append(Entry(f"{ours}.conv1d.weight", conv, _concat_rows, _split_rows_in_three))
    gate = {"f_a_proj.weight": (dim, h), "f_b_proj.weight": (width, dim), "dt_bias": (width,)}
    gate["A_log"] = (1, 1, heads, 1)
    for name, shape in gate.items():
        _copy(plan, f"{ours}.forget_gate.{name}", f"{hf}.{name}", shape)
    shapes = {f"{x}_proj.weight": (width, h) for x in "qkv"}
    shapes |= {"b_proj.weight": (heads, h), "g_a_proj.weight": (dim, h), "g_b_proj.weight": (width, dim)}
    shapes |= {"o_norm.weight": (dim,), "o_proj.weight": (h, width)}
    for name, shape in shapes.items():
        _copy(plan, f"{ours}.{name}", f"{hf}.{name}", shape)


def _mla_attention(plan: Plan, c: ModelConfig, ours: str, hf: str) -> None:
    h, n, rope = c.hidden_size, c.num_attention_heads, c.qk_pos_emb_head_dim
    q_width = n * (c.qk_head_dim + rope)
    if c.q_lora_rank is None:
        _copy(plan, f"{ours}.q_proj.weight", f"{hf}.q_proj.weight", (q_width, h))
    else:
        _copy(plan, f"{ours}.q_a_proj.weight", f"{hf}.q_a_proj.weight", (c.q_lora_rank, h))
        _copy(plan, f"{ours}.q_a_norm.weight", f"{hf}.q_a_layernorm.weight", (c.q_lora_rank,))
        _copy(plan, f"{ours}.q_b_proj.weight", f"{hf}.q_b_proj.weight", (q_width, c.q_lora_rank))
    _copy(plan, f"{ours}.kv_a_proj.weight", f"{hf}.kv_a_proj_with_mqa.weight", (c.kv_lora_rank + rope, h))
    _copy(plan, f"{ours}.kv_a_norm.weight", f"{hf}.kv_a_layernorm.weight", (c.kv_lora_rank,))
    kv_b_shape = (n * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank)
    _copy(plan, f"{ours}.kv_b_proj.weight", f"{hf}.kv_b_proj.weight", kv_b_shape)
    _copy(plan, f"{ours}.o_proj.weight", f"{hf}.o_proj.weight", (h, n * c.v_head_dim))
    if c.dsa_indexer_topk is not None:  # DeepSeek Sparse Attention's lightning indexer, under the same names
        heads, dim = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim
        for name, shape in (
            ("wq_b.weight", (heads * dim, c.q_lora_rank)),
            ("wk.weight", (dim, h)),
            ("k_norm.weight", (dim,)),
            ("k_norm.bias", (dim,)),
            ("weights_proj.weight", (heads, h)),
        ):
            _copy(plan, f"{ours}.indexer.{name}", f"{hf}.indexer.{name}", shape)


def _dense_mlp(plan: Plan, c: ModelConfig, ours: str, hf: str) -> None:
    h, f = c.hidden_size, c.ffn_hidden_size
    for name, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
        _copy(plan, f"{ours}.{name}.weight", f"{hf}.{name}.weight", shape)


def _routed_experts(
    plan: Plan, c: ModelConfig, ours: str, hf: str, experts: tuple[int, ...], available: set[str] | None
) -> None:
    e, h, f = c.num_moe_experts, c.hidden_size, c.moe_ffn_hidden_size
    rows = None if experts == tuple(range(e)) else experts
    if c.activation_func == "swiglu_oai":  # GPT-OSS stores the fused [E, ...] tensors we use, gate/up interleaved
        _copy(plan, f"{ours}.w_gate_up_EH2F", f"{hf}.gate_up_proj", (e, h, 2 * f), rows)
        _copy(plan, f"{ours}.b_gate_up_E2F", f"{hf}.gate_up_proj_bias", (e, 2 * f), rows)
        _copy(plan, f"{ours}.w_down_EFH", f"{hf}.down_proj", (e, f, h), rows)
        _copy(plan, f"{ours}.b_down_EH", f"{hf}.down_proj_bias", (e, h), rows)
        return
    if FAMILIES[c.family].names.experts_fused:
        _copy(plan, f"{ours}.w_gate_up_EH2F", f"{hf}.gate_up_proj", (e, h, 2 * f), rows)
        _copy(plan, f"{ours}.w_down_EFH", f"{hf}.down_proj", (e, f, h), rows)
        return
    if available is not None and f"{hf}.gate_up_proj" in available:
        # transformers 5's in-memory layout ([E, 2F, H] gate rows first, [E, H, F]): read, never written
        gate_up = Source(f"{hf}.gate_up_proj", (e, 2 * f, h), rows)
        plan.entries.append(Entry(f"{ours}.w_gate_up_EH2F", (gate_up,), _transpose, None))
        down = Source(f"{hf}.down_proj", (e, h, f), rows)
        plan.entries.append(Entry(f"{ours}.w_down_EFH", (down,), _transpose, None))
        return
    gate, up, down = FAMILIES[c.family].names.expert_projections
    gate_up = tuple(Source(f"{hf}.{i}.{p}.weight", (f, h)) for i in experts for p in (gate, up))
    plan.entries.append(Entry(f"{ours}.w_gate_up_EH2F", gate_up, _gate_up_to_ours, _gate_up_to_hf))
    downs = tuple(Source(f"{hf}.{i}.{down}.weight", (h, f)) for i in experts)
    plan.entries.append(Entry(f"{ours}.w_down_EFH", downs, _down_to_ours, _down_to_hf))


def _moe_mlp(
    plan: Plan, c: ModelConfig, ours: str, hf: str, experts: tuple[int, ...], available: set[str] | None
) -> None:
    names = FAMILIES[c.family].names
    block, e, h = f"{hf}.{names.moe_block}", c.num_moe_experts, c.hidden_size
    _copy(plan, f"{ours}.router.weight", f"{block}.{names.router}.weight", (e, h))
    if c.add_bias_linear:
        _copy(plan, f"{ours}.router.bias", f"{block}.{names.router}.bias", (e,))
    bias_shape = (1, e) if names.expert_bias_2d else (e,)
    if c.moe_router_enable_expert_bias and names.expert_bias_2d:
        source = (Source(f"{block}.{names.expert_bias}", bias_shape),)
        plan.entries.append(Entry(f"{ours}.router.expert_bias", source, _squeeze_rows, _unsqueeze_rows))
    elif c.moe_router_enable_expert_bias:
        _copy(plan, f"{ours}.router.expert_bias", f"{block}.{names.expert_bias}", (e,))
    elif names.expert_bias_always:  # transformers' router always has the bias: zeros are ours
        plan.zeros[f"{block}.{names.expert_bias}"] = bias_shape
        plan.ignored.add(f"{block}.{names.expert_bias}")
    _routed_experts(plan, c, f"{ours}.experts", f"{block}.experts", experts, available)
    if c.moe_shared_expert_intermediate_size is not None:
        f, shared = c.moe_shared_expert_intermediate_size, f"{block}.{names.shared_experts}"
        sources = (Source(f"{shared}.gate_proj.weight", (f, h)), Source(f"{shared}.up_proj.weight", (f, h)))
        entry = Entry(f"{ours}.shared_experts.w_gate_up_H2F", sources, _shared_gate_up_to_ours, _shared_gate_up_to_hf)
        plan.entries.append(entry)
        down = (Source(f"{shared}.down_proj.weight", (h, f)),)
        plan.entries.append(Entry(f"{ours}.shared_experts.w_down_FH", down, _transpose, _transpose_back))
        if c.moe_shared_expert_gate:  # [1, H] in the checkpoint, [H, 1] ours
            gate = (Source(f"{block}.{names.shared_expert_gate}.weight", (1, h)),)
            plan.entries.append(Entry(f"{ours}.shared_experts.w_gate_H1", gate, _transpose, _transpose_back))


def _decoder_layer(
    plan: Plan,
    c: ModelConfig,
    ours: str,
    hf: str,
    moe: bool,
    experts: tuple[int, ...],
    available: set[str] | None,
    linear: bool = False,
) -> None:
    h = c.hidden_size
    _copy(plan, f"{ours}.input_norm.weight", f"{hf}.input_layernorm.weight", (h,))
    _copy(plan, f"{ours}.post_attention_norm.weight", f"{hf}.post_attention_layernorm.weight", (h,))
    if linear and c.experimental_attention_variant == "kimi_delta_attention":
        _kimi_delta(plan, c, f"{ours}.attention", f"{hf}.self_attn")
    elif linear:
        _gated_delta_net(plan, c, f"{ours}.attention", f"{hf}.linear_attn")
    else:
        attention = _mla_attention if c.multi_latent_attention else _gqa_attention
        attention(plan, c, f"{ours}.attention", f"{hf}.self_attn")
    if moe:
        _moe_mlp(plan, c, f"{ours}.mlp", hf, experts, available)
    else:
        names = FAMILIES[c.family].names
        dense = names.dense_mlp
        if available is not None and f"{hf}.{names.moe_block}.gate_proj.weight" in available:
            dense = names.moe_block  # transformers' Kimi Linear saves a dense MLP under the MoE block's name: read it
        _dense_mlp(plan, c, f"{ours}.mlp", f"{hf}.{dense}")


def _mtp(plan: Plan, c: ModelConfig, k: int, experts: tuple[int, ...], available: set[str] | None) -> None:
    # DeepSeek-V3's published layout: MTP module k is decoder layer num_layers + k with extra tensors
    ours, hf, h = f"mtp.{k}", f"model.layers.{c.num_layers + k}", c.hidden_size
    _copy(plan, f"{ours}.enorm.weight", f"{hf}.enorm.weight", (h,))
    _copy(plan, f"{ours}.hnorm.weight", f"{hf}.hnorm.weight", (h,))
    _copy(plan, f"{ours}.eh_proj.weight", f"{hf}.eh_proj.weight", (h, 2 * h))
    _copy(plan, f"{ours}.final_norm.weight", f"{hf}.shared_head.norm.weight", (h,))
    _decoder_layer(plan, c, f"{ours}.layer", hf, True, experts, available)
    # the module shares the main model's embedding and head; the checkpoint carries copies of them
    plan.copies[f"{hf}.embed_tokens.weight"] = "embed_tokens.weight"
    plan.copies[f"{hf}.shared_head.head.weight"] = "lm_head.weight"


def _mamba_mixer(plan: Plan, c: ModelConfig, ours: str, hf: str) -> None:
    """A Mamba-2 mixer: transformers' ``NemotronHMamba2Mixer`` tensors under the same names, ``in_proj``'s and the
    conv's rows regrouped by B/C group (:mod:`moe_models.mamba`)."""
    h, heads, groups = c.hidden_size, c.mamba_num_heads, c.mamba_num_groups
    inner, bc = heads * c.mamba_head_dim, groups * c.mamba_state_dim
    in_rows, conv_rows = _rows_by_group(groups, [inner, inner, bc, bc, heads]), _rows_by_group(groups, [inner, bc, bc])
    grouped = {
        "in_proj.weight": ((2 * inner + 2 * bc + heads, h), in_rows),
        "conv1d.weight": ((inner + 2 * bc, 1, c.mamba_conv_kernel_dim), conv_rows),
    }
    if c.mamba_conv_bias:
        grouped["conv1d.bias"] = ((inner + 2 * bc,), conv_rows)
    if c.mamba_proj_bias:
        grouped["in_proj.bias"] = ((2 * inner + 2 * bc + heads,), in_rows)
        _copy(plan, f"{ours}.out_proj.bias", f"{hf}.out_proj.bias", (h,))
    for name, (shape, (to_ours, to_hf)) in grouped.items():
        plan.entries.append(Entry(f"{ours}.{name}", (Source(f"{hf}.{name}", shape),), to_ours, to_hf))
    for name, shape in (("dt_bias", (heads,)), ("A_log", (heads,)), ("D", (heads,)), ("norm.weight", (inner,))):
        _copy(plan, f"{ours}.{name}", f"{hf}.{name}", shape)
    _copy(plan, f"{ours}.out_proj.weight", f"{hf}.out_proj.weight", (h, inner))


def _non_gated_moe(
    plan: Plan, c: ModelConfig, ours: str, hf: str, experts: tuple[int, ...], available: set[str] | None
) -> None:
    """Nemotron-H's MoE: DeepSeek-V3's router (its bias always stored), non-gated routed experts (``up_proj``,
    ``down_proj`` each) and one non-gated shared expert."""
    e, h, f = c.num_moe_experts, c.hidden_size, c.moe_ffn_hidden_size
    _copy(plan, f"{ours}.router.weight", f"{hf}.gate.weight", (e, h))
    if c.moe_router_enable_expert_bias:
        _copy(plan, f"{ours}.router.expert_bias", f"{hf}.gate.e_score_correction_bias", (e,))
    else:
        plan.zeros[f"{hf}.gate.e_score_correction_bias"] = (e,)
        plan.ignored.add(f"{hf}.gate.e_score_correction_bias")
    if available is not None and f"{hf}.experts.up_proj" in available:
        # transformers 5's in-memory layout ([E, F, H], [E, H, F]): read, never written
        rows = None if experts == tuple(range(e)) else experts
        up = Source(f"{hf}.experts.up_proj", (e, f, h), rows)
        plan.entries.append(Entry(f"{ours}.experts.w_gate_up_EH2F", (up,), _transpose, None))
        down = Source(f"{hf}.experts.down_proj", (e, h, f), rows)
        plan.entries.append(Entry(f"{ours}.experts.w_down_EFH", (down,), _transpose, None))
    else:  # one [F, H] / [H, F] per expert: each ours is the stack of their transposes
        ups = tuple(Source(f"{hf}.experts.{i}.up_proj.weight", (f, h)) for i in experts)
        plan.entries.append(Entry(f"{ours}.experts.w_gate_up_EH2F", ups, _down_to_ours, _down_to_hf))
        downs = tuple(Source(f"{hf}.experts.{i}.down_proj.weight", (h, f)) for i in experts)
        plan.entries.append(Entry(f"{ours}.experts.w_down_EFH", downs, _down_to_ours, _down_to_hf))
    shared = c.moe_shared_expert_intermediate_size
    for name, key, shape in (("w_gate_up_H2F", "up_proj", (shared, h)), ("w_down_FH", "down_proj", (h, shared))):
        source = (Source(f"{hf}.shared_experts.{key}.weight", shape),)
        plan.entries.append(Entry(f"{ours}.shared_experts.{name}", source, _transpose, _transpose_back))


def _hybrid_plan(c: ModelConfig, experts: tuple[int, ...], available: set[str] | None) -> Plan:
    """Nemotron-H's layout (``hybrid_override_pattern``): ``backbone.embeddings``, one ``norm`` and ``mixer`` per
    layer, ``backbone.norm_f``; a layer's norm is our ``input_norm`` before a token mixer, ``post_attention_norm``
    before a channel mixer."""
    plan, v, h = Plan(), c.vocab_size, c.hidden_size
    _copy(plan, "embed_tokens.weight", "backbone.embeddings.weight", (v, h))
    for i, mixers in enumerate(c.layer_mixers()):
        ours, hf = f"layers.{i}", f"backbone.layers.{i}"
        norm = "input_norm" if mixers.token is not None else "post_attention_norm"
        _copy(plan, f"{ours}.{norm}.weight", f"{hf}.norm.weight", (h,))
        if mixers.token == "mamba":
            _mamba_mixer(plan, c, f"{ours}.attention", f"{hf}.mixer")
        elif mixers.token == "attention":
            _gqa_attention(plan, c, f"{ours}.attention", f"{hf}.mixer")
        elif mixers.channel == "moe":
            _non_gated_moe(plan, c, f"{ours}.mlp", f"{hf}.mixer", experts, available)
        else:
            f = c.ffn_hidden_size
            _copy(plan, f"{ours}.mlp.up_proj.weight", f"{hf}.mixer.up_proj.weight", (f, h))
            _copy(plan, f"{ours}.mlp.down_proj.weight", f"{hf}.mixer.down_proj.weight", (h, f))
    _copy(plan, "norm.weight", "backbone.norm_f.weight", (h,))
    if c.share_embeddings_and_output_weights:
        plan.ignored.add("lm_head.weight")
    else:
        _copy(plan, "lm_head.weight", "lm_head.weight", (v, h))
    return plan


def mtp_prefixes(c: ModelConfig) -> list[str]:
    """The HF name prefix of each MTP module of ``c`` ("model.layers.{num_layers + k}.")."""
    return [f"model.layers.{c.num_layers + k}." for k in range(c.mtp_num_layers or 0)]


def build_plan(c: ModelConfig, *, experts: Sequence[int] | None = None, available: set[str] | None = None) -> Plan:
    """The plan of ``c``; ``experts`` keeps only those routed experts, ``available`` (a checkpoint's names) picks
    transformers' fused expert layout where a checkpoint has it."""
    expert_ids = tuple(range(c.num_moe_experts)) if experts is None else tuple(int(i) for i in experts)
    if c.hybrid_override_pattern is not None:
        return _hybrid_plan(c, expert_ids, available)
    plan, v, h = Plan(), c.vocab_size, c.hidden_size
    _copy(plan, "embed_tokens.weight", "model.embed_tokens.weight", (v, h))
    for i, (moe, linear) in enumerate(zip(c.moe_layer_pattern(), c.linear_attention_pattern(), strict=True)):
        _decoder_layer(plan, c, f"layers.{i}", f"model.layers.{i}", bool(moe), expert_ids, available, bool(linear))
    _copy(plan, "norm.weight", "model.norm.weight", (h,))
    if c.share_embeddings_and_output_weights:
        plan.ignored.add("lm_head.weight")  # some tied checkpoints still carry it
    else:
        _copy(plan, "lm_head.weight", "lm_head.weight", (v, h))
    for k in range(c.mtp_num_layers or 0):
        _mtp(plan, c, k, expert_ids, available)
    plan.ignored |= set(plan.copies)
    return plan


def stored_as_is(entry: Entry) -> bool:
    """Whether our tensor is one HF tensor read whole under another name (so any slice of ours is that slice of it)."""
    return entry.to_ours is _first and len(entry.sources) == 1 and entry.sources[0].rows is None


def is_routed_expert_tensor(ours: str) -> bool:
    """Whether our tensor holds one slice per routed expert (dim 0), i.e. is cut by an expert subset."""
    return ".mlp.experts." in ours
