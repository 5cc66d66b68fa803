"""The scale formula of ``fp8kit.fp8.scaling`` as Triton device functions, for fp8kit's Triton kernels.

Twins of the PyTorch functions (the same formula in float32; ``benchmarks/optimizer_step.py`` checks
that the Triton FP8AdamW step agrees with the PyTorch reference on a GPU):

- ``scale_from_amax(amax, MAX, EPS)`` = ``MAX / min(max(amax, EPS), F32_MAX)``, the twin of
  ``scaling.scale_from_amax(amax, dtype, eps)``;
- ``saturate(y, MAX)`` = ``min(max(y, -MAX), MAX)``, the clamp of ``scaling.quantize`` before its cast.

``MAX`` is the format's largest finite value (``scaling.DTYPE_MAX[dtype]``) and ``EPS`` the amax floor
(``scaling.AMAX_EPS`` or the caller's), both ``tl.constexpr``. Triton is optional (CUDA only): import
this module only from code that already runs Triton kernels (``fp8kit.optim.triton_step``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8kit.fp8.scaling import F32_MAX

#: ``scaling.F32_MAX`` as a literal: a Triton function may not read a Python global that is not a constexpr.
_F32_MAX_LITERAL = 3.4028234663852886e38
if _F32_MAX_LITERAL != F32_MAX:  # pragma: no cover - guards an edit of one of the two
    raise RuntimeError(f"fp8kit.fp8.triton_scale: literal {_F32_MAX_LITERAL} differs from scaling.F32_MAX {F32_MAX}")


@triton.jit
def scale_from_amax(amax, MAX: tl.constexpr, EPS: tl.constexpr):
    """``MAX / min(max(amax, EPS), F32_MAX)`` (float32, elementwise): ``scaling.scale_from_amax``."""
    return MAX / tl.minimum(tl.maximum(amax, EPS), 3.4028234663852886e38)


@triton.jit
def saturate(y, MAX: tl.constexpr):
    """``y`` clamped to ``[-MAX, MAX]`` (the saturating cast of ``scaling.quantize``, before the cast)."""
    return tl.minimum(tl.maximum(y, -MAX), MAX)
