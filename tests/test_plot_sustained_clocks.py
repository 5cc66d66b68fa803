"""benchmarks/plot_sustained_clocks.py on CPU: the burst / steady medians and the figure, from session 30's H100 run.

The run itself needs a GPU (``benchmarks/sustained_clocks.py``); its recorded output is in
``benchmarks/results/session30/``. The steady figures asserted here are those of docs/benchmarks.md
("Session 30" and "Session 46"): fp8kit blockwise with the 128x128 wgrad copy at 5.667 ms, 1.445x of BF16.
"""

from __future__ import annotations

import json

import pytest

from tests.script_loader import load_script
from tests.test_distributed import ROOT

RUN = ROOT / "benchmarks" / "results" / "session30"


@pytest.fixture(scope="module")
def psc():
    return load_script(ROOT / "benchmarks" / "plot_sustained_clocks.py")


def test_steady_window_gives_the_recorded_speedups(psc):
    rows = {r["variant"]: r for r in psc.summary(json.loads((RUN / "sustained_clocks.json").read_text()),
                                                   0.2, (1.0, 5.0))}
    assert rows["bf16"]["steady_speedup"] == 1.0
    got = rows["fp8kit_wgrad2d"]
    assert got["steady_ms"] == pytest.approx(5.6672, abs=1e-4), f"steady median {got['steady_ms']} ms"
    assert got["steady_speedup"] == pytest.approx(1.445, abs=1e-3), f"steady speed-up {got['steady_speedup']}"
    # the burst window is the first 0.2 s only: fewer batches, a different (faster) median than the steady one
    assert got["burst_ms"] < got["steady_ms"], f"burst {got['burst_ms']} vs steady {got['steady_ms']}"


def test_window_without_batches_is_none_not_an_error(psc):
    assert psc.window_ms([[0.1, 5.0], [0.3, 6.0]], 2.0, 3.0) is None
    assert psc.window_ms([[0.1, 5.0], [0.3, 6.0], [0.5, 9.0]], 0.0, 1.0) == 6.0


def test_smi_log_parses_samples_and_skips_other_lines(psc, tmp_path):
    log = tmp_path / "nvidia_smi.csv"
    log.write_text("timestamp, clocks.sm [MHz], power.draw [W], temperature.gpu, clocks_event_reasons.active\n"
                   "2026/11/29 05:22:58.349, 1980 MHz, 79.68 W, 31, 0x0000000000000000\n"
                   "2026/11/29 05:22:58.374, 1455 MHz, 691.00 W, 52, 0x0000000000000004\n"
                   "2026/11/29 05:22:58.39")  # the last line cut when the logger was stopped
    rows = psc.smi_rows(log)
    assert [(r["mhz"], r["w"], r["reasons"]) for r in rows] == [
        (1980.0, 79.68, "0x0000000000000000"), (1455.0, 691.0, "0x0000000000000004")], rows
    assert rows[1]["t"] - rows[0]["t"] == pytest.approx(0.025, abs=1e-6)


def test_plot_writes_a_png(psc, tmp_path):
    result = json.loads((RUN / "sustained_clocks.json").read_text())
    rows = psc.summary(result, 0.2, (1.0, 5.0))
    png = tmp_path / "fig.png"
    psc.plot(result, psc.smi_rows(RUN / "nvidia_smi.csv"), rows, png, (1.0, 5.0))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
