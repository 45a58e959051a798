//! Fuzz target: `tokenizer_config.json`, read by `TokenizerConfig::parse` as
//! `Tokenizer::from_bytes` reads it: the special tokens' text and the chat template (a string, or
//! a list of named templates). A template found is compiled as the engine compiles it and, when
//! it compiles, rendered with the fixed conversation within the fuzzing bounds. The fixed
//! `tokenizer.json` beside it is not parsed again for each input (that took 80 ms an input).

#![no_main]

use std::path::Path;
use std::sync::OnceLock;

use kestrel_fuzz::{Conversation, LIMITS};
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
    // Compiled as the engine compiles it (default bounds), then compiled again within the
    // fuzzing bounds to render: the default bounds let one input run for seconds.
    if ChatTemplate::new(source).is_err() {
        return;
    }
    let template = ChatTemplate::with_limits(source, LIMITS).expect("a source that compiled compiles again");
    static CONVERSATION: OnceLock<Conversation> = OnceLock::new();
    let conversation = CONVERSATION.get_or_init(Conversation::new);
    let input = conversation.input(config.bos_token.as_deref(), config.eos_token.as_deref());
    let _ = std::hint::black_box(kestrel_fuzz::render(&template, &input));
});
