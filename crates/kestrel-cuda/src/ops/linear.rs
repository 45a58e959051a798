//! Linear layers and embeddings, dense and quantised: `kernels/linear.cu`; quantised products of
//! many tokens through `kernels/gemm.cu`.
//!
//! A product takes the first path that fits:
//! - from `Config::dequant_projections_from` tokens, 4- or 8-bit weights of at most
//!   `DEQUANT_MAX_BYTES` as bf16, outside router logits and unless rounded activations are
//!   switched off: the weights dequantised by `gemm.cu`'s `dequant_*` (each weight rounded as
//!   the GEMM tiles round it) into the backend's bf16 copy of the weight, once, outside the
//!   program (`Config::projection_copies`; else into scratch memory at every run), then cuBLAS on
//!   x rounded to bf16;
//! - 2 to `skinny::LINEAR_MAX_TOKENS` (128) tokens of 4- or 8-bit weights, outside router logits
//!   and unless rounded activations are switched off: `skinny.cu`'s `linear_skinny_*` on x
//!   rounded to bf16 (on Hopper from `skinny::WIDE_LINEAR_MIN_TOKENS` (33) tokens,
//!   `linear_wide_*`);
//! - from `GEMM_MIN_TOKENS` (16) tokens, outside router logits (`Encoder::precise`) and unless
//!   rounded activations are switched off (`Exact::projections`): bf16 weights
//!   through cuBLAS on x rounded to bf16, quantised weights in whole tiles (64 columns, K in steps
//!   of 64) through `gemm.cu`'s `linear_gemm_*`;
//! - one token: the matvecs (`matvec_bf16`, `matvec_q*_dp4a`; with the norm in front,
//!   `matvec_norm_q*_dp4a`, through `encode_norm_matvec`);
//! - router logits, and outputs narrower than 16, from quantised weights: `matvec_q*_exact`
//!   (one token, or up to 256 of narrow outputs, a grid row each) or `matvec_q*_exact_tokens_*`
//!   (2, 4 or 8 tokens a block), on x in f32;
//! - every other shape: `linear_*`.

use kestrel_core::ir::{Buf, BufKind, LinearWeight, NormKind, Op};
use kestrel_core::quant::{QuantFormat, ScaleType};
use kestrel_core::DType;

use kestrel_cuda_rt::{Buffer, CommandList, DispatchBuilder, ModuleSource, Result};

use super::common::{
    float_name, k_splits, op_module, padded_len, quant_name, quant_parts_aligned, split_args, split_scratch,
    u32_arg,
};
use super::elementwise::{self, round_bf16};
use super::gemm::{self, mma_smem, DQ_PIECES, GT_COLS, GT_K, GT_ROWS, GT_THREADS, WG_SMEM};
use super::skinny;
use crate::encoder::Encoder;

pub(crate) const MODULE: ModuleSource = op_module(
    "linear",
    include_str!("../../kernels/linear.cu"),
    &[
        ("TOKENS", TOKENS as i64),
        ("VEC_WARPS", VEC_WARPS as i64),
        ("VEC_ROWS", VEC_ROWS as i64),
        ("VEC_BLOCKS_PER_SM", VEC_BLOCKS_PER_SM as i64),
        ("EX_WARPS", EX_WARPS as i64),
        ("DP_WARPS", DP_WARPS as i64),
        ("DP_ROWS", DP_ROWS as i64),
        ("DP_STAGES", DP_STAGES as i64),
        ("DP_BLOCKS_PER_SM", DP_BLOCKS_PER_SM as i64),
        ("DPN_CHUNKS", DPN_CHUNKS as i64),
    ],
);

/// `linear_*`: output rows per block (one warp each; the kernel reads the block size) and
/// tokens per block (`TOKENS` in linear.cu).
const ROWS: usize = 8;
const TOKENS: usize = 8;

/// A weight's kernel-name suffix (`bf16`, `q4`, ...), its buffers in kernel argument order
/// (dense: the matrix; quantised: words, scales, biases) and its group size (quantised only).
pub(super) fn weight_parts(
    enc: &Encoder,
    w: &LinearWeight,
) -> Result<(&'static str, Vec<Buffer>, Option<usize>)> {
    let parts = w
        .bufs()
        .into_iter()
        .map(|b| enc.buf(b).cloned())
        .collect::<Result<Vec<_>>>()?;
    Ok(match w {
        LinearWeight::Dense(d) => (float_name(enc.dtype(d.raw()))?, parts, None),
        LinearWeight::Quant { format, .. } => (quant_name(format)?, parts, Some(format.group_size)),
    })
}

