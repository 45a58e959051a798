#!/usr/bin/env python3
"""Writes the dequantisation fixture with llama.cpp's own Python package (`gguf` on PyPI,
`pip install gguf numpy`): crates/kestrel-model/tests/gguf/dequant.gguf holds one tensor of
random blocks of every block-quantised type Kestrel reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS: random bytes, with each block's f16 scales drawn as finite values between 2^-12
and 2^-2, so every bit pattern of the quantised values and 6-bit sub-scales occurs), and
dequant.safetensors beside it the f32 values the package's dequantiser (`gguf.quants`)
computes for each, which Kestrel's must equal bit for bit.

    python3 scripts/gguf/make-dequant-fixture.py
"""
import os

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType as T
from gguf import quants
from safetensors.numpy import save_file

out = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kestrel-model", "tests", "gguf")
rng = np.random.default_rng(11)
# Where each type's f16 scales sit in its block (byte offsets).
scales = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0],
}
w = GGUFWriter(os.path.join(out, "dequant.gguf"), "llama")
want = {}
for ty, at in scales.items():
    block, size = quants.GGML_QUANT_SIZES[ty]
    rows, cols = 3, 2 * 256
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for a in at:
        d = (rng.uniform(2**-12, 2**-2, size=len(blocks)) * rng.choice([-1, 1], size=len(blocks)))
        blocks[:, a:a + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(rows, -1)
    w.add_tensor(ty.name, raw, raw_dtype=ty)
    want[ty.name] = quants.dequantize(raw, ty).astype(np.float32).reshape(rows, cols)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
save_file(want, os.path.join(out, "dequant.safetensors"))
print("wrote", len(want), "tensors")
