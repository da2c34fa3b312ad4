"""One training step (forward, LM loss, backward) of this project's model against transformers' implementation of the
same family, with the same weights and tokens, on this machine: every family transformers has (Qwen3-MoE,
DeepSeek-V3, GPT-OSS, Mixtral), at each family's tiny preset.

Ours is built from the preset, written as a HuggingFace checkpoint (``moe_models.hf.save_pretrained``) and loaded by
transformers with SDPA attention (eager where it has none: GPT-OSS) and its ``grouped_mm`` experts; both compute in
fp32, MTP off (transformers has none). Ours runs eager and with ``run.compile``'s regional compile (each decoder
layer, inductor). Each is timed head to head against transformers: two steps interleaved in one process, taking
turns at going first (``_harness.head_to_head``), after warm-up steps that also take compilation out of the timing;
the ratios are per repetition (transformers' time / ours), reported as median and range.

The achieved FLOP rate of our step (Megatron's convention, ``moe_models.flops``) is divided by the fp32 GEMM rate
measured in the same run (a square matmul the size of the model's widest GEMM and a 1024 one, whichever is faster).

Targets on this machine: >= 1.25x transformers' speed eager, >= 1.5x compiled, on every family; >= 80% of the GEMM
rate on the default preset (``tiny``, Qwen3-MoE).

    uv run python benchmarks/step_vs_transformers.py [--quick] [--reps 7] [--out ...]
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from _harness import cli, head_to_head, header, parse, ratio_spread, write  # benchmarks/_harness.py, beside this script

from moe_models import build_model, causal_lm_loss
from moe_models.flops import training_flops_per_token
from moe_models.hf import save_pretrained
from moe_train.compile import compile_decoder_layers

FAMILIES = {
    "qwen3_moe": "tiny",
    "deepseek_v3": "tiny-deepseek-v3",
    "gpt_oss": "tiny-gpt-oss",
    "mixtral": "tiny-mixtral",
}
TARGETS = {"eager": 1.25, "compiled": 1.5, "gemm_fraction": 0.8}


def preset_model_config(name: str):
    from moe_train.config import load_config

    return load_config(name, {}).model


def load_hf(path: Path) -> tuple[torch.nn.Module, str]:
    """transformers' model with SDPA attention where it has it (GPT-OSS has only eager, for its sinks)."""
    import transformers

    for attention in ("sdpa", "eager"):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    path, attn_implementation=attention, dtype=torch.float32, experts_implementation="grouped_mm"
                )
        except ValueError:
            continue
        return model.train(), attention
    raise RuntimeError(f"transformers loads {path} with neither sdpa nor eager attention")


def gemm_rate(sizes: tuple[int, ...], reps: int) -> float:
    """The best fp32 GEMM rate (FLOP/s) over square matmuls of these sizes, median of ``reps``."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        best = max(best, 2 * n**3 / statistics.median(times))
    return best


def measure_family(name: str, batch: int, reps: int, warmup: int, seq: int = 128) -> dict:
    """One family's preset: ours eager, ours compiled and transformers, interleaved (module docstring)."""
    config = dataclasses.replace(preset_model_config(name), mtp_num_layers=None)  # transformers has no MTP
    ours = build_model(config, seed=0).train()
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours, Path(tmp))
        hf, attention = load_hf(Path(tmp))
    compiled = build_model(config, seed=0).train()
    compiled.load_state_dict(ours.state_dict())
    compile_decoder_layers(compiled)
    ids = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    def ours_step(model: torch.nn.Module) -> float:
        loss = causal_lm_loss(model(inputs), labels, config.mtp_loss_scaling_factor).total
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    def hf_step() -> float:
        logits = hf(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss.backward()
        hf.zero_grad(set_to_none=True)
        return loss.item()

    losses = {"ours_eager": ours_step(ours), "ours_compiled": ours_step(compiled), "transformers": hf_step()}
    # two head-to-head pairs, each against transformers: a three-way rotation would change what each costs
    eager_s, hf_eager_s = head_to_head(lambda: ours_step(ours), hf_step, reps, warmup)
    compiled_s, hf_compiled_s = head_to_head(lambda: ours_step(compiled), hf_step, reps, warmup)
    flops = training_flops_per_token(config, seq) * batch * seq
    rate = gemm_rate((config.hidden_size, 1024), reps)
    return {
        "preset": name,
        "transformers_attention": attention,
        "batch": [batch, seq],
        "first_losses": losses,  # equal up to fp32 rounding
        "seconds": {
            "eager_pair": {"ours": eager_s, "transformers": hf_eager_s},
            "compiled_pair": {"ours": compiled_s, "transformers": hf_compiled_s},
        },
        "speedup_eager": ratio_spread(hf_eager_s, eager_s),
        "speedup_compiled": ratio_spread(hf_compiled_s, compiled_s),
        "flops_per_step": flops,
        "gemm_rate_flops": rate,
        "gemm_fraction_eager": flops / statistics.median(eager_s) / rate,
        "gemm_fraction_compiled": flops / statistics.median(compiled_s) / rate,
    }


def main() -> None:
    parser = cli("step_vs_transformers", __doc__, "one family, 2 repetitions, batch 2 (CI)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    args = parse(parser)
    families = {"qwen3_moe": FAMILIES["qwen3_moe"]} if args.quick else FAMILIES
    reps, warmup, batch = (2, 1, 2) if args.quick else (args.reps, args.warmup, args.batch)
    torch.manual_seed(0)
    report = header(
        args,
        what="forward + LM loss + backward of one batch; ratios = transformers' time / ours, per repetition",
        baseline="transformers (SDPA attention, grouped_mm experts), same weights and tokens, fp32",
        threads=torch.get_num_threads(),
    )
    report |= {"targets": TARGETS, "families": {}}
    for family, name in families.items():
        entry = measure_family(name, batch, reps, warmup)
        report["families"][family] = entry
        print(
            f"{family:12s} transformers/ours eager {entry['speedup_eager']['median']:.2f}x "
            f"({entry['speedup_eager']['min']:.2f}-{entry['speedup_eager']['max']:.2f}), compiled "
            f"{entry['speedup_compiled']['median']:.2f}x ({entry['speedup_compiled']['min']:.2f}-"
            f"{entry['speedup_compiled']['max']:.2f}); GEMM rate fraction eager {entry['gemm_fraction_eager']:.1%}, "
            f"compiled {entry['gemm_fraction_compiled']:.1%}; first losses {entry['first_losses']}",
            flush=True,
        )
    write(args.out, report)


if __name__ == "__main__":
    main()
