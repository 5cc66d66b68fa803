"""The trainer: setup, loop, schedules, metrics, checkpoints, summary, compare."""
