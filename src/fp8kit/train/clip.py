"""Gradient-norm clipping on the training-speed path, for one process and for FSDP2 / TP / EP alike.

The formula is ``torch.nn.utils.clip_grad_norm_``'s: total L2 norm over every gradient, coefficient
``max_norm / (norm + 1e-6)`` clamped to at most 1.

- **Plain tensors + fused AdamW**: ``clip_grad_norm_`` reads every gradient to take the norm, then reads and
  writes every gradient again to scale it (for N bf16 parameters that second pass moves 4N bytes). The
  fused AdamW kernel already divides each gradient by ``optimizer.grad_scale`` (the mechanism
  ``torch.amp.GradScaler`` uses), so we set ``grad_scale = max(1, (norm + 1e-6) / max_norm)`` and the
  separate scaling pass disappears.
- **FP8AdamW** takes the norm itself (of ``param.grad``, or of its FP8 gradient buffer) and applies the
  coefficient inside its fused step (a device tensor: no host synchronisation).
- **DTensor gradients** (FSDP2, TP, expert-parallel shards): gradients are grouped by device mesh and
  placements; each group's norm is taken with ``torch.nn.utils.get_total_norm`` (a DTensor, made whole with
  ``full_tensor``: DTensor reduces over the right ranks), the group norms combine as
  ``sqrt(sum(norm_g ** 2))``, and ``clip_grads_with_norm_`` scales each group.
"""

from __future__ import annotations

import math

import torch

from fp8kit.optim import FP8AdamW


def clip_grad_norm(params: list[torch.Tensor], max_norm: float, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Return the global L2 norm of the gradients and clip them to ``max_norm`` (0 or inf: no clipping).

    Args:
        params: the parameters whose ``.grad`` to clip (plain tensors or DTensors).
        max_norm: the clipping threshold.
        optimizer: the optimizer about to step; a fused Adam/AdamW over plain tensors scales inside its
            kernel through ``optimizer.grad_scale``, FP8AdamW inside its step (module docstring).

    Returns:
        The total norm before clipping (0-dim float32 tensor, the same on every rank).
    """
    if isinstance(optimizer, FP8AdamW):  # it clips inside its step (and may hold the gradients in FP8)
        return optimizer.clip_grad_norm_(max_norm)
    from torch.distributed.tensor import DTensor

    with_grad = [p for p in params if p.grad is not None]
    if any(isinstance(p.grad, DTensor) for p in with_grad):
        return _clip_dtensor_groups(with_grad, max_norm)
    norm = torch.nn.utils.get_total_norm([p.grad for p in with_grad], norm_type=2.0, foreach=True)
    if not max_norm or math.isinf(max_norm):
        return norm
    if optimizer.defaults.get("fused") and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        optimizer.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
    else:
        torch.nn.utils.clip_grads_with_norm_(with_grad, max_norm, norm, foreach=True)
    return norm


def _clip_dtensor_groups(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Norm and clip over gradients of several meshes / placements (module docstring)."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    norms = []
    for ps in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], norm_type=2.0, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if max_norm and not math.isinf(max_norm):
        for ps in groups.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)
    return total
