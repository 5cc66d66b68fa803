"""Config loading, --set overrides, validation messages, and the generated reference."""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path

import pytest

from fp8kit.base.errors import ConfigError
from fp8kit.config import (
    FP8Config,
    RunConfig,
    SelectiveConfig,
    TrainConfig,
    config_reference_markdown,
    load_config,
    save_config,
)
from fp8kit.fp8.recipes import RECIPE_NAMES

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_embedded_default():
    cfg = load_config()
    assert cfg.model.preset == "tiny"
    assert cfg.data.paths == []
    assert cfg.train.mixed_precision == "fp8"
    assert cfg.fp8.recipe == "tensorwise"


def test_toml_and_yaml_load_the_same(tmp_path):
    (tmp_path / "a.toml").write_text('[train]\nsteps = 7\nlr = 1\n[fp8]\nrecipe = "rowwise"\nexclude = ["lm_head"]\n')
    (tmp_path / "a.yaml").write_text("train:\n  steps: 7\n  lr: 1\nfp8:\n  recipe: rowwise\n  exclude: [lm_head]\n")
    a, b = load_config(tmp_path / "a.toml"), load_config(tmp_path / "a.yaml")
    assert a == b
    assert a.train.steps == 7 and a.train.lr == 1.0 and isinstance(a.train.lr, float)


