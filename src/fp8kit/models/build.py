"""Build an HF transformers causal LM from a preset, a user's config.json or a pretrained directory's config.

``build_model`` initialises randomly; the weights of ``model.pretrained`` are loaded by
``fp8kit.models.pretrained``.

Models are built directly on the target device (``meta`` for planning: shapes only, no memory) with
the run's seed, so initialisation is reproducible. Nothing is downloaded. Under torchrun the model is built
on ``meta`` with its initialisation recorded and replayed on each rank's shards (``fp8kit.models.init``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.models.presets import PRESETS

if TYPE_CHECKING:  # the [model] section of the run config (a type only: config sits above this layer)
    from fp8kit.config import ModelConfig


def _config_kwargs(model_cfg: ModelConfig) -> tuple[dict[str, Any], str]:
    """(kwargs including model_type, where they came from)."""
    if getattr(model_cfg, "pretrained", None):
        from fp8kit.models.pretrained import CONFIG_FILE, inspect_pretrained

        pd = inspect_pretrained(model_cfg.pretrained)
        return dict(pd.config), f"{pd.where} ({CONFIG_FILE})"
    if model_cfg.hf_config:
        p = Path(model_cfg.hf_config)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"model.hf_config: {str(p)!r} does not exist")
        from fp8kit.models.pretrained import read_config_json

        return read_config_json(p, "model.hf_config"), f"model.hf_config {str(p)!r}"
    return dict(PRESETS[model_cfg.preset]), f"model.preset {model_cfg.preset!r}"


def build_hf_config(model_cfg: ModelConfig, vocab_size: int):
    """The HF ``PretrainedConfig`` for the run: preset or config.json, with depth and vocab overridden.

    Raises:
        ConfigError: the config.json is missing or invalid, or its ``model_type`` is unknown.
    """
    from transformers import AutoConfig

    kwargs, where = _config_kwargs(model_cfg)
    model_type = kwargs.pop("model_type")
    for key in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
        kwargs.pop(key, None)
    kwargs["vocab_size"] = vocab_size
    if model_cfg.num_layers is not None:
        kwargs["num_hidden_layers"] = model_cfg.num_layers
        # Per-layer lists (sliding-window layer types, ...) must match the new depth.
        lt = kwargs.get("layer_types")
        if isinstance(lt, list) and len(lt) != model_cfg.num_layers:
            if len(lt) < model_cfg.num_layers:
                raise ConfigError(
                    f"model.num_layers = {model_cfg.num_layers} exceeds the {len(lt)} entries of layer_types in {where}"
                )
            kwargs["layer_types"] = lt[: model_cfg.num_layers]
    # Token ids the model never uses in training but which must fit in the vocabulary.
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = kwargs.get(key)
        if isinstance(v, int) and v >= vocab_size:
            kwargs[key] = None
    try:
        cfg = AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError, TypeError) as e:
        msg = " ".join(str(e).split())[:300]
        raise ConfigError(f"{where}: cannot build a transformers config for model_type {model_type!r}: {msg}") from None
    cfg._attn_implementation = model_cfg.attn_implementation
    cfg.use_cache = False
    return cfg


def build_model(
    model_cfg: ModelConfig,
    vocab_size: int,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> nn.Module:
    """Build the causal LM on ``device`` with weights in ``dtype``, initialised from ``seed``.

    Raises:
        ConfigError: the config is not a causal-LM architecture known to transformers.
    """
    from fp8kit.base.torchao_lib import quiet_torchao_imports

    with quiet_torchao_imports():  # transformers imports torchao's quantizers when torchao is installed
        from transformers import AutoModelForCausalLM

    hf_cfg = build_hf_config(model_cfg, vocab_size)
    torch.manual_seed(seed)
    try:
        with torch.device(device), quiet_torchao_imports():
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    except ValueError as e:
        msg = " ".join(str(e).split())[:300]
        raise ConfigError(f"model: {hf_cfg.model_type!r} is not a causal LM known to transformers: {msg}") from None
    return model


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks (decoder layers) of an HF causal LM.

    Raises:
        ConfigError: no ``ModuleList`` of blocks is found.
    """
    best: nn.ModuleList | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks", "layer"):
            if best is None or sum(p.numel() for p in module.parameters()) > sum(p.numel() for p in best.parameters()):
                best = module
    if best is None:
        raise ConfigError(f"model {type(model).__name__}: no list of transformer blocks (layers/h/blocks) found")
    return best


def count_params(model: nn.Module) -> dict[str, int]:
    """Parameter counts: total, embedding (input embeddings) and the rest (matmul parameters)."""
    total = sum(p.numel() for p in model.parameters())
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    return {"total": total, "embedding": emb, "non_embedding": total - emb}


def flops_per_token(model: nn.Module, hf_cfg, seq_length: int) -> float:
    """Training FLOPs per token, PaLM appendix B (Chowdhery et al. 2022): ``6 N + 12 L H Q T``.

    N is the number of matmul (non-embedding) parameters, lm_head included; L layers, H attention
    heads, Q head dim, T sequence length. Attention is counted in full (not halved for causality), as
    PaLM and torchtitan do, so MFU figures are comparable with theirs.

    MoE: a token passes through ``num_experts_per_tok`` of the E experts, so the 3-D expert weights
    ``(E, ., .)`` count with ``topk / E`` of their parameters (the active parameters, as in the DeepSeek-V3
    and Qwen3 reports; the router counts in full).
    """
    n = count_params(model)["non_embedding"]
    topk = getattr(hf_cfg, "num_experts_per_tok", None)
    if topk:
        for p in model.parameters():
            if p.dim() == 3 and p.shape[0] > topk:
                n -= p.numel() * (1 - topk / p.shape[0])
    if getattr(hf_cfg, "tie_word_embeddings", False):
        n += hf_cfg.vocab_size * hf_cfg.hidden_size  # the tied lm_head still does its matmul
    layers = hf_cfg.num_hidden_layers
    heads = hf_cfg.num_attention_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads
    return 6.0 * n + 12.0 * layers * heads * head_dim * seq_length
