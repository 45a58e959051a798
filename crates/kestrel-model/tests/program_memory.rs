//! Programs a session holds past the backend's memory: preparing another drops the least
//! recently used ones until it fits, and every step still gives the logits it gives without a
//! limit; a program that fits no limit left is an out-of-memory error naming the bytes.

mod common;

use common::{dir, reference};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{Session, Want};

const NAME: &str = "qwen3_moe";

fn session(limit: Option<usize>) -> Session<CpuBackend> {
    let backend = match limit {
        Some(bytes) => CpuBackend::new().with_program_memory(bytes),
        None => CpuBackend::new(),
    };
    Session::open(&dir(NAME), backend, 64, DType::F32).unwrap()
}

/// The last logits of the prompt's first `n` tokens, as a fresh prefill.
fn prefix(s: &mut Session<CpuBackend>, tokens: &[u32], n: usize) -> kestrel_model::Result<Vec<f32>> {
    Ok(s.step(&tokens[..n], 0, Want::LastLogits)?.into_logits().unwrap())
}

#[test]
fn programs_past_the_memory_are_dropped_for_the_next() {
    let (tokens, _, _) = reference(NAME);
    assert!(tokens.len() >= 12);
    // The least memory a 12-token step's program takes (its activations and buffers): between
    // a limit it fails at and one it fits.
    let fits = |limit: usize| prefix(&mut session(Some(limit)), &tokens, 12).is_ok();
    let (mut lo, mut hi) = (0usize, 1usize << 20);
    while !fits(hi) {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1024 {
        let mid = (lo + hi) / 2;
        match fits(mid) {
            true => hi = mid,
            false => lo = mid,
        }
    }
    // Room for the 12-token program but never beside the 11-token one: each step of the two
    // lengths in turn drops the other's program.
    let lengths = [12, 11, 12, 11, 7, 12];
    let mut free = session(None);
    let mut bounded = session(Some(hi));
    for &n in &lengths {
        let want = prefix(&mut free, &tokens, n).unwrap();
        let got = prefix(&mut bounded, &tokens, n).unwrap();
        assert_eq!(got, want, "{n} tokens");
    }
    assert_eq!(free.programs_evicted_for_memory(), 0);
    assert!(
        bounded.programs_evicted_for_memory() >= lengths.len() as u64 - 1,
        "{} programs dropped",
        bounded.programs_evicted_for_memory()
    );
    // Too little for the program even alone: an error that says so.
    let err = prefix(&mut session(Some(lo)), &tokens, 12)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("out of memory") && err.contains("given for programs"),
        "{err}"
    );
}
