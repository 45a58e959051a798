//! A session drawing on its backend picks the tokens the host algorithm picks from the logits
//! the session returns, with the same generators and penalties, over generated sequences (CPU
//! backend, every fixture architecture; CUDA when a device is present).

mod common;

use common::{dir, reference, FIXTURES};
use kestrel_core::rng::Rng;
use kestrel_core::sample::{counts_of, distribution, draw, penalize, SamplingParams};
use kestrel_core::DType;
use kestrel_cpu::CpuBackend;
use kestrel_model::{Session, Want};

/// A batched step drawn on the backend (`step_mixed_drawn`: each output row with its own
/// settings and generator) picks what the host picks from the same step's logits with the
/// same generators, and hands back the generators as the host leaves them: several sequences
/// of a pool with different settings (greedy among them), each fed its draws, a prompt's chunk
/// riding along where the model allows it, padding rows in the bucket (five outputs pad to
/// eight), one row with penalties from the token counts the backend keeps for its sequence.
#[test]
fn batched_draws_equal_host_draws_from_the_logits() {
    draws_against_host(&CpuBackend::new, DType::F32);
}

/// The same on CUDA (graph replay, bf16 caches): the drawing program computes the logits with
/// the kernels the logits program uses, so the host's draws from those logits are the GPU's,
/// bit for bit.
#[test]
fn batched_draws_equal_host_draws_from_the_logits_on_cuda() {
    let Some(dev) =
        kestrel_testing::gpu::device_or_skip("batched_draws_equal_host_draws_from_the_logits_on_cuda")
    else {
        return;
    };
    let backend = || kestrel_cuda::CudaBackend::new(dev.clone(), kestrel_cuda::RunMode::Graph);
    draws_against_host(&backend, DType::BF16);
}

fn draws_against_host<B: kestrel_core::Backend>(backend: &dyn Fn() -> B, cache: DType) {
    use kestrel_core::sample::backend_draws;
    let params = [
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            seed: 1,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 64,
            top_p: 0.9,
            min_p: 0.05,
            seed: 2,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.9,
            top_k: 30,
            top_p: 0.95,
            repetition_penalty: 1.4,
            presence_penalty: 0.5,
            frequency_penalty: 0.3,
            seed: 3,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.5,
            top_k: 5,
            seed: 4,
            ..Default::default()
        },
    ];
    let rows = params.len();
    assert!(params.iter().all(backend_draws));
    for name in FIXTURES {
        let (prompt, _, _) = reference(name);
        let open = || {
            let mut s = Session::open(&dir(name), backend(), 64, cache)
                .unwrap()
                .with_kv_pool(6, 24)
                .unwrap();
            let table: Vec<u32> = (0..6 * s.max_blocks() as u32).map(|b| b % 24).collect();
            s.set_page_table(&table).unwrap();
            s
        };
        let (mut drawn, mut host) = (open(), open());
        let hybrid = drawn.config.arch.is_hybrid();
        let mut states: Vec<[u64; 4]> = params.iter().map(|p| Rng::new(p.seed).state()).collect();
        let mut host_rngs: Vec<Rng> = params.iter().map(|p| Rng::new(p.seed)).collect();
        // Sequences 0-4 start from one prompt token each (the penalised one's counts set from
        // it); sequence 5's prompt runs as a chunk beside them (models without recurrent
        // states).
        let mut next: Vec<u32> = (0..rows).map(|i| prompt[i]).collect();
        let mut history: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        drawn.set_draw_counts(3, &history[3]).unwrap();
        for step in 0..8 {
            let mut seqs: Vec<u32> = (0..rows as u32).collect();
            let (mut ids, mut pos) = (next.clone(), vec![step as u32; rows]);
            if !hybrid && step < 2 {
                for p in 0..4 {
                    seqs.push(rows as u32);
                    ids.push(prompt[p % prompt.len()]);
                    pos.push((step * 4 + p) as u32);
                }
            }
            let got = drawn
                .step_mixed_drawn(&seqs, &ids, &pos, &params, &mut states)
                .unwrap();
            let logits = host
                .step_mixed(&seqs, &ids, &pos, rows, Want::AllLogits)
                .unwrap()
                .into_logits()
                .unwrap();
            let vocab = host.config.vocab;
            let want: Vec<u32> = (0..rows)
                .map(|r| {
                    let mut row = logits[r * vocab..(r + 1) * vocab].to_vec();
                    penalize(&mut row, &counts_of(&history[r], vocab), &params[r]);
                    draw(&distribution(&row, &params[r]), &mut host_rngs[r])
                })
                .collect();
            assert_eq!(got, want, "{name} step {step}");
            for (r, (s, h)) in states.iter().zip(&host_rngs).enumerate() {
                assert_eq!(*s, h.state(), "{name} step {step} row {r}: the generator");
            }
            for (h, &t) in history.iter_mut().zip(&got) {
                h.push(t);
            }
            next = got;
        }
        // Greedy rows leave their generators where they were; sampled ones moved them.
        assert_eq!(states[1], Rng::new(params[1].seed).state());
        assert_ne!(states[0], Rng::new(params[0].seed).state());
        // Settings the backend does not draw with are refused by name.
        let whole = SamplingParams {
            top_k: 0,
            ..params[0]
        };
        let e = drawn
            .step_mixed_drawn(&[0], &[next[0]], &[8], &[whole], &mut [[0; 4]])
            .unwrap_err();
        assert!(e.to_string().contains("does not draw"), "{e}");
        // More outputs than tokens, or generators than outputs: refused, not a panic.
        let e = drawn
            .step_mixed_drawn(&[0], &[next[0]], &[8], &params[..2], &mut [[0; 4]; 2])
            .unwrap_err();
        assert!(e.to_string().contains("for 1 tokens"), "{e}");
        let e = drawn
            .step_mixed_drawn(&[0], &[next[0]], &[8], &params[..1], &mut [[0; 4]; 2])
            .unwrap_err();
        assert!(e.to_string().contains("2 generators"), "{e}");
    }
}
