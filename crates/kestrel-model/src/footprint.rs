//! What a model's weights weigh: parameters (total, and active per token for MoE models), the
//! formats they are stored in, bytes held, and bytes a decode step reads, which over the GPU's
//! bandwidth gives the floor of a token's time.

use std::collections::BTreeMap;

use kestrel_core::DType;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::Weights;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Footprint {
    /// Values of the language model's weights (packed words count as the values they hold).
    pub params: u64,
    /// Of those, the ones one token uses: every weight but the experts, plus the routed share
    /// of the experts.
    pub active_params: u64,
    /// Values by storage format (`bf16`, `4-bit`, ...).
    pub formats: BTreeMap<String, u64>,
    /// Bytes of the language model's tensors (quantisation scales and biases included).
    pub bytes: u64,
    /// Bytes one decode step reads: every tensor but the experts and the embedding table, the
    /// routed share of the experts, one row of the embedding table (all of it when it is also
    /// the output projection).
    pub active_bytes: u64,
}

/// Bits per value of the MLX-quantised matrix `base` (its `.weight` words beside `.scales`),
/// as config.json's quantisation section gives them.
fn bits_of(c: &ModelConfig, w: &Weights, base: &str) -> Option<u64> {
    if !w.contains(&format!("{base}.scales")) {
        return None;
    }
    c.quant.as_ref()?.format_for(base).map(|f| f.bits as u64)
}

/// The footprint of the model `c` whose tensors are `w`. A vision tower of a multimodal
/// checkpoint is not part of it.
pub fn footprint(c: &ModelConfig, w: &Weights) -> Result<Footprint> {
    let mut f = Footprint::default();
    let mut expert_values = 0u64;
    let mut expert_bytes = 0u64;
    let mut embed_bytes = 0u64;
    let tied = !w.contains("lm_head.weight");
    for name in w.names() {
        if name.starts_with("model.visual.") || name.starts_with("visual.") {
            continue;
        }
        let t = w.get(name)?;
        let bytes = t.bytes.len() as u64;
        f.bytes += bytes;
        let expert = name.contains(".experts.") || name.contains(".switch_mlp.");
        if expert {
            expert_bytes += bytes;
        } else if name.contains("embed_tokens.") && !tied {
            embed_bytes += bytes;
        }
        if name.ends_with(".scales") || name.ends_with(".biases") {
            continue;
        }
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let bits = bits_of(c, w, base).filter(|_| t.dtype == DType::U32);
        let n = t.elem_count() as u64;
        let values = bits.map_or(n, |b| n * 32 / b);
        f.params += values;
        if expert {
            expert_values += values;
        }
        let format = bits.map_or_else(|| t.dtype.to_string(), |b| format!("{b}-bit"));
        *f.formats.entry(format).or_default() += values;
    }
    let (k, e) = c
        .moe
        .as_ref()
        .filter(|m| m.experts > 0)
        .map_or((1, 1), |m| (m.experts_per_token as u64, m.experts as u64));
    f.active_params = f.params - expert_values + expert_values * k / e;
    f.active_bytes =
        f.bytes - expert_bytes - embed_bytes + expert_bytes * k / e + embed_bytes / c.vocab.max(1) as u64;
    Ok(f)
}
