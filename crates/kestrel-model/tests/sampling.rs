//! A session sampling on its backend draws the tokens the host algorithm draws from the logits
//! the session returns, with the same seed and penalties, over a generated sequence (CPU
//! backend, every fixture architecture).

mod common;

use common::{dir, reference, FIXTURES};
use kestrel_core::rng::Rng;
use kestrel_core::sample::{counts_of, distribution, draw, penalize, SamplingParams};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{Session, Want};

#[test]
fn backend_sampling_equals_host_sampling() {
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 30,
        top_p: 0.95,
        repetition_penalty: 1.2,
        frequency_penalty: 0.1,
        seed: 42,
        ..Default::default()
    };
    for name in FIXTURES {
        let (prompt, _, _) = reference(name);
        // On the backend.
        let mut s = Session::open(&dir(name), CpuBackend::new(), 64, DType::F32)
            .unwrap()
            .with_sampling(params)
            .with_prefill_chunk(Some(5))
            .unwrap();
        assert!(s.samples_on_backend());
        s.set_sample_history(&prompt).unwrap();
        let sample = |s: &mut Session<CpuBackend>, ids: &[u32], at| {
            s.step(ids, at, Want::Sample).unwrap().token().unwrap()
        };
        let mut got = vec![sample(&mut s, &prompt, 0)];
        for i in 0..15 {
            let at = prompt.len() + i;
            got.push(sample(&mut s, &[got[i]], at));
        }
        // On the host, from the logits.
        let mut h = Session::open(&dir(name), CpuBackend::new(), 64, DType::F32)
            .unwrap()
            .with_prefill_chunk(Some(5))
            .unwrap();
        let mut rng = Rng::new(params.seed);
        let mut history = prompt.clone();
        let mut logits = h
            .step(&prompt, 0, Want::LastLogits)
            .unwrap()
            .into_logits()
            .unwrap();
        let mut want = Vec::new();
        for i in 0..16 {
            let counts = counts_of(&history, logits.len());
            penalize(&mut logits, &counts, &params);
            let t = draw(&distribution(&logits, &params), &mut rng);
            want.push(t);
            history.push(t);
            if i < 15 {
                logits = h
                    .step(&[t], prompt.len() + i, Want::LastLogits)
                    .unwrap()
                    .into_logits()
                    .unwrap();
            }
        }
        assert_eq!(got, want, "{name}");
    }
}
