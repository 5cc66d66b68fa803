"""Triton kernels of :mod:`fp8kit.comm.allreduce_ops` (CUDA): the FP8 all-reduce's elementwise passes, one read each.

Every kernel computes the bits of its reference in :mod:`fp8kit.comm.allreduce_ops` (float32 throughout):

- products ``x * s`` are single IEEE multiplies (no add follows, so nothing can be contracted into an FMA);
- ``saturate`` is ``tl.clamp(y, -MAX, MAX)`` with NaN propagated (torch's ``clamp`` propagates it too);
- the FP8 cast is Triton's round-to-nearest-even conversion (``cvt.rn.satfinite`` on Hopper), the rounding of
  torch's ``.to(float8)``; values are clamped first, so ``satfinite`` never acts;
- divisions are ``tl.div_rn`` (IEEE), as torch's float32 ``/``; Triton's ``/`` would be an approximation;
- the cast of a result to bf16 / fp16 rounds to nearest even, as torch's ``copy_``;
- the rank sum adds the rows in rank order ``((q_0 + q_1) + q_2) + ...``, the references' order.

Kernels (one program per ``BLOCK`` elements; 64-bit offsets; the wrappers expect non-empty inputs):

- :func:`scale_vec`: per program, the max of ``|mu g|`` over finite values and the counts ``|mu g| > MAX`` and
  ``not finite``, stored to ``[G]`` partials; one more program reduces them (max and integer sums are
  order-independent, so the result is deterministic) and computes the float64 vector of the scalar all-reduce.
- :func:`scale_update`: one single-thread program for the float64 bookkeeping after the all-reduce (the
  unified scale, the auto-scaling rule), instead of ~40 tiny torch launches. Float64 ``+ * / < min`` are IEEE in
  both; ``mu0`` is ``blockwise_triton._scale_of`` (torch evaluates ``FP8_MAX / a`` as ``reciprocal(a) * FP8_MAX``:
  two float32 roundings, the first a ``div_rn``), its "one ulp down" a bit decrement (``mu0 > 0``); options
  come as a float64 tensor (a Python float argument would be rounded to float32); negation is ``* -1.0``
  (Triton's unary minus is ``0 - x``, which loses torch's ``-0.0``).
- :func:`quantize`: ``g [k]`` -> FP8 ``[L]``, zeros past ``k`` (the padding), written into the send buffer.
- :func:`quantize_stats`: delayed scaling's pass: :func:`quantize` with ``f32(mu)`` and :func:`scale_vec`'s
  partials from the same products (one read of ``g``), then the same one-program finish into ``vec``.
- :func:`scale_update` with ``delayed=True``: the element-wise MIN of ``N`` ranks' vectors (rows of a strided
  ``[N, 4]`` view) first, then the same program with ``out_scale = f32(mu)`` (or NaN).
- :func:`sum_rows`: ``recv [N, c]`` FP8 -> the float32 rank sum, then either FP8 of ``sum * (1/N)``
  (``requant``, the all-gather's payload) or ``(sum * mul) / scale`` in ``out``'s dtype (the reduce-scatter).
- :func:`dequantize`: FP8 ``[L]`` -> ``out [L]`` (its dtype) ``= q / scale``.
- :func:`gather_mean`: the "gather" algorithm's pass: ``rows [N, L]`` FP8 (every rank's whole tensor) -> the float32
  rank sum of the first ``n`` columns, ``out [n] = (sum * (1/N)) / scale`` in ``out``'s dtype; the rows are loaded
  under a mask on ``L`` (a multiple of 16 in ``fp8_all_reduce``: aligned vector loads), stored under one on ``n``.

Imported only on CUDA (inside the ops' CUDA implementations, through ``base.triton_lib``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.kernels.blockwise_triton import _scale_of
from fp8kit.fp8.scaling import AMAX_EPS

#: Elements per program and warps: memory-bound passes, 16 elements per thread (16-byte FP8 / 32-byte bf16 loads).
BLOCK = 4096
NUM_WARPS = 8
#: ``scaling.F32_MAX``: ``|y| <= F32_MAX`` is "finite" (false for inf and NaN).
_F32_MAX = 3.4028234663852886e38


@triton.jit
def _saturate(y, MAX: tl.constexpr):
    # scaling.quantize's clamp, NaN kept (torch.clamp propagates NaN).
    return tl.clamp(y, -MAX, MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _stats_kernel(g_ptr, values_ptr, amax_ptr, cnt_ptr, n, G, FP8_MAX: tl.constexpr, F32_MAX: tl.constexpr,
                  BLOCK: tl.constexpr):
    # per program: max |y| over finite y, #(|y| > FP8_MAX), #(y not finite), y = f32(g) * f32(mu)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    mu = tl.load(values_ptr).to(tl.float32)  # values[MU], float64 -> float32 (RTNE, as torch's .float())
    a = tl.abs(tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * mu)
    finite = a <= F32_MAX  # false for inf and NaN; masked lanes are 0
    tl.store(amax_ptr + pid, tl.max(tl.where(finite, a, 0.0), axis=0))
    tl.store(cnt_ptr + pid, tl.sum((a > FP8_MAX).to(tl.int32), axis=0))
    tl.store(cnt_ptr + G + pid, tl.sum((~finite).to(tl.int32), axis=0))


@triton.jit(do_not_specialize=["G", "n"])  # n is converted to float64: never a constexpr
def _vec_kernel(amax_ptr, cnt_ptr, G, values_ptr, params_ptr, vec_ptr, n, BLOCK: tl.constexpr):
    # one program: finish the partials, then scale_vec_ref's float64 math
    am = tl.zeros((BLOCK,), tl.float32)
    sat = tl.zeros((BLOCK,), tl.int64)
    bad = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, G, BLOCK):
        o = start + tl.arange(0, BLOCK)
        m = o < G
        am = tl.maximum(am, tl.load(amax_ptr + o, mask=m, other=0.0))
        sat += tl.load(cnt_ptr + o, mask=m, other=0).to(tl.int64)
        bad += tl.load(cnt_ptr + G + o, mask=m, other=0).to(tl.int64)
    amax = tl.max(am, axis=0).to(tl.float64)
    nonfinite = tl.sum(bad, axis=0) > 0
    frac = tl.sum(sat, axis=0).to(tl.float64) / n.to(tl.float64)  # f64 division: IEEE (div.rn.f64)
    mu = tl.load(values_ptr)
    init = tl.load(values_ptr + 4) > 0
    cand = tl.where(frac > tl.load(params_ptr), mu * tl.load(params_ptr + 1), mu)
    cand = tl.where(init, cand, float("inf"))
    # negation as * -1.0 (exact, keeps torch's -0.0)
    tl.store(vec_ptr, cand)
    tl.store(vec_ptr + 1, frac * -1.0)
    tl.store(vec_ptr + 2, tl.where(nonfinite, 0.0, amax) * -1.0)
    tl.store(vec_ptr + 3, nonfinite.to(tl.float64) * -1.0)


@triton.jit
def _update_kernel(vec_ptr, vec_stride, values_ptr, params_ptr, scale_ptr, out_scale_ptr, new_ptr,
                   FP8_MAX: tl.constexpr, EPS: tl.constexpr, F32_MAX: tl.constexpr, WORLD: tl.constexpr,
                   DELAYED: tl.constexpr):
    # one program: scale_update_ref's math (initial_mu in float32, the rest in float64); WORLD > 1: the MIN of
    # WORLD vectors (row i at vec_ptr + i * vec_stride) first, as the scalar all-reduce computes it
    v0 = tl.load(vec_ptr)
    v1 = tl.load(vec_ptr + 1)
    v2 = tl.load(vec_ptr + 2)
    v3 = tl.load(vec_ptr + 3)
    for i in tl.static_range(1, WORLD):
        row = vec_ptr + i * vec_stride
        v0 = tl.minimum(v0, tl.load(row))
        v1 = tl.minimum(v1, tl.load(row + 1))
        v2 = tl.minimum(v2, tl.load(row + 2))
        v3 = tl.minimum(v3, tl.load(row + 3))
    cand_g = v0
    frac_max = v1 * -1.0
    gamax = v2 * -1.0
    bad = v3 < 0
    mu = tl.load(values_ptr)
    steps0 = tl.load(values_ptr + 1)
    init = tl.load(values_ptr + 4) > 0
    # initial_mu: scale_from_amax (IEEE 1 / clamp(f32(amax), eps, F32_MAX), times FP8_MAX: torch's two roundings),
    # one float32 ulp down if mu0 * amax > FP8_MAX
    a32 = tl.minimum(tl.maximum(gamax.to(tl.float32), EPS), F32_MAX)
    mu0 = _scale_of(gamax.to(tl.float32), EPS, F32_MAX, FP8_MAX)
    down = (mu0.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)  # nextafter(mu0, 0), mu0 > 0
    mu0 = tl.where(mu0 * a32 > FP8_MAX, down, mu0).to(tl.float64)
    mu_g = tl.where(init, cand_g, mu0)
    halve = init & (cand_g < mu) & ~bad
    initializing = ~init & ~bad & (gamax > 0)
    quiet = ~bad & ~halve & (init | initializing)
    steps = tl.where(halve, 0.0, tl.where(quiet, steps0 + 1.0, steps0))
    grow = quiet & init & (steps > tl.load(params_ptr + 4))
    mu_next = tl.where(halve, cand_g, tl.where(initializing, mu0, mu))
    mu_next = tl.where(grow, tl.minimum(mu_next * tl.load(params_ptr + 2), tl.load(params_ptr + 3)), mu_next)
    tl.store(new_ptr, mu_next)
    tl.store(new_ptr + 1, steps)
    tl.store(new_ptr + 2, tl.load(values_ptr + 2) + halve.to(tl.float64))
    tl.store(new_ptr + 3, tl.load(values_ptr + 3) + grow.to(tl.float64))
    tl.store(new_ptr + 4, (init | initializing).to(tl.float64))
    tl.store(new_ptr + 5, tl.where(init & ~bad, frac_max, tl.load(values_ptr + 5)))
    used = mu if DELAYED else mu_g  # delayed: the payload was quantized with the key's mu before this call
    tl.store(scale_ptr, used.to(tl.float32))
    tl.store(out_scale_ptr, tl.where(bad, float("nan"), used).to(tl.float32))


@triton.jit
def _quantize_stats_kernel(g_ptr, values_ptr, q_ptr, amax_ptr, cnt_ptr, k, L, G, FP8_MAX: tl.constexpr,
                           F32_MAX: tl.constexpr, BLOCK: tl.constexpr):
    # _quantize_kernel with scale f32(mu) and _stats_kernel's partials of the same products y = f32(g) * f32(mu)
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < k
    mu = tl.load(values_ptr).to(tl.float32)  # values[MU], float64 -> float32 (RTNE, as torch's .float())
    y = tl.load(g_ptr + offs, mask=inb, other=0.0).to(tl.float32) * mu
    a = tl.abs(y)
    finite = a <= F32_MAX  # false for inf and NaN; masked lanes are 0
    tl.store(amax_ptr + pid, tl.max(tl.where(finite, a, 0.0), axis=0))
    tl.store(cnt_ptr + pid, tl.sum((a > FP8_MAX).to(tl.int32), axis=0))
    tl.store(cnt_ptr + G + pid, tl.sum((~finite).to(tl.int32), axis=0))
    q = tl.where(inb, _saturate(y, FP8_MAX), 0.0)  # the padding: +0
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=offs < L)


@triton.jit
def _quantize_kernel(g_ptr, scale_ptr, q_ptr, k, L, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < k
    scale = tl.load(scale_ptr)
    y = _saturate(tl.load(g_ptr + offs, mask=inb, other=0.0).to(tl.float32) * scale, FP8_MAX)
    y = tl.where(inb, y, 0.0)  # the padding: +0
    tl.store(q_ptr + offs, y.to(q_ptr.dtype.element_ty), mask=offs < L)


@triton.jit
def _sum_rows_kernel(recv_ptr, scale_ptr, out_ptr, c, mul, WORLD: tl.constexpr, REQUANT: tl.constexpr,
                     FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < c
    row = recv_ptr + offs
    acc = tl.load(row, mask=mask, other=0.0).to(tl.float32)
    for _ in range(1, WORLD):  # rank order, as the reference; row i starts at i * c (64-bit pointer steps)
        row += c
        acc = acc + tl.load(row, mask=mask, other=0.0).to(tl.float32)
    y = acc * mul
    if REQUANT:
        out = _saturate(y, FP8_MAX).to(out_ptr.dtype.element_ty)
    else:
        out = tl.div_rn(y, tl.load(scale_ptr)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _dequant_kernel(q_ptr, scale_ptr, out_ptr, L, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    x = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, tl.div_rn(x, tl.load(scale_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_mean_kernel(rows_ptr, scale_ptr, out_ptr, n, row, mul, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inrow = offs < row  # the padded row (all of it is written by the all-gather): aligned loads when row % 16 == 0
    ptr = rows_ptr + offs
    acc = tl.load(ptr, mask=inrow, other=0.0).to(tl.float32)
    for _ in tl.static_range(1, WORLD):  # rank order ((q_0 + q_1) + q_2) + ..., as the reference; 64-bit pointers
        ptr += row
        acc = acc + tl.load(ptr, mask=inrow, other=0.0).to(tl.float32)
    y = tl.div_rn(acc * mul, tl.load(scale_ptr))  # one multiply (nothing to contract), one IEEE division
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=offs < n)


def scale_vec(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """``allreduce_ops.scale_vec_ref``: the stats pass over ``g`` (non-empty) and one program finishing it."""
    n = g.numel()
    grid = triton.cdiv(n, BLOCK)
    amax = torch.empty(grid, dtype=torch.float32, device=g.device)
    cnt = torch.empty(2, grid, dtype=torch.int32, device=g.device)
    _stats_kernel[(grid,)](g, values, amax, cnt, n, grid, FP8_MAX=fp8_max, F32_MAX=_F32_MAX, BLOCK=BLOCK,
                           num_warps=NUM_WARPS)
    vec = torch.empty(4, dtype=torch.float64, device=g.device)
    _vec_kernel[(1,)](amax, cnt, grid, values, params, vec, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return vec


def scale_update(vec: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8_max: float, *,
                 delayed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``allreduce_ops.scale_update_ref`` in one single-thread program: ``(scale, out_scale, new_values)``.

    ``vec`` float64 ``(4,)``, or with ``delayed`` a ``[N, 4]`` view (unit column stride) whose rows' MIN is taken
    first, and the scales are ``f32(mu)`` (``scale_update_delayed_ref``)."""
    world, stride = (vec.shape[0], vec.stride(0)) if vec.dim() == 2 else (1, 0)
    scale = torch.empty(1, dtype=torch.float32, device=vec.device)
    out_scale = torch.empty_like(scale)
    new = torch.empty(6, dtype=torch.float64, device=vec.device)
    _update_kernel[(1,)](vec, stride, values, params, scale, out_scale, new, FP8_MAX=fp8_max, EPS=AMAX_EPS,
                         F32_MAX=_F32_MAX, WORLD=world, DELAYED=delayed, num_warps=1)
    return scale, out_scale, new


