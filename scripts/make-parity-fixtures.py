#!/usr/bin/env python3
"""Builds tiny random-weight checkpoints of every architecture Kestrel supports with transformers,
and the fp32 reference outputs its parity tests compare against.

    python3 scripts/make-parity-fixtures.py OUT_DIR     # needs torch, transformers, safetensors, numpy

For each fixture OUT_DIR/<name>/ holds what a user's model directory holds (config.json,
model.safetensors written by `save_pretrained`, generation_config.json) and `reference/`:
  - reference.safetensors: `tokens` (i64 [n]) and `logits` (f32 [n, vocab]): one forward pass over
    the token sequence, computed in float32 from the saved weights;
  - greedy.json: {"prompt": [...], "continuation": [24 ids]} from `generate(do_sample=False)`.
Weights are saved in bf16 (as real checkpoints are) and the reference is computed by loading
them back and upcasting to float32, so the reference sees exactly the stored weights.

`qwen3_moe_mlx_q4` is the qwen3_moe model quantised to 4 bits (groups of 32, router gates at 8
bits) and written in the MLX layout (`switch_mlp` stacked experts, `.weight` u32 / `.scales` /
`.biases`, `quantization` in config.json); its reference is computed from the dequantised
weights loaded into the transformers model.

Everything runs on the CPU in float32 (no TF32), seeded, so a rerun writes the same files.
"""
import json
import os
import shutil
import sys
import zlib

import numpy as np
import torch
from safetensors.numpy import save_file as save_np
from safetensors.torch import save_file as save_torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

VOCAB = 256
TOKENS = [1, 17, 42, 99, 3, 250, 128, 64, 7, 200, 33, 5]
NEW_TOKENS = 24

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4, shared_expert_intermediate_size=64, num_hidden_layers=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def configs():
    return {
        "qwen3_moe": Qwen3MoeConfig(**COMMON, **MOE, intermediate_size=96, num_hidden_layers=3,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "qwen3_next": Qwen3NextConfig(**COMMON, **MOE, **HYBRID, intermediate_size=96, norm_topk_prob=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                       "partial_rotary_factor": 0.25}),
        "qwen3_5_moe": Qwen3_5MoeConfig(
            text_config=dict(**COMMON, **MOE, **HYBRID,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                              "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
                                              "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=4, temporal_patch_size=2, spatial_merge_size=2,
                               num_position_embeddings=16),
            tie_word_embeddings=False),
        "qwen3": Qwen3Config(**COMMON, intermediate_size=96, num_hidden_layers=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "llama": LlamaConfig(**COMMON, intermediate_size=96, num_hidden_layers=2,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32}),
    }


def build(name, cfg):
    torch.manual_seed(zlib.crc32(name.encode()))
    if name == "qwen3_5_moe":
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    # Random weights of a scale that keeps activations in range through a few layers.
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                # norms: around 1 for standard ones, around 0 for zero-centred ones (which init 0)
                p.add_(torch.randn_like(p) * 0.1)
            elif "A_log" in pname or "dt_bias" in pname:
                continue
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return model.to(torch.bfloat16).eval()


def reference(model_dir, cls=None):
    if cls is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = cls.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
    return logits, out[0, len(TOKENS):].tolist()


def write_reference(model_dir, logits, continuation):
    ref = os.path.join(model_dir, "reference")
    os.makedirs(ref, exist_ok=True)
    save_torch({"tokens": torch.tensor(TOKENS, dtype=torch.int64), "logits": logits.contiguous()},
               os.path.join(ref, "reference.safetensors"))
    with open(os.path.join(ref, "greedy.json"), "w") as f:
        json.dump({"prompt": TOKENS, "continuation": continuation}, f)


# ---- MLX 4-bit ----

