"""Routed experts computed with one grouped GEMM per projection.

Parameters (names and layouts used in checkpoints), with ``E`` local experts, ``H`` hidden, ``F`` the expert FFN
width and ``Fl = F / etp_size`` the local FFN width:

- ``w_gate_up_EH2F`` ``[E, H, 2*Fl]`` for gated activations: ``swiglu`` / ``geglu`` keep gate in the first ``Fl``
  columns and up in the last ``Fl``; ``swiglu_oai`` (GPT-OSS) INTERLEAVES them (gate = even columns, up = odd
  columns, HuggingFace's ``gate_up_proj`` layout). Non-gated activations (``squared_relu``, ``gelu``) use the same
  name with width ``Fl``: ``[E, H, Fl]``.
- ``w_down_EFH`` ``[E, Fl, H]``.
- with ``bias=True``: ``b_gate_up_E2F`` ``[E, 2*Fl]`` (``[E, Fl]`` non-gated, same column layout as the weight)
  and ``b_down_EH`` ``[E, H]``.

Router probabilities: ``forward(x, tokens_per_expert, probs_N)`` multiplies each row's activation by its
probability inside the activation (:func:`~moe_experts.fused.weighted_activation`) and scales the down bias by it
too, so the output rows are ``prob * expert(x)`` (GPT-OSS's ``(act @ W_down + b_down) * prob``) and the caller
combines without weights. Padding rows carry probability 0 and come out as zeros.

Initialisation is per expert and independent of the expert / tensor-parallel split (:func:`expert_seed`): expert
``g = first_expert + e`` draws its full (``etp_size = 1``) weights from a generator seeded by ``(seed, g)`` and
keeps its shard, so any split of experts over ranks, and any ``etp_size``, holds slices of the same weights.

Expert tensor parallelism (``etp_rank`` / ``etp_size``): rank ``r`` holds FFN units ``[r*Fl, (r+1)*Fl)``: those
columns of gate and of up (for the interleaved layout the matching interleaved column pairs) and those rows of
``w_down``. Its output is a partial sum: summing the outputs of the etp ranks (the dispatcher's reduce-scatter /
all-reduce; this module does not communicate) gives the ``etp_size = 1`` output. The down bias is added on etp
rank 0 only (other ranks add it times 0, so their ``b_down_EH`` gradient is zero): sum ``b_down_EH``'s gradient
over the etp group, as for any parameter replicated over it.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moe_experts.activations import Activation, gate_up_columns, get_activation
from moe_experts.backends import BACKENDS, Backend, GroupedMM, GroupedWgrad, resolve_backend
from moe_experts.delayed_wgrad import DeferWgrad, LaterWgrad, delayed_grouped_mm
from moe_experts.fused import weighted_activation
from moe_experts.gathered import gather_rows, gathered_grouped_mm

GROUPED_MM_ROW_ALIGN_BYTES = 16  # torch grouped_mm rejects rows that are not 16-byte aligned
_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def expert_seed(seed: int, global_expert: int) -> int:
    """Seed of the generator that initialises global expert ``global_expert`` (a 63-bit mix of both)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ global_expert) >> 1


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's experts: expert parallelism may hold the parameters as DTensors sharded over the experts (so that
    checkpoints see the global tensors); the computation is on the local shard, whose gradient flows back sharded."""
    return param.to_local() if isinstance(param, DTensor) else param


class ExpertLinear(nn.Module):
    """One grouped projection of the experts, ``[N, K] @ w_EKM`` per expert's rows. It holds no parameters (the
    weights stay on :class:`GroupedExperts`, under their checkpoint names): it is a module so that memory policies
    can address it (Megatron's ``expert_fc1`` offload). A module that replaces it (moe-precision's quantised one)
    says with :attr:`gathers_rows` whether the first projection may hand it its input's rows by index."""

    # the first projection may gather its rows itself (row indices, a separate weight-gradient kernel); a
    # replacement that only takes rows leaves it False
    gathers_rows = True

    def forward(
        self, x_NK: torch.Tensor, w_EKM: torch.Tensor, tokens_per_expert_E: torch.Tensor, gmm: GroupedMM
    ) -> torch.Tensor:
        return gmm(x_NK, w_EKM, tokens_per_expert_E)


class ExpertActivation(nn.Module):
    """The experts' activation, weighted by the router probabilities (:func:`~moe_experts.fused.weighted_activation`);
    a module so that memory policies can address it (Megatron's ``moe_act`` recompute and offload)."""

    def __init__(self, activation: Activation) -> None:
        super().__init__()
        self.activation = activation

    def forward(self, h_NW: torch.Tensor, probs_N: torch.Tensor | None) -> torch.Tensor:
        return weighted_activation(h_NW, probs_N, self.activation)


