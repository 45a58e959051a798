//! Fuzz target: `tokenizer_config.json`, read by `Tokenizer::from_bytes` beside the fixed
//! `tokenizer.json` of kestrel-text's tests: the special tokens' text and the chat template
//! (a string, or a list of named templates). A template found is compiled (`Tokenizer::template`)
//! and, when it compiles, rendered with the fixed conversation within the fuzzing bounds.

#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use kestrel_fuzz::{Conversation, LIMITS};
use kestrel_text::{BoundedAlloc, ChatTemplate, Tokenizer};
use libfuzzer_sys::fuzz_target;

/// The render's memory bound holds only with the sandbox's allocator installed.
#[global_allocator]
static ALLOC: BoundedAlloc = BoundedAlloc::new();

static TOKENIZER_JSON: &[u8] = include_bytes!("../../crates/kestrel-text/tests/tokenizer/tokenizer.json");

fuzz_target!(|data: &[u8]| {
    // The file is read with `read_to_string`: text that is not UTF-8 never reaches the parser.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(tokenizer) = Tokenizer::from_bytes(
        TOKENIZER_JSON,
        Some(text),
        Path::new("tokenizer.json"),
        Path::new("tokenizer_config.json"),
    ) else {
        return;
    };
    // Compiled as the engine compiles it (default bounds), then compiled again within the
    // fuzzing bounds to render: the default bounds let one input run for seconds.
    let Ok(Some(_)) = tokenizer.template() else {
        return;
    };
    let source = tokenizer
        .chat_template
        .as_deref()
        .expect("a compiled template has a source");
    let template = ChatTemplate::with_limits(source, LIMITS).expect("a source that compiled compiles again");
    static CONVERSATION: OnceLock<Conversation> = OnceLock::new();
    let conversation = CONVERSATION.get_or_init(Conversation::new);
    let input = conversation.input(tokenizer.bos_token.as_deref(), tokenizer.eos_token.as_deref());
    let _ = std::hint::black_box(kestrel_fuzz::render(&template, &input));
});
