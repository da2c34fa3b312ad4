"""apply_memory_policy on a toy layer: output-discarding recompute and offload keep every gradient, and move or drop
exactly the bytes a hand count says; bad choices are errors naming the setting."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from moe_memory import MemoryConfigError, apply_memory_policy, check_memory_options

B, H = 6, 16


class Norm(nn.Module):
    """RMSNorm-like: saves its input, the inverse rms and the normalised rows (for the weight's gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(H) + 0.5)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Act(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(h)


class Block(nn.Module):
    """norm -> three projections (each saves the norm's output) -> act -> down."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = Norm()
        self.q, self.k, self.v = nn.Linear(H, H), nn.Linear(H, H), nn.Linear(H, H)
        self.act = Act()
        self.down = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        h = self.q(y) * self.k(y) + self.v(y)
        return x + self.down(self.act(h))


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


KINDS = {
    "layernorm": ["layers.0.norm", "layers.1.norm"],
    "attn_norm": ["layers.0.norm", "layers.1.norm"],
    "qkv_linear": [f"layers.{i}.{p}" for i in range(2) for p in "qkv"],
    "moe_act": ["layers.0.act", "layers.1.act"],
    "attn_proj": ["layers.0.down", "layers.1.down"],
}


class SavedBytes:
    """Outer hooks counting the distinct storages saved (parameters excluded), to see what the policy keeps."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in self.params:
            self.storages[key] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def run(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    meter = SavedBytes(model)
    with saved_tensors_hooks(meter.pack, lambda t: t):
        out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), grads, meter.total


@pytest.fixture
def pair() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    plain = Toy()
    return plain, copy.deepcopy(plain), torch.randn(B, H, requires_grad=True)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=0, msg=name)


def test_layernorm_output_is_discarded_and_recomputed_once(pair) -> None:
    plain, wrapped, x = pair
    out_ref, grads_ref, saved_ref = run(plain, x)
    policy = apply_memory_policy(wrapped, KINDS, ["layernorm"])
    out, grads, saved = run(wrapped, x)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    assert_same(grads, grads_ref)
    # per layer the plain norm saves its input x [B,H], the inverse rms [B,1] and the normalised rows [B,H]; its
    # output [B,H] is saved by q, k and v. Recompute keeps the input only, the three saves of the output are tokens
    per_layer = B * 4 + B * H * 4 + B * H * 4
    assert saved_ref - saved == 2 * per_layer
    assert policy.stats.discarded_bytes == 2 * B * H * 4
    # forward, the output's recompute for q/k/v (shared), checkpoint's recompute for the norm's own backward
    assert [layer.norm.calls for layer in wrapped.layers] == [3, 3]
    assert sorted(policy.recomputed) == ["layers.0.norm", "layers.1.norm"]


def test_offload_moves_the_saved_inputs_and_keeps_gradients(pair) -> None:
    plain, wrapped, x = pair
    _, grads_ref, saved_ref = run(plain, x)
    policy = apply_memory_policy(wrapped, KINDS, offload_modules=["qkv_linear"], offload_min_tensor_bytes=0)
    _, grads, saved = run(wrapped, x)
    assert_same(grads, grads_ref)
    # q, k and v all save the norm output: one [B,H] storage per layer leaves, once; weights stay
    assert policy.stats.offloaded_bytes == 2 * B * H * 4
    assert policy.stats.offloaded_tensors == 2
    assert saved_ref - saved == 2 * B * H * 4


def test_offload_threshold_keeps_small_tensors(pair) -> None:
    _, wrapped, x = pair
    policy = apply_memory_policy(wrapped, KINDS, offload_modules=["qkv_linear"], offload_min_tensor_bytes=B * H * 4 + 1)
    run(wrapped, x)
    assert policy.stats.offloaded_bytes == 0


def test_recompute_and_offload_compose(pair) -> None:
    plain, wrapped, x = pair
    _, grads_ref, _ = run(plain, x)
    policy = apply_memory_policy(wrapped, KINDS, ["layernorm", "moe_act"], ["attn_proj"], 0)
    _, grads, _ = run(wrapped, x)
    assert_same(grads, grads_ref)
    # down's input is the discarded activation output: discarding wins, nothing of it is offloaded
    assert policy.stats.offloaded_bytes == 0
    assert policy.stats.discarded_bytes == 2 * (B * H * 4 + B * H * 4)


def test_patterns_still_select_modules(pair) -> None:
    plain, wrapped, x = pair
    _, grads_ref, saved_ref = run(plain, x)
    policy = apply_memory_policy(wrapped, KINDS, ["layers.*.norm"])
    _, grads, saved = run(wrapped, x)
    assert_same(grads, grads_ref)
    assert policy.saved is None  # plain checkpointing needs no saved-tensor hooks
    # the norms' rms and normalised rows are recomputed; their outputs stay saved by q, k and v
    assert saved_ref - saved == 2 * (B * 4 + B * H * 4)


@pytest.mark.parametrize(
    ("recompute", "offload", "field", "message"),
    [
        (["core_atn"], [], "recompute", "=['core_atn']: 'core_atn' is neither a module kind nor a pattern"),
        (["mla_up_proj"], [], "recompute", "=['mla_up_proj']: this model has no 'mla_up_proj' modules; its kinds are"),
        ([], ["expert_fc1"], "offload", "=['expert_fc1']: this model has no 'expert_fc1' modules"),
        (["layers.*"], ["attn_proj"], "offload", "=['attn_proj']: 'attn_proj' (layers.0.down) is recomputed by"),
    ],
)
def test_bad_choices_name_the_setting(recompute, offload, field, message) -> None:
    with pytest.raises(MemoryConfigError) as err:
        check_memory_options(Toy(), KINDS, recompute, offload)
    assert str(err.value).startswith(f"{field}_modules{message}")
    assert err.value.field == f"{field}_modules"
    assert "\n" not in str(err.value)


def test_unknown_name_lists_the_valid_kinds() -> None:
    with pytest.raises(MemoryConfigError) as err:
        check_memory_options(Toy(), KINDS, [], ["qkv"])
    assert "kinds: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act" in str(err.value)


def test_negative_threshold_is_an_error() -> None:
    with pytest.raises(MemoryConfigError, match="offload_min_tensor_bytes=-1: must be >= 0"):
        check_memory_options(Toy(), KINDS, [], [], -1)


def test_a_pipeline_stage_skips_what_it_does_not_hold() -> None:
    """A stage (checked as part of a whole) lacking a kind or a pattern's modules selects nothing for them; the
    whole model is still refused them."""
    recompute, offload = check_memory_options(Toy(), KINDS, ["moe_act", "mla_up_proj"], ["mtp.*"], part=True)
    assert recompute == {"layers.0.act": "moe_act", "layers.1.act": "moe_act"} and offload == {}
    with pytest.raises(MemoryConfigError):
        check_memory_options(Toy(), KINDS, ["moe_act", "mla_up_proj"], [])
    with pytest.raises(MemoryConfigError):
        check_memory_options(Toy(), KINDS, [], ["mtp.*"])
