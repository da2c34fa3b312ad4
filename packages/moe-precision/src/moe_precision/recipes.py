"""Training recipes: which format and scaling each GEMM operand gets.

Every GEMM of a quantised layer (forward ``y = x w^T``, input gradient ``dx = dy w``, weight gradient
``dw = dy^T x``) quantises both operands along the dimension it sums over, in one of three roles: ``input`` (the
activation ``x``), ``weight`` and ``grad`` (the output gradient ``dy``). :meth:`Recipe.fake_quantize` takes an
operand as ``[M, K]`` with ``K`` the summed dimension and returns it quantised and dequantised in fp32 (the exact
emulation of the low-precision GEMM, whose products of such values are exact in fp32 and whose sums a tensor core
also accumulates in fp32).

=================  ===============================  ===============================  ==================================
recipe             input                            weight                           grad
=================  ===============================  ===============================  ==================================
fp8_tensorwise     E4M3, one scale, current amax    E4M3, one scale                  E5M2, one scale
fp8_delayed        as tensorwise, with the scale from an amax history (``amax_history_len``, ``amax_compute_algo``,
                   ``margin``), as Transformer Engine's DelayedScaling
fp8_blockwise      E4M3, 1x128 blocks, fp32 scales  E4M3, 128x128 blocks             E4M3, 1x128 blocks
mxfp8              E4M3, 1x32 blocks, E8M0 scales   E4M3, 1x32 blocks                E4M3, 1x32 blocks
nvfp4              E2M1, 1x16 E4M3 scales + fp32    E2M1, 16x16 blocks + fp32        E2M1, 1x16, stochastic rounding
=================  ===============================  ===============================  ==================================

nvfp4 also applies a random Hadamard transform (16x16, fixed random signs) to both operands of the weight-gradient
GEMM along the token dimension before quantising them.

Error bounds (:data:`ERROR_BOUNDS`, checked by the tests): the relative Frobenius error of each GEMM against the fp32
GEMM for standard-normal operands, K >= 128. E4M3 keeps 3 mantissa bits (at most 6.25% per element, about 2.5% over a
sum), E5M2 2 bits, E2M1 1 bit.

Amax groups: a tensor split over ranks (tensor parallelism) must share the scale of the whole tensor, so the
per-tensor amaxes (tensorwise, delayed, NVFP4's global scale) are all-reduced (max) over ``amax_group``; block scales
are local (a block is never split by the layouts of these layers unless a shard is narrower than a block, where the
shard's edge closes the block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from moe_precision.blockwise import (
    cast_saturating,
    quantize_fp8_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    random_hadamard_transform,
    scale_from_amax,
    tensor_amax,
)
from moe_precision.formats import E4M3, E5M2, MiniFloat

Role = Literal["input", "weight", "grad"]
RECIPES = ("none", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
_GEMMS = ("forward", "input gradient", "weight gradient")
ERROR_BOUNDS: dict[str, dict[str, float]] = {
    "none": dict.fromkeys(_GEMMS, 1e-6),
    # the per-tensor recipes' gradients are E5M2
    "fp8_tensorwise": {"forward": 0.05, "input gradient": 0.09, "weight gradient": 0.09},
    "fp8_delayed": {"forward": 0.05, "input gradient": 0.09, "weight gradient": 0.09},
    "fp8_blockwise": dict.fromkeys(_GEMMS, 0.05),
    "mxfp8": dict.fromkeys(_GEMMS, 0.06),
    "nvfp4": dict.fromkeys(_GEMMS, 0.25),
}
# fixed random signs of nvfp4's Hadamard transform (TE also draws them once); on the CPU whatever the default device
# when this module is imported (a CPU generator drawing under ``with torch.device("cuda")`` fails), moved per use
_RHT_SIGNS = torch.where(
    torch.rand(16, generator=torch.Generator(device="cpu").manual_seed(0x5EED), device="cpu") < 0.5, -1.0, 1.0
)


def group_amax(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """:func:`~moe_precision.blockwise.tensor_amax` of the whole tensor, all-reduced (max) over ``group``."""
    amax = tensor_amax(t)
    if group is not None and dist.get_world_size(group) > 1:
        # NaN does not survive a max reduction everywhere: carry it as +inf, which also gives a NaN scale
        amax = torch.where(torch.isnan(amax), torch.inf, amax)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


@dataclass
class AmaxHistory:
    """Delayed scaling state of one operand of one GEMM: the amaxes of its last ``length`` finite uses (fp32, newest
    first; zeros before the first, which take no part in a max of amaxes) and how many were recorded, both created
    on the first use's device and updated there: no read-back decides anything (a host sync per GEMM on a GPU)."""

    length: int
    history: torch.Tensor | None = None
    recorded: torch.Tensor | None = None  # int64 scalar: the finite amaxes recorded so far

    def scale(self, current_amax: torch.Tensor, fmt: MiniFloat, margin: int, algo: str) -> torch.Tensor:
        """The scale for this use: from the history (``max`` of it or its ``most_recent`` entry); while nothing finite
        has been recorded, from the current amax. Non-finite amaxes are kept out (the last finite scale stays)."""
        if self.history is None or self.recorded is None:  # first use
            return scale_from_amax(current_amax, fmt.max, margin)
        amax = self.history.max() if algo == "max" else self.history[0]
        return scale_from_amax(torch.where(self.recorded > 0, amax, current_amax.float()), fmt.max, margin)

    def record(self, amax: torch.Tensor) -> None:
        if self.history is None or self.recorded is None:
            self.history = torch.zeros(self.length, device=amax.device)
            self.recorded = torch.zeros((), dtype=torch.int64, device=amax.device)
        # an overflowing step must not poison the scale of the steps after it: the history moves only when finite
        finite = torch.isfinite(amax.reshape(()))
        shifted = torch.cat([amax.reshape(1).float(), self.history[:-1]])
        self.history = torch.where(finite, shifted, self.history)
        self.recorded = self.recorded + finite.long()


