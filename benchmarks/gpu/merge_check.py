"""The last step of ``benchmarks/gpu/gpu_check.sh``: everything its steps left in OUTDIR merged into ONE JSON,
``OUTDIR/gpu_check.json``: the date, the card, the versions, the probe, the gpu tests' summary, each suite section's
result or error, and each step's exit status, seconds and (when it failed) last lines of output.

A section whose process died before writing it (killed at its time limit, a crash in CUDA) gets
``{"error": "step ... exited N", "log_tail": [...]}`` from its step's log. Imports nothing but the standard library,
so it runs whatever broke before it. Exit status 0 when every step passed, 1 otherwise (the JSON is written either
way)::

    python benchmarks/gpu/merge_check.py OUTDIR [--budget S --elapsed S --smoke 0|1 --deps DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import xml.etree.ElementTree as ET
from pathlib import Path

SECTIONS = ("step", "experts", "permutation", "fp8", "offload", "sync", "graphs")


def tail(path: Path, lines: int = 20) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def read_steps(out: Path) -> dict[str, dict]:
    steps = {}
    path = out / "steps.tsv"
    if not path.exists():
        return steps
    for line in path.read_text().splitlines()[1:]:
        name, rc, seconds, budget, log = line.split("\t")
        status = {"0": "ok", "124": "timed out", "137": "timed out", "skipped": "skipped"}.get(rc, "failed")
        entry: dict = {"status": status, "rc": None if rc == "skipped" else int(rc), "seconds": float(seconds)}
        entry["budget_s"] = int(budget)
        if status != "ok":
            entry["log_tail"] = tail(Path(log))
        entry["log"] = str(Path(log).relative_to(out)) if Path(log).is_relative_to(out) else log
        steps[name] = entry
    return steps


def tests_summary(out: Path) -> dict:
    """Counts from pytest's junit XML, and each failure or error with its message's first line."""
    path = out / "gpu_tests.xml"
    if not path.exists():
        return {"error": "no junit XML (the tests step did not get as far as writing it)"}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        return {"error": f"junit XML unreadable: {err}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    problems, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                problems.append({"test": name, "kind": kind, "message": (node.get("message") or "")[:500]})
        node = case.find("skipped")
        if node is not None:
            skipped.append({"test": name, "reason": (node.get("message") or "")[:200]})
    return {**counts, "problems": problems, "skipped_tests": skipped[:50]}


def sections(out: Path, steps: dict[str, dict]) -> dict[str, dict]:
    found: dict[str, dict] = {}
    meta: dict = {}
    for path in sorted((out / "suite").glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            meta.setdefault("unreadable", []).append(f"{path.name}: {err}")
            continue
        for key, value in report.items():
            if key in SECTIONS:
                found[key] = value
            elif key in ("device", "torch", "sizes", "smoke"):
                meta[key] = value
    for name in SECTIONS:
        if name in found:
            continue
        step = steps.get(f"suite:{name}") or steps.get("suite:suite") or {}
        why = f"step exited {step.get('rc')} ({step.get('status')})" if step else "its step did not run"
        if step.get("status") == "skipped":
            why = "its step was skipped (the time budget was spent)"
        found[name] = {"error": f"no result: {why}", "log_tail": step.get("log_tail", [])}
    return {"suite": meta, **found}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--elapsed", type=float, default=None)
    parser.add_argument("--smoke", default="0")
    parser.add_argument("--deps", default="")
    args = parser.parse_args()
    out = args.out
    steps = read_steps(out)
    try:
        probe = json.loads((out / "probe.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        probe = {"error": f"no probe result: {err}", "log_tail": steps.get("probe", {}).get("log_tail", [])}
    merged = sections(out, steps)
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "smoke": args.smoke == "1",
        "card": probe.get("card"),
        "versions": probe.get("versions"),
        "deps": args.deps or None,
        "budget_s": args.budget,
        "elapsed_s": args.elapsed,
        "steps": steps,
        "probe": probe,
        "tests": tests_summary(out),
        "suite": merged.pop("suite"),
        "sections": merged,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    bad = [n for n, s in steps.items() if s["status"] != "ok"]
    errors = [n for n, s in merged.items() if isinstance(s, dict) and "error" in s]
    t = report["tests"]
    print(
        f"steps: {len(steps) - len(bad)} ok"
        + (f", not ok: {', '.join(bad)}" if bad else "")
        + f"; sections with an error: {', '.join(errors) or 'none'}"
        + f"; gpu tests: {t.get('passed', '?')} passed, {t.get('failures', '?')} failed, "
        + f"{t.get('errors', '?')} errors, {t.get('skipped', '?')} skipped"
    )
    print(f"wrote {out / 'gpu_check.json'}")
    return 1 if bad or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
