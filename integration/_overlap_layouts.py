"""The equivalence matrix's expert-parallel overlap rows (``parallel.ep_overlap``), for
``test_parallel_equivalence.py``: each overlapped row against the same layout without overlap (its base), to
OVERLAP_TOLERANCE; and the rows whose micro-batches are one process's against it too."""

from __future__ import annotations

from typing import NamedTuple

PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3")  # the equivalence matrix's two proxies


class OverlapRow(NamedTuple):
    world: int
    overrides: dict[str, str]
    base: str | None  # the row it must equal (a row of LAYOUTS or of this table); None: a base row
    presets: tuple[str, ...]
    pipelined: bool = False  # on the 4-layer pipeline proxies
    versus_one_process: bool = True


CHUNKED = {"parallel.ep_overlap": "chunked"}
MICROBATCH = {"parallel.ep_overlap": "microbatch"}  # needs two micro-batches a step on each rank
DELAYED_WGRAD = {**MICROBATCH, "parallel.delay_wgrad_compute": "true"}
CAPACITY = {"model.moe_expert_capacity_factor": "1.0", "model.moe_pad_expert_input_to_capacity": "true"}
EP_ETP = {"parallel.ep": "2", "parallel.etp": "2"}
# 4 data-parallel ranks of the 8-sequence batch: micro-batches of 1 sequence make two of them a step
EP_ETP_TWO_MICRO = {**EP_ETP, "train.micro_batch_size": "1"}
# DualPipeV needs 4 micro-batches a step on each of the 2 data-parallel ranks: micro-batches of 1 sequence, which one
# process's run (of micro-batches of 2) balances otherwise
PP_EP_DUALPIPE = {
    "parallel.pp": "2",
    "parallel.ep": "2",
    "parallel.pp_schedule": "DualPipeV",
    "train.micro_batch_size": "1",
}
QWEN3, DEEPSEEK = ("tiny-qwen3-moe",), ("tiny-deepseek-v3",)
OVERLAP_LAYOUTS: dict[str, OverlapRow] = {
    "ep=2 chunked overlap": OverlapRow(2, {"parallel.ep": "2", **CHUNKED}, "ep=2", PRESETS),
    "ep=2 microbatch overlap": OverlapRow(2, {"parallel.ep": "2", **MICROBATCH}, "ep=2", DEEPSEEK),
    # the experts' weight gradients computed in the backward's exchange waits, into FSDP's gathered parameters
    "ep=2 microbatch overlap delayed wgrad": OverlapRow(2, {"parallel.ep": "2", **DELAYED_WGRAD}, "ep=2", DEEPSEEK),
    # the MoE blocks recomputed inside a backward whose turns run the other micro-batch's forward
    "ep=2 recomputing moe microbatch overlap": OverlapRow(
        2, {"parallel.ep": "2", "run.recompute_modules": "moe", **MICROBATCH}, "ep=2", DEEPSEEK
    ),
    # the whole MoE block recomputed in the backward: its chunks' all-to-alls run again, started and finished there
    "ep=2 recomputing moe chunked overlap": OverlapRow(
        2, {"parallel.ep": "2", "run.recompute_modules": "moe", **CHUNKED}, "ep=2", DEEPSEEK
    ),
    # capacity dropping with padding: the drops are decided for the whole micro-batch before it is chunked
    "ep=2 capacity 1.0": OverlapRow(2, {"parallel.ep": "2", **CAPACITY}, None, QWEN3, versus_one_process=False),
    "ep=2 capacity 1.0 chunked overlap": OverlapRow(
        2, {"parallel.ep": "2", **CAPACITY, **CHUNKED}, "ep=2 capacity 1.0", QWEN3, versus_one_process=False
    ),
    "ep=2 capacity 1.0 microbatch overlap": OverlapRow(
        2, {"parallel.ep": "2", **CAPACITY, **MICROBATCH}, "ep=2 capacity 1.0", QWEN3, versus_one_process=False
    ),
    "ep=2 x etp=2": OverlapRow(4, EP_ETP, None, DEEPSEEK),
    "ep=2 x etp=2 chunked overlap": OverlapRow(4, {**EP_ETP, **CHUNKED}, "ep=2 x etp=2", DEEPSEEK),
    "ep=2 x etp=2 2 micro-batches": OverlapRow(4, EP_ETP_TWO_MICRO, None, DEEPSEEK, versus_one_process=False),
    "ep=2 x etp=2 microbatch overlap": OverlapRow(
        4, {**EP_ETP_TWO_MICRO, **MICROBATCH}, "ep=2 x etp=2 2 micro-batches", DEEPSEEK, versus_one_process=False
    ),
    "ep=2 x etp=2 microbatch overlap delayed wgrad": OverlapRow(
        4, {**EP_ETP_TWO_MICRO, **DELAYED_WGRAD}, "ep=2 x etp=2 2 micro-batches", DEEPSEEK, versus_one_process=False
    ),
    "pp=2 x ep=2 DualPipeV": OverlapRow(4, PP_EP_DUALPIPE, None, QWEN3, pipelined=True, versus_one_process=False),
    "pp=2 x ep=2 DualPipeV chunked overlap": OverlapRow(
        4, {**PP_EP_DUALPIPE, **CHUNKED}, "pp=2 x ep=2 DualPipeV", QWEN3, pipelined=True, versus_one_process=False
    ),
    "pp=2 x ep=2 DualPipeV microbatch overlap": OverlapRow(
        4, {**PP_EP_DUALPIPE, **MICROBATCH}, "pp=2 x ep=2 DualPipeV", QWEN3, pipelined=True, versus_one_process=False
    ),
}
OVERLAP_TOLERANCE = 1e-5
