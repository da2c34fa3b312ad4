"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values go through low-rank latents; a part of
each q/k head gets rotary embeddings, with one rotary key shared by all heads.

With DeepSeek Sparse Attention (DeepSeek-V3.2: ``dsa_indexer_topk`` set) a lightning indexer (``indexer``, as
transformers names it) reads the hidden state and the normalised q latent and picks each query's top-k earlier keys;
``core_attention`` is then :class:`~moe_models.sparse_attention.SparseCoreAttention` over those keys alone, called
with the indices where dense core attention takes its sinks. The selection runs without gradient (as transformers'):
it is not differentiable, so the indexer learns from its own loss alone.

Training the indexer (``dsa_indexer_loss_coeff`` set; DeepSeek-V3.2 report sec. 2.1, Megatron-Core's DSAttention):
in training mode with gradients on, the layer also computes the indexer's KL loss against this layer's attention,
the indexer reading ``x.detach()`` and ``q_latent.detach()`` and the target built from q and k without gradient, so
that the loss reaches the indexer's parameters and nothing else; the forward then returns ``(out, indexer_loss)``
(the loss None in eval mode or under no_grad) and the decoder layer hands it on (``ModelOutput.indexer_loss``, summed
over layers; the trainer adds ``dsa_indexer_loss_coeff`` times it). Which KL:
  * ``dsa_indexer_use_sparse_loss``: over the selected keys (:func:`~moe_models.sparse_attention.sparse_indexer_loss`,
    the report's sparse stage);
  * otherwise over every earlier key (:func:`~moe_models.sparse_attention.dense_indexer_loss`), attention still
    sparse (Megatron-Core's default) or, with ``dsa_indexer_dense_warmup``, dense (the report's warm-up: the core is
    dense :class:`~moe_models.attention.CoreAttention` and the indexer selects nothing)."""

from __future__ import annotations

import torch
from torch import nn

from moe_models.attention import CoreAttention
from moe_models.config import ModelConfig
from moe_models.layers import RMSNorm
from moe_models.qk_clip import AttentionLogitMax, logit_max_of
from moe_models.rope import apply_rotary
from moe_models.sparse_attention import (
    LightningIndexer,
    SparseCoreAttention,
    dense_indexer_loss,
    sparse_indexer_loss,
)


class MLAUpProjection(nn.Module):
    """From the latents to the attention inputs: the up projections of queries and keys/values, split into heads,
    rotary embeddings on their rope parts and the shared rotary key. Parameter-free (the projections are passed in
    and stay on :class:`MultiLatentAttention` under their checkpoint names): a module so that memory policies can
    address it (Megatron's ``mla_up_proj`` recompute)."""

    def __init__(self, nope_dim: int, rope_dim: int, v_dim: int, interleaved: bool) -> None:
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim, self.interleaved = nope_dim, rope_dim, v_dim, interleaved

    def forward(
        self,
        q_up: nn.Module,
        kv_up: nn.Module,
        q_in_BSQ: torch.Tensor,
        kv_latent_BSC: torch.Tensor,
        k_rope_BSR: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k ``[B, N, S, nope + rope]`` and v ``[B, N, S, v_dim]``."""
        b, s, _ = q_in_BSQ.shape
        # heads counted from the projection widths, so a tensor-parallel rank computes its share of them
        q_BNSD = q_up(q_in_BSQ).view(b, s, -1, self.nope_dim + self.rope_dim).transpose(1, 2)
        n = q_BNSD.shape[1]
        q_nope, q_rope = q_BNSD.split([self.nope_dim, self.rope_dim], dim=-1)
        kv_BNSD = kv_up(kv_latent_BSC).view(b, s, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v_BNSV = kv_BNSD.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = apply_rotary(q_rope, cos_SF, sin_SF, self.interleaved)
        k_rope_B1SR = apply_rotary(k_rope_BSR.unsqueeze(1), cos_SF, sin_SF, self.interleaved)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope_B1SR.expand(b, n, s, self.rope_dim)], dim=-1)
        return q, k, v_BNSV


class MultiLatentAttention(nn.Module):
    """Causal MLA. Per head: q/k = [``qk_head_dim`` without rope | ``qk_pos_emb_head_dim`` with rope], v of
    ``v_head_dim``; ``kv_a_proj`` maps to the ``kv_lora_rank`` latent plus the shared rotary key."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.kv_lora_rank = c.num_attention_heads, c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        qk_dim, h = self.nope_dim + self.rope_dim, c.hidden_size
        self.q_latent = c.q_lora_rank is not None
        if not self.q_latent:
            self.q_proj = nn.Linear(h, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, c.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.mla_latent_norm_epsilon)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_lora_rank, c.mla_latent_norm_epsilon)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=False)
        self.up_proj = MLAUpProjection(self.nope_dim, self.rope_dim, self.v_dim, c.rotary_interleaved)
        self.indexer: LightningIndexer | None = None
        self.core_attention: CoreAttention | SparseCoreAttention = CoreAttention(c.softmax_scale)
        self.logit_max = AttentionLogitMax(c.softmax_scale)  # QK-clip's maxima, computed when asked
        # set by the config alone, so the forward's return shape is too: (out, indexer_loss) when the indexer trains
        self.trains_indexer = bool(c.dsa_indexer_loss_coeff)
        self.sparse_indexer_loss, self.dense_warmup = c.dsa_indexer_use_sparse_loss, c.dsa_indexer_dense_warmup
        if c.dsa_indexer_topk is not None:
            self.indexer = LightningIndexer(
                hidden_size=h,
                q_lora_rank=c.q_lora_rank,
                num_heads=c.dsa_indexer_n_heads,
                head_dim=c.dsa_indexer_head_dim,
                rope_dim=self.rope_dim,
                topk=c.dsa_indexer_topk,
                rope_interleaved=c.dsa_indexer_rope_interleaved,  # GLM-5's indexer rotates interleaved pairs
            )
            if not self.dense_warmup:
                self.core_attention = SparseCoreAttention(c.softmax_scale)

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
        logit_max: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`moe_models.attention.Attention.forward`; ``(out, indexer_loss)`` when the indexer trains (module
        docstring), ``(out, max logit per local head)`` with ``logit_max`` (not with a DSA indexer)."""
        if logit_max and self.indexer is not None:
            raise ValueError("logit_max: DeepSeek sparse attention (dsa_indexer_topk) reports no QK-clip maxima")
        b, s, _ = x_BSH.shape
        q_in_BSQ = self.q_a_norm(self.q_a_proj(x_BSH)) if self.q_latent else x_BSH
        latent_BSC, k_rope_BSR = self.kv_a_proj(x_BSH).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_up = self.q_b_proj if self.q_latent else self.q_proj
        q, k, v_BNSV = self.up_proj(
            q_up, self.kv_b_proj, q_in_BSQ, self.kv_a_norm(latent_BSC), k_rope_BSR, cos_SF, sin_SF
        )
        documents = () if document_ids_BS is None else (document_ids_BS,)  # a 7th argument only with documents
        indices_BST = None
        if self.indexer is None or self.dense_warmup:
            out_BNSV = self.core_attention(q, k, v_BNSV, None, positions_S, positions_S, *documents)
        else:  # the selection keeps each query to its own document, so the sparse core needs no document ids
            indices_BST = self.indexer(x_BSH, q_in_BSQ, cos_SF, sin_SF, positions_S, None, positions_S, *documents)
            out_BNSV = self.core_attention(q, k, v_BNSV, indices_BST, positions_S, positions_S)
        out_BSH = self.o_proj(out_BNSV.transpose(1, 2).reshape(b, s, -1))
        if logit_max:
            return out_BSH, logit_max_of(self.logit_max, q, k, positions_S, documents)
        if not self.trains_indexer:
            return out_BSH
        if not (self.training and torch.is_grad_enabled()):  # evaluation, generation: nothing to train
            return out_BSH, None
        loss = self._indexer_loss(x_BSH, q_in_BSQ, cos_SF, sin_SF, q, k, indices_BST, positions_S, document_ids_BS)
        return out_BSH, loss

    def _indexer_loss(
        self,
        x_BSH: torch.Tensor,
        q_in_BSQ: torch.Tensor,
        cos_SF: torch.Tensor,
        sin_SF: torch.Tensor,
        q_BNSD: torch.Tensor,
        k_BNSD: torch.Tensor,
        indices_BST: torch.Tensor | None,
        positions_S: torch.Tensor | None,
        document_ids_BS: torch.Tensor | None,
    ) -> torch.Tensor:
        """The indexer's KL loss (fp32 scalar) against this layer's attention: the indexer's inputs and the attention's
        q and k detached, so its gradient reaches the indexer's parameters alone."""
        x_BSH, q_in_BSQ, q_BNSD, k_BNSD = x_BSH.detach(), q_in_BSQ.detach(), q_BNSD.detach(), k_BNSD.detach()
        scale = self.core_attention.scale
        if self.sparse_indexer_loss:
            selected_BST = self.indexer.selected_scores(x_BSH, q_in_BSQ, cos_SF, sin_SF, indices_BST)
            return sparse_indexer_loss(selected_BST, q_BNSD, k_BNSD, indices_BST, scale, positions_S, positions_S)
        scores_BSK = self.indexer.scores(
            x_BSH, q_in_BSQ, cos_SF, sin_SF, positions_S, None, positions_S, document_ids_BS
        )
        return dense_indexer_loss(
            scores_BSK, q_BNSD, k_BNSD, scale, positions_S, positions_S, documents_BS=document_ids_BS
        )
