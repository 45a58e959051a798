//! A GGUF file (or the splits of one, `NAME-00001-of-0000N.gguf`) as a model: its metadata as a
//! `config.json` ([`ModelConfig`]), its tensors under the Hugging Face names the graph reads, with
//! what llama.cpp's converter changed undone (float experts split per expert, Llama's rotary
//! row order, Qwen3-Next's fused `in_proj_qkvz`, Qwen3.5's value heads in tiled order, the
//! hybrids' `1 + w` norms and `-exp(A_log)`), and its tokenizer, chat template and special
//! tokens as `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` values.
//!
//! Float tensors (F32, F16, BF16) that need no change are read in place from the map. Block-
//! quantised matrices are rewritten exactly as affine matrices with f32 group scales and biases
//! (`gguf_dequant::to_affine`), under `{base}.weight` (u32 words), `{base}.scales` and
//! `{base}.biases` as an MLX checkpoint names them, and a layer's stacked experts as MLX's
//! `{mlp}.switch_mlp.{gate,up,down}_proj` (gate and up in one format); block-quantised vectors, routers and
//! what only f32 can hold are dequantised to f32 exactly. Either way the model computes what
//! the file holds. The config gets the quantisation section such a checkpoint would have, each
//! affine matrix's format named. Every tensor of the file must be used: one the mapping does
//! not know is an error naming it, never silently left out.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use kestrel_core::quant::{QuantFormat, QuantMatrix, ScaleType, SUPER_BLOCK};
use kestrel_core::rope::RopeScaling;
use kestrel_core::DType;
use rayon::prelude::*;
use serde_json::{json, Map, Value as Json};

use crate::config::{Arch, ModelConfig, QuantConfig};
use crate::error::{ModelError, Result};
use crate::gguf::{Gguf, TensorInfo, Value};
use crate::gguf_dequant::{
    affine_format, common_format, dequantize, factors, to_affine, to_factored, widen, QuantParts,
};
use crate::weights::{FileTensor, HeldBytes, MappedFile, OwnedTensor, Weights};

/// A GGUF model read: what a model directory's files would give.
pub struct GgufModel {
    pub config: ModelConfig,
    pub weights: Weights,
    /// The tokenizer as a `tokenizer.json` value, when the file has one.
    pub tokenizer: Option<Json>,
    /// The special tokens' text and the chat template, as a `tokenizer_config.json` value.
    pub tokenizer_config: Json,
    /// The beginning and end token ids, as a `generation_config.json` value.
    pub generation_config: Json,
}

/// llama.cpp's architecture names and Kestrel's.
const ARCHS: &[(&str, Arch)] = &[
    ("llama", Arch::Llama),
    ("qwen3", Arch::Qwen3),
    ("qwen3moe", Arch::Qwen3Moe),
    ("qwen3next", Arch::Qwen3Next),
    ("qwen35moe", Arch::Qwen35Moe),
];

