"""Triton kernel of expert parallelism's receiver: the rowwise payload's rows gathered into local-expert order.

:func:`payload_rows` writes what :func:`fp8kit.moe.rowwise_payload.payload_rows_reference` gives, bit for bit (bytes
are moved, nothing is computed; the GPU test and the interpreter check it): for each output row ``p``, the ``H``
E4M3 bytes and the float32 ``inv_scale`` of payload row ``index[p]``, or for ``index[p] == R`` a zero row with the
``inv_scale`` bits the rowwise recipe gives an all-zero row (``zero_inv``).

Why a kernel: the compiled PyTorch gather (32-bit words through Inductor) moved 1.2-1.5 TB/s on the H200 (session 52,
``benchmarks/ep_dispatch.py``'s ``payload-rows``: 0.36 ms at Qwen3-30B-A3B's 131k rows x 2048, 1.64 ms at
DeepSeek-V3's x 7168), a third of a copy's rate, and it is on the dispatch's critical path between the all-to-all
and the experts' first GEMM (and again in gate_up's weight gradient, :func:`dequantize_payload` with ``index``).
Here each program copies a ``BLOCK_P x BLOCK_H`` tile of bytes with 16-byte accesses (payload rows start on 16-byte
boundaries: ``H + 16`` bytes, ``H % 16 == 0``), its rows' source offsets loaded once, and the programs of the first
column tile also move the scales. The 16-byte accesses need ``received`` to start on a 16-byte boundary, as a fresh
buffer (the all-to-all's output) and any slice of whole rows do; otherwise Triton falls back to byte accesses (the
same bytes, slower). ``R`` and ``P`` are not specialized on (Triton 3.6 miscompiled a row count equal
to 1 turned into a constant in fp8kit's activation casts, ``base.triton_lib.two_rows_if_one``).

Imported only on CUDA (triton is absent from CPU installs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CONFIGS = [
    triton.Config({"BLOCK_P": p, "BLOCK_H": h}, num_warps=w)
    for p, h, w in ((16, 1024, 4), (32, 512, 4), (64, 256, 4), (8, 2048, 8), (32, 1024, 8))
]


@triton.autotune(configs=_CONFIGS, key=["H"])
@triton.jit(do_not_specialize=["R", "P"])
def _payload_rows_kernel(
    src_ptr, words_ptr, index_ptr, q_ptr, inv_ptr,
    R, P, H, SRC_STRIDE, zero_inv,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_h = tl.program_id(1)
    rows = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    in_rows = rows < P
    src_row = tl.load(index_ptr + rows, mask=in_rows, other=0).to(tl.int64)
    real = in_rows & (src_row < R) & (src_row >= 0)  # index R: a zero row (and no read outside the payload)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    in_cols = cols < H
    v = tl.load(src_ptr + src_row[:, None] * SRC_STRIDE + cols[None, :], mask=real[:, None] & in_cols[None, :],
                other=0)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], v, mask=in_rows[:, None] & in_cols[None, :])
    if pid_h == 0:
        # the scale: the 32-bit word after the row's H bytes (SRC_STRIDE and H are multiples of 16 bytes)
        inv = tl.load(words_ptr + src_row * (SRC_STRIDE // 4) + H // 4, mask=real, other=zero_inv)
        tl.store(inv_ptr + rows, inv, mask=in_rows)


def payload_rows(received: torch.Tensor, index: torch.Tensor, hidden: int,
                 zero_inv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q (P, H) uint8, inv (P,) int32)``: the bytes of the E4M3 rows and the bits of their float32 scales.

    Args:
        received: ``(R, H + 16)`` contiguous uint8 CUDA payload (``rowwise_payload.payload_views``'s layout).
        index: ``(P,)`` int64 / int32 CUDA tensor, contiguous: the payload row of each output row, ``R`` a zero row.
        hidden: ``H``, a multiple of 16.
        zero_inv: the int32 bits of an all-zero row's ``inv_scale``.
    """
    p = index.shape[0]
    q = torch.empty(p, hidden, dtype=torch.uint8, device=received.device)
    inv = torch.empty(p, dtype=torch.int32, device=received.device)
    if p:  # at least one column of programs: they write the scales, for H = 0 too
        grid = lambda meta: (triton.cdiv(p, meta["BLOCK_P"]), max(1, triton.cdiv(hidden, meta["BLOCK_H"])))  # noqa: E731
        _payload_rows_kernel[grid](received, received.view(torch.int32), index, q, inv, received.shape[0], p, hidden,
                                   received.stride(0), zero_inv)
    return q, inv
