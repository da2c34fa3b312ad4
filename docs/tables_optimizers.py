"""The optimizer tables of docs/running.md: Muon against AdamW, in convergence and in the cost of a step
(benchmarks/muon_convergence.py, benchmarks/muon_step.py)."""

from __future__ import annotations

from table_format import MiB, captioned, load, num, ratio, source, table

OPTIMIZERS = {"adamw": "AdamW", "muon": "Muon"}


def _mean_range(stats: dict) -> str:
    return f"{stats['mean']:.3f} ({stats['min']:.3f} to {stats['max']:.3f})"


@table("muon_convergence")
def _muon_convergence() -> str:
    data = load("muon_convergence")
    inputs, summary = data["inputs"], data["summary"]
    tuning = inputs["tuning"]
    body = []
    for name, label in OPTIMIZERS.items():
        stats = summary[name]
        keys = ("val_loss", "final_loss_mean_last_10", "final_loss_last_step")
        body.append([label, f"{data['tuned_lr'][name]:g}", *(_mean_range(stats[k]) for k in keys)])
    ratios = summary["muon_over_adamw"]
    keys = ("val_loss", "final_loss_mean_last_10", "final_loss_last_step")
    body.append(["Muon / AdamW, per seed", "", *(_mean_range(ratios[k]) for k in keys)])
    steps = summary["muon_steps_to_adamw_final_loss"]
    caption = (
        f"The `{inputs['preset']}` preset for {inputs['steps']} steps, seeds {', '.join(map(str, inputs['seeds']))} "
        f"(each seed the same initial weights and batches for both), each optimizer at the `train.lr` of "
        f"{', '.join(f'{lr:g}' for lr in tuning['lrs'])} with the lowest held-out loss after {tuning['steps']} steps; "
        f"mean (min to max) over the seeds. Muon reaches AdamW's final loss (mean of the last 10 steps) at step "
        f"{steps['mean']:.0f} on average ({steps['min']} to {steps['max']}) of {steps['adamw_steps']} "
        f"({source('muon_convergence')})."
    )
    header = ["optimizer", "lr", "held-out loss", "loss, mean of the last 10 steps", "loss, last step"]
    return captioned(caption, header, body, ["---", "---:", "---:", "---:", "---:"])


@table("muon_step")
def _muon_step() -> str:
    data = load("muon_step")
    inputs, shares = data["inputs"], data["share"]
    body = []
    for name, label in OPTIMIZERS.items():
        step = data["step_s"][name]
        total = sum(data["state_bytes"][name].values())
        body.append(
            [
                label,
                f"{step['median'] * 1e3:.1f} ({step['min'] * 1e3:.1f} to {step['max'] * 1e3:.1f})",
                f"{shares[name]['share'] * 100:.1f}%",
                f"{shares[name]['share_of_preset_step'] * 100:.1f}%",
                num(total / MiB),
            ]
        )
    spread = data["muon_vs_adamw"]
    micro = inputs["micro_batch"]
    caption = (
        f"One optimizer step of the `{inputs['preset']}` preset's model ({inputs['params']:,} parameters, Muon's "
        f"{inputs['muon_params']:,}), the same gradients, {inputs['reps']} interleaved pairs, Newton-Schulz "
        f"{inputs['ns_dtype']}: Muon / AdamW {ratio(spread['median'], 2)} ({ratio(spread['min'], 2)} to "
        f"{ratio(spread['max'], 2)}); shares against a forward + backward of {micro[0]} x {micro[1]} tokens, alone "
        f"and {inputs['micro_batches_per_step']} of them (the preset's step); state bytes Muon / AdamW "
        f"{ratio(data['state_bytes_muon_vs_adamw'], 2)} ({source('muon_step')})."
    )
    header = ["optimizer", "step, ms", "share of a one-micro-batch step", "share of the preset's step", "state, MiB"]
    return captioned(caption, header, body, ["---", "---:", "---:", "---:", "---:"])
