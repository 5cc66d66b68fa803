"""FP8 all-reduce on CUDA (marker ``gpu``; skipped without CUDA): the Triton passes of
:mod:`fp8kit.comm.allreduce_triton` against the PyTorch references run on the same GPU, bit for bit, and a
2-rank NCCL run (skipped with fewer than 2 GPUs) of the fused path against the reference path.

Run: ``pytest -m gpu tests/test_fp8_allreduce_gpu.py`` (the NCCL test launches ``torchrun --nproc_per_node 2``
itself and runs both algorithms, "scatter" and "gather", fused against their reference paths; it also trains a small FSDP2 model with and without :func:`fp8kit.comm.apply_fp8_reduce_scatter` and
asserts the losses agree within 0.5 % per step). Inputs are realistic gradients (randn * 1e-3 with 0.1 %
outliers of 0.05) of 2^24 + 12345 elements (not a multiple of the block), scaled to the format's range with
the auto-scaling mu (and 2x above it, so values saturate); outputs go into buffers poisoned with 0x7F bytes
(NaN in FP8 and fp16, ~3.4e38 in bf16 and fp32), so an element the kernels leave unwritten fails. Where a
result is NaN only "both NaN" is checked (the hardware cast's NaN encoding may differ from torch's); every
other element must have the reference's bits.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kit.comm import AutoScaleState, fp8_allreduce_bytes
from fp8kit.comm import allreduce_ops as ops
from fp8kit.comm.autoscale import gather_row_bytes
from fp8kit.comm.unify import params_tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N = (1 << 24) + 12345
FP8S = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}
FP8_MAX = {torch.float8_e5m2: 57344.0, torch.float8_e4m3fn: 448.0}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: FSDP2 + Fp8ReduceScatter (E5M2) vs plain FSDP2, per-step relative loss difference (the CPU test measures 0.05 %).
FSDP_LOSS_REL_TOL = 5e-3


def _grad(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = torch.randn(n, generator=gen, device="cuda") * 1e-3
    mask = torch.rand(n, generator=gen, device="cuda") < 1e-3
    return torch.where(mask, 0.05 * torch.sign(g), g).to(dtype)


def _poisoned(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n * torch.empty((), dtype=dtype).element_size(),), 0x7F, dtype=torch.uint8,
                      device="cuda").view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same(got: torch.Tensor, ref: torch.Tensor, where: str, fmt: torch.dtype | None = None) -> None:
    """Bit-equal, except that NaN results only need to be NaN in both (``fmt``: the FP8 format of uint8 bytes)."""
    torch.cuda.synchronize()
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{where}: {got.shape}/{got.dtype} vs {ref.shape}/{ref.dtype}"
    vg = got.view(fmt).float() if fmt is not None else got.float()
    vr = ref.view(fmt).float() if fmt is not None else ref.float()
    nan_g, nan_r = vg.isnan(), vr.isnan()
    assert torch.equal(nan_g, nan_r), f"{where}: NaN at {(nan_g != nan_r).sum().item()} other places"
    diff = ((_bits(got) != _bits(ref)) & ~nan_r).sum().item()
    assert diff == 0, f"{where}: {diff} of {got.numel()} elements differ from the reference"


def test_triton_kernels_are_used():
    assert ops._kernels() is not None, "triton is not importable: the CUDA ops would run the references"


def _values(mu: float, init: bool = True, steps: float = 0.0) -> torch.Tensor:
    return torch.tensor([mu, steps, 1.0, 2.0, float(init), 0.01], dtype=torch.float64, device="cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FP8S))
def test_scale_and_quantize_match_reference(fmt, dtype):
    fp8, m = FP8S[fmt], FP8_MAX[FP8S[fmt]]
    g = _grad(N, 1, dtype)
    amax = g.float().abs().max().item()
    params = params_tensor(AutoScaleState(scaling="current", growth_interval=3), torch.device("cuda"))
    saturated = False
    for factor in (1.0, 2.0, 0.3):  # auto-scaled, saturating, below range
        mu_v = m / amax * factor * (1 + 2**-30)  # not a float32 value: f32(mu) is rounded in both
        for init in (False, True):
            for steps in (0.0, 3.0):
                values = _values(mu_v, init, steps)
                v1 = ops.scale_vec(g, values, params, fp8)
                v2 = ops.scale_vec_ref(g, values, params, fp8)
                _assert_same(v1, v2, f"scale_vec {fmt} {dtype} x{factor} init={init}")
                saturated |= v1[1].item() < 0
                for a, b, what in zip(ops.scale_update(v1, values, params, fp8),
                                      ops.scale_update_ref(v1, values, params, fp8), ("scale", "out_scale", "values"),
                                      strict=True):
                    _assert_same(a, b, f"scale_update {what} {fmt} {dtype} x{factor} init={init} steps={steps}")
        mu = torch.tensor([mu_v], dtype=torch.float32, device="cuda")
        for k, L in ((N, N), (N - 1000, N + 7), (12345, 2 * 12345 + 1)):  # whole, padded, a piece
            got, ref = _poisoned(L, torch.uint8), _poisoned(L, torch.uint8)
            ops.quantize_into(g[:k], mu, got, fp8)
            ops.quantize_ref(g[:k], mu, ref, fp8)
            _assert_same(got, ref, f"quantize {fmt} {dtype} x{factor} k={k} L={L}", fp8)
    assert saturated, "the 2x case should saturate"


@pytest.mark.parametrize("fmt", list(FP8S))
def test_nonfinite_inputs(fmt):
    fp8 = FP8S[fmt]
    g = _grad(100_003, 2, torch.bfloat16)
    g[5], g[77], g[4096] = math.inf, -math.inf, math.nan
    values, params = _values(1000.0), params_tensor(AutoScaleState(scaling="current"), torch.device("cuda"))
    v1 = ops.scale_vec(g, values, params, fp8)
    _assert_same(v1, ops.scale_vec_ref(g, values, params, fp8), f"scale_vec nonfinite {fmt}")
    assert v1[3].item() == -1.0, v1
    scale, out_scale, new = ops.scale_update(v1, values, params, fp8)
    assert out_scale.isnan().all() and torch.equal(new, values)  # NaN result, state unchanged
    mu = torch.tensor([1000.0], device="cuda")
    got, ref = _poisoned(100_100, torch.uint8), _poisoned(100_100, torch.uint8)
    ops.quantize_into(g, mu, got, fp8)
    ops.quantize_ref(g, mu, ref, fp8)
    _assert_same(got, ref, f"quantize nonfinite {fmt}", fp8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FP8S))
def test_delayed_scaling_kernels_match_reference(fmt, dtype):
    """quantize_stats (FP8 bytes into a row, the statistics into its float64 trailer) and scale_update_delayed (the
    MIN of strided rows) against their references, auto-scaled, saturating and below range."""
    fp8, m = FP8S[fmt], FP8_MAX[FP8S[fmt]]
    g = _grad(N, 3, dtype)
    amax = g.float().abs().max().item()
    params = params_tensor(AutoScaleState(scaling="current", growth_interval=3), torch.device("cuda"))
    row = gather_row_bytes(N - 1000)
    for factor in (1.0, 2.0, 0.3):
        values = _values(m / amax * factor * (1 + 2**-30), True, 3.0)
        bufs = []
        for fn in (ops.quantize_stats_into, ops.quantize_stats_ref):
            buf = _poisoned(row + 32, torch.uint8)
            fn(g[: N - 1000], values, params, buf[:row], buf[row:].view(torch.float64), fp8)
            bufs.append(buf)
        _assert_same(bufs[0][:row], bufs[1][:row], f"quantize_stats bytes {fmt} {dtype} x{factor}", fp8)
        _assert_same(bufs[0][row:].view(torch.float64), bufs[1][row:].view(torch.float64),
                     f"quantize_stats statistics {fmt} {dtype} x{factor}")
        _assert_same(bufs[0][row:].view(torch.float64), ops.scale_vec_ref(g[: N - 1000], values, params, fp8),
                     f"quantize_stats statistics vs scale_vec {fmt} {dtype} x{factor}")
        rows = torch.stack([bufs[0], bufs[1], bufs[0]]).reshape(-1)  # three ranks' rows
        vecs = rows.view(3, row + 32)[:, row:].view(torch.float64)
        for a, b, what in zip(ops.scale_update_delayed(vecs, values, params, fp8),
                              ops.scale_update_delayed_ref(vecs, values, params, fp8), ("out_scale", "values"),
                              strict=True):
            _assert_same(a, b, f"scale_update_delayed {what} {fmt} {dtype} x{factor}")


def test_eager_calls_equal_the_ops():
    """fp8kit.comm.eager launches the kernels without the dispatcher: the same bits as the ops."""
    from fp8kit.comm import eager

    fp8 = torch.float8_e5m2
    g = _grad(N, 4, torch.bfloat16)
    values = _values(57344.0 / g.float().abs().max().item(), True, 3.0)
    params = params_tensor(AutoScaleState(scaling="current"), torch.device("cuda"))
    row = gather_row_bytes(N)
    a, b = _poisoned(row + 32, torch.uint8), _poisoned(row + 32, torch.uint8)
    eager.quantize_stats(g, values, params, a[:row], a[row:].view(torch.float64), fp8)
    ops.quantize_stats_into(g, values, params, b[:row], b[row:].view(torch.float64), fp8)
    _assert_same(a, b, "eager quantize_stats")
    rows = torch.cat([a, b])
    vecs = rows.view(2, row + 32)[:, row:].view(torch.float64)
    for x, y in zip(eager.update_delayed(vecs, values, params, fp8), ops.scale_update_delayed(vecs, values, params, fp8),
                    strict=True):
        _assert_same(x, y, "eager update_delayed")
    o1, o2 = _poisoned(N, torch.bfloat16), _poisoned(N, torch.bfloat16)
    scale = torch.tensor([1000.0], device="cuda")
    eager.gather_mean(rows, scale, o1, 2, fp8)
    ops.gather_mean_into(rows, scale, o2, 2, fp8)
    _assert_same(o1, o2, "eager gather_mean")
    v1, v2 = eager.scale_vec(g, values, params, fp8), ops.scale_vec(g, values, params, fp8)
    _assert_same(v1, v2, "eager scale_vec")
    for x, y in zip(eager.scale_update(v1, values, params, fp8), ops.scale_update(v1, values, params, fp8), strict=True):
        _assert_same(x, y, "eager scale_update")


def test_initial_mu_matches_reference_near_the_float32_limits():
    """mu0 = FP8_MAX / amax over 8 decades and at the clamps (eps, F32_MAX): torch's two float32 roundings."""
    params = params_tensor(AutoScaleState(scaling="current"), torch.device("cuda"))
    amaxes = [0.0, 1e-13, 5e-39, 3.0e38, 3.4e38, 1e30] + [1.7 * 10.0**e * (1 + k * 2**-23) for e in range(-8, 1)
                                                          for k in range(5)]
    for fp8 in FP8S.values():
        for a in amaxes:
            vec = torch.tensor([math.inf, -0.0, -a, -0.0], dtype=torch.float64, device="cuda")
            values = _values(1.0, init=False)
            for x, y, what in zip(ops.scale_update(vec, values, params, fp8),
                                  ops.scale_update_ref(vec, values, params, fp8), ("scale", "out_scale", "values"),
                                  strict=True):
                _assert_same(x, y, f"initial mu {fp8} amax={a:.4g} {what}")


