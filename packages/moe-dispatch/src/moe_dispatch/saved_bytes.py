"""What the router and the token dispatchers save for backward, in bytes, from plain sizes; and how many rows routing
puts on a rank. A memory estimate (``moe_memory.estimate``) composes these declarations with the other packages'.

Each declaration is a list of :class:`SavedBytes`: the estimate's name of the module that saves the tensor
(``router``, ``dispatch``, ``combine``), a name for the tensor (the same wherever it is saved again; tensors of the
caller, such as the router's input, carry the name the caller gives), its bytes and a description. They are tested
against ``moe_memory.measure.SavedTensorBytes`` on :class:`~moe_dispatch.router.TopKRouter` and the dispatchers.

- :class:`~moe_dispatch.router.TopKRouter` saves its input (a copy in the router dtype when the activations are in
  another), the weight cast to the router dtype when the parameters are in another, and its logits / scores and
  probabilities as the score function needs them: softmax over the top-k logits saves the logits, the top-k ids and
  probabilities; softmax before top-k the softmax scores and ids; sigmoid the sigmoid scores and ids and, renormalised
  over k > 1, the picked scores and their sum. Then the capacity keep mask, the balancing losses' scores (and their
  sums under sigmoid) and fractions, the z-loss's logsumexp (and the logits), and the loss they attach.
- The dispatcher saves the int64 row of each pair (a spare slot for a dropped one); the permutation's int64 row indices
  (and padding rows) unless the experts gather their rows themselves (:attr:`RoutedRows.gathered_by_experts`); under
  the all-to-all the send map (the token of each sent row, twice, and the sent rows' pair mask in the router dtype).
  Combine on CPU scatter-adds (an int64 token slot per row, and per returned row), elsewhere gathers each token's pair
  rows with their weights (int64 index and weights in the activation dtype, for the returned rows too).

Rows (:func:`routed_rows`): a rank's experts receive the routed rows of its ep group: ``tokens x topk`` expected when
dropless (uniform routing), all-gathered over etp; with a capacity factor the worst case (every source rank fills
every local expert's capacity; exactly that with ``pad_to_capacity``). The all-to-all sends one row per distinct
(token, destination rank) pair: :func:`expected_ranks_per_token` under uniform routing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

INDEX_BYTES = 8  # int64 ids and row indices


class SavedBytes(NamedTuple):
    module: str  # the estimate's module name: router | dispatch | combine
    tensor: str  # names the tensor: the same name wherever it is saved again
    nbytes: int
    description: str


def expected_ranks_per_token(num_experts: int, topk: int, ep: int) -> float:
    """Distinct ep ranks among a token's ``topk`` distinct experts, picked uniformly (each rank owns E/ep)."""
    local_experts = num_experts // ep
    if topk > num_experts - local_experts:
        return float(ep)
    return ep * (1.0 - math.comb(num_experts - local_experts, topk) / math.comb(num_experts, topk))


@dataclass(frozen=True)
class RoutedRows:
    """The rows one rank's MoE layer handles (module docstring)."""

    pairs: int  # (token, expert) rows this rank's experts compute, padding included
    kept: int  # of which real pairs
    sent: int  # all-to-all rows this rank sends (one per distinct (token, destination rank))
    received: int  # rows before the local permutation: the rank's tokens, or those received (x etp)
    capacity: int | None  # rows per expert, with a capacity factor

    @property
    def gathered_by_experts(self) -> bool:
        """Whether the experts' first projection gathers its rows from the fewer received rows itself."""
        return self.received < self.pairs


def routed_rows(
    *,
    tokens: int,
    num_experts: int,
    topk: int,
    ep: int = 1,
    etp: int = 1,
    capacity_factor: float | None = None,
    pad_to_capacity: bool = False,
    dispatcher: str = "alltoall",
) -> RoutedRows:
    """The rows of a rank routing ``tokens`` (its sequence-parallel share) over ``ep`` x ``etp`` (module docstring)."""
    local_experts = num_experts // ep
    distributed = ep * etp > 1
    # all-to-all rows, expected: as many arrive from the ep group as leave
    sent = arriving = tokens * expected_ranks_per_token(num_experts, topk, ep)
    kept = tokens * topk  # pairs this rank's experts get from the ep group, expected: its share of the group's
    capacity = None
    if capacity_factor is not None:  # worst case: every source rank fills every local expert's capacity
        capacity = math.ceil(tokens * topk / num_experts * capacity_factor)
        bound = local_experts * capacity * ep
        kept = min(tokens * ep * min(topk, local_experts), bound)
        sent, arriving = tokens * min(ep, topk), min(tokens * ep, bound)
    pairs = local_experts * capacity * ep if capacity is not None and pad_to_capacity else kept
    if not distributed:
        received = tokens
    elif dispatcher == "allgather":
        received = tokens * ep * etp
    else:
        received = arriving * etp
    return RoutedRows(math.ceil(pairs * etp), math.ceil(kept * etp), math.ceil(sent), math.ceil(received), capacity)


