"""Model preparation for 1..N ranks: the device mesh, TP / EP plans, FP8 conversion, AC, FSDP2, compile."""
