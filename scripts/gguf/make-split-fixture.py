#!/usr/bin/env python3
"""Writes a GGUF model split in three files as llama.cpp's writer splits one (`gguf` on PyPI,
`pip install gguf numpy`; the split keys `split.no`, `split.count` and `split.tensors.count` in
every file, the metadata in the first): tests/gguf/split/qwen3_next-q8_0-0000i-of-00003.gguf,
the same model as tests/gguf/qwen3_next-q8_0.gguf with its tensors shared out 30 a file, and
with a chat template added to its metadata (which llama.cpp's converter copies from
`tokenizer_config.json`; the parity fixtures have none).

    python3 scripts/gguf/make-split-fixture.py
"""
import os

from gguf import GGUFReader, GGUFWriter

from gguf_copy import copy_metadata

here = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "kestrel-model", "tests", "gguf")
src = GGUFReader(os.path.join(here, "qwen3_next-q8_0.gguf"))
os.makedirs(os.path.join(here, "split"), exist_ok=True)
arch = src.fields["general.architecture"].contents()
w = GGUFWriter(os.path.join(here, "split", "qwen3_next-q8_0.gguf"), arch, split_max_tensors=30)
copy_metadata(src, w)
w.add_chat_template("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
for t in src.tensors:
    w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(sorted(os.listdir(os.path.join(here, "split"))))
