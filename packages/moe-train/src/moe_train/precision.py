"""The ``precision`` section applied to a run: which of the model's GEMMs take the recipe, and the dispatch format.

The recipe goes to every ``nn.Linear`` inside the decoder layers (attention projections, dense MLPs, MLA's
projections) and to the grouped expert projections; routers, embeddings, norms, the MTP projections and the output
layer keep the compute dtype. ``precision.first_last_layers_high`` keeps the first and the last decoder layer (and the
MTP layers) out too. It is applied to each module parallelism hands over (the whole model, or each pipeline stage)
after expert parallelism has built the rank's experts, before FSDP.
"""

from __future__ import annotations

from torch import nn

from moe_experts import ExpertLinear
from moe_models.module_kinds import decoder_layers
from moe_precision import BlockwiseFP8Wire, PrecisionConfig, apply_precision


def precision_targets(model: nn.Module, num_layers: int, first_last_high: bool) -> tuple[list[str], list[str]]:
    """(names of the ``nn.Linear`` modules, names of the grouped expert projections) that take the recipe."""
    linear: list[str] = []
    grouped: list[str] = []
    high = {"layers.0", f"layers.{num_layers - 1}"} if first_last_high else set()
    for prefix, layer in decoder_layers(model):
        if prefix in high or (first_last_high and prefix.startswith("mtp.")):
            continue
        for name, module in layer.named_modules():
            if type(module) is nn.Linear:
                linear.append(f"{prefix}.{name}")
            elif isinstance(module, ExpertLinear):
                grouped.append(f"{prefix}.{name}")
    return linear, grouped


def apply_run_precision(model: nn.Module, config: PrecisionConfig, num_layers: int, native: bool) -> int:
    """Give ``model``'s targets the recipe (a no-op for ``none``); the number of modules changed."""
    if not config.enabled:
        return 0
    linear, grouped = precision_targets(model, num_layers, config.first_last_layers_high)
    return apply_precision(model, linear, grouped, config.to_recipe(), native)


def dispatch_wire(config: PrecisionConfig) -> BlockwiseFP8Wire | None:
    return BlockwiseFP8Wire() if config.dispatch_fp8 else None
