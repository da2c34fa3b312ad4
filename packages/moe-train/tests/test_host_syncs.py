"""Host synchronisations of a training step. On a GPU every read-back of a device tensor (``.item()``, ``bool()``,
``.tolist()``, ``.cpu()``) and every op whose output size depends on the data (``nonzero``, boolean-mask indexing,
``repeat_interleave`` without its output size) waits for the stream to drain, and rules out CUDA graphs.

Counted on the CPU through a dispatch mode (``aten._local_scalar_dense`` is what ``.item()``, ``int()`` and
``bool()`` of a tensor dispatch to; the data-dependent ops by name, boolean indices by dtype) and through the tensor
methods that read back without dispatching (``.tolist()``, ``.numpy()``, ``.cpu()``), with the model configured as it
runs on a GPU: torch's ``grouped_mm`` experts, the fused permutation's custom ops (their CPU stand-in here), the
gathered first projection, balancing losses, z-loss and the expert-bias update.

What still needs the host is listed by name in :data:`NEEDS_THE_HOST`, each with its reason, and checked to be where
it says by :func:`test_what_needs_the_host_reads_back_only_where_listed`.
"""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

import moe_train.loop
from moe_train.config import load_config
from moe_train.host_reads import HostRead, HostReads
from moe_train.trainer import prepare, train

# the model as a GPU runs it (model.* keys); the experts' torch back end is grouped_mm, which a GPU picks by default
GPU_MODEL = {
    "model.moe_expert_backend": "torch",
    "model.moe_permute_backend": "triton",  # the fused kernels' custom ops; their plain-torch stand-in on the CPU
    "model.moe_z_loss_coeff": "0.001",
    "model.moe_router_enable_expert_bias": "true",
}
# each run's own balancing on top: both per-batch losses on the default run; DeepSeek-V3's group-limited sigmoid
# routing, shared expert and multi-token prediction as its preset has them
GPU_RUNS = {
    "tiny": {"model.moe_router_load_balancing_type": "aux_loss,seq_aux_loss", "model.moe_aux_loss_coeff": "0.01,0.001"},
    "tiny-deepseek-v3": {},
}

# what still reads back in a step, by name: (the files it reads back in, why). The first is in every step; the others
# only in the configurations named
NEEDS_THE_HOST: dict[str, tuple[str, str]] = {
    "the step's finite / stop flag": (
        "faults.py",
        "one read per step decides whether the optimizer applies the step and whether the run stops (one flag for "
        "both, all-reduced once)",
    ),
    "capacity dropping": (
        "permutation.py",
        "with a capacity (moe_expert_capacity_factor) and no padding to it, the expert-major buffer holds the kept "
        "pairs only, a count the host needs to size it",
    ),
    "the loop experts back end": (
        "backends.py grouped.py",
        "one matmul per expert: the host splits the rows by the counts (grouped_mm takes device offsets instead), "
        "and checks they cover the rows the first projection gathers",
    ),
    "TE's and grouped_gemm's grouped GEMMs": (
        "backends.py",
        "their kernels take the group sizes as a host list (TE's m_splits) or a CPU tensor (grouped_gemm); not on "
        "this machine, listed from their code",
    ),
    "all-to-all dispatch split sizes": (
        "collectives.py",
        "torch.distributed.all_to_all_single takes its input/output split sizes as host ints; the expert-parallel "
        "dispatcher exchanges the counts and reads them back once per dispatch (DeepEP keeps them on the device)",
    ),
    "quantised grouped experts (fp8 / mxfp8 / nvfp4 recipes)": (
        "layers.py",
        "one scaled GEMM per expert: the host splits the rows by the counts (torch._scaled_grouped_mm would take "
        "device offsets; not used yet)",
    ),
    "context-parallel blockwise attention's key ranges": (
        "blockwise.py",
        "the query blocks' key ranges are cut on the host from the rank's positions (one read per attention call, "
        "under context parallelism only; whole sequences need none)",
    ),
}


