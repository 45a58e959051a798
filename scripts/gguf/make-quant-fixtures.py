#!/usr/bin/env python3
"""Quantises the GGUF parity fixtures with llama.cpp itself and records llama.cpp's logits for
them, for the GGUF loader's comparison with llama.cpp. Needs llama-cpp-python (its source
package builds llama.cpp: `pip install llama_cpp_python numpy`, about 20 minutes on two
cores) and the `gguf` package (`pip install gguf`):

    python3 scripts/gguf/make-quant-fixtures.py

For each NAME-f16.gguf (or NAME-bf16.gguf) of tests/gguf/ it writes NAME-q4_k_m.gguf (`llama_model_quantize`,
LLAMA_FTYPE_MOSTLY_Q4_K_M; the fixtures' rows of 64 values are too short for the K types'
256-value blocks, so llama.cpp falls back to the 32-value types its quantiser picks for them)
and NAME-iq4_nl.gguf (LLAMA_FTYPE_MOSTLY_IQ4_NL, whose blocks of 32 these rows hold),
and for every NAME-TYPE.gguf of its float and quantised types, NAME-TYPE.llama.safetensors:
`tokens` and the `logits` llama.cpp computes for the parity prompt (all positions, f32 KV
cache). llama.cpp refuses a BPE vocabulary without merges, and the fixtures' byte vocabularies
have none, so the copy llama.cpp reads gets one merge ("a" "b" into token 255, renamed "ab"):
the ids fed are the same and no tokenisation happens.
"""
import os
import sys
import tempfile

import numpy as np
import llama_cpp
from llama_cpp import Llama
from gguf import GGUFReader, GGUFWriter

from gguf_copy import copy_metadata
from safetensors.numpy import save_file

here = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kestrel-model", "tests", "gguf")
TOKENS = [1, 17, 42, 99, 3, 250, 128, 64, 7, 200, 33, 5]
names = sys.argv[1:] or ["llama", "qwen3", "qwen3_moe_all", "qwen3_next", "qwen3_5_moe"]


def with_a_merge(src, dst):
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())

    def merged(key, v):
        if key == "tokenizer.ggml.tokens":
            v = list(v)
            v[255] = "ab"
        return v

    copy_metadata(r, w, merged)
    w.add_array("tokenizer.ggml.merges", ["a b"])
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def logits(path):
    with tempfile.TemporaryDirectory() as d:
        copy = os.path.join(d, "model.gguf")
        with_a_merge(path, copy)
        llm = Llama(model_path=copy, logits_all=True, n_ctx=128, n_batch=128, n_threads=2, verbose=False,
                    type_k=0, type_v=0)
        llm.eval(TOKENS)
        return np.array(llm.scores[:len(TOKENS)], dtype=np.float32)


for name in names:
    float = [os.path.join(here, f"{name}-{t}.gguf") for t in ["f16", "bf16"]]
    float = [p for p in float if os.path.exists(p)]
    if not float:
        print(f"{name}: no float GGUF")
        continue
    src = float[0]
    for ty, ftype in [("q4_k_m", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M), ("iq4_nl", llama_cpp.LLAMA_FTYPE_MOSTLY_IQ4_NL)]:
        dst = os.path.join(here, f"{name}-{ty}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
        print(f"{name}: quantised to {ty}, rc {rc}, {os.path.getsize(dst)} bytes", flush=True)
    for ty in ["f16", "bf16", "q8_0", "q4_k_m", "iq4_nl"]:
        path = os.path.join(here, f"{name}-{ty}.gguf")
        if not os.path.exists(path):
            continue
        out = os.path.join(here, f"{name}-{ty}.llama.safetensors")
        save_file({"tokens": np.array(TOKENS, dtype=np.int64), "logits": logits(path)}, out)
        print(f"{name}-{ty}: llama.cpp logits written", flush=True)
