"""``run.compile``: regional ``torch.compile`` of each decoder layer, as torchtitan applies it.

Each decoder layer (and each MTP depth's) is compiled in place (``nn.Module.compile``: names, parameters and hooks
stay, so checkpoints and FSDP see the same module), after tensor and expert parallelism, precision and recompute,
before FSDP wraps it. The layers share one compiled code object: the model compiles once, not once per layer.

Each decoder layer of every family traces as ONE graph, so inductor fuses across the whole layer: the dropless MoE
block reads nothing back to the host (tokens per expert are counted into a fixed ``[E]`` tensor, the permutation map's
row count is ``T * topk``, padding rows are masked rather than looked up), and blockwise attention over a whole
sequence (sinks, sliding windows, MLA on CPU) takes its key ranges from the sizes. The token counts stay tensors that
the grouped GEMMs read, so nothing is specialised on them: steps whose expert loads differ reuse the same graphs
(``tests/test_compile.py`` counts the graphs over 10 steps, and checks each family's layers for graph breaks).
Capacity dropping and padding still read counts back (their row counts depend on them): graph breaks there.

Supported: one process and data parallelism (FSDP), fp32 or bf16, recompute. Refused, one line naming the field
(:func:`check_compile`): pipeline parallelism, context parallelism, tensor or expert parallelism (their collectives
and DTensor hooks inside the compiled region are not tested here), a low-precision recipe (delayed scaling keeps
Python state across steps), and activation offload (saved-tensor hooks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from moe_models.module_kinds import decoder_layers

if TYPE_CHECKING:
    from moe_parallel import ParallelLayout
    from moe_train.config import ExperimentConfig


def compile_problem(cfg: ExperimentConfig, layout: ParallelLayout) -> str | None:
    """Why ``run.compile`` cannot apply to this run, or None."""
    if not cfg.run.compile:
        return None
    for name, size in (("pp", layout.pp), ("cp", layout.cp), ("tp", layout.tp), ("ep", layout.ep)):
        if size > 1:
            return (
                f"run.compile=true with parallel.{name}={size}: compile is tested with data parallelism only; set "
                f"parallel.{name}=1, or run.compile false"
            )
    if cfg.precision.recipe != "none":
        return (
            f"run.compile=true with precision.recipe={cfg.precision.recipe!r}: not supported (the recipes keep Python "
            "state across steps); set run.compile false or precision.recipe none"
        )
    if cfg.run.offload_modules:
        return (
            "run.compile=true with run.offload_modules: activation offload's saved-tensor hooks are not supported "
            "under compile; set run.compile false or run.offload_modules []"
        )
    return None


def compile_decoder_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """Compile each decoder layer of ``model`` (a whole model or a pipeline stage) in place; the number compiled.
    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``...)."""
    layers = decoder_layers(model)  # type: ignore[arg-type]
    for _, layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)
