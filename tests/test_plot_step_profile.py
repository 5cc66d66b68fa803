"""benchmarks/plot_step_profile.py on CPU, from session 52's recorded llama3-1b step profiles
(``benchmarks/results/session52/call3`` and ``call6``): the figures of docs/benchmarks.md ("Session 52")."""

from __future__ import annotations

import pytest

from tests.script_loader import load_script
from tests.test_distributed import ROOT

RUN = ROOT / "benchmarks" / "results" / "session52"
BEFORE, AFTER = RUN / "call3" / "step_profile_1b.log", RUN / "call6" / "step_profile_1b_after.log"


@pytest.fixture(scope="module")
def psp():
    return load_script(ROOT / "benchmarks" / "plot_step_profile.py")


def test_the_recorded_profiles_give_the_documented_figures_and_a_plot(psp, tmp_path, monkeypatch, capsys):
    before, after = psp.read_table(BEFORE), psp.read_table(AFTER)
    all_ = "delayed+fp8.delayed_fused_cast=all"
    assert list(before) == ["bf16", "delayed", "delayed+fp8.delayed_fused_cast=grad_output", all_], list(before)
    # docs/benchmarks.md, Session 52: "all" 125.0 -> 92.5 ms, idle 86.4 -> 44.9 ms
    assert (before[all_]["wall ms"], before[all_]["idle ms"]) == ("125.0", "86.4"), before[all_]
    assert (after[all_]["wall ms"], after[all_]["idle ms"]) == ("92.5", "44.9"), after[all_]
    assert psp.short(all_) == "delayed, all"
    png = tmp_path / "p.png"
    monkeypatch.setattr("sys.argv", ["plot_step_profile.py", f"before={BEFORE}", f"after={AFTER}", "--png", str(png)])
    assert psp.main() == 0
    assert png.stat().st_size > 10_000
    assert "| delayed+fp8.delayed_fused_cast=all | 73.2 / 86.4 / 125.0 | 72.5 / 44.9 / 92.5 |" in capsys.readouterr().out


def test_a_file_without_the_table_is_refused(psp, tmp_path):
    bad = tmp_path / "x.log"
    bad.write_text("no table here\n")
    with pytest.raises(SystemExit, match="no step_profile results table"):
        psp.read_table(bad)
