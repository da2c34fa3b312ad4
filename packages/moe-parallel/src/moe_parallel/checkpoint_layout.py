"""The canonical checkpoint form of routed experts: one set of keys and global tensors for every parallel layout.

Each routed-expert tensor (a :class:`~moe_experts.GroupedExperts` parameter, or an optimizer state shaped like it:
``exp_avg``, ``exp_avg_sq``, an fp32 master copy) is saved as pieces under ``fqn + suffix``, each a global tensor
with ``E`` = all experts of the layer and ``F`` = the full expert FFN width, whatever the layout: a gated first
projection ``w_gate_up_EH2F`` as ``.gate`` and ``.up`` (``[E, H, F]`` each; ``swiglu`` / ``geglu`` keep them in
halves, ``swiglu_oai`` interleaved, the pieces are the same), a gated ``b_gate_up_E2F`` as ``.gate`` and ``.up``
(``[E, F]``), and under their own name (suffix ``""``) a non-gated ``w_gate_up_EH2F`` ``[E, H, F]``, ``w_down_EFH``
``[E, F, H]``, ``b_gate_up_E2F`` ``[E, F]`` and ``b_down_EH`` ``[E, H]``. LoRA adapters on the experts
(:mod:`moe_experts.lora`) follow the weight they adapt: a gated ``fc1.lora_B_EMR`` as ``.gate`` and ``.up``
(``[E, F, r]``, its rows the first projection's columns), ``fc2.lora_A_ERK`` ``[E, r, F]``, and ``fc1.lora_A_ERK`` and
``fc2.lora_B_EMR``, whole on every etp rank, under their own names. In one process the pieces are plain
tensors; in a layout they are DTensors over the expert mesh ``(edp, ep, etp)``: ``Shard(0)`` over ep, ``Shard`` of
the FFN dim over etp (``Replicate`` for the down bias, which every etp rank holds whole), and over edp the shard
FSDP2 keeps on this rank (``_StridedShard`` where it splits a dim ep or etp already splits, as FSDP2 does over
tensor parallelism), or ``Replicate`` where FSDP2's shard cuts across the gate / up split (then the rank's pieces are
gathered over edp). DCP then saves the global values and loads them into any other layout; an etp slice of a gated
projection, two column blocks of the whole tensor, is never a DTensor itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from moe_experts import GroupedExperts
from moe_parallel.parallelize import ParallelModel

# parameter -> dim of the FFN units (None: whole on every etp rank); LoRA adapters split as the weight they adapt
EXPERT_UNIT_DIM = {
    "w_gate_up_EH2F": 2,
    "b_gate_up_E2F": 1,
    "w_down_EFH": 1,
    "b_down_EH": None,
    "fc1.lora_A_ERK": None,
    "fc1.lora_B_EMR": 1,
    "fc2.lora_A_ERK": 2,
    "fc2.lora_B_EMR": None,
}
_FIRST_PROJECTION = ("w_gate_up_EH2F", "b_gate_up_E2F", "fc1.lora_B_EMR")
GATED_SUFFIXES = (".gate", ".up")


@dataclass(frozen=True)
class _Layout:
    """How one expert tensor lies on this rank, and the pieces it is saved as."""

    name: str
    layout: str  # the activation's column layout: halves, interleaved or none
    suffixes: tuple[str, ...]
    piece_shape: tuple[int, ...]  # global
    unit_dim: int | None
    first_expert: int  # global index of this rank's first expert
    local_experts: int
    etp_rank: int
    local_units: int  # F / etp
    per_rank: bool  # the tensor's coordinates are this rank's experts and etp slice (not the global ones)
    edp_dim: int | None  # the dim FSDP2 shards over edp (None: not sharded over edp)
    gather: bool  # FSDP2's shard cuts across the gate / up split: the pieces are gathered over edp
    mesh: DeviceMesh | None
    placements: tuple[Placement, ...]


_SUBMESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def _expert_mesh(expert: DeviceMesh) -> DeviceMesh:
    """The ``(edp, ep, etp)`` sub-mesh of an expert mesh, made once (slicing a mesh costs milliseconds)."""
    mesh, sub = _SUBMESHES.get(id(expert), (None, None))
    if mesh is not expert:
        if len(_SUBMESHES) >= 8:  # a few layouts per process at most: keep no old mesh alive for long
            _SUBMESHES.clear()
        sub = expert["edp", "ep", "etp"]
        _SUBMESHES[id(expert)] = (expert, sub)
    return sub


def _find(parallel: ParallelModel, fqn: str) -> tuple[GroupedExperts, str] | None:
    plan = parallel.plan if parallel.plan is not None else parallel.model.parallel_plan()
    for path in plan.experts_paths():
        prefix = f"{path}." if path else ""
        name = fqn[len(prefix) :]
        if fqn.startswith(prefix) and name in EXPERT_UNIT_DIM:
            experts = parallel.model.get_submodule(path)
            if isinstance(experts, GroupedExperts) and _parameter(experts, name) is not None:
                return experts, name
    return None


def _parameter(experts: GroupedExperts, name: str) -> torch.Tensor | None:
    """``experts``' parameter ``name`` (dotted for an adapter's), None where it has none (no bias, no adapter)."""
    try:
        return experts.get_parameter(name)
    except AttributeError:
        return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _columns(spec: _Layout, data: torch.Tensor, suffix: str) -> torch.Tensor:
    """The gate or up piece of a gated first projection's local ``data``: its columns along the unit dim (whole, or
    for the interleaved layout any run of whole column pairs); ``data`` itself for a tensor saved whole."""
    if not suffix:
        return data
    dim, width = spec.unit_dim, data.shape[spec.unit_dim]
    if spec.layout == "interleaved":
        columns = slice(0, None, 2) if suffix == ".gate" else slice(1, None, 2)
    else:
        columns = slice(0, width // 2) if suffix == ".gate" else slice(width // 2, width)
    return data[(slice(None),) * dim + (columns,)]


def _describe(parallel: ParallelModel, fqn: str, tensor: torch.Tensor) -> _Layout | None:
    found = _find(parallel, fqn)
    if found is None or tensor.ndim == 0:  # not a routed expert, or an optimizer's scalar step
        return None
    experts, name = found
    param = experts.get_parameter(name)
    if isinstance(tensor, DTensor) != isinstance(param, DTensor) or tensor.shape != param.shape:
        raise ValueError(
            f"{fqn}: expected a tensor laid out as the parameter ({type(param).__name__} {tuple(param.shape)}), got "
            f"{type(tensor).__name__} {tuple(tensor.shape)} (use get_state_dict's default, sharded, state dicts)"
        )
    if isinstance(tensor, DTensor) and (
        tensor.device_mesh != param.device_mesh or tensor.placements != param.placements
    ):
        raise ValueError(f"{fqn}: the tensor's mesh or placements are not the parameter's")
    act = experts.activation
    gated = act.gated and name in _FIRST_PROJECTION
    unit_dim = EXPERT_UNIT_DIM[name]
    meshes = parallel.meshes
    ep = 1 if meshes is None else meshes.layout.ep
    etp, edp = experts.etp_size, 1 if meshes is None else meshes.layout.edp
    local_experts, units = experts.num_experts, experts.ffn_hidden_size
    shape = list(param.shape)
    shape[0] = local_experts * ep
    if unit_dim is not None:
        shape[unit_dim] = units
    names = (tensor.device_mesh.mesh_dim_names or ()) if isinstance(tensor, DTensor) else ()
    per_rank = "ep" not in names
    # FSDP2's Shard or _StridedShard over edp (the experts are never replicated over it)
    edp_dim = getattr(tensor.placements[names.index("edp")], "dim", None) if "edp" in names else None
    gather = False
    if edp_dim is not None:
        size = tensor.shape[edp_dim] if (per_rank or edp_dim > 0) else local_experts
        gather = size % edp != 0  # FSDP2's uneven shards
        if gated and edp_dim == unit_dim:  # a chunk of the columns: whole gate / up pairs only when interleaved
            gather = gather or act.layout != "interleaved" or (size // 2) % edp != 0
    if meshes is None:
        mesh, placements = None, ()
    else:
        mesh = _expert_mesh(meshes.expert)
        if edp_dim is None or gather or edp == 1:
            on_edp: Placement = Replicate()
        elif edp_dim == 0 and ep > 1:
            on_edp = _StridedShard(0, split_factor=ep)  # ep's block of experts, split over edp inside it
        elif edp_dim == unit_dim and etp > 1:
            on_edp = _StridedShard(edp_dim, split_factor=etp)  # etp's slice of the FFN, split over edp inside it
        else:
            on_edp = Shard(edp_dim)
        on_ep = Shard(0) if ep > 1 else Replicate()
        on_etp = Shard(unit_dim) if etp > 1 and unit_dim is not None else Replicate()
        placements = (on_edp, on_ep, on_etp)
    return _Layout(
        name=name,
        layout=act.layout,
        suffixes=GATED_SUFFIXES if gated else ("",),
        piece_shape=tuple(shape),
        unit_dim=unit_dim,
        first_expert=experts.first_expert,
        local_experts=local_experts,
        etp_rank=experts.etp_rank,
        local_units=experts.local_ffn_hidden_size,
        per_rank=per_rank,
        edp_dim=edp_dim,
        gather=gather,
        mesh=mesh,
        placements=placements,
    )


def _rank_tensor(spec: _Layout, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's experts and etp slice of ``tensor`` whole, gathered over edp (a collective over its mesh)."""
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole if spec.per_rank else whole.narrow(0, spec.first_expert, spec.local_experts)


