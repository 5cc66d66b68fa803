"""One launch of each variant of the one-read activation cast (``bench.py``'s kernel and its ``--ablate`` flags) at
8192x4096, wgrad_x 128x1, for Nsight Compute to read its counters (no timing here; the JIT compile of each variant
is a host step, so every captured launch is a kernel run on real data)::

    ncu --clock-control none --kernel-name regex:_one_read_kernel --csv --page details \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \\
        --section MemoryWorkloadAnalysis python benchmarks/experiments/act_cast_one_read/ncu_target.py > ncu.csv
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402

x = bench.real(8192, 4096, seed=4096)
for name, flags in {"one read": {}, **bench.ABLATIONS}.items():
    bench.one_read(x, "128x1", 4, **flags)
    torch.cuda.synchronize()
    print(f"launched: {name}", flush=True)
