"""One rank of test_parallelize_dist.py (4 gloo ranks): ``python _parallelize_worker.py OUT_DIR``.

Checks that need real process groups, each against the same model in this process alone where it computes:

- the meshes' groups are the layout's, with parallel.timeout_minutes (``_mesh_scenarios.py``), and where each
  parameter ends up (experts never sharded twice);
- one training step of a model with fewer experts per rank than expert-data-parallel ranks (FSDP then shards the
  experts along their second dim);
- the plan protocol: a model that is not moe_models' (``_toy_plan_model.py``), split as its own plan says;
- building on meta and materialising gives each rank exactly the tensors an eager build split the same way holds;
- the experts' gradient scale when ep and dp both exceed 1 (edp / dp);
- activation checkpointing applied through ``before_fsdp`` recomputes the experts that run, in every layout;
- the flex (DeepEP) dispatcher on moe-dispatch's strict DeepEP stand-in: one buffer shared by every MoE layer;
- Qwen3-Next's Gated DeltaNet layers at tp=2 (their heads split over tp), on plain and on packed rows.

Each section is a scenario of its own (``_rank_scenarios.py``) recording what it saw; the test module asserts.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _mesh_scenarios import group_timeouts, mesh_groups
from _toy_plan_model import PLAN, ToyMoE, loss_fn
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

from _rank_scenarios import Scenarios
from moe_experts import GroupedExperts
from moe_memory import apply_activation_checkpointing
from moe_models import build_model, causal_lm_loss
from moe_models.attention import CoreAttention
from moe_models.presets import preset
from moe_parallel import (
    ParallelConfig,
    apply_context_parallel,
    build_meshes,
    full_value,
    hidden_matrix_splits,
    init_distributed,
    load_balanced_positions,
    local_box,
    materialize,
    parallelize,
)

# every GroupedExperts forward, counted at class level so a checkpoint wrapper's recompute counts too
EXPERT_CALLS = [0]
_experts_forward = GroupedExperts.forward


def _counting_forward(self, *args, **kwargs):
    EXPERT_CALLS[0] += 1
    return _experts_forward(self, *args, **kwargs)


GroupedExperts.forward = _counting_forward


def _placements(model) -> dict[str, tuple]:
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out[name] = ("dtensor", p.device_mesh.mesh_dim_names, tuple(map(repr, p.placements)), tuple(p.shape))
        else:
            out[name] = ("plain", None, None, tuple(p.shape))
    return out


def _step(model, config, ids_BS) -> float:
    out = model(ids_BS[:, :-1])
    with loss_parallel():  # tp splits the logits over the vocabulary (nothing changes for whole logits)
        loss = causal_lm_loss(out, ids_BS[:, 1:], config.mtp_loss_scaling_factor).total
        loss.backward()
    return full_value(loss).item()


def _accumulated_reference(model: nn.Module, loss_of, ids_BS: torch.Tensor, dp: int) -> list[float]:
    """One process doing what ``dp`` data-parallel replicas do, as gradient accumulation: a backward per replica's
    slice of the global batch, then the gradients divided by ``dp``. Returns each slice's loss."""
    losses = []
    for part in ids_BS.chunk(dp):
        loss = loss_of(model, part)
        loss.backward()
        losses.append(loss.item())
    for p in model.parameters():
        p.grad /= dp
    return losses


def _grad_pairs(model: nn.Module, reference: nn.Module) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """Each parameter's finalized gradient, gathered to what this rank can compare (the whole tensor, or for plain
    per-rank experts this rank's experts and etp slice), beside the reference's same part."""
    expected = {n: p.grad for n, p in reference.named_parameters()}
    out = {}
    for name, param in model.named_parameters():  # the same order on every rank: full_tensor's collectives line up
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        want = expected[name]
        path, _, attr = name.rpartition(".")
        module = model.get_submodule(path)
        if isinstance(module, GroupedExperts) and grad is not None and grad.shape != want.shape:
            first = module.first_expert
            want = torch.stack([module.local_slice(attr, want[first + e]) for e in range(module.num_experts)])
        out[name] = (None if grad is None else grad.detach().clone(), want.clone())
    return out


