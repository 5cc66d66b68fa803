# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""Every autotune configuration of the blockwise activation cast and the fused SwiGLU casts, timed alone on the
GPU (CUDA graph of 20 launches, replayed; median of 7), each checked bit for bit against the PyTorch reference
(activation cast) or against the activation cast of the values it computed (SwiGLU kernels). ``P`` is the
programs per SM of the persistent launch (0: one program per 128x128 tile). Also a bf16 copy of the same bytes
(read 2 + write 2 bytes per element) as the floor a memory-bound pass can reach.

    python benchmarks/experiments/persistent_casts/bench.py --out /tmp/persistent.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import timed  # noqa: E402,F401  (ablate.py imports it from here)

from fp8kit.base.triton_lib import OneConfig  # noqa: E402
from fp8kit.fp8 import blockwise  # noqa: E402
from fp8kit.fp8.kernels import blockwise_triton as bt  # noqa: E402
from fp8kit.fp8.kernels import swiglu_triton as st  # noqa: E402


def bits(ts):
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in ts]


def same(a, b) -> int:
    return sum(int((x != y).sum()) for x, y in zip(bits(a), bits(b), strict=True))


def real(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, generator=g, device="cuda") * scale
    t.view(-1)[torch.randint(0, t.numel(), (t.numel() // 1000,), generator=g, device="cuda")] *= 20.0
    return t.to(torch.bfloat16)


CONFIGS: list[str] = []


def each(mod, name, run, check):
    tuner = getattr(mod, name)
    rows = []
    try:
        for cfg in tuner.configs:
            if CONFIGS and not any(c in str(cfg) for c in CONFIGS):
                continue
            setattr(mod, name, OneConfig(tuner, cfg))
            bad = check(run())
            ms = timed(run)
            rows.append({"config": dict(cfg.kwargs, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg), "ms": ms, "bits_off": bad})
    finally:
        setattr(mod, name, tuner)
    return rows


def summary(rows, nbytes):
    for r in rows:
        r["TB/s"] = nbytes / r["ms"] / 1e9
    p0 = min((r for r in rows if r["config"].get("P", 0) == 0), key=lambda r: r["ms"])
    best = min(rows, key=lambda r: r["ms"])
    return {"best_tile_grid": p0, "best": best, "bits_off_any": sum(r["bits_off"] for r in rows), "all": rows}


def report(label: str, r: dict) -> None:
    """One line per kernel: the best tile-grid configuration, the best overall, and whether any was off in bits."""
    print(f"{label}: tile grid {r['best_tile_grid']['ms']:.4f} ({r['best_tile_grid']['TB/s']:.2f}) "
          f"best {r['best']['ms']:.4f} ({r['best']['TB/s']:.2f}) {r['best']['config']} "
          f"bits off {r['bits_off_any']}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="8192,16384")
    ap.add_argument("--only", choices=("all", "swiglu_bwd"), default="all")
    ap.add_argument("--configs", default="", help="launch only the configs whose str() contains one of these, e.g. 'P: 0,P: 2'")
    args = ap.parse_args()
    CONFIGS.extend(c for c in args.configs.split(",") if c)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__
    for m in (int(v) for v in args.m.split(",")):
        for k in (4096, 14336) if args.only == "all" else ():
            x = real(m, k, seed=k)
            copy_dst = torch.empty_like(x)
            res[f"copy {m}x{k}"] = {"ms": (ms := timed(lambda: copy_dst.copy_(x))), "TB/s": 4 * x.numel() / ms / 1e9}
            for wgrad_x in ("128x1", "128x128"):
                ref = blockwise.quantize_act(x, wgrad_x)
                r = summary(each(bt, "_act_quant_kernel", lambda: bt.quantize_act(x, wgrad_x),
                                 lambda out: same(out, ref)), 4 * x.numel())
                res[f"act {m}x{k} {wgrad_x}"] = r
                print(f"act {m}x{k} {wgrad_x}: tile grid {r['best_tile_grid']['ms']:.4f} ms "
                      f"({r['best_tile_grid']['TB/s']:.2f} TB/s) best {r['best']['ms']:.4f} ms "
                      f"({r['best']['TB/s']:.2f} TB/s) {r['best']['config']} bits off {r['bits_off_any']}; "
                      f"copy {res[f'copy {m}x{k}']['TB/s']:.2f} TB/s", flush=True)
                Path(args.out).write_text(json.dumps(res, indent=1))
        g, u, da = real(m, 14336, scale=2.0, seed=1), real(m, 14336, seed=2), real(m, 14336, scale=1e-3, seed=3)
        n = g.numel()
        for wgrad_x in ("128x1", "128x128") if args.only == "all" else ():
            *_, a = st.swiglu_quantize_act(g, u, wgrad_x, values=True)
            ref = blockwise.quantize_act(a, wgrad_x)
            r = summary(each(st, "_swiglu_quant_kernel", lambda: st.swiglu_quantize_act(g, u, wgrad_x),
                             lambda out: same(out, ref)), 6 * n)
            res[f"swiglu fwd {m}x14336 {wgrad_x}"] = r
            report(f"swiglu fwd {m} {wgrad_x}", r)
        *_, dg, du = st.swiglu_backward_quantize(da, g, u, values=True)
        ref = (*blockwise.quantize_act(dg), *blockwise.quantize_act(du))
        r = summary(each(st, "_swiglu_bwd_quant_kernel", lambda: st.swiglu_backward_quantize(da, g, u),
                         lambda out: same(out, ref)), 10 * n)
        res[f"swiglu bwd {m}x14336"] = r
        report(f"swiglu bwd {m}", r)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
