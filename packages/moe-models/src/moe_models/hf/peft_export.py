"""A model's LoRA adapters (:mod:`moe_models.lora`) as a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` puts on the transformers model of the base
checkpoint.

PEFT adapts transformers' modules as they are in memory (transformers 5), not the checkpoint's tensors: a
:class:`~moe_models.lora.LoRALinear` (and each projection of a :class:`~moe_models.lora.LoRASharedExperts`) becomes a
``target_modules`` entry, its ``lora_A`` ``[r, in]`` / ``lora_B`` ``[out, r]`` written as they are; routed experts'
adapters (:class:`~moe_experts.LoRAExpertLinear`) become ``target_parameters`` on the fused 3-D expert parameters
``mlp.experts.gate_up_proj`` / ``down_proj`` that transformers 5 builds for every family we map. PEFT's ``ParamWrapper``
keeps one ``nn.Linear`` pair for all experts, ``lora_A.weight`` ``[E r, in]`` (expert-major rows) and ``lora_B.weight``
``[out, r E]`` (expert-minor columns), and reads ``in`` as the projection's input whichever way round the parameter is
stored (``is_transposed``), so our per-expert ``A_e`` ``[r, K]`` / ``B_e`` ``[M, r]`` go in unchanged, only
stacked: the gate/up output order of ours is transformers' (gate rows then up rows; GPT-OSS interleaved, as stored).

A linear named like a transformers-4 expert projection (a dense MLP's or a shared expert's ``gate_proj``, ``up_proj``,
``down_proj``) is targeted through its ``weight`` parameter instead: PEFT rewrites such ``target_modules`` of the MoE
families whose experts transformers 5 fused into the fused experts' parameters (with twice the rank), which would drop
those adapters; a 2-D ``target_parameters`` entry is the same LoRA (``W + scaling B A``) and is left alone.

A router with an expert bias (DeepSeek-V3's aux-loss-free balancing) updates that bias in training, adapters or not,
so the adapted model's routing is not the base's: each such router goes whole into the adapter, as a
``modules_to_save`` entry (its weight, unchanged, and its ``e_score_correction_bias``).

PEFT holds one rank and one ``lora_alpha`` per adapter config; adapters that differ in either, an adapter on a module
transformers' model does not have (a tied ``lm_head``), or one split over experts or ranks is a :class:`ValueError`.
Adapters on DeepSeek-V3 MTP layers are left out with a warning: transformers' model has no MTP layers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from moe_experts import GroupedExperts, LoRAExpertLinear
from moe_models.config import ModelConfig
from moe_models.hf.io import written_whole
from moe_models.hf.state_dict_map import build_plan, stored_as_is
from moe_models.lora import ADAPTER_MARK, LoRALinear, LoRASharedExperts

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's name of the transformers model, in every saved key
# transformers 5's experts modules declare gate_up_proj before down_proj; PEFT wraps targeted parameters of one module
# in that order, each wrapper around the previous, so the first one's adapter sits under the others' `base_layer`
_EXPERT_PARAMETERS = {"fc1": "gate_up_proj", "fc2": "down_proj"}
# modules transformers 5 renames on load (its conversion mapping), on-disk name -> in-memory name
_IN_MEMORY = {"mixtral": ((".block_sparse_moe.", ".mlp."),), "minimax_m2": ((".block_sparse_moe.", ".mlp."),)}
# the leaf names PEFT's transformers-5 conversion takes for expert projections in target_modules (module docstring)
_RENAMED_BY_PEFT = frozenset({"gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"})


def _in_memory(config: ModelConfig, name: str) -> str:
    for old, new in _IN_MEMORY.get(config.family, ()):
        name = name.replace(old, new)
    return name


def _local(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        raise ValueError("the model's adapters are split across ranks (DTensors): export a model loaded in one process")
    return t.detach()


def _module_of(config: ModelConfig, plan_keys: dict[str, str], ours: str, name: str) -> str:
    """The transformers module of our parameter ``ours`` (its first HF tensor's), for adapter ``name``."""
    key = plan_keys.get(ours)
    if key is None:
        raise ValueError(
            f"{name}: transformers' {config.family} model has no module of its own for it (a tied lm_head?); "
            "leave it out of the LoRA targets"
        )
    return _in_memory(config, key.removesuffix(".weight"))


def _linear_pair(a_RK: torch.Tensor, b_MR: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"lora_A.weight": _local(a_RK), "lora_B.weight": _local(b_MR)}


def _expert_pair(module: LoRAExpertLinear) -> dict[str, torch.Tensor]:
    a_ERK, b_EMR = _local(module.lora_A_ERK), _local(module.lora_B_EMR)
    experts, rank = a_ERK.shape[:2]
    return {
        "lora_A.weight": a_ERK.reshape(experts * rank, -1),  # row e r + j: expert e's row j
        "lora_B.weight": b_EMR.permute(1, 2, 0).reshape(b_EMR.shape[1], rank * experts),  # column j E + e
    }


def peft_adapter_state(model: nn.Module, config: ModelConfig) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config, tensors)`` of ``model``'s LoRA adapters as PEFT saves them (module docstring); the
    tensors are ``model``'s own (no copies), by PEFT's key."""
    plan = build_plan(config)
    plan_keys = {e.ours: e.sources[0].key for e in plan.entries}
    # a linear's adapter needs its weight stored whole under one HF name (a module of its own in transformers)
    linear_keys = {e.ours: e.sources[0].key for e in plan.entries if stored_as_is(e)}
    tensors: dict[str, torch.Tensor] = {}
    target_modules: list[str] = []
    target_parameters: list[str] = []
    settings: dict[tuple[int, float], str] = {}  # (rank, scaling) -> the first adapter that has it
    dropouts: set[float] = set()
    covered: set[str] = set()  # our adapter parameters written
    skipped_mtp: list[str] = []

    def add(name: str, hf_module: str, pair: dict[str, torch.Tensor], rank: int, scaling: float) -> None:
        settings.setdefault((rank, float(scaling)), name)
        for key, value in pair.items():
            tensors[f"{PREFIX}{hf_module}.{key}"] = value

    def target_linear(hf_module: str) -> None:
        if hf_module.rpartition(".")[2] in _RENAMED_BY_PEFT:
            target_parameters.append(f"{hf_module}.weight")
        else:
            target_modules.append(hf_module)

    for name, module in model.named_modules():
        own = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False) if ADAPTER_MARK in p]
        if name.startswith("mtp."):
            if own or isinstance(module, LoRAExpertLinear):
                skipped_mtp.append(name)
            covered.update(f"{name}.{p}" for p, _ in module.named_parameters() if ADAPTER_MARK in p)
            continue
        if isinstance(module, LoRALinear):
            hf_module = _module_of(config, linear_keys, f"{name}.weight", name)
            add(name, hf_module, _linear_pair(module.lora_A, module.lora_B), module.lora_A.shape[0], module.scaling)
            target_linear(hf_module)
            dropouts.add(module.lora_dropout_p)
            covered.update(own)
        elif isinstance(module, LoRASharedExperts):
            hf_shared = _module_of(config, plan_keys, f"{name}.w_down_FH", name).removesuffix(".down_proj")
            for projection in ("gate_proj", "up_proj", "down_proj"):
                adapter = getattr(module, f"lora_{projection}")
                pair = _linear_pair(adapter.lora_A, adapter.lora_B)
                add(name, f"{hf_shared}.{projection}", pair, adapter.lora_A.shape[0], adapter.scaling)
                target_linear(f"{hf_shared}.{projection}")
                dropouts.add(getattr(adapter.lora_dropout, "p", 0.0))
                covered.update(f"{name}.lora_{projection}.{p}" for p in ("lora_A", "lora_B"))
        elif isinstance(module, GroupedExperts):
            adapted = [p for p in _EXPERT_PARAMETERS if isinstance(getattr(module, p), LoRAExpertLinear)]
            if not adapted:
                continue
            if module.etp_size != 1 or module.num_experts != config.num_moe_experts:
                raise ValueError(
                    f"{name}: its adapters hold {module.num_experts} of {config.num_moe_experts} experts (expert "
                    "parallel) or a slice of their FFN; export a model loaded whole in one process"
                )
            router = _module_of(config, plan_keys, f"{name.removesuffix('.experts')}.router.weight", name)
            hf_experts = f"{router.rpartition('.')[0]}.experts"
            for i, projection in enumerate(adapted):
                lora: LoRAExpertLinear = getattr(module, projection)
                wrapper = hf_experts + ".base_layer" * (len(adapted) - 1 - i)
                add(f"{name}.{projection}", wrapper, _expert_pair(lora), lora.rank, lora.scaling)
                target_parameters.append(f"{hf_experts}.{_EXPERT_PARAMETERS[projection]}")
                dropouts.add(getattr(lora.dropout, "p", 0.0))
                covered.update(f"{name}.{projection}.{p}" for p in ("lora_A_ERK", "lora_B_EMR"))

    modules_to_save = []
    if settings and config.moe_router_enable_expert_bias:
        state = model.state_dict()
        routers = sorted({e.ours.rpartition(".")[0] for e in plan.entries if e.ours.endswith(".router.expert_bias")})
        for router in routers:
            if router.startswith("mtp."):
                continue
            hf_router = _in_memory(config, plan_keys[f"{router}.expert_bias"].rpartition(".")[0])
            modules_to_save.append(hf_router)
            for entry in plan.entries:
                if entry.ours.startswith(f"{router}."):
                    hf_name = _in_memory(config, entry.sources[0].key).removeprefix(f"{hf_router}.")
                    tensors[f"{PREFIX}{hf_router}.{hf_name}"] = _local(state[entry.ours])

    left = [n for n, _ in model.named_parameters(remove_duplicate=False) if ADAPTER_MARK in n and n not in covered]
    if left:
        raise ValueError(f"{left[0]}: an adapter PEFT's LoRA config cannot express (not on a linear or experts)")
    if skipped_mtp:
        warnings.warn(
            f"{len(skipped_mtp)} adapted MTP module(s) (e.g. {skipped_mtp[0]}) left out of the PEFT adapter: "
            "transformers' model has no MTP layers",
            stacklevel=2,
        )
    if not settings:
        raise ValueError("the model has no LoRA adapters to export (add them with moe_models.lora.add_lora_)")
    if len(settings) > 1:
        found = ", ".join(f"{n}: r={r}, alpha={r * s:g}" for (r, s), n in settings.items())
        raise ValueError(f"PEFT's adapter config holds one rank and one alpha, the adapters have several ({found})")
    ((rank, scaling),) = settings
    alpha = rank * scaling
    adapter_config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "revision": None,
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        # an empty list, not None: None lets PEFT pick the family's default modules
        "target_modules": target_modules,
        "target_parameters": target_parameters or None,
        # PEFT refuses dropout on target_parameters; dropout acts only in training, so the logits are the same
        "lora_dropout": 0.0 if target_parameters or len(dropouts) != 1 else next(iter(dropouts)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": modules_to_save or None,
        "inference_mode": True,
    }
    return adapter_config, tensors


def save_peft_adapter(
    model: nn.Module,
    config: ModelConfig,
    out_dir: str | Path,
    base_model_name_or_path: str | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write ``model``'s adapters as a PEFT adapter directory ``out_dir`` (module docstring), whole or not at all;
    ``base_model_name_or_path``: the base checkpoint, recorded in ``adapter_config.json``. Returns ``out_dir``."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty: pass overwrite=True or choose another path")
    adapter_config, tensors = peft_adapter_state(model, config)
    adapter_config["base_model_name_or_path"] = (
        None if base_model_name_or_path is None else str(base_model_name_or_path)
    )
    with written_whole(out_dir, "peft") as staging:
        # safetensors refuses views of one storage (lora_A reshapes) and non-contiguous ones: own copies
        save_file({k: v.contiguous().clone() for k, v in tensors.items()}, staging / WEIGHTS_FILE, {"format": "pt"})
        (staging / CONFIG_FILE).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return out_dir
