"""Copying a GGUF file's metadata into a new file with llama.cpp's own Python package (`gguf`
on PyPI): shared by the fixture scripts that rewrite a file (make-quant-fixtures.py,
make-fused-fixtures.py, make-split-fixture.py)."""
from gguf import GGUFValueType


def copy_metadata(reader, writer, edit=lambda key, value: value):
    """Adds every key of `reader` to `writer` with its type, each value through `edit(key,
    value)`; the `GGUF.*` keys and the architecture, which the writer writes itself, are left
    out."""
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        ty = f.types[0]
        sub = f.types[1] if ty == GGUFValueType.ARRAY else None
        writer.add_key_value(key, edit(key, f.contents()), ty, sub)
