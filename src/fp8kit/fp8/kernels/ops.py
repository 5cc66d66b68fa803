"""``torch.library`` custom ops of the blockwise FP8 recipe: ``torch.ops.fp8kit.*``.

Each op has one schema and two implementations: CUDA runs the Triton kernels
(:mod:`fp8kit.fp8.kernels.blockwise_triton`) or cuBLAS, every other device the PyTorch reference
(:mod:`fp8kit.fp8.blockwise`), so CPU CI runs the same op as the GPU. ``register_fake`` gives
``torch.compile`` the output shapes; the ops are opaque to Inductor (it neither fuses nor reorders
them), which is what keeps compiled and eager results bit-identical.

- ``fp8kit::blockwise_quant_act(x[M, K], wgrad_x)`` -> the 1x128 copy and the transposed 128x1 (or, with
  ``wgrad_x = "128x128"``, 128x128) copy with scales.
- ``fp8kit::blockwise_quant_act_fprop(x)`` -> the 1x128 copy alone (the forward of a linear that keeps no ``x^T``).
- ``fp8kit::blockwise_quant_weight(w[N, K])`` -> the 128x128 copy in the fprop and dgrad layouts.
- ``fp8kit::blockwise_quant_weight_dgrad(w)`` -> the dgrad layout alone, cast in the backward of a linear that keeps
  no FP8 weight copy (FSDP2, ``fp8.blockwise_recompute``): an op of its own so that AOTAutograd's CSE does not
  merge it with the forward's cast (a Python call per linear per backward; measured within the recompute figures).
- ``fp8kit::blockwise_quant_weight_cached(w)`` -> the same, computed once per weight version (below).
- ``fp8kit::blockwise_mm(a, a_scale_t, b, b_scale, b_block, out_dtype, emulate)`` -> ``a @ b^T``.

The CUDA fast path (:func:`load_cuda_kernels`, on once a blockwise linear is built on a machine with CUDA):
the weight cast is the ``torch.library.triton_op`` ``fp8kit::blockwise_quant_weight_triton``
(:mod:`fp8kit.fp8.kernels.blockwise_triton`) and the GEMM is ``F.scaled_mm`` itself, so a compiled block
launches them from Inductor's code with no Python call per op (as custom ops they cost ~15 ms of GPU idle time
per Llama-3-8B x 8 step: docs/benchmarks.md section 6). The activation cast stays the custom op above (its
calls on one shared input are merged under compile). Same kernels, same bits.

Weight cache. The quantized weight depends only on the weight's values, which change once per
optimizer step; ``blockwise_quant_weight_cached`` returns it from a :class:`fp8kit.fp8.weight_cache.WeightCache`
(one cast per weight version and optimizer step; the rules, and what it cannot see, are in that module). The
lookup runs inside the op, so it works the same eagerly and under ``torch.compile``; the op is tagged
``cudagraph_unsafe`` (a CUDA graph replay would skip the lookup). Memory: an entry holds 2 bytes per weight
element (two E4M3 layouts), as much as the BF16 weight, kept through the optimizer step.
"""

from __future__ import annotations

import functools

import torch

from fp8kit.base.errors import CapabilityError
from fp8kit.base.triton_lib import triton_module
from fp8kit.fp8 import blockwise
from fp8kit.fp8.blockwise import BLOCK, FP8, padded_rows, round_up4
from fp8kit.fp8.blockwise_gathered import dgrad_layout, gathered_blockwise, layouts
from fp8kit.fp8.weight_cache import WeightCache, clear_weight_caches

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


# --------------------------------------------------------------------------- capability

