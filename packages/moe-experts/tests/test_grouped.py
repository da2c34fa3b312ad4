"""GroupedExperts against a naive per-expert gated FFN, and the swiglu activation."""

import importlib.util
import math

import pytest
import torch
from _experts_reference import splits
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts import ACTIVATIONS, BackendUnavailableError, GroupedExperts, get_activation, resolve_backend, swiglu

SETTINGS = settings(max_examples=30, deadline=None)
# torch's grouped_mm needs 16-byte aligned row strides: fp32 feature sizes in multiples of 4
DIMS = st.sampled_from([4, 8])


def naive_experts(x_NH, counts, w_gate_up_EH2F, w_down_EFH):
    """silu(x @ Wg) * (x @ Wu) @ Wd, one expert at a time, Wg = first F columns, Wu = last F."""
    ffn = w_down_EFH.shape[1]
    outs, start = [], 0
    for e, count in enumerate(counts.tolist()):
        x_e = x_NH[start : start + count]
        start += count
        w_g, w_u = w_gate_up_EH2F[e, :, :ffn], w_gate_up_EH2F[e, :, ffn:]
        outs.append((torch.sigmoid(x_e @ w_g) * (x_e @ w_g) * (x_e @ w_u)) @ w_down_EFH[e])
    return torch.cat(outs) if outs else torch.zeros(0, w_down_EFH.shape[-1])


def make_experts(num_experts, hidden, ffn, backend, seed):
    experts = GroupedExperts(num_experts, hidden, ffn, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.w_gate_up_EH2F.copy_(torch.randn(experts.w_gate_up_EH2F.shape, generator=gen) / math.sqrt(hidden))
        experts.w_down_EFH.copy_(torch.randn(experts.w_down_EFH.shape, generator=gen) / math.sqrt(ffn))
    return experts, gen


@SETTINGS
@given(splits(4, 5), DIMS, DIMS, st.sampled_from(["torch", "loop"]), st.integers(0, 2**31 - 1))
def test_matches_naive_reference_forward_and_backward(counts, hidden, ffn, backend, seed):
    experts, gen = make_experts(len(counts), hidden, ffn, backend, seed)
    n = int(counts.sum())
    x = torch.randn(n, hidden, generator=gen, requires_grad=True)
    cot = torch.randn(n, hidden, generator=gen)

    y = experts(x, counts)
    (y * cot).sum().backward()

    x_ref = x.detach().clone().requires_grad_(True)
    wgu = experts.w_gate_up_EH2F.detach().clone().requires_grad_(True)
    wd = experts.w_down_EFH.detach().clone().requires_grad_(True)
    ref = naive_experts(x_ref, counts, wgu, wd)
    # the zero term keeps the graph alive when N == 0 (reference gradients are then zero)
    ((ref * cot).sum() + 0.0 * (x_ref.sum() + wgu.sum() + wd.sum())).backward()

    assert y.shape == (n, hidden) and y.dtype == torch.float32
    torch.testing.assert_close(y.detach(), ref.detach())
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(experts.w_gate_up_EH2F.grad, wgu.grad)
    torch.testing.assert_close(experts.w_down_EFH.grad, wd.grad)


@SETTINGS
@given(splits(4, 5), DIMS, DIMS, st.integers(0, 2**31 - 1))
def test_torch_and_loop_modules_agree(counts, hidden, ffn, seed):
    results = {}
    for backend in ("torch", "loop"):
        experts, gen = make_experts(len(counts), hidden, ffn, backend, seed)
        x = torch.randn(int(counts.sum()), hidden, generator=gen, requires_grad=True)
        experts(x, counts).sum().backward()  # plain sum: expanded gradient into the torch back end
        results[backend] = (x.grad, experts.w_gate_up_EH2F.grad, experts.w_down_EFH.grad)
    for a, b in zip(results["torch"], results["loop"], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_empty_input_forward_and_backward(backend):
    experts, _ = make_experts(3, 8, 4, backend, seed=0)
    x = torch.zeros(0, 8, requires_grad=True)
    y = experts(x, torch.zeros(3, dtype=torch.int64))
    assert y.shape == (0, 8)
    y.sum().backward()
    assert x.grad.shape == (0, 8)
    assert torch.equal(experts.w_gate_up_EH2F.grad, torch.zeros(3, 8, 8))
    assert torch.equal(experts.w_down_EFH.grad, torch.zeros(3, 4, 8))


def test_loop_backend_with_unaligned_sizes():
    experts, gen = make_experts(3, 3, 5, "loop", seed=4)
    counts = torch.tensor([2, 0, 4])
    x = torch.randn(6, 3, generator=gen)
    torch.testing.assert_close(
        experts(x, counts), naive_experts(x, counts, experts.w_gate_up_EH2F.detach(), experts.w_down_EFH.detach())
    )


@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_bf16_activations_compute_in_bf16_and_grads_stay_fp32(backend):
    experts, gen = make_experts(2, 8, 8, backend, seed=5)
    counts = torch.tensor([3, 4])
    x32 = torch.randn(7, 8, generator=gen)
    x = x32.bfloat16().requires_grad_(True)
    y = experts(x, counts)
    assert y.dtype == torch.bfloat16
    ref = naive_experts(x32.bfloat16().float(), counts, experts.w_gate_up_EH2F.detach(), experts.w_down_EFH.detach())
    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2)
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert experts.w_gate_up_EH2F.grad.dtype == torch.float32
    assert experts.w_down_EFH.grad.dtype == torch.float32


def test_parameter_shapes_and_init_scale():
    experts = GroupedExperts(4, 64, 128, backend="loop")
    assert experts.w_gate_up_EH2F.shape == (4, 64, 256)
    assert experts.w_down_EFH.shape == (4, 128, 64)
    experts.reset_parameters(std=0.5, num_layers=8)
    # down projection scaled by 1/sqrt(2 * num_layers): 0.5 / 4
    assert experts.w_gate_up_EH2F.std().item() == pytest.approx(0.5, rel=0.03)
    assert experts.w_down_EFH.std().item() == pytest.approx(0.125, rel=0.03)
    assert experts.w_down_EFH.mean().abs().item() < 0.01


def test_extra_repr_names_backend_and_sizes():
    text = repr(GroupedExperts(4, 8, 12, backend="loop"))
    assert "num_experts=4" in text and "hidden=8" in text and "ffn=12" in text and "backend=loop" in text


def test_construction_errors():
    with pytest.raises(ValueError, match="activation='relu'"):
        GroupedExperts(2, 8, 8, activation="relu")
    with pytest.raises(ValueError, match="divisible by etp_size=3"):
        GroupedExperts(2, 8, 8, etp_size=3, etp_rank=0)
    with pytest.raises(ValueError, match="etp_rank=2"):
        GroupedExperts(2, 8, 8, etp_size=2, etp_rank=2)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        GroupedExperts(2, 8, 8, backend="loop")(torch.zeros(3, 8), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="nope"):
        GroupedExperts(2, 8, 8, backend="nope")


@pytest.mark.skipif(importlib.util.find_spec("grouped_gemm") is not None, reason="grouped_gemm is installed")
def test_unavailable_backend_fails_at_construction():
    with pytest.raises(BackendUnavailableError, match="grouped_gemm"):
        GroupedExperts(2, 8, 8, backend="grouped_gemm")


def test_default_backend_is_auto():
    assert GroupedExperts(2, 8, 8).backend.name == resolve_backend("auto").name


# ---------------------------------------------------------------- activations


def test_swiglu_hand_values():
    gate_up = torch.tensor([[0.0, 1.0, 2.0, 3.0], [-1.0, 2.0, 5.0, -0.5]])
    silu = lambda v: v / (1.0 + math.exp(-v))  # noqa: E731
    expected = torch.tensor([[silu(0.0) * 2.0, silu(1.0) * 3.0], [silu(-1.0) * 5.0, silu(2.0) * -0.5]])
    torch.testing.assert_close(swiglu(gate_up), expected)


@SETTINGS
@given(st.integers(0, 6), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_swiglu_forward_backward_match_formula(rows, ffn, seed):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * ffn, generator=gen, requires_grad=True)
    cot = torch.randn(rows, ffn, generator=gen)
    (swiglu(gate_up) * cot).sum().backward()
    g, u = gate_up.detach()[:, :ffn], gate_up.detach()[:, ffn:]
    sig = torch.sigmoid(g)
    torch.testing.assert_close(swiglu(gate_up.detach()), g * sig * u)
    # d/dg = u * sig * (1 + g * (1 - sig)), d/du = g * sig
    expected = torch.cat([cot * u * sig * (1 + g * (1 - sig)), cot * g * sig], dim=-1)
    torch.testing.assert_close(gate_up.grad, expected)


def test_get_activation():
    assert get_activation("swiglu").fn is swiglu
    assert set(ACTIVATIONS) == {"swiglu", "geglu", "swiglu_oai", "squared_relu", "gelu"}
    gated = {name for name, act in ACTIVATIONS.items() if act.gated}
    assert gated == {"swiglu", "geglu", "swiglu_oai"}
    with pytest.raises(ValueError, match="swiglu"):
        get_activation("relu")


def test_unaligned_sizes_fall_back_to_loop_under_auto_and_fail_clearly_under_torch() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 6)
    auto = GroupedExperts(3, 6, 5, backend="auto")
    loop = GroupedExperts(3, 6, 5, backend="loop")
    loop.load_state_dict(auto.state_dict())
    torch.testing.assert_close(auto(x, counts), loop(x, counts))
    forced = GroupedExperts(3, 6, 5, backend="torch")
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        forced(x, counts)


