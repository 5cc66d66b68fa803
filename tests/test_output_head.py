"""``fp8.output_head``: the output head (lm_head) as an FP8 site on request: the static rule, a tied head, the
recipe's dims, the warning when it still stays BF16, training through ``fp8kit train`` (eager and compiled), and
resume with the delayed recipe's amax history of the head."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from fp8kit.config import ModelConfig, load_config
from fp8kit.config.options import decide_for_library
from fp8kit.config.schema import FP8Config
from fp8kit.models.build import build_model
from fp8kit.selective.decide import DecideOptions, decide, decision_notes
from fp8kit.selective.sites import find_sites
from fp8kit.train.trainer import train


def _llama(vocab: int, tied: bool = False) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _head(model, **kw):
    options = DecideOptions(**kw)
    decisions = decide(find_sites(model), options)
    return next(d for d in decisions if d.fqn == "lm_head"), decision_notes(decisions, options)


def test_the_head_stays_bf16_unless_asked_and_then_follows_the_other_rules():
    """Off (the default): the static rule ``head`` keeps it BF16 and names the option; on: FP8 with each recipe."""
    model = build_model(ModelConfig(preset="tiny"), 1024, device="meta")
    head, notes = _head(model)
    assert (head.precision, head.rule) == ("bf16", "head") and "fp8.output_head = true" in head.reason, head.reason
    assert notes == []
    for recipe in ("tensorwise", "delayed", "blockwise"):
        head, notes = _head(model, recipe=recipe, output_head=True)
        assert head.is_fp8 and head.recipe == recipe and notes == [], (recipe, head.rule, head.reason)
    # a BF16 run: no FP8 head and nothing to warn about
    head, notes = _head(model, output_head=True, mixed_precision="bf16")
    assert not head.is_fp8 and notes == []


def test_a_head_the_rules_keep_bf16_is_said_to_stay_bf16():
    """With the option on, a tied head, a vocabulary off the recipe's block multiple and ``fp8.exclude`` still keep
    the head BF16, each with its reason in the decision and in the warning."""
    tied, notes = _head(_llama(1024, tied=True), output_head=True)
    assert (tied.precision, tied.rule) == ("bf16", "head-tied") and tied.site.tied, tied.reason
    assert notes == [f"fp8.output_head = true, but lm_head stays BF16: {tied.reason}"], notes
    # vocabulary 1040: a multiple of 16 (per-tensor recipes) but not of blockwise's 128-element blocks
    odd, notes = _head(_llama(1040), recipe="blockwise", output_head=True)
    assert (odd.precision, odd.rule) == ("bf16", "dims%128") and "out_features=1040" in notes[0], notes
    assert _head(_llama(1040), recipe="tensorwise", output_head=True)[0].is_fp8
    excluded, notes = _head(_llama(1024), output_head=True, exclude=("lm_head",))
    assert not excluded.is_fp8 and len(notes) == 1, notes


def test_a_policy_has_no_rule_for_a_head_so_it_stays_bf16_with_a_warning():
    """Seed 000's policies time the blocks' module kinds only (no ``head`` kind): with a policy the head stays BF16,
    and the run says so."""
    from fp8kit.selective.decide import Selective
    from fp8kit.selective.policy import load_policy

    sel = Selective({"*": load_policy("builtin:llama3-8b_delayed_h100")}, {"*": 65536})
    head, notes = _head(build_model(ModelConfig(preset="tiny"), 1024, device="meta"), recipe="delayed",
                        output_head=True, selective=sel)
    assert (head.precision, head.rule) == ("bf16", "policy") and "no rule for module kind 'head'" in head.reason
    assert notes == [f"fp8.output_head = true, but lm_head stays BF16: {head.reason}"], notes


def test_library_entry_points_warn_when_the_head_stays_bf16():
    """``convert_to_fp8`` / ``prepare_for_trainer`` decide through ``decide_for_library``: a UserWarning there."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = decide_for_library(_llama(1024, tied=True), FP8Config(output_head=True), None)
    assert not next(d for d in decisions if d.fqn == "lm_head").is_fp8
    assert any("lm_head stays BF16" in str(w.message) and "tied" in str(w.message) for w in caught), \
        [str(w.message) for w in caught]


#: every eligible site in FP8 on any device (on CUDA the default selective_fp8 = auto would time this tiny model's
#: sites and keep them BF16)
FULL = ["selective.selective_fp8=false"]


def _cfg(small_run, *extra):
    return load_config(None, [*small_run, *FULL, "train.checkpoint_every=0", *extra])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_training_with_an_fp8_head_converts_it_and_learns(small_run, tmp_path, recipe):
    """The tiny model's FP8 block linears plus its head in FP8; the loss falls, and its first steps stay within
    3% of the run whose head is BF16 (same data, same seed: the head's quantization is the only difference)."""
    sets = ["train.steps=12", "train.lr=1e-3", f"fp8.recipe={recipe}"]
    with_head = train(_cfg(small_run, *sets, "fp8.output_head=true"), tmp_path / "head").metrics
    without = train(_cfg(small_run, *sets), tmp_path / "nohead").metrics
    blocks = without[0]["fp8_modules"]  # 14 (blockwise: 8, the 688-wide MLPs are not multiples of 128)
    assert blocks == (8 if recipe == "blockwise" else 14) and all(r["fp8_modules"] == blocks for r in without)
    assert all(r["fp8_modules"] == blocks + 1 for r in with_head), [r["fp8_modules"] for r in with_head]
    for run, precision in (("head", "fp8"), ("nohead", "bf16")):
        sites = json.loads((tmp_path / run / "conversion_report.json").read_text())["sites"]
        assert [s["precision"] for s in sites if s["fqn"] == "lm_head"] == [precision], run
    gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(with_head, without, strict=True)]
    assert max(gaps[:4]) < 0.03, f"loss gap with the head in FP8: {gaps}"
    losses = [r["loss"] for r in with_head]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses  # it learns (measured: about 0.5 in 12 steps)


