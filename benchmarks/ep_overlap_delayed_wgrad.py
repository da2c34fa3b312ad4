"""Expert-parallel communication hidden behind computation across micro-batches with delayed weight gradients: a
training step of several micro-batches without overlap and with ``parallel.ep_overlap microbatch`` plus
``parallel.delay_wgrad_compute`` (the experts' weight-gradient GEMMs run while the backward's all-to-alls travel:
moe_experts.delayed_wgrad), on a modelled link.

The measurement is ep_overlap_microbatch.py's (ep_overlap.py's docstring): the same model, link, ratios, micro-batches
and head-to-head pairs against the step without overlap. Writes benchmarks/results/ep_overlap_delayed_wgrad.json.
"""

from __future__ import annotations

from ep_overlap import main

if __name__ == "__main__":
    main("microbatch_delayed")
