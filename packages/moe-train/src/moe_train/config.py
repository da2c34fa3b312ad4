"""Experiment configuration: one dataclass per section, loaded from YAML presets or files, with
``--section.key value`` overrides. Each package owns its section's dataclass (``model`` is
moe_models.ModelConfig, ``parallel`` is moe_parallel.ParallelConfig)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from moe_models import ModelConfig
from moe_parallel import ParallelConfig
from moe_precision import PrecisionConfig
from moe_train.config_error import ConfigError
from moe_train.dtypes import DTYPE_KEYS, short_name
from moe_train.training_checks import check_training


def _field_error_sections() -> dict[type, str]:
    from moe_memory import MemoryConfigError
    from moe_models import ModelConfigError
    from moe_parallel import LayoutError
    from moe_precision import PrecisionConfigError

    return {
        ModelConfigError: "model",
        LayoutError: "parallel",
        MemoryConfigError: "run",
        PrecisionConfigError: "precision",
    }


def config_error(err: Exception) -> ConfigError:
    """A library's error as a :class:`ConfigError` naming the config key: the one place where the fields the
    libraries' errors carry (``err.field``) become ``section.key``. Other errors keep their message."""
    for kind, section in _field_error_sections().items():
        if isinstance(err, kind):
            return ConfigError(f"{section}.{err.field}={err.value!r}: {err.reason}")
    return ConfigError(str(err))


@dataclass
class DataConfig:
    """The ``data`` config section."""

    # "stdlib" (the Python standard library's source files), a .txt (one document per file), .jsonl or .parquet
    # file (one document per record's text_field), a directory of them (recursively, sorted), or a HuggingFace
    # datasets save_to_disk directory (a DatasetDict's train split); see moe_train.sources
    source: str = "stdlib"
    seq_len: int = 128
    cache_dir: str = ""  # token files; "" = $XDG_CACHE_HOME/moe-train (or ~/.cache/moe-train)
    text_field: str = "text"  # the field of a JSONL / Parquet / datasets record that holds the document
    # a tokenizer.json or a directory holding one (other formats load through transformers when installed);
    # "" = the model.from_hf checkpoint's tokenizer.json when it has one, else byte level; "bytes" = byte level
    tokenizer: str = ""
    eos_token: str = ""  # the token after every document; "" = the tokenizer's own end-of-text token
    valid_fraction: float = 0.0  # the last fraction of the documents, held out for validation; 0 = none
    valid_source: str = ""  # validation documents from another source (the formats of data.source); "" = none
    # undecodable bytes in .txt / .jsonl text (and their .gz): strict = an error naming the file and byte offset |
    # replace = each undecodable run of bytes becomes U+FFFD (a note counts them)
    decode_errors: str = "strict"
    # what a record is: text (data.text_field is one document) | chat (a conversation: OpenAI-style "messages" or
    # ShareGPT "conversations", rendered by the tokenizer's chat template) | prompt_completion (two text fields)
    format: str = "text"
    messages_field: str = ""  # chat: the record field holding the turns; "" = "messages", else "conversations"
    prompt_field: str = "prompt"  # prompt_completion: the field holding the prompt
    completion_field: str = "completion"  # prompt_completion: the field holding the answer
    # a jinja chat template file; "" = the tokenizer's own (its tokenizer_config.json chat_template)
    chat_template: str = ""
    # which tokens carry labels: "" = assistant for chat, completion for prompt_completion, all for text |
    # assistant (the assistant's turns, their end-of-turn token included) | completion | all
    loss_on: str = ""
    # chat / prompt_completion: pack whole conversations into data.seq_len windows (first fit; attention never
    # crosses a document) | false = one conversation per window, padded
    packing: bool = True
    # a conversation longer than data.seq_len: error (names the record) | skip (counted in the start-up line)
    truncation: str = "error"
    # a malformed record (unknown role, empty conversation, missing field): error | skip (counted, never silent)
    bad_records: str = "error"


@dataclass
class PeftConfig:
    """The ``peft`` config section: parameter-efficient fine-tuning (LoRA) of a frozen base model."""

    method: str = "none"  # none | lora
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    # fnmatch patterns over module names; [] = attention projections, dense MLPs, shared and routed experts
    targets: list[str] = field(default_factory=list)


