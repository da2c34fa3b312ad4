"""``run.cuda_graphs``: the regions of Megatron-Core's ``--cuda-graph-scope`` (``attn``, ``moe_router``), and whole
decoder layers (``layer``), replayed from CUDA graphs, forward and backward.

Each region of a chosen scope (every decoder layer's token mixer, every MoE block's router, every decoder layer) has
its ``forward`` replaced by :class:`GraphedForward`. A training call (grad on, training mode) with a new signature
(the shapes, dtypes and grad flags of its tensors, its other arguments) is captured by
``torch.cuda.make_graphed_callables`` (which warms the region up on a side stream first) into a forward and a backward
graph, in one memory pool shared by every capture; that call and the later ones of the signature replay them. A new
signature (another micro-batch shape) is captured anew, beside the others: nothing is replayed with the wrong sizes.
Evaluation, no-grad calls and calls under ``torch.compile`` run eagerly.

Before anything is captured, :func:`~moe_train.capture_check.capture_problems` runs each scope's first region once,
forward and backward, counting host read-backs: a region that reads back is refused in one line naming the op and its
site. The dropless MoE layer reads nothing back (its tokens per expert stay on the device), so whole layers capture;
``moe_preprocess`` (the router and the dispatch's permutation) is checked but not yet captured on its own (the MoE
block dispatches inside its exchange).

Refused in one line (:func:`cuda_graphs_problem`): off CUDA, with more than one process (the all-to-all's split sizes
read back, FSDP's hooks and buffers change between calls), and with what keeps Python state or hooks inside a region
(recompute, offload, ``run.compile``, a precision recipe). Graphs keep each region's outputs in static buffers
overwritten by its next replay, which is safe while a micro-batch's backward runs before the next one's forward (one
process, gradient accumulation), and is why pipelines are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moe_models.layers import MoEBlock
from moe_models.module_kinds import decoder_layers
from moe_train.capture_check import CUDA_GRAPH_SCOPES, capture_problems, flatten_tensors
from moe_train.config_error import ConfigError

if TYPE_CHECKING:
    from moe_parallel import ParallelLayout, StagedModel
    from moe_train.config import ExperimentConfig

CAPTURED_SCOPES = ("attn", "moe_router", "layer")


def cuda_graphs_problem(cfg: ExperimentConfig, layout: ParallelLayout, device_type: str) -> str | None:
    """Why ``run.cuda_graphs`` cannot apply to this run (one line naming the key and the fix), or None."""
    scopes = cfg.run.cuda_graphs
    if not scopes:
        return None
    named = f"run.cuda_graphs={','.join(scopes)}"
    unknown = [s for s in scopes if s not in CUDA_GRAPH_SCOPES]
    if unknown:
        return f"{named}: unknown scope {unknown[0]!r}; choose from {', '.join(CUDA_GRAPH_SCOPES)}"
    if "moe_preprocess" in scopes:
        return f"{named}: moe_preprocess is checked capturable but not captured on its own yet; use moe_router or layer"
    if device_type != "cuda":
        return f"{named}: CUDA graphs capture CUDA work and this run is on {device_type}; set run.cuda_graphs []"
    if layout.world_size > 1:
        return (
            f"{named} with {layout.world_size} processes: captured in one process only (the all-to-all's split sizes "
            "read back, FSDP's hooks swap parameters between calls); run one process, or set run.cuda_graphs []"
        )
    for key, value, why in (
        ("run.recompute_modules", cfg.run.recompute_modules, "recompute re-runs regions from its own hooks"),
        ("run.offload_modules", cfg.run.offload_modules, "offload's saved-tensor hooks move memory a graph holds"),
        ("run.compile", cfg.run.compile, "compile and graphs would both own the layers"),
        ("precision.recipe", cfg.precision.recipe != "none", "the recipes keep Python state across calls"),
    ):
        if value:
            return f"{named} with {key} set: {why}; set one of them off"
    return None


class _TensorCall(nn.Module):
    """The region as make_graphed_callables needs it: tensors in, a tuple of tensors out, the other arguments bound.
    The region is a child, so its parameters are the graph's too."""

    def __init__(self, region: nn.Module, eager: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.region = region
        self._eager = eager
        self._flat_in, self._rebuild_in = flatten_tensors((args, kwargs))
        self.rebuild_out: Callable[[list[torch.Tensor]], Any] | None = None

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = self._rebuild_in(list(tensors))
        flat, self.rebuild_out = flatten_tensors(self._eager(*args, **kwargs))
        return tuple(flat)


def _signature(args: tuple, kwargs: dict) -> tuple:
    tensors, _ = flatten_tensors((args, kwargs))
    shapes = tuple((tuple(t.shape), t.dtype, t.requires_grad, t.device) for t in tensors)
    others = repr([(type(v).__name__, v) for v in (*args, *kwargs.items()) if not isinstance(v, torch.Tensor)])
    return shapes, tuple(kwargs), others


class GraphedForward:
    """A region's ``forward`` replaced by CUDA graphs, one capture per call signature (module docstring)."""

    def __init__(self, module: nn.Module, model: nn.Module, pool: Any) -> None:
        self.module, self.model, self.pool = module, model, pool
        self.eager = module.forward
        self.graphs: dict[tuple, tuple[Callable[..., Any], _TensorCall]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and self.module.training) or torch.compiler.is_compiling():
            return self.eager(*args, **kwargs)
        key = _signature(args, kwargs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(args, kwargs)
        graphed, call = self.graphs[key]
        tensors, _ = flatten_tensors((args, kwargs))
        outputs = list(graphed(*tensors))
        assert call.rebuild_out is not None
        # the outputs are the graph's static buffers, overwritten by the next replay: values kept past it (router
        # counts, logged losses) are copied; those with gradients feed the next region at once
        return call.rebuild_out([o if o.requires_grad else o.clone() for o in outputs])

    def _capture(self, args: tuple, kwargs: dict) -> tuple[Callable[..., Any], _TensorCall]:
        call = _TensorCall(self.module, self.eager, args, kwargs)
        samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in flatten_tensors((args, kwargs))[0])
        # the warm-up and capture run the region several times: its buffers (router statistics) are put back after
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        graphed = torch.cuda.make_graphed_callables(call, samples, pool=self.pool, allow_unused_input=True)
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(buffers[name])
        return graphed, call


def regions(model: nn.Module, scopes: tuple[str, ...]) -> list[nn.Module]:
    """Every module the scopes name: each decoder layer's token mixer (attn), each MoE block's router (moe_router),
    each decoder layer holding a MoE block (layer; its token mixer and router are then inside it)."""
    found = []
    for _, layer in decoder_layers(model):  # type: ignore[arg-type]
        moe = isinstance(getattr(layer, "mlp", None), MoEBlock)
        if "layer" in scopes and moe:
            found.append(layer)
            continue
        if "attn" in scopes and layer.attention is not None:
            found.append(layer.attention)
        if "moe_router" in scopes and moe:
            found.append(layer.mlp.router)
    return found


def graph_run_regions(
    parallel: StagedModel, scopes: tuple[str, ...], batch: tuple[int, int], vocab_size: int, dtype: torch.dtype
) -> int:
    """:func:`apply_cuda_graphs` on a run's one stage (one process: :func:`cuda_graphs_problem`), the check's forward
    a random ``batch`` ``(micro-batch, seq_len)`` of token ids under the run's autocast (without its weight cache, as
    the trainer's with graphs on)."""
    (stage,) = parallel.stages
    device = next(stage.parameters()).device
    sample = torch.randint(0, vocab_size, batch, device=device)
    enabled = dtype != torch.float32
    autocast = torch.autocast(device.type, dtype=dtype, enabled=enabled, cache_enabled=False)

    def forward() -> None:
        with autocast:
            stage(sample, sample)  # the first and last stage: token ids in, and the whole sequences

    return apply_cuda_graphs(stage, scopes, forward)


def apply_cuda_graphs(model: nn.Module, scopes: tuple[str, ...], forward: Callable[[], Any]) -> int:
    """Check the scopes' regions (:func:`~moe_train.capture_check.capture_problems`, ``forward`` being a forward of
    the model on a sample batch) and replace their ``forward`` by :class:`GraphedForward`; the number of regions.
    ``ConfigError`` naming ``run.cuda_graphs``, the region and its read-back when one is not capturable."""
    problems = capture_problems(model, scopes, forward)
    if problems:
        scope, problem = next(iter(problems.items()))
        raise ConfigError(f"run.cuda_graphs={scope}: {problem}; it cannot be captured, leave {scope} out")
    pool = torch.cuda.graph_pool_handle()
    chosen = regions(model, scopes)
    for module in chosen:
        module.forward = GraphedForward(module, model, pool)  # type: ignore[method-assign]
        for param in module.parameters():
            if param.requires_grad:
                # a graph's weight gradient is a static buffer its next replay overwrites: accumulated as it is, the
                # parameter's .grad would take that buffer over (autograd keeps an unshared first gradient) and the
                # next micro-batch would add the buffer to itself; a copy keeps .grad its own
                param.register_hook(torch.Tensor.clone)
    return len(chosen)
