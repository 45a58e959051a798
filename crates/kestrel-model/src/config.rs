//! `config.json` of the supported architectures, read into one typed [`ModelConfig`].
//!
//! Two generations of files exist and both load: the hub style written by transformers 4.x
//! (`rope_theta` and `rope_scaling` at the top level, `num_experts`, `full_attention_interval`,
//! `torch_dtype`) and the transformers 5 style (`rope_parameters`, `layer_types`, `dtype`,
//! `num_local_experts`). Where a key is absent, the default is the one transformers' config class
//! for that architecture uses. Multimodal Qwen3.5-MoE files nest the language model under
//! `text_config`; that part is read and the vision tower ignored. MLX-format quantised
//! directories add `quantization` (or `quantization_config`) with per-module overrides.

use std::collections::BTreeMap;
use std::path::Path;

use kestrel_core::quant::QuantFormat;
use kestrel_core::rope::RopeScaling;
use kestrel_core::DType;
use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

/// The architectures Kestrel runs, by their `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Qwen3Moe,
    Qwen3Next,
    Qwen35Moe,
    Qwen3,
    Llama,
}

impl Arch {
    pub const ALL: [Arch; 5] = [
        Arch::Qwen3Moe,
        Arch::Qwen3Next,
        Arch::Qwen35Moe,
        Arch::Qwen3,
        Arch::Llama,
    ];

    /// The `model_type` of `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen3Next => "qwen3_next",
            Arch::Qwen35Moe => "qwen3_5_moe",
            Arch::Qwen3 => "qwen3",
            Arch::Llama => "llama",
        }
    }

    fn from_model_type(t: &str) -> Option<Arch> {
        // The text model of Qwen3.5-MoE on its own has its own type.
        if t == "qwen3_5_moe_text" {
            return Some(Arch::Qwen35Moe);
        }
        Arch::ALL.into_iter().find(|a| a.model_type() == t)
    }

    /// Hybrid models: linear-attention (Gated DeltaNet) layers between full-attention ones.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Arch::Qwen3Next | Arch::Qwen35Moe)
    }
}

/// The token mixer of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    FullAttention,
    LinearAttention,
}

/// The feed-forward block of one decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    /// SwiGLU of width `ModelConfig::intermediate`.
    Dense,
    /// Routed experts (and a shared expert where `MoeConfig::shared_intermediate` is set).
    Moe,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub experts_per_token: usize,
    /// Width of one routed expert.
    pub expert_intermediate: usize,
    /// Renormalise the chosen experts' probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Width of the gated shared expert, for architectures that have one.
    pub shared_intermediate: Option<usize>,
}

/// Gated DeltaNet layers of the hybrid architectures.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttnConfig {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Fraction of each head's dimensions that are rotated.
    pub partial_rotary_factor: f64,
    pub scaling: RopeScaling,
}

/// MLX quantisation: a default format and per-module overrides (`None`: kept unquantised).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantConfig {
    pub default: QuantFormat,
    pub overrides: BTreeMap<String, Option<QuantFormat>>,
}

impl QuantConfig {
    /// The format of the module at `path` (`model.layers.0.mlp.gate`), or None if unquantised.
    pub fn format_for(&self, path: &str) -> Option<QuantFormat> {
        match self.overrides.get(path) {
            Some(f) => *f,
            None => Some(self.default),
        }
    }
}

/// Everything Kestrel needs from `config.json` to build and load a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    /// Query heads and key/value heads of the full-attention layers.
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Width of the dense SwiGLU blocks.
    pub intermediate: usize,
    pub norm_eps: f64,
    pub tie_embeddings: bool,
    /// The weights' declared dtype (`dtype` or `torch_dtype`), if any.
    pub dtype: Option<DType>,
    pub max_position_embeddings: usize,
    pub rope: RopeConfig,
    pub layer_kinds: Vec<LayerKind>,
    pub mlp_kinds: Vec<MlpKind>,
    pub moe: Option<MoeConfig>,
    pub linear_attn: Option<LinearAttnConfig>,
    pub quant: Option<QuantConfig>,
    /// The language model sits under `text_config` (multimodal Qwen3.5-MoE); its weights are
    /// then under `model.language_model.` rather than `model.`.
    pub nested_text: bool,
}

