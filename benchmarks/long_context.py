"""Long context on CPU: attention memory linear in the sequence, vocabulary-parallel logits, context parallelism.

Three measurements, each against a named baseline in the same run (fp32, CPU):

1. **Attention memory** (issue 15, item 2): one training forward + backward of the GPT-OSS proxy (learned sinks,
   sliding windows) and the DeepSeek-V3 proxy (MLA: a value head size of its own) on one sequence of 2k, 4k and 8k
   tokens, with moe_models' attention against the attention it replaced (``previous_core_attention`` below: the
   sink logit concatenated to an explicit ``[S, S]`` softmax; SDPA with a boolean window mask; SDPA's math path for
   MLA on CPU). Reported: activation bytes saved for backward (``SavedTensorBytes``), the peak of tensor bytes live
   during the step (``LiveTensorBytes``: activations, transients and parameter gradients), and the step time
   ratio (median of interleaved repetitions). Then the GPT-OSS proxy trains under ``moe-train`` at 8k tokens a
   sequence (5 steps).
2. **Logits per rank** (item 3): the tiny Qwen3-MoE with a 32k vocabulary at tp=2 on 2 gloo ranks: the bytes of the
   logits each rank holds, and of the loss's saved log-probabilities, against tp=1.
3. **Long-context training** (item 4): the tiny Qwen3-MoE trains on 32,768-token sequences under ``moe-train`` at
   cp=4 (4 gloo ranks on this 2-core machine) and in one process; tokens/s of each, and the activation bytes each
   rank saves for backward in one training forward at that length, cp=4 against cp=1.

    uv run python benchmarks/long_context.py [--quick] [--out benchmarks/results/long_context.json]

``--quick`` (the nox benchmarks session) runs part 1 at 128 tokens and part 3's measurement in one process at 256
tokens (the several-rank parts only in full runs, as memory_estimate's quick mode), and writes a file only where
``--out`` says.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _estimate import measured_step  # benchmarks/_estimate.py, beside this script
from _harness import cli, head_to_head, header, launch_ranks, parse, ratio_spread, write

REPEATS = 7


def previous_core_attention(self, q_BNSD, k_BNSD, v_BNSD, sinks_N=None, q_pos_S=None, k_pos_K=None):
    """``CoreAttention.forward`` as it was before the blockwise kernel (positions were not supported)."""
    s, n, n_kv = q_BNSD.shape[2], q_BNSD.shape[1], k_BNSD.shape[1]
    pos = torch.arange(s, device=q_BNSD.device)
    delta_SS = pos[:, None] - pos[None, :]
    mask_SS = (delta_SS >= 0) & (delta_SS < self.window) if self.window is not None else delta_SS >= 0
    if sinks_N is not None:
        k, v = k_BNSD.repeat_interleave(n // n_kv, dim=1), v_BNSD.repeat_interleave(n // n_kv, dim=1)
        logits_BNSS = (q_BNSD @ k.transpose(-1, -2)) * self.scale
        logits_BNSS = logits_BNSS.masked_fill(~mask_SS, float("-inf"))
        b = logits_BNSS.shape[0]
        sink_BNS1 = sinks_N.to(logits_BNSS.dtype).view(1, n, 1, 1).expand(b, n, s, 1)
        probs = torch.softmax(torch.cat([logits_BNSS, sink_BNS1], dim=-1).float(), dim=-1)[..., :-1]
        return probs.to(v.dtype) @ v
    if self.window is None or self.window >= s:
        return F.scaled_dot_product_attention(
            q_BNSD, k_BNSD, v_BNSD, is_causal=True, scale=self.scale, enable_gqa=n_kv != n
        )
    return F.scaled_dot_product_attention(
        q_BNSD, k_BNSD, v_BNSD, attn_mask=mask_SS, scale=self.scale, enable_gqa=n_kv != n
    )


# --- 1. attention memory ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _attention(previous: bool):
    """moe_models' attention, or (``previous``) the one it replaced, for the duration."""
    from moe_models.attention import CoreAttention

    current = CoreAttention.forward
    if previous:
        CoreAttention.forward = previous_core_attention
    try:
        yield
    finally:
        CoreAttention.forward = current