def _shard_box(spec: _Layout, tensor: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's local data of ``tensor`` (its FSDP2 shard, or all of it) lies in the tensor of this rank's
    experts and etp slice."""
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, n) for n in tensor.shape)
    local, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    box = [slice(o, o + n) for o, n in zip(offset, local, strict=True)]
    if not spec.per_rank:  # an expert-parallel DTensor counts the global experts
        box[0] = slice(box[0].start - spec.first_expert, box[0].stop - spec.first_expert)
    return tuple(box)


def _piece_offset(spec: _Layout, box: tuple[slice, ...]) -> tuple[int, ...]:
    """Global offset of the pieces' local data, from this rank's box in its experts and etp slice."""
    offset = [b.start for b in box]
    offset[0] += spec.first_expert
    if spec.unit_dim is not None:
        if len(spec.suffixes) == 2:  # columns of gate and up (a whole first projection, or interleaved pairs)
            offset[spec.unit_dim] //= 2
        offset[spec.unit_dim] += spec.etp_rank * spec.local_units
    return tuple(offset)


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are views of the same elements (strides of size-1 dims do not matter)."""
    if a.data_ptr() != b.data_ptr() or a.shape != b.shape:
        return False
    return all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


@torch.no_grad()
def expert_checkpoint_pieces(parallel: ParallelModel, fqn: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """What to save instead of ``tensor``, in the layout-independent form of :mod:`moe_parallel.checkpoint_layout`:
    suffix -> piece, to be stored under ``fqn + suffix`` (or, in an optimizer state, ``state_name + suffix``):
    ``.gate`` and ``.up`` for a gated first projection (weight or bias), ``""`` alone for every other expert tensor.

    ``fqn`` names a parameter of ``parallel.model`` (as get_state_dict names it), ``tensor`` is that parameter or an
    optimizer state shaped like it, as get_state_dict's sharded dicts hold them. None for tensors that are not
    routed-expert parameters (and scalar states such as ``step``). The pieces are views of ``tensor`` where they can
    be, else fresh copies; fill them (dcp.load) and call :func:`restore_expert_checkpoint_pieces`. Where FSDP2's
    shard cuts across the gate / up split (a gated bias sharded along its columns, or uneven shards) this gathers the
    tensor over its mesh: call it on every rank for the same keys in the same order.
    """
    spec = _describe(parallel, fqn, tensor)
    if spec is None:
        return None
    if spec.gather:
        data = _rank_tensor(spec, tensor)
        box = tuple(slice(0, n) for n in data.shape)
    else:
        data, box = _local(tensor).detach(), _shard_box(spec, tensor)
    pieces = {}
    for suffix in spec.suffixes:
        local = _columns(spec, data, suffix).contiguous()
        if spec.mesh is None:
            pieces[suffix] = local
            continue
        expected = (tuple(local.shape), _piece_offset(spec, box))
        got = compute_local_shape_and_global_offset(spec.piece_shape, spec.mesh, spec.placements)
        if (tuple(got[0]), tuple(got[1])) != expected:  # the placements must say where this rank's data lies
            raise RuntimeError(
                f"{fqn}{suffix}: placements {spec.placements} put this rank's piece at (shape, offset) {got}, "
                f"its data is {expected}"
            )
        pieces[suffix] = DTensor.from_local(
            local,
            spec.mesh,
            spec.placements,
            run_check=False,
            shape=torch.Size(spec.piece_shape),
            stride=_contiguous_strides(spec.piece_shape),
        )
    return pieces


@torch.no_grad()
def restore_expert_checkpoint_pieces(
    parallel: ParallelModel, fqn: str, tensor: torch.Tensor, pieces: dict[str, torch.Tensor]
) -> None:
    """Copy ``pieces`` (made by :func:`expert_checkpoint_pieces` for this ``fqn`` and ``tensor``, then filled, e.g.
    by dcp.load) back into ``tensor``, in place. Local work only: no communication."""
    spec = _describe(parallel, fqn, tensor)
    if spec is None:
        raise ValueError(f"{fqn}: not a routed-expert tensor; nothing to restore")
    if set(pieces) != set(spec.suffixes):
        raise ValueError(f"{fqn}: expected pieces {list(spec.suffixes)}, got {sorted(pieces)}")
    local = _local(tensor)
    if spec.gather:  # the pieces hold this rank's experts and etp slice whole: take its edp shard of them
        shape = (spec.local_experts, *tensor.shape[1:])
        target = torch.empty(shape, dtype=local.dtype, device=local.device)
    else:
        target = local
    for suffix in spec.suffixes:
        value = _local(pieces[suffix])
        dest = _columns(spec, target, suffix)
        if dest.shape != value.shape:
            raise ValueError(
                f"{fqn}{suffix}: a piece of local shape {tuple(value.shape)}, expected {tuple(dest.shape)}"
            )
        if not _same_elements(dest, value):  # a piece that is a view of the tensor was filled in place
            dest.copy_(value)
    if spec.gather:
        local.copy_(target[_shard_box(spec, tensor)])
