//! The tokenizer of `tests/tokenizer/` (trained by `scripts/fixtures/train-tokenizer.py`, the built-in
//! model's recipe): ids equal what the Python `tokenizers` library gives for awkward strings,
//! text round-trips (also through the copy the built-in model ships), streaming never prints half
//! a character and adds up to the whole decode, and the directory's config supplies the special
//! tokens and the chat template.

use std::path::PathBuf;

use kestrel_core::rng::Rng;
use kestrel_text::{ChatInput, Tokenizer};
use serde_json::Value;

fn dir() -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-text/tests/tokenizer")
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_dir(&dir())
        .unwrap()
        .expect("tokenizer.json present")
}

#[test]
fn ids_equal_the_python_library() {
    let t = tokenizer();
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("encodings.json")).unwrap()).unwrap();
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(t.encode(text, true).unwrap(), want, "{text:?}");
        assert_eq!(t.decode(&want, false).unwrap(), case["decoded"].as_str().unwrap());
        assert_eq!(
            t.decode(&want, true).unwrap(),
            case["decoded_skip_special"].as_str().unwrap()
        );
    }
}

/// Random text over ASCII, Latin, CJK, emoji and whitespace.
fn random_text(rng: &mut Rng, n: usize) -> String {
    let pool: Vec<char> = "abc XYZ 0129 .,;:!?()[]{}\n\t éüßñ 東京語 🦅🐍👍🏽 \u{200d}"
        .chars()
        .collect();
    (0..n).map(|_| pool[rng.range(0, pool.len())]).collect()
}

/// The built-in model's directory, which ships this tokenizer.
fn builtin() -> PathBuf {
    kestrel_testing::fixtures::path("models/kestrel-tiny")
}

#[test]
fn text_round_trips_and_streams_whole_characters() {
    let shipped = Tokenizer::from_dir(&builtin())
        .unwrap()
        .expect("the built-in model's tokenizer");
    for t in [tokenizer(), shipped] {
        round_trips(&t);
    }
}

fn round_trips(t: &Tokenizer) {
    let (mut rng, seed) = Rng::from_time();
    for _ in 0..50 {
        let text = random_text(&mut rng, 80);
        let ids = t.encode(&text, false).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), text, "seed {seed}");
        let mut stream = t.stream();
        let mut out = String::new();
        for &id in &ids {
            let piece = stream.push(id).unwrap();
            assert!(
                !piece.contains('\u{FFFD}'),
                "seed {seed}: half a character printed in {piece:?}"
            );
            out += &piece;
        }
        out += &stream.finish().unwrap();
        assert_eq!(out, text, "seed {seed}");
    }
}

#[test]
fn a_character_split_over_tokens_waits_for_its_last_byte() {
    let t = tokenizer();
    let ids = t.encode("🦅", false).unwrap();
    assert!(
        ids.len() > 1,
        "the eagle is not one token in a 4k vocabulary: {ids:?}"
    );
    let mut stream = t.stream();
    for &id in &ids[..ids.len() - 1] {
        assert_eq!(stream.push(id).unwrap(), "");
    }
    assert_eq!(stream.push(ids[ids.len() - 1]).unwrap(), "🦅");
}

#[test]
fn config_gives_special_tokens_and_template() {
    let t = tokenizer();
    assert_eq!(t.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(t.bos_token, None);
    let eos = t.token_id("<|im_end|>").unwrap();
    assert_eq!(t.encode("<|im_end|>", false).unwrap(), [eos]);
    let template = t.template().unwrap().expect("a chat template");
    let messages = [serde_json::json!({"role": "user", "content": "Hi"})];
    let text = template
        .render(&ChatInput {
            messages: &messages,
            add_generation_prompt: true,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    // No tokenizer.json: no tokenizer, not an error; a broken one names the file.
    assert!(
        Tokenizer::from_dir(&std::env::temp_dir().join("kestrel-no-such-dir"))
            .unwrap()
            .is_none()
    );
    let broken = std::env::temp_dir().join(format!("kestrel-broken-tok-{}", std::process::id()));
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::write(broken.join("tokenizer.json"), "{ not json").unwrap();
    let err = Tokenizer::from_dir(&broken).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&broken).unwrap();
}

/// The error `Tokenizer::from_bytes` gives `json` as the tests' `tokenizer.json` (it must fail).
fn load_error(json: &[u8]) -> String {
    let path = dir().join("tokenizer.json");
    Tokenizer::from_bytes(json, None, &path, &dir().join("tokenizer_config.json"))
        .err()
        .expect("an error")
        .to_string()
}

/// Invalid JSON inside the `decoder` section, where the tokenizers crate panics instead of
/// failing, is an error naming the file.
#[test]
fn invalid_json_in_the_decoder_is_an_error_not_a_panic() {
    let json = std::fs::read_to_string(dir().join("tokenizer.json")).unwrap();
    let at = json.find("\"decoder\"").expect("a decoder section");
    let type_at = at + json[at..].find("\"type\"").unwrap();
    let mut bad = json.into_bytes();
    bad[type_at] = 0x01;
    let e = load_error(&bad);
    assert!(
        e.contains("tokenizer.json") && e.contains("not valid JSON"),
        "{e}"
    );
}

/// Bytes that are not UTF-8 inside a string of the `decoder` section (a fuzzing find: they
/// passed a check that skipped strings, then the tokenizers crate panicked on them) are an error
/// naming the file.
#[test]
fn bytes_that_are_not_utf8_in_the_decoder_are_an_error_not_a_panic() {
    let mut json = br#"{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}, "decoder": {"type": "Sequence", "decoders": [{"type": "Strip", "content": " ", "star##t": 0, "stop": 0}]}}"#.to_vec();
    let at = json.windows(2).position(|w| w == b"##").unwrap();
    json[at] = 0xff;
    json[at + 1] = 0xfe;
    let e = load_error(&json);
    assert!(
        e.contains("tokenizer.json") && e.contains("not valid JSON"),
        "{e}"
    );
}

/// A `tokenizer.json` larger than any tokenizer is refused before it is parsed.
#[test]
fn a_tokenizer_past_the_size_bound_is_refused() {
    let e = load_error(&vec![b' '; kestrel_text::MAX_TOKENIZER_BYTES + 1]);
    assert!(e.contains("more than a tokenizer holds"), "{e}");
}
