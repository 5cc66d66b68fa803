"""Named model presets: HF transformers config kwargs with the real shapes of published models.

A preset is plain data (a ``model_type`` plus the kwargs of that architecture's HF config class);
``models/build.py`` turns it into a model with random initialisation. Nothing is ever downloaded.
The vocabulary size is not part of a preset: the model always takes ``data.vocab_size`` so that it
matches the tokenizer trained on the run's corpus.

Shapes are copied from the published ``config.json`` of each model:
- ``llama-125m``: GPT-3 Small's width/depth (Brown et al. 2020) in the Llama architecture
- ``llama3-1b``: meta-llama/Llama-3.2-1B
- ``llama3-8b``: meta-llama/Llama-3.1-8B
- ``qwen2.5-72b``: Qwen/Qwen2.5-72B
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    # A few million parameters (about 5M with the default 4096-token vocabulary): trains on a CPU in
    # minutes. Every linear dimension is a multiple of 16 so that all of them can run in FP8.
    "tiny": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # GPT-3 Small / GPT-2 124M width and depth (Brown et al. 2020, Table 2.1: d_model 768, 12 layers,
    # 12 heads) in the Llama architecture with a SwiGLU MLP of 2048 (8/3 x 768, rounded to 16): about
    # 85M parameters in the blocks plus 2 x 768 x vocab embeddings (134M with a 32000 vocabulary).
    "llama-125m": {
        "model_type": "llama",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "llama3-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0},
    },
    "llama3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0},
    },
    "qwen2.5-72b": {
        "model_type": "qwen2",
        "hidden_size": 8192,
        "intermediate_size": 29568,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}

PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
