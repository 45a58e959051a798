//! RMS norms: standard `w * x / rms(x)`, zero-centred `(1 + w) * x / rms(x)`, the fused
//! residual-add form, and the gated form `w * x / rms(x) * silu(z)`.

use half::bf16;
use kestrel_core::ir::{Buf, NormKind, Op};
use kestrel_core::DType;
use rayon::prelude::*;

use super::{silu, OpResult};
use crate::views::{Floats, Views};

/// `out = x / sqrt(mean(x²) + eps) * scale(w)` for one row.
pub(super) fn norm_row(x: &[f32], w: Floats, out: &mut [f32], eps: f32, kind: NormKind) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    for (i, o) in out.iter_mut().enumerate() {
        let scale = match kind {
            NormKind::Standard => w.get(i),
            NormKind::ZeroCentered => 1.0 + w.get(i),
        };
        *o = x[i] * inv * scale;
    }
}

/// Runs `f` on f32 storage for `out`: the buffer itself, or for a bf16 buffer a scratch copy
/// whose values are then stored rounded to nearest even.
fn with_f32_rows(v: &mut Views, out: Buf, f: impl FnOnce(&mut [f32])) -> Result<(), String> {
    match v.dtype(out) {
        DType::F32 => f(v.write::<f32>(out)?),
        DType::BF16 => {
            let o = v.write::<bf16>(out)?;
            let mut rows = vec![0.0f32; o.len()];
            f(&mut rows);
            o.par_iter_mut()
                .zip(&rows)
                .for_each(|(o, &r)| *o = bf16::from_f32(r));
        }
        other => return Err(format!("a norm cannot write {other}")),
    }
    Ok(())
}

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match *op {
        // x, out: [rows, dim]
        Op::RmsNorm {
            x,
            w,
            out,
            dim,
            eps,
            kind,
        } => {
            let (x, w) = (v.read::<f32>(x)?, v.floats(w)?);
            with_f32_rows(v, out, |out| {
                out.par_chunks_mut(dim)
                    .zip(x.par_chunks(dim))
                    .for_each(|(o, x)| norm_row(x, w, o, eps, kind))
            })?;
        }
        // residual, x, out: [rows, dim]; residual += x first.
        Op::AddRmsNorm {
            residual,
            x,
            w,
            out,
            dim,
            eps,
            kind,
        } => {
            let (x, w) = (v.read::<f32>(x)?, v.floats(w)?);
            let res = v.write::<f32>(residual)?;
            with_f32_rows(v, out, |out| {
                res.par_chunks_mut(dim)
                    .zip(x.par_chunks(dim))
                    .zip(out.par_chunks_mut(dim))
                    .for_each(|((r, x), o)| {
                        for (r, x) in r.iter_mut().zip(x) {
                            *r += x;
                        }
                        norm_row(r, w, o, eps, kind);
                    })
            })?;
        }
        // x, z, out: [rows, dim]
        Op::GatedRmsNorm {
            x,
            z,
            w,
            out,
            dim,
            eps,
        } => {
            let (x, z, w, out) = (
                v.read::<f32>(x)?,
                v.read::<f32>(z)?,
                v.floats(w)?,
                v.write::<f32>(out)?,
            );
            out.par_chunks_mut(dim)
                .zip(x.par_chunks(dim))
                .zip(z.par_chunks(dim))
                .for_each(|((o, x), z)| {
                    norm_row(x, w, o, eps, NormKind::Standard);
                    for (o, z) in o.iter_mut().zip(z) {
                        *o *= silu(*z);
                    }
                });
        }
        _ => return Err(format!("{} is not a norm", op.name())),
    }
    Ok(())
}
