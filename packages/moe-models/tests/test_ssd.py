"""The Mamba-2 SSD scan (chunked, recurrent, one step) against a naive step-by-step recurrence in fp64 (outputs, final
states and every input gradient), against transformers' torch scan, step and whole Nemotron-H mixer in fp32; a sequence
split in two with the state carried gives the whole sequence's result; the chunked form's saved memory grows linearly
with the sequence. The gated RMSNorm against transformers'."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _hf_reference import rel_err
from _recurrence_reference import assert_matches_reference, grads_of
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import (
    NemotronHMamba2Mixer,
    NemotronHRMSNormGated,
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)

from moe_memory import SavedTensorBytes
from moe_models.gated_delta import causal_conv1d
from moe_models.ssd import chunk_ssd_scan, gated_rms_norm, recurrent_ssd_scan, recurrent_ssd_step

F64 = torch.float64
NAMES = ("x", "dt", "A", "B", "C", "D", "state")


def naive_ssd(x, dt, A, B, C, D, state):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, one step at a time; x [B, S, N, P], dt
    [B, S, N], A, D [N], B, C [B, S, G, D], state [B, N, P, D]."""
    per_group = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(per_group, dim=2), C.repeat_interleave(per_group, dim=2)
    if state is None:
        state = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    outputs = []
    for t in range(x.shape[1]):
        decay = (dt[:, t] * A).exp()[..., None, None]
        write = torch.einsum("bnp,bnd->bnpd", dt[:, t, :, None] * x[:, t], B[:, t])
        state = decay * state + write
        y = torch.einsum("bnpd,bnd->bnp", state, C[:, t])
        outputs.append(y if D is None else y + D[:, None] * x[:, t])
    return torch.stack(outputs, dim=1), state


# (dt, -A) from uniforms: dt * A near zero, very negative (exp underflows over a chunk), both, and as trained
DECAYS = {
    "near_zero": lambda u, v: (1e-4 * u, 0.5 + v),
    "very_negative": lambda u, v: (4.0 + 4.0 * u, 5.0 + 5.0 * v),
    "mixed": lambda u, v: (torch.where(u < 0.5, 1e-4 * u, 4.0 + 4.0 * u), 0.5 + 5.0 * v),
    "typical": lambda u, v: (F.softplus(4.0 * u - 4.0), torch.exp(2.7 * v)),
}


def make_inputs(seed, batch, seq, groups, per_group, dim_p, dim_d, decay, with_state, with_d, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    heads = groups * per_group

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=F64)

    dt, minus_a = DECAYS[decay](rand(batch, seq, heads), rand(heads))
    tensors = {
        "x": randn(batch, seq, heads, dim_p),
        "dt": dt,
        "A": -minus_a,
        "B": randn(batch, seq, groups, dim_d) / dim_d**0.5,
        "C": randn(batch, seq, groups, dim_d) / dim_d**0.5,
        "D": randn(heads) if with_d else None,
        "state": randn(batch, heads, dim_p, dim_d) if with_state else None,
    }
    return {name: None if t is None else t.to(dtype).requires_grad_() for name, t in tensors.items()}


def run_ours(fn, x, **kwargs):
    return fn(
        x["x"],
        x["dt"],
        x["A"],
        x["B"],
        x["C"],
        D_N=x["D"],
        initial_state_BNPD=x["state"],
        output_final_state=True,
        **kwargs,
    )


def run_steps(x):
    """recurrent_ssd_step token by token."""
    state, outputs = x["state"], []
    for s in range(x["x"].shape[1]):
        y, state = recurrent_ssd_step(
            x["x"][:, s], x["dt"][:, s], x["A"], x["B"][:, s], x["C"][:, s], state, D_N=x["D"]
        )
        outputs.append(y)
    return torch.stack(outputs, dim=1), state


@st.composite
def problems(draw):
    heads = draw(st.integers(1, 4))
    groups = draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0]))
    return {
        "batch": draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 40)),
        "groups": groups,
        "per_group": heads // groups,
        "dim_p": draw(st.integers(2, 8)),
        "dim_d": draw(st.integers(2, 8)),
        "decay": draw(st.sampled_from(sorted(DECAYS))),
        "with_state": draw(st.booleans()),
        "with_d": draw(st.booleans()),
    }


