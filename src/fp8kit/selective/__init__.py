"""Selective FP8: sites, static rules, measured policies and the per-site FP8/BF16 decision (plain data)."""
