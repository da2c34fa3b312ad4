"""The ``train`` settings that concern the optimizer and what trains: Muon's keys, QK-clip's, the DSA indexer's
training; and the expert-parallel overlap's clash with the FP8 dispatch. Checked once by
:func:`moe_train.config.validate`, each refusal one line naming the key and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_memory import OUTPUT_DISCARDING_KINDS
from moe_models.qk_clip import qk_clip_refusals
from moe_train.config_error import ConfigError

if TYPE_CHECKING:
    from moe_train.config import ExperimentConfig


def check_training(cfg: ExperimentConfig) -> None:
    """Every rule below, in order."""
    _check_muon(cfg)
    _check_dsa_training(cfg)
    _check_qk_clip(cfg)
    _check_ep_overlap(cfg)


def _check_ep_overlap(cfg: ExperimentConfig) -> None:
    """Both overlaps start each all-to-all and return; the FP8 dispatch encodes, exchanges and decodes in one call
    (moe_dispatch.wire), with no start and finish to overlap."""
    mode = cfg.parallel.ep_overlap
    if mode != "none" and cfg.precision.dispatch_fp8:
        raise ConfigError(
            f"parallel.ep_overlap={mode}: the FP8 token dispatch (precision.dispatch_fp8) cannot be overlapped yet; "
            "set parallel.ep_overlap none or precision.dispatch_fp8 false"
        )
    # offloading and the output-discarding recompute keep one forward's saved tensors at a time (one
    # moe_memory.SavedTensorPolicy around the model), and two micro-batches in flight run a forward inside a backward
    run = cfg.run
    held = [f"run.offload_modules={run.offload_modules}"] if run.offload_modules else []
    held += [f"run.recompute_modules {k}" for k in sorted(OUTPUT_DISCARDING_KINDS & set(run.recompute_modules))]
    if mode == "microbatch" and held:
        raise ConfigError(
            f"parallel.ep_overlap=microbatch: {held[0]} keeps one forward's saved tensors at a time, and two "
            "micro-batches are in flight; set parallel.ep_overlap chunked, or leave it out"
        )


def _check_dsa_training(cfg: ExperimentConfig) -> None:
    """The DSA indexer loss is exact in one model replica only yet: its target sums every attention head (split over
    tp) over every key (split over cp), and it does not cross pipeline stages; the dense warm-up freezes the base."""
    coeff, parallel = cfg.model.dsa_indexer_loss_coeff, cfg.parallel
    for name in ("tp", "cp", "pp"):
        if coeff and getattr(parallel, name) > 1:
            raise ConfigError(
                f"parallel.{name}={getattr(parallel, name)}: the DSA indexer loss (model.dsa_indexer_loss_coeff="
                f"{coeff}) is computed within one tp/cp/pp rank only yet; set --parallel.{name} 1 (dp/ep split fine)"
            )
    if cfg.model.dsa_indexer_dense_warmup and cfg.peft.method != "none":
        raise ConfigError(
            f"peft.method={cfg.peft.method!r}: the DSA dense warm-up trains the indexers alone; set peft.method none"
        )


def _check_qk_clip(cfg: ExperimentConfig) -> None:
    """train.qk_clip's keys, and what keeps a rescale of the q/k projections from bounding the logits
    (moe_models.qk_clip.qk_clip_refusals) or from reaching every head (pipeline stages, LoRA's frozen base)."""
    train = cfg.train
    if not train.qk_clip:
        return
    if not train.qk_clip_threshold > 0:
        raise ConfigError(f"train.qk_clip_threshold={train.qk_clip_threshold}: must be positive, e.g. 100")
    if not 0 < train.qk_clip_alpha < 1:
        raise ConfigError(f"train.qk_clip_alpha={train.qk_clip_alpha}: must be in (0, 1), e.g. 0.5")
    for name, why in qk_clip_refusals(cfg.model).items():
        raise ConfigError(
            f"model.{name}={getattr(cfg.model, name)!r}: train.qk_clip cannot bound the logits ({why}); "
            f"change model.{name} or set train.qk_clip false"
        )
    if cfg.parallel.pp != 1:
        raise ConfigError(
            f"parallel.pp={cfg.parallel.pp}: train.qk_clip does not carry the logit maxima between pipeline stages "
            "(so far); set parallel.pp 1 or train.qk_clip false"
        )
    if cfg.peft.method != "none":
        raise ConfigError(
            f"peft.method={cfg.peft.method!r}: train.qk_clip rescales the base q/k projections LoRA freezes; set "
            "peft.method none or train.qk_clip false"
        )


def _check_muon(cfg: ExperimentConfig) -> None:
    """train.optimizer and Muon's keys."""
    train = cfg.train
    if train.optimizer not in ("adamw", "muon"):
        raise ConfigError(f"train.optimizer={train.optimizer!r}: choose adamw or muon")
    if train.optimizer == "adamw":
        return
    if not 0 <= train.muon_momentum < 1:
        raise ConfigError(f"train.muon_momentum={train.muon_momentum}: must be in [0, 1), e.g. 0.95")
    if not 1 <= train.muon_num_ns_steps < 100:
        raise ConfigError(f"train.muon_num_ns_steps={train.muon_num_ns_steps}: must be in [1, 100), e.g. 5")
    if train.muon_adjust_lr_fn not in ("original", "match_rms_adamw"):
        raise ConfigError(f"train.muon_adjust_lr_fn={train.muon_adjust_lr_fn!r}: choose original or match_rms_adamw")
    if train.muon_ns_dtype not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"train.muon_ns_dtype={train.muon_ns_dtype!r}: choose auto, bf16 or fp32")
    if len(train.muon_ns_coefficients) != 3:
        raise ConfigError(
            f"train.muon_ns_coefficients={train.muon_ns_coefficients}: give the quintic's three (a, b, c), e.g. "
            "[3.4445, -4.775, 2.0315]"
        )