def quantize_stats(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, q: torch.Tensor, vec: torch.Tensor,
                   fp8_max: float) -> None:
    """``allreduce_ops.quantize_stats_ref``: ``q[:k] = FP8(saturate(g * f32(mu)))``, ``q[k:] = 0`` (``q`` an FP8
    view ``[L]``) and ``vec`` = the statistics of the same products, in one read of ``g`` plus one tiny program."""
    n, L = g.numel(), q.numel()
    grid = triton.cdiv(L, BLOCK)
    amax = torch.empty(grid, dtype=torch.float32, device=g.device)
    cnt = torch.empty(2, grid, dtype=torch.int32, device=g.device)
    _quantize_stats_kernel[(grid,)](g, values, q, amax, cnt, n, L, grid, FP8_MAX=fp8_max, F32_MAX=_F32_MAX,
                                    BLOCK=BLOCK, num_warps=NUM_WARPS)
    _vec_kernel[(1,)](amax, cnt, grid, values, params, vec, n, BLOCK=BLOCK, num_warps=NUM_WARPS)


def quantize(g: torch.Tensor, scale: torch.Tensor, q: torch.Tensor, fp8_max: float) -> None:
    """``q[:k] = FP8(saturate(g * scale))``, ``q[k:] = 0``; ``q`` an FP8 view ``[L]``, ``L > 0``."""
    L = q.numel()
    _quantize_kernel[(triton.cdiv(L, BLOCK),)](g, scale, q, g.numel(), L, FP8_MAX=fp8_max, BLOCK=BLOCK,
                                               num_warps=NUM_WARPS)


