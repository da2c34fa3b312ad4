"""What docs/gen_tables.py's table builders share: the registry of tables and figures (``@table``, ``figure``), the
benchmark results they read, and how numbers are printed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MiB = 1 << 20
KiB = 1 << 10

TABLES: dict[str, Callable[[], str]] = {}
FIGURES: dict[str, Callable[[], str]] = {}


def table(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    def register(fn: Callable[[], str]) -> Callable[[], str]:
        TABLES[name] = fn
        return fn

    return register


def figure(name: str, fn: Callable[[], str]) -> None:
    FIGURES[name] = fn


def load(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def source(name: str) -> str:
    """The caption's last words: which file, when, on what."""
    data = load(name)
    date = str(data.get("date", ""))[:10]
    torch = data.get("torch", "")
    return f"`benchmarks/results/{name}.json`, {date}, torch {torch}"


def rows(header: list[str], body: list[list[str]], align: list[str] | None = None) -> str:
    align = align or ["---"] * len(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def captioned(caption: str, header: list[str], body: list[list[str]], align: list[str] | None = None) -> str:
    """A table under the sentence that says what was measured, on what, and where the figures come from."""
    return caption + "\n\n" + rows(header, body, align)


def num(x: float, digits: int = 1) -> str:
    return f"{x:,.{digits}f}"


def pct(x: float, digits: int = 2) -> str:
    return f"{x * 100:+.{digits}f}%"


def ratio(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def span(values: list[float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(min(values))} to {fmt(max(values))}"


# --- speed -------------------------------------------------------------------------------------------------------

FAMILY_NAMES = {"qwen3_moe": "Qwen3-MoE", "deepseek_v3": "DeepSeek-V3", "gpt_oss": "GPT-OSS", "mixtral": "Mixtral"}
