# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The blockwise activation cast with the 128x128 tile read from HBM once and held in registers for both copies
(no second, L2-resident read for the 128x1 copy) against the shipped kernel (CHUNK / num_warps autotuned), each
checked bit for bit against :func:`fp8kit.fp8.blockwise.quantize_act`, and a bf16 copy of the same bytes as the floor.
Timing: CUDA graph of 20 launches, median of 7 replays (``graph_timing.timed``).

With ``--ablate`` it also times variants of the one-read kernel that leave one stage out or change it, to place the
time inside the kernel without hardware counters (the device README's method: time variants, take differences):

- ``rows only``: the 1x128 copy alone (no column amax, no 128x1 copy): 3 of the 4 bytes per element;
- ``no transpose``: the 128x1 copy written untransposed (``[Mp, K]``, the same bytes, wrong layout for cuBLAS):
  the cost of the transpose's shuffle through shared memory;
- ``no clamp``: the conversions without ``tl.clamp`` (Triton's float32 -> E4M3 conversion on sm90 saturates,
  ``cvt.rn.satfinite``): checked bit for bit like the shipped kernel, so if its bits match it is a free saving;
- ``bf16 tile``: the tile kept in registers as bf16 and converted at each use (half the registers, more programs
  per SM).

With ``--maxnreg 168 128`` it also times the one-read kernel capped at those registers per thread (session 45: 168
made the 128x1 cast 7-9% faster and the 128x128 one ~30% slower; the shipped autotuner now tries the 168 cap).

    python benchmarks/experiments/act_cast_one_read/bench.py --out /tmp/one_read.json [--ablate] [--maxnreg 168]
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

from graph_timing import timed  # noqa: E402

from fp8kit.fp8 import blockwise  # noqa: E402
from fp8kit.fp8.blockwise import BLOCK, FP8, padded_rows, round_up4  # noqa: E402
from fp8kit.fp8.kernels import blockwise_triton as bt  # noqa: E402
from fp8kit.fp8.scaling import AMAX_EPS, F32_MAX  # noqa: E402


@triton.jit
def _one_read_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    T_2D: tl.constexpr, K_FIRST: tl.constexpr, ROWS_ONLY: tl.constexpr = False, NO_TRANS: tl.constexpr = False,
    NO_CLAMP: tl.constexpr = False, BF16_TILE: tl.constexpr = False,
):
    pid_m, pid_k = bt._tile_ids(K_FIRST)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    offs_m = pid_m * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    rows = offs_m.to(tl.int64)
    xb = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                 eviction_policy="evict_first")
    if BF16_TILE:
        x = xb
    else:
        x = xb.to(tl.float32)
    if NO_CLAMP:
        ax = tl.abs(x.to(tl.float32))
        scale_r = bt._scale_of(tl.max(ax, axis=1), EPS, AMAX_MAX, FP8_MAX)
        tl.store(q_ptr + rows[:, None] * K + cols[None, :], (x.to(tl.float32) * scale_r[:, None]).to(q_ptr.dtype.element_ty))
        tl.store(s_t_ptr + pid_k * MP + rows, tl.div_rn(tl.full((BLOCK_SIZE,), 1.0, tl.float32), scale_r))
        col_amax = tl.max(ax, axis=0)
    else:
        col_amax = bt._quant_rows(x.to(tl.float32), rows, cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX,
                                  bt._max_init(BLOCK_SIZE, BLOCK_SIZE), BLOCK_SIZE, BLOCK_SIZE)
    if not ROWS_ONLY:
        if T_2D:
            scale_c = bt._tile_scale(col_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
            qc = x.to(tl.float32) * scale_c
        else:
            scale_c = bt._col_scale(col_amax, st_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
            qc = x.to(tl.float32) * scale_c[None, :]
        if not NO_CLAMP:
            qc = tl.clamp(qc, -FP8_MAX, FP8_MAX)
        qc = qc.to(qt_ptr.dtype.element_ty)
        if NO_TRANS:
            tl.store(qt_ptr + rows[:, None] * K + cols[None, :], qc)
        else:
            tl.store(qt_ptr + cols[:, None] * MP + rows[None, :], tl.trans(qc))


def one_read(x, wgrad_x, num_warps, maxnreg=None, **ablate):
    t2d = wgrad_x == "128x128"
    m, k = x.shape
    mp = padded_rows(m)
    q = torch.empty(mp, k, dtype=FP8, device=x.device)
    s_t = torch.empty(k // BLOCK, mp, dtype=torch.float32, device=x.device)
    qt = torch.empty(k, mp, dtype=FP8, device=x.device)
    st_ld = round_up4(mp // BLOCK) if t2d else k
    st = torch.empty((k // BLOCK, st_ld) if t2d else (mp // BLOCK, k), dtype=torch.float32, device=x.device)
    _one_read_kernel[(k // BLOCK, mp // BLOCK)](
        x, q, s_t, qt, st, m, mp, k, x.stride(0), st_ld, BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX,
        FP8_MAX=bt._FP8_MAX, T_2D=t2d, K_FIRST=True, num_warps=num_warps,
        **({} if maxnreg is None else {"maxnreg": maxnreg}), **ablate)
    return q, s_t, qt, st


#: the --ablate variants (module docstring), each a set of the kernel's flags, launched at 4 warps
ABLATIONS = {"rows only": {"ROWS_ONLY": True}, "no transpose": {"NO_TRANS": True}, "no clamp": {"NO_CLAMP": True},
             "bf16 tile": {"BF16_TILE": True}}


def bits_off(a, b) -> int:
    v = [t.view(torch.uint8) if t.dtype == FP8 else t for t in (*a, *b)]
    n = len(a)
    return sum(int((x != y).sum()) for x, y in zip(v[:n], v[n:], strict=True))


def real(*shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, generator=g, device="cuda")
    t.view(-1)[torch.randint(0, t.numel(), (t.numel() // 1000,), generator=g, device="cuda")] *= 20.0
    return t.to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ablate", action="store_true", help="also time the variants of the module docstring")
    ap.add_argument("--maxnreg", type=int, nargs="*", default=[],
                    help="also time the 4-warp one-read kernel capped at these registers per thread (ptx .maxnreg; "
                         "Nsight Compute read 223 registers and 2 blocks (12.5%% occupancy) per SM uncapped)")
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    for m, k in ((8192, 4096), (8192, 14336), (16384, 4096)):
        x = real(m, k, seed=k)
        dst = torch.empty_like(x)
        copy_ms = timed(lambda: dst.copy_(x))
        tb = 4 * x.numel() / 1e9
        row = {"copy ms": copy_ms, "copy TB/s": tb / copy_ms}
        for wgrad_x in ("128x1", "128x128"):
            ref = blockwise.quantize_act(x, wgrad_x)
            shipped = timed(lambda: bt.quantize_act(x, wgrad_x))
            row[f"{wgrad_x} shipped"] = {"ms": shipped, "TB/s": tb / shipped, "bits off": bits_off(bt.quantize_act(x, wgrad_x), ref)}
            for w in (4, 8, 16):
                ms = timed(lambda: one_read(x, wgrad_x, w))
                row[f"{wgrad_x} one read w{w}"] = {"ms": ms, "TB/s": tb / ms, "bits off": bits_off(one_read(x, wgrad_x, w), ref)}
            for r in args.maxnreg:
                ms = timed(lambda: one_read(x, wgrad_x, 4, maxnreg=r))
                row[f"{wgrad_x} one read w4 maxnreg {r}"] = {
                    "ms": ms, "TB/s": tb / ms, "bits off": bits_off(one_read(x, wgrad_x, 4, maxnreg=r), ref)}
            for name, flags in (ABLATIONS.items() if args.ablate else ()):
                ms = timed(lambda: one_read(x, wgrad_x, 4, **flags))
                out = one_read(x, wgrad_x, 4, **flags)
                # bits compared where the variant writes what the shipped kernel writes: its row copy always, the
                # column copy unless the variant leaves it out or lays it out differently
                n = 2 if flags.get("ROWS_ONLY") or flags.get("NO_TRANS") else 4
                row[f"{wgrad_x} {name}"] = {"ms": ms, "TB/s": tb / ms, "bits off": bits_off(out[:n], ref[:n])}
        res[f"{m}x{k}"] = row
        print(f"{m}x{k}: copy {row['copy TB/s']:.2f} TB/s; " + "; ".join(
            f"{n} {v['ms']:.4f} ms {v['TB/s']:.2f} TB/s off {v['bits off']}" for n, v in row.items() if isinstance(v, dict)),
            flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
