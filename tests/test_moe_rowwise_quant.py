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


# ----------------------------------------------------------------------------- swiglu backward + rows

@pytest.mark.parametrize("p,i", [(37, 128), (5, 300), (1, 1), (0, 64)])
def test_swiglu_backward_quantize_rows_equals_quantize_rows_of_the_backward(p, i):
    """``dh`` is the derivative of ``silu(gate) * up`` (>= 45 dB against float64 autograd: bf16 rounding of
    ``dh`` only), and ``(q, inv)`` is ``quantize_rows(dh)`` bit for bit."""
    h = _real(p, 2 * i, scale=3.0, seed=p + i)
    da = _real(p, i, seed=p + i + 1)
    dh, q, inv = rq.swiglu_backward_quantize_rows(h, da)
    assert dh.dtype == h.dtype and dh.shape == h.shape
    _assert_same((q, inv), quantize_rows(dh), f"swiglu backward P={p} I={i}")
    if p * i:
        h64 = h.double().requires_grad_()
        gate, up = h64.chunk(2, dim=-1)
        (F.silu(gate) * up).backward(da.double())
        err = (dh.double() - h64.grad).norm() / h64.grad.norm()
        assert err <= 2.0**-8, f"swiglu backward P={p} I={i}: relative error {err:.2e} > bf16 rounding 2^-8"


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


# ----------------------------------------------------------------------------- the combine's backward, fused

def _combine_case(tokens: int, topk: int, h: int, dtype=torch.bfloat16, seed: int = 0):
    """A real dispatch with empty experts and padding rows, the combine's output gradient and router weights."""
    gen = torch.Generator().manual_seed(seed)
    experts = torch.tensor([0, 1, 3, 4, 6, 7])  # experts 2 and 5 get no token
    top = experts[torch.stack([torch.randperm(6, generator=gen)[:topk] for _ in range(tokens)])]
    d = routing.dispatch(top, 8)
    grad = _real(tokens, h, seed=seed + 1, dtype=dtype)
    weights = torch.softmax(torch.randn(tokens, topk, generator=gen), dim=-1).to(dtype)
    row_pair = routing.row_pairs(d.pair_rows, d.rows)
    token, w_row = routing.combine_row_weights(row_pair, weights)
    dy = routing.combine_rows_grad(grad, weights, row_pair, dtype)
    return d, grad, weights, token, w_row, dy


