# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""Where the hinted expert-weight cast's time goes: each kernel of ``moe.rowwise_weights_triton`` and of the two-kernel
cast timed alone (outputs preallocated), and the one-pass kernel with parts switched off (a copy of it with
``constexpr`` switches, ``--switches``: no partial amaxes, no dgrad copy, no fprop copy), and three ways to write the
one-pass kernel (``_modes``: amaxes in float32 as committed, in the weights' dtype, or on a tile transposed once in
its own dtype), each checked bit for bit against the first. CUDA-graph timing.

    python benchmarks/experiments/hinted_weight_cast/ablate.py --out /tmp/ablate.json [--switches]
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

from fp8kit.moe import rowwise_quant_triton as rqt  # noqa: E402
from fp8kit.moe import rowwise_weights_triton as rwt  # noqa: E402
from fp8kit.moe.rowwise_quant_triton import _KW, FP8, _cast, _inv  # noqa: E402

SHAPES = {"qwen3 gate_up": (128, 1536, 2048), "dsv3 down": (64, 7168, 2048)}


@triton.jit
def _switched(w_ptr, row_hint_ptr, col_hint_ptr, row_part_ptr, col_part_ptr, fprop_ptr, dgrad_ptr, N, K, stride_e,
              stride_n, BN: tl.constexpr, BK: tl.constexpr, FP8_MAX: tl.constexpr, PART: tl.constexpr,
              FPROP: tl.constexpr, DGRAD: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    pid_n, pid_k = tl.program_id(1), tl.program_id(2)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    nmask = offs_n < N
    kmask = offs_k < K
    mask = nmask[:, None] & kmask[None, :]
    w = tl.load(w_ptr + e * stride_e + offs_n[:, None] * stride_n + offs_k[None, :], mask=mask, other=0.0
                ).to(tl.float32)
    if PART:
        a = tl.abs(w)
        tl.store(row_part_ptr + (e * tl.num_programs(2) + pid_k) * N + offs_n, tl.max(a, axis=1), mask=nmask)
        tl.store(col_part_ptr + (e * tl.num_programs(1) + pid_n) * K + offs_k, tl.max(a, axis=0), mask=kmask)
    out = e * N * K
    if FPROP:
        row_scale = _inv(tl.load(row_hint_ptr + e * N + offs_n, mask=nmask, other=1.0))
        tl.store(fprop_ptr + out + offs_n[:, None] * K + offs_k[None, :], _cast(w, row_scale[:, None], FP8_MAX),
                 mask=mask)
    if DGRAD:
        col_scale = _inv(tl.load(col_hint_ptr + e * K + offs_k, mask=kmask, other=1.0))
        dq = tl.trans(_cast(w, col_scale[None, :], FP8_MAX))
        tl.store(dgrad_ptr + out + offs_k[:, None] * N + offs_n[None, :], dq, mask=kmask[:, None] & nmask[None, :])


@triton.jit
def _modes(w_ptr, row_hint_ptr, col_hint_ptr, row_part_ptr, col_part_ptr, fprop_ptr, dgrad_ptr, N, K, stride_e,
           stride_n, BN: tl.constexpr, BK: tl.constexpr, FP8_MAX: tl.constexpr, MODE: tl.constexpr):
    # MODE 0: the committed kernel's math; 1: the amaxes reduced in the weights' own dtype (abs and max are exact);
    # 2: the tile transposed once in its own dtype, the dgrad cast and the column amax taken on the transposed tile
    e = tl.program_id(0).to(tl.int64)
    pid_n, pid_k = tl.program_id(1), tl.program_id(2)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    nmask = offs_n < N
    kmask = offs_k < K
    mask = nmask[:, None] & kmask[None, :]
    wn = tl.load(w_ptr + e * stride_e + offs_n[:, None] * stride_n + offs_k[None, :], mask=mask, other=0.0)
    w = wn.to(tl.float32)
    row_scale = _inv(tl.load(row_hint_ptr + e * N + offs_n, mask=nmask, other=1.0))
    col_scale = _inv(tl.load(col_hint_ptr + e * K + offs_k, mask=kmask, other=1.0))
    out = e * N * K
    tl.store(fprop_ptr + out + offs_n[:, None] * K + offs_k[None, :], _cast(w, row_scale[:, None], FP8_MAX), mask=mask)
    if MODE == 2:
        wt = tl.trans(wn)  # (BK, BN)
        at = tl.abs(wt)
        tl.store(row_part_ptr + (e * tl.num_programs(2) + pid_k) * N + offs_n, tl.max(tl.abs(wn), axis=1).to(tl.float32),
                 mask=nmask)
        tl.store(col_part_ptr + (e * tl.num_programs(1) + pid_n) * K + offs_k, tl.max(at, axis=1).to(tl.float32),
                 mask=kmask)
        dq = _cast(wt.to(tl.float32), col_scale[:, None], FP8_MAX)
    else:
        a = tl.abs(wn) if MODE == 1 else tl.abs(w)
        tl.store(row_part_ptr + (e * tl.num_programs(2) + pid_k) * N + offs_n, tl.max(a, axis=1).to(tl.float32),
                 mask=nmask)
        tl.store(col_part_ptr + (e * tl.num_programs(1) + pid_n) * K + offs_k, tl.max(a, axis=0).to(tl.float32),
                 mask=kmask)
        dq = tl.trans(_cast(w, col_scale[None, :], FP8_MAX))
    tl.store(dgrad_ptr + out + offs_k[:, None] * N + offs_n[None, :], dq, mask=kmask[:, None] & nmask[None, :])


def modes(w, rows, cols) -> dict:
    """Each MODE of ``_modes`` at a few tiles: device ms, and whether its outputs equal MODE 0's bit for bit."""
    e, n, k = w.shape
    res, ref = {}, None
    for bn, bk, warps in ((64, 128, 4), (32, 128, 4), (64, 64, 4), (128, 64, 4), (64, 128, 8)):
        for mode in (0, 1, 2):
            nbn, nbk = triton.cdiv(n, bn), triton.cdiv(k, bk)
            outs = (torch.empty(e, n, k, dtype=FP8, device="cuda"), torch.empty(e, k, n, dtype=FP8, device="cuda"),
                    torch.empty(e, nbk, n, device="cuda"), torch.empty(e, nbn, k, device="cuda"))

            def run():
                _modes[(e, nbn, nbk)](w, rows, cols, outs[2], outs[3], outs[0], outs[1], n, k, w.stride(0),
                                      w.stride(1), BN=bn, BK=bk, num_warps=warps, FP8_MAX=_KW["FP8_MAX"], MODE=mode)
            run()
            got = (outs[0].view(torch.uint8), outs[1].view(torch.uint8), outs[2].amax(1), outs[3].amax(1))
            if ref is None:
                ref = got
            same = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
            res[f"mode {mode} tile {bn},{bk},{warps}"] = {"ms": timed(run), "same_bits": same}
    return res


def measure(name: str, shape, switches: bool) -> dict:
    e, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(*shape, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    _, rows, _, cols = rqt.quantize_experts_dual(w)
    bn, bk, warps = rwt._BN, rwt._BK, rwt._WARPS
    nbn, nbk = triton.cdiv(n, bn), triton.cdiv(k, bk)
    fprop, dgrad = torch.empty(e, n, k, dtype=FP8, device="cuda"), torch.empty(e, k, n, dtype=FP8, device="cuda")
    row_part = torch.empty(e, nbk, n, device="cuda")
    col_part = torch.empty(e, nbn, k, device="cuda")
    fprop_inv, dgrad_inv = torch.empty(e, n, device="cuda"), torch.empty(e, k, device="cuda")
    row_amax, col_amax = torch.empty(e, n, device="cuda"), torch.zeros(e, k, device="cuda")
    fixed = torch.zeros(2, dtype=torch.int32, device="cuda")
    r = {"shape": shape}

    def a_kernel():
        rwt._experts_hinted_cast_kernel[(e, nbn, nbk)](w, rows, cols, row_part, col_part, fprop, dgrad, n, k,
                                                       w.stride(0), w.stride(1), BN=bn, BK=bk, num_warps=warps,
                                                       FP8_MAX=_KW["FP8_MAX"])

    def fix_kernel():
        rows_p = triton.cdiv(n, rwt._FB) * triton.cdiv(k, rwt._SEG)
        rwt._experts_fix_kernel[(e, rows_p + triton.cdiv(k, rwt._FB) * triton.cdiv(n, rwt._SEG))](
            w, rows, cols, row_amax, col_amax, fprop, fprop_inv, dgrad, dgrad_inv, fixed, n, k, w.stride(0),
            w.stride(1), rows_p, FB=rwt._FB, FC=rwt._FC, SEG=rwt._SEG, num_warps=rwt._FIX_WARPS, **_KW)

    a_kernel()
    row_amax.copy_(row_part.amax(dim=1))
    col_amax.copy_(col_part.amax(dim=1))
    r["hinted total"] = timed(lambda: rwt.quantize_experts_dual_hinted(w, rows, cols))
    r["A: one-pass cast"] = timed(a_kernel)
    r["amax reductions"] = timed(lambda: (row_part.amax(dim=1), col_part.amax(dim=1)))
    r["fix kernel"] = timed(fix_kernel)
    r["two-kernel total"] = timed(lambda: rqt.quantize_experts_dual(w))
    r["two-kernel amax"] = timed(lambda: rqt._experts_amax_kernel[(e, triton.cdiv(n, rqt._AMAX_BN))](
        w, row_amax, col_amax, fprop_inv, n, k, w.stride(0), w.stride(1), BN=rqt._AMAX_BN, BK=rqt._AMAX_BK,
        num_warps=rqt._AMAX_WARPS, **_KW))
    r["two-kernel cast"] = timed(lambda: rqt._experts_cast_kernel[(e, triton.cdiv(n, rqt._BN), triton.cdiv(k, rqt._BK))](
        w, row_amax, col_amax, fprop, dgrad, dgrad_inv, n, k, w.stride(0), w.stride(1), BN=rqt._BN, BK=rqt._BK,
        num_warps=rqt._EXPERT_WARPS, **_KW))
    for part, fp, dg in ((1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)) if switches else ():
        for bn_, bk_, wp in ((64, 128, 8), (64, 128, 4)):
            r[f"A part={part} fprop={fp} dgrad={dg} tile={bn_},{bk_},{wp}"] = timed(
                lambda: _switched[(e, triton.cdiv(n, bn_), triton.cdiv(k, bk_))](
                    w, rows, cols, row_part, col_part, fprop, dgrad, n, k, w.stride(0), w.stride(1), BN=bn_, BK=bk_,
                    num_warps=wp, FP8_MAX=_KW["FP8_MAX"], PART=bool(part), FPROP=bool(fp), DGRAD=bool(dg)))
    for key, ms in r.items():
        if key != "shape":
            print(f"{name:14s} {key:45s} {ms:.3f} ms", flush=True)
    r["modes"] = modes(w, rows, cols)
    for key, m in r["modes"].items():
        print(f"{name:14s} {key:45s} {m['ms']:.3f} ms  same bits as mode 0: {m['same_bits']}", flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--switches", action="store_true", help="also time the one-pass kernel with parts switched off")
    args = ap.parse_args()
    rows = {name: measure(name, shape, args.switches) for name, shape in SHAPES.items()}
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
