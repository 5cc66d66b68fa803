"""Shared fixtures: one tokenizer/token cache for the whole session, and the small CPU run settings."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8kit.base import cpu_bf16_gemm

# Two CPU cores: keep torch from oversubscribing them.
torch.set_num_threads(2)

# fp8kit's CPU bf16 GEMM, as `fp8kit train` installs it (fp8kit/base/cpu_bf16_gemm.py says why): here, and through
# tests/site/sitecustomize.py in every Python process the tests launch (their environments extend this PYTHONPATH).
_SITE = str(Path(__file__).resolve().parent / "site")
if _SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SITE, os.environ.get("PYTHONPATH", "")) if p)
cpu_bf16_gemm.install()


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs two workers) each worker computes on one thread, so the two workers
    share the two cores instead of spinning against each other (``workerinput`` exists only in a worker)."""
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """A tokenizer/token cache shared by every test of the session (BPE training takes seconds).

    Under pytest-xdist each worker keeps its own directory, but the one the small runs read (the stdlib corpus,
    vocab 1024: BPE training and tokenizing, about 17 s of CPU) is built once per ``pytest -n`` run, by the first
    worker to get here (a file lock), into a directory beside the workers' base temps, and copied into each
    worker's: the same cached files that worker would otherwise have built itself."""
    path = tmp_path_factory.mktemp("fp8kit-cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        from filelock import FileLock

        from fp8kit.config import DataConfig
        from fp8kit.data.prepare import prepare_data

        shared = tmp_path_factory.getbasetemp().parent / "fp8kit-cache-xdist"  # the run's base temp
        with FileLock(str(shared) + ".lock"):
            if not (shared / "done").is_file():
                prepare_data(DataConfig(seq_length=64, vocab_size=1024, cache_dir=str(shared)),
                             micro_batch_size=4, seed=0)
                (shared / "done").touch()
        shutil.copytree(shared, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("done"))
    return path


def randn_outliers(*shape, scale=1.0, seed=0, dtype=torch.bfloat16) -> torch.Tensor:
    """CPU ``randn(*shape) * scale`` with a few 10-30x outliers spread over it (one per 1000 elements, at least one in a non-empty tensor),
    cast to ``dtype``: never zeros, never uniform (the quantization tests' inputs)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) * scale
    if t.numel():
        idx = torch.randint(0, t.numel(), (max(1, t.numel() // 1000),), generator=g)
        t.view(-1)[idx] *= torch.empty(idx.numel()).uniform_(10, 30, generator=g)
    return t.to(dtype)


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


def assert_hf_logits_equal_run(hf, run) -> None:
    """``hf`` (a transformers model loaded from an export of ``run``) gives exactly the logits of fp8kit's own
    bf16 model loaded from ``run``'s latest checkpoint, on a fixed batch."""
    from fp8kit.config import load_config
    from fp8kit.models.build import build_model
    from fp8kit.train import checkpoint as ckpt

    cfg = load_config(str(run / "resolved_config.toml"), [])
    # bf16 model (its rotary inv_freq buffer stays fp32, as in from_pretrained), fp32 weights cast on load
    ours = build_model(cfg.model, cfg.data.vocab_size, device="cpu", dtype=torch.bfloat16, seed=7)
    ckpt.load_model_weights(ckpt.find_checkpoint(run), ours)
    x = torch.randint(0, cfg.data.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = hf(input_ids=x).logits, ours(input_ids=x).logits
    assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item()}"


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref`` in dB, in float64 on the CPU (inf when equal)."""
    ref, x = ref.detach().double().cpu(), x.detach().double().cpu()
    noise = (ref - x).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (float32 statistics, eps 1e-6): the producer of the FP8 inputs in the compile tests."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * self.weight


def saved_for_backward(fn):
    """``(saved, out)``: ``out = fn()`` and the ``(dtype, shape)`` of every tensor autograd saved for the backward
    while it ran (compiled graphs included: AOTAutograd saves through the same hooks)."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def prepared_llama(sets: list[str], emulate: bool = False, preset: str = "llama-125m"):
    """``(model, Prepared)``: a two-layer ``preset`` (llama-125m by default; vocab 1024, bf16, CPU) built and prepared
    as ``fp8kit train`` does (sites, decisions, ``prepare_model``) with the config overrides ``sets`` (e.g. the
    recipe)."""
    _, model, _, done = prepared_run(sets, emulate, preset)
    return model, done


def prepared_run(sets: list[str], emulate: bool = False, preset: str = "llama-125m", fp8_now: bool = True):
    """``(cfg, model, decisions, Prepared)`` of :func:`prepared_llama` (a ``model.preset`` in ``sets`` wins over
    ``preset``); ``fp8_now=False``: prepared as a run that starts in a BF16 phase of the precision schedule."""
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.config.prepare_options import prepare_options
    from fp8kit.models.build import build_hf_config, build_model
    from fp8kit.parallel.prepare import prepare_model
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    cfg = load_config(None, [f"model.preset={preset}", "model.num_layers=2", "data.vocab_size=1024",
                             "train.mixed_precision=fp8", *sets])
    model = build_model(cfg.model, cfg.data.vocab_size, device="cpu", dtype=torch.bfloat16, seed=0)
    hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
    decisions = decide(find_sites(model), options_from_config(cfg, hf_cfg, "cpu"))
    done = prepare_model(model, decisions, prepare_options(cfg, fp8_now=fp8_now, emulate=emulate), None, hf_cfg=hf_cfg)
    return cfg, model, decisions, done


def llama_steps(model, n: int, seed: int = 0):
    """``n`` forward + backward passes of a :func:`prepared_llama` model on random tokens (delayed histories advance;
    no optimizer step, so the weights stay): the last step's loss and parameter gradients."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 1024, (2, 64), generator=gen)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]
