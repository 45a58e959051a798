#!/usr/bin/env python3
"""Writes the GGUF reader's fixture with llama.cpp's own Python writer (the `gguf` package on
PyPI, `pip install gguf numpy`): crates/kestrel-model/tests/gguf/reader.gguf, a small file with
metadata of every value type (arrays of numbers and strings among them), a custom alignment and
tensors of several ggml types (F32, F16, BF16, Q8_0 and Q4_0 quantised by the package, and raw
Q4_K and Q6_K blocks), and reader.json beside it: what the reader must find (each key's type and
value, each tensor's dims in ggml order, type, offset in the data section, length and a checksum
of its bytes).

    python3 scripts/gguf/make-reader-fixture.py
"""
import json
import os
import sys
import zlib

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T, GGUFReader
from gguf import quants

out = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kestrel-model", "tests", "gguf")
path = os.path.join(out, "reader.gguf")
rng = np.random.default_rng(7)

w = GGUFWriter(path, "qwen3moe")
w.add_custom_alignment(64)
w.add_uint32("qwen3moe.block_count", 2)
w.add_uint64("qwen3moe.context_length", 40960)
w.add_int32("test.i32", -7)
w.add_float32("qwen3moe.rope.freq_base", 1000000.0)
w.add_float64("test.f64", 0.125)
w.add_bool("tokenizer.ggml.add_bos_token", False)
w.add_uint8("test.u8", 200)
w.add_int8("test.i8", -100)
w.add_uint16("test.u16", 60000)
w.add_int16("test.i16", -30000)
w.add_int64("test.i64", -(1 << 40))
w.add_string("tokenizer.ggml.model", "gpt2")
w.add_array("tokenizer.ggml.tokens", ["a", "bé", "Ġthe", "<|im_end|>", "日本"])
w.add_array("tokenizer.ggml.token_type", [1, 1, 1, 3, 1])
w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, 0.0, -3.0])

f32 = rng.standard_normal((3, 64)).astype(np.float32)
w.add_tensor("output_norm.weight", f32)
w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((2, 32)).astype(np.float16))
bf = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), T.BF16)
w.add_tensor("blk.0.attn_k.weight", bf, raw_dtype=T.BF16)
q8 = quants.quantize(rng.standard_normal((4, 96)).astype(np.float32), T.Q8_0)
w.add_tensor("token_embd.weight", q8, raw_dtype=T.Q8_0)
q4 = quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), T.Q4_0)
w.add_tensor("blk.0.ffn_down.weight", q4, raw_dtype=T.Q4_0)
# K-quant blocks as raw bytes (the reader only places them): 2 experts x 3 rows of 256 values.
w.add_tensor("blk.0.ffn_gate_exps.weight", rng.integers(0, 256, (2, 3, 144), dtype=np.uint8), raw_dtype=T.Q4_K)
w.add_tensor("blk.0.ffn_up_exps.weight", rng.integers(0, 256, (1, 210), dtype=np.uint8), raw_dtype=T.Q6_K)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()

# What llama.cpp's reader finds, for the Rust reader to match.
r = GGUFReader(path)
meta = {}
for f in r.fields.values():
    if f.name.startswith("GGUF."):
        continue
    types = [t.name for t in f.types]
    if types[0] == "ARRAY":
        vals = [f.parts[i].tolist() for i in f.data]
        if types[1] == "STRING":
            vals = [bytes(v).decode() for v in vals]
        else:
            vals = [v[0] for v in vals]
        meta[f.name] = {"type": types[0] + ":" + types[1], "value": vals}
    elif types[0] == "STRING":
        meta[f.name] = {"type": "STRING", "value": bytes(f.parts[f.data[0]]).decode()}
    else:
        meta[f.name] = {"type": types[0], "value": f.parts[f.data[0]].tolist()[0]}
tensors = []
for t in r.tensors:
    raw = bytes(np.asarray(t.data).tobytes())
    tensors.append({
        "name": t.name,
        "dims": [int(d) for d in t.shape],
        "type": t.tensor_type.name,
        "data_offset": int(t.data_offset) - int(r.data_offset),
        "bytes": int(t.n_bytes),
        "crc32": zlib.crc32(raw),
    })
with open(os.path.join(out, "reader.json"), "w") as fh:
    json.dump({"alignment": int(r.alignment), "data_start": int(r.data_offset), "metadata": meta, "tensors": tensors}, fh, indent=1)
print(f"wrote {path} ({os.path.getsize(path)} bytes) and reader.json", file=sys.stderr)
