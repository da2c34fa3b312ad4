"""Stand-ins for the vendor kernels ``moe_models.recurrent_backends`` runs, holding their contracts as their sources
state them, computed step by step in fp64 plain torch (none of the packages installs without CUDA):

- ``fla``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` and ``fla.ops.kda.chunk_kda`` (flash-linear-attention
  0.4.0 to 0.5.2): q, k, v of one dtype; q and k ``[B, T, H, K]``, v ``[B, T, HV, V]`` with ``HV`` a multiple of ``H``
  from 0.5 on and ``HV == H`` before (0.4.x's kernels index v's heads with q's: the stand-in refuses what would be
  wrong there); g ``[B, T, HV]`` (KDA: ``[B, T, HV, K]``) log decays; beta ``[B, T, HV]``; the state ``[N, HV, K, V]``;
  the output in q's dtype, the final state fp32; the q/k L2 norm ``x / sqrt(sum x^2 + 1e-6)``.
- ``mamba_ssm``: ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (2.x), its shape asserts, dt through
  ``dt_bias``, softplus and ``dt_limit``; the output in x's dtype, the final state in C's.
- ``causal_conv1d``: ``causal_conv1d_fn`` (1.2 to 1.6): x ``[B, C, S]`` with unit stride on S or on C
  (channel-last, which needs C and the other strides multiples of 8, and alone takes initial and final states, those
  with unit stride on C and x's dtype); widths 2 to 4; fp32, fp16, bf16; the bias in the weight's dtype; the output in
  x's dtype.

Each ``*_modules(version)`` returns the modules to put in ``sys.modules`` (the package and its submodules); each
kernel records its calls in ``module.calls``, so a test can tell that it ran.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from _recurrence_reference import naive_delta_rule

F64 = torch.float64
_TAKES = (torch.float32, torch.float16, torch.bfloat16)


def _modules(version: str, leaves: dict[str, dict[str, object]], calls: list[str]) -> dict[str, types.ModuleType]:
    """The package of ``leaves``' names (``"a.b.c"``: its functions), with every module between, ``__version__`` on
    the top one and ``calls`` (the kernels' record) on each."""
    made: dict[str, types.ModuleType] = {}
    for dotted, functions in leaves.items():
        parts = dotted.split(".")
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            if name not in made:
                made[name] = types.ModuleType(name)
                made[name].calls = calls  # type: ignore[attr-defined]
                if depth > 1:
                    setattr(made[".".join(parts[: depth - 1])], parts[depth - 1], made[name])
        for fname, fn in functions.items():
            setattr(made[dotted], fname, fn)
    made[next(iter(made))].__version__ = version  # type: ignore[attr-defined]
    return made


# ----------------------------------------------------------------------------------------------- fla


def _fla_kernel(name: str, per_channel: bool, grouped_value_heads: bool, calls: list[str]):
    def kernel(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
    ):
        assert q.dtype == k.dtype == v.dtype, "q, k and v must share a dtype"
        batch, seq, heads_qk, dim_k = q.shape
        heads = v.shape[2]
        assert k.shape == q.shape, "q and k must have the same shape"
        if heads != heads_qk and not grouped_value_heads:
            raise AssertionError(f"{heads} value heads for {heads_qk} q/k heads: this fla indexes v with q's heads")
        assert heads % heads_qk == 0, "HV must be a multiple of H"
        assert g.shape == (batch, seq, heads, *((dim_k,) if per_channel else ())), f"g has shape {tuple(g.shape)}"
        assert beta.shape == (batch, seq, heads), f"beta has shape {tuple(beta.shape)}"
        assert cu_seqlens is None, "the stand-in takes equal-length rows"
        if initial_state is not None:
            assert initial_state.shape == (batch, heads, dim_k, v.shape[-1])
        calls.append(name)
        state = None if initial_state is None else initial_state.to(F64)
        o, final = naive_delta_rule(
            *(x.to(F64) for x in (q, k, v, g, beta)),
            state,
            use_qk_l2norm=use_qk_l2norm_in_kernel,
            scale=dim_k**-0.5 if scale is None else scale,
        )
        return o.to(q.dtype), (final.float() if output_final_state else None)

    return kernel


def fla_modules(version: str = "0.5.2") -> dict[str, types.ModuleType]:
    """``fla`` with its gated delta rule and KDA kernels as ``version`` has them (grouped value heads from 0.5)."""
    release = tuple(int(x) for x in version.split(".")[:2])
    calls: list[str] = []
    grouped = release >= (0, 5)
    return _modules(
        version,
        {
            "fla.ops.gated_delta_rule": {
                "chunk_gated_delta_rule": _fla_kernel("chunk_gated_delta_rule", False, grouped, calls)
            },
            "fla.ops.kda": {"chunk_kda": _fla_kernel("chunk_kda", True, grouped, calls)},
        },
        calls,
    )


# ----------------------------------------------------------------------------------------------- mamba_ssm


def _mamba_chunk_scan_combined(calls: list[str]):
    def mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        seq_idx=None,
        cu_seqlens=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        return_varlen_states=False,
    ):
        batch, seq, heads, dim_p = x.shape
        _, _, groups, dim_d = B.shape
        assert heads % groups == 0
        assert B.shape == (batch, seq, groups, dim_d) and C.shape == B.shape
        assert dt.shape == (batch, seq, heads) and A.shape == (heads,)
        assert D is None or D.shape in ((heads, dim_p), (heads,))
        assert initial_states is None or initial_states.shape == (batch, heads, dim_p, dim_d)
        assert isinstance(chunk_size, int) and chunk_size > 0
        assert z is None and seq_idx is None and not return_varlen_states, "not in the stand-in"
        calls.append("mamba_chunk_scan_combined")
        dt = dt.to(F64)
        if dt_bias is not None:
            dt = dt + dt_bias.to(F64)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = dt.clamp(*dt_limit)
        per_group = heads // groups
        x64 = x.to(F64)
        B64, C64 = (t.to(F64).repeat_interleave(per_group, dim=2) for t in (B, C))
        h = x64.new_zeros(batch, heads, dim_p, dim_d) if initial_states is None else initial_states.to(F64)
        outputs = []
        for t in range(seq):
            decay = (dt[:, t] * A.to(F64)).exp()[..., None, None]
            h = decay * h + (dt[:, t, :, None] * x64[:, t]).unsqueeze(-1) * B64[:, t].unsqueeze(-2)
            outputs.append(torch.einsum("bnpd,bnd->bnp", h, C64[:, t]))
        y = torch.stack(outputs, dim=1)
        if D is not None:
            y = y + (D.to(F64) if D.dim() == 2 else D.to(F64)[:, None]) * x64
        out = y.to(x.dtype)
        return (out, h.to(C.dtype)) if return_final_states else out

    return mamba_chunk_scan_combined


