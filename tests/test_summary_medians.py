"""The summary's throughput medians (``train/summary.summarize_run``): the warm-up steps are skipped, and a resumed
run's throughput comes from the resuming session's steps only (an earlier session may have run on another layout,
e.g. 2 ranks before and 1 now, whose per-GPU rate would otherwise be mixed in), with its own warm-up skipped;
losses come from the whole run."""

from __future__ import annotations

from fp8kit.train.summary import summarize_run

DESC = {"model": "tiny", "params_m": 1.0, "precision": "bf16", "fp8_sites": "0 of 0"}


def _records(steps: range, tps: float, per_gpu: float, warm_tps: float) -> list[dict]:
    """One record per step; the first two steps of the session are slow (compilation)."""
    return [{"step": s, "loss": 5.0 - 0.01 * s, "tokens_per_s": warm_tps if s < steps.start + 2 else tps,
             "tokens_per_s_per_gpu": per_gpu if s >= steps.start + 2 else warm_tps, "step_ms": 1e3 / tps,
             "mfu": None, "peak_mem_gib": 1.0} for s in steps]


def test_fresh_run_skips_its_warm_up():
    recs = _records(range(1, 21), tps=1000.0, per_gpu=500.0, warm_tps=10.0)
    s = summarize_run(recs, switches=[], info={}, setup_desc=DESC)
    assert s["tokens_per_s"] == 1000.0 and s["tokens_per_s_per_gpu"] == 500.0, s


def test_resumed_run_reports_the_resuming_sessions_layout():
    before = _records(range(1, 21), tps=1000.0, per_gpu=500.0, warm_tps=10.0)  # 2 ranks: 500 tokens/s per GPU
    after = _records(range(21, 41), tps=1400.0, per_gpu=1400.0, warm_tps=10.0)  # 1 process, after the resume
    s = summarize_run(before + after, switches=[], info={}, setup_desc=DESC, session_from=20)
    assert s["tokens_per_s"] == 1400.0 and s["tokens_per_s_per_gpu"] == 1400.0, (
        f"resumed run's medians mix the sessions: {s['tokens_per_s']}, {s['tokens_per_s_per_gpu']} per GPU")
    assert s["steps_done"] == 40 and s["final_loss"] == after[-1]["loss"], s
    # a resume stopped before its first step has no throughput of its own: none, not the earlier layout's
    s = summarize_run(before, switches=[], info={}, setup_desc=DESC, session_from=20)
    assert s["tokens_per_s"] is None and s["tokens_per_s_per_gpu"] is None and s["steps_done"] == 20, s
