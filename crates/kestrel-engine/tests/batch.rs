//! The batcher against one sequence at a time, on the CPU backend with the built-in model:
//! more requests than slots, prompts of different lengths, greedy and sampled (each with its
//! own seed), stop strings and token limits; every sequence's tokens and text equal what
//! `Engine::generate_pieces` gives it alone. Once with every sequence's context reserved,
//! once with a pool so small that sequences are preempted and run again; prompts that begin
//! alike find the blocks of those before them (prefix caching) and still give the same.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use kestrel_core::Config;
use kestrel_engine::{
    BackendChoice, Batcher, Engine, EngineOptions, Model, ModelSource, SeqEvent, SeqRequest, StepKinds,
    StopReason,
};
use kestrel_text::SamplingParams;

const CTX: usize = 128;

/// What a sequence produced: its token ids, its text, why it ended.
#[derive(Debug, Clone, PartialEq, Default)]
struct Got {
    ids: Vec<u32>,
    text: String,
    end: Option<StopReason>,
}

/// A prefix of more than two blocks that some prompts start with.
const SHARED: &str =
    "You are a helpful assistant. Answer briefly and truthfully, and say so when you do not know. ";

fn engine(max_seqs: Option<usize>, kv_blocks: Option<usize>) -> Engine {
    let model = Model::open(&ModelSource::Builtin).unwrap();
    let opts = EngineOptions {
        backend: Some(BackendChoice::Cpu),
        max_seqs,
        kv_blocks,
        ..EngineOptions::with_ctx(CTX)
    };
    Engine::new(model, &Config::default(), opts).unwrap()
}

fn requests(engine: &Engine) -> Vec<SeqRequest> {
    let text = engine.text();
    let prompts = [
        "The quick brown fox",
        "Once upon a time, in a land far away, there lived",
        "1, 2, 3,",
        "Hello",
        "A long time ago in a galaxy far, far away, the rebels and the empire fought over",
        "Q: what is the capital of France?\nA:",
    ];
    let mut out = Vec::new();
    for i in 0..14 {
        let prompt = match i % 3 {
            0 => format!("{SHARED}{}", prompts[i % prompts.len()]),
            _ => prompts[i % prompts.len()].to_string(),
        };
        let ids = text
            .encode_prompt(&prompt, None, true, &Default::default())
            .unwrap();
        // Sampled with settings the backend draws with, and (5, 12, 13) with ones it does not:
        // penalties, or the whole vocabulary under top-p.
        let sampling = if i == 13 {
            SamplingParams {
                temperature: 0.9,
                top_p: 0.9,
                seed: 100 + i as u64,
                ..Default::default()
            }
        } else if i % 7 == 5 {
            SamplingParams {
                temperature: 0.9,
                top_k: 40,
                repetition_penalty: 1.3,
                seed: 100 + i as u64,
                ..Default::default()
            }
        } else if i % 3 == 1 {
            SamplingParams {
                temperature: 0.8,
                top_k: 20,
                seed: 100 + i as u64,
                ..Default::default()
            }
        } else {
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            }
        };
        out.push(SeqRequest {
            ids,
            max_tokens: [24, 5, 40, 1, 17][i % 5],
            stops: if i % 4 == 3 {
                vec![" the".into()]
            } else {
                Vec::new()
            },
            sampling,
            ignore_eos: i % 2 == 0,
            logprobs: (i % 5 == 2).then_some(3),
        });
    }
    out
}

fn alone(req: &SeqRequest) -> Got {
    let mut e = engine(None, None);
    e.set_sampling(req.sampling).unwrap();
    e.set_ignore_eos(req.ignore_eos);
    e.set_logprobs(req.logprobs);
    let mut got = Got::default();
    let turn = e
        .generate_pieces(
            &req.ids,
            req.max_tokens,
            &req.stops,
            &mut |p| {
                got.ids.extend(p.id);
                got.text.push_str(p.text);
                Ok(())
            },
            &AtomicBool::new(false),
        )
        .unwrap();
    got.end = Some(turn.stop_reason);
    got
}

