//! A layer's routed experts packed into the engine's expert buffer ([`ExpertLayout`]: one
//! contiguous span per expert holding its gate, up and down matrices), from the three ways
//! checkpoints store them:
//!
//! - one tensor per expert and matrix, `{mlp}.experts.{e}.{gate,up,down}_proj.weight` (Qwen3-MoE
//!   and Qwen3-Next on the hub);
//! - stacked, `{mlp}.experts.gate_up_proj` `[E, 2 * inter, hidden]` (gate rows, then up rows) and
//!   `{mlp}.experts.down_proj` `[E, hidden, inter]` (Qwen3.5-MoE);
//! - MLX, quantised and stacked: `{mlp}.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}`
//!   with a leading expert dimension.
//!
//! bf16, f16 and f32 sources are rounded to bf16 for a bf16 layout or quantised on load for a
//! quantised one (as `kestrel_core::quant` does it); MLX sources are copied as they are into a
//! layout of the same format, or dequantised for a bf16 layout.

use half::{bf16, f16};
use kestrel_core::ir::{ExpertFormat, ExpertLayout, MatrixSpan};
use kestrel_core::quant::{QuantFormat, QuantMatrix, ScaleType, SUPER_BLOCK};
use kestrel_core::DType;
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::weights::{Tensor, Weights};

/// How a checkpoint stores a layer's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertSource {
    PerExpert,
    Stacked,
    MlxSwitch,
}

/// Which of gate, up and down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Gate,
    Up,
    Down,
}

impl Which {
    const ALL: [Which; 3] = [Which::Gate, Which::Up, Which::Down];

    fn name(self) -> &'static str {
        match self {
            Which::Gate => "gate_proj",
            Which::Up => "up_proj",
            Which::Down => "down_proj",
        }
    }

    /// `[rows, cols]` of this matrix of one expert.
    fn dims(self, l: &ExpertLayout) -> (usize, usize) {
        match self {
            Which::Gate | Which::Up => (l.inter, l.hidden),
            Which::Down => (l.hidden, l.inter),
        }
    }

    /// This matrix's format in `l` (gate and up share one; down has its own).
    fn format(self, l: &ExpertLayout) -> ExpertFormat {
        match self {
            Which::Gate | Which::Up => l.format,
            Which::Down => l.down,
        }
    }

    fn span(self, l: &ExpertLayout) -> MatrixSpan {
        match self {
            Which::Gate => l.gate(),
            Which::Up => l.up(),
            Which::Down => l.down_span(),
        }
    }
}

fn tensor_error(t: &Tensor, reason: String) -> ModelError {
    ModelError::Tensor {
        name: t.name.to_string(),
        reason,
    }
}

fn expect_shape(t: &Tensor, shape: &[usize]) -> Result<()> {
    if t.shape != shape {
        return Err(tensor_error(
            t,
            format!("shape {:?}, config.json implies {shape:?}", t.shape),
        ));
    }
    Ok(())
}

/// Elements `start .. start + len` of a dense (bf16, f16 or f32) tensor as f32.
pub(crate) fn dense_values(t: &Tensor, start: usize, len: usize) -> Result<Vec<f32>> {
    let b = t.bytes;
    Ok(match t.dtype {
        DType::BF16 => (start..start + len)
            .map(|i| bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32())
            .collect(),
        DType::F16 => (start..start + len)
            .map(|i| f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32())
            .collect(),
        DType::F32 => (start..start + len)
            .map(|i| f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]))
            .collect(),
        other => {
            return Err(tensor_error(
                t,
                format!("dtype {other}, expected bf16, f16 or f32"),
            ))
        }
    })
}

/// Detects how the checkpoint stores the experts under `mlp` (`model.layers.3.mlp`).
pub fn expert_source(w: &Weights, mlp: &str) -> Result<ExpertSource> {
    if w.contains(&format!("{mlp}.switch_mlp.gate_proj.weight")) {
        Ok(ExpertSource::MlxSwitch)
    } else if w.contains(&format!("{mlp}.experts.gate_up_proj")) {
        Ok(ExpertSource::Stacked)
    } else if w.contains(&format!("{mlp}.experts.0.gate_proj.weight")) {
        Ok(ExpertSource::PerExpert)
    } else {
        Err(ModelError::MissingTensor {
            name: format!(
                "{mlp}.experts.0.gate_proj.weight (or .experts.gate_up_proj, .switch_mlp.gate_proj.weight)"
            ),
            dir: w.dir().to_path_buf(),
        })
    }
}

