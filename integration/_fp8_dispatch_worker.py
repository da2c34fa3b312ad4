"""One rank of test_fp8_dispatch.py: ``python _fp8_dispatch_worker.py OUT_DIR`` (2 gloo ranks, torchrun's environment).

Both expert-parallel dispatchers with moe-precision's blockwise FP8 wire against the same dispatcher without it, fed
the tokens after the format's round trip (the blockwise quantiser's own, not the codec's): the received tokens, the
combined output and the tokens' gradient (straight through), the bytes the dispatcher reports against what the
encoded parts hold, and the error against bf16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from _rank_scenarios import Scenarios
from moe_dispatch import RoutingResult, build_dispatcher
from moe_precision import BlockwiseFP8Wire, quantize_fp8_blockwise

HIDDEN, EXPERTS, TOPK = 256, 4, 2
# scenario name -> (dispatcher, token dtype): one scenario each (_rank_scenarios.py)
SCENARIOS = {
    f"{name} {dtype}": (name, dtype) for dtype in (torch.bfloat16, torch.float32) for name in ("alltoall", "allgather")
}


def routing(num_tokens: int, gen: torch.Generator) -> RoutingResult:
    idx = torch.rand(num_tokens, EXPERTS, generator=gen).topk(TOPK, dim=-1).indices
    probs = torch.softmax(torch.randn(num_tokens, TOPK, generator=gen), dim=-1)
    counts = torch.bincount(idx.flatten(), minlength=EXPERTS)
    return RoutingResult(probs, idx, counts, probs.new_zeros(()), None, None)


def run(name: str, wire: BlockwiseFP8Wire | None, x: torch.Tensor, route: RoutingResult, cot: torch.Tensor):
    disp = build_dispatcher(name, EXPERTS, wire=wire)
    x = x.detach().clone().requires_grad_()
    res = disp.dispatch(x, route)
    scale = torch.arange(1, res.tokens_NH.shape[0] + 1, dtype=x.dtype)[:, None]  # an "expert" that is not identity
    out = disp.combine(res.tokens_NH * scale, res.handle)
    (out.float() * cot).sum().backward()
    bytes_sent = disp.dispatch_bytes(res.handle, HIDDEN, 2)  # 2: bf16 elements when sent plain
    return res.tokens_NH.detach(), out.detach(), x.grad, bytes_sent, disp


def compare(name: str, dtype: torch.dtype, wire: BlockwiseFP8Wire, rank: int) -> dict:
    gen = torch.Generator().manual_seed(10 + rank)
    num_tokens = 24 + 8 * rank
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * torch.logspace(-2, 2, HIDDEN)).to(dtype)
    route = routing(num_tokens, gen)
    cot = torch.randn(num_tokens, HIDDEN, generator=gen)
    # the blockwise quantiser's own round trip, not the codec under test's decode(encode(x))
    round_trip = quantize_fp8_blockwise(x, (1, 128)).dequantize(dtype)
    tokens, out, grad, wire_bytes, disp = run(name, wire, x, route, cot)
    ref_tokens, ref_out, ref_grad, plain_bytes, _ = run(name, None, round_trip, route, cot)
    bf16_tokens, *_ = run(name, None, x, route, cot)
    parts = wire.encode(x[:1])
    return {
        "tokens": tokens,
        "ref_tokens": ref_tokens,
        "out": out,
        "ref_out": ref_out,
        "grad": grad,
        "ref_grad": ref_grad,
        "wire_bytes": wire_bytes,
        "plain_bytes": plain_bytes,
        "part_bytes_per_row": sum(p.nbytes for p in parts),
        "rows": disp.rows_sent(disp.dispatch(x, route).handle) if name == "alltoall" else None,
        "rel_error": ((tokens.float() - bf16_tokens.float()).norm() / bf16_tokens.float().norm()).item(),
    }


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    wire = BlockwiseFP8Wire()
    scenarios = Scenarios(out_dir)
    for scenario, (name, dtype) in SCENARIOS.items():
        scenarios.run(scenario, compare, name, dtype, wire, rank)
    scenarios.finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
