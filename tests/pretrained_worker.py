"""Run under ``torchrun --nproc_per_node 2`` by tests/test_pretrained.py: FSDP2 runs from a pretrained dir.

Usage: ``torchrun --nproc_per_node 2 tests/pretrained_worker.py OUT_ROOT PRETRAINED_DIR SCENARIO ... -- SET ...``;
each scenario trains into ``OUT_ROOT/SCENARIO`` with ``model.pretrained = PRETRAINED_DIR`` (the model built
on ``meta``, sharded by FSDP2, then each rank reads its own slices of the safetensors), and writes
``OUT_ROOT/SCENARIO.rank<R>.json`` with that rank's peak host memory (ru_maxrss, MiB).
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

SCENARIOS = {
    "fsdp_bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=2"],
    "fsdp_fp8": ["train.mixed_precision=fp8", "train.micro_batch_size=2"],
}


def main() -> None:
    out_root, pretrained = Path(sys.argv[1]), sys.argv[2]
    split = sys.argv.index("--")
    names, sets = sys.argv[3:split], sys.argv[split + 1:]
    torch.set_num_threads(1)
    import torch.distributed as dist

    from fp8kit.config import load_config
    from fp8kit.train.trainer import train

    for name in names:
        cfg = load_config(None, [*sets, f"model.pretrained={pretrained}", *SCENARIOS[name]])
        train(cfg, out_root / name)
        rank = dist.get_rank() if dist.is_initialized() else 0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        (out_root / f"{name}.rank{rank}.json").write_text(json.dumps({"peak_rss_mib": rss}), encoding="utf-8")
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


if __name__ == "__main__":
    main()
