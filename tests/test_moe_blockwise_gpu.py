"""Blockwise FP8 MoE experts on the GPU (marker ``gpu``; skipped without CUDA): cuBLAS blockwise GEMMs per expert
(``moe/grouped_loop.py``) against the float32 emulation of the same quantized operands and against float64.

Run on the H100: ``pytest -m gpu -s tests/test_moe_blockwise_gpu.py``. Thresholds: cuBLAS vs emulation >= 50 dB
(the dense blockwise GEMM measured 60-62 dB: both compute the same products, differing in accumulation
order and the bf16 output rounding); vs float64 >= 25 dB per GEMM (the MoE issue's floor), including an empty
expert and uneven groups.
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.moe.grouped_loop import blockwise_loop_mm
from tests.conftest import sqnr
from tests.test_moe_grouped import grouped_reference_f64

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("wgrad_x", ["128x1", "128x128"])
@pytest.mark.parametrize("k, n", [(2048, 1536), (768, 2048), (7168, 4096)])
def test_cublas_loop_matches_emulation_and_float64(k, n, wgrad_x):
    sizes = [1024, 0, 48, 2000, 16, 512, 0, 304]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    p = int(offs[-1]) + 16
    x = torch.randn(p, k, device=dev, generator=gen).to(torch.bfloat16)
    x[int(offs[-1]):] = 0
    w = (torch.randn(len(sizes), n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
    g = torch.randn(p, n, device=dev, generator=gen).to(torch.bfloat16)
    outs = {}
    for emulate in (False, True):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = blockwise_loop_mm(xx, ww, offs, emulate=emulate, wgrad_x=wgrad_x)
        y.backward(g)
        outs[emulate] = (y.float(), xx.grad.float(), ww.grad.float())
    ref = grouped_reference_f64(x, w, offs, g)
    last, used = int(offs[-1]), [i for i, s in enumerate(sizes) if s]
    for j, what in enumerate(("fprop", "dgrad", "wgrad")):
        cut = (lambda t: t[used]) if what == "wgrad" else (lambda t: t[:last])
        db_emul = sqnr(cut(outs[True][j]), cut(outs[False][j]))
        db_f64 = sqnr(cut(ref[j]).float(), cut(outs[False][j]))
        print(f"{k}x{n} wgrad_x {wgrad_x} {what}: cuBLAS vs emulation {db_emul:.1f} dB, vs float64 {db_f64:.1f} dB")
        assert db_emul >= 50.0, f"{what}: cuBLAS vs emulation {db_emul:.1f} dB < 50"
        assert db_f64 >= 25.0, f"{what}: cuBLAS vs float64 {db_f64:.1f} dB < 25"
    for i, s in enumerate(sizes):
        if not s:
            assert outs[False][2][i].abs().max().item() == 0.0, f"empty expert {i} got a nonzero wgrad"


def test_cached_expert_weights_give_the_uncached_bits_on_cuda():
    """``cache_weight=True`` on CUDA (the cached op over the Triton weight cast; 3 experts with rows): two calls in one optimizer step give
    the bits of the uncached loop, the second without casting (hits, no misses)."""
    from fp8kit.fp8.kernels import ops

    sizes, k, n = [512, 0, 300, 128], 2048, 1536
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    x = torch.randn(int(offs[-1]), k, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(len(sizes), n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
    g = torch.randn(int(offs[-1]), n, device=dev, generator=gen).to(torch.bfloat16)
    runs = []
    for cache in (False, True, True):
        xx, ww = x.clone().requires_grad_(), (w if cache else w.clone()).requires_grad_()
        ww.grad = None  # the cached runs share w (its storage is the cache key): a fresh gradient each
        before = ops.weight_cache_stats()
        y = blockwise_loop_mm(xx, ww, offs, cache_weight=cache)
        y.backward(g)
        after = ops.weight_cache_stats()
        runs.append(((y, xx.grad, ww.grad.clone()), after["misses"] - before["misses"], after["hits"] - before["hits"]))
    assert [r[1:] for r in runs] == [(0, 0), (3, 0), (0, 3)], [r[1:] for r in runs]
    for name, a, b in zip(("out", "dx", "dw"), runs[0][0], runs[2][0], strict=True):
        assert torch.equal(a, b), f"{name}: cached differs from uncached, max |diff| {(a - b).abs().max().item()}"
