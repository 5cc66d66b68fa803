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


@pytest.fixture
def small_run(cache_dir):
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
