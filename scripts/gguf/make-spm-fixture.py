#!/usr/bin/env python3
"""Writes the SentencePiece tokenizer fixture: crates/kestrel-model/tests/gguf/tokenizer-spm.gguf,
a BPE SentencePiece model as Llama 2's is (byte fallback, identity normalisation, a dummy prefix,
<unk> <s> </s> at ids 0-2), trained here on the standard library's docstrings and a few lines of
other languages (600 pieces), written into GGUF metadata by llama.cpp's converter's own
`_set_vocab_sentencepiece` (torch, which the converter imports but this part does not use, is a
stub); and tokenizer-spm.json beside it: test texts and the ids SentencePiece itself
(`sentencepiece` on PyPI) encodes them to, which the tokenizer Kestrel builds from the metadata
must give.

    pip install sentencepiece gguf numpy transformers
    # llama.cpp's source: the llama-cpp-python sdist on PyPI carries it under vendor/llama.cpp
    python3 scripts/gguf/make-spm-fixture.py PATH/TO/llama.cpp
"""
import json
import os
import pathlib
import sys
import tempfile
import types

import sentencepiece as spm
import transformers  # noqa: F401  (imported before the torch stub, which it would take for torch)

llama = sys.argv[1]
root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
out = os.path.join(root, "crates", "kestrel-model", "tests", "gguf")

TEXTS = [
    "Hello world",
    " leading space, and  two  spaces",
    "Return the canonical string representation of the object.",
    "Grüße aus München, schöne Straße.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "東京は日本の首都です。日本語のテキスト",
    "x**2 + y[i] -> {'a': 1}\n\tindented\nnew line",
    "emoji 🦅 and digits 1234567890",
    "",
]


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
    """Only what `_set_vocab_sentencepiece` reads of a model."""

    model_arch = gguf.MODEL_ARCH.LLAMA

    def __init__(self, dir_model, writer, vocab_size):
        self.dir_model = dir_model
        self.hparams = {"vocab_size": vocab_size}
        self.gguf_writer = writer


with tempfile.TemporaryDirectory() as d:
    parts = []
    for mod in ["os", "json", "re", "collections", "itertools", "functools", "pathlib", "string", "textwrap"]:
        for obj in vars(__import__(mod)).values():
            if isinstance(getattr(obj, "__doc__", None), str):
                parts.append(obj.__doc__)
    parts += ["Grüße aus München, schöne Straße.", "Ceci est une phrase en français.",
              "Быстрая коричневая лиса прыгает.", "El niño comió una manzana."] * 20
    corpus = os.path.join(d, "corpus.txt")
    open(corpus, "w").write("\n".join(parts))
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(d, "tokenizer"), vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(d, "tokenizer.model"))
    json.dump({"vocab_size": sp.vocab_size()}, open(os.path.join(d, "config.json"), "w"))
    json.dump({"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
               "unk_token": "<unk>"}, open(os.path.join(d, "tokenizer_config.json"), "w"))
    w = gguf.GGUFWriter(os.path.join(out, "tokenizer-spm.gguf"), "llama")
    Vocab(pathlib.Path(d), w, sp.vocab_size())._set_vocab_sentencepiece()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    cases = [{"text": t, "ids": sp.encode(t)} for t in TEXTS]
    json.dump({"bos": sp.bos_id(), "cases": cases}, open(os.path.join(out, "tokenizer-spm.json"), "w"),
              ensure_ascii=False, indent=1)
print("wrote tokenizer-spm.gguf and tokenizer-spm.json", file=sys.stderr)
