"""The recurrent kernels' vendor back ends (``moe_models.recurrent_backends``) on stand-ins of the vendors' modules
(``_fake_recurrent_kernels``: their contracts, computed step by step in fp64), behind the CUDA seam
(``recurrent_backends.is_cuda_device``; the tensors stay on the CPU): each adapter, and each layer through it, gives
the torch path's output and final states in fp32 (grouped q/k heads, initial states, fla before and after 0.5's
grouped value heads); ``auto`` picks a vendor only where it runs and in bf16/fp16; naming one that cannot run (missing,
too old, CPU tensors, fp64) raises one line naming the field and the fix."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from _fake_recurrent_kernels import causal_conv1d_modules, fla_modules, mamba_ssm_modules
from _hf_reference import rel_err
from _packed_rows import document_ids
from _recurrence_reference import make_inputs
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moe_models import ModelConfig, preset, recurrent_backends
from moe_models.config import ModelConfigError
from moe_models.gated_delta import causal_conv1d, chunk_gated_delta_rule
from moe_models.kimi_delta import chunk_kimi_delta_rule
from moe_models.linear_attention import GatedDeltaNet
from moe_models.mamba import Mamba2Mixer
from moe_models.recurrent_backends import RecurrentBackendError, resolve, short_conv
from moe_models.ssd import chunk_ssd_scan

CPU, F32 = torch.device("cpu"), torch.float32
TOL = {"rtol": 1e-6, "atol": 1e-6}
LAYER_TOL = 1e-6  # max |ours - torch path| / max |torch path|: the fp32 torch path's own rounding against fp64


def assert_same_layer_outputs(ours: tuple, ref: tuple) -> None:
    """A layer's output and input gradient (:func:`_outputs`) within LAYER_TOL of the torch path's."""
    for name, a, b in zip(("output", "input gradient"), ours, ref, strict=True):
        assert rel_err(a, b) < LAYER_TOL, f"{name}: {rel_err(a, b):.2e}"


def cuda(device: torch.device) -> bool:
    """The CUDA seam's stand-in: every device counts."""
    return True


def install(monkeypatch: pytest.MonkeyPatch, *packages: dict) -> None:
    for modules in packages:
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)


