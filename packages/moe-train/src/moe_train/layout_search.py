"""``moe-train plan --search``: every layout of a model over ``--gpus`` GPUs, those that fit the device's memory,
ranked by an estimated step time (:mod:`moe_train.step_time`).

The model is built once on the meta device, for its parameters by layer (routed experts apart) and its pipeline
plan. Each candidate (tp, cp, pp, vpp, ep, etp; FSDP over what is left, as ``dp_shard -1``) is then sized from
those counts without building it again:

- parameters, gradients and AdamW states per rank: a pipeline rank's layers' non-expert parameters over
  ``tp x dp_shard x cp`` (what tp leaves whole over ``dp_shard x cp`` alone), its routed experts over
  ``ep x etp x edp`` (what ``moe-train plan`` counts exactly, within FSDP's uneven last shards), plus two layers'
  parameters gathered by FSDP at once;
- activations from :func:`moe_memory.estimate.estimate_memory`, put together from one layer of each shape: the
  rank's layers times its micro-batches in flight from the schedule's action list, as ``plan --memory`` counts
  them, and the last stage's head, loss and MTP times that stage's own (one: it runs each backward right after its
  forward, where ``plan --memory`` counts them like the rank's other stages);
- the device's usable memory (``memory_gib - reserved_gib`` of the hardware profile) is the limit.

For each layout the search takes the fastest micro-batch size and memory saving that fit (``none``; ``selective``:
recompute the norms and activation functions, Megatron-Core's cheap kinds; ``offload``: also offload core attention,
the attention projection and the experts' first GEMM's saves to host memory, within the profile's host memory;
``layer``: recompute whole decoder layers).
The best layouts are checked against the model's own rules (``check_plan``) before they are printed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from moe_memory.estimate import LocalParameters, PipelineShare, estimate_memory, in_last_stage, mtp_attention
from moe_models import ModelConfig, build_model
from moe_models.memory import model_shape, run_shape
from moe_parallel import ParallelConfig, check_plan
from moe_parallel.layout import divisors
from moe_parallel.pipeline_time import stage_inflight
from moe_parallel.plan import LayoutError
from moe_parallel.schedules import inflight_microbatches, rank_stages
from moe_parallel.stage_split import split_layers
from moe_train.hardware import Hardware
from moe_train.step_time import LayoutSizes, ModelComm, StageWork, StepTime, step_time

# compute efficiency of the time model: one number for every model and layout, fitted once to the six published
# NeMo AutoModel H100 rows (benchmarks/plan_search.py, benchmarks/results/plan_search.json)
DEFAULT_EFFICIENCY = 0.465
# how each layout may keep its activations, cheapest first: all, recompute the cheap kinds, also offload the big saves
# (Megatron-Core's suggested pairing), recompute whole layers
SAVINGS = ("none", "selective", "offload", "layer")
OFFLOADED = ("core_attn", "attn_proj", "expert_fc1")
MICRO_BATCHES = (1, 2, 4, 8)
VPP = (1, 2, 4, 8, 16)
MAX_CP = 8
GIB = 2**30
TP_SPLITS = (ColwiseParallel, RowwiseParallel)  # the tensor-parallel styles that split their modules' weights


@dataclass(frozen=True)
class SearchSettings:
    """What the search holds fixed: the run's batch, sequence length and dtypes (bytes per element)."""

    global_batch: int
    seq_len: int
    param_bytes: int = 4
    optimizer_state_bytes: int = 4
    master_weights_bytes: int = 0  # a master copy of 2-byte parameters
    activation_bytes: int = 2
    gather_bytes: int = 4  # FSDP's mixed-precision parameter dtype (parallel.mixed_precision_param)
    reduce_bytes: int = 4  # and its gradient reduction dtype (parallel.mixed_precision_reduce)
    dispatcher: str = "alltoall"  # parallel.moe_token_dispatcher_type


@dataclass(frozen=True)
class Candidate:
    sizes: LayoutSizes
    micro_batch: int
    microbatches: int
    saving: str  # how activations are kept: none, selective or layer recompute, or offload (SAVINGS)
    memory: float  # bytes, the most any rank holds on the device
    states: float  # of it, parameters, gradients, optimizer states, master weights and FSDP's gathered layers
    time: StepTime
    host: float = 0.0  # bytes, the most any rank offloads to host memory

    def tokens_per_second_per_gpu(self, settings: SearchSettings) -> float:
        return settings.global_batch * settings.seq_len / self.time.total / self.sizes.world

    def parallel_config(self) -> ParallelConfig:
        return parallel_config(self.sizes)


