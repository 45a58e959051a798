//! Element-wise ops: column splits of fused projections and concatenations, SwiGLU, the sigmoid output gate,
//! addition and row copies.

use kestrel_core::ir::Op;

use super::{sigmoid, silu, OpResult};
use crate::views::Views;

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match op {
        // x: [rows * groups, Σ widths] -> part k: [rows * groups, widths[k]]
        Op::Split {
            x,
            parts,
            rows,
            groups,
        } => {
            let x = v.read::<f32>(*x)?;
            let total: usize = parts.iter().map(|p| p.1).sum();
            let mut start = 0;
            for &(part, width) in parts {
                let out = v.write::<f32>(part)?;
                for r in 0..rows * groups {
                    out[r * width..(r + 1) * width]
                        .copy_from_slice(&x[r * total + start..r * total + start + width]);
                }
                start += width;
            }
        }
        // part k: [rows, widths[k]] -> out: [rows, Σ widths]
        Op::Concat { parts, out, rows } => {
            let total: usize = parts.iter().map(|p| p.1).sum();
            let mut srcs = Vec::new();
            for &(part, width) in parts {
                srcs.push((v.read::<f32>(part)?, width));
            }
            let out = v.write::<f32>(*out)?;
            let mut start = 0;
            for (src, width) in srcs {
                for r in 0..*rows {
                    out[r * total + start..r * total + start + width]
                        .copy_from_slice(&src[r * width..(r + 1) * width]);
                }
                start += width;
            }
        }
        Op::SwiGlu { gate, up, out, .. } => {
            let (g, u, o) = (v.read::<f32>(*gate)?, v.read::<f32>(*up)?, v.write::<f32>(*out)?);
            for ((o, g), u) in o.iter_mut().zip(g).zip(u) {
                *o = silu(*g) * u;
            }
        }
        // x, out: [rows, cols]; gate: [rows, cols] or [rows, 1]
        Op::SigmoidGate {
            x,
            gate,
            out,
            cols,
            gate_cols,
            ..
        } => {
            let (x, g, o) = (v.read::<f32>(*x)?, v.read::<f32>(*gate)?, v.write::<f32>(*out)?);
            for (i, o) in o.iter_mut().enumerate() {
                let (r, c) = (i / cols, i % cols);
                let gv = if *gate_cols == 1 { g[r] } else { g[r * cols + c] };
                *o = x[i] * sigmoid(gv);
            }
        }
        Op::Add { a, b, out, .. } => {
            let (a, b, o) = (v.read::<f32>(*a)?, v.read::<f32>(*b)?, v.write::<f32>(*out)?);
            for ((o, a), b) in o.iter_mut().zip(a).zip(b) {
                *o = a + b;
            }
        }
        Op::CopyRows {
            x,
            out,
            start,
            rows,
            cols,
        } => {
            let (x, o) = (v.read::<f32>(*x)?, v.write::<f32>(*out)?);
            o.copy_from_slice(&x[start * cols..(start + rows) * cols]);
        }
        _ => return Err(format!("{} is not element-wise", op.name())),
    }
    Ok(())
}
