//! Fuzz target: the server's request bodies (`kestrel_server::request::parse`) and the splitter
//! of chat answers (`chat_output::Splitter`). The first byte picks the endpoint (its low bit) and
//! the splitter's settings (bits 1-3) and piece size (the high bits); the rest is the body, and,
//! as text, an answer to split. An answer split in pieces must split as it does whole.

#![no_main]

use kestrel_server::chat_output::{Part, Splitter};
use kestrel_server::request::{parse, Endpoint};
use libfuzzer_sys::fuzz_target;

/// The parts of `text` fed to a splitter in pieces of `n` bytes (at character boundaries),
/// adjacent text parts of one kind joined.
fn split(text: &str, n: usize, flags: u8) -> Vec<Part> {
    let mut s = Splitter::new(flags & 1 != 0, flags & 2 != 0, flags & 4 != 0);
    let mut parts = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut at = n.min(rest.len());
        while !rest.is_char_boundary(at) {
            at += 1;
        }
        parts.extend(s.push(&rest[..at]));
        rest = &rest[at..];
    }
    parts.extend(s.finish());
    let mut joined: Vec<Part> = Vec::new();
    for p in parts {
        match (joined.last_mut(), &p) {
            (Some(Part::Content(a)), Part::Content(b)) | (Some(Part::Reasoning(a)), Part::Reasoning(b)) => {
                a.push_str(b)
            }
            _ => joined.push(p),
        }
    }
    joined
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    let endpoint = if first & 1 == 0 { Endpoint::Chat } else { Endpoint::Completions };
    if let Ok(r) = parse(endpoint, body) {
        assert!(r.n >= 1);
        assert!(r.max_tokens != Some(0));
        assert!(r.stop.iter().all(|s| !s.is_empty()));
    } else if let Err(e) = parse(endpoint, body) {
        assert_eq!(e.status.as_u16(), 400);
        assert!(!e.message.is_empty());
    }
    let text = String::from_utf8_lossy(body);
    let flags = (first >> 1) & 7;
    let whole = split(&text, text.len().max(1), flags);
    let pieces = split(&text, usize::from(first >> 4) + 1, flags);
    assert_eq!(whole, pieces, "{text:?} in pieces of {}", (first >> 4) + 1);
});
