# ruff: noqa: B023  (run() is called inside its loop iteration)
"""Rejected (session 20): splitting the expert-weight amax kernel's columns across programs.

``moe/rowwise_quant_triton._experts_amax_kernel`` runs one program per (expert, 256 rows) and walks all ``K`` columns;
at Mixtral-8x7B's ``down_proj`` (8 experts x 4096 rows) that is 128 programs for 132 SMs. The idea: split ``K`` too and
combine the row amaxes by ``atomic_max``. This times, on the same weights (bf16 randn; ``triton.testing.do_bench``
median), the shipped kernel (``old``), the shipped kernel with its row-amax store replaced by an ``atomic_max``
(``rowatomic``), the split kernel launched unsplit with a plain store (``split_store_nosplit``), and the split kernel
with atomics as it would ship (``split_atomic``: 4 programs per SM). Every variant gives the same bits.

H100, 2026-11-26: the one ``atomic_max`` of 256 row amaxes per program costs 1.0 ms of 2.85 at DeepSeek-V3's
``gate_up_proj`` and doubles Mixtral's ``down_proj`` (0.76 -> 1.63 ms), while splitting gains nothing there (0.74 ms
split with atomics against 0.76 unsplit with a store): the 128 programs were not starving the kernel after all.

    python benchmarks/experiments/expert_amax_split/ablate.py
"""

import torch
import triton
import triton.language as tl
import triton.testing as tt


@triton.jit
def old_k(w_ptr, row_amax_ptr, col_amax_ptr, N, K, stride_e, stride_n, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    offs_n = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    nmask = offs_n < N
    base = w_ptr + e.to(tl.int64) * stride_e + offs_n[:, None] * stride_n
    row_amax = tl.zeros((BN,), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        a = tl.abs(tl.load(base + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32))
        row_amax = tl.maximum(row_amax, tl.max(a, axis=1))
        tl.atomic_max(col_amax_ptr + e * K + offs_k, tl.max(a, axis=0), mask=kmask)
    tl.store(row_amax_ptr + e * N + offs_n, row_amax, mask=nmask)

@triton.jit
def v_rowatomic(w_ptr, row_amax_ptr, col_amax_ptr, N, K, stride_e, stride_n, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    offs_n = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    nmask = offs_n < N
    base = w_ptr + e.to(tl.int64) * stride_e + offs_n[:, None] * stride_n
    row_amax = tl.zeros((BN,), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        a = tl.abs(tl.load(base + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32))
        row_amax = tl.maximum(row_amax, tl.max(a, axis=1))
        tl.atomic_max(col_amax_ptr + e * K + offs_k, tl.max(a, axis=0), mask=kmask)
    tl.atomic_max(row_amax_ptr + e * N + offs_n, row_amax, mask=nmask)

@triton.jit
def v_split_atomic(w_ptr, row_amax_ptr, col_amax_ptr, N, K, K_SPLIT, stride_e, stride_n, BN: tl.constexpr,
                   BK: tl.constexpr):
    e = tl.program_id(0)
    offs_n = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    nmask = offs_n < N
    k_lo = tl.program_id(2) * K_SPLIT
    base = w_ptr + e.to(tl.int64) * stride_e + offs_n[:, None] * stride_n
    row_amax = tl.zeros((BN,), tl.float32)
    for kk in range(0, K_SPLIT, BK):
        offs_k = k_lo + kk + tl.arange(0, BK)
        kmask = (offs_k < k_lo + K_SPLIT) & (offs_k < K)
        a = tl.abs(tl.load(base + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32))
        row_amax = tl.maximum(row_amax, tl.max(a, axis=1))
        tl.atomic_max(col_amax_ptr + e * K + offs_k, tl.max(a, axis=0), mask=kmask)
    tl.atomic_max(row_amax_ptr + e * N + offs_n, row_amax, mask=nmask)


@triton.jit
def v_split_store(w_ptr, row_amax_ptr, col_amax_ptr, N, K, K_SPLIT, stride_e, stride_n, BN: tl.constexpr, BK: tl.constexpr):
    e = tl.program_id(0)
    offs_n = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    nmask = offs_n < N
    k_lo = tl.program_id(2) * K_SPLIT
    base = w_ptr + e.to(tl.int64) * stride_e + offs_n[:, None] * stride_n
    row_amax = tl.zeros((BN,), tl.float32)
    for kk in range(0, K_SPLIT, BK):
        offs_k = k_lo + kk + tl.arange(0, BK)
        kmask = (offs_k < k_lo + K_SPLIT) & (offs_k < K)
        a = tl.abs(tl.load(base + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32))
        row_amax = tl.maximum(row_amax, tl.max(a, axis=1))
        tl.atomic_max(col_amax_ptr + e * K + offs_k, tl.max(a, axis=0), mask=kmask)
    tl.store(row_amax_ptr + e * N + offs_n, row_amax, mask=nmask)



def k_split(row_programs: int, k: int, device) -> int:
    """Columns per program: split ``k`` until about 4 programs run per SM (a multiple of 64)."""
    want = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    chunks = triton.cdiv(k, 64)
    return triton.cdiv(chunks, max(1, min(chunks, triton.cdiv(want, row_programs)))) * 64


for name, shape in {"deepseek-v3 up": (128, 4096, 7168), "mixtral-8x7b down": (8, 4096, 14336), "qwen3 up": (128, 1536, 2048)}.items():
    w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    e, n, kk = shape
    def run(kind):
        row, col = torch.zeros(e, n, device="cuda"), torch.zeros(e, kk, device="cuda")
        if kind == "old":
            old_k[(e, triton.cdiv(n, 256))](w, row, col, n, kk, w.stride(0), w.stride(1), BN=256, BK=64, num_warps=4)
        elif kind == "rowatomic":
            v_rowatomic[(e, triton.cdiv(n, 256))](w, row, col, n, kk, w.stride(0), w.stride(1), BN=256, BK=64, num_warps=4)
        elif kind == "split_store_nosplit":
            v_split_store[(e, triton.cdiv(n, 256), 1)](w, row, col, n, kk, kk, w.stride(0), w.stride(1), BN=256, BK=64, num_warps=4)
        elif kind == "split_atomic":
            ks = k_split(e * triton.cdiv(n, 256), kk, w.device)
            v_split_atomic[(e, triton.cdiv(n, 256), triton.cdiv(kk, ks))](
                w, row, col, n, kk, ks, w.stride(0), w.stride(1), BN=256, BK=64, num_warps=4)
        return row, col
    ref = run("old")
    for kind in ("old", "rowatomic", "split_store_nosplit", "split_atomic"):
        out = run(kind)
        same = all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
        ms = tt.do_bench(lambda kind=kind: run(kind), warmup=5, rep=100)
        print(f"{name} {kind}: {ms:.3f} ms same={same}", flush=True)
