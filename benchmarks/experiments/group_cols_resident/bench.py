# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The per-(expert, column) wgrad casts (``quantize_group_cols_dual``) with the whole column strip of an expert held in
registers: one HBM read instead of two.

The committed kernel walks an expert's rows for a 64-column strip twice: the column amax, then the cast (session 20:
2.8 TB/s counting both reads, i.e. the second read comes from HBM). When the expert's rows fit a register tile
(``RA + RB`` rows: a ``RA``-row tile and an optional ``RB``-row tail tile, both powers of two), this variant loads the
strip once, in its own dtype, takes the amax, casts and stores it; an expert with more rows takes the two-pass path
(``RA``-row slices). Checked bit for bit against the committed kernel; CUDA-graph timing.

    python benchmarks/experiments/group_cols_resident/bench.py --out /tmp/resident.json [--configs 'RA,RB,BC,warps;...']
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import same_bits as same  # noqa: E402
from graph_timing import timed  # noqa: E402
from group_cols.bench import MODELS, dual_args, operands  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as rq  # noqa: E402


@triton.jit
def _rows_native(x_ptr, idx_ptr, offs_p, end, cols, cmask, T, stride_x, GATHER: tl.constexpr):
    # rq._group_rows without the float32 conversion: the tile stays in its own dtype (half the registers for bf16).
    pmask = offs_p < end
    if GATHER:
        src_row = tl.load(idx_ptr + offs_p, mask=pmask, other=0).to(tl.int64)
        pmask = pmask & (src_row < T)
    else:
        src_row = offs_p.to(tl.int64)
    return tl.load(x_ptr + src_row[:, None] * stride_x + cols[None, :], mask=pmask[:, None] & cmask[None, :],
                   other=0.0)


@triton.jit
def _store_cast(data_ptr, x, scale, offs_p, end, cols, cmask, P, FP8_MAX: tl.constexpr):
    q = tl.trans(rq._cast(x.to(tl.float32), scale[None, :], FP8_MAX))
    tl.store(data_ptr + cols[:, None] * P + offs_p[None, :], q, mask=cmask[:, None] & (offs_p < end)[None, :])


@triton.jit
def _resident_block(
    x_ptr, idx_ptr, offs_ptr, data_ptr, inv_ptr, pid_g, pid_c, T, P, C, E, stride_x,
    GATHER: tl.constexpr, RA: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    start = tl.minimum(tl.load(offs_ptr + pid_g - 1, mask=pid_g > 0, other=0), P)
    end = tl.minimum(tl.load(offs_ptr + pid_g, mask=pid_g < E, other=P), P)
    if end - start <= RA + RB:
        cols = (pid_c * BC + tl.arange(0, BC)).to(tl.int64)
        cmask = cols < C
        pa = start + tl.arange(0, RA)
        xa = _rows_native(x_ptr, idx_ptr, pa, end, cols, cmask, T, stride_x, GATHER)
        amax = tl.max(tl.abs(xa), axis=0).to(tl.float32)
        if RB > 0:
            pb = start + RA + tl.arange(0, RB)
            xb = _rows_native(x_ptr, idx_ptr, pb, end, cols, cmask, T, stride_x, GATHER)
            amax = tl.maximum(amax, tl.max(tl.abs(xb), axis=0).to(tl.float32))
        scale = rq._pow2_scale(amax, EPS, AMAX_MAX, FP8_MAX)
        tl.store(inv_ptr + pid_g * C + cols, rq._inv(scale), mask=cmask & (pid_g < E))
        _store_cast(data_ptr, xa, scale, pa, end, cols, cmask, P, FP8_MAX)
        if RB > 0:
            _store_cast(data_ptr, xb, scale, pb, end, cols, cmask, P, FP8_MAX)
    else:
        rq._group_cols_block(x_ptr, idx_ptr, x_ptr, offs_ptr, data_ptr, inv_ptr, pid_g, pid_c, T, P, C, E, stride_x,
                             GATHER, False, RA, BC, EPS, AMAX_MAX, FP8_MAX)


@triton.jit
def _resident_dual_kernel(
    g_ptr, g_data_ptr, g_inv_ptr, N, stride_g,
    x_ptr, idx_ptr, x_data_ptr, x_inv_ptr, K, stride_x, T,
    offs_ptr, P, E, NB_G,
    GATHER: tl.constexpr, RA: tl.constexpr, RB: tl.constexpr, BC: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    pid_g = tl.program_id(0)
    pid_c = tl.program_id(1)
    if pid_c < NB_G:
        _resident_block(g_ptr, idx_ptr, offs_ptr, g_data_ptr, g_inv_ptr, pid_g, pid_c, T, P, N, E, stride_g,
                        False, RA, RB, BC, EPS, AMAX_MAX, FP8_MAX)
    else:
        _resident_block(x_ptr, idx_ptr, offs_ptr, x_data_ptr, x_inv_ptr, pid_g, pid_c - NB_G, T, P, K, E, stride_x,
                        GATHER, RA, RB, BC, EPS, AMAX_MAX, FP8_MAX)


def launch(g, x, offs, index_x, ra, rb, bc, warps):
    out, args, nb_g, nb_x = dual_args(g, x, offs, index_x, bc)
    _resident_dual_kernel[(offs.shape[0] + 1, nb_g + nb_x)](*args, GATHER=index_x is not None, RA=ra, RB=rb, BC=bc,
                                                            num_warps=warps, **rq._KW)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default="", help="'RA,RB,BC,warps;...' instead of the default sweep")
    args = ap.parse_args()
    configs = [(1024, 512, 32, 16), (1024, 512, 32, 8), (1024, 256, 32, 16), (1024, 512, 64, 16),
               (1024, 1024, 32, 16), (1024, 512, 16, 8), (1024, 512, 16, 4), (2048, 0, 16, 16), (1024, 256, 64, 16)]
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "configs": "RA, RB, BC, num_warps", "rows": []}
    for name in args.models.split(","):
        p, ops, offs = operands(name)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        for label, g, x, idx in ops:
            ref = rq.quantize_group_cols_dual(g, x, offs, idx)
            elems = p * (g.shape[1] + x.shape[1])
            base = timed(lambda: rq.quantize_group_cols_dual(g, x, offs, idx), reps=10)
            row = {"model": name, "gemm": label, "P": p, "N": g.shape[1], "K": x.shape[1],
                   "rows_per_expert_max": int(counts.max()), "committed_ms": round(base, 4), "results": []}
            print(name, label, "committed", round(base, 4), "max rows", int(counts.max()), flush=True)
            for cfg in configs:
                try:
                    out = launch(g, x, offs, idx, *cfg)
                    ok = same(out, ref)
                    ms = timed(lambda: launch(g, x, offs, idx, *cfg), reps=10)
                    r = {"cfg": list(cfg), "ms": round(ms, 4), "vs_committed": round(base / ms, 3),
                         "tb_s_one_read": round(elems * 3 / ms / 1e9, 3), "bit_equal": ok}
                except Exception as exc:  # noqa: BLE001 - record and go on
                    r = {"cfg": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                row["results"].append(r)
                print(name, label, r, flush=True)
            rec["rows"].append(row)
            Path(args.out).write_text(json.dumps(rec, indent=1))
        del ops
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
