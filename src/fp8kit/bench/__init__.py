"""bench-layers: per-site BF16 vs FP8 timings, the measurements behind a selective-FP8 policy."""
