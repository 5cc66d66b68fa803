# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""Where the blockwise activation cast's time goes: the kernel of ``fp8kit.fp8.kernels.blockwise_triton`` with
parts switched off or changed, each timed alone (CUDA graph replay, median), at 8192 x {4096, 14336} bf16.

- ``ADDR32``: int64 base pointer per tile, int32 offsets inside it (the committed kernel computes int64 addresses).
- ``PASS2 = 0``: no 128x1 copy (fprop copy alone: 3 bytes per element).
- ``TRANS = 0``: the 128x1 copy stored untransposed (wrong layout; measures the transpose).
- ``COLSCALE = 0``: pass 2 multiplies by one scale per tile (the ``128x128`` layout's arithmetic).

The variants that write the real layout are checked bit for bit against ``fp8kit.fp8.blockwise.quantize_act``.

    python benchmarks/experiments/persistent_casts/ablate.py --out /tmp/ablate.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import real, same, timed  # noqa: E402

from fp8kit.fp8 import blockwise  # noqa: E402
from fp8kit.fp8.blockwise import BLOCK, empty_act_outputs  # noqa: E402
from fp8kit.fp8.kernels.blockwise_triton import _FP8_MAX, _scale_of  # noqa: E402
from fp8kit.fp8.scaling import AMAX_EPS, F32_MAX  # noqa: E402


@triton.jit
def _kernel(x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm,
            BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
            CHUNK: tl.constexpr, ADDR32: tl.constexpr, PASS2: tl.constexpr, TRANS: tl.constexpr,
            COLSCALE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ADDR32:
        xb = x_ptr + (pid_m * BLOCK_SIZE).to(tl.int64) * stride_xm + pid_k * BLOCK_SIZE
        qb = q_ptr + (pid_m * BLOCK_SIZE).to(tl.int64) * K + pid_k * BLOCK_SIZE
        qtb = qt_ptr + (pid_k * BLOCK_SIZE).to(tl.int64) * MP + pid_m * BLOCK_SIZE
        cols = tl.arange(0, BLOCK_SIZE)
    else:
        xb, qb, qtb = x_ptr, q_ptr, qt_ptr
        cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    gcols = pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    col_amax = tl.zeros((BLOCK_SIZE,), tl.float32)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        if ADDR32:
            rows = c + tl.arange(0, CHUNK)
        else:
            rows = offs_m.to(tl.int64)
        x = tl.load(xb + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        ax = tl.abs(x)
        if PASS2:
            col_amax = tl.maximum(col_amax, tl.max(ax, axis=0))
        scale_r = _scale_of(tl.max(ax, axis=1), EPS, AMAX_MAX, FP8_MAX)
        q = tl.clamp(x * scale_r[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
        tl.store(qb + rows[:, None] * K + cols[None, :], q)
        tl.store(s_t_ptr + pid_k * MP + offs_m, tl.div_rn(tl.full((CHUNK,), 1.0, tl.float32), scale_r))
    if PASS2:
        if COLSCALE:
            scale_c = _scale_of(col_amax, EPS, AMAX_MAX, FP8_MAX)
            tl.store(st_ptr + pid_m * K + gcols, tl.div_rn(tl.full((BLOCK_SIZE,), 1.0, tl.float32), scale_c))
        else:
            scale_c = _scale_of(tl.max(col_amax, axis=0), EPS, AMAX_MAX, FP8_MAX)
        for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
            offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
            if ADDR32:
                rows = c + tl.arange(0, CHUNK)
            else:
                rows = offs_m.to(tl.int64)
            x = tl.load(xb + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            if COLSCALE:
                qc = tl.clamp(x * scale_c[None, :], -FP8_MAX, FP8_MAX).to(qt_ptr.dtype.element_ty)
            else:
                qc = tl.clamp(x * scale_c, -FP8_MAX, FP8_MAX).to(qt_ptr.dtype.element_ty)
            if TRANS:
                tl.store(qtb + cols[:, None] * MP + rows[None, :], tl.trans(qc))
            else:
                tl.store(qtb + rows[:, None] * K + cols[None, :], qc)


def launch(x, chunk, warps, **flags):
    m, k = x.shape
    q, s_t, qt, st = empty_act_outputs(x, m, k)
    mp = q.shape[0]
    _kernel[(mp // BLOCK, k // BLOCK)](x, q, s_t, qt, st, m, mp, k, x.stride(0), BLOCK_SIZE=BLOCK, EPS=AMAX_EPS,
                                       AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX, CHUNK=chunk, num_warps=warps, **flags)
    return q, s_t, qt, st


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    for k in (4096, 14336):
        x = real(8192, k, seed=k)
        ref = blockwise.quantize_act(x)
        dst = torch.empty_like(x)
        print(f"copy 8192x{k}: {4 * x.numel() / timed(lambda: dst.copy_(x)) / 1e9:.2f} TB/s", flush=True)
        for addr32, (pass2, trans, colscale) in itertools.product((0, 1), ((1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0))):
            for chunk, warps in ((32, 4), (64, 8), (128, 4), (128, 8)):
                flags = dict(ADDR32=addr32, PASS2=pass2, TRANS=trans, COLSCALE=colscale)
                out = launch(x, chunk, warps, **flags)
                bad = same(out, ref) if (pass2, trans, colscale) == (1, 1, 1) else None
                ms = timed(lambda: launch(x, chunk, warps, **flags))
                nbytes = (4 if pass2 else 3) * x.numel()
                row = {"k": k, **flags, "CHUNK": chunk, "num_warps": warps, "ms": ms, "TB/s": nbytes / ms / 1e9,
                       "bits_off": bad}
                res["rows"].append(row)
                print(row, flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
