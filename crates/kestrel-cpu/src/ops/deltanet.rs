//! Gated DeltaNet (linear attention): the causal depthwise conv1d with its rolling state, the
//! decay and write-strength gates, and the gated delta rule, both as a per-token recurrence and
//! as the chunked form (a triangular solve per chunk) that prefill uses. The two must agree.

use kestrel_core::ir::{DeltaAlgo, Op, StateRows};
use rayon::prelude::*;

use super::{sigmoid, silu, OpResult};
use crate::views::{Floats, Views};

/// `log(1 + exp(x))`, linear above 20 as torch's softplus.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(Σ x² + 1e-6)` in place.
fn l2_normalize(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Inputs of one value head across all tokens, q and k already normalised and q scaled.
struct Head {
    q: Vec<f32>, // [tokens, dk]
    k: Vec<f32>, // [tokens, dk]
    v: Vec<f32>, // [tokens, dv]
    g: Vec<f32>, // [tokens]
    beta: Vec<f32>,
}

/// The recurrence, one token at a time; `s: [dk, dv]`, `out: [tokens, dv]`.
fn recurrent(h: &Head, s: &mut [f32], dk: usize, dv: usize, out: &mut [f32]) {
    let tokens = h.g.len();
    for t in 0..tokens {
        let (q, k, v) = (&h.q[t * dk..][..dk], &h.k[t * dk..][..dk], &h.v[t * dv..][..dv]);
        let decay = h.g[t].exp();
        s.iter_mut().for_each(|x| *x *= decay);
        // kv_mem[j] = Σ_i s[i][j] k[i]; delta = (v - kv_mem) * beta
        let mut delta = v.to_vec();
        for (i, ki) in k.iter().enumerate() {
            for (d, sij) in delta.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                *d -= sij * ki;
            }
        }
        delta.iter_mut().for_each(|d| *d *= h.beta[t]);
        for (i, ki) in k.iter().enumerate() {
            for (sij, d) in s[i * dv..(i + 1) * dv].iter_mut().zip(&delta) {
                *sij += ki * d;
            }
        }
        let o = &mut out[t * dv..(t + 1) * dv];
        o.fill(0.0);
        for (i, qi) in q.iter().enumerate() {
            for (o, sij) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                *o += sij * qi;
            }
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The chunked form: within a chunk of length L the updates are condensed through the unit
/// lower-triangular system `(I + A) U = V·β`, `A[i][j] = β_i k_i·k_j e^{c_i - c_j}` (j < i),
/// `c` the cumulative decay; across chunks the state carries over.
fn chunked(h: &Head, s: &mut [f32], dk: usize, dv: usize, chunk: usize, out: &mut [f32]) {
    let tokens = h.g.len();
    let mut start = 0;
    while start < tokens {
        let l = chunk.min(tokens - start);
        let q = &h.q[start * dk..(start + l) * dk];
        let k = &h.k[start * dk..(start + l) * dk];
        let v = &h.v[start * dv..(start + l) * dv];
        let beta = &h.beta[start..start + l];
        let mut c = vec![0f32; l];
        let mut acc = 0.0;
        for i in 0..l {
            acc += h.g[start + i];
            c[i] = acc;
        }
        let (ki, qi) = (
            |i: usize| &k[i * dk..(i + 1) * dk],
            |i: usize| &q[i * dk..(i + 1) * dk],
        );
        // Forward substitution of (I + A) X = B for B = V·β (X = U) and B = K·β·e^c (X = W).
        let mut u = vec![0f32; l * dv];
        let mut w = vec![0f32; l * dk];
        for i in 0..l {
            for d in 0..dv {
                u[i * dv + d] = v[i * dv + d] * beta[i];
            }
            for d in 0..dk {
                w[i * dk + d] = k[i * dk + d] * beta[i] * c[i].exp();
            }
            for j in 0..i {
                let a = beta[i] * dot(ki(i), ki(j)) * (c[i] - c[j]).exp();
                for d in 0..dv {
                    u[i * dv + d] -= a * u[j * dv + d];
                }
                for d in 0..dk {
                    w[i * dk + d] -= a * w[j * dk + d];
                }
            }
        }
        // v_new = U - W·S
        let mut v_new = u;
        for i in 0..l {
            for a in 0..dk {
                let wia = w[i * dk + a];
                for d in 0..dv {
                    v_new[i * dv + d] -= wia * s[a * dv + d];
                }
            }
        }
        // out_i = (q_i e^{c_i})·S + Σ_{j<=i} (q_i·k_j) e^{c_i - c_j} v_new_j
        for i in 0..l {
            let o = &mut out[(start + i) * dv..(start + i + 1) * dv];
            o.fill(0.0);
            let ec = c[i].exp();
            for a in 0..dk {
                let qa = qi(i)[a] * ec;
                for d in 0..dv {
                    o[d] += qa * s[a * dv + d];
                }
            }
            for j in 0..=i {
                let a = dot(qi(i), ki(j)) * (c[i] - c[j]).exp();
                for d in 0..dv {
                    o[d] += a * v_new[j * dv + d];
                }
            }
        }
        // S = S e^{c_last} + Σ_i (k_i e^{c_last - c_i}) ⊗ v_new_i
        let last = c[l - 1];
        let el = last.exp();
        s.iter_mut().for_each(|x| *x *= el);
        for i in 0..l {
            let f = (last - c[i]).exp();
            for a in 0..dk {
                let ka = ki(i)[a] * f;
                for d in 0..dv {
                    s[a * dv + d] += ka * v_new[i * dv + d];
                }
            }
        }
        start += l;
    }
}

/// The runs of an op's tokens over its state's rows: (row, the tokens that run from it in
/// order). Without rows, or for one sequence, every token from one row; else each token from
/// its own sequence's row (a row named twice, as the padding of a batched step does, is run
/// in token order here; what it holds after is unspecified).
fn runs(rows: Option<StateRows>, v: &mut Views, tokens: usize) -> Result<Vec<(usize, Vec<usize>)>, String> {
    let Some(r) = rows else {
        return Ok(vec![(0, (0..tokens).collect())]);
    };
    let seq = v.read::<u32>(r.seq)?;
    let out: Vec<(usize, Vec<usize>)> = if r.one_seq {
        vec![(r.row_of(seq, 0), (0..tokens).collect())]
    } else {
        (0..tokens).map(|t| (r.row_of(seq, t), vec![t])).collect()
    };
    if let Some((row, _)) = out.iter().find(|(row, _)| *row >= r.seqs) {
        return Err(format!("state row {row} past the {} rows", r.seqs));
    }
    Ok(out)
}

/// The convolution of tokens `ts` (in order) from and into one sequence's state `st: [channels,
/// kernel - 1]`.
fn conv_run(
    x: &[f32],
    w: &Floats,
    st: &mut [f32],
    ts: &[usize],
    channels: usize,
    kernel: usize,
    out: &mut [f32],
) {
    let hist = kernel - 1;
    for c in 0..channels {
        // The channel's sequence: the previous inputs, then this run's.
        let seq: Vec<f32> = st[c * hist..(c + 1) * hist]
            .iter()
            .copied()
            .chain(ts.iter().map(|&t| x[t * channels + c]))
            .collect();
        for (i, &t) in ts.iter().enumerate() {
            let acc: f32 = (0..kernel).map(|j| w.get(c * kernel + j) * seq[i + j]).sum();
            out[t * channels + c] = silu(acc);
        }
        st[c * hist..(c + 1) * hist].copy_from_slice(&seq[seq.len() - hist..]);
    }
}

/// What one run of the delta rule reads.
struct DeltaIn<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    k_heads: usize,
    v_heads: usize,
    dk: usize,
    dv: usize,
    algo: DeltaAlgo,
}

/// The delta rule over tokens `ts` (in order) from and into one sequence's state `st: [v_heads,
/// dk, dv]`, writing their rows of `out`.
fn delta_run(d: &DeltaIn, st: &mut [f32], ts: &[usize], out: &mut [f32]) {
    let (k_heads, v_heads, dk, dv) = (d.k_heads, d.v_heads, d.dk, d.dv);
    let ratio = v_heads / k_heads;
    let scale = 1.0 / (dk as f32).sqrt();
    let n = ts.len();
    let per_head: Vec<Vec<f32>> = st
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(h, s)| {
            let kh = h / ratio;
            let mut head = Head {
                q: Vec::with_capacity(n * dk),
                k: Vec::with_capacity(n * dk),
                v: Vec::with_capacity(n * dv),
                g: Vec::new(),
                beta: Vec::new(),
            };
            for &t in ts {
                let mut qt = d.q[(t * k_heads + kh) * dk..][..dk].to_vec();
                let mut kt = d.k[(t * k_heads + kh) * dk..][..dk].to_vec();
                l2_normalize(&mut qt);
                l2_normalize(&mut kt);
                qt.iter_mut().for_each(|x| *x *= scale);
                head.q.extend(qt);
                head.k.extend(kt);
                head.v.extend_from_slice(&d.v[(t * v_heads + h) * dv..][..dv]);
                head.g.push(d.g[t * v_heads + h]);
                head.beta.push(d.beta[t * v_heads + h]);
            }
            let mut o = vec![0f32; n * dv];
            match d.algo {
                DeltaAlgo::Recurrent => recurrent(&head, s, dk, dv, &mut o),
                DeltaAlgo::Auto if n == 1 => recurrent(&head, s, dk, dv, &mut o),
                DeltaAlgo::Auto => chunked(&head, s, dk, dv, 64, &mut o),
                DeltaAlgo::Chunked { chunk } => chunked(&head, s, dk, dv, chunk, &mut o),
            }
            o
        })
        .collect();
    for (h, o) in per_head.iter().enumerate() {
        for (i, &t) in ts.iter().enumerate() {
            out[(t * v_heads + h) * dv..][..dv].copy_from_slice(&o[i * dv..(i + 1) * dv]);
        }
    }
}

