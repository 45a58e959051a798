#!/usr/bin/env python3
"""Converts the parity fixtures (crates/kestrel-model/tests/parity/NAME, Hugging Face
directories of random weights) into GGUF files with llama.cpp's own converter
(`convert_hf_to_gguf.py`), for the GGUF loader's tests. Needs torch, transformers, numpy and
llama.cpp's source (the llama-cpp-python sdist on PyPI carries it under vendor/llama.cpp); run
where torch is (the GPU host has it):

    python3 scripts/gguf/make-model-fixtures.py LLAMA_CPP_DIR OUT_DIR [NAME ...]

The fixtures carry no tokenizer and their vocabularies are 256 tokens, so each gets one before
the conversion: byte-level BPE over exactly the 256 byte symbols, no merges, no added tokens,
and the pre-tokenizer named by hand (llama.cpp names it from a hash of the encoding of a check
text, which only published tokenizers have an entry for): "llama-bpe" for llama, "qwen2" for
the others (Qwen3.5 names its own "qwen35"). Each fixture is written as F16, BF16 and Q8_0
(`--outtype`), NAME-TYPE.gguf in OUT_DIR, with a log of the conversion beside it.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

llama, out = sys.argv[1], sys.argv[2]
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
parity = os.path.join(root, "crates", "kestrel-model", "tests", "parity")
# qwen3_moe is left out: its layer 1 is a dense MLP (`mlp_only_layers`), which llama.cpp's
# qwen3moe architecture has no tensors for ("Can not map tensor
# 'model.layers.1.mlp.down_proj.weight'"); qwen3_moe_all (every layer MoE) stands in for it.
names = sys.argv[3:] or ["llama", "qwen3", "qwen3_moe_all", "qwen3_next", "qwen3_5_moe"]
pre = {"llama": "llama-bpe", "qwen3_5_moe": "qwen35"}
# The hybrids' converter counts multi-token-prediction layers the fixtures do not have.
extra = {"qwen3_next": ["--no-mtp"], "qwen3_5_moe": ["--no-mtp"]}


def byte_symbols():
    """GPT-2's map from bytes to printable characters, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tokenizer_json():
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": False}, level]},
        "post_processor": level, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {s: i for i, s in enumerate(byte_symbols())}, "merges": []},
    }


# The converter, with the pre-tokenizer's name given instead of found by hash.
wrapper = """
import sys
sys.path.insert(0, {llama!r}); sys.path.insert(0, {llama!r} + "/gguf-py")
sys.argv = ["convert_hf_to_gguf.py"] + {args!r}
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
import runpy
runpy.run_path({llama!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""
os.makedirs(out, exist_ok=True)
failed = []
for name in names:
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, name)
        shutil.copytree(os.path.join(parity, name), model, ignore=shutil.ignore_patterns("reference"))
        json.dump(tokenizer_json(), open(os.path.join(model, "tokenizer.json"), "w"))
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 128},
                  open(os.path.join(model, "tokenizer_config.json"), "w"))
        for outtype in ["f16", "bf16", "q8_0"]:
            dst = os.path.join(out, f"{name}-{outtype}.gguf")
            args = [model, "--outtype", outtype, "--outfile", dst] + extra.get(name, [])
            code = wrapper.format(llama=llama, args=args,
                                  pre=pre.get(name, "qwen2"))
            with open(dst + ".log", "w") as log:
                rc = subprocess.run([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT).returncode
            print(f"{name} {outtype}: rc {rc}" + (f", {os.path.getsize(dst)} bytes" if rc == 0 else ""))
            if rc != 0:
                failed.append(f"{name}-{outtype}")
sys.exit(1 if failed else 0)
