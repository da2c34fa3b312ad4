"""moe_train.torch_differences and its rows in ``moe-train env``."""

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moe_train.env import torch_difference_rows
from moe_train.safe_dcp import SafeFileSystemReader, UnsafeCheckpointError, read_metadata
from moe_train.torch_differences import _silent, dcp_load_names_metadata_errors, torch_differences


def test_the_dcp_difference_is_what_dcp_load_does_with_a_refused_metadata(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"cposix\nsystem\n(Vtrue\ntR.")
    with pytest.raises(UnsafeCheckpointError) as direct:  # what moe-train's loader calls first, on every torch
        read_metadata(tmp_path)
    assert "refused to unpickle 'posix.system'" in str(direct.value)
    with _silent(), pytest.raises((Exception, CheckpointException)) as inside:
        dcp.load({}, storage_reader=SafeFileSystemReader(tmp_path))
    assert ("refused to unpickle 'posix.system'" in str(inside.value)) == dcp_load_names_metadata_errors()


def test_env_has_one_row_per_difference_or_one_saying_none() -> None:
    rows = torch_difference_rows()
    found = torch_differences()
    if found:
        assert [detail for _, _, detail in rows] == found
    else:
        assert rows == [("torch differences", "none", "behaves as torch 2.13 where the packages check")]
