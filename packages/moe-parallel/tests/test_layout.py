"""ParallelLayout: size checks (incl. parallel folding), rank coordinates and process groups."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moe_parallel import ATTENTION_DIMS, EXPERT_DIMS, LayoutError, ParallelConfig, ParallelLayout

SIDES = ("attention", "expert")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rank_from_coords(coords: dict[str, int], sizes: dict[str, int]) -> int:
    """Mixed-radix number with the first dimension fastest (the documented rank order)."""
    rank, stride = 0, 1
    for dim, size in sizes.items():
        rank += coords[dim] * stride
        stride *= size
    return rank


# ----------------------------------------------------------------------------- valid layouts


def test_plain_data_parallel_fills_dp_shard():
    layout = ParallelLayout(8)
    assert layout.dp_shard == 8
    assert layout.dp == 8
    assert layout.etp == 1
    assert layout.edp == 8


def test_dp_shard_minus_one_takes_what_is_left():
    layout = ParallelLayout(16, tp=2, cp=2, dp_replicate=2)
    assert layout.dp_shard == 2
    assert layout.dp == 4
    assert layout == ParallelLayout(16, tp=2, cp=2, dp_replicate=2, dp_shard=2)


def test_etp_defaults_to_tp_like_megatron():
    layout = ParallelLayout(8, tp=2, ep=2)
    assert layout.etp == 2
    assert layout.edp == 2  # 8 / (etp 2 * ep 2)
    assert ParallelLayout(8, tp=2, ep=2, etp=1).edp == 4


def test_folding_world8_ep_exceeds_dp():
    # attention tp=2 x dp=4, experts spread over all 8 ranks: ep (8) > dp (4)
    layout = ParallelLayout(8, tp=2, dp_shard=4, ep=8, etp=1)
    assert layout.dp == 4
    assert layout.ep == 8
    assert layout.edp == 1
    assert layout.sizes("attention") == {"tp": 2, "cp": 1, "dp_shard": 4, "dp_replicate": 1, "pp": 1}
    assert layout.sizes("expert") == {"etp": 1, "ep": 8, "edp": 1, "pp": 1}


def test_folding_world4_ep_over_dp_shard():
    layout = ParallelLayout(4, dp_shard=4, ep=4)
    assert (layout.etp, layout.ep, layout.edp) == (1, 4, 1)


def test_world4_tp2_ep4_needs_etp1():
    # etp defaults to tp=2, and 2 x 4 does not fit 4 ranks; with etp=1 it folds fine
    with pytest.raises(LayoutError, match=r"^ep=4: etp\(2\) x ep\(4\) x pp\(1\) = 8"):
        ParallelLayout(4, tp=2, ep=4)
    layout = ParallelLayout(4, tp=2, ep=4, etp=1)
    assert (layout.dp_shard, layout.edp) == (2, 1)


def test_pipeline_parallel_with_folding():
    layout = ParallelLayout(16, tp=2, pp=2, ep=4)
    assert layout.dp_shard == 4
    assert layout.edp == 1  # 16 / (etp 2 * ep 4 * pp 2)


# ----------------------------------------------------------------------------- invalid layouts


def test_attention_product_mismatch_suggests_dp_shard():
    with pytest.raises(LayoutError) as err:
        ParallelLayout(8, tp=2, dp_shard=2)
    msg = str(err.value)
    assert err.value.field == "dp_shard" and msg.startswith("dp_shard=2: ")
    assert "tp(2)" in msg and "dp_shard(2)" in msg and "= 4 != world_size 8" in msg
    assert "dp_shard=4" in msg
    ParallelLayout(8, tp=2, dp_shard=4)  # the suggestion works


def test_attention_product_not_dividing_world_names_product():
    with pytest.raises(LayoutError) as err:
        ParallelLayout(8, tp=3, dp_shard=1)
    assert err.value.field == "dp_shard"
    assert "= 3" in str(err.value) and "must divide 8" in str(err.value)


def test_fill_impossible_lists_divisors():
    with pytest.raises(LayoutError) as err:
        ParallelLayout(8, tp=3)
    msg = str(err.value)
    assert err.value.field == "tp" and msg.startswith("tp=3: tp*cp*dp_replicate*pp = 3 does not divide world_size 8")
    assert "3" in msg and "world_size 8" in msg
    assert "[1, 2, 4, 8]" in msg


def test_expert_side_error_suggests_exactly_the_eps_that_fit():
    with pytest.raises(LayoutError) as err:
        ParallelLayout(8, tp=2, pp=2, ep=4)
    msg = str(err.value)
    assert err.value.field == "ep" and msg.startswith("ep=4: ")
    assert "etp(2) x ep(4) x pp(2) = 16" in msg and "world_size 8" in msg
    suggested = [int(x) for x in re.search(r"ep can be one of \[([\d, ]*)\]", msg).group(1).split(",")]
    assert suggested == [1, 2]
    for ep in suggested:
        ParallelLayout(8, tp=2, pp=2, ep=ep)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tp": 0}, "tp"),
        ({"cp": 0}, "cp"),
        ({"dp_replicate": -1}, "dp_replicate"),
        ({"pp": 0}, "pp"),
        ({"ep": 0}, "ep"),
        ({"etp": 0}, "etp"),
        ({"dp_shard": 0}, "dp_shard"),
        ({"dp_shard": -2}, "dp_shard"),
    ],
)
def test_nonpositive_sizes_rejected_by_name(kwargs, field):
    with pytest.raises(LayoutError) as err:
        ParallelLayout(8, **kwargs)
    value = kwargs[field]
    assert (err.value.field, err.value.value) == (field, value)
    expected = "must be at least 1, or -1 to fill" if field == "dp_shard" else "must be at least 1"
    assert str(err.value) == f"{field}={value}: {expected}"


def test_world_size_zero_rejected():
    with pytest.raises(LayoutError, match="^world_size=0: must be at least 1$") as err:
        ParallelLayout(0)
    assert err.value.field == "world_size"


# ----------------------------------------------------------------------------- coordinates


def test_hand_checked_coords_world8_tp2_dp4():
    layout = ParallelLayout(8, tp=2, dp_shard=4)
    assert layout.coords(5, "attention") == {"tp": 1, "cp": 0, "dp_shard": 2, "dp_replicate": 0, "pp": 0}
    # etp follows tp (2), so the expert side is etp=2 x ep=1 x edp=4
    assert layout.coords(5, "expert") == {"etp": 1, "ep": 0, "edp": 2, "pp": 0}
    folded = ParallelLayout(8, tp=2, dp_shard=4, ep=8, etp=1)
    assert folded.coords(5, "expert") == {"etp": 0, "ep": 5, "edp": 0, "pp": 0}


def test_hand_checked_coords_dp_shard_faster_than_dp_replicate():
    layout = ParallelLayout(16, tp=2, cp=2, dp_replicate=2, dp_shard=2, ep=4, etp=1)  # edp 4
    # 13 = 0b1101: tp=1, cp=0, dp_shard=1, dp_replicate=1
    assert layout.coords(13, "attention") == {"tp": 1, "cp": 0, "dp_shard": 1, "dp_replicate": 1, "pp": 0}
    assert layout.coords(13, "expert") == {"etp": 0, "ep": 1, "edp": 3, "pp": 0}
    assert layout.group_ranks("dp_replicate", "attention")[0] == [0, 8]
    assert layout.group_ranks("cp", "attention")[0] == [0, 2]


def test_hand_checked_coords_with_pipeline():
    layout = ParallelLayout(8, tp=2, pp=2, ep=2)  # dp_shard 2, etp 2, edp 1
    assert layout.coords(6, "attention") == {"tp": 0, "cp": 0, "dp_shard": 1, "dp_replicate": 0, "pp": 1}
    assert layout.coords(6, "expert") == {"etp": 0, "ep": 1, "edp": 0, "pp": 1}
    assert layout.coords(3, "attention") == {"tp": 1, "cp": 0, "dp_shard": 1, "dp_replicate": 0, "pp": 0}
    assert layout.coords(3, "expert") == {"etp": 1, "ep": 1, "edp": 0, "pp": 0}


def test_hand_checked_groups_world8_tp2_dp4():
    layout = ParallelLayout(8, tp=2, dp_shard=4)
    assert layout.group_ranks("tp", "attention") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.group_ranks("dp_shard", "attention") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.group_ranks("pp", "attention") == [[r] for r in range(8)]
    folded = ParallelLayout(8, tp=2, dp_shard=4, ep=8, etp=1)
    assert folded.group_ranks("ep", "expert") == [list(range(8))]
    assert folded.group_ranks("edp", "expert") == [[r] for r in range(8)]


@pytest.mark.parametrize("rank", [-1, 8])
def test_coords_rejects_out_of_range_rank(rank):
    with pytest.raises(ValueError, match=rf"rank={rank}"):
        ParallelLayout(8).coords(rank, "attention")


def test_rank_map_lists_every_rank_and_its_experts():
    layout = ParallelLayout(4, dp_shard=4, ep=4)
    table = layout.rank_map(num_experts=8).splitlines()
    assert len(table) == 5  # header + one row per rank
    for rank, row in enumerate(table[1:]):
        assert row.split()[0] == str(rank)
        assert f"dp_shard={rank}" in row and f"ep={rank}" in row
        assert row.endswith(f"holds experts {2 * rank}..{2 * rank + 1}")
    assert "holds experts" not in layout.rank_map(num_experts=6)  # 6 experts do not split over ep=4
    assert "holds experts" not in layout.rank_map()


# ----------------------------------------------------------------------------- config


def test_parallel_config_builds_the_same_layout():
    cfg = ParallelConfig(tp=2, ep=8, etp=1)
    assert cfg.layout(8) == ParallelLayout(8, tp=2, dp_shard=4, ep=8, etp=1)
    assert ParallelConfig().layout(4) == ParallelLayout(4, dp_shard=4)
    assert ParallelConfig(tp=2).layout(4).etp == 2
    with pytest.raises(LayoutError, match=r"^ep=3: etp\(1\) x ep\(3\)"):
        ParallelConfig(ep=3).layout(4)


# ----------------------------------------------------------------------------- property tests


@st.composite
def layouts(draw):
    """A random valid layout: attention sizes first (their product is the world), then etp x ep."""
    tp, cp, dp_replicate, dp_shard, pp = (draw(st.integers(1, 4)) for _ in range(5))
    world = tp * cp * dp_replicate * dp_shard * pp
    assume(world <= 96)  # keeps the per-rank loops quick
    per_stage = world // pp
    etp = draw(st.sampled_from(_divisors(per_stage)))
    ep = draw(st.sampled_from(_divisors(per_stage // etp)))
    fill = draw(st.booleans())
    layout = ParallelLayout(
        world, tp=tp, cp=cp, dp_replicate=dp_replicate, dp_shard=-1 if fill else dp_shard, pp=pp, ep=ep, etp=etp
    )
    return layout, dp_shard


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_sizes_multiply_to_world(case):
    layout, dp_shard = case
    assert layout.dp_shard == dp_shard
    assert math.prod(layout.sizes("attention").values()) == layout.world_size
    assert math.prod(layout.sizes("expert").values()) == layout.world_size
    assert layout.edp * layout.etp * layout.ep * layout.pp == layout.world_size
    assert tuple(layout.sizes("attention")) == ATTENTION_DIMS == ("tp", "cp", "dp_shard", "dp_replicate", "pp")
    assert tuple(layout.sizes("expert")) == EXPERT_DIMS == ("etp", "ep", "edp", "pp")


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_coords_are_unique_in_range_and_in_documented_order(case):
    layout, _ = case
    for side in SIDES:
        sizes = layout.sizes(side)
        seen = set()
        for rank in range(layout.world_size):
            c = layout.coords(rank, side)
            assert all(0 <= c[d] < sizes[d] for d in sizes)
            assert _rank_from_coords(c, sizes) == rank
            seen.add(tuple(c.values()))
        assert len(seen) == layout.world_size


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_pipeline_stage_is_the_same_on_both_sides(case):
    layout, _ = case
    for rank in range(layout.world_size):
        assert layout.coords(rank, "attention")["pp"] == layout.coords(rank, "expert")["pp"]
        assert layout.coords(rank, "attention")["pp"] == rank // (layout.world_size // layout.pp)


@settings(max_examples=100, deadline=None)
@given(layouts())
def test_group_ranks_partition_the_world(case):
    layout, _ = case
    for side in SIDES:
        sizes = layout.sizes(side)
        for dim, size in sizes.items():
            groups = layout.group_ranks(dim, side)
            assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
            assert len(groups) == layout.world_size // size
            for group in groups:
                assert len(group) == size
                coords = [layout.coords(r, side) for r in group]
                assert sorted(c[dim] for c in coords) == list(range(size))
                others = {tuple(v for d, v in c.items() if d != dim) for c in coords}
                assert len(others) == 1


@settings(max_examples=100, deadline=None)
@given(layouts(), st.integers(1, 64))
def test_expert_error_suggestions_are_exactly_the_eps_that_fit(case, ep):
    base, _ = case
    kwargs = {d: getattr(base, d) for d in ("tp", "cp", "dp_replicate", "dp_shard", "pp", "etp")}
    world = base.world_size
    fits = world % (base.etp * ep * base.pp) == 0
    if fits:
        assert ParallelLayout(world, ep=ep, **kwargs).edp == world // (base.etp * ep * base.pp)
        return
    with pytest.raises(LayoutError) as err:
        ParallelLayout(world, ep=ep, **kwargs)
    assert err.value.field == "ep"
    listed = re.search(r"ep can be one of \[([\d, ]*)\]", str(err.value)).group(1)
    suggested = [int(x) for x in listed.split(",")] if listed else []
    assert suggested == [e for e in range(1, world + 1) if world % (base.etp * e * base.pp) == 0]
