"""Memory per GPU of the fine-tuning recipes (moe_train/presets/finetune-*.yaml), as ``moe-train plan --memory``
estimates it for the rank that needs the most: each recipe as written, and for the LoRA recipes the same run training
every parameter instead (the baseline), on the same GPUs.

An estimate from shapes (moe_memory.estimate), not a measurement: no GPU ran these. It runs in seconds on a CPU.
"""

from __future__ import annotations

import dataclasses

from _harness import cli, header, parse, write

from moe_train.recipes import RECIPES, GiB, recipe_memory


def _gib(memory) -> dict[str, float]:
    return {key: round(value / GiB, 2) for key, value in dataclasses.asdict(memory).items()}


def main() -> None:
    args = parse(cli("recipe_memory", __doc__, "the same (it takes seconds)"))
    rows = []
    for name, gpus in RECIPES.items():
        ours = recipe_memory(name)
        row = {"recipe": name, "gpus": gpus, "recipe_gib": _gib(ours)}
        if "lora" in name:
            full = recipe_memory(name, full=True)
            row["full_gib"] = _gib(full)
            row["lora_over_full"] = round(ours.total / full.total, 4)
        rows.append(row)
        print(
            f"{name} on {gpus} GPU(s): {ours.total / GiB:.2f} GiB"
            + (f" (full: {full.total / GiB:.2f})" if "lora" in name else "")
        )
    report = header(
        args,
        what="estimated memory of the largest rank of each fine-tuning recipe (moe-train plan --memory)",
        baseline="the same run training every parameter (peft.method none), on the same GPUs",
        device_memory_gib=80,
        rows=rows,
    )
    write(args.out, report)


if __name__ == "__main__":
    main()
