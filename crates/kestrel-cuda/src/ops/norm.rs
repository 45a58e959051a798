//! Norms and rotary embeddings: `kernels/norm.cu`, `kernels/rope.cu`.

use kestrel_core::ir::{Buf, NormKind, Op};
use kestrel_core::DType;

use super::common::{float_name, op_module, u32_arg, unsupported};
use super::linear;
use kestrel_cuda_rt::{Buffer, ModuleSource, Result};

use crate::encoder::Encoder;

pub(crate) const MODULE: ModuleSource = op_module(
    "norm",
    include_str!("../../kernels/norm.cu"),
    &[("VEC_NORM_MAX", VEC_NORM_MAX as i64)],
);
/// Rotary embeddings (`kernels/rope.cu`), which `Rope` ops launch from here.
pub(crate) const ROPE_MODULE: ModuleSource = op_module("rope", include_str!("../../kernels/rope.cu"), &[]);

const THREADS: u32 = 256;
/// `*_vec_*` kernels: float4s per thread at most (`VEC_NORM_MAX` in norm.cu).
const VEC_NORM_MAX: usize = 8;

/// The kernel for rows of `dim` over these buffers: the one-pass `*_vec_*` form when the rows
/// are whole float4s that fit in a block's registers, else the looping one; `_to_bf16` when the
/// output is bf16.
fn norm_kernel(base: &str, dim: usize, w: &str, out: DType, bufs: &[&Buffer]) -> Result<String> {
    let vec = dim % 4 == 0
        && dim / 4 <= VEC_NORM_MAX * THREADS as usize
        && bufs.iter().all(|b| b.device_ptr() % 16 == 0);
    let to = match out {
        DType::F32 => "",
        DType::BF16 => "_to_bf16",
        other => return Err(unsupported(format!("a norm writing {other}"))),
    };
    Ok(if vec {
        format!("{base}_vec_{w}{to}")
    } else {
        format!("{base}_{w}{to}")
    })
}

/// A norm's output buffer and the element type it is stored in: rounded to bf16 where only
/// products that round it anyway read it (`linear::read_rounded_only`; recorded for them,
/// `Encoder::mark_rounded`), else as declared.
fn output(enc: &mut Encoder, out: Buf) -> Result<(Buffer, DType)> {
    if linear::read_rounded_only(enc, out)? {
        enc.mark_rounded(out);
        Ok((enc.rounded_view(out)?, DType::BF16))
    } else {
        Ok((enc.buf(out)?.clone(), enc.dtype(out)))
    }
}

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::RmsNorm {
            x,
            w,
            out,
            dim,
            eps,
            kind,
        } => {
            let rows = enc.graph.decl(x).elem_count() / dim;
            let wname = float_name(enc.dtype(w))?;
            let (out, odt) = output(enc, out)?;
            let (x, w) = (enc.buf(x)?.clone(), enc.buf(w)?.clone());
            let k = enc.kernel(&MODULE, &norm_kernel("rms_norm", dim, wname, odt, &[&x, &out])?)?;
            enc.dispatch(&k)
                .grid(u32_arg(rows)?)
                .block(THREADS)
                .read(&x)
                .read(&w)
                .write(&out)
                .arg(u32_arg(dim)?)
                .arg(eps)
                .arg((kind == NormKind::ZeroCentered) as i32)
                .record();
        }
        Op::AddRmsNorm {
            residual,
            x,
            w,
            out,
            dim,
            eps,
            kind,
        } => {
            let rows = enc.graph.decl(x).elem_count() / dim;
            let wname = float_name(enc.dtype(w))?;
            let (out, odt) = output(enc, out)?;
            let (r, x, w) = (
                enc.buf(residual)?.clone(),
                enc.buf(x)?.clone(),
                enc.buf(w)?.clone(),
            );
            let k = enc.kernel(
                &MODULE,
                &norm_kernel("add_rms_norm", dim, wname, odt, &[&r, &x, &out])?,
            )?;
            enc.dispatch(&k)
                .grid(u32_arg(rows)?)
                .block(THREADS)
                .read_write(&r)
                .read(&x)
                .read(&w)
                .write(&out)
                .arg(u32_arg(dim)?)
                .arg(eps)
                .arg((kind == NormKind::ZeroCentered) as i32)
                .record();
        }
        Op::GatedRmsNorm {
            x,
            z,
            w,
            out,
            dim,
            eps,
        } => {
            let rows = enc.graph.decl(x).elem_count() / dim;
            let k = enc.kernel(&MODULE, &format!("gated_rms_norm_{}", float_name(enc.dtype(w))?))?;
            let (x, z, w, out) = (
                enc.buf(x)?.clone(),
                enc.buf(z)?.clone(),
                enc.buf(w)?.clone(),
                enc.buf(out)?.clone(),
            );
            enc.dispatch(&k)
                .grid(u32_arg(rows)?)
                .block(THREADS)
                .read(&x)
                .read(&z)
                .read(&w)
                .write(&out)
                .arg(u32_arg(dim)?)
                .arg(eps)
                .record();
        }
        Op::Rope {
            x,
            positions,
            inv_freq,
            heads,
            head_dim,
            rot_dim,
            scaling,
        } => {
            let tokens = enc.graph.decl(x).elem_count() / (heads * head_dim);
            let k = enc.kernel(&ROPE_MODULE, "rope_f32")?;
            let block = ((rot_dim / 2).div_ceil(32) * 32).clamp(32, 256) as u32;
            let (x, p, f) = (
                enc.buf(x)?.clone(),
                enc.buf(positions)?.clone(),
                enc.buf(inv_freq)?.clone(),
            );
            enc.dispatch(&k)
                .grid(u32_arg(tokens * heads)?)
                .block(block)
                .read_write(&x)
                .read(&p)
                .read(&f)
                .arg(u32_arg(heads)?)
                .arg(u32_arg(head_dim)?)
                .arg(u32_arg(rot_dim)?)
                .arg(scaling)
                .record();
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}
