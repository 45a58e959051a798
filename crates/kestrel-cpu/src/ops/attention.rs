//! Full attention with a KV cache: append keys and values at their positions (alone, or with
//! the per-head norms and rotation of queries and keys in one op), then causal attention with
//! grouped-query heads (query head h reads kv head h / (heads / kv_heads)). Caches are pools of
//! blocks of rows; each token finds its sequence's rows through the block table (`KvPages`).

use std::collections::HashMap;

use half::{bf16, f16};
use kestrel_core::ir::{KvPages, Op};
use kestrel_core::DType;
use rayon::prelude::*;

use super::norm::norm_row;
use super::rope::{angles, rotate};
use super::OpResult;
use crate::views::Views;

/// Stores `src` at element `at` of a cache of `dtype`.
fn store(cache: &mut [u8], dtype: DType, at: usize, src: &[f32]) -> OpResult {
    match dtype {
        DType::F32 => bytemuck::cast_slice_mut::<u8, f32>(cache)[at..at + src.len()].copy_from_slice(src),
        DType::BF16 => {
            for (d, s) in bytemuck::cast_slice_mut::<u8, bf16>(cache)[at..at + src.len()]
                .iter_mut()
                .zip(src)
            {
                *d = bf16::from_f32(*s);
            }
        }
        DType::F16 => {
            for (d, s) in bytemuck::cast_slice_mut::<u8, f16>(cache)[at..at + src.len()]
                .iter_mut()
                .zip(src)
            {
                *d = f16::from_f32(*s);
            }
        }
        other => return Err(format!("cache dtype {other}")),
    }
    Ok(())
}

