"""Keep a pretraining step free of host syncs, so the host can queue it while the GPU finishes the last one.

A plain CUDA step of the loop had three points where the host waited for the GPU to drain (the `--trace` of
``benchmarks/step_profile.py``; docs/benchmarks.md section 6, "Session 40"):

1. the batch's copy to the device: a ``non_blocking`` copy from *pageable* host memory is not asynchronous (CUDA
   runtime API, "API synchronization behavior", asynchronous memcpy: "If pageable memory must first be staged to
   pinned memory, the driver may synchronize with the stream"; the trace showed the step's GPU idle on it);
   :func:`batch_to_device` stages it in pinned memory (PyTorch's caching host allocator, which keeps the staging
   block until the copy's event completes), so the copy is queued like a kernel;
2. transformers' packed-sequence check at the start of every decoder's forward
   (``transformers.masking_utils.find_packed_sequence_indices``: ``(mask[:, -1] == 0).all()`` read on the host, the
   ``aten::is_nonzero`` of the trace); :func:`no_packed_sequence_check` skips it where its answer is known;
3. the loss read at the end of the step (``train.async_loss`` defers it by one step).

Each drain leaves the GPU idle while the host launches the next kernels. Measured after the change (H200, session
40): no speed-up on Llama-3-8B layers x 8 or llama-125m, with or without ``train.async_loss``; it is kept because
it costs nothing and a step that reads nothing on the host is what ``train.async_loss`` needs where the host is the
bottleneck.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator

import torch
from transformers import masking_utils


def batch_to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``batch`` (a CPU tensor, e.g. ``[B, T + 1]`` int64 token windows) on ``device`` without a host sync.

    On CUDA the rows are copied into pinned memory first (``Tensor.pin_memory``: a host memcpy of the batch, a few
    hundred KiB for an 8B step's windows) and then copied with ``non_blocking=True``; elsewhere it is a plain copy.
    A tensor already on ``device`` is returned as is.
    """
    if batch.device == device:
        return batch
    if device.type == "cuda" and batch.device.type == "cpu":
        if not batch.is_pinned():
            batch = batch.pin_memory()
        return batch.to(device, non_blocking=True)
    return batch.to(device)


#: Set inside :func:`no_packed_sequence_check` (per thread and task: a forward on another thread keeps the check).
_SKIP_PACKED_CHECK: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8kit_skip_packed_check", default=False)


@contextlib.contextmanager
def no_packed_sequence_check() -> Iterator[None]:
    """Within the block, transformers' packed-sequence check answers "not packed" without reading the GPU.

    Only for a forward whose position ids the model builds itself (no ``position_ids``, no cache, no 2-D attention
    mask): the decoder then makes them ``arange(T)``, for which ``find_packed_sequence_indices`` always returns None
    (every position follows the one before), so the answer, and the mask and attention computed from it, are those
    the check would give, without its ``.all()`` on the host. A forward that passes position ids (fine-tuning's
    packed samples) must run outside this block.

    The first use replaces ``transformers.masking_utils.find_packed_sequence_indices`` (once, for the process) by a
    wrapper that calls the original unless a context variable set by this block says otherwise, so forwards on
    other threads, and nested or interleaved blocks, keep their own answer. Where transformers has no such function
    the block changes nothing (a CPU test, ``tests/test_host_sync.py``, fails when a step syncs again).
    """
    _install()
    token = _SKIP_PACKED_CHECK.set(True)
    try:
        yield
    finally:
        _SKIP_PACKED_CHECK.reset(token)


def _install() -> None:
    """Put :func:`_wrap`'s wrapper in place of transformers' function, once (idempotent)."""
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is not None and not getattr(original, "_fp8kit_wrapped", False):
        masking_utils.find_packed_sequence_indices = _wrap(original)


def _wrap(original: Callable[[torch.Tensor], torch.Tensor | None]) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """``original`` unless :data:`_SKIP_PACKED_CHECK` is set, then None: its answer for ``arange`` position ids."""

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        if _SKIP_PACKED_CHECK.get():
            return None
        return original(position_ids)

    find_packed_sequence_indices._fp8kit_wrapped = True  # type: ignore[attr-defined]
    return find_packed_sequence_indices
