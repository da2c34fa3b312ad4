"""The Transformer Engine and grouped_gemm adapters against stand-ins that hold the real libraries' contracts
(``_fake_vendors.py``: signatures of each TE version range, bf16-only grouped_gemm, the fork's all-zero assert,
contiguity), on CPU: GroupedExperts forward and backward against the naive reference for the awkward splits, version
detection, and what ``auto`` picks for each dtype. With the real libraries and CUDA, test_contract.py runs the same
back ends (they join its list where usable)."""

from __future__ import annotations

import _fake_vendors
import pytest
import torch
from _experts_reference import naive_experts

from moe_experts import backends
from moe_experts.backends import BackendUnavailableError, resolve_backend
from moe_experts.grouped import GroupedExperts

SPLITS = {"mixed": [3, 0, 5, 1], "zero_token_experts": [0, 4, 0, 0], "one_expert": [0, 0, 0, 7], "empty": [0, 0, 0, 0]}
HIDDEN, FFN = 8, 12
TE_VERSIONS = ["2.1.0", "2.9.0+abc1234", "2.10.0", "2.11.0", "2.20.2"]


def _contract(backend: str, dtype: torch.dtype, counts: list[int], tol: dict, device: str = "cpu") -> None:
    """GroupedExperts on ``backend`` in ``dtype`` against the naive per-expert reference in fp32 on the same
    (dtype-rounded) values: output, input and every parameter gradient; zero gradients for experts without rows."""
    experts = GroupedExperts(4, HIDDEN, FFN, backend=backend, seed=0).to(device)
    with torch.no_grad():
        experts.w_gate_up_EH2F.mul_(50.0)  # out of the activation's linear range
        for p in experts.parameters():
            p.copy_(p.to(dtype).float())  # values the dtype holds exactly: the reference sees the same ones
    gen = torch.Generator().manual_seed(sum(counts))
    n = sum(counts)
    x0 = torch.randn(n, HIDDEN, generator=gen).to(dtype).float()
    cot = torch.randn(n, HIDDEN, generator=gen)
    x = x0.clone().to(device, dtype).requires_grad_(True)
    y = experts(x, torch.tensor(counts, device=device))
    assert y.dtype == dtype
    (y.float().cpu() * cot).sum().backward()

    params = {name: p.detach().cpu().clone().requires_grad_(True) for name, p in experts.named_parameters()}
    x_ref = x0.clone().requires_grad_(True)
    ref = naive_experts(x_ref, torch.tensor(counts), params["w_gate_up_EH2F"], params["w_down_EFH"], "swiglu")
    ((ref * cot).sum() + 0.0 * sum(t.sum() for t in [x_ref, *params.values()])).backward()
    torch.testing.assert_close(y.float().cpu(), ref.detach(), **tol)
    torch.testing.assert_close(x.grad.float().cpu(), x_ref.grad, **tol)
    for name, p in experts.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), params[name].grad, **tol, msg=lambda m, n=name: f"{n}: {m}")
        for e, count in enumerate(counts):
            if count == 0:
                assert torch.count_nonzero(p.grad[e]) == 0, (name, e)


FP32_TOL = {"rtol": 1e-4, "atol": 1e-4}
BF16_TOL = {"rtol": 3e-2, "atol": 3e-2}  # bf16 intermediates (the activation's input and output) round


# ----------------------------------------------------------------------------- Transformer Engine


@pytest.mark.parametrize("version", TE_VERSIONS)
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_te_adapter_meets_the_contract_on_every_supported_version(monkeypatch, version, split):
    _fake_vendors.install(monkeypatch, _fake_vendors.transformer_engine_modules(version))
    assert resolve_backend("te").name == "te"
    _contract("te", torch.float32, SPLITS[split], FP32_TOL)
    gemms = 2 * (sum(SPLITS[split]) > 0)  # two projections; no call at all without rows
    assert ["NN"] * gemms + ["TN", "NT"] * gemms == _fake_vendors.TE_CALLS


@pytest.mark.parametrize("version", ["2.10.0", "2.20.2"])
def test_te_adapter_in_bf16(monkeypatch, version):
    _fake_vendors.install(monkeypatch, _fake_vendors.transformer_engine_modules(version))
    _contract("te", torch.bfloat16, SPLITS["mixed"], BF16_TOL)


@pytest.mark.parametrize("version", ["2.0.0", "2.21.0", "3.1.0"])
def test_te_versions_outside_the_supported_range_are_one_line_errors(monkeypatch, version):
    _fake_vendors.install(monkeypatch, _fake_vendors.transformer_engine_modules(version))
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend("te")
    assert str(err.value) == (
        f"expert backend 'te' is not available here: transformer_engine {version} is installed; supported: "
        "transformer_engine >= 2.1, < 2.21"
    )
    assert resolve_backend("auto", torch.bfloat16).name == "torch"  # auto passes it over


def test_te_whose_torch_side_fails_to_import_is_unavailable(monkeypatch):
    """TE's torch extension asserts at import when the wheels disagree: that is "unavailable", not a crash."""
    _fake_vendors.install(monkeypatch, _fake_vendors.transformer_engine_modules("2.20.2"))
    real_import = backends.importlib.import_module

    def import_module(name):
        if name == "transformer_engine.pytorch":
            raise AssertionError("Transformer Engine package version mismatch. Found transformer_engine_torch v2.9")
        return real_import(name)

    monkeypatch.setattr(backends.importlib, "import_module", import_module)
    assert backends.BACKENDS["te"].unavailable_reason() == (
        "`import transformer_engine.pytorch` failed (AssertionError: Transformer Engine package version mismatch. "
        "Found transformer_engine_torch v2.9)"
    )
    assert resolve_backend("auto", torch.bfloat16).name == "torch"


