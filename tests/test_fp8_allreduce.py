"""FP8 gradient all-reduce with auto-scaling (fp8kit.comm): real 2-rank gloo runs and unit tests.

One ``torchrun --nproc_per_node 2`` launch of this file (``_worker``) runs every distributed check and
writes its numbers to JSON per rank; the tests below read them. Thresholds:

- accuracy of the "scatter" algorithm (pinned: "auto" is "gather" at 2 ranks, tested in
  test_fp8_allreduce_gather.py) vs the float64 mean over ranks of realistic gradients (randn * 1e-3 with 0.1 %
  outliers of 0.05): SQNR >= 22 dB for E5M2 (2 mantissa bits, two roundings) and >= 28 dB
  for E4M3 (3 bits) (measured 27.1 and 31.9 dB); and bitwise equal to a single-process reference;
- every element within the error bound that the formats' precision gives (:func:`error_bound`: two
  roundings to FP8 with unit roundoff ``u = 2^-(mantissa bits + 1)``, the subnormal floor, the final
  cast to the tensor's dtype), checked against the float64 mean of the ranks' tensors;
- bytes on the wire (scatter): the bytes of the buffers ``fp8_all_reduce`` hands to the collectives (counted by
  wrapping the real gloo collectives) equal the count computed from the shapes,
  ``2 (N-1) ceil(n/N) + 2 (N-1)/N * 32``, and ``AutoScaleState.bytes_sent``;
- shapes (tiny, odd, zeros, non-contiguous, empty) with both algorithms; auto-scaling and DDP with the
  default ("auto": gather at 2 ranks);
- DDP (tiny MLP, 3 buckets, SGD): after 5 steps the parameters' L2 distance to plain DDP's is below
  12 % (E5M2) / 7 % (E4M3) of the L2 distance travelled from the initial parameters (measured with the
  hook's default, gather at 2 ranks: 5.8 % and 3.6 %; with scatter 7.9 % and 4.7 %; a BF16 all-reduce hook
  gives 0.24 %).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp8kit.comm import (
    AutoScaleState,
    fp8_all_reduce,
    fp8_allreduce_bytes,
    fp8_allreduce_hook,
    ring_allreduce_bytes,
)
from tests.test_distributed import torchrun_rank_results

WORLD = 2
GROWTH_INTERVAL = 5
FP8 = {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}
FP8_MAX = {"e5m2": 57344.0, "e4m3": 448.0}
SQNR_FLOOR_DB = {"e5m2": 22.0, "e4m3": 28.0}
DDP_REL_TOL = {"e5m2": 0.12, "e4m3": 0.07}


def _grad(seed: int, n: int) -> torch.Tensor:
    """Realistic gradient: N(0, 1e-3) with 0.1 % outliers of +-0.05 (50x), float32."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * 1e-3
    idx = torch.randperm(n, generator=gen)[: max(1, n // 1000)]
    g[idx] = 0.05 * torch.sign(torch.randn(len(idx), generator=gen))
    return g


def _sqnr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    noise = (ref - x).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)


def _reference(inputs: list[torch.Tensor], fp8: torch.dtype) -> torch.Tensor:
    """The algorithm in one process, written from the issue: mu0 = max / amax, FP8, f32 sum / N, FP8."""
    m = FP8_MAX["e5m2" if fp8 == torch.float8_e5m2 else "e4m3"]
    amax = max(x.float().abs().max() for x in inputs)
    mu = torch.tensor(m, dtype=torch.float32) / amax
    if mu * amax > m:
        mu = torch.nextafter(mu, torch.tensor(0.0))
    qs = [(x.float() * mu).clamp(-m, m).to(fp8) for x in inputs]
    total = sum(q.float() for q in qs)
    return ((total * (1.0 / len(inputs))).clamp(-m, m).to(fp8).float() / mu).to(inputs[0].dtype)


#: Unit roundoff (half an ulp at 1) and smallest subnormal of each FP8 format, and of the output dtypes.
UNIT_ROUNDOFF = {"e5m2": 2.0**-3, "e4m3": 2.0**-4}
MIN_SUBNORMAL = {"e5m2": 2.0**-16, "e4m3": 2.0**-9}
OUT_ROUNDOFF = {torch.float32: (2.0**-24, 0.0), torch.bfloat16: (2.0**-9, 0.0), torch.float16: (2.0**-11, 2.0**-25)}


def error_bound(inputs: list[torch.Tensor], mu: float, fmt: str, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on ``|fp8_all_reduce result - float64 mean of inputs|`` (float64), no saturation.

    With ``u`` the FP8 unit roundoff, ``h = min_subnormal / 2 / mu`` (half the smallest FP8 step, in
    gradient units), ``a = mean_i |g_i|`` and ``r = |mean_i g_i|``: the first rounding ``q_i = FP8(mu g_i)``
    errs by at most ``u |g_i| + h`` per rank, so the mean of the ``q_i / mu`` by ``u a + h``; the second
    rounding of that mean adds ``u (r + u a + h) + h``; the cast to ``out_dtype`` (unit roundoff ``u_o``,
    absolute floor ``h_o`` for float16 subnormals) adds ``u_o (r + E1) + h_o``; float32 arithmetic adds
    ``2^-22 (r + a)``.
    """
    g = torch.stack([x.double() for x in inputs])
    a, r = g.abs().mean(0), g.mean(0).abs()
    u, h = UNIT_ROUNDOFF[fmt], MIN_SUBNORMAL[fmt] / 2 / mu
    e1 = u * a + u * (r + u * a + h) + 2 * h
    u_o, h_o = OUT_ROUNDOFF[out_dtype]
    return e1 + u_o * (r + e1) + h_o + 2.0**-22 * (r + a)


def worst_bound_ratio(out: torch.Tensor, inputs: list[torch.Tensor], mu: float, fmt: str) -> float:
    """``max |out - mean(inputs)| / error_bound``: at most 1 for a correct result."""
    ref = torch.stack([x.double() for x in inputs]).mean(0)
    return ((out.double() - ref).abs() / error_bound(inputs, mu, fmt, out.dtype)).max().item()


# ------------------------------------------------------------------------------------------------
# The worker: run under torchrun (2 processes, gloo); every check returns numbers to the parent.
# ------------------------------------------------------------------------------------------------


def _all_ranks(x: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x.contiguous())
    return out


def _mean_f64(x: torch.Tensor) -> torch.Tensor:
    y = x.double().clone()
    dist.all_reduce(y)
    return y / dist.get_world_size()


def _check_accuracy(rank: int) -> dict:
    res = {}
    for name, fp8 in FP8.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = _grad(100 + rank, 50_000).to(dtype)
            st = AutoScaleState(scaling="current", fp8_dtype=name)
            out = fp8_all_reduce(g.clone(), state=st, key="w", algorithm="scatter")
            ref = _mean_f64(g)
            inputs = _all_ranks(g)
            exact = _reference(inputs, fp8)
            res[f"{name}/{str(dtype).removeprefix('torch.')}"] = {
                "worst_bound_ratio": worst_bound_ratio(out, inputs, st.mu("w"), name),
                "sqnr_db": _sqnr_db(ref, out),
                "max_abs_err_over_amax": ((out.double() - ref).abs().max() / ref.abs().max()).item(),
                "bitwise_reference": torch.equal(out, exact),
                "dtype_kept": out.dtype == dtype,
                "mu": st.mu("w"),
                "bytes_sent": st.bytes_sent,
                "bf16_ring_bytes": st.bf16_ring_bytes,
            }
    g = _grad(200 + rank, 50_000)
    return {"cases": res, "one_shot_sqnr_db": _sqnr_db(_mean_f64(g), fp8_all_reduce(g.clone()))}


def _check_shapes(rank: int, algorithm: str) -> dict:
    res = {}
    for n in (1, 1001):  # smaller than world size; not a multiple of it
        g = _grad(300 + rank, n)
        res[f"n{n}_sqnr_db"] = _sqnr_db(
            _mean_f64(g), fp8_all_reduce(g.clone(), state=AutoScaleState(scaling="current"), algorithm=algorithm)
        )
    z = fp8_all_reduce(torch.zeros(5000), state=AutoScaleState(scaling="current"), algorithm=algorithm)
    res["zeros_exact"] = bool((z == 0).all())
    g = _grad(400 + rank, 64 * 48).view(64, 48).t()  # [48, 64], non-contiguous
    x = g.clone()  # keeps the strides
    out_nc = fp8_all_reduce(x, state=AutoScaleState(scaling="current"), algorithm=algorithm)
    out_c = fp8_all_reduce(g.contiguous(), state=AutoScaleState(scaling="current"), algorithm=algorithm)
    res["noncontiguous_equal"] = (
        not x.is_contiguous() and out_nc is x and torch.equal(out_nc, out_c) and out_nc.shape == (48, 64)
    )
    # mu0 = FP8_MAX / amax saturates nothing: the same 3 values twice -> no halving, 0 saturated
    st, g = AutoScaleState(scaling="current"), _grad(500 + rank, 3)
    for _ in range(2):
        fp8_all_reduce(g.clone(), state=st, algorithm=algorithm)
    res["mu0_no_saturation"] = st.stats()["halvings"] == 0 and st.stats()["last_saturation"] == 0.0
    res["empty_ok"] = fp8_all_reduce(torch.empty(0), state=AutoScaleState(scaling="current"), algorithm=algorithm).numel() == 0
    return res


def _check_autoscale(rank: int, out_dir: Path) -> dict:
    st = AutoScaleState(scaling="current", growth_interval=GROWTH_INTERVAL)
    mus, fracs = [], []

    def call(i: int, factor: float = 1.0) -> torch.Tensor:
        g = _grad(1000 + 10 * i + rank, 20_000)
        if rank == 1:
            g = g * factor
        out = fp8_all_reduce(g, state=st)
        mus.append(st.mu())
        fracs.append(st.stats()["last_saturation"])
        return out

    call(0)  # lazy init: mu0 = FP8_MAX / global amax
    mu0 = mus[0]
    out = call(1, factor=1000.0)  # rank 1's gradient 1000x larger: most of it saturates -> halve
    after_overflow = st.stats()
    res = {"mu0": mu0, "after_overflow": after_overflow, "overflow_call_finite": bool(out.isfinite().all())}
    for i in range(2, 2 + GROWTH_INTERVAL + 3):  # 5 quiet steps, then 3 growths
        call(i)
    res["mus"], res["fracs"], res["final"] = mus, fracs, st.stats()
    res["mu_all_ranks"] = [float(v) for v in _all_ranks(torch.tensor([st.mu()], dtype=torch.float64))]

    # non-finite values on one rank: NaN everywhere, state unchanged
    before = st.stats()
    for bad in (math.inf, math.nan):
        g = _grad(2000 + rank, 20_000)
        if rank == 1:
            g[7] = bad
        out = fp8_all_reduce(g, state=st)
        res[f"nonfinite_{bad}_all_nan"] = bool(out.isnan().all())
    res["nonfinite_state_unchanged"] = st.stats() == {**before, "calls": before["calls"] + 2}

    # checkpoint round trip: torch.save / torch.load(weights_only=True), then the next call agrees bitwise
    path = out_dir / f"state{rank}.pt"
    torch.save(st.state_dict(), path)
    st2 = AutoScaleState(scaling="current", growth_interval=GROWTH_INTERVAL)
    st2.load_state_dict(torch.load(path, weights_only=True))
    g = _grad(3000 + rank, 20_000)
    a, b = fp8_all_reduce(g.clone(), state=st), fp8_all_reduce(g.clone(), state=st2)
    res["resume_bitwise"] = torch.equal(a, b) and st.stats() == st2.stats()
    res["bytes_sent"], res["calls"] = st.bytes_sent, st.calls
    return res


def _ddp_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 8),
    )


def _train(ddp: torch.nn.Module, rank: int, steps: range) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in steps:
        gen = torch.Generator().manual_seed(10 * step + rank)
        x, t = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), t).backward()
        opt.step()


def _bf16_hook(_, bucket):  # no annotations: this file's are strings, which DDP refuses
    """For scale: a BF16 all-reduce hook (torch's bf16_compress_hook refuses gloo)."""
    buf = bucket.buffer()
    b = buf.bfloat16()
    dist.all_reduce(b)
    buf.copy_(b / dist.get_world_size())
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _check_ddp(rank: int, out_dir: Path) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    init = [p.detach().clone() for p in _ddp_model().parameters()]
    cap = 0.01  # MB: several buckets, so several keys
    plain = DDP(_ddp_model(), bucket_cap_mb=cap)
    models = {"e5m2": DDP(_ddp_model(), bucket_cap_mb=cap), "e4m3": DDP(_ddp_model(), bucket_cap_mb=cap)}
    states = {k: AutoScaleState(scaling="current", fp8_dtype=k) for k in models}
    for k, m in models.items():
        m.register_comm_hook(states[k], fp8_allreduce_hook)
    bf16 = DDP(_ddp_model(), bucket_cap_mb=cap)
    bf16.register_comm_hook(None, _bf16_hook)
    for m in (plain, *models.values(), bf16):
        _train(m, rank, range(5))

    def flat(m: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).double()

    moved = flat(plain) - torch.cat([p.reshape(-1) for p in init]).double()

    def rel(m: torch.nn.Module) -> dict:
        d = flat(m) - flat(plain)
        return {"norm": (d.norm() / moved.norm()).item(), "max": (d.abs().max() / moved.abs().max()).item()}

    state = states["e5m2"]
    res = {f"{k}_rel": rel(m) for k, m in models.items()}
    res["bf16_hook_rel"] = rel(bf16)
    res["stats"] = {str(k): state.stats(k) for k in state.keys()}
    res["params_equal_across_ranks"] = all(
        torch.equal(*_all_ranks(p.detach())) for p in models["e5m2"].parameters()
    )

    # resume: a fresh DDP model + the saved hook state continues the saved mu and counters
    fp8 = models["e5m2"]
    path = out_dir / f"hook{rank}.pt"
    torch.save({"model": fp8.module.state_dict(), "hook": state.state_dict()}, path)
    ck = torch.load(path, weights_only=True)
    resumed = DDP(_ddp_model(), bucket_cap_mb=cap)
    st_resumed = AutoScaleState(scaling="current")
    st_resumed.load_state_dict(ck["hook"])
    resumed.register_comm_hook(st_resumed, fp8_allreduce_hook)
    resumed.module.load_state_dict(ck["model"])
    for m in (fp8, resumed):
        _train(m, rank, range(5, 8))
    res["saved"] = ck["hook"]["keys"]
    res["after_original"] = {str(k): state.stats(k) for k in state.keys()}
    res["after_resumed"] = {str(k): st_resumed.stats(k) for k in st_resumed.keys()}
    d = flat(resumed) - flat(fp8)
    res["resumed_vs_original_rel"] = (d.norm() / moved.norm()).item()
    return res


def _check_traffic(rank: int) -> dict:
    """Bytes of the buffers one ``fp8_all_reduce`` call hands to each collective on this rank.

    The real gloo collectives run; each is wrapped to record its input buffer. Bytes sent per rank
    (the conventions of ``ring_allreduce_bytes``): all-to-all ``(N-1)/N`` of its input (the own chunk
    stays), all-gather ``(N-1)`` times its input, ring all-reduce ``2 (N-1)/N`` of its buffer.
    """
    import fp8kit.comm.fp8_allreduce as mod

    def spy(calls: list, name: str, fn, buf_arg: int):
        def wrapped(*args, **kw):
            buf = args[buf_arg]
            calls.append((name, buf.numel() * buf.element_size()))
            return fn(*args, **kw)

        return wrapped

    world, res = dist.get_world_size(), {}
    for n in (1_000_000, 1001):
        calls: list[tuple[str, int]] = []
        real = {"all_to_all_single": dist.all_to_all_single, "all_reduce": dist.all_reduce,
                "all_gather": mod._all_gather_single}  # fmt: skip
        dist.all_to_all_single = spy(calls, "all_to_all", real["all_to_all_single"], 1)
        dist.all_reduce = spy(calls, "all_reduce", real["all_reduce"], 0)
        mod._all_gather_single = spy(calls, "all_gather", real["all_gather"], 1)
        try:
            st = AutoScaleState(scaling="current")
            fp8_all_reduce(_grad(5000 + rank, n).bfloat16(), state=st, algorithm="scatter")
        finally:
            dist.all_to_all_single, dist.all_reduce = real["all_to_all_single"], real["all_reduce"]
            mod._all_gather_single = real["all_gather"]
        factor = {"all_to_all": (world - 1) / world, "all_gather": world - 1, "all_reduce": 2 * (world - 1) / world}
        res[str(n)] = {
            "calls": calls,
            "sent": sum(int(b * factor[name]) for name, b in calls),
            "bytes_sent": st.bytes_sent,
            "bf16_ring_bytes": st.bf16_ring_bytes,
        }
    return res


def _worker(out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = {"world_size": dist.get_world_size()}
    for name, fn in (
        ("accuracy", lambda: _check_accuracy(rank)),
        ("shapes", lambda: _check_shapes(rank, "scatter")),
        ("shapes_gather", lambda: _check_shapes(rank, "gather")),
        ("autoscale", lambda: _check_autoscale(rank, out_dir)),
        ("ddp", lambda: _check_ddp(rank, out_dir)),
        ("traffic", lambda: _check_traffic(rank)),
    ):
        res[name] = fn()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


# ------------------------------------------------------------------------------------------------
# The tests (parent process)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    """The two ranks' results of one real 2-process gloo run of ``_worker``."""
    out = tmp_path_factory.mktemp("fp8_allreduce")
    return torchrun_rank_results(__file__, WORLD, out, timeout=300)


def test_accuracy_vs_full_precision_mean(runs):
    for r in runs:
        assert r["world_size"] == WORLD
        for case, m in r["accuracy"]["cases"].items():
            fmt = case.split("/")[0]
            assert m["sqnr_db"] >= SQNR_FLOOR_DB[fmt], (
                f"{case}: SQNR {m['sqnr_db']:.1f} dB < {SQNR_FLOOR_DB[fmt]}"
            )
            assert m["max_abs_err_over_amax"] < 0.07, (
                f"{case}: max |err| / amax = {m['max_abs_err_over_amax']:.3g}"
            )
            assert m["bitwise_reference"], f"{case}: differs from the single-process reference"
            assert m["dtype_kept"], case
        assert r["accuracy"]["one_shot_sqnr_db"] >= SQNR_FLOOR_DB["e5m2"], r["accuracy"]["one_shot_sqnr_db"]
    # both ranks hold the same mu; bytes: FP8 about half of a BF16 ring all-reduce
    for case, m in runs[0]["accuracy"]["cases"].items():
        assert m["mu"] == runs[1]["accuracy"]["cases"][case]["mu"], case
    m = runs[0]["accuracy"]["cases"]["e5m2/float32"]
    assert m["bytes_sent"] == fp8_allreduce_bytes(50_000, 2, "scatter") == 25_000 * 2 + 32
    assert m["bf16_ring_bytes"] == ring_allreduce_bytes(50_000, 2) == 100_000
    assert m["mu"] == pytest.approx(57344 / 0.05, rel=1e-6)  # mu0 = FP8_MAX / global amax (outliers 0.05)


def test_small_odd_zero_noncontiguous(runs):
    for r in runs:
        for key in ("shapes", "shapes_gather"):
            s = r[key]
            assert s["n1_sqnr_db"] >= 30 and s["n1001_sqnr_db"] >= SQNR_FLOOR_DB["e5m2"], (key, s)
            assert s["zeros_exact"] and s["noncontiguous_equal"] and s["empty_ok"] and s["mu0_no_saturation"], (key, s)


def test_mu_halves_on_overflow_then_grows(runs):
    a0, a1 = runs[0]["autoscale"], runs[1]["autoscale"]
    assert a0["mus"] == a1["mus"] and a0["final"] == a1["final"], "ranks disagree on mu"
    assert a0["mu_all_ranks"][0] == a0["mu_all_ranks"][1]
    mu0, gf = a0["mu0"], AutoScaleState(scaling="current").growth_factor
    assert mu0 == pytest.approx(57344 / 0.05, rel=1e-6)
    ov = a0["after_overflow"]
    assert ov["mu"] == mu0 / 2 and ov["halvings"] == 1 and ov["steps_below"] == 0, ov
    assert ov["last_saturation"] > 0.5, f"injected overflow saturates {ov['last_saturation']:.3f}"
    assert a0["overflow_call_finite"]
    # 5 quiet steps: no growth; then one growth per further quiet step, mu = mu0/2 * gf^k (same float64 ops)
    quiet = a0["mus"][2 : 2 + GROWTH_INTERVAL]
    assert quiet == [mu0 / 2] * GROWTH_INTERVAL, quiet
    expected = mu0 / 2
    for k, mu in enumerate(a0["mus"][2 + GROWTH_INTERVAL :], start=1):
        expected *= gf
        assert mu == expected and mu == pytest.approx(mu0 / 2 * gf**k, rel=1e-12), (k, mu, expected)
    fin = a0["final"]
    assert fin["growths"] == 3 and fin["halvings"] == 1 and fin["steps_below"] == GROWTH_INTERVAL + 3, fin
    assert max(a0["fracs"][2:]) <= 1e-3, a0["fracs"]
    assert a0["nonfinite_inf_all_nan"] and a0["nonfinite_nan_all_nan"] and a0["nonfinite_state_unchanged"]
    assert a0["resume_bitwise"] and a1["resume_bitwise"]
    assert a0["bytes_sent"] == a0["calls"] * fp8_allreduce_bytes(20_000, 2)


def test_ddp_hook_matches_plain_ddp(runs):
    for r in runs:
        d = r["ddp"]
        for fmt in ("e5m2", "e4m3"):
            e = d[f"{fmt}_rel"]
            assert e["norm"] < DDP_REL_TOL[fmt], (
                f"{fmt} hook vs plain DDP after 5 steps: |dp| / |p - p0| = {e['norm']:.4f} (max-norm {e['max']:.4f}); "
                f"bf16 hook: {d['bf16_hook_rel']['norm']:.4f}"
            )
        assert d["params_equal_across_ranks"]
        # keys "index:numel"; torch 2.13: "0:6792" (the whole model, first iteration), then the rebuilt buckets
        assert len(d["stats"]) >= 2 and all(k.endswith(f":{s['numel']}") for k, s in d["stats"].items()), d[
            "stats"
        ]
        assert all(s["initialized"] and s["mu"] > 0 and s["reinits"] == 0 for s in d["stats"].values()), d[
            "stats"
        ]
    assert runs[0]["ddp"]["stats"] == runs[1]["ddp"]["stats"]


def test_ddp_hook_state_resumes(runs):
    """Saved after 5 steps; 3 more steps in the original and in a fresh DDP model with the loaded state."""
    d = runs[0]["ddp"]
    assert set(d["after_resumed"]) == set(d["saved"]) == set(d["after_original"])  # no new keys
    continued = 0
    for k, saved in d["saved"].items():
        for after in (d["after_original"][k], d["after_resumed"][k]):
            used = after["calls"] - saved["calls"]
            assert after["halvings"] == saved["halvings"] and after["growths"] == saved["growths"], (k, after)
            assert after["steps_below"] == saved["steps_below"] + used and after["mu"] == saved["mu"], (
                k,
                after,
            )
        continued += d["after_resumed"][k]["calls"] - saved["calls"] >= 2  # a rebuilt bucket, mu and counters
    assert continued >= 1, d["after_resumed"]
    assert d["resumed_vs_original_rel"] < DDP_REL_TOL["e5m2"], d["resumed_vs_original_rel"]


def test_bytes_on_the_wire_match_the_shapes(runs):
    """FP8 traffic per rank and call (scatter), counted from the buffers handed to gloo, vs the count from the shapes."""
    world = WORLD
    for r in runs:
        for n_text, t in r["traffic"].items():
            n = int(n_text)
            chunk = -(-n // world)  # the tensor is zero-padded to world * chunk FP8 bytes
            want_calls = [("all_reduce", 4 * 8), ("all_to_all", world * chunk), ("all_gather", chunk)]
            assert sorted(map(tuple, t["calls"])) == sorted(want_calls), (n, t["calls"])
            exact = 2 * (world - 1) * chunk + 2 * (world - 1) * 32 // world
            assert t["sent"] == exact == t["bytes_sent"] == fp8_allreduce_bytes(n, world, "scatter"), (n, t, exact)
            assert t["bf16_ring_bytes"] == 2 * (world - 1) * n * 2 // world, (n, t)
    assert runs[0]["traffic"]["1000000"]["sent"] == 1_000_032  # half of BF16's 2_000_000


def test_every_element_within_the_precision_bound(runs):
    for r in runs:
        for case, m in r["accuracy"]["cases"].items():
            assert m["worst_bound_ratio"] <= 1.0, (
                f"{case}: an element is {m['worst_bound_ratio']:.3f} x the error bound from the format's precision"
            )


def test_error_bound_rejects_wrong_results():
    """The bound is tight enough to fail: the single-process reference algorithm passes it, while the
    sum over ranks instead of the mean, the mean with one element off by 10 % of the amax, and (for
    E4M3) the same algorithm rounding to E5M2, one mantissa bit less, are rejected."""
    inputs = [_grad(100 + r, 50_000) for r in range(WORLD)]
    amax = max(x.abs().max().item() for x in inputs)
    for name, fp8 in FP8.items():
        mu = torch.tensor(FP8_MAX[name] / amax, dtype=torch.float32)
        mu = torch.nextafter(mu, torch.tensor(0.0)) if mu * amax > FP8_MAX[name] else mu
        good = _reference(inputs, fp8)
        assert worst_bound_ratio(good, inputs, mu.item(), name) <= 1.0, name
        off = good.clone()
        off[123] += 0.1 * amax
        wrong = {"sum instead of mean": good * WORLD, "one element off": off}
        if name == "e4m3":  # one mantissa bit less than asked for
            wrong["E5M2 roundings"] = _reference(inputs, torch.float8_e5m2)
        for what, x in wrong.items():
            ratio = worst_bound_ratio(x, inputs, mu.item(), name)
            assert ratio > 1.0, f"{name}, {what}: accepted (worst ratio {ratio:.3f})"


# ------------------------------------------------------------------------------------------------
# Single-process tests
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fp8_dtype": "e3m4"}, "fp8_dtype: unknown FP8 format 'e3m4'"),
        ({"fp8_dtype": "bf16"}, "fp8_dtype"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"delta": math.nan}, "delta"),
        ({"delta": "0.1"}, "delta"),
        ({"growth_interval": -1}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"growth_interval": True}, "growth_interval"),
        ({"growth_factor": 0.5}, "growth_factor"),
        ({"growth_factor": math.inf}, "growth_factor"),
        ({"backoff": 1.0}, "backoff"),
        ({"backoff": 0}, "backoff"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoScaleState(**kwargs)


def test_bad_call_arguments():
    with pytest.raises(ValueError, match="tensor must be float32.*got torch.int64"):
        fp8_all_reduce(torch.arange(4))
    with pytest.raises(ValueError, match="tensor must be"):
        fp8_all_reduce(torch.zeros(4, dtype=torch.float8_e5m2))
    with pytest.raises(ValueError, match="tensor must be.*got list"):
        fp8_all_reduce([1.0])
    with pytest.raises(ValueError, match="state must be an AutoScaleState"):
        fp8_all_reduce(torch.zeros(4), state={"mu": 1.0})
    with pytest.raises(ValueError, match="key must be a str or int"):
        fp8_all_reduce(torch.zeros(4), state=AutoScaleState(scaling="current"), key=1.5)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
            fp8_all_reduce(torch.zeros(4))


def _sd(**over) -> dict:
    st = AutoScaleState(scaling="current", fp8_dtype="e4m3")
    sd = st.state_dict()
    sd["keys"] = {
        0: {"mu": 1234.5, "steps_below": 7, "halvings": 2, "growths": 1, "initialized": True,
            "last_saturation": 0.0, "numel": 100, "reinits": 0, "calls": 12},
        "w": {"mu": 3.0, "steps_below": 0, "halvings": 0, "growths": 0, "initialized": True,
              "last_saturation": 2e-3, "numel": 5, "reinits": 1, "calls": 3},
    }  # fmt: skip
    sd.update(calls=9, bytes_sent=1000, bf16_ring_bytes=2000, **over)
    return sd


def test_state_dict_round_trip(tmp_path):
    sd = _sd()
    st = AutoScaleState(scaling="current", fp8_dtype="e4m3", delta=0.01)
    st.load_state_dict(sd)
    assert st.keys() == [0, "w"] and st.mu(0) == 1234.5 and st.stats("w")["reinits"] == 1
    assert st.bytes_sent == 1000 and st.calls == 9 and st.delta == 0.01  # options stay the object's own
    torch.save(st.state_dict(), tmp_path / "s.pt")
    back = torch.load(tmp_path / "s.pt", weights_only=True)
    assert back["keys"] == sd["keys"] and back["bf16_ring_bytes"] == 2000 and back["delta"] == 0.01
    st2 = AutoScaleState(scaling="current", fp8_dtype="e4m3")
    st2.load_state_dict(back)
    assert st2.state_dict()["keys"] == sd["keys"]
    # values on a device (as after a call) read back the same
    st2._values("w", 5, torch.device("cpu"))
    assert st2.stats("w") == back["keys"]["w"]


def test_state_dict_errors():
    with pytest.raises(ValueError, match="fp8_dtype 'e4m3' in the state dict, 'e5m2' here"):
        AutoScaleState(scaling="current").load_state_dict(_sd())
    with pytest.raises(ValueError, match="not an AutoScaleState state dict"):
        AutoScaleState(scaling="current").load_state_dict({"mu": 1.0})
    sd = _sd()
    del sd["keys"]["w"]["halvings"]
    with pytest.raises(ValueError, match=r"keys\['w'\] lacks halvings"):
        AutoScaleState(scaling="current", fp8_dtype="e4m3").load_state_dict(sd)
    sd = _sd()
    sd["keys"][0]["mu"] = 0.0
    with pytest.raises(ValueError, match=r"keys\[0\].mu must be finite and > 0"):
        AutoScaleState(scaling="current", fp8_dtype="e4m3").load_state_dict(sd)
    with pytest.raises(KeyError):
        AutoScaleState(scaling="current").mu("never-used")


def test_numel_change_reinitialises():
    st = AutoScaleState(scaling="current")
    st.load_state_dict(_sd(fp8_dtype="e5m2"))
    v = st._values(0, 100, torch.device("cpu"))
    assert v[0].item() == 1234.5
    st._values(0, 101, torch.device("cpu"))  # a rebuilt DDP bucket of another size
    s = st.stats(0)
    assert not s["initialized"] and s["reinits"] == 1 and s["numel"] == 101 and math.isnan(st.mu(0))


def test_initial_mu_never_saturates():
    """mu0 = FP8_MAX / amax, one float32 ulp lower where ``mu0 * amax`` would round above FP8_MAX."""
    from fp8kit.comm.fp8_allreduce import _initial_mu

    # amax from 2e-12 (above AMAX_EPS) to 5e8; ~18 % of them need the one-ulp step down
    amax = torch.exp(torch.empty(100_000).uniform_(-27, 20, generator=torch.Generator().manual_seed(0)))
    for name, fp8 in FP8.items():
        mu0 = _initial_mu(amax.double(), fp8)
        assert mu0.dtype == torch.float64 and torch.equal(mu0.float().double(), mu0)  # float32 values
        assert bool((mu0.float() * amax <= FP8_MAX[name]).all()), name
        torch.testing.assert_close(mu0, FP8_MAX[name] / amax.double(), rtol=2**-22, atol=0)
    assert _initial_mu(torch.tensor(0.0, dtype=torch.float64), torch.float8_e5m2).item() == pytest.approx(
        57344e12
    )


def test_byte_helpers():
    assert ring_allreduce_bytes(1000, 1) == 0 and fp8_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 4) == 2 * 3 * 1000 * 2 // 4 == 3000
    assert ring_allreduce_bytes(1000, 4, element_size=4) == 6000
    assert fp8_allreduce_bytes(1001, 4) == 2 * 3 * 251 + 2 * 3 * 32 // 4
    assert fp8_allreduce_bytes(0, 4) == 0


def test_world_size_one_is_exact_passthrough():
    """A 1-rank group: no quantization, no collective, the state untouched (documented choice)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = _grad(7, 1000).bfloat16()
        st = AutoScaleState(scaling="current")
        out = fp8_all_reduce(g.clone(), state=st)
        assert torch.equal(out, g) and st.keys() == [] and st.bytes_sent == 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # run by the `runs` fixture under torchrun
    _worker(Path(sys.argv[1]))
