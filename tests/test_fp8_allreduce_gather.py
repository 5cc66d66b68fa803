"""The "gather" algorithm of the FP8 all-reduce (``fp8_all_reduce(..., algorithm="gather")``), on CPU.

- the op ``fp8kit::comm_ar_gather_mean`` (:func:`fp8kit.comm.allreduce_ops.gather_mean_into`) computes the
  documented math on hand-made rows: the float32 rank-order sum of the first ``n`` columns of ``[N, L]``,
  ``* f32(1/N)`` (not ``/ N``), ``/ scale``, NaN for a NaN scale; passes ``torch.library.opcheck`` and traces
  with ``torch.compile(fullgraph=True)`` to eager's bits;
- ``algorithm="auto"`` is gather at 2 ranks and scatter otherwise; ``fp8_allreduce_bytes`` counts
  ``(N-1) * L + 2 (N-1)/N * 32`` bytes for gather (``L`` = numel rounded up to 16);
- on 2 and 3 gloo ranks (one ``torchrun`` launch each): gather equals the algorithm written out in one process
  (mu0 = FP8_MAX / amax, FP8 cast, float32 rank-order sum, ``* f32(1/N)``, ``/ mu``) bit for bit; pipeline pieces
  (3, 7) and ``reference=True`` equal the one-piece call bit for bit, results and state, over 3 steps (lazy init,
  a saturating step that halves mu, a quiet step); "auto" gives gather's bits and bytes at 2 ranks and
  scatter's at 3; accuracy vs the float64 mean of realistic gradients: SQNR at least scatter's and >= 28 dB
  E5M2 / 34 dB E4M3 (measured 31.0 / 36.9 dB at 2 and 3 ranks; scatter 26.8 / 31.6 at 2, 22.9 / 29.1 at 3),
  and every element within the bound of ONE FP8 rounding
  (:func:`one_rounding_bound`), which the scatter algorithm's two roundings exceed; an inf or NaN on one rank
  gives NaN everywhere (pieces too) and leaves mu and the counters unchanged; the buffers handed to gloo (the
  real collectives, wrapped) are one 32-byte all-reduce and one all-gather of ``L`` bytes, matching
  ``state.bytes_sent`` / ``last_bytes_sent``; zeros stay exact, non-contiguous tensors and tiny sizes work,
  an empty tensor is untouched.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp8kit.comm import AutoScaleState, fp8_all_reduce, fp8_allreduce_bytes, ring_allreduce_bytes
from fp8kit.comm import allreduce_ops as ops
from fp8kit.comm.autoscale import GATHER_ROW_ALIGN, gather_row_bytes, pick_algorithm
from tests.test_distributed import torchrun_rank_results

E5M2, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn
FMTS = {"e5m2": E5M2, "e4m3": E4M3}
FP8_MAX = {E5M2: 57344.0, E4M3: 448.0}
#: SQNR floors of gather (measured 31.0 / 36.9 dB at 2 and 3 ranks; test_fp8_allreduce.py's scatter floors: 22 / 28).
GATHER_SQNR_FLOOR_DB = {"e5m2": 28.0, "e4m3": 34.0}
#: Unit roundoff (half an ulp at 1) and smallest subnormal of each FP8 format; output dtypes' roundoff and floor.
UNIT_ROUNDOFF = {"e5m2": 2.0**-3, "e4m3": 2.0**-4}
MIN_SUBNORMAL = {"e5m2": 2.0**-16, "e4m3": 2.0**-9}
OUT_ROUNDOFF = {torch.float32: (2.0**-24, 0.0), torch.bfloat16: (2.0**-9, 0.0), torch.float16: (2.0**-11, 2.0**-25)}


def _grad(seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Realistic gradient: N(0, 1e-3) with 0.1 % outliers of +-0.05 (50x)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * 1e-3
    idx = torch.randperm(n, generator=gen)[: max(1, n // 1000)]
    g[idx] = 0.05 * torch.sign(torch.randn(len(idx), generator=gen))
    return g.to(dtype)


def _sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    noise = (ref - x).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)


def _mu0(inputs: list[torch.Tensor], fp8: torch.dtype) -> torch.Tensor:
    """The first call's unified scale: f32(FP8_MAX / global amax), one float32 ulp down if it would saturate."""
    m = FP8_MAX[fp8]
    amax = max(x.float().abs().max() for x in inputs)
    mu = torch.tensor(m, dtype=torch.float32) / amax
    return torch.nextafter(mu, torch.tensor(0.0)) if mu * amax > m else mu


