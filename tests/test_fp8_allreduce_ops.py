"""The passes of the FP8 all-reduce as torch.library ops (fp8kit.comm.allreduce_ops) and the pipelined exchange, on CPU.

- each op on CPU runs its reference (same bits), passes ``torch.library.opcheck`` (schema, fake tensor,
  functionalization of the ``out`` mutation) and traces with ``torch.compile(fullgraph=True)`` into a graph
  whose result equals eager bit for bit;
- the references compute the documented math on hand-made values (saturation / inf / NaN counts and the
  all-reduce vector, the auto-scaling rule's initialise / halve / grow / non-finite cases, zero padding, the
  rank-order float32 sum, the float32 ``1/N``);
- on 3 gloo ranks (torchrun): ``fp8_all_reduce`` with ``pipeline_chunks`` 2, 3 and 7 and with ``reference=True``
  equals the one-piece call bit for bit (results and state), and equals the algorithm written out in one
  process (mu0 = FP8_MAX / amax, FP8 cast, float32 rank-order sum, ``* f32(1/3)``, FP8, ``/ mu``);
  a NaN on one rank gives NaN everywhere with pieces too.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp8kit.comm import AutoScaleState, fp8_all_reduce
from fp8kit.comm import allreduce_ops as ops
from fp8kit.comm.fp8_allreduce import AUTO_MAX_PIECES, _pieces
from fp8kit.comm.unify import params_tensor
from tests.test_distributed import torchrun_rank_results

E5M2, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn
FP8_MAX = {E5M2: 57344.0, E4M3: 448.0}
WORLD = 3


def _grad(seed: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, generator=gen) * 1e-3
    idx = torch.randperm(n, generator=gen)[: max(1, n // 1000)]
    g[idx] = 0.05 * torch.sign(torch.randn(len(idx), generator=gen))
    return g.to(dtype)


# ------------------------------------------------------------------------------------------------
# The references do the documented math
# ------------------------------------------------------------------------------------------------


def _values(mu: float, init: bool = True, steps: float = 0.0) -> torch.Tensor:
    return torch.tensor([mu, steps, 0.0, 0.0, float(init), 0.0], dtype=torch.float64)


def _params(st: AutoScaleState) -> torch.Tensor:
    return params_tensor(st, torch.device("cpu"))


@pytest.mark.parametrize("fp8", [E5M2, E4M3])
def test_scale_vec_counts_saturation_and_nonfinite(fp8):
    m = FP8_MAX[fp8]
    g = torch.tensor([1.0, -2.0, 3.0, 0.5, -4.0, 0.25, 0.0, 1.5])
    st = AutoScaleState(delta=0.3)
    mu = torch.tensor(m / 2.5, dtype=torch.float32).item()  # |mu g| > m for |g| > 2.5: 3 and -4
    vec = ops.scale_vec(g, _values(mu), _params(st), fp8)
    assert vec.dtype == torch.float64 and vec.shape == (4,)
    # 2 of 8 saturate (0.25 <= delta): cand = mu; amax = f32(4 * f32(mu)); no inf / NaN
    assert vec.tolist() == [mu, -0.25, -(torch.tensor(4.0) * torch.tensor(mu)).item(), 0.0]
    vec = ops.scale_vec(g, _values(mu), _params(AutoScaleState(delta=0.2)), fp8)
    assert vec[0].item() == mu * 0.5  # 0.25 > delta: backoff
    assert ops.scale_vec(g, _values(1.0, init=False), _params(st), fp8)[0].item() == math.inf  # uninitialised
    g[1], g[5], g[6] = math.inf, -math.inf, math.nan
    vec = ops.scale_vec(g, _values(mu), _params(st), fp8)
    # inf counts as saturated (4 of 8), NaN not; amax is replaced by 0 and the bad flag set
    assert vec.tolist() == [mu * 0.5, -0.5, -0.0, -1.0], vec
    amax, counts = ops.stats_ref(g, torch.tensor([mu], dtype=torch.float32), fp8)
    assert counts.tolist() == [4, 3] and amax.item() == pytest.approx(4.0 * mu)  # the largest finite |mu g|


def test_scale_update_follows_the_autoscale_rule():
    """Initialise from the global amax, halve on saturation, count quiet steps, grow after the interval."""
    st = AutoScaleState(growth_interval=2)
    p = _params(st)
    # uninitialised key, global amax 0.05: mu0 = 57344 / f32(0.05), one ulp down if mu0 * amax > 57344
    scale, out_scale, new = ops.scale_update(torch.tensor([math.inf, -0.0, -0.05, -0.0], dtype=torch.float64),
                                             _values(1.0, init=False), p, E5M2)
    mu0 = ops.initial_mu(torch.tensor(0.05, dtype=torch.float64), E5M2).item()
    assert scale.item() == out_scale.item() == mu0 and new.tolist() == [mu0, 1.0, 0.0, 0.0, 1.0, 0.0]
    # halving: cand_g = mu / 2 on some rank; steps reset; last saturation = the max fraction
    scale, _, new = ops.scale_update(torch.tensor([500.0, -0.01, -50.0, -0.0], dtype=torch.float64),
                                     _values(1000.0, steps=5.0), p, E5M2)
    assert scale.item() == 500.0 and new.tolist() == [500.0, 0.0, 1.0, 0.0, 1.0, 0.01]
    # quiet step 3 > growth_interval 2: grow by the growth factor (float64)
    _, _, new = ops.scale_update(torch.tensor([1000.0, -0.0, -50.0, -0.0], dtype=torch.float64),
                                 _values(1000.0, steps=2.0), p, E5M2)
    assert new.tolist() == [1000.0 * st.growth_factor, 3.0, 0.0, 1.0, 1.0, 0.0]
    # any rank non-finite: NaN out_scale, state unchanged
    v = _values(1000.0, steps=2.0)
    scale, out_scale, new = ops.scale_update(torch.tensor([500.0, -0.5, -0.0, -1.0], dtype=torch.float64), v, p, E5M2)
    assert scale.item() == 500.0 and math.isnan(out_scale.item()) and torch.equal(new, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_quantize_saturates_and_zero_pads(dtype):
    g = _grad(1, 1001, dtype)
    g[0], g[1] = 1e3, -1e3  # saturate
    scale = torch.tensor([40000.0])
    out = torch.full((1024,), 0x55, dtype=torch.uint8)
    ops.quantize_into(g, scale, out, E5M2)
    q = out.view(E5M2)
    assert q[0].float().item() == 57344.0 and q[1].float().item() == -57344.0
    assert torch.equal(q[:1001], (g.float() * 40000.0).clamp(-57344, 57344).to(E5M2).view(E5M2))
    assert (out[1001:] == 0).all()


def test_rank_sum_in_order_and_float32_inverse():
    """N = 3: the rank-order float32 sum, then ``* f32(1/3)`` (not ``/ 3``), then the FP8 cast."""
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randn(4000, generator=gen) * 1e4).clamp(-57344, 57344).to(E5M2) for _ in range(3)]
    rows[0][0], rows[1][0], rows[2][0] = torch.tensor([57344.0, 57344.0, 2.0**-16]).to(E5M2)
    recv = torch.cat([r.view(torch.uint8) for r in rows])
    out = torch.empty(4000, dtype=torch.uint8)
    ops.sum_requant_into(recv, out, 3, E5M2)
    total = (rows[0].float() + rows[1].float()) + rows[2].float()
    want = (total * torch.tensor(1 / 3, dtype=torch.float32)).clamp(-57344, 57344).to(E5M2)
    assert torch.equal(out, want.view(torch.uint8))
    assert ops.inverse_world(3) == torch.tensor(1 / 3, dtype=torch.float32).item() != 1 / 3
    scale = torch.tensor([3.0])
    res = torch.empty(4000, dtype=torch.bfloat16)
    ops.sum_dequant_into(recv, scale, res, 3, 0.25, E5M2)
    assert torch.equal(res, ((total * 0.25) / 3.0).bfloat16())


def test_dequantize_divides_and_nan_scale_poisons():
    data = torch.randint(0, 0x7B, (500,), dtype=torch.uint8)  # finite E5M2 bytes
    out = torch.empty(400, dtype=torch.float16)
    ops.dequantize_into(data, torch.tensor([7.0]), out, E5M2)
    assert torch.equal(out, (data[:400].view(E5M2).float() / 7.0).half())
    ops.dequantize_into(data, torch.tensor([math.nan]), out, E5M2)
    assert out.isnan().all()


def test_bad_arguments():
    g, mu, out = torch.zeros(10), torch.ones(1), torch.zeros(16, dtype=torch.uint8)
    v, p = _values(1.0), _params(AutoScaleState())
    with pytest.raises(ValueError, match="comm_ar_scale_vec: g must be a contiguous 1-D"):
        ops.scale_vec(torch.zeros(2, 5), v, p, E5M2)
    with pytest.raises(ValueError, match="comm_ar_scale_vec: g is empty"):
        ops.scale_vec(torch.zeros(0), v, p, E5M2)
    with pytest.raises(ValueError, match="values must be a contiguous float64 tensor of shape \\(6,\\)"):
        ops.scale_vec(g, v.float(), p, E5M2)
    with pytest.raises(ValueError, match="fp8 must be torch.float8_e5m2 or torch.float8_e4m3fn"):
        ops.scale_vec(g, v, p, torch.bfloat16)
    with pytest.raises(ValueError, match="comm_ar_scale_update: vec must be a contiguous float64 tensor of shape"):
        ops.scale_update(torch.zeros(3, dtype=torch.float64), v, p, E5M2)
    with pytest.raises(ValueError, match="scale must be a float32 tensor of shape \\(1,\\)"):
        ops.quantize_into(g, torch.ones(()), out, E5M2)
    with pytest.raises(ValueError, match="g has 10 elements, more than out's 4"):
        ops.quantize_into(g, mu, out[:4], E5M2)
    with pytest.raises(ValueError, match="out must be a contiguous 1-D uint8"):
        ops.quantize_into(g, mu, torch.zeros(16), E5M2)
    with pytest.raises(ValueError, match="recv must hold world \\* out.numel\\(\\) = 3 \\* 8 bytes, got 16"):
        ops.sum_requant_into(out, torch.zeros(8, dtype=torch.uint8), 3, E5M2)
    with pytest.raises(ValueError, match="out has 20 elements, more than data's 16"):
        ops.dequantize_into(out, mu, torch.zeros(20), E5M2)
    with pytest.raises(ValueError, match="pipeline_chunks must be None or an int >= 1, got 0"):
        fp8_all_reduce(g, pipeline_chunks=0)


def test_pieces_cover_the_chunk():
    assert _pieces(100, 1, 0) == [(0, 100)] and _pieces(100, None, 0) == [(0, 100)]
    assert _pieces(5000, 2, 0) == [(0, 3072), (3072, 1928)]  # aligned to 1024 elements
    assert _pieces(10, 4, 0) == [(0, 10)]  # never more pieces than 1024-element blocks
    assert len(_pieces(1 << 26, None, 4 << 30)) == AUTO_MAX_PIECES == 1 and len(_pieces(1 << 20, None, 1 << 20)) == 1  # auto: one piece (measured)
    for chunk, k in ((1, 3), (4097, 3), (123_457, 5)):
        p = _pieces(chunk, k, 0)
        assert p[0][0] == 0 and sum(c for _, c in p) == chunk and all(c > 0 for _, c in p)
        assert all(o2 == o + c for (o, c), (o2, _) in zip(p, p[1:], strict=False))


# ------------------------------------------------------------------------------------------------
# torch.library: opcheck and torch.compile
# ------------------------------------------------------------------------------------------------


def _op_cases():
    g, mu = _grad(3, 3000, torch.bfloat16), torch.tensor([20000.0])
    q = torch.zeros(3003, dtype=torch.uint8)
    ops.quantize_into(g, mu, q, E5M2)
    v, p = _values(20000.0), _params(AutoScaleState())
    return [
        (torch.ops.fp8kit.comm_ar_scale_vec, (g, v, p, E5M2)),
        (torch.ops.fp8kit.comm_ar_scale_update, (torch.tensor([1e4, -0.001, -1.0, -0.0], dtype=torch.float64), v, p,
                                                 E5M2)),
        (torch.ops.fp8kit.comm_ar_quantize, (g, mu, torch.zeros(3003, dtype=torch.uint8), E5M2)),
        (torch.ops.fp8kit.comm_ar_sum_requant, (q, torch.zeros(1001, dtype=torch.uint8), 3, E5M2)),
        (torch.ops.fp8kit.comm_ar_sum_dequant, (q, mu, torch.zeros(1001), 3, 1 / 3, E5M2)),
        (torch.ops.fp8kit.comm_ar_dequant, (q, mu, torch.zeros(3000, dtype=torch.bfloat16), E5M2)),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck(case):
    op, args = _op_cases()[case]
    torch.library.opcheck(op, args)


def test_compiled_passes_equal_eager():
    """A function running all four passes traces into one graph (fullgraph) and gives eager's bits."""

    def passes(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vec = ops.scale_vec(g, values, params, E4M3)
        scale, out_scale, new = ops.scale_update(vec, values, params, E4M3)
        q = torch.empty(2 * 1500, dtype=torch.uint8)
        ops.quantize_into(g, scale, q, E4M3)
        m = torch.empty(1500, dtype=torch.uint8)
        ops.sum_requant_into(q, m, 2, E4M3)
        out = torch.empty(1500, dtype=g.dtype)
        ops.dequantize_into(m, scale, out, E4M3)
        rs = torch.empty(1500)
        ops.sum_dequant_into(q, scale, rs, 2, 0.5, E4M3)
        return vec, scale, out_scale, new, q, m, out, rs

    g, values, params = _grad(5, 2999, torch.bfloat16), _values(1.0, init=False), _params(AutoScaleState())
    torch._dynamo.reset()
    compiled = torch.compile(passes, fullgraph=True, backend="aot_eager")
    for a, b in zip(compiled(g, values, params), passes(g, values, params), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Pipelined exchange on 3 gloo ranks
# ------------------------------------------------------------------------------------------------


def _written_out(inputs: list[torch.Tensor], fp8: torch.dtype) -> torch.Tensor:
    m = FP8_MAX[fp8]
    amax = max(x.float().abs().max() for x in inputs)
    mu = torch.tensor(m, dtype=torch.float32) / amax
    if mu * amax > m:
        mu = torch.nextafter(mu, torch.tensor(0.0))
    total = None
    for x in inputs:
        q = (x.float() * mu).clamp(-m, m).to(fp8).float()
        total = q if total is None else total + q
    mean = (total * torch.tensor(1 / len(inputs), dtype=torch.float32)).clamp(-m, m).to(fp8)
    return (mean.float() / mu).to(inputs[0].dtype)


def _pipeline_worker(out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, res = dist.get_rank(), {}
    for fmt, fp8 in (("e5m2", E5M2), ("e4m3", E4M3)):
        for dtype in (torch.float32, torch.bfloat16):
            for n in (5, 40_001, 123_457):
                variants = {"one": {}, "p2": {"pipeline_chunks": 2}, "p3": {"pipeline_chunks": 3},
                            "p7": {"pipeline_chunks": 7}, "reference": {"reference": True}}  # fmt: skip
                states = {k: AutoScaleState(fp8_dtype=fmt, scaling="current") for k in variants}
                case = {}
                for step in range(3):
                    g = _grad(100 * step + rank, n, dtype) * (100.0 if step == 1 and rank == 2 else 1.0)
                    outs = {k: fp8_all_reduce(g.clone(), state=states[k], **kw) for k, kw in variants.items()}
                    if step == 0:
                        gathered = [torch.empty_like(g) for _ in range(WORLD)]
                        dist.all_gather(gathered, g)
                        case["written_out"] = torch.equal(outs["one"], _written_out(gathered, fp8))
                    case[f"step{step}"] = {k: torch.equal(o, outs["one"]) for k, o in outs.items()}
                case["states"] = {k: s.stats() == states["one"].stats() for k, s in states.items()}
                case["halvings"] = states["one"].stats()["halvings"]
                res[f"{fmt}/{str(dtype).removeprefix('torch.')}/{n}"] = case
    g = _grad(7 + rank, 50_000)
    if rank == 1:
        g[123] = math.inf
    res["nonfinite_pieces_all_nan"] = bool(fp8_all_reduce(g, state=AutoScaleState(scaling="current"), pipeline_chunks=3).isnan().all())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res, indent=1))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("fp8_allreduce_pipeline")
    return torchrun_rank_results(__file__, WORLD, out, timeout=600)


def test_pipelined_and_reference_equal_one_piece(pipeline_runs):
    for rank, r in enumerate(pipeline_runs):
        for case, c in r.items():
            if not isinstance(c, dict):
                continue
            assert c["written_out"], f"rank {rank} {case}: differs from the algorithm written out"
            for step in range(3):
                assert all(c[f"step{step}"].values()), f"rank {rank} {case} step {step}: {c[f'step{step}']}"
            assert all(c["states"].values()), f"rank {rank} {case}: states differ {c['states']}"
            assert c["halvings"] == 1, f"{case}: the 100x step should halve mu once, got {c['halvings']}"
        assert r["nonfinite_pieces_all_nan"]


if __name__ == "__main__":  # run by the `pipeline_runs` fixture under torchrun
    _pipeline_worker(Path(sys.argv[1]))
