"""Activation memory that recompute and offload by Megatron module kind save (moe_memory), and what they cost in time.

Part 1, bytes (one MoE decoder layer at REAL width, fp32 on CPU): a Qwen3-30B-A3B layer (``preset("qwen3-30b-a3b")``)
and a DeepSeek-V3 layer (``preset("deepseek-v3-671b")``, multi-latent attention and a shared expert), each built as a
1-layer ``MoETransformer`` (vocab 256, no MTP, the layer MoE) with FEWER routed experts so that the fp32 weights and
gradients fit on a shared CPU machine: 32 of 128 for Qwen3 (top-8), 16 of 256 for DeepSeek-V3 (top-8; 8 groups of 2,
4 groups chosen per token, so group-limited routing stays valid). The bytes a token keeps depend on top-k and the
widths, not on the expert count, except the router's ``[T, E]`` tensors: that difference is measured separately for
the real expert count (a router + MoE block with a narrow FFN at both counts) and reported as a note.

``model.layers[0]`` runs on ``x`` ``[1, 128, H]`` (a leaf that requires grad) with the model's rotary tables. For each
variant, the memory policy is applied to a copy of the layer that shares its parameters
(``apply_memory_policy(layer_copy, kinds, recompute, offload, min_bytes)``, with the model's module kinds re-rooted at
the layer: ``layers.0.mlp`` -> ``mlp``), so the policy's saved-tensor hooks sit around the layer's forward. An outer
``saved_tensors_hooks`` meter counts the distinct storages saved for backward that stay on the device (parameters
excluded; the layer input and the rotary tables count): the policy hands the meter what it keeps, not what it
discards or offloads. Offloaded bytes are ``policy.stats.offloaded_bytes``. Each variant then runs its backward and
its gradients (every parameter, the input and the output) are checked against the plain run's.

Variants: ``none``; each recompute kind the layer has (``core_attn``, ``moe_act``, ``layernorm``, ``moe``, and for
DeepSeek-V3 ``mla_up_proj`` and ``shared_experts``; ``mlp`` is the dense-layer kind, absent from an MoE layer);
``moe_act+layernorm``; ``core_attn+mla_up_proj`` (DeepSeek-V3); and Megatron's suggested offload set (recompute
``layernorm`` and ``moe_act``, offload ``core_attn``, ``attn_proj``, ``expert_fc1``), once with
``offload_min_tensor_bytes=0`` (every tensor of those modules) and once with moe_train's default 1 MiB.

Part 2, step time: the ``tiny`` moe_train preset (``load_config("tiny", overrides)`` + ``prepare(cfg, 1)``, fp32 on
CPU, a 16 x 128-token micro-batch), one training micro-step (forward, the LM loss, backward) per call. Each
variant is timed head to head against ``none``: two models prepared from the same seed, (none, variant) pairs
interleaved (alternating which runs first) after warm-up; reported are the median of the per-pair ratios
variant/none with their min/max and quartiles, and the ratio of the medians.

Writes JSON (and the markdown tables beside it, ``.md``); ``--quick`` (CI, well under 30 s): narrow layers and 3
repetitions, and writes only where ``--out`` says (nothing by default), never over the committed full-run results.

    uv run python benchmarks/memory_savings.py [--quick] [--out benchmarks/results/memory_savings.json]
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
from _harness import cli, head_to_head, header, parse, quartiles, write  # benchmarks/_harness.py, beside this script
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from moe_memory import RECOMPUTE_KINDS, apply_memory_policy
from moe_models import build_model, next_token_loss
from moe_models.layers import MoEBlock
from moe_models.presets import preset
from moe_models.rope import rotary_cos_sin

SEED = 7
MIB = 1 << 20
GRAD_RTOL = 1e-5  # max |grad - grad_plain| / max |grad_plain| per tensor

# one MoE decoder layer of each published model: (preset, overrides shared by full and quick runs, real expert count)
LAYER_MODELS: dict[str, tuple[str, dict, int]] = {
    "qwen3-30b-a3b": ("qwen3-30b-a3b", {"num_layers": 1, "vocab_size": 256, "num_moe_experts": 32}, 128),
    "deepseek-v3-671b": (
        "deepseek-v3-671b",
        {
            "num_layers": 1,
            "vocab_size": 256,
            "moe_layer_freq": 1,  # the preset's first 3 layers are dense: make the one layer MoE
            "mtp_num_layers": None,  # no MTP depth (None: ModelConfig takes no 0)
            "num_moe_experts": 16,
            "moe_router_num_groups": 8,  # 8 groups of 2 experts (the real model: 8 groups of 32)
            "moe_router_group_topk": 4,  # 4 groups chosen per token, as the real model: 4 x 2 = 8 >= top-8
        },
        256,
    ),
}
# --quick: the same layers, narrow
QUICK_WIDTHS: dict[str, dict] = {
    "qwen3-30b-a3b": {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 32,
        "moe_ffn_hidden_size": 64,
        "ffn_hidden_size": 256,
    },
    "deepseek-v3-671b": {
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "kv_channels": 32,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_head_dim": 32,
        "qk_pos_emb_head_dim": 16,
        "v_head_dim": 32,
        "moe_ffn_hidden_size": 64,
        "moe_shared_expert_intermediate_size": 64,
        "ffn_hidden_size": 256,
    },
}
MEGATRON_RECOMPUTE = ["layernorm", "moe_act"]
MEGATRON_OFFLOAD = ["core_attn", "attn_proj", "expert_fc1"]
MOE_TRAIN_DEFAULT_MIN_BYTES = MIB  # moe_train's run.offload_min_tensor_bytes default


@dataclass(frozen=True)
class Variant:
    name: str
    recompute: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    offload_min_tensor_bytes: int = 0


def variants_for(kinds: dict[str, list[str]]) -> list[Variant]:
    """The variants of the module docstring that this model's kinds allow (``none`` first)."""
    out = [Variant("none")]
    # the layer measured here is the whole of what the ``layer`` kind recomputes: it would keep its input alone
    out += [Variant(kind, (kind,)) for kind in RECOMPUTE_KINDS if kind not in ("mlp", "layer") and kinds.get(kind)]
    out.append(Variant("moe_act+layernorm", ("moe_act", "layernorm")))
    if kinds.get("mla_up_proj"):
        out.append(Variant("core_attn+mla_up_proj", ("core_attn", "mla_up_proj")))
    recompute, offload = tuple(MEGATRON_RECOMPUTE), tuple(MEGATRON_OFFLOAD)
    out.append(Variant("megatron_offload", recompute, offload, 0))
    out.append(Variant("megatron_offload_1MiB", recompute, offload, MOE_TRAIN_DEFAULT_MIN_BYTES))
    return out