def test_set_overrides_parse_by_type():
    cfg = load_config(None, [
        "train.steps=12", "train.lr=2e-4", "train.compile=true", "fp8.include=layers.*.mlp,re:q_proj",
        "model.num_layers=3", "data.tokenizer=none", 'fp8.exclude=["lm_head", "layers.0"]',
    ])
    assert cfg.train.steps == 12 and cfg.train.lr == 2e-4 and cfg.train.compile is True
    assert cfg.fp8.include == ["layers.*.mlp", "re:q_proj"]
    assert cfg.fp8.exclude == ["lm_head", "layers.0"]
    assert cfg.model.num_layers == 3 and cfg.data.tokenizer is None


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=5", "fp8.bf16_warmup_steps=2", "model.num_layers=2"])
    save_config(cfg, tmp_path / "r.toml")
    assert load_config(tmp_path / "r.toml") == cfg


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.mixed_precison=fp8"], "unknown key 'train.mixed_precison'; did you mean 'train.mixed_precision'?"),
        (["train.recipe=rowwise"], "unknown key 'train.recipe'; did you mean 'fp8.recipe'?"),
        (["trian.steps=3"], "unknown section [trian]; did you mean [train]?"),
        (["train.steps=ten"], "--set train.steps=ten: expected an integer, got 'ten'"),
        (["model.preset=llama3-8"], "unknown value 'llama3-8' (did you mean 'llama3-8b'?)"),
        (["fp8.recipe=rowwize"], "unknown value 'rowwize' (did you mean 'rowwise'?)"),
        (["train.mixed_precision=fp16"], "choose one of bf16, fp8"),
        (["train.steps=0"], "--set train.steps=0: must be > 0, got 0"),
        (["fp8.bf16_warmup_steps=80", "fp8.bf16_cooldown_steps=30"], "exceed train.steps (100)"),
        (["fp8.include=re:(unclosed"], "invalid regex '(unclosed'"),
        (["train.device=tpu"], "unknown device 'tpu'"),
        (["train.steps"], "expected section.key=value"),
    ],
)
def test_bad_values_name_key_and_fix(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_file_errors_name_the_file(tmp_path):
    bad_type = tmp_path / "t.toml"
    bad_type.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"t\.toml: train\.steps: expected an integer, got 'ten' \(str\)"):
        load_config(bad_type)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "b.toml"
    broken.write_text("[train\nsteps=1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="unknown extension '.json'"):
        (tmp_path / "c.json").write_text("{}")
        load_config(tmp_path / "c.json")


def test_yaml_is_parsed_safely(tmp_path):
    """A YAML tag that would construct a Python object is refused, not executed."""
    evil = tmp_path / "evil.yaml"
    evil.write_text("train: !!python/object/apply:os.system ['touch pwned']\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(evil)
    assert not Path("pwned").exists()


def test_config_reference_is_current():
    """docs/config.md is generated from the models: regenerate with `fp8kit config-docs --output docs/config.md`."""
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert doc == config_reference_markdown()


def test_every_key_is_documented():
    text = config_reference_markdown()
    for section, obj in vars(RunConfig()).items():
        for key in vars(obj):
            assert f"`{key}`" in text, f"{section}.{key} missing from the reference"


# ----------------------------------------------------------------------------------------------
# [selective]: the measured per-module choice, split from [fp8]; its old [fp8] place still works

SELECTIVE_TOML = '[fp8]\nrecipe = "rowwise"\nselective_fp8 = true\nfp8_dynamic_policy_path = "p.json"\n' \
    "fp8_dynamic_num_tokens = 512\ncomponent_num_tokens = {vision = 64}\n"


def test_old_fp8_selective_keys_in_a_file_move_to_selective(tmp_path):
    (tmp_path / "old.toml").write_text(SELECTIVE_TOML)
    (tmp_path / "old.yaml").write_text("fp8:\n  recipe: rowwise\n  selective_fp8: true\n  fp8_dynamic_policy_path: "
                                       "p.json\n  fp8_dynamic_num_tokens: 512\n  component_num_tokens: {vision: 64}\n")
    (tmp_path / "new.toml").write_text('[fp8]\nrecipe = "rowwise"\n[selective]\nselective_fp8 = true\n'
                                       'fp8_dynamic_policy_path = "p.json"\nfp8_dynamic_num_tokens = 512\n'
                                       "component_num_tokens = {vision = 64}\n")
    old, old_yaml, new = (load_config(tmp_path / n) for n in ("old.toml", "old.yaml", "new.toml"))
    assert old == new == old_yaml
    assert old.selective == SelectiveConfig(selective_fp8=True, fp8_dynamic_policy_path="p.json",
                                            fp8_dynamic_num_tokens=512, component_num_tokens={"vision": 64})
    assert old.fp8.recipe == "rowwise"
    assert len(old.notes) == 4 and new.notes == [], old.notes
    assert all("\n" not in n and "old.toml" in n for n in old.notes), old.notes
    assert "fp8.selective_fp8: moved to selective.selective_fp8" in old.notes[0], old.notes[0]


def test_old_fp8_selective_keys_on_the_command_line_move_to_selective():
    old = load_config(None, ["fp8.selective_fp8=on", "fp8.fp8_dynamic_policy_path=p.json", "fp8.fp8_dynamic_num_tokens=1_024",
                             "fp8.component_policy_paths={vision='v.json'}"])
    new = load_config(None, ["selective.selective_fp8=on", "selective.fp8_dynamic_policy_path=p.json",
                             "selective.fp8_dynamic_num_tokens=1_024", "selective.component_policy_paths={vision='v.json'}"])
    assert old == new and old.selective.fp8_dynamic_num_tokens == 1024
    assert old.selective.component_policy_paths == {"vision": "v.json"}
    assert old.notes[0].startswith("--set fp8.selective_fp8=on: moved to selective.selective_fp8"), old.notes
    # the same value in both places is fine; a --set of the new key overrides the old one of the file
    assert load_config(None, ["fp8.fp8_dynamic_num_tokens=8", "selective.fp8_dynamic_num_tokens=8"]).selective \
        .fp8_dynamic_num_tokens == 8


def test_old_and_new_place_with_different_values_is_an_error(tmp_path):
    both = tmp_path / "both.toml"
    both.write_text("[fp8]\nfp8_dynamic_num_tokens = 512\n[selective]\nfp8_dynamic_num_tokens = 1024\n")
    with pytest.raises(ConfigError) as e:
        load_config(both)
    msg = str(e.value)
    assert "\n" not in msg and f"{both}: " in msg, msg
    assert "fp8_dynamic_num_tokens = 1024 conflicts with" in msg and "fp8.fp8_dynamic_num_tokens = 512" in msg, msg
    with pytest.raises(ConfigError) as e:
        load_config(None, ["fp8.selective_fp8=true", "selective.selective_fp8=false"])
    msg = str(e.value)
    assert msg.startswith("--set selective.selective_fp8=false conflicts with --set fp8.selective_fp8=true"), msg
    # a file key may be overridden on the command line in the other place
    (tmp_path / "p.toml").write_text("[fp8]\nfp8_dynamic_num_tokens = 512\n")
    assert load_config(tmp_path / "p.toml", ["selective.fp8_dynamic_num_tokens=64"]).selective.fp8_dynamic_num_tokens == 64


@pytest.mark.parametrize(
    "line, expected",
    [
        ('steps = "3"', "train.steps: expected an integer, got '3' (str)"),
        ("steps = 3.0", "train.steps: expected an integer, got 3.0 (float)"),
        ("steps = true", "train.steps: expected an integer, got True (bool)"),
        ("lr = true", "train.lr: expected a float, got True (bool)"),
        ('compile = "yes"', "train.compile: expected a boolean, got 'yes' (str)"),
        ("lr = inf", "train.lr: must be a finite number, got inf"),
        ('device = "cuda:x"', "train.device: unknown device 'cuda:x'"),
        ("min_lr_ratio = 2", "train.min_lr_ratio: must be in [0, 1], got 2"),
        ("steps_ = 3", "unknown key 'train.steps_'; did you mean 'train.steps'?"),
        ("selective_fp8 = true", "unknown key 'train.selective_fp8'; did you mean 'selective.selective_fp8'?"),
    ],
)
def test_file_values_of_the_wrong_type_or_out_of_range(tmp_path, line, expected):
    f = tmp_path / "t.toml"
    f.write_text(f"[train]\n{line}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert msg.startswith(f"{f}: {expected}"), msg
    assert "\n" not in msg and "pydantic" not in msg, msg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.steps=true", "--set train.steps=true: expected an integer, got 'true'"),
        ("train.compile=maybe", "--set train.compile=maybe: expected a boolean, got 'maybe'"),
        ("data.paths=[1, 2]", "--set data.paths=[1, 2]: expected a list of strings, got '[1, 2]'"),
        ("selective.component_num_tokens={vision=0}",
         "--set selective.component_num_tokens={vision=0}: selective.component_num_tokens.vision: must be > 0, got 0"),
        ("fp8.selective_fp8=true", "--set fp8.selective_fp8=true: is true but no policy is given"),
        ("fp8.fp8_dynamic_num_tokens=0", "--set fp8.fp8_dynamic_num_tokens=0: must be > 0, got 0"),
        ("fp8.recipe=rowwise", None),
    ],
)
def test_set_values_of_the_wrong_type_or_out_of_range(override, expected):
    overrides = [override] + (["fp8.enable_fsdp_float8_all_gather=true"] if expected is None else [])
    expected = expected or ("--set fp8.enable_fsdp_float8_all_gather=true: FP8 all-gather runs with the tensorwise "
                            "(torchao), delayed and blockwise (fp8kit) recipes only, not 'rowwise'")
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(expected), str(e.value)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise"])
def test_fp8kit_e4m3_all_gather_with_tensor_parallel_is_refused(recipe):
    """fp8kit's FSDP2 E4M3 all-gathers (fp8.delayed_all_gather, fp8.blockwise_all_gather) are not built for TP
    shards: one clear line at config load, naming the key, tp and both ways on; without tp it loads."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"fp8.recipe={recipe}", "fp8.enable_fsdp_float8_all_gather=true", "distributed.tp=2"])
    assert str(e.value) == (
        f"--set fp8.enable_fsdp_float8_all_gather=true: the {recipe} recipe's E4M3 all-gather "
        f"(fp8kit.fp8.{recipe}_all_gather) runs without tensor parallel only, not with distributed.tp = 2 (its "
        "weights are TP shards there: not built); set it false (BF16 all-gather) or distributed.tp = 1"), str(e.value)
    cfg = load_config(None, [f"fp8.recipe={recipe}", "fp8.enable_fsdp_float8_all_gather=true", "distributed.dp_shard=2"])
    assert cfg.fp8.enable_fsdp_float8_all_gather is True


@pytest.mark.parametrize("raw, value", [
    ('["fprop", "dgrad"]', ["fprop", "dgrad"]),  # TOML
    ("[fprop,dgrad]", ["fprop", "dgrad"]),  # bare words in brackets: what a shell leaves of the quoted form
    ("[ fprop ]", ["fprop"]),
    ("fprop,dgrad", ["fprop", "dgrad"]),
    ("[]", []),
])
def test_set_lists_take_toml_bare_words_in_brackets_or_commas(raw, value):
    assert load_config(None, [f"fp8.fast_accum={raw}"]).fp8.fast_accum == value


@pytest.mark.parametrize("raw", ["[fprop,[dgrad]]", "['fprop', dgrad]", "[fprop", "[,]", "[fprop,,dgrad]",
                                 "[fprop dgrad]"])
def test_set_lists_that_are_neither_toml_nor_bare_words_are_refused(raw):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"fp8.fast_accum={raw}"])
    assert str(e.value).startswith(f"--set fp8.fast_accum={raw}: expected a list of strings or none"), str(e.value)


def test_resolved_config_writes_the_new_layout_and_loads_back_equal(tmp_path):
    cfg = load_config(None, ["fp8.selective_fp8=true", "fp8.fp8_dynamic_policy_path=p.json",
                             "selective.component_num_tokens={vision=64}", "train.lr=3e-4", "fp8.exclude=lm_head",
                             "fp8.enable_fsdp_float8_all_gather=false", "distributed.dp_shard=2"])
    save_config(cfg, tmp_path / "resolved_config.toml")
    saved = tomllib.loads((tmp_path / "resolved_config.toml").read_text())
    assert saved["selective"]["selective_fp8"] is True and "selective_fp8" not in saved["fp8"], saved
    assert "fp8_dynamic_num_tokens" not in saved["selective"]  # None is left out, loads back as None
    back = load_config(tmp_path / "resolved_config.toml")
    assert back == cfg and back.to_dict() == cfg.to_dict() and back.notes == []


def test_sections_can_be_built_copied_and_assigned_in_code():
    f8 = FP8Config(recipe="rowwise", exclude=["layers.0"])
    assert f8.include == [] and f8.exclude == ["layers.0"]
    cfg = RunConfig()
    cfg2 = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 7})})
    assert cfg2.train.steps == 7 and cfg.train.steps == 100 and cfg2 != cfg
    cfg.train.mixed_precision = "bf16"
    assert cfg.train.mixed_precision == "bf16"
    for make, expected in [
        (lambda: FP8Config(recipe="rowwize"), "FP8Config: fp8.recipe: unknown value 'rowwize' (did you mean 'rowwise'?)"),
        (lambda: TrainConfig(steps="3"), "TrainConfig: train.steps: expected an integer, got '3' (str)"),
        (lambda: FP8Config(selective_fp8=True), "unknown key 'fp8.selective_fp8'; did you mean 'selective.selective_fp8'?"),
        (lambda: setattr(cfg.train, "steps", 1.5), "TrainConfig: train.steps: expected an integer, got 1.5 (float)"),
        (lambda: FP8Config(include=["re:("]), "FP8Config: fp8.include[0]: invalid regex '('"),
    ]:
        with pytest.raises(ConfigError) as e:
            make()
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_recipe_choices_come_from_the_recipe_list():
    assert typing.get_args(FP8Config.model_fields["recipe"].annotation) == RECIPE_NAMES
