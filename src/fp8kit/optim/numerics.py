"""The FP8AdamW math on flat buffers: scaled load/store, stochastic rounding, the AdamW update.

Pure tensor functions (no Python control flow on tensor values), so that ``torch.compile`` fuses one
optimizer step of a whole parameter group into a few kernels on CUDA; on CPU they run eagerly. A scaled
state is ``(data, scale)`` with value ``data / scale`` (FP8-LM, arXiv:2310.18313, section 2.1;
``fp8kit.fp8.scaling``), with one scale per tensor (``granularity="tensor"``, the paper's choice) or per
``block`` elements (``"block"``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8kit.fp8.scaling import AMAX_EPS, quantize, scale_from_amax


@dataclass(frozen=True)
class StateSpec:
    """Static description of a group's flat states (what ``torch.compile`` specialises on).

    Attributes:
        block: elements per scaling block (and per layout padding unit).
        num_tensors: parameters in the group.
        granularity: ``"tensor"`` or ``"block"``.
        grad, m, v, master: storage dtypes; ``master=None`` means the working weights are the master
            (bf16 master with stochastic rounding over bf16 parameters).
        stochastic_rounding: round the master (bf16) stochastically.
        eps: amax floor of the scales.
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


def expand_scale(scale: torch.Tensor, owner: torch.Tensor, granularity: str) -> torch.Tensor:
    """Per-block scales ``(num_blocks, 1)`` from per-tensor ``(T,)`` or per-block ``(num_blocks,)`` scales."""
    return (scale[owner] if granularity == "tensor" else scale)[:, None]


def load(data: torch.Tensor, scale: torch.Tensor | None, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """Float32 values ``(num_blocks, block)`` of a flat state (``data / scale`` when scaled)."""
    x = data.view(-1, spec.block).float()
    if scale is None:
        return x
    return x / expand_scale(scale, owner, spec.granularity)


def new_scale(x: torch.Tensor, dtype: torch.dtype, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """New scales of float32 ``x`` ``(num_blocks, block)`` for storage ``dtype``: per tensor ``(T,)`` or per
    block ``(num_blocks,)`` float32 (``fp8kit.fp8.scaling.scale_from_amax`` with ``spec.eps``)."""
    amax = x.abs().amax(dim=1)
    if spec.granularity == "tensor":
        amax = torch.zeros(spec.num_tensors, device=x.device, dtype=amax.dtype).scatter_reduce(
            0, owner, amax, reduce="amax", include_self=True
        )
    return scale_from_amax(amax, dtype, spec.eps)


def store(
    x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor | None, owner: torch.Tensor, spec: StateSpec
) -> None:
    """Write float32 ``x`` ``(num_blocks, block)`` into a flat state in place (new scales when scaled)."""
    if scale is None:
        data.copy_(x.view(-1).to(data.dtype))
        return
    s = new_scale(x, data.dtype, owner, spec)
    data.copy_(quantize(x, expand_scale(s, owner, spec.granularity), data.dtype).view(-1))
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
    grad_scale: torch.Tensor,
    m: torch.Tensor,
    m_scale: torch.Tensor | None,
    v: torch.Tensor,
    v_scale: torch.Tensor | None,
    master: torch.Tensor | None,
    master_scale: torch.Tensor | None,
    work: torch.Tensor,
    hp: torch.Tensor,
    owner: torch.Tensor,
    spec: StateSpec,
) -> None:
    """One AdamW step of a flat group, in place on ``m``, ``v``, ``master`` (and scales) and ``work``.

    Args:
        grad, grad_scale: the FP8 gradient and its scales (``grad_scale=None``: unscaled gradient).
        m, v, master (+ scales): the states; ``master=None`` when ``work`` is the master.
        work: the flat working weights the model's parameters are views of.
        hp: float32 ``(7,)`` on the device: lr, beta1, beta2, eps, weight_decay, step, clip coefficient.
        owner: ``(num_blocks,)`` tensor index of each block.

    The update is ``torch.optim.AdamW``'s (Loshchilov & Hutter 2019, decoupled weight decay):
    ``w <- w (1 - lr wd) - lr / bc1 * m / (sqrt(v / bc2) + eps)`` with ``bc_i = 1 - beta_i^step``.
    """
    lr, beta1, beta2, eps, wd, step, clip = hp.unbind()
    g = load(grad, grad_scale, owner, spec) * clip
    mm = beta1 * load(m, m_scale, owner, spec) + (1 - beta1) * g
    vv = beta2 * load(v, v_scale, owner, spec) + (1 - beta2) * g * g
    w = load(master if master is not None else work, master_scale, owner, spec)
    w = w * (1 - lr * wd) - (lr / (1 - beta1**step)) * mm / ((vv / (1 - beta2**step)).sqrt() + eps)
    store(mm, m, m_scale, owner, spec)
    store(vv, v, v_scale, owner, spec)
    if spec.stochastic_rounding:
        rounded = round_to_bf16_stochastic(w).view(-1)
        if master is not None:
            master.copy_(rounded.to(master.dtype))
        work.copy_(rounded.to(work.dtype))
        return
    if master is not None:
        store(w, master, master_scale, owner, spec)
    work.copy_(w.view(-1).to(work.dtype))


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
        x = x + grad_seg.view(x.shape).float() / scale[:, None]
    s = scale_from_amax(x.abs().amax(dim=1), grad_seg.dtype, eps)
    grad_seg.copy_(quantize(x, s[:, None], grad_seg.dtype).view(-1))
    scale.copy_(s)
