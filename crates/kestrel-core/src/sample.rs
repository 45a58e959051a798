//! The sampling algorithm, shared by the host sampler and the backends' `SampleRows` op, so both
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

    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// The largest top-k a backend's `SampleRows` op takes.
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
/// at least min_p times the first; weights are `exp((logit - max) / T)` in f64. A head cut by
/// top-k or top-p is summed in that order; the whole vocabulary (no cut, or the mass top-p
/// measures against without top-k) in token order. Only the head is ever sorted: a vocabulary
/// of 152k sorted whole took 7-12 ms a row.
pub fn distribution(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let best = argmax(logits);
    if p.temperature == 0.0 || logits.is_empty() {
        return vec![(best, 1.0)];
    }
    let t = p.temperature as f64;
    let max = logits[best as usize] as f64;
    // exp is 0 below -745.2 (the least subnormal is e^-744.4); the slow path of its underflow
    // cost 3 ms a row of a wide vocabulary.
    let weight = |l: f32| match (l as f64 - max) / t {
        x if x < -746.0 => 0.0,
        x => x.exp(),
    };
    if let Some(head) = top_k_by_logit(logits, p.top_k, weight) {
        let total = head.iter().map(|c| c.1).sum();
        return cut(head, p, total);
    }
    let mut cand: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .filter(|(_, &l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, weight(l)))
        .collect();
    let likelier = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    // The `n` most likely, most likely first.
    let head = |cand: &[(u32, f64)], n: usize| -> Vec<(u32, f64)> {
        let mut h = cand.to_vec();
        if n < h.len() {
            h.select_nth_unstable_by(n, likelier);
            h.truncate(n);
        }
        h.sort_by(likelier);
        h
    };
    if p.top_k > 0 {
        let h = head(&cand, p.top_k);
        let total = h.iter().map(|c| c.1).sum();
        return cut(h, p, total);
    }
    if p.top_p < 1.0 {
        // The smallest head reaching top_p of the whole vocabulary's mass: ranked a growing
        // number at a time.
        let total = cand.iter().map(|c| c.1).sum();
        let mut n = 64;
        loop {
            let h = head(&cand, n);
            if n >= cand.len() || reach(&h, total, p.top_p).is_some() {
                return cut(h, p, total);
            }
            n *= 4;
        }
    }
    if p.min_p > 0.0 {
        // No cut: the argmax weighs 1, and the survivors stay in token order, summed so.
        cand.retain(|c| c.1 >= p.min_p as f64);
    }
    normalised(cand)
}

/// The candidates as probabilities (summed in their order), in ascending token order.
fn normalised(mut out: Vec<(u32, f64)>) -> Vec<(u32, f64)> {
    let total: f64 = out.iter().map(|c| c.1).sum();
    for c in &mut out {
        c.1 /= total;
    }
    out.sort_by_key(|c| c.0);
    out
}

/// Where the mass of `head` (most likely first) first reaches `top_p` of `total`.
fn reach(head: &[(u32, f64)], total: f64, top_p: f32) -> Option<usize> {
    let mut acc = 0.0;
    head.iter().position(|c| {
        acc += c.1 / total;
        acc >= top_p as f64
    })
}

/// Top-p (against `total`) and min-p over `head` (most likely first), then the distribution.
fn cut(mut head: Vec<(u32, f64)>, p: &SamplingParams, total: f64) -> Vec<(u32, f64)> {
    if p.top_p < 1.0 {
        let keep = reach(&head, total, p.top_p).map_or(head.len(), |i| i + 1);
        head.truncate(keep.max(1));
    }
    if p.min_p > 0.0 {
        let floor = head[0].1 * p.min_p as f64;
        head.retain(|c| c.1 >= floor);
    }
    normalised(head)
}

/// Top-k heads this small are found by one pass over the logits keeping the best so far.
const LOGIT_HEAD_MAX: usize = 256;