def _model_and_ids(preset_name: str, seq: int):
    from moe_models import build_model
    from moe_models.presets import preset

    config = preset(preset_name, max_position_embeddings=seq)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    return build_model(config, seed=0), ids


def _attention_step(preset_name: str, seq: int, previous: bool) -> dict:
    """One forward + loss + backward on one sequence of ``seq`` tokens: saved bytes, peak live bytes, seconds."""
    from moe_memory import LiveTensorBytes

    model, ids = _model_and_ids(preset_name, seq)
    with _attention(previous):
        start = time.perf_counter()
        with LiveTensorBytes() as live:
            saved = measured_step(model, ids, model.config.mtp_loss_scaling_factor)
        seconds = time.perf_counter() - start
    core = sum(n for name, n in saved.by_module.items() if name.endswith("core_attention"))
    return {"saved_bytes": saved.total, "core_attention_saved_bytes": core, "peak_live_bytes": live.peak, "s": seconds}


def _timed_step(preset_name: str, seq: int, previous: bool):
    """A function to time: one forward + loss + backward of a model of its own (its gradients allocated afresh)."""
    from moe_models import causal_lm_loss

    model, ids = _model_and_ids(preset_name, seq)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with _attention(previous):
            causal_lm_loss(model(ids), ids.roll(-1, dims=1), model.config.mtp_loss_scaling_factor).total.backward()

    return step


def train_gpt_oss(seq: int, steps: int) -> dict:
    """The GPT-OSS proxy trained by ``moe-train`` on one ``seq``-token sequence a step, in one process."""
    with tempfile.TemporaryDirectory() as tmp:
        result = _train(1, seq, steps, Path(tmp), config="tiny-gpt-oss")
    print(
        f"tiny-gpt-oss trains at {seq} tokens: {result['tokens_per_s_median']:,.0f} tokens/s, loss {result['losses']}"
    )
    return {"seq_len": seq, **result}


def attention_memory(lengths: tuple[int, ...], repeats: int) -> dict:
    out = {}
    for preset_name in ("tiny-gpt-oss", "tiny-deepseek-v3"):
        for seq in lengths:
            before, after = _attention_step(preset_name, seq, True), _attention_step(preset_name, seq, False)
            previous_s, blockwise_s = head_to_head(
                _timed_step(preset_name, seq, True), _timed_step(preset_name, seq, False), repeats, 0
            )
            speedup = ratio_spread(previous_s, blockwise_s)
            out[f"{preset_name} S={seq}"] = {
                "preset": preset_name,
                "seq_len": seq,
                "previous": before,
                "blockwise": after,
                "saved_ratio": after["saved_bytes"] / before["saved_bytes"],
                "peak_ratio": after["peak_live_bytes"] / before["peak_live_bytes"],
                "speedup_median": speedup["median"],
                "speedup_range": [speedup["min"], speedup["max"]],
            }
            print(
                f"{preset_name} S={seq}: saved {before['saved_bytes'] / 2**20:,.1f} -> "
                f"{after['saved_bytes'] / 2**20:,.1f} MiB, peak {before['peak_live_bytes'] / 2**20:,.1f} -> "
                f"{after['peak_live_bytes'] / 2**20:,.1f} MiB, step time previous / blockwise "
                f"{speedup['median']:.2f} ({speedup['min']:.2f}-{speedup['max']:.2f})",
                flush=True,
            )
    return out


# --- 2 and 3: several ranks ---------------------------------------------------------------------------------------


