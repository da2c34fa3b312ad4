"""FP8 token dispatch (``precision.dispatch_fp8``) round trip on 2 gloo ranks, both dispatchers, bf16 and fp32 tokens
(``_fp8_dispatch_worker.py``): what arrives is exactly the blockwise FP8 round trip of what was sent, the gradient
passes straight through, and the wire carries H + 4 H / 128 bytes a row."""

from pathlib import Path

import _fp8_dispatch_worker as worker
import pytest
import torch

WORKER = Path(__file__).with_name("_fp8_dispatch_worker.py")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, launch_gloo_scenarios):
    """Each rank's record per scenario (dispatcher x token dtype): ``outcomes[scenario]`` is the ranks' list."""
    return launch_gloo_scenarios(WORKER, 2, tmp_path_factory.mktemp("fp8dispatch"))


@pytest.mark.dist
@pytest.mark.parametrize("key", list(worker.SCENARIOS))
def test_tokens_arrive_as_the_fp8_round_trip(outcomes, key):
    assert outcomes.names() == list(worker.SCENARIOS)
    for r in outcomes[key]:
        assert torch.equal(r["tokens"], r["ref_tokens"]), key
        torch.testing.assert_close(r["out"], r["ref_out"], rtol=0, atol=0, msg=str(key))
        torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=0, atol=0, msg=str(key))
        assert 0.005 < r["rel_error"] < 0.04, key  # E4M3 with 1x128 scales: about 2.5%


@pytest.mark.dist
@pytest.mark.parametrize("key", list(worker.SCENARIOS))
def test_wire_bytes_are_the_encoded_rows_and_about_half_of_bf16(outcomes, key):
    name, _ = worker.SCENARIOS[key]
    for r in outcomes[key]:
        assert r["part_bytes_per_row"] == 256 + 4 * 2  # E4M3 data and two fp32 scales
        if name == "alltoall":
            assert r["wire_bytes"] == r["rows"] * r["part_bytes_per_row"]
        assert r["plain_bytes"] > 0
        assert r["wire_bytes"] / r["plain_bytes"] == pytest.approx(264 / 512)
        assert r["wire_bytes"] / r["plain_bytes"] <= 0.53