/// The `k` most likely tokens (most likely first, the lower id on ties) with their weights
/// `weight(logit)`, found by logit without weighing the whole vocabulary; None when `k` is 0,
/// larger than `LOGIT_HEAD_MAX` or not below the vocabulary, or when two logits of the head (or
/// the first left out) weigh the same but differ (the order by weight breaks such ties by id,
/// the order by logit would not). When fewer than `k` tokens weigh anything (a wide spread of
/// logits at a low temperature), the rest of the head is the lowest ids among those weighing
/// nothing, as the order by weight has them.
fn top_k_by_logit(logits: &[f32], k: usize, weight: impl Fn(f32) -> f64) -> Option<Vec<(u32, f64)>> {
    if k == 0 || k > LOGIT_HEAD_MAX || k >= logits.len() {
        return None;
    }
    // The k + 1 best by (logit descending, id ascending), best first.
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 2);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() || best.len() == k + 1 && l <= best[k].0 {
            continue;
        }
        let at = best.partition_point(|&(b, _)| b >= l);
        best.insert(at, (l, i as u32));
        best.truncate(k + 1);
    }
    let weighed: Vec<(f32, u32, f64)> = best.iter().map(|&(l, i)| (l, i, weight(l))).collect();
    // Those weighing anything come first (weight grows with the logit), and are all of the
    // vocabulary's when fewer than k + 1.
    let positive = weighed.iter().take_while(|w| w.2 > 0.0).count();
    let ranked = &weighed[..positive.min(k + 1)];
    if ranked.windows(2).any(|w| w[0].2 == w[1].2 && w[0].0 != w[1].0) {
        return None;
    }
    let mut head: Vec<(u32, f64)> = ranked.iter().take(k).map(|&(_, i, w)| (i, w)).collect();
    if head.len() < k {
        let zeros = logits
            .iter()
            .enumerate()
            .filter(|&(_, &l)| !l.is_nan() && weight(l) == 0.0)
            .map(|(i, _)| (i as u32, 0.0))
            .take(k - head.len());
        head.extend(zeros);
    }
    (head.len() == k).then_some(head)
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

/// Words of one row's settings in a `SampleRows` op's `draws`: temperature, top-k, top-p,
/// min-p, repetition, presence and frequency penalty (the floats as their bits), the row of the
/// op's token counts the row's sequence keeps ([`NO_COUNTS`]: none), then the generator state
/// as [`rng_words`] stores it.
pub const DRAW_WORDS: usize = 16;

/// Words of one row of a `SampleRows` op's output: the token, then the generator state after
/// the draw.
pub const DRAWN_WORDS: usize = 9;

/// The counts row of a row whose sequence keeps none (no penalties): nothing is read or counted.
pub const NO_COUNTS: u32 = u32::MAX;

/// Whether a backend's `SampleRows` op draws with `params` as the host does: it keeps the
/// candidates they need, 1 at temperature 0, else the top-k, at most [`BACKEND_MAX_TOP_K`] (top-k
/// 0 means the whole vocabulary: then the logits go to the host). Penalties need a counts row.
pub fn backend_draws(params: &SamplingParams) -> bool {
    params.temperature == 0.0 || (1..=BACKEND_MAX_TOP_K).contains(&params.top_k)
}

/// One row's settings for a `SampleRows` op: `params`, the generator `state` to draw with, and
/// the row of the op's counts that holds how often the row's sequence has seen each token (it
/// is read for the penalties and counts the drawn token; None: no penalties apply).
pub fn draw_words(params: &SamplingParams, state: [u64; 4], counts_row: Option<u32>) -> [u32; DRAW_WORDS] {
    let mut w = [0u32; DRAW_WORDS];
    w[0] = params.temperature.to_bits();
    w[1] = params.top_k.min(u32::MAX as usize) as u32;
    w[2] = params.top_p.to_bits();
    w[3] = params.min_p.to_bits();
    w[4] = params.repetition_penalty.to_bits();
    w[5] = params.presence_penalty.to_bits();
    w[6] = params.frequency_penalty.to_bits();
    w[7] = counts_row.unwrap_or(NO_COUNTS);
    w[8..].copy_from_slice(&rng_words(state));
    w
}

