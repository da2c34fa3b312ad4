"""``moe-train plan --search --gpus N [--hardware h100-80gb|FILE]``: the fastest layouts of the configured model,
batch and sequence length that fit the device (:mod:`moe_train.layout_search`), printed with their memory per rank,
their time split and why each beats the next. Parallel sizes given on the command line (``--parallel.tp 1``) are held
fixed; the run's dtypes, FSDP precision and dispatcher come from the config."""

from __future__ import annotations

from moe_train.config import ConfigError, ExperimentConfig
from moe_train.dtypes import dtype_bytes
from moe_train.hardware import load_hardware
from moe_train.layout_search import (
    DEFAULT_EFFICIENCY,
    GIB,
    Candidate,
    LayoutSearch,
    SearchResult,
    SearchSettings,
)
from moe_train.step_time import PARTS

SEARCHED = ("tp", "cp", "pp", "vpp", "ep", "etp")  # the ParallelConfig sizes the search varies


def search_settings(cfg: ExperimentConfig) -> SearchSettings:
    """What the search takes from a config: batch, sequence length, parameter, optimizer-state and FSDP dtypes, the
    dispatcher (``run.dtype auto`` is bf16, as on a GPU)."""
    train, p = cfg.train, cfg.parallel
    param_bytes = 2 if getattr(train, "params_dtype", "fp32") == "bf16" else 4
    return SearchSettings(
        global_batch=train.global_batch_size,
        seq_len=cfg.data.seq_len,
        param_bytes=param_bytes,
        optimizer_state_bytes=dtype_bytes(train.optimizer_states_dtype),
        master_weights_bytes={"none": 0}.get(train.master_weights_dtype, 4) if param_bytes != 4 else 0,
        activation_bytes=2 if cfg.run.dtype == "auto" else dtype_bytes(cfg.run.dtype),
        gather_bytes=dtype_bytes(p.mixed_precision_param),
        reduce_bytes=dtype_bytes(p.mixed_precision_reduce),
        dispatcher=p.moe_token_dispatcher_type,
    )


def fixed_sizes(cfg: ExperimentConfig, overrides: dict[str, str]) -> dict[str, int]:
    """The parallel sizes the command line sets (``--parallel.tp 1``): the search holds them."""
    fixed = {}
    for name in SEARCHED:
        if f"parallel.{name}" in overrides:
            value = getattr(cfg.parallel, name)
            fixed[name] = 1 if value is None and name == "vpp" else value
    for name in ("dp_replicate", "dp_shard"):
        if f"parallel.{name}" in overrides:
            raise ConfigError(
                f"parallel.{name}: plan --search shards every layout with FSDP over the ranks the others leave; "
                f"drop --parallel.{name}, or plan one layout without --search"
            )
    return fixed


def run_search(
    cfg: ExperimentConfig,
    overrides: dict[str, str],
    gpus: int | None,
    hardware: str,
    top: int,
    efficiency: float | None,
) -> str:
    """The text ``moe-train plan --search`` prints; a bad argument is a :class:`ConfigError` naming it."""
    if gpus is None or gpus <= 0:
        raise ConfigError(f"--gpus {gpus}: plan --search needs the number of GPUs to lay the model out over, > 0")
    if top <= 0:
        raise ConfigError(f"--top {top}: the number of layouts to print, > 0")
    efficiency = DEFAULT_EFFICIENCY if efficiency is None else efficiency
    if not 0 < efficiency <= 1:
        raise ConfigError(f"--efficiency {efficiency:g}: the fraction of peak FLOP/s compute runs at, in (0, 1]")
    hw = load_hardware(hardware)
    settings = search_settings(cfg)
    fixed = fixed_sizes(cfg, overrides)
    search = LayoutSearch(cfg.model, settings, hw)
    result = search.search(gpus, efficiency, top, fixed)
    return format_search(result, search, efficiency, fixed)


def describe(c: Candidate) -> str:
    s = c.sizes
    text = f"tp={s.tp} cp={s.cp} pp={s.pp}" + (f" vpp={s.vpp}" if s.vpp > 1 else "")
    return text + f" ep={s.ep} etp={s.etp} fsdp={s.fsdp}"


def why(better: Candidate, worse: Candidate, digits: int = 2) -> str:
    """The parts of the step where ``better`` saves the most over ``worse``, and the one where it loses most."""
    gaps = sorted(((worse.time.parts[p] - better.time.parts[p], p) for p in PARTS), reverse=True)
    threshold = 0.005 * worse.time.total
    saved = [f"{p} {gap:.{digits}f} s less" for gap, p in gaps if gap > threshold][:2]
    lost = [f"{p} {-gap:.{digits}f} s more" for gap, p in reversed(gaps) if -gap > threshold][:1]
    return ", ".join(saved + lost) or "within 0.5% of the step in every part"


def _flags(c: Candidate, search: LayoutSearch) -> str:
    config = c.parallel_config()
    flags = [f"--parallel.{k} {getattr(config, k)}" for k in ("tp", "cp", "pp", "ep", "etp") if getattr(config, k) != 1]
    if config.vpp:
        flags += [f"--parallel.pp_schedule {config.pp_schedule}", f"--parallel.vpp {config.vpp}"]
    flags.append(f"--train.micro_batch_size {c.micro_batch}")
    recompute, offload = search.savings[c.saving]
    if recompute:
        flags.append(f"--run.recompute_modules {','.join(sorted(recompute))}")
    if offload:
        flags.append(f"--run.offload_modules {','.join(sorted(offload))}")
    return " ".join(flags)


def format_search(
    result: SearchResult, search: LayoutSearch, efficiency: float, fixed: dict[str, int] | None = None
) -> str:
    settings, hw = search.settings, search.hw
    held = f"; held: {', '.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    lines = [
        f"{result.layouts} layouts over {result.world} x {hw.name}{held}; {result.fitting} fit in "
        f"{hw.memory_gib - hw.reserved_gib:g} GiB ({hw.memory_gib:g} less {hw.reserved_gib:g} reserved); global batch "
        f"{settings.global_batch} x {settings.seq_len} tokens; compute at {efficiency:.1%} of {hw.bf16_tflops:g} "
        f"TFLOP/s bf16; searched in {result.seconds:.1f} s"
    ]
    if not result.top:
        lines.append("no layout fits: more GPUs, a smaller global batch or sequence, or a device with more memory")
        return "\n".join(lines)
    header = ["#", "layout", "micro", "saving", "GiB/rank", "step s", "tok/s/GPU", *PARTS]
    rows = [header]
    for index, c in enumerate(result.top, 1):
        rows.append(
            [str(index), describe(c), f"{c.micro_batch}x{c.microbatches}", c.saving, f"{c.memory / GIB:.1f}",
             f"{c.time.total:.2f}", f"{c.tokens_per_second_per_gpu(settings):,.0f}",
             *(f"{c.time.parts[p]:.2f}" for p in PARTS)]
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.append(
        "micro: sequences per micro-batch x micro-batches per step; saving: none, selective (recompute the norms and "
        "activations), offload (and offload the big saves), layer (recompute whole layers); the split (seconds a "
        "step, the busiest pipeline rank's) adds up to the step"
    )
    for index, (a, b) in enumerate(zip(result.top, result.top[1:], strict=False), 1):
        lines.append(f"#{index} beats #{index + 1} by {b.time.total / a.time.total - 1:.1%}: {why(a, b)}")
    if result.refused:
        lines.append(f"({result.refused} faster layouts left out: the model's own rules refuse them)")
    lines.append("#1 as flags: " + _flags(result.top[0], search))
    return "\n".join(lines)
