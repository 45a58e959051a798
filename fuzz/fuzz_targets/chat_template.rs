//! Fuzz target: a chat template's source (`ChatTemplate::with_limits`, within the fuzzing
//! bounds) compiled and, when it compiles, rendered in its sandbox with the fixed conversation
//! (system, user, an assistant tool call, the tool's result, user; one tool; a generation prompt).

#![no_main]

use kestrel_text::BoundedAlloc;
use libfuzzer_sys::fuzz_target;

/// The render's memory bound holds only with the sandbox's allocator installed, as in the binary.
#[global_allocator]
static ALLOC: BoundedAlloc = BoundedAlloc::new();

fuzz_target!(|data: &[u8]| {
    // Templates are read with `read_to_string` or out of a JSON string: always UTF-8.
    let Ok(source) = std::str::from_utf8(data) else {
        return;
    };
    let _ = std::hint::black_box(kestrel_fuzz::compile_and_render(
        source,
        Some("<s>"),
        Some("</s>"),
    ));
});
