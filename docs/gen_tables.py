"""Write the measured figures of benchmarks/results/*.json into the docs.

    uv run python docs/gen_tables.py

A table sits in a page between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->``; a figure inside a sentence
between ``<!-- fig:NAME -->`` and ``<!-- /fig -->``. This script rewrites what is between the markers from the JSON
the benchmarks wrote (it never runs a benchmark), so no measured number is typed by hand; the builders are in
docs/tables_*.py, registered by name (docs/table_format.py). integration/test_docs.py fails when a page differs from
what this script writes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the builders beside this script

import tables_finetuning  # noqa: F401  (registers its tables)
import tables_layouts_precision  # noqa: F401  (registers its tables)
import tables_optimizers  # noqa: F401  (registers its tables)
import tables_overlap  # noqa: F401  (registers its tables)
import tables_planner  # noqa: F401  (registers its tables)
import tables_speed_memory  # noqa: F401  (registers its tables)
from table_format import FIGURES, ROOT, TABLES

TABLE = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
FIGURE = re.compile(r"(<!-- fig:([\w.-]+) -->)(.*?)(<!-- /fig -->)")


def pages() -> list[Path]:
    """Every page the markers may sit in: the README and docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# --- rendering ---------------------------------------------------------------------------------------------------


def render(text: str) -> str:
    """``text`` with every marked table and figure written from the JSON; an unknown name is an error."""

    def fill_table(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise KeyError(f"no table {name!r} in docs/gen_tables.py (known: {', '.join(TABLES)})")
        return f"{m.group(1)}{TABLES[name]()}\n{m.group(4)}"

    def fill_figure(m: re.Match) -> str:
        name = m.group(2)
        if name not in FIGURES:
            raise KeyError(f"no figure {name!r} in docs/gen_tables.py (known: {', '.join(FIGURES)})")
        return f"{m.group(1)}{FIGURES[name]()}{m.group(4)}"

    return FIGURE.sub(fill_figure, TABLE.sub(fill_table, text))


def used(text: str) -> set[str]:
    return {m.group(2) for m in TABLE.finditer(text)} | {m.group(2) for m in FIGURE.finditer(text)}


def main() -> int:
    changed = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            page.write_text(new)
            changed.append(page.relative_to(ROOT))
    print("rewrote " + ", ".join(map(str, changed)) if changed else "every table is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