def _toy_ids(dp: int) -> torch.Tensor:
    return torch.randint(0, 32, (2 * dp, 9), generator=torch.Generator().manual_seed(11))


def protocol(world: int) -> dict:
    """The toy model (not moe_models') split as its plan says: one step equals one process's."""
    out = {}
    for name, sizes, explicit in [
        ("ep=2", {"ep": 2}, True),  # the plan passed to parallelize
        ("tp=2 x ep=2 (etp=1)", {"tp": 2, "ep": 2, "etp": 1}, False),  # model.parallel_plan()
        ("tp=2 x ep=2 (etp=2)", {"tp": 2, "ep": 2}, False),
    ]:
        cfg = ParallelConfig(**sizes)
        meshes = build_meshes(cfg.layout(world), "cpu")
        model = ToyMoE(seed=3)
        parallel = parallelize(model, meshes, cfg, PLAN if explicit else None)
        dp = meshes.layout.dp
        ids_BS = _toy_ids(dp)
        loss = loss_fn(model, ids_BS.chunk(dp)[parallel.dp_index])
        loss.backward()
        parallel.finalize_grads()
        norm = parallel.clip_grad_norm_(float("inf")).item()
        reference = ToyMoE(seed=3)
        ref_losses = _accumulated_reference(reference, loss_fn, ids_BS, dp)
        out[name] = {
            "loss": loss.item(),
            "ref_loss": ref_losses[parallel.dp_index],
            "norm": norm,
            "ref_norm": nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item(),
            "grads": _grad_pairs(model, reference),
            # the plan's attribute names were the ones swapped; nothing was added under the default names
            "dispatcher": type(model.moe.token_mover).__name__,
            "local_experts": model.moe.bank.num_experts,
            "default_names": [n for n in ("router", "dispatcher", "experts") if hasattr(model.moe, n)],
        }
    return out


def bad_plans(world: int) -> dict:
    """What parallelize says to plans naming what the toy model does not have, with tp=2 x ep=2 (etp=1)."""
    cfg = ParallelConfig(tp=2, ep=2, etp=1)
    meshes = build_meshes(cfg.layout(world), "cpu")
    out = {}
    for name, plan in {
        "tp_partial_grads": dataclasses.replace(PLAN, tp_partial_grads=("moe.gate.wieght",)),
        "tensor_parallel": dataclasses.replace(
            PLAN, tensor_parallel={**PLAN.tensor_parallel, "ffn.w1": ColwiseParallel()}
        ),
        "fsdp_units": dataclasses.replace(PLAN, fsdp_units=("ffn", "mo")),
    }.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                parallelize(ToyMoE(seed=3), meshes, cfg, plan)
                out[name] = ("no error", [str(w.message) for w in caught])
            except Exception as err:  # the test asserts the type
                out[name] = (type(err).__name__, str(err))
    return out


META_CASES = {
    "ep=2": ("tiny-qwen3-moe", {"ep": 2}, {}),
    "ep=4": ("tiny-qwen3-moe", {"ep": 4}, {}),
    "tp=2 x ep=2 (etp=1)": ("tiny-deepseek-v3", {"tp": 2, "ep": 2, "etp": 1}, {}),
    "tp=2 (etp=2)": ("tiny-qwen3-moe", {"tp": 2}, {}),
    "dp_replicate=2 x ep=2": ("tiny-qwen3-moe", {"dp_replicate": 2, "ep": 2}, {}),
    "etp=2 x ep=2, GPT-OSS biases": ("tiny-gpt-oss", {"etp": 2, "ep": 2}, {}),
    "dp_shard=4, tied embeddings": ("tiny-qwen3-moe", {}, {"share_embeddings_and_output_weights": True}),
    # sinks split with the heads, and tied embeddings one vocabulary-parallel parameter again after the styles
    "tp=2, GPT-OSS sinks": ("tiny-gpt-oss", {"tp": 2}, {}),
    "tp=2, tied embeddings": ("tiny-qwen3-moe", {"tp": 2}, {"share_embeddings_and_output_weights": True}),
    # Gated DeltaNet layers: in_proj and the conv channels grouped per key head, A_log / dt_bias split with the heads
    "tp=2, Qwen3-Next linear attention": ("tiny-qwen3-next", {"tp": 2}, {}),
}


