"""Config loading, --set overrides, validation messages, and the generated reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8kit.config import RunConfig, config_reference_markdown, load_config, save_config
from fp8kit.errors import ConfigError

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
    """docs/config.md is generated from the dataclasses: regenerate with `fp8kit config-docs --output docs/config.md`."""
    doc = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert doc == config_reference_markdown()


def test_every_key_is_documented():
    text = config_reference_markdown()
    for section, obj in vars(RunConfig()).items():
        for key in vars(obj):
            assert f"`{key}`" in text, f"{section}.{key} missing from the reference"
