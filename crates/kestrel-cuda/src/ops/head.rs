//! Argmax and top-k over logits: `kernels/head.cu`.

use kestrel_core::ir::Op;

use super::u32_arg;
use crate::backend::Encoder;
use crate::error::Result;

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::Argmax {
            logits,
            out,
            rows,
            cols,
        } => {
            let kern = enc.device.kernel("head", "argmax_f32")?;
            let (l, o) = (enc.buf(logits)?.clone(), enc.buf(out)?.clone());
            enc.dispatch(&kern)
                .grid(u32_arg(rows)?)
                .block(256)
                .read(&l)
                .write(&o)
                .arg(u32_arg(cols)?)
                .record();
        }
        Op::TopK {
            logits,
            ids,
            values,
            rows,
            cols,
            k,
        } => {
            let kern = enc.device.kernel("head", "top_k_f32")?;
            let (l, i, v) = (
                enc.buf(logits)?.clone(),
                enc.buf(ids)?.clone(),
                enc.buf(values)?.clone(),
            );
            enc.dispatch(&kern)
                .grid(u32_arg(rows)?)
                .block(256)
                .read(&l)
                .write(&i)
                .write(&v)
                .arg(u32_arg(cols)?)
                .arg(u32_arg(k)?)
                .record();
        }
        _ => unreachable!("dispatched by ops::encode"),
    }
    Ok(())
}
