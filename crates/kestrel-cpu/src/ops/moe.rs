//! Mixture of experts: the router (softmax, top-k, optional renormalisation) and the routed
//! experts, each a SwiGLU MLP read from its contiguous span of the layer's expert buffer.

use kestrel_core::ir::{ExpertFormat, ExpertLayout, MatrixSpan, Op};
use kestrel_core::quant::ScaleType;
use rayon::prelude::*;

use super::{head::top_k, silu, OpResult};
use crate::ops::linear::{Groups, Matrix};
use crate::views::Floats;
use crate::views::Views;

/// One matrix `[rows, cols]` of one expert, viewed in place.
fn matrix<'a>(
    span: &'a [u8],
    m: MatrixSpan,
    format: ExpertFormat,
    rows: usize,
    cols: usize,
) -> Result<Matrix<'a>, String> {
    let cast_err = |e| format!("expert span: {e:?}");
    Ok(match format {
        ExpertFormat::Bf16 => Matrix::Dense {
            w: Floats::BF16(
                bytemuck::try_cast_slice(&span[m.weight..m.weight + rows * cols * 2]).map_err(cast_err)?,
            ),
            cols,
        },
        ExpertFormat::Quant(q) => Matrix::Quant {
            weight: bytemuck::try_cast_slice(&span[m.weight..m.weight + rows * q.words_per_row(cols) * 4])
                .map_err(cast_err)?,
            groups: {
                let scales = &span[m.scales..m.scales + q.scale_part(rows, cols)];
                let biases = &span[m.biases..m.biases + q.bias_part(rows, cols)];
                match q.scale {
                    ScaleType::Bf16 => Groups::Plain {
                        scales: Floats::BF16(bytemuck::try_cast_slice(scales).map_err(cast_err)?),
                        biases: Floats::BF16(bytemuck::try_cast_slice(biases).map_err(cast_err)?),
                    },
                    ScaleType::F32 => Groups::Plain {
                        scales: Floats::F32(bytemuck::try_cast_slice(scales).map_err(cast_err)?),
                        biases: Floats::F32(bytemuck::try_cast_slice(biases).map_err(cast_err)?),
                    },
                    ScaleType::Factored => Groups::Factored {
                        multiples: bytemuck::try_cast_slice(scales).map_err(cast_err)?,
                        units: bytemuck::try_cast_slice(biases).map_err(cast_err)?,
                        per: q.groups_per_super(),
                    },
                }
            },
            format: q,
            cols,
        },
    })
}

/// `down(silu(gate x) * up x)` for one expert.
pub fn expert_mlp(span: &[u8], layout: &ExpertLayout, x: &[f32]) -> Result<Vec<f32>, String> {
    let (h, i) = (layout.hidden, layout.inter);
    let gate = matrix(span, layout.gate(), layout.format, i, h)?;
    let up = matrix(span, layout.up(), layout.format, i, h)?;
    let down = matrix(span, layout.down_span(), layout.down, h, i)?;
    let act: Vec<f32> = (0..i)
        .map(|r| silu(gate.dot_row(r, x)) * up.dot_row(r, x))
        .collect();
    Ok((0..h).map(|r| down.dot_row(r, &act)).collect())
}

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match *op {
        // logits: [tokens, experts] -> ids, weights: [tokens, k]
        Op::Router {
            logits,
            ids,
            weights,
            experts,
            k,
            normalize,
            ..
        } => {
            let l = v.read::<f32>(logits)?;
            let (ids, w) = (v.write::<u32>(ids)?, v.write::<f32>(weights)?);
            for (t, row) in l.chunks(experts).enumerate() {
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = row.iter().map(|x| (x - m).exp()).collect();
                let sum: f32 = e.iter().sum();
                let probs: Vec<f32> = e.iter().map(|x| x / sum).collect();
                let top = top_k(&probs, k);
                let total: f32 = top.iter().map(|&i| probs[i]).sum();
                for (j, &i) in top.iter().enumerate() {
                    ids[t * k + j] = i as u32;
                    w[t * k + j] = if normalize { probs[i] / total } else { probs[i] };
                }
            }
        }
        // x, out: [tokens, hidden]; ids, weights: [tokens, k]; experts: [E, span] bytes
        Op::MoeExperts {
            x,
            ids,
            weights,
            experts,
            layout,
            out,
            k,
            ..
        } => {
            let (x, ids, w, blob) = (
                v.read::<f32>(x)?,
                v.read::<u32>(ids)?,
                v.read::<f32>(weights)?,
                v.bytes(experts)?,
            );
            let out = v.write::<f32>(out)?;
            let span = layout.span_bytes();
            let results: Result<Vec<()>, String> = out
                .par_chunks_mut(layout.hidden)
                .enumerate()
                .map(|(t, o)| {
                    o.fill(0.0);
                    let xt = &x[t * layout.hidden..(t + 1) * layout.hidden];
                    for j in 0..k {
                        let e = ids[t * k + j] as usize;
                        if e >= layout.experts {
                            return Err(format!("expert {e} of {}", layout.experts));
                        }
                        let y = expert_mlp(&blob[e * span..(e + 1) * span], &layout, xt)?;
                        for (o, y) in o.iter_mut().zip(y) {
                            *o += w[t * k + j] * y;
                        }
                    }
                    Ok(())
                })
                .collect();
            results?;
        }
        _ => return Err(format!("{} is not a MoE op", op.name())),
    }
    Ok(())
}
