//! Fuzz target: the command line as the `kestrel` binary parses it (`kestrel::parse`), with the
//! input as the value of a size, count, number or token-list flag, and `ByteSize::from_str` on
//! the same value. Parse only: no command runs. A parse error is rendered, as the binary prints it.

#![no_main]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::str::FromStr;

use kestrel_engine::ByteSize;
use libfuzzer_sys::fuzz_target;

/// Each command line: the words before the flag, and the flag the value goes with.
const LINES: [(&[&str], &str); 8] = [
    (&["run"], "--prompt-tokens"),
    (&["logits", "--out", "/nonexistent/x"], "--tokens"),
    (&["run"], "-c"),
    (&["inspect"], "--ctx"),
    (&["bench"], "--gpu-mem"),
    (&["run"], "--host-mem"),
    (&["run"], "--temp"),
    (&["run"], "--prefill-chunk"),
];

fuzz_target!(|data: &[u8]| {
    // The first byte picks the line, and whether the value is a word of its own (`--flag X`)
    // or joined to the flag (`--flag=X`, `-cX`); the rest is the value, any bytes (an argument
    // need not be UTF-8).
    let Some((&pick, value)) = data.split_first() else {
        return;
    };
    let (words, flag) = LINES[usize::from(pick) % LINES.len()];
    let mut args: Vec<OsString> = std::iter::once("kestrel")
        .chain(words.iter().copied())
        .map(OsString::from)
        .collect();
    if pick & 0x80 == 0 {
        args.push(flag.into());
        args.push(OsString::from_vec(value.to_vec()));
    } else {
        let joint = if flag.starts_with("--") { "=" } else { "" };
        let mut arg = format!("{flag}{joint}").into_bytes();
        arg.extend_from_slice(value);
        args.push(OsString::from_vec(arg));
    }
    if let Err(e) = kestrel::parse(args) {
        std::hint::black_box(e.render().to_string());
    }
    if let Ok(text) = std::str::from_utf8(value) {
        if let Ok(size) = ByteSize::from_str(text) {
            std::hint::black_box(size.to_string());
        }
    }
});
