"""Every ``from moe_<package>... import name`` in the repository names something that exists: a name removed from one
package and still imported inside a function elsewhere (where no import-time error shows it) fails here, not in the
one run that reaches that function."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("moe_dispatch", "moe_experts", "moe_precision", "moe_parallel", "moe_memory", "moe_models", "moe_train")


def unresolved_imports(files: list[Path]) -> list[str]:
    """``file:line: from module import name`` for each of our names that does not resolve."""
    missing = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS):
                continue
            try:
                module = importlib.import_module(node.module)
            except ImportError as err:
                missing.append(f"{path}:{node.lineno}: {node.module} ({err})")
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    continue
                try:
                    importlib.import_module(f"{node.module}.{alias.name}")  # a submodule
                except ImportError:
                    missing.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
    return missing


def test_every_import_of_our_names_resolves() -> None:
    files = [
        path
        for folder in ("packages", "integration", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
    ]
    assert len(files) > 200
    assert unresolved_imports(files) == []


def test_a_removed_name_is_found(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text("def export():\n    from moe_train.export import DTYPES, export_hf\n")
    assert unresolved_imports([planted]) == [f"{planted}:2: from moe_train.export import DTYPES"]