/// One expert's matrix from a dense source, as f32 `[rows, cols]`.
fn dense_matrix(
    w: &Weights,
    mlp: &str,
    src: ExpertSource,
    l: &ExpertLayout,
    e: usize,
    m: Which,
) -> Result<Vec<f32>> {
    let (rows, cols) = m.dims(l);
    match src {
        ExpertSource::PerExpert => {
            let t = w.get(&format!("{mlp}.experts.{e}.{}.weight", m.name()))?;
            expect_shape(&t, &[rows, cols])?;
            dense_values(&t, 0, rows * cols)
        }
        ExpertSource::Stacked => {
            if m == Which::Down {
                let t = w.get(&format!("{mlp}.experts.down_proj"))?;
                expect_shape(&t, &[l.experts, rows, cols])?;
                dense_values(&t, e * rows * cols, rows * cols)
            } else {
                let t = w.get(&format!("{mlp}.experts.gate_up_proj"))?;
                expect_shape(&t, &[l.experts, 2 * rows, cols])?;
                let half = if m == Which::Gate { 0 } else { rows * cols };
                dense_values(&t, e * 2 * rows * cols + half, rows * cols)
            }
        }
        ExpertSource::MlxSwitch => unreachable!("MLX experts are read by mlx_matrix"),
    }
}

/// The format an MLX stacked source's shapes imply for matrix `m`, with its words and groups
/// per row, checked without reading the tensors' data.
fn mlx_format(w: &Weights, mlp: &str, l: &ExpertLayout, m: Which) -> Result<(QuantFormat, usize, usize)> {
    let (rows, cols) = m.dims(l);
    let base = format!("{mlp}.switch_mlp.{}", m.name());
    let (wt, st, bt) = (
        w.get(&format!("{base}.weight"))?,
        w.get(&format!("{base}.scales"))?,
        w.get(&format!("{base}.biases"))?,
    );
    let bad = |t: &Tensor, r: String| Err(tensor_error(t, r));
    if wt.dtype != DType::U32 || wt.shape.len() != 3 || wt.shape[0] != l.experts || wt.shape[1] != rows {
        return bad(
            &wt,
            format!(
                "{} {:?}, config.json implies u32 [{}, {rows}, words]",
                wt.dtype, wt.shape, l.experts
            ),
        );
    }
    let words = wt.shape[2];
    if words == 0 || (32 * words) % cols != 0 {
        return bad(&wt, format!("{words} words per row do not hold {cols} values"));
    }
    let bits = (32 * words / cols) as u32;
    // Factored scales (a GGUF k-quant's): a byte pair a group beside f32 unit pairs a super-block.
    let factored = st.dtype == DType::U8;
    let groups = st.shape.get(2).copied().unwrap_or(0) / if factored { 2 } else { 1 };
    let scale = if factored {
        Some(ScaleType::Factored)
    } else {
        scale_type(st.dtype)
    };
    let stored = if factored { 2 * groups } else { groups };
    let scale = scale.filter(|_| st.shape == [l.experts, rows, stored] && groups > 0);
    let Some(scale) = scale.filter(|_| cols % groups == 0) else {
        return bad(
            &st,
            format!(
                "{} {:?}, config.json implies bf16 or f32 [{}, {rows}, groups] (or u8 [{0}, {rows}, 2 * groups])",
                st.dtype, st.shape, l.experts
            ),
        );
    };
    let format = QuantFormat {
        bits,
        group_size: cols / groups,
        scale,
    };
    let (bias_dtype, bias_shape) = if factored {
        (DType::F32, vec![l.experts, rows, 2 * (cols / SUPER_BLOCK)])
    } else {
        (st.dtype, st.shape.to_vec())
    };
    if bt.dtype != bias_dtype || bt.shape != bias_shape {
        return bad(
            &bt,
            format!(
                "{} {:?}, expected {bias_dtype} {bias_shape:?}",
                bt.dtype, bt.shape
            ),
        );
    }
    if !format.fits(cols) {
        return bad(
            &wt,
            format!("{bits}-bit groups of {} are not supported", cols / groups),
        );
    }
    Ok((format, words, groups))
}

