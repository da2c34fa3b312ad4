"""apply_activation_checkpointing: same numbers, recomputed forwards, fewer saved activations."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from moe_memory import apply_activation_checkpointing

HIDDEN = 12


class CountingMLP(nn.Module):
    """fc1 -> GELU -> dropout -> fc2, counting how often its own forward body runs."""

    def __init__(self, dim: int, p_drop: float = 0.25) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p_drop)
        self.fc2 = nn.Linear(3 * dim, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc2(self.drop(self.act(self.fc1(x))))


class CountingMix(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.proj(x))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = CountingMix(dim)
        self.mlp = CountingMLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(x)
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self, dim: int = HIDDEN, num_layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(5, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(num_layers))
        self.head = nn.Linear(dim, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class TupleOut(nn.Module):
    """Takes a keyword argument and returns (tensor, tensor), like the MoE block's (out, routing)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x) * scale
        return y, (y**2).mean()


class WithTuple(nn.Module):
    def __init__(self, dim: int = HIDDEN) -> None:
        super().__init__()
        self.inner = TupleOut(dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.inner(x, scale=0.5)
        return self.out(torch.sin(y)).sum() + aux


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _input() -> torch.Tensor:
    return torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(1))


def _run(model: nn.Module, x: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward + backward from a fixed RNG state (dropout); output and parameter gradients."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(x)
    (out.square().sum() + out.sum()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _reset_calls(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "calls"):
            m.calls = 0


# ----------------------------------------------------------------------------- same numbers


@pytest.mark.parametrize("patterns", [["layers.*.mlp"], ["layers.1"], ["layers.0.mix", "layers.2.mlp"]])
def test_outputs_and_gradients_unchanged(patterns):
    plain = _net().train()
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, patterns)
    x = _input()
    out_ref, grads_ref = _run(plain, x)
    out, grads = _run(ckpt, x)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=0, atol=1e-6)
    # the dropout mask really matters here: another seed gives other gradients
    _, other = _run(plain, x, seed=8)
    assert not torch.allclose(other["layers.0.mlp.fc1.weight"], grads_ref["layers.0.mlp.fc1.weight"], atol=1e-4)


def test_input_gradients_unchanged():
    plain = _net()
    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, ["layers.*"])  # nests: layers.0 and everything inside it
    grads = []
    for model in (plain, ckpt):
        x = _input().requires_grad_()
        torch.manual_seed(3)
        model(x).pow(3).sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)


