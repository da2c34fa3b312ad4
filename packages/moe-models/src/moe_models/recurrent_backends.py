"""Back ends of the recurrent layers' kernels: our plain-torch kernels, or a vendor's CUDA kernels detected at run time.

Four kernel families, each with one interface (that of our torch kernel, so a layer calls whichever it is given):

==============  ==========================================  =====================================================
family          torch (always)                              vendor (CUDA only)
==============  ==========================================  =====================================================
``gated_delta`` :func:`~moe_models.gated_delta.            ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_
                chunk_gated_delta_rule`                     rule`` (flash-linear-attention >= 0.4, < 0.6)
``kimi_delta``  :func:`~moe_models.kimi_delta.              ``fla``: ``fla.ops.kda.chunk_kda`` (same versions)
                chunk_kimi_delta_rule`
``ssd``         :func:`~moe_models.ssd.chunk_ssd_scan`      ``mamba_ssm``: ``mamba_ssm.ops.triton.ssd_combined.
                                                            mamba_chunk_scan_combined`` (mamba-ssm >= 2.0, < 3)
``conv1d``      :func:`~moe_models.gated_delta.             ``causal_conv1d``: ``causal_conv1d.causal_conv1d_fn``
                causal_conv1d`                              (causal-conv1d >= 1.2, < 2)
==============  ==========================================  =====================================================

The vendors' contracts, as their sources state them (and where versions differ). All take ``[B, S, heads, dim]``
tensors, as ours do, and a state ``[B, heads, K, V]`` (fla) or ``[B, N, P, D]`` (mamba_ssm):

- fla before 0.4 refuses fp32 inputs (0.4 has no such assert); before 0.5 q and k must have as many heads as v (0.5
  brought grouped value heads, ``HV`` a multiple of ``H``), so the adapter repeats q and k onto the value heads for
  0.4.x as our kernels do inside. Its chunk size is its own (64; 0.5.2 takes 16, 32 or 64): the rule's result does not
  depend on it. Its q/k L2 norm is ours, ``x / sqrt(sum x^2 + 1e-6)``. The keyword order changed across versions
  (chunk_kda's ``cu_seqlens`` moved back in 0.4.2 and again after 0.5.2), so every argument goes by keyword.
- mamba_ssm's scan takes the time step already softplus'd and clamped when ``dt_softplus`` is off (its default
  ``dt_limit`` (0, inf) is no clamp for such a dt); its output has x's dtype, its final state C's.
- causal_conv1d takes x ``[B, C, S]`` in either layout, but its initial and final states only channel-last (a
  ``[B, S, C]`` tensor seen transposed), which needs C and the strides multiples of 8; widths 2 to 4 only; fp32, fp16,
  bf16 (the bias in the weight's dtype, the states in x's). 1.2 brought the states.

Choosing. The layers' fields (:data:`LINEAR_ATTENTION_BACKENDS`: Gated DeltaNet and KDA; :data:`MAMBA_BACKENDS`: the
Mamba-2 mixer) name ``"torch"``, the vendor, or ``"auto"``: the vendor when it can run the call at hand (installed,
version in range, the tensors on CUDA, bf16 or fp16: Triton computes fp32 matmuls in TF32, so auto leaves fp32 to
torch), else torch. Naming the vendor runs it in fp32 too; when it cannot run, :func:`resolve` raises one line naming
the field, why, and the fix. The short convolution follows its layer's field: torch under ``"torch"``, causal_conv1d
under ``"auto"`` as auto picks, and under a named vendor whenever it can run the call (any dtype it takes), torch
otherwise: its package is an optional extra even then. Which device counts as CUDA is :func:`is_cuda_device`'s
answer, a seam: the tests stand fake vendor modules on CPU tensors behind it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_experts.backends import VendorLibrary
from moe_models.config import LINEAR_ATTENTION_BACKENDS, MAMBA_BACKENDS
from moe_models.gated_delta import causal_conv1d, chunk_gated_delta_rule
from moe_models.ssd import chunk_ssd_scan

__all__ = [
    "LINEAR_ATTENTION_BACKENDS",
    "MAMBA_BACKENDS",
    "Kernel",
    "RecurrentBackendError",
    "is_cuda_device",
    "resolve",
    "short_conv",
]

_HALF = (torch.bfloat16, torch.float16)
_TRITON = (torch.float32, *_HALF)  # what the vendors' kernels take (none takes fp64)


class RecurrentBackendError(ValueError):
    """A recurrent kernel's back end was named but cannot run the call at hand."""


def is_cuda_device(device: torch.device) -> bool:
    """Whether tensors on ``device`` can go to a vendor's CUDA kernels."""
    return device.type == "cuda"


