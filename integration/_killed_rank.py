"""``moe-train`` under torchrun with one rank killed once: ``torchrun ... _killed_rank.py STEP train ...``.

Runs ``moe-train`` with the arguments after ``STEP``; on the first attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``
0) rank 1 kills itself with SIGKILL as soon as it has finished optimizer step ``STEP``, as a node or process dies
mid-run. torchrun's later attempts run unharmed. For test_resume.py.
"""

from __future__ import annotations

import os
import signal
import sys

from moe_train import cli
from moe_train.loop import TrainLoop


def main(kill_at: int, argv: list[str]) -> int:
    if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        step = TrainLoop.step

        def step_then_die(self, index, *args, **kwargs):
            result = step(self, index, *args, **kwargs)
            if index + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        TrainLoop.step = step_then_die
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2:]))