def parallel_config(s: LayoutSizes) -> ParallelConfig:
    """The ``parallel`` section that runs layout ``s`` (FSDP over the ranks the others leave)."""
    extra = {"pp_schedule": s.schedule, "vpp": s.vpp} if s.vpp > 1 else {}
    return ParallelConfig(tp=s.tp, cp=s.cp, pp=s.pp, ep=s.ep, etp=s.etp, **extra)


@dataclass(frozen=True)
class _ModelFacts:
    # parameters per decoder layer, then of the first stage's extras (embedding) and the last's (head, MTP)
    dense: tuple[int, ...]  # not routed experts
    whole: tuple[int, ...]  # of those, what tp does not split (norms, routers, MLA's down projections...)
    routed: tuple[int, ...]  # routed experts
    layer_costs: tuple[float, ...]
    first_cost: float
    last_cost: float
    moe: tuple[bool, ...]
    attention: tuple[bool, ...]
    copies: int = 0  # what the last stage keeps a copy of when it is not the first (MTP's embedding)
    copies_whole: int = 0  # of those, what tp does not split


class _Saved(NamedTuple):
    """What one micro-batch saves for backward, in bytes: on the device and offloaded to host memory, apart for the
    last stage's own head, loss and MTP (:func:`moe_memory.estimate.in_last_stage`); and what lives one at a time."""

    device: float
    last_device: float
    host: float
    last_host: float
    logits: float
    dispatcher: float
    working: float  # the recompute working set


