"""The documentation that states our interfaces stays in step with the code."""

import functools
import importlib
import importlib.util
import inspect
import itertools
import re
import tomllib
import typing
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
README_MAX_LINES = 250


def _pages() -> list[Path]:
    """The prose a user reads: the README, the changelog and docs/*.md (interfaces.md is generated from docstrings)."""
    docs = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "interfaces.md"]
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *docs]


def _script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_docs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interfaces_page_is_generated_from_the_code() -> None:
    generator = _script(ROOT / "docs" / "gen_interfaces.py")
    assert sorted(generator.PACKAGES) == PACKAGES
    assert (ROOT / "docs" / "interfaces.md").read_text() == generator.render(), "run docs/gen_interfaces.py"


def test_measured_tables_are_written_from_the_benchmark_results() -> None:
    generator = _script(ROOT / "docs" / "gen_tables.py")
    used: set[str] = set()
    for page in generator.pages():
        text = page.read_text()
        assert text == generator.render(text), f"{page.relative_to(ROOT)} differs from the JSON: run docs/gen_tables.py"
        used |= generator.used(text)
    unused = sorted((set(generator.TABLES) | set(generator.FIGURES)) - used)
    assert not unused, f"docs/gen_tables.py writes {unused}, which no page shows"
    assert len(generator.TABLES) >= 10


# a figure as the tables print it: a decimal with at least three digits, or a number with thousands separators
_FIGURE = re.compile(r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+)(?![\w.]*\d)")


def _figures(text: str) -> set[str]:
    return {f for f in _FIGURE.findall(text) if sum(c.isdigit() for c in f) >= 3}


def test_no_measured_figure_is_typed_twice() -> None:
    """A number a generated table or figure holds appears nowhere else in the prose (it would not follow a rerun).
    CHANGELOG.md is exempt: its figures are dated statements of what was measured then. Code (commands, versions in
    backticks) is not prose."""
    generator = _script(ROOT / "docs" / "gen_tables.py")
    generated: set[str] = set()
    prose: dict[str, str] = {}
    for page in _pages():
        text = page.read_text()
        for pattern in (generator.TABLE, generator.FIGURE):
            generated |= {f for m in pattern.finditer(text) for f in _figures(m.group(3))}
            text = pattern.sub("", text)
        if page.name != "CHANGELOG.md":
            prose[str(page.relative_to(ROOT))] = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.S)
    assert len(generated) > 100
    twice = {name: sorted(_figures(text) & generated) for name, text in prose.items()}
    twice = {name: figures for name, figures in twice.items() if figures}
    assert not twice, f"figures of the generated tables typed again (refer to the table instead): {twice}"


def test_readme_is_a_front_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES, "the README is a front page; details go to docs/"
    for page in ("docs/running.md", "docs/parallelism.md", "docs/memory.md", "docs/precision.md", "CHANGELOG.md"):
        assert f"({page})" in readme, page


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_links_between_pages_resolve() -> None:
    for page in _pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https: and the like
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
                slugs = {_slug(h) for h in headings}
                assert anchor in slugs, f"{page.relative_to(ROOT)} links to {target}: no such heading"


@functools.cache
def _config_keys() -> set[str]:
    from moe_train.config import MODEL_SOURCE_KEYS, SECTIONS

    keys = {f"{section}.{key}" for section, cls in SECTIONS.items() for key in typing.get_type_hints(cls)}
    return keys | {f"model.{key}" for key in MODEL_SOURCE_KEYS}


def _shown_keys(text: str) -> set[str]:
    """``--section.key`` anywhere, and ``section.key`` (with or without a value) as a code span of its own."""
    from moe_train.config import SECTIONS

    flags = set(re.findall(r"(?<![\w-])--([A-Za-z_]\w*\.\w+)", text)) - {"section.key"}  # the placeholder
    sections = "|".join(SECTIONS)
    spans = set(re.findall(rf"`((?:{sections})\.\w+)(?:[ =][^`]*)?`", text))
    return flags | spans


def test_every_config_key_the_docs_show_exists() -> None:
    shown = {}
    for page in _pages():
        for key in _shown_keys(page.read_text()):
            shown.setdefault(key, str(page.relative_to(ROOT)))
    assert len(shown) > 40
    unknown = {key: page for key, page in shown.items() if key not in _config_keys()}
    assert not unknown, f"config keys the docs show that moe_train.config does not have: {unknown}"


@functools.cache
def _nox_sessions() -> tuple[set[str], set[str]]:
    """(every session of noxfile.py, those ``uv run nox`` runs), from nox's own registry."""
    import nox
    import nox.registry

    _script(ROOT / "noxfile.py")
    return set(nox.registry.get()), set(nox.options.sessions)


def test_the_nox_sessions_the_docs_name_are_the_noxfiles() -> None:
    sessions, default = _nox_sessions()
    for page in _pages():
        for name in re.findall(r"nox -s ([\w-]+)", page.read_text()):
            assert name in sessions, f"{page.relative_to(ROOT)} names nox session {name!r}; noxfile.py has {sessions}"
    listed = {}
    for line in (ROOT / "docs" / "testing.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[\w-]+`", cells[0]):
            listed[cells[0].strip("`")] = cells[2].startswith("yes")
    assert set(listed) == sessions, "docs/testing.md's table of sessions and noxfile.py differ"
    assert {name for name, runs in listed.items() if runs} == default, "which sessions `uv run nox` runs"


def _field_errors(dist: str) -> set[str]:
    """The errors a library package exports that carry a field of its config (``field``, ``value``, ``reason``)."""
    module = importlib.import_module(dist.replace("-", "_"))
    found = set()
    for name in module.__all__:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) and issubclass(obj, ValueError)) or "__init__" not in vars(obj):
            continue
        if list(inspect.signature(obj.__init__).parameters)[1:4] == ["field", "value", "reason"]:
            found.add(f"{module.__name__}.{name}")
    return found


def test_architecture_error_table_names_the_errors_the_packages_raise() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Errors")[1].split("\n## ")[0]
    table = set(re.findall(r"^\| `(moe_\w+\.\w+)` \|", section, re.M))
    assert table
    for dotted in sorted(table):
        module, _, name = dotted.rpartition(".")
        cls = getattr(importlib.import_module(module), name, None)
        assert inspect.isclass(cls) and issubclass(cls, ValueError), f"architecture.md names {dotted}, not an error"
    libraries = set().union(*(_field_errors(dist) for dist in PACKAGES if dist != "moe-train"))
    assert table == libraries, "architecture.md's error table and the packages' field errors differ"
    from moe_train.config import _field_error_sections

    for cls in _field_error_sections():
        assert f"`{cls.__name__}` -> `{_field_error_sections()[cls]}.<field>`" in " ".join(section.split()), cls


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


def test_models_page_example_of_the_model_families_runs() -> None:
    page = (ROOT / "docs" / "models.md").read_text()
    code = page.split("## HuggingFace checkpoints")[1].split("```python")[1].split("```")[0]
    namespace: dict = {}
    exec(compile(code, "docs/models.md", "exec"), namespace)
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


def test_plan_search_uses_the_efficiency_its_benchmark_fitted() -> None:
    """``moe-train plan --search``'s default efficiency is the one benchmarks/plan_search.py fitted to the published
    runs (rerunning the benchmark after a change to the time model refits it: set the constant to the new value)."""
    import json

    from moe_train.layout_search import DEFAULT_EFFICIENCY

    fitted = json.loads((ROOT / "benchmarks" / "results" / "plan_search.json").read_text())["fitted_efficiency"]
    assert fitted == DEFAULT_EFFICIENCY
