"""What a run writes for its users, whichever host runs it: `metrics.py` (one metrics.jsonl line per step, MFU),
`tensorboard.py` (the same curves as TensorBoard scalars, purged on resume) and `trace.py` (host-side spans per
rank, merged into one Chrome/Perfetto trace). Sinks only: nothing here decides how a step runs."""