/// The cache row of each token's position (for appends) in caches of `rows` rows.
fn token_rows(pages: &KvPages, v: &mut Views, positions: &[u32], rows: usize) -> Result<Vec<usize>, String> {
    let (table, seq) = (v.read::<u32>(pages.table)?, v.read::<u32>(pages.seq)?);
    positions
        .iter()
        .enumerate()
        .map(|(t, &p)| {
            let s = pages.seq_of(seq, t);
            pages
                .row(table, s, p as usize, rows)
                .ok_or_else(|| format!("position {p} of sequence {s} is outside the cache"))
        })
        .collect()
}

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match *op {
        // k, v: [tokens, kv_heads, head_dim]; caches: [kv_heads, rows, head_dim]
        Op::KvAppend {
            k,
            v: val,
            positions,
            k_cache,
            v_cache,
            pages,
            tokens,
            kv_heads,
            head_dim,
            rows,
        } => {
            let (k, val, pos) = (v.read::<f32>(k)?, v.read::<f32>(val)?, v.read::<u32>(positions)?);
            let at = token_rows(&pages, v, pos, rows)?;
            let (kd, vd) = (v.dtype(k_cache), v.dtype(v_cache));
            let (kc, vc) = (v.write_bytes(k_cache)?, v.write_bytes(v_cache)?);
            for (t, &r) in at.iter().enumerate().take(tokens) {
                for h in 0..kv_heads {
                    let src = (t * kv_heads + h) * head_dim;
                    let dst = (h * rows + r) * head_dim;
                    store(kc, kd, dst, &k[src..src + head_dim])?;
                    store(vc, vd, dst, &val[src..src + head_dim])?;
                }
            }
        }
        // qkv: [tokens, heads * q_stride + 2 * kv_heads * head_dim]; q, gate: [tokens, heads, head_dim]
        Op::AttentionInputs {
            qkv,
            q,
            gate,
            norms,
            positions,
            inv_freq,
            k_cache,
            v_cache,
            pages,
            tokens,
            heads,
            kv_heads,
            head_dim,
            rot_dim,
            scaling,
            rows,
        } => {
            let (x, pos) = (v.read::<f32>(qkv)?, v.read::<u32>(positions)?);
            let at = token_rows(&pages, v, pos, rows)?;
            let inv_freq = &v.read::<f32>(inv_freq)?[..rot_dim / 2];
            let norms = match norms {
                Some(n) => Some((v.floats(n.q)?, v.floats(n.k)?, n.eps, n.kind)),
                None => None,
            };
            let (kd, vd) = (v.dtype(k_cache), v.dtype(v_cache));
            let q = v.write::<f32>(q)?;
            let mut gate = match gate {
                Some(g) => Some(v.write::<f32>(g)?),
                None => None,
            };
            let (kc, vc) = (v.write_bytes(k_cache)?, v.write_bytes(v_cache)?);
            let q_stride = if gate.is_some() { 2 * head_dim } else { head_dim };
            let cols = heads * q_stride + 2 * kv_heads * head_dim;
            let mut row = vec![0f32; head_dim];
            for t in 0..tokens {
                let (cos, sin) = angles(pos[t], inv_freq, scaling);
                let xt = &x[t * cols..(t + 1) * cols];
                for h in 0..heads {
                    let src = &xt[h * q_stride..][..head_dim];
                    let dst = &mut q[(t * heads + h) * head_dim..][..head_dim];
                    match norms {
                        Some((qw, _, eps, kind)) => norm_row(src, qw, dst, eps, kind),
                        None => dst.copy_from_slice(src),
                    }
                    rotate(dst, &cos, &sin);
                    if let Some(g) = gate.as_deref_mut() {
                        g[(t * heads + h) * head_dim..][..head_dim]
                            .copy_from_slice(&xt[h * q_stride + head_dim..][..head_dim]);
                    }
                }
                let (keys, values) = xt[heads * q_stride..].split_at(kv_heads * head_dim);
                for h in 0..kv_heads {
                    let src = &keys[h * head_dim..][..head_dim];
                    match norms {
                        Some((_, kw, eps, kind)) => norm_row(src, kw, &mut row, eps, kind),
                        None => row.copy_from_slice(src),
                    }
                    rotate(&mut row, &cos, &sin);
                    let dst = (h * rows + at[t]) * head_dim;
                    store(kc, kd, dst, &row)?;
                    store(vc, vd, dst, &values[h * head_dim..][..head_dim])?;
                }
            }
        }
        // q, out: [tokens, heads, head_dim]
        Op::Attention {
            q,
            k_cache,
            v_cache,
            positions,
            pages,
            out,
            heads,
            kv_heads,
            head_dim,
            rows,
            scale,
            chunk,
            ..
        } => {
            let (q, pos) = (v.read::<f32>(q)?, v.read::<u32>(positions)?);
            let (table, seq) = (v.read::<u32>(pages.table)?, v.read::<u32>(pages.seq)?);
            // The sequence a query reads: its own, or from the chunk on, its run's.
            let seq_of = |t: usize| {
                let from = match chunk {
                    Some(c) if t >= c.from => c.leader(t),
                    _ => t,
                };
                pages.seq_of(seq, from)
            };
            // Each sequence's rows, up to the furthest position a token of it reads.
            let mut seq_rows: HashMap<usize, Vec<usize>> = HashMap::new();
            for (t, &p) in pos.iter().enumerate() {
                let s = seq_of(t);
                let r = seq_rows.entry(s).or_default();
                for j in r.len()..=p as usize {
                    r.push(
                        pages
                            .row(table, s, j, rows)
                            .ok_or_else(|| format!("position {j} of sequence {s} is outside the cache"))?,
                    );
                }
            }
            let (kc, vc) = (v.floats(k_cache)?, v.floats(v_cache)?);
            let out = v.write::<f32>(out)?;
            let group = heads / kv_heads;
            out.par_chunks_mut(head_dim).enumerate().for_each(|(row, o)| {
                let (t, h) = (row / heads, row % heads);
                let kvh = h / group;
                let qv = &q[row * head_dim..(row + 1) * head_dim];
                let at = &seq_rows[&seq_of(t)][..=pos[t] as usize];
                // scores over the token's rows, softmax with the max subtracted.
                let scores: Vec<f32> = at
                    .iter()
                    .map(|&r| scale * kc.dot((kvh * rows + r) * head_dim, qv))
                    .collect();
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f32 = e.iter().sum();
                o.fill(0.0);
                for (&r, p) in at.iter().zip(&e) {
                    let base = (kvh * rows + r) * head_dim;
                    for (d, o) in o.iter_mut().enumerate() {
                        *o += p / sum * vc.get(base + d);
                    }
                }
            });
        }
        _ => return Err(format!("{} is not attention", op.name())),
    }
    Ok(())
}
