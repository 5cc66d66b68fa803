"""The FP8AdamW math on flat buffers: scaled load/store, stochastic rounding, range expansion, the update.

Pure tensor functions (no Python control flow on tensor values): the reference of the Triton kernels
(``optim/triton_step.py``), the CPU path, and the ``torch.compile`` path for layouts the kernels don't
cover. A scaled state is ``(data, scale)`` with value ``data * (1 / scale)`` (FP8-LM, arXiv:2310.18313,
section 2.1; ``fp8kit.fp8.scaling``), one scale per tensor (``granularity="tensor"``, the paper's choice)
or per ``block`` elements (``"block"``).

Written so that the Triton kernels can reproduce it bit for bit: dequantization multiplies by the
reciprocal of the scale (one float32 division per scale, not per element), the bias corrections come
precomputed in ``hp`` (computed once on the host), the update has one IEEE division and one IEEE square
root per element, no fused multiply-add, and the random numbers of stochastic rounding are a counter-based
integer hash of (step, group, element index) instead of a generator state.

First moment ``m`` (the state that drifts; FP8 E4M3 by default):

- ``m_rounding="stochastic"`` (default): unbiased stochastic rounding onto the storage grid. Rounding
  ``m <- Q(beta1 m + (1 - beta1) g)`` to nearest has a dead band: when the gradient changes slowly, ``m``
  stays on a grid point up to ``0.5 ulp / (1 - beta1)`` = 5 ulps (~30 % with 3 mantissa bits) away from
  its exact value for many steps, a bias that does not average out. Stochastic rounding (``E[Q(x)] = x``)
  removes it at no byte cost; its error is larger per store (up to 1 ulp, variance 1/6 ulp^2 against
  1/12) but unbiased. Measured on the issue's MLP regression (tests/test_fp8_adamw_numerics.py): FP8-LM's
  nearest rounding ends 4-14 % above FP32 AdamW's loss at 200-400 steps, stochastic rounding within the
  problem's noise floor (|gap| <= 1.2 % on seeds 0-2, 4.5 % on seed 3, as much as an fp16 m).
- ``m_expand="coat"``: COAT's dynamic range expansion (Xi et al. 2024, arXiv:2410.19313, section 4): per
  scaling group, ``x -> sign(x) |x / amax|^k`` with ``k = floor(16 log2(R) / log2(amax / amin)) / 16``,
  ``R = 448^2 / 2`` (COAT's constant) and ``amin`` the smallest nonzero ``|x|``, then scaled by 448;
  ``k`` (float32, one per scale) is stored beside the scale and inverted on load (``|y|^(1/k)``). With
  one scale per tensor ``amin`` is one element's magnitude, so ``k`` follows outliers (k ~ 0.7-1.0 on the
  MLP, compressing the range); the measured gain there comes from ``k`` changing from step to step
  (dithering the dead band), and it is smaller than stochastic rounding's (module tests). Not in the
  Triton kernels (``torch.compile`` on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, scale_from_amax

#: Entries of the ``hp`` vector (float32 on the device) every step function reads.
HP_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay", "step", "clip", "step_size", "inv_bc2", "salt")
HP_CLIP = HP_FIELDS.index("clip")
#: Stochastic rounding targets: mantissa bits and smallest normal exponent of each scaled format.
SR_FORMATS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14), torch.float16: (10, -14)}
#: COAT's expansion: target range (``448^2 / 2``), k quantized to 1/16 and clamped to [1/16, 8].
COAT_RANGE = 448.0 * 448.0 / 2
COAT_K_STEPS = 16
COAT_K_MIN, COAT_K_MAX = 1.0 / 16, 8.0
_M32 = 0xFFFFFFFF
_HASH_A, _HASH_B = 0x7FEB352D, 0x31848BAB  # odd multipliers < 2^31 (int64-safe in PyTorch)


@dataclass(frozen=True)
class StateSpec:
    """Static description of a group's flat states (what ``torch.compile`` and the kernels specialise on).

    Attributes:
        block: elements per scaling block (and per layout padding unit).
        num_tensors: parameters in the group.
        granularity: ``"tensor"`` or ``"block"``.
        grad, m, v, master: storage dtypes; ``master=None`` means the working weights are the master
            (bf16 master with stochastic rounding over bf16 parameters). ``grad`` unscaled (bf16/fp32)
            is the framework's gradient gathered flat; scaled (FP8) the hooks' quantized copy.
        stochastic_rounding: round the master (bf16) stochastically.
        eps: amax floor of the scales.
        m_rounding: ``"nearest"`` or ``"stochastic"`` for the stores of ``m``.
        m_expand: ``"none"`` or ``"coat"`` (COAT's dynamic range expansion of ``m``; needs a scaled ``m``).
    """

    block: int
    num_tensors: int
    granularity: str
    grad: torch.dtype
    m: torch.dtype
    v: torch.dtype
    master: torch.dtype | None
    stochastic_rounding: bool
    eps: float = AMAX_EPS
    m_rounding: str = "nearest"
    m_expand: str = "none"


def make_hp(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
            salt: int) -> torch.Tensor:
    """The ``hp`` vector (float32, CPU, ``len(HP_FIELDS)``) of one group's step ``step`` (1-based).

    Bias corrections are computed here in float64 (as ``torch.optim.AdamW`` does on the host):
    ``step_size = lr / (1 - beta1^step)``, ``inv_bc2 = 1 / (1 - beta2^step)``. ``clip`` is 1 (the
    optimizer writes the clip coefficient on the device). ``salt`` (the group index) decorrelates the
    stochastic rounding of groups.

    Raises:
        ValueError: for ``step < 1`` or ``step >= 2**24`` (the step must be exact in float32).
    """
    if not 1 <= step < 2**24:
        raise ValueError(f"FP8AdamW: step {step} must be in [1, 2**24)")
    vals = [lr, beta1, beta2, eps, weight_decay, step, 1.0, lr / (1 - beta1**step), 1 / (1 - beta2**step), salt]
    return torch.tensor(vals, dtype=torch.float32)


def expand_scale(scale: torch.Tensor, owner: torch.Tensor, granularity: str) -> torch.Tensor:
    """Per-block values ``(num_blocks, 1)`` from per-tensor ``(T,)`` or per-block ``(num_blocks,)`` values."""
    return (scale[owner] if granularity == "tensor" else scale)[:, None]


def load(data: torch.Tensor, scale: torch.Tensor | None, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """Float32 values ``(num_blocks, block)`` of a flat state (``data * (1 / scale)`` when scaled)."""
    x = data.view(-1, spec.block).float()
    if scale is None:
        return x
    return x * expand_scale(1 / scale, owner, spec.granularity)


def group_reduce(x: torch.Tensor, owner: torch.Tensor, spec: StateSpec, reduce: str, fill: float) -> torch.Tensor:
    """Per-group reduction (``"amax"``/``"amin"``) of per-block values ``(num_blocks,)``: ``(T,)`` per tensor
    (blocks reduce to their owner, starting from ``fill``) or the values themselves per block."""
    if spec.granularity != "tensor":
        return x
    init = torch.full((spec.num_tensors,), fill, device=x.device, dtype=x.dtype)
    return init.scatter_reduce(0, owner, x, reduce=reduce, include_self=True)


def group_amax(x: torch.Tensor, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """Amax of float32 ``x`` ``(num_blocks, block)`` per scaling group: ``(T,)`` or ``(num_blocks,)``."""
    return group_reduce(x.abs().amax(dim=1), owner, spec, "amax", 0.0)


def group_amin(x: torch.Tensor, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """Smallest nonzero ``|x|`` per scaling group (inf where all are zero), for COAT's ``k``."""
    a = x.abs()
    return group_reduce(torch.where(a > 0, a, torch.inf).amin(dim=1), owner, spec, "amin", math.inf)


def new_scale(x: torch.Tensor, dtype: torch.dtype, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """New scales of float32 ``x`` ``(num_blocks, block)`` for storage ``dtype``: per tensor ``(T,)`` or per
    block ``(num_blocks,)`` float32 (``fp8kit.fp8.scaling.scale_from_amax`` with ``spec.eps``)."""
    return scale_from_amax(group_amax(x, owner, spec), dtype, spec.eps)


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, "lowbias32"-style) of int64 ``x`` in ``[0, 2^32)``;
    values stay in ``[0, 2^32)``. The Triton twin computes it in uint32. (In place on a copy: large CPU
    temporaries cost a page fault each.)"""
    x = x ^ (x >> 16)
    x.mul_(_HASH_A).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_HASH_B).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def uniform_noise(num_blocks: int, block: int, hp: torch.Tensor, noise_delta: torch.Tensor | None = None,
                  owner: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform ``[0, 1)`` float32 ``(num_blocks, block)`` (24-bit resolution) for stochastic rounding:
    ``hash32(index ^ hash32((step << 8) ^ salt)) >> 8`` times ``2^-24``, a function of the step, the group
    (``salt``) and the element's index only, so every implementation draws the same numbers.

    ``index`` is the element's flat index, plus ``noise_delta[t]`` (int64 ``(T,)``, ``owner`` maps blocks
    to tensors) when given: FSDP2 shards pass the offset that makes it the element's index in the
    unsharded group's layout (``optim/sharded.py``), so the numbers do not depend on the sharding."""
    step = hp[HP_FIELDS.index("step")].to(torch.int64)
    salt = hp[HP_FIELDS.index("salt")].to(torch.int64)
    seed = hash32(((step << 8) ^ salt) & _M32)
    idx = torch.arange(num_blocks * block, device=hp.device, dtype=torch.int64)
    if noise_delta is not None:
        idx = (idx.view(num_blocks, block) + noise_delta[owner][:, None]).view(-1)
    idx = idx.bitwise_and_(_M32)
    return (hash32(idx.bitwise_xor_(seed)).bitwise_right_shift_(8).float().mul_(2.0**-24)).view(num_blocks, block)


def round_stochastic(y: torch.Tensor, u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 ``y`` (already within the format's range) rounded stochastically onto ``dtype``'s grid
    (E4M3, E5M2 or FP16, subnormals included), as exact float32 values: ``floor(|y| / ulp + u) * ulp`` with
    the sign of ``y``; ``E[result] = y`` for ``u ~ U[0, 1)``. The ulp is ``2^(max(e, e_min) - mantissa_bits)``
    with ``e = floor(log2 |y|)`` read from the float32 exponent bits (exact)."""
    mant, emin = SR_FORMATS[dtype]
    a = y.abs()
    e = ((a.view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(min=emin)
    ulp = ((e - mant + 127) << 23).view(torch.float32)
    inv_ulp = ((mant - e + 127) << 23).view(torch.float32)
    r = torch.floor(a * inv_ulp + u) * ulp
    return torch.where((y < 0) & (r > 0), -r, r)  # a zero result is +0 (the Triton twin does the same)


def coat_k(amax: torch.Tensor, amin: torch.Tensor) -> torch.Tensor:
    """COAT's exponent per group: ``floor(16 log2(R) / log2(amax / amin)) / 16`` clamped to [1/16, 8]
    (``R = COAT_RANGE``; ``amin`` = smallest nonzero ``|x|``, inf when all are zero: k = 1)."""
    k = torch.floor(math.log2(COAT_RANGE) / torch.log2(amax / amin) * COAT_K_STEPS) / COAT_K_STEPS
    k = k.nan_to_num(nan=COAT_K_MAX, posinf=COAT_K_MAX, neginf=COAT_K_MIN).clamp(COAT_K_MIN, COAT_K_MAX)
    return torch.where(torch.isfinite(amin) & (amax > 0), k, torch.ones_like(k))


def load_m(m: torch.Tensor, m_scale: torch.Tensor | None, m_k: torch.Tensor | None, owner: torch.Tensor,
           spec: StateSpec) -> torch.Tensor:
    """Float32 ``m`` ``(num_blocks, block)``; with COAT's expansion ``sign(y) (MAX / s) (|y| / MAX)^(1/k)``."""
    if m_k is None:
        return load(m, m_scale, owner, spec)
    mx = DTYPE_MAX[spec.m]
    y = m.view(-1, spec.block).float()
    ik = expand_scale(1 / m_k, owner, spec.granularity)
    a = (y.abs() * (1 / mx)) ** ik * expand_scale(mx / m_scale, owner, spec.granularity)
    return torch.where(y < 0, -a, a)


def store_m(x: torch.Tensor, m: torch.Tensor, m_scale: torch.Tensor | None, m_k: torch.Tensor | None,
            owner: torch.Tensor, spec: StateSpec, hp: torch.Tensor, s: torch.Tensor | None = None,
            amin: torch.Tensor | None = None, noise_delta: torch.Tensor | None = None) -> None:
    """Write float32 ``x`` ``(num_blocks, block)`` into ``m`` in place (new scale, ``k``), rounding per
    ``spec.m_rounding`` and expanding per ``spec.m_expand`` (module docstring). ``s`` / ``amin``: the new
    scales / COAT's amin when already known (reduced over FSDP2 shards); ``noise_delta``: :func:`uniform_noise`."""
    sr = spec.m_rounding == "stochastic"
    if m_scale is None:  # bf16 / fp32 m: unscaled
        if sr and spec.m == torch.bfloat16:
            bits = x.contiguous().view(torch.int32)
            noise = (uniform_noise(*x.shape, hp, noise_delta, owner) * 65536).to(torch.int32)
            x = ((bits + noise) & -65536).view(torch.float32)
        m.copy_(x.view(-1).to(m.dtype))
        return
    mx = DTYPE_MAX[spec.m]
    if s is None:
        s = new_scale(x, spec.m, owner, spec)
    y = x * expand_scale(s, owner, spec.granularity)
    if m_k is not None:
        if amin is None:
            amin = group_amin(x, owner, spec)
        k = coat_k(mx / s, amin)
        ya = (y.abs() * (1 / mx)) ** expand_scale(k, owner, spec.granularity) * mx
        y = torch.where(x < 0, -ya, ya)
        m_k.copy_(k)
    y = y.clamp(-mx, mx)
    if sr:
        y = round_stochastic(y, uniform_noise(*x.shape, hp, noise_delta, owner), spec.m)
    m.copy_(y.to(spec.m).view(-1))
    m_scale.copy_(s)


def store(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, owner: torch.Tensor,
          spec: StateSpec, s: torch.Tensor | None = None) -> None:
    """Write float32 ``x`` ``(num_blocks, block)`` into a flat state in place, rounded to nearest (new scales
    when scaled: ``saturate(x * scale)`` cast to the storage dtype; ``s``: the new scales when already known)."""
    if scale is None:
        data.copy_(x.view(-1).to(data.dtype))
        return
    if s is None:
        s = new_scale(x, data.dtype, owner, spec)
    mx = DTYPE_MAX[data.dtype]
    data.copy_((x * expand_scale(s, owner, spec.granularity)).clamp(-mx, mx).to(data.dtype).view(-1))
    scale.copy_(s)


def round_to_bf16_stochastic(x: torch.Tensor) -> torch.Tensor:
    """Round float32 ``x`` to bfloat16 stochastically (unbiased: ``E[round(x)] = x``).

    Adds a uniform random 16-bit integer to the low half of the float32 bit pattern and truncates
    (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision"; the usual bf16 SR trick).
    Finite inputs only.
    """
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def adamw_update(
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    m: torch.Tensor,
    m_scale: torch.Tensor | None,
    m_k: torch.Tensor | None,
    v: torch.Tensor,
    v_scale: torch.Tensor | None,
    master: torch.Tensor | None,
    master_scale: torch.Tensor | None,
    work: torch.Tensor,
    hp: torch.Tensor,
    owner: torch.Tensor,
    spec: StateSpec,
    reduce_amax=None,
    noise_delta: torch.Tensor | None = None,
) -> None:
    """One AdamW step of a flat group, in place on ``m``, ``v``, ``master`` (and scales, ``m_k``) and ``work``.

    Args:
        grad, grad_scale: the flat gradient, FP8 with its scales or unscaled (``grad_scale=None``).
        m, m_scale, m_k: first moment, its scales and COAT exponents (``m_k=None``: no expansion).
        v, master (+ scales): the other states; ``master=None`` when ``work`` is the master.
        work: the flat working weights the model's parameters are views of.
        hp: float32 ``(len(HP_FIELDS),)`` on the device (:func:`make_hp`; ``clip`` written by the caller).
        owner: ``(num_blocks,)`` tensor index of each block.
        reduce_amax: FSDP2 shards (``optim/sharded.py``): called with a float32 ``(k, T)`` tensor of the
            new per-tensor amaxes of the scaled states (and COAT's negated amin), to be MAX-reduced in
            place over the shard group, so every shard scales as the unsharded tensor would. ``None``: one
            process (the amaxes are the tensors' own).
        noise_delta: int64 ``(T,)`` offsets of the stochastic-rounding index (:func:`uniform_noise`).

    The update is ``torch.optim.AdamW``'s (Loshchilov & Hutter 2019, decoupled weight decay):
    ``w <- w (1 - lr wd) - lr / bc1 * m / (sqrt(v / bc2) + eps)`` with ``bc_i = 1 - beta_i^step``,
    evaluated as ``(step_size * m) / (sqrt(v * inv_bc2) + eps)``.
    """
    lr, beta1, beta2, eps, wd, _step, clip, step_size, inv_bc2, _salt = hp.unbind()
    g = load(grad, grad_scale, owner, spec) * clip
    mm = beta1 * load_m(m, m_scale, m_k, owner, spec) + (1 - beta1) * g
    vv = beta2 * load(v, v_scale, owner, spec) + (1 - beta2) * g * g
    w = load(master if master is not None else work, master_scale, owner, spec)
    w = w * (1 - lr * wd) - step_size * mm / ((vv * inv_bc2).sqrt() + eps)
    s_m = s_v = s_w = amin = None
    if reduce_amax is not None:
        s_m, s_v, s_w, amin = reduced_scales(mm, vv, w, m, m_scale, m_k, v, v_scale, master, master_scale,
                                             owner, spec, reduce_amax)
    store_m(mm, m, m_scale, m_k, owner, spec, hp, s_m, amin, noise_delta)
    store(vv, v, v_scale, owner, spec, s_v)
    if spec.stochastic_rounding:
        rounded = round_to_bf16_stochastic(w).view(-1)
        if master is not None:
            master.copy_(rounded.to(master.dtype))
        work.copy_(rounded.to(work.dtype))
        return
    if master is not None:
        store(w, master, master_scale, owner, spec, s_w)
    work.copy_(w.view(-1).to(work.dtype))


def reduced_scales(mm, vv, w, m, m_scale, m_k, v, v_scale, master, master_scale, owner, spec, reduce_amax):
    """Per-tensor scales of the new ``m``, ``v``, ``master`` (None where unscaled) and COAT's amin from
    amaxes MAX-reduced by ``reduce_amax`` over the shards (one call for all of them; see :func:`adamw_update`)."""
    if spec.granularity != "tensor":
        raise ValueError("FP8AdamW: reduced (sharded) scales need granularity = 'tensor'")
    rows = [group_amax(x, owner, spec) for x, sc in ((mm, m_scale), (vv, v_scale), (w, master_scale))
            if sc is not None and not (x is w and spec.stochastic_rounding)]
    if m_k is not None:
        rows.append(-group_amin(mm, owner, spec))  # min over shards = -max(-amin)
    red = torch.stack(rows)
    reduce_amax(red)
    out, i = [], 0
    for sc, data, use in ((m_scale, m, True), (v_scale, v, True), (master_scale, master, not spec.stochastic_rounding)):
        if sc is not None and use:
            out.append(scale_from_amax(red[i], data.dtype, spec.eps))
            i += 1
        else:
            out.append(None)
    out.append(-red[i] if m_k is not None else None)
    return out


def accumulate_gradient(
    grad_seg: torch.Tensor, scale: torch.Tensor, new: torch.Tensor, accumulate: bool, block: int, eps: float
) -> None:
    """Quantize one parameter's gradient into its padded segment of the flat FP8 gradient, in place.

    Args:
        grad_seg: the parameter's padded segment (length a multiple of ``block``) of the FP8 buffer.
        scale: its scales: ``(1,)`` per tensor or ``(len(grad_seg) // block,)`` per block.
        new: the freshly computed gradient (any float dtype, ``numel <= len(grad_seg)``).
        accumulate: add to the segment's current value (gradient accumulation) instead of replacing it.
    """
    x = torch.nn.functional.pad(new.reshape(-1).float(), (0, grad_seg.numel() - new.numel()))
    x = x.view(-1, block) if scale.numel() > 1 else x.view(1, -1)
    if accumulate:
        x = x + grad_seg.view(x.shape).float() * (1 / scale[:, None])
    s = scale_from_amax(x.abs().amax(dim=1), grad_seg.dtype, eps)
    mx = DTYPE_MAX[grad_seg.dtype]
    grad_seg.copy_((x * s[:, None]).clamp(-mx, mx).to(grad_seg.dtype).view(-1))
    scale.copy_(s)
