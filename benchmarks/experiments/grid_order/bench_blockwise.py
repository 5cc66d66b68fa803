# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The blockwise recipe's activation and weight casts (``fp8/kernels/blockwise_triton.py``) with their programs in
two orders: rows first (grid ``(rows / 128, K / 128)``, the order before session 26) and tiles along K first (grid
``(K / 128, rows / 128)``: consecutive programs read consecutive tiles of the same rows). Each order autotunes on its
own (``K_FIRST`` is in the autotune key); both must give the same bits. CUDA-graph timing, the orders interleaved over
``--repeats`` rounds, Llama-3-8B shapes; bytes per element: 4 (read 2, write two E4M3 copies), 3 for the fprop copy
alone.

    python benchmarks/experiments/grid_order/bench_blockwise.py --out /tmp/grid_order_blockwise.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.fp8.kernels import blockwise_triton as bt  # noqa: E402

ACT = [(8192, 4096), (8192, 14336), (16384, 4096), (16384, 14336)]
WEIGHT = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _x(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, generator=g, device="cuda")
    x.view(-1)[::997] *= 30.0
    return x.to(torch.bfloat16)


def cases():
    for m, k in ACT:
        x = _x((m, k), m + k)
        yield f"act 128x1 {m}x{k}", 4 * x.numel(), lambda kf, x=x: bt._act_quant(x, True, False, k_first=kf)
        yield f"act 128x128 {m}x{k}", 4 * x.numel(), lambda kf, x=x: bt._act_quant(x, True, True, k_first=kf)
        yield f"act fprop {m}x{k}", 3 * x.numel(), lambda kf, x=x: bt._act_quant(x, False, k_first=kf)
    for n, k in WEIGHT:
        w = _x((n, k), n * k) * 0.02

        def weight(kf, w=w):
            flag = bt._WEIGHT_K_FIRST
            bt._WEIGHT_K_FIRST = kf
            try:
                return bt.quantize_weight(w)
            finally:
                bt._WEIGHT_K_FIRST = flag
        yield f"weight {n}x{k}", 4 * w.numel(), weight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, nbytes, fn in cases():
        assert same_bits(tuple(fn(True)), tuple(fn(False))), f"{name}: the two orders differ"
        runs = {"rows first": [], "K first": []}
        for _ in range(args.repeats):
            for label, kf in (("rows first", False), ("K first", True)):
                runs[label].append(timed(lambda: fn(kf)))
        med = {k: statistics.median(v) for k, v in runs.items()}
        rows.append({"case": name, "bytes": nbytes, "ms": med, "runs": runs})
        print(f"{name:24s} rows first {med['rows first']:.4f} ms ({nbytes / med['rows first'] / 1e9:.2f} TB/s), "
              f"K first {med['K first']:.4f} ms ({nbytes / med['K first'] / 1e9:.2f} TB/s), "
              f"{med['rows first'] / med['K first']:.3f}x; same bits", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