def test_auto_picks_te_for_bf16_and_leaves_fp32_to_torch(monkeypatch):
    _fake_vendors.install(monkeypatch, _fake_vendors.transformer_engine_modules("2.20.2"))
    assert resolve_backend("auto", torch.bfloat16).name == "te"
    assert resolve_backend("auto", torch.float32).name == "torch"  # TE would run fp32 as TF32
    experts = GroupedExperts(4, HIDDEN, FFN, backend="auto", seed=0)
    assert experts._backend(torch.float32).gmm is backends.torch_grouped_mm
    assert experts._backend(torch.bfloat16).gmm is backends.te_grouped_mm


# ----------------------------------------------------------------------------- grouped_gemm

GG_FLAVOURS = {"tgale96 0.3.0": (False, None, "0.3.0"), "fork 1.1.4.post8": (True, "1.1.4.post8", None)}


def _install_grouped_gemm(monkeypatch, flavour: str, version: str | None = None) -> None:
    fork, attr_version, dist_version = GG_FLAVOURS[flavour]
    if version is not None:
        attr_version, dist_version = (version, None) if fork else (None, version)
    _fake_vendors.install(monkeypatch, _fake_vendors.make_grouped_gemm_modules(fork, attr_version))
    # tgale96's package has no __version__: its distribution's metadata says it
    monkeypatch.setattr(backends, "_distribution_version", lambda *names: dist_version)


@pytest.mark.parametrize("flavour", sorted(GG_FLAVOURS))
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_grouped_gemm_adapter_meets_the_contract_in_bf16(monkeypatch, flavour, split):
    """Zero-token ranks included ("empty": the fork asserts on all-zero group sizes; the adapter never calls it)."""
    _install_grouped_gemm(monkeypatch, flavour)
    _contract("grouped_gemm", torch.bfloat16, SPLITS[split], BF16_TOL)


def test_grouped_gemm_refuses_fp32_in_one_line_and_auto_passes_it_over(monkeypatch):
    _install_grouped_gemm(monkeypatch, "fork 1.1.4.post8")
    experts = GroupedExperts(4, HIDDEN, FFN, backend="grouped_gemm", seed=0)
    with pytest.raises(TypeError) as err:
        experts(torch.randn(3, HIDDEN), torch.tensor([1, 2, 0, 0]))
    assert str(err.value) == (
        "expert backend 'grouped_gemm' computes in bf16 only (its kernels reject other dtypes), got torch.float32 "
        "tokens and torch.float32 weights: train under bf16 autocast, or use backend 'torch'"
    )
    assert resolve_backend("auto", torch.float32).name == "torch"
    assert resolve_backend("auto", torch.bfloat16).name == "grouped_gemm"
    auto = GroupedExperts(4, HIDDEN, FFN, backend="auto", seed=0)
    assert auto(torch.randn(3, HIDDEN), torch.tensor([1, 2, 0, 0])).dtype == torch.float32  # torch's kernel ran


@pytest.mark.parametrize(
    ("flavour", "version"), [("tgale96 0.3.0", "0.1.4"), ("tgale96 0.3.0", "0.4.0"), ("fork 1.1.4.post8", "1.2.0")]
)
def test_grouped_gemm_versions_outside_the_supported_ranges_are_one_line_errors(monkeypatch, flavour, version):
    _install_grouped_gemm(monkeypatch, flavour, version)
    with pytest.raises(BackendUnavailableError) as err:
        resolve_backend("grouped_gemm")
    assert str(err.value) == (
        f"expert backend 'grouped_gemm' is not available here: nv_grouped_gemm {version} is installed; supported: "
        "grouped_gemm 0.1.6 to 0.3.x (tgale96) or 1.0 to 1.1.x (fanshiqing's fork, nv_grouped_gemm)"
    )


def test_grouped_gemm_stand_in_holds_the_library_checks(monkeypatch):
    """What the adapter is protected from: the stand-in rejects it as the library does."""
    _install_grouped_gemm(monkeypatch, "fork 1.1.4.post8")
    from grouped_gemm import ops

    w = torch.zeros(2, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"a.scalar_type\(\) == torch::kBFloat16"):
        ops.gmm(torch.zeros(3, 4), w, torch.tensor([1, 2]))
    with pytest.raises(AssertionError, match="should not be all zeros"):
        ops.gmm(torch.zeros(0, 4, dtype=torch.bfloat16), w, torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match=r"batch_sizes.scalar_type\(\) == torch::kInt64"):
        ops.gmm(torch.zeros(3, 4, dtype=torch.bfloat16), w, torch.tensor([1, 2], dtype=torch.int32))


# ----------------------------------------------------------------------------- the real libraries (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["te", "grouped_gemm"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_real_library_meets_the_bf16_contract(backend, split):
    """Where the library is installed with CUDA: the same contract against the real kernels (TF32/bf16 tolerance)."""
    reason = backends.BACKENDS[backend].unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    _contract(backend, torch.bfloat16, SPLITS[split], BF16_TOL, device="cuda")