def meta_equals_eager(world: int) -> dict:
    out = {}
    for name, (family, sizes, changes) in META_CASES.items():
        config = dataclasses.replace(preset(family), **changes)
        cfg = ParallelConfig(**sizes)
        meshes = build_meshes(cfg.layout(world), "cpu")
        eager = build_model(config, seed=7)
        with torch.device("meta"):
            meta = build_model(config)
        eager_parallel = parallelize(eager, meshes, cfg)
        meta_parallel = parallelize(meta, meshes, cfg)
        materialize(meta, meta.parallel_plan(), meta.initial_weights(7), "cpu")
        want = {n: local_box(t)[0] for n, t in [*eager.named_parameters(), *eager.named_buffers()]}
        got = {n: local_box(t)[0] for n, t in [*meta.named_parameters(), *meta.named_buffers()]}
        case = {
            "names": (sorted(got), sorted(want)),
            "differ": [n for n in want if n in got and not torch.equal(got[n], want[n])],
            "on_meta": [n for n, t in got.items() if t.is_meta],
            "tied": (
                eager.lm_head.weight is eager.embed_tokens.weight,
                meta.lm_head.weight is meta.embed_tokens.weight,
            ),
        }
        # and the materialised model trains as the eager one: the gradient bookkeeping follows the new parameters
        ids_BS = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
        norms = []
        for model, parallel in ((eager, eager_parallel), (meta, meta_parallel)):
            _step(model, config, ids_BS)
            parallel.finalize_grads()
            norms.append(parallel.clip_grad_norm_(float("inf")).item())
        grads = [{n: local_box(p.grad)[0] for n, p in m.named_parameters()} for m in (eager, meta)]
        case["norms"] = tuple(norms)
        case["grads_differ"] = [n for n in grads[0] if not torch.equal(grads[0][n], grads[1][n])]
        out[name] = case
    return out