/// Typed reads of one JSON object, with errors naming the key.
struct Obj<'a>(&'a Map<String, Value>);

impl Obj<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn bad(key: &str, reason: impl Into<String>) -> ModelError {
        ModelError::Config {
            key: key.to_string(),
            reason: reason.into(),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| Obj::bad(key, "missing"))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| Obj::bad(key, format!("expected a non-negative integer, found {v}"))),
        }
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| Obj::bad(key, format!("expected a number, found {v}"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| Obj::bad(key, format!("expected true or false, found {v}"))),
        }
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| Obj::bad(key, format!("expected a string, found {v}"))),
        }
    }

    fn opt_obj(&self, key: &str) -> Result<Option<Obj<'_>>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_object()
                .map(|m| Some(Obj(m)))
                .ok_or_else(|| Obj::bad(key, format!("expected an object, found {v}"))),
        }
    }

    fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as usize)
                        .ok_or_else(|| Obj::bad(key, format!("expected integers, found {v}")))
                })
                .collect(),
            Some(v) => Err(Obj::bad(key, format!("expected a list, found {v}"))),
        }
    }
}

impl ModelConfig {
    /// Reads `config.json` from a model directory.
    pub fn from_dir(dir: &Path) -> Result<ModelConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|error| ModelError::Io {
            path: path.clone(),
            error,
        })?;
        ModelConfig::from_json(&text).map_err(|e| e.in_file(&path))
    }

    /// Parses the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<ModelConfig> {
        let value: Value = serde_json::from_str(text).map_err(|e| ModelError::Json(e.to_string()))?;
        let top = value
            .as_object()
            .ok_or_else(|| ModelError::Json("the top level is not an object".into()))?;
        let top = Obj(top);
        let model_type = top
            .opt_str("model_type")?
            .ok_or_else(|| Obj::bad("model_type", "missing"))?;
        let arch = Arch::from_model_type(model_type).ok_or_else(|| ModelError::UnknownArch {
            model_type: model_type.to_string(),
            supported: Arch::ALL.map(|a| a.model_type()).join(", "),
        })?;
        // Multimodal files keep the language model's settings under `text_config`.
        let text_config = top.opt_obj("text_config")?;
        let nested_text = text_config.is_some();
        let c = text_config.unwrap_or(Obj(top.0));
        parse(arch, &c, &top, nested_text)
    }

    /// Layers with MoE feed-forward blocks.
    pub fn moe_layers(&self) -> usize {
        self.mlp_kinds.iter().filter(|&&k| k == MlpKind::Moe).count()
    }
}

fn dtype(name: &str) -> Result<DType> {
    match name {
        "bfloat16" => Ok(DType::BF16),
        "float16" => Ok(DType::F16),
        "float32" => Ok(DType::F32),
        other => Err(Obj::bad("dtype", format!("unsupported weight dtype {other:?}"))),
    }
}

/// The most decoder layers a config may declare. Published models have a few hundred at most;
/// the per-layer lists are built from the count before any weight is read, so a larger count
/// (a broken file) would exhaust memory rather than fail.
pub(crate) const MAX_LAYERS: usize = 1 << 16;

/// The most dimensions an attention head may have, declared or implied (hidden size over
/// heads). Published models use 64 to 256; the rotary table holds a frequency for every two
/// dimensions and is computed before any weight is read, so a wider head (a broken file) would
/// take memory and time without bound.
const MAX_HEAD_DIM: usize = 1 << 16;

