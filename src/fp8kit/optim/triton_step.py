"""The FP8AdamW step as Triton kernels (CUDA): one multi-tensor pass per group, or two for per-tensor scales.

Why our own kernel: ``torch.compile`` of ``numerics.adamw_update`` is several times slower than
``torch.optim.AdamW(fused=True)`` (figures in docs/benchmarks.md, "FP8AdamW"): inductor splits the three
scaled stores (m, v, master) into separate reduction and pointwise kernels that each re-read the inputs.
Here each program loads ``rows`` blocks of every state once (:data:`LAUNCH`), computes the AdamW update in registers and:

- ``granularity="block"``: takes each block's amax in registers and stores the quantized states (1 pass);
- ``granularity="tensor"``: pass 1 reduces the amax of the new m, v and master over the program's
  rows and does one atomic max per program and tensor; pass 2 recomputes the update (inputs are
  unchanged) and stores with the per-tensor scales.

Gradients: the flat FP8 buffer of the hooks (``grad="e5m2"/"e4m3"``, scaled), or (``grad="param"``)
autograd's ``param.grad`` tensors read in place through a table of addresses (``grad_table``, (2, T)
int64: address and element count per tensor, count 0 for a missing gradient): each row of blocks belongs
to one tensor (the flat layout pads tensors to whole blocks), so a row reads ``address + (offset - start)``
masked to the tensor's elements. With ``grad_vec`` > 1 those reads are 16-byte vector loads, which needs
every entry to start on 16 bytes and hold whole vectors (``FlatGroup.update_grad_table`` pads the gradients
that do not); with element loads this kernel is 15% slower at Llama-3-8B shapes (docs/benchmarks.md,
"FP8AdamW: vector gradient loads"). Each program advances its pointers to its first element once (int64) and
indexes within with int32 offsets. Bytes moved per parameter (bf16 parameters and gradients, per tensor):
pass 1 reads 2 + 1 + 2 + 2, pass 2 reads as much and writes 1 + 2 + 2 + 2: 21, against 28 for
``torch.optim.AdamW(fused=True)`` on fp32 master weights.

Bit for bit the reference: the math is ``numerics.adamw_update``'s in the same order, with IEEE division
and square root (``tl.div_rn``, ``tl.sqrt_rn``), the reciprocal-then-multiply of PyTorch's
``scalar / tensor`` for scales, the same integer hash for stochastic rounding, and no fused multiply-add
(launched with ``enable_fp_fusion=False``). ``tests/test_fp8_adamw_gpu.py`` checks the states bit for bit.
Supported: scaled FP8/FP16 or fp32 ``m`` (no COAT expansion), scaled ``v``, master scaled FP16 or fp32
(separate from the working weights). Other combinations use ``torch.compile`` of the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.scaling import DTYPE_MAX, is_scaled, scale_from_amax
from fp8kit.optim.layout import ALIGN_BLOCKS
from fp8kit.optim.numerics import HP_FIELDS, SR_FORMATS, StateSpec

#: ``(blocks per program, warps per program)`` of each granularity's launch. Launch settings: the states are the
#: same bits for any value (``benchmarks/fp8_adamw_launch.py`` checks). Measured on the H100 at Llama-3-8B x 8
#: (docs/benchmarks.md section 6, "FP8AdamW: launch setting", sessions 12 and 34): per block (one pass) 4 blocks
#: x 2 warps took 12.03 ms against 12.30 ms for 8 x 4 (both 8 elements per thread; 4 per thread was 11-60%
#: slower); per tensor (two passes) 8 x 4 was the best of the warps tried. ``rows`` divides the layout's alignment
#: (``optim.layout.ALIGN_BLOCKS``).
LAUNCH: dict[str, tuple[int, int]] = {"block": (4, 2), "tensor": (8, 4)}
if any(ALIGN_BLOCKS % rows for rows, _ in LAUNCH.values()):
    raise RuntimeError(f"fp8kit.optim.triton_step: LAUNCH {LAUNCH} has blocks per program not dividing {ALIGN_BLOCKS}")
# the kernels read hp by position
if HP_FIELDS != ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "clip", "step_size", "inv_bc2", "salt"):
    raise RuntimeError(f"fp8kit.optim.triton_step: hp layout changed ({HP_FIELDS}); update _update/_round_stochastic")


def supported(spec: StateSpec, master: torch.Tensor | None) -> bool:
    """Whether the Triton kernels handle this state layout (see the module docstring)."""
    scaled = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16)
    m_ok = spec.m in scaled or spec.m == torch.float32
    return (
        m_ok and spec.m_expand == "none" and spec.v in scaled and master is not None
        and spec.master in (torch.float16, torch.float32) and not spec.stochastic_rounding
        and spec.block in (16, 32, 64, 128, 256, 512)
    )


@triton.jit
def _scale_rn(amax, MAX: tl.constexpr, EPS: tl.constexpr):
    """``scaling.scale_from_amax`` exactly: PyTorch's ``MAX / t`` is ``reciprocal(t) * MAX``."""
    return tl.div_rn(1.0, tl.minimum(tl.maximum(amax, EPS), 3.4028234663852886e38)) * MAX