/// The format `mlp`'s MLX stacked experts are stored in, read from their gate (or down)
/// matrices' shapes and scale type (`layout` gives the experts' count and dimensions; its
/// formats are not read).
pub(crate) fn stored_format(
    w: &Weights,
    mlp: &str,
    layout: &ExpertLayout,
    down: bool,
) -> Result<QuantFormat> {
    mlx_format(w, mlp, layout, if down { Which::Down } else { Which::Gate }).map(|f| f.0)
}

/// The scale type a stored scales tensor of `dtype` is read as.
pub(crate) fn scale_type(dtype: DType) -> Option<ScaleType> {
    match dtype {
        DType::BF16 => Some(ScaleType::Bf16),
        DType::F32 => Some(ScaleType::F32),
        _ => None,
    }
}

/// One expert's matrix of an MLX stacked source as its stored bytes (weight, scales part, biases
/// part), with the format its shapes imply.
fn mlx_raw<'a>(
    tensors: &[Tensor<'a>; 3],
    format: QuantFormat,
    (rows, cols): (usize, usize),
    e: usize,
) -> [&'a [u8]; 3] {
    let sizes = [
        4 * rows * format.words_per_row(cols),
        format.scale_part(rows, cols),
        format.bias_part(rows, cols),
    ];
    std::array::from_fn(|i| &tensors[i].bytes[e * sizes[i]..(e + 1) * sizes[i]])
}

/// The weight, scales and biases tensors of `mlp`'s stacked matrix `m`.
fn mlx_tensors<'a>(w: &'a Weights, mlp: &str, m: Which) -> Result<[Tensor<'a>; 3]> {
    let base = format!("{mlp}.switch_mlp.{}", m.name());
    Ok([
        w.get(&format!("{base}.weight"))?,
        w.get(&format!("{base}.scales"))?,
        w.get(&format!("{base}.biases"))?,
    ])
}

/// One expert's matrix of an MLX stacked source, as stored, with the format its shapes imply.
fn mlx_matrix(w: &Weights, mlp: &str, l: &ExpertLayout, e: usize, m: Which) -> Result<QuantMatrix> {
    let (rows, cols) = m.dims(l);
    let (format, ..) = mlx_format(w, mlp, l, m)?;
    let tensors = mlx_tensors(w, mlp, m)?;
    let [wb, sb, bb] = mlx_raw(&tensors, format, (rows, cols), e);
    let (scales, biases) = format.group_values(sb, bb);
    Ok(QuantMatrix {
        format,
        rows,
        cols,
        weight: wb
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        scales,
        biases,
    })
}

/// Writes the parts of a quantised matrix at its place in an expert span.
fn put_parts(span: &mut [u8], at: MatrixSpan, [w, s, b]: [&[u8]; 3]) {
    span[at.weight..at.weight + w.len()].copy_from_slice(w);
    span[at.scales..at.scales + s.len()].copy_from_slice(s);
    span[at.biases..at.biases + b.len()].copy_from_slice(b);
}

/// Writes a quantised matrix at its place in an expert span; an error naming `name` when its
/// format cannot hold its groups exactly.
fn put_quant(span: &mut [u8], at: MatrixSpan, q: &QuantMatrix, name: impl Fn() -> String) -> Result<()> {
    let (scales, biases) = q.group_bytes().ok_or_else(|| ModelError::Tensor {
        name: name(),
        reason: format!("its group scales cannot be held exactly as {:?}", q.format),
    })?;
    put_parts(span, at, [bytemuck::cast_slice(&q.weight), &scales, &biases]);
    Ok(())
}

fn put_bf16(span: &mut [u8], at: MatrixSpan, v: &[f32]) {
    for (i, x) in v.iter().enumerate() {
        span[at.weight + 2 * i..at.weight + 2 * i + 2].copy_from_slice(&bf16::from_f32(*x).to_le_bytes());
    }
}

/// Where the experts of `mlp` come from, once their format is known to fit `layout`.
fn checked_source(w: &Weights, mlp: &str, layout: &ExpertLayout) -> Result<ExpertSource> {
    let src = expert_source(w, mlp)?;
    for m in Which::ALL {
        if let ExpertFormat::Quant(q) = m.format(layout) {
            let (_, cols) = m.dims(layout);
            if !q.fits(cols) {
                return Err(ModelError::Tensor {
                    name: format!("{mlp} {}", m.name()),
                    reason: format!("rows of {cols} values cannot be stored as {q:?}"),
                });
            }
        }
    }
    Ok(src)
}

