"""Fast accumulation per GEMM (``Recipe.fast_accum`` in ``fp8kit.fp8.recipes``, ``fp8.fast_accum``): by default the
torchao recipes run fprop with the tensor cores' fast accumulation and dgrad / wgrad with the split (FP32-promoting)
accumulator, as Transformer Engine and torchao do, and the delayed recipe fprop and wgrad fast, dgrad split (measured
in session 42); ``fp8.fast_accum`` chooses other GEMMs. On the
CPU ``torch._scaled_mm`` computes the same either way, so these tests check what reaches it: every
``aten._scaled_mm`` call of a training step, seen by a dispatch mode. The GPU check of the numbers is
tests/test_delayed_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8kit.base.errors import ConfigError, PolicyError
from fp8kit.fp8.recipes import (
    DELAYED_FAST_ACCUM,
    FPROP_FAST_ACCUM,
    GEMMS,
    RECIPES,
    fast_accum_for,
    float8_linear_config,
)
from tests.conftest import prepared_llama


class _ScaledMMCalls(TorchDispatchMode):
    """Records ``use_fast_accum`` of every ``aten._scaled_mm`` call while active (``fast``), and each call's
    contraction length K (``k``: the tokens in a wgrad GEMM, the output features in a dgrad one)."""

    def __init__(self):
        super().__init__()
        self.fast: list[bool] = []
        self.k: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            # schema: (self, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
            self.fast.append(bool(kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)))
            self.k.append(args[0].shape[-1])
        return func(*args, **kwargs)


def test_the_recipe_table_names_gemms_torchao_follows_transformer_engine_and_delayed_adds_wgrad():
    for r in RECIPES.values():
        assert set(r.fast_accum) <= set(GEMMS), (r.name, r.fast_accum)
    for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert RECIPES[name].fast_accum == FPROP_FAST_ACCUM == ("fprop",), name
    assert RECIPES["delayed"].fast_accum == DELAYED_FAST_ACCUM == ("fprop", "wgrad")  # dgrad split (sessions 41-42)
    assert RECIPES["blockwise"].fast_accum == ()


def _torchao_accum(cfg) -> tuple[bool, bool, bool]:
    return (cfg.gemm_config_output.use_fast_accum, cfg.gemm_config_grad_input.use_fast_accum,
            cfg.gemm_config_grad_weight.use_fast_accum)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_configs_take_the_table_accumulation_or_the_option(recipe):
    assert _torchao_accum(float8_linear_config(recipe)) == (True, False, False)
    assert _torchao_accum(float8_linear_config(recipe, fast_accum=("wgrad", "dgrad"))) == (False, True, True)
    assert _torchao_accum(float8_linear_config(recipe, fast_accum=())) == (False, False, False)
    cfg = float8_linear_config(recipe, emulate=True, fast_accum=GEMMS)  # the other fields survive
    assert cfg.emulate and _torchao_accum(cfg) == (True, True, True)


def test_fast_accum_resolves_per_recipe_and_refuses_unknown_gemms():
    assert fast_accum_for("delayed") == ("fprop", "wgrad")
    assert fast_accum_for("delayed", ["fprop"]) == ("fprop",)
    assert fast_accum_for("delayed", ["wgrad", "fprop"]) == ("fprop", "wgrad")  # GEMMS order
    assert fast_accum_for("blockwise", ["fprop"]) == ()  # cuBLAS's blockwise GEMMs take none
    with pytest.raises(ConfigError, match=r"fp8.fast_accum: unknown GEMM\(s\) 'bwd'; choose from fprop, dgrad, wgrad"):
        fast_accum_for("tensorwise", ["bwd"])


def test_the_option_is_validated():
    from fp8kit.config import load_config
    from fp8kit.config.schema import FP8Config

    assert load_config(None, ['fp8.fast_accum=["fprop","wgrad"]']).fp8.fast_accum == ["fprop", "wgrad"]
    assert load_config(None, []).fp8.fast_accum is None
    assert load_config(None, ["fp8.fast_accum=all"]).fp8.fast_accum == ["fprop", "dgrad", "wgrad"]
    assert load_config(None, ["fp8.fast_accum=[]"]).fp8.fast_accum == []
    assert FP8Config(fast_accum="dgrad").fast_accum == ["dgrad"]
    assert FP8Config(fast_accum=("fprop",)).fast_accum == ["fprop"]
    assert FP8Config(**FP8Config().model_dump()).fast_accum is None  # a Python round trip keeps "unset"
    with pytest.raises(ConfigError, match="fp8.fast_accum.*lists fprop more than once"):
        load_config(None, ['fp8.fast_accum=["fprop","fprop"]'])
    with pytest.raises(ConfigError, match="fp8.fast_accum.*unknown value 'bwd'"):
        load_config(None, ['fp8.fast_accum=["bwd"]'])
    with pytest.raises(ConfigError, match='fp8.fast_accum.*"all" stands alone'):
        load_config(None, ['fp8.fast_accum=["fprop","all"]'])
    # --set turns "none" into null, which would read as "the recipe's default": refused, with both spellings
    with pytest.raises(ConfigError, match=r"--set fp8.fast_accum=none: fp8.fast_accum: none is ambiguous.*use \[\] "
                                          r"for no fast accumulation.*leave the key out"):
        load_config(None, ["fp8.fast_accum=none"])


_DGRAD = "fp8.fast_accum: dgrad with fast accumulation is faster but less accurate: on Llama-3-8B layers"


def _wgrad(recipe: str) -> str:
    return (f"fp8.fast_accum: wgrad with fast accumulation ended within 0.3% of BF16's loss with the delayed recipe in "
            f"short runs (Llama-3-8B layers, 400 steps, two runs: train loss +0.29% / -0.22%; llama-125m, 1200 steps: "
            f"validation loss -0.02%; docs/benchmarks.md section 6, session 42), not measured with {recipe!r}; check "
            f"convergence before relying on it")


@pytest.mark.parametrize("recipe,option,notes", [
    ("blockwise", '["fprop","dgrad"]', ["fp8.fast_accum: fprop, dgrad has no effect with fp8.recipe = 'blockwise'"]),
    ("rowwise_with_gw_hp", "all", ["fp8.fast_accum: wgrad has no effect with fp8.recipe = 'rowwise_with_gw_hp': its "
                                   "wgrad GEMM runs in bf16", _DGRAD]),
    ("rowwise_with_gw_hp", "wgrad", ["fp8.fast_accum: wgrad has no effect with fp8.recipe = 'rowwise_with_gw_hp'"]),
    ("delayed", "all", [_DGRAD]),
    ("delayed", "dgrad", [_DGRAD]),
    ("tensorwise", "all", [_DGRAD, _wgrad("tensorwise")]),
    ("tensorwise", "wgrad", [_wgrad("tensorwise")]),
    ("rowwise", '["fprop","wgrad"]', [_wgrad("rowwise")]),
    ("delayed", '["fprop","wgrad"]', []),  # the default, spelled out
    ("delayed", '["fprop"]', []),  # fprop only (torchao's and Transformer Engine's)
    ("delayed", "wgrad", []),
    ("delayed", None, []),
    ("tensorwise", None, []),  # the default (fprop) says nothing
    ("tensorwise", '["fprop"]', []),
    ("blockwise", None, []),
    ("blockwise", "[]", []),
    ("rowwise_with_gw_hp", None, []),
])
def test_what_a_recipe_cannot_take_is_warned_about(recipe, option, notes):
    """In ``decide_options``' warnings, which ``fp8kit train``, ``fp8kit plan`` and the library entry points show:
    one warning whose notes (joined by "; ") each start as expected, in order; the wgrad note whole."""
    import re

    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config

    cfg = load_config(None, [f"fp8.recipe={recipe}", "train.mixed_precision=fp8"]
                      + ([f"fp8.fast_accum={option}"] if option else []))
    got = [w for w in options_from_config(cfg).warnings if "fast_accum" in w]
    if not notes:
        assert got == [], got
    else:
        assert len(got) == 1, got
        parts = re.split(r"; (?=fp8\.fast_accum: )", got[0])
        assert len(parts) == len(notes) and all(p.startswith(n) for p, n in zip(parts, notes, strict=True)), parts
        assert all(p == n for p, n in zip(parts, notes, strict=True) if n.startswith("fp8.fast_accum: wgrad with")), parts
    bf16 = load_config(None, [f"fp8.recipe={recipe}", "train.mixed_precision=bf16"]
                       + ([f"fp8.fast_accum={option}"] if option else []))
    assert not [w for w in options_from_config(bf16).warnings if "fast_accum" in w]


def test_fp8_experts_note_reaches_the_training_run(small_run):
    """``fp8kit train``'s set-up carries the same warning (``Setup.warnings``, printed and kept in run_info.json)."""
    from fp8kit.config import load_config
    from fp8kit.train.setup import build_setup

    sets = [*small_run, "model.preset=tiny-moe", "train.mixed_precision=fp8", "selective.selective_fp8=false"]
    warned = [w for w in build_setup(load_config(None, [*sets, "fp8.fast_accum=[]"])).warnings if "fast_accum" in w]
    assert len(warned) == 1 and "applies to dense linears only" in warned[0], warned


