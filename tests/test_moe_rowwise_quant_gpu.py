"""Fused rowwise MoE quantization on a CUDA GPU (marker ``gpu``; skipped without CUDA): the Triton kernels of
:mod:`fp8kit.moe.rowwise_quant_triton` against the PyTorch references run on the same GPU, bit for bit.

Run on a Hopper GPU: ``pytest -m gpu tests/test_moe_rowwise_quant_gpu.py``. Shapes are real: T = 16384 tokens
routed top-8 over 128 experts (8 of them never picked) by ``routing.dispatch``, so P = 133,024 padded rows with
empty groups and rows past the last group; hidden K = 2048 / 7168, intermediate I = 768 / 2048. Every output
(values, scales, and the layouts ``torch._scaled_grouped_mm`` reads) has exactly the reference's bits; the output
buffers come from an allocator poisoned with NaN patterns, so an element the kernels leave unwritten fails.
The fp32 cases put 448 / amax a few ulps from a power of two, where ``floor(log2(scale))`` depends on the
``log2`` implementation (the kernels call libdevice's, as torch's CUDA ``log2`` does).
"""

from __future__ import annotations

import functools

import pytest
import torch

from fp8kit.moe import routing
from fp8kit.moe import rowwise_quant as rq
from fp8kit.moe.quantize import group_ids, quantize_experts, quantize_group_cols, quantize_rows
from fp8kit.moe.token_quant import split_gate_up
from tests.conftest import sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOKENS, TOPK, EXPERTS, UNUSED = 16384, 8, 128, 8


