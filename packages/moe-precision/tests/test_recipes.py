"""Quantised GEMMs of each recipe: the three GEMMs against compositions of the format quantisers written out here,
within each recipe's documented error bound of the fp32 GEMM; the in-place quantised layers; the config's checks."""

import pytest
import torch
from torch import nn

from moe_precision import (
    RECIPES,
    PrecisionConfig,
    PrecisionConfigError,
    QuantizedLinear,
    Recipe,
    quantize_fp8_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    quantized_matmul,
)
from moe_precision.blockwise import cast_saturating
from moe_precision.formats import E4M3, E5M2
from moe_precision.layers import quantize_grouped_linear_, quantize_linear_
from moe_precision.recipes import ERROR_BOUNDS

QUANTISED = [r for r in RECIPES if r != "none"]


def fq(t, recipe, role):
    """The fake quantisation each recipe documents, from the format functions (``t``: [M, K], K summed)."""
    if recipe in ("fp8_tensorwise", "fp8_delayed"):  # delayed at its first use: the current amax
        fmt = E5M2 if role == "grad" else E4M3
        amax = t.abs().max()
        scale = torch.tensor(fmt.max) / amax if amax > 0 else torch.tensor(1.0)
        return cast_saturating(t * scale, fmt).float() / scale
    if recipe == "fp8_blockwise":
        return quantize_fp8_blockwise(t, (128, 128) if role == "weight" else (1, 128)).dequantize()
    if recipe == "mxfp8":
        return quantize_mxfp8(t).dequantize()
    return quantize_nvfp4(t, (16, 16) if role == "weight" else (1, 16)).dequantize()


def operands(m=96, k=160, n=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).requires_grad_()
    w = torch.randn(n, k, generator=gen).requires_grad_()
    dy = torch.randn(m, n, generator=gen)
    return x, w, dy


def gemms(recipe, x, w, dy):
    y = quantized_matmul(x, w, Recipe(recipe), state=Recipe(recipe).new_state())
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


