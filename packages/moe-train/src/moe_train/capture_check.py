"""Whether the regions a run would capture in CUDA graphs are capturable: no host read-back, forward or backward.

A CUDA graph replays recorded kernels with the sizes and addresses of its capture; a region that reads a device value
back on the host (``.item()``, ``.tolist()``), or runs an op whose output size depends on the data (``nonzero``, a
boolean index), cannot be captured. The scopes are Megatron-Core's ``--cuda-graph-scope`` names, plus a whole decoder
layer, which a dropless MoE layer here allows (its tokens per expert stay on the device; Megatron-Core needs a
capacity factor for it):

    attn            each decoder layer's token mixer (softmax attention, MLA, the linear-attention mixers)
    moe_router      each MoE block's router
    moe_preprocess  each MoE block's router and its dispatch up to the expert-major rows
    layer           each whole decoder layer holding a MoE block

:func:`capture_problems` runs the first region of each scope once, forward and backward, on the inputs a forward of
the model hands it, under :class:`~moe_train.host_reads.HostReads`, and returns what reads back, by op and site. It
counts on any device, so the check runs in CI on the CPU with the model configured as a GPU runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch
from torch import nn

from moe_models.layers import MoEBlock
from moe_models.module_kinds import decoder_layers
from moe_train.host_reads import HostRead, HostReads

CUDA_GRAPH_SCOPES = ("attn", "moe_router", "moe_preprocess", "layer")


def flatten_tensors(value: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """The tensors of a region's output (tuples, lists, dicts, dataclasses walked; None and other values kept) and
    what rebuilds the output from such a list."""
    if isinstance(value, torch.Tensor):
        return [value], lambda ts: ts[0]
    if is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in fields(value)]
        inner, rebuild = flatten_tensors([getattr(value, n) for n in names])
        return inner, lambda ts: replace(value, **dict(zip(names, rebuild(ts), strict=True)))
    if isinstance(value, dict):
        keys = list(value)
        inner, rebuild = flatten_tensors([value[k] for k in keys])
        return inner, lambda ts: dict(zip(keys, rebuild(ts), strict=True))
    if isinstance(value, list | tuple):
        parts = [flatten_tensors(v) for v in value]
        sizes = [len(p[0]) for p in parts]

        def rebuild_sequence(ts: list[torch.Tensor]) -> Any:
            out, start = [], 0
            for (_, rebuild), size in zip(parts, sizes, strict=True):
                out.append(rebuild(ts[start : start + size]))
                start += size
            return type(value)(out)

        return [t for p in parts for t in p[0]], rebuild_sequence
    return [], lambda ts: value


def _fresh(value: Any) -> Any:
    """A recorded input detached from the model's graph, a leaf that needs grad when floating: the forward is recorded
    without grad, and in training the activations a region takes need theirs (so the inputs' backward is checked
    too, the permutation's scatter among them)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    if isinstance(value, tuple | list):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Region:
    """The first region of a scope: its module path and what runs it on the recorded inputs."""

    scope: str
    path: str
    run: Callable[[], Any]


def _preprocess(block: MoEBlock) -> Callable[..., Any]:
    """The router and the dispatch up to the expert-major rows of ``block``, on the block's own input."""

    def run(x_BSH: torch.Tensor, document_ids_BS: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        ids = None if document_ids_BS is None else document_ids_BS.reshape(-1)
        routing = block.router(x_TH, seq_len=x_BSH.shape[1], document_ids_T=ids)
        dispatched = block.dispatcher.dispatch(x_TH, routing)
        return dispatched.tokens_NH, dispatched.row_probs(), dispatched.tokens_per_expert_E

    return run


def first_regions(model: nn.Module, scopes: tuple[str, ...], forward: Callable[[], Any]) -> list[Region]:
    """The first region of each of ``scopes`` in ``model``, with the inputs ``forward()`` (a forward of the model)
    hands it. Scopes without a region in the model (a model without MoE layers) are left out."""
    wanted: dict[str, tuple[str, nn.Module]] = {}
    for path, layer in decoder_layers(model):  # type: ignore[arg-type]
        block = getattr(layer, "mlp", None)
        if "attn" in scopes and layer.attention is not None and "attn" not in wanted:
            wanted["attn"] = (f"{path}.attention", layer.attention)
        if isinstance(block, MoEBlock):
            for scope, module in (("moe_router", block.router), ("moe_preprocess", block), ("layer", layer)):
                if scope in scopes and scope not in wanted:
                    suffix = {"moe_router": ".mlp.router", "moe_preprocess": ".mlp", "layer": ""}[scope]
                    wanted[scope] = (f"{path}{suffix}", module)
    recorded: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for scope, (_, module) in wanted.items():

        def record(module: nn.Module, args: tuple, kwargs: dict, scope: str = scope) -> None:
            recorded.setdefault(scope, (_fresh(args), _fresh(kwargs)))

        handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    regions = []
    for scope, (path, module) in wanted.items():
        args, kwargs = recorded[scope]
        call = _preprocess(module) if scope == "moe_preprocess" else module
        regions.append(Region(scope, path, lambda call=call, args=args, kwargs=kwargs: call(*args, **kwargs)))
    return regions


def host_reads_of(region: Region) -> list[HostRead]:
    """What the region reads back on the host, forward and backward (a sum of its outputs' values backward)."""
    with HostReads() as reads:
        outputs = [t for t in flatten_tensors(region.run())[0] if t.requires_grad]
        if outputs:
            torch.stack([t.float().sum() for t in outputs]).sum().backward()
    return reads.reads


def capture_problems(model: nn.Module, scopes: tuple[str, ...], forward: Callable[[], Any]) -> dict[str, str]:
    """scope -> one line naming the region and its first host read-back, for each scope whose first region is not
    capturable; empty when all are. The model's buffers (router statistics) are put back and its gradients cleared."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    problems = {}
    try:
        for region in first_regions(model, scopes, forward):
            reads = host_reads_of(region)
            if reads:
                more = f" (and {len(reads) - 1} more)" if len(reads) > 1 else ""
                problems[region.scope] = f"{region.path} reads back on the host: {reads[0]}{more}"
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
    return problems
