#!/usr/bin/env python3
"""Writes GGUF fixtures whose tensors are fused as llama.cpp's converter fuses them when asked
(`convert_hf_to_gguf.py --fuse-gate-up-exps --fuse-qkv`), with llama.cpp's own Python package
(`gguf` on PyPI, `pip install gguf numpy`): for each NAME given (default: the Qwen3-Next and
Qwen3.5-MoE Q8_0 fixtures, the architectures whose tensor lists have `ffn_gate_up_exps`),
crates/kestrel-model/tests/gguf/NAME-fused.gguf holds NAME.gguf's metadata and tensors, with
every layer's `ffn_gate_exps` and `ffn_up_exps` concatenated into `ffn_gate_up_exps` (each
expert's gate rows, then its up rows: the converter's `torch.cat([gate, up], dim=1)`) and every
full-attention layer's `attn_q`, `attn_k` and `attn_v` into `attn_qkv` (their rows in that
order). The fused files must give the same logits as the files they come from.

    python3 scripts/gguf/make-fused-fixtures.py [NAME...]
"""
import os
import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter

from gguf_copy import copy_metadata

here = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kestrel-model", "tests", "gguf")
names = sys.argv[1:] or ["qwen3_next-q8_0", "qwen3_5_moe-q8_0"]


def fused(src, dst):
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    copy_metadata(r, w)
    by_name = {t.name: t for t in r.tensors}
    done = set()
    for t in r.tensors:
        if t.name in done:
            continue
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else None
        parts, name, axis = None, None, 0
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            parts = [f"blk.{layer}.ffn_{w_}_exps.weight" for w_ in ("gate", "up")]
            name, axis = f"blk.{layer}.ffn_gate_up_exps.weight", 1
        elif t.name.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight")):
            parts = [f"blk.{layer}.attn_{p}.weight" for p in ("q", "k", "v")]
            name, axis = f"blk.{layer}.attn_qkv.weight", 0
        if parts is None:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
            continue
        ts = [by_name[p] for p in parts]
        assert len({p.tensor_type for p in ts}) == 1, parts
        w.add_tensor(name, np.concatenate([p.data for p in ts], axis=axis), raw_dtype=t.tensor_type)
        done.update(parts)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


for n in names:
    fused(os.path.join(here, f"{n}.gguf"), os.path.join(here, f"{n}-fused.gguf"))
    print("wrote", f"{n}-fused.gguf")
