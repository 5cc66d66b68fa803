"""bench-layers: per-site BF16 vs FP8 timings for adaptive FP8."""
