//! Choosing the next token from a row of logits on the host, with the algorithm of
//! `kestrel_core::sample` (the one a backend's `SampleRows` op follows too): penalties (repetition,
//! presence, frequency), then temperature, top-k, top-p and min-p in the order transformers
//! applies them, then a draw from the remaining distribution with Kestrel's seeded generator
//! (xoshiro256**), so a seed gives the same tokens on every machine. Temperature 0 is the argmax
//! (after the penalties; the lower id wins ties).

use kestrel_core::rng::Rng;
pub use kestrel_core::sample::{argmax, SamplingParams};
use kestrel_core::sample::{counts_of, distribution, draw, penalize};

use crate::error::{Result, TextError};

pub struct Sampler {
    pub params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate().map_err(TextError::Sampling)?;
        Ok(Sampler {
            params,
            rng: Rng::new(params.seed),
        })
    }

    /// Applies the penalties for `history` (the prompt and the tokens generated so far) to
    /// `logits` in place.
    pub fn penalize(&self, logits: &mut [f32], history: &[u32]) {
        if self.params.has_penalties() {
            penalize(logits, &counts_of(history, logits.len()), &self.params);
        }
    }

    /// The distribution sampling draws from (see `kestrel_core::sample::distribution`).
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        distribution(logits, &self.params)
    }

    /// The generator's state (for a backend that draws in its place: see
    /// `kestrel_core::sample::draw_words`).
    pub fn rng_state(&self) -> [u64; 4] {
        self.rng.state()
    }

    /// Takes the generator's state after a backend drew in its place.
    pub fn set_rng_state(&mut self, state: [u64; 4]) {
        self.rng = Rng::from_state(state);
    }

    /// The next token: penalties for `history`, then a draw from [`Self::distribution`].
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.penalize(logits, history);
        let dist = self.distribution(logits);
        draw(&dist, &mut self.rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.symmetric() * 6.0).collect()
    }

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p).unwrap()
    }

    /// Token ids sorted by logit, highest first (lower id on ties).
    fn ranked(l: &[f32]) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..l.len() as u32).collect();
        ids.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        ids
    }

    fn support(d: &[(u32, f64)]) -> Vec<u32> {
        d.iter().map(|c| c.0).collect()
    }

    #[test]
    fn top_k_keeps_exactly_the_k_most_likely() {
        let mut rng = Rng::new(1);
        for k in [1, 2, 7, 50] {
            let l = logits(&mut rng, 40);
            let d = sampler(SamplingParams {
                top_k: k,
                ..Default::default()
            })
            .distribution(&l);
            let mut want: Vec<u32> = ranked(&l).into_iter().take(k).collect();
            want.sort();
            assert_eq!(support(&d), want, "k {k}");
            assert!((d.iter().map(|c| c.1).sum::<f64>() - 1.0).abs() < 1e-12);
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_head_reaching_p() {
        let mut rng = Rng::new(2);
        for top_p in [0.05f32, 0.3, 0.9, 0.999] {
            let l = logits(&mut rng, 60);
            let s = sampler(SamplingParams {
                top_p,
                ..Default::default()
            });
            let full = sampler(SamplingParams::default()).distribution(&l);
            let prob = |t: u32| full.iter().find(|c| c.0 == t).unwrap().1;
            let kept = support(&s.distribution(&l));
            let order = ranked(&l);
            let n = kept.len();
            let mass: f64 = order[..n].iter().map(|&t| prob(t)).sum();
            let without_last: f64 = order[..n - 1].iter().map(|&t| prob(t)).sum();
            assert!(
                mass >= top_p as f64 - 1e-9 && without_last < top_p as f64,
                "p {top_p}"
            );
            let mut want = order[..n].to_vec();
            want.sort();
            assert_eq!(kept, want);
        }
    }

    #[test]
    fn min_p_keeps_tokens_above_its_share_of_the_best() {
        let mut rng = Rng::new(3);
        let l = logits(&mut rng, 80);
        let s = sampler(SamplingParams {
            min_p: 0.2,
            temperature: 0.7,
            ..Default::default()
        });
        let full = sampler(SamplingParams {
            temperature: 0.7,
            ..Default::default()
        })
        .distribution(&l);
        let top = full.iter().map(|c| c.1).fold(0.0, f64::max);
        let want: Vec<u32> = full.iter().filter(|c| c.1 >= 0.2 * top).map(|c| c.0).collect();
        assert_eq!(support(&s.distribution(&l)), want);
    }

    #[test]
    fn penalties_change_only_the_penalised_logits() {
        let mut rng = Rng::new(4);
        let l = logits(&mut rng, 30);
        let history = [3u32, 7, 7, 29, 3, 3, 100];
        let s = sampler(SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        });
        let mut p = l.clone();
        s.penalize(&mut p, &history);
        for (i, (&a, &b)) in l.iter().zip(&p).enumerate() {
            let n = history.iter().filter(|&&t| t as usize == i).count() as f32;
            if n == 0.0 {
                assert_eq!(a, b, "token {i} untouched");
            } else {
                let r = if a > 0.0 { a / 1.3 } else { a * 1.3 };
                assert!((b - (r - 0.5 - 0.25 * n)).abs() < 1e-6, "token {i}");
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let mut rng = Rng::new(5);
        let rows: Vec<Vec<f32>> = (0..50).map(|_| logits(&mut rng, 100)).collect();
        let p = SamplingParams {
            temperature: 0.9,
            top_k: 40,
            top_p: 0.95,
            seed: 77,
            ..Default::default()
        };
        let draw = |p: SamplingParams| {
            let mut s = sampler(p);
            rows.iter()
                .map(|r| s.sample(&mut r.clone(), &[]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(p), draw(p));
        assert_ne!(draw(p), draw(SamplingParams { seed: 78, ..p }));
        // Fixed across machines and builds: the generator and the order of the sum are fixed.
        assert_eq!(&draw(p)[..8], &[48, 9, 45, 97, 48, 14, 10, 72]);
    }

    #[test]
    fn temperature_zero_is_the_argmax() {
        let mut rng = Rng::new(6);
        for _ in 0..20 {
            let l = logits(&mut rng, 64);
            let mut s = sampler(SamplingParams {
                temperature: 0.0,
                ..Default::default()
            });
            assert_eq!(s.sample(&mut l.clone(), &[]), argmax(&l));
        }
        assert_eq!(argmax(&[1.0, 3.0, 3.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5]), 1);
    }

    #[test]
    fn bad_settings_are_errors() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                min_p: 1.5,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(p).is_err(), "{p:?}");
        }
    }
}