fn parse(arch: Arch, c: &Obj, top: &Obj, nested_text: bool) -> Result<ModelConfig> {
    let hidden = c.usize("hidden_size")?;
    let layers = c.usize("num_hidden_layers")?;
    let heads = c.usize("num_attention_heads")?;
    if heads == 0 || layers == 0 || hidden == 0 {
        return Err(Obj::bad(
            "num_attention_heads",
            "hidden size, layers and heads must be positive",
        ));
    }
    if layers > MAX_LAYERS {
        return Err(Obj::bad(
            "num_hidden_layers",
            format!("{layers} layers, more than the {MAX_LAYERS} a model may have"),
        ));
    }
    let kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(heads);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Obj::bad(
            "num_key_value_heads",
            format!("{kv_heads} does not divide {heads} query heads"),
        ));
    }
    let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden / heads);
    if head_dim > MAX_HEAD_DIM {
        return Err(Obj::bad(
            "head_dim",
            format!(
                "{head_dim} dimensions a head (given, or hidden_size over num_attention_heads), \
                 more than the {MAX_HEAD_DIM} a head may have"
            ),
        ));
    }
    let max_position_embeddings = c.usize("max_position_embeddings")?;
    let dtype = match c.opt_str("dtype")?.or(c.opt_str("torch_dtype")?) {
        Some(d) => Some(dtype(d)?),
        None => match top.opt_str("dtype")?.or(top.opt_str("torch_dtype")?) {
            Some(d) => Some(dtype(d)?),
            None => None,
        },
    };
    let tie_embeddings = match c.opt_bool("tie_word_embeddings")? {
        Some(t) => t,
        None => top.opt_bool("tie_word_embeddings")?.unwrap_or(false),
    };
    let rope = rope(arch, c, max_position_embeddings)?;
    let layer_kinds = layer_kinds(arch, c, layers)?;
    let moe = moe(arch, c)?;
    let mlp_kinds = mlp_kinds(arch, c, layers, moe.as_ref())?;
    let intermediate = match c.opt_usize("intermediate_size")? {
        Some(i) => i,
        // Qwen3.5-MoE has no dense blocks and no such key.
        None if mlp_kinds.iter().all(|&k| k == MlpKind::Moe) => 0,
        None => return Err(Obj::bad("intermediate_size", "missing")),
    };
    let linear_attn = if arch.is_hybrid() {
        Some(LinearAttnConfig {
            key_heads: c.opt_usize("linear_num_key_heads")?.unwrap_or(16),
            value_heads: c.opt_usize("linear_num_value_heads")?.unwrap_or(32),
            key_head_dim: c.opt_usize("linear_key_head_dim")?.unwrap_or(128),
            value_head_dim: c.opt_usize("linear_value_head_dim")?.unwrap_or(128),
            conv_kernel: c.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        })
    } else {
        None
    };
    if let Some(l) = &linear_attn {
        if l.key_heads == 0 || l.value_heads % l.key_heads != 0 {
            return Err(Obj::bad(
                "linear_num_value_heads",
                format!(
                    "{} value heads are not a multiple of {} key heads",
                    l.value_heads, l.key_heads
                ),
            ));
        }
        if l.conv_kernel == 0 || l.key_head_dim == 0 || l.value_head_dim == 0 {
            return Err(Obj::bad(
                "linear_conv_kernel_dim",
                "the convolution window and the linear attention's head sizes must be positive",
            ));
        }
    }
    Ok(ModelConfig {
        arch,
        vocab: c.usize("vocab_size")?,
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        intermediate,
        norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
        tie_embeddings,
        dtype,
        max_position_embeddings,
        rope,
        layer_kinds,
        mlp_kinds,
        moe,
        linear_attn,
        quant: quant(top)?,
        nested_text,
    })
}

