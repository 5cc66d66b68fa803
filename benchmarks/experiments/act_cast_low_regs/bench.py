# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""Blockwise activation casts that hold fewer registers than the one-read kernel, timed against the shipped cast.

Session 45 (Nsight Compute): the one-read cast holds the 128x128 tile as float32 in 128 threads, 223 registers per
thread, 2 programs per SM, 41% of DRAM bandwidth. Session 47 tried these walks of a tile, each checked bit for bit
against :func:`fp8kit.fp8.blockwise.quantize_act` (``same bits``):

- ``rows first`` (``_rows_first_kernel``, shipped for the 128x128 copy as ``blockwise_triton._rows_first_tile``):
  pass 1 reads the whole tile as bf16 for the row amax (and the tile amax) only; pass 2 re-reads ``CS``-column slices
  (L2) and writes both copies; a 128x1 copy reduces each slice's columns.
- ``cols first`` (``_cols_first_kernel``): pass 1 walks ``RS``-row slices for the column amax only; pass 2 walks
  them again for the row amax and both copies.
- ``both first`` (``_both_first_kernel``): pass 1 takes both amaxes of the whole bf16 tile; pass 2 casts column
  slices with known scales (``_piece`` cuts the 128x1 scales). Timing-only ablations (``ABLATIONS``; wrong bits by
  design) drop the column reduction or the per-column multiply, to place the time.
- ``trans`` / ``trans one read`` (``_trans_kernel``): the 128x1 copy computed on ``tl.trans`` of the bf16 tile.
- ``gluon`` / ``gluon reload`` (``gluon_cast.py``): the cast in Gluon with stated layouts (the shipped 128x1 cast,
  ``fp8kit.fp8.kernels.blockwise_gluon``, is ``gluon reload`` at 8 warps: the same PTX).

``shipped`` is ``blockwise_triton.quantize_act`` as the checkout has it (autotuned Triton; Gluon for 128x1 bf16 once
session 47 shipped it). The max of |x| is exact in bf16, so amaxes taken in bf16 equal the float32 ones. Timing:
CUDA graph of 20 launches, median of 7 replays (``graph_timing.timed``), on random normal data with 0.1% of
elements x20. Registers per thread and spills come from the compiled kernel.

    python benchmarks/experiments/act_cast_low_regs/bench.py --out /tmp/low_regs.json \
        [--kinds "rows first,gluon reload"] [--widths 64,128] [--warps 4,8,16] [--caps none,128]
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.fp8 import blockwise  # noqa: E402
from fp8kit.fp8.blockwise import BLOCK, FP8, padded_rows, round_up4  # noqa: E402
from fp8kit.fp8.kernels import blockwise_triton as bt  # noqa: E402
from fp8kit.fp8.scaling import AMAX_EPS, F32_MAX  # noqa: E402


@triton.jit
def _rows_first_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    T_2D: tl.constexpr, CS: tl.constexpr,
):
    # the walk as shipped (blockwise_triton._rows_first_tile; session 47 timed this code before it moved there)
    pid_m, pid_k = bt._tile_ids(True)
    bt._rows_first_tile(x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, pid_m, pid_k, M, MP, K, stride_xm, ST_LD, BLOCK_SIZE,
                        EPS, AMAX_MAX, FP8_MAX, CS, True, T_2D)


