"""Blockwise FP8 MoE experts (``moe/grouped_loop.py``, the ``blockwise_loop`` kernel) on the CPU reference path.

References are float64 per-expert loops (``tests/test_moe_grouped.py``'s helpers). Thresholds:
``FP8_GEMM_DB`` = 25 dB per GEMM (fprop, dgrad, wgrad; the MoE issue's floor for blockwise), with
``NOT_QUANTIZED_DB`` = 35 dB as the ceiling that proves the operands were quantized; 18 / 17 dB for whole
layers and models (torchao's floors). The GPU test (``tests/test_moe_blockwise_gpu.py``) checks cuBLAS
against this emulation.
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.base.errors import ConfigError
from fp8kit.moe import routing
from fp8kit.moe.grouped_loop import blockwise_loop_mm, group_bounds
from fp8kit.moe.grouped_mm import GroupedGemmConfig, fp8_grouped_mm, resolve_grouped_kernel
from tests.test_moe_grouped import (
    FP8_GEMM_DB,
    NOT_QUANTIZED_DB,
    assert_sqnr,
    check_layer,
    grouped_reference_f64,
    layer_case,
)


def _case(dtype: torch.dtype, sizes=(32, 0, 160, 48, 16), k: int = 256, n: int = 384, seed: int = 0):
    """Groups of uneven sizes (one empty expert, one of 160 rows: two 128-row wgrad blocks, the second
    partial), 16 padding rows after the last group, weights (E, n, k)."""
    gen = torch.Generator().manual_seed(seed)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    p = int(offs[-1]) + 16
    x = torch.randn(p, k, generator=gen)
    x[int(offs[-1]):] = 0
    w = torch.randn(len(sizes), n, k, generator=gen) / k**0.5
    g = torch.randn(p, n, generator=gen)
    return x.to(dtype), w.to(dtype), offs, g.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_loop_fprop_dgrad_wgrad_vs_float64(dtype):
    """out, dx, dw of the per-expert blockwise loop within [25, 35) dB of float64; the empty expert's dw is
    exactly zero; rows past the last group are zero in the output and in dx."""
    x, w, offs, g = _case(dtype)
    ref_out, ref_dx, ref_dw = grouped_reference_f64(x, w, offs, g)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_mm(xx, ww, offs, "blockwise_loop")
    out.backward(g)
    last, used = int(offs[-1]), [0, 2, 3, 4]
    assert out.dtype == dtype and xx.grad.dtype == dtype and ww.grad.dtype == dtype
    for what, ref, got in (("fprop", ref_out[:last], out[:last]), ("dgrad", ref_dx[:last], xx.grad[:last]),
                           ("wgrad", ref_dw[used], ww.grad[used])):
        assert_sqnr(ref, got.float(), FP8_GEMM_DB, f"{dtype} {what}", ceiling=NOT_QUANTIZED_DB)
    assert ww.grad[1].abs().max().item() == 0.0, "the expert without rows got a nonzero wgrad"
    assert out[last:].abs().max().item() == 0.0 and xx.grad[last:].abs().max().item() == 0.0


def test_blockwise_loop_recomputes_weight_copies_with_the_same_bits_and_saves_none():
    """keep_weight_copy=False (``prepare_model`` under FSDP2): the experts' FP8 ``w[e]^T`` are quantized again in
    the backward instead of held from the forward: out, dx, dw identical bit for bit, and no FP8 tensor of a
    weight's transposed shape ``(K, N)`` saved (the kept run saves one per expert with rows)."""
    x, w, offs, g = _case(torch.bfloat16)
    k, n = w.shape[2], w.shape[1]
    runs = {}
    for keep in (True, False):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        saved = []

        def pack(t, saved=saved):
            if t.dtype == torch.float8_e4m3fn:
                saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fp8_grouped_mm(xx, ww, offs, "blockwise_loop", keep_weight_copy=keep)
        out.backward(g)
        runs[keep] = (saved, out, xx.grad, ww.grad)
    for name, a, b in zip(("out", "dx", "dw"), runs[True][1:], runs[False][1:], strict=True):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item()}"
    kept, again = runs[True][0].count((k, n)), runs[False][0].count((k, n))
    assert kept == 4 and again == 0, f"FP8 (K, N) copies saved: kept {kept} (want 4), recomputed {again} (want 0)"
    assert GroupedGemmConfig().keep_weight_copies is True


