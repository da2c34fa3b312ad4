"""QK-clip in training (moe_train.qk_clip): one step with planted large logits rescales exactly the q/k rows a hand
computation from plain-torch maxima says (GQA groups, two micro-batches), logs them, and gives the same weights under
tp=2 and cp=2 (two gloo ranks) as in one process, MLA under tp=2 too; and the settings it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from moe_parallel import load_balanced_positions
from moe_train.config import load_config
from moe_train.setup import prepare
from moe_train.trainer import train

HEADS, GROUPS, HEAD_DIM = 4, 2, 16
# (layer, query head) -> factor on its q rows: one head tp rank 0 computes, one of tp rank 1's; under cp=2 each
# head's largest logit is at a query of the cp rank NOT holding its rows (FSDP's half: heads 0-1 | 2-3), which only
# the all-reduce brings to the rank that scales them (checked below)
PLANTED = {(0, 0): 40.0, (1, 3): 60.0}
# MLA with q rows of HEAD_DIM per head (8 without rope, 8 with), so that the same rows are planted
MLA = {
    "model.multi_latent_attention": "true",
    "model.q_lora_rank": "16",
    "model.kv_lora_rank": "16",
    "model.qk_head_dim": "8",
    "model.qk_pos_emb_head_dim": "8",
    "model.v_head_dim": "8",
}
LAYOUTS = {"tp": {"parallel.tp": "2"}, "cp": {"parallel.cp": "2"}, "mla_tp": {**MLA, "parallel.tp": "2"}}
WORLD = 2


def _overrides(micro: dict[str, str]) -> dict[str, str]:
    return {
        **micro,
        "model.num_layers": "2",
        "model.num_attention_heads": str(HEADS),
        "model.num_query_groups": str(GROUPS),
        "model.kv_channels": str(HEAD_DIM),
        "model.qk_layernorm": "false",
        "train.steps": "1",
        "train.micro_batch_size": "2",  # two micro-batches: the maxima are a running max over them
        # AdamW's first step is about lr x sign(gradient): a larger eps keeps it from turning the layouts' different
        # reduction orders in near-zero gradients into differences of the weights
        "train.adam_eps": "1e-5",
        "run.log_interval": "1",
        "run.save_checkpoint": "false",
    }


def _plant(model: torch.nn.Module) -> None:
    """Scale the planted heads' q rows (whole-tensor arithmetic, then split again as the parameter is)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            for (layer, head), factor in PLANTED.items():
                if name.endswith(
                    (f"layers.{layer}.attention.q_proj.weight", f"layers.{layer}.attention.q_b_proj.weight")
                ):
                    full = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
                    full[head * HEAD_DIM : (head + 1) * HEAD_DIM] *= factor
                    if isinstance(param, DTensor):
                        full = distribute_tensor(full, param.device_mesh, param.placements)
                    param.copy_(full)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective under a parallel layout: every rank calls it)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _trained(overrides: dict[str, str], world: int = 1) -> tuple[dict[str, torch.Tensor], list[dict]]:
    setup = prepare(load_config("tiny", overrides), world)
    _plant(setup.model)
    train(setup)
    out = Path(overrides["run.output_dir"]) / "metrics.jsonl"
    return _weights(setup.model), [json.loads(line) for line in out.read_text().splitlines()]