@pytest.mark.parametrize("recipe", [r for r in QUANTISED if r != "nvfp4"])
def test_three_gemms_are_the_documented_compositions(recipe):
    x, w, dy = operands()
    y, dx, dw = gemms(recipe, x, w, dy)
    xd, wd = x.detach(), w.detach()
    torch.testing.assert_close(y, fq(xd, recipe, "input") @ fq(wd, recipe, "weight").t(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(dx, fq(dy, recipe, "grad") @ fq(wd.t(), recipe, "weight").t(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(dw, fq(dy.t(), recipe, "grad") @ fq(xd.t(), recipe, "input").t(), rtol=1e-6, atol=1e-5)


def test_nvfp4_forward_is_the_composition_and_its_weight_gradient_sees_the_hadamard_transform():
    x, w, dy = operands()
    y, _, dw = gemms("nvfp4", x, w, dy)
    xd, wd = x.detach(), w.detach()
    torch.testing.assert_close(y, fq(xd, "nvfp4", "input") @ fq(wd, "nvfp4", "weight").t(), rtol=1e-6, atol=1e-5)
    # the same GEMM without the transform: a different (worse-conditioned) quantisation of the same product
    plain = fq(dy.t(), "nvfp4", "input") @ fq(xd.t(), "nvfp4", "input").t()
    assert not torch.allclose(dw, plain, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemms_within_the_documented_error_bound(recipe):
    for seed in range(3):
        x, w, dy = operands(seed=seed)
        got = gemms(recipe, x, w, dy)
        x.grad = w.grad = None
        y = x @ w.t()
        ref = (y, *torch.autograd.grad(y, (x, w), dy))
        for name, a, b in zip(("forward", "input gradient", "weight gradient"), got, ref, strict=True):
            err = ((a - b).norm() / b.norm()).item()
            assert err <= ERROR_BOUNDS[recipe][name], (recipe, name, err)
            if recipe != "none":
                assert err > 1e-4, (recipe, name)  # it did quantise


def test_stochastic_rounding_makes_nvfp4_gradients_unbiased():
    x, w, dy = operands(m=32, k=64, n=16)
    # the weight's quantisation is deterministic; the gradient's rounding is noise around dy itself
    ref = dy @ fq(w.detach().t(), "nvfp4", "weight").t()
    mean = torch.stack([gemms("nvfp4", x, w, dy)[1] for _ in range(200)]).mean(0)
    single = gemms("nvfp4", x, w, dy)[1]
    assert (mean - ref).norm() < 0.2 * (single - ref).norm()
    nearest = fq(dy, "nvfp4", "input") @ fq(w.detach().t(), "nvfp4", "weight").t()  # round-to-nearest: biased
    assert (mean - ref).norm() < 0.5 * (nearest - ref).norm()


def test_quantize_linear_in_place_keeps_parameters_and_hooks():
    lin = nn.Linear(40, 24)
    seen = []
    lin.register_forward_pre_hook(lambda m, a: seen.append(1))
    weight, bias = lin.weight, lin.bias
    q = quantize_linear_(lin, Recipe("fp8_blockwise"))
    assert q is lin and isinstance(q, QuantizedLinear) and isinstance(q, nn.Linear)
    assert q.weight is weight and q.bias is bias and [n for n, _ in q.named_parameters()] == ["weight", "bias"]
    x = torch.randn(2, 3, 40)
    y = q(x)
    assert seen == [1] and y.shape == (2, 3, 24)
    ref = quantized_matmul(x.reshape(6, 40), weight, Recipe("fp8_blockwise")) + bias
    torch.testing.assert_close(y.reshape(6, 24), ref)
    with pytest.raises(TypeError):
        quantize_linear_(nn.Conv1d(2, 2, 1), Recipe("mxfp8"))


class Projection(nn.Module):
    """Stands in for moe-experts' ExpertLinear: ``forward(x_NK, w_EKM, tokens_per_expert_E, gmm)``."""

    gathers_rows = True  # as ExpertLinear: the experts may hand it row indices instead of rows

    def forward(self, x_NK, w_EKM, tokens_per_expert_E, gmm):
        return gmm(x_NK, w_EKM, tokens_per_expert_E)


def test_a_quantised_projection_says_it_takes_rows_not_indices():
    # moe-experts' GroupedExperts reads this before handing its first projection row indices: a quantised GEMM must
    # get the rows themselves (it quantises them)
    assert Projection.gathers_rows and not quantize_grouped_linear_(Projection(), Recipe("mxfp8")).gathers_rows


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8"])
def test_grouped_projection_quantises_each_expert_on_its_own(recipe):
    proj = quantize_grouped_linear_(Projection(), Recipe(recipe))
    assert isinstance(proj, Projection) and type(proj).__name__ == "QuantizedProjection"
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(19, 32, generator=gen).requires_grad_()  # 17 routed rows and 2 padding rows
    w = torch.randn(4, 32, 24, generator=gen).requires_grad_()
    y = proj(x, w, counts, None)
    y.backward(torch.ones_like(y))
    assert torch.equal(y[17:], torch.zeros(2, 24))
    assert torch.equal(w.grad[1], torch.zeros(32, 24))  # the expert without tokens
    start = 0
    for e, n in enumerate(counts.tolist()):
        ref = quantized_matmul(x.detach()[start : start + n], w.detach()[e].t(), Recipe(recipe))
        torch.testing.assert_close(y[start : start + n], ref)
        start += n
    # each expert has its own delayed-scaling state, one record per use
    assert len(proj.scaling) == 4
    if recipe == "fp8_delayed":
        assert proj.scaling[0].of("input").recorded == 1 and proj.scaling[0].of("grad").recorded == 1


def test_delayed_scaling_records_each_role_once_per_step():
    lin = quantize_linear_(nn.Linear(16, 8), Recipe("fp8_delayed"))
    for _ in range(3):
        lin(torch.randn(4, 16)).sum().backward()
    assert {role: h.recorded for role, h in lin.scaling.histories.items()} == {"input": 3, "weight": 3, "grad": 3}


def test_config_checks_name_the_field():
    for kwargs, field in [
        ({"recipe": "fp9"}, "recipe"),
        ({"emulate": "yes"}, "emulate"),
        ({"margin": -1}, "margin"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
    ]:
        with pytest.raises(PrecisionConfigError) as err:
            PrecisionConfig(**kwargs)
        assert err.value.field == field and "\n" not in str(err.value)
    with pytest.raises(PrecisionConfigError) as err:
        PrecisionConfig(recipe="mxfp8").native_on("cpu")
    assert err.value.field == "recipe" and "emulate" in err.value.reason and "native here: none" in err.value.reason
    assert PrecisionConfig(recipe="mxfp8", emulate=True).native_on("cpu") is False
    assert PrecisionConfig().native_on("cpu") is False and not PrecisionConfig().enabled


def test_a_non_finite_amax_stays_out_of_the_delayed_history():
    fmt, history = E4M3, Recipe("fp8_delayed").new_state().of("input")
    inf, nan = torch.tensor(float("inf")), torch.tensor(float("nan"))
    history.record(inf)  # the first use overflowed: nothing finite recorded, the scale follows the current amax
    assert int(history.recorded) == 0
    torch.testing.assert_close(history.scale(torch.tensor(2.0), fmt, 0, "max"), torch.tensor(fmt.max / 2.0))
    for amax in (torch.tensor(4.0), nan, torch.tensor(1.0), inf):
        history.record(amax)
    assert int(history.recorded) == 2
    assert history.history is not None and history.history[:3].tolist() == [1.0, 4.0, 0.0]
    # the finite amaxes alone decide: max 4, most recent 1, whatever the current amax
    torch.testing.assert_close(history.scale(torch.tensor(100.0), fmt, 0, "max"), torch.tensor(fmt.max / 4.0))
    torch.testing.assert_close(history.scale(nan, fmt, 0, "most_recent"), torch.tensor(fmt.max / 1.0))