/// Expert `e` of `mlp` packed into its span `dst` (`layout.span_bytes()` bytes).
fn pack_into(
    w: &Weights,
    mlp: &str,
    layout: &ExpertLayout,
    src: ExpertSource,
    e: usize,
    dst: &mut [u8],
) -> Result<()> {
    for m in Which::ALL {
        let at = m.span(layout);
        let (rows, cols) = m.dims(layout);
        match (src, m.format(layout)) {
            (ExpertSource::MlxSwitch, ExpertFormat::Quant(want)) => {
                let (format, ..) = mlx_format(w, mlp, layout, m)?;
                if format != want {
                    return Err(ModelError::Tensor {
                        name: format!("{mlp}.switch_mlp.{}.weight", m.name()),
                        reason: format!("stored as {format:?}, the layout wants {want:?}"),
                    });
                }
                put_parts(
                    dst,
                    at,
                    mlx_raw(&mlx_tensors(w, mlp, m)?, format, (rows, cols), e),
                );
            }
            (ExpertSource::MlxSwitch, ExpertFormat::Bf16) => {
                put_bf16(dst, at, &mlx_matrix(w, mlp, layout, e, m)?.dequantize());
            }
            (_, ExpertFormat::Bf16) => put_bf16(dst, at, &dense_matrix(w, mlp, src, layout, e, m)?),
            (_, ExpertFormat::Quant(q)) => {
                let v = dense_matrix(w, mlp, src, layout, e, m)?;
                put_quant(dst, at, &QuantMatrix::quantize(&v, rows, cols, q), || {
                    format!("{mlp} expert {e} {}", m.name())
                })?;
            }
        }
    }
    Ok(())
}

/// Expert `e` of `mlp` alone, packed as in [`pack_experts`]: `layout.span_bytes()` bytes,
/// read from the checkpoint (what a streamed expert outside the host tier costs).
pub fn pack_expert(w: &Weights, mlp: &str, layout: &ExpertLayout, e: usize) -> Result<Vec<u8>> {
    let src = checked_source(w, mlp, layout)?;
    let mut out = vec![0u8; layout.span_bytes()];
    pack_into(w, mlp, layout, src, e, &mut out)?;
    Ok(out)
}

/// The experts of the MoE block at `mlp` (`model.layers.3.mlp`), packed as `layout` lays them
/// out: `layout.total_bytes()` bytes, expert `e`'s span at `e * layout.span_bytes()`.
pub fn pack_experts(w: &Weights, mlp: &str, layout: &ExpertLayout) -> Result<Vec<u8>> {
    let mut out = vec![0u8; layout.total_bytes()];
    pack_experts_into(w, mlp, layout, &mut out)?;
    Ok(out)
}

/// [`pack_experts`] into `out` (`layout.total_bytes()` bytes, zeroed).
pub fn pack_experts_into(w: &Weights, mlp: &str, layout: &ExpertLayout, out: &mut [u8]) -> Result<()> {
    assert_eq!(out.len(), layout.total_bytes(), "the packed experts' size");
    let src = checked_source(w, mlp, layout)?;
    out.par_chunks_mut(layout.span_bytes())
        .enumerate()
        .try_for_each(|(e, dst)| pack_into(w, mlp, layout, src, e, dst))
}

/// The names of the checkpoint tensors that hold `mlp`'s `experts` experts.
pub fn expert_tensor_names(w: &Weights, mlp: &str, experts: usize) -> Result<Vec<String>> {
    let names = match expert_source(w, mlp)? {
        ExpertSource::MlxSwitch => Which::ALL
            .iter()
            .flat_map(|m| {
                ["weight", "scales", "biases"].map(|s| format!("{mlp}.switch_mlp.{}.{s}", m.name()))
            })
            .collect(),
        ExpertSource::Stacked => vec![
            format!("{mlp}.experts.gate_up_proj"),
            format!("{mlp}.experts.down_proj"),
        ],
        ExpertSource::PerExpert => (0..experts)
            .flat_map(|e| Which::ALL.map(|m| format!("{mlp}.experts.{e}.{}.weight", m.name())))
            .collect(),
    };
    Ok(names)
}