def _wire(world: int, c: int, fp8: torch.dtype) -> torch.Tensor:
    """``world`` ranks' FP8 chunks of realistic gradients, quantized with their common mu: uint8 [world * c]."""
    m = FP8_MAX[fp8]
    gs = [_grad(c, 10 + r, torch.float32) for r in range(world)]
    mu = (m / max(x.abs().max() for x in gs)).reshape(1)
    return torch.cat([(x * mu).clamp(-m, m).to(fp8).view(torch.uint8) for x in gs])


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("fmt", list(FP8S))
def test_sum_requant_and_sum_dequant_match_reference(fmt, world):
    fp8 = FP8S[fmt]
    c = (N // world) + 3
    recv = _wire(world, c, fp8)
    got, ref = _poisoned(c, torch.uint8), _poisoned(c, torch.uint8)
    ops.sum_requant_into(recv, got, world, fp8)
    ops.sum_requant_ref(recv, ref, world, fp8)
    _assert_same(got, ref, f"sum_requant {fmt} N={world}", fp8)
    scale = torch.tensor([12345.678], device="cuda")
    for dtype in DTYPES:
        for mul in (1.0 / world, 1.0, 0.1):
            got, ref = _poisoned(c, dtype), _poisoned(c, dtype)
            ops.sum_dequant_into(recv, scale, got, world, mul, fp8)
            ops.sum_dequant_ref(recv, scale, ref, world, mul, fp8)
            _assert_same(got, ref, f"sum_dequant {fmt} N={world} {dtype} mul={mul:.3g}")


def _gather_rows(world: int, n: int, row: int, fp8: torch.dtype) -> torch.Tensor:
    """``world`` ranks' whole FP8 tensors of ``n`` realistic values in rows of ``row`` bytes, padded with 0x7F (NaN,
    which must never reach the result): the "gather" all-gather's output, uint8 ``[world * row]``."""
    m = FP8_MAX[fp8]
    gs = [_grad(n, 20 + r, torch.float32) for r in range(world)]
    mu = (m / max(x.abs().max() for x in gs)).reshape(1)
    rows = torch.full((world, row), 0x7F, dtype=torch.uint8, device="cuda")
    for r, x in enumerate(gs):
        rows[r, :n] = (x * mu).clamp(-m, m).to(fp8).view(torch.uint8)
    return rows.reshape(-1)


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("fmt", list(FP8S))
def test_gather_mean_matches_reference(fmt, world):
    """The "gather" pass (rank-order float32 sum, * f32(1/N), / scale): aligned padded rows (``fp8_all_reduce``'s
    layout), unaligned rows (row = n, odd: no 16-byte specialisation), and a pipeline piece at an offset."""
    fp8 = FP8S[fmt]
    layouts = [(N, gather_row_bytes(N), 0), (N, N, 0), (50_000 - 7, 50_000, world * 3 * 1024)]
    for n, row, lo in layouts:
        rows = _gather_rows(world, n, row, fp8)
        if lo:  # the rows at byte offset lo of a larger buffer (a later pipeline piece)
            rows = torch.cat([torch.full((lo,), 0x7F, dtype=torch.uint8, device="cuda"), rows])
        piece = rows[lo:]
        for dtype in DTYPES:
            for sv in (12345.678, 0.7):
                scale = torch.tensor([sv], device="cuda")
                got, ref = _poisoned(n, dtype), _poisoned(n, dtype)
                ops.gather_mean_into(piece, scale, got, world, fp8)
                ops.gather_mean_ref(piece, scale, ref, world, fp8)
                _assert_same(got, ref, f"gather_mean {fmt} N={world} n={n} row={row} lo={lo} {dtype} scale={sv}")
                assert not got.isnan().any(), "the 0x7F (NaN) padding reached the result"
        got = _poisoned(n, torch.bfloat16)
        ops.gather_mean_into(piece, torch.tensor([math.nan], device="cuda"), got, world, fp8)
        assert got.isnan().all(), "a NaN scale (some rank held an inf / NaN) must give NaN everywhere"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", list(FP8S))
def test_dequantize_matches_reference(fmt, dtype):
    fp8 = FP8S[fmt]
    data = _wire(2, N // 2 + 5, fp8)
    for sv in (40_000.0, 3.3e7, 0.7):
        scale = torch.tensor([sv], device="cuda")
        for lo, L in ((0, N), (3 * 1024, 50_000)):  # the whole buffer; a piece at an offset
            got, ref = _poisoned(L, dtype), _poisoned(L, dtype)
            ops.dequantize_into(data[lo:], scale, got, fp8)
            ops.dequantize_ref(data[lo:], scale, ref, fp8)
            _assert_same(got, ref, f"dequantize {fmt} {dtype} scale={sv} lo={lo}")
    got = _poisoned(1000, dtype)
    ops.dequantize_into(data, torch.tensor([math.nan], device="cuda"), got, fp8)
    assert got.isnan().all()


def test_ops_trace_with_torch_compile():
    """The CUDA ops in a compiled graph (Inductor) give eager's bits."""

    def passes(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor):
        vec = ops.scale_vec(g, values, params, torch.float8_e5m2)
        scale, out_scale, new = ops.scale_update(vec, values, params, torch.float8_e5m2)
        q = torch.empty(2 * (g.numel() // 2 + 1), dtype=torch.uint8, device=g.device)
        ops.quantize_into(g, scale, q, torch.float8_e5m2)
        out = torch.empty_like(g)
        ops.dequantize_into(q, out_scale, out, torch.float8_e5m2)
        return vec, scale, new, q, out

    g = _grad(1 << 20, 3, torch.bfloat16)
    values, params = _values(1.0, init=False), params_tensor(AutoScaleState(scaling="current"), torch.device("cuda"))
    torch._dynamo.reset()
    for a, b in zip(torch.compile(passes, fullgraph=True)(g, values, params), passes(g, values, params), strict=True):
        assert torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------------------------------------
# 2 ranks over NCCL: fused path == reference path, bit for bit
# ------------------------------------------------------------------------------------------------


def _fsdp_losses_rel(rank: int) -> float:
    """FSDP2 on the GPUs (MLP, bf16 params, fp32 reduce, AdamW, 10 steps): the largest relative loss difference
    between plain FSDP2 and FSDP2 with ``apply_fp8_reduce_scatter`` (E5M2), per step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fp8kit.comm import apply_fp8_reduce_scatter

    mesh = init_device_mesh("cuda", (2,))
    teacher = torch.randn(256, 64, generator=torch.Generator().manual_seed(9)).cuda() / 16
    runs = []
    for fp8 in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                                    torch.nn.GELU(), torch.nn.Linear(1024, 64)).cuda()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i in (0, 2, 4):
            fully_shard(model[i], mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if fp8:
            apply_fp8_reduce_scatter(model, AutoScaleState(scaling="current"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(10):
            gen = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(64, 256, generator=gen).cuda()
            loss = torch.nn.functional.mse_loss(model(x).float(), torch.tanh(x @ teacher))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / 2)
        runs.append(losses)
    return max(abs(a - b) / b for a, b in zip(runs[1], runs[0], strict=True))


def _nccl_worker(out_dir: Path) -> None:
    import torch.distributed as dist

    from fp8kit.comm import Fp8ReduceScatter, fp8_all_reduce

    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    res = {}
    for fmt in FP8S:
        for dtype in (torch.bfloat16, torch.float32):
            for n in (N, 1001):
                # each fused variant against its algorithm's reference path; "auto" is gather at 2 ranks
                variants = {"fused": ({"algorithm": "scatter"}, "reference"),
                            "fused_p4": ({"algorithm": "scatter", "pipeline_chunks": 4}, "reference"),
                            "reference": ({"algorithm": "scatter", "reference": True}, "reference"),
                            "gather": ({"algorithm": "gather"}, "gather_reference"),
                            "gather_p4": ({"algorithm": "gather", "pipeline_chunks": 4}, "gather_reference"),
                            "gather_reference": ({"algorithm": "gather", "reference": True}, "gather_reference"),
                            "auto": ({}, "gather_reference"),
                            # delayed scaling (the first call runs current scaling): fused vs its reference path
                            "gather_delayed": ({"algorithm": "gather"}, "gather_delayed_reference"),
                            "gather_delayed_reference": ({"algorithm": "gather", "reference": True},
                                                         "gather_delayed_reference"),
                            "scatter_delayed": ({"algorithm": "scatter"}, "scatter_delayed_reference"),
                            "scatter_delayed_reference": ({"algorithm": "scatter", "reference": True},
                                                          "scatter_delayed_reference")}  # fmt: skip
                states = {k: AutoScaleState(fp8_dtype=fmt, scaling="delayed" if "delayed" in k else "current")
                          for k in variants}  # fmt: skip
                case = {}
                for step in range(3):  # lazy init, a saturating step on rank 1 (mu halves), a quiet step
                    g = _grad(n, 100 * step + rank, dtype) * (100.0 if step == 1 and rank == 1 else 1.0)
                    outs = {k: fp8_all_reduce(g.clone(), state=states[k], **kw) for k, (kw, _) in variants.items()}
                    case[f"step{step}"] = {k: torch.equal(_bits(outs[k]), _bits(outs[against]))
                                           for k, (_, against) in variants.items()}  # fmt: skip
                # the state's meaning does not depend on the algorithm: all equal
                case["states"] = {k: s.stats() == states["reference"].stats() for k, s in states.items()}
                case["halvings"] = states["reference"].stats()["halvings"]
                case["bytes"] = {k: s.last_bytes_sent for k, s in states.items()}
                case["bytes_ok"] = all(
                    s.last_bytes_sent == fp8_allreduce_bytes(n, 2, "gather" if k.startswith(("gather", "auto")) else
                                                             "scatter", s.scaling) for k, s in states.items())  # fmt: skip
                res[f"allreduce/{fmt}/{str(dtype).removeprefix('torch.')}/{n}"] = case
            for scaling in ("current", "delayed"):
                outs = {}
                for name, ref in (("fused", False), ("reference", True)):
                    comm = Fp8ReduceScatter(AutoScaleState(fp8_dtype=fmt, scaling=scaling), "k", reference=ref)
                    for step in range(2):  # delayed: the second call quantizes with the first call's mu
                        x = _grad(2 * 3_000_001, 7 + 10 * step + rank, dtype)
                        out = torch.empty(3_000_001, dtype=dtype, device=dev)
                        comm(out, x, dist.group.WORLD, dist.ReduceOp.AVG)
                    outs[name] = out
                res[f"reduce_scatter/{scaling}/{fmt}/{str(dtype).removeprefix('torch.')}"] = torch.equal(
                    _bits(outs["fused"]), _bits(outs["reference"]))
    g = _grad(1 << 20, 5 + rank, torch.bfloat16)
    if rank == 1:
        g[1234] = math.inf
    for alg in ("scatter", "gather"):
        out = fp8_all_reduce(g.clone(), state=AutoScaleState(scaling="current"), pipeline_chunks=2, algorithm=alg)
        res[f"nonfinite_all_nan_{alg}"] = bool(out.isnan().all())
        st = AutoScaleState(scaling="delayed")
        fp8_all_reduce(_grad(1 << 20, 9 + rank, torch.bfloat16), state=st, algorithm=alg)  # initialise: current
        out = fp8_all_reduce(g.clone(), state=st, algorithm=alg)
        res[f"nonfinite_all_nan_{alg}_delayed"] = bool(out.isnan().all())
    res["fsdp_loss_rel"] = _fsdp_losses_rel(rank)
    torch.cuda.synchronize()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_rank_nccl_fused_equals_reference(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, c in r.items():
            if case.startswith("allreduce/"):
                for step in range(3):
                    assert all(c[f"step{step}"].values()), f"rank {rank} {case} step {step}: {c[f'step{step}']}"
                assert all(c["states"].values()) and c["halvings"] == 1, f"rank {rank} {case}: {c}"
                assert c["bytes_ok"], f"rank {rank} {case}: last_bytes_sent {c['bytes']}"
            elif case.startswith("reduce_scatter/"):
                assert c, f"rank {rank} {case}: fused reduce-scatter differs from the reference"
        assert r["nonfinite_all_nan_scatter"] and r["nonfinite_all_nan_gather"], (rank, r)
        assert r["nonfinite_all_nan_scatter_delayed"] and r["nonfinite_all_nan_gather_delayed"], (rank, r)
        assert r["fsdp_loss_rel"] < FSDP_LOSS_REL_TOL, (
            f"rank {rank}: FSDP2 with the FP8 reduce-scatter vs plain FSDP2, loss differs by {r['fsdp_loss_rel']:.3%}")


if __name__ == "__main__":  # run by test_two_rank_nccl_fused_equals_reference under torchrun
    _nccl_worker(Path(sys.argv[1]))
