"""QK-clip (Kimi K2's MuonClip, Megatron-Core's ``qk_clip``), the model's part: each softmax attention's largest
pre-softmax logit per query head, and the rescale of its query and key projections that shrinks a head's logits by a
factor. The training step (moe_train.qk_clip) takes the maxima over its micro-batches and every rank, and after the
optimizer step rescales every head whose maximum exceeds the threshold tau by ``gamma_h = tau / S_max^h``.

The maximum (:class:`AttentionLogitMax`): ``max(q_i . k_j * softmax_scale)`` over the pairs the attention lets a
query see (causal, window, chunk, same document), per query head, over the batch: the q and k the core attention is
given, so every linear step before it (rotary embeddings, Llama 4's temperature) counts. It is a module called as core
attention is, ``(q, k, v, sinks, q_pos, k_pos[, documents])``, so that context parallelism hands it the keys of every
cp rank as it does the core attention's (the parallel plan names both); v and the sinks are not read. It runs without
gradient, a block of query rows at a time (memory linear in the sequence, as the blockwise kernel), and costs one more
``q k^T`` per layer: a forward computes it only when asked (``MoETransformer.forward(attention_logit_max=True)``).
Learned sinks are not ``q . k`` logits and are left out.

The rescale (:func:`attention_row_scales`, the factor of each row of the q/k projections, and :func:`scale_rows_`,
which applies it to a tensor's rows from a global row offset: a tensor-parallel or FSDP shard's):

* GQA / MHA (:class:`~moe_models.attention.Attention`): a key head serves the G query heads of its group, so as
  Megatron-Core the group's factor is its smallest, ``eta_g = min_h gamma_h``; the group's query rows (weight and bias)
  are scaled by ``eta_g ** alpha`` and its key rows by ``eta_g ** (1 - alpha)`` (``alpha`` 0.5: Kimi K2's square
  roots). Every head of the group then has its logits scaled by ``eta_g``: the head that set it lands on tau, the
  others below it. The output gate's rows (``attention_output_gate``, after each head's q rows) and v stay.
* MLA (:class:`~moe_models.mla.MultiLatentAttention`), per head (Kimi K2): the no-rope query rows (``q_proj`` or
  ``q_b_proj``) by ``gamma ** alpha``, the head's key rows of ``kv_b_proj`` by ``gamma ** (1 - alpha)``, the rope
  query rows by ``gamma``; the rotary key shared by every head (``kv_a_proj``) and the value rows stay.

A norm after the q/k projections (``qk_layernorm``, ``qk_l2_norm``) undoes a rescale of their rows and a clamp
(``clip_qkv``) keeps it from scaling the logits exactly: :func:`qk_clip_refusals` names them, with DeepSeek sparse
attention (its core attends to selected keys alone)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_models.blockwise import _block_rows, _key_ranges, _scores, _whole_sequence_key_ranges
from moe_models.documents import document_positions

if TYPE_CHECKING:
    from moe_models.config import ModelConfig


class AttentionLogitMax(nn.Module):
    """The largest ``q . k * scale`` per query head over the allowed pairs of the batch (module docstring): fp32
    (fp64 for fp64 inputs) ``[N]``, -inf for a head whose queries see no key. Parameter-free; ``scale``, ``window``
    and ``chunk`` are its layer's core attention's."""

    def __init__(self, scale: float | None, window: int | None = None, chunk: int | None = None) -> None:
        super().__init__()
        self.scale, self.window, self.chunk = scale, window, chunk

    @torch.no_grad()
    def forward(
        self,
        q_BNSD: torch.Tensor,
        k_BNKD: torch.Tensor,
        v_BNKV: torch.Tensor | None = None,
        sinks_N: torch.Tensor | None = None,
        q_pos_S: torch.Tensor | None = None,
        k_pos_K: torch.Tensor | None = None,
        documents_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Positions and documents as :meth:`moe_models.attention.CoreAttention.forward` takes them."""
        b, n, seq, d = q_BNSD.shape
        n_kv, keys = k_BNKD.shape[1], k_BNKD.shape[2]
        scale = self.scale if self.scale is not None else d**-0.5
        chunk = self.chunk
        if documents_BS is not None and chunk is not None:  # as CoreAttention: chunks restart at each document
            documents_BS = (document_positions(documents_BS) % chunk == 0).cumsum(-1)
            chunk = None
        if k_pos_K is None:
            k_pos_K = q_pos_S
        whole_sequence = q_pos_S is None
        q_pos = torch.arange(seq, device=q_BNSD.device) if whole_sequence else q_pos_S
        k_pos = torch.arange(keys, device=k_BNKD.device) if whole_sequence else k_pos_K
        rows = _block_rows(b, n, keys, seq, self.window, chunk)
        if whole_sequence:
            ranges = _whole_sequence_key_ranges(seq, keys, self.window, rows, chunk)
        else:
            ranges = _key_ranges(q_pos, k_pos, self.window, rows, chunk)
        q_docs_BS = k_docs_BK = None
        if documents_BS is not None:
            q_docs_BS = documents_BS[:, :seq] if whole_sequence else documents_BS[:, q_pos]
            k_docs_BK = documents_BS[:, :keys] if whole_sequence else documents_BS[:, k_pos]
        q5 = q_BNSD.reshape(b, n_kv, n // n_kv, seq, d)
        acc = torch.promote_types(q_BNSD.dtype, torch.float32)
        top_BNG = torch.full((b, n_kv, n // n_kv), float("-inf"), dtype=acc, device=q_BNSD.device)
        for q0, q1, k0, k1 in ranges:
            if k1 == k0:
                continue
            docs = (None, None) if q_docs_BS is None else (q_docs_BS[:, q0:q1], k_docs_BK[:, k0:k1])
            scores = _scores(
                q5[:, :, :, q0:q1].contiguous(),
                k_BNKD[:, :, k0:k1],
                q_pos[q0:q1],
                k_pos[k0:k1],
                self.window,
                scale,
                *docs,
                chunk,
            )
            top_BNG = torch.maximum(top_BNG, scores.amax(dim=(-1, -2)))
        return top_BNG.amax(dim=0).reshape(n)


def has_logit_max(attention: nn.Module | None) -> bool:
    """Whether ``attention`` is a softmax attention that can report its logit maxima (GQA or MLA)."""
    return isinstance(getattr(attention, "logit_max", None), AttentionLogitMax)


def softmax_attentions(model: nn.Module) -> list[nn.Module]:
    """The softmax attentions of ``model`` (a :class:`~moe_models.model.MoETransformer` or a
    :class:`~moe_models.pipeline.ModelStage`) in the rows of ``ModelOutput.attention_logit_max``: the decoder layers'
    in order, then the MTP depths'. Linear-attention and state-space layers have no logits and no row."""
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    depths = [mtp.layer for mtp in getattr(model, "mtp", ())]
    return [layer.attention for layer in [*layers, *depths] if has_logit_max(layer.attention)]


def qk_clip_refusals(config: ModelConfig) -> dict[str, str]:
    """``{ModelConfig field: why}`` for what keeps a rescale of the q/k projections from scaling the logits (module
    docstring); empty when QK-clip applies."""
    out = {}
    if config.dsa_indexer_topk is not None:
        out["dsa_indexer_topk"] = "DeepSeek sparse attention is not QK-clipped (its core sees the selected keys alone)"
    if config.multi_latent_attention:  # MLA has neither per-head q/k norms nor the clamp
        return out
    if config.qk_layernorm:
        out["qk_layernorm"] = "the q/k norms after the projections undo their rescale"
    if config.qk_l2_norm:
        out["qk_l2_norm"] = "the q/k L2 norm after the projections undoes their rescale"
    if config.clip_qkv is not None:
        out["clip_qkv"] = "the q/k clamp after the projections keeps their rescale from scaling the logits exactly"
    return out


def _per_head_rows(parts: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """Row factors of a projection whose rows are, per head, consecutive parts: ``(rows, factor per head [N])``."""
    return torch.cat([factor_N[:, None].expand(-1, rows) for rows, factor_N in parts], dim=1).reshape(-1)


def attention_row_scales(attention: nn.Module, gamma_N: torch.Tensor, alpha: float = 0.5) -> dict[str, torch.Tensor]:
    """``{parameter name under attention: the factor of each of its global rows}`` that scale the logits of every
    query head h by ``gamma_N[h]`` (``gamma_N``: every head of the layer, <= 1; GQA scales a group by its smallest,
    module docstring). Factors are fp32 on ``gamma_N``'s device; names absent from the module (no bias) are left out.
    The heads counted are the whole layer's (the config's), so the rows are the unsplit projections'."""
    gamma_N = gamma_N.float()
    one_N = torch.ones_like(gamma_N)
    if hasattr(attention, "kv_b_proj"):  # MLA
        nope, rope, v_dim = attention.nope_dim, attention.rope_dim, attention.v_dim
        q_rows = _per_head_rows([(nope, gamma_N.pow(alpha)), (rope, gamma_N)])
        kv_rows = _per_head_rows([(nope, gamma_N.pow(1 - alpha)), (v_dim, one_N)])
        q_name = "q_b_proj" if attention.q_latent else "q_proj"
        return {f"{q_name}.weight": q_rows, "kv_b_proj.weight": kv_rows}
    groups, d = attention.num_kv_heads, attention.head_dim
    eta_G = gamma_N.reshape(groups, -1).amin(dim=1)
    eta_N = eta_G.repeat_interleave(gamma_N.numel() // groups)
    q_parts = [(d, eta_N.pow(alpha))] + ([(d, one_N)] if attention.output_gate else [])  # per head [q, gate]
    scales = {"q_proj": _per_head_rows(q_parts), "k_proj": _per_head_rows([(d, eta_G.pow(1 - alpha))])}
    return {
        f"{proj}.{kind}": rows
        for proj, rows in scales.items()
        for kind in ("weight", "bias")
        if getattr(getattr(attention, proj), kind, None) is not None
    }


@torch.no_grad()
def scale_rows_(tensor: torch.Tensor, row_scales_R: torch.Tensor, row_offset: int = 0) -> None:
    """Multiply ``tensor``'s rows in place by ``row_scales_R[row_offset : row_offset + rows]``: ``tensor`` is rows
    ``row_offset..`` of the whole projection (a tensor-parallel rank's heads start at ``head offset x rows per head``;
    an FSDP shard at its global row offset)."""
    rows = tensor.shape[0]
    if rows == 0:
        return
    factor = row_scales_R[row_offset : row_offset + rows].to(device=tensor.device)
    if factor.numel() != rows:
        raise ValueError(f"rows {row_offset}..{row_offset + rows} are past the projection's {row_scales_R.numel()}")
    tensor.mul_(factor.to(torch.promote_types(tensor.dtype, torch.float32)).view(rows, *([1] * (tensor.dim() - 1))))


@torch.no_grad()
def clip_attention_(attention: nn.Module, gamma_N: torch.Tensor, alpha: float = 0.5) -> None:
    """Rescale one attention's (whole, unsplit) q/k projections so that head h's logits scale by ``gamma_N[h]``
    (:func:`attention_row_scales`). Split parameters: apply :func:`scale_rows_` to each shard with its row offset."""
    for name, rows in attention_row_scales(attention, gamma_N, alpha).items():
        scale_rows_(attention.get_parameter(name), rows)


def logit_max_of(
    module: AttentionLogitMax,
    q_BNSD: torch.Tensor,
    k_BNKD: torch.Tensor,
    positions_S: torch.Tensor | None,
    documents: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """``module``'s maxima for the q and k a core attention is given, called positionally as core attention is
    (context parallelism's pre-hook then gathers the keys, with v: here an empty tensor), without gradient."""
    with torch.no_grad():
        q, k = q_BNSD.detach(), k_BNKD.detach()
        return module(q, k, k.new_empty(*k.shape[:-1], 0), None, positions_S, positions_S, *documents)
