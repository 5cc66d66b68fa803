# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The blockwise activation cast with the 128x128 tile read from HBM once and held in registers for both copies
(no second, L2-resident read for the 128x1 copy) against the shipped kernel (CHUNK / num_warps autotuned), each
checked bit for bit against :func:`fp8kit.fp8.blockwise.quantize_act`, and a bf16 copy of the same bytes as the floor.
Timing: CUDA graph of 20 launches, median of 7 replays (``graph_timing.timed``).

    python benchmarks/experiments/act_cast_one_read/bench.py --out /tmp/one_read.json
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
    T_2D: tl.constexpr, K_FIRST: tl.constexpr,
):
    pid_m, pid_k = bt._tile_ids(K_FIRST)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    offs_m = pid_m * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    rows = offs_m.to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    col_amax = bt._quant_rows(x, rows, cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX,
                              bt._max_init(BLOCK_SIZE, BLOCK_SIZE), BLOCK_SIZE, BLOCK_SIZE)
    if T_2D:
        scale_c = bt._tile_scale(col_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
        qc = tl.clamp(x * scale_c, -FP8_MAX, FP8_MAX).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + cols[:, None] * MP + rows[None, :], tl.trans(qc))
    else:
        scale_c = bt._col_scale(col_amax, st_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
        bt._quant_cols(x, rows, cols, scale_c, qt_ptr, MP, FP8_MAX)


def one_read(x, wgrad_x, num_warps):
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
        FP8_MAX=bt._FP8_MAX, T_2D=t2d, K_FIRST=True, num_warps=num_warps)
    return q, s_t, qt, st


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
        res[f"{m}x{k}"] = row
        print(f"{m}x{k}: copy {row['copy TB/s']:.2f} TB/s; " + "; ".join(
            f"{n} {v['ms']:.4f} ms {v['TB/s']:.2f} TB/s off {v['bits off']}" for n, v in row.items() if isinstance(v, dict)),
            flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
