#!/usr/bin/env python3
"""How well layer L's hidden state predicts layer L+1's routed experts, and what prefetching them
would do to an expert cache: a numpy forward pass of a Qwen3-MoE model in the MLX 4/8-bit layout
(for example one written by `kestrel synth qwen3-30b-a3b --out DIR --layers 16`), fed random
tokens as `kestrel bench` feeds them.

Because the tokens are given rather than sampled, the whole sequence runs layer by layer (causal
attention over all positions), which equals decoding it token by token.

Usage: expert-prediction.py DIR [--tokens N] [--cache-frac F,F,..] [--seed S]

It prints (1) the share of layer L+1's experts found among the top K and 2K of L+1's router
applied to layer L's MoE input, or to its attention input (the earlier point), and (2) for an
LRU cache of each given size a layer, the misses at routing and the copies a token with and
without fetching those predictions ahead. Streamed decode is bound by the link, so a prefetch
pays only if it removes more misses than it adds copies.
"""
import argparse
import json
import os
from collections import OrderedDict

import numpy as np
import struct


def bf16(a):
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a.astype(np.float32)


class Weights:
    def __init__(self, d):
        self.d = d
        index = os.path.join(d, "model.safetensors.index.json")
        if os.path.exists(index):
            self.where = json.load(open(index))["weight_map"]
        else:
            self.where = {name: "model.safetensors" for name in self._header("model.safetensors")[1]}
        self.files = {}
        self.cfg = json.load(open(os.path.join(d, "config.json")))

    def _header(self, f):
        with open(os.path.join(self.d, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            return 8 + n, json.loads(fh.read(n))

    def raw(self, name):
        """A tensor as stored (bf16 as uint16), read through a memory map of its file."""
        f = self.where[name]
        if f not in self.files:
            base, header = self._header(f)
            self.files[f] = (np.memmap(os.path.join(self.d, f), np.uint8, "r"), base, header)
        data, base, header = self.files[f]
        h = header[name]
        a, b = h["data_offsets"]
        dt = {"BF16": np.uint16, "U32": np.uint32, "F32": np.float32}[h["dtype"]]
        return np.frombuffer(data[base + a : base + b], dt).reshape(h["shape"])

    def vec(self, name):
        return bf16(self.raw(name))

    def mat(self, base):
        """Dequantise `base.weight` (uint32-packed, LSB first) with its scales and biases."""
        q = self.raw(base + ".weight")
        scales = self.vec(base + ".scales")
        biases = self.vec(base + ".biases")
        packed = q.shape[-1]
        groups = scales.shape[-1]
        gs = self.cfg["quantization"]["group_size"]
        bits = 32 * packed // (groups * gs)
        per = 32 // bits
        mask = (1 << bits) - 1
        shifts = (np.arange(per, dtype=np.uint32) * bits)
        vals = ((q[..., None] >> shifts) & mask).reshape(*q.shape[:-1], packed * per).astype(np.float32)
        g = vals.reshape(*vals.shape[:-1], groups, gs)
        out = g * scales[..., None] + biases[..., None]
        return out.reshape(*vals.shape)


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.outer(pos, inv).astype(np.float32)  # [T, d/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def topk(logits, k):
    return np.argsort(-logits, axis=-1)[:, :k]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cache-frac", default="0.1,0.25,0.45", help="slots a layer as fractions of the experts")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    w = Weights(args.dir)
    c = w.cfg
    H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    E, K, L, eps = c["num_experts"], c["num_experts_per_tok"], c["num_hidden_layers"], c["rms_norm_eps"]
    T = args.tokens
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, c["vocab_size"], T)
    emb = w.mat("model.embed_tokens")  # [V, H]
    x = emb[ids].astype(np.float32)
    del emb
    pos = np.arange(T)
    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)

    def gate(l, h, norm_layer):
        p = f"model.layers.{l}"
        return rms(h, w.vec(f"model.layers.{norm_layer}.post_attention_layernorm.weight"), eps) @ w.mat(p + ".mlp.gate").T

    chosen = []  # [L][T, K]
    pred_same = []  # prediction of layer l+1 from layer l's MoE input (normed with l+1's norm)
    pred_early = []  # prediction of layer l+1 from layer l's attention input
    for l in range(L):
        p = f"model.layers.{l}"
        attn_in = x
        h = rms(x, w.vec(p + ".input_layernorm.weight"), eps)
        q = (h @ w.mat(p + ".self_attn.q_proj").T).reshape(T, nh, hd)
        k = (h @ w.mat(p + ".self_attn.k_proj").T).reshape(T, nkv, hd)
        v = (h @ w.mat(p + ".self_attn.v_proj").T).reshape(T, nkv, hd)
        q = rope(rms(q, w.vec(p + ".self_attn.q_norm.weight"), eps), pos, c["rope_theta"])
        k = rope(rms(k, w.vec(p + ".self_attn.k_norm.weight"), eps), pos, c["rope_theta"])
        rep = nh // nkv
        o = np.empty((T, nh, hd), np.float32)
        for hh in range(nh):
            s = q[:, hh] @ k[:, hh // rep].T / np.sqrt(hd) + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // rep]
        x = x + o.reshape(T, nh * hd) @ w.mat(p + ".self_attn.o_proj").T
        moe_in = x
        logits = gate(l, moe_in, l)
        sel = topk(logits, K)
        chosen.append(sel)
        if l + 1 < L:
            pred_same.append(topk(gate(l + 1, moe_in, l + 1), 2 * K))
            pred_early.append(topk(gate(l + 1, attn_in, l + 1), 2 * K))
        hn = rms(moe_in, w.vec(p + ".post_attention_layernorm.weight"), eps)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        wsel = np.take_along_axis(probs, sel, -1)
        wsel /= wsel.sum(-1, keepdims=True)
        gp, up, dn = (w.mat(f"{p}.mlp.switch_mlp.{n}_proj") for n in ("gate", "up", "down"))
        out = np.zeros_like(x)
        for t in range(T):
            for j, e in enumerate(sel[t]):
                a = gp[e] @ hn[t]
                u = up[e] @ hn[t]
                out[t] += wsel[t, j] * (dn[e] @ (a / (1 + np.exp(-a)) * u))
        del gp, up, dn
        x = x + out
        print(f"layer {l}: |x| {np.linalg.norm(x, axis=-1).mean():.1f}", flush=True)

    def recall(preds, k):
        r = [np.mean([len(set(pr[t, :k]) & set(chosen[l + 1][t])) / K for t in range(T)]) for l, pr in enumerate(preds)]
        return np.mean(r), np.min(r), np.max(r)

    for name, preds in (("MoE input of L", pred_same), ("attention input of L", pred_early)):
        for k in (K, 2 * K):
            m, lo, hi = recall(preds, k)
            print(f"layer L+1's {K} experts among the top {k} predicted from the {name}: "
                  f"{100*m:.1f}% (layers {100*lo:.1f}-{100*hi:.1f}%)")

    # An LRU cache of `slots` experts a layer, with and without the prediction's top K fetched
    # ahead of the routing.
    warm = T // 4
    cases = (("none", None, 0), ("MoE input of L, top K", pred_same, K), ("MoE input of L, top 2K", pred_same, 2 * K))
    for frac in args.cache_frac.split(","):
        slots = max(K, int(round(float(frac) * E)))
        for label, preds, k_ahead in cases:
            miss = extra = useful = 0
            for l in range(1, L):
                cache = OrderedDict()
                for t in range(T):
                    count = t >= warm
                    if preds is not None:
                        for e in preds[l - 1][t, :k_ahead]:
                            e = int(e)
                            if e not in cache:
                                cache[e] = True
                                if len(cache) > slots:
                                    cache.popitem(last=False)
                                if count:
                                    extra += 1
                                    useful += e in set(chosen[l][t])
                    for e in chosen[l][t]:
                        e = int(e)
                        if e in cache:
                            cache.move_to_end(e)
                        else:
                            cache[e] = True
                            if len(cache) > slots:
                                cache.popitem(last=False)
                            miss += count
            n = (T - warm) * (L - 1)
            print(f"prefetch {label}: {slots} slots, misses at routing {miss / n:.2f} a layer-token, "
                  f"prefetched copies {extra / n:.2f} (of which used at once {useful / n:.2f}), "
                  f"total copies {(miss + extra) / n:.2f}")


if __name__ == "__main__":
    main()
