"""The blockwise FP8 linear layer: an autograd Function (fprop / dgrad / wgrad) and its ``nn.Module``.

Numerics, layouts and sources: :mod:`fp8kit.fp8.blockwise` (DeepSeek-V3, arXiv:2412.19437, section
3.3). The three GEMMs of ``y = x @ w^T + b``:

- fprop ``y = x @ w^T``: ``x`` 1x128 along K, ``w`` 128x128 (cached per weight version).
- dgrad ``dx = dy @ w``: ``dy`` 1x128 along N, ``w^T`` the same 128x128 blocks (the cached ``[K, N]`` copy).
- wgrad ``dw = dy^T @ x``: ``dy^T`` and ``x^T`` 1x128 along M, i.e. 128x1 blocks of ``dy`` and ``x``; with
  ``wgrad_x="128x128"`` the ``x^T`` copy has 128x128 blocks (cuBLAS's faster 1x128 x 128x128 kernel; the trade-off
  is in :mod:`fp8kit.fp8.blockwise`).

By default the forward saves only the FP8 ``x^T`` copy (and the FP8 ``w^T`` copy), not the BF16 input.
``keep_input_copy=False`` / ``keep_weight_copy=False`` save the BF16 input / the weight instead and quantize them
again in the backward (the same bits): the step holds both anyway (the norm, SwiGLU and attention backward save
the inputs of the linears or what they are recomputed from, and the weight is a parameter), so the layer then adds
nothing to the activation memory, at the price of one more cast of each in the backward. The bias is added, and its
gradient reduced, in the input's precision outside the FP8 GEMMs.

Tensor parallel (``fp8kit.parallel.tp_own``): when the weight is a DTensor sharded over a ``tp`` mesh, the
module runs :func:`sharded_linear`: the FP8 ops see this rank's local shards only (``to_local()``) and the
output is wrapped back as a DTensor with the placement the weight's sharding implies; fp8kit's delayed
linear (``fp8.delayed``) uses the same bridge.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fp8kit.fp8.blockwise import BLOCK, check_linear_shape, check_wgrad_x, quantize_act_wgrad, wgrad_x_block
from fp8kit.fp8.kernels import ops


class _BlockwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cache_weight: bool, emulate: bool, keep_weight_copy: bool,
                keep_input_copy: bool = True, wgrad_x: str = "128x1"):
        n, k = weight.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if keep_input_copy:
            xq, xs_t, xtq, xts = ops.quantize_act(x2, wgrad_x)
        else:  # the x^T copy is cast again in the backward: the forward writes the fprop copy only
            xq, xs_t = ops.quantize_act_fprop(x2)
        wq, ws, wtq, wts = ops.quantize_weight(weight, cache_weight)
        y = ops.blockwise_mm(xq, xs_t, wq, ws, BLOCK, x.dtype, emulate)[:m]
        if bias is not None:
            y = y + bias.to(y.dtype)
        # The dgrad copy of the weight: kept from forward to backward (1 byte per weight element), or quantized
        # again in backward (FSDP2: from the re-gathered weight; fp8.blockwise_recompute: to hold no copy).
        ctx.keep = keep_weight_copy or cache_weight  # a cached copy lives in the cache anyway
        # The wgrad copy of the input: kept (1 byte per element), or quantized again in backward from the input.
        ctx.keep_x = keep_input_copy
        ctx.wgrad_x = wgrad_x
        ctx.save_for_backward(*((xtq, xts) if keep_input_copy else (x2,)), *((wtq, wts) if ctx.keep else (weight,)))
        ctx.shape = (lead, m, n, k)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.emulate = emulate
        return y.reshape(*lead, n)

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        x_saved, w = (saved[:2], saved[2:]) if ctx.keep_x else (saved[:1], saved[1:])
        lead, m, n, k = ctx.shape
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dy2 = dy.reshape(-1, n)
        dyq, dys_t, dytq, dyts = ops.quantize_act(dy2)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            wtq, wts = w if ctx.keep else ops.quantize_weight_dgrad(w[0])
            dx = ops.blockwise_mm(dyq, dys_t, wtq, wts, BLOCK, x_dtype, ctx.emulate)[:m].reshape(*lead, k)
        if ctx.needs_input_grad[1]:
            xtq, xts = x_saved if ctx.keep_x else _wgrad_copy(x_saved[0], ctx.wgrad_x)
            dw = ops.blockwise_mm(dytq, dyts, xtq, xts, wgrad_x_block(ctx.wgrad_x), w_dtype, ctx.emulate)
        if ctx.needs_input_grad[2]:
            db = dy2.sum(dim=0, dtype=torch.float32).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


def _wgrad_copy(x2: torch.Tensor, wgrad_x: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``x^T`` copy cast again in the backward: plain PyTorch under ``torch.compile`` (Inductor recomputes and
    fuses it: :func:`fp8kit.fp8.blockwise.quantize_act_wgrad`) and on the CPU; eagerly on CUDA the Triton kernel
    (the same bits as the reference; the plain PyTorch would run as many separate kernels)."""
    if torch.compiler.is_compiling() or not x2.is_cuda:
        return quantize_act_wgrad(x2, wgrad_x)
    return ops.quantize_act(x2, wgrad_x)[2:]


