//! The batcher against one sequence at a time, on the CPU backend with the built-in model:
//! more requests than slots, prompts of different lengths, greedy and sampled (each with its
//! own seed, some with penalties), stop strings and token limits; every sequence's tokens and
//! text equal what it gets alone from `Engine::step`, chunk after chunk, with the host
//! sampler (`reference`). Once with every sequence's context reserved, once with a pool so
//! small that sequences are preempted and run again; prompts that begin alike find the blocks
//! of those before them (prefix caching) and still give the same. And one sequence at a time
//! through the batcher, as `run` and `chat` generate, a turn continuing the last.

use std::sync::{Arc, Mutex};

use kestrel_core::Config;
use kestrel_engine::Want;
use kestrel_engine::{
    BackendChoice, Batcher, Engine, EngineOptions, Model, ModelSource, SeqEvent, SeqRequest, StepKinds,
    StepTimes, StopReason,
};
use kestrel_text::{Sampler, SamplingParams, StopStrings};

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
        // Sampled with settings the backend draws with (5 and 12 with penalties, from the token
        // counts it keeps), and (13) with ones it does not: the whole vocabulary under top-p.
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
    reference(&mut engine(None, None), req)
}

/// What `req` generates when its tokens are run one step after another through
/// [`Engine::step`] (a chunk of one sequence, not the batcher's steps) and chosen on the host
/// with the same algorithm and generator: the reference the batcher is held to.
fn reference(e: &mut Engine, req: &SeqRequest) -> Got {
    let eos = if req.ignore_eos {
        Vec::new()
    } else {
        e.text().eos_ids()
    };
    let tokenizer = e.text().tokenizer.clone();
    let mut stream = tokenizer.as_ref().map(|t| t.stream());
    let mut stops = StopStrings::new(req.stops.iter().cloned());
    let mut sampler = Sampler::new(req.sampling).unwrap();
    let mut history = req.ids.clone();
    let mut got = Got::default();
    let mut logits = e
        .step(&req.ids, 0, Want::LastLogits)
        .unwrap()
        .into_logits()
        .unwrap();
    let end = loop {
        if req.max_tokens == 0 {
            break StopReason::Length;
        }
        let id = sampler.sample(&mut logits, &history);
        if eos.contains(&id) {
            break StopReason::Eos;
        }
        got.ids.push(id);
        history.push(id);
        if let Some(stream) = &mut stream {
            let released = stops.push(&stream.push(id).unwrap());
            got.text.push_str(&released.text);
            if released.stopped {
                got.end = Some(StopReason::Stop);
                return got;
            }
        }
        if got.ids.len() == req.max_tokens {
            break StopReason::Length;
        }
        logits = e
            .step(&[id], history.len() - 1, Want::LastLogits)
            .unwrap()
            .into_logits()
            .unwrap();
    };
    if let Some(stream) = &mut stream {
        let released = stops.push(&stream.finish().unwrap());
        got.text.push_str(&released.text);
        if !released.stopped {
            got.text.push_str(&stops.finish());
        }
    }
    got.end = Some(end);
    got
}

