//! The output head's selections: argmax and top-k per row (the lower index wins ties), and
//! sampling with `kestrel_core::sample`'s algorithm (one token with penalties, or each row with
//! its own settings and generator).

use kestrel_core::ir::Op;
use kestrel_core::rng::Rng;
use kestrel_core::sample::{
    distribution, draw, draw_row, penalize, rng_state, rng_words, DRAWN_WORDS, DRAW_WORDS,
};

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
        Op::Sample {
            logits,
            counts,
            rng,
            out,
            cols,
            params,
        } => {
            let mut row = v.read::<f32>(logits)?[..cols].to_vec();
            let counts = v.write::<u32>(counts)?;
            let words = v.write::<u32>(rng)?;
            penalize(&mut row, counts, &params);
            let mut r = Rng::from_state(rng_state(words));
            let t = draw(&distribution(&row, &params), &mut r);
            words.copy_from_slice(&rng_words(r.state()));
            counts[t as usize] += 1;
            v.write::<u32>(out)?[0] = t;
        }
        Op::SampleRows {
            logits,
            draws,
            out,
            cols,
            ..
        } => {
            let (l, d) = (v.read::<f32>(logits)?, v.read::<u32>(draws)?);
            let o = v.write::<u32>(out)?;
            let rows = l.chunks(cols).zip(d.chunks(DRAW_WORDS));
            for (o, (row, words)) in o.chunks_mut(DRAWN_WORDS).zip(rows) {
                o.copy_from_slice(&draw_row(row, words));
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
