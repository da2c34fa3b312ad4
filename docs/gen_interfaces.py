"""Regenerate docs/interfaces.md from the packages' ``__all__`` and docstrings.

    uv run python docs/gen_interfaces.py

integration/test_docs.py fails when the page and the code disagree.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from pathlib import Path

PACKAGES = ["moe-dispatch", "moe-experts", "moe-precision", "moe-parallel", "moe-memory", "moe-models", "moe-train"]
CONSTANTS = {
    "ACTIVATIONS": "Activation name -> function on the fused gate+up output.",
    "BACKENDS": "Expert back-end name -> Backend (requirements, install hint, grouped-mm function).",
    "ATTENTION_DIMS": "Attention-side dimension names, fastest-varying first.",
    "EXPERT_DIMS": "Expert-side dimension names, fastest-varying first.",
    "FAMILIES": "HuggingFace checkpoint layouts ModelConfig.family names (Kimi-K2 is a deepseek_v3).",
    "CONVENTIONS": "FLOPs conventions training_flops_per_token accepts (megatron, torchtitan).",
    "PRESETS": "Preset name -> ModelConfig factory: the published sizes and a tiny CPU proxy of each family.",
    "PUBLISHED_PRESETS": "Names of the published-size presets.",
    "TINY_PRESETS": "Names of the tiny CPU proxies (moe-train presets of the same names).",
    "PUBLISHED_SIZES": "Published total / active parameter counts of the published presets.",
    "DISPATCHERS": "Dispatcher names build_dispatcher accepts.",
    "OVERLAP_MODES": "The expert-parallel overlap modes (moe-parallel's ``ep_overlap``): none, chunked, microbatch.",
    "SWIGLU_OAI_ALPHA": "GPT-OSS clamped SwiGLU sigmoid scale (1.702).",
    "SWIGLU_OAI_LIMIT": "GPT-OSS clamped SwiGLU clamp limit (7.0).",
}
HEADER = """# Public interfaces

Each package is versioned on its own (semver). Its public API is the names in its `__all__`,
importable from the top-level module (a public subpackage's names are listed qualified, e.g. `hf.load_pretrained`
for `moe_models.hf.load_pretrained`); anything else is internal and may change in any release. A test
in every package (`tests/test_public_api.py`) keeps a snapshot of these names: changing them means
updating the snapshot, this page (`uv run python docs/gen_interfaces.py`) and the version together
(while at 0.x, a breaking change bumps the minor version). Dependencies between our packages are
pinned to one minor series (e.g. `>=0.2,<0.3`).
"""


def describe(name: str, obj: object) -> str:
    if name in CONSTANTS:
        return f"constant. {CONSTANTS[name]}"
    kind = "class" if inspect.isclass(obj) else "function"
    doc = (inspect.getdoc(obj) or "").split("\n\n")[0].replace("\n", " ")
    return f"{kind}. {doc}"


def render() -> str:
    out = [HEADER]
    for dist in PACKAGES:
        module = importlib.import_module(dist.replace("-", "_"))
        ours = [r.split(";")[0].strip() for r in importlib.metadata.requires(dist) or [] if r.startswith("moe-")]
        optional = [r.split(";")[0].strip() for r in importlib.metadata.requires(dist) or [] if "extra ==" in r]
        required = [r for r in ours if r not in optional]
        deps = ", ".join(f"`{r}`" for r in required) or "torch only (nothing of ours)"
        if optional:
            deps += "; optional: " + ", ".join(f"`{r}`" for r in optional)
        out += [f"## {dist} {module.__version__} (`import {module.__name__}`)", ""]
        out += [(module.__doc__ or "").strip().split("\n")[0], "", f"Depends on: {deps}.", ""]
        out += ["| name | what it is |", "|---|---|"]
        for n in sorted(module.__all__):
            obj = getattr(module, n)
            if inspect.ismodule(obj):  # a public subpackage: its own names, qualified
                out += [f"| `{n}.{m}` | {describe(m, getattr(obj, m))} |" for m in sorted(obj.__all__)]
            elif n != "__version__":
                out.append(f"| `{n}` | {describe(n, obj)} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    Path(__file__).with_name("interfaces.md").write_text(render())