/// Each sequence's output, the preemptions, and the prompt tokens found in the caches.
fn batched(
    max_seqs: usize,
    kv_blocks: Option<usize>,
    reqs: &[SeqRequest],
) -> (Vec<Got>, u64, usize, (StepKinds, StepTimes)) {
    let mut b = Batcher::new(engine(Some(max_seqs), kv_blocks));
    // The counts `on_counted` told, and the tokens handed out: each token handed out ran in a
    // step that counted it (and at least one token of its own) before handing it out.
    let told = Arc::new(Mutex::new((StepTimes::default(), 0u64)));
    let tell = told.clone();
    b.on_counted(move |t| tell.lock().unwrap().0 = t);
    let got: Arc<Mutex<Vec<Got>>> = Arc::new(Mutex::new(vec![Got::default(); reqs.len()]));
    let reused = Arc::new(Mutex::new(0));
    for (i, r) in reqs.iter().enumerate() {
        let got = got.clone();
        let found = reused.clone();
        let told = told.clone();
        b.add(
            r.clone(),
            Box::new(move |e| {
                let mut g = got.lock().unwrap();
                match e {
                    SeqEvent::Piece(p) => {
                        g[i].ids.extend(p.id);
                        g[i].text.push_str(p.text);
                        let mut told = told.lock().unwrap();
                        told.1 += u64::from(p.id.is_some());
                        let counted = told.0.prompt_tokens + told.0.decoded_tokens;
                        assert!(counted >= told.1, "{} tokens out, {:?} counted", told.1, told.0);
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
    // Every token ran once but those found in the caches and each sequence's last, unless a
    // preemption ran some again.
    let t = b.step_times();
    println!("times: {t:?}");
    let ran: usize = (reqs.iter().zip(&out))
        .map(|(r, g)| r.ids.len() + g.ids.len() - 1)
        .sum();
    let counted = (t.prompt_tokens + t.decoded_tokens) as usize;
    match b.preempted() {
        0 => assert_eq!(counted, ran - reused, "{t:?}"),
        _ => assert!(counted > ran - reused, "{t:?}"),
    }
    assert!(t.prompt_steps > 0 && t.decode_steps > 0, "{t:?}");
    assert!(t.prompt_steps + t.decode_steps <= steps, "{t:?} in {steps} steps");
    assert!(t.prompt_seconds > 0.0 && t.decode_seconds > 0.0, "{t:?}");
    assert!(t.programs > 0, "{t:?}");
    (out, b.preempted(), reused, (kinds, t))
}

#[test]
fn batched_sequences_equal_each_sequence_alone() {
    let reqs = requests(&engine(None, None));
    let want: Vec<Got> = reqs.iter().map(alone).collect();
    // Every sequence's context reserved: 4 slots for 14 sequences.
    let (got, preempted, reused, (kinds, times)) = batched(4, None, &reqs);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "sequence {i} batched against alone");
    }
    assert_eq!(preempted, 0);
    assert!(kinds.host > 0, "{kinds:?}");
    // The first four prompts start together, in one step.
    assert!(times.prompt_chunks > times.prompt_steps, "{times:?}");
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
    let (got, _, _, (kinds, _)) = batched(4, None, &subset);
    for (g, &i) in got.iter().zip(&on_backend) {
        assert_eq!(g, &want[i], "sequence {i} drawn on the backend against alone");
    }
    assert!(kinds.host == 0 && kinds.drawn > 10, "{kinds:?}");
}

/// A greedy request for `max_tokens` tokens after `ids`, past end-of-sequence ids.
fn greedy(ids: &[u32], max_tokens: usize) -> SeqRequest {
    SeqRequest {
        ids: ids.to_vec(),
        max_tokens,
        stops: Vec::new(),
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        ignore_eos: true,
        logprobs: None,
    }
}

/// One turn through [`Batcher::generate`] as `run` takes it: `ids`, then up to `n` tokens with
/// the engine's sampling, no stop strings, nothing told as it comes.
fn greedy_turn(b: &mut Batcher, ids: &[u32], n: usize) -> kestrel_engine::Turn {
    b.generate(
        ids,
        n,
        &[],
        &mut |_| Ok(()),
        &std::sync::atomic::AtomicBool::new(false),
    )
    .unwrap()
}

/// `n` greedy requests of random ids below `vocab`, past end-of-sequence ids, of mixed lengths.
fn greedy_requests(n: u32, vocab: u32) -> Vec<SeqRequest> {
    (0..n)
        .map(|i| {
            let ids: Vec<u32> = (0..2 + 5 * (i as usize % 4))
                .map(|j| (i * 37 + j as u32 * 11) % vocab + 1)
                .collect();
            greedy(&ids, 5 + i as usize % 4)
        })
        .collect()
}

/// Each request's ids generated alone on an engine of its own (see [`reference`]).
fn ids_alone(open: &dyn Fn() -> Engine, reqs: &[SeqRequest]) -> Vec<Vec<u32>> {
    reqs.iter().map(|r| reference(&mut open(), r).ids).collect()
}

/// Every request's ids generated together by a batcher over `engine`, with the prompt tokens
/// each found in the caches.
fn ids_batched(engine: Engine, reqs: &[SeqRequest]) -> (Vec<Vec<u32>>, Vec<usize>) {
    let mut b = Batcher::new(engine);
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
            snapshots: 0,
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

/// One sequence at a time through the batcher, as `run` and `chat` generate: a turn that
/// extends the sequence the last turn left continues it in the same slot (the recurrent states
/// of a hybrid as they are, the last partial block of the others), prefilling only what is new,
/// and generates what the sequence gets from scratch; a turn that does not starts afresh; a
/// turn of no tokens still runs its prompt, for the next to continue; `forget` drops what was
/// kept.
#[test]
fn a_turn_that_extends_the_last_one_continues_it() {
    for name in ["qwen3", "qwen3_next"] {
        let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name);
        let open = || {
            let model = Model::open(&ModelSource::Dir(dir.clone())).unwrap();
            let opts = EngineOptions {
                backend: Some(BackendChoice::Cpu),
                ignore_eos: true,
                ..EngineOptions::with_ctx(96)
            };
            Engine::new(model, &Config::default(), opts).unwrap()
        };
        let hybrid = open().config().arch.is_hybrid();
        let mut b = Batcher::new(open());
        let turn = |b: &mut Batcher, ids: &[u32], n| {
            let t = greedy_turn(b, ids, n);
            assert_eq!(t.tokens, reference(&mut open(), &greedy(ids, n)).ids, "{name}");
            assert_eq!(t.reused + t.prefilled, ids.len(), "{name}");
            t
        };
        let first: Vec<u32> = (1..20).collect();
        let t1 = turn(&mut b, &first, 5);
        assert_eq!(t1.reused, 0, "{name}");
        // The next turn: what the first left (its last token never ran), then new tokens.
        let mut next = first.clone();
        next.extend(&t1.tokens);
        next.extend([7, 8, 9]);
        let t2 = turn(&mut b, &next, 6);
        assert_eq!(t2.reused, first.len() + t1.tokens.len() - 1, "{name}");
        // Another sequence: a hybrid starts over; prefix caching finds nothing of it either.
        let other: Vec<u32> = (30..45).rev().collect();
        assert_eq!(turn(&mut b, &other, 4).reused, 0, "{name}");
        // No tokens asked for: the prompt runs, and the next turn continues all of it.
        let t = turn(&mut b, &first, 0);
        assert!(t.tokens.is_empty() && t.prefill_s > 0.0, "{name}");
        let longer: Vec<u32> = first.iter().copied().chain([3, 4]).collect();
        assert_eq!(turn(&mut b, &longer, 3).reused, first.len(), "{name}");
        // Forgotten: only the full blocks prefix caching finds, and for a hybrid nothing.
        b.forget();
        let t = turn(&mut b, &next, 2);
        let blocks = (next.len() - 1) / kestrel_model::KV_BLOCK * kestrel_model::KV_BLOCK;
        assert_eq!(t.reused, if hybrid { 0 } else { blocks }, "{name}");
    }
}

/// Prefix caching for a hybrid: with state snapshots, a prompt's states are kept where its
/// chunks end on a block boundary and at its last full block, and a later sequence whose prompt
/// begins with those blocks goes on from the deepest one kept (the least recently used
/// snapshot giving way when the rows are full), generating exactly what it gets from scratch;
/// without snapshots it computes its whole prompt.
#[test]
fn a_hybrid_goes_on_from_states_kept_at_a_block_boundary() {
    let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join("qwen3_next");
    let open = |snapshots| {
        let model = Model::open(&ModelSource::Dir(dir.clone())).unwrap();
        let opts = EngineOptions {
            backend: Some(BackendChoice::Cpu),
            prefill_chunk: Some(32),
            state_snapshots: snapshots,
            ..EngineOptions::with_ctx(128)
        };
        Engine::new(model, &Config::default(), opts).unwrap()
    };
    // Each turn starts afresh (nothing kept from the last), so only snapshots give reuse.
    let turn = |b: &mut Batcher, ids: &[u32]| {
        b.forget();
        let t = greedy_turn(b, ids, 8);
        assert_eq!(t.tokens, reference(&mut open(0), &greedy(ids, 8)).ids);
        assert_eq!(t.reused + t.prefilled, ids.len());
        t.reused
    };
    let base: Vec<u32> = (1..60).map(|j| (j * 37) % 190 + 1).collect();
    let a = &base[..50];
    // Shares 40 tokens with `a`: two blocks (32 tokens), the end of `a`'s first chunk.
    let b_ids: Vec<u32> = base[..40].iter().copied().chain([191, 192, 193]).collect();
    // Extends `a`'s prompt: three blocks, `a`'s last full block.
    let c_ids: Vec<u32> = a.iter().copied().chain([3, 4, 5]).collect();

    let mut b = Batcher::new(open(4));
    assert_eq!(turn(&mut b, a), 0);
    assert_eq!(turn(&mut b, &b_ids), 32);
    assert_eq!(turn(&mut b, &c_ids), 48);
    assert_eq!(turn(&mut b, a), 48, "the same prompt again");

    // One row: `b_ids`' own chunk end (32) replaces `a`'s last block (48).
    let mut b = Batcher::new(open(1));
    assert_eq!(turn(&mut b, a), 0);
    assert_eq!(
        turn(&mut b, &b_ids),
        0,
        "the snapshot at 32 gave way to the one at 48"
    );
    assert_eq!(turn(&mut b, &c_ids), 32);

    let mut b = Batcher::new(open(0));
    assert_eq!(turn(&mut b, a), 0);
    assert_eq!(turn(&mut b, &c_ids), 0, "no snapshots: no reuse");
}