/// Each sequence's output, the preemptions, and the prompt tokens found in the caches.
fn batched(
    max_seqs: usize,
    kv_blocks: Option<usize>,
    reqs: &[SeqRequest],
) -> (Vec<Got>, u64, usize, StepKinds) {
    let mut b = Batcher::new(engine(Some(max_seqs), kv_blocks))
        .ok()
        .expect("a pool");
    let got: Arc<Mutex<Vec<Got>>> = Arc::new(Mutex::new(vec![Got::default(); reqs.len()]));
    let reused = Arc::new(Mutex::new(0));
    for (i, r) in reqs.iter().enumerate() {
        let got = got.clone();
        let found = reused.clone();
        b.add(
            r.clone(),
            Box::new(move |e| {
                let mut g = got.lock().unwrap();
                match e {
                    SeqEvent::Piece(p) => {
                        g[i].ids.extend(p.id);
                        g[i].text.push_str(p.text);
                    }
                    SeqEvent::Done {
                        reason,
                        tokens,
                        reused,
                    } => {
                        assert_eq!(tokens, g[i].ids.len(), "sequence {i}: Done's count");
                        g[i].end = Some(reason);
                        *found.lock().unwrap() += reused;
                    }
                    SeqEvent::Failed(e) => panic!("sequence {i} failed: {e}"),
                }
                true
            }),
        )
        .unwrap();
    }
    let mut steps = 0;
    while !b.is_idle() {
        b.step();
        steps += 1;
        assert!(steps < 10_000, "the batcher makes progress");
    }
    assert_eq!(b.kv_blocks().0, 0, "every block is back");
    let kinds = b.step_kinds();
    println!("steps: {kinds:?}");
    let out = got.lock().unwrap().clone();
    let reused = *reused.lock().unwrap();
    (out, b.preempted(), reused, kinds)
}

#[test]
fn batched_sequences_equal_each_sequence_alone() {
    let reqs = requests(&engine(None, None));
    let want: Vec<Got> = reqs.iter().map(alone).collect();
    // Every sequence's context reserved: 4 slots for 14 sequences.
    let (got, preempted, reused, kinds) = batched(4, None, &reqs);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "sequence {i} batched against alone");
    }
    assert_eq!(preempted, 0);
    assert!(kinds.host > 0, "{kinds:?}");
    // Five prompts start with the shared prefix; the three admitted after the first one's
    // prefill find at least its first block.
    println!("prefix caching found {reused} prompt tokens");
    assert!(
        reused >= 3 * kestrel_model::KV_BLOCK,
        "prefix caching found {reused} tokens"
    );
    // One sequence's context of blocks shared by 6 slots: sequences wait and are preempted.
    let (got, preempted, _, _) = batched(6, Some(CTX / kestrel_model::KV_BLOCK), &reqs);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "sequence {i} batched in a small pool against alone");
    }
    assert!(preempted > 0, "a pool this small preempts");
    // Without the requests whose tokens the host must choose, every sampled step is drawn on
    // the backend, each sequence with its own generator, and still equals it alone.
    let on_backend: Vec<usize> = (0..reqs.len())
        .filter(|&i| reqs[i].logprobs.is_none() && kestrel_core::sample::backend_draws(&reqs[i].sampling))
        .collect();
    let subset: Vec<SeqRequest> = on_backend.iter().map(|&i| reqs[i].clone()).collect();
    let (got, _, _, kinds) = batched(4, None, &subset);
    for (g, &i) in got.iter().zip(&on_backend) {
        assert_eq!(g, &want[i], "sequence {i} drawn on the backend against alone");
    }
    assert!(kinds.host == 0 && kinds.drawn > 10, "{kinds:?}");
}

/// `n` greedy requests of random ids below `vocab`, past end-of-sequence ids, of mixed lengths.
fn greedy_requests(n: u32, vocab: u32) -> Vec<SeqRequest> {
    (0..n)
        .map(|i| SeqRequest {
            ids: (0..2 + 5 * (i as usize % 4))
                .map(|j| (i * 37 + j as u32 * 11) % vocab + 1)
                .collect(),
            max_tokens: 5 + i as usize % 4,
            stops: Vec::new(),
            sampling: SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
            ignore_eos: true,
            logprobs: None,
        })
        .collect()
}