def test_fp8_experts_get_a_note_that_the_option_is_for_dense_linears():
    """The library entry points warn (``decision_notes``, which ``fp8kit train`` and ``plan`` print too) when the
    option is set and MoE experts run in FP8; not without the option, nor in a BF16 run."""
    import warnings

    from fp8kit.config import FP8Config
    from fp8kit.config.options import decide_for_library
    from tests.conftest import tiny_moe_model

    def notes(fp8, mixed_precision="fp8"):
        model, _ = tiny_moe_model()
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            decisions = decide_for_library(model, fp8, None, mixed_precision=mixed_precision)
        assert any(d.is_fp8 and d.site.is_grouped for d in decisions) == (mixed_precision == "fp8"), decisions
        return [str(w.message) for w in rec if "fast_accum" in str(w.message)]

    got = notes(FP8Config(fast_accum=[]))
    assert len(got) == 1 and got[0].startswith("fp8.fast_accum = [] applies to dense linears only"), got
    assert notes(FP8Config()) == [], notes(FP8Config())
    assert notes(FP8Config(fast_accum=[]), "bf16") == []


def test_reports_and_policies_carry_the_accumulation():
    from fp8kit.selective.policy import check_compatible_reports, merge_reports, report_fast_accum

    # reports written before the key existed: the delayed recipe promoted every GEMM then, the others as now
    old_delayed, old_tensorwise = {"device": "H100", "recipe": "delayed"}, {"device": "H100", "recipe": "tensorwise"}
    assert report_fast_accum(old_delayed) == [] and report_fast_accum(old_tensorwise) == ["fprop"]
    assert report_fast_accum({**old_delayed, "fast_accum": ["wgrad", "fprop"]}) == ["fprop", "wgrad"]  # GEMMS order
    assert report_fast_accum({**old_delayed, "fast_accum": None}) == []  # null: as if absent
    assert report_fast_accum({**old_delayed, "fast_accum": "all"}) == list(GEMMS)  # hand-written forms
    assert report_fast_accum({**old_delayed, "fast_accum": "dgrad"}) == ["dgrad"]
    for bad in (["fprop", "bogus"], 1, {"fprop": True}, "fprop,dgrad"):
        with pytest.raises(PolicyError, match=r"x\.json: fast_accum must be a list of") as err:
            report_fast_accum({**old_delayed, "fast_accum": bad}, "x.json")
        assert repr(bad) in str(err.value), err.value
    check_compatible_reports([("a", old_delayed), ("b", {**old_delayed, "fast_accum": []})])
    with pytest.raises(PolicyError, match=r"reports differ in fast_accum: a has \[\], b has \['fprop'\]; a policy "
                                          r"must come from one device, recipe and fast accumulation"):
        check_compatible_reports([("a", old_delayed), ("b", {**old_delayed, "fast_accum": ["fprop"]})])
    report = {**old_tensorwise, "fast_accum": list(GEMMS), "measurements": [], "sites": []}
    assert merge_reports([("r.json", report)]).metadata["fast_accum"] == list(GEMMS)


