"""moe_memory.torch_differences: what it reports is what the installed torch's checkpoint does."""

import torch
from torch import nn

from moe_memory import apply_activation_checkpointing
from moe_memory.torch_differences import checkpoint_placeholders, torch_differences


def test_placeholders_are_the_empty_tensors_a_recomputed_module_saves() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    apply_activation_checkpointing(model, ["0", "2"])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = model(torch.randn(3, 4, requires_grad=True))
    out.sum().backward()
    assert sum(t.numel() == 0 for t in saved) == 2 * checkpoint_placeholders()
    assert sum(t.nbytes for t in saved if t.numel() == 0) == 0
    assert len(torch_differences()) == (checkpoint_placeholders() > 0)
