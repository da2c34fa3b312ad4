"""``moe-train plan`` at published sizes: per-rank shard sizes on the meta device over a fake process group, checked
against figures computed by hand from the architectures and against moe_models.count_parameters."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from moe_models import PUBLISHED_PRESETS, build_model, count_parameters
from moe_models.presets import preset
from moe_parallel import ParallelConfig
from moe_train import cli
from moe_train.muon import muon_parameters
from moe_train.plan_report import (
    NON_EXPERT,
    ROUTED_EXPERTS,
    MemoryOptions,
    PlanReport,
    RankKind,
    _strided_shard_length,
    format_memory,
    memory_estimates,
    plan_report,
    rank_ranges,
)

F32 = torch.float32


def kind_of(report: PlanReport, rank: int) -> RankKind:
    return next(kind for kind in report.kinds if rank in kind.ranks)


def rows_on(rank: int, rows: int, ranks: int) -> int:
    """Rows of a tensor FSDP2 (torch.chunk) gives ``rank`` out of ``ranks``: ceil-sized chunks, the last ones
    shorter or empty."""
    chunk = math.ceil(rows / ranks)
    return max(0, min(chunk, rows - rank * chunk))


def deepseek_v3_non_expert_on(rank: int, world: int) -> int:
    """DeepSeek-V3's non-expert parameters on ``rank`` when FSDP shards each along dim 0 over all ``world`` ranks:
    (rows, row length) of each tensor, from the published architecture (H 7168, MLA q/kv ranks 1536/512, 128 heads
    of 128 + 64 rotary dims, 3 dense layers of FFN 18432, 58 MoE layers with 256 experts and a 2048-wide shared
    expert, one MTP depth, vocab 129280)."""
    h, vocab = 7168, 129280
    attention = [(h, 1), (h, 1), (1536, h), (1536, 1), (128 * 192, 1536), (512 + 64, h), (512, 1)]
    attention += [(128 * 256, 512), (h, 128 * 128)]  # kv_b_proj (k_nope + v per head), o_proj
    dense_mlp = [(18432, h), (18432, h), (h, 18432)]
    moe_mlp = [(256, h), (h, 2 * 2048), (2048, h)]  # router, shared expert gate_up and down
    mtp_input = [(h, 1), (h, 1), (h, 2 * h), (h, 1)]  # enorm, hnorm, eh_proj, final_norm
    root = [(vocab, h), (h, 1), (vocab, h)]  # embedding, final norm, head

    def on_rank(tensors: list[tuple[int, int]]) -> int:
        return sum(rows_on(rank, rows, world) * row for rows, row in tensors)

    layers = 3 * on_rank(attention + dense_mlp) + (58 + 1) * on_rank(attention + moe_mlp)
    return layers + on_rank(mtp_input + root)


@pytest.fixture(scope="module")
def deepseek_v3_ep64() -> PlanReport:
    return plan_report(preset("deepseek-v3-671b"), ParallelConfig(ep=64), 1024)


def test_deepseek_v3_at_1024_ranks_ep64(deepseek_v3_ep64: PlanReport) -> None:
    report = deepseek_v3_ep64
    assert not dist.is_initialized()  # the fake world is gone
    assert (report.layout.dp, report.layout.ep, report.layout.edp) == (1024, 64, 16)
    # every rank: 4 experts (256 / ep 64) of 7168 x 4096 gate_up + 2048 x 7168 down, FSDP-split over edp 16, in each
    # of 58 MoE layers and the MTP depth's
    experts = 59 * 4 * (7168 * 4096 + 2048 * 7168) // 16
    assert experts == 649_592_832
    for rank in (0, 255, 256, 767, 768, 1016, 1017, 1018, 1023):
        kind = kind_of(report, rank)
        assert kind.params == {(NON_EXPERT, F32): deepseek_v3_non_expert_on(rank, 1024), (ROUTED_EXPERTS, F32): experts}
        assert kind.buffers == {F32: 59 * 256}  # each MoE router's expert bias, whole everywhere
    assert kind_of(report, 0).params[NON_EXPERT, F32] == 17_788_986
    assert kind_of(report, 1023).params[NON_EXPERT, F32] == 14_211_968  # past the embedding's and head's last rows
    assert sorted(r for kind in report.kinds for r in kind.ranks) == list(range(1024))
    counted = count_parameters(preset("deepseek-v3-671b"))
    assert sum(report.distinct_params.values()) == counted.total + counted.mtp == report.expected_params


def test_qwen3_30b_at_8_ranks_ep8_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model.preset", "qwen3-30b-a3b", "--world-size", "8", "--parallel.ep", "8"]
    assert cli.main([*args, "--parallel.tp", "2", "--parallel.etp", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "8 ranks, 128 experts per MoE layer (qwen3_moe)"
    assert len(out) == 2 + 8 + 4  # the rank map (a small world), then title, header, one rank kind, the check
    # H 2048, 32 query heads and 4 key/value heads of 128, 48 MoE layers; tp 2 splits the projections, embedding and
    # head, FSDP the rest over dp 4: all evenly, so every rank holds the same
    h, vocab = 2048, 151936
    projections = (32 * 128 * h + 2 * 4 * 128 * h + h * 32 * 128) // (2 * 4)  # q, k, v, o
    replicated_over_tp = (2 * h + 2 * 128 + 128 * h) // 4  # layer norms, q/k norms, router
    non_expert = 48 * (projections + replicated_over_tp) + 2 * vocab * h // (2 * 4) + h // 4
    experts = 48 * 128 // 8 * (h * 2 * 768 + 768 * h)  # 16 whole experts per rank (etp 1, edp 1)
    assert (non_expert, experts) == (194_235_904, 3_623_878_656)
    title, header, row = out[-4:-1]
    assert title.startswith("parameter shards per rank") and "dp=4 tp=2 | ep=8 etp=1 edp=1; 16 experts" in title
    assert header.split() == ["ranks", "count", "non-expert", "float32", "routed", "experts", "float32", "parameters"]
    assert row.split()[:2] == ["0-7", "8"]
    assert f"{non_expert:,} = 740.95 MiB" in row and f"{experts:,} = 13.50 GiB" in row
    assert f"{non_expert + experts:,} = 14.22 GiB" in row
    counted = count_parameters(preset("qwen3-30b-a3b"))
    assert out[-1].startswith(f"over all ranks, each replicated copy once: {counted.total + counted.mtp:,} parameters")
    assert "; matches moe_models.count_parameters" in out[-1]


# every other published preset, in a layout that shards unevenly somewhere and uses tp where the model allows it
OTHER_PRESET_LAYOUTS = {
    "kimi-k2": (256, ParallelConfig(ep=32, tp=8, etp=1)),
    "qwen3-235b-a22b": (512, ParallelConfig(ep=32, tp=4)),
    "gpt-oss-20b": (96, ParallelConfig(ep=16)),  # attention sinks: no tp yet
    "gpt-oss-120b": (64, ParallelConfig(ep=64)),
    "mixtral-8x7b": (64, ParallelConfig(ep=8, tp=8)),  # etp = tp = 8: experts as plain per-rank tensors
    "glm-4.5-355b-a32b": (128, ParallelConfig(ep=32, tp=4)),
    "glm-4.5-air": (64, ParallelConfig(ep=16, tp=2)),
    "glm-4.6": (256, ParallelConfig(ep=32, tp=8, etp=1)),
    "glm-4.7": (96, ParallelConfig(ep=32, tp=2, etp=1)),
    "glm-4.7-flash": (16, ParallelConfig(ep=8, tp=2, etp=1)),
    "dots.llm1": (128, ParallelConfig(ep=32, tp=4)),
    "minimax-m2": (64, ParallelConfig(ep=32, tp=2, etp=1)),  # q/k norms across heads split with the heads
    "qwen1.5-moe-a2.7b": (8, ParallelConfig(ep=4, tp=2)),
    "qwen2-57b-a14b": (32, ParallelConfig(ep=8, tp=4)),
    "olmoe-1b-7b": (16, ParallelConfig(ep=8, tp=2, etp=1)),
    "deepseek-v2": (128, ParallelConfig(ep=16, tp=8)),
    "deepseek-v2-lite": (16, ParallelConfig(ep=16)),
    "ernie-4.5-21b-a3b": (16, ParallelConfig(ep=8, tp=2, etp=1)),
    "ernie-4.5-300b-a47b": (64, ParallelConfig(ep=16, tp=4, etp=1)),
    "hunyuan-a13b": (32, ParallelConfig(ep=16, tp=2, etp=1)),
    "llama-4-scout-17b-16e": (32, ParallelConfig(ep=16, tp=2, etp=1)),
    "llama-4-maverick-17b-128e": (64, ParallelConfig(ep=32, tp=2, etp=1)),
    # Gated DeltaNet layers split their 16 key heads over tp (2 query groups: tp <= 2)
    "qwen3-next-80b-a3b": (64, ParallelConfig(ep=32, tp=2, etp=1)),
    # Qwen3.5 MoE likewise: 16 key heads over tp, 2 query groups (tp <= 2)
    "qwen3.5-35b-a3b": (64, ParallelConfig(ep=32, tp=2, etp=1)),
    "qwen3.5-122b-a10b": (128, ParallelConfig(ep=64, tp=2, etp=1)),
    "qwen3.5-397b-a17b": (256, ParallelConfig(ep=128, tp=2, etp=1)),
    # the lightning indexers stay whole on every tp rank (DeepSeek-V3's heads split as V3's)
    "deepseek-v3.2": (256, ParallelConfig(ep=32, tp=8, etp=1)),
    # GLM-5 likewise: 64 MLA heads over tp=8, the indexers whole on every tp rank
    "glm-5": (256, ParallelConfig(ep=32, tp=8, etp=1)),
    # Nemotron-H: attention heads and dense MLP widths split over tp, the Mamba-2 mixers whole on every tp rank
    "nemotron-h-8b": (8, ParallelConfig(tp=8)),
    "nemotron-h-47b": (16, ParallelConfig(tp=8)),
    "nemotron-h-56b": (16, ParallelConfig(tp=8)),
    "nemotron-3-nano-30b-a3b": (16, ParallelConfig(ep=8, tp=2, etp=1)),  # 2 query groups: tp <= 2
    # Kimi Linear: 32 MLA heads over tp=4, the KDA layers whole on every tp rank
    "kimi-linear-48b-a3b": (64, ParallelConfig(ep=16, tp=4, etp=1)),
}


def test_every_published_preset_is_covered() -> None:
    covered = {"deepseek-v3-671b", "qwen3-30b-a3b", *OTHER_PRESET_LAYOUTS}
    assert covered == set(PUBLISHED_PRESETS)


@pytest.mark.parametrize("name", sorted(OTHER_PRESET_LAYOUTS))
def test_shards_summed_over_ranks_give_the_parameter_count(name: str) -> None:
    world, parallel = OTHER_PRESET_LAYOUTS[name]
    report = plan_report(preset(name), parallel, world)
    counted = count_parameters(preset(name))
    assert sum(report.distinct_params.values()) == counted.total + counted.mtp
    assert sorted(r for kind in report.kinds for r in kind.ranks) == list(range(world))
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # the layout itself: 48 does not divide 1024
            ["--world-size", "1024", "--parallel.ep", "48"],
            "moe-train: error: parallel.ep=48: etp(1) x ep(48) x pp(1) = 48 does not divide world_size 1024",
        ),
        (  # the layout against the model: 256 experts over 3 ranks
            ["--world-size", "96", "--parallel.ep", "3"],
            "moe-train: error: parallel.ep=3: the model's 256 experts per MoE layer do not divide over it",
        ),
        (  # recompute / offload settings against the model's module kinds
            ["--world-size", "64", "--parallel.ep", "64", "--run.offload_modules", "core_attn,mlp_norms"],
            "moe-train: error: run.offload_modules=['core_attn', 'mlp_norms']: 'mlp_norms' is neither a module kind",
        ),
    ],
)
def test_layouts_that_do_not_fit_are_one_line_errors(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["plan", "--model.preset", "deepseek-v3-671b", *overrides]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(message) and captured.err.count("\n") == 1
    assert not dist.is_initialized()


def test_a_refused_ep_suggests_only_eps_that_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """tiny (8 experts per MoE layer) over 3 ranks: the world size alone allows ep 1 or 3, the experts 1, 2, 4 or 8;
    the suggestion holds for both, so each value it lists plans, and each other divisor of the world size does not."""
    plan = ["plan", "--world-size", "3", "--parallel.ep"]
    assert cli.main([*plan, "2"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("moe-train: error: parallel.ep=2: etp(1) x ep(2) x pp(1) = 2 does not divide world_size 3; ")
    assert err.count("\n") == 1
    listed = re.search(r"ep can be one of \[([\d, ]*)\]$", err.strip())
    assert listed is not None, err
    suggested = [int(v) for v in listed.group(1).split(", ") if v]
    assert suggested
    for ep in suggested:
        assert cli.main([*plan, str(ep)]) == 0, capsys.readouterr().err
    for ep in {1, 3} - set(suggested):
        assert cli.main([*plan, str(ep)]) == cli.EXIT_USAGE
    capsys.readouterr()
    assert not dist.is_initialized()


def test_rank_ranges_are_compact() -> None:
    assert rank_ranges((0, 1, 2, 5, 7, 8)) == "0-2, 5, 7-8"
    assert rank_ranges(tuple(range(0, 20, 2)), most=3) == "0, 2, 4, ... (7 more runs)"


def test_strided_shard_sizes_agree_with_torchs_helper() -> None:
    for length, mesh_size, split_factor in itertools.product(range(41), range(1, 7), range(1, 5)):
        placement = _StridedShard(0, split_factor=split_factor)
        for coordinate in range(mesh_size):
            (torch_rows,), _ = _compute_local_shape_and_global_offset(
                (length,), (mesh_size,), [coordinate], [placement], skip_offset=True
            )
            assert _strided_shard_length(length, mesh_size, coordinate, split_factor) == torch_rows


# --- the memory estimate per rank kind ----------------------------------------------------------------------------


def test_memory_estimate_holds_each_rank_kinds_exact_shards(deepseek_v3_ep64: PlanReport) -> None:
    report = deepseek_v3_ep64
    options = MemoryOptions(micro_batch=1, seq_len=4096, master_weights_bytes=0)
    estimates = memory_estimates(report, preset("deepseek-v3-671b"), options)
    assert [kind for kind, _ in estimates] == report.kinds
    tensors = report.param_tensors
    with torch.device("meta"):
        assert tensors == len(list(build_model(preset("deepseek-v3-671b")).parameters()))
    for kind, estimate in estimates:
        assert estimate.parameters == kind.param_bytes() == 4 * kind.param_count()
        assert estimate.gradients == kind.param_bytes()
        # AdamW: exp_avg and exp_avg_sq in fp32 and a 4-byte step per parameter tensor; fp32 parameters, no master
        assert estimate.optimizer_states == 8 * kind.param_count() + 4 * tensors
        assert estimate.master_weights == 0
        assert estimate.buffers == 59 * 256 * 4  # the routers' fp32 expert bias
        # the same tokens on every rank: activations do not depend on the shard
        assert estimate.activation_bytes == estimates[0][1].activation_bytes > 0
    table = format_memory(estimates, options, device_memory_gib=80)
    assert "activations: core_attn" in table and "activations: expert_fc1" in table
    assert table.count("exceeds --device-memory 80 GiB by") == len(report.kinds)


def test_muon_states_are_one_momentum_buffer_per_matrix(deepseek_v3_ep64: PlanReport) -> None:
    report = deepseek_v3_ep64
    with torch.device("meta"):
        model = build_model(preset("deepseek-v3-671b"))
    takes_muon = muon_parameters(model)
    muon_numel = sum(p.numel() for p in model.parameters() if id(p) in takes_muon)
    assert report.muon_tensors == len(takes_muon)
    # each element of the 1024 ranks' shards is held once (FSDP over dp and edp, experts over ep): they add up
    assert sum(kind.muon * len(kind.ranks) for kind in report.kinds) == muon_numel
    options = MemoryOptions(micro_batch=1, seq_len=4096, master_weights_bytes=0, optimizer="muon")
    muon_estimates = memory_estimates(report, preset("deepseek-v3-671b"), options)
    adamw = memory_estimates(report, preset("deepseek-v3-671b"), dataclasses.replace(options, optimizer="adamw"))
    for (kind, estimate), (_, with_adamw) in zip(muon_estimates, adamw, strict=True):
        muon, rest = kind.muon, kind.param_count() - kind.muon
        # Muon: a momentum buffer (fp32) per matrix; AdamW: two moments and a 4-byte step per tensor
        assert estimate.optimizer_states == 4 * muon + 8 * rest + 4 * (report.param_tensors - report.muon_tensors)
        assert with_adamw.optimizer_states - estimate.optimizer_states == 4 * muon + 4 * report.muon_tensors
        assert muon > 0.9 * kind.param_count()  # the matrices are most of DeepSeek-V3


QWEN_8 = ["plan", "--model.preset", "qwen3-30b-a3b", "--world-size", "8", "--parallel.ep", "8"]


def _memory_rows(out: list[str]) -> dict[str, str]:
    start = next(i for i, line in enumerate(out) if line.startswith("memory per rank"))
    rows = {}
    for line in out[start + 2 :]:
        label, _, value = line.rpartition("  ")
        if value.endswith("GiB"):
            rows[label.strip()] = value.strip()
    return rows


def test_plan_prints_the_memory_table_with_the_reports_shard_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*QWEN_8, "--data.seq_len", "4096", "--train.micro_batch_size", "1"]
    assert cli.main([*args, "--memory"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "micro-batch 1 x 4096 tokens, activations bf16" in next(line for line in out if "memory per rank" in line)
    rows = _memory_rows(out)
    shard_row = next(line for line in out if line.startswith("0-7 "))
    assert shard_row.endswith("3,816,515,328 = 14.22 GiB")  # the parameters column of the shard table
    assert rows["parameters"] == rows["gradients"] == "14.22 GiB"
    assert rows["optimizer states"] == "28.44 GiB"
    assert not any("exceeds" in line for line in out)  # no --device-memory, no verdict
    total = float(rows["total"].split()[0])
    assert total > 14.22 * 4  # states plus activations


@pytest.mark.parametrize(("gib", "verdict"), [(1, "exceeds --device-memory 1 GiB by"), (1000, "every rank fits")])
def test_device_memory_flags_the_ranks_that_do_not_fit(
    gib: int, verdict: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([*QWEN_8, "--device-memory", str(gib)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = _memory_rows(out)
    assert "total" in rows
    flagged = [line for line in out if verdict in line]
    assert len(flagged) == 1
    if gib == 1:
        total = float(rows["total"].split()[0])
        assert flagged[0] == f"ranks 0-7 (8): {total:.2f} GiB exceeds --device-memory 1 GiB by {total - 1:.2f} GiB"


def test_device_memory_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([*QWEN_8, "--device-memory", "0"]) == cli.EXIT_USAGE
    assert "--device-memory=0" in capsys.readouterr().err


@pytest.mark.parametrize("world_size", ["-1", "0"])
def test_world_size_must_be_positive(capsys: pytest.CaptureFixture[str], world_size: str) -> None:
    """``--world-size -1`` used to plan one rank."""
    assert cli.main(["plan", "--world-size", world_size]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--world-size {world_size}: must be a positive number of ranks" in err


def test_bf16_parameters_halve_the_shards_and_add_master_weights(capsys: pytest.CaptureFixture[str]) -> None:
    from moe_train.config import TrainConfig

    if not hasattr(TrainConfig, "params_dtype"):
        pytest.skip("train.params_dtype is not in this version")
    assert cli.main([*QWEN_8, "--memory", "--train.params_dtype", "bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    shard_row = next(line for line in out if line.startswith("0-7 "))
    assert shard_row.endswith("3,816,515,328 = 7.11 GiB")
    rows = _memory_rows(out)
    assert rows["parameters"] == rows["gradients"] == "7.11 GiB"
    assert rows["master weights"] == "14.22 GiB"  # fp32 copies of the bf16 parameters


def test_pipeline_ranks_hold_their_stages_and_their_micro_batches_in_flight() -> None:
    """Qwen3-30B-A3B over pp=4 x ep=8 (32 ranks): each pipeline rank's routed experts are its stages' layers' share
    by hand (16 of 128 experts of 3 x 2048 x 768 per layer), the shards still sum to the parameter count, and 1F1B
    with 8 micro-batches keeps 4 - rank of them in flight, which the activation estimate counts."""
    from moe_train.plan_report import with_microbatches

    config = preset("qwen3-30b-a3b")
    report = with_microbatches(plan_report(config, ParallelConfig(pp=4, ep=8), 32), "1F1B", 8)
    counted = count_parameters(config)
    assert sum(report.distinct_params.values()) == counted.total + counted.mtp
    assert [i for row in report.stages for i in row["layers"]] == list(range(48))
    assert report.stages[0]["modules"] == ["embed_tokens"] and report.stages[-1]["modules"] == ["norm", "lm_head"]
    assert report.inflight == [4, 3, 2, 1]
    per_layer = 16 * 3 * 2048 * 768
    for row in report.stages:
        kind = kind_of(report, 8 * row["pp_rank"])
        assert kind.pp_rank == row["pp_rank"] and len(kind.ranks) == 8
        assert kind.params[(ROUTED_EXPERTS, F32)] == len(row["layers"]) * per_layer
    options = MemoryOptions(micro_batch=1, seq_len=4096)
    estimates = {kind.pp_rank: estimate for kind, estimate in memory_estimates(report, config, options)}
    norms = {r: e.activations_by_module()["attn_norm"] for r, e in estimates.items()}
    layers = {row["pp_rank"]: len(row["layers"]) for row in report.stages}
    for r in range(4):  # one attention norm input per layer and micro-batch in flight
        assert norms[r] * layers[3] * 1 == norms[3] * layers[r] * (4 - r)
    assert estimates[0].logits == 0 and estimates[3].logits > 0
    assert (
        estimates[1].activations_by_module().get("embedding", 0)
        == 0
        < estimates[0].activations_by_module()["embedding"]
    )


def test_context_parallel_ranks_shard_with_the_data_parallel_ones_and_hold_their_share_of_the_tokens() -> None:
    """Qwen3-30B-A3B at 32k tokens over cp=4 x ep=8 (32 ranks): FSDP shards the dense parameters over the 32
    dp_shard x cp ranks, as over 32 data-parallel ranks; the shards sum to the parameter count; a rank keeps a
    quarter of the token-wise activations, and its attention the keys and values of the whole sequence."""
    config = preset("qwen3-30b-a3b", max_position_embeddings=32768)
    with_cp = plan_report(config, ParallelConfig(cp=4, ep=8), 32)
    without = plan_report(config, ParallelConfig(ep=8), 32)
    counted = count_parameters(config)
    assert sum(with_cp.distinct_params.values()) == counted.total + counted.mtp
    assert [k.params for k in with_cp.kinds] == [k.params for k in without.kinds]
    options = MemoryOptions(micro_batch=1, seq_len=32768)
    (_, cp4), (_, cp1) = memory_estimates(with_cp, config, options)[0], memory_estimates(without, config, options)[0]
    a, b = cp4.activations_by_module(), cp1.activations_by_module()
    assert a["attn_norm"] * 4 == b["attn_norm"] and a["lm_head"] * 4 == b["lm_head"] and cp4.logits * 4 == cp1.logits
    # q, the output and the log-sum-exp are the rank's quarter; k and v (4 of 32 heads of 128) the whole sequence's
    kv_whole = 48 * 2 * 32768 * 4 * 128 * 2  # 48 layers, k and v, bf16
    assert (a["core_attn"] - kv_whole) * 4 == b["core_attn"] - kv_whole > 0


def test_a_memory_plan_the_estimate_cannot_describe_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-Next's linear-attention layers are estimated at cp=1 (moe-models' test_saved_bytes.py checks them module
    by module); under context parallelism their chained chunk states are not: ``plan --memory`` says so in one line
    naming the key, before any planning; ``plan`` alone still prints the shards."""
    assert cli.main(["plan", "--model.preset", "tiny-qwen3-next", "--memory"]) == 0
    assert "activations" in capsys.readouterr().out
    assert cli.main(["plan", "--model.preset", "tiny-qwen3-next", "--parallel.cp", "2", "--memory"]) == cli.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("moe-train: error: parallel.cp=2: the memory estimate does not model recurrent ")
    assert captured.err.count("\n") == 1
    assert cli.main(["plan", "--model.preset", "tiny-qwen3-next", "--parallel.cp", "2"]) == 0