def uninstall(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """``import name`` raises ImportError, installed or not."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def fp32_leaves(x: dict) -> dict:
    return {k: None if v is None else v.detach().float() for k, v in x.items()}


# ----------------------------------------------------------------------------------------------- the adapters


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 11),
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(2, 6),
    st.integers(2, 5),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["0.4.1", "0.5.2"]),
    st.sampled_from(["gated_delta", "kimi_delta"]),
    st.integers(0, 2**31 - 1),
)
def test_fla_rules_give_the_torch_kernels_output_and_state(
    batch, seq, qk_heads, groups, dim_k, dim_v, with_state, l2norm, version, family, seed
) -> None:
    per_channel = family == "kimi_delta"
    x = fp32_leaves(
        make_inputs(
            seed, batch, seq, qk_heads, groups, dim_k, dim_v, "typical", "uniform", with_state, l2norm,
            per_channel=per_channel,
        )
    )  # fmt: skip
    modules = fla_modules(version)
    with pytest.MonkeyPatch.context() as mp:
        install(mp, modules)
        kernel = resolve(family, "fla", CPU, F32, field="linear_attention_backend", cuda_check=cuda)
        assert kernel.name == "fla"
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        options = {"initial_state_BNKV": x["state"], "output_final_state": True, "use_qk_l2norm": l2norm}
        out, state = kernel(*args, chunk_size=4, **options)
    torch_kernel = chunk_kimi_delta_rule if per_channel else chunk_gated_delta_rule
    ref_out, ref_state = torch_kernel(*args, chunk_size=4, **options)
    assert modules["fla"].calls == ["chunk_kda" if per_channel else "chunk_gated_delta_rule"]
    assert out.dtype == ref_out.dtype and state.dtype == ref_state.dtype
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(state, ref_state, **TOL)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 11),
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_mamba_ssm_scan_gives_the_torch_scan_output_and_state(
    batch, seq, groups, per_group, dim_p, dim_d, with_state, with_d, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads = groups * per_group
    x = torch.randn(batch, seq, heads, dim_p, generator=gen)
    dt = torch.rand(batch, seq, heads, generator=gen) * 0.5
    A = -torch.rand(heads, generator=gen) * 2
    B, C = (torch.randn(batch, seq, groups, dim_d, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen) if with_d else None
    state = torch.randn(batch, heads, dim_p, dim_d, generator=gen) if with_state else None
    modules = mamba_ssm_modules()
    with pytest.MonkeyPatch.context() as mp:
        install(mp, modules)
        kernel = resolve("ssd", "mamba_ssm", CPU, F32, field="mamba_backend", cuda_check=cuda)
        out, final = kernel(x, dt, A, B, C, chunk_size=4, D_N=D, initial_state_BNPD=state, output_final_state=True)
    ref_out, ref_final = chunk_ssd_scan(
        x, dt, A, B, C, chunk_size=4, D_N=D, initial_state_BNPD=state, output_final_state=True
    )
    assert modules["mamba_ssm"].calls == ["mamba_chunk_scan_combined"]
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 2),
    st.integers(1, 9),
    st.sampled_from([8, 16]),
    st.integers(2, 4),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
@example(1, 1, 8, 4, False, True, True, 0)  # size-1 dims of a slice keep strides that .contiguous() leaves alone
def test_causal_conv1d_gives_the_torch_convolution_and_its_state(
    batch, seq, channels, width, with_bias, with_state, strided, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    # strided: x a slice of a wider tensor, as the layers' in_proj splits give it
    wide = torch.randn(batch, seq, channels + (3 if strided else 0), generator=gen)
    x = wide[..., :channels]
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen) if with_bias else None
    state = torch.randn(batch, channels, width - 1, generator=gen) if with_state else None
    modules = causal_conv1d_modules()
    options = {"activation": "silu", "initial_state_BCW1": state, "output_final_state": True}
    with pytest.MonkeyPatch.context() as mp:
        install(mp, modules)
        kernel = short_conv("mamba_ssm", CPU, F32, width=width, channels=channels, cuda_check=cuda)
        assert kernel.name == "causal_conv1d"
        y, final = kernel(x, weight, bias, **options)
    ref_y, ref_final = causal_conv1d(x, weight, bias, **options)
    assert modules["causal_conv1d"].calls == ["causal_conv1d_fn"]
    torch.testing.assert_close(y, ref_y, **TOL)
    torch.testing.assert_close(final, ref_final, **TOL)


# ----------------------------------------------------------------------------------------------- the layers


def _gated_delta_net(backend: str) -> GatedDeltaNet:
    """tiny-qwen3-next's layer (2 key heads serving 4 value heads; 256 conv channels), weights away from their
    initial values, under ``linear_attention_backend=backend``."""
    config = dataclasses.replace(preset("tiny-qwen3-next"), linear_attention_chunk_size=4)
    torch.manual_seed(0)
    layer = GatedDeltaNet(dataclasses.replace(config, linear_attention_backend=backend))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _mixer(backend: str) -> Mamba2Mixer:
    """A tiny Mamba-2 mixer (2 groups of 2 heads, 32 conv channels) under ``mamba_backend=backend``."""
    config = ModelConfig(
        hidden_size=12,
        mamba_num_groups=2,
        mamba_num_heads=4,
        mamba_head_dim=4,
        mamba_state_dim=4,
        mamba_chunk_size=4,
        mamba_dt_clamp_min=0.1,
        norm_epsilon=1e-5,
        mamba_backend=backend,
    )
    torch.manual_seed(0)
    mixer = Mamba2Mixer(config)
    with torch.no_grad():
        for p in mixer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return mixer


def _outputs(layer: torch.nn.Module, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output on a fixed input and that input's gradient."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 13, layer.in_proj.in_features, generator=gen).to(layer.in_proj.weight.dtype).requires_grad_()
    out = layer(x, **kwargs)
    (out.float() * torch.randn(out.shape, generator=gen)).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("version", ["0.4.1", "0.5.2"])
def test_gated_delta_net_through_fla_and_causal_conv1d_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, version: str, packed: bool
) -> None:
    ref = _outputs(_gated_delta_net("torch"), document_ids_BS=document_ids([[5, 8], [13]], 13) if packed else None)
    fla, conv = fla_modules(version), causal_conv1d_modules()
    install(monkeypatch, fla, conv)
    monkeypatch.setattr(recurrent_backends, "is_cuda_device", cuda)
    ours = _outputs(_gated_delta_net("fla"), document_ids_BS=document_ids([[5, 8], [13]], 13) if packed else None)
    assert set(fla["fla"].calls) == {"chunk_gated_delta_rule"} and set(conv["causal_conv1d"].calls) == {
        "causal_conv1d_fn"
    }
    assert_same_layer_outputs(ours, ref)


def test_gated_delta_net_named_fla_runs_its_convolution_in_torch_without_causal_conv1d(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref = _outputs(_gated_delta_net("torch"))
    fla = fla_modules()
    install(monkeypatch, fla)
    uninstall(monkeypatch, "causal_conv1d")
    monkeypatch.setattr(recurrent_backends, "is_cuda_device", cuda)
    ours = _outputs(_gated_delta_net("fla"))
    assert fla["fla"].calls == ["chunk_gated_delta_rule"]
    assert_same_layer_outputs(ours, ref)


@pytest.mark.parametrize("given_positions", [False, True])
def test_mamba_mixer_through_mamba_ssm_and_causal_conv1d_equals_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, given_positions: bool
) -> None:
    # given positions: two segments, each scanned from its conv state with its final state asked for
    positions = {"positions_S": torch.arange(13)[torch.tensor([*range(7, 13), *range(7)])]} if given_positions else {}
    ref = _outputs(_mixer("torch"), **positions)
    mamba, conv = mamba_ssm_modules(), causal_conv1d_modules()
    install(monkeypatch, mamba, conv)
    monkeypatch.setattr(recurrent_backends, "is_cuda_device", cuda)
    ours = _outputs(_mixer("mamba_ssm"), **positions)
    assert set(mamba["mamba_ssm"].calls) == {"mamba_chunk_scan_combined"}
    assert set(conv["causal_conv1d"].calls) == {"causal_conv1d_fn"}
    assert_same_layer_outputs(ours, ref)


@pytest.mark.parametrize("layer", ["gated_delta_net", "mamba"])
def test_auto_runs_the_vendors_in_bf16_near_the_torch_path(monkeypatch: pytest.MonkeyPatch, layer: str) -> None:
    make = _gated_delta_net if layer == "gated_delta_net" else _mixer
    ref = _outputs(make("torch").to(torch.bfloat16))
    vendor = fla_modules() if layer == "gated_delta_net" else mamba_ssm_modules()
    conv = causal_conv1d_modules()
    install(monkeypatch, vendor, conv)
    monkeypatch.setattr(recurrent_backends, "is_cuda_device", cuda)
    ours = _outputs(make("auto").to(torch.bfloat16))
    assert next(iter(vendor.values())).calls and conv["causal_conv1d"].calls
    assert ours[0].dtype == ref[0].dtype == torch.bfloat16
    assert rel_err(ours[0], ref[0]) < 2e-2  # bf16 rounding of the inputs each side hands the kernels


def test_torch_and_auto_on_the_cpu_are_our_kernels_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fla_modules(), mamba_ssm_modules(), causal_conv1d_modules())  # installed, but on the CPU
    for family, run in {"gated_delta": chunk_gated_delta_rule, "ssd": chunk_ssd_scan, "conv1d": causal_conv1d}.items():
        for name in ("torch", "auto"):
            for dtype in (torch.float32, torch.bfloat16):
                assert resolve(family, name, CPU, dtype, field="f", width=4, channels=8).run is run
    assert torch.equal(_outputs(_gated_delta_net("auto"))[0], _outputs(_gated_delta_net("torch"))[0])
    assert torch.equal(_outputs(_mixer("auto"))[0], _outputs(_mixer("torch"))[0])


@pytest.mark.parametrize(
    ("family", "vendor"),
    [("gated_delta", "fla"), ("kimi_delta", "fla"), ("ssd", "mamba_ssm"), ("conv1d", "causal_conv1d")],
)
def test_auto_picks_a_vendor_on_cuda_in_bf16_and_fp16_only(monkeypatch, family: str, vendor: str) -> None:
    install(monkeypatch, fla_modules(), mamba_ssm_modules(), causal_conv1d_modules())
    picks = {
        dtype: resolve(family, "auto", CPU, dtype, field="f", width=4, channels=8, cuda_check=cuda).name
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
    }
    assert picks == {torch.bfloat16: vendor, torch.float16: vendor, torch.float32: "torch", torch.float64: "torch"}
    # the convolution's limits: widths 2 to 4, channels divisible by 8
    if family == "conv1d":
        assert (
            resolve(family, "auto", CPU, torch.bfloat16, field="f", width=5, channels=8, cuda_check=cuda).name
            == "torch"
        )
        assert (
            resolve(family, "auto", CPU, torch.bfloat16, field="f", width=4, channels=12, cuda_check=cuda).name
            == "torch"
        )


# ----------------------------------------------------------------------------------------------- refusals


def _refusal(make_layer, backend: str, monkeypatch) -> str:
    layer = make_layer(backend)
    with pytest.raises(RecurrentBackendError) as err:
        layer(torch.randn(1, 5, layer.in_proj.in_features))
    return str(err.value)


LAYERS = {
    "linear_attention_backend": (_gated_delta_net, "fla", "fla", fla_modules),
    "mamba_backend": (_mixer, "mamba_ssm", "mamba_ssm", mamba_ssm_modules),
}


@pytest.mark.parametrize("field", LAYERS)
@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("missing", "failed (ModuleNotFoundError"),
        ("too old", "is installed; supported:"),
        ("too new", "is installed; supported:"),
        ("on the cpu", "run on CUDA only and the tensors are on cpu"),
    ],
)
def test_a_named_vendor_that_cannot_run_is_refused_in_one_line_naming_the_field(
    monkeypatch: pytest.MonkeyPatch, field: str, case: str, says: str
) -> None:
    make_layer, backend, package, modules = LAYERS[field]
    versions = {"too old": {"fla": "0.3.2", "mamba_ssm": "1.2.2"}, "too new": {"fla": "0.6.0", "mamba_ssm": "3.0.0"}}
    if case == "missing":
        uninstall(monkeypatch, package)
    else:
        install(monkeypatch, modules(versions[case][package]) if case in versions else modules())
    if case != "on the cpu":
        monkeypatch.setattr(recurrent_backends, "is_cuda_device", cuda)
    message = _refusal(make_layer, backend, monkeypatch)
    assert "\n" not in message
    assert message.startswith(f"{field}={backend!r} cannot run here: ")
    assert says in message and f"set {field} to 'auto'" in message and "'torch'" in message
    if case in versions:
        assert versions[case][package] in message


def test_a_named_vendor_refuses_fp64(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, fla_modules())
    with pytest.raises(RecurrentBackendError, match=r"^linear_attention_backend='fla' cannot run here: .*float64"):
        resolve("gated_delta", "fla", CPU, torch.float64, field="linear_attention_backend", cuda_check=cuda)


@pytest.mark.parametrize(("field", "value"), [("linear_attention_backend", "mamba_ssm"), ("mamba_backend", "fla")])
def test_the_config_takes_each_field_s_own_choices(field: str, value: str) -> None:
    with pytest.raises(ModelConfigError) as err:
        ModelConfig(**{field: value})
    assert err.value.field == field and "\n" not in str(err.value)
    for good in ("auto", "torch"):
        assert getattr(ModelConfig(**{field: good}), field) == good


def test_the_back_end_fields_are_run_choices_that_checkpoints_do_not_record(tmp_path) -> None:
    """A model built with named back ends writes and reads back an HF checkpoint (the fields are training choices,
    as moe_expert_backend is), and its config.json names none of them."""
    import json

    from moe_models import build_model
    from moe_models.hf import load_pretrained, save_pretrained

    config = dataclasses.replace(preset("tiny-qwen3-next"), linear_attention_backend="torch", mamba_backend="torch")
    save_pretrained(build_model(config, seed=0), tmp_path / "hf")
    assert "backend" not in (tmp_path / "hf" / "config.json").read_text()
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_next"
    assert load_pretrained(tmp_path / "hf").config.linear_attention_backend == "auto"