fn bad(path: &Path, reason: impl Into<String>) -> ModelError {
    ModelError::Weights {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The splits of the model `path` names: itself, or every `-0000i-of-0000N` file beside it.
fn split_paths(path: &Path) -> Vec<PathBuf> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let Some(stem) = name.strip_suffix(".gguf") else {
        return vec![path.to_path_buf()];
    };
    // NAME-00001-of-00003
    let parts: Vec<&str> = stem.rsplitn(4, '-').collect();
    if parts.len() == 4 && parts[1] == "of" && parts[0].len() == 5 && parts[2].len() == 5 {
        if let (Ok(n), Ok(_)) = (parts[0].parse::<usize>(), parts[2].parse::<usize>()) {
            if (1..=9999).contains(&n) {
                let base = parts[3];
                return (1..=n)
                    .map(|i| path.with_file_name(format!("{base}-{i:05}-of-{n:05}.gguf")))
                    .collect();
            }
        }
    }
    vec![path.to_path_buf()]
}

/// Opens the GGUF model at `path` (a file, or the first or any split of one).
pub fn open_gguf(path: &Path) -> Result<GgufModel> {
    let paths = split_paths(path);
    let mut files = Vec::with_capacity(paths.len());
    for p in &paths {
        if !p.is_file() {
            return Err(bad(p, "this split of the model is missing"));
        }
        files.push(MappedFile::open(p)?);
    }
    model_of(files)
}

/// A GGUF model from a file's bytes held in memory (named `label` in messages).
pub fn gguf_from_bytes(label: &Path, bytes: Vec<u8>) -> Result<GgufModel> {
    model_of(vec![MappedFile::in_memory(label, bytes)])
}

/// The model of a GGUF file's splits, in order.
fn model_of(files: Vec<MappedFile>) -> Result<GgufModel> {
    let paths: Vec<PathBuf> = files.iter().map(|f| f.path.clone()).collect();
    let mut ggufs = Vec::with_capacity(files.len());
    for f in &files {
        ggufs.push(Gguf::parse(f.bytes()).map_err(|e| bad(&f.path, e.to_string()))?);
    }
    if paths.len() > 1 {
        for (i, g) in ggufs.iter().enumerate() {
            let no = g.get("split.no").and_then(Value::as_u64);
            let count = g.get("split.count").and_then(Value::as_u64);
            if no != Some(i as u64) || count != Some(paths.len() as u64) {
                return Err(bad(
                    &paths[i],
                    format!(
                        "split.no {no:?} / split.count {count:?}: not split {i} of {}",
                        paths.len()
                    ),
                ));
            }
        }
    }
    let label = paths[0].clone();
    let meta = &ggufs[0];
    let mut tensors: HashMap<&str, (usize, &TensorInfo)> = HashMap::new();
    for (i, g) in ggufs.iter().enumerate() {
        for t in &g.tensors {
            if tensors.insert(&t.name, (i, t)).is_some() {
                return Err(bad(&paths[i], format!("tensor {} is in two splits", t.name)));
            }
        }
    }
    let arch_name = meta
        .str("general.architecture")
        .map_err(|e| bad(&label, e.to_string()))?;
    let arch = ARCHS
        .iter()
        .find(|a| a.0 == arch_name)
        .map(|a| a.1)
        .ok_or_else(|| {
            bad(
                &label,
                format!(
                    "general.architecture {arch_name:?} is not supported (supported: {})",
                    ARCHS.iter().map(|a| a.0).collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
    check_memory(&label, arch, &tensors)?;
    let mut src = Source {
        label: &label,
        arch,
        files: &files,
        tensors,
        used: HashSet::new(),
        views: Vec::new(),
        owned: Vec::new(),
        formats: BTreeMap::new(),
    };
    let config_json = config_json(meta, arch_name, arch, &src).map_err(|e| e.in_file(&label))?;
    let mut config = ModelConfig::from_json(&config_json.to_string()).map_err(|e| e.in_file(&label))?;
    if let Some(factors) = src.rope_factors(&config)? {
        config.rope.scaling = RopeScaling::Factors(factors);
    }
    // Fused attention projections, split into their parts.
    let parts = split_qkv(&label, &config, &src.tensors)?;
    for (_, t) in &parts {
        src.tensors.remove(fused_qkv_of(&t.name).as_str());
    }
    for (file, t) in &parts {
        src.tensors.insert(&t.name, (*file, t));
    }
    map_tensors(&mut src, &config)?;
    config.quant = quant_config(std::mem::take(&mut src.formats));
    let unused: Vec<&str> = src
        .tensors
        .keys()
        .filter(|n| !src.used.contains(**n))
        .filter(|n| !extra_layer(n, config.layers))
        .copied()
        .collect();
    if let Some(n) = unused.iter().min() {
        return Err(bad(
            &label,
            format!(
                "tensor {n} is not one Kestrel reads for {arch_name} ({} such tensors); the file \
                 may be of a variant of the architecture that is not supported",
                unused.len()
            ),
        ));
    }
    let (views, owned) = (std::mem::take(&mut src.views), std::mem::take(&mut src.owned));
    let weights = Weights::from_files(&label, files, views, owned)?;
    // "no_vocab": llama.cpp's mark of a model without a vocabulary (prompts are token ids).
    let tokenizer = match meta.get("tokenizer.ggml.model") {
        None => None,
        Some(v) if v.as_str() == Some("no_vocab") => None,
        Some(_) => Some(meta.tokenizer_json().map_err(|e| bad(&label, e.to_string()))?),
    };
    let (tokenizer_config, generation_config) = text_json(meta);
    Ok(GgufModel {
        config,
        weights,
        tokenizer,
        tokenizer_config,
        generation_config,
    })
}

/// The fused tensor a part made by [`split_qkv`] comes from.
fn fused_qkv_of(part: &str) -> String {
    let blk = part.rsplit_once(".attn_").map_or(part, |(b, _)| b);
    format!("{blk}.attn_qkv.weight")
}

/// Each full-attention layer's `attn_qkv` (llama.cpp's converter fuses a layer's q, k and v
/// projections into one tensor with `--fuse-qkv`) as the `attn_q`, `attn_k` and `attn_v` it
/// holds: their rows follow each other, so each part is the fused tensor's bytes from its first
/// row on. k and v have `kv_heads * head_dim` rows; q (with Qwen3-Next's gate) the rest. Layers
/// with their own `attn_q` are left as they are.
fn split_qkv(
    label: &Path,
    c: &ModelConfig,
    tensors: &HashMap<&str, (usize, &TensorInfo)>,
) -> Result<Vec<(usize, TensorInfo)>> {
    let mut parts = Vec::new();
    for i in 0..c.layers {
        let name = format!("blk.{i}.attn_qkv.weight");
        let (Some(&(file, t)), false) = (
            tensors.get(name.as_str()),
            tensors.contains_key(format!("blk.{i}.attn_q.weight").as_str()),
        ) else {
            continue;
        };
        if c.layer_kinds[i] != crate::config::LayerKind::FullAttention {
            continue;
        }
        let kv = (c.kv_heads * c.head_dim) as u64;
        let (cols, rows) = match t.dims[..] {
            [cols, rows] => (cols, rows),
            _ => (0, 0),
        };
        let row_bytes = cols / t.ty.block * t.ty.block_bytes;
        if cols == 0 || cols % t.ty.block != 0 || rows <= 2 * kv || rows * row_bytes != t.bytes {
            return Err(bad(
                label,
                format!(
                    "tensor {name}: dims {:?} are not q, k and v projections of {kv} rows for k and v",
                    t.dims
                ),
            ));
        }
        let mut first = 0;
        for (part, n) in [("q", rows - 2 * kv), ("k", kv), ("v", kv)] {
            parts.push((
                file,
                TensorInfo {
                    name: format!("blk.{i}.attn_{part}.weight"),
                    dims: vec![cols, n],
                    ty: t.ty,
                    start: t.start + first * row_bytes,
                    bytes: n * row_bytes,
                },
            ));
            first += n;
        }
    }
    Ok(parts)
}

/// The host memory available now (`MemAvailable` of `/proc/meminfo`), where the system says.
fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// An error, before anything is converted, when the file's block-quantised tensors as Kestrel
/// holds them ([`loaded_bytes`]) would not fit in the host memory available.
fn check_memory(label: &Path, arch: Arch, tensors: &HashMap<&str, (usize, &TensorInfo)>) -> Result<()> {
    let need = loaded_bytes(arch, tensors);
    match available_memory() {
        Some(have) if need > have => {
            let file: u64 = tensors
                .values()
                .filter(|t| plain(t.1).is_none())
                .map(|t| t.1.bytes)
                .fold(0, u64::saturating_add);
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            Err(bad(
                label,
                format!(
                    "its quantised tensors ({:.1} GiB in the file) take {:.1} GiB as Kestrel holds \
                     them (4- or 8-bit values with f32 group scales and biases, f32 for vectors) \
                     and {:.1} GiB of memory is available",
                    gib(file),
                    gib(need),
                    gib(have)
                ),
            ))
        }
        _ => Ok(()),
    }
}

/// The affine format the tensor `name` is held in, when it is a block-quantised matrix the
/// graph reads as a projection; None for float tensors, and for block-quantised vectors, routers
/// and the convolution, which are held as f32.
fn held_affine(name: &str, t: &TensorInfo) -> Option<QuantFormat> {
    if t.dims.len() < 2 || name.contains("ffn_gate_inp") || name.contains("ssm_conv1d") {
        return None;
    }
    let format = affine_format(t.ty)?;
    Some(if expert_tensor(name) && factors(t.ty) {
        QuantFormat::factored(format.bits, format.group_size)
    } else {
        format
    })
}

/// `m.group_bytes()`, its rows shared out over the threads (a Q4_K_M file of Qwen3-30B-A3B
/// factors 37 million super-blocks as it loads).
fn group_bytes_par(m: &QuantMatrix) -> Option<(Vec<u8>, Vec<u8>)> {
    /// Rows a task takes.
    const ROWS: usize = 64;
    let f = m.format;
    let groups = f.groups_per_row(m.cols);
    let (s_row, b_row) = f.group_parts_len(groups)?;
    if groups == 0 || m.scales.len() != m.rows * groups || m.biases.len() != m.rows * groups {
        return m.group_bytes();
    }
    let (mut sp, mut bp) = (vec![0u8; m.rows * s_row], vec![0u8; m.rows * b_row]);
    m.scales
        .par_chunks(ROWS * groups)
        .zip(m.biases.par_chunks(ROWS * groups))
        .zip(sp.par_chunks_mut(ROWS * s_row))
        .zip(bp.par_chunks_mut(ROWS * b_row))
        .all(|(((s, b), sp), bp)| f.group_bytes_into(s, b, sp, bp))
        .then_some((sp, bp))
}

/// A layer's stacked routed experts (`ffn_{gate,up,down,gate_up}_exps`): held with factored
/// group scales when a k-quant's ([`factors`]), which the expert kernels read.
fn expert_tensor(name: &str) -> bool {
    name.contains("_exps.")
}

/// The tensors held in one format with `name`, `name` among them: those one kernel reads as one
/// matrix (a layer's gate and up expert tensors; Qwen3-Next's `attn_qkv` and `attn_gate`,
/// gathered into one), and an attention's `attn_q`, `attn_k` and `attn_v`, which the graph fuses
/// into one product when they share a format (llama.cpp's Q4_K_M makes `attn_v` Q6_K beside a
/// Q4_K `attn_q`, which would otherwise take three products and a concatenation).
fn held_together(arch: Arch, name: &str) -> Option<Vec<String>> {
    let (blk, rest) = name.strip_prefix("blk.")?.split_once('.')?;
    let names: &[&str] = match rest {
        "ffn_gate_exps.weight" | "ffn_up_exps.weight" => &["ffn_gate_exps", "ffn_up_exps"],
        "attn_qkv.weight" | "attn_gate.weight" if arch == Arch::Qwen3Next => &["attn_qkv", "attn_gate"],
        "attn_q.weight" | "attn_k.weight" | "attn_v.weight" => &["attn_q", "attn_k", "attn_v"],
        _ => return None,
    };
    Some(names.iter().map(|n| format!("blk.{blk}.{n}.weight")).collect())
}

/// The affine format the block-quantised matrix `name` is held in: its own ([`held_affine`]),
/// or, when every tensor held together with it ([`held_together`]) is one, the narrowest format
/// common to them ([`common_format`], each widened to it exactly). None as for `held_affine`.
fn held_format(arch: Arch, tensors: &HashMap<&str, (usize, &TensorInfo)>, name: &str) -> Option<QuantFormat> {
    let format_of = |n: &str| tensors.get(n).and_then(|t| held_affine(n, t.1));
    let own = format_of(name)?;
    let together = held_together(arch, name)
        .and_then(|names| common_format(&names.iter().map(|n| format_of(n)).collect::<Option<Vec<_>>>()?));
    Some(together.unwrap_or(own))
}

/// The bytes the file's tensors take once loaded beyond the file itself: block-quantised
/// matrices as affine values with their group scales and biases (in the format common to the
/// tensors held together), other block-quantised tensors as f32, and f32 routers as the bf16
/// copy [`Source::router`] makes of them (at most: none when a value is not a bf16). Other float
/// tensors are read in place and not counted.
fn loaded_bytes(arch: Arch, tensors: &HashMap<&str, (usize, &TensorInfo)>) -> u64 {
    tensors
        .iter()
        .filter(|(name, t)| plain(t.1).is_none() || f32_router(name, t.1))
        .map(|(name, (_, t))| {
            let values = t.elem_count();
            if plain(t).is_some() {
                return values.saturating_mul(2);
            }
            let Some(format) = held_format(arch, tensors, name) else {
                return values.saturating_mul(4);
            };
            // A row's scale and bias parts, as the format stores them, over its values.
            let per_super = (format.scale_part(1, SUPER_BLOCK) + format.bias_part(1, SUPER_BLOCK)) as u64;
            (values.saturating_mul(format.bits as u64) / 8)
                .saturating_add(values / SUPER_BLOCK as u64 * per_super)
        })
        .fold(0, u64::saturating_add)
}

/// A layer's router stored as f32, which [`Source::router`] holds as bf16 when it can.
fn f32_router(name: &str, t: &TensorInfo) -> bool {
    name.ends_with(".ffn_gate_inp.weight") && plain(t) == Some(DType::F32)
}

/// A tensor of a layer past the model's own (multi-token-prediction layers, which the file may
/// carry and Kestrel does not run).
fn extra_layer(name: &str, layers: usize) -> bool {
    name.strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|i| i.parse::<usize>().ok())
        .is_some_and(|i| i >= layers)
}

/// A metadata value as JSON (numbers, strings, booleans and arrays of them).
fn to_json(v: &Value) -> Json {
    if let Some(a) = v.as_array() {
        if let Some(s) = a.strings() {
            return json!(s);
        }
        if let crate::gguf::Array::Bool(b) = a {
            return json!(b);
        }
        if let Some(i) = a.ints() {
            return json!(i);
        }
        return json!(a.floats().unwrap_or_default());
    }
    if let Some(s) = v.as_str() {
        return json!(s);
    }
    if let Value::Bool(b) = v {
        return json!(b);
    }
    if let Some(u) = v.as_u64() {
        return json!(u);
    }
    json!(v.as_f64())
}

/// The architecture's metadata as the `config.json` transformers would have written.
fn config_json(g: &Gguf, a: &str, arch: Arch, src: &Source) -> Result<Json> {
    let key = |k: &str| format!("{a}.{k}");
    let get = |k: &str| g.get(&key(k));
    let need = |k: &str| -> Result<Json> {
        get(k).map(to_json).ok_or_else(|| ModelError::Config {
            key: key(k),
            reason: "missing".into(),
        })
    };
    // A per-layer list (some files give head counts per layer): one value for every layer.
    let one = |k: &str, v: Json| -> Result<Json> {
        match v {
            Json::Array(list) => {
                let mut nonzero = list.iter().filter(|x| x.as_u64() != Some(0));
                let first = nonzero.next().cloned().unwrap_or(json!(0));
                if nonzero.any(|x| *x != first) {
                    return Err(ModelError::Config {
                        key: key(k),
                        reason: "differs between layers, which Kestrel does not support".into(),
                    });
                }
                Ok(first)
            }
            v => Ok(v),
        }
    };
    let model_type = if arch == Arch::Qwen35Moe {
        "qwen3_5_moe_text"
    } else {
        arch.model_type()
    };
    let blocks = need("block_count")?.as_u64().unwrap_or(0);
    let nextn = get("nextn_predict_layers").and_then(Value::as_u64).unwrap_or(0);
    let layers = blocks.checked_sub(nextn).ok_or_else(|| ModelError::Config {
        key: key("nextn_predict_layers"),
        reason: format!("{nextn}, more than the {blocks} blocks"),
    })?;
    // Before any per-layer list is built from the count.
    if layers > crate::config::MAX_LAYERS as u64 {
        return Err(ModelError::Config {
            key: key("block_count"),
            reason: format!(
                "{layers} layers, more than the {} a model may have",
                crate::config::MAX_LAYERS
            ),
        });
    }
    let embd = src.info("token_embd.weight")?;
    let vocab = embd.dims.get(1).copied().unwrap_or(0);
    let mut c = Map::new();
    c.insert("model_type".into(), json!(model_type));
    c.insert("hidden_size".into(), need("embedding_length")?);
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert(
        "num_attention_heads".into(),
        one("attention.head_count", need("attention.head_count")?)?,
    );
    if let Some(v) = get("attention.head_count_kv") {
        c.insert(
            "num_key_value_heads".into(),
            one("attention.head_count_kv", to_json(v))?,
        );
    }
    if let Some(v) = get("attention.key_length") {
        c.insert("head_dim".into(), to_json(v));
    }
    if let Some(v) = get("feed_forward_length") {
        c.insert(
            "intermediate_size".into(),
            one("feed_forward_length", to_json(v))?,
        );
    }
    c.insert("max_position_embeddings".into(), need("context_length")?);
    c.insert("vocab_size".into(), json!(vocab));
    if let Some(v) = get("attention.layer_norm_rms_epsilon") {
        c.insert("rms_norm_eps".into(), to_json(v));
    }
    c.insert(
        "tie_word_embeddings".into(),
        json!(!src.tensors.contains_key("output.weight")),
    );
    let mut rope = Map::new();
    rope.insert(
        "rope_theta".into(),
        get("rope.freq_base").map_or(json!(10000.0), to_json),
    );
    if let (Some(rot), Some(head)) = (
        get("rope.dimension_count").and_then(Value::as_u64),
        get("attention.key_length").and_then(Value::as_u64).or_else(|| {
            Some(g.get(&key("embedding_length"))?.as_u64()? / g.get(&key("attention.head_count"))?.as_u64()?)
        }),
    ) {
        if head > 0 {
            rope.insert("partial_rotary_factor".into(), json!(rot as f64 / head as f64));
        }
    }
    let scaling = get("rope.scaling.type").and_then(Value::as_str).unwrap_or("none");
    match scaling {
        "none" => {
            rope.insert("rope_type".into(), json!("default"));
        }
        "linear" | "yarn" => {
            rope.insert("rope_type".into(), json!(scaling));
            rope.insert("factor".into(), need("rope.scaling.factor")?);
            if let Some(v) = get("rope.scaling.original_context_length") {
                rope.insert("original_max_position_embeddings".into(), to_json(v));
            }
            for (k, hf) in [
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(v) = get(k) {
                    rope.insert(hf.into(), to_json(v));
                }
            }
        }
        other => {
            return Err(ModelError::Config {
                key: key("rope.scaling.type"),
                reason: format!("{other:?} is not supported (none, linear, yarn are)"),
            })
        }
    }
    c.insert("rope_parameters".into(), Json::Object(rope));
    if let Some(v) = get("expert_count") {
        c.insert("num_experts".into(), to_json(v));
        c.insert("num_experts_per_tok".into(), need("expert_used_count")?);
        c.insert(
            "moe_intermediate_size".into(),
            need("expert_feed_forward_length")?,
        );
        // llama.cpp normalises the chosen experts' weights for all three MoE architectures.
        c.insert("norm_topk_prob".into(), json!(true));
        c.insert("decoder_sparse_step".into(), json!(1));
        c.insert("mlp_only_layers".into(), json!([]));
        if let Some(v) = get("expert_shared_feed_forward_length") {
            c.insert("shared_expert_intermediate_size".into(), to_json(v));
        }
    }
    if arch.is_hybrid() {
        let n = |k: &str| -> Result<u64> {
            need(k)?.as_u64().ok_or_else(|| ModelError::Config {
                key: key(k),
                reason: "expected a non-negative integer".into(),
            })
        };
        let (v_heads, inner) = (n("ssm.time_step_rank")?, n("ssm.inner_size")?);
        if v_heads == 0 || inner % v_heads != 0 {
            return Err(ModelError::Config {
                key: key("ssm.inner_size"),
                reason: format!("{inner} is not a multiple of {v_heads} value heads"),
            });
        }
        c.insert("linear_conv_kernel_dim".into(), json!(n("ssm.conv_kernel")?));
        c.insert("linear_key_head_dim".into(), json!(n("ssm.state_size")?));
        c.insert("linear_num_key_heads".into(), json!(n("ssm.group_count")?));
        c.insert("linear_num_value_heads".into(), json!(v_heads));
        c.insert("linear_value_head_dim".into(), json!(inner / v_heads));
        let kinds: Vec<&str> = match get("attention.recurrent_layers").and_then(Value::as_array) {
            Some(crate::gguf::Array::Bool(r)) => r
                .iter()
                .take(layers as usize)
                .map(|&rec| if rec { "linear_attention" } else { "full_attention" })
                .collect(),
            _ => {
                let every = get("full_attention_interval")
                    .and_then(Value::as_u64)
                    .unwrap_or(4)
                    .max(1);
                (0..layers)
                    .map(|i| {
                        if (i + 1) % every == 0 {
                            "full_attention"
                        } else {
                            "linear_attention"
                        }
                    })
                    .collect()
            }
        };
        c.insert("layer_types".into(), json!(kinds));
    }
    Ok(Json::Object(c))
}

/// The tokenizer's special tokens and template, and the beginning and end ids, from metadata.
fn text_json(g: &Gguf) -> (Json, Json) {
    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .and_then(|a| a.strings());
    let id = |k: &str| g.get(k).and_then(Value::as_u64);
    let text = |i: Option<u64>| Some(tokens?.get(usize::try_from(i?).ok()?)?.clone());
    // SentencePiece vocabularies that name no beginning or end token have llama.cpp's.
    let spm = g.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("llama");
    let (b, e, _) = crate::gguf::SPM_DEFAULT_IDS;
    let bos = id("tokenizer.ggml.bos_token_id").or(spm.then_some(b));
    let eos = id("tokenizer.ggml.eos_token_id").or(spm.then_some(e));
    let mut tc = Map::new();
    if let Some(t) = text(bos) {
        tc.insert("bos_token".into(), json!(t));
    }
    if let Some(t) = text(eos) {
        tc.insert("eos_token".into(), json!(t));
    }
    if let Some(t) = g.get("tokenizer.chat_template").and_then(Value::as_str) {
        tc.insert("chat_template".into(), json!(t));
    }
    let mut ends: Vec<u64> = Vec::new();
    let more = ["eot", "eom"].map(|k| id(&format!("tokenizer.ggml.{k}_token_id")));
    for i in std::iter::once(eos).chain(more).flatten() {
        if !ends.contains(&i) {
            ends.push(i);
        }
    }
    let mut gc = Map::new();
    if let Some(b) = bos {
        gc.insert("bos_token_id".into(), json!(b));
    }
    if !ends.is_empty() {
        gc.insert("eos_token_id".into(), json!(ends));
    }
    (Json::Object(tc), Json::Object(gc))
}

/// The file's tensors, and what the mapping made of them so far.
struct Source<'a> {
    label: &'a Path,
    arch: Arch,
    files: &'a [MappedFile],
    tensors: HashMap<&'a str, (usize, &'a TensorInfo)>,
    used: HashSet<String>,
    views: Vec<FileTensor>,
    owned: Vec<OwnedTensor>,
    /// The format of each module held as an affine matrix (and of each layer's `switch_mlp`).
    formats: BTreeMap<String, Option<QuantFormat>>,
}

/// The quantisation section an MLX checkpoint of the affine matrices `formats` would have, every
/// one of them named: the graph checks each stored matrix against it, a layer's expert layout is
/// known without reading its tensors (a streamed layer's in-memory experts are dropped once
/// packed), and the footprint counts their values. The default (the most common format) is
/// never read: the modules it would cover are floats (no `.scales`). None when nothing is
/// quantised.
fn quant_config(formats: BTreeMap<String, Option<QuantFormat>>) -> Option<QuantConfig> {
    let mut counts: Vec<(QuantFormat, usize)> = Vec::new();
    for f in formats.values().flatten() {
        match counts.iter_mut().find(|c| c.0 == *f) {
            Some(c) => c.1 += 1,
            None => counts.push((*f, 1)),
        }
    }
    let default = counts.iter().max_by_key(|c| c.1)?.0;
    Some(QuantConfig {
        default,
        overrides: formats,
    })
}

/// A tensor's values in a float type: as stored (F32, F16, BF16) or dequantised to f32.
struct Dense<'a> {
    dtype: DType,
    bytes: Cow<'a, [u8]>,
    /// Torch order (slowest first).
    shape: Vec<usize>,
}

impl Dense<'_> {
    fn to_f32(&self) -> Vec<f32> {
        let t = crate::weights::Tensor {
            name: "",
            dtype: self.dtype,
            shape: &self.shape,
            bytes: &self.bytes,
        };
        crate::experts::dense_values(&t, 0, self.bytes.len() / self.dtype.size_in_bytes())
            .expect("a dense tensor is f32, f16 or bf16")
    }
}

