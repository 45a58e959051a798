//! End-to-end parity on the CPU backend against transformers: the fixtures' fp32 reference
//! logits (max |error| / max |reference| <= 1e-3) and 24-token greedy continuations (identical),
//! both as one prefill of the whole sequence and as a one-token prefill followed by single-token
//! decode steps; for the fixtures and their wider hybrids (`WIDE`, 48-token prompts).

mod common;

use common::{describe_positions, reference, rel_max_err, run, FIXTURES, WIDE};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;

fn check(name: &str) {
    let (_, want, cont) = reference(name);
    let (prefill, decode, generated) = run(name, CpuBackend::new, DType::F32);
    for (mode, got) in [("prefill", &prefill), ("decode", &decode)] {
        let err = rel_max_err(got, &want);
        println!("{name}: {mode} max |error| / max |reference| = {err:.2e}");
        println!("{name}: {mode} {}", describe_positions(got, &want));
        assert!(err <= 1e-3, "{name}: {mode} error {err:.2e}");
    }
    assert_eq!(generated, cont, "{name}: greedy continuation");
}

#[test]
fn every_fixture_matches_transformers() {
    for name in FIXTURES.into_iter().chain(WIDE) {
        check(name);
    }
}