@dataclass
class TrainConfig:
    """The ``train`` config section: steps, batch sizes, AdamW and the learning-rate schedule."""

    steps: int = 100
    global_batch_size: int = 16  # sequences per optimizer step, over all ranks
    # sequences per rank per forward (gradient accumulation fills the rank's share of the global batch); 0 = the
    # largest divisor of global_batch_size up to 4, the same under every layout, so layouts train alike (balancing
    # losses are per micro-batch)
    micro_batch_size: int = 0
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    # Megatron's precision-aware optimizer: dtype of AdamW's exp_avg and exp_avg_sq (fp32 | bf16), of the model's
    # parameters (fp32 | bf16), and of the master copy the optimizer keeps of bf16 parameters (fp32 | none: update
    # the bf16 parameters directly); see moe_train.adamw
    optimizer_states_dtype: str = "fp32"
    params_dtype: str = "fp32"
    master_weights_dtype: str = "fp32"
    # adamw | muon: Muon (moe_train.muon) for the hidden matrices, routed experts one matrix each, and AdamW (the
    # keys above) for embeddings, head, norms, biases, routers and MTP projections, one lr for both (train.lr, so
    # muon_adjust_lr_fn match_rms_adamw lets Muon reuse AdamW's lr and weight decay, as Moonlight does)
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # Megatron --muon-momentum
    muon_use_nesterov: bool = True  # Megatron --muon-use-nesterov
    muon_num_ns_steps: int = 5  # Megatron --muon-num-ns-steps
    muon_adjust_lr_fn: str = "match_rms_adamw"  # torch.optim.Muon's adjust_lr_fn: original | match_rms_adamw
    # Newton-Schulz's dtype: auto (bf16 on GPU as torch and Megatron-Core, fp32 on CPU) | bf16 | fp32
    muon_ns_dtype: str = "auto"
    # Newton-Schulz's quintic (a, b, c): torch.optim.Muon's ns_coefficients, Keller Jordan's by default
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    # QK-clip (Kimi K2's MuonClip, Megatron --qk-clip; moe_train.qk_clip): after each optimizer step, rescale the q/k
    # projections of every attention head whose largest logit over the step's batch exceeds qk_clip_threshold;
    # qk_clip_alpha is the query's share of the factor (Megatron --qk-clip-alpha; 0.5: Kimi K2's square roots)
    qk_clip: bool = False
    qk_clip_threshold: float = 100.0  # Megatron --qk-clip-threshold
    qk_clip_alpha: float = 0.5
    # a step whose loss or gradient norm is not finite stops the run; up to this many such steps are skipped instead
    # (no update) first
    skip_nonfinite_steps: int = 0
    eval_interval: int = 0  # steps between validation losses (and at the last step); 0 = no evaluation
    eval_iters: int = 4  # validation batches (of global_batch_size sequences) per evaluation


@dataclass
class RunConfig:
    """The ``run`` config section: output, devices, metrics, checkpoints, recompute and offload."""

    output_dir: str = "outputs/run"
    log_interval: int = 10
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | fp32 | bf16
    peak_tflops: float = 0.0  # 0 = auto: datasheet for known GPUs, a measured fp32 GEMM rate on CPU
    save_checkpoint: bool = True  # at the last step (and at checkpoint_interval, exit_interval, on SIGTERM/SIGINT)
    checkpoint_interval: int = 0  # steps between checkpoints during the run; 0 = only at the end
    keep_last: int = 0  # complete checkpoints kept (the oldest go once a newer one is in place); 0 = all
    async_checkpoint: bool = False  # write checkpoints in the background (DCP async_save) while training goes on
    resume: str = ""  # "" = a fresh run | auto = the latest complete checkpoint in output_dir | a checkpoint path
    overwrite: bool = False  # clear a non-empty output_dir instead of refusing it
    exit_interval: int = 0  # stop after the first step that is a multiple of this, with a checkpoint (Megatron's)
    wandb_project: str = ""  # also log to Weights & Biases (needs wandb installed); "" = TensorBoard only
    # Megatron module kinds (core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts; layer: whole
    # decoder layers) or fnmatch patterns over module names (e.g. "layers.*.mlp")
    recompute_modules: list[str] = field(default_factory=list)
    # kinds whose saved activations wait in host memory: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm,
    # expert_fc1, moe_act (or name patterns); only tensors of at least offload_min_tensor_bytes move
    offload_modules: list[str] = field(default_factory=list)
    offload_min_tensor_bytes: int = 1 << 20
    # regional torch.compile of each decoder layer (moe_train/compile.py); off until it is faster where it runs
    compile: bool = False
    # regions replayed from CUDA graphs (moe_train/cuda_graphs.py), Megatron-Core's --cuda-graph-scope names: attn,
    # moe_router, and layer (whole decoder layers holding a dropless MoE block); [] = none
    cuda_graphs: list[str] = field(default_factory=list)


