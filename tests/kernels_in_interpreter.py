"""fp8kit's blockwise Triton kernels in Triton's CPU interpreter (``TRITON_INTERPRET=1``; run by
tests/test_kernels_in_interpreter.py where triton is installed, e.g. ``pip install triton`` on a CPU machine).

What it checks, every autotune configuration launched in turn (the interpreter has no benchmarker):

- the activation and weight casts give the same bits in every configuration (the activation cast's one-read and
  rows-first walks included), and in both program orders (tiles along K first or rows first, including the
  rows-first fallback past CUDA's grid limit);
- the fused SwiGLU casts (``fp8.kernels.swiglu_triton``) write exactly the activation kernel's casts of the SwiGLU
  values they computed (``values=True``), and those values are the PyTorch reference's within a bf16 ulp
  (forward) or bf16 rounding (backward, >= 45 dB);
- the MoE token kernels (``moe.token_quant_triton``) write the activation kernel's casts of their gathered / SwiGLU
  rows;
- the rowwise MoE kernels' fusions (``moe.rowwise_quant_triton``: the combine's backward read through the pairs, the
  SwiGLU backward + row cast) give the casts of the same kernels on the materialized input;
- the expert weights' one-pass cast with scale hints (``moe.rowwise_weights_triton``) gives the two-kernel cast's
  bits for exact, zero, partly wrong and NaN hints, its fix in one and in several segments, at three tiles and in
  both program orders (the expert count differs from every tile count, so swapped program ids show), and recasts
  exactly the rows and columns whose hint was wrong;
- the scatter dispatch kernel at two more tiles, and writing expert parallelism's payload rows (strided views of one
  uint8 buffer) as the gather kernel does;
- the delayed recipe's fused cast-transpose (``fp8.kernels.cast_transpose_triton``) in every config, its amax (an integer
  atomic max of the float bits) equal to ``torch.amax``'s, NaN included;
- expert parallelism's receiver gather (``moe.payload_triton``) in every config against its PyTorch reference, byte
  for byte (nothing is converted), at R = 0 / 1 and P = 1;
- the FP8AdamW step (``optim.triton_step``, per block and per tensor, stochastic rounding of ``m``) equals the
  reference ``optim.numerics.adamw_update`` bit for bit in ``m``, ``v``, the master and their scales, with the FP8
  gradient buffer and with ``param.grad`` read through the address table by element and by 16-byte vector loads
  (the interpreter's float32 -> bf16 conversion is not the GPU's, so the bf16 working weights are compared
  within one bf16 ulp there, and bit for bit between the two load widths).

Not here: the Gluon 128x1 activation cast (``fp8.kernels.blockwise_gluon``; the interpreter runs no Gluon, and
``blockwise_triton.gluon_applies`` routes the interpreter's CPU tensors to the Triton kernel); the GPU tests check it.

It does not compare E4M3 bits with PyTorch's: Triton 3.6's interpreter converts float32 to E4M3 differently from
the GPU near powers of two (e.g. 124.6 -> 64 instead of 128), so bit equality with the PyTorch reference is the
GPU tests' job (``pytest -m gpu``); here every kernel is compared with the same emulation.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
import triton
import triton.language as tl

from fp8kit.base.triton_lib import OneConfig

#: launch keywords the interpreter does not take (each autotuned kernel runs one config: it has no benchmarker)
INTERP = ("enable_fp_fusion",)


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def same(got, ref, where):
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.shape == b.shape, (where, i, a.shape, b.shape)
        n = (bits(a) != bits(b)).sum().item()
        assert n == 0, f"{where} output {i}: {n} of {a.numel()} differ"


def each_config(mod, name, fn):
    """``fn(cfg)`` with ``mod.name`` launching each of its autotune configs in turn; their outputs must agree."""
    tuner = getattr(mod, name)
    first = None
    try:
        for cfg in tuner.configs:
            setattr(mod, name, OneConfig(tuner, cfg, drop=INTERP))
            out = fn(cfg)
            first = out if first is None else first
            same(out, first, f"{name} {cfg} vs {tuner.configs[0]}")
    finally:
        setattr(mod, name, tuner)


def rnd(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) * scale
    t.view(-1)[::97] *= 25.0
    return t.to(torch.bfloat16)


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.library.wrap_triton = lambda k: k  # the weight op launches through it; OneConfig is not a JITFunction
    from fp8kit.fp8 import swiglu
    from fp8kit.fp8.kernels import blockwise_triton as bt
    from fp8kit.fp8.kernels import swiglu_triton as st
    from fp8kit.moe import token_quant_triton as tqt

    def act(t, wgrad_x="128x1"):  # the activation kernel, first config: the casts every other kernel must match
        tuner = bt._act_quant_kernel
        bt._act_quant_kernel = OneConfig(tuner, tuner.configs[0], drop=INTERP)
        try:
            return bt.quantize_act(t, wgrad_x)
        finally:
            bt._act_quant_kernel = tuner

    x = rnd(300, 256, seed=1)
    for wgrad_x in ("128x1", "128x128"):
        each_config(bt, "_act_quant_kernel", lambda cfg, w=wgrad_x: bt.quantize_act(x, w))
    each_config(bt, "_act_quant_kernel", lambda cfg: bt.quantize_act_fprop(x))
    print("act kernel: every config the same bits", flush=True)
    w = rnd(256, 384, scale=0.02, seed=2)
    each_config(bt, "_weight_quant_kernel", lambda cfg: bt.quantize_weight(w))
    print("weight kernel: every config the same bits", flush=True)
    # the two program orders (tiles along K first, or rows first) give the same bits
    flags = bt._ACT_K_FIRST, bt._WEIGHT_K_FIRST, bt._MAX_GRID_Y
    try:
        outs = []
        # K first; rows first; K first asked but past the grid limit (2 row tiles here): the rows-first fallback
        for bt._ACT_K_FIRST, bt._WEIGHT_K_FIRST, bt._MAX_GRID_Y in ((True, True, flags[2]), (False, False, flags[2]),
                                                                     (True, True, 1)):
            tuner, fprop = bt._weight_quant_kernel, bt._act_quant_kernel
            bt._weight_quant_kernel = OneConfig(tuner, tuner.configs[0], drop=INTERP)
            bt._act_quant_kernel = OneConfig(fprop, fprop.configs[0], drop=INTERP)
            try:
                outs.append((*bt.quantize_act(x), *bt.quantize_act(x, "128x128"), *bt.quantize_act_fprop(x),
                             *bt.quantize_weight(w)))
            finally:
                bt._weight_quant_kernel, bt._act_quant_kernel = tuner, fprop
        same(outs[0], outs[1], "act and weight kernels, tiles along K first vs rows first")
        same(outs[2], outs[1], "act and weight kernels, the rows-first fallback past the grid limit")
    finally:
        bt._ACT_K_FIRST, bt._WEIGHT_K_FIRST, bt._MAX_GRID_Y = flags
    print("act and weight kernels: both program orders the same bits", flush=True)

    g, u, da = rnd(200, 256, scale=2.0, seed=3), rnd(200, 256, seed=4), rnd(200, 256, scale=1e-3, seed=5)
    g.view(-1)[:6] = torch.tensor([-100.0, -87.5, 0.0, 30.0, 90.0, -1e-20], dtype=torch.bfloat16)
    for wgrad_x in ("128x1", "128x128"):
        def forward(cfg, wgrad_x=wgrad_x):
            *got, a = st.swiglu_quantize_act(g, u, wgrad_x, values=True)
            same(got, act(a, wgrad_x), f"swiglu {wgrad_x} {cfg}")
            ref = swiglu.swiglu_ref(g, u).float()
            off = ((a.float() - ref).abs() > 2**-7 * ref.abs()).sum().item()
            assert off == 0, f"swiglu {wgrad_x} {cfg}: {off} values off by more than a bf16 ulp"
            same(st.swiglu_quantize_act(g, u, wgrad_x), got, f"swiglu without values {cfg}")
            return got
        each_config(st, "_swiglu_quant_kernel", forward)
    print("swiglu kernel: every config casts its values as the act kernel does, values within a bf16 ulp", flush=True)

    def backward(cfg):
        *got, dg, du = st.swiglu_backward_quantize(da, g, u, values=True)
        same(got, (*act(dg), *act(du)), f"swiglu backward {cfg}")
        for v, r in zip((dg, du), swiglu.swiglu_backward_ref(da, g, u), strict=True):
            err = (v.double() - r.double()).square().sum() / r.double().square().sum()
            assert err < 10 ** -4.5, f"swiglu backward {cfg}: relative error {err.item():.2e} (GPU test: >= 45 dB)"
        same(st.swiglu_backward_quantize(da, g, u), got, f"swiglu backward without values {cfg}")
        return got

    each_config(st, "_swiglu_bwd_quant_kernel", backward)
    print("swiglu backward kernel: every config casts its values as the act kernel does", flush=True)

    src = rnd(50, 256, seed=6)
    idx = torch.randint(0, 51, (300,), generator=torch.Generator().manual_seed(7))
    gathered = act(torch.cat([src, src.new_zeros(1, 256)])[idx])
    each_config(tqt, "_gather_act_quant_kernel",
                lambda cfg: (same(out := tqt.gather_quantize_act(src, idx), gathered, f"moe gather {cfg}"), out)[1])
    h = rnd(200, 512, seed=8)

    def moe_swiglu(cfg):
        a, *got = tqt.swiglu_quantize_act(h, False)
        same(got, act(a), f"moe swiglu {cfg}")
        return got

    each_config(tqt, "_swiglu_act_quant_kernel", moe_swiglu)
    print("moe token kernels: every config casts as the act kernel does", flush=True)
    moe_rowwise_fusions()
    moe_expert_weights_hinted()
    fp8_adamw_step()
    delayed_swiglu_backward()
    delayed_cast_transpose()
    ep_payload_rows()
    return 0


@triton.jit
def _round_pow2(scale):
    # moe.rowwise_quant_triton's power-of-two rounding without libdevice (absent from the interpreter); both sides of
    # each rowwise comparison use this one
    return tl.exp2(tl.floor(tl.log2(scale)))


def moe_rowwise_fusions() -> None:
    """The rowwise MoE kernels' fusions (``moe.rowwise_quant_triton``) against the same kernels on the materialized
    input: the combine's backward read through the pairs (rows and wgrad columns), and the SwiGLU backward + row cast
    (one chunk, and two chunks with the re-read of ``dh``) against the row kernel on the ``dh`` it wrote."""
    from fp8kit.moe import routing
    from fp8kit.moe import rowwise_quant as rq
    from fp8kit.moe import rowwise_quant_triton as rqt

    rqt._round_pow2 = _round_pow2
    gen = torch.Generator().manual_seed(9)
    top = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(45)])
    d = routing.dispatch(top, 8)  # experts 6 and 7 empty, rows past the last group
    grad, x = rnd(45, 136, seed=10), rnd(45, 72, seed=11)
    weights = torch.softmax(torch.randn(45, 2, generator=gen), dim=-1).to(torch.bfloat16)
    row_pair = routing.row_pairs(d.pair_rows, d.rows)
    token, w_row = routing.combine_row_weights(row_pair, weights)
    dy = routing.combine_rows_grad(grad, weights, row_pair, torch.bfloat16)
    q, inv, rows = rqt.gather_quantize_rows(grad, token, weight=w_row, keep_rows=True)
    # the interpreter rounds float32 to bf16 its own way: rows within a bf16 ulp of torch's, then kernel vs kernel
    err = ((rows.float() - dy.float()).abs() / dy.float().abs().clamp(min=1e-6)).max().item()
    assert err <= 2.0**-7, f"moe weighted gather: rows off by {err:.2e} (> a bf16 ulp)"
    same((q, inv), rqt.gather_quantize_rows(rows, torch.arange(d.rows)), "moe weighted gather")
    kq, kinv, kept = rqt.gather_quantize_rows(x, d.gather_idx, keep_rows=True)  # the dispatch keeping bf16 rows
    same((kq, kinv, kept), (*rqt.gather_quantize_rows(x, d.gather_idx), routing.gather(x, d)), "moe gather keep rows")
    # the scatter kernel (each token read once, stored at its top-k rows; padding zeroed) against the gather kernel
    same(rqt.scatter_quantize_rows(x, d.gather_idx, d.pair_rows, keep_rows=True),
         (kq, kinv, kept), "moe scatter keep rows")
    same(rqt.scatter_quantize_rows(x, d.gather_idx, d.pair_rows, cast=False)[2:], (kept,), "moe scatter rows only")
    same(rqt.scatter_quantize_rows(grad, d.gather_idx, d.pair_rows, weight=weights.reshape(-1), keep_rows=True),
         (q, inv, rows), "moe weighted scatter")
    # expert parallelism's payload from the tokens' side: the scatter kernel writing into the (P, K + 16) uint8 rows'
    # strided views (send order: pairs sorted by destination, no padding) equals the gather kernel writing there
    from fp8kit.moe import rowwise_payload as rp

    order = torch.argsort(top.reshape(-1), stable=True)
    token_rows = order // 2
    pair_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    payloads = [torch.full((90, rp.rowwise_payload_bytes(144)), 0xAB, dtype=torch.uint8) for _ in range(2)]
    x144 = rnd(45, 144, seed=14)
    assert rqt.scatter_quantize_rows(x144, token_rows, pair_rows, out=rp.payload_views(payloads[0], 144)) is not None
    rqt.gather_quantize_rows(x144, token_rows, out=rp.payload_views(payloads[1], 144))
    same(rp.payload_views(payloads[0], 144), rp.payload_views(payloads[1], 144), "moe payload scatter vs gather")
    assert torch.equal(payloads[0][:, 148:], payloads[1][:, 148:]), "moe payload scatter wrote into the row padding"
    # the shipped tile rule (H100 sweep, session 27): 64 elements per thread, at least 4096 per program
    got = {w: rqt._scatter_tile(w) for w in (256, 1024, 2048, 4096, 8192)}
    assert got == {256: (16, 2), 1024: (4, 2), 2048: (2, 2), 4096: (1, 2), 8192: (1, 4)}, got
    # other tiles (token rows per program, warps; 45 tokens: a partial last program); (0, 0): _row_blocks'
    for tile in ((4, 4), (8, 2), (0, 0)):
        same(rqt.scatter_quantize_rows(grad, d.gather_idx, d.pair_rows, weight=weights.reshape(-1), keep_rows=True,
                                       tile=tile), (q, inv, rows), f"moe weighted scatter, tile {tile}")
    same(rqt.quantize_group_cols_dual(grad, x, d.offs, d.gather_idx, index_g=token, weight_g=w_row),
         rqt.quantize_group_cols_dual(rows, x, d.offs, d.gather_idx), "moe group cols, g through the pairs")
    for i, max_block in ((150, 8192), (150, 64)):  # one chunk; three chunks of 64 (dh re-read)
        h, da = rnd(7, 2 * i, scale=3.0, seed=12), rnd(7, i, seed=13)
        blocks = rqt._row_blocks
        rqt._row_blocks = lambda k, mb=max_block, blocks=blocks: blocks(k, mb)
        try:
            dh, q, inv = rqt.swiglu_backward_quantize_rows(h, da)
        finally:
            rqt._row_blocks = blocks
        ref = rq.swiglu_backward_ref(h, da).float()
        err = ((dh.float() - ref).abs() / ref.abs().clamp(min=1e-6)).max().item()
        assert err <= 2.0**-7, f"moe swiglu backward I={i} block {max_block}: dh off by {err:.2e} (> a bf16 ulp)"
        same((q, inv), rqt.gather_quantize_rows(dh, torch.arange(7)), f"moe swiglu backward cast, block {max_block}")
    print("moe rowwise fusions: the same casts as on the materialized input", flush=True)


def moe_expert_weights_hinted() -> None:
    """The expert weights' one-pass cast with scale hints (``moe.rowwise_weights_triton``) against the two-kernel cast,
    for exact, zero, partly wrong and NaN hints, and the count of rows and columns it recast."""
    from fp8kit.moe import rowwise_quant_triton as rqt
    from fp8kit.moe import rowwise_weights_triton as rwt

    rqt._round_pow2 = _round_pow2
    gen = torch.Generator().manual_seed(14)
    # 7 experts: unlike every tile count of the tiles below (4 along N; 2, 3 or 5 along K), so swapped program ids show
    w = rnd(7, 200, 136, seed=15) * torch.logspace(-3, 2, 200)[None, :, None].to(torch.bfloat16)
    ref = rqt.quantize_experts_dual(w)
    rows, cols = ref[1].clone(), ref[3].clone()
    bad_r, bad_c = torch.rand(rows.shape, generator=gen) < 0.05, torch.rand(cols.shape, generator=gen) < 0.05
    cases = {
        "exact": (rows, cols, (0, 0)),
        "zero": (torch.zeros_like(rows), torch.zeros_like(cols), (rows.numel(), cols.numel())),
        "5% off": (torch.where(bad_r, rows * 2, rows), torch.where(bad_c, cols / 2, cols),
                   (int(bad_r.sum()), int(bad_c.sum()))),
        "nan": (torch.full_like(rows, float("nan")), cols, (rows.numel(), 0)),
    }
    seg = rwt._SEG
    # the default tile and session 22's, the fix in one segment; a narrow tile, the fix in two segments
    tiles = (((rwt._BN, rwt._BK, rwt._WARPS), seg), ((64, 128, 4), seg), ((64, 32, 4), 128))
    try:
        for name, (rh, ch, want) in cases.items():
            for (tile, rwt._SEG), kf in itertools.product(tiles, (True, False)):  # both program orders
                *got, fixed = rwt.quantize_experts_dual_hinted(w, rh, ch, tile=tile, k_fastest=kf)
                same(tuple(got), ref, f"moe expert weights, {name} hints, tile {tile}, segment {rwt._SEG}, "
                                      f"k_fastest {kf}")
                assert tuple(fixed.tolist()) == want, f"moe expert weights, {name} hints: recast {fixed.tolist()}"
    finally:
        rwt._SEG = seg
    print("moe expert weights with scale hints: the two-kernel cast's bits for any hints", flush=True)


def fp8_adamw_step() -> None:
    """The FP8AdamW Triton step against the reference (module docstring), 3 steps of one flat group."""
    import dataclasses

    from fp8kit.optim import numerics as N
    from fp8kit.optim import triton_step
    from tests.fp8_adamw_util import flat_states

    numels = [304, 1000, 5000, 8, 4096, 128]  # whole 16-byte vectors of bf16: every load width applies

    def raw(t: torch.Tensor) -> torch.Tensor:  # the stored bits (-0 and +0 differ, as the GPU tests compare)
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    def run(impl: str, spec, grad_vec: int = 0) -> dict:  # grad_vec 0: the FP8 gradient buffer
        gen = torch.Generator().manual_seed(0)
        lay, bufs, work = flat_states(numels, spec, torch.device("cpu"), gen)
        n_scales = len(numels) if spec.granularity == "tensor" else lay.num_blocks
        for step in range(1, 4):
            grads = [torch.randn(n, generator=gen).to(torch.bfloat16) * 10.0 ** (-2 - i % 3)
                     for i, n in enumerate(numels)]
            hp = N.make_hp(1e-3, 0.9, 0.95, 1e-8, 0.1, step, 1)
            hp[N.HP_CLIP] = 0.6
            flat = torch.zeros(lay.total, dtype=torch.bfloat16)
            for i, gr in enumerate(grads):
                lay.segment(flat, i).copy_(gr)
            args = (bufs["m"], bufs["m_scale"], None, bufs["v"], bufs["v_scale"], bufs["w"], bufs["w_scale"], work,
                    hp, lay.block_owner, spec)
            if grad_vec:
                table = torch.tensor([[gr.data_ptr() for gr in grads], numels], dtype=torch.int64)
                assert all(gr.data_ptr() % 16 == 0 for gr in grads)
                kw = dict(grad_table=table, seg_start=torch.tensor(lay.offsets, dtype=torch.int64))
                if impl == "triton":
                    triton_step.adamw_update_triton(None, None, *args, grad_vec=grad_vec, **kw)
                else:
                    N.adamw_update(flat, None, *args)
            else:
                g8, gs = torch.zeros(lay.total, dtype=e5m2), torch.ones(n_scales)
                N.store(flat.float().view(-1, spec.block), g8, gs, lay.block_owner, spec)
                (triton_step.adamw_update_triton if impl == "triton" else N.adamw_update)(g8, gs, *args)
        return {**bufs, "work": work}

    base = N.StateSpec(block=128, num_tensors=len(numels), granularity="tensor", grad=e5m2, m=e4m3, v=torch.float16,
                       master=torch.float16, stochastic_rounding=False, m_rounding="stochastic")
    for over in (dict(granularity="block"), dict()):
        spec = dataclasses.replace(base, **over)
        for grad_vec in (0, 1, 8):
            if grad_vec:
                spec = dataclasses.replace(spec, grad=torch.bfloat16)
            ref, got = run("reference", spec, grad_vec), run("triton", spec, grad_vec)
            where = f"fp8 adamw {over or 'per tensor'}, {'fp8 grads' if not grad_vec else f'grad_vec {grad_vec}'}"
            states = ("m", "m_scale", "v", "v_scale", "w", "w_scale")
            same([raw(got[k]) for k in states], [raw(ref[k]) for k in states], where)
            off = (got["work"].float() - ref["work"].float()).abs() > 2**-7 * ref["work"].float().abs()
            assert not off.any(), f"{where}: {int(off.sum())} working weights off by more than a bf16 ulp"
            if grad_vec == 1:
                by_element = got
            elif grad_vec == 8:
                same([raw(t) for t in got.values()], [raw(t) for t in by_element.values()], f"{where} vs element loads")
    print("fp8 adamw step: the reference's states, vector and element gradient loads the same bits", flush=True)


def delayed_swiglu_backward() -> None:
    """``fp8.kernels.swiglu_delayed_triton``: every config writes the same bits (150 x 320: tiles cut at both edges);
    the transposed copies are the row-major ones transposed; the amaxes are those of the values written; the values
    are the PyTorch reference's within a bf16 ulp."""
    from fp8kit.fp8.kernels import swiglu_delayed_triton as sd
    from fp8kit.fp8.swiglu import swiglu_backward_ref, swiglu_ref

    g, u, da = rnd(150, 320, scale=2.0, seed=11), rnd(150, 320, seed=12), rnd(150, 320, scale=1e-3, seed=13)
    scales = [torch.tensor(v) for v in (57344.0 / 4e-3, 57344.0 / 3e-3, 448.0 / 16.0)]
    rg, ru = swiglu_backward_ref(da, g, u)

    def run(cfg):
        qg, qgt, qu, qut, qat, amax, vg, vu, va = sd.swiglu_backward_cast(g, u, da, *scales, write_values=True)
        q = [t.view(torch.uint8) for t in (qg, qgt, qu, qut, qat)]
        assert torch.equal(q[1], q[0].t()) and torch.equal(q[3], q[2].t()), f"delayed swiglu {cfg}: transposes"
        assert torch.equal(amax, torch.stack([vg.abs().amax().float(), vu.abs().amax().float()])), (cfg, amax)
        for name, x, y in (("dg", vg, rg), ("du", vu, ru), ("a", va, swiglu_ref(g, u))):
            off = ((x.float() - y.float()).abs() > 2**-7 * y.float().abs()).float().mean().item()
            assert off <= 1e-3, f"delayed swiglu {cfg}: {name} {off:.2e} of the values beyond a bf16 ulp"
        return [*q, amax, vg, vu, va]

    each_config(sd, "_swiglu_bwd_cast_kernel", run)
    print("delayed swiglu backward: every config the same bits, transposes and amaxes consistent", flush=True)