/// Where one piece of every expert's span lies in the checkpoint's files, when the span holds
/// those bytes as stored: `len` bytes at `dst` in the span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPart {
    pub dst: usize,
    pub len: usize,
    pub src: PartSource,
}

/// Which file and offset expert `e`'s piece is at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartSource {
    /// A stacked tensor: expert `e` at `first + e * stride` of `file`.
    Strided { file: usize, first: u64, stride: u64 },
    /// A tensor per expert: (file, offset) of each.
    Each(Vec<(usize, u64)>),
}

impl CopyPart {
    /// (file, offset) of expert `e`'s piece.
    pub fn at(&self, e: usize) -> (usize, u64) {
        match &self.src {
            PartSource::Strided { file, first, stride } => (*file, first + e as u64 * stride),
            PartSource::Each(v) => v[e],
        }
    }
}

/// How the spans of `mlp`'s experts are byte copies of the checkpoint's files, when they are:
/// MLX experts stored in the layout's format, and bf16 experts in a bf16 layout. None when
/// packing converts them, or the weights are held in memory rather than in files.
pub fn expert_copy_parts(w: &Weights, mlp: &str, layout: &ExpertLayout) -> Result<Option<Vec<CopyPart>>> {
    let src = checked_source(w, mlp, layout)?;
    let n = layout.experts;
    let strided = |name: &str, dst: usize, len: usize, skip: usize, stride: usize| -> Option<CopyPart> {
        let f = w.file_span(name)?;
        // The tensor's bytes hold `n` experts of `stride` bytes (checked by the shapes too).
        (f.len == n * stride).then(|| CopyPart {
            dst,
            len,
            src: PartSource::Strided {
                file: f.file,
                first: f.offset + skip as u64,
                stride: stride as u64,
            },
        })
    };
    let mut parts = Vec::new();
    for m in Which::ALL {
        let at = m.span(layout);
        let (rows, cols) = m.dims(layout);
        match (src, m.format(layout)) {
            (ExpertSource::MlxSwitch, ExpertFormat::Quant(want)) => {
                let (format, ..) = mlx_format(w, mlp, layout, m)?;
                if format != want {
                    return Ok(None);
                }
                let base = format!("{mlp}.switch_mlp.{}", m.name());
                for (suffix, dst, len) in [
                    ("weight", at.weight, 4 * rows * format.words_per_row(cols)),
                    ("scales", at.scales, format.scale_part(rows, cols)),
                    ("biases", at.biases, format.bias_part(rows, cols)),
                ] {
                    match strided(&format!("{base}.{suffix}"), dst, len, 0, len) {
                        Some(p) => parts.push(p),
                        None => return Ok(None),
                    }
                }
            }
            (ExpertSource::PerExpert, ExpertFormat::Bf16) => {
                let mut each = Vec::with_capacity(n);
                for e in 0..n {
                    let name = format!("{mlp}.experts.{e}.{}.weight", m.name());
                    let t = w.get(&name)?;
                    expect_shape(&t, &[rows, cols])?;
                    match w.file_span(&name) {
                        Some(f) if t.dtype == DType::BF16 => each.push((f.file, f.offset)),
                        _ => return Ok(None),
                    }
                }
                parts.push(CopyPart {
                    dst: at.weight,
                    len: 2 * rows * cols,
                    src: PartSource::Each(each),
                });
            }
            (ExpertSource::Stacked, ExpertFormat::Bf16) => {
                let len = 2 * rows * cols;
                let (name, skip, stride) = match m {
                    Which::Down => ("down_proj", 0, len),
                    Which::Gate => ("gate_up_proj", 0, 2 * len),
                    Which::Up => ("gate_up_proj", len, 2 * len),
                };
                let name = format!("{mlp}.experts.{name}");
                let t = w.get(&name)?;
                let rows_stored = if m == Which::Down { rows } else { 2 * rows };
                expect_shape(&t, &[n, rows_stored, cols])?;
                if t.dtype != DType::BF16 {
                    return Ok(None);
                }
                match strided(&name, at.weight, len, skip, stride) {
                    Some(p) => parts.push(p),
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        }
    }
    Ok(Some(parts))
}
