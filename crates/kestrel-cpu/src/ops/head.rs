//! The output head's selections: argmax and top-k per row (the lower index wins ties), and
//! sampling each row with its own settings and generator by `kestrel_core::sample`'s algorithm.

use kestrel_core::ir::Op;
use kestrel_core::sample::{draw_row, draw_settings, DRAWN_WORDS, DRAW_WORDS};

use super::OpResult;
use crate::views::Views;

/// Indices of the `k` largest values, descending, ties to the lower index.
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match *op {
        Op::SampleRows {
            logits,
            draws,
            counts,
            out,
            cols,
            ..
        } => {
            let (l, d) = (v.read::<f32>(logits)?, v.read::<u32>(draws)?);
            let counts = v.write::<u32>(counts)?;
            let o = v.write::<u32>(out)?;
            let rows = l.chunks(cols).zip(d.chunks(DRAW_WORDS));
            for (o, (row, words)) in o.chunks_mut(DRAWN_WORDS).zip(rows) {
                // A row past the counts is read as none, as the CUDA kernel reads it.
                let c = draw_settings(words)
                    .2
                    .and_then(|r| counts.get_mut(r as usize * cols..(r as usize + 1) * cols));
                o.copy_from_slice(&draw_row(row, words, c));
            }
        }
        Op::Argmax {
            logits, out, cols, ..
        } => {
            let (l, o) = (v.read::<f32>(logits)?, v.write::<u32>(out)?);
            for (o, row) in o.iter_mut().zip(l.chunks(cols)) {
                let mut best = 0;
                for (i, &x) in row.iter().enumerate() {
                    if x > row[best] {
                        best = i;
                    }
                }
                *o = best as u32;
            }
        }
        Op::TopK {
            logits,
            ids,
            values,
            cols,
            k,
            ..
        } => {
            let l = v.read::<f32>(logits)?;
            let (ids, vals) = (v.write::<u32>(ids)?, v.write::<f32>(values)?);
            for (r, row) in l.chunks(cols).enumerate() {
                for (j, i) in top_k(row, k).into_iter().enumerate() {
                    ids[r * k + j] = i as u32;
                    vals[r * k + j] = row[i];
                }
            }
        }
        _ => return Err(format!("{} is not a head op", op.name())),
    }
    Ok(())
}
