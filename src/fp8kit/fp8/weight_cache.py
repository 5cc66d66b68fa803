"""Quantized weights kept across gradient-accumulation micro-batches: one cast per weight version.

The FP8 copies of a weight depend only on its values, which change once per optimizer step; with gradient
accumulation a layer runs its forward (and its dgrad) once per micro-batch. A :class:`WeightCache` wraps one
quantization function ``quantize(w) -> tuple of tensors`` and reuses its result for ``w`` while all three hold:

(a) the weight's storage is the same object (a weak reference: a new tensor at a recycled address,
    or ``param.data = new_tensor``, misses);
(b) ``weight._version`` is unchanged (in-place updates through autograd-visible ops bump it:
    ``copy_``, ``load_state_dict``, foreach / for-loop optimizers);
(c) no ``torch.optim.Optimizer.step()`` ran since the entry was made: a global optimizer step
    post-hook (``register_optimizer_step_post_hook``, installed on first use) bumps a generation
    counter. This is needed: the fused AdamW / SGD kernels (``fused=True``) update parameters in place
    WITHOUT bumping ``_version``, and FSDP2 writes unsharded parameters under
    ``_unsafe_preserve_version_counter``.

An update that bypasses all three (``weight.data.copy_(...)`` outside an optimizer step, e.g. a hand-written EMA)
is not seen: call :func:`clear_weight_caches` after it (``fp8kit train`` does after loading a checkpoint).
Entries are keyed on (device, data pointer, shape, stride, dtype); an entry is dropped when its storage is freed
(a weak-reference callback: no sweep over the entries, whose number grows with per-expert keys, e.g. 48 layers x 128
experts x 2 weights of blockwise MoE experts). A cache made with ``requantize`` computes a new version of a weight it holds an outdated entry of
as ``requantize(w, outdated_result)`` (the MoE expert weights: cast with the previous step's scales as hints, one
read instead of two; the same bits). Used by the blockwise linear (:mod:`fp8kit.fp8.kernels.ops`, 128x128 copies), the fused
rowwise MoE experts (:mod:`fp8kit.moe.fused_experts`, fprop + dgrad copies of the 3-D expert weights) and the
delayed-scaling linear (:mod:`fp8kit.fp8.delayed_weight_cache`: E4M3 copies at a weight scale held for the optimizer
step).
Memory: an entry holds the FP8 copies (2 bytes per weight element for two layouts) from the forward through
the optimizer step, where without the cache the dgrad copy lives from forward to backward only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_REGISTRY: list[WeightCache] = []
_GENERATION = [0]  # optimizer steps seen (one counter for every cache)
_HOOK: list = []


def _step_done(*_args) -> None:
    _GENERATION[0] += 1


@dataclass
class _Entry:
    storage: weakref.ref
    version: int
    generation: int
    out: tuple[torch.Tensor, ...]


class WeightCache:
    """The results of ``quantize(w)`` by weight, valid while the weight is unchanged (module docstring).

    Args:
        quantize: ``(w, *args) -> tuple of tensors`` (the FP8 copies and their scales); must not depend on anything
            but ``w``'s values and ``args`` (:meth:`get`).
        name: for :func:`weight_cache_stats`.
        requantize: ``(w, outdated) -> quantize(w)``, given the outdated result for the same storage (for instance
            to reuse its scales as hints); None: always ``quantize(w)``.
    """

    def __init__(self, quantize: Callable[..., tuple[torch.Tensor, ...]], name: str,
                 requantize: Callable[[torch.Tensor, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]] | None = None
                 ) -> None:
        self.quantize, self.name, self.requantize = quantize, name, requantize
        self.entries: dict[tuple, _Entry] = {}
        self.hits = 0
        self.misses = 0
        self.requantized = 0  # misses computed by requantize
        _REGISTRY.append(self)

    def get(self, w: torch.Tensor, *args) -> tuple[torch.Tensor, ...]:
        """``quantize(w, *args)``, computed at most once per weight version and optimizer step. ``args`` (e.g. the
        delayed recipe's weight scale) are the caller's promise: constant while the weight and the optimizer step
        are (a hit ignores them)."""
        install_step_hook()
        key = (w.device, w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype)
        storage = w.untyped_storage()
        entry = self.entries.get(key)
        if (entry is not None and entry.storage() is storage and entry.version == w._version
                and entry.generation == _GENERATION[0]):
            self.hits += 1
            return entry.out
        self.misses += 1
        outdated = entry is not None and entry.storage() is storage and self.requantize is not None
        self.requantized += outdated
        out = self.requantize(w, entry.out) if outdated else self.quantize(w, *args)
        del entry
        self.entries[key] = _Entry(weakref.ref(storage, self._dropper(key)), w._version, _GENERATION[0], out)
        return out

    def _dropper(self, key: tuple) -> Callable[[weakref.ref], None]:
        """The callback of an entry's storage reference: drops the entry when its storage is freed (unless the key
        holds a newer entry by then: a new weight at a recycled address). Holds the cache weakly."""
        cache = weakref.ref(self)

        def drop(ref: weakref.ref) -> None:
            me = cache()
            entry = None if me is None else me.entries.get(key)
            if entry is not None and entry.storage is ref:
                del me.entries[key]

        return drop

    def clear(self) -> None:
        """Drop every entry of this cache."""
        self.entries.clear()

    def stats(self) -> dict[str, int]:
        """``{"hits", "misses", "requantized", "entries"}`` since the process started (``requantized``: misses
        computed from an outdated entry by ``requantize``)."""
        return {"hits": self.hits, "misses": self.misses, "requantized": self.requantized,
                "entries": len(self.entries)}


def install_step_hook() -> None:
    """Count optimizer steps from now on (the global step post-hook, installed once; :func:`optimizer_steps`)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_post_hook(_step_done))


def optimizer_steps() -> int:
    """``torch.optim.Optimizer.step()`` calls counted since :func:`install_step_hook` (every cache's generation)."""
    return _GENERATION[0]


def clear_weight_caches() -> None:
    """Drop every cached quantized weight of every cache (call after an update that bypasses the checks)."""
    for cache in _REGISTRY:
        cache.clear()
