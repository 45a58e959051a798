//! GGUF files as llama.cpp writes them, read by Kestrel: the reader against llama.cpp's own
//! Python writer and reader (`gguf` on PyPI) on `tests/gguf/reader.gguf` (every value type, a
//! custom alignment, seven tensor types); a tokenizer as llama.cpp's converter writes one
//! (`tokenizer.gguf`) against the same tokenizer's `tokenizer.json`; and the parity models as
//! llama.cpp's converter writes them (`NAME-TYPE.gguf`). The scripts that made each are in
//! `scripts/gguf/`.

use kestrel_model::gguf::{Array, Gguf, Value};
use serde_json::Value as Json;

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xEDB8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// The value as the fixture's JSON writes it: its type name and value.
fn as_json(v: &Value) -> (String, Json) {
    let array = |a: &Array| -> (&str, Json) {
        match a {
            Array::U8(v) => ("UINT8", v.clone().into()),
            Array::I8(v) => ("INT8", v.clone().into()),
            Array::U16(v) => ("UINT16", v.clone().into()),
            Array::I16(v) => ("INT16", v.clone().into()),
            Array::U32(v) => ("UINT32", v.clone().into()),
            Array::I32(v) => ("INT32", v.clone().into()),
            Array::U64(v) => ("UINT64", v.clone().into()),
            Array::I64(v) => ("INT64", v.clone().into()),
            Array::F32(v) => (
                "FLOAT32",
                v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>().into(),
            ),
            Array::F64(v) => ("FLOAT64", v.clone().into()),
            Array::Bool(v) => ("BOOL", v.clone().into()),
            Array::String(v) => ("STRING", v.clone().into()),
        }
    };
    let (t, j): (&str, Json) = match v {
        Value::U8(x) => ("UINT8", (*x).into()),
        Value::I8(x) => ("INT8", (*x).into()),
        Value::U16(x) => ("UINT16", (*x).into()),
        Value::I16(x) => ("INT16", (*x).into()),
        Value::U32(x) => ("UINT32", (*x).into()),
        Value::I32(x) => ("INT32", (*x).into()),
        Value::U64(x) => ("UINT64", (*x).into()),
        Value::I64(x) => ("INT64", (*x).into()),
        Value::F32(x) => ("FLOAT32", f64::from(*x).into()),
        Value::F64(x) => ("FLOAT64", (*x).into()),
        Value::Bool(x) => ("BOOL", (*x).into()),
        Value::String(x) => ("STRING", x.clone().into()),
        Value::Array(a) => {
            let (t, j) = array(a);
            return (format!("ARRAY:{t}"), j);
        }
    };
    (t.to_string(), j)
}

