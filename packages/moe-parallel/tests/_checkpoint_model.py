"""A small model with several routed-expert banks, each of another kind, and its ParallelPlan: what the expert
checkpoint tests save under one layout and load under another. No forward: only its parameters matter there.

Banks are ``(name, activation, experts, ffn width, bias)``; the dense parts (embedding, an FFN, a head) are split
by tensor parallelism as moe_models splits its own (sequence parallel between the blocks)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from moe_dispatch import LocalDispatcher, RouterConfig, TopKRouter
from moe_experts import GroupedExperts
from moe_parallel import MoEBlockPlan, ParallelPlan

VOCAB, FFN = 32, 32
Bank = tuple[str, str, int, int, bool]


class MoEBlock(nn.Module):
    def __init__(self, hidden: int, activation: str, experts: int, ffn: int, bias: bool, seed: int) -> None:
        super().__init__()
        self.router = TopKRouter(hidden, RouterConfig(num_experts=experts, topk=1))
        self.dispatcher = LocalDispatcher(experts)
        self.experts = GroupedExperts(experts, hidden, ffn, activation=activation, bias=bias, seed=seed)


class BanksModel(nn.Module):
    def __init__(self, hidden: int, banks: tuple[Bank, ...], seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(VOCAB, hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, FFN), nn.GELU(), nn.Linear(FFN, hidden))
        self.moe = nn.ModuleDict(
            {
                name: MoEBlock(hidden, act, experts, ffn, bias, seed=seed * 100 + i)
                for i, (name, act, experts, ffn, bias) in enumerate(banks)
            }
        )
        self.out = nn.Linear(hidden, VOCAB, bias=False)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # the experts' own init leaves biases at zero
            for block in self.moe.values():
                for b in (block.experts.b_gate_up_E2F, block.experts.b_down_EH):
                    if b is not None:
                        b.copy_(torch.randn(b.shape, generator=gen))
        self.banks = banks

    def parallel_plan(self) -> ParallelPlan:
        names = [name for name, *_ in self.banks]
        return ParallelPlan(
            tensor_parallel={
                "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "ffn": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
                "ffn.0": ColwiseParallel(),
                "ffn.2": RowwiseParallel(output_layouts=Shard(1)),
                "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
            tp_partial_grads=tuple(f"moe.{n}.router.weight" for n in names),
            tp_divides={"FFN": FFN},
            fsdp_units=("ffn", *(f"moe.{n}" for n in names)),
            moe_blocks=tuple(MoEBlockPlan(f"moe.{n}") for n in names),
        )


# swiglu (gate and up in halves) with biases, GPT-OSS's interleaved swiglu_oai with biases, a non-gated bank
MAIN = (16, (("a", "swiglu", 4, 8, True), ("b", "swiglu_oai", 2, 8, True), ("c", "gelu", 2, 8, False)))
# experts that do not divide over the edp ranks: FSDP2 shards them along dim 1, or unevenly along dim 0
ODD = (6, (("a", "swiglu", 3, 4, True), ("b", "swiglu_oai", 1, 4, True)))
FAMILIES = {"main": MAIN, "odd": ODD}


def build(family: str, seed: int) -> BanksModel:
    hidden, banks = FAMILIES[family]
    return BanksModel(hidden, banks, seed)
