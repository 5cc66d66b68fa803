"""FP8 gradient reduce-scatter for FSDP2: the FP8-LM reduction of :func:`fp8kit.comm.fp8_all_reduce`, without the all-gather.

FSDP2 reduces each module's flat gradient buffer ``[N * c]`` (its ``reduce_dtype``) into this rank's shard
``[c]`` with one reduce-scatter per backward. ``FSDPModule.set_custom_reduce_scatter(comm)`` (torch >= 2.9,
``torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter``: ``allocate(size, dtype=, device=)`` and
``comm(output_tensor, input_tensor, group, op, async_op=False)``) replaces it. :class:`Fp8ReduceScatter` does,
per call and per rank (the passes of :mod:`fp8kit.comm.allreduce_ops`: Triton on CUDA, PyTorch elsewhere)::

    mu_g = unified scale of the whole input [N * c]      stats + one MIN all-reduce of 4 float64 (comm.unify)
    q    = FP8(saturate(f32(input) * f32(mu_g)))         [N * c] bytes
    all_to_all_single(q)                                 rank r receives chunk r of every rank   [N, c]
    out  = ((q_0 + ... + q_{N-1}) * f32(mul)) / f32(mu_g) in float32, rank order, cast to out's dtype

``mul`` follows FSDP's ``op``: ``AVG`` -> ``1/N`` (the mean; FSDP2's default for bf16 / fp32 reduce dtypes),
``SUM`` -> 1 (FSDP then divides by its pre/post factors itself), ``PREMUL_SUM(f)`` -> ``f`` (a
``set_gradient_divide_factor``). With ``AutoScaleState(scaling="delayed")`` an initialised key quantizes with
its ``mu`` in the pass that measures the input, and the statistics' MIN all-reduce is queued behind the
all-to-all (:mod:`fp8kit.comm.autoscale`). The shard is written at full precision from the float32 sum: one FP8 rounding
per rank's value (the all-reduce has a second one, for its all-gather). The auto-scaling rule, the non-finite
rule (NaN everywhere, state unchanged) and the state are those of ``fp8_all_reduce``; each FSDP module keeps
its own ``mu`` under the key ``"fsdp:<module fqn>"``. Bytes per rank and call: ``(N-1) c`` plus 32 for the
scalars, half of a bf16 reduce-scatter's ``2 (N-1) c`` (counted in ``state.bytes_sent`` /
``state.bf16_ring_bytes``).

Use :func:`apply_fp8_reduce_scatter` after ``fully_shard``; ``fp8kit train`` does with
``distributed.fp8_reduce_scatter = "e5m2"`` (or ``"e4m3"``) and saves the state in its checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from fp8kit.comm import allreduce_ops as ops
from fp8kit.comm import eager
from fp8kit.comm.autoscale import AutoScaleState, ring_allreduce_bytes
from fp8kit.comm.unify import params_tensor, unify_scale

try:  # torch >= 2.9 (FSDP2's pluggable collectives); checked again where it is needed
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterBase
except ImportError:  # pragma: no cover - older torch
    _ReduceScatterBase = object

_NEEDS = ("FSDPModule.set_custom_reduce_scatter and torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter "
          "(torch >= 2.9)")


def fsdp_custom_reduce_scatter_support() -> tuple[bool, str]:
    """Whether this torch lets FSDP2 use a custom reduce-scatter: ``(ok, reason)``, the reason naming the version."""
    from torch.distributed.fsdp import FSDPModule

    if _ReduceScatterBase is object or not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        return False, f"torch {torch.__version__} lacks {_NEEDS}"
    return True, ""


class Fp8ReduceScatter(_ReduceScatterBase):
    """FSDP2 reduce-scatter through FP8 with auto-scaling (module docstring); one per FSDP module.

    Args:
        state: the ``AutoScaleState`` holding ``mu`` (its ``process_group`` is not used: FSDP passes its group).
        key: this module's key in ``state`` (str or int).
        reference: run the plain PyTorch passes also on CUDA (same bits; for tests and benchmarks).

    Raises:
        RuntimeError: this torch has no pluggable FSDP2 reduce-scatter (the message names the version).
        ValueError: ``state`` not an ``AutoScaleState`` or ``key`` not a str or int.
    """

    def __init__(self, state: AutoScaleState, key: str | int = "fsdp", *, reference: bool = False) -> None:
        ok, why = fsdp_custom_reduce_scatter_support()
        if not ok:
            raise RuntimeError(f"Fp8ReduceScatter: {why}")
        if not isinstance(state, AutoScaleState):
            raise ValueError(f"Fp8ReduceScatter: state must be an AutoScaleState, got {type(state).__name__}")
        if isinstance(key, bool) or not isinstance(key, str | int):
            raise ValueError(f"Fp8ReduceScatter: key must be a str or int, got {key!r}")
        self.state, self.key, self.reference = state, key, reference

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer from the caching allocator (FSDP2 asks for its reduce-scatter input and output)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> None:
        """Reduce ``input_tensor [N * c]`` into ``output_tensor [c]`` (this rank's shard) through FP8.

        Runs synchronously on the current stream (FSDP2 calls it on its reduce-scatter stream without
        ``async_op``); returns None. ``async_op=True`` is refused.

        Raises:
            ValueError: ``async_op``; an ``op`` other than AVG, SUM or PREMUL_SUM; shapes that are not
                ``[N * c]`` -> ``[c]``; non-contiguous or non-float tensors.
        """
        where = f"Fp8ReduceScatter[{self.key!r}]"
        if async_op:
            raise ValueError(f"{where}: async_op=True is not supported (the FP8 reduction runs synchronously)")
        world = dist.get_world_size(group)
        src, out = input_tensor.reshape(-1), output_tensor
        if not (input_tensor.is_contiguous() and out.is_contiguous()) or src.dtype not in ops._FLOATS:
            raise ValueError(f"{where}: need contiguous float tensors, got input {input_tensor.dtype} "
                             f"{tuple(input_tensor.shape)} and output {out.dtype} {tuple(out.shape)}")
        if src.numel() != world * out.numel():
            raise ValueError(f"{where}: input has {src.numel()} elements, need world size {world} x output's "
                             f"{out.numel()}")
        mul = _multiplier(op, world, where)
        if src.numel() == 0:
            return None
        if world == 1:  # the sum over one rank is the input itself
            out.copy_(src.float() * torch.tensor(mul, dtype=torch.float32).item())
            return None
        st, fp8, ref = self.state, self.state.dtype, self.reference
        q = torch.empty(src.numel(), dtype=torch.uint8, device=src.device)
        recv = torch.empty_like(q)
        if st._delayed_ready(self.key, src.numel()):  # quantize with mu now; the statistics' MIN rides behind
            values, params = st._values(self.key, src.numel(), src.device), params_tensor(st, src.device)
            vec = torch.empty(4, dtype=torch.float64, device=src.device)
            (ops.quantize_stats_ref if ref else eager.quantize_stats)(src, values, params, q, vec, fp8)
            sent = dist.all_to_all_single(recv, q, group=group, async_op=True)
            dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)
            sent.wait()
            out_scale, new_values = (ops.scale_update_delayed_ref if ref else eager.update_delayed)(
                vec.view(1, 4), values, params, fp8)
        else:
            scale, out_scale, new_values = unify_scale(src, st, self.key, group, reference=ref)
            (ops.quantize_ref if ref else eager.quantize)(src, scale, q, fp8)
            dist.all_to_all_single(recv, q, group=group)  # gloo / NCCL have no float8 dtypes: bytes
        (ops.sum_dequant_ref if ref else eager.sum_dequant)(recv, out_scale, out.view(-1), world, mul, fp8)
        c = out.numel()
        st._store(self.key, new_values, (world - 1) * c + ring_allreduce_bytes(4, world, 8), 2 * (world - 1) * c)
        return None


def _multiplier(op: object, world: int, where: str) -> float:
    """The factor on the sum that FSDP's ``op`` asks for: AVG ``1/N``, SUM 1, PREMUL_SUM its factor."""
    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM) carries its type in .op
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor) and factor.numel() == 1:
            factor = factor.item()
        if not isinstance(factor, int | float):
            raise ValueError(f"{where}: PREMUL_SUM without a readable scalar factor (got {factor!r}) in torch "
                             f"{torch.__version__}")
        return float(factor)
    raise ValueError(f"{where}: reduce op {op!r} is not supported (AVG, SUM or PREMUL_SUM)")


