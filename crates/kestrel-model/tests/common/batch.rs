//! Batched decode against one sequence at a time, on any backend: sequences of mixed lengths
//! in a pool of KV blocks scattered at random (and, for hybrids, a recurrent-state row each),
//! joining and leaving the batch at different steps, each step's logits compared with those of
//! the same sequence run alone. Joining sequences' prompts run alone before the step, or (mixed
//! steps, models without recurrent states) inside it: the prompts' tokens in the same step as
//! the others' next tokens, each prompt's last token an output. Where several prompts join at
//! once (step 0), their chunks share the step, each token attending its own sequence; a prompt
//! joining alone runs as one sequence's chunk.

use kestrel_core::rng::Rng;
use kestrel_core::{Backend, DType};
use kestrel_model::{Session, Want};

use super::{dir, VOCAB};

const CTX: usize = 64;

/// One sequence of the schedule: its prompt, the step it joins the batch at (its prompt is
/// prefilled just before), and the tokens it then decodes (fed, not sampled, so both runs see
/// the same ones).
struct Seq {
    prompt: Vec<u32>,
    join: usize,
    fed: Vec<u32>,
}

fn schedule(tokens: &[u32], rng: &mut Rng) -> Vec<Seq> {
    // Prompt lengths, joining steps and decode lengths: mixed, one sequence of a single token,
    // some joining late; five at once at step 3 (a bucket of 8, three tokens of padding).
    let shape = [(3, 0, 6), (12, 0, 2), (7, 1, 4), (1, 0, 6), (9, 3, 3), (5, 2, 4)];
    shape
        .iter()
        .enumerate()
        .map(|(i, &(len, join, steps))| Seq {
            prompt: (0..len).map(|j| tokens[(i + j) % tokens.len()]).collect(),
            join,
            fed: (0..steps).map(|_| rng.range(0, VOCAB) as u32).collect(),
        })
        .collect()
}

