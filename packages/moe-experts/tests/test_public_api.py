"""Snapshot of moe_experts's public interface. Changing it is an interface change: update
docs/interfaces.md and this snapshot together, and bump the version (semver)."""

import importlib.metadata

import moe_experts

PUBLIC_NAMES = [
    "ACTIVATIONS",
    "Activation",
    "BACKENDS",
    "BackendUnavailableError",
    "ExpertActivation",
    "ExpertLinear",
    "GroupedExperts",
    "LoRAExpertLinear",
    "SWIGLU_OAI_ALPHA",
    "SWIGLU_OAI_LIMIT",
    "SharedExperts",
    "SharedExpertsHandle",
    "WeightedActivation",
    "__version__",
    "add_expert_lora_",
    "backend_availability",
    "expert_seed",
    "gate_up_columns",
    "geglu",
    "gelu",
    "get_activation",
    "loop_grouped_mm",
    "merged_expert_weights",
    "resolve_backend",
    "shared_expert_stream",
    "squared_relu",
    "swiglu",
    "swiglu_oai",
    "te_grouped_mm",
    "torch_grouped_mm",
    "weighted_activation",
]


def test_version() -> None:
    assert moe_experts.__version__ == "0.2.9"
    assert importlib.metadata.version("moe-experts") == moe_experts.__version__


def test_public_names_match_snapshot() -> None:
    assert sorted(moe_experts.__all__) == PUBLIC_NAMES


def test_every_public_name_resolves() -> None:
    missing = [name for name in moe_experts.__all__ if not hasattr(moe_experts, name)]
    assert missing == []
