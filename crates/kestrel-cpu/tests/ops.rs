//! Every op on the CPU backend against its float64 reference, on fresh random shapes and data.

use kestrel_core::ir::DeltaAlgo;
use kestrel_core::rng::Rng;
use kestrel_cpu::testing::{self, all_cases, f32s, rel_err, run_case, u32s, Case, Expect};
use kestrel_cpu::CpuBackend;

/// f32 arithmetic against f64: errors stay far under this.
const TOL: f64 = 2e-5;

fn check(case: &Case, seed: u64) {
    let mut cpu = CpuBackend::new();
    let outs = run_case(&mut cpu, case).unwrap_or_else(|e| panic!("seed {seed} {}: {e}", case.name));
    for (check, bytes) in case.checks.iter().zip(outs) {
        match &check.expect {
            Expect::Floats(want) => {
                let err = rel_err(&f32s(&bytes), want);
                assert!(
                    err <= TOL,
                    "seed {seed} {} / {}: relative error {err:e}",
                    case.name,
                    check.label
                );
            }
            Expect::Backends => {}
            Expect::Ids(want) => {
                assert_eq!(&u32s(&bytes), want, "seed {seed} {} / {}", case.name, check.label)
            }
        }
    }
}

#[test]
fn every_op_matches_its_f64_reference() {
    let (mut rng, seed) = Rng::from_time();
    for round in 0..4 {
        for case in all_cases(&mut rng) {
            check(&case, seed);
            let _ = round;
        }
    }
}

#[test]
fn chunked_delta_rule_equals_recurrent_steps() {
    let (mut rng, seed) = Rng::from_time();
    for _ in 0..3 {
        let s = rng.next_u64();
        let rec = testing::deltanet(Rng::new(s), DeltaAlgo::Recurrent);
        let chunk = testing::deltanet(
            Rng::new(s),
            DeltaAlgo::Chunked {
                chunk: 1 + (s % 40) as usize,
            },
        );
        let (a, b) = (
            run_case(&mut CpuBackend::new(), &rec).unwrap(),
            run_case(&mut CpuBackend::new(), &chunk).unwrap(),
        );
        for ((ca, x), y) in rec.checks.iter().zip(&a).zip(&b) {
            let (x, y) = (f32s(x), f32s(y));
            let yf: Vec<f64> = y.iter().map(|&v| v as f64).collect();
            let err = rel_err(&x, &yf);
            assert!(
                err <= TOL,
                "seed {seed} {}: {} differs between chunked and recurrent: {err:e}",
                rec.name,
                ca.label
            );
        }
    }
}