def blockwise_gemm_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether cuBLAS blockwise FP8 GEMMs (1x128 x 128x128, 1x128 x 1x128) run on ``device``.

    Needs ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` (torch >= 2.10), CUDA
    >= 12.9 and a Hopper GPU (compute capability 9.x: cuBLAS's blockwise FP8 kernels).

    Returns:
        ``(ok, reason)``; on failure ``reason`` names the GPU, the torch and CUDA versions and the fix
        (:func:`blockwise_gemm_verdict`).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return False, f"device {dev} is not a CUDA GPU: blockwise GEMMs run emulated in float32 there"
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    has_api = (scaling is not None and hasattr(scaling, "BlockWise128x128")
               and hasattr(torch.nn.functional, "scaled_mm"))
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return blockwise_gemm_verdict(torch.cuda.get_device_name(index), index, torch.cuda.get_device_capability(index),
                                  torch.__version__, torch.version.cuda, has_api)


def blockwise_gemm_verdict(gpu: str, index: int, capability: tuple[int, int], torch_version: str,
                           cuda_version: str | None, has_blockwise_scaled_mm: bool) -> tuple[bool, str]:
    """:func:`blockwise_gemm_support`'s decision from the facts it reads (a pure function: the tests give it the
    facts of GPUs and torch builds this machine does not have).

    Args:
        gpu: the GPU's name (``torch.cuda.get_device_name``); index: its CUDA index.
        capability: ``(major, minor)`` compute capability.
        torch_version, cuda_version: ``torch.__version__``, ``torch.version.cuda`` (None: a build without CUDA).
        has_blockwise_scaled_mm: torch has ``torch.nn.functional.scaled_mm`` and ``ScalingType.BlockWise128x128``.

    Returns:
        ``(ok, reason)``: every failure names the GPU, the torch and CUDA versions and the fix.
    """
    device = f"{gpu} (cuda:{index}, capability {capability[0]}.{capability[1]})"
    where = f"{device} with torch {torch_version} (CUDA {cuda_version or 'none'})"
    fix = ('Fix: use fp8.recipe = "tensorwise" or "rowwise", or fp8.emulate = true (blockwise numerics '
           "without the speed-up)")
    if not has_blockwise_scaled_mm:
        return False, (f"blockwise FP8 GEMMs need torch.nn.functional.scaled_mm with ScalingType.BlockWise128x128 "
                       f"(torch >= 2.10); this is {where}. {fix}, or upgrade torch")
    cuda_ok = cuda_version is not None and tuple(int(p) for p in cuda_version.split(".")[:2]) >= (12, 9)
    if capability[0] != 9 or not cuda_ok:
        return False, (f"blockwise FP8 GEMMs need a Hopper GPU (compute capability 9.x) and CUDA >= 12.9; this is "
                       f"{where}. {fix}")
    return True, f"{device}, torch {torch_version}: blockwise FP8 GEMMs"


@functools.cache
def _require_blockwise_gemm(device: torch.device) -> None:
    ok, reason = blockwise_gemm_support(device)
    if not ok:
        raise CapabilityError(f'fp8.recipe = "blockwise": {reason}')


def _triton_kernels():
    """:mod:`fp8kit.fp8.kernels.blockwise_triton`, or None (``base.triton_lib.triton_module``)."""
    return triton_module("fp8kit.fp8.kernels.blockwise_triton", "blockwise quantization")


def _prepare(t: torch.Tensor, what: str, where: str, rows_blocked: bool) -> torch.Tensor:
    """Validate a 2-D operand (last dim, and rows when ``rows_blocked``, multiples of 128); unit stride."""
    if t.dim() != 2 or t.shape[1] % BLOCK or (rows_blocked and t.shape[0] % BLOCK):
        dims = "both dimensions" if rows_blocked else "the last dimension"
        raise ValueError(f"{where}: {what} must be 2-D with {dims} divisible by {BLOCK}, got {tuple(t.shape)}")
    t = t.detach()
    return t if t.stride(1) == 1 else t.contiguous()


# name -> (operand, op name, rows blocked too, reference quantizer); the Triton kernels share the names.
_QUANTIZERS = {
    "quantize_act": ("x", "fp8kit::blockwise_quant_act", False, blockwise.quantize_act),
    "quantize_act_fprop": ("x", "fp8kit::blockwise_quant_act_fprop", False, blockwise.quantize_act_fprop),
    "quantize_weight": ("weight", "fp8kit::blockwise_quant_weight", True, blockwise.quantize_weight),
}


def _quantize(name: str, t: torch.Tensor, *args, cuda: bool) -> Quantized:
    """Checked input -> the Triton kernel ``name`` on CUDA (when triton imports), else the reference; ``args``
    follow ``t`` in both."""
    what, op, rows_blocked, reference = _QUANTIZERS[name]
    t = _prepare(t, what, op, rows_blocked)
    # the loaded fast-path module first: no import in traced code (load_cuda_kernels)
    kernels = (_CUDA_KERNELS or _triton_kernels()) if cuda else None
    if kernels is None:
        return reference(t, *args)
    return _on_device(t, getattr(kernels, name), t, *args)


def _quantize_act_ref(x: torch.Tensor, wgrad_x: str) -> Quantized:
    return _quantize("quantize_act", x, wgrad_x, cuda=False)


def _quantize_act_cuda(x: torch.Tensor, wgrad_x: str) -> Quantized:
    return _quantize("quantize_act", x, wgrad_x, cuda=True)


def _quantize_act_fprop_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize("quantize_act_fprop", x, cuda=False)


def _quantize_act_fprop_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize("quantize_act_fprop", x, cuda=True)


def _quantize_weight_ref(w: torch.Tensor) -> Quantized:
    return _quantize("quantize_weight", w, cuda=False)


def _quantize_weight_cuda(w: torch.Tensor) -> Quantized:
    return _quantize("quantize_weight", w, cuda=True)


def _quantize_weight_any(w: torch.Tensor) -> Quantized:
    return _quantize_weight_cuda(w) if w.is_cuda else _quantize_weight_ref(w)


# --------------------------------------------------------------------------- quantization ops

@torch.library.custom_op("fp8kit::blockwise_quant_act", mutates_args=())
def _quant_act_op(x: torch.Tensor, wgrad_x: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_act_ref(x, wgrad_x)


@_quant_act_op.register_kernel("cuda")
def _(x: torch.Tensor, wgrad_x: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_act_cuda(x, wgrad_x)


@_quant_act_op.register_fake
def _(x: torch.Tensor, wgrad_x: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return blockwise.empty_act_outputs(x, *x.shape, wgrad_x)


@torch.library.custom_op("fp8kit::blockwise_quant_act_fprop", mutates_args=())
def _quant_act_fprop_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_act_fprop_ref(x)


@_quant_act_fprop_op.register_kernel("cuda")
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_act_fprop_cuda(x)


@_quant_act_fprop_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    mp = padded_rows(m)
    return x.new_empty(mp, k, dtype=FP8), x.new_empty(k // BLOCK, mp, dtype=torch.float32)


def _fake_weight(w: torch.Tensor) -> Quantized:
    n, k = w.shape
    f32 = torch.float32
    return (w.new_empty(n, k, dtype=FP8), w.new_empty(n // BLOCK, round_up4(k // BLOCK), dtype=f32),
            w.new_empty(k, n, dtype=FP8), w.new_empty(k // BLOCK, round_up4(n // BLOCK), dtype=f32))


@torch.library.custom_op("fp8kit::blockwise_quant_weight", mutates_args=())
def _quant_weight_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_weight_ref(w)


@_quant_weight_op.register_kernel("cuda")
def _(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _quantize_weight_cuda(w)


_quant_weight_op.register_fake(_fake_weight)


# The backward's own cast of a weight (``keep_weight_copy=False``): the dgrad copy alone. A separate op (same
# kernel, same bits) because AOTAutograd's CSE would otherwise merge it with the forward's identical call and keep
# the forward's FP8 copy alive until the backward: the memory that casting again saves.

@torch.library.custom_op("fp8kit::blockwise_quant_weight_dgrad", mutates_args=())
def _quant_weight_dgrad_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_weight_ref(w)[2:]


@_quant_weight_dgrad_op.register_kernel("cuda")
def _(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_weight_cuda(w)[2:]


@_quant_weight_dgrad_op.register_fake
def _(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_weight(w)[2:]


_CACHE = WeightCache(lambda w: _quantize_weight_any(w), "blockwise 128x128")


@torch.library.custom_op(
    "fp8kit::blockwise_quant_weight_cached", mutates_args=(),
    tags=(_CUDAGRAPH_UNSAFE,) if _CUDAGRAPH_UNSAFE is not None else (),
)
def _quant_weight_cached_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _CACHE.get(w)


_quant_weight_cached_op.register_fake(_fake_weight)


def clear_weight_cache() -> None:
    """Drop every cached quantized weight, blockwise linears' and fused MoE experts' alike
    (:func:`fp8kit.fp8.weight_cache.clear_weight_caches`; call after an update that bypasses ``_version``)."""
    clear_weight_caches()


def weight_cache_stats() -> dict[str, int]:
    """``{"hits", "misses", "entries"}`` of the weight cache since the process started."""
    return _CACHE.stats()


# --------------------------------------------------------------------------- GEMM op

@torch.library.custom_op("fp8kit::blockwise_mm", mutates_args=())
def _blockwise_mm_op(
    a: torch.Tensor, a_scale_t: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, b_block: int,
    out_dtype: torch.dtype, emulate: bool,
) -> torch.Tensor:
    return blockwise.blockwise_mm_emulated(a, a_scale_t, b, b_scale, b_block, out_dtype)


@_blockwise_mm_op.register_kernel("cuda")
def _(
    a: torch.Tensor, a_scale_t: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, b_block: int,
    out_dtype: torch.dtype, emulate: bool,
) -> torch.Tensor:
    if emulate:
        return blockwise.blockwise_mm_emulated(a, a_scale_t, b, b_scale, b_block, out_dtype)
    _require_blockwise_gemm(a.device)
    return _cublas_blockwise_mm(a, a_scale_t, b, b_scale, b_block, out_dtype)


@torch.compiler.allow_in_graph
def _cublas_blockwise_mm(a, a_scale_t, b, b_scale, b_block: int, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS ``a @ b^T`` with 1x128 scales on ``a`` and 128x128 (``b_block=128``) or 1x128 scales on ``b``.

    ``allow_in_graph``: Dynamo of torch 2.11 cannot trace ``torch._scaled_mm_v2`` (``F.scaled_mm``'s builtin), so
    the call enters the graph whole and AOTAutograd traces it to the ATen op (meta kernel in torch)."""
    f = torch.nn.functional
    recipe_b = f.ScalingType.BlockWise128x128 if b_block == BLOCK else f.ScalingType.BlockWise1x128
    return f.scaled_mm(
        a, b.t(), scale_a=a_scale_t.t(), scale_recipe_a=f.ScalingType.BlockWise1x128,
        scale_b=b_scale.t(), scale_recipe_b=recipe_b, output_dtype=out_dtype,
    )


@_blockwise_mm_op.register_fake
def _(
    a: torch.Tensor, a_scale_t: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, b_block: int,
    out_dtype: torch.dtype, emulate: bool,
) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


# --------------------------------------------------------------------------- CUDA fast path

#: The Triton kernel module once :func:`load_cuda_kernels` imported it (None before, and on machines without
#: CUDA or triton). Its weight cast is a ``torch.library.triton_op``, which ``torch.compile`` launches from
#: Inductor's code without a Python call; the custom ops above remain for the activation cast, the CPU,
#: ``emulate`` and code that runs before the kernels are loaded (same bits either way).
_CUDA_KERNELS = None


def load_cuda_kernels() -> bool:
    """Import the Triton kernels (and register their ``triton_op``s) when CUDA and triton are there; idempotent.

    Called by :class:`fp8kit.fp8.linear.Float8BlockwiseLinear` at construction, outside any traced code
    (importing a module is not traceable). Returns whether the fast path is on.
    """
    global _CUDA_KERNELS
    if _CUDA_KERNELS is None and torch.cuda.is_available():
        _CUDA_KERNELS = _triton_kernels()
    return _CUDA_KERNELS is not None


def _fast(t: torch.Tensor) -> bool:
    return t.is_cuda and _CUDA_KERNELS is not None


def _on_device(t: torch.Tensor, fn, *args):
    """``fn(*args)`` with ``t``'s GPU current (eager Triton launches use the current device); under
    ``torch.compile`` Inductor places the launch itself."""
    if torch.compiler.is_compiling():
        return fn(*args)
    with torch.cuda.device(t.device):
        return fn(*args)


# --------------------------------------------------------------------------- public entry points

def quantize_act(x: torch.Tensor, wgrad_x: str = "128x1") -> Quantized:
    """Both FP8 copies of an activation or output gradient ``x[M, K]``: ``(q, s_t, qt, st)``.

    Layouts and numerics: :func:`fp8kit.fp8.blockwise.quantize_act` (``wgrad_x``: the blocks of the ``x^T``
    copy, ``"128x1"`` or ``"128x128"``). Triton on CUDA (one read of ``x``).

    Raises:
        ValueError: ``x`` is not 2-D with a last dimension divisible by 128, or ``wgrad_x`` is not a layout.
    """
    blockwise.check_wgrad_x(wgrad_x, "fp8kit::blockwise_quant_act")
    # The custom op, not the triton_op: AOTAutograd's CSE merges the casts of one input shared by several
    # linears (q/k/v, gate/up) only for an opaque op; Triton kernel wrappers allocate their outputs and are
    # never merged (measured: 112 instead of 88 activation casts per Llama-3-8B x 8 step, +2 ms).
    return torch.ops.fp8kit.blockwise_quant_act(x, wgrad_x)


def quantize_act_fprop(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fprop copy ``(q, s_t)`` of ``x[M, K]`` alone: :func:`quantize_act`'s first two outputs, the same bits,
    without writing the ``x^T`` copy (the blockwise linear's forward with ``keep_input_copy=False``). A custom op
    like :func:`quantize_act`, so the casts of one input shared by several linears are merged.

    Raises:
        ValueError: ``x`` is not 2-D with a last dimension divisible by 128.
    """
    return torch.ops.fp8kit.blockwise_quant_act_fprop(x)


def quantize_weight(w: torch.Tensor, cache: bool = True) -> Quantized:
    """The 128x128 FP8 weight ``(wq, ws, wtq, wts)`` of ``w[N, K]``, from the cache when ``cache``.

    Layouts and numerics: :func:`fp8kit.fp8.blockwise.quantize_weight`.

    A weight FSDP2 all-gathered already quantized (:mod:`fp8kit.fp8.blockwise_gathered`) gives its gathered bytes
    and their transpose: the same bits, no cast (and no cache: nothing to cast again).

    Raises:
        ValueError: ``w`` is not 2-D with both dimensions divisible by 128.
    """
    if gathered_blockwise(w):
        return layouts(w)
    if cache:
        return torch.ops.fp8kit.blockwise_quant_weight_cached(w)
    if _fast(w):  # the triton_op itself, no custom op around it
        return _quantize_weight_cuda(w)
    return torch.ops.fp8kit.blockwise_quant_weight(w)


def quantize_weight_dgrad(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dgrad copy ``(wtq, wts)`` of ``w[N, K]`` alone (``w^T``'s 128x128 blocks; the last two of
    :func:`quantize_weight`'s outputs, the same bits), cast again in the backward (``keep_weight_copy=False``).

    A separate op from the forward's weight cast so that ``torch.compile`` does not merge the two. A weight
    all-gathered quantized (:mod:`fp8kit.fp8.blockwise_gathered`) gives the transpose of its gathered bytes.

    Raises:
        ValueError: ``w`` is not 2-D with both dimensions divisible by 128.
    """
    if gathered_blockwise(w):
        return dgrad_layout(w)
    return torch.ops.fp8kit.blockwise_quant_weight_dgrad(w)


def blockwise_mm(
    a: torch.Tensor, a_scale_t: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, b_block: int,
    out_dtype: torch.dtype, emulate: bool = False,
) -> torch.Tensor:
    """``a[M, K] @ b[N, K]^T`` of blockwise E4M3 operands -> ``[M, N]`` of ``out_dtype``.

    ``a`` has 1x128 blocks with decoding scales ``a_scale_t[K/128, M]``; ``b`` has 128x128 blocks
    (``b_block=128``, scales ``[N/128, L4(K/128)]``) or 1x128 blocks along K (``b_block=1``, scales
    ``[K/128, N]``). CUDA: cuBLAS via ``F.scaled_mm`` unless ``emulate``; elsewhere, and with
    ``emulate``: :func:`fp8kit.fp8.blockwise.blockwise_mm_emulated`.

    On CUDA with the kernels loaded (:func:`load_cuda_kernels`) and not ``emulate``, ``F.scaled_mm`` is called
    here directly, so ``torch.compile`` records the ATen GEMM itself (no custom-op call around it); the
    capability check then runs eagerly only (a compiled graph was traced after an eager check or on a
    device that passed it at conversion).

    Raises:
        CapabilityError: on a CUDA device without blockwise FP8 GEMMs (see :func:`blockwise_gemm_support`)
            and ``emulate`` false.
    """
    if _fast(a) and not emulate:
        if not torch.compiler.is_compiling():
            _require_blockwise_gemm(a.device)
        return _cublas_blockwise_mm(a, a_scale_t, b, b_scale, b_block, out_dtype)
    return torch.ops.fp8kit.blockwise_mm(a, a_scale_t, b, b_scale, b_block, out_dtype, emulate)
