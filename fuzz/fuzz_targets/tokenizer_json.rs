//! Fuzz target: `tokenizer.json`, read by `Tokenizer::from_bytes` as a model directory's is (the
//! JSON checked first, then the tokenizers crate's reader); a tokenizer that loads encodes a fixed
//! text, decodes the ids and streams them back one by one, as generation does.

#![no_main]

use std::path::Path;

use kestrel_text::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(t) = Tokenizer::from_bytes(data, None, Path::new("tokenizer.json"), Path::new("tokenizer_config.json"))
    else {
        return;
    };
    let Ok(ids) = t.encode("Hello, wörld!\n  你好 <think>12345</think>", true) else {
        return;
    };
    let _ = std::hint::black_box(t.decode(&ids, false));
    let mut stream = t.stream();
    for &id in &ids {
        let _ = std::hint::black_box(stream.push(id));
    }
    let _ = std::hint::black_box(stream.finish());
});
