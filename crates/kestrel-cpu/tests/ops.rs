//! Every op on the CPU backend against its float64 reference, on fresh random shapes and data.

use kestrel_core::ir::DeltaAlgo;
use kestrel_core::rng::Rng;
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_testing::cases::{
    self, all_cases, as_f64, bf16_err, f32s, rel_err, run_case, u32s, Case, Expect, BF16_STEP,
};

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
            Expect::Bf16(want) => {
                let err = bf16_err(&as_f64(&bytes, DType::BF16), want);
                assert!(
                    err <= BF16_STEP,
                    "seed {seed} {} / {}: bf16 error {err:e}",
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
        let rec = cases::deltanet(Rng::new(s), DeltaAlgo::Recurrent);
        let chunk = cases::deltanet(
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

/// The `Sample` op, run step after step with fresh logits, picks what the host algorithm picks
/// with the same seed, keeping the token counts (penalties) and the generator state between runs.
#[test]
fn sample_op_follows_the_host_algorithm() {
    use kestrel_core::sample::{distribution, draw, penalize, rng_words, SamplingParams};
    use kestrel_core::{Backend, DType, GraphBuilder};
    let (mut rng, seed) = Rng::from_time();
    for params in [
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            seed: 3,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 64,
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            seed: 9,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.5,
            ..Default::default()
        },
    ] {
        let vocab = 3000;
        let mut g = GraphBuilder::new();
        let logits = g.logits_input("logits", 1, vocab);
        let counts = g.state("counts", DType::U32, [vocab]);
        let state = g.state("rng", DType::U32, [8]);
        let token = g.sample("sample", logits, counts, state, params);
        g.mark_output(token);
        let graph = g.finish().unwrap();
        let mut cpu = CpuBackend::new();
        let mut p = cpu.prepare(&graph).unwrap();
        let history: Vec<u32> = (0..20).map(|_| rng.range(0, vocab) as u32).collect();
        let mut host_counts = kestrel_core::sample::counts_of(&history, vocab);
        cpu.upload(&mut p, counts, &host_counts).unwrap();
        let mut host_rng = Rng::new(params.seed);
        cpu.upload(&mut p, state, &rng_words(host_rng.state())).unwrap();
        for step in 0..30 {
            let row: Vec<f32> = (0..vocab).map(|_| rng.symmetric() * 5.0).collect();
            cpu.upload(&mut p, logits, &row).unwrap();
            cpu.run(&mut p).unwrap();
            let got = cpu.download::<u32>(&p, token).unwrap()[0];
            let mut l = row.clone();
            penalize(&mut l, &host_counts, &params);
            let want = draw(&distribution(&l, &params), &mut host_rng);
            assert_eq!(got, want, "seed {seed} step {step} {params:?}");
            host_counts[want as usize] += 1;
        }
        assert_eq!(
            cpu.download::<u32>(&p, counts).unwrap(),
            host_counts,
            "counts kept"
        );
    }
}