fn plain(t: &TensorInfo) -> Option<DType> {
    match t.ty.name {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

/// Torch order of a tensor's dims (GGUF gives the fastest first).
fn torch_shape(t: &TensorInfo) -> Vec<usize> {
    t.dims.iter().rev().map(|&d| d as usize).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

impl<'a> Source<'a> {
    /// Tensor `name`'s file (its index among the splits) and info.
    fn entry(&self, name: &str) -> Result<(usize, &'a TensorInfo)> {
        self.tensors
            .get(name)
            .copied()
            .ok_or_else(|| bad(self.label, format!("tensor {name} is missing")))
    }

    fn info(&self, name: &str) -> Result<&'a TensorInfo> {
        Ok(self.entry(name)?.1)
    }

    fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Tensor `name`'s values, marking it used.
    fn dense(&mut self, name: &str) -> Result<Dense<'a>> {
        let (file, t) = self.entry(name)?;
        self.used.insert(name.to_string());
        let bytes = t.data(self.files[file].bytes());
        let shape = torch_shape(t);
        Ok(match plain(t) {
            Some(dtype) => Dense {
                dtype,
                bytes: Cow::Borrowed(bytes),
                shape,
            },
            None => Dense {
                dtype: DType::F32,
                bytes: Cow::Owned(f32_bytes(
                    &dequantize(t.ty, bytes).map_err(|r| bad(self.label, format!("tensor {name}: {r}")))?,
                )),
                shape,
            },
        })
    }

    fn own(&mut self, name: String, dtype: DType, shape: Vec<usize>, bytes: impl Into<HeldBytes>) {
        self.owned.push(OwnedTensor {
            name,
            dtype,
            shape,
            bytes: bytes.into(),
        });
    }

    /// Block-quantised tensor `name` (`[.., rows, cols]`, every dimension but the last as rows)
    /// as an affine matrix, marking it used.
    fn affine(&mut self, name: &str) -> Result<QuantMatrix> {
        let (file, t) = self.entry(name)?;
        self.used.insert(name.to_string());
        let cols = t.dims.first().copied().unwrap_or(0) as usize;
        let rows = t.dims.iter().skip(1).product::<u64>() as usize;
        to_affine(t.ty, t.data(self.files[file].bytes()), rows, cols)
            .map_err(|r| bad(self.label, format!("tensor {name}: {r}")))
    }

    /// Block-quantised matrix `name` factored straight from its blocks ([`to_factored`]),
    /// marking it used; None (nothing marked) for the types that cannot be.
    fn factored(&mut self, name: &str) -> Result<Option<QuantParts>> {
        let (file, t) = self.entry(name)?;
        let cols = t.dims.first().copied().unwrap_or(0) as usize;
        let rows = t.dims.iter().skip(1).product::<u64>() as usize;
        let Some(parts) = to_factored(t.ty, t.data(self.files[file].bytes()), rows, cols) else {
            return Ok(None);
        };
        self.used.insert(name.to_string());
        parts
            .map(Some)
            .map_err(|r| bad(self.label, format!("tensor {name}: {r}")))
    }

    /// Block-quantised matrix `name` as [`Source::affine`], widened to the format it is held in
    /// with the tensors held together with it ([`held_format`]).
    fn held(&mut self, name: &str) -> Result<QuantMatrix> {
        let m = self.affine(name)?;
        match held_format(self.arch, &self.tensors, name) {
            Some(to) if to != m.format => {
                widen(m, to).map_err(|r| bad(self.label, format!("tensor {name}: {r}")))
            }
            _ => Ok(m),
        }
    }

    /// `m` under `{base}.weight` (u32 words), `{base}.scales` and `{base}.biases` (f32), as
    /// `[rows, ..]`, or with `experts`, as `[experts, rows / experts, ..]`. Factored scales are a
    /// byte pair a group (`scales`, u8 `[.., 2 * groups]`) and an f32 pair of units a super-block
    /// (`biases`, `[.., 2 * cols / 256]`).
    fn own_quant(&mut self, base: &str, m: QuantMatrix, experts: Option<usize>) -> Result<()> {
        let f = m.format;
        let (scales, biases) = group_bytes_par(&m).ok_or_else(|| {
            bad(
                self.label,
                format!(
                    "{base}: its group scales cannot be held exactly as {f:?} (one not finite, or not \
                     a multiple of its super-block's unit)"
                ),
            )
        })?;
        let parts = QuantParts {
            format: f,
            rows: m.rows,
            cols: m.cols,
            weight: m.weight,
            scale_part: scales,
            bias_part: biases,
        };
        self.own_parts(base, parts, experts);
        Ok(())
    }

    /// A quantised matrix's packed values and its group scales' two parts under
    /// `{base}.weight`, `.scales` and `.biases`, shaped as [`Source::own_quant`] says.
    fn own_parts(&mut self, base: &str, p: QuantParts, experts: Option<usize>) {
        let f = p.format;
        self.formats.insert(base.to_string(), Some(f));
        let (words, groups) = (f.words_per_row(p.cols), f.groups_per_row(p.cols));
        let shape = |n: usize| match experts {
            Some(e) => vec![e, p.rows / e, n],
            None => vec![p.rows, n],
        };
        let (sd, ss, bs) = match f.scale {
            ScaleType::Factored => (DType::U8, shape(2 * groups), shape(2 * (p.cols / SUPER_BLOCK))),
            _ => (DType::F32, shape(groups), shape(groups)),
        };
        self.own(format!("{base}.weight"), DType::U32, shape(words), p.weight);
        self.own(format!("{base}.scales"), sd, ss, p.scale_part);
        self.own(format!("{base}.biases"), DType::F32, bs, p.bias_part);
    }

    /// `gguf` under the name `hf`: read in place when stored as a float type, as an affine
    /// matrix (`{base}.weight`, `.scales`, `.biases`) when a block-quantised matrix.
    fn direct(&mut self, gguf: &str, hf: String) -> Result<()> {
        self.direct_as(gguf, hf, None)
    }

    /// [`Source::direct`], the tensor given the torch shape `shape` (of as many values) when
    /// there is one: llama.cpp's quantiser writes a `[1, n]` matrix as a vector.
    fn direct_as(&mut self, gguf: &str, hf: String, shape: Option<Vec<usize>>) -> Result<()> {
        let (file, t) = self.entry(gguf)?;
        let shape = match shape {
            Some(s) if s.iter().product::<usize>() as u64 == t.elem_count() => s,
            Some(s) => {
                return Err(bad(
                    self.label,
                    format!("tensor {gguf}: shape {:?}, {s:?} expected", torch_shape(t)),
                ))
            }
            None => torch_shape(t),
        };
        match plain(t) {
            Some(dtype) => {
                self.used.insert(gguf.to_string());
                self.views.push(FileTensor {
                    name: hf,
                    file,
                    dtype,
                    shape,
                    start: t.start as usize,
                });
            }
            None => match hf.strip_suffix(".weight") {
                Some(base) if shape.len() == 2 && held_affine(gguf, t).is_some() => {
                    let m = self.held(gguf)?;
                    if [m.rows, m.cols] != shape[..] {
                        return Err(bad(
                            self.label,
                            format!("tensor {gguf}: shape {:?}, {shape:?} expected", [m.rows, m.cols]),
                        ));
                    }
                    self.own_quant(base, m, None)?;
                }
                _ => {
                    let bytes = self.dense(gguf)?.bytes.into_owned();
                    self.own(hf, DType::F32, shape, bytes);
                }
            },
        }
        Ok(())
    }

    /// A router `gguf` under the name `hf`: as bf16 when it is f32 and every value is a bf16
    /// (llama.cpp's converter writes a bf16 checkpoint's routers as f32), which the router's
    /// product then reads in half the bytes, else as [`Source::direct`] holds it.
    fn router(&mut self, gguf: &str, hf: String) -> Result<()> {
        let (file, t) = self.entry(gguf)?;
        if !f32_router(gguf, t) {
            return self.direct(gguf, hf);
        }
        let bytes = t.data(self.files[file].bytes());
        // The high half of each little-endian f32, when every low half is zero.
        let words = bytes.chunks_exact(4);
        if !words.clone().all(|w| w[0] == 0 && w[1] == 0) {
            return self.direct(gguf, hf);
        }
        self.used.insert(gguf.to_string());
        let bf16: Vec<u8> = words.flat_map(|w| [w[2], w[3]]).collect();
        self.own(hf, DType::BF16, torch_shape(t), bf16);
        Ok(())
    }

    /// `gguf`'s values, each changed by `f`, as f32 under the name `hf`, optionally in the
    /// order `order` (element `i` of the result is element `order[i]`).
    fn values(
        &mut self,
        gguf: &str,
        hf: String,
        order: Option<&[usize]>,
        f: impl Fn(f32) -> f32,
    ) -> Result<()> {
        let d = self.dense(gguf)?;
        let v = d.to_f32();
        let v: Vec<f32> = match order {
            Some(o) if o.len() != v.len() => {
                return Err(bad(
                    self.label,
                    format!("tensor {gguf}: {} values, {} expected", v.len(), o.len()),
                ))
            }
            Some(o) => o.iter().map(|&i| f(v[i])).collect(),
            None => v.into_iter().map(f).collect(),
        };
        self.own(hf, DType::F32, d.shape, f32_bytes(&v));
        Ok(())
    }

    /// Rows gathered from the tensors `parts` (2-D or 1-D as a column), row `i` of the result
    /// being row `order[i].1` of part `order[i].0`, under `hf`: as an affine matrix when every
    /// part is a block-quantised matrix (in the format common to them, [`widen`]), else in the
    /// parts' float type (f32 if they differ or some are block-quantised).
    fn rows(&mut self, parts: &[&str], hf: String, order: &[(usize, usize)]) -> Result<()> {
        let affine = parts
            .iter()
            .map(|p| Ok(self.info(p)?.dims.len() == 2 && held_affine(p, self.info(p)?).is_some()))
            .collect::<Result<Vec<bool>>>()?;
        if let Some(base) = hf.strip_suffix(".weight").filter(|_| affine.iter().all(|&a| a)) {
            return self.quant_rows(parts, base, order);
        }
        let mut dense = parts.iter().map(|p| self.dense(p)).collect::<Result<Vec<_>>>()?;
        if dense.iter().any(|d| d.shape.is_empty()) {
            return Err(bad(
                self.label,
                format!("tensors {parts:?}: one has no dimension"),
            ));
        }
        let cols = dense[0].shape[1..].iter().product::<usize>();
        if dense
            .iter()
            .any(|d| d.shape[1..].iter().product::<usize>() != cols)
        {
            return Err(bad(
                self.label,
                format!("tensors {parts:?} have rows of different lengths"),
            ));
        }
        if dense.iter().any(|d| d.dtype != dense[0].dtype) {
            for d in &mut dense {
                *d = Dense {
                    dtype: DType::F32,
                    bytes: Cow::Owned(f32_bytes(&d.to_f32())),
                    shape: d.shape.clone(),
                };
            }
        }
        let row = cols * dense[0].dtype.size_in_bytes();
        let mut out = Vec::with_capacity(order.len() * row);
        for &(p, r) in order {
            let b = &dense[p].bytes;
            if (r + 1) * row > b.len() {
                return Err(bad(self.label, format!("tensor {} has no row {r}", parts[p])));
            }
            out.extend_from_slice(&b[r * row..(r + 1) * row]);
        }
        let mut shape = dense[0].shape.clone();
        shape[0] = order.len();
        let dtype = dense[0].dtype;
        self.own(hf, dtype, shape, out);
        Ok(())
    }

    /// [`Source::rows`] of block-quantised matrices: each part as an affine matrix, widened to
    /// the format common to them, its rows gathered under `{base}.weight`, `.scales`, `.biases`.
    fn quant_rows(&mut self, parts: &[&str], base: &str, order: &[(usize, usize)]) -> Result<()> {
        let mats = parts.iter().map(|p| self.held(p)).collect::<Result<Vec<_>>>()?;
        let cols = mats[0].cols;
        if mats.iter().any(|m| m.cols != cols) {
            return Err(bad(
                self.label,
                format!("tensors {parts:?} have rows of different lengths"),
            ));
        }
        let format =
            common_format(&mats.iter().map(|m| m.format).collect::<Vec<_>>()).expect("a gather has parts");
        let mats = mats
            .into_iter()
            .zip(parts)
            .map(|(m, p)| widen(m, format).map_err(|r| bad(self.label, format!("tensor {p}: {r}"))))
            .collect::<Result<Vec<_>>>()?;
        let (wpr, gpr) = (format.words_per_row(cols), format.groups_per_row(cols));
        let mut out = QuantMatrix {
            format,
            rows: order.len(),
            cols,
            weight: Vec::with_capacity(order.len() * wpr),
            scales: Vec::with_capacity(order.len() * gpr),
            biases: Vec::with_capacity(order.len() * gpr),
        };
        for &(p, r) in order {
            let m = &mats[p];
            if r >= m.rows {
                return Err(bad(self.label, format!("tensor {} has no row {r}", parts[p])));
            }
            out.weight.extend_from_slice(&m.weight[r * wpr..(r + 1) * wpr]);
            out.scales.extend_from_slice(&m.scales[r * gpr..(r + 1) * gpr]);
            out.biases.extend_from_slice(&m.biases[r * gpr..(r + 1) * gpr]);
        }
        self.own_quant(base, out, None)?;
        Ok(())
    }

    /// A 2-D tensor's columns put in the order `order` (column `i` of the result is column
    /// `order[i]`): as an affine matrix when it is a block-quantised one whose groups move
    /// whole (every aligned run of a group's columns comes from one aligned run), else as f32.
    fn columns(&mut self, gguf: &str, hf: String, order: &[usize]) -> Result<()> {
        let t = self.info(gguf)?;
        let cols = t.dims.first().copied().unwrap_or(0) as usize;
        if cols != order.len() {
            return Err(bad(
                self.label,
                format!("tensor {gguf}: {cols} columns, {} expected", order.len()),
            ));
        }
        let whole = |g: usize| {
            order.chunks(g).all(|run| {
                run.len() == g
                    && run[0] % g == 0
                    && run[0] + g <= cols
                    && run.iter().enumerate().all(|(i, &c)| c == run[0] + i)
            })
        };
        let format = held_affine(gguf, t).filter(|f| t.dims.len() == 2 && whole(f.group_size));
        if let (Some(base), Some(f)) = (hf.strip_suffix(".weight"), format) {
            let m = self.affine(gguf)?;
            let (g, wpr, gpr) = (f.group_size, f.words_per_row(cols), f.groups_per_row(cols));
            let wpg = g / f.values_per_word();
            let mut out = QuantMatrix {
                weight: Vec::with_capacity(m.weight.len()),
                scales: Vec::with_capacity(m.scales.len()),
                biases: Vec::with_capacity(m.biases.len()),
                ..m
            };
            for r in 0..m.rows {
                for run in order.chunks(g) {
                    let (src, w) = (r * gpr + run[0] / g, r * wpr + run[0] / g * wpg);
                    out.weight.extend_from_slice(&m.weight[w..w + wpg]);
                    out.scales.push(m.scales[src]);
                    out.biases.push(m.biases[src]);
                }
            }
            self.own_quant(base, out, None)?;
            return Ok(());
        }
        let d = self.dense(gguf)?;
        let v = d.to_f32();
        let mut out = Vec::with_capacity(v.len());
        for r in v.chunks_exact(cols.max(1)) {
            out.extend(order.iter().map(|&c| r[c]));
        }
        self.own(hf, DType::F32, d.shape, f32_bytes(&out));
        Ok(())
    }

    /// Layer `i`'s stacked experts (`blk.{i}.ffn_{gate,up,down}_exps.weight`, `[experts, rows,
    /// cols]`) under the MoE block `mlp`. Block-quantised ones as MLX's stacked
    /// `{mlp}.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}`, `gate` and `up` in one
    /// format (one kernel reads both), the narrowest that holds each exactly ([`widen`]), `down`
    /// in its own (a Q4_K_M file often has a Q6_K `down` beside Q4_K `gate` and `up`).
    /// Otherwise one tensor an expert, `{mlp}.experts.{e}.{gate,up,down}_proj.weight`. Gate and
    /// up may be one tensor, `ffn_gate_up_exps` (`[experts, 2 * rows, cols]`, each expert's
    /// gate rows before its up rows), as llama.cpp's converter writes them when asked to fuse.
    fn expert_layer(&mut self, i: usize, mlp: &str) -> Result<()> {
        const WHICH: [&str; 3] = ["gate", "up", "down"];
        let fused = format!("blk.{i}.ffn_gate_up_exps.weight");
        let fused = self.has(&fused).then_some(fused);
        // Where each matrix is: its tensor, and with a fused gate and up, which half of each
        // expert's rows.
        let names = WHICH.map(|w| match &fused {
            Some(f) if w != "down" => (f.clone(), Some(usize::from(w == "up"))),
            _ => (format!("blk.{i}.ffn_{w}_exps.weight"), None),
        });
        let mut affine = true;
        for (n, half) in &names {
            let t = self.info(n)?;
            let halves = half.is_none_or(|_| t.dims.len() == 3 && t.dims[1] % 2 == 0);
            affine &=
                t.dims.len() == 3 && t.dims[1] > 0 && t.dims[2] > 0 && halves && held_affine(n, t).is_some();
        }
        if !affine {
            for (w, (n, half)) in WHICH.iter().zip(&names) {
                self.experts(n, *half, |e| format!("{mlp}.experts.{e}.{w}_proj.weight"))?;
            }
            return Ok(());
        }
        // Each matrix's own format (a k-quant's scales factored: the same values, fewer bytes);
        // gate and up are read by one kernel, so they share a format, and down keeps its own.
        let mut own = Vec::with_capacity(3);
        for (n, _) in &names {
            own.push(held_affine(n, self.info(n)?).expect("checked above"));
        }
        let gate_up = common_format(&own[..2]).expect("two matrices");
        let formats = [gate_up, gate_up, own[2]];
        // A fused gate and up is decoded once, for both halves.
        let mut whole: Option<QuantMatrix> = None;
        for (((w, (n, half)), own), format) in WHICH.iter().zip(&names).zip(own).zip(formats) {
            let experts = self.info(n)?.dims[2] as usize;
            let base = format!("{mlp}.switch_mlp.{w}_proj");
            // Held as the file holds it: its blocks' factors taken as they are.
            if half.is_none() && own == format && own.scale == ScaleType::Factored {
                if let Some(parts) = self.factored(n)? {
                    self.own_parts(&base, parts, Some(experts));
                    continue;
                }
            }
            let m = match half {
                Some(h) => {
                    if whole.is_none() {
                        whole = Some(self.affine(n)?);
                    }
                    half_rows(whole.as_ref().expect("decoded above"), experts, *h)
                }
                None => self.affine(n)?,
            };
            let m = QuantMatrix {
                format: QuantFormat {
                    scale: own.scale,
                    ..m.format
                },
                ..m
            };
            let m = widen(m, format).map_err(|r| bad(self.label, format!("tensor {n}: {r}")))?;
            self.own_quant(&base, m, Some(experts))?;
        }
        drop(whole);
        Ok(())
    }

    /// A stacked expert tensor (`[experts, rows, cols]`) as one tensor an expert, `hf(e)`: each
    /// expert's rows, or with `half` 0 or 1 the first or second half of them (a fused gate
    /// and up).
    fn experts(&mut self, gguf: &str, half: Option<usize>, hf: impl Fn(usize) -> String) -> Result<()> {
        let (file, t) = self.entry(gguf)?;
        let shape = torch_shape(t);
        if shape.len() != 3 {
            return Err(bad(
                self.label,
                format!("tensor {gguf}: shape {shape:?}, not [experts, rows, cols]"),
            ));
        }
        let (n, each) = (shape[0], shape[1] * shape[2]);
        if n == 0 || each == 0 || (half.is_some() && shape[1] % 2 != 0) {
            return Err(bad(
                self.label,
                format!(
                    "tensor {gguf}: shape {shape:?} holds no expert{}",
                    if half.is_some() {
                        "'s gate and up halves"
                    } else {
                        ""
                    }
                ),
            ));
        }
        // The rows taken of each expert: where they start among its values, and their shape.
        let (skip, rows) = match half {
            Some(h) => (h * each / 2, shape[1] / 2),
            None => (0, shape[1]),
        };
        let (part, part_shape) = (rows * shape[2], vec![rows, shape[2]]);
        match plain(t) {
            Some(dtype) => {
                self.used.insert(gguf.to_string());
                for e in 0..n {
                    self.views.push(FileTensor {
                        name: hf(e),
                        file,
                        dtype,
                        shape: part_shape.clone(),
                        start: t.start as usize + (e * each + skip) * dtype.size_in_bytes(),
                    });
                }
            }
            None => {
                let d = self.dense(gguf)?;
                for (e, chunk) in d.bytes.chunks_exact(each * 4).enumerate() {
                    let bytes = chunk[skip * 4..(skip + part) * 4].to_vec();
                    self.own(hf(e), DType::F32, part_shape.clone(), bytes);
                }
            }
        }
        Ok(())
    }

    /// Llama 3's frequency factors (`rope_freqs.weight`), checked against the rotated dims.
    fn rope_factors(&mut self, c: &ModelConfig) -> Result<Option<Vec<f32>>> {
        if !self.has("rope_freqs.weight") {
            return Ok(None);
        }
        let v = self.dense("rope_freqs.weight")?.to_f32();
        let rot = (c.head_dim as f64 * c.rope.partial_rotary_factor) as usize / 2;
        if v.len() != rot || v.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
            return Err(bad(
                self.label,
                format!(
                    "rope_freqs.weight: {} factors, expected {rot} positive ones",
                    v.len()
                ),
            ));
        }
        Ok(Some(v))
    }
}