class LayoutSearch:
    """The search over one model, batch and hardware (module docstring)."""

    def __init__(self, model_config: ModelConfig, settings: SearchSettings, hardware: Hardware) -> None:
        self.config, self.settings, self.hw = model_config, settings, hardware
        with torch.device("meta"):
            self.model = build_model(model_config)
        self.plan = self.model.parallel_plan(settings.seq_len)
        self.facts = self._facts()
        self.shape = model_shape(model_config)
        self.kinds = list(dict.fromkeys(self.shape.layers))  # the distinct layer shapes
        self.kind_of = [self.kinds.index(layer) for layer in self.shape.layers]
        self.mtp_attention = mtp_attention(self.shape) if self.shape.mtp_depth else self.shape.mtp_attention
        c = model_config
        qk = (c.qk_head_dim + c.qk_pos_emb_head_dim) if c.multi_latent_attention else c.kv_channels or 0
        v = c.v_head_dim if c.multi_latent_attention else c.kv_channels or 0
        kv_heads = c.num_attention_heads if c.multi_latent_attention else c.num_query_groups or c.num_attention_heads
        self.comm = ModelComm(
            hidden=c.hidden_size,
            topk=c.moe_router_topk or 1,
            kv_width=kv_heads * (qk + v),
            seq_len=settings.seq_len,
            group_topk=c.moe_router_group_topk if c.moe_router_num_groups else None,
            num_groups=c.moe_router_num_groups or 1,
            dispatcher=settings.dispatcher,
        )
        self.selective = ["layernorm", "moe_act"] + (["mla_up_proj"] if c.multi_latent_attention else [])
        present = self.model.module_kinds()
        self.offload = [kind for kind in OFFLOADED if present.get(kind)]
        selective = frozenset(self.selective)
        self.savings = {  # saving -> (recompute kinds, offload kinds)
            "none": (frozenset(), frozenset()),
            "selective": (selective, frozenset()),
            "offload": (selective, frozenset(self.offload)),
            "layer": (frozenset({"layer"}), frozenset()),
        }

    def _facts(self) -> _ModelFacts:
        """Parameters by decoder layer (routed experts apart, and of the rest what tp leaves whole on every rank),
        the embedding's, the head's and MTP's, and the pipeline plan's costs."""
        pipeline = self.plan.pipeline
        layer_of = {path: index for index, path in enumerate(pipeline.layers)}
        experts = tuple(f"{p}." for p in self.plan.experts_paths())
        split = {path for path, style in self.plan.tensor_parallel.items() if isinstance(style, TP_SPLITS)}
        n = len(pipeline.layers)
        dense, whole, routed = [0] * (n + 2), [0] * (n + 2), [0] * (n + 2)  # layers, then first and last stage
        for name, param in self.model.named_parameters():
            layer = next((layer_of[p] for p in _prefixes(name) if p in layer_of), None)
            if layer is None:
                layer = n if name.startswith(tuple(pipeline.first_modules)) else n + 1
            if name.startswith(experts):
                routed[layer] += param.numel()
                continue
            dense[layer] += param.numel()
            if name.rsplit(".", 1)[0] not in split and name not in self.plan.tp_shard_parameters:
                whole[layer] += param.numel()
        attention = tuple(layer.attention is not None for layer in model_shape(self.config).layers)
        params = dict(self.model.named_parameters())
        copied = [name for name in pipeline.last_stage_copies if name in params]
        return _ModelFacts(
            tuple(dense), tuple(whole), tuple(routed), pipeline.layer_costs, pipeline.first_cost, pipeline.last_cost,
            tuple(count > 0 for count in routed[:n]), attention, sum(params[name].numel() for name in copied),
            sum(params[name].numel() for name in copied if name.rsplit(".", 1)[0] not in split),
        )  # fmt: skip

    # --- enumeration ------------------------------------------------------------------------------------------------

    def layouts(self, world: int, fixed: dict[str, int] | None = None) -> Iterator[LayoutSizes]:
        """Every layout over ``world`` GPUs the search considers; ``fixed``: sizes held (``{"tp": 1}``)."""
        fixed = fixed or {}
        for sizes in self._all_layouts(world):
            if all(getattr(sizes, name) == value for name, value in fixed.items()):
                yield sizes

    def _all_layouts(self, world: int) -> Iterator[LayoutSizes]:
        """The sizes the model's plan allows at a glance (what it cannot take at all, what tp must divide); the
        finer rules are ``check_plan``'s, run on the best."""
        plan, layers = self.plan, len(self.facts.layer_costs)
        experts = self.config.num_moe_experts or 1
        tps = [1] if plan.tp_unsupported else [d for d in divisors(world) if d <= self.hw.nvlink_domain]
        tps = [tp for tp in tps if all(size % tp == 0 for size in plan.tp_divides.values())]
        most_cp = MAX_CP if plan.context_parallel else 1
        most_pp = 1 if plan.pipeline.unsupported else layers
        for tp in tps:
            for cp in (d for d in divisors(world // tp) if d <= most_cp and self.settings.seq_len % (2 * d) == 0):
                for pp in (d for d in divisors(world // (tp * cp)) if d <= most_pp):
                    for vpp in (v for v in VPP if (v == 1 or pp > 1) and pp * v <= layers):
                        for etp in sorted({1, tp}):
                            for ep in divisors(experts):
                                if world % (pp * ep * etp) == 0:
                                    yield LayoutSizes(world, tp, cp, pp, vpp, ep, etp)

    # --- memory -----------------------------------------------------------------------------------------------------

    @functools.cache  # noqa: B019 -- one search object per command; its methods' arguments repeat
    def _split(self, stages: int) -> tuple[tuple[int, ...], ...]:
        f = self.facts
        return tuple(split_layers(f.layer_costs, stages, first_cost=f.first_cost, last_cost=f.last_cost))

    @functools.cache  # noqa: B019
    def stage_work(self, stages: int) -> tuple[StageWork, ...]:
        f = self.facts
        split = self._split(stages)
        n = len(f.layer_costs)
        out = []
        for index, layers in enumerate(split):
            first, last = index == 0, index == len(split) - 1
            held = [*layers, *([n] if first else []), *([n + 1] if last else [])]
            copies = (f.copies, f.copies_whole) if last and not first else (0, 0)
            layer_flops = sum(f.layer_costs[i] for i in layers)
            out.append(
                StageWork(
                    flops=layer_flops + (f.first_cost if first else 0.0) + (f.last_cost if last else 0.0),
                    layer_flops=layer_flops,
                    moe_layers=sum(f.moe[i] for i in layers),
                    attention_layers=sum(f.attention[i] for i in layers),
                    layers=len(layers),
                    params=sum(f.dense[i] + f.routed[i] for i in held) + copies[0],
                    expert_params=sum(f.routed[i] for i in held),
                    tp_whole=sum(f.whole[i] for i in held) + copies[1],
                    largest_layer_dense=max(f.dense[i] for i in layers),
                    largest_layer_experts=max(f.routed[i] for i in layers),
                )
            )
        return tuple(out)

    @functools.cache  # noqa: B019 -- one search object per command; its methods' arguments repeat
    def _saved(self, layer: int | None, last: bool, key: tuple) -> _Saved:
        """What one micro-batch saves (:class:`_Saved`): of one decoder layer of shape ``self.kinds[layer]``, or with
        ``layer`` None of what a pipeline rank holds around its layers (first stage: the embedding; last: head, loss
        and MTP). ``key``: (first, tp, cp, ep, etp, micro, saving)."""
        first, tp, cp, ep, etp, micro, saving = key
        layers = () if layer is None else (self.kinds[layer],)
        mtp = self.shape.mtp_depth if layer is None and last else 0
        shape = dataclasses.replace(self.shape, layers=layers, mtp_depth=mtp, mtp_attention=self.mtp_attention)
        sizes = types.SimpleNamespace(tp=tp, cp=cp, ep=ep, etp=etp)  # what run_shape reads of a layout
        s = self.settings
        run = run_shape(
            self.config, LocalParameters(0, 0), micro_batch=micro, seq_len=s.seq_len,
            activation_bytes=s.activation_bytes, layout=sizes,
        )  # fmt: skip
        recompute, offload = self.savings[saving]
        share = PipelineShare(first and layer is None, last and layer is None, 1)
        e = estimate_memory(shape, run, recompute=recompute, offload=offload, pipeline=share)

        def split(saved) -> tuple[float, float]:
            at_end = sum(t.total for t in saved if in_last_stage(t))
            return float(sum(t.total for t in saved) - at_end), float(at_end)

        return _Saved(*split(e.activations), *split(e.offloaded), e.logits, e.dispatcher_buffers, e.recompute_bytes)

    def _activations(
        self, layers: tuple[int, ...], ends: tuple[bool, bool], inflight: int, last_inflight: int, key: tuple
    ) -> tuple[float, float]:
        """What :func:`estimate_memory` gives a pipeline rank holding ``layers`` (``inflight`` micro-batches of each
        of its stages in flight), put together from one layer of each shape: it adds layers' saves and takes the
        largest buffers. ``ends``: whether the rank holds the first and the last stage, whose head, loss and MTP
        count ``last_inflight`` times. Returns (device bytes, offloaded bytes in host memory)."""
        counts = Counter(self.kind_of[i] for i in layers)
        parts = [self._saved(kind, False, (False, *key)) for kind in counts]
        times = [inflight * count for count in counts.values()]
        around = self._saved(None, ends[1], (ends[0], *key))
        device = sum(p.device * t for p, t in zip(parts, times, strict=True)) + around.device * inflight
        host = sum(p.host * t for p, t in zip(parts, times, strict=True)) + around.host * inflight
        device += around.last_device * last_inflight + around.logits
        host += around.last_host * last_inflight
        everything = [*parts, around]
        return device + max(p.dispatcher for p in everything) + max(p.working for p in everything), host

    def offloaded(self, sizes: LayoutSizes, micro: int, saving: str) -> tuple[float, ...]:
        """Each stage's bytes one micro-batch offloads (its layers': the ends offload nothing)."""
        if saving != "offload":
            return ()
        key = (False, sizes.tp, sizes.cp, sizes.ep, sizes.etp, micro, saving)
        split = self._split(sizes.pp * sizes.vpp)
        return tuple(sum(self._saved(self.kind_of[i], False, key).host for i in layers) for layers in split)

    def _state_bytes(self, sizes: LayoutSizes, work: list[StageWork], mine: list[int]) -> float:
        s = self.settings
        dense = sum(work[i].dense_local(sizes) for i in mine)
        routed = sum(work[i].expert_params for i in mine) / (sizes.ep * sizes.etp * sizes.edp)
        per_element = 2 * s.param_bytes + 2 * s.optimizer_state_bytes + s.master_weights_bytes
        gathered = 2 * max(work[i].gathered(sizes) for i in mine) * s.gather_bytes  # one layer, the next prefetched
        return (dense + routed) * per_element + gathered

    def rank_memory(
        self, sizes: LayoutSizes, micro: int, microbatches: int, saving: str
    ) -> list[tuple[float, float, float]]:
        """Per pipeline rank: (activation bytes on the device, parameter and optimizer bytes, bytes offloaded)."""
        stages = sizes.pp * sizes.vpp
        work = self.stage_work(stages)
        split = self._split(stages)
        inflight = _inflight(sizes.schedule, sizes.pp, sizes.vpp, microbatches)
        last_inflight = _stage_inflight(sizes.schedule, sizes.pp, sizes.vpp, microbatches)[-1]
        key = (sizes.tp, sizes.cp, sizes.ep, sizes.etp, micro, saving)
        out = []
        for rank in range(sizes.pp):
            mine = rank_stages(sizes.schedule, sizes.pp, sizes.vpp, rank)
            layers = tuple(sorted(i for stage in mine for i in split[stage]))
            ends = (0 in mine, stages - 1 in mine)
            per_stage = math.ceil(inflight[rank] / len(mine))  # its stages share the rank's micro-batches in flight
            device, host = self._activations(layers, ends, per_stage, last_inflight, key)
            out.append((device, self._state_bytes(sizes, work, mine), host))
        return out

    def memory(self, sizes: LayoutSizes, micro: int, microbatches: int, saving: str) -> tuple[float, float, float]:
        """(the most any rank holds on the device, that rank's parameter and optimizer bytes, the most any rank
        offloads to host memory)."""
        ranks = self.rank_memory(sizes, micro, microbatches, saving)
        total, states = max((device + states, states) for device, states, _ in ranks)
        return total, states, max(host for _, _, host in ranks)

    # --- ranking ----------------------------------------------------------------------------------------------------

    def best_for(self, sizes: LayoutSizes, efficiency: float) -> Candidate | None:
        """The fastest micro-batch size and memory saving of this layout that fit (device and host memory), or None.
        Savings are tried cheapest first; after ``offload`` fits, ``layer`` is timed too (either may cost more)."""
        s = self.settings
        per_rank = s.global_batch // sizes.dp if s.global_batch % sizes.dp == 0 else 0
        limit = self.hw.usable_bytes
        work = self.stage_work(sizes.pp * sizes.vpp)
        if min(self._state_bytes(sizes, work, rank_stages(sizes.schedule, sizes.pp, sizes.vpp, r))
               for r in range(sizes.pp)) > limit:  # fmt: skip
            return None
        best = None
        for saving in SAVINGS:
            for micro in MICRO_BATCHES:
                if not per_rank or per_rank % micro:
                    continue
                microbatches = per_rank // micro
                if microbatches < sizes.pp:
                    continue
                memory, states, host = self.memory(sizes, micro, microbatches, saving)
                if memory > limit or host > self.hw.host_memory_gib * GIB:
                    continue
                timed = step_time(
                    sizes, work, micro, microbatches, saving == "layer", self.comm, self.hw, efficiency,
                    s.gather_bytes, s.reduce_bytes, self.offloaded(sizes, micro, saving),
                )  # fmt: skip
                candidate = Candidate(sizes, micro, microbatches, saving, memory, states, timed, host)
                if best is None or timed.total < best.time.total:
                    best = candidate
            if best is not None and best.saving != "offload":  # saving more memory only adds time from here
                return best
        return best

    def check(self, sizes: LayoutSizes) -> str | None:
        """The model's own refusal of this layout (``check_plan``), or None when it takes it."""
        config = parallel_config(sizes)
        try:
            check_plan(self.model, self.plan, config, config.layout(sizes.world))
        except LayoutError as err:
            return str(err)
        return None

    def search(
        self, world: int, efficiency: float = DEFAULT_EFFICIENCY, top: int = 5, fixed: dict[str, int] | None = None
    ) -> SearchResult:
        start = time.perf_counter()
        layouts = list(self.layouts(world, fixed))
        fits = [c for c in (self.best_for(sizes, efficiency) for sizes in layouts) if c is not None]
        fits.sort(key=lambda c: c.time.total)
        ranked, refused = [], 0
        for candidate in fits:
            if self.check(candidate.sizes) is None:
                ranked.append(candidate)
            else:
                refused += 1
            if len(ranked) == top:
                break
        return SearchResult(world, len(layouts), len(fits), refused, ranked, fits, time.perf_counter() - start)


@dataclass
class SearchResult:
    world: int
    layouts: int  # enumerated
    fitting: int  # of those, fitting the memory with some micro-batch size and memory saving
    refused: int  # of the best, refused by the model's own rules
    top: list[Candidate]
    ranked: list[Candidate]  # every fitting layout, fastest first (not checked by the model's rules)
    seconds: float


@functools.cache
def _inflight(schedule: str, pp: int, vpp: int, microbatches: int) -> tuple[int, ...]:
    if microbatches > 3 * pp and microbatches % pp == 0:  # the warm-up's peak is reached by then
        return _inflight(schedule, pp, vpp, 3 * pp)
    return tuple(inflight_microbatches(schedule, pp, vpp, microbatches) or [microbatches] * pp)


@functools.cache
def _stage_inflight(schedule: str, pp: int, vpp: int, microbatches: int) -> tuple[int, ...]:
    if microbatches > 3 * pp and microbatches % pp == 0:
        return _stage_inflight(schedule, pp, vpp, 3 * pp)
    if pp == 1:
        return (1,)
    return stage_inflight(schedule, pp, vpp, microbatches)


def _prefixes(name: str) -> Iterator[str]:
    parts = name.split(".")
    for i in range(1, len(parts)):
        yield ".".join(parts[:i])
