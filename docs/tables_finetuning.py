"""The tables of fine-tuning: how well conversations pack (docs/gen_tables.py writes them into the pages)."""

from __future__ import annotations

from table_format import captioned, load, num, source, table


@table("packing_efficiency")
def _packing_efficiency() -> str:
    data = load("packing_efficiency")
    body = [
        [
            f"{row['seq_len']:,}",
            f"{row['conversations']:,} ({row['longer_than_window']:,} longer, left out)",
            f"{100 * row['efficiency_packed']:.2f}% ({row['windows_packed']:,} windows)",
            f"{100 * row['efficiency_padded']:.2f}% ({row['windows_padded']:,} windows)",
            f"{num(row['pack_seconds_per_100k'], 2)} s",
        ]
        for row in data["rows"]
    ]
    inputs = data["inputs"]
    caption = (
        f"Share of the windows' tokens that are conversation tokens: {inputs['conversations']:,} conversations whose "
        f"lengths are {inputs['lengths']} (seed {inputs['seed']}), first-fit packing (`data.packing true`) against one "
        f"padded window each (`data.packing false`); the time is the packing plan's, per 100,000 conversations "
        f"({source('packing_efficiency')})."
    )
    header = ["window (data.seq_len)", "conversations", "packed", "padded", "time to plan"]
    return captioned(caption, header, body)


@table("recipe_memory")
def _recipe_memory() -> str:
    data = load("recipe_memory")
    body = []
    for row in data["rows"]:
        ours, full = row["recipe_gib"], row.get("full_gib")
        states = ours["gradients"] + ours["optimizer_states"] + ours["master_weights"]
        body.append(
            [
                f"`{row['recipe']}`",
                str(row["gpus"]),
                f"{ours['total']:.2f} GiB",
                f"{ours['parameters']:.2f} / {states:.2f} / {ours['activations']:.2f}",
                "-" if full is None else f"{full['total']:.2f} GiB ({row['lora_over_full']:.2f}x)",
            ]
        )
    caption = (
        f"Estimated memory of the rank that needs the most (`moe-train plan --memory`, 4,096-token sequences, one per "
        f"micro-batch), against {data['device_memory_gib']} GB GPUs; for the LoRA recipes the same run training every "
        f"parameter, on the same GPUs ({source('recipe_memory')})."
    )
    header = [
        "recipe",
        "GPUs",
        "per GPU",
        "parameters / gradients + optimizer states + master weights / activations (GiB)",
        "training every parameter instead (LoRA / full)",
    ]
    return captioned(caption, header, body)
