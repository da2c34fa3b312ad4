"""SharedExperts against the Qwen2-MoE / Qwen3-Next shared-expert formula and HuggingFace's own modules."""

import pytest
import torch
import torch.nn.functional as F

from moe_experts.shared import SharedExperts, SharedExpertsHandle

HIDDEN, FFN = 8, 12


def hf_style_shared_expert(x, gate_proj_FH, up_proj_FH, down_proj_HF, gate_1H=None):
    """Qwen2MoeMLP + shared_expert_gate as written in transformers' modeling_qwen2_moe.py, with HF's
    ``nn.Linear`` weight layouts ([out, in]):
    ``down_proj(act(gate_proj(x)) * up_proj(x))``, then ``sigmoid(shared_expert_gate(x)) * out``."""
    out = F.linear(F.silu(F.linear(x, gate_proj_FH)) * F.linear(x, up_proj_FH), down_proj_HF)
    if gate_1H is not None:
        out = torch.sigmoid(F.linear(x, gate_1H)) * out
    return out


def hf_weights(module: SharedExperts):
    """Our parameters in HuggingFace's layouts (detached leaves, so reference gradients are independent)."""
    ffn = module.ffn_hidden_size
    w = module.w_gate_up_H2F.detach()
    leaves = [w[:, :ffn].T.clone(), w[:, ffn:].T.clone(), module.w_down_FH.detach().T.clone()]
    if module.w_gate_H1 is not None:
        leaves.append(module.w_gate_H1.detach().T.clone())
    return [t.requires_grad_() for t in leaves]


def randomized(gate: bool, dtype=torch.float32, seed=0) -> SharedExperts:
    torch.manual_seed(seed)
    module = SharedExperts(HIDDEN, FFN, gate=gate).to(dtype)
    with torch.no_grad():  # O(1) weights so silu / sigmoid are exercised away from their linear regime
        for p in module.parameters():
            p.normal_(std=0.5)
    return module


def test_parameter_names_and_shapes():
    plain, gated = SharedExperts(HIDDEN, FFN), SharedExperts(HIDDEN, FFN, gate=True)
    assert {n: tuple(p.shape) for n, p in plain.named_parameters()} == {
        "w_gate_up_H2F": (HIDDEN, 2 * FFN),
        "w_down_FH": (FFN, HIDDEN),
    }
    assert dict(gated.named_parameters())["w_gate_H1"].shape == (HIDDEN, 1)
    assert not plain.gated and gated.gated


@pytest.mark.parametrize("gate", [False, True])
def test_forward_and_gradients_match_hf_formula(gate):
    module = randomized(gate, torch.float64)
    x = torch.randn(2, 5, HIDDEN, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ref_weights = hf_weights(module)
    out = module(x)
    ref = hf_style_shared_expert(x_ref, *ref_weights)
    assert out.shape == x.shape
    torch.testing.assert_close(out, ref)

    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad)
    g, u, d = (t.grad for t in ref_weights[:3])
    torch.testing.assert_close(module.w_gate_up_H2F.grad, torch.cat([g.T, u.T], dim=1))
    torch.testing.assert_close(module.w_down_FH.grad, d.T)
    if gate:
        torch.testing.assert_close(module.w_gate_H1.grad, ref_weights[3].grad.T)


def test_gate_scales_each_token_by_its_sigmoid():
    gated = randomized(gate=True)
    plain = SharedExperts(HIDDEN, FFN)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if k != "w_gate_H1"})
    x = torch.randn(7, HIDDEN)
    scale = torch.sigmoid(x @ gated.w_gate_H1)
    assert not torch.allclose(scale, torch.ones_like(scale))
    torch.testing.assert_close(gated(x), scale * plain(x))


def test_gradcheck_float64():
    module = randomized(gate=True, dtype=torch.float64)
    x = torch.randn(4, HIDDEN, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, *w: module(x), (x, *module.parameters()))


def test_matches_transformers_qwen2_moe_modules():
    """The real Qwen2MoeSparseMoeBlock's shared_expert and shared_expert_gate, weights copied in."""
    qwen2_moe = pytest.importorskip("transformers.models.qwen2_moe.modeling_qwen2_moe")
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        shared_expert_intermediate_size=FFN,
        moe_intermediate_size=4,
        intermediate_size=4,
        num_experts=2,
        num_experts_per_tok=1,
    )
    block = qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    ours = randomized(gate=True)
    g, u, d, gate = (t.detach() for t in hf_weights(ours))
    with torch.no_grad():
        block.shared_expert.gate_proj.weight.copy_(g)
        block.shared_expert.up_proj.weight.copy_(u)
        block.shared_expert.down_proj.weight.copy_(d)
        block.shared_expert_gate.weight.copy_(gate)
    x = torch.randn(6, HIDDEN)
    expected = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gate", [False, True])
def test_start_on_cpu_runs_inline_and_equals_forward(gate):
    module = randomized(gate)
    x = torch.randn(9, HIDDEN, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    handle = module.start(x)
    assert isinstance(handle, SharedExpertsHandle) and not handle.overlapped
    out = handle.wait()
    assert handle.wait() is out  # waiting twice is harmless
    torch.testing.assert_close(out, module(x2), rtol=0, atol=0)
    out.sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    module(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    for got, want in zip(grads, [p.grad for p in module.parameters()], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream overlap needs a CUDA device")
@pytest.mark.parametrize("gate", [False, True])
def test_side_stream_equals_inline_on_cuda(gate):
    module = randomized(gate).cuda()
    x = torch.randn(256, HIDDEN, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    handle = module.start(x)
    assert handle.overlapped
    # work on the main stream in between, as a token dispatch would do
    busy = torch.randn(512, 512, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 512
    out = handle.wait()
    (out * 2).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    inline = module(x2)
    (inline * 2).sum().backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, inline)
    torch.testing.assert_close(x.grad, x2.grad)
    for got, want in zip(grads, [p.grad for p in module.parameters()], strict=True):
        torch.testing.assert_close(got, want)
