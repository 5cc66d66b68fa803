"""Time the fused FP8AdamW step + expert-weight casts (``kernel.py``) against the unfused path on a GPU, and check
that they give the same bits (session 26 on the H100: same bits, the fused kernel slower; README). Run from the
repository root:

    PYTHONPATH=src:. python benchmarks/experiments/fused_optimizer_cast/bench.py --out /tmp/fused_optimizer_cast.json

For each expert weight shape, one flat group holding that weight (per-block FP8AdamW states: E4M3 m rounded
stochastically, fp16 v and master, bf16 weights and gradients) after 3 warm-up steps:

- unfused: ``triton_step.adamw_update_triton`` (the group's one pass), then
  ``rowwise_weights_triton.quantize_experts_dual_hinted`` of the new bf16 weights with the previous step's scales
  as hints (what the fused MoE experts run at the next forward);
- fused: ``kernel.adamw_step_with_expert_casts``.

Each is timed over ``--iters`` consecutive steps with CUDA events (the states keep training: the hints stay the
previous step's, as in a run), interleaved over ``--repeats`` rounds; bytes per element: 18 unfused, 16 fused. The
fused kernel runs at each ``--tiles`` setting (rows x warps; README: registers and spills per tile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: optimizer_step.time_it

from kernel import adamw_step_with_expert_casts  # noqa: E402
from optimizer_step import time_it  # noqa: E402

from fp8kit.moe import rowwise_weights_triton as rwt  # noqa: E402
from fp8kit.moe.rowwise_quant import quantize_experts_dual  # noqa: E402
from fp8kit.optim import numerics as N  # noqa: E402
from fp8kit.optim import triton_step  # noqa: E402
from fp8kit.optim.layout import FlatLayout  # noqa: E402

SHAPES = {"qwen3 gate_up": (128, 1536, 2048), "qwen3 down": (128, 2048, 768), "mixtral down": (8, 4096, 14336)}


def _label(bn: int, warps: int, k_fastest: bool) -> str:
    return f"{bn}x{warps}{'k' if k_fastest else ''}"


def bench_shape(name: str, shape: tuple[int, int, int], iters: int, repeats: int, dev: torch.device,
                tiles: list[tuple[int, int]]) -> dict:
    """Both paths on one expert weight (module docstring), the fused one per ``(rows, warps)`` tile: the median ms,
    bandwidth and whether the bits agree with the unfused path."""
    n_el = shape[0] * shape[1] * shape[2]
    spec = N.StateSpec(block=128, num_tensors=1, granularity="block", grad=torch.bfloat16, m=torch.float8_e4m3fn,
                       v=torch.float16, master=torch.float16, stochastic_rounding=False, m_rounding="stochastic")
    lay = FlatLayout.build([n_el], 128, dev)
    bufs = {"m": torch.zeros(lay.total, device=dev, dtype=spec.m),
            "v": torch.zeros(lay.total, device=dev, dtype=spec.v),
            "w": torch.zeros(lay.total, device=dev, dtype=spec.master)}
    for k in ("m", "v", "w"):
        bufs[k + "_scale"] = torch.ones(lay.num_blocks, device=dev)
    w0 = torch.randn(lay.total, device=dev) * 0.02
    N.store(w0.view(-1, 128), bufs["w"], bufs["w_scale"], lay.block_owner, spec)
    bufs["work"] = w0.to(torch.bfloat16)
    del w0
    grad = torch.randn(shape, device=dev).to(torch.bfloat16) * 1e-3
    table = torch.tensor([[grad.data_ptr()], [n_el]], device=dev, dtype=torch.int64)
    seg = torch.tensor(lay.offsets, device=dev, dtype=torch.int64)
    w3 = bufs["work"][:n_el].view(shape)
    fq = quantize_experts_dual(w3)
    state = {"step": 0, "hints": (fq[1], fq[3])}

    def hp() -> torch.Tensor:
        state["step"] += 1
        return N.make_hp(3e-4, 0.9, 0.95, 1e-8, 0.1, state["step"], 0).to(dev)

    def unfused():
        triton_step.adamw_update_triton(None, None, bufs["m"], bufs["m_scale"], None, bufs["v"], bufs["v_scale"],
                                        bufs["w"], bufs["w_scale"], bufs["work"], hp(), lay.block_owner, spec,
                                        grad_table=table, seg_start=seg, grad_vec=8)
        out = rwt.quantize_experts_dual_hinted(w3, *state["hints"])
        state["hints"] = (out[1], out[3])
        return out

    def fused(bn: int = 16, warps: int = 4, k_fastest: bool = False):
        out = adamw_step_with_expert_casts(0, shape, bufs["m"], bufs["m_scale"], bufs["v"], bufs["v_scale"], bufs["w"],
                                           bufs["w_scale"], bufs["work"], hp(), spec, table, seg, 0, *state["hints"],
                                           bn=bn, warps=warps, k_fastest=k_fastest)
        state["hints"] = (out[1], out[3])
        return out

    for _ in range(3):
        unfused()
    # bits: one step of each from the same start
    snap, snap_state = {k: t.clone() for k, t in bufs.items()}, dict(state)
    a = [t.clone() for t in unfused()]
    a_states = {k: t.clone() for k, t in bufs.items()}
    same = {}
    for bn, warps, kf in tiles:
        for k, t in snap.items():
            bufs[k].copy_(t)
        state.update(snap_state)
        b = fused(bn, warps, kf)
        ok = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a[:4], b[:4], strict=True))
        same[_label(bn, warps, kf)] = ok and all(torch.equal(a_states[k].view(torch.uint8), t.view(torch.uint8))
                                           for k, t in bufs.items())
    del snap, a, a_states, b
    variants = {"unfused": unfused} | {_label(bn, warps, kf): (lambda bn=bn, warps=warps, kf=kf: fused(bn, warps, kf))
                                       for bn, warps, kf in tiles}
    times = {label: [] for label in variants}
    for _ in range(repeats):
        for label, fn in variants.items():
            times[label].append(time_it(fn, iters, warmup=1))
    med = {label: statistics.median(t) for label, t in times.items()}
    return {"weight": name, "shape": shape, "ms": med, "runs": times, "same_bits": same,
            "unfused_tb_s": n_el * 18 / med["unfused"] / 1e9,
            "fused_tb_s": {t: n_el * 16 / med[t] / 1e9 for t in same}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiles", default="16x4,8x4,32x4,32x8,64x8",
                    help="fused kernel tiles to time, rows x warps, a 'k' suffix for the grid with tiles along K "
                         "first (comma-separated; README: registers per tile)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    tiles = [(int(t.split("x")[0]), int(t.split("x")[1].rstrip("k")), t.endswith("k")) for t in args.tiles.split(",")]
    for name in args.shapes.split(","):
        r = bench_shape(name, SHAPES[name], args.iters, args.repeats, torch.device("cuda"), tiles)
        rows.append(r)
        print(f"{name} {r['shape']}: unfused {r['ms']['unfused']:.3f} ms ({r['unfused_tb_s']:.2f} TB/s at 18 B)", flush=True)
        for t, ok in r["same_bits"].items():
            print(f"  fused {t}: {r['ms'][t]:.3f} ms ({r['fused_tb_s'][t]:.2f} TB/s at 16 B), "
                  f"{r['ms']['unfused'] / r['ms'][t]:.3f}x; same bits: {ok}", flush=True)
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
