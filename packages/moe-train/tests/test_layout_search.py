"""``moe-train plan --search``: hardware profiles, the collective times by hand, the search's memory against
``plan --memory``'s exact shards and estimate, the published NeMo AutoModel layouts (they fit the H100 profile and the
time model lands near their published throughput at the one fitted efficiency), and the command line."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from moe_models.presets import preset
from moe_parallel import ParallelConfig
from moe_parallel.schedules import rank_stages
from moe_train import cli
from moe_train.config import ConfigError
from moe_train.hardware import builtin_hardware, load_hardware
from moe_train.layout_search import DEFAULT_EFFICIENCY, LayoutSearch, SearchSettings
from moe_train.plan_report import ROUTED_EXPERTS, memory_estimates, memory_options, plan_report, with_microbatches
from moe_train.plan_search import why
from moe_train.published_runs import PUBLISHED_RUNS, SEQ_LEN
from moe_train.step_time import LayoutSizes, ModelComm, _dispatch_time, _group_time

H100 = "h100-80gb"


def test_builtin_profiles_load_and_a_users_file_too(tmp_path) -> None:
    assert builtin_hardware() == ["b200-192gb", "gb200-186gb", "h100-80gb", "h200-141gb"]
    for name in builtin_hardware():
        hw = load_hardware(name)
        assert hw.usable_bytes > 0 and hw.nvlink_gbps > hw.internode_gbps
    own = tmp_path / "mine.yaml"
    own.write_text((tmp_path / "x").parent.joinpath("x").as_posix() and "")
    text = "\n".join(f"{k}: {v}" for k, v in vars(load_hardware(H100)).items() if k != "name")
    own.write_text(text.replace("memory_gib: 79.1", "memory_gib: 40"))
    assert load_hardware(str(own)).memory_gib == 40 and load_hardware(str(own)).name == "mine"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bf16_tflops: 1", "missing fields fp8_tflops"),
        ("{}: [", "not valid YAML"),
        ("- 1", "expected a mapping"),
    ],
)
def test_a_bad_profile_is_one_line_naming_it(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_hardware(str(path))
    assert "\n" not in str(caught.value) and str(caught.value).startswith(f"--hardware {path}")


def test_a_bad_profile_field_is_named(tmp_path) -> None:
    text = "\n".join(f"{k}: {v}" for k, v in vars(load_hardware(H100)).items() if k != "name")
    for old, new, message in [
        ("nvlink_gbps: 360", "nvlink_gbps: -1", "nvlink_gbps=-1 must be a number >= 0"),
        ("hbm_gbps: 3350", "hbm_gbps: 0", "hbm_gbps=0 must be > 0"),
        ("reserved_gib: 6", "reserved_gib: 90", "reserved_gib=90 leaves no memory"),
        ("hbm_gbps: 3350", "hbm_gbps: 3350\nextra: 1", "unknown fields extra"),
    ]:
        path = tmp_path / "p.yaml"
        path.write_text(text.replace(old, new))
        with pytest.raises(ConfigError, match=message):
            load_hardware(str(path))
    with pytest.raises(ConfigError, match="neither a built-in profile"):
        load_hardware(str(tmp_path / "missing.yaml"))


def test_collective_times_by_hand() -> None:
    hw = load_hardware(H100)  # 8 GPUs an NVLink domain at 360 GB/s, 40 GB/s between nodes, 20 us a collective
    latency = 20e-6
    volume = 8e9
    # 8 ranks side by side: each sends 7/8 of the volume over NVLink
    assert _group_time(volume, 8, 1, hw) == pytest.approx(latency + volume * 7 / 8 / 360e9)
    # 16 ranks, 8 per node: 7/16 of the volume over NVLink and 8/16 over InfiniBand at once, the slower one counts
    assert _group_time(volume, 16, 1, hw) == pytest.approx(latency + volume * 8 / 16 / 40e9)
    # ranks 8 apart (the data-parallel ranks under tp 8): every peer is on another node
    assert _group_time(volume, 4, 8, hw) == pytest.approx(latency + volume * 3 / 4 / 40e9)
    assert _group_time(volume, 1, 1, hw) == 0.0
    # DeepEP over 8 nodes with node-limited routing (4 groups a token): 4 x 7/8 rows cross, not 8 x 7/8
    model = ModelComm(hidden=7168, topk=8, kv_width=0, seq_len=4096, group_topk=4, num_groups=8, dispatcher="flex")
    sizes = LayoutSizes(64, 1, 1, 1, 1, 64, 1)
    rows, row = 4096, 7168 * 2
    reached = min(8 * (1 - (7 / 8) ** 8), 4)
    assert _dispatch_time(rows, sizes, model, hw) == pytest.approx(latency + rows * row * reached * 7 / 8 / 40e9)
    # over 32 nodes a group's experts span 4 of them: 4 groups reach up to 16 nodes, 8 experts at most 8
    wide = LayoutSizes(256, 1, 1, 1, 1, 256, 1)
    reached = min(32 * (1 - (31 / 32) ** 8), 16)
    assert _dispatch_time(rows, wide, model, hw) == pytest.approx(latency + rows * row * reached * 31 / 32 / 40e9)
    plain = ModelComm(hidden=7168, topk=8, kv_width=0, seq_len=4096)
    assert _dispatch_time(rows, sizes, plain, hw) == pytest.approx(_group_time(rows * 8 * row, 64, 1, hw))


SMALL = SearchSettings(global_batch=16, seq_len=256, param_bytes=4, optimizer_state_bytes=4, activation_bytes=2)


@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("tiny-deepseek-v3", dict(ep=4)),
        ("tiny-deepseek-v3", dict(tp=2, ep=2, etp=1)),
        ("tiny-qwen3-moe", dict(cp=2, ep=4)),
        ("tiny-qwen3-moe", dict(tp=2, ep=2, etp=2)),
        ("tiny-deepseek-v3", dict(pp=2, ep=2)),  # 1F1B: its dense first layer on rank 0, MTP on rank 1
        ("tiny-qwen3-moe", dict(pp=2, vpp=2, ep=2, pp_schedule="Interleaved1F1B")),
        ("qwen3-30b-a3b", dict(ep=8)),  # at its real size: saves past the 1 MiB offload threshold
    ],
)
@pytest.mark.parametrize("saving", ["none", "offload", "layer"])
def test_memory_is_plan_memorys_estimate_without_building_each_layout(name: str, sizes: dict, saving: str) -> None:
    """The search sizes layouts from per-layer counts; ``plan --memory`` splits the model over a fake world and
    estimates each rank kind from its exact shards. Pipeline rank by pipeline rank, their activations (with buffers,
    logits and the recompute working set; and what is offloaded) agree exactly, parameters within FSDP's uneven last
    shards."""
    pp, vpp = sizes.get("pp", 1), sizes.get("vpp", 1)
    config = preset(name)
    config = dataclasses.replace(config, num_layers=max(config.num_layers, pp * vpp))  # a layer a stage at least
    world = 8
    search = LayoutSearch(config, SMALL, load_hardware(H100))
    layout = LayoutSizes(world, sizes.get("tp", 1), sizes.get("cp", 1), pp, vpp, sizes["ep"], sizes.get("etp", 1))
    micro = 2
    microbatches = SMALL.global_batch // (micro * layout.dp)
    report = plan_report(config, ParallelConfig(**sizes), world, seq_len=SMALL.seq_len)
    report = with_microbatches(report, layout.schedule, microbatches)
    recompute, offload = search.savings[saving]
    options = memory_options(sorted(recompute), sorted(offload), micro_batch=micro, seq_len=SMALL.seq_len)
    ranks = search.rank_memory(layout, micro, microbatches, saving)
    for kind, estimate in memory_estimates(report, config, options):
        device, _, host = ranks[kind.pp_rank or 0]
        held = estimate.activation_bytes + estimate.dispatcher_buffers + estimate.logits + estimate.recompute_bytes
        assert device == pytest.approx(held, rel=1e-12), kind.ranks
        assert host == pytest.approx(estimate.offloaded_bytes, rel=1e-12), kind.ranks
        if not name.startswith("tiny"):
            assert (host > 0) == (saving == "offload")
    work = search.stage_work(pp * vpp)
    for rank, stages in enumerate(rank_stages(layout.schedule, pp, vpp, r) for r in range(pp)):
        kind = max((k for k in report.kinds if (k.pp_rank or 0) == rank), key=lambda k: k.param_count())
        expert = sum(work[i].expert_params for i in stages) / (layout.ep * layout.etp * layout.edp)
        assert sum(work[i].dense_local(layout) for i in stages) + expert == pytest.approx(kind.param_count(), rel=0.03)
        assert expert == pytest.approx(kind.param_count(ROUTED_EXPERTS), rel=1e-9)


@pytest.fixture(scope="module", params=list(PUBLISHED_RUNS))
def published(request):
    run = PUBLISHED_RUNS[request.param]
    settings = SearchSettings(run.global_batch, SEQ_LEN, gather_bytes=2, reduce_bytes=4, dispatcher="flex")
    return request.param, run, settings, LayoutSearch(preset(run.preset), settings, load_hardware(H100))


def test_published_layouts_fit_the_h100_profile_and_their_throughput_is_near_the_estimate(published) -> None:
    """Each NeMo AutoModel row's layout is one the search enumerates, fits 80 GB under the estimate with some
    micro-batch size and recompute choice, and the time model (at the one efficiency fitted to the six rows,
    benchmarks/plan_search.py) puts it within 0.6x-1.5x of its published tokens/s/GPU."""
    name, run, settings, search = published
    sizes = LayoutSizes(run.gpus, run.tp, run.cp, run.pp, run.vpp, run.ep, 1)
    assert sizes in set(search.layouts(run.gpus)), name
    assert search.check(sizes) is None, name
    candidate = search.best_for(sizes, DEFAULT_EFFICIENCY)
    assert candidate is not None, f"{name}: does not fit"
    assert candidate.memory <= search.hw.usable_bytes
    ratio = candidate.tokens_per_second_per_gpu(settings) / run.tokens_per_second
    assert 0.6 <= ratio <= 1.5, f"{name}: estimated / published tokens/s = {ratio:.3f}"
    parts = candidate.time.parts
    assert math.isclose(sum(parts.values()), candidate.time.total, rel_tol=1e-9)
    assert all(value >= -1e-9 for value in parts.values()), parts


def test_why_names_the_parts_that_differ_most() -> None:
    from moe_train.layout_search import Candidate
    from moe_train.step_time import PARTS, StepTime

    def candidate(**parts: float) -> Candidate:
        split = dict.fromkeys(PARTS, 0.0) | parts
        return Candidate(LayoutSizes(8, 1, 1, 1, 1, 8, 1), 1, 8, "none", 0.0, 0.0, StepTime(sum(split.values()), split))

    better, worse = candidate(compute=10, tp=1.0), candidate(compute=10, ep_a2a=3.0, bubble=0.5)
    assert why(better, worse) == "ep_a2a 3.00 s less, bubble 0.50 s less, tp 1.00 s more"
    assert why(better, better) == "within 0.5% of the step in every part"


QWEN = ["--model.preset", "qwen3-30b-a3b", "--train.global_batch_size", "512", "--data.seq_len", "4096"]


def test_search_prints_the_best_layouts_and_the_first_plans(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["plan", "--search", "--gpus", "8", "--top", "3", *QWEN, "--parallel.tp", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert "over 8 x h100-80gb; held: tp=1" in lines[0]
    table = lines[1 : lines.index(next(line for line in lines if line.startswith("micro:")))]
    assert len(table) == 4 and all(" tp=1 " in row for row in table[1:])
    beats = [line for line in lines if " beats " in line]
    assert len(beats) == 2 and all(re.match(rf"#{i} beats #{i + 1} by \d+\.\d%: \w", b) for i, b in enumerate(beats, 1))
    flags = next(line for line in lines if line.startswith("#1 as flags: ")).removeprefix("#1 as flags: ").split()
    assert cli.main(["plan", "--world-size", "8", *QWEN, *flags]) == 0  # the model's own checks take it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--search"], "--gpus None: plan --search needs the number of GPUs"),
        (["--search", "--gpus", "8", "--hardware", "tpu"], "--hardware tpu: neither a built-in profile"),
        (["--search", "--gpus", "8", "--parallel.dp_shard", "2"], "parallel.dp_shard: plan --search shards"),
        (["--search", "--gpus", "8", "--world-size", "8"], "plan --search takes --gpus and --hardware"),
        (["--search", "--gpus", "8", "--efficiency", "2"], "--efficiency 2: the fraction of peak"),
    ],
)
def test_search_errors_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert cli.main(["plan", *args, *QWEN]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"moe-train: error: {message}") and err.count("\n") == 1, err


def test_one_stage_step_by_hand() -> None:
    """One stage, no parallelism: compute is the FLOPs at the efficiency, offloaded bytes cost what their transfer
    takes beyond each pass's compute, the optimizer reads and writes 28 bytes an element at HBM speed."""
    from moe_train.step_time import StageWork, step_time

    hw = load_hardware(H100)
    stage = StageWork(
        flops=6e9, layer_flops=6e9, moe_layers=0, attention_layers=1, layers=1, params=1_000_000, expert_params=0,
        tp_whole=0, largest_layer_dense=1_000_000, largest_layer_experts=0,
    )  # fmt: skip
    model = ModelComm(hidden=1024, topk=1, kv_width=256, seq_len=4096)
    sizes = LayoutSizes(1, 1, 1, 1, 1, 1, 1)
    rate = 989e12 * 0.5
    forward = 2e9 * 4096 / rate  # a third of the training FLOPs, one micro-batch of 4096 tokens
    sent = 4e9 / 50e9  # 4 GB to host at 50 GB/s, each way
    timed = step_time([sizes][0], [stage], 1, 3, False, model, hw, 0.5, offloaded=(4e9,))
    assert timed.parts["compute"] == pytest.approx(3 * 3 * forward)
    assert timed.parts["offload"] == pytest.approx(3 * (max(0, sent - forward) + max(0, sent - 2 * forward)))
    assert timed.parts["optimizer"] == pytest.approx(1_000_000 * 28 / 3350e9)
    assert timed.parts["bubble"] == pytest.approx(0, abs=1e-12) and timed.parts["fsdp"] == 0
    assert timed.total == pytest.approx(sum(timed.parts.values()))