/// The one-token `matvec_bf16` / `matvec_*_exact` kernels: warps per block, rows of a warp's
/// tile, persistent blocks per multiprocessor.
const VEC_WARPS: usize = 4;
const VEC_ROWS: usize = 4;
const VEC_BLOCKS_PER_SM: usize = 8;
/// `matvec_*_dp4a`: warps per block, rows of a warp's item, ring slots per warp, persistent
/// blocks per multiprocessor.
const DP_WARPS: usize = 4;
const DP_ROWS: usize = 4;
const DP_STAGES: usize = 4;
const DP_BLOCKS_PER_SM: usize = 3;

/// Bytes of a `matvec_*_dp4a` block's rings (`DP_WARPS` x `DP_STAGES` slots, a slot holding
/// 2 x `DP_ROWS` rows x 32 lanes of 16-byte vectors and the rows' scales and biases for 64
/// vectors: `dp_slot_vecs` in linear.cu), or None when the group scales cannot be copied in
/// 16-byte pieces.
fn dp_ring_bytes(in_dim: usize, format: &QuantFormat) -> Option<usize> {
    let (bits, group, size) = (format.bits, format.group_size, format.scale.size_in_bytes());
    if bits != 4 && bits != 8 {
        return None;
    }
    let (vals, per) = (128 / bits as usize, 16 / size);
    let seg = 64 * vals / group;
    let aligned = group > 0 && in_dim % group == 0 && (in_dim / group) % per == 0 && seg % per == 0;
    aligned.then(|| DP_WARPS * DP_STAGES * (2 * DP_ROWS * 32 + DP_ROWS * seg * size / 8) * 16)
}

/// Shared memory of a `matvec_*_dp4a` (or `matvec_norm_*_dp4a`) block for rows of `in_dim`
/// values of `format`: the weight rings, then x as int8 with a scale and a sum per block of 32.
/// None when those kernels cannot take the weight (4- or 8-bit values whose 16-byte vectors each
/// take one group's scale and bias, rows a multiple of 64) or the block would not fit the
/// device's shared memory.
fn dp4a_smem(enc: &Encoder, in_dim: usize, format: &QuantFormat) -> Option<usize> {
    let ring = dp_ring_bytes(in_dim, format)?;
    if in_dim % 64 != 0 || format.group_size % (128 / format.bits as usize) != 0 {
        return None;
    }
    let smem = ring + in_dim + (in_dim / 32 + in_dim / 16) * 4;
    (smem <= enc.device.info().max_shared_per_block).then_some(smem)
}

/// Persistent blocks of a `matvec_*_dp4a` for `out_dim` rows: a warp item's rows each, at most
/// `DP_BLOCKS_PER_SM` a multiprocessor.
fn dp4a_blocks(enc: &Encoder, out_dim: usize) -> Result<u32> {
    let sms = enc.device.info().sm_count as usize;
    u32_arg(out_dim.div_ceil(DP_WARPS * DP_ROWS).min(DP_BLOCKS_PER_SM * sms))
}

/// The arguments a `matvec_*_dp4a` and a `matvec_norm_*_dp4a` end with: the weight's words,
/// scales and biases, the output and the shape.
fn dp4a_tail<'a>(
    b: DispatchBuilder<'a>,
    parts: &[Buffer],
    out: &Buffer,
    in_dim: usize,
    out_dim: usize,
    group: usize,
) -> Result<DispatchBuilder<'a>> {
    Ok(b.read(&parts[0])
        .read(&parts[1])
        .read(&parts[2])
        .write(out)
        .arg(u32_arg(in_dim)?)
        .arg(u32_arg(out_dim)?)
        .arg(u32_arg(group)?))
}