/// `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling` / `partial_rotary_factor`
/// at the top level (4.x); the dictionary's own values win, as in transformers.
fn rope(arch: Arch, c: &Obj, max_pos: usize) -> Result<RopeConfig> {
    let params = match c.opt_obj("rope_parameters")? {
        Some(p) => Some(p),
        None => c.opt_obj("rope_scaling")?,
    };
    let key = if c.get("rope_parameters").is_some() {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    let field = |name: &str| -> Result<Option<f64>> {
        match &params {
            Some(p) => match p.opt_f64(name) {
                Ok(v) => Ok(v),
                Err(_) => Err(Obj::bad(&format!("{key}.{name}"), "expected a number")),
            },
            None => Ok(None),
        }
    };
    let theta = match field("rope_theta")? {
        Some(t) => t,
        None => c.opt_f64("rope_theta")?.unwrap_or(10000.0),
    };
    // Qwen3-Next and Qwen3.5 rotate a quarter of each head unless told otherwise.
    let default_partial = if arch.is_hybrid() { 0.25 } else { 1.0 };
    let partial_rotary_factor = match field("partial_rotary_factor")? {
        Some(f) => f,
        None => c.opt_f64("partial_rotary_factor")?.unwrap_or(default_partial),
    };
    if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
        return Err(Obj::bad(
            "partial_rotary_factor",
            format!("{partial_rotary_factor} is not in (0, 1]"),
        ));
    }
    let kind = match &params {
        Some(p) => p
            .opt_str("rope_type")?
            .or(p.opt_str("type")?)
            .unwrap_or("default"),
        None => "default",
    };
    let required = |name: &str| -> Result<f64> {
        field(name)?.ok_or_else(|| Obj::bad(&format!("{key}.{name}"), format!("missing for {kind} scaling")))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: required("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: required("factor")?,
            low_freq_factor: required("low_freq_factor")?,
            high_freq_factor: required("high_freq_factor")?,
            original_max_position_embeddings: required("original_max_position_embeddings")?,
        },
        "yarn" => {
            let original = field("original_max_position_embeddings")?.unwrap_or(max_pos as f64);
            let truncate = match &params {
                Some(p) => p.opt_bool("truncate")?.unwrap_or(true),
                None => true,
            };
            RopeScaling::Yarn {
                factor: field("factor")?.unwrap_or(max_pos as f64 / original),
                original_max_position_embeddings: original,
                beta_fast: field("beta_fast")?.unwrap_or(32.0),
                beta_slow: field("beta_slow")?.unwrap_or(1.0),
                attention_factor: field("attention_factor")?,
                mscale: field("mscale")?,
                mscale_all_dim: field("mscale_all_dim")?,
                truncate,
            }
        }
        other => {
            return Err(Obj::bad(
                &format!("{key}.rope_type"),
                format!("unsupported rope type {other:?} (supported: default, linear, llama3, yarn)"),
            ))
        }
    };
    Ok(RopeConfig {
        theta,
        partial_rotary_factor,
        scaling,
    })
}

fn layer_kinds(arch: Arch, c: &Obj, layers: usize) -> Result<Vec<LayerKind>> {
    if let Some(v) = c.get("layer_types") {
        let list = v
            .as_array()
            .ok_or_else(|| Obj::bad("layer_types", "expected a list"))?;
        if list.len() != layers {
            return Err(Obj::bad(
                "layer_types",
                format!("{} entries for {layers} layers", list.len()),
            ));
        }
        return list
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(LayerKind::FullAttention),
                Some("linear_attention") if arch.is_hybrid() => Ok(LayerKind::LinearAttention),
                other => Err(Obj::bad(
                    "layer_types",
                    format!("unsupported layer type {other:?} for {}", arch.model_type()),
                )),
            })
            .collect();
    }
    if !arch.is_hybrid() {
        if c.opt_bool("use_sliding_window")? == Some(true) {
            return Err(Obj::bad(
                "use_sliding_window",
                "sliding-window attention is not supported",
            ));
        }
        return Ok(vec![LayerKind::FullAttention; layers]);
    }
    // Hub-style hybrid configs: every `full_attention_interval`-th layer is full attention.
    let interval = c.opt_usize("full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(Obj::bad("full_attention_interval", "must be positive"));
    }
    Ok((0..layers)
        .map(|i| {
            if (i + 1) % interval == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            }
        })
        .collect())
}

