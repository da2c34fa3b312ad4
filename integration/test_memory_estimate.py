"""The per-rank memory estimate under parallel layouts (2 gloo ranks, fp32, CPU): each rank built as ``moe-train
train`` builds it (meta build, parallelize, materialize), one forward + backward + optimizer step.

Per rank, the estimate's parameter, gradient and optimizer-state bytes (moe-train's AdamW, states in fp32 and in
bf16; Muon's momentum) equal what the rank allocated, and its activations are within 10% of the bytes
``SavedTensorBytes`` measured: expert parallelism (all-to-all and all-gather dispatchers, FSDP over the data-parallel
ranks), tensor + sequence parallelism with expert tensor parallelism (also with bf16 parameters and fp32 master
weights), tp x ep on DeepSeek-V3's proxy (MLA, shared expert, dense layer, MTP), and context parallelism (GQA,
GPT-OSS's sinks and windows, MLA with MTP).
Routing decides how many rows each rank's experts get: the estimate's is the expected share, so the mean over the
ranks is held closer (2%) than each rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_memory_estimate_worker.py")
TOLERANCE = 0.10
MEAN_TOLERANCE = 0.02
COMMON = {"train.global_batch_size": "4", "train.micro_batch_size": "2", "data.seq_len": "64"}
CASES = {
    "qwen3-moe ep=2 (alltoall, FSDP dp=2)": ("tiny-qwen3-moe", {"parallel.ep": "2"}),
    "qwen3-moe ep=2 allgather, bf16 AdamW states": (
        "tiny-qwen3-moe",
        {
            "parallel.ep": "2",
            "parallel.moe_token_dispatcher_type": "allgather",
            "train.optimizer_states_dtype": "bf16",
        },
    ),
    "qwen3-moe tp=2 (sequence parallel, etp=2)": ("tiny-qwen3-moe", {"parallel.tp": "2"}),
    # tp only: FSDP's default mixed precision (float32) would compute bf16 parameters in fp32
    "qwen3-moe tp=2, bf16 parameters and activations, fp32 master weights": (
        "tiny-qwen3-moe",
        {"parallel.tp": "2", "train.params_dtype": "bf16", "train.master_weights_dtype": "fp32"},
    ),
    "deepseek-v3 tp=2 x ep=2 (etp=1)": (
        "tiny-deepseek-v3",
        {"parallel.tp": "2", "parallel.ep": "2", "parallel.etp": "1"},
    ),
    # Muon: its matrices keep one momentum buffer each (no moments, no step), AdamW the rest
    "deepseek-v3 ep=2, Muon": ("tiny-deepseek-v3", {"parallel.ep": "2", "train.optimizer": "muon"}),
    "qwen3-moe tp=2, Muon, bf16 parameters, bf16 momentum, fp32 master weights": (
        "tiny-qwen3-moe",
        {
            "parallel.tp": "2",
            "train.optimizer": "muon",
            "train.params_dtype": "bf16",
            "train.optimizer_states_dtype": "bf16",
            "train.master_weights_dtype": "fp32",
        },
    ),
    # context parallelism: half the positions a rank, the keys and values of all of them in attention
    "qwen3-moe cp=2": ("tiny-qwen3-moe", {"parallel.cp": "2"}),
    "gpt-oss cp=2 (sinks, sliding windows)": ("tiny-gpt-oss", {"parallel.cp": "2"}),
    "deepseek-v3 cp=2 (MLA, MTP)": ("tiny-deepseek-v3", {"parallel.cp": "2"}),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory, launch_gloo_workers) -> list[dict]:
    out = tmp_path_factory.mktemp("memory-estimate")
    cases = [{"name": name, "preset": p, "overrides": {**COMMON, **o}} for name, (p, o) in CASES.items()]
    (out / "cases.json").write_text(json.dumps(cases))
    return launch_gloo_workers(WORKER, 2, out, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_parameter_gradient_and_optimizer_bytes_are_exact(ranks: list[dict], name: str) -> None:
    for rank, results in enumerate(ranks):
        r = results[name]
        assert r["estimated_params"] == r["allocated_params"], f"rank {rank}"
        assert r["estimated_grads"] == r["allocated_grads"], f"rank {rank}"
        assert r["estimated_optimizer"] == r["allocated_optimizer"], f"rank {rank}"


@pytest.mark.parametrize("name", list(CASES))
def test_activations_within_tolerance_on_every_rank(ranks: list[dict], name: str) -> None:
    expected = {"tp": 2} if "tp=2" in name else {}
    expected.update({"ep": 2} if "ep=2" in name else {})
    expected.update({"cp": 2} if "cp=2" in name else {})
    for rank, results in enumerate(ranks):
        r = results[name]
        assert {k: r["layout"][k] for k in expected} == expected
        estimated, measured = r["estimated_activations"], r["measured_activations"]
        assert abs(estimated - measured) <= TOLERANCE * measured, f"rank {rank}: {estimated} vs {measured}"
    mean = sum(results[name]["measured_activations"] for results in ranks) / len(ranks)
    estimated = ranks[0][name]["estimated_activations"]
    assert estimated == ranks[1][name]["estimated_activations"]
    assert abs(estimated - mean) <= MEAN_TOLERANCE * mean


@pytest.mark.parametrize(
    "name",
    [
        "qwen3-moe tp=2 (sequence parallel, etp=2)",
        "qwen3-moe cp=2",
        "gpt-oss cp=2 (sinks, sliding windows)",
        "deepseek-v3 cp=2 (MLA, MTP)",
    ],
)
def test_tensor_and_context_parallel_are_exact_module_by_module(ranks: list[dict], name: str) -> None:
    """Without expert parallelism the rows are known exactly: the estimate matches every module of both ranks (under
    cp with FSDP sharding over the cp ranks)."""
    for rank, results in enumerate(ranks):
        r = results[name]
        estimated = dict(r["estimated_by_module"])
        estimated["dispatch"] = estimated.get("dispatch", 0) + estimated.pop("combine", 0)
        assert estimated == r["measured_by_module"], f"rank {rank}"