def test_checkpoint_names_and_shapes_per_activation_and_bias():
    assert set(GroupedExperts(2, 8, 12, backend="loop").state_dict()) == {"w_gate_up_EH2F", "w_down_EFH"}
    gelu = GroupedExperts(2, 8, 12, activation="gelu", backend="loop", bias=True)
    shapes = {name: tuple(t.shape) for name, t in gelu.state_dict().items()}
    assert shapes == {
        "w_gate_up_EH2F": (2, 8, 12),
        "w_down_EFH": (2, 12, 8),
        "b_gate_up_E2F": (2, 12),
        "b_down_EH": (2, 8),
    }
    oai = GroupedExperts(2, 8, 12, activation="swiglu_oai", backend="loop", bias=True, etp_rank=1, etp_size=2)
    shapes = {name: tuple(t.shape) for name, t in oai.state_dict().items()}
    assert shapes == {
        "w_gate_up_EH2F": (2, 8, 12),
        "w_down_EFH": (2, 6, 8),
        "b_gate_up_E2F": (2, 12),
        "b_down_EH": (2, 8),
    }
    assert "etp_rank=1, etp_size=2" in repr(oai) and "bias=True" in repr(oai)


def test_meta_device_build_then_materialize_matches_cpu_build():
    with torch.device("meta"):
        meta = GroupedExperts(3, 8, 12, backend="loop", bias=True, seed=7)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    cpu = GroupedExperts(3, 8, 12, backend="loop", bias=True, seed=7)
    for (name, a), b in zip(meta.state_dict().items(), cpu.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
