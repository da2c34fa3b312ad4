"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): a lightning indexer picks for each query the ``topk``
earlier keys it scores highest, and multi-latent attention then attends over those keys alone.

Lightning indexer. From the hidden state x_s and MLA's normalised q latent c_s (after ``q_a_norm``): H index heads
of size d, q_{s,h} = (W_qb c_s)_h, one key per token shared by the heads k_t = LayerNorm(W_k x_t), the first
``rope_dim`` dimensions of both rotated by the rotary embeddings of their positions (half-split pairs in
DeepSeek-V3.2, interleaved pairs in GLM-5: ``rope_interleaved``), and per-head weights w_{s,h} = (W_w x_s)_h / sqrt(H).
The score of key t for query s is

    I_{s,t} = sum_h w_{s,h} relu(q_{s,h} . k_t / sqrt(d))     (t not later than s; -inf otherwise)

and S_s = the ``topk`` keys of highest I_{s,t}, or every earlier key when there are fewer. Selection is not
differentiable; the indexer learns from its own loss alone.

Sparse attention. With MLA's per-head q, k, v: o_{s,n} = sum_{t in S_s} softmax_t(scale q_{s,n} . k_{t,n}) v_{t,n}.
Queries go in blocks, each gathering its selected keys and values ``[B, N, block, topk, D]``, so memory (held and
saved for the backward) is linear in the sequence for a fixed ``topk``; there is no ``[S, S]`` mask.

Indexer loss (DeepSeek-V3.2 report, sec. 2.1). The target at query s is the main attention's probabilities P_{n,s,t}
summed over the heads n and L1-normalised over the keys, p_{s,t} = sum_n P_{n,s,t} / sum_{n,t'} P_{n,s,t'},
computed without gradient; the loss is KL(p_s || softmax_t I_{s,t}):
  * dense warm-up stage (attention still dense, the model frozen, the indexer alone trained): over every earlier key,
    P the dense causal softmax of scale q.k (:func:`dense_indexer_loss`);
  * sparse training stage (the model trained through sparse attention): over the selected keys S_s only, P the
    sparse attention's softmax over S_s and the indexer's softmax taken over S_s (:func:`sparse_indexer_loss`).
Both average the KL over queries (the report sums over tokens: multiply by their count). The report detaches the
indexer's inputs so that this loss trains the indexer alone and the language-model loss the rest: the caller passes
``x.detach()`` and ``q_latent.detach()`` to the indexer's scores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_models.attention import CoreAttention
from moe_models.rope import apply_rotary

QUERY_BLOCK = 64  # queries per block: bounds the gathered [B, N, block, topk, D] keys


