"""Rounds the routers (`blk.N.ffn_gate_inp.weight`) of a GGUF file we wrote ourselves to
bf16-exact values, in place: what a file converted from a bf16 checkpoint holds (Qwen3's are
bf16; llama.cpp's converter stores routers as F32, so every value is a bf16 widened), where
`make_gguf.py` draws them as any f32. The file keeps its types and layout; only those tensors'
bytes change (round to nearest even, as torch's `.to(torch.bfloat16)`).

    python3 scripts/gguf/round-routers-bf16.py FILE.gguf

Prints how many routers it rounded; refuses a router that is not F32."""
import sys

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType


def round_to_bf16(values: np.ndarray) -> np.ndarray:
    """f32 values rounded to the nearest bf16 (ties to even), still as f32; NaN stays NaN."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(values), values, out)


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    reader = GGUFReader(sys.argv[1], "r+")
    routers = [t for t in reader.tensors if t.name.endswith("ffn_gate_inp.weight")]
    # Every router checked before any is written: a refused file is left as it was.
    for t in routers:
        if t.tensor_type != GGMLQuantizationType.F32:
            print(f"{t.name} is {t.tensor_type.name}, not F32", file=sys.stderr)
            return 1
    for t in routers:
        t.data[...] = round_to_bf16(np.asarray(t.data))
    reader.data.flush()
    print(f"{len(routers)} routers rounded to bf16 values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
