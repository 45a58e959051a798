#!/usr/bin/env python3
"""Writes a model directory with random weights at the real shapes of a named configuration, in
the MLX 4-bit layout, so decode speed can be measured without downloading the model.

    python3 scripts/make-synthetic-model.py qwen3-30b-a3b OUT [--layers N]    # needs numpy

The weights are random but tame: every quantised group dequantises to zero-mean values of about
1/sqrt(columns), norms are 1, so activations stay finite and routing is spread over the experts.
The directory loads like a published MLX checkpoint (`config.json` with `quantization`,
`model.safetensors` with `.weight` / `.scales` / `.biases`, experts as `switch_mlp` stacks).
"""
import argparse
import json
import os
import struct

import numpy as np

CONFIGS = {
    # Qwen3-30B-A3B, as published.
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
    },
}

BITS, GROUP, ROUTER_BITS = 4, 64, 8


class Writer:
    """Streams tensors into one safetensors file: the header first, then each tensor's bytes."""

    def __init__(self, path, entries):
        header, offset = {}, 0
        for name, dtype, shape, nbytes in entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "mlx"}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * ((8 - len(text) % 8) % 8)
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(text)))
        self.f.write(text)

    def write(self, data):
        self.f.write(data)

    def close(self):
        self.f.close()


def bf16(x):
    return (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def quant_entries(name, lead, rows, cols, bits):
    words, groups = cols * bits // 32, cols // GROUP
    return [(f"{name}.weight", "U32", lead + [rows, words], int(np.prod(lead + [rows, words])) * 4),
            (f"{name}.scales", "BF16", lead + [rows, groups], int(np.prod(lead + [rows, groups])) * 2),
            (f"{name}.biases", "BF16", lead + [rows, groups], int(np.prod(lead + [rows, groups])) * 2)]


def quant_data(rng, lead, rows, cols, bits):
    """Random words; scale and bias so that q * scale + bias is centred with std ~ 1/sqrt(cols)."""
    words, groups = cols * bits // 32, cols // GROUP
    n = int(np.prod(lead + [rows]))
    levels = (1 << bits) - 1
    scale = (1.0 / np.sqrt(cols)) / (levels / np.sqrt(12.0))
    w = rng.integers(0, 2**32, size=n * words, dtype=np.uint32).tobytes()
    s = np.full(n * groups, bf16(scale), dtype=np.uint16).tobytes()
    b = np.full(n * groups, bf16(-scale * levels / 2), dtype=np.uint16).tobytes()
    return [w, s, b]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("name", choices=sorted(CONFIGS))
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, help="fewer layers than the real model")
    args = ap.parse_args()
    cfg = dict(CONFIGS[args.name])
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    H, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    # (name, kind, lead, rows, cols, bits) in file order.
    plan = [("model.embed_tokens", "q", [], V, H, BITS)]
    for l in range(L):
        p = f"model.layers.{l}"
        plan += [(f"{p}.input_layernorm.weight", "norm", [], H, 0, 0),
                 (f"{p}.self_attn.q_proj", "q", [], heads * hd, H, BITS),
                 (f"{p}.self_attn.k_proj", "q", [], kv * hd, H, BITS),
                 (f"{p}.self_attn.v_proj", "q", [], kv * hd, H, BITS),
                 (f"{p}.self_attn.o_proj", "q", [], H, heads * hd, BITS),
                 (f"{p}.self_attn.q_norm.weight", "norm", [], hd, 0, 0),
                 (f"{p}.self_attn.k_norm.weight", "norm", [], hd, 0, 0),
                 (f"{p}.post_attention_layernorm.weight", "norm", [], H, 0, 0),
                 (f"{p}.mlp.gate", "q", [], E, H, ROUTER_BITS),
                 (f"{p}.mlp.switch_mlp.gate_proj", "q", [E], I, H, BITS),
                 (f"{p}.mlp.switch_mlp.up_proj", "q", [E], I, H, BITS),
                 (f"{p}.mlp.switch_mlp.down_proj", "q", [E], H, I, BITS)]
    plan += [("model.norm.weight", "norm", [], H, 0, 0), ("lm_head", "q", [], V, H, BITS)]
    entries = []
    for name, kind, lead, rows, cols, bits in plan:
        if kind == "norm":
            entries.append((name, "BF16", [rows], rows * 2))
        else:
            entries += quant_entries(name, lead, rows, cols, bits)
    os.makedirs(args.out, exist_ok=True)
    w = Writer(os.path.join(args.out, "model.safetensors"), entries)
    rng = np.random.default_rng(0)
    total = 0
    for name, kind, lead, rows, cols, bits in plan:
        parts = [np.full(rows, bf16(1.0), dtype=np.uint16).tobytes()] if kind == "norm" else \
            quant_data(rng, lead, rows, cols, bits)
        for d in parts:
            w.write(d)
            total += len(d)
    w.close()
    q = {"group_size": GROUP, "bits": BITS}
    for l in range(L):
        q[f"model.layers.{l}.mlp.gate"] = {"group_size": GROUP, "bits": ROUTER_BITS}
    cfg["quantization"] = q
    cfg["quantization_config"] = q
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    print(f"wrote {args.out}: {args.name}, {L} layers, {total / 2**30:.2f} GiB of weights")


if __name__ == "__main__":
    main()
