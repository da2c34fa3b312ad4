"""The ``moe-train`` command line.

moe-train                          # = moe-train train --config tiny
moe-train train --config NAME_OR_PATH [--section.key value ...]
moe-train launch --nproc-per-node N [torchrun options] [--config ...] [--section.key value ...]   # under torchrun
moe-train plan [--world-size N] [--config ...] [--parallel.ep 4 ...]   # shard sizes per rank, no run
moe-train plan ... --memory [--device-memory 80]   # and each rank's estimated memory
moe-train plan --search --gpus 64 [--hardware h100-80gb] [--model.preset ...]   # the fastest layouts that fit
moe-train env                      # capability table
moe-train export CHECKPOINT --hf OUT [--dtype fp32|bf16] [--overwrite]   # a checkpoint (or a run's latest) as HF
moe-train export CHECKPOINT --peft OUT [--dtype ...] [--overwrite]   # a LoRA run's adapters as a PEFT adapter
moe-train generate CHECKPOINT --prompt TEXT [--chat] [--max-new-tokens N] [--temperature T] [--seed S]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from moe_train import __version__
from moe_train.config import ConfigError, config_error, load_config, preset_names, recurrent_layers_field

EXIT_USAGE = 2
EXIT_DIVERGED = 3  # the loss or gradient norm stopped being finite
# how long `moe-train launch` waits for workers told to stop (they save first) before killing them; torchrun's is 30 s
LAUNCH_SHUTDOWN_TIMEOUT_S = 600


def _parse_overrides(tokens: Sequence[str]) -> dict[str, str]:
    """``--a.b 1 --c.d=2`` -> ``{"a.b": "1", "c.d": "2"}``."""
    overrides: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"unexpected argument {token!r}; overrides look like --section.key value")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ConfigError(f"override --{key} needs a value, e.g. --{key} VALUE")
            value = tokens[i + 1]
            i += 1
        if "." not in key:
            raise ConfigError(f"override --{key} must name a section and key, e.g. --train.{key}")
        overrides[key] = value
        i += 1
    return overrides


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-train", description="Train Mixture-of-Experts language models on native PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command")
    train = commands.add_parser(
        "train",
        help="train a model (the default command)",
        description="Overrides: any --section.key value, e.g. --train.steps 20 --model.num_layers 4.",
    )
    train.add_argument("--config", default="tiny", help=f"preset ({', '.join(preset_names())}) or YAML file")
    plan = commands.add_parser(
        "plan",
        help="print each rank's parameter shard sizes (and, for small worlds, which rank holds what), without a run",
        description="Builds the model on the meta device and splits it as training would, over a simulated world "
        "of --world-size ranks; takes the same --config and --section.key overrides as train, e.g. "
        "--model.preset deepseek-v3-671b --world-size 1024 --parallel.ep 64.",
    )
    plan.add_argument("--config", default="tiny", help=f"preset ({', '.join(preset_names())}) or YAML file")
    plan.add_argument(
        "--world-size", type=int, default=None, help="ranks to plan for (default: $WORLD_SIZE, else the smallest fit)"
    )
    plan.add_argument(
        "--memory",
        action="store_true",
        help="also estimate each rank's memory (parameters, gradients, optimizer states, activations by module, "
        "dispatcher buffers, logits) for train.micro_batch_size x data.seq_len tokens, run.dtype (auto: bf16), "
        "train.*_dtype, run.recompute_modules / run.offload_modules",
    )
    plan.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="flag the ranks whose estimated memory exceeds this many GiB (implies --memory)",
    )
    plan.add_argument(
        "--search",
        action="store_true",
        help="rank every layout of the model over --gpus GPUs that fits --hardware by an estimated step time (sizes "
        "given as --parallel.tp 1 ... are held); prints the best with memory per rank and time split",
    )
    plan.add_argument("--gpus", type=int, default=None, help="with --search: the GPUs to lay the model out over")
    plan.add_argument(
        "--hardware",
        default="h100-80gb",
        help="with --search: a built-in profile (h100-80gb, h200-141gb, b200-192gb, gb200-186gb) or a YAML file",
    )
    plan.add_argument("--top", type=int, default=5, help="with --search: how many layouts to print (default 5)")
    plan.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="with --search: the fraction of peak FLOP/s compute runs at (default: the one fitted to published runs)",
    )
    commands.add_parser(
        "launch",
        help="train under torchrun (every rank), after checking the config for the launch's world size once",
        description="Takes torchrun's options (--nproc-per-node, --nnodes, --rdzv-endpoint, ...) and train's "
        "(--config, --section.key value). A config error is one line and exit code 2 before any worker starts; a run "
        "that diverges exits 3, as one process does (plain torchrun turns every failure into 1 and a traceback).",
    )
    commands.add_parser("env", help="show which back ends and optional packages this machine has")
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a HuggingFace model directory (transformers' from_pretrained reads it)",
        description="CHECKPOINT: a checkpoint directory (step_N) or a run's output directory (its latest complete "
        "checkpoint). --hf writes config.json + safetensors, and the run's local tokenizer.json, into OUT (a LoRA "
        "run's model merged); --peft writes a LoRA run's adapters as a PEFT adapter directory (adapter_config.json + "
        "adapter_model.safetensors) for peft.PeftModel.from_pretrained on the transformers model of model.from_hf.",
    )
    export.add_argument("checkpoint", help="checkpoint directory (step_N) or run output directory")
    export.add_argument("--hf", metavar="OUT", default=None, help="HuggingFace directory to write")
    export.add_argument("--peft", metavar="OUT", default=None, help="PEFT adapter directory to write (LoRA runs)")
    export.add_argument("--dtype", default=None, help="fp32 or bf16 (default: the dtype the run trained in)")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    generate = commands.add_parser(
        "generate",
        help="continue a prompt with a trained model (greedy, or sampled with --temperature), with a KV cache",
        description="CHECKPOINT: a checkpoint directory (step_N) or a run's output directory (its latest complete "
        "checkpoint), LoRA runs included. --chat renders the prompt as a user turn with the run's chat template and "
        "its generation prompt (as apply_chat_template(..., add_generation_prompt=True) does); generation stops at the "
        "tokenizer's end-of-text token or after --max-new-tokens.",
    )
    generate.add_argument("checkpoint", help="checkpoint directory (step_N) or run output directory")
    generate.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    generate.add_argument("--chat", action="store_true", help="render the prompt with the run's chat template")
    generate.add_argument("--max-new-tokens", type=int, default=128, help="at most this many tokens (default 128)")
    generate.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy; > 0 samples")
    generate.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    quantize = commands.add_parser(
        "quantize",
        help="write a checkpoint as a quantised (FP8 or NVFP4) HuggingFace checkpoint, with NVIDIA Model Optimizer",
        description="CHECKPOINT: a checkpoint directory (step_N) or a run's output directory. Calibrates on the "
        "run's configured data and writes modelopt's HF export (config.json with quantization_config, safetensors) "
        "into OUT. Needs nvidia-modelopt: pip install 'moe-train[quantize]'. Runs on CPU.",
    )
    quantize.add_argument("checkpoint", help="checkpoint directory (step_N) or run output directory")
    quantize.add_argument("--recipe", required=True, help="fp8 or nvfp4 (modelopt's FP8_DEFAULT / NVFP4_DEFAULT)")
    quantize.add_argument("--out", required=True, help="directory to write")
    quantize.add_argument("--calib-batches", type=int, default=8, help="calibration batches of the run's data")
    quantize.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and is not empty")
    return parser


def _generate(args: argparse.Namespace, rest: list[str]) -> int:
    from pathlib import Path

    from moe_models.hf import HFCheckpointError
    from moe_train.checkpoint import CheckpointError
    from moe_train.generate import answer

    if rest:
        raise ConfigError(f"moe-train generate takes CHECKPOINT --prompt TEXT [options], got {' '.join(rest)}")
    try:
        said = answer(
            Path(args.checkpoint),
            args.prompt,
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
        )
    except (CheckpointError, HFCheckpointError) as err:
        raise ConfigError(str(err)) from None
    print(said.text)
    how = (
        "stopped at the end-of-text token" if said.stopped else f"stopped after --max-new-tokens {args.max_new_tokens}"
    )
    print(f"moe-train: {len(said.prompt_tokens)} prompt tokens, {len(said.tokens)} new ({how})", file=sys.stderr)
    return 0


def _quantize(checkpoint: str, recipe: str, out: str, calib_batches: int, overwrite: bool, rest: list[str]) -> int:
    import json
    from pathlib import Path

    from moe_models.hf import HFCheckpointError
    from moe_train.checkpoint import CheckpointError
    from moe_train.quantize import QuantizeError, modelopt_version, quantize_checkpoint
    from moe_train.write_errors import describe

    if rest:
        raise ConfigError(
            f"moe-train quantize takes CHECKPOINT --recipe --out [--calib-batches] [--overwrite], got {' '.join(rest)}"
        )
    try:
        written = quantize_checkpoint(
            Path(checkpoint), recipe, Path(out), calib_batches=calib_batches, overwrite=overwrite
        )
    except (QuantizeError, CheckpointError, HFCheckpointError, FileExistsError) as err:
        raise ConfigError(str(err)) from None
    except OSError as err:  # a full disk, a read-only directory
        raise ConfigError(f"{describe(err, Path(out))}; nothing was written to {out}") from None
    algo = json.loads((written / "config.json").read_text()).get("quantization_config", {}).get("quant_algo", recipe)
    print(f"quantized {checkpoint} with nvidia-modelopt {modelopt_version()} ({algo}) -> {written}")
    return 0


def _train(config: str, override_tokens: list[str]) -> int:
    from moe_parallel import shutdown_distributed
    from moe_train.checkpoint import CheckpointError
    from moe_train.faults import NonFiniteError, OtherRankFailed
    from moe_train.trainer import prepare, train
    from moe_train.write_errors import OutputWriteError

    cfg = load_config(config, _parse_overrides(override_tokens))
    try:
        train(prepare(cfg, int(os.environ.get("WORLD_SIZE", "1"))))
    except CheckpointError as err:  # found only once the checkpoint is read, after the build
        raise ConfigError(f"run.resume={cfg.run.resume!r}: {err}") from None
    except OutputWriteError as err:  # a full disk, a read-only directory: what to free or fix
        raise ConfigError(str(err)) from None
    except OtherRankFailed:  # the rank that failed says why
        return EXIT_USAGE
    except NonFiniteError as err:
        if int(os.environ.get("RANK", "0")) == 0:  # every rank stops at the same step (global values): one line
            print(f"moe-train: error: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    finally:
        shutdown_distributed()
    return 0


def _split_launch_tokens(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """(torchrun's tokens, train's): train's are ``--config`` and the dotted overrides (``--train.steps 5``), each
    with its value; an optional ``train`` word is dropped; everything else is torchrun's."""
    launcher: list[str] = []
    training: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name = token[2:].partition("=")[0] if token.startswith("--") else ""
        if name == "config" or "." in name:
            training.append(token)
            if "=" not in token and i + 1 < len(tokens):
                training.append(tokens[i + 1])
                i += 1
        elif not (token == "train" and not training):
            launcher.append(token)
        i += 1
    return launcher, training


