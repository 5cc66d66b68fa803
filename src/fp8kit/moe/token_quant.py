"""Fused blockwise FP8 quantization on the MoE token path: dispatch gather + cast, SwiGLU + cast.

The blockwise recipe (DeepSeek-V3 1x128 tiles) of :mod:`fp8kit.fp8.blockwise` applied where the experts'
tokens are made, so no BF16 copy is written and read again just to be quantized:

- :func:`gather_quantize_act`: the dispatch permutation (``routing.Dispatch.gather_idx``) writing FP8
  directly in expert order: ``quantize_act(cat([src, zeros(1, K)])[index])`` without the gathered copy.
- :func:`swiglu_quantize_act`: ``a = silu(gate) * up`` of the gate_up projection's output and both FP8
  copies of ``a`` (the down projection's fprop and wgrad operands); ``a`` itself is returned too, for
  the SwiGLU backward (:func:`swiglu_backward`).

Layouts and scale numerics: :func:`fp8kit.fp8.blockwise.quantize_act` (``q[Mp, K]``, ``s_t[K/128, Mp]``,
``qt[K, Mp]``, ``st[Mp/128, K]``, ``Mp = padded_rows(M)``, pad rows zero). Each function is a
``torch.library`` op (``torch.ops.fp8kit.moe_*``): CUDA runs the Triton kernels of
:mod:`fp8kit.moe.token_quant_triton` (one read of the input), every other device the PyTorch reference
below, bit for bit the same (tests/test_moe_token_quant_gpu.py). The ops are opaque to Inductor and
have no autograd formula: the caller's ``autograd.Function`` uses :func:`swiglu_backward`.

SiLU, bit-reproducible. ``silu(g) = g * sigmoid(g)``, ``sigmoid(g) = 1 / (1 + exp(-g))`` in float32, with
``exp`` spelled out as Cephes' ``expf`` (Cody-Waite reduction by ln 2, degree-5 polynomial, 2^n from its
exponent bits) in IEEE float32 multiplies and adds and an IEEE division (:func:`sigmoid_f32`; within 3e-7
relative of the exact sigmoid). Library ``exp`` is not correctly rounded (torch's Sleef on the CPU,
Triton's ``ex2.approx`` on the GPU): with it, ``a`` would differ by a bf16 ulp now and then. Spelled out,
the kernel (compiled with FMA contraction off) and the reference compute the same bits, and the GPU test
asserts ``a`` equal bit for bit (the FP8 copies then follow). ``-g`` is clamped to ``[-87, 87]`` (2^n
stays normal; for ``g >= 87`` ``1 + exp(-g)`` rounds to 1 anyway) and ``sigmoid(g) = 0`` for
``g < -87`` (exact value below 1.7e-38). ``a = silu(g) * up`` in float32, rounded once to ``h.dtype``.
Subnormal products are kept on both sides (Triton does not flush plain float32 arithmetic).
"""

from __future__ import annotations

import struct

import torch

from fp8kit.base.triton_lib import triton_module
from fp8kit.fp8 import blockwise
from fp8kit.fp8.blockwise import BLOCK

Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _f32(c: float) -> float:
    """``c`` rounded to the nearest float32 (so Python, torch and Triton hold the same constant)."""
    return struct.unpack("f", struct.pack("f", c))[0]


# Cephes expf (S. L. Moshier, Cephes Math Library, expf.c): reduction constants and polynomial.
EXP_LOG2E = _f32(1.44269504088896341)
EXP_C1 = _f32(0.693359375)
EXP_C2 = _f32(-2.12194440e-4)
EXP_P = tuple(_f32(p) for p in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                1.6666665459e-1, 5.0000001201e-1))
#: |g| bound of the exp argument (2^n stays a normal float32); sigmoid is 0 below -SILU_CLAMP.
SILU_CLAMP = 87.0


# --------------------------------------------------------------------------- checks

def _check_2d(t: torch.Tensor, name: str, where: str) -> None:
    if t.dim() != 2 or t.dtype not in _FLOATS:
        raise ValueError(f"{where}: {name} must be a 2-D bf16 / fp16 / fp32 tensor, got {t.dtype} {tuple(t.shape)}")


