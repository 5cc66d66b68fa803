"""One call's unified scale ``mu_g`` (FP8-LM auto-scaling + scale unification) and the key's next state.

Shared by :func:`fp8kit.comm.fp8_all_reduce` and :class:`fp8kit.comm.Fp8ReduceScatter`; the rule is in
:mod:`fp8kit.comm.autoscale`, the math in :mod:`fp8kit.comm.allreduce_ops` (``scale_vec`` / ``scale_update``:
two Triton launches on CUDA, their references elsewhere). Per call, on every rank of the group (float64 device
scalars, no host sync)::

    vec  = [cand, -n_sat/n, -amax (0 if n_bad), -(n_bad > 0)]    stats of f32(g) * f32(mu), one read of g
    all-reduce MIN of vec                                         (32 bytes)
    mu_g = cand_g if initialised else mu0 = FP8_MAX / global amax (one float32 ulp down if needed)
    next values: halve on saturation, initialise, count quiet steps, grow (unchanged if any rank saw inf/NaN)

The next values depend only on all-reduced numbers, so every rank keeps the same ``mu`` and counters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8kit.comm import allreduce_ops as ops
from fp8kit.comm import eager
from fp8kit.comm.autoscale import AutoScaleState

#: ``params`` tensors by (device, stream, options): made once, so a call copies nothing from the host (one per
#: CUDA stream, so that a tensor is never read on another stream than the one its host-to-device copy ran on).
_PARAMS: dict[tuple, torch.Tensor] = {}


def params_tensor(st: AutoScaleState, device: torch.device) -> torch.Tensor:
    """``[delta, backoff, growth_factor, mu_max, growth_interval]`` of ``st`` as float64 ``(5,)`` on ``device``."""
    vals = (st.delta, st.backoff, st.growth_factor, st.mu_max, float(st.growth_interval))
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, *vals)
    t = _PARAMS.get(key)
    if t is None:
        t = _PARAMS[key] = torch.tensor(vals, dtype=torch.float64, device=device)
    return t


def unify_scale(src: torch.Tensor, st: AutoScaleState, key: str | int, group: dist.ProcessGroup | None, *,
                reference: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unified scale of this call for ``src`` (contiguous 1-D, this rank's gradient, non-empty).

    Creates (or resets, when the numel changed) the key's values (``st._values``), builds this rank's vector,
    all-reduces it (MIN) over ``group`` and returns ``(scale, out_scale, new_values)`` of
    :func:`fp8kit.comm.allreduce_ops.scale_update`; the caller stores ``new_values`` (``st._store``) once the
    call's collectives are queued. ``reference`` runs the PyTorch references instead of the ops.
    """
    fp8 = st.dtype
    values = st._values(key, src.numel(), src.device)  # float64[6]: mu, steps_below, halvings, growths, init, sat
    params = params_tensor(st, src.device)
    vec = (ops.scale_vec_ref if reference else eager.scale_vec)(src, values, params, fp8)
    dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)  # unified mu, max fraction, global amax, any bad
    return (ops.scale_update_ref if reference else eager.scale_update)(vec, values, params, fp8)