def written_out_gather(inputs: list[torch.Tensor], fp8: torch.dtype) -> torch.Tensor:
    """The gather algorithm in one process: FP8(sat(x mu)) per rank, float32 sum in rank order, * f32(1/N), / mu."""
    m, mu = FP8_MAX[fp8], _mu0(inputs, fp8)
    total = None
    for x in inputs:
        q = (x.float() * mu).clamp(-m, m).to(fp8).float()
        total = q if total is None else total + q
    return ((total * torch.tensor(1 / len(inputs), dtype=torch.float32)) / mu).to(inputs[0].dtype)


def written_out_scatter(inputs: list[torch.Tensor], fp8: torch.dtype) -> torch.Tensor:
    """The scatter algorithm in one process: as gather, but the mean is rounded to FP8 once more before ``/ mu``."""
    m, mu = FP8_MAX[fp8], _mu0(inputs, fp8)
    total = None
    for x in inputs:
        q = (x.float() * mu).clamp(-m, m).to(fp8).float()
        total = q if total is None else total + q
    mean = (total * torch.tensor(1 / len(inputs), dtype=torch.float32)).clamp(-m, m).to(fp8)
    return (mean.float() / mu).to(inputs[0].dtype)


def one_rounding_bound(inputs: list[torch.Tensor], mu: float, fmt: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on ``|gather result - float64 mean|`` (float64), no saturation: ONE FP8 rounding.

    With ``u`` the FP8 unit roundoff, ``h = min_subnormal / 2 / mu`` (half the smallest FP8 step in gradient
    units), ``a = mean_i |g_i|``, ``r = |mean_i g_i|``: ``q_i = FP8(mu g_i)`` errs by at most ``u |g_i| + h``, so
    the mean of ``q_i / mu`` by ``e1 = u a + h``; the cast to ``out_dtype`` (roundoff ``u_o``, floor ``h_o``) adds
    ``u_o (r + e1) + h_o``; the float32 products, sum and division add less than ``2^-22 (r + a)``.
    (test_fp8_allreduce.error_bound is the scatter algorithm's: it adds the second rounding ``u (r + e1) + h``.)
    """
    g = torch.stack([x.double() for x in inputs])
    a, r = g.abs().mean(0), g.mean(0).abs()
    u, h = UNIT_ROUNDOFF[fmt], MIN_SUBNORMAL[fmt] / 2 / mu
    e1 = u * a + h
    u_o, h_o = OUT_ROUNDOFF[out_dtype]
    return e1 + u_o * (r + e1) + h_o + 2.0**-22 * (r + a)


def worst_ratio(out: torch.Tensor, inputs: list[torch.Tensor], mu: float, fmt: str) -> float:
    """``max |out - mean(inputs)| / one_rounding_bound``: at most 1 for a correct gather result."""
    ref = torch.stack([x.double() for x in inputs]).mean(0)
    return ((out.double() - ref).abs() / one_rounding_bound(inputs, mu, fmt, out.dtype)).max().item()


# ------------------------------------------------------------------------------------------------
# Single process: the op, the rule, the byte count, the bound
# ------------------------------------------------------------------------------------------------


def _rows(world: int, n: int, row: int, fp8: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``world`` rows of ``row`` FP8 bytes: ``n`` values (large, so sums need float32), then 0x7F junk."""
    gen = torch.Generator().manual_seed(seed)
    m = FP8_MAX[fp8]
    out = torch.full((world, row), 0x7F, dtype=torch.uint8)  # NaN in E5M2 and E4M3: must never be read into out
    for i in range(world):
        out[i, :n] = (torch.randn(n, generator=gen) * m / 4).clamp(-m, m).to(fp8).view(torch.uint8)
    return out.reshape(-1)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_gather_mean_math(world, dtype):
    n, row = 1000, 1008
    rows = _rows(world, n, row, E5M2)
    rows.view(world, row)[:, 0] = torch.tensor([57344.0] * world).to(E5M2).view(torch.uint8)  # 57344 N: float32
    scale = torch.tensor([3.0])
    out = torch.full((n,), 7.0, dtype=dtype)
    ops.gather_mean_into(rows, scale, out, world, E5M2)
    q = rows.view(E5M2).view(world, row)[:, :n].float()
    total = q[0]
    for i in range(1, world):
        total = total + q[i]
    want = ((total * torch.tensor(1 / world, dtype=torch.float32)) / torch.tensor(3.0)).to(dtype)
    assert torch.equal(out, want), f"max |diff| {(out.double() - want.double()).abs().max().item()}"
    assert out.isfinite().all()  # the 0x7F padding (NaN) is never read into the result
    assert out[0].item() == pytest.approx(57344.0 / 3.0, rel=2**-7)
    if world == 3:  # the data tell * f32(1/3) from / 3, so the check above pins the multiply
        assert not torch.equal(total * torch.tensor(1 / 3, dtype=torch.float32), total / torch.tensor(3.0))
    ops.gather_mean_into(rows, torch.tensor([math.nan]), out, world, E5M2)
    assert out.isnan().all()


def test_gather_mean_bad_arguments():
    rows, scale = torch.zeros(32, dtype=torch.uint8), torch.ones(1)
    with pytest.raises(ValueError, match="comm_ar_gather_mean: rows must hold world \\* L bytes .* got 32"):
        ops.gather_mean_into(rows, scale, torch.zeros(5), 3, E5M2)
    with pytest.raises(ValueError, match="out has 17 elements, more than a row's 16 bytes"):
        ops.gather_mean_into(rows, scale, torch.zeros(17), 2, E5M2)
    with pytest.raises(ValueError, match="rows must be a contiguous 1-D uint8"):
        ops.gather_mean_into(rows.float(), scale, torch.zeros(4), 2, E5M2)
    with pytest.raises(ValueError, match="scale must be a float32 tensor of shape \\(1,\\)"):
        ops.gather_mean_into(rows, torch.ones(()), torch.zeros(4), 2, E5M2)
    with pytest.raises(ValueError, match="fp8 must be"):
        ops.gather_mean_into(rows, scale, torch.zeros(4), 2, torch.bfloat16)


def test_gather_mean_opcheck_and_compile():
    rows = _rows(2, 3000, 3008, E4M3)
    scale = torch.tensor([20.0])
    torch.library.opcheck(torch.ops.fp8kit.comm_ar_gather_mean, (rows, scale, torch.zeros(3000), 2, E4M3))
    torch.library.opcheck(torch.ops.fp8kit.comm_ar_gather_mean,
                          (rows, scale, torch.zeros(2999, dtype=torch.bfloat16), 2, E4M3))

    def f(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = torch.empty(3000, dtype=torch.bfloat16)
        ops.gather_mean_into(rows, scale, out, 2, E4M3)
        return out

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(rows, scale), f(rows, scale))


def test_auto_rule_and_byte_count():
    assert pick_algorithm("auto", 2) == "gather"
    assert [pick_algorithm("auto", w) for w in (1, 3, 4, 8)] == ["scatter"] * 4
    assert pick_algorithm("gather", 8) == "gather" and pick_algorithm("scatter", 2) == "scatter"
    with pytest.raises(ValueError, match="algorithm must be 'auto', 'scatter' or 'gather', got 'ring'"):
        pick_algorithm("ring", 2)
    assert GATHER_ROW_ALIGN == 16 and gather_row_bytes(1001) == 1008 and gather_row_bytes(1008) == 1008
    # gather: (N-1) L + 2 (N-1)/N 32; scatter: 2 (N-1) ceil(n/N) + the same 32-byte term
    assert fp8_allreduce_bytes(1001, 2, "gather") == 1008 + 32 == fp8_allreduce_bytes(1001, 2)
    assert fp8_allreduce_bytes(1001, 2, "scatter") == 2 * 501 + 32
    assert fp8_allreduce_bytes(1001, 3, "gather") == 2 * 1008 + 2 * 2 * 32 // 3
    assert fp8_allreduce_bytes(1001, 3) == fp8_allreduce_bytes(1001, 3, "scatter") == 4 * 334 + 42
    assert fp8_allreduce_bytes(1 << 20, 2, "gather") == fp8_allreduce_bytes(1 << 20, 2, "scatter")  # N = 2: same
    assert fp8_allreduce_bytes(1 << 20, 8, "gather") == 4 * (fp8_allreduce_bytes(1 << 20, 8, "scatter") - 56) + 56
    assert fp8_allreduce_bytes(0, 2, "gather") == 0 == fp8_allreduce_bytes(5, 1, "gather")
    with pytest.raises(ValueError, match="algorithm must be"):
        fp8_allreduce_bytes(10, 2, "all")


def test_bad_algorithm_argument():
    with pytest.raises(ValueError, match="fp8_all_reduce: algorithm must be 'auto', 'scatter' or 'gather', got 'x'"):
        fp8_all_reduce(torch.zeros(4), algorithm="x")
    with pytest.raises(ValueError, match="algorithm must be .* got None"):
        fp8_all_reduce(torch.zeros(4), algorithm=None)


def test_one_rounding_bound_rejects_two_roundings():
    """The bound can fail: the written-out gather passes it, the written-out scatter (one more FP8 rounding), gather
    rounded to E5M2 when E4M3 was asked for, and the sum instead of the mean are rejected."""
    for world in (2, 3):
        inputs = [_grad(100 + r, 50_000) for r in range(world)]
        for fmt, fp8 in FMTS.items():
            mu = _mu0(inputs, fp8).item()
            good = written_out_gather(inputs, fp8)
            ratio = worst_ratio(good, inputs, mu, fmt)
            assert ratio <= 1.0, f"N={world} {fmt}: the gather reference exceeds its bound ({ratio:.3f})"
            wrong = {"scatter (two roundings)": written_out_scatter(inputs, fp8), "sum": good * world}
            if fmt == "e4m3":
                wrong["E5M2 rounding"] = written_out_gather(inputs, E5M2)
            for what, x in wrong.items():
                r = worst_ratio(x, inputs, mu, fmt)
                assert r > 1.0, f"N={world} {fmt} {what}: accepted by the one-rounding bound (worst ratio {r:.3f})"


def test_world_size_one_is_exact_passthrough():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = _grad(7, 1000).bfloat16()
        st = AutoScaleState(scaling="current")
        out = fp8_all_reduce(g.clone(), state=st, algorithm="gather")
        assert torch.equal(out, g) and st.keys() == [] and st.bytes_sent == 0 and st.calls == 0
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# The worker: torchrun, 2 or 3 gloo processes; every check returns numbers to the parent
# ------------------------------------------------------------------------------------------------


def _all_ranks(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return out


def _check_equivalences(rank: int, world: int) -> dict:
    """Gather vs the written-out algorithm, pieces, the reference path; auto vs gather / scatter; 3 steps."""
    res = {}
    for fmt, fp8 in FMTS.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n in (1, 5, 1001, 40_001):
                variants = {"gather": {"algorithm": "gather"},
                            "gather_p3": {"algorithm": "gather", "pipeline_chunks": 3},
                            "gather_p7": {"algorithm": "gather", "pipeline_chunks": 7},
                            "gather_reference": {"algorithm": "gather", "reference": True},
                            "auto": {}, "scatter": {"algorithm": "scatter"}}  # fmt: skip
                states = {k: AutoScaleState(scaling="current", fp8_dtype=fmt) for k in variants}
                expect_auto = "gather" if world == 2 else "scatter"
                case = {}
                for step in range(3):  # lazy init; rank N-1 100x larger (mu halves); quiet
                    g = _grad(100 * step + rank, n, dtype) * (100.0 if step == 1 and rank == world - 1 else 1.0)
                    outs = {k: fp8_all_reduce(g.clone(), state=states[k], **kw) for k, kw in variants.items()}
                    if step == 0:
                        case["written_out"] = torch.equal(outs["gather"], written_out_gather(_all_ranks(g), fp8))
                    same = {k: torch.equal(outs[k], outs["gather"]) for k in variants if k.startswith("gather")}
                    same["auto"] = torch.equal(outs["auto"], outs[expect_auto])
                    case[f"step{step}"] = same
                    case[f"step{step}_ranks_agree"] = all(torch.equal(o, outs["gather"]) for o in _all_ranks(
                        outs["gather"]))
                ref = states["gather"].stats()
                case["states"] = {k: s.stats() == ref for k, s in states.items()}
                case["halvings"] = ref["halvings"]
                gb = fp8_allreduce_bytes(n, world, "gather")
                case["bytes"] = {k: (s.last_bytes_sent, s.bytes_sent, s.calls) for k, s in states.items()}
                case["bytes_ok"] = all(
                    s.bytes_sent == 3 * s.last_bytes_sent and s.calls == 3
                    and s.last_bytes_sent == (fp8_allreduce_bytes(n, world, "scatter") if k == "scatter" else
                                              fp8_allreduce_bytes(n, world, expect_auto) if k == "auto" else gb)
                    and s.bf16_ring_bytes == 3 * ring_allreduce_bytes(n, world, 2)
                    for k, s in states.items()
                )  # fmt: skip
                res[f"{fmt}/{str(dtype).removeprefix('torch.')}/{n}"] = case
    return res


def _check_accuracy(rank: int, world: int) -> dict:
    """SQNR vs the float64 mean and the worst ratio to the one-rounding bound, gather and scatter."""
    res = {}
    for fmt in FMTS:
        for dtype in (torch.float32, torch.bfloat16):
            g = _grad(500 + rank, 50_000, dtype)
            inputs = _all_ranks(g)
            ref = torch.stack([x.double() for x in inputs]).mean(0)
            case = {}
            for alg in ("gather", "scatter"):
                st = AutoScaleState(scaling="current", fp8_dtype=fmt)
                out = fp8_all_reduce(g.clone(), state=st, algorithm=alg)
                case[alg] = {"sqnr_db": _sqnr_db(ref, out), "worst_ratio": worst_ratio(out, inputs, st.mu(), fmt)}
            res[f"{fmt}/{str(dtype).removeprefix('torch.')}"] = case
    return res


def _check_nonfinite(rank: int, world: int) -> dict:
    res = {}
    for bad in (math.inf, -math.inf, math.nan):
        for pieces in (1, 3):
            st = AutoScaleState(scaling="current")
            fp8_all_reduce(_grad(40 + rank, 20_000), state=st, algorithm="gather")  # initialise mu
            before = st.stats()
            g = _grad(50 + rank, 20_000)
            if rank == 1:
                g[7] = bad
            out = fp8_all_reduce(g, state=st, algorithm="gather", pipeline_chunks=pieces)
            res[f"{bad}/p{pieces}"] = {
                "all_nan": bool(out.isnan().all()),
                "state_unchanged": st.stats() == {**before, "calls": before["calls"] + 1},
            }
    return res


def _check_traffic(rank: int, world: int) -> dict:
    """The buffers one call hands to the (real, wrapped) gloo collectives, per algorithm; bytes a rank sends: ring
    all-reduce ``2 (N-1)/N`` of its buffer, all-gather ``(N-1)`` times its input, all-to-all ``(N-1)/N`` of it."""
    import fp8kit.comm.fp8_allreduce as mod

    def spy(calls: list, name: str, fn, buf_arg: int):
        def wrapped(*args, **kw):
            buf = args[buf_arg]
            calls.append((name, buf.numel() * buf.element_size()))
            return fn(*args, **kw)

        return wrapped

    factor = {"all_to_all": (world - 1) / world, "all_gather": world - 1, "all_reduce": 2 * (world - 1) / world}
    res = {}
    for alg in ("gather", "auto"):
        for n in (100_000, 1001):
            calls: list[tuple[str, int]] = []
            real = (dist.all_to_all_single, dist.all_reduce, mod._all_gather_single)
            dist.all_to_all_single = spy(calls, "all_to_all", real[0], 1)
            dist.all_reduce = spy(calls, "all_reduce", real[1], 0)
            mod._all_gather_single = spy(calls, "all_gather", real[2], 1)
            try:
                st = AutoScaleState(scaling="current")
                fp8_all_reduce(_grad(5000 + rank, n).bfloat16(), state=st, algorithm=alg)
            finally:
                dist.all_to_all_single, dist.all_reduce, mod._all_gather_single = real
            res[f"{alg}/{n}"] = {"calls": calls, "sent": sum(int(b * factor[k]) for k, b in calls),
                                 "bytes_sent": st.bytes_sent, "last_bytes_sent": st.last_bytes_sent}  # fmt: skip
    return res


def _check_shapes(rank: int, world: int) -> dict:
    res = {}
    z = fp8_all_reduce(torch.zeros(5000), state=AutoScaleState(scaling="current"), algorithm="gather")
    res["zeros_exact"] = bool((z == 0).all())
    g = _grad(400 + rank, 64 * 48).view(64, 48).t()  # [48, 64], non-contiguous
    x = g.clone()
    out_nc = fp8_all_reduce(x, state=AutoScaleState(scaling="current"), algorithm="gather")
    out_c = fp8_all_reduce(g.contiguous(), state=AutoScaleState(scaling="current"), algorithm="gather")
    res["noncontiguous_equal"] = (not x.is_contiguous() and out_nc is x and torch.equal(out_nc, out_c)
                                  and out_nc.shape == (48, 64))  # fmt: skip
    st = AutoScaleState(scaling="current")
    e = torch.empty(0)
    res["empty_untouched"] = fp8_all_reduce(e, state=st, algorithm="gather") is e and st.keys() == [] and st.calls == 0
    return res


def _worker(out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"world_size": world}
    for name, fn in (("equivalences", _check_equivalences), ("accuracy", _check_accuracy),
                     ("nonfinite", _check_nonfinite), ("traffic", _check_traffic), ("shapes", _check_shapes)):
        res[name] = fn(rank, world)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def runs(request, tmp_path_factory) -> list[dict]:
    """The ranks' results of one real gloo run of ``_worker`` on 2, then 3 processes."""
    world = request.param
    out = tmp_path_factory.mktemp(f"fp8_allreduce_gather{world}")
    return torchrun_rank_results(__file__, world, out, timeout=900)


def test_gather_equals_written_out_pieces_and_reference(runs):
    world = runs[0]["world_size"]
    for rank, r in enumerate(runs):
        for case, c in r["equivalences"].items():
            where = f"N={world} rank {rank} {case}"
            assert c["written_out"], f"{where}: gather differs from the algorithm written out in one process"
            for step in range(3):
                assert all(c[f"step{step}"].values()), f"{where} step {step}: {c[f'step{step}']}"
                assert c[f"step{step}_ranks_agree"], f"{where} step {step}: ranks hold different results"
            assert all(c["states"].values()), f"{where}: states differ from gather's one-piece call {c['states']}"
            assert c["halvings"] == 1, f"{where}: the 100x step should halve mu once, got {c['halvings']}"
            assert c["bytes_ok"], f"{where}: byte counters {c['bytes']}"


def test_gather_at_least_as_accurate_as_scatter(runs):
    world = runs[0]["world_size"]
    for rank, r in enumerate(runs):
        for case, c in r["accuracy"].items():
            fmt = case.split("/")[0]
            g, s = c["gather"], c["scatter"]
            msg = (f"N={world} rank {rank} {case}: gather SQNR {g['sqnr_db']:.2f} dB (worst bound ratio "
                   f"{g['worst_ratio']:.3f}), scatter {s['sqnr_db']:.2f} dB ({s['worst_ratio']:.3f})")
            print(msg)
            assert g["sqnr_db"] >= s["sqnr_db"], msg
            assert g["worst_ratio"] <= 1.0, msg  # one FP8 rounding
            assert g["sqnr_db"] >= GATHER_SQNR_FLOOR_DB[fmt], msg


def test_gather_nonfinite_gives_nan_and_keeps_state(runs):
    for rank, r in enumerate(runs):
        for case, c in r["nonfinite"].items():
            assert c["all_nan"] and c["state_unchanged"], (rank, case, c)


def test_gather_bytes_on_the_wire(runs):
    world = runs[0]["world_size"]
    for r in runs:
        for case, t in r["traffic"].items():
            alg, n = case.split("/")[0], int(case.split("/")[1])
            used = pick_algorithm(alg, world)
            if used == "gather":
                want = [("all_gather", gather_row_bytes(n)), ("all_reduce", 32)]
            else:
                chunk = -(-n // world)
                want = [("all_gather", chunk), ("all_reduce", 32), ("all_to_all", world * chunk)]
            assert sorted(map(tuple, t["calls"])) == want, (world, case, t["calls"])
            exact = fp8_allreduce_bytes(n, world, used)
            assert t["sent"] == exact == t["bytes_sent"] == t["last_bytes_sent"], (world, case, t, exact)
    if world == 2:  # auto is gather: one all-gather of the whole (padded) FP8 tensor
        assert runs[0]["traffic"]["auto/1001"]["sent"] == 1008 + 32


def test_gather_shapes(runs):
    for r in runs:
        s = r["shapes"]
        assert s["zeros_exact"] and s["noncontiguous_equal"] and s["empty_untouched"], s


if __name__ == "__main__":  # run by the `runs` fixture under torchrun
    _worker(Path(sys.argv[1]))