def apply_fp8_reduce_scatter(model: nn.Module, state: AutoScaleState, *, reference: bool = False) -> list[str]:
    """Make every FSDP2 module of ``model`` reduce its gradients through :class:`Fp8ReduceScatter`.

    Call after ``fully_shard`` (and before the first backward). Each ``FSDPModule`` (the root included) gets its
    own comm with key ``"fsdp:<fqn>"`` in ``state`` (``"fsdp:"`` for the root); save ``state.state_dict()``
    with the checkpoint to resume the auto-scaling. Every rank must call it alike.

    Args:
        model: a model sharded with ``torch.distributed.fsdp.fully_shard``.
        state: the ``AutoScaleState`` (its ``fp8_dtype``: E5M2 by default, the gradient format).
        reference: force the plain PyTorch passes (same bits as the kernels).

    Returns:
        The fqns of the modules that got the comm ("" for the root).

    Raises:
        RuntimeError: this torch has no ``FSDPModule.set_custom_reduce_scatter`` (needs torch >= 2.9).
        ValueError: ``model`` holds no FSDP module; ``state`` not an ``AutoScaleState``; torch's own refusal of a
            module with several parameter groups.
    """
    ok, why = fsdp_custom_reduce_scatter_support()
    if not ok:
        raise RuntimeError(f"apply_fp8_reduce_scatter: {why}")
    from torch.distributed.fsdp import FSDPModule

    names = []
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(Fp8ReduceScatter(state, f"fsdp:{fqn}", reference=reference))
            names.append(fqn)
    if not names:
        raise ValueError("apply_fp8_reduce_scatter: the model has no FSDP2 module (call fully_shard first)")
    return names