class LightningIndexer(nn.Module):
    """DSA's lightning indexer; parameters as transformers' ``DeepseekV32Indexer`` (``self_attn.indexer.*``):
    ``wq_b`` [H*d, q_lora_rank], ``wk`` [d, hidden], ``k_norm`` (LayerNorm with bias, [d]), ``weights_proj``
    [H, hidden] (HF import is a rename of the prefix). ``rope_interleaved``: False for DeepSeek-V3.2's indexer
    (rotate-half pairs), True for GLM-5's (``glm_moe_dsa``)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
        norm_eps: float = 1e-6,
        rope_interleaved: bool = False,
        block_size: int = QUERY_BLOCK,
    ) -> None:
        super().__init__()
        if topk < 1:
            raise ValueError(f"topk={topk}: the indexer must select at least one key; set index_topk >= 1")
        if rope_dim % 2 or not 0 < rope_dim <= head_dim:
            raise ValueError(f"rope_dim={rope_dim}: must be even and at most the index head_dim={head_dim}")
        self.num_heads, self.head_dim, self.rope_dim, self.topk = num_heads, head_dim, rope_dim, topk
        self.rope_interleaved = rope_interleaved
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=norm_eps)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.top_k = IndexerTopK(topk, block_size)

    def keys(self, x_BSH: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
        """The index keys ``[B, S, d]`` of the tokens (what a generation cache keeps), in fp32 (fp64 for fp64)."""
        k_BSD = self.k_norm(self.wk(x_BSH)).to(_compute_dtype(x_BSH))
        return self._rotate(k_BSD.unsqueeze(1), cos_SF, sin_SF).squeeze(1)

    def forward(
        self,
        x_BSH: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        q_pos_S: torch.Tensor | None = None,
        k_BKD: torch.Tensor | None = None,
        k_pos_K: torch.Tensor | None = None,
        documents_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The selected keys per query, int64 ``[B, S, min(topk, K)]`` indices into the key axis, highest score
        first, -1 in the slots of a query with fewer earlier keys than that. No gradient.

        ``cos_SF`` / ``sin_SF``: rotary tables at the queries' positions (``[S, rope_dim/2]``, or ``[B, S, ...]`` with
        packed documents, as MLA's); ``k_BKD``: index keys from :meth:`keys` (a cache's, or the whole sequence's),
        default the tokens' own; ``q_pos_S`` / ``k_pos_K``: positions for the causal rule (default: the queries are
        the last S of the K keys); ``documents_BS``: packed documents' ids of the whole sequences (indexed by
        position): a query then selects keys of its own document only. The ranking runs in :attr:`top_k` (called as
        core attention is, so that context parallelism can hand it every rank's keys)."""
        with torch.no_grad():
            q_BHSD, w_BSH, k_BKD = self._queries_and_keys(x_BSH, q_latent_BSQ, cos_SF, sin_SF, k_BKD)
            q_pos_S, k_pos_K = _positions(q_BHSD.shape[2], k_BKD.shape[1], q_pos_S, k_pos_K, x_BSH.device)
            # one key head, no values: the (q, k, v, ...) layout of core attention
            k_B1KD = k_BKD.unsqueeze(1)
            documents = () if documents_BS is None else (documents_BS,)
            return self.top_k(q_BHSD, k_B1KD, k_B1KD[..., :0], w_BSH, q_pos_S, k_pos_K, *documents)

    def scores(
        self,
        x_BSH: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        q_pos_S: torch.Tensor | None = None,
        k_BKD: torch.Tensor | None = None,
        k_pos_K: torch.Tensor | None = None,
        documents_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The dense scores I ``[B, S, K]`` (-inf at later keys and at other documents' keys), differentiable: the
        dense indexer loss's input (quadratic in S, as the warm-up's dense attention). Arguments as :meth:`forward`."""
        q_BHSD, w_BSH, k_BKD = self._queries_and_keys(x_BSH, q_latent_BSQ, cos_SF, sin_SF, k_BKD)
        q_pos_S, k_pos_K = _positions(q_BHSD.shape[2], k_BKD.shape[1], q_pos_S, k_pos_K, x_BSH.device)
        hidden_BSK = None if documents_BS is None else ~_same_document(documents_BS, q_pos_S, k_pos_K)
        return _dense_scores(q_BHSD, w_BSH, k_BKD, q_pos_S, k_pos_K, hidden_BSK)

    def selected_scores(
        self,
        x_BSH: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        indices_BST: torch.Tensor,
        k_BKD: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scores ``[B, S, T]`` of the selected keys only (-inf in the -1 slots), differentiable and linear in S:
        the sparse stage's input. ``indices_BST`` from :meth:`forward` (on the same keys)."""
        q_BHSD, w_BSH, k_BKD = self._queries_and_keys(x_BSH, q_latent_BSQ, cos_SF, sin_SF, k_BKD)
        b, s, t = indices_BST.shape
        indices_BST = indices_BST.long()  # transformers' are int32
        k_BSTD = k_BKD.gather(1, indices_BST.clamp_min(0).reshape(b, s * t, 1).expand(-1, -1, k_BKD.shape[-1]))
        logits_BHST = torch.einsum("bhsd,bstd->bhst", q_BHSD, k_BSTD.view(b, s, t, -1)).relu()
        scores_BST = torch.einsum("bhst,bsh->bst", logits_BHST, w_BSH)
        return scores_BST.masked_fill(indices_BST < 0, float("-inf"))

    def _queries_and_keys(
        self,
        x_BSH: torch.Tensor,
        q_latent_BSQ: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        k_BKD: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated index queries ``[B, H, S, d]``, head weights ``[B, S, H]`` carrying both 1/sqrt(H) and the
        1/sqrt(d) of the dot products (relu commutes with a positive scale), and the index keys ``[B, K, d]``: the
        given ones in the queries' dtype, else the tokens' own (:meth:`keys`)."""
        b, s, _ = x_BSH.shape
        dtype = _compute_dtype(x_BSH)
        q_BHSD = self.wq_b(q_latent_BSQ).view(b, s, self.num_heads, self.head_dim).transpose(1, 2).to(dtype)
        # the head weights in fp32 whatever the model's dtype (transformers keeps weights_proj in fp32)
        w_BSH = F.linear(x_BSH.to(dtype), self.weights_proj.weight.to(dtype)) * (self.num_heads * self.head_dim) ** -0.5
        k_BKD = self.keys(x_BSH, cos_SF, sin_SF) if k_BKD is None else k_BKD.to(dtype)
        return self._rotate(q_BHSD, cos_SF, sin_SF), w_BSH, k_BKD

    def _rotate(self, x_BNSD: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
        """Rotary embeddings on the first ``rope_dim`` dimensions (the indexer's rope part leads, unlike MLA's)."""
        rope, rest = x_BNSD.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat([apply_rotary(rope, cos_SF, sin_SF, self.rope_interleaved), rest], dim=-1)


class IndexerTopK(CoreAttention):
    """The indexer's ranking, parameter-free: a core attention in its calling convention, ``(q_BHSD, k_B1KD, v_B1K0,
    w_BSH, q_pos_S, k_pos_K[, documents_BS])`` (index queries, the one index key head, an empty value, the per-query
    head weights where core attention takes its sinks, positions, packed documents' ids), whose output is the
    selection. So context parallelism's ``GatherKeysValues`` hands it the keys of every rank, and the generation cache
    (:class:`~moe_models.generation.KVCache`) those of the tokens before, in the order the sparse core's keys then
    come in. Scores go ``block_size`` queries at a time: ``[B, H, block, K]`` at once, never ``[B, H, S, K]``."""

    def __init__(self, topk: int, block_size: int = QUERY_BLOCK) -> None:
        super().__init__(scale=None)
        _check_block_size(block_size)
        self.topk, self.block_size = topk, block_size

    def forward(
        self,
        q_BHSD: torch.Tensor,
        k_B1KD: torch.Tensor,
        v_B1K0: torch.Tensor,
        w_BSH: torch.Tensor,
        q_pos_S: torch.Tensor,
        k_pos_K: torch.Tensor,
        documents_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del v_B1K0  # the layout's value slot: the indexer only ranks keys
        k_BKD = k_B1KD.squeeze(1)
        topk = min(self.topk, k_BKD.shape[1])

        def select(rows: slice) -> torch.Tensor:
            hidden_BsK = None
            if documents_BS is not None:  # keys of another document are hidden like later ones
                hidden_BsK = ~_same_document(documents_BS, q_pos_S[rows], k_pos_K)
            scores_BsK = _dense_scores(q_BHSD[:, :, rows], w_BSH[:, rows], k_BKD, q_pos_S[rows], k_pos_K, hidden_BsK)
            values_BsT, indices_BsT = scores_BsK.topk(topk, dim=-1)
            return indices_BsT.masked_fill(values_BsT == float("-inf"), -1)

        return _by_query_blocks(select, q_BHSD.shape[2], self.block_size, dim=1)


class SparseCoreAttention(CoreAttention):
    """:func:`sparse_attention` as a parameter-free core attention, called as the dense one with the selected keys'
    indices where it takes its sinks: memory policies address it, context parallelism and the generation cache hand it
    every key (the indices index them); ``scale`` None: 1/sqrt(q/k head dim)."""

    def __init__(self, scale: float | None, block_size: int = QUERY_BLOCK) -> None:
        super().__init__(scale)
        self.block_size = block_size

    def forward(
        self,
        q_BNSD: torch.Tensor,
        k_BNKD: torch.Tensor,
        v_BNKV: torch.Tensor,
        indices_BST: torch.Tensor,
        q_pos_S: torch.Tensor | None = None,
        k_pos_K: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return sparse_attention(q_BNSD, k_BNKD, v_BNKV, indices_BST, self.scale, q_pos_S, k_pos_K, self.block_size)


def sparse_attention(
    q_BNSD: torch.Tensor,
    k_BNKD: torch.Tensor,
    v_BNKV: torch.Tensor,
    indices_BST: torch.Tensor,
    scale: float | None = None,
    q_pos_S: torch.Tensor | None = None,
    k_pos_K: torch.Tensor | None = None,
    block_size: int = QUERY_BLOCK,
) -> torch.Tensor:
    """Attention ``[B, N, S, V]`` of each query over its selected keys: ``indices_BST`` (distinct per query, -1 =
    empty slot) index the K keys of ``k_BNKD`` / ``v_BNKV`` (MLA's per-head keys and values, as
    :class:`~moe_models.mla.MLAUpProjection` forms them). Keys later than their query are ignored whatever the
    indices say; a query left with no key gets zeros. fp32 compute (fp64 for fp64), the output in q's dtype."""
    b, s = q_BNSD.shape[0], q_BNSD.shape[2]
    if indices_BST.dim() != 3 or indices_BST.shape[:2] != (b, s):
        raise ValueError(f"indices_BST has shape {tuple(indices_BST.shape)}: give [B={b}, S={s}, topk] key indices")
    _check_block_size(block_size)
    scale, q_pos_S, k_pos_K = _scale_and_positions(q_BNSD, k_BNKD, scale, q_pos_S, k_pos_K)
    dtype, indices_BST = _compute_dtype(q_BNSD), indices_BST.long()
    k_BNKD, v_BNKV = k_BNKD.to(dtype), v_BNKV.to(dtype)

    def attend(rows: slice) -> torch.Tensor:
        probs_BNsT, v_BNsTV = _selected_probs(
            q_BNSD[:, :, rows].to(dtype), k_BNKD, v_BNKV, indices_BST[:, rows], scale, q_pos_S[rows], k_pos_K
        )
        return torch.einsum("bnst,bnstv->bnsv", probs_BNsT, v_BNsTV)

    return _by_query_blocks(attend, s, block_size, dim=2).to(q_BNSD.dtype)


def dense_indexer_loss(
    index_scores_BSK: torch.Tensor,
    q_BNSD: torch.Tensor,
    k_BNKD: torch.Tensor,
    scale: float | None = None,
    q_pos_S: torch.Tensor | None = None,
    k_pos_K: torch.Tensor | None = None,
    block_size: int = QUERY_BLOCK,
    documents_BS: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dense warm-up's indexer loss: mean over queries of KL(p_s || softmax(I_s)) over every earlier key, p the
    dense causal attention of ``q_BNSD`` on ``k_BNKD`` summed over heads and L1-normalised (no gradient).
    ``index_scores_BSK`` from :meth:`LightningIndexer.scores`; ``documents_BS`` (packed rows, indexed by position):
    a query's keys are those of its own document only."""
    scale, q_pos_S, k_pos_K = _scale_and_positions(q_BNSD, k_BNKD, scale, q_pos_S, k_pos_K)
    dtype = _compute_dtype(index_scores_BSK)

    def visible(rows: slice | None = None) -> torch.Tensor:
        """``[B or 1, s, K]``: the keys each query of ``rows`` sees (earlier ones of its document)."""
        q_pos_s = q_pos_S if rows is None else q_pos_S[rows]
        causal_1sK = (k_pos_K <= q_pos_s.unsqueeze(-1)).unsqueeze(0)
        return causal_1sK if documents_BS is None else causal_1sK & _same_document(documents_BS, q_pos_s, k_pos_K)

    def heads_summed(rows: slice) -> torch.Tensor:
        logits_BNsK = torch.einsum("bnsd,bnkd->bnsk", q_BNSD[:, :, rows].to(dtype), k_BNKD.to(dtype)) * scale
        return _masked_softmax(logits_BNsK, visible(rows).unsqueeze(1)).sum(1)

    with torch.no_grad():
        target_BSK = _l1_normalise(_by_query_blocks(heads_summed, q_BNSD.shape[2], block_size, dim=1))
    return _kl(target_BSK, index_scores_BSK.to(dtype), visible())


def sparse_indexer_loss(
    selected_scores_BST: torch.Tensor,
    q_BNSD: torch.Tensor,
    k_BNKD: torch.Tensor,
    indices_BST: torch.Tensor,
    scale: float | None = None,
    q_pos_S: torch.Tensor | None = None,
    k_pos_K: torch.Tensor | None = None,
    block_size: int = QUERY_BLOCK,
) -> torch.Tensor:
    """The sparse stage's indexer loss: mean over queries of KL(p_s || softmax(I_s)) over the selected keys S_s only,
    p the sparse attention's probabilities over S_s summed over heads and L1-normalised (no gradient), the indexer's
    softmax over S_s. ``selected_scores_BST`` from :meth:`LightningIndexer.selected_scores` on ``indices_BST``."""
    scale, q_pos_S, k_pos_K = _scale_and_positions(q_BNSD, k_BNKD, scale, q_pos_S, k_pos_K)
    dtype, indices_BST = _compute_dtype(selected_scores_BST), indices_BST.long()

    with torch.no_grad():
        q_BNSD, k_BNKD = q_BNSD.to(dtype), k_BNKD.to(dtype)

        def heads_summed(rows: slice) -> torch.Tensor:
            probs_BNsT, _ = _selected_probs(
                q_BNSD[:, :, rows], k_BNKD, None, indices_BST[:, rows], scale, q_pos_S[rows], k_pos_K
            )
            return probs_BNsT.sum(1)

        target_BST = _l1_normalise(_by_query_blocks(heads_summed, q_BNSD.shape[2], block_size, dim=1))
    return _kl(target_BST, selected_scores_BST.to(dtype), _selected_valid(indices_BST, q_pos_S, k_pos_K))


def _dense_scores(
    q_BHSD: torch.Tensor,
    w_BSH: torch.Tensor,
    k_BKD: torch.Tensor,
    q_pos_S: torch.Tensor,
    k_pos_K: torch.Tensor,
    hidden_BSK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Index scores ``[B, S, K]`` of the queries against all keys, -inf at keys later than the query (and where
    ``hidden_BSK``)."""
    logits_BHSK = torch.einsum("bhsd,bkd->bhsk", q_BHSD, k_BKD).relu()
    scores_BSK = torch.einsum("bhsk,bsh->bsk", logits_BHSK, w_BSH)
    hidden = k_pos_K > q_pos_S.unsqueeze(-1)
    return scores_BSK.masked_fill(hidden if hidden_BSK is None else hidden | hidden_BSK, float("-inf"))


def _selected_probs(
    q_BNsD: torch.Tensor,
    k_BNKD: torch.Tensor,
    v_BNKV: torch.Tensor | None,
    indices_BsT: torch.Tensor,
    scale: float,
    q_pos_s: torch.Tensor,
    k_pos_K: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query block's attention probabilities over its selected keys ``[B, N, s, T]`` and the selected values
    ``[B, N, s, T, V]`` (None without ``v_BNKV``)."""
    b, n, s_blk, _ = q_BNsD.shape
    t = indices_BsT.shape[-1]
    valid_BsT = _selected_valid(indices_BsT, q_pos_s, k_pos_K)
    flat_B1X1 = indices_BsT.clamp_min(0).reshape(b, 1, s_blk * t, 1)

    def gather(x_BNKD: torch.Tensor) -> torch.Tensor:
        picked = x_BNKD.gather(2, flat_B1X1.expand(-1, x_BNKD.shape[1], -1, x_BNKD.shape[-1]))
        return picked.view(b, x_BNKD.shape[1], s_blk, t, -1).expand(-1, n, -1, -1, -1)

    logits_BNsT = torch.einsum("bnsd,bnstd->bnst", q_BNsD, gather(k_BNKD)) * scale
    probs_BNsT = _masked_softmax(logits_BNsT, valid_BsT.unsqueeze(1))
    return probs_BNsT, None if v_BNKV is None else gather(v_BNKV)


def _same_document(documents_BS: torch.Tensor, q_pos_S: torch.Tensor, k_pos_K: torch.Tensor) -> torch.Tensor:
    """``[B, S, K]``: whether each key is of its query's document (``documents_BS`` indexed by position)."""
    return documents_BS[:, q_pos_S].unsqueeze(-1) == documents_BS[:, k_pos_K].unsqueeze(1)


def _selected_valid(indices_BST: torch.Tensor, q_pos_S: torch.Tensor, k_pos_K: torch.Tensor) -> torch.Tensor:
    """Which slots hold a key the query may see: a real index (not -1) of a key not later than the query."""
    indices_BST = indices_BST.long()
    return (indices_BST >= 0) & (k_pos_K[indices_BST.clamp_min(0)] <= q_pos_S.unsqueeze(-1))


def _masked_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis restricted to ``valid``; all zeros where nothing is valid (no NaN either way)."""
    logits = logits.masked_fill(~valid, float("-inf"))
    peak = logits.amax(-1, keepdim=True).detach()
    weights = torch.exp(logits - torch.where(torch.isfinite(peak), peak, 0.0))
    return weights / weights.sum(-1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny)


def _l1_normalise(p: torch.Tensor) -> torch.Tensor:
    return p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)


def _kl(target: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean over queries of KL(target || softmax(scores)) over the valid entries (the target is zero elsewhere)."""
    log_q = F.log_softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).masked_fill(~valid, 0.0)
    return (torch.xlogy(target, target) - target * log_q).sum(-1).mean()


def _by_query_blocks(block: Callable[[slice], torch.Tensor], s: int, block_size: int, dim: int) -> torch.Tensor:
    """``block(rows)`` of each ``block_size`` queries of the S in turn, concatenated along ``dim`` (the query axis):
    what is formed for a block at once is bounded by the block, never the sequence."""
    return torch.cat([block(slice(i, i + block_size)) for i in range(0, s, block_size)], dim=dim)


def _scale_and_positions(
    q_BNSD: torch.Tensor,
    k_BNKD: torch.Tensor,
    scale: float | None,
    q_pos_S: torch.Tensor | None,
    k_pos_K: torch.Tensor | None,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The softmax scale (default 1/sqrt(the q/k head dim)) and the query and key positions (:func:`_positions`)."""
    scale = q_BNSD.shape[-1] ** -0.5 if scale is None else scale
    return scale, *_positions(q_BNSD.shape[2], k_BNKD.shape[2], q_pos_S, k_pos_K, q_BNSD.device)


def _positions(
    s: int, k: int, q_pos_S: torch.Tensor | None, k_pos_K: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key positions; by default the keys are 0..K-1 and the queries the last S of them."""
    if k_pos_K is None:
        k_pos_K = torch.arange(k, device=device)
    if q_pos_S is None:
        q_pos_S = torch.arange(k - s, k, device=device)
    if q_pos_S.shape != (s,) or k_pos_K.shape != (k,):
        raise ValueError(f"q_pos_S / k_pos_K must be [S={s}] / [K={k}] positions; per-row positions are not supported")
    return q_pos_S, k_pos_K


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size={block_size}: give a positive number of queries per block")


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)
