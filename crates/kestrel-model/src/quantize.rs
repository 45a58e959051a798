//! A dense model directory rewritten as an MLX-format quantised one, so quantisation is done
//! once: every projection (embeddings and lm_head included) becomes `.weight` (`u32` words),
//! `.scales` and `.biases`; routers and gates get 8 bits; a layer's experts become
//! `switch_mlp` stacks; config.json gains `quantization` (and `quantization_config`) with the
//! per-module exceptions; norms, convolutions and gate parameters are copied as they are, and so
//! is every other file of the directory (tokenizer, generation config). Layers are processed one
//! at a time and written in shards as they fill, so memory holds a shard, not the model.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kestrel_core::quant::{QuantFormat, QuantMatrix, ScaleType};
use safetensors::tensor::{serialize_to_file, Dtype, TensorView};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::experts::dense_values;
use crate::weights::{st_dtype, Tensor, Weights};

/// What `quantize_dir` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantizeReport {
    /// Matrices quantised (experts counted per layer and matrix).
    pub quantized: usize,
    /// Tensors copied as stored.
    pub copied: usize,
    /// Bytes of the written weights.
    pub bytes: usize,
}

/// One output tensor.
struct Out {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn quantized_parts(q: &QuantMatrix, lead: &[usize]) -> Result<[(String, Out); 3]> {
    let shape = |cols: usize| lead.iter().copied().chain([q.rows, cols]).collect::<Vec<_>>();
    let f = q.format;
    // Factored scales are written as the GGUF loader holds them: a byte pair a group, f32 unit
    // pairs a super-block.
    let ((sd, sn), (bd, bn)) = match f.scale {
        ScaleType::Bf16 => ((Dtype::BF16, 1), (Dtype::BF16, 1)),
        ScaleType::F32 => ((Dtype::F32, 1), (Dtype::F32, 1)),
        ScaleType::Factored => ((Dtype::U8, 2), (Dtype::F32, 0)),
    };
    let groups = f.groups_per_row(q.cols);
    let units = 2 * (q.cols / kestrel_core::quant::SUPER_BLOCK);
    let (scales, biases) = q.group_bytes().ok_or_else(|| ModelError::Config {
        key: "quantization".into(),
        reason: format!("{:?} cannot hold the quantiser's group scales", q.format),
    })?;
    Ok([
        (
            "weight".into(),
            Out {
                dtype: Dtype::U32,
                shape: shape(f.words_per_row(q.cols)),
                data: q.weight.iter().flat_map(|w| w.to_le_bytes()).collect(),
            },
        ),
        (
            "scales".into(),
            Out {
                dtype: sd,
                shape: shape(sn * groups),
                data: scales,
            },
        ),
        (
            "biases".into(),
            Out {
                dtype: bd,
                shape: shape(if bn == 0 { units } else { groups }),
                data: biases,
            },
        ),
    ])
}

/// `{mlp}.experts.{e}.{proj}.weight` → (mlp, e, proj).
fn per_expert(name: &str) -> Option<(&str, usize, &str)> {
    let (mlp, rest) = name.split_once(".experts.")?;
    let (e, rest) = rest.split_once('.')?;
    let proj = rest.strip_suffix(".weight")?;
    Some((mlp, e.parse().ok()?, proj))
}

/// Bytes of tensors per output file before a new shard starts.
pub const DEFAULT_SHARD_BYTES: usize = 4 << 30;

/// The layer a tensor belongs to (`model.layers.12.` → `Some(12)`), so a layer's tensors (its
/// experts in particular) are quantised together.
fn layer_of(name: &str) -> Option<usize> {
    let (_, rest) = name.split_once("layers.")?;
    rest.split('.').next()?.parse().ok()
}

/// Rewrites the dense model directory `src` into `dst` (created, or an empty directory: files
/// are never overwritten) with its projections quantised to `format`, in shards of about
/// [`DEFAULT_SHARD_BYTES`].
pub fn quantize_dir(src: &Path, dst: &Path, format: QuantFormat) -> Result<QuantizeReport> {
    quantize_dir_sharded(src, dst, format, DEFAULT_SHARD_BYTES)
}

/// [`quantize_dir`] with shards of at most `shard_bytes` (a larger single layer gets a shard of
/// its own). Layers are quantised one at a time and each shard is written as soon as it is full,
/// so memory holds one shard and one layer, not the model. One shard is `model.safetensors`;
/// several are `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.
pub fn quantize_dir_sharded(
    src: &Path,
    dst: &Path,
    format: QuantFormat,
    shard_bytes: usize,
) -> Result<QuantizeReport> {
    let config = ModelConfig::from_dir(src)?;
    if config.quant.is_some() {
        return Err(ModelError::Config {
            key: "quantization".into(),
            reason: format!("{} is already quantised", src.display()),
        });
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |error| ModelError::Io { path, error }
    };
    // Only a new or empty directory: whatever a directory holds is the user's.
    let created = match std::fs::read_dir(dst) {
        Ok(mut entries) => {
            if entries.next().is_some() {
                return Err(ModelError::Weights {
                    path: dst.to_path_buf(),
                    reason: "is not empty; quantize writes only into a new or empty directory, \
                             so that no file of yours is overwritten"
                        .into(),
                });
            }
            false
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
        Err(error) => return Err(io(dst)(error)),
    };
    let w = Weights::open(src)?;
    // A group size no matrix's input width is a multiple of would quantise nothing.
    let fits = w.names().into_iter().any(|name| {
        w.get(name).is_ok_and(|t| {
            let dense = matches!(
                t.dtype,
                kestrel_core::DType::BF16 | kestrel_core::DType::F16 | kestrel_core::DType::F32
            );
            dense && t.shape.len() >= 2 && !name.contains("norm") && format.fits(t.shape[t.shape.len() - 1])
        })
    });
    if !fits {
        return Err(ModelError::Config {
            key: "group size".into(),
            reason: format!(
                "no matrix of {} has an input width that is a multiple of {} (at {} bits): \
                 nothing would be quantised; the usual group sizes are 32, 64 and 128",
                src.display(),
                format.group_size,
                format.bits
            ),
        });
    }
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    let written = write_quantized(src, dst, &w, format, shard_bytes);
    if written.is_err() {
        // Take back what this run wrote (the directory was new or empty), so a failure leaves
        // no half-written model behind.
        if let Ok(entries) = std::fs::read_dir(dst) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if src.join(&name).is_file() || is_output_name(&name) {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
        if created {
            let _ = std::fs::remove_dir(dst);
        }
    }
    written
}

/// Names this module writes besides copies of the source's files: `config.json` and the
/// weights, one file or shards with their index.
fn is_output_name(name: &str) -> bool {
    name == "config.json"
        || name == "model.safetensors"
        || name == "model.safetensors.index.json"
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
}

/// The writing half of [`quantize_dir_sharded`], into the existing empty directory `dst`.
fn write_quantized(
    src: &Path,
    dst: &Path,
    w: &Weights,
    format: QuantFormat,
    shard_bytes: usize,
) -> Result<QuantizeReport> {
    let mut overrides = serde_json::Map::new();
    let mut report = QuantizeReport::default();
    // Tensors by layer (the rest, embeddings, norms, the vision tower, last).
    let mut groups: BTreeMap<Option<usize>, Vec<&str>> = BTreeMap::new();
    for name in w.names() {
        groups.entry(layer_of(name)).or_default().push(name);
    }
    let mut order: Vec<Option<usize>> = groups.keys().copied().filter(Option::is_some).collect();
    order.extend(groups.contains_key(&None).then_some(None));
    let mut shards = Shards::new(dst, shard_bytes);
    for key in order {
        let out = quantize_group(w, &groups[&key], format, &mut overrides, &mut report)?;
        shards.add(out)?;
    }
    report.bytes = shards.bytes;
    shards.finish()?;
    // Every file but the weights and config.json, as it is.
    let entries = std::fs::read_dir(src).map_err(|error| ModelError::Io {
        path: src.to_path_buf(),
        error,
    })?;
    for entry in entries.flatten() {
        let p = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let weights_file = name.ends_with(".safetensors") || name == "model.safetensors.index.json";
        if p.is_file() && !weights_file && name != "config.json" {
            std::fs::copy(&p, dst.join(&name)).map_err(|error| ModelError::Io {
                path: p.clone(),
                error,
            })?;
        }
    }
    // config.json: the original, plus the quantisation MLX readers look for.
    let cfg_path = src.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(|error| ModelError::Io {
        path: cfg_path,
        error,
    })?;
    let mut cfg: Value = serde_json::from_str(&text).map_err(|e| ModelError::Json(e.to_string()))?;
    let mut q = serde_json::Map::new();
    q.insert("group_size".into(), format.group_size.into());
    q.insert("bits".into(), format.bits.into());
    q.extend(overrides);
    let obj = cfg
        .as_object_mut()
        .ok_or_else(|| ModelError::Json("config.json is not an object".into()))?;
    obj.insert("quantization".into(), Value::Object(q.clone()));
    obj.insert("quantization_config".into(), Value::Object(q));
    let pretty = serde_json::to_string_pretty(&cfg).map_err(|e| ModelError::Json(e.to_string()))?;
    std::fs::write(dst.join("config.json"), pretty).map_err(|error| ModelError::Io {
        path: dst.join("config.json"),
        error,
    })?;
    Ok(report)
}

/// The output tensors of the source tensors `names` (one layer's, or the rest): projections
/// quantised (routers and gates at 8 bits), experts stacked as `switch_mlp`, the others copied.
fn quantize_group(
    w: &Weights,
    names: &[&str],
    format: QuantFormat,
    overrides: &mut serde_json::Map<String, Value>,
    report: &mut QuantizeReport,
) -> Result<Vec<(String, Out)>> {
    let router = QuantFormat { bits: 8, ..format };
    let mut out: BTreeMap<String, Out> = BTreeMap::new();
    // Experts by (mlp, projection): one matrix per expert, stacked at the end.
    let mut experts: BTreeMap<(String, String), BTreeMap<usize, QuantMatrix>> = BTreeMap::new();
    let quantize =
        |t: &Tensor, rows: usize, cols: usize, f: QuantFormat, start: usize| -> Result<QuantMatrix> {
            Ok(QuantMatrix::quantize(
                &dense_values(t, start, rows * cols)?,
                rows,
                cols,
                f,
            ))
        };
    for &name in names {
        let t = w.get(name)?;
        let dense = matches!(
            t.dtype,
            kestrel_core::DType::BF16 | kestrel_core::DType::F16 | kestrel_core::DType::F32
        );
        // The vision tower of a multimodal checkpoint is copied as it is.
        let visual = name.starts_with("model.visual.") || name.starts_with("visual.");
        if let Some((mlp, e, proj)) = per_expert(name).filter(|_| dense && t.shape.len() == 2) {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            if format.fits(cols) {
                experts
                    .entry((mlp.to_string(), proj.to_string()))
                    .or_default()
                    .insert(e, quantize(&t, rows, cols, format, 0)?);
                continue;
            }
        }
        // Qwen3.5 stores a layer's experts stacked: gate rows then up rows, and down.
        if let Some(mlp) = name
            .strip_suffix(".experts.gate_up_proj")
            .filter(|_| dense && t.shape.len() == 3)
        {
            let (n, rows2, cols) = (t.shape[0], t.shape[1], t.shape[2]);
            if format.fits(cols) {
                for (proj, half) in [("gate_proj", 0), ("up_proj", 1)] {
                    let e_map = experts.entry((mlp.to_string(), proj.to_string())).or_default();
                    for e in 0..n {
                        let start = e * rows2 * cols + half * (rows2 / 2) * cols;
                        e_map.insert(e, quantize(&t, rows2 / 2, cols, format, start)?);
                    }
                }
                continue;
            }
        }
        if let Some(mlp) = name
            .strip_suffix(".experts.down_proj")
            .filter(|_| dense && t.shape.len() == 3)
        {
            let (n, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
            if format.fits(cols) {
                let e_map = experts
                    .entry((mlp.to_string(), "down_proj".to_string()))
                    .or_default();
                for e in 0..n {
                    e_map.insert(e, quantize(&t, rows, cols, format, e * rows * cols)?);
                }
                continue;
            }
        }
        let base = name.strip_suffix(".weight");
        let matrix = dense && t.shape.len() == 2 && !visual && !name.contains("norm");
        if let (Some(base), true) = (base, matrix) {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let f = if base.ends_with(".mlp.gate") || base.ends_with(".shared_expert_gate") {
                router
            } else {
                format
            };
            if f.fits(cols) {
                let q = quantize(&t, rows, cols, f, 0)?;
                for (suffix, o) in quantized_parts(&q, &[])? {
                    out.insert(format!("{base}.{suffix}"), o);
                }
                if f != format {
                    overrides.insert(
                        base.to_string(),
                        serde_json::json!({"group_size": f.group_size, "bits": f.bits}),
                    );
                }
                report.quantized += 1;
                continue;
            }
            overrides.insert(base.to_string(), Value::Bool(false));
        }
        out.insert(
            name.to_string(),
            Out {
                dtype: st_dtype(t.dtype),
                shape: t.shape.to_vec(),
                data: t.bytes.to_vec(),
            },
        );
        report.copied += 1;
    }
    for ((mlp, proj), mats) in experts {
        let n = mats.len();
        if mats.keys().copied().ne(0..n) {
            return Err(ModelError::Tensor {
                name: format!("{mlp}.experts.*.{proj}.weight"),
                reason: format!("experts {:?} are not 0..{n}", mats.keys().collect::<Vec<_>>()),
            });
        }
        let first = &mats[&0];
        let mut parts = quantized_parts(first, &[n])?;
        for (_, o) in parts.iter_mut() {
            o.data.clear();
        }
        for q in mats.values() {
            for (i, (_, o)) in quantized_parts(q, &[n])?.into_iter().enumerate() {
                parts[i].1.data.extend(o.data);
            }
        }
        for (suffix, o) in parts {
            out.insert(format!("{mlp}.switch_mlp.{proj}.{suffix}"), o);
        }
        report.quantized += 1;
    }
    Ok(out.into_iter().collect())
}

/// Refuses a destination that holds anything: writing a model never overwrites a file the
/// program did not create. A missing folder is fine (it is created when writing starts).
pub fn check_empty_dst(dst: &Path) -> Result<()> {
    let refuse = |reason: &str| ModelError::Weights {
        path: dst.to_path_buf(),
        reason: reason.into(),
    };
    match std::fs::read_dir(dst) {
        Ok(mut entries) => match entries.next() {
            None => Ok(()),
            Some(_) => Err(refuse("is not empty; not writing a model into it")),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(_) if dst.exists() => Err(refuse("is not a folder we can read")),
        Err(error) => Err(ModelError::Io {
            path: dst.to_path_buf(),
            error,
        }),
    }
}

/// Writes `weights` and `config` (the `config.json` object) as the model directory `dst`:
/// safetensors shards of about `shard_bytes` each, a layer's tensors together, their index when
/// there are several, and `config.json`. `dst` must be missing or empty ([`check_empty_dst`]).
/// Returns the bytes of tensor data written.
pub fn write_model_dir(dst: &Path, config: &Value, weights: &Weights, shard_bytes: usize) -> Result<usize> {
    check_empty_dst(dst)?;
    std::fs::create_dir_all(dst).map_err(|error| ModelError::Io {
        path: dst.to_path_buf(),
        error,
    })?;
    let mut groups: BTreeMap<Option<usize>, Vec<&str>> = BTreeMap::new();
    for name in weights.names() {
        groups.entry(layer_of(name)).or_default().push(name);
    }
    let mut order: Vec<Option<usize>> = groups.keys().copied().filter(Option::is_some).collect();
    order.extend(groups.contains_key(&None).then_some(None));
    let mut shards = Shards::new(dst, shard_bytes);
    for key in order {
        let mut group = Vec::with_capacity(groups[&key].len());
        for &name in &groups[&key] {
            let t = weights.get(name)?;
            let out = Out {
                dtype: st_dtype(t.dtype),
                shape: t.shape.to_vec(),
                data: t.bytes.to_vec(),
            };
            group.push((name.to_string(), out));
        }
        shards.add(group)?;
    }
    let bytes = shards.bytes;
    shards.finish()?;
    let pretty = serde_json::to_string_pretty(config).map_err(|e| ModelError::Json(e.to_string()))?;
    std::fs::write(dst.join("config.json"), pretty).map_err(|error| ModelError::Io {
        path: dst.join("config.json"),
        error,
    })?;
    Ok(bytes)
}

/// Output files being written: tensors gather until the next group would pass the limit.
struct Shards<'a> {
    dst: &'a Path,
    limit: usize,
    pending: Vec<(String, Out)>,
    pending_bytes: usize,
    /// Written shards: temporary file name and tensor names.
    written: Vec<(PathBuf, Vec<String>)>,
    bytes: usize,
}

impl<'a> Shards<'a> {
    fn new(dst: &'a Path, limit: usize) -> Shards<'a> {
        Shards {
            dst,
            limit,
            pending: Vec::new(),
            pending_bytes: 0,
            written: Vec::new(),
            bytes: 0,
        }
    }

    fn add(&mut self, group: Vec<(String, Out)>) -> Result<()> {
        let size: usize = group.iter().map(|(_, o)| o.data.len()).sum();
        if !self.pending.is_empty() && self.pending_bytes + size > self.limit {
            self.flush()?;
        }
        self.pending_bytes += size;
        self.bytes += size;
        self.pending.extend(group);
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let file = self
            .dst
            .join(format!(".shard-{}.safetensors.partial", self.written.len()));
        let views: Vec<(String, TensorView)> = self
            .pending
            .iter()
            .map(|(n, o)| {
                TensorView::new(o.dtype, o.shape.clone(), &o.data)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| ModelError::Tensor {
                        name: n.clone(),
                        reason: e.to_string(),
                    })
            })
            .collect::<Result<_>>()?;
        let meta = [("format".to_string(), "mlx".to_string())].into_iter().collect();
        serialize_to_file(views, Some(meta), &file).map_err(|e| ModelError::Weights {
            path: file.clone(),
            reason: e.to_string(),
        })?;
        let names = self.pending.drain(..).map(|(n, _)| n).collect();
        self.pending_bytes = 0;
        self.written.push((file, names));
        Ok(())
    }

    /// Writes the last shard and gives the files their final names (and the index, if several).
    fn finish(mut self) -> Result<()> {
        if !self.pending.is_empty() || self.written.is_empty() {
            self.flush()?;
        }
        let n = self.written.len();
        let rename = |from: &Path, to: &Path| {
            std::fs::rename(from, to).map_err(|error| ModelError::Io {
                path: to.to_path_buf(),
                error,
            })
        };
        if n == 1 {
            return rename(&self.written[0].0, &self.dst.join("model.safetensors"));
        }
        let mut map = serde_json::Map::new();
        for (i, (tmp, names)) in self.written.iter().enumerate() {
            let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
            rename(tmp, &self.dst.join(&file))?;
            for name in names {
                map.insert(name.clone(), Value::String(file.clone()));
            }
        }
        let index = serde_json::json!({"metadata": {"total_size": self.bytes}, "weight_map": map});
        let path = self.dst.join("model.safetensors.index.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&index).map_err(|e| ModelError::Json(e.to_string()))?,
        )
        .map_err(|error| ModelError::Io { path, error })
    }
}
