"""On 2 gloo ranks (one process group for the module): packed rows of documents through moe_models' model under
context parallelism (cp=2), under tensor + sequence parallelism (tp=2) and over two pipeline stages (pp=2) give one
process's logits (relative 1e-4), for GQA with QK-norm, sinks with a sliding window, MLA with MTP, partial rotary
(GLM-4.5) and q/k norms across heads (OLMoE) (_packed_documents_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _packed_documents_worker import FAMILIES, LAYOUTS

pytestmark = pytest.mark.dist

WORLD = 2
WORKER = Path(__file__).with_name("_packed_documents_worker.py")


@pytest.fixture(scope="module")
def outcomes(launch_gloo_scenarios, tmp_path_factory):
    return launch_gloo_scenarios(WORKER, WORLD, tmp_path_factory.mktemp("packed_documents"))


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "pp=2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_split_over_two_ranks_equal_one_process(outcomes, family: str, layout: str) -> None:
    ranks = outcomes[f"{family} {layout}"]
    if layout == "cp=2":  # each rank its load-balanced chunks: 0-15 and 48-63, 16-47
        assert [r["positions"] for r in ranks] == [[*range(16), *range(48, 64)], list(range(16, 48))]
    for rank, result in enumerate(ranks):
        assert result["logits"] < 1e-4, (rank, result)
        assert all(err < 1e-4 for err in result["mtp"]), (rank, result)
        assert result["grads_finite"], rank
        # the control: the same rows without their documents are another computation
        assert result["unmasked"] > 1e-2, (rank, result)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_documents_through_two_pipeline_stages_equal_one_process(outcomes, family: str) -> None:
    ranks = outcomes[f"{family} pp=2"]
    (last,) = [result for result in ranks if result["last"]]
    assert last["logits"] < 1e-4 and all(err < 1e-4 for err in last["mtp"]), last
    assert last["unmasked"] > 1e-2, last
    held = [name for result in ranks for name in result["grads"]]
    assert {"embed_tokens.weight", "lm_head.weight", "layers.0.input_norm.weight", "layers.1.input_norm.weight"} <= set(
        held
    )
    for rank, result in enumerate(ranks):
        for name, err in result["grads"].items():
            assert err < 1e-5, (rank, name, err)
