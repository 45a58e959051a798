//! Linear layers `y = x · Wᵀ` over dense (bf16, f16, f32) and affine-quantised weights, and the
//! token embedding gather from either kind of table.

use kestrel_core::ir::{LinearWeight, Op};
use kestrel_core::quant::QuantFormat;
use rayon::prelude::*;

use super::OpResult;
use crate::views::{Floats, Views};

/// A weight matrix `[rows, cols]` read row by row as f32.
pub enum Matrix<'a> {
    Dense {
        w: Floats<'a>,
        cols: usize,
    },
    Quant {
        weight: &'a [u32],
        groups: Groups<'a>,
        format: QuantFormat,
        cols: usize,
    },
}

/// A quantised matrix's group scales and biases, viewed in place.
pub enum Groups<'a> {
    /// A scale and a bias stored a group (bf16 or f32).
    Plain { scales: Floats<'a>, biases: Floats<'a> },
    /// `ScaleType::Factored`: a group's multiples of its super-block's two units, `per` groups a
    /// super-block.
    Factored {
        multiples: &'a [[i8; 2]],
        units: &'a [[f32; 2]],
        per: usize,
    },
}

impl Groups<'_> {
    /// Group `g`'s scale and bias.
    #[inline]
    pub fn get(&self, g: usize) -> (f32, f32) {
        match self {
            Groups::Plain { scales, biases } => (scales.get(g), biases.get(g)),
            Groups::Factored {
                multiples,
                units,
                per,
            } => {
                let ([ns, nb], [us, ub]) = (multiples[g], units[g / per]);
                (us * ns as f32, ub * nb as f32)
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Groups::Plain { scales, .. } => scales.len(),
            Groups::Factored { multiples, .. } => multiples.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<'a> Matrix<'a> {
    pub fn bind(w: &LinearWeight, v: &mut Views<'a>, cols: usize) -> Result<Matrix<'a>, String> {
        Ok(match *w {
            LinearWeight::Dense(w) => Matrix::Dense {
                w: v.floats(w.raw())?,
                cols,
            },
            LinearWeight::Quant {
                weight,
                scales,
                biases,
                format,
            } => Matrix::Quant {
                weight: v.read(weight.raw())?,
                groups: Groups::Plain {
                    scales: v.floats(scales.raw())?,
                    biases: v.floats(biases.raw())?,
                },
                format,
                cols,
            },
        })
    }

    /// `Σ_c W[row, c] * x[c]`.
    pub fn dot_row(&self, row: usize, x: &[f32]) -> f32 {
        match self {
            Matrix::Dense { w, cols } => w.dot(row * cols, x),
            Matrix::Quant {
                weight,
                groups,
                format,
                cols,
            } => quant_dot(weight, groups, *format, *cols, row, x),
        }
    }

    /// Row `row` as f32.
    pub fn row(&self, row: usize) -> Vec<f32> {
        match self {
            Matrix::Dense { w, cols } => w.to_vec(row * cols, *cols),
            Matrix::Quant {
                weight,
                groups,
                format,
                cols,
            } => {
                let mut out = vec![0.0; *cols];
                quant_row(weight, groups, *format, *cols, row, &mut out);
                out
            }
        }
    }
}

/// Dequantises row `row` of a quantised matrix: `w = q * scale + bias` per group.
pub fn quant_row(weight: &[u32], groups: &Groups, f: QuantFormat, cols: usize, row: usize, out: &mut [f32]) {
    let (vpw, mask) = (f.values_per_word(), (1u32 << f.bits) - 1);
    let words = &weight[row * f.words_per_row(cols)..][..f.words_per_row(cols)];
    for (g, group) in out.chunks_mut(f.group_size).enumerate() {
        let (s, b) = groups.get(row * f.groups_per_row(cols) + g);
        for (i, o) in group.iter_mut().enumerate() {
            let c = g * f.group_size + i;
            let q = (words[c / vpw] >> (f.bits as usize * (c % vpw))) & mask;
            *o = q as f32 * s + b;
        }
    }
}

/// `Σ_c dequant(W[row, c]) * x[c]`, group by group: `scale * Σ q x + bias * Σ x`.
pub fn quant_dot(weight: &[u32], groups: &Groups, f: QuantFormat, cols: usize, row: usize, x: &[f32]) -> f32 {
    let (vpw, mask) = (f.values_per_word(), (1u32 << f.bits) - 1);
    let words = &weight[row * f.words_per_row(cols)..][..f.words_per_row(cols)];
    let mut acc = 0.0f32;
    for g in 0..f.groups_per_row(cols) {
        let (mut qx, mut sx) = (0.0f32, 0.0f32);
        for i in 0..f.group_size {
            let c = g * f.group_size + i;
            let q = (words[c / vpw] >> (f.bits as usize * (c % vpw))) & mask;
            qx += q as f32 * x[c];
            sx += x[c];
        }
        let (s, b) = groups.get(row * f.groups_per_row(cols) + g);
        acc += s * qx + b * sx;
    }
    acc
}

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match op {
        // x: [tokens, in], out: [tokens, out]
        Op::Linear {
            x,
            w,
            out,
            in_dim,
            out_dim,
            ..
        } => {
            // bf16 activations (a norm's rounded output) are read as the f32 values they hold.
            let x = v.floats(*x)?;
            let x = match x {
                Floats::F32(x) => std::borrow::Cow::Borrowed(x),
                _ => std::borrow::Cow::Owned(x.to_vec(0, x.len())),
            };
            let m = Matrix::bind(w, v, *in_dim)?;
            let out = v.write::<f32>(*out)?;
            for (xr, or) in x.chunks(*in_dim).zip(out.chunks_mut(*out_dim)) {
                or.par_iter_mut()
                    .enumerate()
                    .for_each(|(o, y)| *y = m.dot_row(o, xr));
            }
        }
        // ids: [tokens], out: [tokens, hidden]
        Op::Embed {
            table,
            ids,
            out,
            hidden,
        } => {
            let ids = v.read::<u32>(*ids)?;
            let m = Matrix::bind(table, v, *hidden)?;
            let vocab = match &m {
                Matrix::Dense { w, cols } => w.len() / cols,
                Matrix::Quant {
                    groups, format, cols, ..
                } => groups.len() / format.groups_per_row(*cols),
            };
            let out = v.write::<f32>(*out)?;
            for (&id, row) in ids.iter().zip(out.chunks_mut(*hidden)) {
                if id as usize >= vocab {
                    return Err(format!("token id {id} outside a vocabulary of {vocab}"));
                }
                row.copy_from_slice(&m.row(id as usize));
            }
        }
        _ => return Err(format!("{} is not a linear op", op.name())),
    }
    Ok(())
}
