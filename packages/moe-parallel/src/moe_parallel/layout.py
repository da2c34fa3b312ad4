"""Parallel layouts with folding: attention and MoE layers split the same ranks differently.

Attention side: ``tp * cp * dp_replicate * dp_shard * pp == world_size``.
Expert side:    ``etp * ep * edp * pp == world_size``, where ``edp`` (expert data parallel) is
whatever is left, so ``ep`` may exceed the attention data-parallel size ("parallel folding").
Rank order, fastest first: attention tp, cp, dp_shard, dp_replicate, pp; experts etp, ep, edp, pp.
Both sides keep pp slowest, so a rank has the same pipeline stage in both.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_parallel.plan import LayoutError

ATTENTION_DIMS = ("tp", "cp", "dp_shard", "dp_replicate", "pp")
EXPERT_DIMS = ("etp", "ep", "edp", "pp")
# attention dimensions flattened into one, by name (the first named is the slower): FSDP's shard dimension under
# context parallelism, and the ranks holding other tokens of the same sequences
FLATTENED_DIMS = {"dp_shard_cp": ("dp_shard", "cp"), "cp_tp": ("cp", "tp")}


def divisors(n: int) -> list[int]:
    """The sizes a dimension of ``n`` things can be split into evenly (what error messages offer as fits)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """Validated sizes of every parallel dimension over ``world_size`` ranks, with parallel folding."""

    world_size: int
    tp: int = 1
    cp: int = 1
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: take every rank the other attention dimensions leave
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: same as tp, as Megatron-Core's expert_tensor_parallel_size

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LayoutError("world_size", self.world_size, "must be at least 1")
        for name in ("tp", "cp", "dp_replicate", "pp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(name, getattr(self, name), "must be at least 1")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        elif self.etp < 1:
            raise LayoutError("etp", self.etp, "must be at least 1")
        others = self.tp * self.cp * self.dp_replicate * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                field = max(("tp", "cp", "dp_replicate", "pp"), key=lambda d: getattr(self, d))
                raise LayoutError(
                    field,
                    getattr(self, field),
                    f"tp*cp*dp_replicate*pp = {others} does not divide world_size {self.world_size}",
                    f"their product must be one of {divisors(self.world_size)}",
                )
            object.__setattr__(self, "dp_shard", self.world_size // others)
        elif self.dp_shard < 1:
            raise LayoutError("dp_shard", self.dp_shard, "must be at least 1, or -1 to fill")
        attention = others * self.dp_shard
        if attention != self.world_size:
            hint = (
                f"set dp_shard={self.world_size // others} or -1"
                if self.world_size % others == 0
                else f"tp*cp*dp_replicate*pp = {others} must divide {self.world_size}"
            )
            raise LayoutError(
                "dp_shard",
                self.dp_shard,
                f"tp({self.tp}) x cp({self.cp}) x dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard})"
                f" x pp({self.pp}) = {attention} != world_size {self.world_size}",
                hint,
            )
        expert_model = self.etp * self.ep * self.pp
        if self.world_size % expert_model:
            fits = [
                d for d in divisors(self.world_size // self.pp) if (self.world_size // self.pp) % (d * self.etp) == 0
            ]
            raise LayoutError(
                "ep",
                self.ep,
                f"etp({self.etp}) x ep({self.ep}) x pp({self.pp}) = {expert_model} does not divide world_size "
                f"{self.world_size}",
                f"with etp={self.etp} and pp={self.pp}, ep can be one of {fits}",
            )

    @property
    def dp(self) -> int:
        """Attention data-parallel size (replicate x shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Attention ranks of one tp group holding different tokens of a step (dp x cp): FSDP shards dense parameters
        over them and averages their gradients."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the ranks holding the same experts."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def sizes(self, side: str) -> dict[str, int]:
        """Sizes of the ``"attention"`` or ``"expert"`` layout, fastest-varying dimension first."""
        if side not in ("attention", "expert"):
            raise ValueError(f"side={side!r}: choose 'attention' or 'expert'")
        dims = ATTENTION_DIMS if side == "attention" else EXPERT_DIMS
        return {d: getattr(self, d) for d in dims}

    def flattened_coord(self, rank: int, name: str) -> int:
        """Position of ``rank`` along the flattened attention dimension ``name`` (:data:`FLATTENED_DIMS`)."""
        coords, sizes, out = self.coords(rank, "attention"), self.sizes("attention"), 0
        for dim in FLATTENED_DIMS[name]:
            out = out * sizes[dim] + coords[dim]
        return out

    def coords(self, rank: int, side: str) -> dict[str, int]:
        """Position of ``rank`` along each dimension of the ``"attention"`` or ``"expert"`` layout."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}: must be in [0, {self.world_size})")
        out, rest = {}, rank
        for dim, size in self.sizes(side).items():
            out[dim], rest = rest % size, rest // size
        return out

    def group_ranks(self, dim: str, side: str) -> list[list[int]]:
        """Every process group along ``dim``: ranks that differ only in that coordinate."""
        if dim not in self.sizes(side):
            raise ValueError(f"dim={dim!r} is not a dimension of the {side} layout {tuple(self.sizes(side))}")
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank, side)
            key = tuple(v for d, v in c.items() if d != dim)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    def rank_map(self, num_experts: int | None = None) -> str:
        """A table of which rank holds which attention shard and which experts."""
        lines = [f"{'rank':>4}  attention ({' '.join(ATTENTION_DIMS)})    experts ({' '.join(EXPERT_DIMS)})"]
        for rank in range(self.world_size):
            a, e = self.coords(rank, "attention"), self.coords(rank, "expert")
            attention, experts = " ".join(f"{k}={v}" for k, v in a.items()), " ".join(f"{k}={v}" for k, v in e.items())
            row = f"{rank:>4}  {attention:<38} {experts}"
            if num_experts is not None and num_experts % self.ep == 0:
                per_rank = num_experts // self.ep
                row += f"  holds experts {e['ep'] * per_rank}..{(e['ep'] + 1) * per_rank - 1}"
            lines.append(row)
        return "\n".join(lines)
