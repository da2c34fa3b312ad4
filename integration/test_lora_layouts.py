"""LoRA (``peft.method=lora``) trains alike under every layout the trainer supports: the adapters follow each split
(FSDP shards them, expert parallelism takes each rank's experts' adapters, tensor parallelism splits a
column-parallel projection's ``lora_B`` and a row-parallel one's ``lora_A`` as their weights, as expert tensor
parallelism does the experts' ``fc1`` ``lora_B`` and ``fc2`` ``lora_A``, pipeline stages carry their layers'), so
losses, gradient norms and the trained adapters equal one process's (fp32, gloo, CPU); an etp=2 checkpoint resumes in
one process.

The model is the 4-layer DeepSeek-V3 proxy (MLA attention, a dense first layer, shared experts, MTP: every kind of
adapter the default targets make); 4 steps of a global batch of 8 sequences in micro-batches of 2, as in
test_parallel_equivalence.py. One 2-rank process group trains every layout in turn.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_models.lora import ADAPTER_MARK
from moe_train.config import load_config
from moe_train.trainer import prepare, train

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_lora_worker.py")
PRESET = "tiny-deepseek-v3"
STEPS = 4
TOLERANCE = 1e-4
ETP = "etp=2 x tp=2"
LAYOUTS: dict[str, dict[str, str]] = {
    "dp_shard=2": {},
    "ep=2": {"parallel.ep": "2"},
    "tp=2 x ep=2 (etp=1)": {"parallel.tp": "2", "parallel.ep": "2", "parallel.etp": "1"},
    "pp=2": {"parallel.pp": "2"},
    # the experts' adapters split over etp as their weights, their whole factors' gradients summed over etp; its
    # step-2 checkpoint is resumed in one process (test_etp_checkpoint_resumes_in_one_process)
    ETP: {"parallel.tp": "2", "parallel.etp": "2", "run.save_checkpoint": "true", "run.checkpoint_interval": "2"},
}


def _overrides(data_cache: Path) -> dict[str, str]:
    return {
        "model.num_layers": "4",
        "model.moe_layer_freq": "0,1,1,1",
        "peft.method": "lora",
        "peft.rank": "8",
        "peft.alpha": "16",
        "train.steps": str(STEPS),
        "train.lr": "1e-2",
        "train.global_batch_size": "8",
        "train.micro_batch_size": "2",
        "train.warmup_steps": "1",
        "train.seed": "3",
        "data.seq_len": "32",
        "data.cache_dir": str(data_cache),
        "run.log_interval": "100",
        "run.save_checkpoint": "false",
        "run.dtype": "fp32",
    }


def _records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def _case_dir(layout: str) -> str:
    return layout.replace(" ", "_").replace("=", "").replace("(", "").replace(")", "")


@pytest.fixture(scope="module")
def single_process(data_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict]:
    out = tmp_path_factory.mktemp("lora-single") / "run"
    setup = prepare(load_config(PRESET, {**_overrides(data_cache), "run.output_dir": str(out)}), 1)
    train(setup)
    adapters = {
        setup.parallel.global_name(n): p.detach().clone()
        for n, p in setup.model.named_parameters()
        if ADAPTER_MARK in n
    }
    return _records(out), adapters


@pytest.fixture(scope="module")
def parallel_runs(data_cache: Path, tmp_path_factory: pytest.TempPathFactory, launch_gloo_scenarios) -> dict:
    out = tmp_path_factory.mktemp("lora-parallel")
    cases = [
        {"name": _case_dir(name), "preset": PRESET, "overrides": {**_overrides(data_cache), **extra}}
        for name, extra in LAYOUTS.items()
    ]
    (out / "cases.json").write_text(json.dumps(cases))
    return {"out": out, "outcomes": launch_gloo_scenarios(WORKER, 2, out, timeout=600)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_layout_equals_single_process(layout: str, single_process, parallel_runs: dict) -> None:
    parallel_runs["outcomes"][_case_dir(layout)]  # the ranks' tracebacks if the case failed
    folder = parallel_runs["out"] / _case_dir(layout)
    reference, ref_adapters = single_process
    ours = _records(folder)
    assert len(ours) == len(reference) == STEPS
    diffs = {
        key: max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(ours, reference, strict=True))
        for key in ("loss", "grad_norm")
    }
    adapters: dict[str, torch.Tensor] = {}
    for rank in range(2):
        for name, value in torch.load(folder / f"adapters_rank{rank}.pt", weights_only=True).items():
            if name in adapters:  # held by both ranks (replicated, or gathered whole): the same values
                assert torch.equal(adapters[name], value), name
            adapters[name] = value
    assert set(adapters) == set(ref_adapters)
    diffs["adapters"] = max(
        ((adapters[n] - ref).norm() / ref.norm()).item() for n, ref in ref_adapters.items() if ref.norm() > 0
    )
    print(f"LoRA {layout}: max relative difference {diffs}")
    assert all(d < TOLERANCE for d in diffs.values()), diffs
    # the adapters trained: every lora_B left zero
    assert all(ref.norm() > 0 for ref in ref_adapters.values())
    assert reference[-1]["loss"] < reference[0]["loss"]


def test_etp_checkpoint_resumes_in_one_process(
    data_cache: Path, tmp_path: Path, single_process, parallel_runs: dict
) -> None:
    """The etp=2 run's step-2 checkpoint holds global adapters (the experts' in their canonical form): one process
    resumed from it trains steps 3 and 4 as the uninterrupted one-process run."""
    parallel_runs["outcomes"][_case_dir(ETP)]
    checkpoint = parallel_runs["out"] / _case_dir(ETP) / "checkpoints" / "step_2"
    out = tmp_path / "resumed"
    overrides = {**_overrides(data_cache), "run.output_dir": str(out), "run.resume": str(checkpoint)}
    train(prepare(load_config(PRESET, overrides), 1))
    reference, _ = single_process
    resumed = _records(out)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, theirs in zip(resumed, reference[2:], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(ours[key] - theirs[key]) / abs(theirs[key]) < TOLERANCE, (key, ours, theirs)
