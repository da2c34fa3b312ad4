"""A small MoE model that is not moe_models', with its own ParallelPlan: what a third-party model hands
moe_parallel. Its MoE block keeps router, dispatcher and experts under other names than the plan's defaults, so
a test passing proves the plan's names are the ones used."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from moe_dispatch import LocalDispatcher, RouterConfig, TopKRouter
from moe_experts import GroupedExperts
from moe_parallel import MoEBlockPlan, ParallelPlan

VOCAB, HIDDEN, FFN, EXPERTS, EXPERT_FFN, TOPK = 32, 16, 32, 4, 8, 2


class DenseFFN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(HIDDEN, FFN)
        self.wo = nn.Linear(FFN, HIDDEN)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.wo(F.gelu(self.wi(x_BSH)))


class RoutedFFN(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.gate = TopKRouter(HIDDEN, RouterConfig(num_experts=EXPERTS, topk=TOPK))
        self.token_mover = LocalDispatcher(EXPERTS)
        self.bank = GroupedExperts(EXPERTS, HIDDEN, EXPERT_FFN, activation="swiglu", bias=True, seed=seed)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        routing = self.gate(x_TH, seq_len=x_BSH.shape[1])
        sent = self.token_mover.dispatch(x_TH, routing)
        y_NH = self.bank(sent.tokens_NH, sent.tokens_per_expert_E, sent.row_probs())
        return self.token_mover.combine(y_NH, sent.probs_applied()).view_as(x_BSH)


class ToyMoE(nn.Module):
    """Embedding -> residual dense FFN -> residual routed FFN -> head: ``model(ids_BS) -> logits_BSV``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.ffn = DenseFFN()
        self.moe = RoutedFFN(seed)
        self.out = nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():  # non-zero expert biases, so their gradients' paths matter
            self.moe.bank.b_gate_up_E2F.normal_(std=0.1)
            self.moe.bank.b_down_EH.normal_(std=0.1)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSH = self.tok(ids_BS)
        x_BSH = x_BSH + self.ffn(x_BSH)
        x_BSH = x_BSH + self.moe(x_BSH)
        return self.out(x_BSH)

    def parallel_plan(self) -> ParallelPlan:
        return PLAN


# sequence parallel between the blocks (as moe_models): the embedding reduce-scatters the sequence, the dense FFN
# all-gathers it and reduce-scatters its output, the MoE block routes the local chunk, the head gathers it again
PLAN = ParallelPlan(
    tensor_parallel={
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "ffn": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "ffn.wi": ColwiseParallel(),
        "ffn.wo": RowwiseParallel(output_layouts=Shard(1)),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    },
    tp_partial_grads=("moe.gate.weight",),  # whole on every tp rank, sees its sequence chunk only
    tp_divides={"FFN": FFN},
    fsdp_units=("ffn", "moe"),
    moe_blocks=(MoEBlockPlan("moe", router="gate", dispatcher="token_mover", experts="bank"),),
)


def loss_fn(model: nn.Module, ids_BS: torch.Tensor) -> torch.Tensor:
    logits_BSV = model(ids_BS[:, :-1])
    return F.cross_entropy(logits_BSV.reshape(-1, VOCAB), ids_BS[:, 1:].reshape(-1))