_FLA_VERSIONS = (("flash-linear-attention", "fla-core"), (((0, 4), (0, 6)),), "flash-linear-attention >= 0.4, < 0.6")
FLA_GATED_DELTA = VendorLibrary("fla.ops.gated_delta_rule", *_FLA_VERSIONS)
FLA_KDA = VendorLibrary("fla.ops.kda", *_FLA_VERSIONS)
MAMBA_SSM = VendorLibrary(
    "mamba_ssm.ops.triton.ssd_combined", ("mamba_ssm", "mamba-ssm"), (((2, 0), (3, 0)),), "mamba-ssm >= 2.0, < 3"
)
CAUSAL_CONV1D = VendorLibrary(
    "causal_conv1d", ("causal_conv1d", "causal-conv1d"), (((1, 2), (2, 0)),), "causal-conv1d >= 1.2, < 2"
)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fla_groups_value_heads() -> bool:
    """Whether the installed fla takes fewer q/k heads than value heads (0.5 on; resolve has checked >= 0.4)."""
    major, minor = re.match(r"(\d+)\.(\d+)", FLA_GATED_DELTA.version() or "0.0").groups()
    return (int(major), int(minor)) >= (0, 5)


def _repeat_qk_before_fla_0_5(q_BSHK: torch.Tensor, k_BSHK: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """q and k as fla takes them: grouped from 0.5 on, repeated onto the ``heads`` value heads before."""
    if q_BSHK.shape[2] == heads or _fla_groups_value_heads():
        return q_BSHK, k_BSHK
    groups = heads // q_BSHK.shape[2]
    return q_BSHK.repeat_interleave(groups, dim=2), k_BSHK.repeat_interleave(groups, dim=2)


def _fla_rule(module: str, function: str) -> Callable:
    """An adapter giving fla's ``module.function`` (chunk_gated_delta_rule or chunk_kda) our kernels' interface."""

    def rule(
        q_BSHK: torch.Tensor,
        k_BSHK: torch.Tensor,
        v_BSNV: torch.Tensor,
        g_BSN_: torch.Tensor,
        beta_BSN: torch.Tensor,
        *,
        chunk_size: int = 64,  # fla chunks by its own size; the result does not depend on it
        initial_state_BNKV: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm: bool = False,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kernel = getattr(importlib.import_module(module), function)
        q_BSHK, k_BSHK = _repeat_qk_before_fla_0_5(q_BSHK, k_BSHK, v_BSNV.shape[2])
        dtype = q_BSHK.dtype
        o_BSNV, final_BNKV = kernel(
            q=q_BSHK,
            k=k_BSHK.to(dtype),  # fla asserts q, k and v share a dtype
            v=v_BSNV.to(dtype),
            g=g_BSN_,
            beta=beta_BSN,
            scale=k_BSHK.shape[-1] ** -0.5 if scale is None else scale,
            initial_state=None if initial_state_BNKV is None else initial_state_BNKV.float(),
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
        final = final_BNKV.to(_compute_dtype(dtype)) if output_final_state else None
        return o_BSNV.to(dtype), final

    return rule


def _mamba_ssd(
    x_BSNP: torch.Tensor,
    dt_BSN: torch.Tensor,
    A_N: torch.Tensor,
    B_BSGD: torch.Tensor,
    C_BSGD: torch.Tensor,
    *,
    chunk_size: int = 64,
    D_N: torch.Tensor | None = None,
    initial_state_BNPD: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """mamba_ssm's ``mamba_chunk_scan_combined`` with :func:`~moe_models.ssd.chunk_ssd_scan`'s interface (dt given
    already softplus'd and clamped, so its own softplus and clamp stay off)."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    result = mamba_chunk_scan_combined(
        x_BSNP,
        dt_BSN,
        A_N.float(),
        B_BSGD,
        C_BSGD,
        chunk_size,
        D=D_N,
        initial_states=initial_state_BNPD,
        return_final_states=output_final_state,
    )
    if not output_final_state:
        return result.to(x_BSNP.dtype), None
    y_BSNP, final_BNPD = result
    return y_BSNP.to(x_BSNP.dtype), final_BNPD.to(_compute_dtype(x_BSNP.dtype))


def _channel_last(x_BSC: torch.Tensor) -> torch.Tensor:
    """``[B, C, S]`` channel-last (a ``[B, S, C]`` tensor seen transposed), strides as causal_conv1d's states need."""
    if x_BSC.stride(-1) != 1 or x_BSC.stride(1) % 8 or x_BSC.stride(0) % 8:
        # a copy with the plain strides: .contiguous() keeps any stride of a size-1 dim, which the kernel checks
        x_BSC = x_BSC.new_empty(x_BSC.shape).copy_(x_BSC)
    return x_BSC.transpose(1, 2)


def _vendor_conv1d(
    x_BSC: torch.Tensor,
    weight_CW: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
    initial_state_BCW1: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """causal_conv1d's ``causal_conv1d_fn`` with :func:`~moe_models.gated_delta.causal_conv1d`'s interface, channel-last
    (:func:`resolve` has checked C % 8 == 0 and the width)."""
    from causal_conv1d import causal_conv1d_fn

    initial_BCW1 = None
    if initial_state_BCW1 is not None:
        initial_BCW1 = _channel_last(initial_state_BCW1.to(x_BSC.dtype).transpose(1, 2))
    result = causal_conv1d_fn(
        _channel_last(x_BSC),
        weight_CW,
        None if bias_C is None else bias_C.to(weight_CW.dtype),
        initial_states=initial_BCW1,
        return_final_states=output_final_state,
        activation=activation,
    )
    y_BCS, final_BCW1 = result if output_final_state else (result, None)
    return y_BCS.transpose(1, 2).to(x_BSC.dtype), final_BCW1


def _kimi_torch(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    from moe_models.kimi_delta import chunk_kimi_delta_rule  # kimi_delta imports the layers, which import the config

    return chunk_kimi_delta_rule(*args, **kwargs)


@dataclass(frozen=True)
class Kernel:
    """A family's kernel as a back end runs it: called as the family's torch kernel is."""

    family: str
    name: str
    run: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.run(*args, **kwargs)


@dataclass(frozen=True)
class _Vendor:
    name: str
    library: VendorLibrary
    install: str
    run: Callable


_TORCH = {
    "gated_delta": chunk_gated_delta_rule,
    "kimi_delta": _kimi_torch,
    "ssd": chunk_ssd_scan,
    "conv1d": causal_conv1d,
}
_FLA_INSTALL = "pip install flash-linear-attention"
_VENDORS = {
    "gated_delta": _Vendor(
        "fla", FLA_GATED_DELTA, _FLA_INSTALL, _fla_rule("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
    ),
    "kimi_delta": _Vendor("fla", FLA_KDA, _FLA_INSTALL, _fla_rule("fla.ops.kda", "chunk_kda")),
    "ssd": _Vendor("mamba_ssm", MAMBA_SSM, "pip install mamba-ssm --no-build-isolation", _mamba_ssd),
    "conv1d": _Vendor("causal_conv1d", CAUSAL_CONV1D, "pip install causal-conv1d --no-build-isolation", _vendor_conv1d),
}
FAMILIES = tuple(_TORCH)


def _why_not(
    vendor: _Vendor,
    device: torch.device,
    dtype: torch.dtype,
    width: int | None,
    channels: int | None,
    cuda_check: Callable[[torch.device], bool],
) -> str | None:
    """None when ``vendor`` can run a call on ``device`` in ``dtype`` (and, for the convolution, of that width and
    channel count), else why not: the cheap checks first, so CPU runs never import anything."""
    if not cuda_check(device):
        return f"its kernels run on CUDA only and the tensors are on {device}"
    if dtype not in _TRITON:
        return f"its kernels take fp32, fp16 or bf16, not {dtype}"
    if width is not None and not 2 <= width <= 4:
        return f"its kernels take widths 2 to 4, not {width}"
    if channels is not None and channels % 8:
        return f"its channel-last kernels need channels divisible by 8, not {channels}"
    problem = vendor.library.problem()
    if problem is not None:
        return f"{problem} ({vendor.install})"
    return None


def resolve(
    family: str,
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    field: str,
    width: int | None = None,
    channels: int | None = None,
    cuda_check: Callable[[torch.device], bool] | None = None,
) -> Kernel:
    """The kernel of ``family`` that back end ``name`` (the value of the config ``field``: ``"auto"``, ``"torch"`` or
    the family's vendor) runs for tensors on ``device`` in ``dtype``; ``width`` and ``channels`` describe a
    convolution. ``cuda_check`` says which devices count as CUDA (default :func:`is_cuda_device`)."""
    if family not in _TORCH:
        raise ValueError(f"unknown recurrent kernel family {family!r}: choose one of {FAMILIES}")
    vendor = _VENDORS[family]
    if name not in ("auto", "torch", vendor.name):
        raise ValueError(f"{field}={name!r}: choose one of {('auto', 'torch', vendor.name)}")
    if name == "torch":
        return Kernel(family, "torch", _TORCH[family])
    cuda_check = cuda_check or is_cuda_device
    if name == "auto":
        usable = dtype in _HALF and _why_not(vendor, device, dtype, width, channels, cuda_check) is None
        return Kernel(family, vendor.name, vendor.run) if usable else Kernel(family, "torch", _TORCH[family])
    reason = _why_not(vendor, device, dtype, width, channels, cuda_check)
    if reason is not None:
        raise RecurrentBackendError(
            f"{field}={name!r} cannot run here: {reason}; set {field} to 'auto' (torch where {name} cannot run) "
            "or 'torch'"
        )
    return Kernel(family, vendor.name, vendor.run)


def short_conv(
    field_value: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    width: int,
    channels: int,
    cuda_check: Callable[[torch.device], bool] | None = None,
) -> Kernel:
    """The short convolution of a layer whose recurrent back-end field is ``field_value``: torch under ``"torch"``,
    auto's pick under ``"auto"``, and under a named vendor causal_conv1d whenever it can run the call, else torch."""
    if field_value in ("torch", "auto"):
        return resolve(
            "conv1d", field_value, device, dtype, field="conv", width=width, channels=channels, cuda_check=cuda_check
        )
    vendor = _VENDORS["conv1d"]
    if _why_not(vendor, device, dtype, width, channels, cuda_check or is_cuda_device) is None:
        return Kernel("conv1d", vendor.name, vendor.run)
    return Kernel("conv1d", "torch", causal_conv1d)
