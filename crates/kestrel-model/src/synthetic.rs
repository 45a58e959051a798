//! Random weights at the shapes of named real configurations, built in memory in the MLX
//! quantised layout (the layout `quantize_dir` writes and MLX-community checkpoints use:
//! `.weight` / `.scales` / `.biases`, experts stacked under `switch_mlp`, routers and gates at 8
//! bits), so whole models can be loaded and measured without downloading them.
//!
//! The values are random but tame: every quantised group dequantises to zero-mean values with a
//! standard deviation of 1/sqrt(columns), norms are neutral (1, or 0 where the architecture's
//! norm is zero-centred), so activations stay finite through every layer. Routing is spread in
//! the first layers and over tokens of different sequences, but along one long sequence it
//! concentrates on a few experts in deeper layers (measured for `qwen3-30b-a3b`: attention with
//! neutral q and k norms is nearly uniform, so the tokens' states converge), which a real
//! checkpoint's does not: prefill measured on these weights reads fewer experts than a real
//! model's would. A seed gives the same weights on every machine.

use half::bf16;
use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_core::DType;
use rayon::prelude::*;
use serde_json::{json, Map, Value};

use crate::config::{Arch, LayerKind, MlpKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::weights::{OwnedTensor, Weights};

/// The named configurations, as published (`config.json` of the original checkpoints).
pub const SYNTHETIC_MODELS: [&str; 3] = ["qwen3-30b-a3b", "qwen3-next-80b-a3b", "qwen3.5-397b-a17b"];

fn published(name: &str) -> Option<Value> {
    Some(match name {
        "qwen3-30b-a3b" => json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "rope_scaling": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
        }),
        "qwen3-next-80b-a3b" => json!({
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
            "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "num_experts": 512, "num_experts_per_tok": 10, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25, "rope_scaling": null, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643,
            "eos_token_id": 151645,
        }),
        // Multimodal: the language model under `text_config`, its weights under
        // `model.language_model.` (the vision tower is not built).
        "qwen3.5-397b-a17b" => json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": false,
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 4096, "num_hidden_layers": 60,
                "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256,
                "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_num_key_heads": 16, "linear_num_value_heads": 64,
                "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024,
                "num_experts": 512, "num_experts_per_tok": 10,
                "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
                "rope_parameters": {
                    "rope_type": "default", "rope_theta": 10000000.0,
                    "partial_rotary_factor": 0.25, "mrope_interleaved": true,
                    "mrope_section": [11, 11, 10],
                },
                "partial_rotary_factor": 0.25, "tie_word_embeddings": false, "dtype": "bfloat16",
                "vocab_size": 248320, "bos_token_id": 248044, "eos_token_id": 248046,
            },
        }),
        _ => return None,
    })
}

/// The `config.json` of the named configuration with `layers` decoder layers (default: all),
/// before quantisation.
pub fn synthetic_config_json(name: &str, layers: Option<usize>) -> Result<Value> {
    let mut v = published(name).ok_or_else(|| ModelError::Config {
        key: "synthetic".into(),
        reason: format!("unknown model {name:?}; known: {}", SYNTHETIC_MODELS.join(", ")),
    })?;
    if let Some(n) = layers {
        let full = v.get("text_config").unwrap_or(&v)["num_hidden_layers"]
            .as_u64()
            .unwrap_or(0);
        if n == 0 || n as u64 > full {
            return Err(ModelError::Config {
                key: "layers".into(),
                reason: format!("{name} has {full} layers; asked for {n}"),
            });
        }
        let text = match v.get_mut("text_config") {
            Some(t) => t,
            None => &mut v,
        };
        text["num_hidden_layers"] = n.into();
    }
    Ok(v)
}

/// How one stored tensor is filled.
#[derive(Debug, Clone, Copy)]
enum Fill {
    /// Every value the same.
    Const(f32),
    /// Uniform in `[-a, a)`.
    Uniform(f32),
    /// `ln(A)` with `A` uniform in `[1, 16)`, as transformers initialises Gated DeltaNet decays.
    LogDecay,
}