def test_keyword_arguments_and_tuple_outputs():
    torch.manual_seed(0)
    plain = WithTuple()
    ckpt = copy.deepcopy(plain)
    assert apply_activation_checkpointing(ckpt, ["inner"]) == ["inner"]
    x = torch.randn(3, HIDDEN)
    results = []
    for model in (plain, ckpt):
        loss = model(x)
        loss.backward()
        results.append((loss.detach(), model.inner.lin.weight.grad.clone()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- recomputation happens


def test_wrapped_forward_runs_twice_others_once():
    model = _net()
    apply_activation_checkpointing(model, ["layers.*.mlp"])
    child_calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.endswith(("mlp.fc1", "mix.proj", "norm")) or name in ("embed", "head"):
            module.register_forward_hook(
                lambda *_, name=name: child_calls.__setitem__(name, child_calls.get(name, 0) + 1)
            )
    _reset_calls(model)
    _run(model, _input())
    for i, layer in enumerate(model.layers):
        assert layer.mlp.calls == 2, f"layers.{i}.mlp"
        assert layer.mix.calls == 1, f"layers.{i}.mix"
        assert child_calls[f"layers.{i}.mlp.fc1"] == 2  # submodules of a recomputed module rerun too
        assert child_calls[f"layers.{i}.mix.proj"] == 1
        assert child_calls[f"layers.{i}.norm"] == 1
    assert child_calls["embed"] == child_calls["head"] == 1


def test_forward_alone_runs_once():
    model = _net()
    apply_activation_checkpointing(model, ["layers.*.mlp"])
    _reset_calls(model)
    with torch.no_grad():
        model(_input())
    assert [layer.mlp.calls for layer in model.layers] == [1, 1, 1]


def test_only_matching_modules_are_recomputed():
    model = _net()
    assert apply_activation_checkpointing(model, ["layers.1.mlp"]) == ["layers.1.mlp"]
    _reset_calls(model)
    _run(model, _input())
    assert [layer.mlp.calls for layer in model.layers] == [1, 2, 1]


def _saved_tensor_count(model: nn.Module, x: torch.Tensor) -> int:
    """Tensors autograd keeps for backward outside any checkpointed region."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += t.numel() > 0  # an empty placeholder holds nothing (torch 2.11's checkpoint saves one per region)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.sum().backward()
    return count


def test_checkpointed_modules_keep_no_activations():
    x = _input()
    plain = _net().eval()  # no dropout masks: the per-module counts below add up exactly
    full = _saved_tensor_count(plain, x)
    mlps = [layer.mlp for layer in plain.layers]
    h = plain.embed(x)
    per_mlp = []
    for layer in plain.layers:  # what each MLP alone saves on its real input
        h = h + layer.mix(h)
        per_mlp.append(_saved_tensor_count(layer.mlp, layer.norm(h).detach().requires_grad_()))
        h = h + layer.mlp(layer.norm(h))
    assert all(n > 0 for n in per_mlp) and len(per_mlp) == len(mlps)

    ckpt = copy.deepcopy(plain)
    apply_activation_checkpointing(ckpt, ["layers.*.mlp"])
    # each recomputed MLP keeps just its one input (to rerun from) instead of its activations
    assert _saved_tensor_count(ckpt, x) == full - sum(per_mlp) + len(mlps)


# ----------------------------------------------------------------------------- names, state, idempotence


def test_returns_the_names_wrapped_in_model_order():
    model = _net()
    assert apply_activation_checkpointing(model, ["layers.*.mlp"]) == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]
    assert apply_activation_checkpointing(model, ["layers.?.mix", "head"]) == [
        "layers.0.mix",
        "layers.1.mix",
        "layers.2.mix",
        "head",
    ]


def test_overlapping_patterns_wrap_each_module_once():
    model = _net()
    assert apply_activation_checkpointing(model, ["layers.0.mlp", "layers.*.mlp"]) == [
        "layers.0.mlp",
        "layers.1.mlp",
        "layers.2.mlp",
    ]
    _reset_calls(model)
    _run(model, _input())
    assert [layer.mlp.calls for layer in model.layers] == [2, 2, 2]


def test_wrapping_twice_is_a_no_op():
    model = _net()
    reference = copy.deepcopy(model)
    apply_activation_checkpointing(model, ["layers.*.mlp"])
    assert apply_activation_checkpointing(model, ["layers.*.mlp"]) == []
    _reset_calls(model)
    out, grads = _run(model, _input())
    assert [layer.mlp.calls for layer in model.layers] == [2, 2, 2]  # not recomputed a third time
    out_ref, grads_ref = _run(reference, _input())
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=0, atol=1e-6)


def test_state_dict_and_parameter_names_unchanged():
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names_before = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, ["layers.*.mlp", "layers.0"])
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert [n for n, _ in model.named_parameters()] == names_before
    # and a checkpoint from an unwrapped model loads into the wrapped one
    fresh = Net()
    assert model.load_state_dict(fresh.state_dict()) is not None
    assert torch.equal(model.layers[1].mlp.fc1.weight, fresh.layers[1].mlp.fc1.weight)


def test_deepcopy_of_a_wrapped_model_uses_its_own_weights():
    model = _net()
    apply_activation_checkpointing(model, ["layers.*.mlp"])
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in twin.layers:
            layer.mlp.fc2.weight.zero_()
            layer.mlp.fc2.bias.zero_()
    _reset_calls(model)
    _reset_calls(twin)
    x = _input()
    twin_out, _ = _run(twin, x)
    # with the MLPs' outputs zeroed, each block is x + mix(x)
    plain = copy.deepcopy(twin).eval()
    h = plain.embed(x)
    for layer in plain.layers:
        h = h + layer.mix(h)
    torch.testing.assert_close(twin_out, plain.head(h).detach(), rtol=0, atol=1e-6)
    assert [layer.mlp.calls for layer in twin.layers] == [2, 2, 2]
    assert [layer.mlp.calls for layer in model.layers] == [0, 0, 0]


# ----------------------------------------------------------------------------- errors


def test_unmatched_pattern_names_close_matches():
    model = _net()
    with pytest.raises(ValueError) as err:
        apply_activation_checkpointing(model, ["layer.1.mlp"])
    msg = str(err.value)
    assert "'layer.1.mlp'" in msg
    assert "did you mean" in msg and "layers.1.mlp" in msg


def test_unmatched_pattern_without_close_matches():
    with pytest.raises(ValueError, match=r"'zzzz' matches no submodule$"):
        apply_activation_checkpointing(_net(), ["zzzz"])


def test_pattern_is_not_matched_against_the_root():
    with pytest.raises(ValueError, match="matches no submodule"):
        apply_activation_checkpointing(_net(), [""])


def test_a_bad_pattern_leaves_the_model_untouched():
    model = _net()
    with pytest.raises(ValueError, match=re.escape("'layers.*.mpl'")):
        apply_activation_checkpointing(model, ["layers.*.mlp", "layers.*.mpl"])
    _reset_calls(model)
    _run(model, _input())
    assert [layer.mlp.calls for layer in model.layers] == [1, 1, 1]
    assert apply_activation_checkpointing(model, ["layers.*.mlp"]) == ["layers.0.mlp", "layers.1.mlp", "layers.2.mlp"]


def test_no_patterns_wraps_nothing():
    model = _net()
    assert apply_activation_checkpointing(model, []) == []
    _run(model, _input())
    assert [layer.mlp.calls for layer in model.layers] == [1, 1, 1]