pub fn exec(op: &Op, v: &mut Views) -> OpResult {
    match *op {
        // x, out: [tokens, channels]; w: [channels, kernel]; state: [rows, channels, kernel - 1]
        Op::CausalConv1d {
            x,
            w,
            state,
            rows,
            out,
            tokens,
            channels,
            kernel,
        } => {
            let runs = runs(rows, v, tokens)?;
            let (x, w) = (v.read::<f32>(x)?, v.floats(w)?);
            let (st, out) = (v.write::<f32>(state)?, v.write::<f32>(out)?);
            let size = channels * (kernel - 1);
            for (row, ts) in &runs {
                conv_run(
                    x,
                    &w,
                    &mut st[row * size..(row + 1) * size],
                    ts,
                    channels,
                    kernel,
                    out,
                );
            }
        }
        // a, b, g, beta: [tokens, heads]
        Op::DeltaGates {
            a,
            b,
            a_log,
            dt_bias,
            g,
            beta,
            heads,
            ..
        } => {
            let (a, b, a_log, dt) = (
                v.read::<f32>(a)?,
                v.read::<f32>(b)?,
                v.floats(a_log)?,
                v.floats(dt_bias)?,
            );
            let (g, beta) = (v.write::<f32>(g)?, v.write::<f32>(beta)?);
            for i in 0..a.len() {
                let h = i % heads;
                g[i] = -a_log.get(h).exp() * softplus(a[i] + dt.get(h));
                beta[i] = sigmoid(b[i]);
            }
        }
        // q, k: [tokens, k_heads, k_dim]; v, out: [tokens, v_heads, v_dim]; g, beta: [tokens, v_heads];
        // state: [rows, v_heads, k_dim, v_dim]
        Op::DeltaRule {
            q,
            k,
            v: val,
            g,
            beta,
            state,
            rows,
            out,
            tokens,
            k_heads,
            v_heads,
            k_dim: dk,
            v_dim: dv,
            algo,
        } => {
            let runs = runs(rows, v, tokens)?;
            let d = DeltaIn {
                q: v.read::<f32>(q)?,
                k: v.read::<f32>(k)?,
                v: v.read::<f32>(val)?,
                g: v.read::<f32>(g)?,
                beta: v.read::<f32>(beta)?,
                k_heads,
                v_heads,
                dk,
                dv,
                algo,
            };
            let (st, out) = (v.write::<f32>(state)?, v.write::<f32>(out)?);
            let size = v_heads * dk * dv;
            for (row, ts) in &runs {
                delta_run(&d, &mut st[row * size..(row + 1) * size], ts, out);
            }
        }
        _ => return Err(format!("{} is not a DeltaNet op", op.name())),
    }
    Ok(())
}
