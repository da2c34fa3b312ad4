"""The Mamba-2 mixer layer (Nemotron-H's) against transformers' ``NemotronHMamba2Mixer`` on the same weights, loaded
by name (its state dict loads into ours strictly, so the parameters map 1:1): in fp32, the output within 1e-5 of its
largest value and the gradients of the input and of every parameter within 1e-5 of the largest gradient (see
``_error``), over tiny random configs (one and several B/C groups, head and state sizes, sequences not a multiple of
the chunk, conv and projection biases on and off, time-step clamps that bite).
transformers runs its reference PyTorch path: the CUDA packages it would prefer are absent, and its module is in eval
mode (no fused training kernel).

Packed documents compute each document as alone (outputs and gradients within 1e-6); rows of one document each compute
as unpacked rows; given positions (a context-parallel rank's) in any order of their runs compute the whole
row (fp64, 1e-12, with gradients). Splitting each of in_proj's parts, the conv channels and the per-head
parameters in halves gives two layers of half the heads and groups whose outputs sum to the whole layer's (what tensor
parallelism would compute). Bad Mamba config values raise ModelConfigError naming the field."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
from _hf_reference import randomize_, rel_err
from _packed_rows import (
    PACKING,
    POSITION_ORDERS,
    SEQ,
    assert_each_document_computes_as_alone,
    assert_given_positions_must_tile_and_not_come_with_documents,
    assert_positions_in_any_order_compute_the_whole_row,
    assert_rows_of_one_document_compute_as_unpacked,
    document_ids,
    relative,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

from moe_models.config import ModelConfig, ModelConfigError
from moe_models.mamba import Mamba2Mixer

TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class Case:
    groups: int = 2
    heads_per_group: int = 2
    head_dim: int = 4
    state_dim: int = 4
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    chunk: int = 8
    dt_min: float = 0.0
    dt_max: float | None = None
    hidden: int = 12
    batch: int = 2
    seq: int = 13


def our_config(case: Case) -> ModelConfig:
    return ModelConfig(
        hidden_size=case.hidden,
        mamba_num_groups=case.groups,
        mamba_num_heads=case.groups * case.heads_per_group,
        mamba_head_dim=case.head_dim,
        mamba_state_dim=case.state_dim,
        mamba_conv_kernel_dim=case.conv_kernel,
        mamba_conv_bias=case.conv_bias,
        mamba_proj_bias=case.proj_bias,
        mamba_chunk_size=case.chunk,
        mamba_dt_clamp_min=case.dt_min,
        mamba_dt_clamp_max=case.dt_max,
        norm_epsilon=1e-5,
    )


def hf_mixer(case: Case, seed: int) -> NemotronHMamba2Mixer:
    """transformers' mixer of the case, every parameter random (not its init's ones and aranges, which hide mix-ups),
    in eval mode."""
    assert importlib.util.find_spec("mamba_ssm") is None and importlib.util.find_spec("causal_conv1d") is None, (
        "the reference must be transformers' torch path: mamba_ssm / causal_conv1d are installed"
    )
    config = NemotronHConfig(
        hidden_size=case.hidden,
        layers_block_type=["linear_attention"],  # a Mamba layer
        mamba_num_heads=case.groups * case.heads_per_group,
        mamba_head_dim=case.head_dim,
        n_groups=case.groups,
        ssm_state_size=case.state_dim,
        conv_kernel=case.conv_kernel,
        use_conv_bias=case.conv_bias,
        use_bias=case.proj_bias,
        chunk_size=case.chunk,
        time_step_min=case.dt_min,
        layer_norm_epsilon=1e-5,
    )
    mixer = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    if case.dt_max is not None:  # transformers' config has no upper clamp; its scan applies this pair
        mixer.time_step_limit = (case.dt_min, case.dt_max)
    randomize_(mixer, seed)
    with torch.no_grad():
        mixer.dt_bias.sub_(1.0)  # time steps about 0.1 to 2: clamps at 0.5 and 1.2 both bite
    return mixer


def _by_group(whole: torch.Tensor, groups: int, parts: list[int]) -> torch.Tensor:
    """transformers' rows (each part whole over all groups) as ours: group by group, its share of each part."""
    shares = [part.unflatten(0, (groups, -1)) for part in whole.split(parts)]
    return torch.cat(shares, dim=1).flatten(0, 1)


def as_ours(tensors: dict[str, torch.Tensor], case: Case, prefix: str = "") -> dict[str, torch.Tensor]:
    """transformers' mixer tensors (or their gradients, names under ``prefix``) in our layout: the same names and
    shapes, in_proj's and the conv's rows by group."""
    heads = case.groups * case.heads_per_group
    inner, bc = heads * case.head_dim, case.groups * case.state_dim
    out = dict(tensors)
    for name in ("in_proj.weight", "in_proj.bias", "conv1d.weight", "conv1d.bias"):
        if prefix + name in out:
            parts = [inner, inner, bc, bc, heads] if name.startswith("in_proj.") else [inner, bc, bc]
            out[prefix + name] = _by_group(out[prefix + name], case.groups, parts)
    return out