/// One module of the layout: a quantised matrix (with `lead` stacked copies, the experts) or a
/// tensor stored dense in bf16.
enum Entry {
    Quant {
        base: String,
        lead: Option<usize>,
        rows: usize,
        cols: usize,
        format: QuantFormat,
    },
    Dense {
        name: String,
        shape: Vec<usize>,
        fill: Fill,
    },
}

/// What a matrix becomes: quantised when its rows fit the format, else dense (and named in
/// the overrides as unquantised, as `quantize_dir` does).
struct Layout {
    entries: Vec<Entry>,
    overrides: Map<String, Value>,
    default: QuantFormat,
}

impl Layout {
    fn matrix(
        &mut self,
        base: String,
        lead: Option<usize>,
        rows: usize,
        cols: usize,
        f: QuantFormat,
    ) -> Result<()> {
        if f.fits(cols) {
            if f != self.default {
                self.overrides
                    .insert(base.clone(), json!({"group_size": f.group_size, "bits": f.bits}));
            }
            self.entries.push(Entry::Quant {
                base,
                lead,
                rows,
                cols,
                format: f,
            });
        } else if lead.is_some() {
            // Stacked experts are quantised or not at all: the loaders read no mixture.
            return Err(ModelError::Config {
                key: "quantization".into(),
                reason: format!(
                    "{base}: rows of {cols} do not divide into groups of {}",
                    f.group_size
                ),
            });
        } else {
            self.overrides.insert(base.clone(), Value::Bool(false));
            self.entries.push(Entry::Dense {
                name: format!("{base}.weight"),
                shape: vec![rows, cols],
                fill: Fill::Uniform((3.0 / cols as f32).sqrt()),
            });
        }
        Ok(())
    }

    fn dense(&mut self, name: String, shape: Vec<usize>, fill: Fill) {
        self.entries.push(Entry::Dense { name, shape, fill });
    }
}

