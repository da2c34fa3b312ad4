"""A HuggingFace checkpoint as the source a meta-built, parallelised model is materialised from: each rank reads
only the tensors and slices it holds (``moe_parallel.materialize`` asks for them one at a time).

Non-expert tensors stored as they are (a rename) are read as the box the rank holds, through safetensors slicing
(a tensor-parallel or FSDP shard reads its rows and columns only); tensors whose layout changes on the way in
(fused gate/up, transposes) are read whole, converted and then cut. Routed experts are read one expert at a time,
so a rank never touches the experts it does not own.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_models.config import ModelConfig
from moe_models.hf.errors import HFCheckpointError
from moe_models.hf.files import CheckpointReader
from moe_models.hf.io import FP32_SUFFIXES, plan_for, stored_plan
from moe_models.hf.state_dict_map import Entry, is_routed_expert_tensor, stored_as_is


class CheckpointSource:
    """The tensors of the checkpoint directory ``path`` (whose config is ``config``), served by our names.

    Names, and every tensor's shape, are checked against ``config`` here, before anything is allocated. Use as a
    context manager (or call :meth:`close`) to close the files.
    """

    def __init__(self, path: str | Path, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        self.config, self.dtype = config, dtype
        self.reader = CheckpointReader(path)
        try:
            plan = plan_for(self.reader, config, None)
            for entry in plan.entries:
                for source in entry.sources:
                    if self.reader.shape(source.key) != source.shape:
                        raise HFCheckpointError(
                            f"tensor {source.key} has shape {list(self.reader.shape(source.key))}, the config needs "
                            f"{list(source.shape)}: check config.json against the weights"
                        )
        except BaseException:
            self.close()
            raise
        self.entries = {e.ours: e for e in plan.entries if not is_routed_expert_tensor(e.ours)}
        self._available = self.reader.names()
        self._expert_entries: dict[int, dict[str, Entry]] = {}

    def __enter__(self) -> CheckpointSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.reader.__exit__(None, None, None)

    def _cast(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32 if name.endswith(FP32_SUFFIXES) else self.dtype)
        return tensor.contiguous()

    def tensor(self, name: str, shape: tuple[int, ...], box: tuple[slice, ...] | None = None) -> torch.Tensor:
        """Non-expert tensor ``name`` of ours, or its ``box``."""
        entry = self.entries[name]
        if box is not None and stored_as_is(entry):
            return self._cast(name, self.reader.read_box(entry.sources[0].key, box))
        whole = entry.to_ours([self.reader.read(source) for source in entry.sources])
        return self._cast(name, whole if box is None else whole[box])

    def expert(self, path: str, index: int) -> dict[str, torch.Tensor]:
        """Global expert ``index`` of our grouped experts at ``path``, by parameter name (expert dim dropped)."""
        if index not in self._expert_entries:
            plan = stored_plan(self._available, self.config, [index])
            self._expert_entries[index] = {e.ours: e for e in plan.entries if is_routed_expert_tensor(e.ours)}
        prefix = f"{path}."
        return {
            ours[len(prefix) :]: self._cast(ours, entry.to_ours([self.reader.read(s) for s in entry.sources])[0])
            for ours, entry in self._expert_entries[index].items()
            if ours.startswith(prefix)
        }
