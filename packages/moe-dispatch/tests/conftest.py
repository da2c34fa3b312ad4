import os
import sys
from pathlib import Path

import torch

# the shared test helpers beside this file (_*.py) import as top-level modules under importlib import mode
sys.path.insert(0, str(Path(__file__).parent))

# Without a GPU the Triton kernels run in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when a kernel
# is decorated, so it must be set before moe_dispatch.triton_permutation is first imported: conftest runs before
# any test module is imported, whatever order the modules run in.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
