#!/usr/bin/env python3
"""Writes crates/kestrel-model/tests/gguf/tokenizer.gguf: the tokenizer of kestrel-text's tests
(crates/kestrel-text/tests/tokenizer: byte-level BPE, Qwen2's pre-tokenizer, 4,096 tokens and 5
added ones) as llama.cpp's converter writes a tokenizer into a GGUF file, metadata only. It runs
the converter's own `_set_vocab_gpt2` (tokens, token types, merges, special token ids, chat
template) from llama.cpp's source, with two things fixed by hand: the pre-tokenizer is named
"qwen2" (the converter names it from a hash of the encoding of a check text, which only
published tokenizers have an entry for), and torch, which the converter imports but this part
does not use, is a stub.

    pip install gguf transformers numpy
    # llama.cpp's source: the llama-cpp-python sdist on PyPI carries it under vendor/llama.cpp
    python3 scripts/gguf/make-tokenizer-fixture.py PATH/TO/llama.cpp
"""
import json
import os
import shutil
import sys
import tempfile
import types

import transformers  # noqa: F401  (imported before the torch stub, which it would take for torch)

llama = sys.argv[1]
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
src = os.path.join(root, "crates", "kestrel-text", "tests", "tokenizer")
out = os.path.join(root, "crates", "kestrel-model", "tests", "gguf", "tokenizer.gguf")


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name)

    def __call__(self, *args, **kwargs):
        return _Stub("call")


for m in ["torch", "torch.nn", "torch.nn.functional"]:
    sys.modules[m] = _Stub(m)
sys.path.insert(0, os.path.join(llama, "gguf-py"))
sys.path.insert(0, llama)
import gguf  # noqa: E402
from conversion import base  # noqa: E402


class Vocab(base.TextModel):
    """Only what `_set_vocab_gpt2` reads of a model."""

    model_arch = gguf.MODEL_ARCH.QWEN3

    def __init__(self, dir_model, writer, vocab_size):
        self.dir_model = dir_model
        self.hparams = {"vocab_size": vocab_size}
        self.gguf_writer = writer

    def get_vocab_base_pre(self, tokenizer):
        return "qwen2"


with tempfile.TemporaryDirectory() as d:
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(src, f), d)
    tok = json.load(open(os.path.join(src, "tokenizer.json")))
    ids = list(tok["model"]["vocab"].values()) + [a["id"] for a in tok["added_tokens"]]
    vocab_size = max(ids) + 1
    json.dump({"vocab_size": vocab_size}, open(os.path.join(d, "config.json"), "w"))
    w = gguf.GGUFWriter(out, "qwen3")
    Vocab(__import__("pathlib").Path(d), w, vocab_size)._set_vocab_gpt2()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
print(f"wrote {out} ({os.path.getsize(out)} bytes)", file=sys.stderr)
