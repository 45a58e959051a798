//! Fuzz target: `generation_config.json` (`GenerationConfig::from_json`), then the sampling
//! parameters it gives, a sampler built from them, and one token drawn from a fixed row of logits
//! with a fixed history, as a run with the model's defaults would draw its first token.

#![no_main]

use kestrel_text::{GenerationConfig, Sampler};
use libfuzzer_sys::fuzz_target;

/// Logits with ties, a negative and a large value, and a history that repeats and names a token
/// past the vocabulary.
const LOGITS: [f32; 12] = [0.5, -1.0, 3.0, 3.0, 0.0, -30.0, 12.5, 1e-3, 2.0, -0.5, 7.0, 0.25];
const HISTORY: [u32; 6] = [2, 2, 6, 11, 40, 0];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = GenerationConfig::from_json(text) else {
        return;
    };
    let params = config.sampling();
    // `from_json` checks every value the file sets, so its parameters make a sampler.
    let mut sampler = Sampler::new(params).expect("a generation config that parses gives valid sampling");
    let mut logits = LOGITS;
    let token = sampler.sample(&mut logits, &HISTORY);
    assert!((token as usize) < LOGITS.len(), "token {token} of {params:?}");
});