/// Of `m`, `experts` stacked matrices of `2 * r` rows each, the first (`half` 0) or second
/// (`half` 1) `r` rows of every one: a fused gate and up tensor's gate or up.
fn half_rows(m: &QuantMatrix, experts: usize, half: usize) -> QuantMatrix {
    // The half's items of every expert, of `v` with `per_row` items a row.
    fn take<T: Copy>(v: &[T], rows: usize, per_row: usize, half: usize) -> Vec<T> {
        v.chunks_exact(2 * rows * per_row)
            .flat_map(|e| &e[half * rows * per_row..(half + 1) * rows * per_row])
            .copied()
            .collect()
    }
    let f = m.format;
    let rows = m.rows / experts / 2;
    let (words, groups) = (f.words_per_row(m.cols), f.groups_per_row(m.cols));
    QuantMatrix {
        format: f,
        rows: rows * experts,
        cols: m.cols,
        weight: take(&m.weight, rows, words, half),
        scales: take(&m.scales, rows, groups, half),
        biases: take(&m.biases, rows, groups, half),
    }
}

/// Where row `i` of a tensor whose value heads are grouped by key head (`[key heads, value heads
/// a key head, dim]`, transformers' order) lies in llama.cpp's tiled order (`[value heads a key
/// head, key heads, dim]`), for each `i`.
fn untile(key_heads: usize, per_key: usize, dim: usize) -> Vec<usize> {
    let mut order = Vec::with_capacity(key_heads * per_key * dim);
    for k in 0..key_heads {
        for j in 0..per_key {
            for d in 0..dim {
                order.push((j * key_heads + k) * dim + d);
            }
        }
    }
    order
}