def ours_from(mixer: NemotronHMamba2Mixer, case: Case) -> Mamba2Mixer:
    ours = Mamba2Mixer(our_config(case))
    ours.load_state_dict(as_ours(mixer.state_dict(), case), strict=True)
    return ours


def outputs_and_grads(module, x_BSH: torch.Tensor, cotangent_BSH: torch.Tensor) -> dict[str, torch.Tensor]:
    x_BSH = x_BSH.detach().clone().requires_grad_()
    out_BSH = module(x_BSH)
    params = dict(module.named_parameters())
    grads = torch.autograd.grad((out_BSH * cotangent_BSH).sum(), [x_BSH, *params.values()])
    named = {f"d_{n}": g for n, g in zip(params, grads[1:], strict=True)}
    return {"out": out_BSH.detach(), "d_input": grads[0]} | named


def assert_matches_transformers(case: Case, seed: int) -> dict[str, float]:
    reference = hf_mixer(case, seed)
    ours = ours_from(reference, case)
    gen = torch.Generator().manual_seed(seed + 1)
    x_BSH = torch.randn(case.batch, case.seq, case.hidden, generator=gen)
    cotangent_BSH = torch.randn(case.batch, case.seq, case.hidden, generator=gen)
    ref = as_ours(outputs_and_grads(reference, x_BSH, cotangent_BSH), case, prefix="d_")
    got = outputs_and_grads(ours, x_BSH, cotangent_BSH)
    assert got.keys() == ref.keys()
    # the gradients share one scale: each is compared to the largest of them (see _error); the output to itself
    grad_scale = max(ref[name].abs().max().item() for name in ref if name != "out")
    errors = {name: _error(got[name], ref[name], ref[name] if name == "out" else grad_scale) for name in ref}
    assert all(error < TOLERANCE for error in errors.values()), (case, errors)
    return errors


def _error(ours: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float) -> float:
    """max |ours - ref| / max |scale|. The gradients are measured against the largest of them, not each against
    itself: in a tiny problem one head's D, A_log or dt_bias gradient (or a conv channel's) sums a few O(1) terms,
    amplified by a gated norm over a small group, that can cancel to 1e-3 of the others, where fp32 leaves transformers
    and us each some 1e-5 relative off the exact (fp64) value (measured: 8e-6 and 4e-5), or to 0 when every time step
    is clamped."""
    scale = float(scale.abs().max()) if isinstance(scale, torch.Tensor) else scale
    return float((ours.double() - ref.double()).abs().max()) / max(scale, 1e-30)


