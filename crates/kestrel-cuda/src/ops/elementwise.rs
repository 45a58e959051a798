//! Splits, concatenations, SwiGLU, gates, additions, row copies and rounding to bf16:
//! `kernels/elementwise.cu`.

use kestrel_core::ir::Op;
use kestrel_core::DType;

use super::common::{op_module, u32_arg};
use kestrel_cuda_rt::{Buffer, ModuleSource, Result};

use crate::encoder::Encoder;

pub(crate) const MODULE: ModuleSource =
    op_module("elementwise", include_str!("../../kernels/elementwise.cu"), &[]);

const THREADS: u32 = 256;

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match op {
        Op::Split {
            x,
            parts,
            rows,
            groups,
        } => {
            let k = enc.kernel(&MODULE, "split_f32")?;
            let total: usize = parts.iter().map(|p| p.1).sum();
            let x = enc.buf(*x)?.clone();
            let mut offset = 0;
            for &(part, width) in parts {
                let out = enc.buf(part)?.clone();
                let n = rows * groups * width;
                enc.dispatch(&k)
                    .cover(n, THREADS)
                    .read(&x)
                    .write(&out)
                    .arg(u32_arg(rows * groups)?)
                    .arg(u32_arg(total)?)
                    .arg(u32_arg(offset)?)
                    .arg(u32_arg(width)?)
                    .record();
                offset += width;
            }
        }
        Op::Concat { parts, out, rows } => {
            let k = enc.kernel(&MODULE, "place_f32")?;
            let total: usize = parts.iter().map(|p| p.1).sum();
            let o = enc.buf(*out)?.clone();
            let mut offset = 0;
            for &(part, width) in parts {
                let src = enc.buf(part)?.clone();
                enc.dispatch(&k)
                    .cover(rows * width, THREADS)
                    .read(&src)
                    .write(&o)
                    .arg(u32_arg(*rows)?)
                    .arg(u32_arg(total)?)
                    .arg(u32_arg(offset)?)
                    .arg(u32_arg(width)?)
                    .record();
                offset += width;
            }
        }
        Op::SwiGlu { gate, up, out, len } => {
            let k = enc.kernel(&MODULE, "swiglu_f32")?;
            let (g, u, o) = (
                enc.buf(*gate)?.clone(),
                enc.buf(*up)?.clone(),
                enc.buf(*out)?.clone(),
            );
            enc.dispatch(&k)
                .cover(*len, THREADS)
                .read(&g)
                .read(&u)
                .write(&o)
                .arg(u32_arg(*len)?)
                .record();
        }
        Op::SigmoidGate {
            x,
            gate,
            out,
            rows,
            cols,
            gate_cols,
        } => {
            let k = enc.kernel(&MODULE, "sigmoid_gate_f32")?;
            let (x, g, o) = (
                enc.buf(*x)?.clone(),
                enc.buf(*gate)?.clone(),
                enc.buf(*out)?.clone(),
            );
            enc.dispatch(&k)
                .cover(rows * cols, THREADS)
                .read(&x)
                .read(&g)
                .write(&o)
                .arg(u32_arg(*rows)?)
                .arg(u32_arg(*cols)?)
                .arg(u32_arg(*gate_cols)?)
                .record();
        }
        Op::Add { a, b, out, len } => {
            let k = enc.kernel(&MODULE, "add_f32")?;
            let (a, b, o) = (enc.buf(*a)?.clone(), enc.buf(*b)?.clone(), enc.buf(*out)?.clone());
            enc.dispatch(&k)
                .cover(*len, THREADS)
                .read(&a)
                .read(&b)
                .write(&o)
                .arg(u32_arg(*len)?)
                .record();
        }
        Op::CopyRows {
            x,
            out,
            start,
            rows,
            cols,
        } => {
            let k = enc.kernel(&MODULE, "copy_f32")?;
            let src = enc.buf(*x)?.slice(start * cols, rows * cols)?;
            let o = enc.buf(*out)?.clone();
            enc.dispatch(&k)
                .cover(rows * cols, THREADS)
                .read(&src)
                .write(&o)
                .arg(u32_arg(rows * cols)?)
                .record();
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}

/// `x` (f32 `[rows, cols]`, `rows * cols` a multiple of 8) rounded to bf16 into a workspace, as
/// the tensor-core products read their activations (`convert_f32_bf16`).
pub(crate) fn round_bf16(enc: &mut Encoder, x: &Buffer, rows: usize, cols: usize) -> Result<Buffer> {
    let xb = enc.workspace(DType::BF16, [rows, cols])?;
    let convert = enc.kernel(&MODULE, "convert_f32_bf16")?;
    enc.dispatch(&convert)
        .cover(rows * cols / 8, 256)
        .read(x)
        .write(&xb)
        .arg(u32_arg(rows * cols)?)
        .record();
    Ok(xb)
}
