"""The delayed recipe's fused SwiGLU MLP on a CUDA GPU (marker ``gpu``; skipped without an FP8 GPU): the Triton
backward-cast kernel against the PyTorch reference, and the fused MLP compiled against the three compiled linears.

Run on the H100: ``pytest -m gpu tests/test_delayed_mlp_gpu.py -s``. The CPU twins are in
``tests/test_delayed_mlp.py``.
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.fp8.delayed_state import E4M3, E5M2
from fp8kit.fp8.scaling import quantize
from fp8kit.fp8.swiglu import swiglu_backward_ref, swiglu_ref
from tests.conftest import sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with FP8 tensor cores (sm89+)"),
]


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _inputs(m, i, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda s: (torch.randn(m, i, generator=g, device="cuda") * s).to(dtype)  # noqa: E731
    gate, up, da = mk(2.0), mk(1.0), mk(1e-3)
    gate[0, : min(i, 3)] = torch.tensor([-88.0, 30.0, -0.0], dtype=dtype, device="cuda")[: min(i, 3)]  # sigmoid edges
    return gate, up, da


@pytest.mark.parametrize("m,i", [(8192, 14336), (1000, 384), (77, 1000), (4096, 4096), (1, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_casts_are_the_reference_casts_of_its_values(m, i, dtype):
    from fp8kit.fp8.kernels.swiglu_delayed_triton import swiglu_backward_cast

    g, u, da = _inputs(m, i, seed=m + i, dtype=dtype)
    sg, su, sa = (torch.tensor(v, device="cuda") for v in (57344.0 / 4e-3, 57344.0 / 3e-3, 448.0 / 16.0))
    qg, qgt, qu, qut, qat, amax, vg, vu, va = swiglu_backward_cast(g, u, da, sg, su, sa, write_values=True)
    want = (quantize(vg, sg, E5M2), quantize(vg, sg, E5M2).t().contiguous(), quantize(vu, su, E5M2),
            quantize(vu, su, E5M2).t().contiguous(), quantize(va, sa, E4M3).t().contiguous())
    for name, a, b in zip(("qg", "qgt", "qu", "qut", "qat"), (qg, qgt, qu, qut, qat), want, strict=True):
        same = _bits(a) == _bits(b)
        assert same.all(), f"{name}: {(~same).sum().item()} of {same.numel()} bytes differ from the reference cast"
    assert torch.equal(amax, torch.stack([vg.abs().amax().float(), vu.abs().amax().float()]))
    # the values: the reference's within a bf16 / fp16 ulp (the hardware's exp in the sigmoid)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    rg, ru = swiglu_backward_ref(da, g, u)
    for name, x, y in (("dg", vg, rg), ("du", vu, ru), ("a", va, swiglu_ref(g, u))):
        beyond = ((x.float() - y.float()).abs() > y.float().abs() * ulp).float().mean().item()
        print(f"{m}x{i} {dtype}: {name} beyond one ulp of the reference: {beyond:.2e}")
        assert beyond <= 1e-4, f"{name}: {beyond:.2e} of the values beyond one ulp of the reference"
    # the op dispatches to the kernel and gives the same bits as the direct launch
    from fp8kit.fp8.swiglu_delayed import swiglu_backward_cast as op

    for a, b in zip(op(g, u, da, sg, su, sa), (qg, qgt, qu, qut, qat, amax), strict=True):
        assert torch.equal(_bits(a), _bits(b))


def test_nan_reaches_the_amax_and_an_empty_input_works():
    from fp8kit.fp8.swiglu_delayed import swiglu_backward_cast

    g, u, da = _inputs(300, 256, seed=5)
    da[7, 9] = float("nan")
    s = torch.tensor(100.0, device="cuda")
    amax = swiglu_backward_cast(g, u, da, s, s, s)[5]
    assert torch.isnan(amax).all(), amax
    e = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    out = swiglu_backward_cast(e, e, e, s, s, s)
    assert out[1].shape == (256, 0) and torch.equal(out[5], torch.zeros(2, device="cuda"))


def test_compiled_fused_mlp_against_the_compiled_linears():
    """A 2-layer llama-125m with the delayed recipe, compiled per block, fused and unfused, 4 steps (the first
    runs the linears): losses and gradients as close to each other as FP8 allows, both close to BF16's."""
    from tests.test_delayed_mlp import _llama

    out = {}
    for name, fused, extra in (("fused", True, []), ("unfused", False, []),
                               ("bf16", False, ["train.mixed_precision=bf16"])):
        torch._dynamo.reset()
        model, done = _llama(fused, extra=["train.compile=true", *extra])
        assert any("fp8.delayed_fused_mlp: 2 of 2 SwiGLU MLPs run" in n for n in done.facts) == fused, done.facts
        model.cuda()
        for blk in model.model.layers:
            blk.compile()
        out[name] = _steps_cuda(model, 4)
    for (name, gf), (_, gp), (_, gb) in zip(out["fused"][1], out["unfused"][1], out["bf16"][1], strict=True):
        db_f, db_p = sqnr(gb, gf), sqnr(gb, gp)
        print(f"{name}: fused {db_f:.1f} dB, unfused {db_p:.1f} dB from BF16")
        assert db_f >= db_p - 1.5, f"{name}: fused {db_f:.1f} dB vs unfused {db_p:.1f} dB from BF16"
    lf, lp = out["fused"][0], out["unfused"][0]
    assert abs(lf - lp) <= 2e-3 * abs(lp), (lf, lp)


def _steps_cuda(model, n):
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, 1024, (2, 256), generator=gen, device="cuda")
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.item(), [(n_, p.grad.double().cpu()) for n_, p in model.named_parameters()]