def context_parallel_attention(world: int) -> dict:
    """Core attention over cp=world ranks, each holding its load-balanced positions and handed every rank's keys and
    values: its output rows and q / k / v gradients equal one process's at its positions, and the sinks' gradients
    sum to one process's. GQA, a value head size of its own, sinks, with and without a sliding window."""
    cfg = ParallelConfig(cp=world)
    meshes = build_meshes(cfg.layout(world), "cpu")
    rank, seq = meshes.rank, 32
    positions = load_balanced_positions(seq, world, meshes.layout.coords(rank, "attention")["cp"])
    gen = torch.Generator().manual_seed(11)  # the same tensors on every rank
    q, k = torch.randn(2, 4, seq, 8, generator=gen), torch.randn(2, 2, seq, 8, generator=gen)
    v = torch.randn(2, 2, seq, 6, generator=gen)
    sinks, grad_out = torch.randn(4, generator=gen), torch.randn(2, 4, seq, 6, generator=gen)
    out = {}
    for window in (None, 5):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        reference = CoreAttention(0.3, window)(*leaves)
        ref_grads = torch.autograd.grad(reference, leaves, grad_out)
        holder = nn.ModuleDict({"core": CoreAttention(0.3, window)})
        apply_context_parallel(holder, ("core",), meshes.group("cp"))
        mine = [t[:, :, positions].clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
        got = holder["core"](*mine, positions, positions)
        grads = list(torch.autograd.grad(got, mine, grad_out[:, :, positions]))
        dist.all_reduce(grads[3])  # each rank's sinks saw its own queries
        out[f"window={window}"] = {
            "out": (got - reference[:, :, positions]).abs().max().item(),
            **{
                f"d{name}": (g - (r[:, :, positions] if name != "sinks" else r)).abs().max().item()
                for name, g, r in zip(("q", "k", "v", "sinks"), grads, ref_grads, strict=True)
            },
        }
    return out


def expert_gradient_scale(world: int) -> dict:
    """ep=2 x dp_shard=4 (edp=2): one step of tiny-qwen3-moe, each replica on its slice, against one process."""
    config = preset("tiny-qwen3-moe")
    cfg = ParallelConfig(ep=2)
    meshes = build_meshes(cfg.layout(world), "cpu")
    model = build_model(config, seed=5)
    parallel = parallelize(model, meshes, cfg)
    dp = meshes.layout.dp
    ids_BS = torch.randint(0, config.vocab_size, (dp, 17), generator=torch.Generator().manual_seed(9))

    def lm_loss(m, part):
        return causal_lm_loss(m(part[:, :-1]), part[:, 1:], config.mtp_loss_scaling_factor).total

    loss = lm_loss(model, ids_BS.chunk(dp)[parallel.dp_index])
    loss.backward()
    parallel.finalize_grads()
    norm = parallel.clip_grad_norm_(float("inf")).item()
    reference = build_model(config, seed=5)
    ref_losses = _accumulated_reference(reference, lm_loss, ids_BS, dp)
    grads = _grad_pairs(model, reference)
    return {
        "sizes": (meshes.layout.ep, meshes.layout.dp, meshes.layout.edp),
        "loss": loss.item(),
        "ref_loss": ref_losses[parallel.dp_index],
        "norm": norm,
        "ref_norm": nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item(),
        "expert_grads": {n: g for n, g in grads.items() if ".experts." in n},
    }


def recompute(world: int) -> dict:
    """The experts of every MoE layer recomputed in the backward, through before_fsdp, as the trainer applies it."""
    config = preset("tiny-qwen3-moe")
    ids_BS = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    out = {}
    for name, sizes in {"ep=2": {"ep": 2}, "tp=2 x ep=2 (etp=1)": {"tp": 2, "ep": 2, "etp": 1}}.items():
        cfg = ParallelConfig(**sizes)
        meshes = build_meshes(cfg.layout(world), "cpu")
        runs = {}
        for checkpointed in (False, True):
            model = build_model(config, seed=2)
            wrapped: list[str] = []

            def before_fsdp(m, wrapped=wrapped):
                wrapped.extend(apply_activation_checkpointing(m, ["layers.*.mlp.experts"]))

            parallel = parallelize(model, meshes, cfg, before_fsdp=before_fsdp if checkpointed else None)
            EXPERT_CALLS[0] = 0
            _step(model, config, ids_BS)  # every replica reads the same batch: both runs see the same tokens
            calls = EXPERT_CALLS[0]
            parallel.finalize_grads()
            grads = {n: local_box(p.grad)[0].clone() for n, p in model.named_parameters()}
            runs[checkpointed] = (calls, wrapped, grads)
        plain, ckpt = runs[False], runs[True]
        out[name] = {
            "moe_layers": sum(1 for layer in model.layers if layer.is_moe),
            "calls": (plain[0], ckpt[0]),
            "wrapped": ckpt[1],
            "differ": [n for n in plain[2] if not torch.equal(plain[2][n], ckpt[2][n])],
        }
    return out


def materialised_bytes(world: int) -> dict:
    """Peak tensor bytes while building a 64-expert model's share on meta and materialising it, against this rank's
    expert shard plus the whole non-expert parameters (issue 11's bound), and the whole-model-first way."""
    from moe_memory import LiveTensorBytes

    config = dataclasses.replace(preset("tiny-qwen3-moe"), num_moe_experts=64, num_layers=2)
    out = {}
    for name, sizes in {"ep=4": {"ep": 4}, "tp=2 x ep=2": {"tp": 2, "ep": 2, "etp": 1}}.items():
        cfg = ParallelConfig(**sizes)
        meshes = build_meshes(cfg.layout(world), "cpu")
        with LiveTensorBytes() as meta_way:
            with torch.device("meta"):
                model = build_model(config)
            plan = model.parallel_plan()
            parallelize(model, meshes, cfg, plan)
            materialize(model, plan, model.initial_weights(3), "cpu")
        in_experts = tuple(f"{p}." for p in plan.experts_paths())
        experts = sum(
            local_box(p)[0].untyped_storage().nbytes() for n, p in model.named_parameters() if n.startswith(in_experts)
        )
        with torch.device("meta"):
            whole = build_model(config)
        non_expert = sum(
            t.nbytes for n, t in [*whole.named_parameters(), *whole.named_buffers()] if not n.startswith(in_experts)
        )
        with LiveTensorBytes() as eager_way:
            parallelize(build_model(config, seed=3), meshes, cfg, plan)
        out[name] = (meta_way.peak, eager_way.peak, experts + non_expert)
    return out


def from_checkpoint(world: int, out_dir: Path) -> dict:
    """tp=2 x ep=2 on 4 ranks materialised from a HuggingFace checkpoint: the same local shards as loading the whole
    checkpoint and splitting it, while each rank reads only its experts, and its box of tensors stored as they are."""
    from moe_models.hf import CheckpointSource, load_pretrained, save_pretrained

    config = preset("tiny-qwen3-moe")
    path = out_dir / "hf"
    if dist.get_rank() == 0:
        save_pretrained(build_model(config, seed=5), path)
    dist.barrier()
    cfg = ParallelConfig(tp=2, ep=2, etp=1)
    meshes = build_meshes(cfg.layout(world), "cpu")
    reference = load_pretrained(path)
    parallelize(reference, meshes, cfg)
    with torch.device("meta"):
        model = build_model(config)
    plan = model.parallel_plan()
    parallelize(model, meshes, cfg, plan)
    boxes_read, whole_read = {}, []
    with CheckpointSource(path, config) as source:
        read, read_box = source.reader.read, source.reader.read_box

        def spy_read(entry):
            whole_read.append(entry.key)
            return read(entry)

        def spy_read_box(key, box):
            boxes_read[key] = tuple((s.start, s.stop) for s in box)
            return read_box(key, box)

        source.reader.read, source.reader.read_box = spy_read, spy_read_box
        materialize(model, plan, source, "cpu")
    mine, want = dict(model.named_parameters()), dict(reference.named_parameters())
    local = lambda t: local_box(t)[0]  # noqa: E731
    return {
        "differ": [n for n in want if not torch.equal(local(mine[n]), local(want[n]))],
        # Qwen3 checkpoints store one tensor per expert: model.layers.{l}.mlp.experts.{e}.{proj}.weight
        "experts_read": sorted({int(k.split(".experts.")[1].split(".")[0]) for k in whole_read if ".experts." in k}),
        "first_expert": reference.layers[0].mlp.experts.first_expert,
        "local_experts": reference.layers[0].mlp.experts.num_experts,
        "q_proj_box": boxes_read.get("model.layers.0.self_attn.q_proj.weight"),
        "q_proj_whole_read": "model.layers.0.self_attn.q_proj.weight" in whole_read,
        "q_proj_shape": tuple(want["layers.0.attention.q_proj.weight"].shape),
    }


def flex_dispatch(world: int) -> dict:
    """ep=2 with the flex dispatcher on the stand-in (``moe-dispatch/tests/_fake_deep_ep.py``, CUDA reported
    available while it runs): one step of tiny-qwen3-moe against one process (bf16 on the wire)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "moe-dispatch" / "tests"))
    import _fake_deep_ep

    config = preset("tiny-qwen3-moe")
    cfg = ParallelConfig(ep=2, moe_token_dispatcher_type="flex")
    ids_BS = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(6))
    saved_cuda = torch.cuda.is_available
    sys.modules["deep_ep"] = fake = _fake_deep_ep.module()
    torch.cuda.is_available = lambda: True
    try:
        model = build_model(config, seed=2)
        parallelize(model, build_meshes(cfg.layout(world), "cpu"), cfg)
        buffers = {id(layer.mlp.dispatcher.buffer) for layer in model.layers}
        loss = _step(model, config, ids_BS)  # every rank reads the same batch
    finally:
        torch.cuda.is_available = saved_cuda
        sys.modules.pop("deep_ep", None)
    return {
        "buffers_made": len(fake.Buffer.created),
        "layers_sharing": (len(model.layers), len(buffers)),
        "dispatcher": type(model.layers[0].mlp.dispatcher).__name__,
        "loss": loss,
        "ref_loss": _step(build_model(config, seed=2), config, ids_BS),
    }


def expert_placements(world: int) -> dict:
    config = preset("tiny-qwen3-moe")
    result: dict = {"placements": {}}
    for name, sizes in {
        "ep=2 (edp=2)": {"ep": 2},
        "ep=4 (edp=1)": {"ep": 4},
        "tp=2 x ep=2": {"tp": 2, "ep": 2, "etp": 1},
        "etp=2 x ep=2": {"etp": 2, "ep": 2},
    }.items():
        with torch.device("meta"):  # placements only: nothing to allocate
            model = build_model(config)
        cfg = ParallelConfig(**sizes)
        parallel = parallelize(model, build_meshes(cfg.layout(world), "cpu"), cfg)
        result["placements"][name] = _placements(model)
        # the matrices split outside their placements (etp's slices), by name: (dim, the group's ranks)
        names = {id(p): n for n, p in model.named_parameters()}
        hidden = result.setdefault("hidden", {})
        hidden[name] = {
            names[i]: (s.dim, dist.get_process_group_ranks(s.group)) for i, s in hidden_matrix_splits(parallel).items()
        }
    return result


def few_experts(world: int) -> dict:
    """2 experts over 4 data-parallel ranks: FSDP shards them along dim 1; one step equals one process."""
    few = dataclasses.replace(preset("tiny-qwen3-moe"), num_moe_experts=2, moe_router_topk=1)
    ids_BS = torch.randint(0, few.vocab_size, (2, 17), generator=torch.Generator().manual_seed(5))
    reference = build_model(few, seed=1)
    model = build_model(few, seed=1)
    cfg = ParallelConfig()
    parallel = parallelize(model, build_meshes(cfg.layout(world), "cpu"), cfg)
    result: dict = {"few_experts_placement": _placements(model)["layers.0.mlp.experts.w_down_EFH"]}
    result["loss"] = _step(model, few, ids_BS)  # every rank reads the same batch: the mean is that batch's
    parallel.finalize_grads()
    result["norm"] = parallel.clip_grad_norm_(float("inf")).item()
    result["ref_loss"] = _step(reference, few, ids_BS)
    result["ref_norm"] = torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item()
    return result


# the documents of each row of tiny-qwen3-next's inputs (16 positions; -1: a padding tail), two rows per dp replica
LINEAR_PACKING = [[5, 7, 4], [16], [3, 3, 6, -4], [9, 7]]


def _packed_ids(rows: list[list[int]]) -> torch.Tensor:
    out = []
    for lengths in rows:
        out.append([doc if n > 0 else -1 for doc, n in enumerate(lengths) for _ in range(abs(n))])
    return torch.tensor(out)


def linear_attention(world: int) -> dict:
    """tiny-qwen3-next (three Gated DeltaNet layers, then full attention): one step under tp=2 x dp_shard=2 on plain
    and on packed rows, and under cp=2 x dp_shard=2 and cp=2 x tp=2 (each rank its load-balanced chunks of 16
    positions: the second cp rank's two chunks are one run of positions, the first rank's two), against one process
    accumulating the replicas' slices. Balancing loss off (the sequence split of routing statistics is not what this
    checks). Under cp a rank's loss is its share of the whole sequences' mean, as the trainer takes it."""
    config = preset("tiny-qwen3-next", moe_aux_loss_coeff=[0.0])
    out = {}
    cases = (
        ("rows", {"tp": 2}, False),
        ("packed documents", {"tp": 2}, True),
        ("cp=2", {"cp": 2}, False),
        ("cp=2 x tp=2", {"cp": 2, "tp": 2}, False),
    )
    for case, sizes, packed in cases:
        cfg = ParallelConfig(**sizes)
        meshes = build_meshes(cfg.layout(world), "cpu")
        model = build_model(config, seed=5)
        parallel = parallelize(model, meshes, cfg)
        dp = meshes.layout.dp
        ids_BS = torch.randint(0, config.vocab_size, (2 * dp, 17), generator=torch.Generator().manual_seed(9))
        docs_BS = _packed_ids(LINEAR_PACKING[: 2 * dp]) if packed else None

        def lm_loss(m, rows: slice, positions=None, ids_BS=ids_BS, docs_BS=docs_BS):
            documents = {} if docs_BS is None else {"document_ids_BS": docs_BS[rows]}
            out = m(ids_BS[rows, :-1], positions_S=positions, **documents)
            loss = causal_lm_loss(out, ids_BS[rows, 1:], config.mtp_loss_scaling_factor, positions_S=positions)
            return loss.total

        slices = [slice(2 * r, 2 * r + 2) for r in range(dp)]
        positions = parallel.positions(16)
        with loss_parallel():
            loss = lm_loss(model, slices[parallel.dp_index], positions)
            loss.backward()
        parallel.finalize_grads()
        norm = parallel.clip_grad_norm_(float("inf")).item()
        reference = build_model(config, seed=5)
        ref_losses = []
        for rows in slices:
            ref_loss = lm_loss(reference, rows)
            ref_loss.backward()
            ref_losses.append(ref_loss.item())
        for p in reference.parameters():
            p.grad /= dp
        with torch.no_grad():  # the rank's share of its replica's loss, from the whole sequences' logits
            rows = slices[parallel.dp_index]
            whole = reference(ids_BS[rows, :-1], **({} if docs_BS is None else {"document_ids_BS": docs_BS[rows]}))
            mine = whole if positions is None else dataclasses.replace(whole, logits=whole.logits[:, positions])
            ref_share = causal_lm_loss(mine, ids_BS[rows, 1:], positions_S=positions).total.item()
        out[case] = {
            "placements": {n: v for n, v in _placements(model).items() if n.startswith("layers.0.attention.")},
            "loss": full_value(loss).item(),
            "ref_loss": ref_share,
            "ref_replica_loss": ref_losses[parallel.dp_index],
            "norm": norm,
            "ref_norm": nn.utils.clip_grad_norm_(reference.parameters(), float("inf")).item(),
            "grads": _grad_pairs(model, reference),
        }
    return out


def _keyed(key: str, section, *args) -> dict:
    return {key: section(*args)}


def main(out_dir: Path) -> None:
    ctx = init_distributed("gloo", "cpu")
    world = ctx.world_size
    scenarios = Scenarios(out_dir)  # one scenario per section (_rank_scenarios.py): a dict of what it saw
    scenarios.run("groups", mesh_groups, world)
    scenarios.run("timeouts", group_timeouts, world)
    scenarios.run("placements", expert_placements, world)
    scenarios.run("few experts", few_experts, world)
    for key, section, *args in [
        ("protocol", protocol),
        ("bad_plans", bad_plans),
        ("meta", meta_equals_eager),
        ("expert_scale", expert_gradient_scale),
        ("context_parallel", context_parallel_attention),
        ("recompute", recompute),
        ("bytes", materialised_bytes),
        ("checkpoint", from_checkpoint, out_dir),
        ("flex", flex_dispatch),
        ("linear_attention", linear_attention),
    ]:
        scenarios.run(key, _keyed, key, section, world, *args)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
