"""Build the folder of pure-Python test dependencies the GPU machine lacks: pytest and hypothesis and what they
import, at the versions in uv.lock, as one flat folder of importable packages to put on PYTHONPATH there (it has
torch, Triton and transformers of its own, no network and nothing of ours installed)::

    python benchmarks/gpu/build_test_deps.py benchmarks/gpu/.deps       # here, with uv and the registry
    benchmarks/gpu/gpu_check.sh "$OUT" --deps benchmarks/gpu/.deps      # there (the default --deps)

The packages are ``ROOTS`` and their dependencies as uv.lock records them, those whose markers hold on the target
(CPython ``--python-version``, default 3.12, Linux ``--platform``, default x86_64): ``uv pip install --target DIR
--no-deps --only-binary :all:`` of each ``name==version``, for that interpreter and platform (hypothesis ships a
compiled extension, so the folder is for one Python minor version). Then, to stay under 10 MB (the device tool
carries 64 MiB in all): pygments keeps only the lexers pytest uses (Python and diff: it highlights source and
diffs in failure reports; the other ~550 lexer modules are 4 MB), and ``bin/`` goes. ``MANIFEST.json`` in the
folder says what it holds, for which target, and what was left out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROOTS = ("pytest", "hypothesis")
KEEP_LEXERS = {"__init__.py", "_mapping.py", "python.py", "diff.py"}  # pygments.lexers modules pytest imports
LIMIT_BYTES = 10_000_000


def lock_packages(lock: Path) -> dict[str, dict]:
    return {p["name"]: p for p in tomllib.loads(lock.read_text())["package"]}


def marker_holds(marker: str | None, python: str, machine: str) -> bool:
    """Whether a dependency's marker holds on the target (CPython ``python`` on Linux ``machine``)."""
    if not marker:
        return True
    from packaging.markers import Marker  # pytest's own dependency: present wherever this runs under uv

    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": machine,
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    return Marker(marker).evaluate(env)


def closure(packages: dict[str, dict], roots: tuple[str, ...], python: str, machine: str) -> dict[str, str]:
    """``name -> version`` of ``roots`` and everything they need on the target, from the lock."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        entry = packages[name]
        found[name] = entry["version"]
        todo += [d["name"] for d in entry.get("dependencies", []) if marker_holds(d.get("marker"), python, machine)]
    return dict(sorted(found.items()))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def build(out: Path, python: str = "3.12", machine: str = "x86_64", lock: Path = ROOT / "uv.lock") -> dict:
    pins = closure(lock_packages(lock), ROOTS, python, machine)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    command = [
        "uv",
        "pip",
        "install",
        "--target",
        str(out),
        "--no-deps",
        "--only-binary",
        ":all:",
        "--python-version",
        python,
        "--python-platform",
        f"{machine}-manylinux_2_28",
        "--no-progress",
        *(f"{name}=={version}" for name, version in pins.items()),
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    pruned = []
    lexers = out / "pygments" / "lexers"
    if lexers.is_dir():
        for path in sorted(lexers.iterdir()):
            if path.name not in KEEP_LEXERS:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        pruned.append("pygments/lexers/* but " + ", ".join(sorted(KEEP_LEXERS)))
    for leftover in ("bin",):
        if (out / leftover).exists():
            shutil.rmtree(out / leftover)
            pruned.append(f"{leftover}/")
    for cache in out.rglob("__pycache__"):
        shutil.rmtree(cache, ignore_errors=True)
    manifest = {
        "packages": pins,
        "python": python,
        "platform": f"{machine}-manylinux_2_28",
        "from": "uv.lock",
        "pruned": pruned,
    }
    manifest["bytes"] = folder_bytes(out)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=ROOT / "benchmarks" / "gpu" / ".deps")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (major.minor)")
    parser.add_argument("--platform", default="x86_64", help="the GPU machine's CPU architecture")
    args = parser.parse_args()
    manifest = build(args.out, args.python_version, args.platform)
    size = manifest["bytes"]
    print(f"{args.out}: {', '.join(f'{n}=={v}' for n, v in manifest['packages'].items())}; {size / 1e6:.1f} MB")
    if size > LIMIT_BYTES:
        sys.exit(f"{args.out} is {size / 1e6:.1f} MB, over {LIMIT_BYTES / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