@dataclass
class ExperimentConfig:
    """A whole experiment: one section per owning package."""

    model: ModelConfig = field(default_factory=ModelConfig)
    # a HuggingFace checkpoint directory the model section was read from and the weights are loaded from
    # (``--model.from_hf PATH``); "" = initialise from scratch
    model_from_hf: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(ExperimentConfig).items() if dataclasses.is_dataclass(hint)
}
# keys of the model section that name where the architecture comes from instead of a ModelConfig field:
# ``model.preset NAME`` (a moe_models preset, e.g. tiny-deepseek-v3) and ``model.from_hf PATH``
MODEL_SOURCE_KEYS = ("preset", "from_hf")


def preset_names() -> list[str]:
    """Names of the built-in presets (``moe-train train --config NAME``)."""
    files = resources.files("moe_train.presets").iterdir()
    return sorted(p.name.removesuffix(".yaml") for p in files if p.name.endswith(".yaml"))


def _read_yaml(name_or_path: str) -> dict[str, Any]:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"config file {name_or_path!r} not found; pass a YAML path or one of {preset_names()}")
        text = path.read_text()
    elif name_or_path in preset_names():
        text = resources.files("moe_train.presets").joinpath(f"{name_or_path}.yaml").read_text()
    else:
        close = difflib.get_close_matches(name_or_path, preset_names(), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"config {name_or_path!r} is neither a file nor a preset; {hint}presets: {', '.join(preset_names())}"
        )
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config {name_or_path!r} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {name_or_path!r} must be a mapping of sections ({', '.join(SECTIONS)})")
    return data


