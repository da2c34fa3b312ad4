"""A training step that writes no metrics waits for the device once outside the model's layers (the non-finite /
stop flag); on a GPU every other read-back (``.item()``, ``.tolist()``, ``.cpu()``) would stall the stream. Counted
through a dispatch mode (``aten._local_scalar_dense``: ``.item()``, ``float()``, ``bool()``) and the tensor methods
that read a tensor back without dispatching on the CPU (``.tolist()``, ``.cpu()``, ``.numpy()``), in a middle step
of the default run (``tiny``)."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_train.loop
from moe_train.config import load_config
from moe_train.trainer import prepare, train

# the model's layers (their forward, the autograd functions of their backward, and what wraps them: quantised GEMMs,
# recompute): what they read back is the layers' business (a dispatch sizes its buffers from the counts), not the
# training step's
MODEL_PACKAGES = ("moe_models", "moe_dispatch", "moe_experts", "moe_precision", "moe_memory")


def _in_model(stack: list[traceback.FrameSummary]) -> bool:
    return any(f"/{package}/" in frame.filename for frame in stack for package in MODEL_PACKAGES)


class HostSyncs(TorchDispatchMode):
    """The read-backs made while active, outside the model's code, each with where it was made. ``on_host``: tensors
    kept on the host by design, whose reads wait for nothing on a GPU (AdamW's step counters, as torch's own)."""

    READ_BACKS = ("tolist", "cpu", "numpy")

    def __init__(self, on_host: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.outside: list[str] = []
        self.on_host = {id(t) for t in on_host}
        self._originals = {name: getattr(torch.Tensor, name) for name in self.READ_BACKS}

    def _record(self, what: str, tensor: torch.Tensor) -> None:
        if id(tensor) in self.on_host:
            return
        stack = traceback.extract_stack()[:-2]
        if not _in_model(stack):
            caller = next(f for f in reversed(stack) if "torch/" not in f.filename and f.filename != __file__)
            self.outside.append(f"{what} at {Path(caller.filename).name}:{caller.lineno}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self._record("item", args[0])
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostSyncs:
        for name, original in self._originals.items():

            def counted(tensor, *args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
                if _name != "cpu" or tensor.device.type != "cpu":  # .cpu() of a CPU tensor reads nothing back
                    self._record(_name, tensor)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        super().__exit__(*exc)


def test_the_counter_sees_each_kind_of_read_back() -> None:
    x = torch.ones(3)
    with HostSyncs() as syncs:
        x.sum().item()
        x.tolist()
        float(x[0])
        bool(x.all())
    assert len(syncs.outside) == 4, syncs.outside


def test_a_step_that_writes_no_metrics_syncs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = {
        "train.steps": "3",
        "run.log_interval": "100",  # step 2 is neither the first, a log step nor the last
        "run.output_dir": str(tmp_path / "run"),
        "data.cache_dir": str(tmp_path / "cache"),
        "run.save_checkpoint": "false",
    }
    counted: dict[int, list[str]] = {}
    step = moe_train.loop.TrainLoop.step

    def counting_step(self, index, *args, **kwargs):  # type: ignore[no-untyped-def]
        step_counters = tuple(state["step"] for state in self.optimizer.state.values())
        assert all(counter.device.type == "cpu" for counter in step_counters)
        with HostSyncs(on_host=step_counters) as syncs:
            result = step(self, index, *args, **kwargs)
        counted[index] = syncs.outside
        return result

    monkeypatch.setattr(moe_train.loop.TrainLoop, "step", counting_step)
    train(prepare(load_config("tiny", overrides), world_size=1))
    assert counted[1] == [next(s for s in counted[1] if "faults.py" in s)], counted[1]  # the flag, and nothing else
    assert len(counted[2]) > 1, counted[2]  # the last step writes its metrics: read back, so counted
