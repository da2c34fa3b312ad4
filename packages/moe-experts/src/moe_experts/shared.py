"""Shared experts: a dense gated MLP every token goes through, added to the routed experts' output.

As in Qwen2-MoE / Qwen3-Next (``shared_expert`` + ``shared_expert_gate``) and DeepSeek-V2/V3 (``shared_experts``,
no gate)::

    mlp(x) = (silu(x @ W_gate) * (x @ W_up)) @ W_down
    out(x) = sigmoid(x @ w_gate_H1) * mlp(x)     with gate=True (Qwen2-MoE / Qwen3-Next)
    out(x) = mlp(x)                              with gate=False (DeepSeek-V3)

Parameters (names used in checkpoints):

- ``w_gate_up_H2F`` ``[H, 2F]``: gate projection in the first F columns, up projection in the last F (the layout of
  :class:`~moe_experts.grouped.GroupedExperts` ``w_gate_up_EH2F`` for one expert). HuggingFace's
  ``gate_proj.weight`` / ``up_proj.weight`` (``[F, H]`` each) are its transposed halves.
- ``w_down_FH`` ``[F, H]``: HuggingFace's ``down_proj.weight`` transposed.
- ``w_gate_H1`` ``[H, 1]`` (gate=True only): HuggingFace's ``shared_expert_gate.weight`` (``[1, H]``) transposed.

With a non-gated ``activation`` (Nemotron-H's ``squared_relu``) the MLP is ``act(x @ W_up) @ W_down`` and the first
projection, still ``w_gate_up_H2F``, is ``[H, F]`` (HuggingFace's ``up_proj.weight`` transposed), as the grouped
experts store theirs.

The shared expert does not depend on the routing, so on CUDA it can run on a side stream while the tokens are
dispatched: :meth:`SharedExperts.start` launches it and returns a :class:`SharedExpertsHandle`; its
:meth:`~SharedExpertsHandle.wait` makes the current stream wait for the result. Off CUDA, and under
``torch.compile``, ``start`` computes the result inline (no overlap) and ``wait`` returns it. Autograd runs each
backward op on the stream its forward op ran on, so the backward of the shared expert overlaps too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moe_experts.activations import get_activation

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def shared_expert_stream(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """The side stream (one per CUDA device, created on first use) :meth:`SharedExperts.start` uses by default."""
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"shared_expert_stream needs a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


class SharedExpertsHandle:
    """A shared-expert forward that may still be running on a side stream; :meth:`wait` returns its output."""

    def __init__(self, out_TH: torch.Tensor, done: torch.cuda.Event | None = None) -> None:
        self._out_TH = out_TH
        self._done = done  # recorded on the side stream after the forward; None when computed inline
        self._waited = False

    @property
    def overlapped(self) -> bool:
        """Whether the forward was launched on a side stream (False: it ran inline)."""
        return self._done is not None

    def wait(self) -> torch.Tensor:
        """Make the current stream wait for the side stream's forward and return the output ``[T, H]``."""
        if self._done is not None and not self._waited:
            current = torch.cuda.current_stream(self._out_TH.device)
            current.wait_event(self._done)
            # the output was allocated on the side stream: keep its memory until the current stream is done with it
            self._out_TH.record_stream(current)
            self._waited = True
        return self._out_TH


class SharedExperts(nn.Module):
    """Dense SwiGLU MLP of width ``ffn_hidden_size`` with an optional per-token sigmoid gate (module docstring)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, gate: bool = False, activation: str = "swiglu") -> None:
        super().__init__()
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        # a non-gated activation (Nemotron-H's squared ReLU): the first projection is [H, F], act(x W) W_down; a gated
        # one is SwiGLU whichever it is (the families with shared experts use SwiGLU)
        act = get_activation(activation)
        self.activation = None if act.gated else act
        width = 2 * ffn_hidden_size if act.gated else ffn_hidden_size
        self.w_gate_up_H2F = nn.Parameter(torch.empty(hidden_size, width))
        self.w_down_FH = nn.Parameter(torch.empty(ffn_hidden_size, hidden_size))
        self.w_gate_H1 = nn.Parameter(torch.empty(hidden_size, 1)) if gate else None
        self.reset_parameters()

    @property
    def gated(self) -> bool:
        return self.w_gate_H1 is not None

    def reset_parameters(self, std: float = 0.02, num_layers: int = 1) -> None:
        nn.init.normal_(self.w_gate_up_H2F, std=std)
        # scaled output init, as GroupedExperts (Megatron's output_layer_init_method)
        nn.init.normal_(self.w_down_FH, std=std / math.sqrt(2.0 * num_layers))
        if self.w_gate_H1 is not None:
            nn.init.normal_(self.w_gate_H1, std=std)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        """``[..., H] -> [..., H]``; computed in the input dtype (the weights are cast, as GroupedExperts)."""
        dtype = x_TH.dtype
        h_NF = x_TH @ self.w_gate_up_H2F.to(dtype)
        if self.activation is None:
            gate_NF, up_NF = h_NF.chunk(2, dim=-1)
            out = (F.silu(gate_NF) * up_NF) @ self.w_down_FH.to(dtype)
        else:
            out = self.activation.fn(h_NF) @ self.w_down_FH.to(dtype)
        if self.w_gate_H1 is not None:
            out = torch.sigmoid(x_TH @ self.w_gate_H1.to(dtype)) * out
        return out

    def start(self, x_TH: torch.Tensor, stream: torch.cuda.Stream | None = None) -> SharedExpertsHandle:
        """Launch the forward on ``stream`` (default :func:`shared_expert_stream`) when ``x_TH`` is on CUDA, else
        run it inline. Call :meth:`SharedExpertsHandle.wait` before using the output (e.g. after the combine)."""
        # inline when compiling: Dynamo's stream/event/record_stream tracing is new and untested here; one plain graph
        if not x_TH.is_cuda or torch.compiler.is_compiling():
            return SharedExpertsHandle(self(x_TH))
        side = shared_expert_stream(x_TH.device) if stream is None else stream
        main = torch.cuda.current_stream(x_TH.device)
        side.wait_stream(main)  # x_TH (and the weights) were produced on the current stream
        with torch.cuda.stream(side):
            x_TH.record_stream(side)  # x_TH's memory must not be reused before the side stream has read it
            out_TH = self(x_TH)
            done = torch.cuda.Event()
            done.record(side)
        return SharedExpertsHandle(out_TH, done)

    def extra_repr(self) -> str:
        act = "swiglu" if self.activation is None else self.activation.name
        return f"hidden={self.hidden_size}, ffn={self.ffn_hidden_size}, gate={self.gated}, activation={act}"
