"""moe_memory's per-rank estimate against a real forward + backward of every family's tiny model (one process, CPU):
the activations it says are saved for backward against the bytes ``SavedAtBackwardBytes`` counts still saved when the
backward starts (module by module, byte for byte where no token is dropped, within 10% where tokens are dropped or
under recompute and offload; a hybrid pattern's byte for byte under recompute and offload too, DeepSeek Sparse
Attention's on the device), and the
parameter, gradient and AdamW state bytes against what the step allocates (exactly). Layouts over several ranks (ep,
tp) are checked in integration/test_memory_estimate.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _hybrid_configs import HYBRID_BLOCKS

import moe_memory
from moe_memory.estimate import MemoryEstimate, estimate_memory
from moe_memory.measure import SavedAtBackwardBytes, SavedStorage
from moe_models import MoETransformer, build_model, causal_lm_loss
from moe_models.config import ModelConfig
from moe_models.kimi_delta import KimiDeltaMixer
from moe_models.linear_attention import GatedDeltaNet
from moe_models.mamba import Mamba2Mixer
from moe_models.memory import estimate_module, local_parameters, model_shape, run_shape
from moe_models.presets import preset

TOLERANCE = 0.10
# (preset, micro-batch, sequence length, ModelConfig overrides)
CASES = {
    "qwen3-moe": ("tiny-qwen3-moe", 2, 64, {}),
    "deepseek-v3 (MLA, shared expert, dense layer, MTP)": ("tiny-deepseek-v3", 2, 64, {}),
    "kimi-k2": ("tiny-kimi-k2", 2, 64, {}),
    "gpt-oss (sinks, biases, sliding window)": ("tiny-gpt-oss", 2, 64, {}),
    "mixtral": ("tiny-mixtral", 2, 64, {}),
    "deepseek-v3, one long sequence": ("tiny-deepseek-v3", 1, 128, {}),
    "gpt-oss, window as long as the sequence": ("tiny-gpt-oss", 3, 32, {}),
    "qwen3-moe, capacity 1.0 padded": (
        "tiny-qwen3-moe",
        2,
        64,
        {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True},
    ),
    "mixtral, capacity 1.5 dropping (worst case)": ("tiny-mixtral", 2, 32, {"moe_expert_capacity_factor": 1.5}),
    "mixtral, window, z-loss, squared relu": (
        "tiny-mixtral",
        4,
        32,
        {"window_size": 16, "moe_z_loss_coeff": 1e-3, "activation_func": "squared_relu"},
    ),
    "deepseek-v3, full-rank q, capacity 1.25 padded": (
        "tiny-deepseek-v3",
        2,
        32,
        {"q_lora_rank": None, "moe_expert_capacity_factor": 1.25, "moe_pad_expert_input_to_capacity": True},
    ),
    "qwen3-moe, pre-softmax, sequence aux loss": (
        "tiny-qwen3-moe",
        2,
        32,
        {"moe_router_pre_softmax": True, "moe_router_load_balancing_type": ["seq_aux_loss"]},
    ),
    # the building blocks of the other families, on the Qwen3 proxy
    "partial rotary (GLM-4.5)": ("tiny-qwen3-moe", 2, 64, {"rotary_percent": 0.5}),
    "q/k norms across heads, clip_qkv (OLMoE)": (
        "tiny-qwen3-moe",
        2,
        64,
        {"qk_layernorm_across_heads": True, "clip_qkv": 8.0},
    ),
    "gated shared expert (Qwen2-MoE)": (
        "tiny-qwen3-moe",
        2,
        64,
        {"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_gate": True},
    ),
    "deepseek-v3, group score of the best expert (DeepSeek-V2)": (
        "tiny-deepseek-v3",
        2,
        32,
        {"moe_router_group_score_topk": 1},
    ),
    "NoPE, chunks, q/k L2 norms, temperature, probabilities on the input (Llama 4)": (
        "tiny-qwen3-moe",
        2,
        64,
        {
            "qk_layernorm": False,
            "no_rope_freq": 2,
            "attention_chunk_size": 48,
            "qk_l2_norm": True,
            "attn_temperature_tuning": True,
            "attn_temperature_floor_scale": 16,
            "moe_apply_probs_on_input": True,
            "moe_router_topk": 1,
            "moe_router_score_function": "sigmoid",
            "moe_router_sigmoid_norm_topk": False,
        },
    ),
    # two chunks of 64 positions, the last padded (one chunk, or whole chunks of several rows, save tensors that are
    # freed before the backward: test_saved_bytes measures those layers alone)
    "qwen3-next (Gated DeltaNet, output gate, zero-centred norms)": ("tiny-qwen3-next", 2, 96, {}),
    # KDA layers (per-channel decays by sub-chunks) before MLA: 80 positions, chunks of 48 (the last padded) in 6
    # sub-chunks of 8
    "kimi-linear (KDA, MLA)": ("tiny-kimi-linear", 2, 80, {"linear_attention_chunk_size": 48}),
    # 80 positions: more than the top-k of 16 and two query blocks (of 64 and 16 queries)
    "deepseek-v3.2 (DeepSeek Sparse Attention)": ("tiny-deepseek-v32", 2, 80, {}),
    # no preset: a ModelConfig of these fields. Chunks of 8 positions, the last padded
    "hybrid pattern (Nemotron-H: Mamba-2, NoPE attention, squared-ReLU MLP, MoE and shared expert)": (
        None,
        2,
        60,
        {"hybrid_override_pattern": "M-ME*E", "num_layers": 6, **HYBRID_BLOCKS},
    ),
}
HYBRID = "hybrid pattern (Nemotron-H: Mamba-2, NoPE attention, squared-ReLU MLP, MoE and shared expert)"
DSA = "deepseek-v3.2 (DeepSeek Sparse Attention)"
BLOCKS = [
    "partial rotary (GLM-4.5)",
    "q/k norms across heads, clip_qkv (OLMoE)",
    "gated shared expert (Qwen2-MoE)",
    "NoPE, chunks, q/k L2 norms, temperature, probabilities on the input (Llama 4)",
    "qwen3-next (Gated DeltaNet, output gate, zero-centred norms)",
    "kimi-linear (KDA, MLA)",
    HYBRID,
    DSA,
]


@dataclasses.dataclass
class Step:
    model: MoETransformer
    estimate: MemoryEstimate
    measured: list[SavedStorage]  # what the backward found saved
    optimizer: torch.optim.Optimizer

    @property
    def measured_bytes(self) -> int:
        return sum(saved.nbytes for saved in self.measured)


def _config(name: str) -> ModelConfig:
    preset_name, _, _, overrides = CASES[name]
    return ModelConfig(**overrides) if preset_name is None else preset(preset_name, **overrides)


def _forward_and_backward(model: MoETransformer, config: ModelConfig, batch: int, seq_len: int) -> list[SavedStorage]:
    """A forward, loss and backward on random tokens: the storages still saved when the backward starts."""
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with SavedAtBackwardBytes(model=model) as measured:
        loss = causal_lm_loss(model(ids), ids.roll(-1, dims=1), config.mtp_loss_scaling_factor)
    alive = measured.alive()
    loss.total.backward()
    return alive


def _step(name: str, dtype: torch.dtype = torch.float32, **estimate_options) -> Step:
    _, batch, seq_len, _ = CASES[name]
    config = _config(name)
    model = build_model(config, seed=0).to(dtype)
    measured = _forward_and_backward(model, config, batch, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    optimizer.step()
    size = dtype.itemsize
    run = run_shape(
        config,
        local_parameters(model),
        micro_batch=batch,
        seq_len=seq_len,
        activation_bytes=size,
        param_bytes=size,
        grad_bytes=size,
        master_weights_bytes=0,
        device="cpu",
    )
    return Step(model, estimate_memory(model_shape(config), run, **estimate_options), measured, optimizer)


def _measured_by_module(step: Step) -> dict[str, int]:
    dense = {n for n, m in step.model.named_modules() if n.endswith("mlp") and not hasattr(m, "router")}
    linear = {n for n, m in step.model.named_modules() if isinstance(m, GatedDeltaNet | KimiDeltaMixer)}
    mamba = {n for n, m in step.model.named_modules() if isinstance(m, Mamba2Mixer)}
    out: dict[str, int] = {}
    for saved in step.measured:
        module = estimate_module(saved.module, saved.module in dense, saved.module in linear, saved.module in mamba)
        out[module] = out.get(module, 0) + saved.nbytes
    return out


def _estimated_by_module(estimate: MemoryEstimate) -> dict[str, int]:
    out = dict(estimate.activations_by_module())
    out["dispatch"] = out.get("dispatch", 0) + out.pop("combine", 0)  # one MoE-block forward runs both
    if "mamba_norm" in out:  # the Mamba-2 mixer calls its gated norm as a function: measured under the mixer
        out["mamba_mixer"] += out.pop("mamba_norm")
    return out


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("name", list(CASES))
def test_estimated_activations_match_the_measured_forward(name: str) -> None:
    step = _step(name)
    estimated, measured = step.estimate.activation_bytes, step.measured_bytes
    assert abs(estimated - measured) <= TOLERANCE * measured, f"{name}: estimated {estimated}, measured {measured}"
    by_estimate, by_measure = _estimated_by_module(step.estimate), _measured_by_module(step)
    assert set(by_estimate) == set(by_measure)
    for module, n in by_measure.items():  # module by module too
        assert abs(by_estimate[module] - n) <= TOLERANCE * n, f"{name}, {module}: {by_estimate[module]} vs {n}"
    if "worst case" in name:  # tokens were dropped: the capacity bound is an upper bound
        assert estimated >= measured
    else:  # nothing dropped: every saved tensor is declared, byte for byte
        assert by_estimate == by_measure


@pytest.mark.parametrize("name", list(CASES)[:5] + BLOCKS)
def test_parameter_gradient_and_optimizer_bytes_are_what_the_step_allocates(name: str) -> None:
    step = _step(name)
    params = list(step.model.parameters())
    assert step.estimate.parameters == _storage_bytes(params)
    # no gradient reaches a DSA indexer that only selects: no gradient, and AdamW keeps no state for it
    assert step.estimate.gradients == _storage_bytes(p.grad for p in params if p.grad is not None)
    # torch's AdamW: exp_avg, exp_avg_sq and a 0-d fp32 step per parameter tensor
    states = [t for state in step.optimizer.state.values() for t in state.values()]
    assert step.estimate.optimizer_states == _storage_bytes(states)
    assert step.estimate.master_weights == 0


def test_bf16_parameters_and_activations_match_too() -> None:
    """2-byte activations as with bf16 parameters: the norms' fp32 internals, the fp32 router, the fp32 math path of
    CPU attention with unequal head dims and the weight casts the router keeps."""
    for name in ("qwen3-moe", "deepseek-v3 (MLA, shared expert, dense layer, MTP)", *BLOCKS):
        step = _step(name, torch.bfloat16)
        estimated, measured = step.estimate.activation_bytes, step.measured_bytes
        assert abs(estimated - measured) <= TOLERANCE * measured, f"{name}: estimated {estimated}, measured {measured}"
        assert step.estimate.parameters == _storage_bytes(step.model.parameters())


@pytest.mark.parametrize(
    ("name", "recompute", "offload"),
    [
        ("qwen3-moe", {"core_attn", "moe_act", "layernorm"}, set()),
        ("qwen3-moe", set(), {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1"}),
        ("deepseek-v3 (MLA, shared expert, dense layer, MTP)", {"moe", "mlp", "mla_up_proj"}, {"core_attn"}),
        ("q/k norms across heads, clip_qkv (OLMoE)", {"core_attn", "layernorm"}, {"qkv_linear", "attn_proj"}),
        ("gated shared expert (Qwen2-MoE)", {"shared_experts", "moe_act"}, {"mlp_norm", "expert_fc1"}),
        (
            "NoPE, chunks, q/k L2 norms, temperature, probabilities on the input (Llama 4)",
            {"core_attn", "moe_act"},
            {"qkv_linear", "expert_fc1"},
        ),
        (
            "qwen3-next (Gated DeltaNet, output gate, zero-centred norms)",
            {"layernorm", "moe_act", "core_attn"},
            {"qkv_linear", "attn_proj"},
        ),
        (HYBRID, {"layernorm", "mlp", "moe_act"}, {"qkv_linear", "attn_proj"}),
        (HYBRID, {"core_attn", "moe"}, {"attn_norm", "mlp_norm", "qkv_linear"}),
        (HYBRID, {"shared_experts", "mlp"}, {"moe_act", "core_attn", "expert_fc1"}),
        (DSA, {"core_attn", "layernorm"}, {"qkv_linear", "attn_proj"}),  # the recomputed core keeps the selection
        (DSA, {"mla_up_proj", "moe"}, {"core_attn"}),  # q, k and v recomputed: the core keeps q's block copies
        # whole decoder layers: each keeps its input only (MTP's layer too)
        ("qwen3-moe", {"layer"}, set()),
        ("deepseek-v3 (MLA, shared expert, dense layer, MTP)", {"layer", "moe_act"}, set()),
    ],
)
def test_recompute_and_offload_match_moe_memory_policies(name: str, recompute: set, offload: set) -> None:
    """Where moe_memory applies recompute / offload by module kind, the estimate's bookkeeping of them holds too."""
    apply = moe_memory.apply_memory_policy
    _, batch, seq_len, _ = CASES[name]
    config = _config(name)
    model = build_model(config, seed=0)
    policy = apply(model, model.module_kinds(), sorted(recompute), sorted(offload), 0)
    measured = sum(saved.nbytes for saved in _forward_and_backward(model, config, batch, seq_len))  # on the device
    params = local_parameters(model)
    run = run_shape(config, params, micro_batch=batch, seq_len=seq_len, activation_bytes=4, device="cpu")
    estimate = estimate_memory(
        model_shape(config),
        run,
        recompute=frozenset(recompute),
        offload=frozenset(offload),
        offload_min_tensor_bytes=0,
    )
    assert abs(estimate.activation_bytes - measured) <= TOLERANCE * measured
    assert abs(estimate.offloaded_bytes - policy.stats.offloaded_bytes) <= TOLERANCE * max(estimate.offloaded_bytes, 1)
    if name == HYBRID:  # its blocks are declared byte for byte under recompute and offload too
        assert (estimate.activation_bytes, estimate.offloaded_bytes) == (measured, policy.stats.offloaded_bytes)
    if name == DSA:  # byte for byte on the device; the policy also copies out what the softmax's amax saves and
        # frees at once (its peak is detached), which no backward holds
        assert estimate.activation_bytes == measured
    baseline = _step(name).estimate.activation_bytes
    assert estimate.activation_bytes < baseline
