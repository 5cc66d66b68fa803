"""The fused SwiGLU MLP of the blockwise recipe on a CUDA GPU (marker ``gpu``; skipped without CUDA): its two
Triton kernels against the PyTorch reference bit for bit, the fused MLP on cuBLAS against the three blockwise
linears and float64, compiled against eager, and the casts it launches.

Run on a Hopper GPU: ``pytest -m gpu tests/test_swiglu_mlp_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8kit.fp8 import blockwise, swiglu
from fp8kit.fp8.linear import Float8BlockwiseLinear
from fp8kit.fp8.swiglu_mlp import blockwise_swiglu_mlp
from tests.conftest import sqnr
from tests.test_blockwise_gpu import _assert_same, _poison_allocator, _real

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_NAMES = ("q", "s_t", "qt", "st")


@pytest.mark.parametrize("m,i,dtype", [
    (8192, 14336, torch.bfloat16), (1000, 4096, torch.bfloat16), (1001, 640, torch.bfloat16),
    (130, 384, torch.float32), (1, 256, torch.bfloat16),
])
def test_triton_swiglu_kernels_cast_their_values_bit_for_bit(m, i, dtype):
    """The kernels' FP8 copies equal ``blockwise.quantize_act`` of the SwiGLU values they computed, bit for bit;
    those values are the PyTorch reference's within a bf16 ulp (the kernels' sigmoid is the hardware's)."""
    kernels = swiglu._kernels()
    assert kernels is not None, "the Triton kernels did not load on this CUDA machine"
    g = _real(m, i, scale=2.0, seed=m + i, dtype=dtype)
    u = _real(m, i, seed=m + i + 1, dtype=dtype)
    da = _real(m, i, scale=1e-3, seed=m + i + 2, dtype=dtype)
    g.view(-1)[:7] = torch.tensor([-100.0, -87.5, -60.0, 0.0, 30.0, 90.0, -1e-20], dtype=dtype)  # exp's edges
    gc, uc, dac = g.cpu(), u.cpu(), da.cpu()
    rel = 2.0**-7 if dtype == torch.bfloat16 else 1e-5  # a bf16 ulp; float32: the fast exp's error
    for wgrad_x in blockwise.WGRAD_X_BLOCKS:
        _poison_allocator(8 * blockwise.padded_rows(m) * i)
        *got, a = kernels.swiglu_quantize_act(g, u, wgrad_x, values=True)
        torch.cuda.synchronize()
        _assert_same(got, blockwise.quantize_act(a.cpu(), wgrad_x), _NAMES, f"swiglu {m}x{i} {wgrad_x}")
        _assert_same(swiglu.swiglu_quantize_act(g, u, wgrad_x), got, _NAMES, f"swiglu op {m}x{i} {wgrad_x}")
        ref = swiglu.swiglu_ref(gc, uc).float()
        off = (a.cpu().float() - ref).abs() > rel * ref.abs()
        assert not off.any(), f"swiglu {m}x{i}: {off.sum().item()} values more than one ulp from the reference"
    _poison_allocator(16 * blockwise.padded_rows(m) * i)
    *got, dg, du = kernels.swiglu_backward_quantize(da, g, u, values=True)
    torch.cuda.synchronize()
    names = [f"d{w} {n}" for w in ("gate", "up") for n in _NAMES]
    _assert_same(got, (*blockwise.quantize_act(dg.cpu()), *blockwise.quantize_act(du.cpu())), names,
                 f"swiglu backward {m}x{i}")
    _assert_same(swiglu.swiglu_backward_quantize(da, g, u), got, names, f"swiglu backward op {m}x{i}")
    for name, got_v, ref_v in zip(("dg", "du"), (dg, du), swiglu.swiglu_backward_ref(dac, gc, uc), strict=True):
        db = sqnr(ref_v.double(), got_v.cpu().double())
        print(f"{m}x{i} {dtype}: {name} {db:.1f} dB from the reference")
        assert db >= 45.0, f"swiglu backward {m}x{i}: {name} {db:.1f} dB from the reference (< 45 dB)"


