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

/// Attention read by a quantised product, at the shapes the CUDA test of the same case takes
/// (its decode kernel storing its output rounded): the case's references hold on the CPU.
#[test]
fn attention_then_product_matches_its_f64_reference() {
    let (mut rng, seed) = Rng::from_time();
    for _ in 0..16 {
        check(&cases::attention_then_product(Rng::new(rng.next_u64())), seed);
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

/// The `SampleRows` op, run step after step with fresh logits, picks for each row what the host
/// algorithm picks with the same generator, penalised by the row's counts where it names one,
/// and keeps those counts (the drawn token counted) between runs.
#[test]
fn sample_rows_follow_the_host_algorithm() {
    use kestrel_core::sample::{
        counts_of, distribution, draw, draw_words, penalize, rng_state, SamplingParams, DRAWN_WORDS,
    };
    use kestrel_core::{Backend, DType, GraphBuilder};
    let (mut rng, seed) = Rng::from_time();
    let params = [
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.02,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 64,
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.2,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.5,
            ..Default::default()
        },
    ];
    let (vocab, rows) = (3000, params.len());
    let mut g = GraphBuilder::new();
    let logits = g.logits_input("logits", rows, vocab);
    let draws = g.draws_input("draws", rows);
    // Rows 1 and 2 keep their counts in rows 2 and 0 of the state.
    let counts = g.state("counts", DType::U32, [3, vocab]);
    let out = g.sample_rows("sample_rows", logits, draws, counts);
    g.mark_output(out);
    let graph = g.finish().unwrap();
    let mut cpu = CpuBackend::new();
    let mut p = cpu.prepare(&graph).unwrap();
    let counts_row = [None, Some(2u32), Some(0)];
    let mut history: Vec<Vec<u32>> = (0..rows)
        .map(|_| (0..20).map(|_| rng.range(0, vocab) as u32).collect())
        .collect();
    for (r, row) in counts_row.iter().enumerate() {
        if let Some(c) = row {
            cpu.upload_at(
                &mut p,
                counts,
                *c as usize * vocab,
                &counts_of(&history[r], vocab),
            )
            .unwrap();
        }
    }
    let mut states: Vec<Rng> = (0..rows).map(|r| Rng::new(seed ^ r as u64)).collect();
    for step in 0..30 {
        let l: Vec<f32> = (0..rows * vocab).map(|_| rng.symmetric() * 5.0).collect();
        let words: Vec<u32> = (0..rows)
            .flat_map(|r| draw_words(&params[r], states[r].state(), counts_row[r]))
            .collect();
        cpu.upload(&mut p, logits, &l).unwrap();
        cpu.upload(&mut p, draws, &words).unwrap();
        cpu.run(&mut p).unwrap();
        let got = cpu.download::<u32>(&p, out).unwrap();
        for r in 0..rows {
            let mut row = l[r * vocab..(r + 1) * vocab].to_vec();
            if counts_row[r].is_some() {
                penalize(&mut row, &counts_of(&history[r], vocab), &params[r]);
            }
            let want = draw(&distribution(&row, &params[r]), &mut states[r]);
            let o = &got[r * DRAWN_WORDS..(r + 1) * DRAWN_WORDS];
            assert_eq!(o[0], want, "seed {seed} step {step} row {r}");
            assert_eq!(
                rng_state(&o[1..]),
                states[r].state(),
                "seed {seed} step {step} row {r}"
            );
            history[r].push(want);
        }
    }
    let kept = cpu.download::<u32>(&p, counts).unwrap();
    for (r, row) in counts_row.iter().enumerate() {
        if let Some(c) = row {
            let c = *c as usize;
            assert_eq!(
                kept[c * vocab..(c + 1) * vocab],
                counts_of(&history[r], vocab),
                "row {r}"
            );
        }
    }
    // The row no sequence's counts were kept in was never written.
    assert!(kept[vocab..2 * vocab].iter().all(|&n| n == 0));
}
