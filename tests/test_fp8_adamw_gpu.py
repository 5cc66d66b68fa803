"""The Triton FP8AdamW step on a CUDA GPU (marker ``gpu``; skipped without CUDA), bit for bit.

Run on the H100: ``pytest -m gpu tests/test_fp8_adamw_gpu.py``. The reference is ``numerics.adamw_update``
run eagerly on the same CUDA tensors (the math the CPU tests check). The kernel reproduces it exactly: IEEE
division and square root, PyTorch's reciprocal-then-multiply for ``scalar / tensor``, the same integer
hash for stochastic rounding, no fused multiply-add (``optim/triton_step.py``). So the threshold is
equality of every stored bit (states, scales, working weights) after several steps, for the layouts the
kernel covers, with the gradients read in place through the address table or from the FP8 buffer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fp8kit.optim import FP8AdamW, FP8AdamWPrecision
from fp8kit.optim import numerics as N
from tests.fp8_adamw_util import flat_states

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NUMELS = [300, 1000, 5000, 7, 4096 * 3, 128]
#: every count a multiple of 8 bf16 elements (16 bytes): the table's gradients are read with 16-byte vector loads
NUMELS_VEC = [304, 1000, 5000, 8, 4096 * 3, 128]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


#: FSDP2 shards' stochastic-rounding offsets (``optim/sharded.py``): per tensor, including negative ones and one
#: that carries the index past 2^32 (the kernel's uint32 sum must wrap as the reference's int64 sum truncates)
NOISE_DELTA = [0, 1_000_003, -300, 2**32 - 2000, 5 * 10**9 + 17, 12_345_678]


def _run(impl: str, spec: N.StateSpec, pdtype: torch.dtype, table: bool, steps: int = 4, vec: int = 1,
         noise_delta: bool = False):
    """``steps`` steps of one flat group with ``impl`` ("reference" or "triton"); returns the buffers. ``vec``:
    the Triton step's gradient load width (> 1: the ``NUMELS_VEC`` counts, whose fresh gradients are aligned);
    ``noise_delta``: pass ``NOISE_DELTA`` as FSDP2 shards do."""
    from fp8kit.optim import triton_step  # Triton: CUDA machines only

    NUMELS = NUMELS_VEC if vec > 1 else globals()["NUMELS"]  # noqa: N806
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    L, bufs, work = flat_states(NUMELS, spec, dev, g, pdtype)
    n_scales = len(NUMELS) if spec.granularity == "tensor" else L.num_blocks
    for step in range(1, steps + 1):
        grads = [torch.randn(n, generator=g, device=dev).to(pdtype) * 10.0 ** (-2 - i % 3)
                 for i, n in enumerate(NUMELS)]
        if step == 2:
            grads[1] = None  # a parameter without a gradient this step
        hp = N.make_hp(1e-3, 0.9, 0.95, 1e-8, 0.1, step, 1).to(dev)
        hp[N.HP_CLIP] = 0.6
        flat = torch.zeros(L.total, device=dev, dtype=pdtype)
        for i, gr in enumerate(grads):
            if gr is not None:
                L.segment(flat, i).copy_(gr)
        args = (bufs["m"], bufs["m_scale"], None, bufs["v"], bufs["v_scale"], bufs["w"], bufs["w_scale"], work, hp,
                L.block_owner, spec)
        nd = torch.tensor(NOISE_DELTA, device=dev, dtype=torch.int64) if noise_delta else None
        if table:
            gargs, kw = (None, None), dict(
                grad_table=torch.tensor([[gr.data_ptr() if gr is not None else 0 for gr in grads],
                                         [n if gr is not None else 0 for gr, n in zip(grads, NUMELS, strict=True)]],
                                        device=dev, dtype=torch.int64),
                seg_start=torch.tensor(L.offsets, device=dev, dtype=torch.int64))
        else:
            g8, gs = torch.zeros(L.total, device=dev, dtype=spec.grad), torch.ones(n_scales, device=dev)
            N.store(flat.float().view(-1, spec.block), g8, gs, L.block_owner, spec)
            gargs, kw = (g8, gs), {}
        if impl == "triton":
            if vec > 1:
                assert all(gr is None or gr.data_ptr() % 16 == 0 for gr in grads)
                kw["grad_vec"] = vec
            triton_step.adamw_update_triton(*gargs, *args, noise_delta=nd, **kw)
        else:
            N.adamw_update(*((flat, None) if table else gargs), *args, noise_delta=nd)
    torch.cuda.synchronize()
    return {**bufs, "work": work}


CASES = {
    "defaults bf16 per tensor": (dict(), torch.bfloat16, True),
    "defaults bf16 per block": (dict(granularity="block"), torch.bfloat16, True),
    "defaults fp32 params": (dict(), torch.float32, True),
    "paper: e5m2 grads, m nearest": (dict(grad=E5M2, m_rounding="nearest"), torch.bfloat16, False),
    "paper per block": (dict(grad=E5M2, m_rounding="nearest", granularity="block"), torch.bfloat16, False),
    "e5m2 grads, m stochastic": (dict(grad=E5M2), torch.bfloat16, False),
    "fp16 m stochastic": (dict(m=torch.float16), torch.bfloat16, True),
    "fp32 m, fp32 master": (dict(m=torch.float32, master=torch.float32), torch.bfloat16, True),
    "block 64, e4m3 v": (dict(block=64, v=E4M3, granularity="block"), torch.bfloat16, True),
    # the table's gradients read with 16-byte vector loads (optim/triton_step.py, ``grad_vec``)
    "defaults bf16 per block, vector grad loads": (dict(granularity="block"), torch.bfloat16, True, 8),
    "defaults bf16 per tensor, vector grad loads": (dict(), torch.bfloat16, True, 8),
    "fp32 params, vector grad loads": (dict(), torch.float32, True, 4),
    # FSDP2 shards' noise offsets (the stochastic rounding of m, per tensor and per block)
    "noise delta per tensor": (dict(), torch.bfloat16, True, 1, True),
    "noise delta per block, vector grad loads": (dict(granularity="block"), torch.bfloat16, True, 8, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_step_equals_reference_bit_for_bit(case):
    from fp8kit.optim import triton_step

    over, pdtype, table, *extra = CASES[case]
    vec = extra[0] if extra else 1
    noise_delta = extra[1] if len(extra) > 1 else False
    base = N.StateSpec(block=128, num_tensors=len(NUMELS), granularity="tensor", grad=pdtype, m=E4M3,
                       v=torch.float16, master=torch.float16, stochastic_rounding=False, m_rounding="stochastic")
    spec = dataclasses.replace(base, **over)
    assert triton_step.supported(spec, torch.empty(0)), spec
    ref = _run("reference", spec, pdtype, table, vec=vec, noise_delta=noise_delta)
    tri = _run("triton", spec, pdtype, table, vec=vec, noise_delta=noise_delta)
    diffs = {}
    for name, a in ref.items():
        if a is None:
            continue
        b = tri[name]
        n_diff = int((_bits(a) != _bits(b)).sum())
        if n_diff:
            diffs[name] = (n_diff, float((a.float() - b.float()).abs().max()))
    print(f"{case}: elements differing (count, max abs diff) {diffs or 'none'}")
    assert not diffs, f"{case}: Triton differs from the reference: {diffs}"


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(1000, 256), nn.Linear(256, 768), nn.LayerNorm(768), nn.Linear(768, 256),
                         nn.Linear(256, 7)).to(device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("prec", [FP8AdamWPrecision(), FP8AdamWPrecision(granularity="block")], ids=["tensor", "block"])
def test_optimizer_triton_equals_eager_on_cuda(prec):
    """The whole optimizer (two groups, clipping, no hooks, a gradient missing, model.zero_grad()): the Triton
    step against the eager reference on CUDA, same gradients; every state and weight equal after 6 steps."""
    models = [_model(0), _model(0)]
    opts = []
    for m, compile_ in zip(models, (True, False), strict=True):
        groups = [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        opts.append(FP8AdamW(groups, lr=1e-3, betas=(0.9, 0.95), precision=prec, compile=compile_))
    assert opts[0].step_impl == "triton" and opts[1].step_impl == "eager", [o.step_impl for o in opts]
    assert opts[0]._hooks == [] and opts[1]._hooks == []
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(6):
        grads = [torch.randn(p.shape, generator=g, device="cuda").to(p.dtype) * 1e-2 for p in models[0].parameters()]
        for m, opt in zip(models, opts, strict=True):
            m.zero_grad(set_to_none=True)  # new gradient tensors every step: the address table is refreshed
            for i, (p, gr) in enumerate(zip(m.parameters(), grads, strict=True)):
                p.grad = None if (step == 3 and i == 2) else gr.clone()
            opt.clip_grad_norm_(0.5 if step % 2 else 0.0)
            opt.step()
    torch.cuda.synchronize()
    # vector loads throughout; the 7-element bias (the only gradient that is not whole 16-byte vectors) went
    # through its padded buffer
    assert [fg.grad_vec for fg in opts[0]._flat] == [8, 8], [fg.grad_vec for fg in opts[0]._flat]
    assert [sorted(fg.grad_pad) for fg in opts[0]._flat] == [[], [4]], [sorted(fg.grad_pad) for fg in opts[0]._flat]
    for gi, (fa, fb) in enumerate(zip(opts[0]._flat, opts[1]._flat, strict=True)):
        for name, a in {**fa.buffers(), "work": fa.work}.items():
            b = {**fb.buffers(), "work": fb.work}[name]
            if a is not None:
                assert torch.equal(_bits(a), _bits(b)), (
                    f"group {gi} {name}: {int((_bits(a) != _bits(b)).sum())} elements differ, "
                    f"max {float((a.float() - b.float()).abs().max()):.3e}")