def _check_gather(src: torch.Tensor, index: torch.Tensor) -> None:
    where = "fp8kit::moe_gather_quant_act"
    _check_2d(src, "src", where)
    if src.shape[1] % BLOCK:
        raise ValueError(f"{where}: src must be [T, K] with K a multiple of {BLOCK}, got shape {tuple(src.shape)}")
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32) or index.device != src.device:
        raise ValueError(f"{where}: index must be a 1-D int64 / int32 tensor on {src.device}, got "
                         f"{index.dtype} {tuple(index.shape)} on {index.device}")


def _check_h(h: torch.Tensor, where: str) -> int:
    """The intermediate size ``I`` of ``h[M, 2I]``, after checking ``h``."""
    _check_2d(h, "h", where)
    if h.shape[1] % (2 * BLOCK):
        raise ValueError(f"{where}: h must be [M, 2I] with I a multiple of {BLOCK}, got shape {tuple(h.shape)}")
    return h.shape[1] // 2


# --------------------------------------------------------------------------- reference

def sigmoid_f32(g: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-g))`` of float32 ``g``, ``exp`` spelled out as Cephes' ``expf`` (module docstring).

    Every line is one IEEE float32 operation, in the order the Triton kernel's ``_sigmoid`` performs them.
    """
    t = (-g).clamp(-SILU_CLAMP, SILU_CLAMP)
    n = torch.floor(t * EXP_LOG2E + 0.5)  # exp(t) = 2^n * exp(r), |r| <= ln(2) / 2
    r = t - n * EXP_C1
    r = r - n * EXP_C2
    y = r * EXP_P[0] + EXP_P[1]
    for p in EXP_P[2:]:
        y = y * r + p
    y = y * (r * r) + r + 1.0
    e = y * ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    s = torch.reciprocal(e + 1.0)
    return torch.where(-g > SILU_CLAMP, torch.zeros_like(s), s)


def split_gate_up(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` views of ``h[M, 2I]``: halves (``chunk(2, -1)``, transformers' default ``_apply_gate``
    for Qwen3-MoE / Mixtral) or, ``interleaved``, even / odd columns (GPT-OSS's ``[..., ::2]``, ``[..., 1::2]``)."""
    if interleaved:
        return h[:, 0::2], h[:, 1::2]
    i = h.shape[1] // 2
    return h[:, :i], h[:, i:]


