//! Fuzz target: `tokenizer_config.json`, read by `TokenizerConfig::parse` as
//! `Tokenizer::from_bytes` reads it: the special tokens' text and the chat template (a string, or
//! a list of named templates). A template found is compiled as the engine compiles it and, when
//! it compiles, compiled again within the fuzzing bounds and rendered with the fixed
//! conversation. The fixed `tokenizer.json` beside it is not parsed again for each input (that
//! took 80 ms an input).

#![no_main]

use std::path::Path;

use kestrel_text::{BoundedAlloc, ChatTemplate, TokenizerConfig};
use libfuzzer_sys::fuzz_target;

/// The render's memory bound holds only with the sandbox's allocator installed.
#[global_allocator]
static ALLOC: BoundedAlloc = BoundedAlloc::new();

fuzz_target!(|data: &[u8]| {
    // The file is read with `read_to_string`: text that is not UTF-8 never reaches the parser.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = TokenizerConfig::parse(text, Path::new("tokenizer_config.json")) else {
        return;
    };
    let Some(source) = config.chat_template.as_deref() else {
        return;
    };
    // Compiled as the engine compiles it (default bounds), then rendered within the fuzzing
    // bounds: the default bounds let one input run for seconds.
    if ChatTemplate::new(source).is_err() {
        return;
    }
    let rendered =
        kestrel_fuzz::compile_and_render(source, config.bos_token.as_deref(), config.eos_token.as_deref());
    assert!(
        rendered.is_some(),
        "a source that compiled with the default bounds compiles within the fuzzing bounds"
    );
    let _ = std::hint::black_box(rendered);
});
