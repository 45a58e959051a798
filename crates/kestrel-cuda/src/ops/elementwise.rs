//! Splits, concatenations, SwiGLU, gates, additions and row copies: `kernels/elementwise.cu` (and `add_f32`
//! from `kernels/runtime.cu`).

use kestrel_core::ir::Op;

use super::u32_arg;
use crate::backend::Encoder;
use crate::error::Result;

const THREADS: u32 = 256;

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match op {
        Op::Split {
            x,
            parts,
            rows,
            groups,
        } => {
            let k = enc.device.kernel("elementwise", "split_f32")?;
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
            let k = enc.device.kernel("elementwise", "place_f32")?;
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
            let k = enc.device.kernel("elementwise", "swiglu_f32")?;
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
            let k = enc.device.kernel("elementwise", "sigmoid_gate_f32")?;
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
            let k = enc.device.kernel("elementwise", "add_f32")?;
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
            let k = enc.device.kernel("elementwise", "copy_f32")?;
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