/// The stored tensors of `c` in the MLX layout with `format` (routers and shared-expert gates
/// at 8 bits), and the `quantization` object of its config.
fn layout(c: &ModelConfig, format: QuantFormat) -> Result<Layout> {
    let mut l = Layout {
        entries: Vec::new(),
        overrides: Map::new(),
        default: format,
    };
    let router = QuantFormat { bits: 8, ..format };
    let prefix = if c.nested_text {
        "model.language_model"
    } else {
        "model"
    };
    // Norms multiply by (1 + w) in the hybrids, by w elsewhere.
    let neutral = Fill::Const(if c.arch.is_hybrid() { 0.0 } else { 1.0 });
    l.matrix(format!("{prefix}.embed_tokens"), None, c.vocab, c.hidden, format)?;
    for i in 0..c.layers {
        let p = format!("{prefix}.layers.{i}");
        l.dense(format!("{p}.input_layernorm.weight"), vec![c.hidden], neutral);
        l.dense(
            format!("{p}.post_attention_layernorm.weight"),
            vec![c.hidden],
            neutral,
        );
        match c.layer_kinds[i] {
            LayerKind::FullAttention => {
                let a = format!("{p}.self_attn");
                let (hd, q) = (c.head_dim, c.heads * c.head_dim);
                // The hybrids' attention output is gated: q_proj also yields the gate.
                let q_rows = if c.arch.is_hybrid() { 2 * q } else { q };
                l.matrix(format!("{a}.q_proj"), None, q_rows, c.hidden, format)?;
                l.matrix(format!("{a}.k_proj"), None, c.kv_heads * hd, c.hidden, format)?;
                l.matrix(format!("{a}.v_proj"), None, c.kv_heads * hd, c.hidden, format)?;
                l.matrix(format!("{a}.o_proj"), None, c.hidden, q, format)?;
                if c.arch != Arch::Llama {
                    l.dense(format!("{a}.q_norm.weight"), vec![hd], neutral);
                    l.dense(format!("{a}.k_norm.weight"), vec![hd], neutral);
                }
            }
            LayerKind::LinearAttention => {
                let la = c
                    .linear_attn
                    .as_ref()
                    .expect("hybrid configs have linear attention");
                let a = format!("{p}.linear_attn");
                let (nk, nv) = (la.key_heads, la.value_heads);
                let (key_dim, value_dim) = (nk * la.key_head_dim, nv * la.value_head_dim);
                let conv_dim = 2 * key_dim + value_dim;
                if c.arch == Arch::Qwen3Next {
                    let qkvz = 2 * key_dim + 2 * value_dim;
                    l.matrix(format!("{a}.in_proj_qkvz"), None, qkvz, c.hidden, format)?;
                    l.matrix(format!("{a}.in_proj_ba"), None, 2 * nv, c.hidden, format)?;
                } else {
                    l.matrix(format!("{a}.in_proj_qkv"), None, conv_dim, c.hidden, format)?;
                    l.matrix(format!("{a}.in_proj_z"), None, value_dim, c.hidden, format)?;
                    l.matrix(format!("{a}.in_proj_b"), None, nv, c.hidden, format)?;
                    l.matrix(format!("{a}.in_proj_a"), None, nv, c.hidden, format)?;
                }
                let k = la.conv_kernel;
                let conv = Fill::Uniform((3.0 / k as f32).sqrt());
                l.dense(format!("{a}.conv1d.weight"), vec![conv_dim, 1, k], conv);
                l.dense(format!("{a}.A_log"), vec![nv], Fill::LogDecay);
                l.dense(format!("{a}.dt_bias"), vec![nv], Fill::Const(1.0));
                // The gated norm of the output multiplies by w itself.
                l.dense(
                    format!("{a}.norm.weight"),
                    vec![la.value_head_dim],
                    Fill::Const(1.0),
                );
                l.matrix(format!("{a}.out_proj"), None, c.hidden, value_dim, format)?;
            }
        }
        let m = format!("{p}.mlp");
        match c.mlp_kinds[i] {
            MlpKind::Dense => {
                l.matrix(format!("{m}.gate_proj"), None, c.intermediate, c.hidden, format)?;
                l.matrix(format!("{m}.up_proj"), None, c.intermediate, c.hidden, format)?;
                l.matrix(format!("{m}.down_proj"), None, c.hidden, c.intermediate, format)?;
            }
            MlpKind::Moe => {
                let moe = c.moe.as_ref().expect("MoE layers have a MoE config");
                let (e, ei) = (moe.experts, moe.expert_intermediate);
                l.matrix(format!("{m}.gate"), None, e, c.hidden, router)?;
                let s = format!("{m}.switch_mlp");
                l.matrix(format!("{s}.gate_proj"), Some(e), ei, c.hidden, format)?;
                l.matrix(format!("{s}.up_proj"), Some(e), ei, c.hidden, format)?;
                l.matrix(format!("{s}.down_proj"), Some(e), c.hidden, ei, format)?;
                if let Some(si) = moe.shared_intermediate {
                    let s = format!("{m}.shared_expert");
                    l.matrix(format!("{s}.gate_proj"), None, si, c.hidden, format)?;
                    l.matrix(format!("{s}.up_proj"), None, si, c.hidden, format)?;
                    l.matrix(format!("{s}.down_proj"), None, c.hidden, si, format)?;
                    l.matrix(format!("{m}.shared_expert_gate"), None, 1, c.hidden, router)?;
                }
            }
        }
    }
    l.dense(format!("{prefix}.norm.weight"), vec![c.hidden], neutral);
    if !c.tie_embeddings {
        l.matrix("lm_head".into(), None, c.vocab, c.hidden, format)?;
    }
    Ok(l)
}

/// Bytes filled per task, so large tensors spread over every core.
const CHUNK: usize = 1 << 20;

