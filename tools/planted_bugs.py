"""Does each package catch its own bugs? Plants realistic bugs one at a time in a checkout (each a one-line edit of
the source), runs the owning package's tests against it (``-x``: the first failure is enough) and, with ``--whole``,
the rest of the suite for a bug the owner missed; writes what caught what to a JSON file.

Run it on a checkout nobody else is editing (it edits the source and puts it back; an interrupted run leaves
``git diff`` to show the planted line)::

    git clone -q . /tmp/plant && cd /tmp/plant && uv sync --frozen && uv run --no-sync python tools/planted_bugs.py

Issue 39's first six bugs are the ones its measurement planted (pipeline, context parallelism, FP8 wire, schedules,
the trainer's non-finite guard); the other six were written for the same areas (gathered experts, context-parallel
gradients, expert checkpoints under etp, delayed scaling, resume).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"


@dataclass(frozen=True)
class Bug:
    name: str
    owner: str  # the package whose source it is in
    path: str  # relative to packages/<owner>/src/
    old: str  # the exact text replaced (once)
    new: str


BUGS = (
    Bug(
        "non-finite guard reads the previous step's loss",
        "moe-train",
        "moe_train/loop.py",
        "        not_finite_here = ~(torch.isfinite(losses[0]) & torch.isfinite(grad_norm.to(losses[0].device)))\n",
        "        previous, self._previous = getattr(self, '_previous', losses[0]), losses[0]\n"
        "        not_finite_here = ~(torch.isfinite(previous) & torch.isfinite(grad_norm.to(losses[0].device)))\n",
    ),
    Bug(
        "pipeline gradients divided by the micro-batch count twice",
        "moe-parallel",
        "moe_parallel/staged.py",
        "loss_fn=loss_fn, scale_grads=False)",
        "loss_fn=loss_fn, scale_grads=True)",
    ),
    Bug(
        "context-parallel MTP loss over the rank's own labelled positions",
        "moe-models",
        "moe_models/loss.py",
        "            loss = summed / (labels_BS.shape[0] * (seq - depth) * share)\n",
        "            loss = summed / (targets_BS != IGNORE_INDEX).sum()\n",
    ),
    Bug(
        "FP8 wire decode applies each token's first block scale to the whole row",
        "moe-precision",
        "moe_precision/wire.py",
        "BlockwiseFP8(data.view(E4M3.torch_dtype), scale, (1, self.block))",
        "BlockwiseFP8(data.view(E4M3.torch_dtype), scale[:, :1].expand_as(scale), (1, self.block))",
    ),
    Bug(
        "1F1B in-flight micro-batches pp - r + 1",
        "moe-parallel",
        "moe_parallel/schedules.py",
        "min(microbatches, pp - r)",
        "min(microbatches, pp - r + 1)",
    ),
    Bug(
        "last pipeline stage's loss outside the vocabulary-parallel loss context",
        "moe-parallel",
        "moe_parallel/staged.py",
        "        return vocab_parallel_loss(self.tp)\n",
        "        return vocab_parallel_loss(self.tp if self.pp == 1 else 1)\n",
    ),
    Bug(
        "gathered experts keep one row's input gradient per token (copy, not sum)",
        "moe-experts",
        "moe_experts/gathered.py",
        "out_TH.index_add_(0, _slot_of_row(row_source_N, num_tokens), rows_NH)",
        "out_TH.index_copy_(0, _slot_of_row(row_source_N, num_tokens), rows_NH)",
    ),
    Bug(
        "gathered experts' padding rows read token 0",
        "moe-experts",
        "moe_experts/gathered.py",
        "    return torch.where(row_source_N >= 0, row_source_N, num_tokens)\n",
        "    return row_source_N.clamp(min=0)\n",
    ),
    Bug(
        "context-parallel key/value gather's backward keeps the rank's own gradient only",
        "moe-parallel",
        "moe_parallel/context_parallel.py",
        "        dist.reduce_scatter_tensor(out, g0, op=dist.ReduceOp.SUM, group=ctx.group)\n",
        "        out.copy_(g0.chunk(size)[dist.get_rank(ctx.group)])\n",
    ),
    Bug(
        "expert checkpoint pieces ignore the etp rank's offset",
        "moe-parallel",
        "moe_parallel/checkpoint_layout.py",
        "        offset[spec.unit_dim] += spec.etp_rank * spec.local_units\n",
        "        offset[spec.unit_dim] += 0 * spec.etp_rank * spec.local_units\n",
    ),
    Bug(
        "delayed scaling's most_recent reads the oldest amax",
        "moe-precision",
        "moe_precision/recipes.py",
        'amax = self.history.max() if algo == "max" else self.history[0]',
        'amax = self.history.max() if algo == "max" else self.history[-1]',
    ),
    # (not "set_optimizer_state_dict skipped on load": in one process DCP loads the optimizer's own state tensors in
    # place, so that bug shows only under FSDP, where integration/test_resume.py catches it)
    Bug(
        "a checkpoint records the step before its update",
        "moe-train",
        "moe_train/checkpoint.py",
        '            state["step"] = torch.tensor(step)\n',
        '            state["step"] = torch.tensor(step - 1)\n',
    ),
)


def _pytest(paths: list[str], timeout: float) -> dict:
    """Run pytest on ``paths`` (stop at the first failure); whether it failed, the first failing test, the time."""
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *paths]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"caught": True, "by": f"timed out after {timeout:g} s", "seconds": timeout}
    # pytest's summary lines ("FAILED path::test - why"), not captured log lines that start with a level name
    summary = [line.split(maxsplit=1)[1] for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    failed = [test.split(" - ")[0] for test in summary if "::" in test.split(" ")[0]]
    # a run that ended without naming a failed test (a crash, a collection error) counts as caught, with its output
    ending = (proc.stdout + proc.stderr).strip()[-400:]
    return {
        "caught": proc.returncode not in (0, 5),
        "by": failed[0] if failed else (None if proc.returncode in (0, 5) else f"exit {proc.returncode}: {ending}"),
        "seconds": round(time.monotonic() - start, 1),
    }


def plant_and_test(bug: Bug, whole: bool, timeout: float) -> dict:
    source = PACKAGES / bug.owner / "src" / bug.path
    original = source.read_text()
    if original.count(bug.old) != 1:
        raise SystemExit(f"{bug.name}: the text to replace is not in {source} exactly once (the code moved on)")
    source.write_text(original.replace(bug.old, bug.new))
    try:
        result = {"bug": asdict(bug), "owner": _pytest([f"packages/{bug.owner}/tests"], timeout)}
        if whole and not result["owner"]["caught"]:
            others = [f"packages/{p.name}/tests" for p in sorted(PACKAGES.iterdir()) if p.name != bug.owner]
            result["rest"] = _pytest([*others, "integration"], 4 * timeout)
    finally:
        source.write_text(original)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--whole", action="store_true", help="run the rest of the suite for a bug the owner missed")
    parser.add_argument("--only", type=int, nargs="*", help="the bugs to plant (1-based indices into BUGS)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per package run")
    parser.add_argument("--out", type=Path, default=ROOT / "tools" / "planted_bugs.json")
    args = parser.parse_args()
    chosen = [BUGS[i - 1] for i in args.only] if args.only else list(BUGS)
    results = []
    for bug in chosen:
        result = plant_and_test(bug, args.whole, args.timeout)
        results.append(result)
        seen = result.get("rest", result["owner"])
        print(f"{bug.owner:14s} {'caught' if result['owner']['caught'] else 'MISSED':7s} {bug.name}: {seen['by']}")
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    owned = sum(r["owner"]["caught"] for r in results)
    whole = sum(r["owner"]["caught"] or r.get("rest", {}).get("caught", False) for r in results)
    print(f"owning packages caught {owned} of {len(results)}; the whole suite {whole} of {len(results)}")


if __name__ == "__main__":
    main()