def _config_and_overrides(training: list[str]) -> tuple[str, list[str]]:
    """``--config NAME`` (or ``--config=NAME``; default ``tiny``) and the other tokens of train's."""
    config, overrides, i = "tiny", [], 0
    while i < len(training):
        token = training[i]
        if token == "--config":
            if i + 1 >= len(training):
                raise ConfigError("--config needs a value: a preset name or a YAML file")
            config, i = training[i + 1], i + 2
            continue
        if token.startswith("--config="):
            config = token.partition("=")[2]
        else:
            overrides.append(token)
        i += 1
    return config, overrides


def _launch_world_size(args: argparse.Namespace) -> int | None:
    """nnodes x processes per node when both are fixed (an elastic range or ``auto`` is not known beforehand)."""
    from torch.distributed.run import determine_local_world_size

    low, _, high = str(args.nnodes).partition(":")
    if high and high != low:
        return None
    try:
        return int(low) * determine_local_world_size(args.nproc_per_node)
    except ValueError:
        return None


def _launch(tokens: list[str]) -> int:
    """``moe-train launch``: check the run for the launch's world size here, then run torchrun's launcher in this
    process, its workers running ``moe-train train``; the job exits with the first failing worker's code (2 for a
    config error found late, 3 for a diverged run) without torchrun's traceback."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    from moe_train.setup import check_run

    launcher, training = _split_launch_tokens(tokens)
    config, overrides = _config_and_overrides(training)
    args = get_args_parser().parse_args([*launcher, "-m", "moe_train", "train", "--config", config, *overrides])
    world_size = _launch_world_size(args)
    if world_size is not None:
        checked = check_run(load_config(config, _parse_overrides(overrides)), world_size)
        if checked.source is not None:
            checked.source.close()
    single_node = str(args.nnodes) in ("1", "1:1")
    if single_node and not args.standalone and not args.rdzv_endpoint and args.rdzv_backend == "static":
        args.standalone = True  # a free port of its own rather than the fixed default one
    # torchrun's agents share one store across the rendezvous rounds of a job, where the ranks of a failed attempt
    # left their addresses under the keys the restarted ranks use: a restarted rank could read a dead one's address
    # (gloo then fails to connect, 4 restarts in 5 here). A store of each round's own, on its rank 0, keeps them apart
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if args.shutdown_timeout is None:  # on Ctrl-C / SIGTERM the workers finish their step and save: give them time
        args.shutdown_timeout = LAUNCH_SHUTDOWN_TIMEOUT_S
    # the workers print their own one-line errors; the agent's log lines about them would only repeat them
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun(args)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


def _plan(
    config: str,
    world_size: int | None,
    override_tokens: list[str],
    memory: bool = False,
    device_memory: float | None = None,
) -> int:
    import torch

    from moe_models.memory import model_shape
    from moe_train.plan_report import (
        RANK_MAP_MAX_WORLD,
        format_memory,
        format_report,
        memory_estimates,
        plan_memory_options,
        plan_micro_batching,
        plan_report,
        with_microbatches,
    )

    if world_size is not None and world_size <= 0:
        raise ConfigError(
            f"--world-size {world_size}: must be a positive number of ranks; omit it to plan for $WORLD_SIZE, else for "
            "the smallest world the layout fits"
        )
    cfg = load_config(config, _parse_overrides(override_tokens))
    p = cfg.parallel
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "0"))
    if world_size <= 0:  # the smallest world both the attention and the expert side fold into
        attention = p.tp * p.cp * p.pp * p.dp_replicate * max(p.dp_shard, 1)
        world_size = math.lcm(attention, (p.etp or p.tp) * p.ep * p.pp)
    if device_memory is not None and device_memory <= 0:
        raise ConfigError(f"--device-memory={device_memory:g}: give the memory of one device in GiB, > 0")
    if memory or device_memory is not None:  # a model the estimate cannot describe: one line, before any planning
        try:
            model_shape(cfg.model)
        except ValueError as err:  # ModelConfigError
            raise config_error(err) from None
        recurrent = recurrent_layers_field(cfg.model)
        if p.cp > 1 and recurrent:  # their chained chunk states are not modelled
            raise ConfigError(
                f"parallel.cp={p.cp}: the memory estimate does not model recurrent layers (model.{recurrent}) under "
                "context parallelism yet; plan --memory at cp=1, or measure a step with moe_memory.SavedTensorBytes"
            )
    param_dtype = torch.bfloat16 if getattr(cfg.train, "params_dtype", "fp32") == "bf16" else torch.float32
    report = plan_report(
        cfg.model, p, world_size, param_dtype, cfg.run, cfg.data.seq_len, cfg.peft
    )  # validates the layout against the model first
    report = with_microbatches(report, p.pp_schedule, plan_micro_batching(cfg, report.layout)[1])
    print(f"{world_size} ranks, {cfg.model.num_moe_experts} experts per MoE layer ({cfg.model.family})")
    if world_size <= RANK_MAP_MAX_WORLD:  # one line per rank
        print(report.layout.rank_map(cfg.model.num_moe_experts))
    print(format_report(report))
    if memory or device_memory is not None:
        options = plan_memory_options(cfg, report.layout)
        print(format_memory(memory_estimates(report, cfg.model, options), options, device_memory))
    return 0


def _plan_search(args: argparse.Namespace, override_tokens: list[str]) -> int:
    from moe_train.plan_search import run_search

    if args.world_size is not None or args.memory or args.device_memory is not None:
        raise ConfigError("plan --search takes --gpus and --hardware, not --world-size, --memory or --device-memory")
    overrides = _parse_overrides(override_tokens)
    cfg = load_config(args.config, overrides)
    print(run_search(cfg, overrides, args.gpus, args.hardware, args.top, args.efficiency))
    return 0


def _export(
    checkpoint: str, out: str | None, dtype: str | None, overwrite: bool, rest: list[str], peft_out: str | None = None
) -> int:
    import json
    import warnings
    from pathlib import Path

    from moe_models import count_parameters
    from moe_models.hf import HFCheckpointError
    from moe_train.checkpoint import CheckpointError
    from moe_train.dtypes import short_name
    from moe_train.export import (
        EXPORT_DTYPES,
        export_hf,
        export_peft_checkpoint,
        resolve_checkpoint,
        trained_model_config,
    )
    from moe_train.write_errors import describe

    if rest:
        raise ConfigError(
            f"moe-train export takes CHECKPOINT --hf OUT | --peft OUT [--dtype] [--overwrite], got {' '.join(rest)}"
        )
    if (out is None) == (peft_out is None):
        raise ConfigError(
            "moe-train export needs --hf OUT (a HuggingFace model directory) or --peft OUT (a PEFT adapter): one"
        )
    if dtype is not None and short_name(dtype) not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {dtype}: choose {' or '.join(EXPORT_DTYPES)}")
    target = out if out is not None else peft_out
    assert target is not None
    try:
        info = resolve_checkpoint(Path(checkpoint))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if peft_out is not None:
                written = export_peft_checkpoint(info.path, Path(peft_out), dtype, overwrite=overwrite)
            else:
                written = export_hf(info.path, Path(target), dtype, overwrite=overwrite)
        config = trained_model_config(info.path)
    except (CheckpointError, HFCheckpointError, FileExistsError) as err:
        raise ConfigError(str(err)) from None
    except OSError as err:  # a full disk, a read-only directory
        raise ConfigError(f"{describe(err, Path(target))}; nothing was written to {target}") from None
    for warning in caught:
        print(f"moe-train: warning: {warning.message}", file=sys.stderr)
    if peft_out is not None:
        adapter = json.loads((written / "adapter_config.json").read_text())
        print(
            f"exported the LoRA adapters of step {info.step} ({info.path}): {config.family}, r={adapter['r']}, "
            f"{len(adapter['target_modules'])} modules and {len(adapter['target_parameters'] or [])} parameters "
            f"adapted, base {adapter['base_model_name_or_path']} -> {written}"
        )
        return 0
    counts = count_parameters(config)
    mtp = f", {counts.mtp / 1e6:.2f}M of them in MTP layers (transformers skips them)" if counts.mtp else ""
    tokenizer = "; tokenizer.json copied" if (written / "tokenizer.json").is_file() else ""
    print(
        f"exported step {info.step} ({info.path}): {config.family}, {(counts.total + counts.mtp) / 1e6:.2f}M "
        f"parameters{mtp}, {json.loads((written / 'config.json').read_text())['dtype']} -> {written}{tokenizer}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("--") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["train", *argv]
    if argv[:1] == ["launch"] and argv[1:2] not in (["-h"], ["--help"]):
        try:  # its options are torchrun's and train's: parsed by _launch, not by this parser
            return _launch(argv[1:])
        except ConfigError as err:
            print(f"moe-train: error: {err}", file=sys.stderr)
            return EXIT_USAGE
        except KeyboardInterrupt:  # during the checks, before any worker started
            print("moe-train: interrupted", file=sys.stderr)
            return 130
    args, rest = _parser().parse_known_args(argv)
    try:
        if args.command == "env":
            if rest:
                raise ConfigError(f"moe-train env takes no arguments, got {' '.join(rest)}")
            from moe_train.env import capability_rows, format_table

            print(format_table(capability_rows()))
            return 0
        if args.command == "export":
            return _export(args.checkpoint, args.hf, args.dtype, args.overwrite, rest, args.peft)
        if args.command == "generate":
            return _generate(args, rest)
        if args.command == "quantize":
            return _quantize(args.checkpoint, args.recipe, args.out, args.calib_batches, args.overwrite, rest)
        if args.command == "plan" and args.search:
            return _plan_search(args, rest)
        if args.command == "plan":
            return _plan(args.config, args.world_size, rest, args.memory, args.device_memory)
        return _train(args.config, rest)
    except ConfigError as err:
        print(f"moe-train: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as err:
        print(f"moe-train: {str(err) or 'interrupted'}", file=sys.stderr)
        return 130