@pytest.mark.slow
def test_delayed_head_resumes_bit_exact(small_run, tmp_path):
    """The head's amax history is checkpointed with the blocks' (resume continues bit for bit); a resume that
    changes the option is warned about."""
    base = ["train.steps=6", "train.checkpoint_every=3", "fp8.recipe=delayed", "fp8.output_head=true",
            "train.lr=1e-3", *FULL]
    full = train(load_config(None, [*small_run, *base]), tmp_path / "full").metrics
    resumed = train(load_config(None, [*small_run, *base]), tmp_path / "resumed",
                    resume=tmp_path / "full" / "checkpoints" / "step_000003")
    assert [r["loss"] for r in resumed.metrics] == [r["loss"] for r in full[3:]]
    # resumed with the head back in BF16: allowed, and said
    base[3] = "fp8.output_head=false"
    train(load_config(None, [*small_run, *base]), tmp_path / "bf16head", resume=tmp_path / "full" / "checkpoints" /
          "step_000003")
    said = json.loads((tmp_path / "bf16head" / "run_info.json").read_text())["warnings"]
    assert any("the output head ran in FP8 in the checkpoint's run and runs in BF16 from here on" in w
               for w in said), said


def _compiled(module) -> bool:
    return module._compiled_call_impl is not None


def test_the_fp8_head_is_compiled_by_prepare_the_schedule_and_the_guard(small_run):
    """Under train.compile the FP8 head, outside the compiled blocks, is compiled itself: by prepare_model, again
    after the precision schedule swaps it in, and after the divergence guard's BF16 window for it ends (each swap
    makes a new, uncompiled module). A BF16 head is left as it is."""
    from fp8kit.train.guard import DivergenceGuard
    from fp8kit.train.loop import set_precision
    from fp8kit.train.setup import build_setup

    sets = [*small_run, *FULL, "fp8.recipe=delayed", "fp8.output_head=true", "train.compile=true"]
    setup = build_setup(load_config(None, sets))
    assert type(setup.model.lm_head).__name__ == "Float8DelayedLinear" and _compiled(setup.model.lm_head)

    setup = build_setup(load_config(None, [*sets, "fp8.bf16_warmup_steps=1"]))
    assert type(setup.model.lm_head) is nn.Linear and not _compiled(setup.model.lm_head)  # the BF16 phase
    set_precision(setup, "fp8")
    assert type(setup.model.lm_head).__name__ == "Float8DelayedLinear" and _compiled(setup.model.lm_head)

    guard = DivergenceGuard(setup)
    guard.forced = {"lm_head": 1}  # as a recovery sets it: BF16 until step 1
    guard.before_step(0, "fp8", say=lambda _: None)
    assert type(setup.model.lm_head) is nn.Linear
    guard.before_step(1, "fp8", say=lambda _: None)
    assert type(setup.model.lm_head).__name__ == "Float8DelayedLinear" and _compiled(setup.model.lm_head)


def test_plan_shows_the_fp8_head_and_warns_when_it_stays_bf16(capsys):
    """``fp8kit plan`` lists the head's decision and prints the warning a training run would."""
    from fp8kit.cli.main import main

    assert main(["plan", "--set", "model.preset=tiny", "--set", "fp8.output_head=true", "--json"]) == 0
    rows = {r["fqn"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["lm_head"]["precision"] == "fp8", rows["lm_head"]
    # llama3-1b ties its head to the embedding: planned BF16, and the warning says why
    assert main(["plan", "--set", "model.preset=llama3-1b", "--set", "fp8.output_head=true"]) == 0
    out = capsys.readouterr().out
    assert "fp8.output_head = true, but lm_head stays BF16: output head tied to the input embedding" in \
        " ".join(out.split()), out[-2000:]


def test_only_an_fp8_head_is_compiled_whatever_its_class():
    """``compile_fp8_heads`` compiles the head while it is an FP8 linear, and not in a BF16 phase, also when the BF16
    module's class is a subclass of ``nn.Linear`` (FSDP2's ``fully_shard`` makes it one); a compiled head is left."""
    from fp8kit.config.options import conversion_options_for
    from fp8kit.parallel.convert import apply_fp8
    from fp8kit.parallel.prepare import compile_fp8_heads

    model = _llama(1024)
    options = DecideOptions(output_head=True, recipe="tensorwise")
    decisions = decide(find_sites(model), options)
    assert next(d for d in decisions if d.fqn == "lm_head").is_fp8

    class ShardedLinear(nn.Linear):  # the shape of FSDP2's dynamic subclass of a BF16 head
        pass

    model.lm_head.__class__ = ShardedLinear
    assert compile_fp8_heads(model, decisions, cuda_graphs=False) == [], "a BF16 head (nn.Linear subclass) compiled"
    model.lm_head.__class__ = nn.Linear
    apply_fp8(model, decisions, conversion_options_for(FP8Config(recipe="tensorwise", emulate=True)))
    assert compile_fp8_heads(model, decisions, cuda_graphs=False) == ["lm_head"]
    assert compile_fp8_heads(model, decisions, cuda_graphs=False) == [], "compiled twice"