fn moe(arch: Arch, c: &Obj) -> Result<Option<MoeConfig>> {
    if matches!(arch, Arch::Qwen3 | Arch::Llama) {
        return Ok(None);
    }
    let experts = match c.opt_usize("num_experts")? {
        Some(e) => e,
        None => c
            .opt_usize("num_local_experts")?
            .ok_or_else(|| Obj::bad("num_experts", "missing (also as num_local_experts)"))?,
    };
    let experts_per_token = c.usize("num_experts_per_tok")?;
    if experts > 0 && (experts_per_token == 0 || experts_per_token > experts) {
        return Err(Obj::bad(
            "num_experts_per_tok",
            format!("{experts_per_token} of {experts} experts"),
        ));
    }
    let norm_topk_prob = match arch {
        // Qwen3.5-MoE always renormalises (its config has no such key).
        Arch::Qwen35Moe => true,
        Arch::Qwen3Next => c.opt_bool("norm_topk_prob")?.unwrap_or(true),
        _ => c.opt_bool("norm_topk_prob")?.unwrap_or(false),
    };
    let shared_intermediate = if arch.is_hybrid() {
        Some(c.usize("shared_expert_intermediate_size")?)
    } else {
        None
    };
    Ok(Some(MoeConfig {
        experts,
        experts_per_token,
        expert_intermediate: c.usize("moe_intermediate_size")?,
        norm_topk_prob,
        shared_intermediate,
    }))
}

/// As the modelling code: layer i is MoE unless listed in `mlp_only_layers`, when there are
/// experts and (i + 1) is a multiple of `decoder_sparse_step`. Qwen3.5-MoE is MoE throughout.
fn mlp_kinds(arch: Arch, c: &Obj, layers: usize, moe: Option<&MoeConfig>) -> Result<Vec<MlpKind>> {
    let Some(moe) = moe else {
        return Ok(vec![MlpKind::Dense; layers]);
    };
    if arch == Arch::Qwen35Moe {
        return Ok(vec![MlpKind::Moe; layers]);
    }
    let only = c.usize_list("mlp_only_layers")?;
    let step = c.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(Obj::bad("decoder_sparse_step", "must be positive"));
    }
    Ok((0..layers)
        .map(|i| {
            if !only.contains(&i) && moe.experts > 0 && (i + 1) % step == 0 {
                MlpKind::Moe
            } else {
                MlpKind::Dense
            }
        })
        .collect())
}

fn quant_format(key: &str, o: &Obj) -> Result<QuantFormat> {
    let bits = o
        .usize("bits")
        .map_err(|_| Obj::bad(&format!("{key}.bits"), "missing"))?;
    let group_size = o
        .usize("group_size")
        .map_err(|_| Obj::bad(&format!("{key}.group_size"), "missing"))?;
    if !matches!(bits, 4 | 8) {
        return Err(Obj::bad(
            &format!("{key}.bits"),
            format!("{bits}-bit weights are not supported (4, 8)"),
        ));
    }
    if group_size == 0 || group_size % 32 != 0 {
        return Err(Obj::bad(
            &format!("{key}.group_size"),
            format!("group size {group_size} is not a multiple of 32"),
        ));
    }
    Ok(QuantFormat::mlx(bits as u32, group_size))
}

/// MLX's `quantization` (or the same under `quantization_config`): `group_size` and `bits`, and
/// per-module entries that override them (`false`: that module is not quantised). Other
/// quantisation methods (a `quant_method` key) are refused by name.
fn quant(top: &Obj) -> Result<Option<QuantConfig>> {
    let (key, q) = match top.opt_obj("quantization")? {
        Some(q) => ("quantization", q),
        None => match top.opt_obj("quantization_config")? {
            Some(q) => ("quantization_config", q),
            None => return Ok(None),
        },
    };
    if let Some(method) = q.opt_str("quant_method")? {
        return Err(Obj::bad(
            &format!("{key}.quant_method"),
            format!("{method:?} checkpoints are not supported (MLX affine 4/8-bit only)"),
        ));
    }
    let default = quant_format(key, &q)?;
    let mut overrides = BTreeMap::new();
    for (module, v) in q.0 {
        match v {
            Value::Object(m) => {
                overrides.insert(
                    module.clone(),
                    Some(quant_format(&format!("{key}.{module}"), &Obj(m))?),
                );
            }
            Value::Bool(false) => {
                overrides.insert(module.clone(), None);
            }
            _ => {}
        }
    }
    Ok(Some(QuantConfig { default, overrides }))
}