def test_blockwise_loop_casts_each_expert_weight_once_per_optimizer_step_with_the_cache():
    """``cache_weight=True`` (``fp8kit train`` with ``train.grad_accum > 1``): two micro-batches of the same step
    cast each expert weight with rows once (4 misses, then 4 hits), with the same out / dx / dw bits as casting
    every call; after an optimizer step the updated weights are cast again (4 misses), and equal an uncached cast
    of the new weights."""
    from fp8kit.fp8.kernels import ops

    x, w, offs, g = _case(torch.bfloat16)
    ww = w.clone().requires_grad_()
    opt = torch.optim.SGD([ww], lr=0.5)

    def run(weight, cache):
        xx = x.clone().requires_grad_()
        out = fp8_grouped_mm(xx, weight, offs, "blockwise_loop", cache_weight=cache)
        out.backward(g)
        return out, xx.grad

    for step in range(2):
        plain_w = ww.detach().clone().requires_grad_()
        before = ops.weight_cache_stats()
        cached = [run(ww, True) for _ in range(2)]
        after = ops.weight_cache_stats()
        misses, hits = after["misses"] - before["misses"], after["hits"] - before["hits"]
        assert (misses, hits) == (4, 4), f"step {step}: {misses} misses, {hits} hits (want 4 and 4: 4 experts with rows)"
        plain = [run(plain_w, False) for _ in range(2)]
        for (co, cdx), (po, pdx) in zip(cached, plain, strict=True):
            assert torch.equal(co, po) and torch.equal(cdx, pdx), f"step {step}: cached out / dx differ"
        assert torch.equal(ww.grad, plain_w.grad), f"step {step}: cached dw differs"
        opt.step()
        opt.zero_grad()


def test_blockwise_beats_rowwise_on_outlier_blocks():
    """Outlier input channels 1e5x larger, confined to one 128-wide block of K (the engine issue's case; the
    weights of those channels scaled by 1e-5 so that both parts of the output matter): blockwise keeps the
    other blocks' precision (one scale per 1x128 tile), rowwise scales each whole row by the outlier and
    flushes the rest toward E4M3's subnormals. Blockwise must be >= 10 dB better on the fprop output."""
    x, w, offs, g = _case(torch.float32, sizes=(64, 64), k=2048, n=256, seed=3)
    x[:, :4] *= 1e5  # four outlier channels, all in the first K block
    w[:, :, :4] *= 1e-5
    ref_out, _, _ = grouped_reference_f64(x, w, offs, g)
    last = int(offs[-1])
    block = fp8_grouped_mm(x, w, offs, "blockwise_loop")[:last]
    row = fp8_grouped_mm(x, w, offs, "emulated")[:last]
    from tests.conftest import sqnr

    db_block, db_row = sqnr(ref_out[:last], block), sqnr(ref_out[:last], row)
    assert db_block >= db_row + 10.0, f"blockwise {db_block:.1f} dB vs rowwise {db_row:.1f} dB"


def test_blockwise_experts_layer_vs_float64_reference():
    """A whole MoE layer through Float8GroupedExperts' code path (dispatch, blockwise gate_up, SiLU gate,
    blockwise down, combine) against the HF experts formula in float64, with experts left without tokens."""
    e, hdim, inter, tokens = 6, 128, 128, 90
    torch.manual_seed(0)
    idx = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])  # experts 4, 5 get nothing
    leaves, weights, g, ref_leaves, ref = layer_case(idx, e, hdim, inter)
    d = routing.dispatch(idx, e)
    bounds = group_bounds(d.offs)
    x = routing.gather(leaves[0], d)
    gate, u = blockwise_loop_mm(x, leaves[1], d.offs, bounds=bounds).chunk(2, dim=-1)
    y = blockwise_loop_mm(torch.nn.functional.silu(gate) * u, leaves[2], d.offs, bounds=bounds)
    out = routing.combine(y, d, weights, torch.float32)
    out.backward(g)
    unused = check_layer("blockwise layer", idx, e, leaves, ref_leaves, ref, out)
    assert unused[4:].all()