def test_a_policy_measured_with_another_accumulation_is_warned_about():
    """The shipped delayed policies were measured before the delayed fprop took fast accumulation: a default run
    (fprop and wgrad fast) hears so; a run with every GEMM promoted, as then, does not; a BF16 run has nothing to
    hear."""
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config

    base = ["fp8.recipe=delayed", "selective.selective_fp8=policy",
            "selective.fp8_dynamic_policy_path=builtin:llama3-8b_delayed_h100"]
    for sets, want in (([], 1), (["fp8.fast_accum=[]"], 0), (["train.mixed_precision=bf16"], 0)):
        cfg = load_config(None, ["train.mixed_precision=fp8", *base, *sets])
        got = [w for w in options_from_config(cfg).warnings if "fast accumulation" in w]
        assert len(got) == want, (sets, got)
        assert all("was measured with fast accumulation in [], this run uses it in ['fprop', 'wgrad'] "
                   "(fp8.fast_accum)" in w
                   for w in got), got


def test_auto_cache_keys_tell_the_accumulations_apart():
    from fp8kit.bench.auto import FP8SiteOptions, shape_recipe_key
    from fp8kit.selective.auto import AutoShape

    shape = AutoShape(gemms=((4096, 4096),), num_tokens=8192)
    # spelled out always, the default too: a change of a recipe's default cannot reuse the old default's timings
    assert shape_recipe_key(shape, FP8SiteOptions("delayed"), None) == "delayed:fast_accum=fprop+wgrad"
    assert shape_recipe_key(shape, FP8SiteOptions("delayed", fast_accum=("fprop", "wgrad")), None) == \
        "delayed:fast_accum=fprop+wgrad"
    assert shape_recipe_key(shape, FP8SiteOptions("delayed", fast_accum=("fprop",)), None) == "delayed:fast_accum=fprop"
    assert shape_recipe_key(shape, FP8SiteOptions("delayed", fast_accum=GEMMS), None) == \
        "delayed:fast_accum=fprop+dgrad+wgrad"
    assert shape_recipe_key(shape, FP8SiteOptions("tensorwise"), None) == "tensorwise:fast_accum=fprop"
    assert shape_recipe_key(shape, FP8SiteOptions("tensorwise", fast_accum=()), None) == "tensorwise:fast_accum=none"
    assert shape_recipe_key(shape, FP8SiteOptions("rowwise_with_gw_hp", fast_accum=GEMMS), None) == \
        "rowwise_with_gw_hp:fast_accum=fprop+dgrad"  # its wgrad runs in bf16
    assert shape_recipe_key(shape, FP8SiteOptions("blockwise", fast_accum=GEMMS), None) == "blockwise"  # takes none anyway
    grouped = AutoShape(gemms=((2048, 768),), num_tokens=8192, num_gemms=128)
    assert shape_recipe_key(grouped, FP8SiteOptions("tensorwise"), "grouped:fused") == "grouped:fused"  # the experts' kernels