def _logits(seq: int, vocab: int) -> dict:
    """tp=2 and tp=1 (a lone rank) of the tiny Qwen3-MoE: the logits and the loss's saved log-probabilities."""
    from moe_memory.measure import SavedTensorBytes
    from moe_models import build_model, causal_lm_loss
    from moe_models.presets import preset
    from moe_parallel import ParallelConfig, build_meshes, init_distributed, parallelize, vocab_parallel_loss

    ctx = init_distributed("gloo", "cpu")
    config = preset("tiny-qwen3-moe", vocab_size=vocab, max_position_embeddings=seq)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    result = {}
    for tp in (1, 2):
        model = build_model(config, seed=0)
        if tp > 1:
            cfg = ParallelConfig(tp=tp)
            parallelize(model, build_meshes(cfg.layout(ctx.world_size), "cpu"), cfg)
        with vocab_parallel_loss(tp), SavedTensorBytes(model=model) as saved:
            output = model(ids)
            loss = causal_lm_loss(output, ids.roll(-1, dims=1), 0.0)
        logits = output.logits
        local = logits.to_local() if hasattr(logits, "to_local") else logits
        with vocab_parallel_loss(tp):
            loss.total.backward()
        result[f"tp={tp}"] = {
            "logits_shape_local": list(local.shape),
            "logits_bytes_per_rank": local.untyped_storage().nbytes(),
            "loss_saved_bytes": saved.by_module.get("<outside>", 0),
        }
    return result


def _activations(out: Path, seq: int, cp: int) -> dict:
    """One training forward of the tiny Qwen3-MoE at ``seq`` tokens, built as moe-train builds it under cp (in this
    process for cp=1): the bytes this rank saves for backward, and the estimate's."""
    from moe_memory.estimate import estimate_memory
    from moe_models.memory import local_parameters, model_shape, run_shape
    from moe_train.config import load_config
    from moe_train.setup import prepare

    overrides = {
        "run.dtype": "fp32",
        "run.device": "cpu",
        "run.output_dir": str(out / "unused"),
        "run.save_checkpoint": "false",
        "data.seq_len": str(seq),
        "data.cache_dir": str(out / "cache"),
        "train.global_batch_size": "1",
        "model.max_position_embeddings": str(seq),
        "parallel.cp": str(cp),
    }
    cfg = load_config("tiny-qwen3-moe", overrides)
    setup = prepare(cfg, cp)
    ids = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    (stage,) = setup.model  # no pipeline: the one stage holds the whole model
    saved = measured_step(stage, ids, 0.0, setup.parallel.positions(seq))
    run = run_shape(
        cfg.model, local_parameters(setup.model), micro_batch=1, seq_len=seq, activation_bytes=4, layout=setup.layout
    )
    estimate = estimate_memory(model_shape(cfg.model), run)
    return {"saved_bytes": saved.total, "estimated_bytes": estimate.activation_bytes}


def _rank(out: Path, parts: list[str], seq: int, vocab: int, logits_seq: int) -> None:
    """One of several ranks: the ``parts`` (``activations`` under cp = the world size, ``logits`` at tp=2)."""
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    result = {}
    if "activations" in parts:
        result["activations"] = _activations(out, seq, world)
    if "logits" in parts:
        result["logits"] = _logits(logits_seq, vocab)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _launch(world: int, tmp: Path, *args: str) -> list[dict]:
    tmp.mkdir(parents=True, exist_ok=True)
    return launch_ranks(__file__, world, tmp, *args, timeout=3600)


def _logits_summary(ranks: list[dict], seq: int, vocab: int) -> dict:
    one, two = ranks[0]["tp=1"], ranks[0]["tp=2"]
    result = {
        "seq_len": seq,
        "vocab_size": vocab,
        "per_rank": ranks,
        "logits_ratio": two["logits_bytes_per_rank"] / one["logits_bytes_per_rank"],
        "loss_saved_ratio": two["loss_saved_bytes"] / one["loss_saved_bytes"],
    }
    print(
        f"logits per rank, {seq} tokens x vocab {vocab}: tp=1 {one['logits_bytes_per_rank'] / 2**20:,.1f} MiB, "
        f"tp=2 {two['logits_bytes_per_rank'] / 2**20:,.1f} MiB ({result['logits_ratio']:.2f}x); loss saved "
        f"{one['loss_saved_bytes'] / 2**20:,.1f} -> {two['loss_saved_bytes'] / 2**20:,.1f} MiB",
        flush=True,
    )
    return result


