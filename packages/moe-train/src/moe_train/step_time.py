"""The step-time model ``moe-train plan --search`` ranks layouts by: compute from the FLOPs count at one efficiency,
each collective's time from its volume and the links it crosses, the pipeline's bubble from its schedule's action
list.

Per pipeline stage and micro-batch, a stage's forward takes its FLOPs (Megatron's convention,
:func:`moe_models.flops.stage_costs`; a third of the training FLOPs) at ``efficiency`` of the peak, plus its
exposed communication; its backward twice the compute, plus a recomputed forward under ``recompute layer``, plus its
communication. Communication is counted exposed (nothing here overlaps it with compute) except FSDP's, which
prefetches. Per collective and micro-batch:

- EP all-to-all: each MoE layer's dispatch and combine, forward and backward (and again when recomputed), of
  ``tokens x topk x hidden`` bf16 rows; the part of the group inside the NVLink domain moves at NVLink speed, the
  rest at the inter-node speed, at once (the slower of the two sets the time); DeepEP (``flex``) sends a token
  across once per node (:func:`_dispatch_time`); under etp, the rows are gathered over etp before the experts and
  reduce-scattered after;
- TP with sequence parallelism: an all-gather and a reduce-scatter around the token mixer and around the MLP, forward
  and backward, of the micro-batch's ``tokens x hidden``;
- CP: the keys and values gathered in the forward and their gradients reduce-scattered in the backward;
- PP: each stage boundary's activations forward and gradients back;
- FSDP: the parameters gathered (``gather_bytes`` an element: FSDP's mixed-precision parameter dtype) for the
  forward and again for the backward, the gradients reduce-scattered (``reduce_bytes``) after every micro-batch's
  backward (once a step under pp, whose stages defer it, exposed); the experts' over ``edp``, the rest over
  ``dp_shard x cp``. Gathers hide behind the micro-batch's forward or backward compute, what exceeds it is exposed,
  and so is each micro-batch's first layer's gather;
- activation offload: what a micro-batch's offloaded modules save goes to host memory at ``host_gbps`` in the
  forward and comes back in the backward, exposed where it takes longer than that pass's compute;
- the optimizer step: AdamW reading and writing each local parameter's fp32 copies at HBM speed.

Each collective costs the profile's ``collective_latency_us`` plus its bytes' time; a group's members inside one
NVLink domain (rank order: attention tp, cp, dp_shard, pp; experts etp, ep, edp, pp) exchange at NVLink speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_parallel.pipeline_time import pipeline_step_time
from moe_parallel.schedules import rank_stages
from moe_train.hardware import Hardware

BF16, FP32 = 2, 4
ADAMW_BYTES = 7 * FP32  # read parameter, gradient and both moments, write parameter and both moments
PARTS = ("compute", "recompute", "ep_a2a", "tp", "cp", "pp_send", "bubble", "fsdp", "offload", "optimizer")


@dataclass(frozen=True)
class StageWork:
    """One pipeline stage's share of the model: its training FLOPs per token, its layers (MoE, attention) and its
    parameters (non-expert, of which what tp leaves whole, and routed experts)."""

    flops: float  # per token, forward + backward, without recompute
    layer_flops: float  # of which, decoder layers' (what full-layer recompute runs again)
    moe_layers: int
    attention_layers: int
    layers: int
    params: int
    expert_params: int
    tp_whole: int  # of the non-expert parameters, those tp leaves whole on every rank
    largest_layer_dense: int  # the non-expert parameters of its largest layer (FSDP gathers one layer at a time)
    largest_layer_experts: int  # the routed experts of its largest MoE layer

    def dense_local(self, sizes: LayoutSizes) -> float:
        """Non-expert elements on each rank: tp's share of what it splits, FSDP's share over the data-parallel ranks."""
        return ((self.params - self.expert_params - self.tp_whole) / sizes.tp + self.tp_whole) / sizes.fsdp

    def gathered(self, sizes: LayoutSizes) -> float:
        """Elements of one layer FSDP gathers on each rank: its tp shard of the non-expert parameters (sharded over
        the data-parallel ranks), its ep x etp shard of the experts (sharded over edp)."""
        dense = self.largest_layer_dense / sizes.tp if sizes.fsdp > 1 else 0.0
        return dense + (self.largest_layer_experts / (sizes.ep * sizes.etp) if sizes.edp > 1 else 0.0)


@dataclass(frozen=True)
class LayoutSizes:
    world: int
    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    etp: int

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def fsdp(self) -> int:
        """The ranks FSDP shards the non-expert parameters over: the data-parallel ones and the context-parallel ones
        beside them (``dp_shard x cp``)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        return self.world // (self.pp * self.ep * self.etp)

    @property
    def schedule(self) -> str:
        return "1F1B" if self.vpp == 1 else "Interleaved1F1B"