@dataclass
class ScalingState:
    """Per-GEMM state a recipe keeps between uses (only ``fp8_delayed`` keeps any): one history per role."""

    length: int = 1024
    histories: dict[str, AmaxHistory] = field(default_factory=dict)

    def of(self, role: Role) -> AmaxHistory:
        if role not in self.histories:
            self.histories[role] = AmaxHistory(self.length)
        return self.histories[role]


@dataclass(frozen=True)
class Recipe:
    """A recipe by name (:data:`RECIPES`) with its delayed-scaling settings."""

    name: str
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"unknown recipe {self.name!r}; known: {', '.join(RECIPES)}")

    @property
    def hadamard_wgrad(self) -> bool:
        return self.name == "nvfp4"

    def element_format(self, role: Role) -> MiniFloat:
        """The FP8 element format of a role (E5M2 for gradients under per-tensor scaling: Megatron's "hybrid")."""
        if self.name in ("fp8_tensorwise", "fp8_delayed") and role == "grad":
            return E5M2
        return E4M3

    def new_state(self) -> ScalingState:
        return ScalingState(self.amax_history_len)

    def fake_quantize(
        self,
        t_MK: torch.Tensor,
        role: Role,
        *,
        state: ScalingState | None = None,
        amax_group: dist.ProcessGroup | None = None,
        record: bool = True,
    ) -> torch.Tensor:
        """``t`` (``[M, K]``, ``K`` summed by the GEMM) quantised with this recipe's format for ``role`` and
        dequantised, in fp32. ``record`` adds this use's amax to a delayed-scaling history (once per tensor and
        step: the backward's second use of a tensor passes False)."""
        t = t_MK.float()
        if self.name == "none" or t.numel() == 0:
            return t
        if self.name in ("fp8_tensorwise", "fp8_delayed"):
            data, scale = self.quantize_per_tensor(t, role, state=state, amax_group=amax_group, record=record)
            return data.float() / scale
        if self.name == "fp8_blockwise":
            block = (128, 128) if role == "weight" else (1, 128)
            return quantize_fp8_blockwise(t, block).dequantize()
        if self.name == "mxfp8":
            return quantize_mxfp8(t).dequantize()
        block = (16, 16) if role == "weight" else (1, 16)
        global_amax = group_amax(t, amax_group)
        return quantize_nvfp4(t, block, stochastic=role == "grad", global_amax=global_amax).dequantize()

    def quantize_per_tensor(
        self,
        t: torch.Tensor,
        role: Role,
        *,
        state: ScalingState | None = None,
        amax_group: dist.ProcessGroup | None = None,
        record: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 data and its fp32 scale (``t ~= data / scale``) for the per-tensor recipes."""
        fmt = self.element_format(role)
        amax = group_amax(t, amax_group)
        if self.name == "fp8_delayed":
            history = (state or self.new_state()).of(role)
            scale = history.scale(amax, fmt, self.margin, self.amax_compute_algo)
            if record:
                history.record(amax)
        else:
            scale = scale_from_amax(amax, fmt.max, self.margin)
        return cast_saturating(t.float() * scale, fmt), scale

    def wgrad_operands(self, dy_NM: torch.Tensor, x_KM: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight-gradient GEMM's operands (tokens last), Hadamard-transformed where the recipe does so."""
        if not self.hadamard_wgrad:
            return dy_NM, x_KM
        signs = _RHT_SIGNS.to(dy_NM.device)
        return random_hadamard_transform(dy_NM, signs), random_hadamard_transform(x_KM, signs)
