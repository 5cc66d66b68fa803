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
- ``qwen3-30b-a3b``: Qwen/Qwen3-30B-A3B (MoE: 128 experts, 8 per token)
- ``deepseek-v3``: deepseek-ai/DeepSeek-V3 (MoE: 256 routed + 1 shared expert, 8 per token; MLA attention;
  rope scaling left at the default, which does not change any shape)

MoE presets use transformers v5's fused 3-D experts (``gate_up_proj`` / ``down_proj``), the layout the
FP8 grouped GEMM (``fp8kit.moe``) converts. ``model.num_layers`` cuts the depth to fit one GPU; note
that one DeepSeek-V3 MoE layer alone holds 11.3B parameters.
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
    # A Qwen3-MoE of about 6M parameters (8 experts of width 128, 2 per token): trains on a CPU in
    # minutes with its experts in FP8 (emulated grouped GEMM on the CPU). Every dim is a multiple of 16.
    "tiny-moe": {
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "intermediate_size": 688,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "first_k_dense_replace": 3,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}

PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