@dataclass(frozen=True)
class ModelComm:
    hidden: int
    topk: int
    kv_width: int  # elements of keys and values per position (what CP gathers)
    seq_len: int
    group_topk: int | None = None  # node-limited routing: the expert groups a token may use
    num_groups: int = 1  # of how many (moe_router_num_groups)
    dispatcher: str = "alltoall"  # flex (DeepEP): a token crosses to each other node once, then fans out inside it


@dataclass
class StepTime:
    """A step's time (seconds) and its split on the busiest pipeline rank (:data:`PARTS`)."""

    total: float
    parts: dict[str, float] = field(default_factory=dict)


def _dispatch_time(rows: float, sizes: LayoutSizes, model: ModelComm, hw: Hardware) -> float:
    """One dispatch (or combine) of ``rows`` tokens from each rank of the EP group. ``alltoall`` sends each token
    to each of its ``topk`` experts' ranks; ``flex`` (DeepEP) sends it once to each other node holding one of them
    and forwards it over NVLink there, so the inter-node volume is the expected number of other nodes a token's
    experts are on (uniform routing over the group's nodes; with node-limited routing at most the nodes of
    ``group_topk`` groups) rather than ``topk``."""
    row = model.hidden * BF16
    everything = _group_time(rows * model.topk * row, sizes.ep, sizes.etp, hw)
    per_node = max(1, hw.nvlink_domain // sizes.etp)
    nodes = -(-sizes.ep // per_node)
    if model.dispatcher != "flex" or nodes == 1:
        return everything
    inside = _group_time(rows * model.topk * row * per_node / sizes.ep, per_node, sizes.etp, hw)
    reached = nodes * (1 - (1 - 1 / nodes) ** model.topk)
    if model.group_topk is not None:  # a group's experts span nodes / num_groups nodes (one, when groups share nodes)
        reached = min(reached, model.group_topk * -(-nodes // model.num_groups))
    across = rows * row * reached * (nodes - 1) / nodes / (hw.internode_gbps * 1e9)
    return max(inside, hw.collective_latency_us * 1e-6 + across)


def _group_time(volume: float, group: int, stride: int, hw: Hardware) -> float:
    """Seconds for each rank of a ``group`` whose members are ``stride`` ranks apart to send ``volume`` bytes spread
    evenly over its peers (what a ring all-gather, reduce-scatter or an even all-to-all moves)."""
    if group == 1:
        return 0.0
    inside = max(1, min(group, hw.nvlink_domain // stride)) if stride <= hw.nvlink_domain else 1
    near = volume * (inside - 1) / group / (hw.nvlink_gbps * 1e9)
    far = volume * (group - inside) / group / (hw.internode_gbps * 1e9)
    return hw.collective_latency_us * 1e-6 + max(near, far)


def step_time(
    sizes: LayoutSizes,
    stages: list[StageWork],
    micro_batch: int,
    microbatches: int,
    recompute_layers: bool,
    model: ModelComm,
    hw: Hardware,
    efficiency: float,
    gather_bytes: int = BF16,
    reduce_bytes: int = FP32,
    offloaded: tuple[float, ...] = (),
) -> StepTime:
    """The step's time under the model of the module docstring; ``offloaded``: each stage's activation bytes a
    micro-batch sends to host memory (none: nothing offloaded)."""
    s = sizes
    flops_rate = hw.bf16_tflops * 1e12 * efficiency
    tokens = micro_batch * model.seq_len  # one data-parallel rank's micro-batch
    local_tokens = tokens / (s.tp * s.cp)  # each rank's rows (sequence-parallel under tp)
    row = model.hidden * BF16
    a2a = _dispatch_time(local_tokens, s, model, hw)  # one dispatch or combine
    # under etp the received rows are gathered over etp before the experts and reduce-scattered after
    etp = _group_time(local_tokens * model.topk * row * s.etp, s.etp, 1, hw)
    tp = _group_time(tokens / s.cp * row, s.tp, 1, hw)  # one all-gather or reduce-scatter
    cp = _group_time(tokens * model.kv_width * BF16, s.cp, s.tp, hw)
    pp_send = _group_time(local_tokens * row * 2, 2, s.world // s.pp, hw)  # one peer: the whole volume
    forward, backward, split = [], [], []
    for stage in stages:
        compute = stage.flops / 3 * local_tokens / flops_rate
        again = stage.layer_flops / 3 * local_tokens / flops_rate if recompute_layers else 0.0
        ep_time = 2 * stage.moe_layers * (a2a + etp)
        parts = {
            "compute": 3 * compute,
            "recompute": again + (ep_time if recompute_layers else 0.0),
            "ep_a2a": 2 * ep_time,
            "tp": 8 * stage.layers * tp,
            "cp": 2 * stage.attention_layers * cp,
            "pp_send": 2 * pp_send if s.pp > 1 else 0.0,
        }
        forward.append(compute + ep_time + 4 * stage.layers * tp + stage.attention_layers * cp + parts["pp_send"] / 2)
        backward.append(sum(parts.values()) - forward[-1])
        split.append(parts)
    makespan = pipeline_step_time(s.schedule, s.pp, s.vpp, microbatches, forward, backward)
    # the busiest pipeline rank: its own work; the rest of the makespan is its share of the bubble
    per_rank = [rank_stages(s.schedule, s.pp, s.vpp, r) for r in range(s.pp)]
    busiest = max(per_rank, key=lambda mine: sum(forward[i] + backward[i] for i in mine))
    parts = {name: microbatches * sum(split[i][name] for i in busiest) for name in PARTS[:6]}
    parts["bubble"] = makespan - sum(parts.values())
    dense_local = sum(stages[i].dense_local(s) for i in busiest)
    expert_local = sum(stages[i].expert_params for i in busiest) / (s.ep * s.etp * s.edp)
    gather = _group_time(dense_local * s.fsdp * gather_bytes, s.fsdp, s.tp, hw) + _group_time(
        expert_local * s.edp * gather_bytes, s.edp, s.ep * s.etp, hw
    )
    reduce = _group_time(dense_local * s.fsdp * reduce_bytes, s.fsdp, s.tp, hw) + _group_time(
        expert_local * s.edp * reduce_bytes, s.edp, s.ep * s.etp, hw
    )
    # FSDP prefetches, so its gathers hide behind each micro-batch's forward and backward compute; it reduces after
    # every backward, except in a pipeline stage, which reduces once a step
    forward_compute, backward_compute = parts["compute"] / 3 / microbatches, parts["compute"] * 2 / 3 / microbatches
    exposed = max(0.0, gather - forward_compute) + max(0.0, gather + (reduce if s.pp == 1 else 0) - backward_compute)
    # each micro-batch's first layer waits for its gather
    first_dense = max(stages[i].largest_layer_dense for i in busiest) / s.tp * gather_bytes
    first_experts = max(stages[i].largest_layer_experts for i in busiest) / (s.ep * s.etp) * gather_bytes
    first = _group_time(first_dense, s.fsdp, s.tp, hw) + _group_time(first_experts, s.edp, s.ep * s.etp, hw)
    parts["fsdp"] = microbatches * (exposed + first)
    parts["fsdp"] += reduce if s.pp > 1 else 0.0
    # offloaded activations go out during the forward and come back during the backward, behind their compute
    sent = sum(offloaded[i] for i in busiest) / (hw.host_gbps * 1e9) if offloaded else 0.0
    parts["offload"] = microbatches * (max(0.0, sent - forward_compute) + max(0.0, sent - backward_compute))
    parts["optimizer"] = (dense_local + expert_local) * ADAMW_BYTES / (hw.hbm_gbps * 1e9)
    return StepTime(makespan + parts["fsdp"] + parts["offload"] + parts["optimizer"], parts)
