from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    """Package tests use tiny tensors; on a shared 2-core machine a second OpenMP thread only adds stalls
    (steps of ~3 ms were seen taking 1.6 s while other processes held the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
