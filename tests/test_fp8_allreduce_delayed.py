"""Delayed scaling of the FP8 all-reduce and reduce-scatter (``AutoScaleState(scaling="delayed")``), on CPU.

- the ops: ``fp8kit::comm_ar_quantize_stats`` equals ``quantize_into`` with ``f32(mu)`` plus ``scale_vec`` (bit for
  bit, also into a float64 view inside a byte buffer, as the all-gather row's trailer); ``comm_ar_scale_update_delayed``
  on a strided ``[N, 4]`` view equals ``scale_update`` on the rows' MIN, with ``out_scale = f32(mu)`` (NaN if any
  rank was bad); both pass ``torch.library.opcheck``; bad arguments are refused naming the argument;
- options: an unknown ``scaling`` and ``pipeline_chunks > 1`` with delayed scaling are clear errors;
  ``fp8_allreduce_bytes(..., "gather", "delayed")`` counts ``(N-1) (L + 32)`` and no scalar all-reduce;
- on 2 gloo ranks (one torchrun launch), gather and scatter: the key's first call runs "current" (mu0 from the
  global amax); every later call quantizes with the mu the earlier calls left and equals the algorithm written
  out with that mu bit for bit; the state after every step equals the "current" run's (the rule reads the same
  statistics); on the step where one rank jumps 100x, delayed scaling clips that step (the written-out result
  with the old mu, saturated) and mu halves for the next step; a key that starts with zeros stays "current"
  until initialised; inf / NaN gives NaN everywhere and leaves the state unchanged; the collectives handed to
  gloo: gather one all-gather of ``L + 32`` bytes (no all-reduce), scatter all-to-all + a 32-byte all-reduce +
  all-gather; ``Fp8ReduceScatter`` with delayed scaling equals its written-out sum with the old mu.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp8kit.comm import AutoScaleState, Fp8ReduceScatter, fp8_all_reduce, fp8_allreduce_bytes
from fp8kit.comm import allreduce_ops as ops
from fp8kit.comm.autoscale import SCALINGS, VEC_BYTES, gather_row_bytes
from fp8kit.comm.fsdp_reduce_scatter import fsdp_custom_reduce_scatter_support
from fp8kit.comm.unify import params_tensor
from tests.test_distributed import torchrun_rank_results
from tests.test_fp8_allreduce_gather import FMTS, FP8_MAX, _all_ranks, _grad

E5M2 = torch.float8_e5m2


def _values(mu: float, init: bool = True) -> torch.Tensor:
    return torch.tensor([mu, 3.0, 1.0, 0.0, float(init), 0.0], dtype=torch.float64)


# ------------------------------------------------------------------------------------------------
# Single process: the two ops and the options
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_quantize_stats_equals_quantize_and_scale_vec(fmt, dtype):
    fp8 = FMTS[fmt]
    st = AutoScaleState(fp8_dtype=fmt)
    params = params_tensor(st, torch.device("cpu"))
    g = _grad(3, 3001, dtype)
    g[5] = 0.9 * g.abs().max()  # some values saturate at this mu
    mu = FP8_MAX[fp8] / 0.02  # 0.1% outliers of 0.05 saturate: frac above delta, cand = mu / 2
    values = _values(mu)
    row = gather_row_bytes(g.numel())
    buf = torch.full((row + VEC_BYTES,), 0xAB, dtype=torch.uint8)
    ops.quantize_stats_into(g, values, params, buf[:row], buf[row:].view(torch.float64), fp8)
    want_q = torch.full((row,), 0xAB, dtype=torch.uint8)
    ops.quantize_into(g, values[0].float().reshape(1), want_q, fp8)
    want_vec = ops.scale_vec(g, values, params, fp8)
    assert torch.equal(buf[:row], want_q), "quantize_stats' FP8 bytes differ from quantize_into with f32(mu)"
    got_vec = buf[row:].view(torch.float64)
    assert torch.equal(got_vec, want_vec), f"statistics {got_vec.tolist()} != scale_vec {want_vec.tolist()}"
    assert got_vec[0].item() == mu / 2 and -got_vec[1].item() > st.delta, got_vec.tolist()  # it saturates


def test_scale_update_delayed_is_min_of_rows_with_old_mu():
    st = AutoScaleState()
    params = params_tensor(st, torch.device("cpu"))
    mu = 1000.0
    values = _values(mu)
    rank_vecs = torch.tensor([[mu, -0.0, -20.0, -0.0], [mu / 2, -0.01, -80.0, -0.0], [mu, -0.0, -5.0, -0.0]],
                             dtype=torch.float64)
    # the rows as the all-gather leaves them: trailers of 40-byte rows (strided view)
    raw = torch.zeros(3, 72, dtype=torch.uint8)
    raw[:, 40:].view(torch.float64).copy_(rank_vecs)
    vecs = raw[:, 40:].view(torch.float64)
    assert vecs.stride() == (9, 1)
    out_scale, new = ops.scale_update_delayed(vecs, values, params, E5M2)
    _, want_out, want_new = ops.scale_update(rank_vecs.amin(0), values, params, E5M2)
    assert torch.equal(new, want_new), f"next values {new.tolist()} != scale_update's {want_new.tolist()}"
    assert new[0].item() == mu / 2 and new[2].item() == 2.0  # halved, one more halving
    assert out_scale.item() == mu and want_out.item() == mu / 2  # delayed: this call used the old mu
    bad = rank_vecs.clone()
    bad[2, 3] = -1.0  # rank 2 saw an inf / NaN
    bad[2, 2] = -0.0
    out_scale, new = ops.scale_update_delayed(bad, values, params, E5M2)
    assert math.isnan(out_scale.item()) and torch.equal(new, values), (out_scale.item(), new.tolist())


def test_delayed_ops_opcheck_and_bad_arguments():
    st = AutoScaleState()
    params = params_tensor(st, torch.device("cpu"))
    g, values = _grad(1, 1000), _values(4000.0)
    torch.library.opcheck(torch.ops.fp8kit.comm_ar_quantize_stats,
                          (g, values, params, torch.zeros(1008, dtype=torch.uint8), torch.zeros(4, dtype=torch.float64),
                           E5M2))  # fmt: skip
    torch.library.opcheck(torch.ops.fp8kit.comm_ar_scale_update_delayed,
                          (torch.tensor([[4000.0, -0.0, -3.0, -0.0], [2000.0, -0.01, -9.0, -0.0]], dtype=torch.float64),
                           values, params, E5M2))
    with pytest.raises(ValueError, match="comm_ar_quantize_stats: vec must be a contiguous float64 tensor of shape"):
        ops.quantize_stats_into(g, values, params, torch.zeros(1008, dtype=torch.uint8), torch.zeros(4), E5M2)
    with pytest.raises(ValueError, match="comm_ar_quantize_stats: g has 1000 elements, more than out's 999"):
        ops.quantize_stats_into(g, values, params, torch.zeros(999, dtype=torch.uint8),
                                torch.zeros(4, dtype=torch.float64), E5M2)
    with pytest.raises(ValueError, match="comm_ar_quantize_stats: g is empty"):
        ops.quantize_stats_into(torch.zeros(0), values, params, torch.zeros(8, dtype=torch.uint8),
                                torch.zeros(4, dtype=torch.float64), E5M2)
    with pytest.raises(ValueError, match=r"comm_ar_scale_update_delayed: vecs must be a float64 \[N >= 1, 4\]"):
        ops.scale_update_delayed(torch.zeros(4, dtype=torch.float64), values, params, E5M2)
    with pytest.raises(ValueError, match="vecs must be a float64"):
        ops.scale_update_delayed(torch.zeros(4, 2, dtype=torch.float64).t(), values, params, E5M2)


def test_scaling_option_and_bytes():
    assert SCALINGS == ("current", "delayed") and AutoScaleState().scaling == "delayed"
    with pytest.raises(ValueError, match="AutoScaleState.scaling: unknown 'late'; valid: current, delayed"):
        AutoScaleState(scaling="late")
    assert AutoScaleState(scaling="delayed").state_dict()["scaling"] == "delayed"
    # gather + delayed: the rows carry the 32 bytes, no scalar all-reduce; scatter keeps its all-reduce
    assert fp8_allreduce_bytes(1001, 2, "gather", "delayed") == 1008 + VEC_BYTES
    assert fp8_allreduce_bytes(1001, 3, "gather", "delayed") == 2 * (1008 + VEC_BYTES)
    assert fp8_allreduce_bytes(1001, 2, "scatter", "delayed") == fp8_allreduce_bytes(1001, 2, "scatter")
    with pytest.raises(ValueError, match="scaling must be 'current' or 'delayed', got 'x'"):
        fp8_allreduce_bytes(10, 2, "gather", "x")
    with pytest.raises(ValueError, match="pipeline_chunks=3 needs the state's scaling='current'"):
        fp8_all_reduce(torch.zeros(8), state=AutoScaleState(scaling="delayed"), pipeline_chunks=3)


# ------------------------------------------------------------------------------------------------
# The worker: torchrun, 2 gloo processes
# ------------------------------------------------------------------------------------------------


def written_out(inputs: list[torch.Tensor], mu: float, fp8: torch.dtype, algorithm: str) -> torch.Tensor:
    """The algorithm in one process with the given float32 ``mu``: FP8(sat(x mu)) per rank, float32 rank-order sum,
    ``* f32(1/N)``, (scatter: rounded to FP8 once more), ``/ mu``."""
    m, mu32 = FP8_MAX[fp8], torch.tensor(mu, dtype=torch.float32)
    total = None
    for x in inputs:
        q = (x.float() * mu32).clamp(-m, m).to(fp8).float()
        total = q if total is None else total + q
    mean = total * torch.tensor(1 / len(inputs), dtype=torch.float32)
    if algorithm == "scatter":
        mean = mean.clamp(-m, m).to(fp8).float()
    return (mean / mu32).to(inputs[0].dtype)


def _check_steps(rank: int, world: int) -> dict:
    """Five steps per format / algorithm / dtype: init, quiet, rank N-1 jumps 100x, quiet, quiet."""
    res = {}
    for fmt, fp8 in FMTS.items():
        for alg in ("gather", "scatter"):
            for dtype in (torch.float32, torch.bfloat16):
                for n in (5, 40_001):
                    cur, dly, dref = (AutoScaleState(fp8_dtype=fmt, scaling="current"), AutoScaleState(fp8_dtype=fmt, scaling="delayed"),
                                      AutoScaleState(fp8_dtype=fmt, scaling="delayed"))  # fmt: skip
                    case = {"steps": []}
                    for step in range(5):
                        g = _grad(100 * step + rank, n, dtype) * (100.0 if step == 2 and rank == world - 1 else 1.0)
                        mu_before = dly.mu() if step else math.nan
                        o_cur = fp8_all_reduce(g.clone(), state=cur, algorithm=alg)
                        o_dly = fp8_all_reduce(g.clone(), state=dly, algorithm=alg)
                        o_ref = fp8_all_reduce(g.clone(), state=dref, algorithm=alg, reference=True)
                        inputs = _all_ranks(g)
                        s = {"same_state": cur.stats() == dly.stats() == dref.stats(),
                             "reference_equal": torch.equal(o_dly, o_ref),
                             "ranks_agree": all(torch.equal(o, o_dly) for o in _all_ranks(o_dly))}  # fmt: skip
                        if step == 0:
                            s["first_is_current"] = torch.equal(o_dly, o_cur)
                        else:
                            want = written_out(inputs, mu_before, fp8, alg)
                            s["written_out"] = torch.equal(o_dly, want)
                            s["equals_current"] = torch.equal(o_dly, o_cur)
                            sat = max(float((x.float() * mu_before).abs().gt(FP8_MAX[fp8]).float().mean())
                                      for x in inputs)
                            s["saturated_frac"] = sat
                        s["mu_after"] = dly.mu()
                        case["steps"].append(s)
                    case["halvings"] = dly.stats()["halvings"]
                    case["bytes"] = (dly.last_bytes_sent, fp8_allreduce_bytes(n, world, alg, "delayed"))
                    res[f"{fmt}/{alg}/{str(dtype).removeprefix('torch.')}/{n}"] = case
    return res


def _check_lazy_and_nonfinite(rank: int, world: int) -> dict:
    res = {}
    cur, dly = AutoScaleState(scaling="current"), AutoScaleState(scaling="delayed")
    outs, mus = [], []
    for g in (torch.zeros(3000), _grad(7 + rank, 3000), _grad(8 + rank, 3000)):  # zeros leave the key uninitialised
        mus.append(dly.stats()["mu"] if dly.keys() else math.nan)
        outs.append((fp8_all_reduce(g.clone(), state=cur), fp8_all_reduce(g.clone(), state=dly)))
    res["zeros_then_init_like_current"] = [torch.equal(a, b) for a, b in outs[:2]]
    res["third_uses_old_mu"] = torch.equal(outs[2][1], written_out(_all_ranks(_grad(8 + rank, 3000)), mus[2], E5M2,
                                                                   "gather"))
    for bad in (math.inf, math.nan):
        for alg in ("gather", "scatter"):
            st = AutoScaleState(scaling="delayed")
            fp8_all_reduce(_grad(40 + rank, 2000), state=st, algorithm=alg)
            fp8_all_reduce(_grad(41 + rank, 2000), state=st, algorithm=alg)
            before = st.stats()
            g = _grad(50 + rank, 2000)
            if rank == world - 1:
                g[7] = bad
            out = fp8_all_reduce(g, state=st, algorithm=alg)
            res[f"{bad}/{alg}"] = {"all_nan": bool(out.isnan().all()),
                                   "state_unchanged": st.stats() == {**before, "calls": before["calls"] + 1}}
    return res


def _check_traffic(rank: int, world: int) -> dict:
    import fp8kit.comm.fp8_allreduce as mod

    res = {}
    for alg in ("gather", "scatter"):
        calls: list[tuple[str, int]] = []
        real = (dist.all_to_all_single, dist.all_reduce, mod._all_gather_single)

        def spy(name, fn, i, calls=calls):
            def wrapped(*args, **kw):
                calls.append((name, args[i].numel() * args[i].element_size()))
                return fn(*args, **kw)

            return wrapped

        st = AutoScaleState(scaling="delayed")
        fp8_all_reduce(_grad(5 + rank, 1001), state=st, algorithm=alg)  # the first call: current
        dist.all_to_all_single = spy("all_to_all", real[0], 1)
        dist.all_reduce = spy("all_reduce", real[1], 0)
        mod._all_gather_single = spy("all_gather", real[2], 1)
        try:
            fp8_all_reduce(_grad(6 + rank, 1001), state=st, algorithm=alg)
        finally:
            dist.all_to_all_single, dist.all_reduce, mod._all_gather_single = real
        res[alg] = {"calls": calls, "last_bytes_sent": st.last_bytes_sent}
    return res


def _check_reduce_scatter(rank: int, world: int) -> dict:
    ok, why = fsdp_custom_reduce_scatter_support()
    if not ok:
        return {"skipped": why}
    res = {}
    group = dist.group.WORLD
    cur, dly = AutoScaleState(scaling="current"), AutoScaleState(scaling="delayed")
    rs_cur, rs_dly = Fp8ReduceScatter(cur, "k"), Fp8ReduceScatter(dly, "k")
    for step in range(3):
        x = _grad(70 * step + rank, world * 4000) * (100.0 if step == 1 and rank == 0 else 1.0)
        mu_before = dly.mu("k") if step else math.nan
        o_cur, o_dly = torch.empty(4000), torch.empty(4000)
        rs_cur(o_cur, x.clone(), group, dist.ReduceOp.AVG)
        rs_dly(o_dly, x.clone(), group, dist.ReduceOp.AVG)
        case = {"same_state": cur.stats("k") == dly.stats("k")}
        if step == 0:
            case["first_is_current"] = torch.equal(o_cur, o_dly)
        else:
            full = written_out(_all_ranks(x), mu_before, E5M2, "gather")  # one rounding, the mean
            case["written_out"] = torch.equal(o_dly, full[rank * 4000 : (rank + 1) * 4000])
        res[f"step{step}"] = case
    return res


def _worker(out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"world_size": world}
    for name, fn in (("steps", _check_steps), ("lazy", _check_lazy_and_nonfinite), ("traffic", _check_traffic),
                     ("reduce_scatter", _check_reduce_scatter)):
        res[name] = fn(rank, world)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fp8_allreduce_delayed")
    return torchrun_rank_results(__file__, 2, out, timeout=600)


def test_delayed_steps_follow_the_written_out_algorithm(runs):
    for rank, r in enumerate(runs):
        for case, c in r["steps"].items():
            where = f"rank {rank} {case}"
            for step, s in enumerate(c["steps"]):
                assert s["same_state"], f"{where} step {step}: the state differs from the current-scaling run"
                assert s["reference_equal"] and s["ranks_agree"], f"{where} step {step}: {s}"
                if step == 0:
                    assert s["first_is_current"], f"{where}: the key's first call must run current scaling"
                    continue
                assert s["written_out"], f"{where} step {step}: not the written-out algorithm with the old mu {s}"
                if step == 2:  # rank N-1 jumped 100x: delayed clips this step, current halved first
                    assert s["saturated_frac"] > 1e-3 and not s["equals_current"], f"{where}: {s}"
                    assert c["steps"][2]["mu_after"] == c["steps"][1]["mu_after"] / 2, f"{where}: mu did not halve"
                elif step in (1, 4):
                    assert s["equals_current"], f"{where} step {step}: a quiet step differs from current scaling"
            assert c["halvings"] >= 1, f"{where}: halvings {c['halvings']}"
            assert c["bytes"][0] == c["bytes"][1], f"{where}: bytes {c['bytes']}"


def test_delayed_lazy_init_and_nonfinite(runs):
    for rank, r in enumerate(runs):
        lz = r["lazy"]
        assert all(lz["zeros_then_init_like_current"]), f"rank {rank}: {lz['zeros_then_init_like_current']}"
        assert lz["third_uses_old_mu"], f"rank {rank}: the first delayed call after init did not use the old mu"
        for k in ("inf/gather", "inf/scatter", "nan/gather", "nan/scatter"):
            assert lz[k]["all_nan"] and lz[k]["state_unchanged"], f"rank {rank} {k}: {lz[k]}"


def test_delayed_collectives(runs):
    row = gather_row_bytes(1001)
    for rank, r in enumerate(runs):
        t = r["traffic"]
        assert t["gather"]["calls"] == [["all_gather", row + VEC_BYTES]], f"rank {rank} gather: {t['gather']}"
        assert t["gather"]["last_bytes_sent"] == row + VEC_BYTES
        assert t["scatter"]["calls"] == [["all_to_all", 1002], ["all_reduce", 32], ["all_gather", 501]], (
            f"rank {rank} scatter: {t['scatter']}")


def test_delayed_reduce_scatter(runs):
    for rank, r in enumerate(runs):
        rs = r["reduce_scatter"]
        if "skipped" in rs:
            pytest.skip(rs["skipped"])
        for step in range(3):
            s = rs[f"step{step}"]
            assert s["same_state"], f"rank {rank} step {step}: {s}"
            assert s.get("first_is_current", s.get("written_out")), f"rank {rank} step {step}: {s}"


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
