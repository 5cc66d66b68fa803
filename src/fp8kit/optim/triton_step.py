"""The FP8AdamW step as Triton kernels (CUDA): one pass per block, or two for per-tensor scales.

Why our own kernel: ``torch.compile`` of ``numerics.adamw_update`` is several times slower than
``torch.optim.AdamW(fused=True)`` (figures in docs/benchmarks.md, "FP8AdamW"): inductor splits the three
scaled stores (m, v, master) into separate reduction and pointwise kernels that each re-read the inputs,
and the per-tensor amax went through a scatter with atomics per block. Here each program loads
``ROWS`` blocks of every state once, computes the AdamW update in registers and:

- ``granularity="block"``: takes each block's amax in registers and stores the quantized states (1 pass);
- ``granularity="tensor"``: pass 1 reduces the amax of the new m, v and master over the program's
  rows and does one atomic max per program and tensor (per-block atomics on one address per tensor,
  or a per-block store + ``torch.segment_reduce``, were slower; docs/benchmarks.md); pass 2 recomputes
  the update (inputs are unchanged) and stores with the per-tensor scales. 19 bytes/param of traffic
  against 14 for fused AdamW on bf16 parameters.

The math is ``numerics.adamw_update``'s (same formula; the scale is ``fp8kit.fp8.triton_scale``'s
``scale_from_amax``, the Triton twin of ``fp8kit.fp8.scaling.scale_from_amax``), which stays the
reference (and the CPU path); ``benchmarks/optimizer_step.py`` checks the two agree on the GPU.
Supported: scaled FP8/FP16 gradient, m, v; master scaled FP16 or unscaled FP32 (separate from the working
weights). Other combinations (bf16 states, stochastic rounding) use ``torch.compile``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.scaling import DTYPE_MAX, is_scaled, scale_from_amax
from fp8kit.fp8.triton_scale import saturate as tl_saturate
from fp8kit.fp8.triton_scale import scale_from_amax as tl_scale_from_amax
from fp8kit.optim.numerics import StateSpec

ROWS = 8  # blocks per program


def supported(spec: StateSpec, master: torch.Tensor | None) -> bool:
    """Whether the Triton kernels handle this state layout (see the module docstring)."""
    scaled = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16)
    return (
        spec.grad in scaled and spec.m in scaled and spec.v in scaled and master is not None
        and spec.master in (torch.float16, torch.float32) and not spec.stochastic_rounding
        and spec.block in (16, 32, 64, 128, 256, 512)
    )


@triton.jit
def _load_scaled(ptr, sptr, offs, srow, SCALED: tl.constexpr):
    x = tl.load(ptr + offs).to(tl.float32)
    if SCALED:
        x = x / tl.load(sptr + srow)[:, None]
    return x


@triton.jit
def _update(grad, gs, m, ms, v, vs, w, ws, offs, srow, hp, M_SCALED: tl.constexpr, W_SCALED: tl.constexpr):
    lr = tl.load(hp + 0)
    beta1 = tl.load(hp + 1)
    beta2 = tl.load(hp + 2)
    eps = tl.load(hp + 3)
    wd = tl.load(hp + 4)
    step = tl.load(hp + 5)
    clip = tl.load(hp + 6)
    g = _load_scaled(grad, gs, offs, srow, True) * clip
    mm = beta1 * _load_scaled(m, ms, offs, srow, M_SCALED) + (1 - beta1) * g
    vv = beta2 * _load_scaled(v, vs, offs, srow, True) + (1 - beta2) * g * g
    ww = _load_scaled(w, ws, offs, srow, W_SCALED)
    bc1 = 1 - tl.exp2(step * tl.log2(beta1))
    bc2 = 1 - tl.exp2(step * tl.log2(beta2))
    ww = ww * (1 - lr * wd) - (lr / bc1) * mm / (tl.sqrt(vv / bc2) + eps)
    return mm, vv, ww


@triton.jit
def _store_scaled(x, ptr, out_s, offs, srow, MAX: tl.constexpr, AMAX_EPS: tl.constexpr, OWN_SCALE: tl.constexpr):
    if OWN_SCALE:  # per-block: this row's amax gives its new scale
        s = tl_scale_from_amax(tl.max(tl.abs(x), axis=1), MAX, AMAX_EPS)
        tl.store(out_s + srow, s)
    else:  # per-tensor: the new scale from pass 1's amax
        s = tl.load(out_s + srow)
    y = tl_saturate(x * s[:, None], MAX)
    tl.store(ptr + offs, y.to(ptr.dtype.element_ty))


@triton.jit
def _fp8_adamw_kernel(
    grad, gs, m, ms, v, vs, w, ws, work, hp, owner, out_m, out_v, out_w,
    BLOCK: tl.constexpr, ROWS_: tl.constexpr, PASS: tl.constexpr, PER_TENSOR: tl.constexpr,
    M_MAX: tl.constexpr, V_MAX: tl.constexpr, W_MAX: tl.constexpr, AMAX_EPS: tl.constexpr,
    M_SCALED: tl.constexpr, W_SCALED: tl.constexpr,
):
    """PASS 1: atomic-max the new m/v/master amax into out_* (``(num_tensors,)``). PASS 2: store the states;
    out_* are the new scales (written per block, or read per tensor). ms/vs/ws are the old scales."""
    pid = tl.program_id(0)
    rows = pid * ROWS_ + tl.arange(0, ROWS_)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if PER_TENSOR:
        srow = tl.load(owner + rows)
    else:
        srow = rows
    mm, vv, ww = _update(grad, gs, m, ms, v, vs, w, ws, offs, srow, hp, M_SCALED, W_SCALED)
    if PASS == 1:  # per-tensor amax: one atomic per program when its rows share a tensor (the usual case)
        am = tl.max(tl.abs(mm), axis=1)
        av = tl.max(tl.abs(vv), axis=1)
        aw = tl.max(tl.abs(ww), axis=1)
        first = tl.load(owner + pid * ROWS_)
        last = tl.load(owner + pid * ROWS_ + ROWS_ - 1)
        if first == last:
            tl.atomic_max(out_m + first, tl.max(am, axis=0))
            tl.atomic_max(out_v + first, tl.max(av, axis=0))
            tl.atomic_max(out_w + first, tl.max(aw, axis=0))
        else:
            tl.atomic_max(out_m + srow, am)
            tl.atomic_max(out_v + srow, av)
            tl.atomic_max(out_w + srow, aw)
    else:
        if M_SCALED:
            _store_scaled(mm, m, out_m, offs, srow, M_MAX, AMAX_EPS, not PER_TENSOR)
        else:
            tl.store(m + offs, mm.to(m.dtype.element_ty))
        _store_scaled(vv, v, out_v, offs, srow, V_MAX, AMAX_EPS, not PER_TENSOR)
        if W_SCALED:
            _store_scaled(ww, w, out_w, offs, srow, W_MAX, AMAX_EPS, not PER_TENSOR)
        else:
            tl.store(w + offs, ww.to(w.dtype.element_ty))
        tl.store(work + offs, ww.to(work.dtype.element_ty))


def adamw_update_triton(
    grad, grad_scale, m, m_scale, v, v_scale, master, master_scale, work, hp, owner, spec: StateSpec
) -> None:
    """Same contract as :func:`fp8kit.optim.numerics.adamw_update` (in place), on CUDA tensors.

    Raises:
        ValueError: when the flat length is not a multiple of ``ROWS`` blocks (``FlatLayout`` aligns it).
    """
    nb = grad.numel() // spec.block
    if nb % ROWS:
        raise ValueError(f"FP8AdamW Triton step: {nb} blocks is not a multiple of {ROWS}")
    per_tensor = spec.granularity == "tensor"
    m_scaled, w_scaled = m_scale is not None, master_scale is not None
    consts = dict(
        BLOCK=spec.block, ROWS_=ROWS, PER_TENSOR=per_tensor, AMAX_EPS=spec.eps, M_SCALED=m_scaled,
        W_SCALED=w_scaled, M_MAX=DTYPE_MAX.get(m.dtype, 1.0), V_MAX=DTYPE_MAX[v.dtype],
        W_MAX=DTYPE_MAX.get(master.dtype, 1.0),
    )
    ms = m_scale if m_scaled else hp  # hp: a placeholder for pointers a configuration never touches
    ws = master_scale if w_scaled else hp
    args = [grad, grad_scale, m, ms, v, v_scale, master, ws, work, hp, owner]
    grid = (nb // ROWS,)
    if per_tensor:
        amax = torch.zeros(3, spec.num_tensors, device=grad.device, dtype=torch.float32)
        _fp8_adamw_kernel[grid](*args, amax[0], amax[1], amax[2], PASS=1, **consts)
        # the per-tensor scales of pass 1's amax (an unscaled state's row is never read: ones)
        new = torch.stack([
            scale_from_amax(a, t.dtype, spec.eps) if is_scaled(t.dtype) else torch.ones_like(a)
            for a, t in zip(amax, (m, v, master), strict=True)
        ])
        _fp8_adamw_kernel[grid](*args, new[0], new[1], new[2], PASS=2, **consts)
        for s, n in ((m_scale, new[0]), (v_scale, new[1]), (master_scale, new[2])):
            if s is not None:
                s.copy_(n)
    else:  # per block: new scales overwrite the old ones row by row (each row is read before it is written)
        _fp8_adamw_kernel[grid](*args, ms, v_scale, ws, PASS=2, **consts)
