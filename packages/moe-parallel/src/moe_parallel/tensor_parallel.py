"""Tensor + sequence parallelism (Megatron-style, with DTensor parallel styles) for moe_models' decoder.

The residual stream between blocks is split along the sequence over the tp ranks (sequence parallel): norms run
on the local chunk (:class:`SequenceParallel`), attention and dense MLPs all-gather it, split heads / FFN columns
(:class:`ColwiseParallel`) and reduce-scatter the output (:class:`RowwiseParallel`). MoE blocks route the local
chunk: tokens reach their experts through the expert-parallel dispatcher, not through tp. Balancing statistics
are summed over the tp ranks (the routers' ``sequence_group``), but a capacity factor is applied per chunk, as in
Megatron-Core: with token dropping, tp changes which tokens are dropped.

Parameters that stay plain tensors and see only part of the data get only part of their gradient on each tp rank;
:func:`apply_tensor_parallel` returns them so the training step sums their gradients over tp
(:class:`~moe_parallel.grads.GradientSync`): the router and shared experts of MoE blocks (local tokens), Qwen3's
q/k norms (local heads) and the MTP input projections (local tokens). MLA's ``kv_a_proj`` output feeds both the
column-parallel ``kv_b_proj`` (whose input gradient DTensor already sums) and the rotary key every local head
shares: the gradient of that rotary slice is summed over tp in the backward (:class:`_SumGradOverGroup`).

Module names follow moe_models' checkpoint layout (``layers.{i}.attention.q_proj`` ...); the model code itself
holds no parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient's last-dim columns ``[start:]`` over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.start, ctx.group = start, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.clone()
        part = grad[..., ctx.start :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., ctx.start :] = part
        return grad, None, None


def _sum_grad_columns_from(start: int, group: dist.ProcessGroup):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return _SumGradOverGroup.apply(output, start, group)

    return hook


def check_tensor_parallel(config, tp: int) -> None:
    """Raise ``ValueError`` naming the field when ``config`` (a moe_models ModelConfig) cannot split over ``tp``."""
    if tp == 1:
        return
    checks = [("num_attention_heads", config.num_attention_heads)]
    if not config.multi_latent_attention:
        checks.append(("num_query_groups", config.num_query_groups))
    for name, value in checks:
        if value % tp:
            raise ValueError(f"model.{name}={value} is not divisible by parallel.tp={tp}")
    if config.softmax_type != "vanilla":
        raise ValueError(f"model.softmax_type={config.softmax_type!r} (attention sinks) does not support tp > 1 yet")
    if config.share_embeddings_and_output_weights:
        raise ValueError("model.share_embeddings_and_output_weights=true does not support tp > 1 yet")
    if 0 in config.moe_layer_pattern() and config.ffn_hidden_size % tp:  # only dense layers split it
        raise ValueError(f"model.ffn_hidden_size={config.ffn_hidden_size} is not divisible by parallel.tp={tp}")


def _attention_plan(attention: nn.Module) -> dict:
    plan: dict = {"o_proj": RowwiseParallel(output_layouts=Shard(1))}
    if hasattr(attention, "kv_a_proj"):  # MLA: the latents are small and stay whole on every rank
        plan["kv_b_proj"] = ColwiseParallel()
        plan["q_b_proj" if getattr(attention, "q_latent", False) else "q_proj"] = ColwiseParallel()
    else:
        plan.update({name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")})
    return plan


def _parallelize_decoder_layer(layer: nn.Module, tp_mesh: DeviceMesh, partial: list[nn.Parameter]) -> None:
    attention, mlp = layer.attention, layer.mlp
    parallelize_module(
        layer,
        tp_mesh,
        {
            "input_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,  # the MLA latents are plain Linears on the whole sequence
            ),
            "post_attention_norm": SequenceParallel(),
        },
    )
    parallelize_module(attention, tp_mesh, _attention_plan(attention))
    if hasattr(attention, "kv_a_proj"):
        group = tp_mesh.get_group()
        attention.kv_a_proj.register_forward_hook(_sum_grad_columns_from(attention.kv_lora_rank, group))
    else:
        for norm in (attention.q_norm, attention.k_norm):  # per-head norms over this rank's heads
            partial.extend(norm.parameters())
    if hasattr(mlp, "router"):  # MoE: route this rank's sequence chunk
        parallelize_module(
            mlp,
            tp_mesh,
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True),
        )
        partial.extend(mlp.router.parameters())
        if mlp.shared_experts is not None:
            partial.extend(mlp.shared_experts.parameters())
    else:
        parallelize_module(
            mlp,
            tp_mesh,
            {
                "": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
                "gate_proj": ColwiseParallel(),
                "up_proj": ColwiseParallel(),
                "down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> list[nn.Parameter]:
    """Split a moe_models ``MoETransformer`` over ``tp_mesh`` in place (tensor + sequence parallel).

    Returns the parameters whose gradients must be summed over the tp ranks after the backward (module
    docstring). The sequence length must divide by the tp size; routers are not told about the split here
    (:func:`moe_parallel.parallelize` sets their ``sequence_group``).
    """
    check_tensor_parallel(model.config, tp_mesh.size())
    partial: list[nn.Parameter] = []
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for layer in model.layers:
        _parallelize_decoder_layer(layer, tp_mesh, partial)
    for mtp in model.mtp:
        # the MTP input (norms of the previous hidden state and of the next embeddings, their projection) runs on
        # the local sequence chunk with whole weights
        partial.extend([*mtp.enorm.parameters(), *mtp.hnorm.parameters(), *mtp.eh_proj.parameters()])
        _parallelize_decoder_layer(mtp.layer, tp_mesh, partial)
        parallelize_module(mtp, tp_mesh, {"final_norm": SequenceParallel()})
    return partial
