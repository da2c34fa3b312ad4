"""QK-clip in the training step (Kimi K2's MuonClip; Megatron-Core's ``--qk-clip``, ``--qk-clip-threshold``,
``--qk-clip-alpha``): after every optimizer step, each softmax attention head h whose largest pre-softmax logit over
the step's global batch, ``S_max^h``, exceeds ``train.qk_clip_threshold`` tau has its query and key projections
rescaled so that its logits shrink by ``gamma_h = tau / S_max^h`` (moe_models.qk_clip: the rows per head, GQA's groups,
MLA's rope parts). As in Megatron-Core it follows any optimizer (with Muon it is MuonClip) and uses the maxima the
step's forwards measured, with the weights before the update.

The maxima come out of the model as a value: every forward of the step is asked for them (the stage's
``attention_logit_max`` keyword, so the output's last item is ``[L_attn, N_local]``); :meth:`QKClip.track` wraps the
step's loss to take that item off and keep the running max over the micro-batches. After the update,
:meth:`QKClip.clip_` makes them global with one ``all_reduce(MAX)`` over every rank of a ``[L_attn, N]`` tensor
(-inf where a rank holds no head): data-parallel replicas saw other sequences, a context-parallel rank its own queries
against every key, and a tensor-parallel rank its share of the heads (global head = tp rank x local heads + local
index). Each rank then scales the rows it holds: a DTensor's local rows (tp's heads, FSDP's shard) from their global
row offset, and an fp32 master copy the optimizer keeps (bf16 parameters) alike. One host synchronisation per step is
avoided: every factor is applied (a factor of 1 leaves a row bitwise as it was).

The step's largest logit and the number of (layer, head) pairs clipped go to ``metrics.jsonl`` as
``max_attention_logit`` and ``qk_clipped_heads`` (:meth:`QKClip.annotate`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moe_models.qk_clip import attention_row_scales, scale_rows_, softmax_attentions

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class QKClip:
    """The running maxima of one step and the clip after its update (module docstring). ``stage``: the model's one
    stage on this rank (pipeline parallelism is refused by the config); ``tp_rank``: this rank's place among the
    tensor-parallel ranks, whose heads it computes."""

    def __init__(
        self,
        stage: nn.Module,
        optimizer: torch.optim.Optimizer,
        threshold: float,
        alpha: float = 0.5,
        tp_rank: int = 0,
    ) -> None:
        self.attentions = softmax_attentions(stage)
        self.heads = stage.config.num_attention_heads
        self.optimizer, self.threshold, self.alpha, self.tp_rank = optimizer, threshold, alpha, tp_rank
        self.running_LN: torch.Tensor | None = None
        self.pending: dict[int, torch.Tensor] = {}  # step -> [max logit, heads clipped], until written

    @classmethod
    def for_run(cls, parallel: Any, optimizer: torch.optim.Optimizer, threshold: float, alpha: float) -> QKClip:
        """The clip of a :class:`~moe_parallel.StagedModel` holding the whole model (one stage)."""
        if len(parallel.stages) != 1:
            raise ValueError("train.qk_clip: the model must be one pipeline stage (parallel.pp 1)")
        meshes = parallel.meshes
        tp_rank = 0 if meshes is None else meshes.layout.coords(meshes.rank, "attention")["tp"]
        return cls(parallel.stages[0], optimizer, threshold, alpha, tp_rank)

    def track(self, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` for a step whose stage forwards return the maxima last: they are kept (running max over the
        micro-batches, restarted here), the rest goes to ``loss_fn``."""
        self.running_LN = None

        def loss(output: tuple[torch.Tensor, ...], labels_BS: torch.Tensor) -> torch.Tensor:
            *rest, maxima_LN = output
            maxima_LN = maxima_LN.detach().float()
            self.running_LN = maxima_LN if self.running_LN is None else torch.maximum(self.running_LN, maxima_LN)
            return loss_fn(rest[0] if len(rest) == 1 else tuple(rest), labels_BS)

        return loss

    def global_maxima(self) -> torch.Tensor:
        """``[L_attn, N]``: every head's largest logit over the step's global batch (a collective: every rank)."""
        if self.running_LN is None:
            raise RuntimeError("train.qk_clip: no forward reported its attention logit maxima this step")
        local_LN = self.running_LN
        layers, local_heads = local_LN.shape
        full_LN = local_LN.new_full((layers, self.heads), float("-inf"))
        first = self.tp_rank * local_heads
        full_LN[:, first : first + local_heads] = local_LN
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(full_LN, op=dist.ReduceOp.MAX)
        return full_LN

    @torch.no_grad()
    def clip_(self, step: int) -> torch.Tensor:
        """Rescale the q/k projections of every head over the threshold (after the optimizer step); returns the
        step's ``[L_attn, N]`` maxima and keeps its metrics for :meth:`annotate`."""
        maxima_LN = self.global_maxima()
        over_LN = maxima_LN > self.threshold
        gamma_LN = torch.where(over_LN, self.threshold / maxima_LN, torch.ones_like(maxima_LN))
        for attention, gamma_N in zip(self.attentions, gamma_LN, strict=True):
            for name, rows_R in attention_row_scales(attention, gamma_N, self.alpha).items():
                param = attention.get_parameter(name)
                master = self.optimizer.state.get(param, {}).get("master")  # moe_train.adamw's fp32 copy
                for tensor in (param, master):
                    if tensor is not None:
                        local, first_row = _local_rows(tensor)
                        scale_rows_(local, rows_R, first_row)
        top = maxima_LN.max() if maxima_LN.numel() else maxima_LN.new_tensor(float("-inf"))
        self.pending[step] = torch.stack([top, over_LN.sum().float()])
        self.running_LN = None
        return maxima_LN

    def annotate(self, records: list[dict[str, Any]]) -> None:
        """Add each written step's ``max_attention_logit`` and ``qk_clipped_heads`` to its record (read back with
        the records, so a step that writes none never waits)."""
        for record in records:
            stats = self.pending.pop(record["step"], None)
            if stats is not None:
                top, clipped = stats.tolist()
                record["max_attention_logit"], record["qk_clipped_heads"] = top, int(clipped)
        self.pending = {s: v for s, v in self.pending.items() if s > max((r["step"] for r in records), default=0)}


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """This rank's rows of ``tensor`` (a DTensor's local shard, or all of it) and the global index of the first."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor._local_tensor[: shape[0]], offset[0]