#[test]
fn the_reader_finds_what_llama_cpps_reader_finds() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let bytes = std::fs::read(dir.join("reader.gguf")).unwrap();
    let want: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reader.json")).unwrap()).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    assert_eq!(g.alignment, want["alignment"].as_u64().unwrap());
    assert_eq!(g.data_start, want["data_start"].as_u64().unwrap());
    let meta = want["metadata"].as_object().unwrap();
    assert_eq!(
        g.keys().collect::<Vec<_>>(),
        meta.keys().map(String::as_str).collect::<Vec<_>>()
    );
    for (key, w) in meta {
        let (t, j) = as_json(g.get(key).unwrap());
        assert_eq!(t, w["type"].as_str().unwrap(), "{key}");
        assert_eq!(j, w["value"], "{key}");
    }
    let tensors = want["tensors"].as_array().unwrap();
    assert_eq!(g.tensors.len(), tensors.len());
    for (t, w) in g.tensors.iter().zip(tensors) {
        assert_eq!(t.name, w["name"].as_str().unwrap());
        let dims: Vec<u64> = w["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.ty.name, w["type"].as_str().unwrap(), "{}", t.name);
        assert_eq!(
            t.start - g.data_start,
            w["data_offset"].as_u64().unwrap(),
            "{}",
            t.name
        );
        assert_eq!(t.bytes, w["bytes"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(
            u64::from(crc32(t.data(&bytes))),
            w["crc32"].as_u64().unwrap(),
            "{}",
            t.name
        );
    }
}

/// The tokenizer llama.cpp's converter writes into a GGUF file (`tests/gguf/tokenizer.gguf`, by
/// `scripts/gguf/make-tokenizer-fixture.py` from kestrel-text's test tokenizer: byte-level BPE,
/// Qwen2's pre-tokenizer, control tokens) read back as a tokenizer: every text, multilingual and
/// with special tokens, encodes to the ids `tokenizer.json` gives and decodes back alike. (This
/// vocabulary has no token of two digits, so how Qwen2's and Llama 3's patterns group digits is
/// not told apart here; the patterns are those of the models' `tokenizer.json`, as llama.cpp's
/// `llama-vocab.cpp` quotes them.)
#[test]
fn a_gguf_tokenizer_encodes_as_its_tokenizer_json_does() {
    use kestrel_text::Tokenizer;
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let text_dir = kestrel_testing::fixtures::path("crates/kestrel-text/tests/tokenizer");
    let g = Gguf::parse(&std::fs::read(dir.join("tokenizer.gguf")).unwrap()).unwrap();
    let json = serde_json::to_vec(&g.tokenizer_json().unwrap()).unwrap();
    let path = dir.join("tokenizer.gguf");
    let from_gguf = Tokenizer::from_bytes(&json, None, &path, &path).unwrap();
    let reference = Tokenizer::from_dir(&text_dir).unwrap().unwrap();
    assert_eq!(from_gguf.vocab_size(), reference.vocab_size());
    let encodings: Json =
        serde_json::from_str(&std::fs::read_to_string(text_dir.join("encodings.json")).unwrap()).unwrap();
    let mut texts: Vec<String> = (encodings.as_array().unwrap().iter())
        .map(|e| e["text"].as_str().unwrap().to_string())
        .collect();
    texts.extend(
        [
            "Grüße aus Köln, naïve café — 東京で会いましょう。Привет, мир! 안녕하세요 مرحبا 🦙🚀 3.14159 x**2",
            "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>",
            "  leading spaces\t\ttabs\r\nCRLF   trailing   ",
            "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
        ]
        .map(String::from),
    );
    for t in &texts {
        for special in [false, true] {
            let ids = reference.encode(t, special).unwrap();
            assert_eq!(
                from_gguf.encode(t, special).unwrap(),
                ids,
                "{t:?} (special tokens {special})"
            );
            for skip in [false, true] {
                assert_eq!(
                    from_gguf.decode(&ids, skip).unwrap(),
                    reference.decode(&ids, skip).unwrap(),
                    "{t:?}"
                );
            }
        }
    }
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>"] {
        assert_eq!(from_gguf.token_id(token), reference.token_id(token), "{token}");
    }
}

/// Tokenizers Kestrel does not read from GGUF metadata are refused with what it reads named.
#[test]
fn an_unknown_gguf_tokenizer_is_refused_by_name() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let mut bytes = std::fs::read(dir.join("tokenizer.gguf")).unwrap();
    // "qwen2" -> "qwen9" where the pre-tokenizer's name is stored.
    let at = bytes.windows(5).position(|w| w == b"qwen2").unwrap();
    bytes[at + 4] = b'9';
    let e = Gguf::parse(&bytes)
        .unwrap()
        .tokenizer_json()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"qwen9\" is not a pre-tokenizer Kestrel reads (qwen2, qwen35, llama-bpe)"),
        "{e}"
    );
    // Another tokenizer model: "gpt2" -> "bert" (the value after the key, its type and length).
    let key = b"tokenizer.ggml.model";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 12;
    assert_eq!(&bytes[at..at + 4], b"gpt2");
    bytes[at..at + 4].copy_from_slice(b"bert");
    let e = Gguf::parse(&bytes)
        .unwrap()
        .tokenizer_json()
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"bert\": only \"gpt2\" (byte-level BPE)"), "{e}");
    // The reader's own fixture names no pre-tokenizer.
    let g = Gguf::parse(&std::fs::read(dir.join("reader.gguf")).unwrap()).unwrap();
    let e = g.tokenizer_json().unwrap_err().to_string();
    assert!(
        e.contains("\"tokenizer.ggml.pre\"") && e.contains("missing"),
        "{e}"
    );
}

