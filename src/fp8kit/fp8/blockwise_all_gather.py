"""FSDP2 all-gather of the blockwise recipe's weights as E4M3 with 128x128 block scales
(``fp8.enable_fsdp_float8_all_gather`` with ``fp8.recipe = "blockwise"``): 1 byte per element plus one float32 per
block (about 0.5x of a BF16 all-gather), and no weight cast in the forward.

Why it is exact: a 128x128 block's scale comes from that block alone (DeepSeek-V3, arXiv:2412.19437, section 3.3;
:func:`fp8kit.fp8.blockwise.quantize_weight`), so when every FSDP2 shard holds whole 128-row blocks (``out_features``
a multiple of 128 x the shard count: FSDP2 shards dim 0 evenly, without padding then), each rank quantizing its
shard makes exactly the bytes and scales of the whole weight's quantization, rows ``[r * N / S, (r + 1) * N / S)``.
FSDP2 gathers both (data and scales concatenate along dim 0), and ``fsdp_post_all_gather`` returns them as a
:class:`~fp8kit.fp8.blockwise_gathered.GatheredBlockwiseWeight`, which the blockwise linear and the fused SwiGLU MLP
take instead of casting (``fp8kit.fp8.kernels.ops.quantize_weight``). A weight whose shards would split a block
keeps the BF16 all-gather (:func:`wrap_weight` says why); so does every weight under tensor parallel (refused at
config load).

The cost sits on the other side of the all-gather: each rank casts its shard on every gather, the forward's and
the backward's (FSDP2 re-gathers for the backward; the BF16 path casts the gathered weight in the forward and its
dgrad copy in the backward too), and the forward transposes the gathered E4M3 data for the dgrad GEMM (one byte
read and written per element). Whether that pays is the interconnect's question: docs/benchmarks.md (section 6).
"""

from __future__ import annotations

from typing import Any

import torch

from fp8kit.fp8.blockwise import BLOCK
from fp8kit.fp8.blockwise_gathered import GatheredBlockwiseWeight
from fp8kit.fp8.fsdp_weight import FP8AllGatherWeight
from fp8kit.fp8.kernels import ops
from fp8kit.fp8.linear import Float8BlockwiseLinear


class BlockwiseFloat8Weight(FP8AllGatherWeight):
    """A blockwise linear's weight (or its FSDP2 shard) whose all-gather is its 128x128-block E4M3 quantization
    (module docstring). Every other op sees the wrapped tensor (:class:`~fp8kit.fp8.fsdp_weight.FP8AllGatherWeight`)."""

    def fsdp_pre_all_gather(self, mesh) -> tuple[tuple[torch.Tensor, ...], Any]:
        """``(wq, ws)`` of the shard: E4M3 ``[N/S, K]`` and float32 ``[N/(128 S), L4(K/128)]`` (the whole weight's
        rows and block rows of this rank)."""
        wq, ws, _, _ = ops.quantize_weight(self._tensor, cache=False)
        return (wq, ws), None

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        """The unsharded weight: a :class:`GatheredBlockwiseWeight` of the gathered data and scales. FSDP2 refills
        the same buffers on a later gather (``out`` given): nothing to update then."""
        data, scale = all_gather_outputs
        if out is not None:
            return None
        return GatheredBlockwiseWeight(data, scale, param_dtype), (data, scale)


def shard_problem(out_features: int, shards: int) -> str | None:
    """Why a ``[out_features, K]`` weight's FSDP2 shards (``shards`` of them along dim 0) cannot be all-gathered as
    128x128 blocks, or None when they can."""
    if out_features % (BLOCK * shards):
        return (f"out_features {out_features} is not a multiple of 128 x {shards} shards: a shard would split a "
                f"128x128 block")
    return None


def wrap_weight(module: torch.nn.Module, shards: int) -> str | None:
    """Make ``module.weight`` (a blockwise linear's) a :class:`BlockwiseFloat8Weight` Parameter, before
    ``fully_shard`` and before the optimizer is built, when its ``shards`` FSDP2 shards hold whole blocks.
    Idempotent. Returns None when wrapped, else the reason it keeps the BF16 all-gather."""
    w = module.weight
    if isinstance(w.data, BlockwiseFloat8Weight):
        return None
    problem = shard_problem(w.shape[0], shards)
    if problem is None:
        module.weight = torch.nn.Parameter(BlockwiseFloat8Weight(w.data), requires_grad=w.requires_grad)
    return problem


def gather_notes(model: torch.nn.Module, shards: int) -> tuple[list[str], list[str]]:
    """After :func:`wrap_weight` ran on ``model``'s blockwise linears: ``(facts, warnings)`` for the run's log, how
    many all-gather FP8 blocks, and one warning per reason some keep the BF16 all-gather (count and an example)."""
    kept: dict[str, list[str]] = {}
    total = 0
    for name, m in model.named_modules():
        if isinstance(m, Float8BlockwiseLinear):
            total += 1
            if not isinstance(m.weight.data, BlockwiseFloat8Weight):
                kept.setdefault(shard_problem(m.weight.shape[0], shards) or "not wrapped", []).append(name)
    wrapped = total - sum(len(v) for v in kept.values())
    facts = [f"fp8.enable_fsdp_float8_all_gather: {wrapped} of {total} blockwise linears all-gather their 128x128-block "
             f"E4M3 quantization (fp8kit.fp8.blockwise_all_gather)"] if total else []
    return facts, [f"fp8.enable_fsdp_float8_all_gather: {len(names)} of {total} blockwise linears keep the BF16 "
                   f"all-gather ({reason}), e.g. {names[0]}" for reason, names in sorted(kept.items())]