@pytest.mark.parametrize("tokens,topk,h", [(45, 2, 136), (9, 5, 64), (1, 1, 256), (30, 6, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_quantize_rows_equals_the_gathers(tokens, topk, h, dtype):
    """The dispatch cast knowing the layout from both sides (``gather_idx`` and ``pair_rows``: the CUDA scatter
    kernel's inputs from top-2) gives the gather's bits, with the gathered rows kept if asked; with the router
    weights per pair, the cast of ``routing.combine_rows_grad``'s rows (the output gradient's dgrad copy read through
    the pairs), which ``keep_rows`` returns exactly; padding rows zero. Int32 indices too."""
    d, grad, weights, token, w_row, dy = _combine_case(tokens, topk, h, dtype, seed=tokens + topk)
    where = f"dispatch T={tokens} topk={topk} H={h} {dtype}"
    q, inv, rows = rq.dispatch_quantize_rows(grad, d.gather_idx, d.pair_rows)
    assert rows is None
    _assert_same((q, inv), rq.gather_quantize_rows(grad, d.gather_idx), where)
    _assert_same(rq.dispatch_quantize_rows(grad, d.gather_idx.int(), d.pair_rows, keep_rows=True),
                 (*rq.gather_quantize_rows(grad, d.gather_idx), routing.gather_rows(grad, d.gather_idx)),
                 f"{where}, rows kept")
    q, inv, rows = rq.dispatch_quantize_rows(grad, d.gather_idx, d.pair_rows.int(), weight=weights.reshape(-1))
    assert rows is None
    _assert_same((q, inv), quantize_rows(dy), f"{where}, weighted")
    q, inv, rows = rq.dispatch_quantize_rows(grad, d.gather_idx, d.pair_rows, weight=weights.reshape(-1),
                                             keep_rows=True)
    _assert_same((q, inv, rows), (*quantize_rows(dy), dy), f"{where}, weighted, rows kept")
    pad = d.gather_idx == tokens
    assert (rows[pad] == 0).all() and (inv[pad] == ZERO_ROW_INV).all(), "padding rows must be zero"
    assert torch.equal(token, d.gather_idx), "the combine's token index is the dispatch index"
    _assert_same((rq.dispatch_rows(grad, d.gather_idx, d.pair_rows),), (routing.gather_rows(grad, d.gather_idx),),
                 f"{where}, rows only")
    compiled = torch.compile(lambda *a: rq.dispatch_quantize_rows(*a, keep_rows=True), fullgraph=True)
    _assert_same(compiled(grad, d.gather_idx, d.pair_rows, weights.reshape(-1)), (*quantize_rows(dy), dy),
                 f"{where}, compiled")


def test_quantize_group_cols_dual_reads_the_gradient_through_the_pairs():
    """``g`` read through the combine's token index and router weights equals ``g`` materialized by
    ``routing.combine_rows_grad``, bit for bit, with ``x`` plain or read through the dispatch index."""
    d, grad, weights, token, w_row, dy = _combine_case(45, 2, 136, seed=3)
    src = _real(45, 72, seed=4)
    ref = rq.quantize_group_cols_dual(dy, src, d.offs, d.gather_idx)
    _assert_same(rq.quantize_group_cols_dual(grad, src, d.offs, d.gather_idx, index_g=token, weight_g=w_row), ref,
                 "dual, g through the pairs, indexed x")
    x = routing.gather(src, d)
    _assert_same(rq.quantize_group_cols_dual(grad, x, d.offs, index_g=token, weight_g=w_row),
                 rq.quantize_group_cols_dual(dy, x, d.offs), "dual, g through the pairs, plain x")


# ----------------------------------------------------------------------------- expert weights

@pytest.mark.parametrize("e,n,k,dtype", [(3, 96, 200, torch.bfloat16), (2, 64, 128, torch.float32), (1, 1, 1, torch.float16)])
def test_quantize_experts_dual_equals_two_quantize_experts(e, n, k, dtype):
    w = _real(e, n, k, seed=e + n + k, dtype=dtype)
    _assert_same(rq.quantize_experts_dual(w), (*quantize_experts(w, -1), *quantize_experts(w, -2)),
                 f"experts E={e} N={n} K={k}")


def test_quantize_experts_dual_with_hints_equals_without():
    """On the CPU the hints are checked and otherwise unused: any hints give the unhinted bits (the GPU test checks
    the one-pass kernel, tests/test_moe_rowwise_quant_gpu.py)."""
    w = _real(3, 96, 200, seed=5)
    ref = rq.quantize_experts_dual(w)
    for rows, cols in ((ref[1], ref[3]), (torch.zeros(3, 96), torch.full((3, 200), float("nan")))):
        _assert_same(rq.quantize_experts_dual(w, hints=(rows, cols)), ref, "experts with hints")


def test_weight_cache_recasts_a_new_version_from_the_outdated_entry():
    """The expert-weight cache casts a changed weight with ``requantize`` (the previous scales as hints): the same bits
    as a fresh cast, and counted as ``requantized``."""
    w = _real(2, 64, 128, seed=6)
    before = rq.experts_cache_stats()
    first = rq.quantize_experts_dual(w, cache=True)
    assert rq.quantize_experts_dual(w, cache=True)[0].data_ptr() == first[0].data_ptr()  # a hit
    with torch.no_grad():
        w.mul_(3.0)  # bumps _version: every scale moves by a factor of 2 or 4
    again = rq.quantize_experts_dual(w, cache=True)
    stats = rq.experts_cache_stats()
    assert stats["requantized"] - before["requantized"] == 1, (before, stats)
    assert stats["misses"] - before["misses"] == 2, (before, stats)
    _assert_same(again, rq.quantize_experts_dual(w), "requantized cache entry vs a fresh cast")


# ----------------------------------------------------------------------------- torch.compile

def test_ops_compile_fullgraph_equal_eager():
    torch._dynamo.reset()
    d = routing.dispatch(torch.tensor([[0, 2], [2, 3], [0, 3], [3, 0], [2, 0]]), 4)  # expert 1 empty
    src, h, g, w = _real(5, 128, seed=1), _real(d.rows, 256, seed=2), _real(d.rows, 96, seed=3), _real(4, 64, 128, seed=4)

    weights = torch.rand(5, 2)
    token, w_row = routing.combine_row_weights(routing.row_pairs(d.pair_rows, d.rows), weights)

    def fn(src, idx, offs, h, g, w, token, w_row):
        return (*rq.gather_quantize_rows(src, idx), *rq.swiglu_quantize_rows(h),
                *rq.quantize_group_cols_fused(src, offs, transposed=False, index=idx),
                *rq.quantize_group_cols_dual(g, src, offs, idx), *rq.quantize_experts_dual(w),
                *rq.dispatch_quantize_rows(src, idx, d.pair_rows, weight=weights.reshape(-1), keep_rows=True),
                rq.dispatch_rows(src, idx, d.pair_rows),
                *rq.quantize_group_cols_dual(src, src, offs, idx, index_g=token, weight_g=w_row),
                *rq.swiglu_backward_quantize_rows(h, h[:, :128]),
                *rq.quantize_experts_dual(w, hints=(torch.ones(4, 64), torch.ones(4, 128))))

    args = (src, d.gather_idx, d.offs, h, g, w, token, w_row)
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
    with pytest.raises(ValueError, match="moe_rw_dispatch_quant: pair_rows must hold topk rows per token"):
        rq.dispatch_quantize_rows(torch.randn(4, 16), torch.zeros(12, dtype=torch.long), torch.arange(6))
    with pytest.raises(ValueError, match="moe_rw_dispatch_quant: weight must be a 1-D float tensor with one weight"):
        rq.dispatch_quantize_rows(torch.randn(4, 16), torch.zeros(12, dtype=torch.long), torch.arange(8),
                                  weight=torch.ones(4))
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
    w3 = _real(2, 8, 16)
    with pytest.raises(ValueError, match=r"moe_rw_experts_dual_quant_hinted: col_hint must be float32 \(2, 16\)"):
        rq.quantize_experts_dual(w3, hints=(torch.ones(2, 8), torch.ones(2, 8)))
    with pytest.raises(ValueError, match="moe_rw_experts_dual_quant_hinted: row_hint must be float32"):
        rq.quantize_experts_dual(w3, hints=(torch.ones(2, 8, dtype=torch.int32), torch.ones(2, 16)))
    with pytest.raises(ValueError, match="hints and cache=True cannot be combined"):
        rq.quantize_experts_dual(w3, cache=True, hints=(torch.ones(2, 8), torch.ones(2, 16)))
    with pytest.raises(ValueError, match="moe_rw_dispatch_quant: weight must be"):
        rq.dispatch_quantize_rows(torch.randn(4, 16), torch.zeros(12, dtype=torch.long), torch.arange(8),
                                  weight=torch.ones(8, dtype=torch.int64))
    with pytest.raises(ValueError, match="moe_rw_dispatch_quant: pair_rows must be a 1-D int64"):
        rq.dispatch_rows(torch.randn(4, 16), torch.zeros(12, dtype=torch.long), torch.arange(8.0))
    with pytest.raises(ValueError, match=r"moe_rw_swiglu_bwd_quant: da must be \(8, 64\)"):
        rq.swiglu_backward_quantize_rows(src, src[:, :32])
    with pytest.raises(ValueError, match="moe_rw_group_cols_dual_quant: index_g and weight_g come together"):
        rq.quantize_group_cols_dual(src, src[:3], offs, index_g=idx)
    with pytest.raises(ValueError, match="moe_rw_group_cols_dual_quant: weight_g must be a 1-D float tensor"):
        rq.quantize_group_cols_dual(src, src[:3], offs, index_g=idx, weight_g=torch.ones(4))
