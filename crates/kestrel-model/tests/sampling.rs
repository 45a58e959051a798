//! A session sampling on its backend draws the tokens the host algorithm draws from the logits
//! the session returns, with the same seed and penalties, over a generated sequence (CPU
//! backend, every fixture architecture).

mod common;

use common::{dir, reference, FIXTURES};
use kestrel_core::rng::Rng;
use kestrel_core::sample::{counts_of, distribution, draw, penalize, SamplingParams};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::Session;

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
            .with_sampling(params);
        assert!(s.samples_on_backend());
        s.set_sample_history(&prompt).unwrap();
        let mut got = vec![s.prefill_sample_next_token(&prompt, 0, 5).unwrap()];
        for i in 0..15 {
            let at = prompt.len() + i;
            got.push(s.sample_next_token(&[got[i]], at).unwrap());
        }
        // On the host, from the logits.
        let mut h = Session::open(&dir(name), CpuBackend::new(), 64, DType::F32).unwrap();
        let mut rng = Rng::new(params.seed);
        let mut history = prompt.clone();
        let mut logits = h.prefill(&prompt, 0, 5, false).unwrap();
        let mut want = Vec::new();
        for i in 0..16 {
            let counts = counts_of(&history, logits.len());
            penalize(&mut logits, &counts, &params);
            let t = draw(&distribution(&logits, &params), &mut rng);
            want.push(t);
            history.push(t);
            if i < 15 {
                logits = h.forward(&[t], prompt.len() + i, false).unwrap();
            }
        }
        assert_eq!(got, want, "{name}");
    }
}