@pytest.mark.parametrize("fused,option,forward,dgrad,wgrad", [
    (True, None, True, False, True), (False, None, True, False, True),  # the default: fprop, wgrad fast; dgrad split
    (True, '["dgrad"]', False, True, False), (False, '["fprop","dgrad","wgrad"]', True, True, True),
    (True, "[]", False, False, False), (False, '["fprop"]', True, False, False),
])
def test_delayed_gemms_accumulate_as_configured(fused, option, forward, dgrad, wgrad):
    """Three steps of a two-layer llama: the delayed linears (step 1, dynamic scales; every step unfused) and the
    fused delayed MLP (steps 2-3) call their forward and backward GEMMs with the accumulation asked for. (torchao's
    linears call ``_scaled_mm`` from a tensor subclass, below a dispatch mode: their config is checked above.)"""
    sets = ["fp8.recipe=delayed", f"fp8.delayed_fused_mlp={str(fused).lower()}"]
    model, _ = prepared_llama(sets + ([f"fp8.fast_accum={option}"] if option else []))
    out_features = {m.weight.shape[0] for m in model.modules() if getattr(m, "weight", None) is not None
                    and m.weight.dim() == 2}
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, 1024, (2, 64), generator=gen)
        model.zero_grad(set_to_none=True)
        with _ScaledMMCalls() as fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with _ScaledMMCalls() as bwd:
            loss.backward()
        # 2 layers x 7 linears (the head stays BF16): 14 forward GEMMs, 28 backward: 14 wgrad (K = the tokens)
        # and 14 dgrad (K = a linear's output features, 768 or 2048 in llama-125m: never the token count)
        assert fwd.fast == [forward] * 14, f"step {step}: forward use_fast_accum {fwd.fast}"
        tokens = ids.numel()
        assert tokens not in out_features, (tokens, out_features)
        got_w = [f for f, k in zip(bwd.fast, bwd.k, strict=True) if k == tokens]
        got_d = [f for f, k in zip(bwd.fast, bwd.k, strict=True) if k != tokens]
        assert got_w == [wgrad] * 14, f"step {step}: wgrad use_fast_accum {got_w} (K {bwd.k})"
        assert got_d == [dgrad] * 14, f"step {step}: dgrad use_fast_accum {got_d} (K {bwd.k})"


