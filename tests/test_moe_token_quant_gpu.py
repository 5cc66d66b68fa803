"""MoE token-path quantization on a CUDA GPU (marker ``gpu``; skipped without CUDA): the Triton kernels of
:mod:`fp8kit.moe.token_quant_triton` against the PyTorch reference on the CPU, bit for bit.

Run on a Hopper GPU: ``pytest -m gpu tests/test_moe_token_quant_gpu.py``. What is asserted: every output
(``q``, ``s_t``, ``qt``, ``st`` and, for SwiGLU, ``a``) has exactly the reference's bits. For ``a`` this
holds because both sides evaluate SiLU by the same float32 operation sequence (Cephes ``expf`` spelled
out, IEEE reciprocal; the kernel is compiled without FMA contraction), not with a library ``exp``.
Inputs are randn with outliers, plus gates in the clamped SiLU ranges (|g| > 87).
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.fp8 import blockwise
from fp8kit.moe import token_quant as tq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

QUANT = ("q", "s_t", "qt", "st")


def _real(*shape, scale=1.0, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, generator=g, device="cuda") * scale
    n = max(1, t.numel() // 1000)
    idx = torch.randint(0, t.numel(), (n,), generator=g, device="cuda")
    t.view(-1)[idx] *= torch.empty(n, device="cuda").uniform_(10, 30, generator=g)
    return t.to(dtype)


def _poison_allocator(nbytes: int) -> None:
    """Leave freed blocks full of 0x7F (E4M3 NaN, a float32 NaN pattern) for the next allocations."""
    torch.full((nbytes,), 0x7F, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got, ref, names, where):
    for name, a, b in zip(names, got, ref, strict=True):
        a = a.cpu()
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where} {name}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        diff = (_bits(a) != _bits(b)).sum().item()
        assert diff == 0, f"{where} {name}: {diff} of {a.numel()} elements differ from the reference"


@pytest.mark.parametrize("t,k,m", [(4096, 2048, 16384), (4096, 7168, 16384), (4096, 2048, 1000),
                                   (4096, 7168, 1000), (37, 256, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_quant_matches_reference_bit_for_bit(t, k, m, dtype):
    src = _real(t, k, seed=t + k + m, dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(m)
    index = torch.randint(0, t + 1, (m,), generator=g, device="cuda")
    index[torch.rand(m, generator=g, device="cuda") < 0.1] = t  # ~10% zero rows (dispatch padding)
    _poison_allocator(8 * blockwise.padded_rows(m) * k)
    got = tq.gather_quantize_act(src, index)
    torch.cuda.synchronize()
    ref = tq.gather_quantize_act_ref(src.cpu(), index.cpu())
    _assert_same(got, ref, QUANT, f"gather T={t} K={k} M={m} {dtype}")


@pytest.mark.parametrize("m,i", [(16384, 2048), (16384, 768), (1000, 2048), (1000, 7168), (1, 128)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_swiglu_quant_matches_reference_bit_for_bit(m, i, interleaved):
    h = _real(m, 2 * i, scale=3.0, seed=m + i + interleaved)
    gates = torch.tensor([-1e4, -100.0, -87.5, -86.9, 86.9, 87.5, 100.0, 0.0], device="cuda").to(h.dtype)
    tq.split_gate_up(h, interleaved)[0][0, : gates.numel()] = gates  # the SiLU clamps, in the gate columns
    _poison_allocator(8 * blockwise.padded_rows(m) * i)
    got = tq.swiglu_quantize_act(h, interleaved)
    torch.cuda.synchronize()
    ref = tq.swiglu_quantize_act_ref(h.cpu(), interleaved)
    _assert_same(got, ref, ("a", *QUANT), f"swiglu M={m} I={i} interleaved={interleaved}")


def test_swiglu_quant_fp16_and_fp32_inputs():
    for dtype in (torch.float16, torch.float32):
        h = _real(1000, 1024, scale=3.0, seed=9, dtype=dtype)
        got = tq.swiglu_quantize_act(h, False)
        _assert_same(got, tq.swiglu_quantize_act_ref(h.cpu(), False), ("a", *QUANT), f"swiglu {dtype}")


def test_compile_matches_eager_on_cuda():
    torch._dynamo.reset()

    def path(src, index, h):
        return (*tq.gather_quantize_act(src, index), *tq.swiglu_quantize_act(h, True))

    src, h = _real(512, 1024, seed=1), _real(2000, 1536, seed=2)
    index = torch.randint(0, 513, (2000,), device="cuda")
    eager = path(src, index, h)
    compiled = torch.compile(path, fullgraph=True)(src, index, h)
    _assert_same(compiled, [t.cpu() for t in eager], (*QUANT, "a", *QUANT), "compiled")
