#!/usr/bin/env bash
# Builds the seed corpora, fuzz/corpus/<target>/, from the repository's fixtures (the parity
# models' weights and configs, the tokenizer config and published chat templates of
# kestrel-text's tests) and small hand-written inputs. `seed.sh [TARGET...]` seeds only those;
# files already in a corpus stay (a corpus grows as the fuzzer finds inputs).
set -euo pipefail
source "$(dirname "$0")/common.sh"
ROOT="$(cd "$FUZZ_DIR/.." && pwd)"
PARITY="$ROOT/crates/kestrel-model/tests/parity"
CONFIGS="$ROOT/crates/kestrel-model/tests/configs"
TEXT_TESTS="$ROOT/crates/kestrel-text/tests"

# seed TARGET NAME: standard input becomes corpus file NAME of TARGET.
seed() {
    mkdir -p "$FUZZ_DIR/corpus/$1"
    cat >"$FUZZ_DIR/corpus/$1/$2"
}

# safetensors_file HEADER DATA_BYTES: a safetensors file of that JSON header, padded with spaces
# to a multiple of 8 as the writer pads it, then DATA_BYTES bytes counting up.
safetensors_file() {
    local header="$1" data="$2"
    while [ $(((${#header}) % 8)) -ne 0 ]; do header="$header "; done
    local n=${#header} i
    for i in 0 1 2 3 4 5 6 7; do printf "\\x$(printf %02x $(((n >> (8 * i)) & 255)))"; done
    printf '%s' "$header"
    for ((i = 0; i < data; i++)); do printf "\\x$(printf %02x $((i & 255)))"; done
}

seed_safetensors() {
    local f name
    # The parity models under 256 KiB whole (bf16 and MLX 4-bit); larger files only slow the
    # fuzzer down, their headers are no different in kind.
    for f in "$PARITY"/*/model.safetensors; do
        name="$(basename "$(dirname "$f")")"
        if [ "$(stat -c %s "$f")" -le 262144 ]; then seed safetensors "parity-$name" <"$f"; fi
    done
    safetensors_file '{}' 0 | seed safetensors empty
    safetensors_file '{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}' 16 |
        seed safetensors f32-metadata
    safetensors_file '{"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},"h":{"dtype":"F16","shape":[1,2],"data_offsets":[6,10]},"u":{"dtype":"U8","shape":[2],"data_offsets":[10,12]}}' 12 |
        seed safetensors half-and-bytes
    safetensors_file '{"w":{"dtype":"U32","shape":[2,1],"data_offsets":[0,8]},"i":{"dtype":"I32","shape":[],"data_offsets":[8,12]},"l":{"dtype":"I64","shape":[1],"data_offsets":[12,20]}}' 20 |
        seed safetensors ints-and-scalar
    safetensors_file '{"z":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},"d":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"t":{"dtype":"BOOL","shape":[2],"data_offsets":[8,10]}}' 10 |
        seed safetensors empty-tensor-and-unread-dtypes
    safetensors_file '{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}' 8 | seed safetensors shape-mismatch
    safetensors_file '{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}' 12 |
        seed safetensors overlap
}

seed_gguf() {
    # llama.cpp's writer's files (every value type, seven tensor types, alignment 64; a
    # tokenizer as its converter writes one), and a small one by hand: no metadata, one F32
    # tensor of four values at the default alignment.
    seed gguf reader <"$ROOT/crates/kestrel-model/tests/gguf/reader.gguf"
    seed gguf tokenizer <"$ROOT/crates/kestrel-model/tests/gguf/tokenizer.gguf"
    seed gguf tokenizer-spm <"$ROOT/crates/kestrel-model/tests/gguf/tokenizer-spm.gguf"
    # Whole models as llama.cpp writes them, for the mapping into a model: Llama (rotary rows,
    # frequency factors), Qwen3-MoE (stacked experts) and the two hybrids, quantised, one of
    # them with its experts' gate and up and its attention's q, k and v fused.
    for m in llama-q8_0 qwen3_moe_all-q4_k_m qwen3_next-q4_k_m qwen3_5_moe-q8_0 qwen3_next-q8_0-fused; do
        seed gguf "$m" <"$ROOT/crates/kestrel-model/tests/gguf/$m.gguf"
    done
    {
        printf 'GGUF\x03\x00\x00\x00'
        printf '\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00'
        printf '\x01\x00\x00\x00\x00\x00\x00\x00t'
        printf '\x01\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00'
        printf '\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00'
        printf '\x00%.0s' $(seq 1 7)
        printf '\x00\x00\x80\x3f%.0s' 1 2 3 4
    } | seed gguf one-tensor
}

seed_safetensors_index() {
    # The target's directory holds model-00001-of-00002.safetensors (model.embed_tokens.weight,
    # model.norm.weight) and model-00002-of-00002.safetensors (lm_head.weight, model.ids).
    local one=model-00001-of-00002.safetensors two=model-00002-of-00002.safetensors
    printf '{"metadata":{"total_size":74},"weight_map":{"model.embed_tokens.weight":"%s","model.norm.weight":"%s","lm_head.weight":"%s","model.ids":"%s"}}' \
        "$one" "$one" "$two" "$two" | seed safetensors_index both-shards
    printf '{"weight_map":{"lm_head.weight":"%s"}}' "$two" | seed safetensors_index one-shard
    printf '{"weight_map":{"lm_head.weight":"%s"}}' "$one" | seed safetensors_index wrong-shard
    printf '{"weight_map":{"x":"missing.safetensors"}}' | seed safetensors_index missing-file
    printf '{"weight_map":{"x":"../%s"}}' "$one" | seed safetensors_index outside
    printf '{"weight_map":{"x":".."}}' | seed safetensors_index dot-dot
    printf '{"weight_map":{"x":"."}}' | seed safetensors_index dot
    printf '{"weight_map":{"x":"model.safetensors.index.json"}}' | seed safetensors_index itself
    printf '{"weight_map":{}}' | seed safetensors_index empty-map
    printf '{"weight_map":{"x":7}}' | seed safetensors_index not-a-name
    printf '[]' | seed safetensors_index not-an-object
}

seed_config_json() {
    local f
    for f in "$PARITY"/*/config.json; do
        seed config_json "parity-$(basename "$(dirname "$f")")" <"$f"
    done
    for f in "$CONFIGS"/*.json; do
        seed config_json "$(basename "$f" .json)" <"$f"
    done
}

seed_generation_config() {
    local f
    for f in "$PARITY"/*/generation_config.json; do
        seed generation_config "parity-$(basename "$(dirname "$f")")" <"$f"
    done
    printf '{"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643], "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}' |
        seed generation_config sampling
    printf '{"eos_token_id": 2, "do_sample": false, "temperature": 0.9}' | seed generation_config greedy
    printf '{"do_sample": true, "temperature": 1e-30, "top_p": 1e-7, "top_k": 0}' | seed generation_config extremes
}

seed_tokenizer_config() {
    local f
    seed tokenizer_config tests <"$TEXT_TESTS/tokenizer/tokenizer_config.json"
    # Each published template as the config's `chat_template`, as hub files carry it.
    if command -v jq >/dev/null; then
        for f in "$TEXT_TESTS"/templates/*.jinja; do
            jq -n --rawfile t "$f" '{bos_token: {content: "<s>"}, eos_token: "</s>", chat_template: $t}' |
                seed tokenizer_config "$(basename "$f" .jinja)"
        done
    else
        echo "seed.sh: no jq, so no tokenizer_config seeds with the published templates" >&2
    fi
    printf '{"eos_token": {"content": "<|im_end|>", "lstrip": false}, "chat_template": [{"name": "default", "template": "{{ bos_token }}{%% for m in messages %%}{{ m.role }}: {{ m.content }}\\n{%% endfor %%}"}, {"name": "tool_use", "template": "{{ tools | tojson }}"}]}' |
        seed tokenizer_config named-templates
}

seed_chat_template() {
    local f
    for f in "$TEXT_TESTS"/templates/*.jinja; do
        seed chat_template "$(basename "$f" .jinja)" <"$f"
    done
    printf '%s' '{% for m in messages %}{{ loop.index }} {{ m.role }}{% if loop.previtem %} after {{ loop.previtem.role }}{% endif %}: {{ m.content | string }}{% if m.tool_calls %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}' | seed chat_template loop-and-tojson
    printf '%s' '{% macro show(v) %}{{ v }}{% endmacro %}{% set ns = namespace(n=0) %}{% for t in tools %}{% set ns.n = ns.n + 1 %}{{ show(t.function.parameters) }}{% endfor %}{{ ns.n }} {{ strftime_now("%d %b %Y") }}' |
        seed chat_template macro-namespace
    printf '%s' '{% if messages[0].role != "system" %}{{ raise_exception("first message must be system") }}{% endif %}{{ messages[0].content.split(" ") | list }} {{ "x".upper() ~ messages|length }}' |
        seed chat_template raise-and-methods
    printf '%s' '{% set s = "ab" %}{% for i in range(3) %}{% set s = s ~ s %}{% endfor %}{{ s|length }} {{ "-" * 8 }} {{ (messages * 2)|length }}' |
        seed chat_template growth
}

seed_cli_flags() {
    # The first byte picks the command line (its low three bits: 0 run --prompt-tokens,
    # 1 logits --tokens, 2 run -c, 3 inspect --ctx, 4 bench --gpu-mem, 5 run --host-mem,
    # 6 run --temp, 7 run --prefill-chunk) and, with bit 7 set, joins the value to the flag.
    seed cli_flags prompt-tokens < <(printf '\000151643,872,13')
    seed cli_flags tokens-joined < <(printf '\2011,2,3')
    seed cli_flags ctx-short < <(printf '\0024096')
    seed cli_flags ctx-short-joined < <(printf '\2020')
    seed cli_flags inspect-ctx < <(printf '\003131072')
    seed cli_flags gpu-mem < <(printf '\00416GiB')
    seed cli_flags gpu-mem-joined < <(printf '\204 1.5 tb')
    seed cli_flags host-mem < <(printf '\005500MB')
    seed cli_flags temp < <(printf '\006-0.7')
    seed cli_flags temp-joined < <(printf '\206nan')
    seed cli_flags prefill-chunk < <(printf '\007512')
    seed cli_flags prefill-chunk-joined < <(printf '\207+18446744073709551616')
}

seed_tokenizer_json() {
    # The tests' byte-level BPE (the built-in model's), and small ones of other kinds.
    seed tokenizer_json tests <"$TEXT_TESTS/tokenizer/tokenizer.json"
    printf '{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "a": 1, "b": 2}, "unk_token": "[UNK]"}, "pre_tokenizer": {"type": "Whitespace"}, "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true}}' |
        seed tokenizer_json word-level
    printf '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<0x41>": 3}, "merges": ["a b"], "byte_fallback": true}, "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "x"}, {"type": "Replace", "pattern": {"String": " "}, "content": "_"}]}, "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}, "added_tokens": [{"id": 4, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}]}' |
        seed tokenizer_json bpe-byte-fallback
}

seed_openai_request() {
    # The first byte: bit 0 the endpoint (0 chat, 1 completions), bits 1-3 the splitter's
    # settings (thinking, opened, tools), the high bits the piece size less one.
    seed openai_request chat < <(printf '\000{"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "stop": ["x"], "seed": 3}')
    seed openai_request chat-stream < <(printf '\020{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}], "stream": true, "stream_options": {"include_usage": true}, "n": 2}')
    seed openai_request chat-tools < <(printf '\016{"messages": [{"role": "user", "content": "w"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": false}}')
    seed openai_request completion-ids < <(printf '\001{"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": true, "top_k": -1, "min_p": 0.1}')
    seed openai_request completion-text < <(printf '\041{"prompt": ["def f():"], "echo": true, "best_of": 1, "logprobs": null}')
    seed openai_request answer-think < <(printf '\062<think>plan</think>\n\nanswer<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    seed openai_request answer-xml < <(printf '\010<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>')
}

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${FUZZ_TARGETS[@]}")
for t in "${targets[@]}"; do
    if ! fuzz_is_target "$t"; then
        echo "seed.sh: no target $t (targets: ${FUZZ_TARGETS[*]})" >&2
        exit 2
    fi
    "seed_$t"
    echo "seed.sh: $t: $(find "$FUZZ_DIR/corpus/$t" -type f | wc -l) files in fuzz/corpus/$t"
done