def blockwise_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    cache_weight: bool = True, emulate: bool = False, keep_weight_copy: bool = True, keep_input_copy: bool = True,
    wgrad_x: str = "128x1",
) -> torch.Tensor:
    """``x @ weight^T + bias`` with the three GEMMs in blockwise FP8 (differentiable in all three inputs).

    Args:
        x: ``[..., K]`` bf16 (or fp16 / fp32) input; the output has its dtype.
        weight: ``[N, K]``, ``N`` and ``K`` multiples of 128.
        bias: ``[N]`` or None.
        cache_weight: reuse the quantized weight while the weight is unchanged
            (:mod:`fp8kit.fp8.kernels.ops`, "Weight cache").
        emulate: on CUDA, run the GEMMs in float32 on the dequantized operands (the CPU always does).
        keep_weight_copy: keep the FP8 ``w^T`` copy of the forward for the backward's dgrad GEMM (1 byte per
            weight element held in between; faster); False quantizes the weight again in the backward (what a
            weight sharded between forward and backward, FSDP2, needs). Same bits either way.
        keep_input_copy: keep the forward's FP8 ``x^T`` copy (128x1 blocks, the wgrad operand) for the backward
            (1 byte per input element held in between); False saves the input itself and quantizes it again in
            the backward (module docstring). Same bits either way.
        wgrad_x: the blocks of the wgrad GEMM's ``x^T`` copy: ``"128x1"`` (DeepSeek-V3) or ``"128x128"``
            (``fp8.blockwise_wgrad_x``; :mod:`fp8kit.fp8.blockwise`).

    Returns:
        ``[..., N]`` tensor of ``x.dtype``.

    Raises:
        ValueError: ``weight`` is not ``[N, K]`` with multiples of 128, ``x``'s last dimension is not K, or
            ``wgrad_x`` is not a layout.
        CapabilityError: on a CUDA GPU without blockwise FP8 GEMMs and ``emulate`` false.
    """
    check_wgrad_x(wgrad_x, "blockwise_linear")
    if weight.dim() != 2:
        raise ValueError(f"blockwise_linear: weight must be 2-D [out_features, in_features], got {tuple(weight.shape)}")
    check_linear_shape(weight.shape[0], weight.shape[1], "blockwise_linear")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"blockwise_linear: input of shape {tuple(x.shape)} does not match weight "
                         f"{tuple(weight.shape)} (last dimension must be {weight.shape[1]})")
    return _BlockwiseLinearFn.apply(x, weight, bias, cache_weight, emulate, keep_weight_copy, keep_input_copy, wgrad_x)


