"""``optim.name = "auto"`` / ``train.param_dtype = "auto"`` (``fp8kit.config.optim_choice``): what each resolves to."""

from __future__ import annotations

import pytest

from fp8kit.config import load_config
from fp8kit.config.optim_choice import resolve_optimizer


@pytest.mark.parametrize("sets, name, dtype, why", [
    ([], "adamw", "bf16", ""),  # the defaults are left alone
    (["optim.name=auto"], "fp8_adamw", "bf16", "auto -> fp8_adamw"),
    (["optim.name=auto", "distributed.tp=2"], "adamw", "fp32", "tp = 2"),
    (["optim.name=auto", "distributed.ep=2"], "adamw", "fp32", "ep = 2"),
    (["optim.name=auto", "train.async_checkpoint=true"], "adamw", "fp32", "async_checkpoint"),
    (["optim.name=auto", "train.param_dtype=fp32"], "adamw", "fp32", "asks for FP32 parameters"),
    (["train.param_dtype=auto"], "adamw", "fp32", "param_dtype = auto -> fp32"),
    (["optim.name=fp8_adamw", "train.param_dtype=auto"], "fp8_adamw", "bf16", "param_dtype = auto -> bf16"),
])
def test_auto_resolves_to_a_high_precision_master(sets, name, dtype, why):
    cfg = load_config(None, sets)
    out, note = resolve_optimizer(cfg)
    assert (out.optim.name, out.train.param_dtype) == (name, dtype), (out.optim.name, out.train.param_dtype, note)
    assert why in note, note
    again, _ = resolve_optimizer(out)
    assert again is out, "resolving twice must change nothing"
    assert cfg.optim.name == load_config(None, sets).optim.name, "the input config was modified"
