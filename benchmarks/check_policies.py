"""Check every shipped adaptive-FP8 policy against the reports it was merged from.

For each ``src/fp8kit/policies/<name>.json`` and its reports in ``benchmarks/results/policy_reports/``:
``selective.policy.grid_check`` (the
chosen precision's time over the faster of bf16 and fp8 at every measured site x token point) and the
rules in short form. Prints the markdown table used in ``docs/benchmarks.md``; runs on any machine.

    python benchmarks/check_policies.py [--tolerance 0.02]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fp8kit.selective.policy import builtin_policy_dir, grid_check, load_policy

REPORTS = Path(__file__).resolve().parent / "results" / "policy_reports"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tolerance", type=float, default=0.02)
    args = ap.parse_args()
    root = builtin_policy_dir()
    print(f"| policy | timing | points | points > {args.tolerance:.0%} off | worst ratio | rules (ub_name@tp >= min_tokens) |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for path in sorted(root.glob("*.json")):
        data = json.loads(path.read_text())
        names = [s["name"] for s in data.get("metadata", {}).get("reports", [])]
        reports = [json.loads((REPORTS / n).read_text()) for n in names]
        policy = load_policy(path)
        g = grid_check(reports, policy, args.tolerance)
        timing = ",".join(sorted({"v2" if str(r.get("timing", "")).startswith("device queue") else "v1" for r in reports}))
        rules = []
        for kind, by_name in data["rules"].items():
            if isinstance(by_name, dict):
                for ub, entries in by_name.items():
                    rules += [f"{ub}@tp{e['tp']}>={e['min_tokens']}" for e in entries]
            else:
                rules += [f"{kind}@etp{e['etp']}/g{e['num_gemms']}>={e['min_tokens']}" for e in by_name]
        bad += len(g["misses"])
        print(f"| {path.stem} | {timing} | {g['points']} | {len(g['misses'])} | {g['worst_ratio']:.3f} | "
              f"{', '.join(rules) or 'none'} |")
        for m in g["misses"]:
            print(f"|  miss: {m['key']} {m['num_tokens']} tok chose {m['chosen']} "
                  f"(bf16 {m['bf16_ms']:.3f} ms, fp8 {m['fp8_ms']:.3f} ms, x{m['ratio']:.3f}) | | | | | |")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
