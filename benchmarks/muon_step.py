"""Muon's optimizer step against AdamW's: its time, its share of a training step, and its state bytes.

Setting (default): the ``tiny`` preset's model (4 layers, 8 routed experts, hidden 128) and a micro-batch of 4 x 128
tokens, fp32 on CPU, one process. Both optimizers are moe-train's own (``moe_train.optim.build_optimizer`` with
``train.optimizer`` adamw and muon), each over its own copy of the model holding the same gradients:

- ``muon_vs_adamw``: the two ``optimizer.step()`` calls head to head (interleaved, taking turns at going first); the
  per-repetition ratio Muon / AdamW, median and range;
- ``share``: each step against the model's forward + backward on the micro-batch, head to head: the optimizer's share
  of a one-micro-batch training step, median(step) / (median(forward + backward) + median(step)), and of the
  preset's own step (its global batch of 16 sequences: 4 micro-batches, each a forward + backward, then one update);
- ``state_bytes``: what each optimizer holds (``moe_train.adamw.optimizer_state_bytes``) after a step.

Newton-Schulz runs in fp32 on CPU (``train.muon_ns_dtype auto``); on a GPU it runs in bf16 and the ratios differ.

    uv run python benchmarks/muon_step.py [--quick] [--out benchmarks/results/muon_step.json]

``--quick`` (CI, seconds): the micro model, 3 repetitions; it writes only where ``--out`` says.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from _harness import cli, head_to_head, header, parse, ratio_spread, spread, write

from moe_models import build_model
from moe_train.adamw import optimizer_state_bytes
from moe_train.config import load_config
from moe_train.optim import build_optimizer

MICRO = {"model.hidden_size": "32", "model.num_layers": "1", "model.num_moe_experts": "4"}
MICRO |= {"model.moe_ffn_hidden_size": "32", "model.kv_channels": "16", "data.seq_len": "32"}


def main() -> None:
    args = parse(cli("muon_step", __doc__, "micro model, 3 repetitions (CI, seconds)"))
    torch.manual_seed(0)
    reps, warmup, batch = (3, 1, 2) if args.quick else (15, 2, 4)
    overrides = {**(MICRO if args.quick else {}), "run.device": "cpu", "run.dtype": "fp32"}
    configs = {name: load_config("tiny", {**overrides, "train.optimizer": name}) for name in ("adamw", "muon")}
    cfg = configs["adamw"]
    accumulation = cfg.train.global_batch_size // batch  # micro-batches in one of the preset's steps
    base = build_model(cfg.model, seed=0)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len))

    def forward_backward(model: torch.nn.Module) -> None:
        logits = model(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()

    models = {name: copy.deepcopy(base) for name in configs}
    optimizers = {}
    for name, model in models.items():
        forward_backward(model)  # the same gradients in both copies
        optimizers[name] = build_optimizer(model, configs[name].train)
        for group in optimizers[name].param_groups:
            group["lr"] = 0.0  # the timed steps leave the weights (and so nothing the other side sees) unchanged
    steps = {name: opt.step for name, opt in optimizers.items()}
    adamw_s, muon_s = head_to_head(steps["adamw"], steps["muon"], reps, warmup)
    probe = copy.deepcopy(base)
    shares = {}
    for name in configs:
        step_s, pass_s = head_to_head(steps[name], lambda: forward_backward(probe), reps, warmup)
        step, whole = spread(step_s)["median"], spread(pass_s)["median"]
        shares[name] = {"step_s": spread(step_s), "forward_backward_s": spread(pass_s), "share": step / (whole + step)}
        shares[name]["share_of_preset_step"] = step / (accumulation * whole + step)
    state_bytes = {name: optimizer_state_bytes(opt) for name, opt in optimizers.items()}
    totals = {name: sum(b.values()) for name, b in state_bytes.items()}
    muon_params = sum(p.numel() for g in optimizers["muon"].param_groups if g["rule"] == "muon" for p in g["params"])
    report = header(
        args,
        what="Muon's optimizer step against AdamW's (moe-train's own), same model and gradients, one process",
        baseline="AdamW's step (train.optimizer adamw); a forward + backward of one micro-batch for the shares",
        inputs={
            "preset": "tiny",
            "overrides": overrides,
            "micro_batch": [batch, cfg.data.seq_len],
            "micro_batches_per_step": accumulation,
            "reps": reps,
            "params": sum(p.numel() for p in base.parameters()),
            "muon_params": muon_params,
            "ns_dtype": "fp32 (CPU)",
        },
        cpu_threads=torch.get_num_threads(),
        muon_vs_adamw=ratio_spread(muon_s, adamw_s),
        step_s={"adamw": spread(adamw_s), "muon": spread(muon_s)},
        share=shares,
        state_bytes=state_bytes,
        state_bytes_muon_vs_adamw=totals["muon"] / totals["adamw"],
    )
    print(
        f"Muon step / AdamW step {report['muon_vs_adamw']['median']:.2f}x "
        f"(range {report['muon_vs_adamw']['min']:.2f}-{report['muon_vs_adamw']['max']:.2f}); share of a "
        f"one-micro-batch step: AdamW {shares['adamw']['share']:.1%}, Muon {shares['muon']['share']:.1%}; of the "
        f"preset's step: AdamW {shares['adamw']['share_of_preset_step']:.1%}, "
        f"Muon {shares['muon']['share_of_preset_step']:.1%}; "
        f"state bytes Muon / AdamW {report['state_bytes_muon_vs_adamw']:.2f}"
    )
    write(args.out, report)


if __name__ == "__main__":
    main()
