"""Shared fixtures: one tokenizer/token cache for the whole session, and the small CPU run settings."""

from __future__ import annotations

import pytest
import torch

# Two CPU cores: keep torch from oversubscribing them.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A tokenizer/token cache shared by every test of the session (BPE training takes seconds)."""
    return tmp_path_factory.mktemp("fp8kit-cache")


def small_run_overrides(cache_dir) -> list[str]:
    """--set overrides for a small, real training run on the stdlib corpus (CPU-friendly)."""
    return [
        "model.num_layers=2",
        "data.seq_length=64",
        "data.vocab_size=1024",
        f"data.cache_dir={cache_dir}",
        "train.micro_batch_size=4",
        "train.log_every=1000",
        "train.eval_batches=4",
    ]


@pytest.fixture
def small_run(cache_dir):
    """:func:`small_run_overrides` as a fixture."""
    return small_run_overrides(cache_dir)


def tiny_moe_model():
    """A Qwen3-MoE (transformers v5 fused 3-D experts) of 2 layers and 8 experts, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        head_dim=64,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg), cfg