@triton.jit
def _piece(v, i: tl.constexpr, N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # v[i * 128 / N : (i + 1) * 128 / N] of a [128] register vector (N = 1, 2 or 4): Triton can't index registers,
    # so the vector is split in halves (reshape to [2, n], transpose, tl.split) once or twice
    if N == 1:
        return v
    else:
        a, b = tl.split(tl.trans(tl.reshape(v, (2, BLOCK_SIZE // 2))))
        if N == 2:
            return b if i == 1 else a
        else:
            h = b if i >= 2 else a
            c, d = tl.split(tl.trans(tl.reshape(h, (2, BLOCK_SIZE // 4))))
            return d if i % 2 == 1 else c


@triton.jit
def _both_first_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    T_2D: tl.constexpr, CS: tl.constexpr, ABLATE: tl.constexpr = 0, F32_AMAX: tl.constexpr = False,
):
    # ABLATE (timing only, wrong bits; 128x1): 1 = the column amax and its stores as usual but pass 2 scaled by the
    # tile's scalar (the cost of the per-column multiply); 2 = no column reduction, pass 2 scaled per column by the
    # row scales' values (the cost of the column reduction)
    # pass 1: the whole tile as bf16 -> row amax and column amax (both reductions once); pass 2: CS-column slices
    # (L2) cast with scales already known: no reduction in pass 2 (the 128x1 scales cut into slices by _piece)
    pid_m, pid_k = bt._tile_ids(True)
    offs_m = pid_m * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    rows = offs_m.to(tl.int64)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                eviction_policy="evict_last")
    if F32_AMAX:
        ax = tl.abs(x.to(tl.float32))
    else:
        ax = tl.abs(x)
    row_amax = tl.max(ax, axis=1).to(tl.float32)
    scale_r = bt._scale_of(row_amax, EPS, AMAX_MAX, FP8_MAX)
    tl.store(s_t_ptr + pid_k * MP + rows, tl.div_rn(tl.full((BLOCK_SIZE,), 1.0, tl.float32), scale_r))
    if T_2D:
        scale_c = bt._tile_scale(row_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    elif ABLATE == 2:
        scale_c = scale_r
    else:
        scale_c = bt._col_scale(tl.max(ax, axis=0).to(tl.float32), st_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX,
                                BLOCK_SIZE)
    if ABLATE == 1:
        scale_c = bt._scale_of(tl.max(row_amax, axis=0), EPS, AMAX_MAX, FP8_MAX)
    for i in tl.static_range(0, BLOCK_SIZE // CS):
        ccols = (pid_k * BLOCK_SIZE + i * CS + tl.arange(0, CS)).to(tl.int64)
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + ccols[None, :], mask=offs_m[:, None] < M, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        q = tl.clamp(xs * scale_r[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * K + ccols[None, :], q)
        if T_2D or ABLATE == 1:
            qc = tl.clamp(xs * scale_c, -FP8_MAX, FP8_MAX)
        else:
            qc = tl.clamp(xs * _piece(scale_c, i, BLOCK_SIZE // CS, BLOCK_SIZE)[None, :], -FP8_MAX, FP8_MAX)
        tl.store(qt_ptr + ccols[:, None] * MP + rows[None, :], tl.trans(qc.to(qt_ptr.dtype.element_ty)))


@triton.jit
def _trans_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    T_2D: tl.constexpr, CS: tl.constexpr, ONE_READ: tl.constexpr = False,
):
    # The x^T copy computed on tl.trans of the bf16 tile: Triton then converts the bf16 tile (ldmatrix / stmatrix on
    # sm90) instead of the E4M3 result (byte-wise shared-memory traffic), and the 128x1 column amax is a reduction
    # along the transposed tile's contiguous axis (in-thread and lanes, no cross-warp step). ONE_READ: the tile is
    # read once and serves both copies (CS must be 128); else pass 1 reads it for the row amax and pass 2 re-reads
    # CS-column slices (L2).
    pid_m, pid_k = bt._tile_ids(True)
    offs_m = pid_m * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    rows = offs_m.to(tl.int64)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                eviction_policy="evict_last")
    row_amax = tl.max(tl.abs(x), axis=1).to(tl.float32)
    scale_r = bt._scale_of(row_amax, EPS, AMAX_MAX, FP8_MAX)
    tl.store(s_t_ptr + pid_k * MP + rows, tl.div_rn(tl.full((BLOCK_SIZE,), 1.0, tl.float32), scale_r))
    scale_t = 0.0
    if T_2D:
        scale_t = bt._tile_scale(row_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CS):
        ccols = (pid_k * BLOCK_SIZE + c + tl.arange(0, CS)).to(tl.int64)
        if ONE_READ:
            xs = x
        else:
            xs = tl.load(x_ptr + rows[:, None] * stride_xm + ccols[None, :], mask=offs_m[:, None] < M, other=0.0,
                         eviction_policy="evict_first")
        q = tl.clamp(xs.to(tl.float32) * scale_r[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * K + ccols[None, :], q)
        xt = tl.trans(xs)
        if T_2D:
            qt = tl.clamp(xt.to(tl.float32) * scale_t, -FP8_MAX, FP8_MAX)
        else:
            sc = bt._scale_of(tl.max(tl.abs(xt), axis=1).to(tl.float32), EPS, AMAX_MAX, FP8_MAX)
            tl.store(st_ptr + pid_m * K + ccols, tl.div_rn(tl.full((CS,), 1.0, tl.float32), sc))
            qt = tl.clamp(xt.to(tl.float32) * sc[:, None], -FP8_MAX, FP8_MAX)
        tl.store(qt_ptr + ccols[:, None] * MP + rows[None, :], qt.to(qt_ptr.dtype.element_ty))


@triton.jit
def _cols_first_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    T_2D: tl.constexpr, RS: tl.constexpr,
):
    pid_m, pid_k = bt._tile_ids(True)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    run = tl.zeros((RS, BLOCK_SIZE), tl.bfloat16)
    for c in tl.static_range(0, BLOCK_SIZE, RS):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, RS)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M,
                    other=0.0, eviction_policy="evict_last")
        run = tl.maximum(run, tl.abs(x))
    col_amax = tl.max(run, axis=0).to(tl.float32)
    scale_c = bt._t_scale(col_amax, st_ptr, pid_m, pid_k, cols, MP, K, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE, T_2D)
    for c in tl.static_range(0, BLOCK_SIZE, RS):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, RS)
        rows = offs_m.to(tl.int64)
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        bt._quant_rows(xs, rows, cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX,
                       bt._max_init(RS, BLOCK_SIZE), RS, BLOCK_SIZE)
        bt._quant_cols_or_tile(xs, rows, cols, scale_c, qt_ptr, MP, FP8_MAX, T_2D)


KERNELS = {"rows first": (_rows_first_kernel, "CS"), "cols first": (_cols_first_kernel, "RS"),
           "both first": (_both_first_kernel, "CS"), "trans": (_trans_kernel, "CS"),
           "trans one read": (_trans_kernel, "CS")}
#: timing-only ablations of "both first" (its ABLATE flag; their bits are wrong by design)
ABLATIONS = {"both first abl1 scalar": 1, "both first abl2 no col reduce": 2}


def outputs(x, t2d):
    """Empty ``(q, s_t, qt, st)`` of :func:`fp8kit.fp8.blockwise.quantize_act` for ``x``, and ``st``'s row length."""
    m, k = x.shape
    mp = padded_rows(m)
    st_ld = round_up4(mp // BLOCK) if t2d else k
    return (torch.empty(mp, k, dtype=FP8, device=x.device),
            torch.empty(k // BLOCK, mp, dtype=torch.float32, device=x.device),
            torch.empty(k, mp, dtype=FP8, device=x.device),
            torch.empty((k // BLOCK, st_ld) if t2d else (mp // BLOCK, k), dtype=torch.float32, device=x.device),
            st_ld)


def launch(kind, x, wgrad_x, width, num_warps, maxnreg=None):
    """Run one variant; returns ((q, s_t, qt, st), compiled kernel)."""
    if kind in ("gluon", "gluon reload"):
        return launch_gluon(x, wgrad_x, num_warps, kind == "gluon reload")
    extra = {} if maxnreg is None else {"maxnreg": maxnreg}
    if kind == "trans one read":
        extra["ONE_READ"] = True
        width = BLOCK
    if kind == "both first f32 amax":
        kind = "both first"
        extra["F32_AMAX"] = True
    if kind in ABLATIONS:
        kernel, arg = KERNELS["both first"]
        extra["ABLATE"] = ABLATIONS[kind]
    else:
        kernel, arg = KERNELS[kind]
    t2d = wgrad_x == "128x128"
    m, k = x.shape
    mp = padded_rows(m)
    q, s_t, qt, st, st_ld = outputs(x, t2d)
    compiled = kernel[(k // BLOCK, mp // BLOCK)](
        x, q, s_t, qt, st, m, mp, k, x.stride(0), st_ld, BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX,
        FP8_MAX=bt._FP8_MAX, T_2D=t2d, num_warps=num_warps, **{arg: width}, **extra)
    return (q, s_t, qt, st), compiled


def launch_gluon(x, wgrad_x, num_warps, reload=False):
    """The Gluon cast of ``gluon_cast.py`` (one 128x128 tile per program, the grid K first)."""
    from gluon_cast import gluon_act_quant_kernel

    t2d = wgrad_x == "128x128"
    m, k = x.shape
    mp = padded_rows(m)
    q, s_t, qt, st, st_ld = outputs(x, t2d)
    compiled = gluon_act_quant_kernel[(k // BLOCK, mp // BLOCK)](
        x, q, s_t, qt, st, m, mp, k, x.stride(0), st_ld, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=bt._FP8_MAX,
        T_2D=t2d, W=num_warps, RELOAD=reload, num_warps=num_warps)
    return (q, s_t, qt, st), compiled


def real(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, generator=g, device="cuda")
    t.view(-1)[torch.randint(0, t.numel(), (t.numel() // 1000,), generator=g, device="cuda")] *= 20.0
    return t.to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="8192x4096,8192x14336,16384x4096")
    ap.add_argument("--kinds", default=",".join(KERNELS), help="comma-separated variants (KERNELS)")
    ap.add_argument("--widths", default="16,32,64", help="slice widths (CS or RS)")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--caps", default="none,128", help="register caps per thread (ptx .maxnreg); none = uncapped")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for shape in args.shapes.split(","):
        m, k = map(int, shape.split("x"))
        x = real(m, k, seed=k)
        dst = torch.empty_like(x)
        copy_ms = timed(lambda: dst.copy_(x))
        tb = 4 * x.numel() / 1e9
        row = {"copy ms": copy_ms, "copy TB/s": tb / copy_ms}
        for wgrad_x in ("128x1", "128x128"):
            ref = blockwise.quantize_act(x, wgrad_x)
            ms = timed(lambda: bt.quantize_act(x, wgrad_x))
            row[f"{wgrad_x} shipped"] = {"ms": ms, "of copy": copy_ms / ms,
                                         "same bits": same_bits(bt.quantize_act(x, wgrad_x), ref)}
            for kind in args.kinds.split(","):
                for width in map(int, args.widths.split(",")):
                    for w in map(int, args.warps.split(",")):
                        for cap in (None if c == "none" else int(c) for c in args.caps.split(",")):
                            try:
                                out, ck = launch(kind, x, wgrad_x, width, w, cap)
                                ms = timed(lambda: launch(kind, x, wgrad_x, width, w, cap))
                            except Exception as e:  # a config Triton can't compile: recorded, the others go on
                                row[f"{wgrad_x} {kind} {width} w{w} cap{cap}"] = {"error": repr(e)[:300]}
                                continue
                            row[f"{wgrad_x} {kind} {width} w{w} cap{cap}"] = {
                                "ms": ms, "of copy": copy_ms / ms, "same bits": same_bits(out, ref),
                                "regs": ck.n_regs, "spills": ck.n_spills}
        res[shape] = row
        best = sorted(((v["ms"], n) for n, v in row.items() if isinstance(v, dict) and "ms" in v))
        print(f"{shape}: copy {copy_ms * 1e3:.1f} us; " + "; ".join(
            f"{n} {row[n]['ms'] * 1e3:.1f} us {row[n]['of copy']:.2f} bits {row[n]['same bits']} regs {row[n].get('regs')}"
            for _, n in best), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