class GroupedExperts(nn.Module):
    """E FFN experts stored as one tensor per projection (module docstring for layouts, probs, init and ETP).

    Input rows must be in expert-major order with ``tokens_per_expert_E`` rows each.

    Args:
        num_experts: local experts on this rank.
        hidden_size: H.
        ffn_hidden_size: the FULL expert FFN width F (before expert tensor parallelism).
        activation: a name of :data:`~moe_experts.activations.ACTIVATIONS`.
        backend: ``"auto"`` or a name of :data:`~moe_experts.backends.BACKENDS`.
        bias: add ``b_gate_up_E2F`` and ``b_down_EH`` (GPT-OSS).
        first_expert: global id of local expert 0 (expert parallelism: ``ep_rank * num_experts``).
        seed: base seed of the per-expert init; None draws one from torch's global generator at every
            :meth:`reset_parameters` (deterministic under ``torch.manual_seed``, but the same on every rank only if
            the ranks' generators agree: pass a seed with expert parallelism).
        etp_rank, etp_size: this rank's place in the expert tensor-parallel group (``F % etp_size == 0``).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        activation: str = "swiglu",
        backend: str = "auto",
        bias: bool = False,
        *,
        first_expert: int = 0,
        seed: int | None = None,
        etp_rank: int = 0,
        etp_size: int = 1,
    ) -> None:
        super().__init__()
        if etp_size < 1 or not 0 <= etp_rank < etp_size:
            raise ValueError(f"need 0 <= etp_rank < etp_size, got etp_rank={etp_rank}, etp_size={etp_size}")
        if ffn_hidden_size % etp_size:
            raise ValueError(f"ffn_hidden_size={ffn_hidden_size} is not divisible by etp_size={etp_size}")
        if first_expert < 0:
            raise ValueError(f"first_expert={first_expert} must be >= 0")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.local_ffn_hidden_size = ffn_hidden_size // etp_size
        self.first_expert, self.seed = first_expert, seed
        self.etp_rank, self.etp_size = etp_rank, etp_size
        self.activation_name = activation
        self.activation = get_activation(activation)
        # parameter-free stages, modules only so that recompute / offload can name them
        self.fc1, self.act, self.fc2 = ExpertLinear(), ExpertActivation(self.activation), ExpertLinear()
        self.requested_backend = backend
        self.backend = resolve_backend(backend)
        self._auto_backends: dict[torch.dtype, Backend] = {}  # "auto" by compute dtype, resolved once each
        width = self.activation.width_factor * self.local_ffn_hidden_size
        self.w_gate_up_EH2F = nn.Parameter(torch.empty(num_experts, hidden_size, width))
        self.w_down_EFH = nn.Parameter(torch.empty(num_experts, self.local_ffn_hidden_size, hidden_size))
        if bias:
            self.b_gate_up_E2F = nn.Parameter(torch.empty(num_experts, width))
            self.b_down_EH = nn.Parameter(torch.empty(num_experts, hidden_size))
        else:
            self.register_parameter("b_gate_up_E2F", None)
            self.register_parameter("b_down_EH", None)
        # parallel.delay_wgrad_compute: set by moe_parallel to the run's Lanes.defer (moe_experts.delayed_wgrad)
        self.defer_wgrad: DeferWgrad | None = None
        self.reset_parameters()

    @property
    def has_bias(self) -> bool:
        return self.b_down_EH is not None

    def local_gate_up_columns(self) -> torch.Tensor:
        """Columns of the full (``etp_size = 1``) first projection this etp rank holds, in local order."""
        fl = self.local_ffn_hidden_size
        return gate_up_columns(
            self.activation.layout, self.ffn_hidden_size, self.etp_rank * fl, (self.etp_rank + 1) * fl
        )

    def initial_expert(
        self, expert: int, base_seed: int, std: float = 0.02, num_layers: int = 1
    ) -> dict[str, torch.Tensor]:
        """Global expert ``expert``'s initial values at full FFN width (``etp_size = 1``), one CPU tensor per parameter
        name without the expert dimension: normal(0, std) first projection, normal(0, std / sqrt(2 * num_layers))
        down projection (Megatron's scaled output init), zero biases. Drawn from a generator seeded by
        ``(base_seed, expert)`` alone, so they do not depend on the split of experts over ranks or on the device."""
        # CPU spelled out: under ``with torch.device("cuda")`` a bare randn lands on the GPU and rejects the CPU
        # generator, and the values must not depend on the device anyway
        cpu = torch.device("cpu")
        gen = torch.Generator(device=cpu).manual_seed(expert_seed(base_seed, expert))
        hidden, f = self.hidden_size, self.ffn_hidden_size
        width = self.activation.width_factor * f
        values = {
            "w_gate_up_EH2F": torch.randn(hidden, width, generator=gen, device=cpu).mul_(std),
            "w_down_EFH": torch.randn(f, hidden, generator=gen, device=cpu).mul_(std / math.sqrt(2.0 * num_layers)),
        }
        if self.has_bias:
            values["b_gate_up_E2F"] = torch.zeros(width, device=cpu)
            values["b_down_EH"] = torch.zeros(hidden, device=cpu)
        return values

    def local_slice(self, name: str, whole_expert: torch.Tensor) -> torch.Tensor:
        """This etp rank's part of one expert's full-width value of parameter ``name`` (expert dimension dropped):
        its gate/up columns of the first projection, its rows of the down projection; the down bias is whole."""
        if self.etp_size == 1 or name == "b_down_EH":
            return whole_expert
        if name == "w_down_EFH":
            fl = self.local_ffn_hidden_size
            return whole_expert[self.etp_rank * fl : (self.etp_rank + 1) * fl]
        cols = self.local_gate_up_columns().to(whole_expert.device)
        return whole_expert.index_select(whole_expert.ndim - 1, cols)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, num_layers: int = 1) -> None:
        """Each local expert from :meth:`initial_expert` (this etp rank's slice), with ``seed`` or, when it is None,
        a base seed drawn from torch's global generator."""
        if self.w_gate_up_EH2F.is_meta:  # nothing to fill (nn.init is a no-op on meta too)
            return
        base = self.seed if self.seed is not None else int(torch.randint(0, 2**62, (), device="cpu").item())
        for e in range(self.num_experts):
            for name, value in self.initial_expert(self.first_expert + e, base, std, num_layers).items():
                _local(getattr(self, name))[e].copy_(self.local_slice(name, value))

    def forward(
        self,
        x_NH: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        probs_N: torch.Tensor | None = None,
        *,
        row_source_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[N, H] -> [N, H]``; with ``probs_N`` (one router probability per row) each row comes out scaled by it.

        With ``row_source_N`` (int64 ``[N]``, -1 for a zero padding row) the input is the token rows ``x_TH`` and row
        ``n`` is ``x_TH[row_source_N[n]]``: the first projection gathers them itself and saves ``x_TH`` instead of
        the ``[N, H]`` rows (:mod:`moe_experts.gathered`), where the back end can (torch, loop) and the projection is
        the plain one (not quantised); otherwise the rows are gathered here first.

        Computed in ``x_NH``'s dtype (weights cast: bf16 under autocast, whose op lists lack grouped_mm).
        """
        if tokens_per_expert_E.shape != (self.num_experts,):
            raise ValueError(
                f"tokens_per_expert_E must have shape ({self.num_experts},), got {tuple(tokens_per_expert_E.shape)}"
            )
        dtype = x_NH.dtype
        backend = self._backend(dtype)
        gmm = backend.gmm
        assert gmm is not None  # resolve_backend only returns implemented back ends
        w_gate_up, w_down = _local(self.w_gate_up_EH2F).to(dtype), _local(self.w_down_EFH).to(dtype)
        later_fc1, later_fc2 = self._later_wgrads(backend, x_NH)
        fc1_mm, fc2_mm = gmm, gmm
        if later_fc2 is not None:
            fc2_mm = functools.partial(delayed_grouped_mm, gmm=gmm, later=later_fc2)
        if row_source_N is not None:
            wgrad = self._wgrad(backend, x_NH, row_source_N, tokens_per_expert_E)
            if wgrad is None:
                x_NH = gather_rows(x_NH, row_source_N)
            else:
                fc1_mm = functools.partial(
                    gathered_grouped_mm, row_source_N=row_source_N, gmm=gmm, wgrad=wgrad, later=later_fc1
                )
        if later_fc1 is not None and fc1_mm is gmm:
            fc1_mm = functools.partial(delayed_grouped_mm, gmm=gmm, later=later_fc1)
        h_NW = self.fc1(x_NH, w_gate_up, tokens_per_expert_E, fc1_mm)
        expert_N = None
        if self.b_gate_up_E2F is not None:
            expert_N = torch.repeat_interleave(
                torch.arange(self.num_experts, device=h_NW.device),
                tokens_per_expert_E.to(h_NW.device),
                output_size=h_NW.shape[0],
            )
            h_NW = h_NW + _local(self.b_gate_up_E2F).to(dtype)[expert_N]
        a_NF = self.act(h_NW, probs_N)
        y_NH = self.fc2(a_NF, w_down, tokens_per_expert_E, fc2_mm)
        if self.b_down_EH is not None:
            b_down = _local(self.b_down_EH).to(dtype)
            if self.etp_rank != 0:
                b_down = b_down * 0.0  # added once over the etp group (zero gradient here)
            b_NH = b_down[expert_N]
            if probs_N is not None:
                b_NH = (b_NH * probs_N[:, None]).to(dtype)
            y_NH = y_NH + b_NH
        return y_NH

    def _later_wgrads(self, backend: Backend, x: torch.Tensor) -> tuple[LaterWgrad | None, LaterWgrad | None]:
        """Where each projection's weight gradient goes when it is delayed (``defer_wgrad`` set): a back end with a
        separate weight gradient, plain tensors, a plain projection module (an adapter's or a quantised one's GEMMs
        take the weight on their own terms), a weight that wants a gradient, and not under torch.compile; None where
        it is not."""
        defer = self.defer_wgrad
        if defer is None or backend.wgrad is None or type(x) is not torch.Tensor or not torch.is_grad_enabled():
            return None, None
        if torch.compiler.is_compiling():
            return None, None
        return tuple(  # type: ignore[return-value]
            LaterWgrad(defer, param, backend.wgrad) if type(module) is ExpertLinear and param.requires_grad else None
            for module, param in ((self.fc1, self.w_gate_up_EH2F), (self.fc2, self.w_down_EFH))
        )

    def _wgrad(
        self, backend: Backend, x_TH: torch.Tensor, row_source_N: torch.Tensor, tokens_per_expert_E: torch.Tensor
    ) -> GroupedWgrad | None:
        """The weight-gradient kernel of ``backend`` when the first projection can gather its own rows: its module
        says so (:attr:`ExpertLinear.gathers_rows`; a quantised one takes rows), plain tensors (not DTensors), a back
        end with a separate weight gradient (for the loop back end, groups that cover every row), and not under
        torch.compile."""
        if not getattr(self.fc1, "gathers_rows", False) or type(x_TH) is not torch.Tensor:
            return None
        if torch.compiler.is_compiling():  # as for the fused activation: the compiler chooses what to save itself
            return None
        if backend.wgrad is None:
            return None
        # the loop back end splits the rows by the counts on the host anyway: there, rows past the groups (which it
        # cannot gather for) are checked; torch's grouped_mm takes device offsets, and reading the counts back to
        # check would stall the stream every layer (the dispatchers' groups cover every row)
        if backend.name == "loop" and int(tokens_per_expert_E.sum()) != row_source_N.shape[0]:
            return None
        return backend.wgrad

    def _backend(self, dtype: torch.dtype) -> Backend:
        """The back end that computes in ``dtype`` here (``auto`` resolved per dtype; loop for rows torch rejects)."""
        backend = self.backend
        if self.requested_backend == "auto" and not backend.takes(dtype, auto=True):
            # auto chose by what is installed; the dtype at hand may not suit that choice (fp32 on grouped_gemm).
            # Resolved once per dtype: resolving imports the vendor library and reads its version
            if dtype not in self._auto_backends:
                self._auto_backends[dtype] = resolve_backend("auto", dtype)
            backend = self._auto_backends[dtype]
        assert backend.gmm is not None  # resolve_backend only returns implemented back ends
        element_size = torch.finfo(dtype).bits // 8
        hidden, ffn = self.hidden_size, self.local_ffn_hidden_size
        aligned = all(n * element_size % GROUPED_MM_ROW_ALIGN_BYTES == 0 for n in (hidden, ffn))
        if backend.name != "torch" or aligned:
            return backend
        if self.requested_backend == "auto":
            return BACKENDS["loop"]
        raise ValueError(
            f"expert backend 'torch' needs hidden_size ({hidden}) and ffn_hidden_size ({ffn}, per etp rank) rows of "
            f"a multiple of {GROUPED_MM_ROW_ALIGN_BYTES} bytes ({element_size}-byte elements); "
            "use backend 'loop' or 'auto'"
        )

    def extra_repr(self) -> str:
        text = (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, "
            f"activation={self.activation_name}, backend={self.backend.name}, bias={self.has_bias}"
        )
        if self.first_expert:
            text += f", first_expert={self.first_expert}"
        if self.etp_size > 1:
            text += f", etp_rank={self.etp_rank}, etp_size={self.etp_size}"
        return text
