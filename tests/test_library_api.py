"""``fp8kit.convert_to_fp8``: the library entry point honours every field it is given.

The config's ``emulate`` reaches the FP8 modules, and a ``[selective]`` policy decides per site by the
token count (the same decision path as ``fp8kit train``).
"""

from __future__ import annotations

import torch

from fp8kit import convert_to_fp8
from fp8kit.config import FP8Config, ModelConfig, SelectiveConfig
from fp8kit.models.build import build_model
from fp8kit.parallel.convert import count_fp8_modules


def _tiny():
    return build_model(ModelConfig(preset="tiny"), 512, device=torch.device("cpu"), dtype=torch.bfloat16, seed=0)


def test_emulate_reaches_the_fp8_modules():
    from fp8kit.base.torchao_lib import torchao_float8

    model = _tiny()
    convert_to_fp8(model, FP8Config(emulate=True))
    f8 = [m for m in model.modules() if isinstance(m, torchao_float8().Float8Linear)]
    assert f8, "no layer was converted"
    assert all(m.config.emulate for m in f8), "FP8Config.emulate = True did not reach Float8Linear.config"


def test_recipe_of_the_decision_is_the_recipe_of_the_module():
    from torchao.float8.config import ScalingGranularity

    from fp8kit.base.torchao_lib import torchao_float8

    model = _tiny()
    decisions = convert_to_fp8(model, FP8Config(recipe="rowwise"))
    assert {d.recipe for d in decisions if d.is_fp8} == {"rowwise"}
    f8 = [m for m in model.modules() if isinstance(m, torchao_float8().Float8Linear)]
    gran = {m.config.cast_config_input.scaling_granularity for m in f8}
    assert gran == {ScalingGranularity.AXISWISE}, f"rowwise decisions built modules with {gran}"


def test_selective_policy_decides_by_token_count():
    policy = SelectiveConfig(selective_fp8=True, fp8_dynamic_policy_path="builtin:llama3-8b_tensorwise_h100")
    few, many = _tiny(), _tiny()
    d_few = convert_to_fp8(few, FP8Config(), selective=policy, num_tokens=256)
    d_many = convert_to_fp8(many, FP8Config(), selective=policy, num_tokens=65536)
    # the shipped policy keeps every linear BF16 below 2048 tokens and takes fc1/fc2 to FP8 above 8192
    assert count_fp8_modules(few) == 0, [d.fqn for d in d_few if d.is_fp8]
    assert count_fp8_modules(many) > 0
    assert "policy" in {d.rule for d in d_few}, {d.rule for d in d_few}
    assert sum(d.is_fp8 for d in d_many) == count_fp8_modules(many)


def test_auto_outside_the_trainer_warns_that_the_static_rules_decide():
    """``selective_fp8 = "auto"`` (the default) is measured only by ``fp8kit train``: the library entry point
    must say that it decided by the static rules instead, not silently."""
    import warnings as _warnings

    import torch

    from fp8kit import convert_to_fp8
    from fp8kit.config import SelectiveConfig

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        decisions = convert_to_fp8(model, selective=SelectiveConfig(), num_tokens=128)
    messages = [str(w.message) for w in caught if "selective_fp8 = 'auto'" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert all(d.precision == "fp8" for d in decisions), [(d.site.fqn, d.precision) for d in decisions]


def test_convert_to_fp8_honours_the_delayed_scaling_settings():
    """``FP8Config``'s amax_history_len / amax_compute_algo / margin reach the delayed linears built by the
    library entry point (they were dropped for the defaults before)."""
    import torch

    from fp8kit import convert_to_fp8
    from fp8kit.config import FP8Config
    from fp8kit.fp8.delayed import Float8DelayedLinear

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    convert_to_fp8(model, FP8Config(recipe="delayed", amax_history_len=5, amax_compute_algo="most_recent",
                                    margin=1, emulate=True))
    layers = [m for m in model.modules() if isinstance(m, Float8DelayedLinear)]
    assert len(layers) == 2, model
    for layer in layers:
        cfg = layer._state.config
        got = (layer._entry.history.shape[1], cfg.amax_compute_algo, cfg.margin)
        assert got == (5, "most_recent", 1), got
