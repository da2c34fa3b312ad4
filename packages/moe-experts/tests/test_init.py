"""Per-expert init independent of how experts are split over ranks, and of expert tensor parallelism."""

from __future__ import annotations

import pytest
import torch

from moe_experts.activations import ACTIVATIONS, gate_up_columns
from moe_experts.grouped import GroupedExperts, expert_seed

H, F = 8, 12


def _params(experts):
    return {name: p.detach().clone() for name, p in experts.named_parameters()}


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "squared_relu"])
@pytest.mark.parametrize("slices", [[2, 2], [1, 1, 1, 1], [3, 1]])
def test_expert_slices_equal_building_all_experts_at_once(activation, slices):
    whole = _params(GroupedExperts(4, H, F, activation, backend="loop", bias=True, seed=11))
    parts, first = [], 0
    for size in slices:
        parts.append(_params(GroupedExperts(size, H, F, activation, "loop", True, first_expert=first, seed=11)))
        first += size
    for name, tensor in whole.items():
        torch.testing.assert_close(torch.cat([p[name] for p in parts]), tensor, rtol=0, atol=0)


def test_experts_differ_from_each_other_and_between_seeds():
    a = GroupedExperts(3, H, F, backend="loop", seed=1)
    b = GroupedExperts(3, H, F, backend="loop", seed=2)
    w = a.w_gate_up_EH2F.detach()
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    assert not torch.equal(w, b.w_gate_up_EH2F.detach())
    # the same expert on two layers with different seeds differs; rank 3 of 4 expert 0 = global expert 3
    c = GroupedExperts(1, H, F, backend="loop", seed=1, first_expert=2)
    torch.testing.assert_close(c.w_gate_up_EH2F.detach()[0], w[2], rtol=0, atol=0)


def test_expert_seed_mixes_both_inputs():
    seeds = {expert_seed(s, g) for s in range(20) for g in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)


def test_reset_parameters_is_reproducible_and_keeps_scales():
    experts = GroupedExperts(4, 64, 128, backend="loop", seed=5)
    before = _params(experts)
    experts.reset_parameters(std=0.02)
    for name, tensor in _params(experts).items():
        assert torch.equal(tensor, before[name]), name
    experts.reset_parameters(std=0.5, num_layers=8)
    assert experts.w_gate_up_EH2F.std().item() == pytest.approx(0.5, rel=0.03)
    assert experts.w_down_EFH.std().item() == pytest.approx(0.125, rel=0.03)


def test_without_seed_follows_torch_manual_seed():
    torch.manual_seed(3)
    a = _params(GroupedExperts(2, H, F, backend="loop"))
    torch.manual_seed(3)
    b = _params(GroupedExperts(2, H, F, backend="loop"))
    c = _params(GroupedExperts(2, H, F, backend="loop"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["w_gate_up_EH2F"], c["w_gate_up_EH2F"])


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "gelu"])
@pytest.mark.parametrize("etp_size", [2, 3])
def test_etp_shards_are_slices_of_the_full_weights(activation, etp_size):
    full = GroupedExperts(2, H, F, activation, backend="loop", bias=True, seed=4, first_expert=6)
    fl = F // etp_size
    for rank in range(etp_size):
        shard = GroupedExperts(
            2, H, F, activation, "loop", True, first_expert=6, seed=4, etp_rank=rank, etp_size=etp_size
        )
        if ACTIVATIONS[activation].layout == "halves":  # by hand: gate units then up units
            cols = list(range(rank * fl, (rank + 1) * fl)) + list(range(F + rank * fl, F + (rank + 1) * fl))
        elif ACTIVATIONS[activation].layout == "interleaved":
            cols = list(range(2 * rank * fl, 2 * (rank + 1) * fl))
        else:
            cols = list(range(rank * fl, (rank + 1) * fl))
        assert gate_up_columns(ACTIVATIONS[activation].layout, F, rank * fl, (rank + 1) * fl).tolist() == cols
        assert shard.w_gate_up_EH2F.shape == (2, H, len(cols))
        torch.testing.assert_close(
            shard.w_gate_up_EH2F.detach(), full.w_gate_up_EH2F.detach()[:, :, cols], rtol=0, atol=0
        )
        torch.testing.assert_close(
            shard.w_down_EFH.detach(), full.w_down_EFH.detach()[:, rank * fl : (rank + 1) * fl], rtol=0, atol=0
        )


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_oai", "geglu", "squared_relu", "gelu"])
def test_etp_partial_outputs_sum_to_full_output_in_one_process(activation):
    """The etp ranks simulated in one process (the 2-process version is test_etp_dist.py)."""
    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 4])
    x = torch.randn(7, H, generator=gen)
    probs = torch.rand(7, generator=gen)
    kwargs = dict(activation=activation, backend="loop", bias=True, seed=9)

    def build(**extra):
        experts = GroupedExperts(3, H, F, **kwargs, **extra)
        b_gen = torch.Generator().manual_seed(1)  # the same non-zero full biases, sliced for the shards
        b1 = torch.randn(3, F * ACTIVATIONS[activation].width_factor, generator=b_gen)
        with torch.no_grad():
            experts.b_gate_up_E2F.copy_(b1[:, experts.local_gate_up_columns()])
            experts.b_down_EH.copy_(torch.randn(3, H, generator=b_gen))
            experts.w_gate_up_EH2F.mul_(50)
        return experts

    full = build()(x, counts, probs)
    partial = [build(etp_rank=r, etp_size=2)(x, counts, probs) for r in range(2)]
    torch.testing.assert_close(partial[0] + partial[1], full, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(partial[0], full, atol=1e-3)  # each shard alone is not the answer
