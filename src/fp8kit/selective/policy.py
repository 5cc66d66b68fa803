"""Adaptive-FP8 policies: LoongForge's JSON format, validation, lookup, and merging layer reports.

Format (LoongForge adaptive FP8's "FP8 Dynamic Policy" file; files written for it load here unchanged)::

    {"version": 1, "speedup_threshold": 1.0,
     "rules": {
       "layernorm_column": {"qkv": [{"tp": 1, "min_tokens": 16384, "measured_speedup": 1.03}], ...},
       "row":              {"fc2": [{"tp": 1, "min_tokens": 8192,  "measured_speedup": 1.23}], ...},
       "column_grouped":   [{"etp": 1, "num_gemms": 64, "min_tokens": 424, "measured_speedup": 1.02}],
       "row_grouped":      [...]},
     "metadata": {...}}          # optional, fp8kit's: device, recipe, fast_accum, versions, source reports

Decision (LoongForge adaptive FP8's decision logic):

- dense kinds (layernorm_column / column / row / duplicated): the rule for ``(module_kind, ub_name,
  tp)``; FP8 when ``num_tokens >= min_tokens`` with ``num_tokens = seq_length x micro_batch_size``.
- grouped kinds (column_grouped / row_grouped): the rule for ``(module_kind, etp, num_gemms)``; FP8
  when ``num_tokens x moe_router_topk >= min_tokens``.
- no matching rule: BF16 (conservative).

Merging (``merge_reports``): per site key and token count, ``speedup = bf16_ms / fp8_ms``;
``min_tokens`` is the smallest measured token count from which FP8 beats the threshold
(``speedup > speedup_threshold``) at every larger measured count, so a policy never switches FP8 on,
off and on again as tokens grow; a site that never gets there gets no rule.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8kit.base.errors import ConfigError, PolicyError
from fp8kit.fp8.recipes import GEMMS, fast_accum_for
from fp8kit.selective.sites import DENSE_KINDS, GROUPED_KINDS, MODULE_KINDS

POLICY_VERSION = 1
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class Rule:
    """One rule: FP8 from ``min_tokens`` on. Dense rules carry ``tp``; grouped ``etp`` and ``num_gemms``."""

    min_tokens: int
    measured_speedup: float
    tp: int | None = None
    etp: int | None = None
    num_gemms: int | None = None


@dataclass(frozen=True)
class PolicyVerdict:
    """Result of a lookup: ``use_fp8`` and the sentence for the conversion report."""

    use_fp8: bool
    reason: str
    rule: Rule | None


@dataclass
class Policy:
    """A loaded, validated policy. ``dense[kind][ub_name]`` and ``grouped[kind]`` hold :class:`Rule` lists."""

    speedup_threshold: float = 1.0
    dense: dict[str, dict[str, list[Rule]]] = field(default_factory=dict)
    grouped: dict[str, list[Rule]] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    # -- lookup ------------------------------------------------------------------------------------
    def decide(
        self, module_kind: str, ub_name: str | None, *, num_tokens: int, tp: int = 1, etp: int = 1,
        num_gemms: int | None = None, topk: int = 1,
    ) -> PolicyVerdict:
        """FP8 or BF16 for one site (see the module docstring for the rules)."""
        if module_kind in GROUPED_KINDS:
            tokens = num_tokens * topk
            rule = next((r for r in self.grouped.get(module_kind, []) if r.etp == etp and r.num_gemms == num_gemms), None)
            what = f"{module_kind} etp={etp} num_gemms={num_gemms}"
            shown = f"{num_tokens}x{topk}={tokens}" if topk != 1 else f"{tokens}"
        elif module_kind in DENSE_KINDS:
            tokens = num_tokens
            rules = self.dense.get(module_kind, {}).get(ub_name or "", [])
            rule = next((r for r in rules if r.tp == tp), None)
            what = f"{ub_name} tp={tp}"
            shown = f"{tokens}"
        else:
            return PolicyVerdict(False, f"no rule for module kind {module_kind!r} -> bf16", None)
        if rule is None:
            return PolicyVerdict(False, f"no rule for {what} -> bf16", None)
        if tokens >= rule.min_tokens:
            return PolicyVerdict(True, f"{what} min_tokens={rule.min_tokens} <= {shown} -> fp8", rule)
        return PolicyVerdict(False, f"{what} min_tokens={rule.min_tokens} > {shown} -> bf16", rule)

    # -- (de)serialisation -------------------------------------------------------------------------
    def to_json(self) -> dict:
        rules: dict[str, Any] = {}
        for kind in DENSE_KINDS:
            if self.dense.get(kind):
                rules[kind] = {
                    ub: [{"tp": r.tp, "min_tokens": r.min_tokens, "measured_speedup": round(r.measured_speedup, 4)} for r in rs]
                    for ub, rs in sorted(self.dense[kind].items())
                }
        for kind in GROUPED_KINDS:
            if self.grouped.get(kind):
                rules[kind] = [
                    {"etp": r.etp, "num_gemms": r.num_gemms, "min_tokens": r.min_tokens,
                     "measured_speedup": round(r.measured_speedup, 4)}
                    for r in self.grouped[kind]
                ]
        out = {"version": POLICY_VERSION, "speedup_threshold": self.speedup_threshold, "rules": rules}
        if self.metadata:
            out["metadata"] = self.metadata
        return out

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Loading and validation


def builtin_policy_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "policies"


def resolve_policy_path(text: str) -> Path:
    """``builtin:NAME`` -> the shipped ``policies/NAME.json``; anything else is a path."""
    if text.startswith(BUILTIN_PREFIX):
        name = text[len(BUILTIN_PREFIX):]
        return builtin_policy_dir() / (name if name.endswith(".json") else f"{name}.json")
    return Path(text).expanduser()


def list_builtin_policies() -> list[str]:
    return sorted(p.stem for p in builtin_policy_dir().glob("*.json"))


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PolicyError(f"{where}: must be a positive integer, got {value!r}")
    return value


def _speedup(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise PolicyError(f"{where}: must be a finite, non-negative number, got {value!r}")
    return float(value)


def _rule(entry: Any, where: str, keys: tuple[str, ...]) -> Rule:
    """One rule object: ``min_tokens``, ``measured_speedup`` and the key fields (``tp`` or ``etp``, ``num_gemms``)."""
    if not isinstance(entry, dict):
        raise PolicyError(f"{where}: must be an object")
    return Rule(
        min_tokens=_positive_int(entry.get("min_tokens"), f"{where}.min_tokens"),
        measured_speedup=_speedup(entry.get("measured_speedup", 0.0), f"{where}.measured_speedup"),
        **{k: _positive_int(entry.get(k), f"{where}.{k}") for k in keys},
    )


def policy_from_json(data: Any, source: str = "<memory>") -> Policy:
    """Validate a parsed policy; every error names ``source`` and the key path.

    Raises:
        PolicyError: unknown version, unknown module kind, wrong layout, non-positive or non-integer
            ``tp`` / ``etp`` / ``num_gemms`` / ``min_tokens``, negative or NaN speedups.
    """
    if not isinstance(data, dict):
        raise PolicyError(f"{source}: the policy must be a JSON object, got {type(data).__name__}")
    version = data.get("version")
    if version != POLICY_VERSION:
        raise PolicyError(f"{source}: version: unknown policy version {version!r} (fp8kit reads version {POLICY_VERSION})")
    threshold = data.get("speedup_threshold", 1.0)
    threshold = _speedup(threshold, f"{source}: speedup_threshold")
    rules = data.get("rules")
    if not isinstance(rules, dict):
        raise PolicyError(f"{source}: rules: must be an object of module kinds, got {type(rules).__name__}")
    policy = Policy(speedup_threshold=threshold, metadata=dict(data.get("metadata") or {}), source=source)
    for kind, body in rules.items():
        where = f"{source}: rules.{kind}"
        if kind not in MODULE_KINDS:
            raise PolicyError(f"{where}: unknown module kind {kind!r}; known: {', '.join(MODULE_KINDS)}")
        if kind in DENSE_KINDS:
            if not isinstance(body, dict):
                raise PolicyError(f"{where}: a dense kind maps ub_name -> list of rules, got {type(body).__name__}")
            for ub, entries in body.items():
                if not isinstance(entries, list):
                    raise PolicyError(f"{where}.{ub}: must be a list of rules")
                policy.dense.setdefault(kind, {})[ub] = [
                    _rule(e, f"{where}.{ub}[{i}]", ("tp",)) for i, e in enumerate(entries)
                ]
        else:
            if not isinstance(body, list):
                raise PolicyError(f"{where}: a grouped kind holds a flat list of rules, got {type(body).__name__}")
            policy.grouped[kind] = [_rule(e, f"{where}[{i}]", ("etp", "num_gemms")) for i, e in enumerate(body)]
    return policy


def load_policy(path_or_name: str | Path) -> Policy:
    """Load and validate a policy file (``builtin:NAME`` for a shipped one).

    Raises:
        PolicyError: missing file, invalid JSON, or any validation error (file and key path named).
    """
    text = str(path_or_name)
    path = resolve_policy_path(text)
    if path.is_dir():
        raise PolicyError(f"policy file {text!r} is a directory (give the policy's JSON file, e.g. merge-policy's "
                          f"--output)")
    if not path.is_file():
        hint = ""
        if text.startswith(BUILTIN_PREFIX):
            hint = f"; shipped policies: {', '.join(list_builtin_policies()) or 'none'}"
        raise PolicyError(f"policy file {text!r} does not exist{hint}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PolicyError(f"{path}: invalid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"{path}: cannot be read: {e}") from None
    return policy_from_json(data, str(path))


# ----------------------------------------------------------------------------------------------
# Merging benchmark reports into a policy


def site_key(m: dict) -> tuple:
    """The policy key of a measurement: dense ``(kind, ub_name, tp)``, grouped ``(kind, etp, num_gemms)``."""
    if m["module_kind"] in GROUPED_KINDS:
        return (m["module_kind"], m["etp"], m["num_gemms"])
    return (m["module_kind"], m["ub_name"], m["tp"])


def speedup_curves(reports: list[dict], component: str | None = None) -> dict[tuple, list[tuple[int, float, float, float]]]:
    """Per site key: sorted ``(num_tokens, speedup, bf16_ms, fp8_ms)`` (median ms over duplicate reports)."""
    times: dict[tuple, dict[int, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for rep in reports:
        for m in rep["measurements"]:
            if component is not None and m.get("component", "llm") != component:
                continue
            if m.get("ms") is None:
                continue
            times[site_key(m)][int(m["num_tokens"])][m["precision"]].append(float(m["ms"]))
    curves = {}
    for key, by_tokens in times.items():
        pts = []
        for tokens in sorted(by_tokens):
            p = by_tokens[tokens]
            if p.get("bf16") and p.get("fp8"):
                b, f = statistics.median(p["bf16"]), statistics.median(p["fp8"])
                pts.append((tokens, b / f, b, f))
        if pts:
            curves[key] = pts
    return curves


def min_tokens_for(points: list[tuple[int, float, float, float]], threshold: float) -> tuple[int, float] | None:
    """Smallest token count from which every larger measured count beats ``threshold``; with its speedup."""
    best = None
    for tokens, speedup, *_ in reversed(points):
        if speedup > threshold:
            best = (tokens, speedup)
        else:
            break
    return best


def check_compatible_reports(reports: list[tuple[str, dict]], force: bool = False) -> None:
    """Refuse to merge reports from different devices, recipes or fast accumulation (unless ``force``; then
    :func:`merge_reports` records each report's fast accumulation, the policy's being :data:`MIXED_FAST_ACCUM`).

    Raises:
        PolicyError: naming both reports and the differing field.
    """
    if force or len(reports) < 2:
        return
    name0, first = reports[0]
    for name, rep in reports[1:]:
        for key in ("device", "recipe", "fast_accum"):
            a, b = _report_value(first, key, name0), _report_value(rep, key, name)
            if a != b:
                raise PolicyError(
                    f"reports differ in {key}: {name0} has {a!r}, {name} has {b!r}; "
                    f"a policy must come from one device, recipe and fast accumulation (pass --force to merge anyway)"
                )


#: What a report or policy written before its ``fast_accum`` key existed (before session 39) was timed with, where
#: that differs from today's default: the delayed recipe ran every GEMM with FP32 promotion then.
_LEGACY_FAST_ACCUM = {"delayed": []}


#: A merged policy's ``metadata["fast_accum"]`` when its reports were timed with different fast accumulation
#: (``merge-policy --force``): no one setting holds for its rules; each report's is in its ``metadata["reports"]``
#: entry.
MIXED_FAST_ACCUM = "mixed"


def report_fast_accum(report: dict, where: str = "report") -> list[str] | str | None:
    """The GEMMs a bench-layers report (or a merged policy's ``metadata``) timed with fast accumulation
    (``fp8.fast_accum``, resolved; in ``fp8.recipes.GEMMS`` order); without the key (written before it existed):
    what its recipe ran then (:data:`_LEGACY_FAST_ACCUM`, else the recipe's default, ``fp8.recipes.fast_accum_for``);
    :data:`MIXED_FAST_ACCUM` for a policy merged from reports of different settings; None for an unknown recipe.

    Raises:
        PolicyError: a ``fast_accum`` that is not a list of GEMM names, ``"all"``, one name or ``"mixed"`` (a
            hand-edited file), naming ``where`` (the file) and the value.
    """
    given = report.get("fast_accum")
    if given == MIXED_FAST_ACCUM:
        return MIXED_FAST_ACCUM
    if isinstance(given, str):  # a hand-written file: "all" or one GEMM's name, as fp8.fast_accum takes them
        given = list(GEMMS) if given == "all" else [given]
    if given is not None:
        if not isinstance(given, list) or any(g not in GEMMS for g in given):
            raise PolicyError(f"{where}: fast_accum must be a list of {list(GEMMS)} (or \"all\", or "
                              f"{MIXED_FAST_ACCUM!r} in a forced merge), got {report.get('fast_accum')!r}")
        return [g for g in GEMMS if g in given]
    recipe = report.get("recipe")
    if recipe in _LEGACY_FAST_ACCUM:
        return list(_LEGACY_FAST_ACCUM[recipe])
    try:
        return list(fast_accum_for(recipe))
    except ConfigError:
        return None


def _report_value(report: dict, key: str, name: str):
    return report_fast_accum(report, name) if key == "fast_accum" else report.get(key)


def merge_reports(
    reports: list[tuple[str, dict]], speedup_threshold: float = 1.0, *, force: bool = False, component: str | None = None
) -> Policy:
    """Merge ``(name, report)`` pairs into a :class:`Policy` (see the module docstring).

    Raises:
        PolicyError: incompatible reports (see :func:`check_compatible_reports`) or a bad threshold.
    """
    _speedup(speedup_threshold, "--speedup-threshold")
    check_compatible_reports(reports, force)
    policy = Policy(speedup_threshold=speedup_threshold)
    for key, points in sorted(speedup_curves([r for _, r in reports], component).items(), key=lambda kv: str(kv[0])):
        found = min_tokens_for(points, speedup_threshold)
        if found is None:
            continue
        min_tokens, speedup = found
        kind = key[0]
        if kind in GROUPED_KINDS:
            policy.grouped.setdefault(kind, []).append(
                Rule(min_tokens=min_tokens, measured_speedup=speedup, etp=key[1], num_gemms=key[2])
            )
        else:
            policy.dense.setdefault(kind, {}).setdefault(key[1], []).append(
                Rule(min_tokens=min_tokens, measured_speedup=speedup, tp=key[2])
            )
    for rules in policy.dense.values():
        for lst in rules.values():
            lst.sort(key=lambda r: r.tp)
    for lst in policy.grouped.values():
        lst.sort(key=lambda r: (r.etp, r.num_gemms))
    reps = [r for _, r in reports]
    accums = [report_fast_accum(r, name) for name, r in reports]  # differing ones only under force: recorded per report, "mixed"
    policy.metadata = {
        "generator": "fp8kit merge-policy",
        "device": reps[0].get("device") if reps else None,
        "recipe": reps[0].get("recipe") if reps else None,
        "fast_accum": (accums[0] if all(a == accums[0] for a in accums) else MIXED_FAST_ACCUM) if reps else None,
        "versions": reps[0].get("versions") if reps else None,
        "component": component or "all",
        "reports": [
            {"name": Path(n).name, "tp": r.get("tp"), "ep": r.get("ep"), "etp": r.get("etp"),
             "simulated_tp": r.get("simulated_tp"), "device": r.get("device"), "date": r.get("date"),
             "compile_shapes": report_compile_shapes(r), "fast_accum": a}
            for (n, r), a in zip(reports, accums, strict=True)
        ],
    }
    notes = []
    if any(r.get("device_type") == "cpu" for r in reps):
        notes.append("CPU timings: for testing the workflow, not for a GPU policy")
    dynamic = [Path(n).name for n, r in reports if report_compile_shapes(r) == "dynamic"]
    if dynamic:
        notes.append(DYNAMIC_NOTE.format(reports=", ".join(dynamic)))
    if notes:
        policy.metadata["note"] = "; ".join(notes)
    return policy


#: the note of a policy merged from reports whose sites were compiled with a dynamic token dimension
DYNAMIC_NOTE = (
    "FP8 timed with a dynamic-shape compile ({reports}): Inductor's FP8 casts for a symbolic row count run slower "
    "than training's static compile (on the H100, Qwen3-30B-A3B's FP8 qkv at 16384 tokens took 2.08 ms against "
    "1.28 ms; docs/benchmarks.md section 2, session 28), so this policy may keep sites BF16 that run faster in FP8. "
    "Prefer selective_fp8 = 'auto', or regenerate the reports with bench-layers' default (static) compile"
)


def report_compile_shapes(report: dict) -> str | None:
    """How a bench-layers report compiled its dense sites: ``"static"`` (one compile per token count, since
    session 28), ``"dynamic"`` (one compile with the token dimension dynamic: ``--dynamic``, and every compiled
    report written before the field existed), or None (eager)."""
    if not report.get("compiled"):
        return None
    return report.get("compile_shapes", "dynamic")


def grid_check(reports: list[dict], policy: Policy, tolerance: float = 0.02, component: str | None = None) -> dict:
    """How close the policy's choice is to the faster precision at every measured point.

    For each site key and token count of the reports: the chosen precision's time over
    ``min(bf16_ms, fp8_ms)``. Returns the worst ratio, the number of points, and the points where the
    choice is more than ``tolerance`` slower than the faster precision (LoongForge adaptive FP8's goal,
    "never slower than BF16, as close to full FP8 as possible", checked per layer).
    """
    worst, points, misses = 1.0, 0, []
    for key, curve in speedup_curves(reports, component).items():
        kind = key[0]
        for tokens, _speedup, b, f in curve:
            if kind in GROUPED_KINDS:
                v = policy.decide(kind, None, num_tokens=tokens, etp=key[1], num_gemms=key[2])
            else:
                v = policy.decide(kind, key[1], num_tokens=tokens, tp=key[2])
            chosen = f if v.use_fp8 else b
            ratio = chosen / min(b, f)
            points += 1
            worst = max(worst, ratio)
            if ratio > 1.0 + tolerance:
                misses.append({"key": list(key), "num_tokens": tokens, "chosen": "fp8" if v.use_fp8 else "bf16",
                               "bf16_ms": b, "fp8_ms": f, "ratio": ratio})
    return {"points": points, "worst_ratio": worst, "misses": misses}
