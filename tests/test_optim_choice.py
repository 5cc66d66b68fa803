"""``optim.name = "auto"`` / ``train.param_dtype = "auto"`` (``fp8kit.config.optim_choice``): what each resolves to."""

from __future__ import annotations

import pytest

from fp8kit.config import load_config
from fp8kit.config.optim_choice import resolve_optimizer


@pytest.mark.parametrize("sets, name, dtype, why", [
    ([], "fp8_adamw", "bf16", "auto -> fp8_adamw"),  # the defaults: a high-precision master
    (["optim.name=auto"], "fp8_adamw", "bf16", "auto -> fp8_adamw"),
    (["distributed.tp=2"], "adamw", "fp32", "tp = 2"),
    (["distributed.ep=2"], "adamw", "fp32", "ep = 2"),
    (["train.async_checkpoint=true"], "fp8_adamw", "bf16", "auto -> fp8_adamw"),  # async DCP holds its states
    (["train.param_dtype=fp32"], "adamw", "fp32", "asks for FP32 parameters"),
    (["distributed.tp=2", "train.param_dtype=bf16"], "adamw", "bf16", "bf16 weights updated in place"),
    (["optim.name=adamw"], "adamw", "fp32", "param_dtype = auto -> fp32"),
    # bf16 weights updated in place by AdamW: only when asked for, and then nothing to resolve
    (["optim.name=adamw", "train.param_dtype=bf16"], "adamw", "bf16", ""),
    (["optim.name=fp8_adamw"], "fp8_adamw", "bf16", "param_dtype = auto -> bf16"),
    (["optim.name=fp8_adamw", "train.param_dtype=fp32"], "fp8_adamw", "fp32", ""),
])
def test_auto_resolves_to_a_high_precision_master(sets, name, dtype, why):
    cfg = load_config(None, sets)
    out, note = resolve_optimizer(cfg)
    assert (out.optim.name, out.train.param_dtype) == (name, dtype), (out.optim.name, out.train.param_dtype, note)
    assert why in note, note
    again, _ = resolve_optimizer(out)
    assert again is out, "resolving twice must change nothing"
    assert cfg.optim.name == load_config(None, sets).optim.name, "the input config was modified"


def test_auto_keeps_the_optimizer_of_the_checkpoint_being_resumed():
    """An AdamW checkpoint (e.g. from an expert-parallel run) resumed in one process stays AdamW under auto; an
    FP8AdamW checkpoint stays FP8AdamW; a resumed FP8AdamW checkpoint where FP8AdamW cannot run (tp = 2) gives
    adamw, which the resume's optimizer check then refuses with its own message."""
    cfg = load_config(None, [])
    out, note = resolve_optimizer(cfg, saved="adamw")
    # train.param_dtype = auto gives AdamW its FP32 master (the checkpoint's weights load into either dtype)
    assert (out.optim.name, out.train.param_dtype) == ("adamw", "fp32") and "holds AdamW states" in note, note
    out, note = resolve_optimizer(load_config(None, ["train.param_dtype=bf16"]), saved="adamw")
    assert (out.optim.name, out.train.param_dtype) == ("adamw", "bf16"), note
    out, note = resolve_optimizer(cfg, saved="fp8_adamw")
    assert out.optim.name == "fp8_adamw" and "holds FP8AdamW states" in note
    out, _ = resolve_optimizer(load_config(None, ["optim.name=auto", "distributed.tp=2"]), saved="fp8_adamw")
    assert out.optim.name == "adamw"
    explicit, _ = resolve_optimizer(load_config(None, ["optim.name=fp8_adamw"]), saved="adamw")
    assert explicit.optim.name == "fp8_adamw", "an explicit choice is never overridden (the resume refuses instead)"


@pytest.mark.parametrize("sets, kw, want, why", [
    ([], {}, "block", "optim.granularity = auto -> block (one process"),
    ([], {"distributed": True}, "tensor", "auto -> tensor (FSDP2 / HSDP shards"),
    ([], {"saved": "fp8_adamw", "saved_granularity": "tensor"}, "tensor", "the FP8AdamW states being resumed"),
    # under torchrun the per-block states of a one-process checkpoint are recast at load (FP8AdamW.adapt_full_state)
    ([], {"saved": "fp8_adamw", "saved_granularity": "block", "distributed": True}, "tensor", "FSDP2 / HSDP"),
    (["optim.granularity=tensor"], {}, "tensor", None),  # an explicit choice is kept
    (["optim.granularity=block"], {"saved": "fp8_adamw", "saved_granularity": "tensor"}, "block", None),
    (["optim.name=adamw"], {}, "block", None),  # resolved, but AdamW has no scales: nothing said about it
    (["optim.m_expand=coat"], {}, "tensor", "COAT's m expansion"),  # its exponents could not be recast for FSDP2
])
def test_granularity_auto_is_per_block_in_one_process_and_per_tensor_under_torchrun(sets, kw, want, why):
    """FP8AdamW's scales: one pass per block where no shard boundary can cut a block; a checkpoint resumed in one
    process keeps its own."""
    out, note = resolve_optimizer(load_config(None, sets), **kw)
    assert out.optim.granularity == want, (out.optim.granularity, note)
    if why is None:
        assert "granularity" not in note, note
    else:
        assert why in note, note
    again, _ = resolve_optimizer(out, **kw)
    assert again is out, "resolving twice must change nothing"
