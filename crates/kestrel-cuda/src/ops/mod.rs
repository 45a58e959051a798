//! One module per op family, each encoding its ops into dispatches of its `kernels/<family>.cu`.

mod attention;
mod deltanet;
mod elementwise;
mod head;
mod linear;
mod moe;
mod norm;

pub(crate) use linear::GEMM_MIN_TOKENS;

use kestrel_core::ir::Op;
use kestrel_core::DType;

use crate::backend::Encoder;
use crate::buffer::Buffer;
use crate::error::{CudaError, Result};

/// Floats of shared memory for `n` staged values (`padded_len` in kestrel.cuh).
fn padded_len(n: usize) -> usize {
    n + n.div_ceil(32) * 4
}

/// `x` (f32 `[rows, cols]`, `rows * cols` a multiple of 8) rounded to bf16 into a workspace, as
/// the tensor-core products read their activations (`convert_f32_bf16`).
fn round_bf16(enc: &mut Encoder, x: &Buffer, rows: usize, cols: usize) -> Result<Buffer> {
    let xb = enc.workspace(DType::BF16, [rows, cols])?;
    let convert = enc.device.kernel("elementwise", "convert_f32_bf16")?;
    enc.dispatch(&convert)
        .cover(rows * cols / 8, 256)
        .read(x)
        .write(&xb)
        .arg(u32_arg(rows * cols)?)
        .record();
    Ok(xb)
}

/// Encodes the first nodes of `ops` as one kernel when one kernel does them together: a
/// one-token router's residual add and norm, product and choice of experts (three), or its
/// product and choice (two). Returns how many it encoded; 0, and nothing recorded, otherwise.
pub fn encode_fused(ops: &[&Op], enc: &mut Encoder) -> Result<usize> {
    if let [norm, linear, router, ..] = ops {
        if moe::encode_route(Some(norm), linear, router, enc)? {
            return Ok(3);
        }
    }
    if let [linear, router, ..] = ops {
        if moe::encode_route(None, linear, router, enc)? {
            return Ok(2);
        }
    }
    Ok(0)
}

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    use Op::*;
    match op {
        Embed { .. } | Linear { .. } => linear::encode(op, enc),
        RmsNorm { .. } | AddRmsNorm { .. } | GatedRmsNorm { .. } | Rope { .. } => norm::encode(op, enc),
        Split { .. } | Concat { .. } | SwiGlu { .. } | SigmoidGate { .. } | Add { .. } | CopyRows { .. } => {
            elementwise::encode(op, enc)
        }
        KvAppend { .. } | AttentionInputs { .. } | Attention { .. } => attention::encode(op, enc),
        Router { .. } | MoeExperts { .. } => moe::encode(op, enc),
        CausalConv1d { .. } | DeltaGates { .. } | DeltaRule { .. } => deltanet::encode(op, enc),
        Argmax { .. } | TopK { .. } | Sample { .. } => head::encode(op, enc),
    }
}

/// The kernel-name suffix of a float dtype.
fn float_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(dtype.name()),
        other => Err(unsupported(format!("{other} is not a float dtype"))),
    }
}

fn unsupported(reason: String) -> CudaError {
    CudaError::Op {
        node: String::new(),
        reason,
    }
}

fn u32_arg(n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| unsupported(format!("{n} does not fit a 32-bit kernel argument")))
}
