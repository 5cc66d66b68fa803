"""Fused rowwise MoE quantization on the CPU (:mod:`fp8kit.moe.rowwise_quant`): each op's CPU path against the
functions of :mod:`fp8kit.moe.quantize` on the materialized input (bits and layouts), the SwiGLU values against
torch, the ops under torch.compile (fullgraph) against eager, bad input. The CUDA kernels are compared with the
same references bit for bit in tests/test_moe_rowwise_quant_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8kit.moe import routing
from fp8kit.moe import rowwise_quant as rq
from fp8kit.moe.quantize import group_ids, quantize_experts, quantize_group_cols, quantize_rows
from fp8kit.moe.token_quant import split_gate_up
from tests.conftest import randn_outliers as _real

BF16_HALF_ULP = 2.0**-8  # relative rounding error bound of bf16 (8 significand bits)
ZERO_ROW_INV = 2.0**-48  # 1 / 2^floor(log2(448 / AMAX_EPS)): the inv_scale of an all-zero row


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got, ref, where):
    """Same shapes, dtypes, strides (non-empty tensors) and bits."""
    assert len(got) == len(ref), f"{where}: {len(got)} outputs vs {len(ref)}"
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where} [{i}]: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert a.numel() == 0 or a.stride() == b.stride(), f"{where} [{i}]: strides {a.stride()} vs {b.stride()}"
        diff = (_bits(a) != _bits(b)).sum().item()
        assert diff == 0, f"{where} [{i}]: {diff} of {a.numel()} elements differ"


def _index(t: int, p: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, t + 1, (p,), generator=g)
    index[::5] = t  # zero rows
    return index


def _gathered(src, index):
    return torch.stack([src[i] if i < src.shape[0] else src.new_zeros(src.shape[1]) for i in index.tolist()]) \
        if index.numel() else src.new_zeros(0, src.shape[1])


def _offs(sizes) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


# ----------------------------------------------------------------------------- gather + rows

@pytest.mark.parametrize("t,k,p", [(64, 256, 300), (7, 200, 1), (0, 128, 9), (33, 130, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_quantize_rows_equals_quantize_rows_of_gathered(t, k, p, dtype):
    src = _real(t, k, seed=t + k + p, dtype=dtype)
    index = _index(t, p, seed=p)
    ref = quantize_rows(_gathered(src, index))
    _assert_same(rq.gather_quantize_rows(src, index), ref, f"gather T={t} K={k} P={p}")
    _assert_same(rq.gather_quantize_rows(src, index.int()), ref, f"gather int32 index T={t} K={k} P={p}")
    zero = index == t
    assert (ref[1][zero] == ZERO_ROW_INV).all() and (ref[0][zero].float() == 0).all()


# ----------------------------------------------------------------------------- swiglu + rows

@pytest.mark.parametrize("p,i", [(37, 128), (5, 300), (1, 1)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_swiglu_quantize_rows_equals_quantize_rows_of_swiglu(p, i, interleaved):
    h = _real(p, 2 * i, scale=3.0, seed=p + i)
    a, q, inv = rq.swiglu_quantize_rows(h, interleaved)
    gate, up = split_gate_up(h, interleaved)
    exact = F.silu(gate.double()) * up.double()
    err = ((a.double() - exact).abs() / exact.abs().clamp(min=1e-30)).max().item()
    assert err <= BF16_HALF_ULP * 1.01, f"swiglu values: max relative error {err:.3e} > bf16 half-ulp {BF16_HALF_ULP:.3e}"
    _assert_same((q, inv), quantize_rows(a), f"swiglu P={p} I={i} interleaved={interleaved}")


# ----------------------------------------------------------------------------- group columns

GROUP_CASES = [  # (P, C, group sizes, T for an index or None)
    (300, 200, [0, 70, 0, 0, 130, 16, 0], None),  # empty groups, 84 rows past the end
    (130, 64, [130], None),                       # one group, no tail
    (77, 150, [0, 0, 3], None),                   # mostly tail
    (0, 64, [0, 0], None),                        # no rows
    (257, 96, [32, 0, 48, 64, 0, 100], 40),       # read through an index
]


@pytest.mark.parametrize("p,c,sizes,t", GROUP_CASES)
@pytest.mark.parametrize("transposed", [True, False])
def test_quantize_group_cols_fused_equals_reference(p, c, sizes, t, transposed):
    offs = _offs(sizes)
    if t is None:
        x, index = _real(p, c, seed=p + c), None
        x[p - p // 4:] *= 7  # tail rows unlike the rest
        rows = x
    else:
        x, index = _real(t, c, seed=p + c), _index(t, p, seed=p)
        rows = _gathered(x, index)
    ref = quantize_group_cols(rows, group_ids(offs, p), len(sizes), transposed=transposed)
    got = rq.quantize_group_cols_fused(x, offs, transposed=transposed, index=index)
    _assert_same(got, ref, f"group cols P={p} C={c} sizes={sizes} index={t is not None} transposed={transposed}")
    _assert_same(rq.quantize_group_cols_fused(x, offs.long(), transposed=transposed, index=index), ref, "int64 offs")


def test_quantize_group_cols_dual_equals_two_calls_on_a_real_dispatch():
    gen = torch.Generator().manual_seed(0)
    experts = torch.tensor([0, 1, 3, 4, 6, 7])  # experts 2 and 5 get no token
    top = experts[torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(45)])]
    d = routing.dispatch(top, 8)
    assert d.offs[-1] < d.rows, "the case needs rows past the last group"
    src, g = _real(45, 136, seed=1), _real(d.rows, 72, seed=2)
    ref_g = quantize_group_cols(g, group_ids(d.offs, d.rows), 8, transposed=True)
    ref_x = quantize_group_cols(routing.gather(src, d), group_ids(d.offs, d.rows), 8, transposed=False)
    _assert_same(rq.quantize_group_cols_dual(g, src, d.offs, d.gather_idx), (*ref_g, *ref_x), "dual, indexed x")
    x = routing.gather(src, d)
    _assert_same(rq.quantize_group_cols_dual(g, x, d.offs), (*ref_g, *ref_x), "dual, plain x")


# ----------------------------------------------------------------------------- expert weights

@pytest.mark.parametrize("e,n,k,dtype", [(3, 96, 200, torch.bfloat16), (2, 64, 128, torch.float32), (1, 1, 1, torch.float16)])
def test_quantize_experts_dual_equals_two_quantize_experts(e, n, k, dtype):
    w = _real(e, n, k, seed=e + n + k, dtype=dtype)
    _assert_same(rq.quantize_experts_dual(w), (*quantize_experts(w, -1), *quantize_experts(w, -2)),
                 f"experts E={e} N={n} K={k}")


# ----------------------------------------------------------------------------- torch.compile

def test_ops_compile_fullgraph_equal_eager():
    torch._dynamo.reset()
    d = routing.dispatch(torch.tensor([[0, 2], [2, 3], [0, 3], [3, 0], [2, 0]]), 4)  # expert 1 empty
    src, h, g, w = _real(5, 128, seed=1), _real(d.rows, 256, seed=2), _real(d.rows, 96, seed=3), _real(4, 64, 128, seed=4)

    def fn(src, idx, offs, h, g, w):
        return (*rq.gather_quantize_rows(src, idx), *rq.swiglu_quantize_rows(h),
                *rq.quantize_group_cols_fused(src, offs, transposed=False, index=idx),
                *rq.quantize_group_cols_dual(g, src, offs, idx), *rq.quantize_experts_dual(w))

    args = (src, d.gather_idx, d.offs, h, g, w)
    _assert_same(torch.compile(fn, fullgraph=True)(*args), fn(*args), "compiled vs eager")


# ----------------------------------------------------------------------------- bad input

def test_bad_input_raises_naming_the_op():
    src, idx, offs = _real(8, 128), torch.tensor([0, 8, 3]), torch.tensor([2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="moe_rw_gather_quant: src must be a 2-D"):
        rq.gather_quantize_rows(src[0], idx)
    with pytest.raises(ValueError, match="moe_rw_gather_quant: index must be a 1-D int64"):
        rq.gather_quantize_rows(src, idx.float())
    with pytest.raises(ValueError, match="moe_rw_gather_quant: index must be a 1-D"):
        rq.gather_quantize_rows(src, idx[None])
    with pytest.raises(ValueError, match="moe_rw_swiglu_quant: h must be .* even last dim"):
        rq.swiglu_quantize_rows(_real(4, 129))
    with pytest.raises(ValueError, match="moe_rw_swiglu_quant: h must be a 2-D"):
        rq.swiglu_quantize_rows(src.to(torch.int32))
    with pytest.raises(ValueError, match="moe_rw_group_cols_quant: offs must be a non-empty"):
        rq.quantize_group_cols_fused(src, offs[:0], transposed=True)
    with pytest.raises(ValueError, match="moe_rw_group_cols_quant: offs must be"):
        rq.quantize_group_cols_fused(src, offs.float(), transposed=True)
    with pytest.raises(ValueError, match="moe_rw_group_cols_dual_quant: g has 3 rows but index_x gives 2"):
        rq.quantize_group_cols_dual(src[:3], src, offs, idx[:2])
    with pytest.raises(ValueError, match="moe_rw_experts_dual_quant: w must be a 3-D"):
        rq.quantize_experts_dual(src)