/// The parity fixtures as llama.cpp's own converter writes them (`tests/gguf/NAME-TYPE.gguf`, by
/// `scripts/gguf/make-model-fixtures.py`; each given a byte-level tokenizer of its 256 tokens
/// first): every file reads, names the architecture llama.cpp gives the model, has the layers,
/// widths and experts of the model's `config.json`, its tensors of the types its file type
/// implies, and a tokenizer that encodes text as its UTF-8 bytes (token i is byte i).
#[test]
fn llama_cpps_conversions_of_the_parity_models_read() {
    use kestrel_text::Tokenizer;
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let parity = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity");
    let cases = [
        ("llama", "f16", "llama"),
        ("llama", "q8_0", "llama"),
        ("qwen3", "bf16", "qwen3"),
        ("qwen3_next", "f16", "qwen3next"),
        ("qwen3_next", "q8_0", "qwen3next"),
        ("qwen3_5_moe", "f16", "qwen35moe"),
        ("qwen3_5_moe", "q8_0", "qwen35moe"),
    ];
    for (name, ty, arch) in cases {
        let path = dir.join(format!("{name}-{ty}.gguf"));
        let bytes = std::fs::read(&path).unwrap();
        let g = Gguf::parse(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let config: Json =
            serde_json::from_str(&std::fs::read_to_string(parity.join(name).join("config.json")).unwrap())
                .unwrap();
        let text = if config["text_config"].is_object() {
            &config["text_config"]
        } else {
            &config
        };
        let key = |k: &str| g.u64(&format!("{arch}.{k}")).unwrap();
        assert_eq!(g.str("general.architecture").unwrap(), arch, "{name}");
        assert_eq!(
            key("block_count"),
            text["num_hidden_layers"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            key("embedding_length"),
            text["hidden_size"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            key("attention.head_count"),
            text["num_attention_heads"].as_u64().unwrap(),
            "{name}"
        );
        assert_eq!(
            key("attention.head_count_kv"),
            text["num_key_value_heads"].as_u64().unwrap(),
            "{name}"
        );
        if let Some(experts) = text["num_experts"].as_u64() {
            assert_eq!(key("expert_count"), experts, "{name}");
            assert_eq!(
                key("expert_used_count"),
                text["num_experts_per_tok"].as_u64().unwrap(),
                "{name}"
            );
            // Experts stacked: [in, out, experts] in ggml's order.
            let down = g.tensor("blk.0.ffn_down_exps.weight").unwrap();
            let inter = text["moe_intermediate_size"].as_u64().unwrap();
            assert_eq!(
                down.dims,
                [inter, text["hidden_size"].as_u64().unwrap(), experts],
                "{name}"
            );
        }
        // Matrices in the file's type; norms, biases and small vectors stay F32.
        let want = ty.to_uppercase();
        let embed = g.tensor("token_embd.weight").unwrap();
        assert_eq!(embed.ty.name, want, "{name}");
        assert!(
            g.tensors.iter().all(|t| t.ty.name == want || t.ty.name == "F32"),
            "{name}"
        );
        assert!(g.tensors.iter().any(|t| t.ty.name == "F32"), "{name}");
        let json = serde_json::to_vec(&g.tokenizer_json().unwrap()).unwrap();
        let tok = Tokenizer::from_bytes(&json, None, &path, &path).unwrap();
        let s = "Grüße, 東京! x**2";
        let ids: Vec<u32> = s.bytes().map(u32::from).collect();
        assert_eq!(tok.encode(s, false).unwrap(), ids, "{name}");
        assert_eq!(tok.decode(&ids, false).unwrap(), s, "{name}");
    }
}

/// A SentencePiece BPE vocabulary as llama.cpp's converter writes one (`tokenizer-spm.gguf`, by
/// `scripts/gguf/make-spm-fixture.py`: a model trained as Llama 2's is, byte fallback, identity
/// normalisation): every test text (spaces leading and doubled, accents, Cyrillic, Japanese
/// that no piece covers, code, an emoji, nothing) encodes to the ids SentencePiece itself gives,
/// with the beginning token in front when special tokens are added, and decodes back.
#[test]
fn a_sentencepiece_vocabulary_encodes_as_sentencepiece_does() {
    use kestrel_text::Tokenizer;
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
    let path = dir.join("tokenizer-spm.gguf");
    let g = Gguf::parse(&std::fs::read(&path).unwrap()).unwrap();
    let json = serde_json::to_vec(&g.tokenizer_json().unwrap()).unwrap();
    let tok = Tokenizer::from_bytes(&json, None, &path, &path).unwrap();
    let want: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer-spm.json")).unwrap()).unwrap();
    let bos = want["bos"].as_u64().unwrap() as u32;
    let cases = want["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text, false).unwrap(), ids, "{text:?}");
        let with_bos: Vec<u32> = std::iter::once(bos).chain(ids.iter().copied()).collect();
        assert_eq!(tok.encode(text, true).unwrap(), with_bos, "{text:?}");
        if !text.starts_with(' ') {
            assert_eq!(tok.decode(&ids, false).unwrap(), text, "{text:?}");
        }
    }
}