/// Where row `i` of a Llama query or key projection (`heads` heads, transformers' rotary order:
/// each head's first halves, then its second halves) lies in llama.cpp's interleaved order.
fn unpermute(rows: usize, heads: usize) -> Option<Vec<usize>> {
    let even = heads.checked_mul(2)?;
    if rows == 0 || rows % even != 0 {
        return None;
    }
    let (dim, half) = (rows / heads, rows / even);
    let mut order = Vec::with_capacity(rows);
    for h in 0..heads {
        for t in 0..2 {
            for i in 0..half {
                order.push(h * dim + 2 * i + t);
            }
        }
    }
    Some(order)
}

fn single(order: Vec<usize>) -> Vec<(usize, usize)> {
    order.into_iter().map(|r| (0, r)).collect()
}

/// Every tensor the graph reads, from the file's.
fn map_tensors(s: &mut Source, c: &ModelConfig) -> Result<()> {
    let hybrid = c.arch.is_hybrid();
    // The hybrids' norms are `1 + w` in transformers; llama.cpp's converter stores `1 + w`.
    let norm = |s: &mut Source, gguf: &str, hf: String| -> Result<()> {
        if hybrid {
            s.values(gguf, hf, None, |v| v - 1.0)
        } else {
            s.direct(gguf, hf)
        }
    };
    s.direct("token_embd.weight", "model.embed_tokens.weight".into())?;
    norm(s, "output_norm.weight", "model.norm.weight".into())?;
    if s.has("output.weight") {
        s.direct("output.weight", "lm_head.weight".into())?;
    }
    for i in 0..c.layers {
        let b = |n: &str| format!("blk.{i}.{n}");
        let m = |n: &str| format!("model.layers.{i}.{n}");
        norm(s, &b("attn_norm.weight"), m("input_layernorm.weight"))?;
        let post = if hybrid {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        norm(s, &b(post), m("post_attention_layernorm.weight"))?;
        if c.layer_kinds[i] == crate::config::LayerKind::LinearAttention {
            linear_attention(s, c, i)?;
        } else {
            for (g, h) in [("attn_v", "v_proj"), ("attn_output", "o_proj")] {
                s.direct(&b(&format!("{g}.weight")), m(&format!("self_attn.{h}.weight")))?;
            }
            if c.arch == Arch::Llama {
                for (g, h, heads) in [("attn_q", "q_proj", c.heads), ("attn_k", "k_proj", c.kv_heads)] {
                    let name = b(&format!("{g}.weight"));
                    let rows = torch_shape(s.info(&name)?).first().copied().unwrap_or(0);
                    let order = unpermute(rows, heads).ok_or_else(|| {
                        bad(
                            s.label,
                            format!("tensor {name}: {rows} rows are not {heads} heads of an even size"),
                        )
                    })?;
                    s.rows(&[&name], m(&format!("self_attn.{h}.weight")), &single(order))?;
                }
            } else {
                for (g, h) in [("attn_q", "q_proj"), ("attn_k", "k_proj")] {
                    s.direct(&b(&format!("{g}.weight")), m(&format!("self_attn.{h}.weight")))?;
                }
                for (g, h) in [("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")] {
                    norm(s, &b(&format!("{g}.weight")), m(&format!("self_attn.{h}.weight")))?;
                }
            }
        }
        if s.has(&b("ffn_gate_inp.weight")) {
            s.router(&b("ffn_gate_inp.weight"), m("mlp.gate.weight"))?;
            s.expert_layer(i, &m("mlp"))?;
            if s.has(&b("ffn_gate_inp_shexp.weight")) {
                s.direct_as(
                    &b("ffn_gate_inp_shexp.weight"),
                    m("mlp.shared_expert_gate.weight"),
                    Some(vec![1, c.hidden]),
                )?;
            }
            if s.has(&b("ffn_up_shexp.weight")) {
                for w in ["gate", "up", "down"] {
                    s.direct(
                        &b(&format!("ffn_{w}_shexp.weight")),
                        m(&format!("mlp.shared_expert.{w}_proj.weight")),
                    )?;
                }
            }
        } else {
            for w in ["gate", "up", "down"] {
                s.direct(&b(&format!("ffn_{w}.weight")), m(&format!("mlp.{w}_proj.weight")))?;
            }
        }
    }
    Ok(())
}

/// A Gated DeltaNet layer's tensors.
fn linear_attention(s: &mut Source, c: &ModelConfig, i: usize) -> Result<()> {
    let l = c.linear_attn.as_ref().expect("hybrids have linear attention");
    let (nk, hk, nv, hv) = (l.key_heads, l.key_head_dim, l.value_heads, l.value_head_dim);
    let r = nv / nk;
    let b = |n: &str| format!("blk.{i}.{n}");
    let m = |n: &str| format!("model.layers.{i}.linear_attn.{n}");
    // The head counts and sizes of the metadata against the tensors, before any reordering is
    // built from them (so its size is the file's, whatever the metadata says).
    let rows = |s: &Source, n: &str| s.info(&b(n)).map(|t| torch_shape(t).first().copied());
    let (v_dim, qk) = (
        nv.checked_mul(hv),
        nk.checked_mul(hk).and_then(|x| x.checked_mul(2)),
    );
    let qkv = qk.zip(v_dim).and_then(|(a, b)| a.checked_add(b));
    if nv == 0
        || rows(s, "attn_gate.weight")? != v_dim
        || rows(s, "attn_qkv.weight")? != qkv
        || s.info(&b("ssm_a"))?.elem_count() != nv as u64
    {
        return Err(bad(
            s.label,
            format!(
                "layer {i}: its linear attention's tensors do not have the shapes of {nk} key \
                 heads of {hk} and {nv} value heads of {hv} (the ssm metadata)"
            ),
        ));
    }
    // Qwen3.5's value heads were put in tiled order wherever they appear (Qwen3-Next's not).
    let tiled = c.arch == Arch::Qwen35Moe;
    let heads = untile(nk, r, 1);
    // llama.cpp stores -exp(A_log).
    let a_order = tiled.then_some(heads.as_slice());
    s.values(&b("ssm_a"), m("A_log"), a_order, |a| (-f64::from(a)).ln() as f32)?;
    s.direct(&b("ssm_norm.weight"), m("norm.weight"))?;
    if !tiled {
        // transformers' `in_proj_qkvz` holds, for each key head, its q, k, v and z rows.
        let mut order = Vec::new();
        for g in 0..nk {
            order.extend((0..hk).map(|d| (0, g * hk + d)));
            order.extend((0..hk).map(|d| (0, nk * hk + g * hk + d)));
            order.extend((0..r * hv).map(|d| (0, 2 * nk * hk + g * r * hv + d)));
            order.extend((0..r * hv).map(|d| (1, g * r * hv + d)));
        }
        s.rows(
            &[&b("attn_qkv.weight"), &b("attn_gate.weight")],
            m("in_proj_qkvz.weight"),
            &order,
        )?;
        s.direct(&b("ssm_ba.weight"), m("in_proj_ba.weight"))?;
        s.direct(&b("ssm_dt.bias"), m("dt_bias"))?;
        s.direct(&b("ssm_conv1d.weight"), m("conv1d.weight"))?;
        s.direct(&b("ssm_out.weight"), m("out_proj.weight"))?;
        return Ok(());
    }
    let v_rows = untile(nk, r, hv);
    let qk = 2 * nk * hk;
    let mut qkv: Vec<(usize, usize)> = (0..qk).map(|x| (0, x)).collect();
    qkv.extend(v_rows.iter().map(|&x| (0, qk + x)));
    s.rows(&[&b("attn_qkv.weight")], m("in_proj_qkv.weight"), &qkv)?;
    s.rows(
        &[&b("attn_gate.weight")],
        m("in_proj_z.weight"),
        &single(v_rows.clone()),
    )?;
    s.rows(
        &[&b("ssm_beta.weight")],
        m("in_proj_b.weight"),
        &single(heads.clone()),
    )?;
    s.rows(
        &[&b("ssm_alpha.weight")],
        m("in_proj_a.weight"),
        &single(heads.clone()),
    )?;
    s.values(&b("ssm_dt.bias"), m("dt_bias"), Some(&heads), |x| x)?;
    let mut conv: Vec<(usize, usize)> = (0..qk).map(|x| (0, x)).collect();
    conv.extend(v_rows.iter().map(|&x| (0, qk + x)));
    s.rows(&[&b("ssm_conv1d.weight")], m("conv1d.weight"), &conv)?;
    s.columns(&b("ssm_out.weight"), m("out_proj.weight"), &v_rows)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `check_memory` counts is what a model holds in memory: the Q4_K_M fixtures whose
    /// only tensors held in memory come from block-quantised ones.
    #[test]
    fn the_memory_counted_is_the_memory_held() {
        let dir = kestrel_testing::fixtures::path("crates/kestrel-model/tests/gguf");
        for (name, arch) in [
            ("llama", Arch::Llama),
            ("qwen3", Arch::Qwen3),
            ("qwen3_moe_all", Arch::Qwen3Moe),
        ] {
            let path = dir.join(format!("{name}-q4_k_m.gguf"));
            let bytes = std::fs::read(&path).unwrap();
            let g = Gguf::parse(&bytes).unwrap();
            let tensors = g.tensors.iter().map(|t| (t.name.as_str(), (0, t))).collect();
            let w = open_gguf(&path).unwrap().weights;
            let held: usize = w
                .names()
                .into_iter()
                .filter(|n| w.file_span(n).is_none())
                .map(|n| w.get(n).unwrap().bytes.len())
                .sum();
            assert_eq!(loaded_bytes(arch, &tensors), held as u64, "{name}");
        }
    }

    /// A layer's gate and up experts are counted in the format common to the two, down in its
    /// own, their k-quant scales factored: Q4_K `gate` and `up` take 4 bits, a byte pair per 32
    /// values and 8 bytes of units per 256, a Q6_K `down` 8 bits and a byte pair per 16, and a
    /// Q4_K `up` beside a Q6_K `gate` the gate's format; other matrices an f32 scale and bias a
    /// group.
    #[test]
    fn experts_are_counted_widened() {
        let info = |name: &str, ty: u32, dims: Vec<u64>| TensorInfo {
            name: name.into(),
            dims,
            ty: crate::gguf::GgmlType::from_id(ty).unwrap(),
            start: 0,
            bytes: 0,
        };
        let t = [
            info("blk.0.ffn_gate_exps.weight", 12, vec![256, 256, 4]),
            info("blk.0.ffn_up_exps.weight", 12, vec![256, 256, 4]),
            info("blk.0.ffn_down_exps.weight", 14, vec![256, 256, 4]),
            info("blk.1.ffn_gate_exps.weight", 14, vec![256, 256, 4]),
            info("blk.1.ffn_up_exps.weight", 12, vec![256, 256, 4]),
            info("blk.0.attn_q.weight", 12, vec![256, 64]),
            info("blk.0.ffn_gate_inp.weight", 8, vec![256, 4]),
        ];
        let tensors = t.iter().map(|t| (t.name.as_str(), (0, t))).collect();
        // A matrix of 4 x 256 x 256 values: 4-bit in groups of 32 is 19/32 byte a value (1/2 +
        // 2/32 + 8/256), 8-bit in groups of 16 37/32 (1 + 2/16 + 8/256); f32 scales and biases
        // take 3/4 and 3/2.
        let m = 4 * 256 * 256;
        let experts = 2 * m * 19 / 32 + m * 37 / 32 + 2 * m * 37 / 32;
        let attn_q = 64 * 256 * 3 / 4;
        let router = 4 * 256 * 4;
        assert_eq!(
            loaded_bytes(Arch::Qwen3Moe, &tensors),
            (experts + attn_q + router) as u64
        );
    }
}