def router_saved_bytes(
    *,
    input_tensor: str,
    tokens: int,
    sequences: int,
    hidden: int,
    num_experts: int,
    topk: int,
    router_bytes: int,
    activation_bytes: int,
    param_bytes: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    sigmoid_norm_topk: bool = True,
    aux_losses: Sequence[str] = ("aux_loss",),
    z_loss: bool = False,
    capacity: bool = False,
) -> list[SavedBytes]:
    """What :class:`~moe_dispatch.router.TopKRouter` saves routing ``tokens`` rows (of ``sequences`` sequences) of
    ``input_tensor`` (``[tokens, hidden]`` in the activation dtype): module docstring. ``aux_losses``: the balancing
    losses with a nonzero coefficient; ``capacity``: a capacity factor is set."""

    def router(tensor: str, nbytes: int, description: str) -> SavedBytes:
        return SavedBytes("router", tensor, nbytes, description)

    input_bytes = tokens * hidden * router_bytes
    if activation_bytes == router_bytes:
        saves = [router(input_tensor, input_bytes, "router input")]
    else:
        saves = [router("router.x", input_bytes, "router input in its dtype")]
    if param_bytes != router_bytes:  # the weight cast to the router dtype is a copy autograd keeps
        saves.append(router("router.weight", num_experts * hidden * router_bytes, "router weight cast"))
    pairs, scores = tokens * topk, tokens * num_experts  # [tokens, topk] and [tokens, num_experts] elements
    topk_ids = router("router.idx", pairs * INDEX_BYTES, "top-k expert ids")
    logits = router("router.logits", scores * router_bytes, "router logits")
    if score_function == "sigmoid":
        saves += [router("router.sigmoid", scores * router_bytes, "sigmoid scores"), topk_ids]
        if sigmoid_norm_topk and topk > 1:
            saves.append(router("router.picked", pairs * router_bytes, "picked scores"))
            saves.append(router("router.denominator", tokens * router_bytes, "sum of picked scores"))
    elif pre_softmax:
        saves += [router("router.softmax", scores * router_bytes, "softmax scores"), topk_ids]
    else:
        saves += [logits, topk_ids, router("router.probs", pairs * router_bytes, "top-k probabilities")]
    if capacity:
        saves.append(router("router.keep", pairs * router_bytes, "capacity keep mask"))
    losses = [kind for kind in aux_losses if kind != "none"]
    if losses:
        saves.append(router("router.aux_scores", scores * router_bytes, "balancing-loss scores"))
        if score_function == "sigmoid":
            saves.append(router("router.aux_denominator", tokens * router_bytes, "balancing-score sums"))
        for kind in losses:
            fraction_rows = sequences if kind == "seq_aux_loss" else 1
            saves.append(router(f"router.{kind}", fraction_rows * num_experts * router_bytes, f"{kind} fractions"))
    if z_loss:
        saves += [logits, router("router.lse", tokens * router_bytes, "z-loss logsumexp")]
    if losses or z_loss:
        saves.append(router("router.loss", router_bytes, "attached loss"))  # a scalar in the router dtype
    return saves


def dispatcher_saved_bytes(
    rows: RoutedRows,
    *,
    tokens: int,
    topk: int,
    router_bytes: int,
    activation_bytes: int,
    distributed: bool = False,
    dispatcher: str = "alltoall",
    device: str = "cuda",
    experts_gather: bool = True,
) -> list[SavedBytes]:
    """What dispatch and combine save for a rank routing ``tokens`` rows with ``rows`` (:func:`routed_rows`):
    module docstring. ``distributed``: ep x etp > 1; ``device``: "cpu" combines with scatter-adds;
    ``experts_gather`` False: the rows are permuted even where the experts could gather them themselves (the caller
    weighs them before the experts)."""
    saves = []
    alltoall = distributed and dispatcher != "allgather"  # the all-to-all's send map and its returned rows
    if alltoall:
        saves += [
            SavedBytes("dispatch", "dispatch.send_index", rows.sent * INDEX_BYTES, "send-row token ids"),
            SavedBytes("dispatch", "dispatch.send_token", rows.sent * INDEX_BYTES, "send-row token ids (probs)"),
            SavedBytes("dispatch", "dispatch.send_probs", rows.sent * topk * router_bytes, "send-row pair mask"),
        ]
    if not (experts_gather and rows.gathered_by_experts):
        saves.append(SavedBytes("dispatch", "dispatch.index", rows.pairs * INDEX_BYTES, "permutation row ids"))
        if rows.pairs > rows.kept:
            padding = (rows.pairs - rows.kept) * INDEX_BYTES
            saves.append(SavedBytes("dispatch", "dispatch.padding", padding, "padding rows"))
    # the rows' probabilities: the row of each pair, a spare slot for a dropped one (no boolean index: no host sync)
    saves.append(SavedBytes("dispatch", "dispatch.rows", rows.received * topk * INDEX_BYTES, "row of each pair"))
    if device == "cpu":  # the unweighted sums are one scatter-add each, saving every row's token slot
        saves.append(SavedBytes("combine", "combine.slots", rows.pairs * INDEX_BYTES, "token slot of each row"))
        if alltoall:
            returned = rows.sent * INDEX_BYTES
            saves.append(SavedBytes("combine", "combine.return_slots", returned, "token of each returned row"))
    else:  # a gather of each token's pair rows and their weights
        pair_rows = rows.received * topk  # [rows, topk]
        saves += [
            SavedBytes("combine", "combine.index", pair_rows * INDEX_BYTES, "pair rows"),
            SavedBytes("combine", "combine.weights", pair_rows * activation_bytes, "pair weights"),
        ]
        if alltoall:
            returned = tokens * topk  # [tokens, topk]
            saves += [
                SavedBytes("combine", "combine.return_index", returned * INDEX_BYTES, "returned rows"),
                SavedBytes("combine", "combine.return_weights", returned * activation_bytes, "returned-row weights"),
            ]
    return saves


def exchange_buffer_bytes(rows: RoutedRows, *, hidden: int, activation_bytes: int, dispatcher: str) -> int:
    """The bytes one layer's exchange holds in flight under ep or etp: the rows received and as many sent back."""
    sent = 0 if dispatcher == "allgather" else rows.sent
    return (rows.received + sent) * hidden * activation_bytes
