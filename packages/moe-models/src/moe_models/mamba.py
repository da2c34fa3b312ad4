"""Nemotron-H's Mamba-2 mixer: the selective state-space token mixer of its ``M`` layers, in place of
:class:`~moe_models.attention.Attention`.

One input projection gives, per token, the gate z and the scan input x (``mamba_num_heads`` heads of
``mamba_head_dim`` channels), B and C (``mamba_num_groups`` groups of ``mamba_state_dim``) and one time step per head.
x, B and C go through a causal depthwise convolution of ``mamba_conv_kernel_dim`` taps (with a bias when
``mamba_conv_bias``) and SiLU; then, per head,

    dt = clamp(softplus(dt_proj + dt_bias), mamba_dt_clamp_min, mamba_dt_clamp_max),    A = -exp(A_log)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,    y_t = h_t C_t + D x_t

(:func:`~moe_models.ssd.chunk_ssd_scan`, each B/C group serving its consecutive heads). The scan's output is gated
and normalised, ``weight * rmsnorm(y * silu(z))`` over the channels of each group's heads
(:func:`~moe_models.ssd.gated_rms_norm`, epsilon ``norm_epsilon``), and goes through ``out_proj``. The scan and the
norm compute in fp32 (fp64 for fp64 inputs), as transformers' torch path does, and ``out_proj`` takes the input's dtype.

Parameters under transformers' ``NemotronHMamba2Mixer`` names: ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log`` and
``D`` one per head, ``norm.weight`` one per channel of x (heads in order), ``out_proj``. Their rows are grouped by B/C
group, so that a contiguous split over tensor-parallel ranks gives each rank whole groups with their heads:
``in_proj``'s rows are, group by group, ``[z, x, B, C, dt]`` of the group (its heads' z and x channels, its B and C,
its heads' time steps), the conv's channels ``[x, B, C]`` of each group; transformers stores each of the five parts
whole over all heads and groups (``[z, x, B, C, dt]``, conv ``[x, B, C]``), and ``moe_models.hf`` reorders the rows
on import and export. The layer reads how many heads it holds from :meth:`Mamba2Mixer.head_parameters`, so a rank
holding a split computes its heads and groups.

Packed documents (``document_ids_BS``): neither the convolution window nor the state crosses a document boundary, each
document computed alone from zero states, batched by length as Gated DeltaNet does
(:func:`~moe_models.recurrent_documents.per_document`). Rotary tables are taken and ignored.

Given positions (``positions_S``, a context-parallel rank's share of each sequence), each run of consecutive positions
is a segment computed from the states the segment before leaves (:mod:`moe_models.sequence_segments`): the
convolution from its last W - 1 inputs, the scan from a zero state, then corrected. The scan is linear in its state
with a scalar decay per head, so a segment's final state is ``exp(sum dt A) h_in + h_0`` and its outputs gain
``exp(cumulative dt A)_t h_in C_t``: its summary is ``h_0`` (``[N, P, D]``) and its total log decay, exchanged
through :attr:`Mamba2Mixer.segments` and chained in position order. Packed documents with given positions are
refused for now.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_models import recurrent_backends
from moe_models.config import ModelConfig
from moe_models.recurrent_documents import per_document
from moe_models.sequence_segments import SegmentedPositions, SequenceSegments
from moe_models.ssd import gated_rms_norm

__all__ = ["Mamba2Mixer", "MambaHeadParameters"]


class MambaHeadParameters(NamedTuple):
    """The per-head (and per-channel) parameters of the heads a :class:`Mamba2Mixer` computes."""

    conv_weight_CW: torch.Tensor  # [x, B, C] channels
    conv_bias_C: torch.Tensor | None
    A_log_N: torch.Tensor
    dt_bias_N: torch.Tensor
    D_N: torch.Tensor
    norm_weight_I: torch.Tensor  # one per channel of x (the heads' channels in order)


class _GatedNorm(nn.Module):
    """Holds the gated norm's weight under transformers' name (``norm.weight``), starting at one; the mixer applies
    it with :func:`~moe_models.ssd.gated_rms_norm` to the heads it computes."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer (module docstring); called as :class:`~moe_models.attention.Attention` is."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.head_dim, self.state_dim = c.mamba_head_dim, c.mamba_state_dim
        self.heads_per_group = c.mamba_num_heads // c.mamba_num_groups
        self.chunk_size = c.mamba_chunk_size
        self.kernel_backend = c.mamba_backend  # _mix's kernels (moe_models.recurrent_backends)
        self.dt_clamp = (c.mamba_dt_clamp_min, c.mamba_dt_clamp_max)
        self.norm_epsilon = c.norm_epsilon
        inner = c.mamba_num_heads * c.mamba_head_dim
        conv_channels = inner + 2 * c.mamba_num_groups * c.mamba_state_dim
        self.in_proj = nn.Linear(c.hidden_size, inner + conv_channels + c.mamba_num_heads, bias=c.mamba_proj_bias)
        self.conv1d = nn.Conv1d(
            conv_channels, conv_channels, c.mamba_conv_kernel_dim, groups=conv_channels, bias=c.mamba_conv_bias
        )  # weight [C, 1, W]; applied causally by gated_delta.causal_conv1d
        self.dt_bias = nn.Parameter(torch.ones(c.mamba_num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, c.mamba_num_heads + 1, dtype=torch.float32)))
        self.norm = _GatedNorm(inner)
        self.D = nn.Parameter(torch.ones(c.mamba_num_heads))
        self.out_proj = nn.Linear(inner, c.hidden_size, bias=c.mamba_proj_bias)
        self.segments = SequenceSegments()

    def head_parameters(self) -> MambaHeadParameters:
        """The per-head parameters of the heads this module computes (all of them here; a tensor-parallel plan may
        override it to give a rank's part)."""
        return MambaHeadParameters(
            self.conv1d.weight.squeeze(1), self.conv1d.bias, self.A_log, self.dt_bias, self.D, self.norm.weight
        )

    def forward(
        self,
        x_BSH: torch.Tensor,
        cos_SF: torch.Tensor | None = None,
        sin_SF: torch.Tensor | None = None,
        positions_S: torch.Tensor | None = None,
        document_ids_BS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output ``[B, S, H]`` for whole sequences ``x_BSH`` (the rotary tables are not used), each
        document of packed rows (``document_ids_BS``, ``[B, S]``) computed alone."""
        if positions_S is not None and document_ids_BS is not None:
            raise ValueError(
                "Mamba layers take packed documents or given positions (context parallelism), not both yet: turn off "
                "document packing or use cp=1"
            )
        p = self.head_parameters()
        groups, width = p.A_log_N.shape[0] // self.heads_per_group, self.heads_per_group * self.head_dim
        proj_BSGX = self.in_proj(x_BSH).unflatten(-1, (groups, -1))  # per group [z, x, B, C, dt]
        parts = [width, width + 2 * self.state_dim, self.heads_per_group]
        z_BSI, xbc_BSC, dt_BSN = (part.flatten(-2) for part in proj_BSGX.split(parts, dim=-1))
        compute = torch.promote_types(x_BSH.dtype, torch.float32)
        dt_BSN = F.softplus(dt_BSN.to(compute) + p.dt_bias_N.to(compute)).clamp(*self.dt_clamp)
        if positions_S is None:
            y_BSNP = per_document(functools.partial(self._mix, p=p), (xbc_BSC, dt_BSN), document_ids_BS)
        else:
            y_BSNP = self._mix_segments(xbc_BSC, dt_BSN, p, positions_S)
        group_size = self.heads_per_group * self.head_dim
        y_BSI = gated_rms_norm(y_BSNP.flatten(2), z_BSI, p.norm_weight_I, group_size=group_size, eps=self.norm_epsilon)
        return self.out_proj(y_BSI.to(x_BSH.dtype))

    def _mix(
        self,
        xbc_BSC: torch.Tensor,
        dt_BSN: torch.Tensor,
        p: MambaHeadParameters,
        conv_state_BCW1: torch.Tensor | None = None,
        output_final_state: bool = False,
    ):
        """The convolution and the scan over whole rows from zero states (the convolution from ``conv_state_BCW1``
        when given): the output ``[B, S, N, P]`` in the computation dtype of ``dt_BSN`` (and, if asked, C per head
        ``[B, S, N, D]`` and the scan's final state ``[B, N, P, D]``). The kernels are those ``mamba_backend`` picks
        (:mod:`moe_models.recurrent_backends`)."""
        device, dtype = xbc_BSC.device, xbc_BSC.dtype
        width, channels = p.conv_weight_CW.shape[-1], xbc_BSC.shape[-1]
        conv = recurrent_backends.short_conv(self.kernel_backend, device, dtype, width=width, channels=channels)
        scan = recurrent_backends.resolve("ssd", self.kernel_backend, device, dtype, field="mamba_backend")
        xbc_BSC, _ = conv(
            xbc_BSC, p.conv_weight_CW, p.conv_bias_C, activation="silu", initial_state_BCW1=conv_state_BCW1
        )
        heads = dt_BSN.shape[-1]
        groups, width = heads // self.heads_per_group, self.heads_per_group * self.head_dim
        # the conv's channels, per group [x, B, C]
        x_BSGW, B_BSGD, C_BSGD = xbc_BSC.unflatten(-1, (groups, -1)).split(
            [width, self.state_dim, self.state_dim], dim=-1
        )
        x_BSNP = x_BSGW.reshape(*x_BSGW.shape[:2], heads, self.head_dim)
        if scan.name == "torch":  # the output in fp32, as transformers'; a vendor's takes x, B, C in one dtype
            x_BSNP = x_BSNP.to(dt_BSN.dtype)
        y_BSNP, final_BNPD = scan(
            x_BSNP,
            dt_BSN,
            -p.A_log_N.to(dt_BSN.dtype).exp(),
            B_BSGD,
            C_BSGD,
            chunk_size=self.chunk_size,
            D_N=p.D_N,
            output_final_state=output_final_state,
        )
        y_BSNP = y_BSNP.to(dt_BSN.dtype)  # a vendor's comes in x's dtype
        if not output_final_state:
            return y_BSNP
        return y_BSNP, C_BSGD.repeat_interleave(self.heads_per_group, dim=2), final_BNPD

    def _mix_segments(
        self, xbc_BSC: torch.Tensor, dt_BSN: torch.Tensor, p: MambaHeadParameters, positions_S: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`_mix` of the runs of consecutive ``positions_S``, each from the states its predecessor leaves
        (module docstring: segments)."""
        segments = SegmentedPositions(self.segments, positions_S)
        pieces = segments.pieces(xbc_BSC)
        conv_states = segments.conv_states(pieces, p.conv_weight_CW.shape[-1])
        log_decay_BSN = dt_BSN * -p.A_log_N.to(dt_BSN.dtype).exp()
        outputs, summaries = [], []
        for piece_BLC, conv_state, dt_BLN, log_decay_BLN in zip(
            pieces, conv_states, segments.pieces(dt_BSN), segments.pieces(log_decay_BSN), strict=True
        ):
            y_BLNP, c_BLND, final_BNPD = self._mix(piece_BLC, dt_BLN, p, conv_state, output_final_state=True)
            cumulative_BLN = log_decay_BLN.cumsum(dim=1)
            outputs.append((y_BLNP, c_BLND, cumulative_BLN))
            # the segment's summary: its final state from zero and its log decay (the state's transition)
            summaries.append(torch.cat([final_BNPD.flatten(-2), cumulative_BLN[:, -1, :, None]], dim=-1))

        def step(summary_BNX: torch.Tensor, state_BNPD: torch.Tensor, length: int) -> torch.Tensor:
            final_BNPD = summary_BNX[..., :-1].view_as(state_BNPD)
            return summary_BNX[..., -1, None, None].exp() * state_BNPD + final_BNPD

        zero_BNPD = outputs[0][0].new_zeros(*summaries[0].shape[:2], self.head_dim, self.state_dim)
        mixed = []
        for (y_BLNP, c_BLND, cumulative_BLN), state_in_BNPD in zip(
            outputs, segments.chain(summaries, step, zero_BNPD), strict=True
        ):
            # h_t = exp(cumulative decay) h_in + (from zero): y_t gains exp(cumulative_t) h_in C_t
            read_BLNP = torch.einsum("bnpd,blnd->blnp", state_in_BNPD, c_BLND.to(state_in_BNPD.dtype))
            mixed.append(y_BLNP + cumulative_BLN.exp().unsqueeze(-1) * read_BLNP)
        return torch.cat(mixed, dim=1)