/// The one-token path: 16-byte loads, x staged in shared memory. Returns false (and records
/// nothing) when the weight's format or alignment needs the general kernel.
fn encode_matvec(
    enc: &mut Encoder,
    x: &Buffer,
    w: &LinearWeight,
    out: Buf,
    in_dim: usize,
    out_dim: usize,
) -> Result<bool> {
    match w {
        // Each block rounds x to int8 in blocks of 32, then 8-bit integer dot products.
        LinearWeight::Quant { format, .. } => {
            let Some(smem) = dp4a_smem(enc, in_dim, format) else {
                return Ok(false);
            };
            let out = enc.buf(out)?.clone();
            let (name, parts, _) = weight_parts(enc, w)?;
            let k = enc.kernel(&MODULE, &format!("matvec_{name}_dp4a"))?;
            let grid = dp4a_blocks(enc, out_dim)?;
            let b = enc
                .dispatch(&k)
                .grid(grid)
                .block(u32_arg(32 * DP_WARPS)?)
                .shared_mem(u32_arg(smem)?)
                .read(x);
            dp4a_tail(b, &parts, &out, in_dim, out_dim, format.group_size)?.record();
        }
        // matvec_bf16 stages x padded as floats, read as float4s.
        LinearWeight::Dense(wb)
            if enc.dtype(wb.raw()) == DType::BF16 && in_dim % 8 == 0 && x.device_ptr() % 16 == 0 =>
        {
            let smem = padded_len(in_dim) * 4;
            if smem > enc.device.info().max_shared_per_block {
                return Ok(false);
            }
            let out = enc.buf(out)?.clone();
            let k = enc.kernel(&MODULE, "matvec_bf16")?;
            let wb = enc.buf(wb.raw())?.clone();
            let sms = enc.device.info().sm_count as usize;
            let rows = VEC_WARPS * VEC_ROWS;
            enc.dispatch(&k)
                .grid(u32_arg(out_dim.div_ceil(rows).min(VEC_BLOCKS_PER_SM * sms))?)
                .block(u32_arg(32 * VEC_WARPS)?)
                .shared_mem(u32_arg(smem)?)
                .read(x)
                .read(&wb)
                .write(&out)
                .arg(u32_arg(in_dim)?)
                .arg(u32_arg(out_dim)?)
                .record();
        }
        LinearWeight::Dense(_) => return Ok(false),
    }
    Ok(true)
}

/// `matvec_norm_*_dp4a`: 8-value chunks of the normed row a thread holds at most (`DPN_CHUNKS`
/// in linear.cu): rows of up to 4,096 values.
const DPN_CHUNKS: usize = 4;

/// One token's `RmsNorm` or `AddRmsNorm` and the quantised `Linear` that reads its output, as one
/// `matvec_norm_*_dp4a` (each block norms the row itself; the last one writes the new residual
/// and the normed row for any other reader), when the device allows it
/// (`Config::fused_norm`), the product would take `matvec_*_dp4a` anyway (not router logits:
/// `precise`), the row fits the kernel's registers and the product is the normed row's only
/// reader. With other readers (a DeltaNet layer's two or four input products, a shared expert
/// beside its gate) they would wait for the whole fused product, where after a plain norm they
/// run beside it: Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B decoded 2-3% slower fused. Returns
/// false, recording nothing, for any other pair.
pub(crate) fn encode_norm_matvec(norm: &Op, linear: &Op, precise: bool, enc: &mut Encoder) -> Result<bool> {
    let (residual, add, nw, normed, dim, eps, kind) = match *norm {
        Op::AddRmsNorm {
            residual,
            x,
            w,
            out,
            dim,
            eps,
            kind,
        } => (Some(residual), x, w, out, dim, eps, kind),
        Op::RmsNorm {
            x,
            w,
            out,
            dim,
            eps,
            kind,
        } => (None, x, w, out, dim, eps, kind),
        _ => return Ok(false),
    };
    let Op::Linear {
        x,
        w: ref weight @ LinearWeight::Quant { ref format, .. },
        out,
        tokens: 1,
        in_dim,
        out_dim,
    } = *linear
    else {
        return Ok(false);
    };
    if !enc.device.fused_norm()
        || precise
        || enc.exact.projections
        || x != normed
        || dim != in_dim
        || enc.graph.decl(add).elem_count() != dim
        || in_dim / 8 > DPN_CHUNKS * 32 * DP_WARPS
        || enc.readers(normed).len() != 1
        || residual
            .into_iter()
            .chain([add, normed])
            .any(|b| enc.dtype(b) != DType::F32)
    {
        return Ok(false);
    }
    let w_bf16 = match enc.dtype(nw) {
        DType::BF16 => 1i32,
        DType::F32 => 0,
        _ => return Ok(false),
    };
    let Some(smem) = dp4a_smem(enc, in_dim, format) else {
        return Ok(false);
    };
    let residual = residual.map(|b| enc.buf(b).cloned()).transpose()?;
    let (add, nw, normed) = (
        enc.buf(add)?.clone(),
        enc.buf(nw)?.clone(),
        enc.buf(normed)?.clone(),
    );
    if residual
        .iter()
        .chain([&add, &normed])
        .any(|b| b.device_ptr() % 16 != 0)
    {
        return Ok(false);
    }
    let out = enc.buf(out)?.clone();
    let counter = enc.counters(1)?;
    let (name, parts, _) = weight_parts(enc, weight)?;
    let k = enc.kernel(&MODULE, &format!("matvec_norm_{name}_dp4a"))?;
    let grid = dp4a_blocks(enc, out_dim)?;
    let b = enc
        .dispatch(&k)
        .grid(grid)
        .block(u32_arg(32 * DP_WARPS)?)
        .shared_mem(u32_arg(smem)?);
    let b = match &residual {
        Some(r) => b.read_write(r),
        None => b.arg(0u64),
    };
    let b = b
        .read(&add)
        .read(&nw)
        .write(&normed)
        .read_write(&counter)
        .arg(eps)
        .arg(i32::from(kind == NormKind::ZeroCentered))
        .arg(w_bf16);
    dp4a_tail(b, &parts, &out, in_dim, out_dim, format.group_size)?.record();
    Ok(true)
}

