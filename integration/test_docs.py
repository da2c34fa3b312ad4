"""The documentation that states our interfaces stays in step with the code."""

import importlib
import importlib.util
import itertools
import re
import tomllib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())


def test_interfaces_page_is_generated_from_the_code() -> None:
    spec = importlib.util.spec_from_file_location("gen_interfaces", ROOT / "docs" / "gen_interfaces.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert sorted(generator.PACKAGES) == PACKAGES
    assert (ROOT / "docs" / "interfaces.md").read_text() == generator.render(), "run docs/gen_interfaces.py"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@pytest.mark.parametrize("dist", PACKAGES)
def test_package_layout_and_pinned_internal_dependencies(dist: str) -> None:
    project = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())["project"]
    module = importlib.import_module(dist.replace("-", "_"))
    assert project["version"] == module.__version__
    assert (ROOT / "packages" / dist / "src" / module.__name__ / "py.typed").is_file()
    requirements = [*project["dependencies"], *itertools.chain(*project.get("optional-dependencies", {}).values())]
    for requirement in (r for r in requirements if r.startswith("moe-")):
        # each internal dependency is pinned to one minor series that holds the workspace's current version
        name, low, high = re.fullmatch(r"(moe-[a-z]+)>=([0-9.]+),<([0-9.]+)", requirement).groups()
        current = _version(importlib.import_module(name.replace("-", "_")).__version__)
        assert _version(low) <= current < _version(high), requirement
        assert _version(high)[:2] == (0, _version(low)[1] + 1), requirement
    # the floor the floors nox session tests (noxfile.py: FLOOR_TORCH)
    floor = re.search(r'FLOOR_TORCH, FLOOR_TRITON = "([0-9]+\.[0-9]+)', (ROOT / "noxfile.py").read_text()).group(1)
    assert f"torch>={floor}" in project["dependencies"], (dist, floor)


def test_readme_states_the_two_commands_and_ci_runs_the_test_one() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "uv run moe-train" in readme and "uv run nox" in readme
    assert "\nuv run nox\n" in (ROOT / ".ci" / "run").read_text()


def test_readme_example_of_the_parts_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Using the parts alone")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["out_TH"].shape == (2048, 512)
    assert namespace["router"].expert_bias.abs().sum() > 0  # the bias update ran


def test_readme_example_of_the_model_families_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    code = readme.split("## Model families and HuggingFace checkpoints")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    ids = namespace["ids"]
    torch.testing.assert_close(namespace["again"](ids).logits, namespace["model"](ids).logits)
    assert namespace["experts_0_to_3"]["layers.1.mlp.experts.w_down_EFH"].shape[0] == 4


def _package_table(page: Path) -> dict[str, str]:
    """dist name -> its "may import" cell (the last), from ``page``'s table with one row per package."""
    rows = {}
    for line in page.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`moe[-_][a-z]+`", cells[0]):
            rows[cells[0].strip("`").replace("_", "-")] = cells[-1].replace("`", "").removesuffix(" only")
    return rows


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md"])
def test_package_tables_match_the_declared_dependencies(page: str) -> None:
    rows = _package_table(ROOT / page)
    assert sorted(rows) == PACKAGES
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    ignored = [rule for c in contracts for rule in c.get("ignore_imports", [])]
    for dist, may_import in rows.items():
        project = tomllib.loads((ROOT / "packages" / dist / "pyproject.toml").read_text())["project"]
        ours = (r for r in project["dependencies"] if r.startswith("moe-"))
        declared = {re.match(r"moe-[a-z]+", r).group().replace("-", "_") for r in ours}
        named = set() if may_import == "nothing of ours" else {m.strip() for m in may_import.split(",")}
        assert {m.split(".")[0] for m in named} == declared, (dist, may_import)
        for submodule in (m for m in named if "." in m):  # "moe_parallel.plan": the contract lets only that in
            assert f"{dist.replace('-', '_')}.** -> {submodule}" in ignored, submodule


def test_readme_status_versions_are_the_packages_versions() -> None:
    readme = (ROOT / "README.md").read_text()
    status = dict(re.findall(r"\*\*(moe-[a-z]+) ([0-9]+\.[0-9]+\.[0-9]+)\*\*", readme))
    assert sorted(status) == PACKAGES
    for dist, version in status.items():
        assert importlib.import_module(dist.replace("-", "_")).__version__ == version, dist


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_architecture_page_names_real_files_and_functions() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text()
    spans = re.findall(r"`([^`\n]+)`", text)
    files = {s for s in spans if re.fullmatch(r"[\w./*-]+\.(py|toml|json|md)", s) and "*" not in s}
    sources = [*(ROOT / "packages").glob("*/src")]
    for name in sorted(files):
        found = (ROOT / name).exists() or any((src / name).exists() for src in sources)
        assert found, f"docs/architecture.md names {name}, which does not exist"
    names = {s for s in spans if re.fullmatch(r"moe_[a-z]+(\.[A-Za-z_]\w*)+", s)}
    assert len(files) > 10 and len(names) > 10
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"docs/architecture.md names {missing}, which the packages do not have"
