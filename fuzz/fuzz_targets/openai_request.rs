//! Fuzz target: the server's request bodies (`kestrel_server::request::parse`) and the splitter
//! of chat answers (`chat_output::Splitter`). The first byte picks the endpoint (its low bit) and
//! the splitter's settings (bits 1-3) and piece size (the high bits); the rest is the body, and,
//! as text, an answer to split. An answer split in pieces must split as it does whole.

#![no_main]

use kestrel_server::chat_output::{split_in_pieces, Splitter};
use kestrel_server::request::{parse, Endpoint};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    let endpoint = if first & 1 == 0 { Endpoint::Chat } else { Endpoint::Completions };
    match parse(endpoint, body) {
        Ok(r) => {
            assert!(r.n >= 1);
            assert!(r.max_tokens != Some(0));
            assert!(r.stop.iter().all(|s| !s.is_empty()));
        }
        Err(e) => {
            assert_eq!(e.status.as_u16(), 400);
            assert!(!e.message.is_empty());
        }
    }
    let text = String::from_utf8_lossy(body);
    let flags = (first >> 1) & 7;
    let splitter = || Splitter::new(flags & 1 != 0, flags & 2 != 0, flags & 4 != 0);
    let whole = split_in_pieces(splitter(), &text, text.len());
    let pieces = split_in_pieces(splitter(), &text, usize::from(first >> 4) + 1);
    assert_eq!(whole, pieces, "{text:?} in pieces of {}", (first >> 4) + 1);
});