/// Each request's ids generated alone on an engine of its own.
fn ids_alone(open: &dyn Fn() -> Engine, reqs: &[SeqRequest]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| {
            let mut e = open();
            e.set_ignore_eos(r.ignore_eos);
            let mut ids = Vec::new();
            e.generate_pieces(
                &r.ids,
                r.max_tokens,
                &r.stops,
                &mut |p| {
                    ids.extend(p.id);
                    Ok(())
                },
                &AtomicBool::new(false),
            )
            .unwrap();
            ids
        })
        .collect()
}

/// Every request's ids generated together by a batcher over `engine`, with the prompt tokens
/// each found in the caches.
fn ids_batched(engine: Engine, reqs: &[SeqRequest]) -> (Vec<Vec<u32>>, Vec<usize>) {
    let mut b = Batcher::new(engine).ok().expect("a pool");
    let got = Arc::new(Mutex::new((
        vec![Vec::<u32>::new(); reqs.len()],
        vec![0usize; reqs.len()],
    )));
    for (i, r) in reqs.iter().enumerate() {
        let got = got.clone();
        b.add(
            r.clone(),
            Box::new(move |e| {
                let mut g = got.lock().unwrap();
                match e {
                    SeqEvent::Piece(p) => g.0[i].extend(p.id),
                    SeqEvent::Done { reused, .. } => g.1[i] = reused,
                    SeqEvent::Failed(e) => panic!("sequence {i} failed: {e}"),
                }
                true
            }),
        )
        .unwrap();
    }
    while !b.is_idle() {
        b.step();
    }
    let out = got.lock().unwrap().clone();
    out
}

/// A hybrid model (recurrent states a row per slot, zeroed for each sequence admitted; no
/// prefix caching): more sequences than slots, each slot used by several in turn, every
/// sequence's tokens equal to its own alone.
#[test]
fn a_hybrid_models_sequences_equal_each_alone() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join("qwen3_next");
    let open = |max_seqs: Option<usize>| {
        let model = Model::open(&ModelSource::Dir(dir.clone())).unwrap();
        let opts = EngineOptions {
            backend: Some(BackendChoice::Cpu),
            max_seqs,
            ..EngineOptions::with_ctx(64)
        };
        Engine::new(model, &Config::default(), opts).unwrap()
    };
    let reqs = greedy_requests(8, 200);
    let alone = ids_alone(&|| open(None), &reqs);
    let (got, reused) = ids_batched(open(Some(3)), &reqs);
    assert_eq!(got, alone);
    assert!(reused.iter().all(|&r| r == 0), "no prefix caching: {reused:?}");
}

/// Batching with the routed experts streamed through small caches of slots (a GPU budget just
/// over the smallest that streams): every sequence equals itself alone under the same budget.
#[test]
fn batched_sequences_with_streamed_experts_equal_each_alone() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join("qwen3_moe");
    let model = || Model::open(&ModelSource::Dir(dir.clone())).unwrap();
    // Just over the smallest budget that streams, for one sequence's caches and for a pool.
    let m = model();
    let budget = |pool: Option<kestrel_model::KvPool>| {
        let shape = kestrel_engine::RunShape {
            ctx: 64,
            cache_dtype: kestrel_core::DType::F32,
            quant: None,
            prefill_chunk: 64,
            pool,
        };
        let p = kestrel_engine::Placement::plan(&m.config, &m.weights, shape, u64::MAX / 2, None).unwrap();
        p.min_gpu_bytes() + 2 * p.expert_span
    };
    let open = |max_seqs: Option<usize>| {
        let pool = max_seqs.map(|seqs| kestrel_model::KvPool {
            seqs,
            blocks: seqs * 64 / kestrel_model::KV_BLOCK,
        });
        let opts = EngineOptions {
            backend: Some(BackendChoice::Cpu),
            max_seqs,
            kv_blocks: pool.map(|p| p.blocks),
            gpu_mem: Some(budget(pool)),
            ..EngineOptions::with_ctx(64)
        };
        let e = Engine::new(model(), &Config::default(), opts).unwrap();
        assert!(e.placement().is_some(), "the experts stream");
        e
    };
    let reqs = greedy_requests(6, 250);
    let alone = ids_alone(&|| open(None), &reqs);
    assert_eq!(ids_batched(open(Some(4)), &reqs).0, alone);
}
