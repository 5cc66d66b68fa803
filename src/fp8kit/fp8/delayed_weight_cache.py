"""The delayed-scaling linear's E4M3 weight, cast once per optimizer step: ``torch.ops.fp8kit.delayed_weight_cached``.

With gradient accumulation (``train.grad_accum > 1``) every micro-batch's forward casts each weight to E4M3 again (the
fprop copy, and the column-major dgrad copy for its backward), though the weight changes only at the optimizer step.
Transformer Engine skips those casts after the first micro-batch (``is_first_microbatch``); so does fp8kit with
``DelayedScaling.cache_weights`` (``prepare_model`` sets it where the weight cache applies: ``train.grad_accum > 1``,
not under FSDP2, whose unsharded weights it would pin, and not with ``train.cuda_graphs``, whose replay would skip the
lookup). Two parts:

- The weight's scale is held for the optimizer step: :meth:`fp8kit.fp8.delayed_state.DelayedScalingState.roll` takes
  the weight row of a record into the history only at the first roll after an optimizer step (the weights changed),
  so each optimizer step's weight amax enters the history once (its last micro-batch's record: the same values every
  micro-batch), and the weight scale computed from the history is the same at every micro-batch of a step. That
  roll also empties the cache (:func:`weight_scales_changed`): a forward between the optimizer step and it (an
  evaluation) cast the new weights at the old scale, in the same optimizer step.
- This op returns ``(w8 [N, K], w8t [K, N], amax [])``, the E4M3 cast of the weight at that scale in both layouts
  (``fp8.kernels.cast_ops.cast_transpose``, on CUDA the triton_op ``fp8kit::cast_transpose_triton``: one read;
  the same bits as the uncached casts) from a :class:`~fp8kit.fp8.weight_cache.WeightCache`: computed at the first micro-batch of an optimizer step, returned as
  they are until the weight changes (its storage, ``_version``, or an optimizer step: the cache's checks). The cache
  ignores the scale argument on a hit: the first part makes it the scale of the miss.

Limits: the weight row advances with ``torch.optim.Optimizer.step()`` calls (a global step hook counts them); weights
updated another way (a hand-written update loop) are cast again (their ``_version`` changes) but keep their first
step's scale, so such a loop must not use the cache. A weight shared by two delayed linears whose weight scales differ
(their histories started at different steps, or two states) is cached once, for the first of them. A linear back in
FP8 from a BF16 phase of the precision schedule casts with its earlier weight scale until the next optimizer step (its
first record comes after the step's first roll).

An update of the weight or of the delayed state that bypasses those checks (a hand-written ``weight.data.copy_``, a
state loaded mid-step) needs :func:`fp8kit.fp8.weight_cache.clear_weight_caches` (``fp8kit train`` calls it after a
checkpoint load). Memory: the two copies (2 bytes per weight element) live from the first micro-batch's forward through
the optimizer step. Tagged ``cudagraph_unsafe``: a CUDA graph replay would skip the lookup.
"""

from __future__ import annotations

import torch

from fp8kit.fp8.kernels.cast_ops import cast_transpose
from fp8kit.fp8.weight_cache import WeightCache

_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)
E4M3 = torch.float8_e4m3fn

Cast = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def weight_cast(w: torch.Tensor, scale: torch.Tensor) -> Cast:
    """The uncached cast a cache miss runs: :func:`cached_weight_cast`'s ``(w8, w8t, amax)`` computed now
    (``fp8.kernels.cast_ops.cast_transpose``, both layouts). ``selective_fp8 = "auto"`` times it (``bench/layers.py``)."""
    return tuple(cast_transpose(w, scale, E4M3, True))


CACHE = WeightCache(weight_cast, "delayed E4M3")


@torch.library.custom_op(
    "fp8kit::delayed_weight_cached", mutates_args=(),
    tags=(_CUDAGRAPH_UNSAFE,) if _CUDAGRAPH_UNSAFE is not None else (),
)
def _cached_op(w: torch.Tensor, scale: torch.Tensor) -> Cast:
    return CACHE.get(w, scale)


@_cached_op.register_fake
def _(w: torch.Tensor, scale: torch.Tensor) -> Cast:
    n, k = w.shape
    return w.new_empty(n, k, dtype=E4M3), w.new_empty(k, n, dtype=E4M3), w.new_empty((), dtype=torch.float32)


def cached_weight_cast(w: torch.Tensor, scale: torch.Tensor) -> Cast:
    """``(w8, w8t, amax)`` of a weight ``w`` ``[N, K]`` (bf16 / fp16 / fp32) at the E4M3 encoding ``scale`` (float32,
    one element): ``w8 = saturate(w * scale) -> E4M3`` ``[N, K]``, ``w8t = w8.T`` contiguous ``[K, N]``,
    ``amax = max |w|`` float32 ``[]``; cast at most once per weight version and optimizer step (module docstring).

    Raises:
        ValueError: ``w`` not 2-D, ``scale`` not one float32 value (``cast_ops.cast_transpose``'s checks).
    """
    return torch.ops.fp8kit.delayed_weight_cached(w, scale)


def weight_scales_changed() -> None:
    """Drop every cached delayed weight: a roll changed the weight scales (``DelayedScalingState.roll`` calls it when
    it takes a weight row into the histories, and after a state load). The cache's own checks see weight and
    optimizer-step changes, not scale changes."""
    CACHE.clear()
