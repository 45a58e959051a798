//! Shared by the parity tests: the fixtures' references, a model on any backend, and the
//! comparisons.

#![allow(dead_code)]

pub mod batch;

use std::path::PathBuf;

use kestrel_core::{Backend, DType};
use kestrel_model::{Session, Want, Weights};

pub const VOCAB: usize = 256;

pub fn dir(name: &str) -> PathBuf {
    kestrel_testing::fixtures::path("crates/kestrel-model/tests/parity").join(name)
}

/// A fixture's model on one backend, caches of 128 positions (the fixtures' trained length).
pub fn open<B: Backend>(name: &str, backend: B, cache: DType) -> Session<B> {
    Session::open(&dir(name), backend, 128, cache).unwrap()
}

/// The token ids of an i64 tensor `name` of `w` (how the references store them).
pub fn token_ids(w: &Weights, name: &str) -> Vec<u32> {
    w.get(name)
        .unwrap()
        .bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
        .collect()
}

/// The fixture's tokens, reference logits `[tokens, vocab]` and greedy continuation.
pub fn reference(name: &str) -> (Vec<u32>, Vec<f32>, Vec<u32>) {
    let r = Weights::open(&dir(name).join("reference")).unwrap();
    let tokens = token_ids(&r, "tokens");
    let logits: Vec<f32> = r
        .get("logits")
        .unwrap()
        .bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let greedy: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir(name).join("reference/greedy.json")).unwrap())
            .unwrap();
    let cont = greedy["continuation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    (tokens, logits, cont)
}

/// max |got - want| / max |want|.
pub fn rel_max_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale
}

/// The smallest cosine similarity between corresponding rows of `vocab` values.
pub fn min_cosine(got: &[f32], want: &[f32]) -> f64 {
    got.chunks(VOCAB)
        .zip(want.chunks(VOCAB))
        .map(|(a, b)| {
            let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
            dot / (na * nb)
        })
        .fold(1.0, f64::min)
}

/// Fraction of rows whose largest entry is at the same index.
pub fn top1_agreement(got: &[f32], want: &[f32]) -> f64 {
    let rows = got.len() / VOCAB;
    let same = got
        .chunks(VOCAB)
        .zip(want.chunks(VOCAB))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    same as f64 / rows as f64
}

/// Fraction of rows where `got`'s largest entry is `want`'s, or within `tol` of `want`'s range
/// (max - min) of `want`'s largest: a near-tie, whose order any rounding may swap.
pub fn top1_agreement_or_tie(got: &[f32], want: &[f32], tol: f32) -> f64 {
    let rows = got.len() / VOCAB;
    let ok = got
        .chunks(VOCAB)
        .zip(want.chunks(VOCAB))
        .filter(|(g, w)| {
            let (lo, hi) = w
                .iter()
                .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
            w[argmax(g) as usize] >= hi - tol * (hi - lo)
        })
        .count();
    ok as f64 / rows as f64
}

/// Per row: |got - want| largest over the row, over the row's largest |want|; and whether the
/// two rows' largest entries are at the same index.
pub fn per_position(got: &[f32], want: &[f32]) -> Vec<(f32, bool)> {
    got.chunks(VOCAB)
        .zip(want.chunks(VOCAB))
        .map(|(g, w)| (rel_max_err(g, w), argmax(g) == argmax(w)))
        .collect()
}

/// `per_position` as one line: the top-1 agreement, the positions that disagree and the
/// largest errors, so a failure shows where the rows part, not only the worst one.
pub fn describe_positions(got: &[f32], want: &[f32]) -> String {
    let p = per_position(got, want);
    let agree = p.iter().filter(|(_, same)| *same).count();
    let differ: Vec<String> = p
        .iter()
        .enumerate()
        .filter(|(_, (_, same))| !same)
        .map(|(i, (e, _))| format!("{i} ({:.1}%)", 100.0 * e))
        .collect();
    let mut errs: Vec<f32> = p.iter().map(|(e, _)| *e).collect();
    errs.sort_by(f32::total_cmp);
    let median = errs[errs.len() / 2];
    format!(
        "top-1 agrees at {agree} of {} positions; differs at [{}]; per-position error median {:.2}%, largest {:.2}%",
        p.len(),
        differ.join(", "),
        100.0 * median,
        100.0 * errs[errs.len() - 1]
    )
}

pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Logits of the whole sequence as one prefill, and as a one-token prefill followed by decode
/// steps, then the greedy continuation from the decode state.
pub fn run<B: Backend>(
    name: &str,
    mut new: impl FnMut() -> B,
    cache: DType,
) -> (Vec<f32>, Vec<f32>, Vec<u32>) {
    let (tokens, _, cont) = reference(name);
    let prefill = open(name, new(), cache)
        .step(&tokens, 0, Want::AllLogits)
        .unwrap()
        .into_logits()
        .unwrap();
    let mut m = open(name, new(), cache);
    let mut rows = Vec::new();
    for (t, &id) in tokens.iter().enumerate() {
        rows.extend(m.step(&[id], t, Want::LastLogits).unwrap().into_logits().unwrap());
    }
    let mut next = argmax(&rows[(tokens.len() - 1) * VOCAB..]);
    let mut generated = vec![next];
    for t in tokens.len()..tokens.len() + cont.len() - 1 {
        next = argmax(
            &m.step(&[next], t, Want::LastLogits)
                .unwrap()
                .into_logits()
                .unwrap(),
        );
        generated.push(next);
    }
    // The same steps with the argmax taken on the backend pick the same tokens.
    let mut m = open(name, new(), cache);
    let mut on_backend = Vec::new();
    for (t, &id) in tokens.iter().enumerate() {
        next = m.step(&[id], t, Want::Argmax).unwrap().token().unwrap();
    }
    on_backend.push(next);
    for t in tokens.len()..tokens.len() + cont.len() - 1 {
        next = m.step(&[next], t, Want::Argmax).unwrap().token().unwrap();
        on_backend.push(next);
    }
    assert_eq!(on_backend, generated, "{name}: argmax on the backend");
    (prefill, rows, generated)
}

/// The hybrids at wider shapes with a 48-token prompt (hidden 128, head_dim 64 with a quarter
/// rotary, linear key/value heads of 32, 16 experts top-4 and a shared expert), where CUDA
/// prefill's roundings show.
pub const WIDE: [&str; 2] = ["qwen3_next_wide", "qwen3_5_moe_wide"];

pub const FIXTURES: [&str; 6] = [
    "llama",
    "qwen3",
    "qwen3_moe",
    "qwen3_moe_mlx_q4",
    "qwen3_next",
    "qwen3_5_moe",
];

/// A directory under the system's temporary one, made empty, removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// `kestrel-{tag}-{pid}`, emptied.
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("kestrel-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