CASES = {
    "one_group": Case(groups=1, heads_per_group=3, head_dim=5),
    "groups": Case(groups=3, heads_per_group=2, seq=21, chunk=4),
    "head_per_group": Case(groups=2, heads_per_group=1, state_dim=6, seq=9),
    "no_conv_bias_proj_bias": Case(conv_bias=False, proj_bias=True, conv_kernel=3, seq=17, chunk=5),
    "dt_clamped_below": Case(dt_min=0.5, seq=15),
    "dt_clamped_both": Case(dt_min=0.5, dt_max=1.2, seq=15, chunk=4),
    "shorter_than_conv_and_chunk": Case(seq=2, conv_kernel=4, chunk=8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_mixer_with_gradients(name: str) -> None:
    assert_matches_transformers(CASES[name], seed=len(name))


@st.composite
def cases(draw) -> Case:
    dt_min = draw(st.sampled_from([0.0, 0.5]))
    return Case(
        groups=draw(st.integers(1, 3)),
        heads_per_group=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(2, 6)),  # a norm over one channel is all cancellation
        state_dim=draw(st.integers(1, 6)),
        conv_kernel=draw(st.integers(1, 4)),
        conv_bias=draw(st.booleans()),
        proj_bias=draw(st.booleans()),
        chunk=draw(st.integers(2, 8)),
        dt_min=dt_min,
        dt_max=draw(st.sampled_from([None, 1.2])),
        hidden=draw(st.sampled_from([4, 8, 12])),
        batch=draw(st.integers(1, 2)),
        seq=draw(st.integers(1, 24)),
    )


@settings(max_examples=25, deadline=None)
@given(cases(), st.integers(0, 2**16))
def test_random_tiny_configs_match_transformers_mixer(case: Case, seed: int) -> None:
    assert_matches_transformers(case, seed)


def test_the_time_step_clamps_change_the_output() -> None:
    """The clamp cases above exercise the clamp: without it the output moves."""
    case = CASES["dt_clamped_both"]
    x_BSH = torch.randn(case.batch, case.seq, case.hidden, generator=torch.Generator().manual_seed(0))
    clamped = ours_from(hf_mixer(case, seed=3), case)
    free = dataclasses.replace(case, dt_min=0.0, dt_max=None)
    unclamped = ours_from(hf_mixer(free, seed=3), free)
    with torch.no_grad():
        assert rel_err(unclamped(x_BSH), clamped(x_BSH)) > 1e-2


# --- packed documents ---

# the rows of _packed_rows.PACKING, in chunks of 4 positions
PACKED_CASE = Case(groups=2, heads_per_group=2, chunk=4, dt_min=0.1, hidden=12)


def _layer() -> Mamba2Mixer:
    return ours_from(hf_mixer(PACKED_CASE, seed=5), PACKED_CASE)


def test_a_packed_row_computes_each_document_as_alone_with_gradients() -> None:
    assert_each_document_computes_as_alone(_layer(), PACKED_CASE.hidden, PACKED_CASE.hidden)


def test_rows_of_one_document_each_compute_as_unpacked_rows() -> None:
    assert_rows_of_one_document_compute_as_unpacked(_layer(), PACKED_CASE.hidden)


@pytest.mark.parametrize("order", POSITION_ORDERS.values(), ids=POSITION_ORDERS.keys())
def test_given_positions_compute_each_segment_from_the_states_before_it(order: list) -> None:
    assert_positions_in_any_order_compute_the_whole_row(
        _layer().double(), PACKED_CASE.hidden, PACKED_CASE.hidden, order
    )


def test_given_positions_must_tile_the_sequences_and_not_come_with_documents() -> None:
    assert_given_positions_must_tile_and_not_come_with_documents(_layer(), PACKED_CASE.hidden)


# --- a split of the heads ---


def _half_of(name: str, whole: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s half of a parameter split contiguously (in_proj's and the conv's rows, grouped by B/C group,
    the per-head and per-channel parameters), out_proj by its input columns, the out_proj bias on rank 0 only."""
    if name == "out_proj.weight":
        return whole.chunk(2, dim=1)[rank]
    if name == "out_proj.bias":
        return whole if rank == 0 else torch.zeros_like(whole)
    return whole.chunk(2)[rank]


@pytest.mark.parametrize("packed", [False, True])
def test_a_contiguous_split_is_a_split_of_the_heads_and_groups(packed: bool) -> None:
    """Two half mixers, each holding the contiguous half of every parameter (what tensor parallelism's column split
    gives), sum to the whole mixer's output."""
    case = dataclasses.replace(PACKED_CASE, proj_bias=True)
    layer = ours_from(hf_mixer(case, seed=7), case)
    half = dataclasses.replace(case, groups=case.groups // 2)
    docs_BS = document_ids(PACKING, SEQ) if packed else None
    x_BSH = torch.randn(len(PACKING), SEQ, case.hidden, generator=torch.Generator().manual_seed(3))
    total = torch.zeros(())
    with torch.no_grad():
        for rank in range(2):
            shard = Mamba2Mixer(our_config(half))
            for name, p in shard.named_parameters():
                p.copy_(_half_of(name, layer.get_parameter(name), rank))
            total = total + shard(x_BSH, document_ids_BS=docs_BS)
        assert relative(total, layer(x_BSH, document_ids_BS=docs_BS)) < 1e-6


# --- configuration ---


def test_the_defaults_are_valid_and_nemotron_h_sized() -> None:
    c = ModelConfig()
    assert (c.mamba_num_heads, c.mamba_head_dim, c.mamba_num_groups, c.mamba_state_dim) == (128, 64, 8, 128)
    assert (c.mamba_dt_clamp_min, c.mamba_dt_clamp_max) == (0.0, None)


@pytest.mark.parametrize(
    ("field", "value", "others"),
    [
        ("mamba_state_dim", 0, {}),
        ("mamba_head_dim", 0, {}),
        ("mamba_num_groups", 0, {}),
        ("mamba_num_heads", 0, {}),
        ("mamba_conv_kernel_dim", 0, {}),
        ("mamba_chunk_size", 0, {}),
        ("mamba_num_heads", 6, {"mamba_num_groups": 4}),
        ("mamba_dt_clamp_min", -0.1, {}),
        ("mamba_dt_clamp_min", math.inf, {}),
        ("mamba_dt_clamp_min", math.nan, {}),
        ("mamba_dt_clamp_max", 0.0, {}),
        ("mamba_dt_clamp_max", 0.5, {"mamba_dt_clamp_min": 0.5}),
        ("mamba_dt_clamp_max", math.nan, {}),
    ],
)
def test_bad_values_name_the_field(field: str, value: object, others: dict) -> None:
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(**{field: value, **others})
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}=")