def sum_rows(recv: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor, world: int, mul: float,
             fp8_max: float, *, requant: bool) -> None:
    """Rank sum of ``recv [world, c]`` (FP8 view) into ``out [c]``: FP8 of ``sum * mul`` (``requant``, ``out`` an
    FP8 view) or ``(sum * mul) / scale`` in ``out``'s dtype. ``mul`` must hold a float32 value."""
    c = out.numel()
    _sum_rows_kernel[(triton.cdiv(c, BLOCK),)](recv, out if scale is None else scale, out, c, mul, WORLD=world,
                                               REQUANT=requant, FP8_MAX=fp8_max, BLOCK=BLOCK,
                                               num_warps=NUM_WARPS)


def dequantize(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out = q[:L] / scale`` in ``out``'s dtype; ``q`` an FP8 view."""
    L = out.numel()
    _dequant_kernel[(triton.cdiv(L, BLOCK),)](q, scale, out, L, BLOCK=BLOCK, num_warps=NUM_WARPS)


def gather_mean(rows: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, row: int, mul: float) -> None:
    """``out [n] = (sum_i rows[i, :n] * mul) / scale`` in ``out``'s dtype; ``rows`` an FP8 view ``[world * row]``,
    ``0 < n <= row``; ``mul`` must hold a float32 value."""
    n = out.numel()
    _gather_mean_kernel[(triton.cdiv(n, BLOCK),)](rows, scale, out, n, row, mul, WORLD=world, BLOCK=BLOCK,
                                                  num_warps=NUM_WARPS)