def _train(world: int, seq: int, steps: int, tmp: Path, config: str = "tiny-qwen3-moe") -> dict:
    """``moe-train train`` of ``config`` on ``seq``-token sequences at cp=world: tokens/s per step."""
    out = tmp / f"{config}-cp{world}"
    args = [
        "train",
        "--config",
        config,
        "--data.seq_len",
        str(seq),
        "--model.max_position_embeddings",
        str(seq),
        "--data.cache_dir",
        str(tmp / "cache"),
        "--train.global_batch_size",
        "1",
        "--train.steps",
        str(steps),
        "--run.dtype",
        "fp32",
        "--run.save_checkpoint",
        "false",
        "--run.log_interval",
        "1",
        "--run.output_dir",
        str(out),
        "--parallel.cp",
        str(world),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1" if world > 1 else "2"}
    launcher = ["-m", "torch.distributed.run", "--nproc-per-node", str(world), "-m", "moe_train"]
    command = [sys.executable, *(launcher if world > 1 else ["-m", "moe_train"]), *args]
    subprocess.run(command, env=env, check=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records[1:]]  # the first step pays one-off costs
    return {
        "steps": len(records),
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s": rates,
        "losses": [r["loss"] for r in records],
    }


def _activations_summary(one: dict, many: list[dict], seq: int, cp: int, trained: dict) -> dict:
    result = {
        "seq_len": seq,
        "cp": cp,
        "activation_bytes": {"cp=1": one, f"cp={cp}": many},
        "activation_ratio_worst_rank": max(r["saved_bytes"] for r in many) / one["saved_bytes"],
        "training": trained,
    }
    print(
        f"{seq} tokens: activations per rank cp=1 {one['saved_bytes'] / 2**20:,.1f} MiB, cp={cp} "
        f"{max(r['saved_bytes'] for r in many) / 2**20:,.1f} MiB (worst rank, "
        f"{result['activation_ratio_worst_rank']:.3f}x)"
        + "".join(f"; tokens/s {k} {v['tokens_per_s_median']:,.0f}" for k, v in trained.items()),
        flush=True,
    )
    return result


def several_ranks() -> dict:
    """Logits per rank at tp=2, and activations per rank at cp=4 against one process with training rates."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        seq, cp, vocab, logits_seq = 32768, 4, 32768, 2048
        args = ("--parts", "logits", "--logits-seq", str(logits_seq), "--vocab", str(vocab))
        logits = [r["logits"] for r in _launch(2, tmp / "l", *args)]
        ranks = _launch(cp, tmp / "a", "--parts", "activations", "--seq", str(seq))
        trained = {f"cp={cp}": _train(cp, seq, 3, tmp), "cp=1": _train(1, seq, 3, tmp)}
        one = _activations(tmp / "one", seq, 1)
        return {
            "logits_per_rank": _logits_summary(logits, logits_seq, vocab),
            "long_context": _activations_summary(one, [r["activations"] for r in ranks], seq, cp, trained),
        }


def main() -> None:
    parser = cli("long_context", __doc__, "small sizes over the same code paths (nox benchmarks)", ranks=True)
    parser.add_argument("--parts", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--logits-seq", type=int, default=64, help=argparse.SUPPRESS)
    args = parse(parser)
    if args.rank_dir is not None:
        args.rank_dir.mkdir(parents=True, exist_ok=True)
        _rank(args.rank_dir, args.parts.split(","), args.seq, args.vocab, args.logits_seq)
        return
    torch.set_num_threads(2)
    started = time.perf_counter()
    quick = args.quick
    result = header(args, device="cpu", dtype="float32") | {
        "attention_memory": attention_memory((128,) if quick else (2048, 4096, 8192), 1 if quick else REPEATS),
        "gpt_oss_training": None if quick else train_gpt_oss(8192, 5),
    }
    if quick:  # one process only (as memory_estimate's quick mode): the estimate's path at 256 tokens
        with tempfile.TemporaryDirectory() as tmp:
            result["activations_one_process"] = _activations(Path(tmp), 256, 1)
    else:
        result.update(several_ranks())
    result["seconds"] = round(time.perf_counter() - started, 1)
    write(args.out, result)


if __name__ == "__main__":
    main()