def _unknown(kind: str, name: str, choices: list[str]) -> ConfigError:
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    if not close:
        return ConfigError(f"unknown config {kind} {name!r}; known: {', '.join(choices)}")
    others = f" (also close: {', '.join(close[1:])})" if len(close) > 1 else ""
    hint = f"; did you mean {close[0]!r}?{others}"
    return ConfigError(f"unknown config {kind} {name!r}{hint}")


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check ``value`` against a field's annotation; strings from the command line are parsed as YAML."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        for option in options[:-1]:  # e.g. int | list[int]: the first type the value fits
            with contextlib.suppress(ConfigError):
                return _coerce(key, value, option)
        return _coerce(key, value, options[-1])
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v] if not value.startswith("[") else yaml.safe_load(value)
        if not isinstance(value, list):
            value = [value]  # one value where a list is allowed, as Megatron's list flags accept
        return [_coerce(key, v, item) for v in value]
    if isinstance(value, str) and annotation is not str:
        with contextlib.suppress(yaml.YAMLError):
            value = yaml.safe_load(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            with contextlib.suppress(TypeError, ValueError):  # YAML 1.1 reads "1e-3" (no dot) as a string
                number = float(value)
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")
            return number
    elif annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        return value
    raise ConfigError(f"config key {key!r} expects {annotation.__name__}, got {value!r}")


def _set(sections: dict[str, dict[str, Any]], dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        raise _unknown("section", section, list(SECTIONS))
    if not key:
        raise ConfigError(f"config key {dotted!r} needs a field name, e.g. '{section}.<field>'")
    hints = typing.get_type_hints(SECTIONS[section])
    if key not in hints:
        extra = [f"model.{k}" for k in MODEL_SOURCE_KEYS] if section == "model" else []
        raise _unknown("key", dotted, [f"{section}.{k}" for k in hints] + extra)
    value = _coerce(dotted, value, hints[key])
    sections[section][key] = short_name(value) if (section, key) in DTYPE_KEYS else value


def _model_base(preset: str | None, from_hf: str | None) -> dict[str, Any]:
    """ModelConfig fields of a moe_models preset or of a HuggingFace checkpoint's config.json."""
    if from_hf is not None:
        from moe_models.hf import checkpoint_config
        from moe_models.hf.files import resolve_inside

        config_json = Path(from_hf) / "config.json"
        if not config_json.is_file():
            raise ConfigError(f"model.from_hf={from_hf!r}: no config.json there; pass a HuggingFace model directory")
        if resolve_inside(from_hf, "config.json") is None:
            raise ConfigError(
                f"model.from_hf={from_hf!r}: config.json leads outside the checkpoint directory; copy the file into "
                "it instead of linking to it"
            )
        try:
            return dataclasses.asdict(checkpoint_config(from_hf))
        except (ValueError, OSError) as err:  # HFCheckpointError and JSON errors are ValueErrors
            raise ConfigError(f"model.from_hf={from_hf!r}: {err}") from None
    if preset is not None:
        from moe_models.presets import PRESETS
        from moe_models.presets import preset as model_preset

        if preset not in PRESETS:
            close = difflib.get_close_matches(preset, list(PRESETS), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(f"model.preset={preset!r} is not a moe_models preset; {hint}known: {', '.join(PRESETS)}")
        return dataclasses.asdict(model_preset(preset))
    return {}


def load_config(name_or_path: str = "tiny", overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Preset or YAML file, then overrides (``{"train.steps": "5"}``), validated section by section.

    The model section may start from ``model.preset NAME`` or ``model.from_hf PATH``; its other keys override
    that. A ``model.preset`` or ``model.from_hf`` given as an override replaces the file's whole model section (whose
    keys describe another model); only ``model.*`` overrides apply on top of it.
    """
    raw = _read_yaml(name_or_path)
    overrides = dict(overrides or {})
    for section in raw:
        if section not in SECTIONS:
            raise _unknown("section", str(section), list(SECTIONS))
        if not isinstance(raw[section], dict):
            raise ConfigError(f"config section {section!r} must be a mapping of keys, got {raw[section]!r}")
    model_raw = dict(raw.get("model", {}))
    source = {key: model_raw.pop(key) for key in MODEL_SOURCE_KEYS if key in model_raw}
    cli_source = {key: str(overrides.pop(f"model.{key}")) for key in MODEL_SOURCE_KEYS if f"model.{key}" in overrides}
    if cli_source:  # the file's model keys describe its own model, not the one named here
        source, model_raw = {}, {}
    source.update(cli_source)
    if "preset" in source and "from_hf" in source:
        raise ConfigError("model.preset and model.from_hf both name the model: keep one")
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    sections["model"] = _model_base(source.get("preset"), source.get("from_hf"))
    for section, values in {**raw, "model": model_raw}.items():
        for key, value in values.items():
            _set(sections, f"{section}.{key}", value)
    for dotted, value in overrides.items():
        _set(sections, dotted, value)
    try:
        built = {name: cls(**sections[name]) for name, cls in SECTIONS.items()}
    except ValueError as err:
        raise config_error(err) from None
    cfg = ExperimentConfig(**built, model_from_hf=str(source.get("from_hf", "")))
    validate(cfg)
    return cfg


def _at_least(section: str, obj: Any, low: int, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < low:
            raise ConfigError(f"{section}.{name}={getattr(obj, name)}: must be >= {low}")


def _positive(section: str, obj: Any, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(f"{section}.{name}={getattr(obj, name)}: must be positive")


def validate(cfg: ExperimentConfig) -> None:
    """Checks that span fields, or that the section dataclasses leave to the trainer."""
    _positive("train", cfg.train, "steps", "global_batch_size", "lr")
    _positive("data", cfg.data, "seq_len")
    _positive("run", cfg.run, "log_interval")
    _at_least("train", cfg.train, 0, "skip_nonfinite_steps", "eval_interval")
    _at_least("train", cfg.train, 1, "eval_iters")
    _at_least("run", cfg.run, 0, "checkpoint_interval", "keep_last", "exit_interval")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(cfg.train, name) < 1:
            raise ConfigError(f"train.{name}={getattr(cfg.train, name)}: must be in [0, 1), e.g. 0.9 / 0.95")
    if cfg.train.adam_eps <= 0:
        raise ConfigError(f"train.adam_eps={cfg.train.adam_eps}: must be positive, e.g. 1e-8")
    if cfg.train.weight_decay < 0:
        raise ConfigError(f"train.weight_decay={cfg.train.weight_decay}: must be >= 0")
    if cfg.train.clip_grad < 0:
        raise ConfigError(f"train.clip_grad={cfg.train.clip_grad}: must be >= 0 (0 = no clipping)")
    if cfg.data.seq_len > cfg.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len}: longer than model.max_position_embeddings="
            f"{cfg.model.max_position_embeddings}; shorten data.seq_len or raise model.max_position_embeddings"
        )
    if cfg.train.micro_batch_size < 0:
        raise ConfigError(f"train.micro_batch_size={cfg.train.micro_batch_size}: must be >= 0 (0 = derive)")
    if not 0 <= cfg.train.min_lr <= cfg.train.lr:
        raise ConfigError(f"train.min_lr={cfg.train.min_lr}: must be in [0, train.lr={cfg.train.lr}]")
    if cfg.train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={cfg.train.warmup_steps}: must be >= 0")
    for key, choices in (
        ("optimizer_states_dtype", ("fp32", "bf16")),
        ("params_dtype", ("fp32", "bf16")),
        ("master_weights_dtype", ("fp32", "none")),
    ):
        if getattr(cfg.train, key) not in choices:
            raise ConfigError(f"train.{key}={getattr(cfg.train, key)!r}: choose {' or '.join(choices)}")
    _validate_data(cfg)
    _validate_peft(cfg.peft)
    check_training(cfg)
    if cfg.run.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"run.device={cfg.run.device!r}: choose auto, cpu or cuda")
    if cfg.run.dtype not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"run.dtype={cfg.run.dtype!r}: choose auto, fp32 or bf16")


def _validate_peft(peft: PeftConfig) -> None:
    if peft.method not in ("none", "lora"):
        raise ConfigError(f"peft.method={peft.method!r}: choose none (train every parameter) or lora")
    if peft.method == "none":
        return
    _positive("peft", peft, "rank", "alpha")
    if not 0 <= peft.dropout < 1:
        raise ConfigError(f"peft.dropout={peft.dropout}: must be in [0, 1)")


def _validate_data(cfg: ExperimentConfig) -> None:
    """The data checks that read no files (``moe-train plan`` runs them too, where the data may not exist); the
    others come in moe_train.data.prepare_data, before the trainer builds anything."""
    data = cfg.data
    if not data.source:
        raise ConfigError(
            "data.source='': name the training data: 'stdlib', a .txt, .jsonl or .parquet file, a directory of them, "
            "or a datasets save_to_disk directory"
        )
    if not data.text_field:
        raise ConfigError("data.text_field='': name the record field that holds the text (default 'text')")
    if not 0 <= data.valid_fraction < 1:
        raise ConfigError(
            f"data.valid_fraction={data.valid_fraction}: must be in [0, 1) (the fraction of documents held out for "
            "validation; 0 = none)"
        )
    if cfg.train.eval_interval and not (data.valid_fraction or data.valid_source):
        raise ConfigError(
            f"train.eval_interval={cfg.train.eval_interval}: there is no validation data to evaluate on; hold some "
            "out with data.valid_fraction (e.g. 0.01), name it with data.valid_source, or set train.eval_interval 0"
        )
    if data.decode_errors not in ("strict", "replace"):
        raise ConfigError(
            f"data.decode_errors={data.decode_errors!r}: must be strict (undecodable text is an error) or replace "
            "(undecodable bytes become U+FFFD)"
        )
    if data.valid_fraction and data.valid_source:
        raise ConfigError(
            f"data.valid_fraction={data.valid_fraction} and data.valid_source={data.valid_source!r} both name the "
            "validation data: keep one"
        )
    _validate_data_format(cfg)
    # byte level for sure: no tokenizer named, none to take from a checkpoint (whether one has a tokenizer.json is
    # for prepare_data to look at)
    if (data.tokenizer == "bytes" or not (data.tokenizer or cfg.model_from_hf)) and cfg.model.vocab_size < 256:
        raise ConfigError(f"model.vocab_size={cfg.model.vocab_size}: byte-level data needs at least 256")


# data.format -> the data.loss_on values that mean something for it ("" = its default)
LOSS_ON = {"text": ("", "all"), "chat": ("", "assistant", "all"), "prompt_completion": ("", "completion", "all")}


def recurrent_layers_field(model: ModelConfig) -> str | None:
    """``"field=value"`` of the model config field that gives it recurrent layers (Gated DeltaNet's
    experimental_attention_variant, a hybrid pattern's Mamba-2 layers), None without any."""
    if model.experimental_attention_variant:
        return f"experimental_attention_variant={model.experimental_attention_variant}"
    if "mamba" in model.attention_kinds():
        return f"hybrid_override_pattern={model.hybrid_override_pattern}"
    return None


def _validate_data_format(cfg: ExperimentConfig) -> None:
    """data.format and the keys of conversation data (moe_train.conversation_data reads them)."""
    data = cfg.data
    if data.format not in LOSS_ON:
        raise ConfigError(
            f"data.format={data.format!r}: choose text (one document per record), chat (conversations) or "
            "prompt_completion (two text fields)"
        )
    if data.format != "text" and cfg.model.mtp_num_layers:
        # an MTP depth's targets lie further on in the window, in the next conversation at a document's end
        raise ConfigError(
            f"model.mtp_num_layers={cfg.model.mtp_num_layers}: multi-token prediction is not supported on packed "
            f"conversations (data.format={data.format}) yet; set --model.mtp_num_layers null to fine-tune without it"
        )
    recurrent = recurrent_layers_field(cfg.model)
    if data.format != "text" and data.packing and cfg.parallel.cp > 1 and recurrent:
        # a recurrent layer chains its state across the cp ranks' chunks, not yet across documents' ends
        raise ConfigError(
            f"parallel.cp={cfg.parallel.cp}: the model's recurrent layers (model.{recurrent}) take packed "
            "conversations at cp=1 only yet; set --data.packing false or --parallel.cp 1"
        )
    if data.loss_on not in LOSS_ON[data.format]:
        known = ("", "assistant", "completion", "all")
        what = "is not a choice" if data.loss_on not in known else f"does not apply to data.format={data.format}"
        choices = ", ".join(c for c in LOSS_ON[data.format] if c)
        raise ConfigError(f"data.loss_on={data.loss_on!r}: {what}; choose {choices} (or '' for the format's default)")
    for key, meaning in (("truncation", "conversations longer than data.seq_len"), ("bad_records", "bad records")):
        if getattr(data, key) not in ("error", "skip"):
            raise ConfigError(
                f"data.{key}={getattr(data, key)!r}: choose error (stop at the first of the {meaning}) or skip (count "
                "and leave them out)"
            )
    if data.format == "text":
        return
    if data.source == "stdlib":
        raise ConfigError(
            f"data.source='stdlib' is text, not {data.format} records; name a .jsonl or .parquet file, a directory of "
            "them or a datasets save_to_disk directory"
        )
    # that conversations have a tokenizer is checked where the data is prepared (moe_train.conversation_data), not here:
    # `moe-train plan --config` sizes a fine-tuning recipe whose checkpoint (and so tokenizer) is not on this machine
    if data.format == "prompt_completion":
        for key in ("prompt_field", "completion_field"):
            if not getattr(data, key):
                raise ConfigError(f"data.{key}='': name the record field that holds the {key.split('_')[0]}")
        if data.prompt_field == data.completion_field:
            raise ConfigError(
                f"data.prompt_field and data.completion_field are both {data.prompt_field!r}: name two fields"
            )