@settings(max_examples=30, deadline=None)
@given(problems(), st.integers(4, 16), st.integers(0, 2**31 - 1))
def test_matches_the_naive_recurrence_with_gradients(problem, chunk_size: int, seed: int) -> None:
    x = make_inputs(seed, **problem)
    ref_out, ref_state = naive_ssd(*x.values())
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = (
        torch.randn(ref_out.shape, generator=gen, dtype=F64),
        torch.randn(ref_state.shape, generator=gen, dtype=F64),
    )
    ref_grads = grads_of(x, ref_out, ref_state, cotangents)
    for name, run in [
        ("chunked", lambda: run_ours(chunk_ssd_scan, x, chunk_size=chunk_size)),
        ("recurrent", lambda: run_ours(recurrent_ssd_scan, x)),
        ("steps", lambda: run_steps(x)),
    ]:
        out, state = run()
        assert out.dtype == F64 and state.dtype == F64
        assert_matches_reference(name, x, out, state, (ref_out, ref_state, ref_grads), cotangents)


@pytest.mark.parametrize("seq,split,chunk_size", [(40, 17, 8), (32, 16, 8), (13, 1, 16), (9, 8, 4), (6, 0, 4)])
def test_split_sequence_with_carried_state_gives_the_whole(seq: int, split: int, chunk_size: int) -> None:
    x = make_inputs(7, 2, seq, 2, 2, 5, 6, "typical", True, True)
    whole_out, whole_state = run_ours(chunk_ssd_scan, x, chunk_size=chunk_size)
    sequence_wise = ("x", "dt", "B", "C")
    first = {n: t[:, :split] if n in sequence_wise else t for n, t in x.items()}
    second = {n: t[:, split:] if n in sequence_wise else t for n, t in x.items()}
    # a chunked prefill then the rest chunked (context parallelism) or token by token (generation)
    out_1, state_1 = run_ours(chunk_ssd_scan, first, chunk_size=chunk_size)
    for run in [
        lambda x: run_ours(chunk_ssd_scan, x, chunk_size=chunk_size),
        lambda x: run_ours(recurrent_ssd_scan, x),
        run_steps,
    ]:
        out_2, state_2 = run({**second, "state": state_1})
        torch.testing.assert_close(torch.cat([out_1, out_2], dim=1), whole_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(state_2, whole_state, rtol=1e-10, atol=1e-10)


def _raw_dt_inputs(seed: int, batch: int, seq: int, groups: int, per_group: int, dim_p: int, dim_d: int):
    """fp32 inputs with dt before the mixer's softplus(dt + dt_bias) and A = -exp(A_log), as transformers takes them."""
    x = make_inputs(seed, batch, seq, groups, per_group, dim_p, dim_d, "typical", True, True, dtype=torch.float32)
    x = {n: t.detach() for n, t in x.items()}
    gen = torch.Generator().manual_seed(seed + 1)
    heads = groups * per_group
    x["dt_raw"] = torch.randn(batch, seq, heads, generator=gen) * 2.0 - 3.0
    x["dt_bias"] = torch.randn(heads, generator=gen)
    return x


def test_chunked_scan_matches_transformers_torch_scan_in_fp32() -> None:
    x = _raw_dt_inputs(3, 2, 150, 2, 2, 16, 32)
    dt_limit = (0.01, float("inf"))
    ref_out, ref_state = mamba2_chunk_scan(
        x["x"],
        x["dt_raw"],
        x["A"],
        x["B"],
        x["C"],
        chunk_size=64,
        D=x["D"],
        dt_bias=x["dt_bias"],
        initial_states=x["state"],
        dt_softplus=True,
        dt_limit=dt_limit,
        return_final_states=True,
    )
    dt = F.softplus(x["dt_raw"] + x["dt_bias"]).clamp(*dt_limit)
    out, state = run_ours(chunk_ssd_scan, {**x, "dt": dt}, chunk_size=64)
    assert out.shape == ref_out.shape and out.dtype == torch.float32
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(state, ref_state) < 1e-5


def test_step_matches_transformers_torch_step_in_fp32() -> None:
    x = _raw_dt_inputs(4, 2, 1, 2, 2, 16, 32)
    batch, _, heads, dim_p = x["x"].shape
    dim_d = x["B"].shape[-1]
    ref_state = x["state"].clone()  # transformers updates its state in place
    ref_out = mamba2_selective_state_update(
        ref_state,
        x["x"][:, 0],
        x["dt_raw"][:, 0, :, None].expand(-1, -1, dim_p),
        x["A"][:, None, None].expand(-1, dim_p, dim_d),
        x["B"][:, 0],
        x["C"][:, 0],
        x["D"][:, None].expand(-1, dim_p),
        dt_bias=x["dt_bias"][:, None].expand(-1, dim_p),
        dt_softplus=True,
    )
    # transformers' step applies no time-step limit (its chunked scan does)
    dt = F.softplus(x["dt_raw"][:, 0] + x["dt_bias"])
    out, state = recurrent_ssd_step(x["x"][:, 0], dt, x["A"], x["B"][:, 0], x["C"][:, 0], x["state"], D_N=x["D"])
    assert out.shape == (batch, heads, dim_p)
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(state, ref_state) < 1e-5


def _tiny_mixer(groups: int) -> NemotronHMamba2Mixer:
    config = NemotronHConfig(
        hidden_size=24,
        layers_block_type=["linear_attention"],
        mamba_num_heads=4,
        mamba_head_dim=6,
        n_groups=groups,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=16,
        use_bias=True,
        use_conv_bias=True,
        layer_norm_epsilon=1e-5,
        time_step_min=0.01,
    )
    torch.manual_seed(0)
    mixer = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in mixer.parameters():  # not the init's ones and aranges, which hide mix-ups
            param.copy_(torch.randn_like(param) * 0.5)
        mixer.dt_bias.sub_(2.0)
    return mixer


def mixer_from_our_pieces(mixer: NemotronHMamba2Mixer, hidden_BSE: torch.Tensor) -> torch.Tensor:
    """The Nemotron-H Mamba-2 mixer assembled from ours with transformers' module's weights."""
    heads, dim_p, groups, dim_d = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    inner = heads * dim_p
    gate_BSI, xbc_BSX, dt_BSN = mixer.in_proj(hidden_BSE).split([inner, mixer.conv_dim, heads], dim=-1)
    xbc_BSX, _ = causal_conv1d(xbc_BSX, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias, activation="silu")
    x_BSI, B_BSJ, C_BSJ = xbc_BSX.split([inner, groups * dim_d, groups * dim_d], dim=-1)
    dt_BSN = F.softplus(dt_BSN + mixer.dt_bias).clamp(*mixer.time_step_limit)
    y_BSNP, _ = chunk_ssd_scan(
        x_BSI.unflatten(-1, (heads, dim_p)),
        dt_BSN,
        -mixer.A_log.float().exp(),
        B_BSJ.unflatten(-1, (groups, dim_d)),
        C_BSJ.unflatten(-1, (groups, dim_d)),
        chunk_size=mixer.chunk_size,
        D_N=mixer.D,
    )
    y_BSI = gated_rms_norm(
        y_BSNP.flatten(2),
        gate_BSI,
        mixer.norm.weight,
        group_size=mixer.norm.group_size,
        eps=mixer.norm.variance_epsilon,
    )
    return mixer.out_proj(y_BSI.to(hidden_BSE.dtype))


@pytest.mark.parametrize("groups", [1, 2])
def test_mixer_from_our_pieces_matches_transformers_mixer_in_fp32(groups: int) -> None:
    mixer = _tiny_mixer(groups)
    hidden_BSE = torch.randn(2, 37, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = mixer(hidden_BSE)
        ours = mixer_from_our_pieces(mixer, hidden_BSE)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_gate", [True, False])
@pytest.mark.parametrize("reference", [NemotronHRMSNormGated, MambaRMSNormGated])
def test_gated_rms_norm_matches_transformers(reference, with_gate: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    x_BSI, gate_BSI = (torch.randn(2, 5, 24, generator=gen).to(dtype) for _ in range(2))
    norm = reference(24, group_size=8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=gen))
    gate_BSI = gate_BSI if with_gate else None
    ours = gated_rms_norm(x_BSI, gate_BSI, norm.weight, group_size=8, eps=1e-5)
    ref = norm(x_BSI, gate_BSI)
    assert ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_gated_rms_norm_before_gate_and_groups() -> None:
    gen = torch.Generator().manual_seed(3)
    x_BSI, gate_BSI, weight_I = (
        torch.randn(2, 5, 12, generator=gen, dtype=F64),
        torch.randn(2, 5, 12, generator=gen, dtype=F64),
        torch.randn(12, generator=gen, dtype=F64),
    )

    def rms_normed(h):
        groups = h.unflatten(-1, (3, 4))
        return (groups / groups.square().mean(-1, keepdim=True).add(1e-6).sqrt()).flatten(-2)

    after = gated_rms_norm(x_BSI, gate_BSI, weight_I, group_size=4, eps=1e-6)
    before = gated_rms_norm(x_BSI, gate_BSI, weight_I, group_size=4, eps=1e-6, norm_before_gate=True)
    torch.testing.assert_close(after, weight_I * rms_normed(x_BSI * F.silu(gate_BSI)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(before, weight_I * rms_normed(x_BSI) * F.silu(gate_BSI), rtol=1e-12, atol=1e-12)


def test_bf16_inputs_compute_in_fp32() -> None:
    x64 = make_inputs(5, 1, 70, 2, 2, 16, 16, "typical", True, True)
    x16 = {n: t.detach().to(torch.bfloat16) for n, t in x64.items()}
    x32 = {n: t.to(torch.float32) for n, t in x16.items()}
    for fn, kwargs in [(chunk_ssd_scan, {"chunk_size": 32}), (recurrent_ssd_scan, {})]:
        out_16, state_16 = run_ours(fn, x16, **kwargs)
        out_32, state_32 = run_ours(fn, x32, **kwargs)
        assert out_16.dtype == torch.bfloat16 and state_16.dtype == torch.float32
        torch.testing.assert_close(state_16, state_32, rtol=0, atol=0)
        torch.testing.assert_close(out_16, out_32.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("dt_a", [-1e3, -1e-7, 0.0])
def test_extreme_decays_stay_finite_in_fp32(dt_a: float) -> None:
    """exp of the cumulative dt A underflows to zero over a chunk of -1e3 steps; neither output nor gradients may turn
    to nan/inf, and they still match fp64."""
    x = make_inputs(11, 1, 100, 2, 2, 8, 8, "typical", True, True, dtype=torch.float32)
    x["dt"] = torch.full_like(x["dt"], 0.5).requires_grad_()
    x["A"] = torch.full_like(x["A"], 2.0 * dt_a).requires_grad_()
    out, state = run_ours(chunk_ssd_scan, x, chunk_size=64)
    grads = torch.autograd.grad(out.square().sum() + state.square().sum(), list(x.values()))
    assert all(t.isfinite().all() for t in (out, state, *grads))
    ref_out, ref_state = naive_ssd(*(x[n].detach().to(F64) for n in NAMES))
    assert rel_err(out, ref_out) < 1e-5
    assert rel_err(state, ref_state) < 1e-5


@pytest.mark.parametrize("decay", ["mixed", "typical"])
def test_fp32_error_stays_small_when_small_decays_follow_large_ones(decay: str) -> None:
    """Each within-chunk decay is its own segment sum, not a difference of cumulative sums that grow to ~-1e3 within
    a chunk when dt A mixes ~0 and ~-40 (differences leave ~4e-5 relative error on the output, transformers' scan
    ~1e-5)."""
    x = make_inputs(0, 2, 300, 2, 2, 16, 16, decay, True, True)
    x = {n: t.detach() for n, t in x.items()}
    ref_out, ref_state = naive_ssd(*x.values())
    out, state = run_ours(chunk_ssd_scan, {n: t.float() for n, t in x.items()}, chunk_size=64)
    assert rel_err(out, ref_out) < 1e-6
    assert rel_err(state, ref_state) < 1e-6


def _saved(seq: int, chunk_size: int = 64) -> tuple[int, int]:
    x = make_inputs(0, 1, seq, 1, 2, 16, 16, "typical", False, True, dtype=torch.float32)
    with SavedTensorBytes() as saved:
        chunk_ssd_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], chunk_size=chunk_size, D_N=x["D"])
    largest = max(s.nbytes // s.dtype.itemsize for s in saved.storages)
    return saved.total, largest


def test_saved_memory_grows_linearly_with_the_sequence() -> None:
    (short, _), (long, largest) = _saved(256), _saved(512)
    assert 1.8 < long / short < 2.2, (short, long)
    heads = 2
    # the largest saved tensor is a [T, C, C] chunk-pairwise matrix per head: S * C elements, never S * S
    assert largest // heads <= 512 * 64 < 512 * 512
