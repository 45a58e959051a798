#!/usr/bin/env python3
"""Trains the byte-level BPE tokenizer of Kestrel's built-in model on the documentation strings
of the Python standard library, which the script gathers itself (by parsing the library's
sources, importing nothing).

    python3 scripts/train-tokenizer.py OUT_DIR [--vocab 4096] [--samples]    # needs `tokenizers`

Writes OUT_DIR/tokenizer.json and OUT_DIR/tokenizer_config.json (special tokens and a ChatML chat
template), and prints what it read; with `--samples`, also OUT_DIR/encodings.json: the ids the
`tokenizers` library gives a few awkward strings and the text it decodes them to (test data). The pre-tokenizer is Qwen2's split pattern over bytes, so the
tokenizer behaves like the ones of the model families Kestrel runs. The same Python version gives
the same corpus and the same tokenizer.
"""
import argparse
import ast
import json
import os
import sys
import sysconfig

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added, not special: shown when decoded (the Qwen3 convention).
ADDED = ["<think>", "</think>"]
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SAMPLES = [
    "Return the number of items in a container.",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "Zürich, naïve café — 東京 and emoji 🦅🐍 in one line.",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHi!",
    "   leading spaces, trailing spaces   ",
    "",
]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def documented():
    """(qualified name, docstring) of every module, class and function in the standard library's
    sources, in a fixed order (sorted paths, then source order), each docstring once. Shared with
    scripts/train-builtin-model.py."""
    root = sysconfig.get_paths()["stdlib"]
    seen, out = set(), []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)[:-3].replace(os.sep, ".")
            module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            try:
                tree = ast.parse(open(os.path.join(dirpath, name), encoding="utf-8").read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue

            def visit(node, prefix):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40 and doc not in seen:
                    seen.add(doc)
                    out.append((prefix, doc))
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        visit(child, f"{prefix}.{child.name}")

            visit(tree, module)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--samples", action="store_true")
    a = ap.parse_args()
    docs = [doc for _, doc in documented()]
    print(f"Python {sys.version.split()[0]}: {len(docs)} docstrings, {sum(map(len, docs))} characters")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=a.vocab, min_frequency=2, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    tok.add_tokens(ADDED)
    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
        "chat_template": CHATML,
    }
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"vocabulary {tok.get_vocab_size()} written to {a.out}")
    if a.samples:
        samples = []
        for text in SAMPLES:
            ids = tok.encode(text).ids
            samples.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
        with open(os.path.join(a.out, "encodings.json"), "w") as f:
            json.dump(samples, f, indent=1, ensure_ascii=False)
            f.write("\n")


if __name__ == "__main__":
    main()