def delayed_cast_transpose() -> None:
    """``fp8.kernels.cast_transpose_triton`` (the delayed recipe's fused cast, a ``triton_op``): every config writes the
    same bits, for E4M3 and E5M2, at tiles cut at both edges and one row; ``qt`` is ``q`` transposed; the amax from
    the tiles' integer atomic max is ``torch.amax``'s bit for bit, a NaN (of either sign) included; float32 inputs
    take ``q.T`` copied; an empty input gives amax 0."""
    from fp8kit.fp8.kernels import cast_transpose_triton as ct

    scale = torch.tensor(57.3)
    cases = [rnd(150, 200, scale=3.0, seed=21), rnd(1, 96, seed=22), rnd(70, 33, seed=23).float()]
    # one NaN each: +NaN (bf16 bits 0x7FC0) and -NaN (0xFFC0; assigning -float("nan") to a bf16 tensor stores +NaN)
    nan, neg_nan = rnd(90, 130, seed=24), rnd(90, 130, seed=25)
    nan[17, 5] = float("nan")
    neg_nan.view(torch.int16)[60, 100] = -64  # 0xFFC0
    assert neg_nan.view(torch.int16)[60, 100].item() == -64 and neg_nan.isnan().sum().item() == 1
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for x in cases:
            def run(cfg, x=x, dtype=dtype):
                q, qt, amax = ct.cast_transpose(x, scale, dtype, True)
                assert torch.equal(qt.view(torch.uint8), q.view(torch.uint8).t()), f"cast_transpose {cfg}: transpose"
                assert torch.equal(amax, x.abs().amax().float()), (cfg, amax, x.abs().amax())
                q2, qt2, _ = ct.cast_transpose(x, scale, dtype, False)
                assert qt2.shape == (0,) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8)), cfg
                return [q.view(torch.uint8), qt.view(torch.uint8), amax]
            each_config(ct, "_cast_transpose_kernel", run)

    def nan_and_empty(cfg):
        amax = torch.stack([ct.cast_transpose(t, scale, torch.float8_e4m3fn, True)[2] for t in (nan, neg_nan)])
        assert amax.isnan().all(), f"cast_transpose {cfg}: a NaN (+, -) must reach the amax, got {amax}"
        q, qt, empty = ct.cast_transpose(rnd(0, 64), scale, torch.float8_e4m3fn, True)
        assert q.shape == (0, 64) and qt.shape == (64, 0) and empty.item() == 0.0, (q.shape, qt.shape, empty)
        return [amax.isnan()]

    each_config(ct, "_cast_transpose_kernel", nan_and_empty)
    print("delayed cast-transpose: every config the same bits, transposes, amax = torch.amax (NaN too)", flush=True)



