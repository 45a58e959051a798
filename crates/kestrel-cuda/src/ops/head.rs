//! Argmax, top-k and sampling over logits: `kernels/head.cu`.

use kestrel_core::ir::Op;
use kestrel_core::sample::{DRAWN_WORDS, DRAW_WORDS, NO_COUNTS};
use kestrel_core::DType;

use super::common::{op_module, u32_arg};
use kestrel_cuda_rt::{ModuleSource, Result};

use crate::encoder::Encoder;

/// Rows up to this long take one block for their argmax.
const ARGMAX_ONE_BLOCK: usize = 8192;
/// Columns per block of the two-pass argmax (8 per thread of 256).
const ARGMAX_CHUNK: usize = 2048;
/// Logits per block of `sample_rows_partial_f32` (`SAMPLE_CHUNK` in head.cu).
const SAMPLE_CHUNK: usize = 2048;

pub(crate) const MODULE: ModuleSource = op_module(
    "head",
    include_str!("../../kernels/head.cu"),
    &[
        ("SAMPLE_CHUNK", SAMPLE_CHUNK as i64),
        ("SAMPLE_MAX_K", ROW_CANDIDATES as i64),
        ("DRAW_WORDS", DRAW_WORDS as i64),
        ("DRAWN_WORDS", DRAWN_WORDS as i64),
        ("NO_COUNTS", NO_COUNTS as i64),
    ],
);

/// The most candidates a draw keeps (the largest top-k), and the stride of a part's candidates
/// in `sample_rows_partial_f32`'s output.
const ROW_CANDIDATES: usize = kestrel_core::sample::BACKEND_MAX_TOP_K;

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
                let kern = enc.kernel(&MODULE, "argmax_f32")?;
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
            let partial = enc.kernel(&MODULE, "argmax_partial_f32")?;
            enc.dispatch(&partial)
                .grid((u32_arg(parts)?, u32_arg(rows)?))
                .block(256)
                .read(&l)
                .write(&part_v)
                .write(&part_i)
                .arg(u32_arg(cols)?)
                .arg(u32_arg(ARGMAX_CHUNK)?)
                .record();
            let last = enc.kernel(&MODULE, "argmax_final_f32")?;
            enc.dispatch(&last)
                .grid(u32_arg(rows)?)
                .block(128)
                .read(&part_v)
                .read(&part_i)
                .write(&o)
                .arg(u32_arg(parts)?)
                .record();
        }
        Op::SampleRows {
            logits,
            draws,
            counts,
            out,
            rows,
            cols,
        } => {
            let parts = cols.div_ceil(SAMPLE_CHUNK);
            let (l, d, c, o) = (
                enc.buf(logits)?.clone(),
                enc.buf(draws)?.clone(),
                enc.buf(counts)?.clone(),
                enc.buf(out)?.clone(),
            );
            let seqs = c.elem_count() / cols.max(1);
            let part_v = enc.workspace(DType::F32, [rows, parts, ROW_CANDIDATES])?;
            let part_i = enc.workspace(DType::U32, [rows, parts, ROW_CANDIDATES])?;
            let partial = enc.kernel(&MODULE, "sample_rows_partial_f32")?;
            enc.dispatch(&partial)
                .grid((u32_arg(parts)?, u32_arg(rows)?))
                .block(256)
                .read(&l)
                .read(&d)
                .read(&c)
                .write(&part_v)
                .write(&part_i)
                .arg(u32_arg(cols)?)
                .arg(u32_arg(seqs)?)
                .record();
            let last = enc.kernel(&MODULE, "sample_rows_final_f32")?;
            enc.dispatch(&last)
                .grid(u32_arg(rows)?)
                .block(256)
                .shared_mem(u32_arg(parts * ROW_CANDIDATES * 8)?)
                .read(&part_v)
                .read(&part_i)
                .read(&d)
                .read_write(&c)
                .write(&o)
                .arg(u32_arg(parts)?)
                .arg(u32_arg(cols)?)
                .arg(u32_arg(seqs)?)
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
            let kern = enc.kernel(&MODULE, "top_k_f32")?;
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
