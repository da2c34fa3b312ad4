"""The ``precision`` section: the training recipe and where it applies (owned here, read by moe-train)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_precision.gemm import native_recipes
from moe_precision.recipes import AMAX_COMPUTE_ALGOS, RECIPES, Recipe


class PrecisionConfigError(ValueError):
    """An invalid :class:`PrecisionConfig`: ``field`` is the field to change, ``reason`` what is wrong and the fix."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return type(self), (self.field, self.value, self.reason)


@dataclass(frozen=True)
class PrecisionConfig:
    """Low-precision training (field names after Megatron-Core's ``--fp8-recipe``, ``--fp8-margin``,
    ``--fp8-amax-history-len``, ``--fp8-amax-compute-algo``, ``--first-last-layers-bf16``).

    - ``recipe``: none | fp8_tensorwise | fp8_delayed | fp8_blockwise | mxfp8 | nvfp4 (:mod:`moe_precision.recipes`);
      it applies to the attention and dense linears and the grouped experts; router, embeddings, norms and the
      output layer stay in high precision.
    - ``first_last_layers_high``: the first and the last decoder layer (and the MTP layers) stay in high precision.
    - ``emulate``: run a recipe the device has no native GEMM for as exact emulation (quantise, dequantise, fp32
      GEMM); without it such a recipe is an error. Every recipe needs it on CPU.
    - ``dispatch_fp8``: the token dispatchers send blockwise FP8 tokens (1x128, fp32 scales) and dequantise them
      on arrival; the backward's gradients travel in the compute dtype.
    - ``margin``, ``amax_history_len``, ``amax_compute_algo`` (max | most_recent): delayed scaling's settings.
    """

    recipe: str = "none"
    first_last_layers_high: bool = False
    emulate: bool = False
    dispatch_fp8: bool = False
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise PrecisionConfigError("recipe", self.recipe, f"unknown recipe; choose one of {', '.join(RECIPES)}")
        for name in ("first_last_layers_high", "emulate", "dispatch_fp8"):
            if not isinstance(getattr(self, name), bool):
                raise PrecisionConfigError(name, getattr(self, name), "must be true or false")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise PrecisionConfigError("margin", self.margin, "must be an integer >= 0 (powers of two of headroom)")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise PrecisionConfigError("amax_history_len", self.amax_history_len, "must be an integer >= 1")
        if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
            raise PrecisionConfigError(
                "amax_compute_algo", self.amax_compute_algo, f"choose one of {', '.join(AMAX_COMPUTE_ALGOS)}"
            )

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def to_recipe(self) -> Recipe:
        return Recipe(self.recipe, self.margin, self.amax_history_len, self.amax_compute_algo)

    def native_on(self, device: torch.device | str) -> bool:
        """Whether the recipe's GEMMs run natively on ``device``; raises :class:`PrecisionConfigError` (``recipe``)
        when they cannot and emulation is off."""
        device = torch.device(device)
        supported = native_recipes(device)
        if not self.enabled or self.recipe in supported:
            return self.enabled
        if self.emulate:
            return False
        names = ", ".join(supported) if supported else "none"
        raise PrecisionConfigError(
            "recipe",
            self.recipe,
            f"{device.type} has no native {self.recipe} GEMM (native here: {names}); "
            "turn on emulate to run it as exact emulation (quantise, dequantise, fp32 GEMM)",
        )
