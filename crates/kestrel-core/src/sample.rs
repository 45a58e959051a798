//! The sampling algorithm, shared by the host sampler and the backends' `Sample` op, so both
//! pick the same tokens: penalties from token counts (repetition, presence, frequency), then
//! temperature, top-k, top-p and min-p in the order transformers applies them, then a draw from
//! the remaining distribution with the seeded xoshiro generator. Temperature 0 is the argmax
//! (after the penalties; the lower id wins ties).

use crate::rng::Rng;

/// Sampling settings; the defaults change nothing (plain sampling at temperature 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the most likely tokens whose probabilities add up to `top_p` (1: all).
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one (0: all).
    pub min_p: f32,
    /// transformers' repetition penalty on tokens seen before (1: none): a positive logit is
    /// divided by it, a negative one multiplied.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token seen before (0: none).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was seen (0: none).
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// A setting out of range, described with the range it must lie in.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |what: &str, v: f32, range: &str| Err(format!("{what} {v} is out of range: {range}"));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature, "0 (greedy) or more");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top-p", self.top_p, "above 0, at most 1 (1: all tokens)");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p", self.min_p, "0 (all tokens) to 1");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "repetition penalty",
                self.repetition_penalty,
                "above 0 and finite (1: none)",
            );
        }
        if !self.presence_penalty.is_finite() {
            return bad(
                "presence penalty",
                self.presence_penalty,
                "a finite number (0: none)",
            );
        }
        if !self.frequency_penalty.is_finite() {
            return bad(
                "frequency penalty",
                self.frequency_penalty,
                "a finite number (0: none)",
            );
        }
        Ok(())
    }

    /// Whether sampling can only return the argmax of the raw logits (no penalties, greedy).
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature == 0.0 && !self.has_penalties()
    }

    /// How many candidates a backend's `Sample` op must keep to sample as the host does (1 at
    /// temperature 0, else top-k), or None when that is over [`BACKEND_MAX_TOP_K`] (top-k 0
    /// means all tokens): then the logits go to the host.
    pub fn backend_candidates(&self) -> Option<usize> {
        if self.temperature == 0.0 {
            Some(1)
        } else {
            (1..=BACKEND_MAX_TOP_K)
                .contains(&self.top_k)
                .then_some(self.top_k)
        }
    }

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// The largest top-k a backend's `Sample` op takes.
pub const BACKEND_MAX_TOP_K: usize = 64;

/// How many times each token of a vocabulary of `vocab` occurs in `history` (ids past the
/// vocabulary are ignored).
pub fn counts_of(history: &[u32], vocab: usize) -> Vec<u32> {
    let mut counts = vec![0u32; vocab];
    for &t in history {
        if let Some(c) = counts.get_mut(t as usize) {
            *c += 1;
        }
    }
    counts
}

/// Applies the penalties for tokens seen `counts[t]` times to `logits` in place (f32
/// arithmetic: a backend computes the same values).
pub fn penalize(logits: &mut [f32], counts: &[u32], p: &SamplingParams) {
    if !p.has_penalties() {
        return;
    }
    for (l, &n) in logits.iter_mut().zip(counts) {
        if n == 0 {
            continue;
        }
        if p.repetition_penalty != 1.0 {
            *l = if *l > 0.0 {
                *l / p.repetition_penalty
            } else {
                *l * p.repetition_penalty
            };
        }
        *l -= p.presence_penalty + p.frequency_penalty * n as f32;
    }
}

/// The index of the largest value (the lower index wins ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The distribution a draw is made from after temperature, top-k, top-p and min-p: (token,
/// probability) in ascending token order, probabilities summing to one. Logits must already
/// carry the penalties. At temperature 0 it is the argmax alone.
///
/// Candidates are ordered most likely first (lower id first on ties); top-k keeps the first
/// k, top-p the smallest head whose mass reaches p (the token crossing it included), min-p those
/// at least min_p times the first; weights are `exp((logit - max) / T)` in f64, summed in that
/// order.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let best = argmax(logits);
    if p.temperature == 0.0 || logits.is_empty() {
        return vec![(best, 1.0)];
    }
    let t = p.temperature as f64;
    let max = logits[best as usize] as f64;
    let mut cand: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, &l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, ((l as f64 - max) / t).exp()))
        .collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        cand.truncate(p.top_k);
    }
    let total: f64 = cand.iter().map(|c| c.1).sum();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = cand
            .iter()
            .position(|c| {
                acc += c.1 / total;
                acc >= p.top_p as f64
            })
            .map_or(cand.len(), |i| i + 1);
        cand.truncate(keep.max(1));
    }
    if p.min_p > 0.0 {
        let floor = cand[0].1 * p.min_p as f64;
        cand.retain(|c| c.1 >= floor);
    }
    let total: f64 = cand.iter().map(|c| c.1).sum();
    let mut out: Vec<(u32, f64)> = cand.into_iter().map(|(i, w)| (i, w / total)).collect();
    out.sort_by_key(|c| c.0);
    out
}

/// A draw from `dist` (as [`distribution`] returns it): one number from `rng` unless a single
/// token remains, then the first token whose cumulative probability (ascending ids) passes it.
pub fn draw(dist: &[(u32, f64)], rng: &mut Rng) -> u32 {
    if dist.len() == 1 {
        return dist[0].0;
    }
    let u = rng.next_f32() as f64;
    let mut acc = 0.0;
    for &(t, p) in dist {
        acc += p;
        if u < acc {
            return t;
        }
    }
    dist.last().expect("a non-empty distribution").0
}

/// A generator state as a `Sample` op stores it: `u32 [8]`, each word's low half first.
pub fn rng_words(state: [u64; 4]) -> [u32; 8] {
    let mut w = [0u32; 8];
    for (i, s) in state.iter().enumerate() {
        w[2 * i] = *s as u32;
        w[2 * i + 1] = (*s >> 32) as u32;
    }
    w
}

/// The state stored by [`rng_words`].
pub fn rng_state(words: &[u32]) -> [u64; 4] {
    std::array::from_fn(|i| words[2 * i] as u64 | (words[2 * i + 1] as u64) << 32)
}
