"""``torch.library`` op of the per-tensor FP8 cast with a known scale: ``torch.ops.fp8kit.cast_transpose``.

Used by the delayed-scaling linear (:mod:`fp8kit.fp8.delayed`), whose scale comes from the amax history
before the cast. One op, two implementations: CUDA runs the Triton kernel
(:mod:`fp8kit.fp8.kernels.cast_transpose_triton`: one read of ``x`` writes both FP8 layouts and the amax),
every other device :func:`cast_transpose_reference` (the same float32 math op by op), so CPU CI runs the
same op as the GPU. ``register_fake`` gives ``torch.compile`` the output shapes; the op is opaque to
Inductor (not fused into the producer of ``x``, not reordered).

On CUDA, once :func:`load_cuda_kernels` ran, :func:`cast_transpose` calls the kernel's ``torch.library.triton_op``
(``fp8kit::cast_transpose_triton``) instead, which ``torch.compile`` launches from Inductor's generated code with
no Python call around it (same bits). The custom op stays for ``mergeable`` casts: AOTAutograd's CSE merges
identical calls of an opaque op (the input cast of sibling linears reading one tensor at one scale,
:mod:`fp8kit.fp8.delayed_siblings`), never a Triton kernel's launch, whose outputs are allocated in the graph.
"""

from __future__ import annotations

import torch

from fp8kit.base.triton_lib import triton_module
from fp8kit.fp8.scaling import quantize

#: The formats the cast writes.
CAST_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

Cast = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def cast_transpose_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool) -> Cast:
    """``(q, qt, amax)`` in plain PyTorch: ``q = saturate(float32(x) * scale) -> dtype`` ``[M, N]``
    (:func:`fp8kit.fp8.scaling.quantize`), ``qt = q.T`` contiguous ``[N, M]`` (``[0]`` without ``transpose``),
    ``amax = max |x|`` float32 ``[]`` (NaN if ``x`` holds one; 0 for an empty ``x``)."""
    q = quantize(x, scale, dtype)
    qt = q.t().contiguous() if transpose else q.new_empty(0)
    amax = x.abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    return q, qt, amax


def _check(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"fp8kit::cast_transpose: x must be 2-D, got shape {tuple(x.shape)}")
    if dtype not in CAST_DTYPES:
        raise ValueError(f"fp8kit::cast_transpose: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"fp8kit::cast_transpose: scale must be one float32 value, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    return x if x.stride(1) == 1 or x.numel() == 0 else x.contiguous()


@torch.library.custom_op("fp8kit::cast_transpose", mutates_args=())
def _cast_transpose_op(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool) -> Cast:
    return cast_transpose_reference(_check(x, scale, dtype), scale, dtype, transpose)


@_cast_transpose_op.register_kernel("cuda")
def _(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool) -> Cast:
    x = _check(x, scale, dtype)
    kernels = triton_module("fp8kit.fp8.kernels.cast_transpose_triton", "FP8 cast-transpose")
    if kernels is None:
        return cast_transpose_reference(x, scale, dtype, transpose)
    with torch.cuda.device(x.device):
        return kernels.cast_transpose(x, scale.reshape(()), dtype, transpose)


@_cast_transpose_op.register_fake
def _(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool) -> Cast:
    m, n = x.shape
    return (x.new_empty(m, n, dtype=dtype), x.new_empty((n, m) if transpose else (0,), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


#: The Triton kernel module once :func:`load_cuda_kernels` imported it (None before, and without CUDA or triton).
_TRITON = None


def load_cuda_kernels() -> bool:
    """Import the Triton cast-transpose kernel (registering its ``triton_op``) when CUDA and triton are there;
    idempotent. Called outside traced code (importing is not traceable): by
    :class:`fp8kit.fp8.delayed.Float8DelayedLinear` at construction and by eager :func:`cast_transpose` calls.
    Returns whether the ``triton_op`` path is on."""
    global _TRITON
    if _TRITON is None and torch.cuda.is_available():
        _TRITON = triton_module("fp8kit.fp8.kernels.cast_transpose_triton", "FP8 cast-transpose")
    return _TRITON is not None


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, transpose: bool = True,
                   mergeable: bool = False) -> Cast:
    """Both FP8 layouts of ``x`` at a known per-tensor scale, and ``x``'s amax, from one read of ``x``.

    Args:
        x: ``[M, N]`` bf16 / fp16 / fp32.
        scale: float32, one element: the encoding scale (``q = x * scale``; decoding scale ``1 / scale``).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: also write ``qt`` (the layout a backward GEMM takes); otherwise ``qt`` is empty ``[0]``.
        mergeable: call the opaque custom op ``fp8kit::cast_transpose``, whose identical calls ``torch.compile``
            merges into one (sibling linears casting one input); otherwise a CUDA ``x`` takes the ``triton_op``
            (module docstring; the same bits) once :func:`load_cuda_kernels` ran: an eager call runs it, and so does
            every :class:`~fp8kit.fp8.delayed.Float8DelayedLinear` at construction. Code compiled before that
            takes the custom op (the same bits, a Python call per cast).

    Returns:
        ``q`` ``[M, N]`` and ``qt`` ``[N, M]`` (contiguous) of ``dtype`` (values beyond the format's
        maximum saturate to it), and ``amax`` float32 ``[]``, the largest ``|x|`` (NaN propagates).

    Raises:
        ValueError: ``x`` not 2-D, ``dtype`` not an FP8 format, ``scale`` not one float32 value.
    """
    if not mergeable and x.is_cuda:
        compiling = torch.compiler.is_compiling()
        if not compiling:
            load_cuda_kernels()
        if _TRITON is not None:
            x = _check(x, scale, dtype)
            if compiling:  # Inductor places the launch itself
                return torch.ops.fp8kit.cast_transpose_triton(x, scale, dtype, transpose)
            with torch.cuda.device(x.device):  # an eager launch runs on the current device
                return torch.ops.fp8kit.cast_transpose_triton(x, scale, dtype, transpose)
    return torch.ops.fp8kit.cast_transpose(x, scale, dtype, transpose)
