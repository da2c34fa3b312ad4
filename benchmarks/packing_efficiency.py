"""Packing efficiency of conversations: the share of a window's tokens that are a conversation's, first-fit packing
(``data.packing true``) against one conversation per padded window (``data.packing false``, the baseline).

Lengths follow a log-normal distribution shaped like chat fine-tuning sets (median 450 tokens, sigma 0.9: a mean of
about 680, one conversation in a hundred longer than 3,700), drawn with a fixed seed; conversations longer than the
window are left out and counted (``data.truncation skip``). The packing time is the plan's (moe_train.document_packing),
per 100,000 conversations, on this machine.
"""

from __future__ import annotations

import time

import numpy as np
from _harness import cli, header, parse, write

from moe_train.document_packing import pack_first_fit

MEDIAN, SIGMA = 450.0, 0.9
SEQ_LENS = (2048, 4096, 8192)


def lengths(count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.maximum(1, np.round(rng.lognormal(np.log(MEDIAN), SIGMA, size=count))).astype(np.int64)


def main() -> None:
    args = parse(cli("packing_efficiency", __doc__, "10,000 conversations instead of 200,000"))
    count = 10_000 if args.quick else 200_000
    drawn = lengths(count)
    rows = []
    for seq_len in SEQ_LENS:
        kept = drawn[drawn <= seq_len]
        start = time.perf_counter()
        packed = pack_first_fit(kept.tolist(), seq_len)
        seconds = time.perf_counter() - start
        padded = float(kept.sum() / (len(kept) * seq_len))
        rows.append(
            {
                "seq_len": seq_len,
                "conversations": len(kept),
                "longer_than_window": int(len(drawn) - len(kept)),
                "windows_packed": len(packed.windows),
                "windows_padded": len(kept),
                "efficiency_packed": round(packed.efficiency, 5),
                "efficiency_padded": round(padded, 5),
                "windows_saved": round(1 - len(packed.windows) / len(kept), 5),
                "pack_seconds_per_100k": round(seconds * 100_000 / len(kept), 3),
            }
        )
        print(
            f"seq_len {seq_len}: packed {100 * packed.efficiency:.2f}% of tokens used, padded {100 * padded:.2f}% "
            f"({len(packed.windows)} windows instead of {len(kept)}; {len(drawn) - len(kept)} longer than a window); "
            f"{seconds:.2f} s to pack"
        )
    report = header(
        args,
        what="share of window tokens that are conversation tokens, first-fit packing vs one padded window each",
        baseline="one conversation per window, padded (data.packing false)",
        inputs={"conversations": count, "lengths": f"log-normal, median {MEDIAN:.0f}, sigma {SIGMA}", "seed": 0},
        rows=rows,
    )
    write(args.out, report)


if __name__ == "__main__":
    main()