/// Fewer outputs than this (the skinny products take 16 at a time), of up to `NARROW_MAX_TOKENS`
/// tokens: the exact matvec per token too. A shared expert's gate (one output) of 64 tokens took
/// 23 µs through `linear_q8` on the H200.
const NARROW_OUT: usize = 16;

/// Up to this many tokens, outputs narrower than `NARROW_OUT` run as one exact matvec per token
/// (`matvec_q*_exact`, grid row y a token, the persistent blocks shared out among them): a block
/// staging several tokens' x would have too few rows to spread that work over.
const NARROW_MAX_TOKENS: usize = 256;

/// Tokens a block of `matvec_q*_exact_tokens_*` takes (staging each one's x in shared memory):
/// the most of these that still gives every multiprocessor a block, else the fewest. Router
/// logits of 512 tokens took 78.5 µs a layer through `linear_q8`, 65 µs as 512 rows of
/// `matvec_q8_exact`, 32 at 8 tokens a block; a batched step of 64 sequences took 21.5 µs at 8
/// tokens a block (32 blocks), 12.6 at 2 (128 blocks; the H200).
const EX_TOKENS: [usize; 3] = [8, 4, 2];

/// Tokens a block of `matvec_*_exact_tokens_*` for `tokens` tokens whose rows make `tiles` tiles
/// a grid row.
fn exact_block_tokens(tokens: usize, tiles: usize, sms: usize) -> usize {
    EX_TOKENS
        .into_iter()
        .find(|&t| tokens.div_ceil(t) * tiles >= sms)
        .unwrap_or(EX_TOKENS[EX_TOKENS.len() - 1])
}
/// Warps of a `matvec_q*_exact_tokens` block. On Qwen3-30B-A3B's router, 16 left a 256-token
/// step 64 blocks and took 34 µs a layer (an H100); 8 take 22 (an H200; 4 warps took 23 on the
/// H100).
const EX_WARPS: usize = 8;

