"""Expert-parallel communication hidden behind computation across micro-batches: a training step of several
micro-batches without overlap and with ``parallel.ep_overlap microbatch`` (each micro-batch's backward and the next
one's forward in flight together, taking turns at their all-to-alls: moe_dispatch.lanes; each exchange in 4 chunks,
parallel.ep_overlap_chunks' default), on a modelled link.

The measurement is ep_overlap.py's (its docstring): the same model, link, ratios and head-to-head pairs, with a
step of ``MICRO_BATCHES`` micro-batches of 1,024 tokens a rank, at ep=2 and ep=4. Writes
benchmarks/results/ep_overlap_microbatch.json.
"""

from __future__ import annotations

from ep_overlap import main

if __name__ == "__main__":
    main("microbatch")
