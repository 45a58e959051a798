//! Rotary-embedding inverse frequencies, computed on the host exactly as transformers computes
//! them (default, linear, llama3 and yarn scaling), plus the factor applied to cos and sin.

/// How positions are scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: a ramp between interpolated and extrapolated frequencies, and an attention factor.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// Explicit `attention_factor`; else derived from `factor`, `mscale`, `mscale_all_dim`.
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
    /// Each frequency divided by its own factor, `rot_dim / 2` of them: how GGUF files of Llama 3
    /// carry its scaling (llama.cpp's `rope_freqs` tensor, computed by its converter from the
    /// Llama 3 parameters, which the file then leaves out).
    Factors(Vec<f32>),
}

/// Inverse frequencies for the rotated part of a head, and the cos/sin scaling factor.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeTable {
    /// `rot_dim / 2` frequencies, as f32 like transformers' buffer.
    pub inv_freq: Vec<f32>,
    /// Number of leading dimensions of each head that are rotated (even).
    pub rot_dim: usize,
    /// Multiplies cos and sin (1 except for YaRN).
    pub attention_scaling: f32,
}

impl RopeTable {
    /// `head_dim * partial_rotary_factor` dimensions rotated with base `theta`.
    pub fn new(theta: f64, head_dim: usize, partial_rotary_factor: f64, scaling: &RopeScaling) -> RopeTable {
        let dim = (head_dim as f64 * partial_rotary_factor) as usize;
        let dim = dim - dim % 2;
        // transformers: base ** (arange(0, dim, 2).float() / dim) in f32.
        let pos_freqs: Vec<f32> = (0..dim / 2)
            .map(|i| (theta as f32).powf((2 * i) as f32 / dim as f32))
            .collect();
        let default: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let (inv_freq, attention_scaling) = match *scaling {
            RopeScaling::None => (default, 1.0),
            RopeScaling::Linear { factor } => (default.iter().map(|f| f / factor as f32).collect(), 1.0),
            RopeScaling::Factors(ref factors) => {
                assert_eq!(factors.len(), default.len(), "one factor a rotated frequency");
                (default.iter().zip(factors).map(|(f, d)| f / d).collect(), 1.0)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let (factor, low, high, old) = (
                    factor as f32,
                    low_freq_factor as f32,
                    high_freq_factor as f32,
                    old as f32,
                );
                let low_wavelen = old / low;
                let high_wavelen = old / high;
                let f = default
                    .iter()
                    .map(|&inv| {
                        let wavelen = 2.0 * std::f32::consts::PI / inv;
                        let llama = if wavelen > low_wavelen { inv / factor } else { inv };
                        let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
                        if medium {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * llama / factor + smooth * llama
                        } else {
                            llama
                        }
                    })
                    .collect();
                (f, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attn = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                        get_mscale(factor, m) / get_mscale(factor, a)
                    }
                    _ => get_mscale(factor, 1.0),
                });
                let correction_dim = |rot: f64| {
                    (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let (low, mut high) = (low.max(0.0) as f32, high.min(dim as f64 - 1.0) as f32);
                if low == high {
                    high += 0.001;
                }
                let f = (0..dim / 2)
                    .map(|i| {
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        let extra = 1.0 / pos_freqs[i];
                        let inter = 1.0 / (factor as f32 * pos_freqs[i]);
                        inter * (1.0 - extrapolation_factor) + extra * extrapolation_factor
                    })
                    .collect();
                (f, attn as f32)
            }
        };
        RopeTable {
            inv_freq,
            rot_dim: dim,
            attention_scaling,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies() {
        let t = RopeTable::new(10000.0, 8, 1.0, &RopeScaling::None);
        assert_eq!(t.rot_dim, 8);
        let expect = [1.0, 0.1, 0.01, 0.001];
        for (a, b) in t.inv_freq.iter().zip(expect) {
            assert!((a - b).abs() <= 1e-6 * b.max(1e-3), "{a} vs {b}");
        }
        assert_eq!(t.attention_scaling, 1.0);
    }

    #[test]
    fn partial_rotary_rotates_a_prefix() {
        let t = RopeTable::new(10000.0, 256, 0.25, &RopeScaling::None);
        assert_eq!(t.rot_dim, 64);
        assert_eq!(t.inv_freq.len(), 32);
        assert_eq!(t.inv_freq[0], 1.0);
    }

    #[test]
    fn llama3_keeps_high_and_divides_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let base = RopeTable::new(500000.0, 128, 1.0, &RopeScaling::None);
        let t = RopeTable::new(500000.0, 128, 1.0, &s);
        assert_eq!(t.inv_freq[0], base.inv_freq[0], "highest frequency untouched");
        let last = t.inv_freq.len() - 1;
        assert!((t.inv_freq[last] - base.inv_freq[last] / 8.0).abs() < 1e-12);
        // Monotone decreasing as the unscaled table.
        assert!(t.inv_freq.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn yarn_ramps_and_scales_attention() {
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let base = RopeTable::new(1e6, 128, 1.0, &RopeScaling::None);
        let t = RopeTable::new(1e6, 128, 1.0, &s);
        assert!((t.attention_scaling - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
        assert_eq!(t.inv_freq[0], base.inv_freq[0], "fast dims extrapolate");
        let last = t.inv_freq.len() - 1;
        assert!((t.inv_freq[last] - base.inv_freq[last] / 4.0).abs() <= 1e-6 * base.inv_freq[last]);
    }
}
