"""Errors, the console and device/runtime facts: the bottom layer (imports nothing of fp8kit)."""