def _case(m, h, i, seed):
    lins = [torch.nn.Linear(a, b, bias=False, device="cuda", dtype=torch.bfloat16) for a, b in ((h, i), (h, i), (i, h))]
    for k, lin in enumerate(lins):
        lin.weight.data.copy_(_real(*lin.weight.shape, scale=0.02, seed=seed + k))
    return lins, _real(m, h, seed=seed + 5).requires_grad_(), _real(m, h, scale=1e-2, seed=seed + 6)


@pytest.mark.parametrize("wgrad_x", blockwise.WGRAD_X_BLOCKS)
def test_fused_mlp_on_cublas_matches_unfused_and_float64(wgrad_x):
    lins, x, dy = _case(4000, 1024, 2816, seed=20)
    weights = [lin.weight for lin in lins]
    fp8 = [Float8BlockwiseLinear.from_linear(lin, wgrad_x=wgrad_x, cache_weight=False) for lin in lins]
    xd, wd = x.double(), [w.double() for w in weights]
    y_ref = (F.silu(xd @ wd[0].t()) * (xd @ wd[1].t())) @ wd[2].t()
    ref = (y_ref, *torch.autograd.grad(y_ref, (x, *weights), dy.double()))
    y_un = fp8[2](F.silu(fp8[0](x)) * fp8[1](x))
    unfused = (y_un, *torch.autograd.grad(y_un, (x, *weights), dy))
    y_fu = blockwise_swiglu_mlp(x, *weights, cache_weight=False, wgrad_x=wgrad_x)
    fused = (y_fu, *torch.autograd.grad(y_fu, (x, *weights), dy))
    for name, r, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), ref, unfused, fused, strict=True):
        vs_unfused, db_f, db_u = sqnr(a.double(), b.double()), sqnr(r, b.double()), sqnr(r, a.double())
        print(f"{wgrad_x} {name}: fused vs unfused {vs_unfused:.1f} dB; vs float64 fused {db_f:.2f}, unfused {db_u:.2f}")
        assert vs_unfused >= 35.0, f"{name}: fused vs unfused {vs_unfused:.1f} dB (< 35 dB)"
        assert db_f >= 22.0 and db_f >= db_u - 0.5, f"{name}: fused {db_f:.2f} dB vs unfused {db_u:.2f} from float64"


def test_compiled_fused_mlp_equals_eager_and_launches_two_activation_casts():
    """Compiled (fullgraph) = eager bit for bit; one forward + backward casts x and dy with the activation kernel
    (not five tensors: a, dg, du are cast inside the SwiGLU kernels)."""
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    lins, x, dy = _case(2048, 1024, 2816, seed=30)
    weights = [lin.weight for lin in lins]

    def f(x, *w):
        return blockwise_swiglu_mlp(x, *w, cache_weight=False)

    y = f(x, *weights)
    grads = torch.autograd.grad(y, (x, *weights), dy)
    cf = torch.compile(f, fullgraph=True)
    yc = cf(x, *weights)
    grads_c = torch.autograd.grad(yc, (x, *weights), dy)
    assert torch.equal(y, yc)
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, grads_c, strict=True):
        assert torch.equal(a, b), f"compiled {name} differs: max {(a - b).abs().max().item()}"
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(cf(x, *weights), (x, *weights), dy)
        torch.cuda.synchronize()
    # the activation cast is the Triton _act_quant_kernel, or for a bf16 input with 128x1 wgrad blocks the Gluon
    # _act_quant_128x1_kernel where Triton ships Gluon (blockwise_triton.gluon_applies; session 47)
    kernels = {
        "act_cast": ("_act_quant_kernel", "_act_quant_128x1_kernel"),
        "_swiglu_quant_kernel": ("_swiglu_quant_kernel",),
        "_swiglu_bwd_quant_kernel": ("_swiglu_bwd_quant_kernel",),
    }
    counts: dict[str, int] = {}
    for e in prof.events():
        for k, names in kernels.items():
            if any(n in e.name for n in names):
                counts[k] = counts.get(k, 0) + 1
    assert counts == {"act_cast": 2, "_swiglu_quant_kernel": 1, "_swiglu_bwd_quant_kernel": 1}, counts