def mamba_ssm_modules(version: str = "2.2.4") -> dict[str, types.ModuleType]:
    calls: list[str] = []
    leaves = {"mamba_ssm.ops.triton.ssd_combined": {"mamba_chunk_scan_combined": _mamba_chunk_scan_combined(calls)}}
    return _modules(version, leaves, calls)


# ----------------------------------------------------------------------------------------------- causal_conv1d


def _causal_conv1d_fn(calls: list[str]):
    def causal_conv1d_fn(
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        assert x.dtype in _TAKES and weight.dtype in _TAKES
        batch, dim, seq = x.shape
        width = weight.shape[1]
        assert weight.shape == (dim, width)
        assert 2 <= width <= 4, "causal_conv1d only supports width between 2 and 4"
        assert x.stride(2) == 1 or x.stride(1) == 1
        channel_last = x.stride(1) == 1 and x.stride(2) != 1
        if channel_last:
            assert dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now"
            assert x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, "channel last layout requires strides % 8"
        assert bias is None or bias.dtype == weight.dtype
        assert seq_idx is None and final_states_out is None, "not in the stand-in"
        if initial_states is not None:
            assert channel_last, "initial_states is only supported for channel last layout"
            assert initial_states.dtype == x.dtype and initial_states.stride(1) == 1
            assert initial_states.shape == (batch, dim, width - 1)
        if return_final_states:
            assert channel_last, "Only channel-last layout support returning final_states_out"
        calls.append("causal_conv1d_fn")
        past = x.new_zeros(batch, dim, width - 1) if initial_states is None else initial_states
        padded = torch.cat([past, x], dim=-1).to(F64)
        w = weight.to(F64)
        y = sum(w[:, j, None] * padded[:, :, j : j + seq] for j in range(width))
        if bias is not None:
            y = y + bias.to(F64)[:, None]
        if activation is not None:
            y = F.silu(y)
        out = y.to(x.dtype)
        if not return_final_states:
            return out
        final = padded[:, :, seq:].to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # channel-last as theirs
        return out, final

    return causal_conv1d_fn


def causal_conv1d_modules(version: str = "1.5.2") -> dict[str, types.ModuleType]:
    calls: list[str] = []
    return _modules(version, {"causal_conv1d": {"causal_conv1d_fn": _causal_conv1d_fn(calls)}}, calls)