def quantize(w, bits, group):
    """MLX affine layout: per group scale = (max - min) / (2^bits - 1), bias = min, both bf16;
    values packed lowest bits first into u32 words. Returns (words, scales, biases, dequantised)."""
    w = w.astype(np.float32)
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    lo, hi = g.min(axis=2), g.max(axis=2)
    levels = (1 << bits) - 1
    to_bf16 = lambda a: torch.tensor(a).to(torch.bfloat16).float().numpy()
    scale = to_bf16((hi - lo) / levels)
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    bias = to_bf16(lo)
    q = np.clip(np.round((g - bias[..., None]) / scale[..., None]), 0, levels).astype(np.uint32)
    deq = (q * scale[..., None] + bias[..., None]).reshape(rows, cols)
    per = 32 // bits
    q = q.reshape(rows, cols // per, per)
    words = np.zeros((rows, cols // per), dtype=np.uint32)
    for i in range(per):
        words |= q[:, :, i] << np.uint32(bits * i)
    bf = lambda a: torch.tensor(a).to(torch.bfloat16)
    return words, bf(scale), bf(bias), deq


def mlx_fixture(src_dir, out_dir, bits=4, group=32):
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    cfg = json.load(open(os.path.join(src_dir, "config.json")))
    sd = {k: v.float() for k, v in model.state_dict().items()}
    tensors, overrides = {}, {}
    deq_sd = dict(sd)

    def quant(name, w, b=bits):
        words, s, bb, deq = quantize(w.numpy(), b, group)
        return words, s, bb, torch.tensor(deq)

    def stack(pre, proj, mats):
        """Quantises each expert's matrix; writes the MLX stack; returns the dequantised stack."""
        qs = [quant(f"{pre}.{proj}", m) for m in mats]
        w = np.stack([q[0] for q in qs])
        tensors[f"{pre}.mlp.switch_mlp.{proj}.weight"] = torch.tensor(w.view(np.int32)).view(torch.uint32)
        tensors[f"{pre}.mlp.switch_mlp.{proj}.scales"] = torch.stack([q[1] for q in qs])
        tensors[f"{pre}.mlp.switch_mlp.{proj}.biases"] = torch.stack([q[2] for q in qs])
        return torch.stack([q[3] for q in qs])

    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            # transformers 5 holds experts stacked: [E, 2 * inter, hidden], gate rows then up rows.
            pre = k[: -len(".mlp.experts.gate_up_proj")]
            inter = v.shape[1] // 2
            g = stack(pre, "gate_proj", [v[e, :inter] for e in range(v.shape[0])])
            u = stack(pre, "up_proj", [v[e, inter:] for e in range(v.shape[0])])
            deq_sd[k] = torch.cat([g, u], dim=1)
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len(".mlp.experts.down_proj")]
            deq_sd[k] = stack(pre, "down_proj", [v[e] for e in range(v.shape[0])])
        elif ".mlp.experts." in k:
            raise SystemExit(f"unexpected expert tensor {k}: update the MLX writer")
        elif v.dim() == 2 and not k.endswith("norm.weight"):
            b = 8 if k.endswith("mlp.gate.weight") else bits
            words, s, bb, deq = quant(k, v, b)
            base = k[: -len(".weight")]
            tensors[f"{base}.weight"] = torch.tensor(words.view(np.int32)).view(torch.uint32)
            tensors[f"{base}.scales"] = s
            tensors[f"{base}.biases"] = bb
            if b != bits:
                overrides[base] = {"group_size": group, "bits": b}
            deq_sd[k] = deq
        else:
            tensors[k] = v.to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    save_torch({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
               metadata={"format": "mlx"})
    q = {"group_size": group, "bits": bits, **overrides}
    cfg["quantization"] = q
    cfg["quantization_config"] = q
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    shutil.copy(os.path.join(src_dir, "generation_config.json"), out_dir)
    # Reference: the transformers model holding the dequantised weights.
    model.load_state_dict({k: v for k, v in deq_sd.items()})
    model.eval()
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
        out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
    write_reference(out_dir, logits, out[0, len(TOKENS):].tolist())


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(4)
    for name, cfg in configs().items():
        d = os.path.join(out, name)
        shutil.rmtree(d, ignore_errors=True)
        model = build(name, cfg)
        model.save_pretrained(d)
        cls = Qwen3_5MoeForConditionalGeneration if name == "qwen3_5_moe" else None
        logits, cont = reference(d, cls)
        write_reference(d, logits, cont)
        print(name, "logits", tuple(logits.shape), "continuation", cont[:8], "...", flush=True)
    mlx_fixture(os.path.join(out, "qwen3_moe"), os.path.join(out, "qwen3_moe_mlx_q4"))
    print("qwen3_moe_mlx_q4 written", flush=True)
    for name in sorted(os.listdir(out)):
        files = {f: os.path.getsize(os.path.join(out, name, f)) for f in os.listdir(os.path.join(out, name))
                 if os.path.isfile(os.path.join(out, name, f))}
        print(name, files)


if __name__ == "__main__":
    main()
