"""Heterogeneous Parallel Allocator: how many devices the encoder(s) and the backbone get, and how each is
parallelized, so the producer keeps the consumer busy at the highest throughput (pure computation: numpy and
OR-Tools, no process groups; importable in a notebook).

    hardware.py   cluster presets (recipes/cluster/*.yaml) over the per-SKU peak table of mindspeed_flow/skus.py
    workload.py   the sample shapes a plan is made for (data recipe, InfoVQA-like generator, length table)
    parts.py      PartSpec: one entry per part (encoder, backbone, a second encoder ...), workload-averaged
    cost.py       analytic step time and memory per layout, vectorized over layouts
    space.py      structurally valid layouts per part (TP in a node, divisibility, batch, token budget)
    solver.py     lexicographic CP-SAT allocation, and the exhaustive enumeration it is tested against
    baselines.py  Megatron-style coupled and MindSpeed dist-train layouts in the same cost model
    plan.py       Problem -> Plan (make_plan), binding constraints, infeasibility messages
    report.py     text report, JSON, Hydra experiment recipe, throughput-vs-encoder-share plot
    inputs.py     cluster= / model= / data= / overrides -> Problem
    cli.py        `mindspeed-flow plan`
    profile.py    `mindspeed-flow profile`: timings on the devices at hand -> calibration table
    measure.py    timing helpers: a call's wall and CPU seconds, the core share of concurrent processes
    memory.py     predicted vs measured peak memory per part of each host's tiny job (`bench memory`)
    validate.py   predicted vs measured step time through `mindspeed-flow train`
"""
from mindspeed_flow.skus import PEAK_TFLOPS, peak_flops

__all__ = ["PEAK_TFLOPS", "peak_flops"]
