//! KV-cache append and causal GQA attention: `kernels/attention.cu`.

use kestrel_core::ir::Op;

use super::{float_name, u32_arg, unsupported};
use crate::backend::Encoder;
use crate::error::Result;

/// `attention.cu` holds up to 8 dims per lane of a warp.
const MAX_HEAD_DIM: usize = 256;

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::KvAppend {
            k,
            v,
            positions,
            k_cache,
            v_cache,
            tokens,
            kv_heads,
            head_dim,
            max_ctx,
        } => {
            let name = float_name(enc.dtype(k_cache))?;
            if enc.dtype(v_cache) != enc.dtype(k_cache) {
                return Err(unsupported("k and v caches of different dtypes".into()));
            }
            let kern = enc.device.kernel("attention", &format!("kv_append_{name}"))?;
            let (k, v, p) = (
                enc.buf(k)?.clone(),
                enc.buf(v)?.clone(),
                enc.buf(positions)?.clone(),
            );
            let (kc, vc) = (enc.buf(k_cache)?.clone(), enc.buf(v_cache)?.clone());
            enc.list
                .dispatch(&kern)
                .cover(tokens * kv_heads * head_dim, 256)
                .read(&k)
                .read(&v)
                .read(&p)
                .read_write(&kc)
                .read_write(&vc)
                .arg(u32_arg(tokens)?)
                .arg(u32_arg(kv_heads)?)
                .arg(u32_arg(head_dim)?)
                .arg(u32_arg(max_ctx)?)
                .record();
        }
        Op::Attention {
            q,
            k_cache,
            v_cache,
            positions,
            out,
            tokens,
            heads,
            kv_heads,
            head_dim,
            max_ctx,
            scale,
        } => {
            if head_dim > MAX_HEAD_DIM {
                return Err(unsupported(format!("head_dim {head_dim} > {MAX_HEAD_DIM}")));
            }
            let kern = enc.device.kernel(
                "attention",
                &format!("attention_{}", float_name(enc.dtype(k_cache))?),
            )?;
            let (q, p, o) = (
                enc.buf(q)?.clone(),
                enc.buf(positions)?.clone(),
                enc.buf(out)?.clone(),
            );
            let (kc, vc) = (enc.buf(k_cache)?.clone(), enc.buf(v_cache)?.clone());
            enc.list
                .dispatch(&kern)
                .grid(u32_arg(tokens * heads)?)
                .block(128)
                .read(&q)
                .read(&kc)
                .read(&vc)
                .read(&p)
                .write(&o)
                .arg(u32_arg(heads)?)
                .arg(u32_arg(kv_heads)?)
                .arg(u32_arg(head_dim)?)
                .arg(u32_arg(max_ctx)?)
                .arg(scale)
                .record();
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}