def _synthetic_report(fast_accum):
    """A tensorwise bench-layers report whose qkv site runs 1.5x faster in FP8 from 1024 tokens on."""
    ms = []
    for tokens in (1024, 4096):
        site = {"site": "qkv", "component": "llm", "module_kind": "layernorm_column", "ub_name": "qkv",
                "num_tokens": tokens, "tp": 1, "etp": None, "num_gemms": None}
        ms += [{**site, "precision": "bf16", "ms": 1.5}, {**site, "precision": "fp8", "ms": 1.0}]
    return {"device": "NVIDIA H100", "device_type": "cuda", "recipe": "tensorwise", "tp": 1,
            "fast_accum": fast_accum, "measurements": ms}


def test_a_forced_merge_of_different_accumulations_records_each_and_warns(tmp_path, capsys):
    """``merge-policy --force`` over reports timed with different ``fp8.fast_accum``: the policy claims no one
    setting (``"mixed"``), each report's entry carries its own, and a run with the policy hears that it mixes
    settings, whatever its own accumulation (one that matches either report included)."""
    import json

    from fp8kit.cli.main import main
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.selective.policy import MIXED_FAST_ACCUM, load_policy, merge_reports, report_fast_accum

    a, b, policy = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "policy.json"
    a.write_text(json.dumps(_synthetic_report(["fprop"])))
    b.write_text(json.dumps(_synthetic_report(list(GEMMS))))
    assert main(["merge-policy", "--reports", str(a), str(b), "--output", str(policy)]) != 0  # refused unforced
    assert "reports differ in fast_accum" in capsys.readouterr().err
    assert main(["merge-policy", "--reports", str(a), str(b), "--output", str(policy), "--force"]) == 0
    meta = load_policy(str(policy)).metadata
    assert meta["fast_accum"] == MIXED_FAST_ACCUM == "mixed", meta
    assert report_fast_accum(meta) == MIXED_FAST_ACCUM, report_fast_accum(meta)  # no GEMM list read from it
    each = [(r["name"], r["fast_accum"]) for r in meta["reports"]]
    assert each == [("a.json", ["fprop"]), ("b.json", ["fprop", "dgrad", "wgrad"])], each
    sets = ["train.mixed_precision=fp8", "fp8.recipe=tensorwise", "selective.selective_fp8=policy",
            f"selective.fp8_dynamic_policy_path={policy}"]
    for extra, now in (([], ["fprop"]), (["fp8.fast_accum=all"], list(GEMMS)), (["fp8.fast_accum=[]"], [])):
        warned = [w for w in options_from_config(load_config(None, sets + extra)).warnings
                  if "fast accumulation" in w and "less accurate" not in w]  # not the backward GEMMs' accuracy note
        assert warned == [f"policy {policy} was merged (merge-policy --force) from reports measured with different "
                          f"fast accumulation (a.json: ['fprop']; b.json: ['fprop', 'dgrad', 'wgrad']): its "
                          f"thresholds mix settings; this run uses it in {now} (fp8.fast_accum)"], (extra, warned)
    # reports that agree still give the one setting, each entry its own
    same = merge_reports([(f"r{i}.json", _synthetic_report(["fprop"])) for i in range(2)]).metadata
    assert same["fast_accum"] == ["fprop"] and [r["fast_accum"] for r in same["reports"]] == [["fprop"]] * 2, same