def ep_payload_rows() -> None:
    """``moe.payload_triton`` (expert parallelism's receiver gather): in every config the reference's bytes and scale
    bits exactly (bytes are moved, no conversion, so the interpreter compares with PyTorch itself), zero rows for
    index R with the zero row's scale bits, the payload's padding bytes never copied, at R = 0 and 1 and P = 1."""
    from fp8kit.moe import payload_triton as pt
    from fp8kit.moe import rowwise_payload as rp

    zero_inv = rp._zero_row_inv_bits()
    for tokens, hidden, rows in ((37, 48, 90), (1, 2048, 5), (5, 2048, 1), (0, 64, 7)):
        src = rnd(tokens, hidden, scale=3.0, seed=30 + tokens)
        payload = rp.gather_quantize_payload_ref(src, torch.arange(tokens))
        payload.view(-1, hidden + 16)[:, hidden + 4:] = 0xAB  # padding: must not reach the outputs
        g = torch.Generator().manual_seed(31)
        index = torch.randint(0, tokens + 1, (rows,), generator=g)  # value `tokens` (= R): a zero row
        if rows > 1:
            index[-1] = tokens
        want_q, want_inv = rp.payload_rows_reference(payload, index, hidden)

        def run(cfg, payload=payload, index=index, hidden=hidden, want_q=want_q, want_inv=want_inv):
            q, inv = pt.payload_rows(payload, index, hidden, zero_inv)
            assert torch.equal(q, want_q.view(torch.uint8)), f"payload rows {cfg} {hidden}: bytes differ"
            assert torch.equal(inv, want_inv.view(torch.int32)), f"payload rows {cfg} {hidden}: scales differ"
            return [q, inv]
        each_config(pt, "_payload_rows_kernel", run)
    print("ep payload rows: every config the reference's bytes and scales, zero rows, padding never copied", flush=True)


if __name__ == "__main__":
    sys.exit(main())
