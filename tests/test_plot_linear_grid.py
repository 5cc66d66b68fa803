"""benchmarks/plot_linear_grid.py on CPU, from session 51's recorded H200 grid (``benchmarks/results/session51/``).

The counts asserted are those of docs/benchmarks.md ("Session 51"): the delayed default faster than torchao
tensorwise at 15 of the 18 shapes, with ``delayed_fused_cast`` grad_output or all at 18 of 18.
"""

from __future__ import annotations

import json

import pytest

from tests.script_loader import load_script
from tests.test_distributed import ROOT

RUN = ROOT / "benchmarks" / "results" / "session51"
FILES = [RUN / "call1" / "delayed8.json", RUN / "call4" / "grid10.json"]


@pytest.fixture(scope="module")
def plg():
    return load_script(ROOT / "benchmarks" / "plot_linear_grid.py")


def test_the_recorded_grid_gives_the_documented_counts_and_a_figure(plg, tmp_path, monkeypatch, capsys):
    rows, meta = plg.load_rows(FILES)
    assert len(rows) == 18 and meta["device"] == "NVIDIA H200", (len(rows), meta)
    sizes = [r["M"] * r["K"] * r["N"] for r in rows]
    assert sizes == sorted(sizes), "shapes are not ordered by GEMM size"
    sp = plg.speedups(rows, ["ao_tensorwise", "fp8kit_delayed"])
    first = rows[0]  # 4096x2048x2048: bf16 0.1477 ms, torchao 0.1576 ms in call 1
    assert (first["M"], first["K"], first["N"]) == (4096, 2048, 2048)
    assert abs(sp["ao_tensorwise"][0] - 0.1477 / 0.1576) < 2e-3, sp["ao_tensorwise"][0]
    png = tmp_path / "grid.png"
    monkeypatch.setattr("sys.argv", ["plot_linear_grid.py", *map(str, FILES), "--png", str(png)])
    assert plg.main() == 0
    out = capsys.readouterr().out
    assert "fp8kit_delayed: faster than ao_tensorwise at 15 of 18 shapes" in out, out
    assert "fp8kit_delayed_grad: faster than ao_tensorwise at 18 of 18 shapes" in out, out
    assert "fp8kit_delayed_fused: faster than ao_tensorwise at 18 of 18 shapes" in out, out
    assert png.stat().st_size > 10_000, png.stat().st_size


def test_a_file_without_a_bf16_baseline_is_refused_by_name(plg, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"M": 8, "K": 16, "N": 16, "ms": {"ao_tensorwise": 1.0}}]}))
    with pytest.raises(SystemExit, match=r"bad.json: shape 8x16x16 has no bf16 time"):
        plg.load_rows([bad])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"variant": "bf16"}))
    with pytest.raises(SystemExit, match=r"other.json: not a linear_fwd_bwd.py result"):
        plg.load_rows([other])