@pytest.mark.parametrize("sets,want", [
    (["fp8.recipe=delayed"], ["fprop", "wgrad"]),  # the table's default, as DelayedScaling took it
    (["fp8.recipe=delayed", 'fp8.fast_accum=["dgrad","fprop"]'], ["fprop", "dgrad"]),  # GEMMS order
    (["fp8.recipe=tensorwise"], ["fprop"]),  # torchao's default
    (["fp8.recipe=tensorwise", "fp8.fast_accum=all"], list(GEMMS)),
    (["fp8.recipe=rowwise_with_gw_hp", "fp8.fast_accum=all"], ["fprop", "dgrad"]),  # its wgrad runs in bf16
    (["fp8.recipe=blockwise", "fp8.fast_accum=all"], []),  # cuBLAS's blockwise GEMMs take none
    (["train.mixed_precision=bf16", "fp8.fast_accum=all"], None),  # no FP8 GEMM at all
    (["fp8.recipe=delayed", "fp8.exclude=[\"*\"]"], None),  # FP8 run, but no dense linear decided FP8
])
def test_the_run_records_the_accumulation_its_conversion_took(sets, want):
    from fp8kit.config import load_config
    from fp8kit.config.options import conversion_options_for, options_from_config
    from fp8kit.models.build import build_model
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites
    from fp8kit.train.setup import run_fast_accum

    cfg = load_config(None, ["train.mixed_precision=fp8", "selective.selective_fp8=false", *sets])
    model = build_model(cfg.model.model_copy(update={"num_layers": 1}), 512, device=torch.device("meta"),
                        dtype=torch.bfloat16, seed=0)
    decisions = decide(find_sites(model), options_from_config(cfg))
    got = run_fast_accum(cfg, conversion_options_for(cfg.fp8), decisions)
    assert got == want, (sets, got, sum(d.is_fp8 for d in decisions))


def test_the_resume_note_names_both_accumulations_and_the_checkpoint():
    from pathlib import Path

    from fp8kit.train.setup import fast_accum_resume_note

    ck = Path("runs/a/checkpoints/step_000004")
    for state, now in (({}, ["fprop"]),  # saved before the key existed: nothing to say
                       ({"fast_accum": None}, ["fprop"]), ({"fast_accum": ["fprop"]}, None),  # a BF16 run on a side
                       ({"fast_accum": ["fprop"]}, ["fprop"]), ({"fast_accum": ["wgrad", "fprop"]}, ["fprop", "wgrad"])):
        assert fast_accum_resume_note(ck, state, now) is None, (state, now, fast_accum_resume_note(ck, state, now))
    note = fast_accum_resume_note(ck, {"fast_accum": []}, ["fprop"])
    assert note == ("--resume 'runs/a/checkpoints/step_000004': the checkpoint's run used fast accumulation in [], "
                    "this run uses it in ['fprop'] (fp8.fast_accum): the FP8 GEMMs' numerics change from here on; "
                    "resume with --set 'fp8.fast_accum=[]' to keep the checkpoint's"), note


