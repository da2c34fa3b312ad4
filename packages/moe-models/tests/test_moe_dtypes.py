"""The dtypes along the MoE path under bf16 autocast with fp32 parameters (Megatron's mixed precision): the router's
logits in ``router_dtype`` (fp32), and dispatch, expert GEMMs and combine in bf16. On CPU bf16 is slow but correct,
so this is checked here with spies on the dispatcher and the expert back end."""

from __future__ import annotations

import dataclasses

import torch

from moe_dispatch import RouterConfig
from moe_models.layers import MoEBlock

HIDDEN, FFN, EXPERTS = 32, 16, 4


def _block(seed: int = 0) -> MoEBlock:
    torch.manual_seed(seed)
    block = MoEBlock(HIDDEN, FFN, RouterConfig(num_experts=EXPERTS, topk=2), expert_backend="loop")
    block.experts.seed = seed
    block.experts.reset_parameters()
    return block


class _Spy:
    """Records the dtypes the dispatcher and the expert back end receive, around the real ones."""

    def __init__(self, block: MoEBlock) -> None:
        self.seen: dict[str, list[torch.dtype]] = {"dispatch": [], "gmm_x": [], "gmm_w": [], "combine": []}
        dispatcher, backend = block.dispatcher, block.experts.backend
        real_dispatch, real_combine, real_gmm = dispatcher.dispatch, dispatcher.combine, backend.gmm

        def dispatch(x_TH, routing):
            self.seen["dispatch"].append(x_TH.dtype)
            return real_dispatch(x_TH, routing)

        def combine(y_NH, handle):
            self.seen["combine"].append(y_NH.dtype)
            return real_combine(y_NH, handle)

        def gmm(x_NK, w_EKM, tokens_per_expert_E):
            self.seen["gmm_x"].append(x_NK.dtype)
            self.seen["gmm_w"].append(w_EKM.dtype)
            return real_gmm(x_NK, w_EKM, tokens_per_expert_E)

        dispatcher.dispatch, dispatcher.combine = dispatch, combine
        block.experts.backend = dataclasses.replace(backend, gmm=gmm)


def test_bf16_autocast_runs_dispatch_experts_and_combine_in_bf16_with_fp32_router_logits():
    block = _block()
    spy = _Spy(block)
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, routing = block(x)
    out.float().sum().backward()
    assert spy.seen["dispatch"] == [torch.bfloat16]
    # both projections forward, and the first one's input gradient (the experts gather their own rows: the back
    # end's own gmm runs in that backward)
    assert spy.seen["gmm_x"] == [torch.bfloat16] * 3
    assert spy.seen["gmm_w"] == [torch.bfloat16] * 3
    assert spy.seen["combine"] == [torch.bfloat16]
    assert out.dtype == torch.bfloat16
    assert x.grad is not None and x.grad.dtype == torch.float32  # the residual stream keeps its dtype
    assert block.experts.w_gate_up_EH2F.grad.dtype == torch.float32

    # the router saw fp32 logits: the same choice and the same probabilities as without autocast
    reference = _block()
    with torch.no_grad():
        _, ref_routing = reference(x.detach())
    assert routing.probs_TK.dtype == torch.float32
    assert torch.equal(routing.expert_idx_TK, ref_routing.expert_idx_TK)
    torch.testing.assert_close(routing.probs_TK.detach(), ref_routing.probs_TK, rtol=0, atol=0)


def test_without_autocast_the_moe_path_keeps_the_input_dtype():
    block = _block()
    spy = _Spy(block)
    out, _ = block(torch.randn(1, 4, HIDDEN))
    assert spy.seen["dispatch"] == spy.seen["combine"] == [torch.float32]
    assert spy.seen["gmm_x"] == [torch.float32, torch.float32]
    assert out.dtype == torch.float32