# ----------------------------------------------------------------------------------------------- measuring


class DeviceSavedBytes:
    """Distinct storages saved for backward that stay on the device, parameters excluded (as
    integration/test_memory_policy.py): installed outside the policy's hooks, it sees what the policy keeps."""

    def __init__(self, module: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.storages: dict[int, tuple[int, list[int], str]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params and storage.nbytes():
            self.storages.setdefault(storage.data_ptr(), (storage.nbytes(), list(t.shape), str(t.dtype)[6:]))
        return t

    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(v[0] for v in self.storages.values())

    def largest(self, n: int = 6) -> list[dict]:
        top = sorted(self.storages.values(), key=lambda v: -v[0])[:n]
        return [{"bytes": b, "shape": s, "dtype": d} for b, s, d in top]


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    flat = t.detach().reshape(-1)
    return list(flat.split(1 << 24)) if flat.numel() > 1 << 24 else [flat]


def max_rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|, in chunks (an expert weight's gradient is ~2 GB at real width)."""
    diff = max((x - y).abs().max().item() for x, y in zip(_chunks(a), _chunks(ref), strict=True))
    scale = max(y.abs().max().item() for y in _chunks(ref))
    return diff / scale if scale > 0 else diff


def shared_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` holding the SAME parameters (no second copy of the weights)."""
    return copy.deepcopy(module, memo={id(p): p for p in module.parameters()})


def layer_config(name: str, quick: bool):
    preset_name, overrides, _ = LAYER_MODELS[name]
    return preset(preset_name, **overrides, **(QUICK_WIDTHS[name] if quick else {}))


def router_bytes_per_token(config, num_experts: int, groups: int | None, group_topk: int | None, seq: int) -> float:
    """Saved bytes per token of the router + dispatch + a narrow expert block with ``num_experts`` experts (hidden
    size, top-k, scoring and losses of ``config``): two expert counts differ in the router's [T, E] tensors alone."""
    c = replace(config, num_moe_experts=num_experts, moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    torch.manual_seed(SEED)
    block = MoEBlock(c.hidden_size, 8, c.router_config(), c.moe_expert_backend, activation=c.activation_func)
    x = torch.randn(1, seq, c.hidden_size, requires_grad=True)
    meter = DeviceSavedBytes(block)
    with meter.hooks():
        out, _ = block(x)
    out.sum().backward()
    return meter.total / seq


def measure_layer(name: str, quick: bool, seq: int, tmp: Path) -> dict:
    """Part 1 for one model: the byte table of its MoE layer (module docstring)."""
    started = time.perf_counter()
    config = layer_config(name, quick)
    model = build_model(config, seed=SEED)
    layer = model.layers[0]
    assert layer.is_moe, name
    kinds = {k: [n.removeprefix("layers.0.") for n in v] for k, v in model.module_kinds().items()}
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(1, seq, config.hidden_size, generator=gen).requires_grad_()
    grad_out = torch.randn(1, seq, config.hidden_size, generator=gen)
    cos, sin = rotary_cos_sin(config, seq, x.device)
    tokens = x.shape[0] * x.shape[1]
    params = dict(layer.named_parameters())

    # the plain run: the reference bytes and gradients (saved to disk, read back memory-mapped: at real width the
    # DeepSeek-V3 layer's gradients are ~3.7 GB, and the machine is shared)
    meter = DeviceSavedBytes(layer)
    with meter.hooks():
        out, _ = layer(x, cos, sin)
    out.backward(grad_out)
    ref_out, ref_x_grad = out.detach().clone(), x.grad.clone()
    grads_path = tmp / f"{name}-grads.pt"
    torch.save({n: p.grad for n, p in params.items()}, grads_path)
    del out
    for p in params.values():
        p.grad = None
    x.grad = None
    if not quick:  # gc takes ~0.25 s a call here; at real width it frees the copies' cycles
        gc.collect()
    ref_grads = torch.load(grads_path, mmap=True, weights_only=True)
    base = meter.total
    rows = {
        "none": {
            "recompute": [],
            "offload": [],
            "offload_min_tensor_bytes": 0,
            "kept_bytes_per_token": base / tokens,
            "offloaded_bytes_per_token": 0.0,
            "discarded_bytes_per_token": 0.0,
            "saving_bytes_per_token": 0.0,
            "kept_over_none": 1.0,
            "grad_max_rel_diff": 0.0,
            "largest_kept": meter.largest(),
        }
    }
    for v in variants_for(kinds)[1:]:
        wrapped = shared_copy(layer)
        policy = apply_memory_policy(wrapped, kinds, v.recompute, v.offload, v.offload_min_tensor_bytes)
        meter = DeviceSavedBytes(wrapped)
        with meter.hooks():
            out, _ = wrapped(x, cos, sin)
        kept, stats = meter.total, copy.copy(policy.stats)
        out_diff = max_rel_diff(out, ref_out)
        out.backward(grad_out)
        del out
        diffs = {"<output>": out_diff, "<input grad>": max_rel_diff(x.grad, ref_x_grad)}
        for n, p in params.items():
            diffs[n] = max_rel_diff(p.grad, ref_grads[n])
            p.grad = None
        x.grad = None
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] <= GRAD_RTOL, f"{name} {v.name}: {worst} differs by {diffs[worst]:.3g} (relative)"
        rows[v.name] = {
            "recompute": list(v.recompute),
            "offload": list(v.offload),
            "offload_min_tensor_bytes": v.offload_min_tensor_bytes,
            "kept_bytes_per_token": kept / tokens,
            "offloaded_bytes_per_token": stats.offloaded_bytes / tokens,
            "discarded_bytes_per_token": stats.discarded_bytes / tokens,
            "saving_bytes_per_token": (base - kept) / tokens,
            "kept_over_none": kept / base,
            "grad_max_rel_diff": diffs[worst],
            "grad_max_rel_diff_at": worst,
            "largest_kept": meter.largest(),
        }
        del wrapped, policy, meter
        if not quick:  # gc takes ~0.25 s a call here; at real width it frees the copies' cycles
            gc.collect()
    del ref_grads
    grads_path.unlink()

    preset_name, _, real_experts = LAYER_MODELS[name]
    real = preset(preset_name)
    c = config
    per_token_used = router_bytes_per_token(c, c.num_moe_experts, c.moe_router_num_groups, c.moe_router_group_topk, seq)
    per_token_real = router_bytes_per_token(
        c, real_experts, real.moe_router_num_groups, real.moe_router_group_topk, seq
    )
    n_params = sum(p.numel() for p in params.values())
    result = {
        "preset": LAYER_MODELS[name][0],
        "overrides": {**LAYER_MODELS[name][1], **(QUICK_WIDTHS[name] if quick else {})},
        "layer": {
            "hidden_size": c.hidden_size,
            "attention": "MLA" if c.multi_latent_attention else "GQA",
            "num_attention_heads": c.num_attention_heads,
            **(
                {
                    "q_lora_rank": c.q_lora_rank,
                    "kv_lora_rank": c.kv_lora_rank,
                    "qk_head_dim": c.qk_head_dim,
                    "qk_pos_emb_head_dim": c.qk_pos_emb_head_dim,
                    "v_head_dim": c.v_head_dim,
                }
                if c.multi_latent_attention
                else {"num_query_groups": c.num_query_groups, "kv_channels": c.kv_channels}
            ),
            "num_moe_experts_used": c.num_moe_experts,
            "num_moe_experts_real": real_experts,
            "moe_router_topk": c.moe_router_topk,
            "moe_router_num_groups": c.moe_router_num_groups,
            "moe_router_group_topk": c.moe_router_group_topk,
            "moe_ffn_hidden_size": c.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": c.moe_shared_expert_intermediate_size,
            "parameters": n_params,
        },
        "tokens": {"batch": 1, "seq_len": seq},
        "kinds": sorted(kinds),
        "variants": rows,
        "router_expert_count_note": {
            "extra_kept_bytes_per_token_at_real_expert_count": per_token_real - per_token_used,
            "extra_over_none": (per_token_real - per_token_used) / (base / tokens),
            "how": f"saved bytes per token of a router + dispatch + narrow-FFN expert block with {real_experts} "
            f"experts minus the same with {c.num_moe_experts} (same hidden size, top-k, groups, losses, tokens)",
            "applies_to": "every variant except 'moe' (which recomputes the router and keeps only the block's input)",
        },
        "wall_s": time.perf_counter() - started,
    }
    del model, layer, params
    if not quick:  # gc takes ~0.25 s a call here; at real width it frees the copies' cycles
        gc.collect()
    return result


# ----------------------------------------------------------------------------------------------- step time


def _setup(v: Variant, quick: bool, cache_dir: str):
    from moe_train.config import load_config
    from moe_train.trainer import prepare

    overrides = {
        "run.device": "cpu",
        "run.dtype": "fp32",
        "run.save_checkpoint": "false",
        "data.cache_dir": cache_dir,
        "run.recompute_modules": ",".join(v.recompute),
        "run.offload_modules": ",".join(v.offload),
        "run.offload_min_tensor_bytes": str(v.offload_min_tensor_bytes),
        **({"train.global_batch_size": "2", "model.num_layers": "2"} if quick else {}),
    }
    cfg = load_config("tiny", overrides)
    return cfg, prepare(cfg, 1)


def _batch(setup):
    cfg = setup.cfg
    stream = setup.data.train
    batch = stream.batch(0, cfg.train.global_batch_size, 0, setup.micro_batch)
    return batch.input_ids_BS, batch.labels_BS


def micro_step(setup, inputs: torch.Tensor, labels: torch.Tensor, meter: DeviceSavedBytes | None = None) -> float:
    """One training micro-step as trainer.train runs it (fp32: no autocast): forward, loss, backward."""
    for p in setup.model.parameters():
        p.grad = None
    from _estimate import forward_logits  # benchmarks/_estimate.py (imports moe-train)

    (stage,) = setup.model  # no pipeline: the one stage holds the whole model
    with meter.hooks() if meter is not None else contextlib.nullcontext():
        logits, mtp = forward_logits(stage, inputs)
    loss = next_token_loss(logits, mtp, labels, setup.cfg.model.mtp_loss_scaling_factor)
    loss.total.backward()
    return loss.total.item()


def measure_step_time(quick: bool, reps: int, warmup: int, cache_dir: str) -> dict:
    """Part 2: each variant against none on the tiny preset, head to head (module docstring)."""
    started = time.perf_counter()
    cfg, probe = _setup(Variant("none"), quick, cache_dir)
    kinds = probe.model[0].module_kinds()
    del probe
    rows = {}
    inputs = labels = None
    for v in variants_for(kinds)[1:]:
        _, none = _setup(Variant("none"), quick, cache_dir)
        _, var = _setup(v, quick, cache_dir)
        if inputs is None:
            inputs, labels = _batch(none)
        # bytes kept (whole model) and the gradients, from one step of each
        meters = DeviceSavedBytes(none.model), DeviceSavedBytes(var.model)
        loss_none = micro_step(none, inputs, labels, meters[0])
        grads_none = {n: p.grad.clone() for n, p in none.model.named_parameters() if p.grad is not None}
        loss_var = micro_step(var, inputs, labels, meters[1])
        grad_diff = max(max_rel_diff(p.grad, grads_none[n]) for n, p in var.model.named_parameters() if n in grads_none)
        assert grad_diff <= GRAD_RTOL and abs(loss_var - loss_none) <= GRAD_RTOL * abs(loss_none), (v.name, grad_diff)
        step_none, step_var = (partial(micro_step, setup, inputs, labels) for setup in (none, var))
        t_none, t_var = head_to_head(step_none, step_var, reps, warmup)
        ratios = [a / b for a, b in zip(t_var, t_none, strict=True)]
        rows[v.name] = {
            **{k: list(val) if isinstance(val, tuple) else val for k, val in asdict(v).items() if k != "name"},
            "time_ratio_median": statistics.median(ratios),
            "time_ratio_min_max": [min(ratios), max(ratios)],
            "time_ratio_iqr": quartiles(ratios),
            "time_ratio_of_medians": statistics.median(t_var) / statistics.median(t_none),
            "pair_ratios": ratios,
            "times_s": {"none": t_none, "variant": t_var},
            "kept_bytes_model_over_none": meters[1].total / meters[0].total,
            "offloaded_bytes_per_step": var.memory.stats.offloaded_bytes,
            "grad_max_rel_diff": grad_diff,
        }
        print(
            f"  step time {v.name:24s} x{rows[v.name]['time_ratio_median']:.3f} [{min(ratios):.3f}, {max(ratios):.3f}]",
            flush=True,
        )
        del none, var
        if not quick:  # gc takes ~0.25 s a call here; at real width it frees the copies' cycles
            gc.collect()
    m = cfg.model
    return {
        "preset": "tiny",
        "model": {
            "hidden_size": m.hidden_size,
            "num_layers": m.num_layers,
            "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.num_query_groups,
            "kv_channels": m.kv_channels,
            "num_moe_experts": m.num_moe_experts,
            "moe_router_topk": m.moe_router_topk,
            "moe_ffn_hidden_size": m.moe_ffn_hidden_size,
        },
        "micro_batch": {"sequences": int(inputs.shape[0]), "seq_len": int(inputs.shape[1])},
        "reps": reps,
        "warmup_pairs": warmup,
        "checked_pairs": "one (none, variant) pair before the warm-up: bytes kept, loss and gradients compared",
        "kinds": sorted(kinds),
        "variants": rows,
        "wall_s": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------------------------- report


def _kib(b: float) -> str:
    return f"{b / 1024:,.1f}"


def markdown(report: dict) -> str:
    lines = []
    for name, r in report["layers"].items():
        layer = r["layer"]
        lines += [
            f"**{name}**, one MoE layer (hidden {layer['hidden_size']}, {layer['attention']}, "
            f"{layer['num_moe_experts_used']} of {layer['num_moe_experts_real']} experts, "
            f"top-{layer['moe_router_topk']}), {r['tokens']['seq_len']} tokens, fp32, CPU: KiB per token",
            "",
            "| variant | kept on device | offloaded | saved vs none | kept / none | grad max rel diff |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for vname, v in r["variants"].items():
            lines.append(
                f"| {vname} | {_kib(v['kept_bytes_per_token'])} | {_kib(v['offloaded_bytes_per_token'])} | "
                f"{_kib(v['saving_bytes_per_token'])} | {v['kept_over_none']:.3f} | {v['grad_max_rel_diff']:.1e} |"
            )
        note = r["router_expert_count_note"]
        lines += [
            "",
            f"With all {layer['num_moe_experts_real']} experts the router's [T, E] tensors add "
            f"{_kib(note['extra_kept_bytes_per_token_at_real_expert_count'])} KiB per token to every row but `moe`.",
            "",
        ]
    t = report.get("step_time")
    if t:
        mb = t["micro_batch"]
        lines += [
            f"Step time, `tiny` preset ({t['model']['num_layers']} layers, hidden {t['model']['hidden_size']}, "
            f"{mb['sequences']} x {mb['seq_len']} tokens, fp32, CPU, {t['reps']} interleaved pairs): variant / none",
            "",
            "| variant | median ratio | min - max | IQR | kept bytes / none (whole model) |",
            "|---|---:|---:|---:|---:|",
        ]
        for vname, v in t["variants"].items():
            lo, hi = v["time_ratio_min_max"]
            q1, q3 = v["time_ratio_iqr"]
            lines.append(
                f"| {vname} | {v['time_ratio_median']:.3f} | {lo:.3f} - {hi:.3f} | {q1:.3f} - {q3:.3f} | "
                f"{v['kept_bytes_model_over_none']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


NOTES = [
    "Bytes are distinct storages autograd saves for backward in one forward of the layer that stay on the device "
    "(parameters excluded); the layer input x and the rotary cos/sin tables count (in a full model the tables are "
    "shared by all layers). Per token = bytes / 128 tokens (batch 1, seq 128).",
    "Expert count: fewer routed experts than the real model (see each layer's num_moe_experts_used). Per-token "
    "activation bytes depend on top-k and the widths, not on the number of experts, except the router's [T, E] "
    "tensors (logits, scores, probabilities of the balancing losses): router_expert_count_note gives that difference "
    "per token at the real expert count.",
    "CPU attention path: Qwen3 (q/k and v head dims equal, 128) runs SDPA's flash kernel on CPU, which saves q, k, v, "
    "the output and a logsumexp. DeepSeek-V3's MLA (q/k head dim 192, v 128) makes SDPA take its math path on CPU, "
    "which saves scaled copies of q and k and the [B, N, S, S] probability matrix: per token that grows with the "
    "sequence length (N x S x 4 bytes = 64 KiB at S=128, 128 heads), so core_attn's share here differs from GPU "
    "kernels (flash / cuDNN), which save q, k, v, the output and the logsumexp only.",
    "mla_up_proj (output-discarding recompute of the MLA up projection) frees less than its outputs on this path: "
    "the math-path SDPA saves its own scaled copies of q and k, so discarding the up projection's q and k frees "
    "nothing; what it frees is the kv up projection's output, whose v half the math path saves as a view (128 KiB "
    "per token at real width). Recomputed together with core_attn (core_attn+mla_up_proj) it frees q, k and that "
    "output, as it would with GPU kernels that save their inputs. core_attn alone frees only the probability matrix "
    "on this path: it keeps the unscaled q and k as its inputs in place of the scaled copies, of the same size.",
    "Megatron's offload set still keeps the routed experts' first projection output on the device: it is the input "
    "of the recomputed moe_act (saved by its checkpoint, outside expert_fc1's offload), 48 KiB per token for Qwen3, "
    "128 KiB for DeepSeek-V3; offloading moe_act instead would conflict with recomputing it (moe_memory rejects "
    "offloading a recomputed module).",
    "The 'mlp' recompute kind is for dense-MLP layers (DeepSeek-V3's first 3 layers); these layers are MoE, so it "
    "is skipped.",
    "Offload on a CPU-only machine copies saved tensors into a host store (the same RAM): offloaded_bytes is what "
    "would leave the GPU; the time cost in the step-time table is a memcpy, not a PCIe transfer overlapped with "
    "compute as on CUDA.",
    "megatron_offload uses offload_min_tensor_bytes=0 (every tensor those modules save); megatron_offload_1MiB uses "
    "moe_train's default run.offload_min_tensor_bytes (1 MiB). At 128 tokens that threshold keeps Qwen3's k and v "
    "([1, 4, 128, 128] fp32, 256 KiB each: 4 key-value heads) and the attention logsumexp on the device; every "
    "tensor DeepSeek-V3's offloaded modules save is above it. Megatron-Core's default min_offloaded_tensor_size is "
    "1024*1024 elements (2 MiB in bf16, 4 MiB in fp32); at realistic micro-batches (thousands of tokens) these "
    "tensors are far above either threshold.",
    "Gradients: every variant's parameter, input and output gradients are checked against the plain run's "
    f"(max |diff| / max |ref| per tensor <= {GRAD_RTOL}); grad_max_rel_diff is the largest over all tensors.",
    "Step times are ratios measured head to head in one process on a shared 2-core CPU with one torch thread (two "
    "threads competing with other jobs made the pairs erratic); absolute times are noisy and only listed for "
    "completeness.",
]


def main() -> None:
    parser = cli("memory_savings", __doc__, "narrow layers, 3 repetitions (CI, < 30 s)")
    parser.add_argument("--seq", type=int, default=128, help="tokens of the layer measurement (batch 1)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved (none, variant) pairs per variant")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up pairs per variant")
    parser.add_argument("--models", default=",".join(LAYER_MODELS), help="comma-separated, of the layer models")
    parser.add_argument("--no-step-time", action="store_true", help="skip part 2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see the module docstring)")
    parser.add_argument("--cache-dir", default="", help="moe-train data.cache_dir (default: a temporary directory)")
    args = parse(parser)
    reps = args.reps or (3 if args.quick else 11)
    warmup = args.warmup if args.warmup is not None else (0 if args.quick else 2)  # + the checked pair
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    layers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            print(f"{name}: measuring the layer", flush=True)
            layers[name] = measure_layer(name, args.quick, args.seq, Path(tmp))
        step_time = None
        if not args.no_step_time:
            print("step time (tiny preset)", flush=True)
            step_time = measure_step_time(args.quick, reps, warmup, args.cache_dir or tmp)

    report = {
        "what": "activation bytes per token of one real-width MoE layer (Qwen3-30B-A3B, DeepSeek-V3) kept on the "
        "device under recompute / offload by Megatron module kind (moe_memory), and the step-time cost of each "
        "variant against none on the tiny preset",
        "machine": f"CPU only, {os.cpu_count()} cores, shared with other jobs; {args.threads} torch thread(s)",
        "device": "cpu",
        "dtype": "float32",
        "layers": layers,
        "step_time": step_time,
        "notes": NOTES,
        "wall_s": time.perf_counter() - started,
    }
    report = header(args, **report)
    md = markdown(report)
    print(md)
    print(f"wall time {report['wall_s']:.1f} s")
    write(args.out, report, {".md": md})


if __name__ == "__main__":
    main()