def test_checkpoints_record_the_accumulation_and_a_resume_with_another_says_so(small_run, tmp_path):
    """A delayed run of 2 steps saves its GEMMs with fast accumulation in its checkpoints; resuming from step 1 with
    ``fp8.fast_accum = "all"`` prints a warning naming both settings and the checkpoint (and records it in
    run_info.json). (The same setting saying nothing: the note's unit test above.)"""
    import io
    import json

    from rich.console import Console

    from fp8kit.config import load_config
    from fp8kit.train import checkpoint as ckpt
    from fp8kit.train.trainer import train

    base = [*small_run, "selective.selective_fp8=false", "train.mixed_precision=fp8", "fp8.recipe=delayed",
            "train.steps=2", "train.checkpoint_every=1"]
    train(load_config(None, base), tmp_path / "full")
    ck = tmp_path / "full" / "checkpoints" / "step_000001"
    saved = ckpt.load_train_state(ck).get("fast_accum", "<missing>")
    assert saved == ["fprop", "wgrad"], f"the checkpoint's fast_accum: {saved!r}"

    def resumed(name: str, *sets: str) -> tuple[str, list[str]]:
        out = io.StringIO()
        train(load_config(None, [*base, *sets]), tmp_path / name, resume=ck,
              console=Console(file=out, width=100_000, soft_wrap=True))
        return out.getvalue(), json.loads((tmp_path / name / "run_info.json").read_text())["warnings"]

    info = json.loads((tmp_path / "full" / "run_info.json").read_text())
    assert info["fast_accum"] == ["fprop", "wgrad"], info.get("fast_accum", "<missing>")  # the run says it too
    printed, said = resumed("all", "fp8.fast_accum=all")
    assert "fp8 delayed (fast accumulation: fprop, dgrad, wgrad) on" in printed, printed  # the start line says it
    summary = json.loads((tmp_path / "all" / "summary.json").read_text())
    assert summary["precision"] == "fp8 delayed (fast accumulation: fprop, dgrad, wgrad)", summary["precision"]
    note = (f"--resume {str(ck)!r}: the checkpoint's run used fast accumulation in ['fprop', 'wgrad'], this run uses "
            f"it in "
            f"['fprop', 'dgrad', 'wgrad'] (fp8.fast_accum)")
    assert any(w.startswith(note) for w in said), said
    assert f"warning: {note}" in printed, printed


def test_the_precision_line_names_the_accumulation_and_the_bf16_phases():
    from fp8kit.config import load_config
    from fp8kit.train.trainer import _precision_desc

    cfg = load_config(None, ["train.mixed_precision=fp8", "fp8.recipe=delayed"])
    assert _precision_desc(cfg, ["fprop", "wgrad"]) == "fp8 delayed (fast accumulation: fprop, wgrad)"
    assert _precision_desc(cfg, []) == "fp8 delayed (fast accumulation: none)"
    assert _precision_desc(cfg, None) == "fp8 delayed"  # no dense linear in FP8: nothing to say
    phased = load_config(None, ["train.mixed_precision=fp8", "fp8.recipe=delayed", "fp8.bf16_warmup_steps=5"])
    got = _precision_desc(phased, ["fprop", "wgrad"])
    assert got == "fp8 delayed (fast accumulation: fprop, wgrad; bf16 warmup 5, cooldown 0 steps)", got
    assert _precision_desc(load_config(None, ["train.mixed_precision=bf16"]), ["fprop"]) == "bf16"
