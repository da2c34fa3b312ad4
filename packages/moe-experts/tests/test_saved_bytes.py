"""moe_experts.saved_bytes against what GroupedExperts and SharedExperts really save for backward
(moe_memory.measure.SavedTensorBytes), byte for byte and module by module, on CPU in fp32 and bf16: rows given or
gathered by the first projection itself, gated or not, with biases, rows of padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_experts import GroupedExperts, SharedExperts
from moe_experts.saved_bytes import grouped_experts_saved_bytes, shared_experts_saved_bytes
from moe_memory.measure import SavedTensorBytes

HIDDEN, FFN = 8, 8  # 16-byte rows in bf16: what torch's grouped_mm needs
MODULE_OF = {"fc1": "expert_fc1", "act": "moe_act", "fc2": "expert_fc2", "": "expert_bias"}  # GroupedExperts' own


def _declared_by_module(declared) -> dict[str, int]:
    out: dict[str, int] = {}
    for save in {save.tensor: save for save in declared}.values():  # a tensor saved twice counts once
        out[save.module] = out.get(save.module, 0) + save.nbytes
    return out


@settings(max_examples=16, deadline=None)
@given(
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(sum),  # no rows: nothing saved
    activation=st.sampled_from(["swiglu", "squared_relu", "swiglu_oai"]),
    bias=st.booleans(),
    gather=st.booleans(),
    bf16=st.booleans(),
    backend=st.sampled_from(["torch", "loop"]),
)
def test_grouped_experts_save_what_they_declare(counts, activation, bias, gather, bf16, backend) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    experts = GroupedExperts(len(counts), HIDDEN, FFN, activation=activation, bias=bias, backend=backend)
    experts = experts.to(dtype)
    rows = sum(counts)
    counts_E = torch.tensor(counts)
    probs_N = torch.rand(rows, requires_grad=True)
    tokens = max(rows // 2, 1)
    x_TH = torch.randn(tokens, HIDDEN, dtype=dtype, requires_grad=True)
    row_source_N = torch.randint(0, tokens, (rows,))
    x_NH = x_TH[row_source_N]  # the rows the dispatcher would permute
    with SavedTensorBytes(model=experts) as measured:
        if gather:
            experts(x_TH, counts_E, probs_N, row_source_N=row_source_N)
        else:
            experts(x_NH, counts_E, probs_N)
    declared = grouped_experts_saved_bytes(
        rows=rows,
        local_experts=len(counts),
        hidden=HIDDEN,
        ffn_hidden=FFN,
        gated=experts.activation.gated,
        bias=bias,
        activation_bytes=dtype.itemsize,
        prob_bytes=probs_N.element_size(),
        source_tensor="x" if gather else None,
        source_rows=tokens,
        backend=backend,
    )
    measured_by_module = {MODULE_OF[name]: n for name, n in measured.by_module.items()}
    assert measured_by_module == {module: n for module, n in _declared_by_module(declared).items() if n}


@pytest.mark.parametrize("gate", [False, True], ids=["no gate", "gate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shared_experts_save_what_they_declare(dtype: torch.dtype, gate: bool) -> None:
    shared = SharedExperts(HIDDEN, FFN, gate=gate).to(dtype)
    x_TH = torch.randn(6, HIDDEN, dtype=dtype, requires_grad=True)
    with SavedTensorBytes(model=shared) as measured:
        shared(x_TH)
    declared = shared_experts_saved_bytes(
        input_tensor="x", tokens=6, hidden=HIDDEN, ffn_hidden=FFN, activation_bytes=dtype.itemsize, gate=gate
    )
    assert measured.by_module == {"": sum(save.nbytes for save in declared)}
