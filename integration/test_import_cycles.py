"""No import cycle between the modules of one package, in every package of ours (``[tool.importlinter]``'s
``root_packages``). import-linter's contracts in pyproject.toml check the layers between packages; this checks the
modules inside each.

Every import statement counts, the ones inside functions too: a function-level import is how a cycle hides (the
module imports fine, the cycle stays). Imports under ``if TYPE_CHECKING:`` do not count: they never run, and an
annotation naming a class of a module that imports this one is no cycle at run time. (import-linter's
``acyclic_siblings`` contract would count them, unless the session-wide ``exclude_type_checking_imports`` were set,
which would also loosen the contracts between packages: hence a test over grimp's graph.)
"""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"]


def import_cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The import cycles among ``package``'s modules: each strongly connected component of more than one module of
    the graph of imports between them (sorted module names; the components sorted)."""
    modules = {m for m in graph.modules if m == package or m.startswith(package + ".")}
    imports = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in sorted(modules)}
    # Tarjan's algorithm, iterative
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in imports:
        if root in index:
            continue
        work = [(root, iter(imports[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(imports[target])))
            elif target in on_stack:
                low[module] = min(low[module], index[target])
    return sorted(cycles)


def describe(graph: grimp.ImportGraph, cycle: list[str]) -> str:
    """The modules of ``cycle`` and every import between them, with its line."""
    lines = [f"cycle between {', '.join(cycle)}:"]
    for importer in cycle:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & set(cycle)):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                where = f"line {detail['line_number']}: {detail['line_contents']}"
                lines.append(f"  {importer} -> {imported}  ({where})")
    return "\n".join(lines)


def build_graph(*packages: str) -> grimp.ImportGraph:
    return grimp.build_graph(*packages, exclude_type_checking_imports=True, cache_dir=None)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return build_graph(*PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_between_the_modules_of_a_package(graph: grimp.ImportGraph, package: str) -> None:
    cycles = import_cycles(graph, package)
    assert not cycles, f"import cycles in {package}:\n" + "\n".join(describe(graph, c) for c in cycles)


PLANTED = {
    "__init__.py": "from planted.a import A\n",
    # a -> b at the top, b -> a inside a function: the cycle the test must find
    "a.py": "from planted.b import helper\n\nA = 1\n",
    "b.py": "def helper():\n    from planted.a import A\n\n    return A\n",
    # c <-> d through a TYPE_CHECKING import only: not a cycle at run time
    "c.py": "from planted.d import D\n",
    "d.py": """
        from __future__ import annotations
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from planted.c import D

        D = 1
    """,
    # e and f import a and each other's nothing: no cycle
    "e.py": "import planted.a\n",
    "f.py": "from planted import e\n",
}


def test_a_planted_cycle_is_found_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "planted").mkdir()
    for name, source in PLANTED.items():
        (tmp_path / "planted" / name).write_text(textwrap.dedent(source).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    planted = build_graph("planted")
    cycles = import_cycles(planted, "planted")
    assert cycles == [["planted.a", "planted.b"]]
    message = describe(planted, cycles[0])
    assert "planted.a -> planted.b  (line 1: from planted.b import helper)" in message
    assert "planted.b -> planted.a  (line 2: from planted.a import A)" in message