/// The settings, generator state and counts row [`draw_words`] stored.
pub fn draw_settings(words: &[u32]) -> (SamplingParams, [u64; 4], Option<u32>) {
    let params = SamplingParams {
        temperature: f32::from_bits(words[0]),
        top_k: words[1] as usize,
        top_p: f32::from_bits(words[2]),
        min_p: f32::from_bits(words[3]),
        repetition_penalty: f32::from_bits(words[4]),
        presence_penalty: f32::from_bits(words[5]),
        frequency_penalty: f32::from_bits(words[6]),
        seed: 0,
    };
    let row = (words[7] != NO_COUNTS).then_some(words[7]);
    (params, rng_state(&words[8..DRAW_WORDS]), row)
}

/// One row of a `SampleRows` op: the token drawn from `logits` with the settings `words`
/// ([`draw_words`]), penalised by `counts` (the row's counts, when it names one), and the
/// generator state after the draw, as [`DRAWN_WORDS`] words; the drawn token is counted.
pub fn draw_row(logits: &[f32], words: &[u32], counts: Option<&mut [u32]>) -> [u32; DRAWN_WORDS] {
    let (params, state, _) = draw_settings(words);
    let mut rng = Rng::from_state(state);
    let token = match counts {
        Some(counts) => {
            let mut row = logits.to_vec();
            penalize(&mut row, counts, &params);
            let token = draw(&distribution(&row, &params), &mut rng);
            counts[token as usize] += 1;
            token
        }
        None => draw(&distribution(logits, &params), &mut rng),
    };
    let mut out = [0u32; DRAWN_WORDS];
    out[0] = token;
    out[1..].copy_from_slice(&rng_words(rng.state()));
    out
}

/// A generator state as a `SampleRows` op stores it: `u32 [8]`, each word's low half first.
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The distribution as first written: every candidate ranked, sums most likely first.
    fn ranked_whole(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
        let best = argmax(logits);
        let (t, max) = (p.temperature as f64, logits[best as usize] as f64);
        let mut cand: Vec<(u32, f64)> = (logits.iter().enumerate())
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
            let keep = (cand.iter())
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

    /// Ranking only the head gives the whole ranking's distribution: the same tokens, and where
    /// top-k cuts the vocabulary the same probabilities bit for bit (the sums run in the same
    /// order; a backend's sampler relies on it), else within the rounding of a sum taken in
    /// another order. Vocabularies with ties, a NaN, and weights that underflow to zero.
    #[test]
    fn ranking_the_head_gives_the_whole_rankings_distribution() {
        let mut rng = Rng::new(7);
        for round in 0..200 {
            let vocab = [5, 300, 5000, 40_000][round % 4];
            let spread = [0.1, 8.0, 400.0][round % 3];
            let mut logits: Vec<f32> = (0..vocab)
                .map(|_| (rng.symmetric() * spread * 8.0).round() / 8.0)
                .collect();
            if round % 5 == 0 {
                logits[rng.range(0, vocab)] = f32::NAN;
            }
            let p = SamplingParams {
                temperature: [0.3, 1.0, 2.5][round % 3],
                top_k: [0, 1, 20, 64, 1000][rng.range(0, 5)],
                top_p: [1.0, 0.9, 0.5, 0.999][rng.range(0, 4)],
                min_p: [0.0, 0.0, 0.05][rng.range(0, 3)],
                ..Default::default()
            };
            let (got, want) = (distribution(&logits, &p), ranked_whole(&logits, &p));
            let ids = |d: &[(u32, f64)]| d.iter().map(|c| c.0).collect::<Vec<_>>();
            assert_eq!(ids(&got), ids(&want), "round {round} {p:?}");
            for (g, w) in got.iter().zip(&want) {
                match p.top_k > 0 {
                    true => assert_eq!(g.1.to_bits(), w.1.to_bits(), "round {round} {p:?}"),
                    false => assert!(
                        (g.1 - w.1).abs() <= 1e-12 * w.1.max(1e-300),
                        "round {round} {p:?}"
                    ),
                }
            }
        }
    }
}
