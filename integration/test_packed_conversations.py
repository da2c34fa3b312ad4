"""Chat fine-tuning on packed conversations trains the same however the global batch is cut (fp32, gloo, CPU).

Conversations of very different lengths (25 to 110 tokens) are packed into 128-token windows, with labels on the
assistant's tokens only, so micro-batches and ranks hold very different numbers of labels. The loss is a mean over the
labelled tokens of the whole global batch (Megatron's ``--calculate-per-token-loss``): one process with one
micro-batch of 8 windows, with four of 2, and 2-rank runs under dp_shard=2, ep=2, cp=2 and tp=2 must give the same loss,
gradient norm and validation loss at every step (relative 1e-5; the attention of the cp and tp runs is cut along the
sequence and the heads, with the document boundaries). A mean per micro-batch, as before, would not (the control).

Balancing losses are off: they are per micro-batch by design (and so differ between 1 and 4 micro-batches).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _conversations import conversations, write_jsonl, write_tokenizer

from moe_train.config import load_config
from moe_train.loop import TrainLoop
from moe_train.trainer import prepare, train

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_parallel_worker.py")
PRESET = "tiny-qwen3-moe"
STEPS = 4
TOLERANCE = 1e-5
LAYOUTS = {
    "dp_shard=2": {},
    "ep=2": {"parallel.ep": "2"},
    "cp=2": {"parallel.cp": "2"},
    "tp=2": {"parallel.tp": "2"},
}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("chat")
    return {
        "data.format": "chat",
        "data.source": str(write_jsonl(root / "chat.jsonl", conversations(240))),
        "data.tokenizer": str(write_tokenizer(root / "tokenizer")),
        "data.cache_dir": str(root / "cache"),
        "data.seq_len": "128",
        "data.valid_fraction": "0.1",
        "model.vocab_size": "320",
        "model.moe_aux_loss_coeff": "0",
        "train.steps": str(STEPS),
        "train.global_batch_size": "8",
        "train.micro_batch_size": "2",
        "train.warmup_steps": "1",
        "train.eval_interval": "2",
        "train.eval_iters": "1",
        "train.seed": "7",
        "run.log_interval": "100",
        "run.save_checkpoint": "false",
        "run.dtype": "fp32",
    }


def _records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def _run(overrides: dict[str, str], out: Path) -> list[dict]:
    train(prepare(load_config(PRESET, {**overrides, "run.output_dir": str(out)}), 1))
    return _records(out)


@pytest.fixture(scope="module")
def single_process(chat_data: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("single")
    runs = {
        "4 micro-batches": _run(chat_data, out / "micro2"),
        "1 micro-batch": _run({**chat_data, "train.micro_batch_size": "8"}, out / "micro8"),
    }
    mean_per_micro_batch = pytest.MonkeyPatch()
    # the loss before issue 33: each micro-batch's mean over its own labelled tokens
    mean_per_micro_batch.setattr(TrainLoop, "labelled_per_share", lambda self, step: None)
    try:
        runs["4 micro-batches, mean per micro-batch"] = _run(chat_data, out / "micro2-mean")
    finally:
        mean_per_micro_batch.undo()
    return runs


@pytest.fixture(scope="module")
def parallel_runs(chat_data: dict[str, str], tmp_path_factory: pytest.TempPathFactory, launch_gloo_scenarios) -> dict:
    out = tmp_path_factory.mktemp("parallel")
    cases = [
        {"name": name.replace("=", ""), "preset": PRESET, "overrides": {**chat_data, **extra}}
        for name, extra in LAYOUTS.items()
    ]
    (out / "cases.json").write_text(json.dumps(cases))
    return {"out": out, "outcomes": launch_gloo_scenarios(WORKER, 2, out, timeout=600)}


def _max_rel_diff(ours: list[dict], reference: list[dict], key: str) -> float:
    pairs = [(a[key], b[key]) for a, b in zip(ours, reference, strict=True) if key in b]
    assert len(ours) == len(reference) == STEPS and pairs
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)


def _diffs(ours: list[dict], reference: list[dict]) -> dict[str, float]:
    return {key: _max_rel_diff(ours, reference, key) for key in ("loss", "grad_norm", "val_loss")}


def test_one_micro_batch_equals_four(single_process) -> None:
    diffs = _diffs(single_process["1 micro-batch"], single_process["4 micro-batches"])
    print(f"1 vs 4 micro-batches: {diffs}")
    assert all(d < TOLERANCE for d in diffs.values()), diffs
    reference = single_process["4 micro-batches"]
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.3  # it trained


def test_a_mean_per_micro_batch_differs(single_process) -> None:
    diffs = _diffs(single_process["4 micro-batches, mean per micro-batch"], single_process["1 micro-batch"])
    print(f"mean per micro-batch vs per-token: {diffs}")
    assert diffs["loss"] > 100 * TOLERANCE


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_single_process(layout: str, single_process, parallel_runs: dict) -> None:
    name = layout.replace("=", "")
    parallel_runs["outcomes"][name]  # every rank trained it (else this fails with their tracebacks)
    diffs = _diffs(_records(parallel_runs["out"] / name), single_process["4 micro-batches"])
    print(f"{layout}: {diffs}")
    assert all(d < TOLERANCE for d in diffs.values()), diffs