def _real(*shape, scale=1.0, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, generator=g, device="cuda") * scale
    n = max(1, t.numel() // 1000)
    idx = torch.randint(0, t.numel(), (n,), generator=g, device="cuda")
    t.view(-1)[idx] *= torch.empty(n, device="cuda").uniform_(10, 30, generator=g)
    return t.to(dtype)


@functools.cache
def _dispatch() -> routing.Dispatch:
    """Random top-8 of 128 experts for 16384 tokens; the last 8 experts are never picked (empty groups)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.rand(TOKENS, EXPERTS, generator=g, device="cuda")
    logits[:, EXPERTS - UNUSED:] = -1.0
    d = routing.dispatch(logits.topk(TOPK, dim=-1).indices, EXPERTS)
    assert (d.tokens_per_expert == 0).sum().item() == UNUSED and d.offs[-1].item() < d.rows
    return d


def _poison_allocator(nbytes: int) -> None:
    """Leave freed blocks full of 0x7F (E4M3 NaN, a float32 NaN pattern) for the next allocations."""
    torch.full((nbytes,), 0x7F, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got, ref, where):
    torch.cuda.synchronize()
    assert len(got) == len(ref), f"{where}: {len(got)} outputs vs {len(ref)}"
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where} [{i}]: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        assert a.stride() == b.stride(), f"{where} [{i}]: strides {a.stride()} vs {b.stride()}"
        diff = (_bits(a) != _bits(b)).sum().item()
        assert diff == 0, f"{where} [{i}]: {diff} of {a.numel()} elements differ from the reference"


def _near_pow2_amax(n: int) -> torch.Tensor:
    """n float32 amaxes 1.75 * 2^s * (1 + k 2^-23): 448 / amax within a few ulps of 2^(8 - s)."""
    vals = [1.75 * 2.0**s * (1 + k * 2.0**-23) for s in (-7, -1, 0, 3) for k in range(-8, 9)]
    return torch.tensor(vals * (n // len(vals) + 1), device="cuda")[:n]


@pytest.mark.parametrize("k", [2048, 7168])
def test_gather_quantize_rows_matches_reference(k):
    d = _dispatch()
    src = _real(TOKENS, k, seed=k)
    _poison_allocator(4 * d.rows * k)
    got = rq.gather_quantize_rows(src, d.gather_idx)
    _assert_same(got, quantize_rows(routing.gather(src, d)), f"gather K={k}")


def test_fp32_scales_next_to_a_power_of_two_match_torch_log2():
    amax = _near_pow2_amax(4096)
    src = (torch.rand(amax.numel(), 2048, device="cuda") * 2 - 1) * amax[:, None] * 0.9
    src[:, 100] = amax
    index = torch.arange(src.shape[0] + 1, device="cuda").flip(0)
    _assert_same(rq.gather_quantize_rows(src, index), rq.gather_quantize_rows_ref(src, index), "gather fp32 near 2^n")
    offs = torch.arange(1, 2049, dtype=torch.int32, device="cuda")  # 1-row groups of src^T: amax per column
    x = src[:, :2048].t().contiguous()
    _assert_same(rq.quantize_group_cols_fused(x, offs, transposed=True),
                 quantize_group_cols(x, group_ids(offs, x.shape[0]), 2048, transposed=True), "group cols fp32 near 2^n")
    w = src[:1024].reshape(4, 256, 2048)
    _assert_same(rq.quantize_experts_dual(w), (*quantize_experts(w, -1), *quantize_experts(w, -2)),
                 "experts fp32 near 2^n (rows)")
    w = src[:, :1024].t().contiguous().reshape(4, 256, 4096)
    _assert_same(rq.quantize_experts_dual(w), (*quantize_experts(w, -1), *quantize_experts(w, -2)),
                 "experts fp32 near 2^n (columns)")


@pytest.mark.parametrize("i,interleaved", [(768, False), (2048, False), (768, True), (14336, False), (14336, True),
                                           (20480, False)])
def test_swiglu_quantize_rows_matches_reference(i, interleaved):
    # Mixtral-wide rows (one 16384-wide chunk; 20480: two chunks) on 4099 rows (a tail block), not 131K
    h = _real(_dispatch().rows if i <= 2048 else 4099, 2 * i, scale=3.0, seed=i)
    gates = torch.tensor([-1e4, -100.0, -87.5, -86.9, 86.9, 87.5, 100.0, 0.0], device="cuda").to(h.dtype)
    split_gate_up(h, interleaved)[0][0, : gates.numel()] = gates  # the SiLU clamps, in the gate columns
    _poison_allocator(4 * h.numel())
    got = rq.swiglu_quantize_rows(h, interleaved)
    _assert_same(got, rq.swiglu_quantize_rows_ref(h, interleaved), f"swiglu I={i} interleaved={interleaved}")


@pytest.mark.parametrize("rows", [1, 2, 17])
def test_swiglu_row_kernels_on_a_few_rows(rows):
    """The SwiGLU forward and backward row kernels on 1, 2 and 17 rows (the blockwise activation cast miscompiled a
    one-row input, session 48): the same checks as on thousands of rows, bit for bit against the references' casts."""
    i = 768
    h = _real(rows, 2 * i, scale=3.0, seed=rows)
    _assert_same(rq.swiglu_quantize_rows(h, False), rq.swiglu_quantize_rows_ref(h, False), f"swiglu {rows} rows")
    dh, q, inv = rq.swiglu_backward_quantize_rows(h, _real(rows, i, seed=rows + 1))
    _assert_same((q, inv), quantize_rows(dh), f"swiglu backward cast, {rows} rows")


@pytest.mark.parametrize("i", [768, 2048, 1000, 14336])
def test_swiglu_backward_quantize_rows_matches_reference(i):
    """The SwiGLU backward + rowwise cast kernel (one chunk per half at 768 / 2048 / 1000 with a masked tail; two
    chunks and a re-read of ``dh`` at Mixtral's 14336, on 4099 rows): the cast is ``quantize_rows`` of the ``dh`` it
    wrote, bit for bit; ``dh`` is the PyTorch reference's within a bf16 ulp but for at most 1e-4 of the elements
    (the hardware's ``exp`` in the sigmoid; where ``1 + g (1 - s)`` nearly cancels, an fp32 ulp can move the bf16
    rounding), and >= 45 dB from it overall."""
    rows = _dispatch().rows if i <= 2048 else 4099
    h = _real(rows, 2 * i, scale=3.0, seed=i + 3)
    da = _real(rows, i, seed=i + 4)
    _poison_allocator(6 * rows * i)
    dh, q, inv = rq.swiglu_backward_quantize_rows(h, da)
    _assert_same((q, inv), quantize_rows(dh), f"swiglu backward cast I={i}")
    ref = rq.swiglu_backward_ref(h, da).float()
    beyond = ((dh.float() - ref).abs() > ref.abs() * 2.0**-7).float().mean().item()
    db = sqnr(ref, dh.float())
    assert beyond <= 1e-4 and db >= 45.0, f"swiglu backward I={i}: {beyond:.2e} of dh beyond a bf16 ulp, {db:.1f} dB"


@pytest.mark.parametrize("k", [2048, 7168])
@pytest.mark.parametrize("transposed", [True, False])
def test_quantize_group_cols_through_the_index_matches_reference(k, transposed):
    d = _dispatch()
    src = _real(TOKENS, k, seed=k + 1)
    _poison_allocator(4 * d.rows * k)
    got = rq.quantize_group_cols_fused(src, d.offs, transposed=transposed, index=d.gather_idx)
    ref = quantize_group_cols(routing.gather(src, d), group_ids(d.offs, d.rows), EXPERTS, transposed=transposed)
    _assert_same(got, ref, f"group cols indexed K={k} transposed={transposed}")


def test_quantize_group_cols_tail_rows_and_dual_match_reference():
    d = _dispatch()
    g = _real(d.rows, 2048, seed=5)  # rows past offs[-1] hold values too: the reference casts them (dummy group)
    x = _real(TOKENS, 2048, seed=6)
    gid = group_ids(d.offs, d.rows)
    ref_g = quantize_group_cols(g, gid, EXPERTS, transposed=True)
    ref_x = quantize_group_cols(routing.gather(x, d), gid, EXPERTS, transposed=False)
    _poison_allocator(8 * d.rows * 2048)
    _assert_same(rq.quantize_group_cols_fused(g, d.offs, transposed=True), ref_g, "group cols plain")
    _assert_same(rq.quantize_group_cols_dual(g, x, d.offs, d.gather_idx), (*ref_g, *ref_x), "group cols dual")


def _combine_grad(d: routing.Dispatch, tokens: int, topk: int, h: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    grad = _real(tokens, h, seed=seed)
    weights = torch.softmax(torch.randn(tokens, topk, generator=g, device="cuda"), dim=-1).to(torch.bfloat16)
    row_pair = routing.row_pairs(d.pair_rows, d.rows)
    token, w_row = routing.combine_row_weights(row_pair, weights)
    return grad, weights, row_pair, token, w_row


@pytest.mark.parametrize("h", [2048, 7168, 14336])
def test_weighted_dispatch_cast_matches_the_combines_backward(h):
    """The output gradient's dgrad copy read through the pairs (the scatter kernel at top-8; Mixtral's 14336 on a
    top-2 routing of 4099 tokens: the gather kernel, one and two chunks per row) equals
    ``quantize_rows(routing.combine_rows_grad(...))`` bit for bit, and the kept rows equal ``combine_rows_grad``'s
    (compiled on CUDA: a gather and one float32 product, exact)."""
    if h <= 7168:
        d, tokens, topk = _dispatch(), TOKENS, TOPK
    else:
        gen = torch.Generator(device="cuda").manual_seed(1)
        tokens, topk = 4099, 2
        d = routing.dispatch(torch.rand(tokens, 8, generator=gen, device="cuda").topk(topk, dim=-1).indices, 8)
    grad, weights, row_pair, token, w_row = _combine_grad(d, tokens, topk, h, seed=h)
    dy = routing.combine_rows_grad(grad, weights, row_pair, torch.bfloat16)
    _poison_allocator(4 * d.rows * h)
    got = rq.dispatch_quantize_rows(grad, d.gather_idx, d.pair_rows, weight=weights.reshape(-1))
    assert got[2] is None
    _assert_same(got[:2], quantize_rows(dy), f"weighted dispatch H={h}")
    _poison_allocator(4 * d.rows * h)
    _assert_same(rq.dispatch_quantize_rows(grad, d.gather_idx, d.pair_rows, weight=weights.reshape(-1), keep_rows=True),
                 (*quantize_rows(dy), dy), f"weighted dispatch, rows kept, H={h}")


@pytest.mark.parametrize("case", ["qwen3", "deepseek", "odd-k", "top2", "top1", "long-rows", "one-token"])
def test_dispatch_quantize_rows_matches_the_gathers(case):
    """``dispatch_quantize_rows`` and ``dispatch_rows`` (no cast): from top-2 (``SCATTER_MIN_TOPK``) the scatter kernel (each token read once, stored at its top-k rows,
    padding rows zeroed by its tail programs), below it or for rows longer than one chunk the gather kernel: the
    gathers' bits for the plain cast, the kept rows and the weighted cast of the combine's backward (outputs from
    a NaN-poisoned allocator, so a row left unwritten fails)."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    tokens, topk, h, experts = {"qwen3": (TOKENS, TOPK, 2048, EXPERTS), "deepseek": (TOKENS, TOPK, 7168, EXPERTS),
                                "odd-k": (3001, 6, 1000, 64), "top2": (4099, 2, 4096, 8), "top1": (777, 1, 2048, 16),
                                "long-rows": (513, 8, 16384, 32), "one-token": (1, 8, 2048, 128)}[case]
    if case in ("qwen3", "deepseek"):
        d = _dispatch()
    else:
        d = routing.dispatch(torch.rand(tokens, experts, generator=gen, device="cuda").topk(topk, dim=-1).indices,
                             experts)
    grad, weights, row_pair, token, w_row = _combine_grad(d, tokens, topk, h, seed=h + topk)
    dy = routing.combine_rows_grad(grad, weights, row_pair, torch.bfloat16)
    plain = routing.gather(grad, d)
    wp = weights.reshape(-1)
    for keep in (False, True):
        _poison_allocator(4 * d.rows * h)
        q, inv, rows = rq.dispatch_quantize_rows(grad, d.gather_idx, d.pair_rows, keep_rows=keep)
        _assert_same((q, inv, *((rows,) if keep else ())), (*quantize_rows(plain), *((plain,) if keep else ())),
                     f"dispatch {case} keep_rows={keep}")
        _poison_allocator(4 * d.rows * h)
        q, inv, rows = rq.dispatch_quantize_rows(grad, d.gather_idx, d.pair_rows, weight=wp, keep_rows=keep)
        _assert_same((q, inv, *((rows,) if keep else ())), (*quantize_rows(dy), *((dy,) if keep else ())),
                     f"dispatch {case} weighted keep_rows={keep}")
    _poison_allocator(4 * d.rows * h)
    _assert_same((rq.dispatch_rows(grad, d.gather_idx, d.pair_rows),), (plain,), f"dispatch {case} rows only")
    compiled = torch.compile(lambda *a: rq.dispatch_quantize_rows(*a, keep_rows=True), fullgraph=True)
    _assert_same(compiled(grad, d.gather_idx, d.pair_rows, wp), (*quantize_rows(dy), dy), f"dispatch {case} compiled")


@pytest.mark.parametrize("h", [2048, 7168])
def test_quantize_group_cols_dual_through_the_pairs_matches_reference(h):
    """``g`` read through the combine's pairs and router weights equals the dual cast of the materialized ``dy``."""
    d = _dispatch()
    grad, weights, row_pair, token, w_row = _combine_grad(d, TOKENS, TOPK, h, seed=h + 1)
    dy = routing.combine_rows_grad(grad, weights, row_pair, torch.bfloat16)
    a = _real(d.rows, 768, seed=h + 2)
    ref = rq.quantize_group_cols_dual_ref(dy, a, d.offs, None)
    _poison_allocator(6 * d.rows * h)
    got = rq.quantize_group_cols_dual(grad, a, d.offs, index_g=token, weight_g=w_row)
    _assert_same((got[0], got[1], got[2].t(), got[3]), ref, f"dual through the pairs H={h}")


@pytest.mark.parametrize("e,n,k", [(128, 1536, 2048), (128, 2048, 768), (8, 4096, 7168)])
def test_quantize_experts_dual_matches_reference(e, n, k):
    w = _real(e, n, k, scale=0.02, seed=n + k)
    _poison_allocator(2 * w.numel())
    got = rq.quantize_experts_dual(w)
    _assert_same(got, (*quantize_experts(w, -1), *quantize_experts(w, -2)), f"experts E={e} N={n} K={k}")


@pytest.mark.parametrize("e,n,k", [(128, 1536, 2048), (128, 2048, 768), (8, 4096, 7168), (3, 1000, 600)])
def test_quantize_experts_dual_with_hints_matches_reference_for_any_hints(e, n, k):
    """The one-pass cast with scale hints (``moe.rowwise_weights_triton``) gives the reference's bits whatever the
    hints hold, and recasts exactly the rows and columns whose hint is not the new ``inv_scale``."""
    from fp8kit.moe.rowwise_weights_triton import quantize_experts_dual_hinted

    w = _real(e, n, k, scale=0.02, seed=n + k + 1)
    ref = (*quantize_experts(w, -1), *quantize_experts(w, -2))
    rows, cols = ref[1].clone(), ref[3].clone()
    g = torch.Generator(device="cuda").manual_seed(e + n)
    bad_r = torch.rand(rows.shape, generator=g, device="cuda") < 0.01
    bad_c = torch.rand(cols.shape, generator=g, device="cuda") < 0.01
    cases = {
        "exact": (rows, cols, (0, 0)),
        "zero": (torch.zeros_like(rows), torch.zeros_like(cols), (rows.numel(), cols.numel())),
        "1% off": (torch.where(bad_r, rows * 2, rows), torch.where(bad_c, cols * 0.5, cols),
                   (int(bad_r.sum()), int(bad_c.sum()))),
        "nan rows": (torch.full_like(rows, float("nan")), cols, (rows.numel(), 0)),
    }
    for name, (rh, ch, want) in cases.items():
        for k_fastest in (True, False):  # the one-pass kernel's two program orders
            _poison_allocator(2 * w.numel())
            fprop, fprop_inv, dgrad, dgrad_inv, fixed = quantize_experts_dual_hinted(w, rh, ch, k_fastest=k_fastest)
            _assert_same((fprop.transpose(-2, -1), fprop_inv, dgrad.transpose(-2, -1), dgrad_inv), ref,
                         f"experts E={e} N={n} K={k}, {name} hints, k_fastest {k_fastest}")
            assert tuple(fixed.tolist()) == want, f"{name} hints: recast (rows, cols) {fixed.tolist()}, want {want}"
        _assert_same(rq.quantize_experts_dual(w, hints=(rh, ch)), ref, f"the op, {name} hints")


def test_ops_compile_fullgraph_equal_eager():
    torch._dynamo.reset()
    d = _dispatch()
    src, h, g, w = _real(TOKENS, 2048, seed=7), _real(d.rows, 1536, seed=8), _real(d.rows, 2048, seed=9), \
        _real(16, 1536, 2048, seed=10)

    _, weights, _, token, w_row = _combine_grad(d, TOKENS, TOPK, 2048, seed=11)

    def fn(src, idx, offs, h, g, w, token, w_row):
        return (*rq.gather_quantize_rows(src, idx), *rq.dispatch_quantize_rows(src, idx, d.pair_rows, keep_rows=True),
                *rq.swiglu_quantize_rows(h),
                *rq.quantize_group_cols_fused(src, offs, transposed=False, index=idx),
                *rq.quantize_group_cols_dual(g, src, offs, idx), *rq.quantize_experts_dual(w),
                *rq.dispatch_quantize_rows(src, idx, d.pair_rows, weight=weights.reshape(-1), keep_rows=True),
                rq.dispatch_rows(src, idx, d.pair_rows),
                *rq.quantize_group_cols_dual(src, src, offs, idx, index_g=token, weight_g=w_row),
                *rq.swiglu_backward_quantize_rows(h, g[:, :768]),
                *rq.quantize_experts_dual(w, hints=(torch.ones(16, 1536, device="cuda"),
                                                    torch.ones(16, 2048, device="cuda"))))

    args = (src, d.gather_idx, d.offs, h, g, w, token, w_row)
    _assert_same(torch.compile(fn, fullgraph=True)(*args), fn(*args), "compiled vs eager")
