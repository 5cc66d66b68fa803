"""The Triton cast-transpose kernel (``fp8kit::cast_transpose`` on CUDA) equals the PyTorch reference of the
same math bit for bit (marker ``gpu``; run on the H100: ``pytest -m gpu -s tests/test_cast_transpose_gpu.py``).

The CPU twin (the reference path CI runs) is ``tests/test_cast_transpose.py``.
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.fp8.kernels.cast_ops import cast_transpose, cast_transpose_reference, load_cuda_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

@pytest.fixture(autouse=True)
def _triton_op_loaded():
    """Compiled code takes the triton_op only once it is registered (``cast_ops.load_cuda_kernels``, which a
    delayed linear calls at construction): load it before any test compiles, whatever ran first in this worker."""
    assert load_cuda_kernels(), "the Triton cast-transpose kernel did not load"


SHAPES = [(4096, 4096), (8192, 14336), (1000, 1001), (1, 4096), (4096, 1), (333, 96), (0, 64)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mergeable", [False, True], ids=["triton_op", "custom_op"])
def test_kernel_equals_reference_bit_for_bit(shape, dtype, src, mergeable):
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g, device="cuda") * 3).to(src)
    if x.numel():
        x.view(-1)[:: max(1, x.numel() // 7)] *= 1e3  # saturating values at this scale (E4M3)
    scale = torch.tensor(57.3, device="cuda")
    for transpose in (True, False):
        got = cast_transpose(x, scale, dtype, transpose, mergeable=mergeable)
        ref = cast_transpose_reference(x, scale, dtype, transpose)
        assert torch.equal(_bits(got[0]), _bits(ref[0])), f"q differs at {shape} {dtype}"
        assert got[1].shape == ref[1].shape and torch.equal(_bits(got[1]), _bits(ref[1])), f"qt differs at {shape}"
        assert torch.equal(got[2], ref[2]), f"amax {got[2].item()} != {ref[2].item()}"


def test_strided_rows_and_nan():
    x = torch.randn(512, 768, device="cuda").bfloat16()[:, :640]
    scale = torch.tensor(0.5, device="cuda")
    got, ref = cast_transpose(x, scale, torch.float8_e4m3fn), cast_transpose_reference(x, scale, torch.float8_e4m3fn, True)
    assert all(torch.equal(_bits(a) if a.dtype != torch.float32 else a, _bits(b) if b.dtype != torch.float32 else b)
               for a, b in zip(got, ref, strict=True))
    x = x.contiguous()
    x[100, 7] = float("nan")
    assert torch.isnan(cast_transpose(x, scale, torch.float8_e4m3fn)[2]), "a NaN must reach the amax"
    x[100, 7] = 0.0
    x.view(torch.int16)[3, 200] = -64  # bf16 -NaN (0xFFC0): the atomic max of the bits must still give a NaN
    for mergeable in (False, True):
        assert torch.isnan(cast_transpose(x, scale, torch.float8_e4m3fn, mergeable=mergeable)[2]), "-NaN lost"


def test_compiled_equals_eager():
    x = torch.randn(2048, 1536, device="cuda").bfloat16()
    scale = torch.tensor(11.0, device="cuda")
    fn = torch.compile(lambda x, s: cast_transpose(x * 2, s, torch.float8_e5m2), fullgraph=True)
    got, ref = fn(x, scale), cast_transpose(x * 2, scale, torch.float8_e5m2)
    assert torch.equal(_bits(got[0]), _bits(ref[0])) and torch.equal(_bits(got[1]), _bits(ref[1]))
    assert torch.equal(got[2], ref[2])


def _launches(fn, *args) -> dict[str, int]:
    """Kernel launches and fp8kit host ops of one call of ``fn`` (profiled)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for e in prof.events():
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        # kernels counted on the GPU (Inductor also names a host record after each launch), ops on the host
        for k, where in (("_cast_transpose_kernel", True), ("aten::amax", False),
                         ("fp8kit::cast_transpose", False)):
            if k in e.name and on_gpu == where and "cast_transpose_triton" not in e.name:
                counts[k] = counts.get(k, 0) + 1
    return counts


class _TwoCasts(torch.autograd.Function):
    """Two casts of one input at one scale inside a training graph's forward, as sibling linears make them
    (AOTAutograd's CSE runs on the joint graph of a compiled training step, not on an inference graph)."""

    @staticmethod
    def forward(ctx, x, s, mergeable):
        a = cast_transpose(x, s, torch.float8_e4m3fn, True, mergeable=mergeable)
        b = cast_transpose(x, s, torch.float8_e4m3fn, True, mergeable=mergeable)
        return a[0].view(torch.uint8), b[1].view(torch.uint8), a[2] + b[2]

    @staticmethod
    def backward(ctx, *grads):
        return None, None, None


def test_compiled_triton_op_launches_one_kernel_without_a_python_op():
    """Compiled, the triton_op is launched from Inductor's code: one cast kernel per cast (its amax by atomic max, no
    reduction after it; a one-element zero fill aside) and no ``fp8kit::cast_transpose`` host op; the mergeable custom op casts one input at one
    scale once however many times a training graph calls it (CSE), the triton_op once per call."""
    torch._dynamo.reset()
    x = torch.randn(4096, 2048, device="cuda").bfloat16().requires_grad_()
    scale = torch.tensor(3.0, device="cuda")
    for mergeable in (False, True):
        fn = torch.compile(lambda x, s, m=mergeable: _TwoCasts.apply(x * 2, s, m), fullgraph=True)
        eager = _TwoCasts.apply(x * 2, scale, mergeable)
        got = fn(x, scale)
        assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True)), f"mergeable={mergeable}: compiled != eager"
        counts = _launches(fn, x, scale)
        print(f"mergeable={mergeable}: {counts}")
        kernels = counts.get("_cast_transpose_kernel", 0)
        if mergeable:
            assert kernels == 1 and counts.get("fp8kit::cast_transpose", 0) == 1, counts
        else:
            assert kernels == 2 and counts.get("fp8kit::cast_transpose", 0) == 0, counts
        assert counts.get("aten::amax", 0) == 0, f"an amax reduction beside the cast: {counts}"
