"""SiLU's sigmoid in float32, bit-reproducible between PyTorch and Triton (used by the fused SwiGLU casts).

``silu(g) = g * sigmoid(g)``, ``sigmoid(g) = 1 / (1 + exp(-g))`` in float32, with ``exp`` spelled out as
Cephes' ``expf`` (S. L. Moshier, Cephes Math Library, ``expf.c``: Cody-Waite reduction by ln 2, degree-5
polynomial, 2^n from its exponent bits) in IEEE float32 multiplies and adds and an IEEE division
(:func:`sigmoid_f32`; within 3e-7 relative of the exact sigmoid). Library ``exp`` is not correctly rounded
(torch's Sleef on the CPU, Triton's ``ex2.approx`` on the GPU): with it a SwiGLU output would differ by a bf16
ulp now and then. Spelled out, the Triton kernels (``fp8.kernels.blockwise_triton._sigmoid``, compiled with FMA
contraction off) and this reference compute the same bits. ``-g`` is clamped to ``[-87, 87]`` (2^n stays
normal; for ``g >= 87`` ``1 + exp(-g)`` rounds to 1 anyway) and ``sigmoid(g) = 0`` for ``g < -87`` (exact
value below 1.7e-38).

Users: the MoE token path (:mod:`fp8kit.moe.token_quant`) and the dense fused SwiGLU MLP
(:mod:`fp8kit.fp8.swiglu`).
"""

from __future__ import annotations

import struct

import torch


def _f32(c: float) -> float:
    """``c`` rounded to the nearest float32 (so Python, torch and Triton hold the same constant)."""
    return struct.unpack("f", struct.pack("f", c))[0]


# Cephes expf: reduction constants and polynomial.
EXP_LOG2E = _f32(1.44269504088896341)
EXP_C1 = _f32(0.693359375)
EXP_C2 = _f32(-2.12194440e-4)
EXP_P = tuple(_f32(p) for p in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                1.6666665459e-1, 5.0000001201e-1))
#: |g| bound of the exp argument (2^n stays a normal float32); sigmoid is 0 below -SILU_CLAMP.
SILU_CLAMP = 87.0


def sigmoid_f32(g: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-g))`` of float32 ``g``, ``exp`` spelled out as Cephes' ``expf`` (module docstring).

    Every line is one IEEE float32 operation, in the order the Triton kernels' ``_sigmoid`` performs them.
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
