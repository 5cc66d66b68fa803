"""Metrics: the JSONL writer, peak memory, and MFU against the device's dense BF16 peak."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path

import torch

# Dense BF16 tensor-core peaks in FLOP/s from NVIDIA datasheets (no sparsity). Matched on substrings
# of torch.cuda.get_device_name(); the first match wins, so more specific names come first.
BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
)


def bf16_peak_flops(device: torch.device) -> float | None:
    """Dense BF16 peak of a CUDA device in FLOP/s, or None (CPU, unknown GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in BF16_PEAK_FLOPS:
        if key in name:
            return flops
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float:
    """CUDA: peak allocated by the caching allocator. CPU: the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``; flushes every line."""

    def __init__(self, path: Path, truncate_after_step: int | None = None):
        self.path = Path(path)
        if truncate_after_step is not None and self.path.exists():
            # On resume: drop records of steps after the checkpoint (they will be redone).
            kept = [
                line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line).get("step", 0) <= truncate_after_step
            ]
            self.path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._fh.write(json.dumps(clean) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: Path, *, events: bool = False) -> list[dict]:
    """The step records of a ``metrics.jsonl``, one per step in step order.

    A run that recovered from a divergence (``train.on_divergence = "recover"``, ``fp8kit.train.guard``)
    holds the records of the rolled-back steps, then an event record (``{"step", "event": ...}``), then the
    redone steps: the redone record of a step replaces the rolled-back one, and event records are left out.
    With ``events=True``: every record as written, events included, in file order.
    """
    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if events:
        return records
    steps = {r["step"]: r for r in records if "event" not in r}  # the last record of a step wins
    return [steps[s] for s in sorted(steps)]