def _hand_maxima(overrides: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[layers, heads]`` max of q.k / sqrt(d) over the causal pairs of step 0's global batch, in plain torch from
    the q and k each core attention is given (the planted model before its update); and the same over the queries of
    cp rank 1 of 2 alone."""
    setup = prepare(load_config("tiny", overrides), 1)
    _plant(setup.model)
    cfg = setup.cfg
    ids = setup.data.train.batch(0, cfg.train.global_batch_size, 0, cfg.train.global_batch_size).input_ids_BS
    (stage,) = setup.parallel.stages
    seen: list[torch.Tensor] = []
    cp_rank1 = load_balanced_positions(ids.shape[1], 2, 1)

    def keep(module, args):
        q, k = args[0].double(), args[1].double().repeat_interleave(HEADS // GROUPS, dim=1)
        logits = q @ k.transpose(-1, -2) * HEAD_DIM**-0.5
        causal = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
        per_query_NS = logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 3))
        seen.append(torch.stack([per_query_NS.amax(dim=1), per_query_NS[:, cp_rank1].amax(dim=1)]))

    hooks = [layer.attention.core_attention.register_forward_pre_hook(keep) for layer in stage.layers.values()]
    with torch.no_grad():
        stage(ids, input_ids_BS=ids)
    for hook in hooks:
        hook.remove()
    whole_LN, cp_rank1_LN = torch.stack(seen).unbind(1)
    return whole_LN, cp_rank1_LN


def _mla_threshold(overrides: dict[str, str]) -> float:
    """Half the smaller planted maximum of the MLA model (its own maxima: moe_models' tests hold them to plain torch),
    after checking that the planted heads are the only ones above it."""
    setup = prepare(load_config("tiny", overrides), 1)
    _plant(setup.model)
    cfg = setup.cfg
    ids = setup.data.train.batch(0, cfg.train.global_batch_size, 0, cfg.train.global_batch_size).input_ids_BS
    (stage,) = setup.parallel.stages
    with torch.no_grad():
        maxima_LN = stage(ids, input_ids_BS=ids, attention_logit_max=True)[-1]
    planted = torch.zeros_like(maxima_LN, dtype=torch.bool)
    planted[tuple(zip(*PLANTED, strict=True))] = True
    tau = 0.5 * float(maxima_LN[planted].min())
    assert float(maxima_LN[~planted].max()) < tau
    return tau


def _hand_clipped(weights: dict[str, torch.Tensor], maxima_LN: torch.Tensor, tau: float) -> dict[str, torch.Tensor]:
    """Kimi K2 / Megatron-Core's GQA rule by hand: a group's factor eta = min(1, tau / its heads' largest max); its
    query rows and its key rows each times sqrt(eta)."""
    out = dict(weights)
    for layer, maxima_N in enumerate(maxima_LN):
        for group in range(GROUPS):
            heads = range(group * HEADS // GROUPS, (group + 1) * HEADS // GROUPS)
            eta = min(1.0, tau / max(float(maxima_N[h]) for h in heads))
            for h in heads:
                name = next(n for n in out if n.endswith(f"layers.{layer}.attention.q_proj.weight"))
                out[name] = out[name].clone()
                out[name][h * HEAD_DIM : (h + 1) * HEAD_DIM] *= eta**0.5
            name = next(n for n in out if n.endswith(f"layers.{layer}.attention.k_proj.weight"))
            out[name] = out[name].clone()
            out[name][group * HEAD_DIM : (group + 1) * HEAD_DIM] *= eta**0.5
    return out


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        err = float((got[name].double() - tensor.double()).norm() / tensor.double().norm().clamp_min(1e-30))
        assert err < rel, (name, err)


def test_planted_logits_are_clipped_as_by_hand_in_one_process_and_under_tp_and_cp(
    launch_gloo_workers, micro_overrides: dict[str, str], tmp_path: Path
) -> None:
    base = _overrides(micro_overrides)
    maxima_LN, cp_rank1_LN = _hand_maxima(base)
    planted = torch.zeros_like(maxima_LN, dtype=torch.bool)
    for layer, head in PLANTED:
        planted[layer, head] = True
        seen_by_rank1 = bool(cp_rank1_LN[layer, head] == maxima_LN[layer, head])
        assert seen_by_rank1 == (head < HEADS // 2), "the cp check needs each maximum on the other rank (PLANTED)"
    assert float(maxima_LN[~planted].max()) < 0.5 * float(maxima_LN[planted].min())  # the planting took
    tau = 0.5 * float(maxima_LN[planted].min())
    clip = {"train.qk_clip": "true", "train.qk_clip_threshold": str(tau)}
    mla_tau = _mla_threshold({**base, **MLA})
    runs = {name: {**base, **clip, **layout} for name, layout in LAYOUTS.items()}
    runs["mla_tp"]["train.qk_clip_threshold"] = str(mla_tau)
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    results = launch_gloo_workers(Path(__file__), WORLD, tmp_path, timeout=400)

    plain, _ = _trained({**base, "run.output_dir": str(tmp_path / "plain")})
    clipped, records = _trained({**base, **clip, "run.output_dir": str(tmp_path / "clipped")})
    want = _hand_clipped(plain, maxima_LN, tau)
    moved = {n for n in want if not torch.equal(want[n], plain[n])}
    assert moved == {f"0.layers.{i}.attention.{p}_proj.weight" for i in (0, 1) for p in ("q", "k")}
    _assert_close(clipped, want, 1e-6)
    for name in want.keys() - moved:  # nothing else is touched: the same update bit for bit
        assert torch.equal(clipped[name], plain[name]), name
    (record,) = records
    assert record["qk_clipped_heads"] == len(PLANTED)
    assert record["max_attention_logit"] == pytest.approx(float(maxima_LN.max()), rel=1e-5)

    mla_run = {**base, **MLA, **clip, "train.qk_clip_threshold": str(mla_tau), "run.output_dir": str(tmp_path / "mla")}
    mla_clipped, mla_records = _trained(mla_run)
    assert mla_records[0]["qk_clipped_heads"] == len(PLANTED)
    one_process = {"tp": clipped, "cp": clipped, "mla_tp": mla_clipped}
    for layout, result in zip(LAYOUTS, results[0]["weights"], strict=True):  # rank 0's whole weights
        single = one_process[layout]
        # tp splits the routed experts' FFN width (etp) in plain tensors: rank 0's half, not QK-clip's business
        halves = {n for n in result if result[n].shape != single[n].shape}
        assert all(".mlp.experts." in n for n in halves) and ("tp" in layout or not halves), (layout, halves)
        _assert_close(
            {n: t for n, t in result.items() if n not in halves}, {n: single[n] for n in result.keys() - halves}, 1e-5
        )

    for layout in LAYOUTS:  # rank 0 (which writes the metrics) counts the heads of both tp ranks: global maxima
        assert results[0]["records"][layout][0]["qk_clipped_heads"] == len(PLANTED), layout


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"train.qk_clip_threshold": "0"}, "train.qk_clip_threshold=0.0: must be positive"),
        ({"train.qk_clip_alpha": "1.0"}, "train.qk_clip_alpha=1.0: must be in (0, 1)"),
        ({"model.qk_layernorm": "true"}, "model.qk_layernorm=True: train.qk_clip cannot bound the logits"),
        ({"model.clip_qkv": "4.0"}, "model.clip_qkv=4.0: train.qk_clip cannot bound the logits"),
        ({"parallel.pp": "2"}, "parallel.pp=2: train.qk_clip does not carry the logit maxima"),
        ({"peft.method": "lora"}, "peft.method='lora': train.qk_clip rescales the base q/k projections"),
    ],
)
def test_refusals_are_one_line_exit_2(micro_overrides: dict[str, str], refused_in_one_line, extra, expected) -> None:
    refused_in_one_line({**_overrides(micro_overrides), "train.qk_clip": "true", **extra}, expected)


def _worker(out: Path) -> None:
    runs = json.loads((out / "runs.json").read_text())
    torch.set_num_threads(1)
    weights, records = [], {}
    for name in LAYOUTS:
        run = {**runs[name], "run.output_dir": str(out / name)}
        setup = prepare(load_config("tiny", run), WORLD)
        _plant(setup.model)
        train(setup)
        weights.append(_weights(setup.model))
        if torch.distributed.get_rank() == 0:  # the rank that writes them
            records[name] = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rank = torch.distributed.get_rank()
    torch.save({"weights": weights, "records": records}, out / f"rank{rank}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import sys

    _worker(Path(sys.argv[1]))