/// `len` bytes from `fill_chunk(rng, chunk)` over chunks of `CHUNK`, each chunk with its own
/// generator derived from `seed` and its index, so the result does not depend on the threads.
fn random_bytes(len: usize, seed: u64, fill_chunk: impl Fn(&mut Rng, &mut [u8]) + Sync) -> Vec<u8> {
    let mut v = vec![0u8; len];
    v.par_chunks_mut(CHUNK).enumerate().for_each(|(i, chunk)| {
        let mut rng = Rng::new(seed ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
        fill_chunk(&mut rng, chunk);
    });
    v
}

fn bf16_bytes(n: usize, seed: u64, value: impl Fn(&mut Rng) -> f32 + Sync) -> Vec<u8> {
    random_bytes(n * 2, seed, |rng, chunk| {
        for pair in chunk.chunks_exact_mut(2) {
            pair.copy_from_slice(&bf16::from_f32(value(rng)).to_le_bytes());
        }
    })
}

fn tensor(name: String, dtype: DType, shape: Vec<usize>, bytes: Vec<u8>) -> OwnedTensor {
    OwnedTensor {
        name,
        dtype,
        shape,
        bytes: bytes.into(),
    }
}

/// Random weights for `c` in the MLX layout with `format`, and the `quantization` object its
/// config gets (the default format and the per-module exceptions).
pub fn synthetic_weights(c: &ModelConfig, format: QuantFormat, seed: u64) -> Result<(Weights, Value)> {
    let l = layout(c, format)?;
    let mut tensors = Vec::new();
    for (t, entry) in l.entries.into_iter().enumerate() {
        let seed = seed ^ (t as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        match entry {
            Entry::Quant {
                base,
                lead,
                rows,
                cols,
                format: f,
            } => {
                let shape = |last: usize| lead.into_iter().chain([rows, last]).collect::<Vec<_>>();
                let n = lead.unwrap_or(1) * rows;
                let words = n * f.words_per_row(cols);
                let weight = random_bytes(words * 4, seed, |rng, chunk| {
                    for w in chunk.chunks_mut(8) {
                        let n = w.len();
                        w.copy_from_slice(&rng.next_u64().to_le_bytes()[..n]);
                    }
                });
                // q uniform over 0..2^bits: mean (2^bits - 1) / 2, variance (4^bits - 1) / 12.
                let levels = (1u64 << f.bits) as f32;
                let q_std = ((levels * levels - 1.0) / 12.0).sqrt();
                let scale = 1.0 / ((cols as f32).sqrt() * q_std);
                let bias = -scale * (levels - 1.0) / 2.0;
                let groups = n * f.groups_per_row(cols);
                tensors.push(tensor(
                    format!("{base}.weight"),
                    DType::U32,
                    shape(f.words_per_row(cols)),
                    weight,
                ));
                let g = f.groups_per_row(cols);
                tensors.push(tensor(
                    format!("{base}.scales"),
                    DType::BF16,
                    shape(g),
                    bf16_bytes(groups, 0, |_| scale),
                ));
                tensors.push(tensor(
                    format!("{base}.biases"),
                    DType::BF16,
                    shape(g),
                    bf16_bytes(groups, 0, |_| bias),
                ));
            }
            Entry::Dense { name, shape, fill } => {
                let n = shape.iter().product();
                let bytes = match fill {
                    Fill::Const(v) => bf16_bytes(n, 0, |_| v),
                    Fill::Uniform(a) => bf16_bytes(n, seed, |rng| a * rng.symmetric()),
                    Fill::LogDecay => bf16_bytes(n, seed, |rng| (1.0 + 15.0 * rng.next_f32()).ln()),
                };
                tensors.push(tensor(name, DType::BF16, shape, bytes));
            }
        }
    }
    let mut q = Map::new();
    q.insert("group_size".into(), format.group_size.into());
    q.insert("bits".into(), format.bits.into());
    q.extend(l.overrides);
    Ok((Weights::from_memory("<synthetic>", tensors)?, Value::Object(q)))
}

/// A named configuration with random weights: its config (with `quantization`) and weights.
pub fn synthetic_model(
    name: &str,
    layers: Option<usize>,
    format: QuantFormat,
    seed: u64,
) -> Result<(ModelConfig, Weights)> {
    let (_, config, weights) = synthetic_model_json(name, layers, format, seed)?;
    Ok((config, weights))
}

/// The same, with the `config.json` object a directory of it holds (see `write_model_dir`).
pub fn synthetic_model_json(
    name: &str,
    layers: Option<usize>,
    format: QuantFormat,
    seed: u64,
) -> Result<(Value, ModelConfig, Weights)> {
    let mut json = synthetic_config_json(name, layers)?;
    let dense = ModelConfig::from_json(&json.to_string())?;
    let (weights, quant) = synthetic_weights(&dense, format, seed)?;
    let obj = json.as_object_mut().expect("published configs are objects");
    obj.insert("quantization".into(), quant.clone());
    obj.insert("quantization_config".into(), quant);
    let config = ModelConfig::from_json(&json.to_string())?;
    Ok((json, config, weights))
}
