//! Argmax and top-k over logits: `kernels/head.cu`.

use kestrel_core::ir::Op;
use kestrel_core::DType;

use super::u32_arg;
use crate::backend::Encoder;
use crate::error::Result;

/// Rows up to this long take one block for their argmax.
const ARGMAX_ONE_BLOCK: usize = 8192;
/// Columns per block of the two-pass argmax (8 per thread of 256).
const ARGMAX_CHUNK: usize = 2048;

pub fn encode(op: &Op, enc: &mut Encoder) -> Result<()> {
    match *op {
        Op::Argmax {
            logits,
            out,
            rows,
            cols,
        } => {
            let (l, o) = (enc.buf(logits)?.clone(), enc.buf(out)?.clone());
            if cols <= ARGMAX_ONE_BLOCK {
                let kern = enc.device.kernel("head", "argmax_f32")?;
                enc.dispatch(&kern)
                    .grid(u32_arg(rows)?)
                    .block(256)
                    .read(&l)
                    .write(&o)
                    .arg(u32_arg(cols)?)
                    .record();
                return Ok(());
            }
            // A vocabulary's row: spread over the GPU, then the parts' best.
            let parts = cols.div_ceil(ARGMAX_CHUNK);
            let part_v = enc.workspace(DType::F32, [rows, parts])?;
            let part_i = enc.workspace(DType::U32, [rows, parts])?;
            let partial = enc.device.kernel("head", "argmax_partial_f32")?;
            enc.dispatch(&partial)
                .grid((u32_arg(parts)?, u32_arg(rows)?))
                .block(256)
                .read(&l)
                .write(&part_v)
                .write(&part_i)
                .arg(u32_arg(cols)?)
                .arg(u32_arg(ARGMAX_CHUNK)?)
                .record();
            let last = enc.device.kernel("head", "argmax_final_f32")?;
            enc.dispatch(&last)
                .grid(u32_arg(rows)?)
                .block(128)
                .read(&part_v)
                .read(&part_i)
                .write(&o)
                .arg(u32_arg(parts)?)
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