def swiglu_ref(h: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``a[M, I] = silu(gate) * up`` in float32 (module docstring), rounded to ``h.dtype``."""
    gate, up = split_gate_up(h, interleaved)
    g = gate.float()
    return (g * sigmoid_f32(g) * up.float()).to(h.dtype)


def gather_quantize_act_ref(src: torch.Tensor, index: torch.Tensor) -> Quantized:
    """PyTorch reference of :func:`gather_quantize_act`."""
    _check_gather(src, index)
    rows = torch.cat([src, src.new_zeros(1, src.shape[1])])[index]
    return blockwise.quantize_act(rows)


def swiglu_quantize_act_ref(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, ...]:
    """PyTorch reference of :func:`swiglu_quantize_act`."""
    _check_h(h, "fp8kit::moe_swiglu_quant_act")
    a = swiglu_ref(h, interleaved)
    return (a, *blockwise.quantize_act(a))


# --------------------------------------------------------------------------- ops

def _triton_kernels():
    """:mod:`fp8kit.moe.token_quant_triton`, or None (``base.triton_lib.triton_module``)."""
    return triton_module("fp8kit.moe.token_quant_triton", "MoE token quantization")


@torch.library.custom_op("fp8kit::moe_gather_quant_act", mutates_args=())
def _gather_op(src: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return gather_quantize_act_ref(src, index)


@_gather_op.register_kernel("cuda")
def _(src, index):
    _check_gather(src, index)
    kernels = _triton_kernels()
    if kernels is None:
        return gather_quantize_act_ref(src, index)
    src = src if src.stride(1) == 1 else src.contiguous()
    with torch.cuda.device(src.device):
        return kernels.gather_quantize_act(src, index.contiguous())


@_gather_op.register_fake
def _(src, index):
    _check_gather(src, index)
    return blockwise.empty_act_outputs(src, index.shape[0], src.shape[1])


@torch.library.custom_op("fp8kit::moe_swiglu_quant_act", mutates_args=())
def _swiglu_op(h: torch.Tensor, interleaved: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_quantize_act_ref(h, interleaved)


@_swiglu_op.register_kernel("cuda")
def _(h, interleaved):
    _check_h(h, "fp8kit::moe_swiglu_quant_act")
    kernels = _triton_kernels()
    if kernels is None:
        return swiglu_quantize_act_ref(h, interleaved)
    h = h if h.stride(1) == 1 else h.contiguous()
    with torch.cuda.device(h.device):
        return kernels.swiglu_quantize_act(h, interleaved)


@_swiglu_op.register_fake
def _(h, interleaved):
    i = _check_h(h, "fp8kit::moe_swiglu_quant_act")
    return (h.new_empty(h.shape[0], i), *blockwise.empty_act_outputs(h, h.shape[0], i))


# --------------------------------------------------------------------------- public entry points

def gather_quantize_act(src: torch.Tensor, index: torch.Tensor) -> Quantized:
    """Both blockwise FP8 copies of the rows ``src`` gathered by ``index`` (a zero row where ``index == T``).

    Equal bit for bit to ``fp8kit.fp8.blockwise.quantize_act(torch.cat([src, zeros(1, K)])[index])``; on
    CUDA one Triton kernel reads each source row through ``index`` and never writes the gathered copy.

    Args:
        src: ``[T, K]`` bf16 / fp16 / fp32 tokens, ``K`` a multiple of 128.
        index: ``[M]`` int64 (or int32) source row of each output row, on ``src``'s device, values in
            ``[0, T]``, ``T`` meaning a zero row (``routing.Dispatch.gather_idx``). Values outside that
            range are the caller's contract: the CPU path raises IndexError (and wraps negative values),
            the CUDA kernel does not check them.

    Returns:
        ``(q, s_t, qt, st)``: E4M3 ``q[Mp, K]``, float32 ``s_t[K/128, Mp]``, E4M3 ``qt[K, Mp]``, float32
        ``st[Mp/128, K]``, ``Mp = padded_rows(M)``; layouts of :func:`fp8kit.fp8.blockwise.quantize_act`.

    Raises:
        ValueError: ``src`` not 2-D float or ``K`` not a multiple of 128; ``index`` not a 1-D integer
            tensor on ``src``'s device (the message names the shapes).
    """
    return torch.ops.fp8kit.moe_gather_quant_act(src, index)


def swiglu_quantize_act(h: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, ...]:
    """SwiGLU of the gate_up output and both blockwise FP8 copies of the result, from one read of ``h``.

    Args:
        h: ``[M, 2I]`` bf16 / fp16 / fp32, ``I`` a multiple of 128; gate and up split as by
            :func:`split_gate_up` (halves, or even / odd columns when ``interleaved``).
        interleaved: the gate_up layout (transformers' ``is_concatenated = False``).

    Returns:
        ``(a, q, s_t, qt, st)``: ``a[M, I] = silu(gate) * up`` in ``h.dtype`` (float32 math, one rounding;
        SiLU as in the module docstring), then ``quantize_act(a)`` of those rounded values: E4M3
        ``q[Mp, I]``, float32 ``s_t[I/128, Mp]``, E4M3 ``qt[I, Mp]``, float32 ``st[Mp/128, I]``.

    Raises:
        ValueError: ``h`` not 2-D float or its last dim not a multiple of 256 (names the shape).
    """
    return torch.ops.fp8kit.moe_swiglu_quant_act(h, interleaved)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Gradient of ``a = silu(gate) * up`` with respect to ``h[M, 2I]``, given ``da[M, I]``.

    ``dgate = da * up * s * (1 + g * (1 - s))`` and ``dup = da * g * s`` with ``s = sigmoid(g)``, in float32
    (``torch.sigmoid``: within an ulp of the forward's, far below the rounding of ``dh``), rounded to
    ``h.dtype`` and laid out as ``h`` (halves or interleaved). Plain PyTorch: Inductor fuses it.

    Raises:
        ValueError: ``h`` as in :func:`swiglu_quantize_act`, or ``da`` not of shape ``[M, I]``.
    """
    i = _check_h(h, "swiglu_backward")
    if da.shape != (h.shape[0], i):
        raise ValueError(f"swiglu_backward: da must have shape {(h.shape[0], i)} for h {tuple(h.shape)}, "
                         f"got {tuple(da.shape)}")
    gate, up = split_gate_up(h, interleaved)
    g, u, d = gate.float(), up.float(), da.float()
    s = torch.sigmoid(g)
    dg = d * u * s * (1.0 + g * (1.0 - s))
    du = d * g * s
    if interleaved:
        return torch.stack([dg, du], dim=2).reshape(h.shape).to(h.dtype)
    return torch.cat([dg, du], dim=1).to(h.dtype)