def _counted_steps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, overrides: dict[str, str], steps: int = 3, run: str = "tiny"
) -> dict[int, HostReads]:
    """Train ``steps`` steps of the preset ``run`` with ``overrides``; the host reads of each step."""
    overrides = {
        "train.steps": str(steps),
        "run.log_interval": "100",  # the middle steps are neither the first, a log step nor the last
        "run.output_dir": str(tmp_path / "run"),
        "data.cache_dir": str(tmp_path / "cache"),
        "run.save_checkpoint": "false",
        **overrides,
    }
    counted: dict[int, HostReads] = {}
    step = moe_train.loop.TrainLoop.step

    def counting_step(self, index, *args, **kwargs):  # type: ignore[no-untyped-def]
        step_counters = tuple(state["step"] for state in self.optimizer.state.values())
        assert all(counter.device.type == "cpu" for counter in step_counters)
        with HostReads(on_host=step_counters) as reads:
            result = step(self, index, *args, **kwargs)
        counted[index] = reads
        return result

    monkeypatch.setattr(moe_train.loop.TrainLoop, "step", counting_step)
    train(prepare(load_config(run, overrides), world_size=1))
    return counted


def _listed_site(read: HostRead) -> str | None:
    file = read.site.split(":")[0]
    return next((name for name, (files, _) in NEEDS_THE_HOST.items() if file in files.split()), None)


def test_the_counter_sees_each_kind_of_read_back() -> None:
    x = torch.ones(3)
    with HostReads() as reads:
        x.sum().item()
        x.tolist()
        float(x[0])
        bool(x.all())
        x[x > 0]
        (x > 0).nonzero()
        torch.repeat_interleave(torch.tensor([1, 2]))
        x.numpy()
    kinds = collections.Counter(r.kind for r in reads.reads)
    assert kinds == {"item": 3, "tolist": 1, "bool index": 1, "nonzero": 1, "repeat_interleave": 1, "numpy": 1}, kinds


@pytest.mark.parametrize("run", list(GPU_RUNS))
def test_a_gpu_configured_step_reads_back_once_and_never_in_a_moe_layer(
    run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted = _counted_steps(monkeypatch, tmp_path, {**GPU_MODEL, **GPU_RUNS[run]}, run=run)
    middle = counted[1]
    assert middle.in_moe_layers() == [], [str(r) for r in middle.in_moe_layers()]
    assert [_listed_site(r) for r in middle.reads] == ["the step's finite / stop flag"], [str(r) for r in middle.reads]
    assert len(counted[2].outside_model()) > 1  # the last step writes its metrics: read back, so counted


def test_the_default_step_reads_back_only_the_flag_outside_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the default run on the CPU (auto back ends: its permutation and experts may read back inside the layers)
    counted = _counted_steps(monkeypatch, tmp_path, {})
    outside = counted[1].outside_model()
    assert [_listed_site(r) for r in outside] == ["the step's finite / stop flag"], [str(r) for r in outside]


# configurations that need the host, each with the entries of NEEDS_THE_HOST it reads back for
HOST_CONFIGS: dict[str, tuple[dict[str, str], set[str]]] = {
    "capacity": ({"model.moe_expert_capacity_factor": "1.0"}, {"capacity dropping"}),
    "loop": ({"model.moe_expert_backend": "loop"}, {"the loop experts back end"}),
    "fp8_delayed": (
        {"precision.recipe": "fp8_delayed", "precision.emulate": "true"},
        {"quantised grouped experts (fp8 / mxfp8 / nvfp4 recipes)"},  # delayed scaling's update reads nothing
    ),
}


@pytest.mark.parametrize("name", list(HOST_CONFIGS))
def test_what_needs_the_host_reads_back_only_where_listed(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, expected = HOST_CONFIGS[name]
    reads = _counted_steps(monkeypatch, tmp_path, {**GPU_MODEL, **config}, steps=2)[0].in_moe_layers()
    assert [str(r) for r in reads if _listed_site(r) is None] == []
    assert {_listed_site(r) for r in reads} == expected
