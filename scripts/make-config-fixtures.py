#!/usr/bin/env python3
"""Writes transformers-5-style config.json fixtures for kestrel-model's config tests, from
transformers' own config classes with the published models' values (no download needed).

    python3 scripts/make-config-fixtures.py   # needs `pip install transformers` (torch not needed)

The hub-style (transformers 4.x) fixtures next to them (`*_hub.json`, `qwen3_moe_mlx_q4.json`)
are written by hand in the form of the published config.json files (Qwen3-30B-A3B,
Qwen3-Next-80B-A3B, Llama 3.1 8B, an MLX 4-bit Qwen3-30B-A3B with its per-layer override list
shortened) and are not generated.
"""
import json
import os
import warnings

warnings.filterwarnings("ignore")
from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig  # noqa: E402

out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates/kestrel-model/tests/configs")

configs = {
    # Qwen3-30B-A3B
    "qwen3_moe_v5.json": Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16",
    ),
    # Qwen3-Next-80B-A3B
    "qwen3_next_v5.json": Qwen3NextConfig(
        hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, moe_intermediate_size=512, num_experts=512,
        num_experts_per_tok=10, shared_expert_intermediate_size=512, max_position_embeddings=262144,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        dtype="bfloat16",
    ),
    # Qwen3.5-35B-A3B (multimodal: the language model under text_config)
    "qwen3_5_moe_v5.json": Qwen3_5MoeConfig(
        text_config=dict(
            vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, moe_intermediate_size=512, num_experts=256,
            num_experts_per_tok=8, shared_expert_intermediate_size=512, max_position_embeddings=262144,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            dtype="bfloat16",
        ),
        tie_word_embeddings=False,
    ),
    # Qwen3-8B
    "qwen3_v5.json": Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, dtype="bfloat16",
    ),
    # Llama 3.1 8B
    "llama_v5.json": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        dtype="bfloat16",
    ),
}
for name, cfg in configs.items():
    with open(os.path.join(out, name), "w") as f:
        f.write(cfg.to_json_string(use_diff=False))
    print("wrote", name)
