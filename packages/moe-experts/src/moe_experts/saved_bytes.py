"""What the grouped experts and the shared expert save for backward, in bytes, from plain sizes. A memory estimate
(``moe_memory.estimate``) composes these declarations with the other packages'.

Each declaration is a list of :class:`SavedBytes`: the estimate's name of the module that saves the tensor
(``expert_fc1``, ``moe_act``, ``expert_fc2``, ``expert_bias`` for :class:`~moe_experts.grouped.GroupedExperts`' own
operations, ``shared_experts``), a name for the tensor (the same wherever it is saved again; tensors of the caller,
such as the experts' input, carry the name the caller gives), its bytes and a description. They are tested against
``moe_memory.measure.SavedTensorBytes`` on the real modules.

- :class:`~moe_experts.grouped.GroupedExperts` with torch's ``grouped_mm`` (back end ``torch``) or one matmul per
  expert (``loop``, which saves no group offsets): the first projection saves, when it gathers its rows itself
  (:mod:`moe_experts.gathered`: the source has fewer rows than the expert rows), the source rows, the int64 source
  row of each row and the int64 group sizes; else its input rows and the int32 group offsets. With biases, the int64
  expert of each row. The weighted activation saves the first projection's output and the row probabilities
  (:data:`ACTIVATION_INPUTS`), the second projection the int32 group offsets and the activation's output
  (:data:`ACTIVATION_OUTPUT`); with biases, the down-bias rows. Other back ends are not declared (Transformer
  Engine saves a transposed weight copy).
- :class:`~moe_experts.shared.SharedExperts` (SwiGLU) saves its input, the gate|up projection, ``silu(gate)`` and
  the product; with its sigmoid gate also the gate's ``[tokens, 1]`` sigmoid and the MLP's output it scales (the gate's
  own projection saves the input, already counted).
"""

from __future__ import annotations

from typing import NamedTuple

INDEX_BYTES = 8  # int64 row ids and group sizes
OFFSETS_BYTES = 4  # int32 group offsets of grouped_mm

# the tensors the experts' weighted activation takes (recomputing it keeps these) and the one it returns
ACTIVATION_INPUTS = ("experts.h", "experts.probs")
ACTIVATION_OUTPUT = "experts.act"


class SavedBytes(NamedTuple):
    module: str  # the estimate's module name: expert_fc1 | moe_act | expert_fc2 | expert_bias | shared_experts
    tensor: str  # names the tensor: the same name wherever it is saved again
    nbytes: int
    description: str


def grouped_experts_saved_bytes(
    *,
    rows: int,
    local_experts: int,
    hidden: int,
    ffn_hidden: int,
    gated: bool,
    bias: bool,
    activation_bytes: int,
    prob_bytes: int,
    source_tensor: str | None = None,
    source_rows: int = 0,
    source_description: str = "expert source rows",
    backend: str = "torch",
    probs: bool = True,
) -> list[SavedBytes]:
    """What :class:`~moe_experts.grouped.GroupedExperts` saves computing ``rows`` expert rows (padding included) of
    ``local_experts`` experts, ``ffn_hidden`` wide (per etp rank), the row probabilities in ``prob_bytes``: module
    docstring. ``source_tensor``: the first projection gathers its rows from ``source_rows`` rows of that tensor
    (``[source_rows, hidden]``) itself; None: it is given the rows (``[rows, hidden]``). ``backend``: ``torch`` or
    ``loop`` (the others are not declared). ``probs`` False: the rows come already weighted (Llama 4's probabilities on
    the input), the activation takes none."""
    if backend not in ("torch", "loop"):
        raise ValueError(f"backend={backend!r}: declared for 'torch' and 'loop' only")
    group_offsets = local_experts * OFFSETS_BYTES if backend == "torch" else 0  # int32 [local_experts]
    width = (2 if gated else 1) * ffn_hidden  # the first projection's output: [rows, width]
    if source_tensor is not None:
        saves = [
            SavedBytes("expert_fc1", source_tensor, source_rows * hidden * activation_bytes, source_description),
            SavedBytes("expert_fc1", "fc1.row_source", rows * INDEX_BYTES, "source row of each row"),
            SavedBytes("expert_fc1", "fc1.counts", local_experts * INDEX_BYTES, "group sizes"),
        ]
    else:
        saves = [
            SavedBytes("expert_fc1", "experts.x", rows * hidden * activation_bytes, "expert input rows"),
            SavedBytes("expert_fc1", "fc1.offsets", group_offsets, "group offsets"),
        ]
    if bias:
        saves.append(SavedBytes("expert_bias", "experts.expert_of_row", rows * INDEX_BYTES, "expert of each row"))
    fc1_output, row_probs = ACTIVATION_INPUTS
    saves.append(SavedBytes("moe_act", fc1_output, rows * width * activation_bytes, "first projection output"))
    if probs:
        saves.append(SavedBytes("moe_act", row_probs, rows * prob_bytes, "row probabilities"))
    saves += [
        SavedBytes("expert_fc2", "fc2.offsets", group_offsets, "group offsets"),
        SavedBytes("expert_fc2", ACTIVATION_OUTPUT, rows * ffn_hidden * activation_bytes, "activation output"),
    ]
    if bias:
        saves.append(SavedBytes("expert_bias", "experts.down_bias", rows * hidden * activation_bytes, "down bias rows"))
    return saves


def shared_experts_saved_bytes(
    *, input_tensor: str, tokens: int, hidden: int, ffn_hidden: int, activation_bytes: int, gate: bool = False
) -> list[SavedBytes]:
    """What :class:`~moe_experts.shared.SharedExperts` (``ffn_hidden`` wide, with the sigmoid gate or not) saves for
    ``tokens`` rows of ``input_tensor`` (``[tokens, hidden]``): module docstring."""

    def shared(tensor: str, width: int, description: str) -> SavedBytes:
        return SavedBytes("shared_experts", tensor, tokens * width * activation_bytes, description)

    saves = [
        shared(input_tensor, hidden, "shared expert input"),
        shared("shared.gate_up", 2 * ffn_hidden, "shared expert gate|up"),  # [tokens, 2 x ffn]
        shared("shared.silu", ffn_hidden, "shared expert silu(gate)"),
        shared("shared.product", ffn_hidden, "shared expert silu(gate) * up"),
    ]
    if gate:  # sigmoid saves its output, and the product both factors
        saves += [
            shared("shared.gate", 1, "shared expert sigmoid gate"),
            shared("shared.mlp_out", hidden, "shared expert output before the gate"),
        ]
    return saves