@triton.jit
def _hash32(x):
    """``numerics.hash32`` on uint32."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x31848BAB
    return x ^ (x >> 16)


@triton.jit
def _round_stochastic(y, offs, hp, MANT: tl.constexpr, EMIN: tl.constexpr):
    """``numerics.round_stochastic(y, numerics.uniform_noise(...))`` for the elements at flat ``offs``."""
    step = tl.load(hp + 5).to(tl.uint32)
    salt = tl.load(hp + 9).to(tl.uint32)
    seed = _hash32((step << 8) ^ salt)
    u = (_hash32(offs.to(tl.uint32) ^ seed) >> 8).to(tl.float32) * 5.9604644775390625e-08
    a = tl.abs(y)
    # the reference's e = max(biased exponent - 127, EMIN), kept as the exponent field max(E, EMIN + 127) << 23:
    # ulp = 2^(e - MANT) and 1 / ulp = 2^(MANT - e) are that field minus / subtracted from a constant (uint32, wraps)
    eb = tl.maximum(a.to(tl.uint32, bitcast=True) & 0x7F800000, (EMIN + 127) << 23)
    ulp = (eb - (MANT << 23)).to(tl.float32, bitcast=True)
    inv_ulp = (((254 + MANT) << 23) - eb).to(tl.float32, bitcast=True)
    r = tl.floor(a * inv_ulp + u) * ulp
    return tl.where((y < 0) & (r > 0), -r, r)  # a zero result is +0, as numerics.round_stochastic


@triton.jit
def _load_scaled(ptr, sptr, offs, srow, SCALED: tl.constexpr):
    x = tl.load(ptr + offs).to(tl.float32)
    if SCALED:
        x = x * tl.div_rn(1.0, tl.load(sptr + srow))[:, None]
    return x


@triton.jit
def _update(grad, gs, gtab, seg_start, m, ms, v, vs, w, ws, work, hp, p0, loc, srow, owner_r,
            GRAD_TABLE: tl.constexpr, GRAD_VEC: tl.constexpr, NUM_T: tl.constexpr, M_SCALED: tl.constexpr,
            W_SCALED: tl.constexpr, SPAN: tl.constexpr):
    # the pointers are advanced to the program's first element p0 (int64); loc: int32 offsets within the program
    lr = tl.load(hp + 0)
    beta1 = tl.load(hp + 1)
    beta2 = tl.load(hp + 2)
    eps = tl.load(hp + 3)
    wd = tl.load(hp + 4)
    clip = tl.load(hp + 6)
    step_size = tl.load(hp + 7)
    inv_bc2 = tl.load(hp + 8)
    if GRAD_TABLE:  # autograd's gradients, in the working weights' dtype, read in place
        addr = tl.load(gtab + owner_r)
        count = tl.load(gtab + NUM_T + owner_r)
        roff = p0 - tl.load(seg_start + owner_r)  # each row's offset into its tensor, less its row * BLOCK
        gptr = addr.to(tl.pointer_type(work.dtype.element_ty)) + roff
        lim = tl.minimum(tl.maximum(count - roff, 0), SPAN).to(tl.int32)  # loc < lim: inside the tensor
        if GRAD_VEC > 1:  # every gradient 16-byte aligned, its length a multiple of 16 bytes: vector loads
            gptr = tl.multiple_of(gptr, 16)
            lim = tl.multiple_of(lim, GRAD_VEC)
        g = tl.load(gptr[:, None] + loc, mask=loc < lim[:, None], other=0.0).to(tl.float32)
    else:
        g = _load_scaled(grad, gs, loc, srow, True)
    g = g * clip
    mm = beta1 * _load_scaled(m, ms, loc, srow, M_SCALED) + (1 - beta1) * g
    vv = beta2 * _load_scaled(v, vs, loc, srow, True) + (1 - beta2) * g * g
    ww = _load_scaled(w, ws, loc, srow, W_SCALED)
    ww = ww * (1 - lr * wd) - tl.div_rn(step_size * mm, tl.sqrt_rn(vv * inv_bc2) + eps)
    return mm, vv, ww


@triton.jit
def advance_states(m, v, w, work, p0):
    """The flat state pointers moved to element ``p0`` (int64), for int32 offsets from there."""
    return m + p0, v + p0, w + p0, work + p0


@triton.jit
def _store_scaled(x, ptr, out_s, offs, noffs, srow, hp, MAX: tl.constexpr, AMAX_EPS: tl.constexpr,
                  OWN_SCALE: tl.constexpr, SR: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    if OWN_SCALE:  # per block: this row's amax gives its new scale
        s = _scale_rn(tl.max(tl.abs(x), axis=1), MAX, AMAX_EPS)
        tl.store(out_s + srow, s)
    else:  # per tensor: the new scale from pass 1's amax
        s = tl.load(out_s + srow)
    y = tl.minimum(tl.maximum(x * s[:, None], -MAX), MAX)
    if SR:
        y = _round_stochastic(y, noffs, hp, MANT, EMIN)
    tl.store(ptr + offs, y.to(ptr.dtype.element_ty))


@triton.jit
def _fp8_adamw_kernel(
    grad, gs, gtab, seg_start, m, ms, v, vs, w, ws, work, hp, owner, out_m, out_v, out_w, noise_delta,
    BLOCK: tl.constexpr, ROWS_: tl.constexpr, PASS: tl.constexpr, PER_TENSOR: tl.constexpr,
    M_MAX: tl.constexpr, V_MAX: tl.constexpr, W_MAX: tl.constexpr, AMAX_EPS: tl.constexpr,
    M_SCALED: tl.constexpr, W_SCALED: tl.constexpr, GRAD_TABLE: tl.constexpr, NUM_T: tl.constexpr,
    M_SR: tl.constexpr, M_MANT: tl.constexpr, M_EMIN: tl.constexpr, NOISE_DELTA: tl.constexpr,
    GRAD_VEC: tl.constexpr = 1,
):
    """PASS 1: atomic-max the new m/v/master amax into out_* (``(num_tensors,)``). PASS 2: store the states;
    out_* are the new scales (written per block, or read per tensor). ms/vs/ws are the old scales."""
    pid = tl.program_id(0).to(tl.int64)
    p0 = pid * (ROWS_ * BLOCK)  # the program's first element: pointers advance by it, offsets below are int32
    rows = pid * ROWS_ + tl.arange(0, ROWS_)
    loc = tl.arange(0, ROWS_)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    owner_r = tl.load(owner + rows)
    if PER_TENSOR:
        srow = owner_r
    else:
        srow = rows
    if not GRAD_TABLE:
        grad += p0
    m, v, w, work = advance_states(m, v, w, work, p0)
    mm, vv, ww = _update(grad, gs, gtab, seg_start, m, ms, v, vs, w, ws, work, hp, p0, loc, srow, owner_r,
                         GRAD_TABLE, GRAD_VEC, NUM_T, M_SCALED, W_SCALED, ROWS_ * BLOCK)
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
        # the stochastic rounding's element index, as uint32 (numerics.uniform_noise keeps its low 32 bits; the
        # uint32 sum wraps as the int64 one truncates)
        if NOISE_DELTA:  # FSDP2 shards: the element's index in the unsharded layout (numerics.uniform_noise)
            nbase = (p0 + tl.load(noise_delta + owner_r)).to(tl.uint32)[:, None]
        else:
            nbase = p0.to(tl.uint32)
        noffs = nbase + loc.to(tl.uint32)
        if M_SCALED:
            _store_scaled(mm, m, out_m, loc, noffs, srow, hp, M_MAX, AMAX_EPS, not PER_TENSOR, M_SR, M_MANT,
                          M_EMIN)
        else:
            tl.store(m + loc, mm.to(m.dtype.element_ty))
        _store_scaled(vv, v, out_v, loc, loc, srow, hp, V_MAX, AMAX_EPS, not PER_TENSOR, False, 0, 0)
        if W_SCALED:
            _store_scaled(ww, w, out_w, loc, loc, srow, hp, W_MAX, AMAX_EPS, not PER_TENSOR, False, 0, 0)
        else:
            tl.store(w + loc, ww.to(w.dtype.element_ty))
        tl.store(work + loc, ww.to(work.dtype.element_ty))


def adamw_update_triton(
    grad, grad_scale, m, m_scale, m_k, v, v_scale, master, master_scale, work, hp, owner, spec: StateSpec,
    grad_table: torch.Tensor | None = None, seg_start: torch.Tensor | None = None, reduce_amax=None,
    noise_delta: torch.Tensor | None = None, grad_vec: int = 1,
) -> None:
    """Same contract as :func:`fp8kit.optim.numerics.adamw_update` (in place), on CUDA tensors.

    Args:
        grad, grad_scale: the flat scaled FP8 gradient, or ``None`` with ``grad_table``.
        grad_table, seg_start: ``grad="param"``: (2, T) int64 addresses and element counts of the
            gradients (``flat_group.FlatGroup.update_grad_table``) and the (T,) int64 segment starts.
        reduce_amax, noise_delta: FSDP2 shards, as ``numerics.adamw_update``: pass 1's ``(3, T)`` amaxes are
            MAX-reduced over the shards before the scales are taken; the stochastic-rounding index of an
            element is its flat offset plus ``noise_delta[tensor]``.
        grad_vec: with ``grad_table``, the elements of one 16-byte vector load when EVERY gradient's address is a
            multiple of 16 bytes and its element count a multiple of ``grad_vec`` (``FlatGroup.update_grad_table``
            checks); 1 otherwise (element loads). A launch setting: the same bits either way.

    Raises:
        ValueError: when the flat length is not a multiple of the launch's blocks per program (``FlatLayout`` aligns it),
            with COAT's ``m_k``, with neither a gradient nor a table, or a ``grad_vec`` other than 1 or 16 bytes.
    """
    nb = work.numel() // spec.block
    if grad_vec not in (1, 16 // work.element_size()):
        raise ValueError(f"FP8AdamW Triton step: grad_vec = {grad_vec}; 1 or {16 // work.element_size()} "
                         f"(16 bytes of {work.dtype})")
    rows, warps = LAUNCH[spec.granularity]
    if nb % rows:
        raise ValueError(f"FP8AdamW Triton step: {nb} blocks is not a multiple of {rows}")
    if m_k is not None or (grad is None) == (grad_table is None):
        raise ValueError("FP8AdamW Triton step: needs exactly one of grad / grad_table, and no m_k")
    per_tensor = spec.granularity == "tensor"
    m_scaled, w_scaled = m_scale is not None, master_scale is not None
    m_sr = m_scaled and spec.m_rounding == "stochastic"
    mant, emin = SR_FORMATS.get(m.dtype, (0, 0))
    consts = dict(
        BLOCK=spec.block, ROWS_=rows, PER_TENSOR=per_tensor, AMAX_EPS=spec.eps, M_SCALED=m_scaled,
        W_SCALED=w_scaled, M_MAX=DTYPE_MAX.get(m.dtype, 1.0), V_MAX=DTYPE_MAX[v.dtype],
        W_MAX=DTYPE_MAX.get(master.dtype, 1.0), GRAD_TABLE=grad_table is not None, NUM_T=spec.num_tensors,
        M_SR=m_sr, M_MANT=mant, M_EMIN=emin, NOISE_DELTA=noise_delta is not None, enable_fp_fusion=False,
        GRAD_VEC=grad_vec if grad_table is not None else 1,
        num_warps=warps,
    )
    ms = m_scale if m_scaled else hp  # hp: a placeholder for pointers a configuration never touches
    ws = master_scale if w_scaled else hp
    if grad_table is not None:
        args = [work, hp, grad_table, seg_start]
    else:
        args = [grad, grad_scale, owner, owner]
    args += [m, ms, v, v_scale, master, ws, work, hp, owner]
    nd = noise_delta if noise_delta is not None else owner  # placeholder when unused
    grid = (nb // rows,)
    if per_tensor:
        amax = torch.zeros(3, spec.num_tensors, device=work.device, dtype=torch.float32)
        _fp8_adamw_kernel[grid](*args, amax[0], amax[1], amax[2], nd, PASS=1, **consts)
        if reduce_amax is not None:  # FSDP2: the unsharded tensors' amaxes (one collective for the group)
            reduce_amax(amax)
        # the per-tensor scales of pass 1's amax (an unscaled state's row is never read: ones)
        new = torch.stack([
            scale_from_amax(a, t.dtype, spec.eps) if is_scaled(t.dtype) else torch.ones_like(a)
            for a, t in zip(amax, (m, v, master), strict=True)
        ])
        _fp8_adamw_kernel[grid](*args, new[0], new[1], new[2], nd, PASS=2, **consts)
        for s, n in ((m_scale, new[0]), (v_scale, new[1]), (master_scale, new[2])):
            if s is not None:
                s.copy_(n)
    else:  # per block: new scales overwrite the old ones row by row (each row is read before it is written)
        if reduce_amax is not None:
            raise ValueError("FP8AdamW Triton step: reduced (FSDP2) scales need granularity = 'tensor'")
        _fp8_adamw_kernel[grid](*args, ms, v_scale, ws, nd, PASS=2, **consts)