def sharded_linear(
    x: torch.Tensor, weight: DTensor, bias: torch.Tensor | None,
    local_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor], name: str = "linear",
) -> DTensor:
    """``y = x @ weight^T + bias`` of a tensor-parallel linear whose FP8 GEMMs run on local shards.

    ``local_fn(x_local, w_local, b_local)`` computes ``[..., k] x [n, k] -> [..., n]`` on plain tensors (the
    custom FP8 ops never see a DTensor); this function maps the DTensor placements around it, over the
    weight's 1-D (``tp``) mesh, as ``nn.Linear`` does under torch's ``ColwiseParallel`` / ``RowwiseParallel``:

    ================  ===================  =====================  ==========================================
    weight            input ``x``          output                 gradient of ``x`` (from ``local_fn``)
    ================  ===================  =====================  ==========================================
    ``Shard(0)``      ``Replicate``        ``Shard(-1)``          ``Partial`` (each rank's ``dy_r @ w_r``; the
    column-parallel                                               style's input conversion sums it)
    ``Shard(1)``      ``Shard(-1)``        ``Partial`` (summed    ``Shard(-1)``
    row-parallel                           by the style)
    ``Replicate``     ``Replicate``        ``Replicate``          ``Replicate``
    ================  ===================  =====================  ==========================================

    The bias (``Shard(0)`` column-parallel, else ``Replicate``) is added locally by ``local_fn``, except
    row-parallel, where it is added to the ``Partial`` output as a DTensor (DTensor adds it once, not per rank).
    The weight's gradient is this rank's shard (``Shard(0)`` / ``Shard(1)``), as the weight.

    Args:
        x: ``[..., K]`` DTensor on the weight's mesh (the style's input conversion makes it one).
        weight: ``[N, K]`` DTensor (global shape) on a 1-D mesh.
        bias: ``[N]`` DTensor or None.
        name: the module, for errors.

    Raises:
        ValueError: ``x`` is not a DTensor, the mesh is not 1-D, or ``x``'s placement does not match the weight's.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    if not isinstance(x, DTensor):
        raise ValueError(f"{name}: tensor-parallel weight {weight.placements} but a plain input tensor; apply "
                         f"fp8kit.parallel.tp_own's OwnColwiseParallel / OwnRowwiseParallel to the module")
    if weight.device_mesh.ndim != 1:
        raise ValueError(f"{name}: tensor-parallel FP8 linears take a 1-D mesh, got {weight.device_mesh}")
    (wp,), (xp,) = weight.placements, x.placements
    mesh, last = weight.device_mesh, x.ndim - 1
    b = bias.to_local() if isinstance(bias, DTensor) else bias
    if wp.is_shard(0):  # column-parallel
        if not xp.is_replicate():
            raise ValueError(f"{name}: column-parallel weight needs a replicated input, got {xp}")
        y = local_fn(x.to_local(grad_placements=(Partial(),)), weight.to_local(), b)
        return DTensor.from_local(y, mesh, (Shard(last),), run_check=False)
    if wp.is_shard(1):  # row-parallel
        if not xp.is_shard(last):
            raise ValueError(f"{name}: row-parallel weight needs an input sharded on its last dim, got {xp}")
        y = DTensor.from_local(local_fn(x.to_local(), weight.to_local(), None), mesh, (Partial(),), run_check=False)
        return y if bias is None else y + bias.to(y.dtype)
    if wp.is_replicate() and xp.is_replicate():
        y = local_fn(x.to_local(), weight.to_local(), b)
        return DTensor.from_local(y, mesh, (Replicate(),), run_check=False)
    raise ValueError(f"{name}: unsupported tensor-parallel placements weight {wp}, input {xp}")


class Float8BlockwiseLinear(nn.Module):
    """A linear layer whose fprop, dgrad and wgrad run in blockwise FP8 (DeepSeek-V3 recipe).

    Holds ``weight`` ``[out_features, in_features]`` and ``bias`` ``[out_features]`` (or None) like
    ``nn.Linear``; :meth:`from_linear` takes over the very Parameter objects of an ``nn.Linear``, so
    optimizer state and ``state_dict`` keys are unchanged, and :meth:`to_linear` gives them back.
    Not a subclass of ``nn.Linear`` on purpose: converters that look for ``nn.Linear`` skip it.

    Args:
        in_features, out_features: multiples of 128.
        bias: whether to create a bias.
        cache_weight: quantize the weight once per weight version (see :mod:`fp8kit.fp8.kernels.ops`).
        emulate: run the GEMMs in float32 on dequantized operands on CUDA (for GPUs without blockwise
            FP8 GEMMs; the CPU always emulates).
        keep_weight_copy: keep the forward's FP8 ``w^T`` copy for the backward (see :func:`blockwise_linear`;
            ``prepare_model`` turns it off under FSDP2 and with ``fp8.blockwise_recompute``).
        keep_input_copy: keep the forward's FP8 ``x^T`` copy for the backward (see :func:`blockwise_linear`;
            ``prepare_model`` turns it off with ``fp8.blockwise_recompute``).
        wgrad_x: ``"128x1"`` or ``"128x128"``, the blocks of the wgrad GEMM's ``x^T`` copy (see
            :func:`blockwise_linear`; ``fp8.blockwise_wgrad_x``).

    Raises:
        ValueError: a feature count that is not a multiple of 128 (naming the shape), or an unknown ``wgrad_x``.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, device=None, dtype=None,
        cache_weight: bool = True, emulate: bool = False, keep_weight_copy: bool = True,
        keep_input_copy: bool = True, wgrad_x: str = "128x1",
    ) -> None:
        super().__init__()
        check_linear_shape(out_features, in_features, "Float8BlockwiseLinear")
        check_wgrad_x(wgrad_x, "Float8BlockwiseLinear")
        self.wgrad_x = wgrad_x
        self.in_features = in_features
        self.out_features = out_features
        self.cache_weight = cache_weight
        self.emulate = emulate
        self.keep_weight_copy = keep_weight_copy
        self.keep_input_copy = keep_input_copy
        ops.load_cuda_kernels()  # here, not in traced code: see fp8kit.fp8.kernels.ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation (Kaiming-uniform weight, uniform bias)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, *, cache_weight: bool = True, emulate: bool = False, name: str | None = None,
        keep_weight_copy: bool = True, keep_input_copy: bool = True, wgrad_x: str = "128x1",
    ) -> Float8BlockwiseLinear:
        """A ``Float8BlockwiseLinear`` sharing ``linear``'s ``weight`` and ``bias`` Parameter objects.

        Args:
            linear: the layer to replace (its hooks are not carried over).
            name: the module's qualified name, for the error message.

        Raises:
            ValueError: ``in_features`` or ``out_features`` not a multiple of 128 (keep the layer BF16), or an
                unknown ``wgrad_x``.
        """
        n, k = linear.weight.shape
        where = f"Float8BlockwiseLinear.from_linear({name or type(linear).__name__})"
        check_linear_shape(n, k, where)
        check_wgrad_x(wgrad_x, where)
        mod = cls.__new__(cls)
        nn.Module.__init__(mod)
        mod.in_features, mod.out_features = k, n
        mod.cache_weight, mod.emulate, mod.keep_weight_copy = cache_weight, emulate, keep_weight_copy
        mod.keep_input_copy, mod.wgrad_x = keep_input_copy, wgrad_x
        ops.load_cuda_kernels()  # here, not in traced code: see fp8kit.fp8.kernels.ops
        mod.weight = linear.weight
        mod.bias = linear.bias
        mod.train(linear.training)
        return mod

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding this module's ``weight`` and ``bias`` Parameter objects."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = self.weight
        linear.bias = self.bias
        linear.train(self.training)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` in ``x``'s dtype."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Float8BlockwiseLinear: input of shape {tuple(x.shape)} does not match "
                             f"in_features={self.in_features}")
        if isinstance(self.weight, DTensor):  # tensor parallel: the FP8 ops run on this rank's shards
            return sharded_linear(x, self.weight, self.bias, self._local_forward, "Float8BlockwiseLinear")
        return self._local_forward(x, self.weight, self.bias)

    def _local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[..., k] x [n, k] (+ [n]) -> [..., n]`` on plain tensors (a whole weight or a TP shard)."""
        return _BlockwiseLinearFn.apply(x, weight, bias, self.cache_weight, self.emulate, self.keep_weight_copy,
                                        self.keep_input_copy, self.wgrad_x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe=blockwise, cache_weight={self.cache_weight}, emulate={self.emulate}, "
                f"keep_weight_copy={self.keep_weight_copy}, keep_input_copy={self.keep_input_copy}, "
                f"wgrad_x={self.wgrad_x!r}")