/// The product of a quantised, f32 or bf16 weight and f32 activations with nothing rounded
/// beyond f32 arithmetic, for the logits a router decides from (a token's logits the same, bit
/// for bit, whatever the number of tokens, and those of the router's fused one-token kernel),
/// for outputs too narrow for the skinny products and for f32 weights: one token (or a few
/// narrow ones) through `matvec_*_exact`, more through `matvec_*_exact_tokens`.
/// Returns false (and records nothing) when the format's 16-byte vectors do not tile the groups
/// or x does not fit shared memory.
#[allow(clippy::too_many_arguments)]
fn encode_matvec_exact(
    enc: &mut Encoder,
    x: &Buffer,
    w: &LinearWeight,
    out: Buf,
    tokens: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<bool> {
    // 16-byte vectors of the weight's values (f32: four, bf16: eight); quantised ones take one
    // group's scale.
    let (vals, group) = match w {
        LinearWeight::Quant { format, .. } => (128 / format.bits as usize, format.group_size),
        LinearWeight::Dense(d) => match enc.dtype(d.raw()) {
            DType::F32 => (4, 4),
            DType::BF16 => (8, 8),
            _ => return Ok(false),
        },
    };
    let per_token = tokens == 1 || (out_dim < NARROW_OUT && tokens <= NARROW_MAX_TOKENS);
    let sms = enc.device.info().sm_count as usize;
    let block_tokens = exact_block_tokens(tokens, out_dim.div_ceil(EX_WARPS * VEC_ROWS), sms);
    // x staged (padded, pre-scaled), then each 16-byte vector's plain sum; x is read as float4s.
    let smem = if per_token {
        (padded_len(in_dim) + in_dim / vals) * 4
    } else {
        block_tokens * (padded_len(in_dim) + in_dim / vals).next_multiple_of(4) * 4
    };
    // in_dim a multiple of 16-byte vectors keeps every token's row of x 16-byte aligned too.
    if group % vals != 0
        || in_dim % vals != 0
        || x.device_ptr() % 16 != 0
        || smem > enc.device.info().max_shared_per_block
    {
        return Ok(false);
    }
    let (name, parts, group) = weight_parts(enc, w)?;
    let out = enc.buf(out)?.clone();
    // Blocks per grid row: the persistent blocks shared out among the rows (tokens, or groups
    // of block_tokens), each walking tiles of VEC_ROWS rows a warp.
    let persistent = VEC_BLOCKS_PER_SM * sms;
    let (kernel, rows, warps) = match per_token {
        true => (format!("matvec_{name}_exact"), tokens, VEC_WARPS),
        false => (
            format!("matvec_{name}_exact_tokens_{block_tokens}"),
            tokens.div_ceil(block_tokens),
            EX_WARPS,
        ),
    };
    let tiles = out_dim.div_ceil(warps * VEC_ROWS);
    let grid = (u32_arg(tiles.min(persistent.div_ceil(rows)))?, u32_arg(rows)?);
    let k = enc.kernel(&MODULE, &kernel)?;
    let mut b = enc
        .dispatch(&k)
        .grid(grid)
        .block(u32_arg(32 * warps)?)
        .shared_mem(u32_arg(smem)?)
        .read(x);
    for part in &parts {
        b = b.read(part);
    }
    b = b.write(&out);
    if !per_token {
        b = b.arg(u32_arg(tokens)?);
    }
    b = b.arg(u32_arg(in_dim)?).arg(u32_arg(out_dim)?);
    if let Some(group) = group {
        b = b.arg(u32_arg(group)?);
    }
    b.record();
    Ok(true)
}

/// The most ranges a quantised tensor-core product splits K into, and the fewest steps of
/// `GT_K` each range takes.
const MAX_K_SPLITS: usize = 8;
const MIN_SPLIT_STEPS: usize = 4;

/// From this many tokens, bf16 projections run as cuBLAS products on bf16 activations, quantised
/// ones as tensor-core tiles (`gemm.cu`).
pub(crate) const GEMM_MIN_TOKENS: usize = 16;
/// The largest weight (as bf16 bytes) dequantised into scratch memory for a product of many
/// tokens (`Config::dequant_projections_from`): attention and linear-attention projections and
/// shared experts, not an LM head, whose scratch would take hundreds of MiB.
const DEQUANT_MAX_BYTES: usize = 64 << 20;

/// Whether node `node` is a product that runs dequantised (`encode_dequantised`) or on the skinny
/// products (`encode_skinny`), which round its activations to bf16 first: a norm in front of such
/// products only may store its output rounded (`Encoder::mark_rounded`) and save them the
/// conversion.
pub(crate) fn rounds_its_input(enc: &Encoder, node: usize) -> Result<bool> {
    let Op::Linear {
        w: ref w @ LinearWeight::Quant { ref format, .. },
        tokens,
        in_dim,
        out_dim,
        ..
    } = enc.graph.nodes[node].op
    else {
        return Ok(false);
    };
    if enc.decision(node) || enc.exact.projections {
        return Ok(false);
    }
    if dequant_fits(enc, w, tokens, (in_dim, out_dim))? {
        return Ok(true);
    }
    let (_, parts, _) = weight_parts(enc, w)?;
    Ok(skinny::linear_fits(*format, tokens, (in_dim, out_dim), &parts))
}

/// Whether the op writing `out` may store it rounded to bf16 instead of in f32: when `out` is an
/// f32 transient (nothing outside the program reads it) and every node that reads it is a
/// product that rounds its input to bf16 anyway (`rounds_its_input`: the dequantised and the
/// skinny products of a batched step), which then reads the rounded values and runs no conversion
/// of its own. A norm (`ops/norm.rs`) and decode attention (`ops/attention.rs`) ask.
pub(crate) fn read_rounded_only(enc: &Encoder, out: Buf) -> Result<bool> {
    if enc.dtype(out) != DType::F32 || enc.graph.decl(out).kind != BufKind::Transient {
        return Ok(false);
    }
    let readers = enc.readers(out);
    for &i in readers {
        match enc.graph.nodes[i].op {
            Op::Linear { x, .. } if x == out && rounds_its_input(enc, i)? => {}
            _ => return Ok(false),
        }
    }
    Ok(!readers.is_empty())
}

/// The activations `x` (`[tokens, in_dim]`) as bf16 for a tensor-core product: the buffer itself
/// when it is bf16, or its rounded half when its norm stored it so (`Encoder::held_dtype`), else
/// rounded into a workspace.
fn bf16_activations(enc: &mut Encoder, x: Buf, tokens: usize, in_dim: usize) -> Result<Buffer> {
    match (enc.dtype(x), enc.held_dtype(x)) {
        (DType::BF16, _) => Ok(enc.buf(x)?.clone()),
        (_, DType::BF16) => enc.rounded_view(x),
        _ => {
            let xb = enc.buf(x)?.clone();
            round_bf16(enc, &xb, tokens, in_dim)
        }
    }
}

/// The activations `x` as f32, for the products on CUDA cores: the buffer itself, or bf16 values
/// (a bf16 buffer, or an f32 one its norm stored rounded) widened into a workspace (exactly:
/// every bf16 value is an f32).
fn f32_activations(enc: &mut Encoder, x: Buf) -> Result<Buffer> {
    if enc.held_dtype(x) != DType::BF16 {
        return Ok(enc.buf(x)?.clone());
    }
    let xb = match enc.dtype(x) {
        DType::BF16 => enc.buf(x)?.clone(),
        _ => enc.rounded_view(x)?,
    };
    let n = enc.graph.decl(x).elem_count();
    let xf = enc.workspace(DType::F32, n)?;
    let widen = enc.kernel(&elementwise::MODULE, "convert_bf16_f32")?;
    enc.dispatch(&widen)
        .cover(n, 256)
        .read(&xb)
        .write(&xf)
        .arg(u32_arg(n)?)
        .record();
    Ok(xf)
}

/// 2 to `skinny::LINEAR_MAX_TOKENS` tokens of a 4- or 8-bit weight as `skinny.cu`'s products,
/// over x as bf16 (`bf16_activations`). Returns false (and records nothing) for other weights
/// and shapes.
fn encode_skinny(
    enc: &mut Encoder,
    x: Buf,
    w: &LinearWeight,
    out: Buf,
    tokens: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<bool> {
    let LinearWeight::Quant { format, .. } = w else {
        return Ok(false);
    };
    let (_, parts, _) = weight_parts(enc, w)?;
    if !skinny::linear_fits(*format, tokens, (in_dim, out_dim), &parts) {
        return Ok(false);
    }
    let out = enc.buf(out)?.clone();
    let xb = bf16_activations(enc, x, tokens, in_dim)?;
    skinny::encode_linear(enc, &xb, (*format, &parts), &out, (tokens, in_dim, out_dim))?;
    Ok(true)
}

/// Whether a weight of `format` with rows of `in_dim` values and `out_dim` rows may run
/// dequantised: 4- or 8-bit values with bf16 or f32 scales in groups of whole 16s that divide K,
/// of at most `DEQUANT_MAX_BYTES` as bf16 (what the weight alone decides, before its buffers'
/// alignment).
pub(crate) fn dequant_format_fits(format: &QuantFormat, (in_dim, out_dim): (usize, usize)) -> bool {
    let (bits, group) = (format.bits, format.group_size);
    (bits == 4 || bits == 8)
        && format.scale != ScaleType::Factored
        && group % 16 == 0
        && in_dim % group == 0
        && out_dim * in_dim * 2 <= DEQUANT_MAX_BYTES
}

/// Whether a product of `tokens` tokens of weight `w` runs dequantised (`encode_dequantised`):
/// from `Config::dequant_projections_from` tokens, weights `dequant_format_fits` takes, aligned
/// for the kernel's loads.
fn dequant_fits(enc: &Encoder, w: &LinearWeight, tokens: usize, dims: (usize, usize)) -> Result<bool> {
    let LinearWeight::Quant { format, .. } = w else {
        return Ok(false);
    };
    let from = enc.device.dequant_projections_from();
    if from == 0 || tokens < from.max(2) || !dequant_format_fits(format, dims) {
        return Ok(false);
    }
    let (_, parts, _) = weight_parts(enc, w)?;
    Ok(quant_parts_aligned(format, &parts))
}

/// A quantised product of many tokens as cuBLAS's bf16 product over the weights dequantised
/// (`dequant_*` in `gemm.cu`, each weight rounded as the GEMM tiles round it), on x as bf16
/// (`bf16_activations`). The tiles and the skinny products dequantise every weight once for each
/// tile of tokens, so once is cheaper from a few dozen tokens on. Where the backend keeps weight
/// copies (`Encoder::weight_copy`) the weight is dequantised into its copy once, outside the
/// program, and the program records only the product; else into scratch memory at every run.
/// Returns false (and records nothing) where `dequant_fits` says no.
fn encode_dequantised(
    enc: &mut Encoder,
    x: Buf,
    w: &LinearWeight,
    out: Buf,
    tokens: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<bool> {
    if !dequant_fits(enc, w, tokens, (in_dim, out_dim))? {
        return Ok(false);
    }
    let (name, parts, group) = weight_parts(enc, w)?;
    let group = group.expect("a quantised weight has a group size");
    let out = enc.buf(out)?.clone();
    let xb = bf16_activations(enc, x, tokens, in_dim)?;
    let k = enc.kernel(&gemm::MODULE, &format!("dequant_{name}"))?;
    let dequantise = |list: &mut CommandList, wb: &Buffer| -> Result<()> {
        list.dispatch(&k)
            .programmatic()
            .cover((out_dim * in_dim / 8).div_ceil(DQ_PIECES), 256)
            .read(&parts[0])
            .read(&parts[1])
            .read(&parts[2])
            .write(wb)
            .arg(u32_arg(out_dim)?)
            .arg(u32_arg(in_dim)?)
            .arg(u32_arg(group)?)
            .record();
        Ok(())
    };
    let wb = match enc.weight_copy(&w.bufs(), [out_dim, in_dim], dequantise)? {
        Some(copy) => copy,
        None => {
            let wb = enc.workspace(DType::BF16, [out_dim, in_dim])?;
            dequantise(enc.list, &wb)?;
            wb
        }
    };
    enc.list.gemm_bf16(&xb, &wb, &out, tokens, out_dim, in_dim);
    Ok(true)
}

/// Many tokens on tensor cores, over x as bf16 (`bf16_activations`): bf16 weights through
/// cuBLAS; 4-/8-bit weights as tiles over the weights dequantised in shared memory
/// (`linear_gemm_*` in `gemm.cu`). Returns false (and records nothing) for other weights and
/// for shapes that are not whole tiles.
fn encode_tensor_core(
    enc: &mut Encoder,
    x: Buf,
    w: &LinearWeight,
    out: Buf,
    tokens: usize,
    in_dim: usize,
    out_dim: usize,
) -> Result<bool> {
    let format = match w {
        LinearWeight::Dense(wb) => {
            if enc.dtype(wb.raw()) != DType::BF16 || in_dim % 8 != 0 {
                return Ok(false);
            }
            let (wb, out) = (enc.buf(wb.raw())?.clone(), enc.buf(out)?.clone());
            let xb = bf16_activations(enc, x, tokens, in_dim)?;
            enc.list.gemm_bf16(&xb, &wb, &out, tokens, out_dim, in_dim);
            return Ok(true);
        }
        LinearWeight::Quant { format, .. } => format,
    };
    let (bits, group) = (format.bits, format.group_size);
    let format = *format;
    let fits = (bits == 4 || bits == 8)
        && in_dim % GT_K == 0
        && out_dim % GT_COLS == 0
        && group % 16 == 0
        && in_dim % group == 0;
    if !fits {
        return Ok(false);
    }
    let (name, parts, _) = weight_parts(enc, w)?;
    if !quant_parts_aligned(&format, &parts) {
        return Ok(false);
    }
    let out = enc.buf(out)?.clone();
    let xb = bf16_activations(enc, x, tokens, in_dim)?;
    // 128 output columns a block where they divide, so each A tile feeds twice the work; on
    // Hopper those run on wgmma.
    let nb = if out_dim % (2 * GT_COLS) == 0 { 2 } else { 1 };
    let (kernel, smem) = match (enc.device.wgmma(), nb) {
        (true, 2) => (format!("linear_gemm_{name}_wg"), WG_SMEM),
        _ => (format!("linear_gemm_{name}_{nb}"), mma_smem(nb)),
    };
    let k = enc.kernel(&gemm::MODULE, &kernel)?;
    // K split in equal ranges of whole steps while the blocks are at most half the
    // multiprocessors: a tile's K loop is latency-bound, and the GPU would half idle (the o_proj
    // of 256 tokens is 32 tiles). Counting the two blocks a multiprocessor holds split more and
    // lost at 512 tokens (46 µs a product became 67 on the H200).
    let (row_tiles, col_tiles) = (tokens.div_ceil(GT_ROWS), out_dim / (nb * GT_COLS));
    let tiles = row_tiles * col_tiles;
    let sms = enc.device.info().sm_count as usize;
    let splits = k_splits(tiles, in_dim / GT_K, sms, MAX_K_SPLITS, MIN_SPLIT_STEPS);
    let scratch = split_scratch(enc, splits, tiles, GT_ROWS * nb * GT_COLS)?;
    let b = enc
        .dispatch(&k)
        .grid((u32_arg(row_tiles)?, u32_arg(col_tiles)?, u32_arg(splits)?))
        .block(GT_THREADS)
        .shared_mem(u32_arg(smem)?)
        .read(&xb)
        .read(&parts[0])
        .read(&parts[1])
        .read(&parts[2])
        .write(&out);
    split_args(b, &scratch)
        .arg(u32_arg(tokens)?)
        .arg(u32_arg(in_dim)?)
        .arg(u32_arg(out_dim)?)
        .arg(u32_arg(group)?)
        .record();
    Ok(true)
}

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match op {
        Op::Linear {
            x,
            w,
            out,
            tokens,
            in_dim,
            out_dim,
        } => {
            // Router logits, or every product when rounded activations are switched off.
            let precise = enc.precise || enc.exact.projections;
            if !precise && encode_dequantised(enc, *x, w, *out, *tokens, *in_dim, *out_dim)? {
                return Ok(());
            }
            if !precise && encode_skinny(enc, *x, w, *out, *tokens, *in_dim, *out_dim)? {
                return Ok(());
            }
            if *tokens >= GEMM_MIN_TOKENS
                && !precise
                && encode_tensor_core(enc, *x, w, *out, *tokens, *in_dim, *out_dim)?
            {
                return Ok(());
            }
            // Every other path reads f32 activations.
            let x = f32_activations(enc, *x)?;
            // The dense matvec keeps x in f32, so it is exact enough for router logits too.
            let exact = matches!(w, LinearWeight::Dense(_));
            if *tokens == 1 && (!precise || exact) && encode_matvec(enc, &x, w, *out, *in_dim, *out_dim)? {
                return Ok(());
            }
            // Router logits (a bf16 checkpoint's dense routers among them), outputs too narrow
            // for the skinny products (a shared expert's one-column gate), and f32 weights (a GGUF
            // file's routers): on f32 activations, each token's sums in one order.
            let narrow = *out_dim < NARROW_OUT;
            let f32_weight = matches!(w, LinearWeight::Dense(d) if enc.dtype(d.raw()) == DType::F32);
            if (precise || narrow || f32_weight)
                && encode_matvec_exact(enc, &x, w, *out, *tokens, *in_dim, *out_dim)?
            {
                return Ok(());
            }
            let grid = (
                u32_arg(out_dim.div_ceil(ROWS))?,
                u32_arg(tokens.div_ceil(TOKENS))?,
            );
            let out = enc.buf(*out)?.clone();
            let (suffix, parts, group) = weight_parts(enc, w)?;
            let k = enc.kernel(&MODULE, &format!("linear_{suffix}"))?;
            let mut b = enc.dispatch(&k).grid(grid).block(32 * ROWS as u32).read(&x);
            for part in &parts {
                b = b.read(part);
            }
            b = b
                .write(&out)
                .arg(u32_arg(*tokens)?)
                .arg(u32_arg(*in_dim)?)
                .arg(u32_arg(*out_dim)?);
            if let Some(group) = group {
                b = b.arg(u32_arg(group)?);
            }
            b.record();
        }
        Op::Embed {
            table,
            ids,
            out,
            hidden,
        } => {
            let tokens = enc.graph.decl(*ids).elem_count();
            // Rows of the table: the first dimension of its weight tensor, dense or packed.
            let vocab = enc.graph.decl(table.bufs()[0]).shape[0];
            let (ids, out) = (enc.buf(*ids)?.clone(), enc.buf(*out)?.clone());
            let (suffix, parts, group) = weight_parts(enc, table)?;
            let k = enc.kernel(&MODULE, &format!("embed_{suffix}"))?;
            let mut b = enc.dispatch(&k).grid(u32_arg(tokens)?).block(256);
            for part in &parts {
                b = b.read(part);
            }
            b = b
                .read(&ids)
                .write(&out)
                .arg(u32_arg(*hidden)?)
                .arg(u32_arg(vocab)?);
            if let Some(group) = group {
                b = b.arg(u32_arg(group)?);
            }
            b.record();
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}