/// What a comparison found: the largest relative error of any logits row and how many rows'
/// argmax differed (with the backend's argmax of a batched step checked against its logits):
/// by more than the row's own error explains, and within it (a near-tie of the alone row,
/// whose top two logits are closer than twice the largest difference between the rows).
pub struct Found {
    /// Prompts ran inside the batched steps (asked for, and the model has no recurrent states).
    pub mixed: bool,
    pub max_err: f32,
    pub rows: usize,
    pub top1_differs: usize,
    pub near_ties: usize,
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

fn argmax(row: &[f32]) -> u32 {
    kestrel_core::sample::argmax(row)
}

/// Runs the schedule for fixture `name` both ways on backends from `backend`, with caches of
/// `cache`; with `mixed` (ignored for hybrids), prompts inside the batched steps.
pub fn batched_against_alone<B: Backend>(
    name: &str,
    backend: &dyn Fn() -> B,
    cache: DType,
    seed: u64,
    mixed: bool,
) -> Found {
    let mut rng = Rng::new(seed);
    let (tokens, _, _) = super::reference(name);
    let hybrid = kestrel_model::ModelConfig::from_dir(&dir(name))
        .unwrap()
        .arch
        .is_hybrid();
    let seqs = schedule(&tokens, &mut rng);
    let mixed = mixed && !hybrid;

    // Alone: each sequence in a session of its own, prompt then one token at a time.
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for s in &seqs {
        let mut session = Session::open(&dir(name), backend(), CTX, cache).unwrap();
        let mut rows = vec![session
            .step(&s.prompt, 0, Want::LastLogits)
            .unwrap()
            .into_logits()
            .unwrap()];
        for (i, &t) in s.fed.iter().enumerate() {
            let at = s.prompt.len() + i;
            rows.push(
                session
                    .step(&[t], at, Want::LastLogits)
                    .unwrap()
                    .into_logits()
                    .unwrap(),
            );
        }
        alone.push(rows);
    }

    // Batched: one session, a pool with three spare blocks, every block somewhere at random.
    let n = seqs.len();
    let session = Session::open(&dir(name), backend(), CTX, cache).unwrap();
    let max_blocks = session.max_blocks();
    let blocks = n * max_blocks + 3;
    let mut session = session.with_kv_pool(n, blocks).unwrap();
    let mut pool: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.range(0, i + 1));
    }
    session.set_page_table(&pool[..n * max_blocks]).unwrap();

    let mut found = Found {
        mixed,
        max_err: 0.0,
        rows: 0,
        top1_differs: 0,
        near_ties: 0,
    };
    let check = |got: &[f32], want: &[f32], found: &mut Found| {
        found.max_err = found.max_err.max(rel_err(got, want));
        found.rows += 1;
        let (g, w) = (argmax(got) as usize, argmax(want) as usize);
        if g != w {
            let diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            match want[w] - want[g] <= 2.0 * diff {
                true => found.near_ties += 1,
                false => found.top1_differs += 1,
            }
        }
    };
    let steps = seqs.iter().map(|s| s.join + s.fed.len()).max().unwrap();
    for step in 0..steps {
        // Sequences joining now: their prompts, each alone, or all in a mixed step.
        let (mut prompts, mut first_alone) = (Vec::new(), Vec::new());
        for i in (0..n).filter(|&i| seqs[i].join == step) {
            match mixed {
                true => prompts.push(i),
                false => first_alone.push(i),
            }
        }
        for &i in &first_alone {
            session.select_seq(i).unwrap();
            let logits = session
                .step(&seqs[i].prompt, 0, Want::LastLogits)
                .unwrap()
                .into_logits()
                .unwrap();
            check(&logits, &alone[i][0], &mut found);
        }
        // Then one token of every sequence still decoding; in a mixed step, the joining
        // prompts' last tokens are outputs too (before the others) and their other tokens
        // follow the outputs.
        let live: Vec<usize> = (0..n)
            .filter(|&i| step >= seqs[i].join && step - seqs[i].join < seqs[i].fed.len())
            .collect();
        if live.is_empty() && prompts.is_empty() {
            continue;
        }
        let k = |i: usize| step - seqs[i].join;
        let (mut sq, mut ids, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        for &i in &prompts {
            let p = &seqs[i].prompt;
            sq.push(i as u32);
            ids.push(p[p.len() - 1]);
            pos.push(p.len() as u32 - 1);
        }
        for &i in &live {
            sq.push(i as u32);
            ids.push(seqs[i].fed[k(i)]);
            pos.push((seqs[i].prompt.len() + k(i)) as u32);
        }
        let outputs = sq.len();
        for &i in &prompts {
            let p = &seqs[i].prompt;
            for (j, &t) in p[..p.len() - 1].iter().enumerate() {
                sq.push(i as u32);
                ids.push(t);
                pos.push(j as u32);
            }
        }
        let logits = session
            .step_mixed(&sq, &ids, &pos, outputs, Want::AllLogits)
            .unwrap()
            .into_logits()
            .unwrap();
        assert_eq!(logits.len(), outputs * VOCAB);
        let want = prompts
            .iter()
            .map(|&i| &alone[i][0])
            .chain(live.iter().map(|&i| &alone[i][k(i) + 1]));
        for (r, want) in want.enumerate() {
            check(&logits[r * VOCAB..(r + 1) * VOCAB], want, &mut found);
        }
        // The same step again for the backend's argmax (it writes the same cache rows again;
        // recurrent states would advance twice, so not for hybrids).
        if hybrid {
            continue;
        }
        let picked = session
            .step_mixed(&sq, &ids, &pos, outputs, Want::Argmax)
            .unwrap()
            .into_tokens()
            .unwrap();
        let want: Vec<u32> = logits.chunks(VOCAB).map(argmax).collect();
        assert_eq!(
            picked, want,
            "{name} step {step}: the batch's argmax against its logits"
        );
    }
    found
}
