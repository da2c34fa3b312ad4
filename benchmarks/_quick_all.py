"""Every benchmark script's quick mode in one process (the nox benchmarks session): ``python _quick_all.py OUT_DIR``.

Each script runs as ``__main__`` (``runpy``) with ``--quick --out OUT_DIR/bench-<name>.json``, so the seconds of
importing torch and the packages are paid once rather than once a script (about 15 s each on these machines).
torch's thread count and default dtype are put back after each one. Scripts that measure the process's own peak
resident memory (``FRESH_PROCESS``) run in a process of their own: memory the earlier scripts freed would hide their
peaks. A script that fails is reported and the rest still run; the exit status is 1 if any failed.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
FRESH_PROCESS = {"experts_block.py"}  # its --quick peak-RSS figures need a process no other script has used


def main(out_dir: Path) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    failed = []
    sys.path.insert(0, str(ROOT))  # the scripts import their helpers (_harness, _estimate, _rss) from beside them
    for script in sorted(ROOT.glob("[!_]*.py")):  # _*.py: helpers
        argv = sys.argv
        sys.argv = [str(script), "--quick", "--out", str(out_dir / f"bench-{script.stem}.json")]
        start, ok = time.perf_counter(), True
        try:
            if script.name in FRESH_PROCESS:
                subprocess.run([sys.executable, *sys.argv], check=True)
            else:
                runpy.run_path(str(script), run_name="__main__")
        except (Exception, SystemExit):  # SystemExit: argparse errors and sys.exit calls of a script
            traceback.print_exc()
            failed.append(script.name)
            ok = False
        finally:
            sys.argv = argv
            torch.set_num_threads(threads)
            torch.set_default_dtype(dtype)
        print(f"== {script.name}: {time.perf_counter() - start:.1f} s{'' if ok else ' FAILED'}")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