def test_blockwise_recipe_resolves_to_the_loop_and_mismatches_are_refused():
    cpu = torch.device("cpu")
    assert resolve_grouped_kernel(GroupedGemmConfig.for_fp8_recipe("blockwise"), cpu) == "blockwise_loop"
    assert resolve_grouped_kernel(GroupedGemmConfig.for_fp8_recipe("tensorwise"), cpu) == "emulated"
    with pytest.raises(ConfigError, match="does not run recipe"):
        resolve_grouped_kernel(GroupedGemmConfig(kernel="torchao", recipe="blockwise"), cpu)
    with pytest.raises(ConfigError, match="does not run recipe"):
        resolve_grouped_kernel(GroupedGemmConfig(kernel="blockwise_loop"), cpu)
    with pytest.raises(ConfigError, match="unknown recipe 'tensorwise'"):
        resolve_grouped_kernel(GroupedGemmConfig(recipe="tensorwise"), cpu)


def test_expert_dims_not_multiple_of_128_are_refused_with_the_shape():
    x, w, offs, _ = _case(torch.float32, k=256, n=384)
    with pytest.raises(ValueError, match=r"\(E, N, K\) = \(5, 80, 256\).*multiples of 128"):
        blockwise_loop_mm(x, w[:, :80], offs)


def test_blockwise_recipe_keeps_experts_of_odd_width_bf16_with_the_reason():
    """With fp8.recipe = blockwise the static rules require 128-multiples of the expert weights too: the
    tiny-moe preset's experts (hidden 256, width 128 -> gate_up 256 x 256 and down 128 x 256) qualify,
    a width of 96 does not, and the decision says why."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fp8kit.config import FP8Config
    from fp8kit.config.options import decide_for_library

    for width, want in ((128, True), (96, False)):
        cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=width,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             num_experts=8, num_experts_per_tok=2)
        model = Qwen3MoeForCausalLM(cfg)
        decisions = decide_for_library(model, FP8Config(recipe="blockwise"), None, mixed_precision="fp8",
                                       num_tokens=256)
        grouped = [d for d in decisions if d.site.is_grouped_weight]
        assert grouped and all(d.is_fp8 == want for d in grouped), [(d.fqn, d.precision, d.reason) for d in grouped]
        if want:
            assert all(d.recipe == "blockwise" for d in grouped)
        else:
            assert any("128" in d.reason for d in grouped), [d.reason for d in grouped]


def test_blockwise_recipe_keeps_many_local_experts_bf16_and_says_why():
    """More than BLOCKWISE_LOOP_MAX_EXPERTS local experts (the per-expert loop is host-bound there) stay BF16 with
    the reason; expert parallelism that brings the local count down makes them FP8 again."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fp8kit.config import FP8Config
    from fp8kit.config.options import decide_options
    from fp8kit.selective.decide import BLOCKWISE_LOOP_MAX_EXPERTS, decide
    from fp8kit.selective.sites import find_sites

    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=32, num_experts_per_tok=2)
    sites = find_sites(Qwen3MoeForCausalLM(cfg))
    for ep, want in ((1, False), (4, True)):
        opts = decide_options(FP8Config(recipe="blockwise"), None, num_tokens=256, ep=ep, topk=2)
        grouped = [d for d in decide(sites, opts) if d.site.is_grouped_weight]
        assert grouped and all(d.is_fp8 == want for d in grouped), [(d.fqn, d.precision, d.reason) for d in grouped]
        if not want:
            assert all(d.rule == "blockwise-loop" and f"{32 // ep} local experts" in d.reason for d in grouped)
    assert 32 > BLOCKWISE_LOOP_MAX_EXPERTS >= 8
