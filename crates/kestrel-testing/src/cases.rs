//! Op test cases shared by every backend's tests: each case is a small graph over random data
//! of a random shape (deliberately not a multiple of any tile), plus a float64 reference of
//! what it must compute, written naively and independently of the CPU backend.
//!
//! The CPU tests compare the CPU backend with the references; the CUDA tests compare CUDA with
//! the CPU backend on the same cases.

use half::{bf16, f16};
use kestrel_core::ir::*;
use kestrel_core::quant::{QuantFormat, QuantMatrix, ScaleType};
use kestrel_core::rng::Rng;
use kestrel_core::rope::{RopeScaling, RopeTable};
use kestrel_core::{Backend, DType, GraphBuilder};

/// What a checked buffer must hold.
#[derive(Debug, Clone)]
pub enum Expect {
    /// f32 values, compared by max |error| / max |reference|.
    Floats(Vec<f64>),
    /// Exact u32 values.
    Ids(Vec<u32>),
    /// No reference: backends are compared with each other (whole layers).
    Backends,
    /// Values stored as bf16: each within one bf16 step of the reference ([`bf16_err`]).
    Bf16(Vec<f64>),
}

#[derive(Debug, Clone)]
pub struct Check {
    pub buf: Buf,
    pub label: String,
    pub expect: Expect,
    /// For a product's outputs: the root mean square over them of their sums' terms,
    /// sqrt(mean over outputs of Σ_k (w_k x_k)²). Rounded activations move an output by an
    /// amount of that scale however much its terms cancel, so a relative bound measures the
    /// error against it where the outputs themselves come out smaller ([`rel_l2_over`]).
    pub term_rms: Option<f64>,
}

/// A graph, the bytes of every buffer the host supplies, and what to check after one run.
pub struct Case {
    pub name: String,
    pub graph: Graph,
    pub data: Vec<(Buf, Vec<u8>)>,
    pub checks: Vec<Check>,
    /// A backend may round activations before a matrix product here (to int8 per block of 32
    /// for quantised one-token products, to bf16 for tensor-core products, as CUDA does):
    /// compare with the looser bound that needs.
    pub rounded_activations: bool,
}

/// Bytes of every checked buffer after running `case` once on `backend`.
pub fn run_case<B: Backend>(backend: &mut B, case: &Case) -> Result<Vec<Vec<u8>>, B::Error> {
    let mut p = backend.prepare(&case.graph)?;
    for (buf, bytes) in &case.data {
        backend.write_bytes(&mut p, *buf, 0, bytes)?;
    }
    backend.run(&mut p)?;
    case.checks
        .iter()
        .map(|c| {
            let mut out = vec![0u8; case.graph.decl(c.buf).byte_len()];
            backend.read_bytes(&p, c.buf, &mut out)?;
            Ok(out)
        })
        .collect()
}

/// max |got - want| / max(max |want|, 1e-30).
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    let worst = got.iter().zip(want).fold(0f64, |m, (g, w)| {
        if g.is_nan() {
            f64::INFINITY
        } else {
            m.max((*g as f64 - w).abs())
        }
    });
    worst / scale
}

/// ‖got - want‖₂ / ‖want‖₂: the bound for paths that round their inputs (int8 activations),
/// where a single element may move by a rounding step but the whole stays close.
pub fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    rel_l2_over(got, want, None)
}

/// [`rel_l2`], for a product's outputs with their terms' scale ([`Check::term_rms`]) measured
/// against that scale where it is larger: a few outputs whose terms happen to cancel (4 outputs
/// at 0.44 of it were drawn) would otherwise hold rounding to a bound tighter than the rest.
pub fn rel_l2_over(got: &[f32], want: &[f64], term_rms: Option<f64>) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if g.is_nan() {
            return f64::INFINITY;
        }
        num += (*g as f64 - w).powi(2);
        den += w * w;
    }
    let floor = term_rms.map_or(0.0, |t| want.len() as f64 * t * t);
    (num / den.max(floor).max(1e-300)).sqrt()
}

/// The largest `|got - want| / (|want| + 1e-6 · max |want|)`: for values stored as bf16, where
/// one rounding is within 2^-9 of the value and two roundings of nearly equal values (two
/// backends) within one step, 2^-7 ([`BF16_STEP`]).
pub fn bf16_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let floor = 1e-6 * want.iter().fold(0.0f64, |m, v| m.max(v.abs())) + 1e-30;
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (w.abs() + floor))
        .fold(0.0, f64::max)
}

/// One step of bf16's 8-bit significand, relative: the bound for [`Expect::Bf16`] checks.
pub const BF16_STEP: f64 = 1.0 / 128.0;

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytemuck::pod_collect_to_vec(bytes)
}

/// A buffer's bytes as f64 values, by its dtype.
pub fn as_f64(bytes: &[u8], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F32 => f32s(bytes).iter().map(|&v| v as f64).collect(),
        DType::BF16 => bytemuck::pod_collect_to_vec::<u8, bf16>(bytes)
            .iter()
            .map(|v| v.to_f64())
            .collect(),
        DType::F16 => bytemuck::pod_collect_to_vec::<u8, f16>(bytes)
            .iter()
            .map(|v| v.to_f64())
            .collect(),
        DType::U32 => u32s(bytes).iter().map(|&v| v as f64).collect(),
        DType::I32 => bytemuck::pod_collect_to_vec::<u8, i32>(bytes)
            .iter()
            .map(|&v| v as f64)
            .collect(),
        DType::I64 => bytemuck::pod_collect_to_vec::<u8, i64>(bytes)
            .iter()
            .map(|&v| v as f64)
            .collect(),
        DType::U8 => bytes.iter().map(|&v| v as f64).collect(),
    }
}

pub fn u32s(bytes: &[u8]) -> Vec<u32> {
    bytemuck::pod_collect_to_vec(bytes)
}

/// Builds a case: declares buffers with random contents and remembers their bytes.
pub struct CaseBuilder {
    pub g: GraphBuilder,
    pub rng: Rng,
    data: Vec<(Buf, Vec<u8>)>,
    checks: Vec<(Buf, Expect)>,
    /// [`Check::term_rms`] of the checked products.
    term_rms: Vec<(Buf, f64)>,
    /// When false, weights and states are declared but not written: a later graph of a
    /// sequence reuses what an earlier one uploaded under the same labels.
    pub upload_persistent: bool,
    /// See [`Case::rounded_activations`].
    pub rounded_activations: bool,
}

/// Values as a weight of `dtype` stores them, widened to f64.
fn stored(values: &[f32], dtype: DType) -> (Vec<u8>, Vec<f64>) {
    match dtype {
        DType::F32 => (
            bytemuck::cast_slice(values).to_vec(),
            values.iter().map(|&v| v as f64).collect(),
        ),
        DType::BF16 => {
            let h: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            (
                bytemuck::cast_slice(&h).to_vec(),
                h.iter().map(|v| v.to_f64()).collect(),
            )
        }
        DType::F16 => {
            let h: Vec<f16> = values.iter().map(|&v| f16::from_f32(v)).collect();
            (
                bytemuck::cast_slice(&h).to_vec(),
                h.iter().map(|v| v.to_f64()).collect(),
            )
        }
        other => panic!("{other} is not a float dtype"),
    }
}

impl CaseBuilder {
    pub fn new(rng: Rng) -> Self {
        CaseBuilder {
            g: GraphBuilder::new(),
            rng,
            data: Vec::new(),
            checks: Vec::new(),
            term_rms: Vec::new(),
            upload_persistent: true,
            rounded_activations: false,
        }
    }

    pub fn randn(&mut self, n: usize, scale: f32) -> Vec<f32> {
        // Sum of uniforms: a cheap bell shape with full support around zero.
        (0..n)
            .map(|_| (self.rng.symmetric() + self.rng.symmetric() + self.rng.symmetric()) * scale)
            .collect()
    }

    pub fn set(&mut self, buf: impl Into<Buf>, bytes: Vec<u8>) {
        let buf = buf.into();
        if self.upload_persistent || !self.g.decl(buf).kind.is_persistent() {
            self.data.push((buf, bytes));
        }
    }

    /// A float weight of `dtype` with random values; returns its id and stored values.
    pub fn weight(
        &mut self,
        label: &str,
        dtype: DType,
        shape: &[usize],
        scale: f32,
    ) -> (BufId<Weight>, Vec<f64>) {
        let n = shape.iter().product();
        let values = self.randn(n, scale);
        self.weight_from(label, dtype, shape, &values)
    }

    pub fn weight_from(
        &mut self,
        label: &str,
        dtype: DType,
        shape: &[usize],
        values: &[f32],
    ) -> (BufId<Weight>, Vec<f64>) {
        let id = self.g.weight(label, dtype, shape.to_vec());
        let (bytes, f) = stored(values, dtype);
        self.set(id, bytes);
        (id, f)
    }

    /// A `[rows, cols]` projection weight, dense of `dtype` or quantised; returns the weight
    /// and its values as the kernels must see them (dequantised for quantised weights).
    pub fn linear_weight(
        &mut self,
        label: &str,
        rows: usize,
        cols: usize,
        format: Option<QuantFormat>,
        dtype: DType,
    ) -> (LinearWeight, Vec<f64>) {
        let scale = 1.0 / (cols as f32).sqrt();
        match format {
            None => {
                let (w, f) = self.weight(label, dtype, &[rows, cols], scale);
                (LinearWeight::Dense(w), f)
            }
            Some(q) => {
                let values = self.randn(rows * cols, scale);
                let m = QuantMatrix::quantize(&values, rows, cols, q);
                let lw = self.quant_weight(label, &m);
                (lw, m.dequantize().iter().map(|&v| v as f64).collect())
            }
        }
    }

    /// The quantised projection weight `label` holding `m`.
    pub fn quant_weight(&mut self, label: &str, m: &QuantMatrix) -> LinearWeight {
        let lw = self.g.quant_weight(label, m.rows, m.cols, m.format);
        let LinearWeight::Quant {
            weight,
            scales,
            biases,
            ..
        } = lw
        else {
            unreachable!("quant_weight makes quantised weights")
        };
        let (sb, bb) = m.group_bytes().expect("the quantiser's scales fit its format");
        self.set(weight, bytemuck::cast_slice(&m.weight).to_vec());
        self.set(scales, sb);
        self.set(biases, bb);
        lw
    }

    pub fn act(&mut self, label: &str, rows: usize, cols: usize, scale: f32) -> (BufId<Act>, Vec<f64>) {
        let values = self.randn(rows * cols, scale);
        let id = self.g.act_input(label, rows, cols);
        self.set(id, bytemuck::cast_slice(&values).to_vec());
        (id, values.iter().map(|&v| v as f64).collect())
    }

    pub fn residual(&mut self, label: &str, rows: usize, cols: usize) -> (BufId<Residual>, Vec<f64>) {
        let values = self.randn(rows * cols, 1.0);
        let id = self.g.residual_input(label, rows, cols);
        self.set(id, bytemuck::cast_slice(&values).to_vec());
        (id, values.iter().map(|&v| v as f64).collect())
    }

    pub fn positions(&mut self, label: &str, pos: &[u32]) -> BufId<Positions> {
        let id = self.g.positions_input(label, pos.len());
        self.set(id, bytemuck::cast_slice(pos).to_vec());
        id
    }

    pub fn state(&mut self, label: &str, shape: &[usize], scale: f32) -> (BufId<State>, Vec<f64>) {
        let n = shape.iter().product();
        let values = self.randn(n, scale);
        let id = self.g.state(label, DType::F32, shape.to_vec());
        self.set(id, bytemuck::cast_slice(&values).to_vec());
        (id, values.iter().map(|&v| v as f64).collect())
    }

    pub fn check_floats<R: Role>(&mut self, id: BufId<R>, expect: Vec<f64>) {
        self.g.mark_output(id);
        self.checks.push((id.raw(), Expect::Floats(expect)));
    }

    /// A checked `format` product `label` (weight `w_label`, `[out_dim, in_dim]`) of `x`, whose
    /// values are `xf`; the backends may round x to bf16 first (`rounded_activations`).
    pub fn checked_product<R: ProjectionInput>(
        &mut self,
        (w_label, label): (&str, &str),
        (x, xf): (BufId<R>, &[f64]),
        (in_dim, out_dim): (usize, usize),
        format: QuantFormat,
    ) -> BufId<Act> {
        let (w, wf) = self.linear_weight(w_label, out_dim, in_dim, Some(format), DType::BF16);
        let y = self.g.linear(label, x, &w);
        self.rounded_activations = true;
        self.check_floats(y, r::linear(xf, &wf, in_dim, out_dim));
        self.term_rms.push((y.raw(), term_rms(xf, &wf, in_dim)));
        y
    }

    /// Checks a bf16 output against reference values within one bf16 step.
    pub fn check_bf16<R: Role>(&mut self, id: BufId<R>, expect: Vec<f64>) {
        self.g.mark_output(id);
        self.checks.push((id.raw(), Expect::Bf16(expect)));
    }

    /// A norm's output supplied as bf16 (the rounded values, as f64, are returned).
    pub fn normed_bf16(
        &mut self,
        label: &str,
        rows: usize,
        cols: usize,
        scale: f32,
    ) -> (BufId<Normed>, Vec<f64>) {
        let values = self.randn(rows * cols, scale);
        let id = self.g.normed_input(label, rows, cols, DType::BF16);
        let (bytes, f) = stored(&values, DType::BF16);
        self.set(id, bytes);
        (id, f)
    }

    pub fn check_ids<R: Role>(&mut self, id: BufId<R>, expect: Vec<u32>) {
        self.g.mark_output(id);
        self.checks.push((id.raw(), Expect::Ids(expect)));
    }

    /// Checks `id` against the other backends only.
    pub fn check_backends<R: Role>(&mut self, id: BufId<R>) {
        self.g.mark_output(id);
        self.checks.push((id.raw(), Expect::Backends));
    }

    /// Checks a persistent buffer (state, cache) against the other backends after the run.
    pub fn check_state<R: Role>(&mut self, id: BufId<R>) {
        self.checks.push((id.raw(), Expect::Backends));
    }

    pub fn finish(self, name: impl Into<String>) -> Case {
        let name = name.into();
        let graph = self.g.finish().unwrap_or_else(|e| panic!("case {name}: {e}"));
        let checks = self
            .checks
            .into_iter()
            .map(|(buf, expect)| Check {
                buf,
                label: graph.decl(buf).label.clone(),
                expect,
                term_rms: self.term_rms.iter().find(|t| t.0 == buf).map(|t| t.1),
            })
            .collect();
        Case {
            name,
            graph,
            data: self.data,
            checks,
            rounded_activations: self.rounded_activations,
        }
    }
}

/// sqrt(mean over rows t of `x` and rows i of `w` of Σ_k (w_ik x_tk)²), both `in_dim` values a
/// row: [`Check::term_rms`] of x wᵀ.
fn term_rms(x: &[f64], w: &[f64], in_dim: usize) -> f64 {
    let (tokens, outs) = (x.len() / in_dim, w.len() / in_dim);
    let total: f64 = x
        .chunks(in_dim)
        .flat_map(|xr| {
            w.chunks(in_dim)
                .map(move |wr| wr.iter().zip(xr).map(|(a, b)| (a * b).powi(2)).sum::<f64>())
        })
        .sum();
    (total / (tokens * outs).max(1) as f64).sqrt()
}

// ---- float64 references ----

pub mod reference {
    //! Naive float64 versions of every op.

    pub fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    pub fn sigmoid(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    /// Neox rotation of every head of `x` (`[tokens, heads * head_dim]`, in place) by
    /// `positions[t] * inv_freq[i]`, the angle taken in f32 as transformers computes it.
    pub fn rope(x: &mut [f64], head_dim: usize, positions: &[u32], inv_freq: &[f32], scaling: f32) {
        let half = inv_freq.len();
        let per_token = x.len() / positions.len();
        for (row, &p) in x.chunks_mut(per_token).zip(positions) {
            for head in row.chunks_mut(head_dim) {
                for i in 0..half {
                    let a = (p as f32 * inv_freq[i]) as f64;
                    let (cs, sn) = (a.cos() * scaling as f64, a.sin() * scaling as f64);
                    let (x1, x2) = (head[i], head[i + half]);
                    head[i] = x1 * cs - x2 * sn;
                    head[i + half] = x2 * cs + x1 * sn;
                }
            }
        }
    }

    pub fn rms_norm(x: &[f64], w: &[f64], dim: usize, eps: f64, zero_centered: bool) -> Vec<f64> {
        x.chunks(dim)
            .flat_map(|row| {
                let ms = row.iter().map(|v| v * v).sum::<f64>() / dim as f64;
                let inv = 1.0 / (ms + eps).sqrt();
                row.iter()
                    .enumerate()
                    .map(move |(i, v)| v * inv * if zero_centered { 1.0 + w[i] } else { w[i] })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// `y[t, o] = Σ_i x[t, i] w[o, i]`.
    pub fn linear(x: &[f64], w: &[f64], in_dim: usize, out_dim: usize) -> Vec<f64> {
        x.chunks(in_dim)
            .flat_map(|xr| {
                (0..out_dim).map(move |o| (0..in_dim).map(|i| xr[i] * w[o * in_dim + i]).sum::<f64>())
            })
            .collect()
    }

    pub fn softmax(x: &[f64]) -> Vec<f64> {
        let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    pub fn top_k(x: &[f64], k: usize) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
        idx.truncate(k);
        idx
    }

    pub fn softplus(x: f64) -> f64 {
        if x > 20.0 {
            x
        } else {
            x.exp().ln_1p()
        }
    }

    pub fn l2norm(x: &[f64]) -> Vec<f64> {
        let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
        x.iter().map(|v| v * inv).collect()
    }

    /// The gated delta rule for one value head, token by token; `s: [dk, dv]`.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_head(
        q: &[Vec<f64>],
        k: &[Vec<f64>],
        v: &[Vec<f64>],
        g: &[f64],
        beta: &[f64],
        s: &mut [f64],
        dk: usize,
        dv: usize,
    ) -> Vec<Vec<f64>> {
        let mut outs = Vec::new();
        for t in 0..g.len() {
            let qn: Vec<f64> = l2norm(&q[t]).iter().map(|x| x / (dk as f64).sqrt()).collect();
            let kn = l2norm(&k[t]);
            s.iter_mut().for_each(|x| *x *= g[t].exp());
            let mem: Vec<f64> = (0..dv)
                .map(|j| (0..dk).map(|i| s[i * dv + j] * kn[i]).sum())
                .collect();
            let delta: Vec<f64> = (0..dv).map(|j| (v[t][j] - mem[j]) * beta[t]).collect();
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] += kn[i] * delta[j];
                }
            }
            outs.push(
                (0..dv)
                    .map(|j| (0..dk).map(|i| s[i * dv + j] * qn[i]).sum())
                    .collect(),
            );
        }
        outs
    }
}

use reference as r;

fn pick<T: Copy>(rng: &mut Rng, xs: &[T]) -> T {
    xs[rng.range(0, xs.len())]
}

// ---- the cases ----

pub fn embed(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (vocab, hidden, tokens) = (c.rng.range(5, 300), 64 * c.rng.range(1, 4), c.rng.range(1, 9));
    let format = pick(
        &mut c.rng,
        &[
            None,
            Some(QuantFormat::Q4),
            Some(QuantFormat::Q8),
            Some(QuantFormat::f32_scales(4, 32)),
            Some(QuantFormat::f32_scales(8, 16)),
        ],
    );
    let dtype = pick(&mut c.rng, &[DType::BF16, DType::F16, DType::F32]);
    let (table, tf) = c.linear_weight("embed", vocab, hidden, format, dtype);
    let ids: Vec<u32> = (0..tokens).map(|_| c.rng.range(0, vocab) as u32).collect();
    let idb = c.g.tokens_input("ids", tokens);
    c.set(idb, bytemuck::cast_slice(&ids).to_vec());
    let out = c.g.embed("embed", &table, idb);
    let expect = ids
        .iter()
        .flat_map(|&i| tf[i as usize * hidden..(i as usize + 1) * hidden].to_vec())
        .collect();
    c.check_floats(out, expect);
    c.finish(format!("embed {vocab}x{hidden} {format:?} {dtype}"))
}

pub fn rms_norm(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (rows, dim) = (c.rng.range(1, 9), c.rng.range(1, 700));
    let kind = pick(&mut c.rng, &[NormKind::Standard, NormKind::ZeroCentered]);
    let dtype = pick(&mut c.rng, &[DType::BF16, DType::F32]);
    // Sometimes written as bf16, for projections that read bf16.
    let out_dtype = pick(&mut c.rng, &[DType::F32, DType::F32, DType::BF16]);
    let (x, xf) = c.residual("x", rows, dim);
    let (w, wf) = c.weight("w", dtype, &[dim], 0.5);
    let out = c.g.rms_norm_to("norm", x, w, 1e-6, kind, out_dtype);
    let want = r::rms_norm(&xf, &wf, dim, 1e-6, kind == NormKind::ZeroCentered);
    match out_dtype {
        DType::BF16 => c.check_bf16(out, want),
        _ => c.check_floats(out, want),
    }
    c.finish(format!("rms_norm {rows}x{dim} {kind:?} {dtype} -> {out_dtype}"))
}

pub fn head_norm(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (tokens, heads, hd) = (
        c.rng.range(1, 7),
        c.rng.range(1, 9),
        pick(&mut c.rng, &[64, 80, 128, 256]),
    );
    let (x, xf) = c.act("x", tokens, heads * hd, 1.0);
    let (w, wf) = c.weight("w", DType::BF16, &[hd], 0.5);
    let out = c.g.head_norm("qnorm", x, w, hd, 1e-6, NormKind::ZeroCentered);
    c.check_floats(out, r::rms_norm(&xf, &wf, hd, 1e-6, true));
    c.finish(format!("head_norm {tokens}x{heads}x{hd}"))
}

pub fn add_rms_norm(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (rows, dim) = (c.rng.range(1, 9), c.rng.range(1, 700));
    let (res, rf) = c.residual("res", rows, dim);
    let (x, xf) = c.act("x", rows, dim, 1.0);
    let (w, wf) = c.weight("w", DType::BF16, &[dim], 0.5);
    let out_dtype = pick(&mut c.rng, &[DType::F32, DType::F32, DType::BF16]);
    let out =
        c.g.add_rms_norm_to("add_norm", res, x, w, 1e-6, NormKind::Standard, out_dtype);
    let sum: Vec<f64> = rf.iter().zip(&xf).map(|(a, b)| a + b).collect();
    let want = r::rms_norm(&sum, &wf, dim, 1e-6, false);
    match out_dtype {
        DType::BF16 => c.check_bf16(out, want),
        _ => c.check_floats(out, want),
    }
    c.g.mark_output(res);
    c.checks.push((res.raw(), Expect::Floats(sum)));
    c.finish(format!("add_rms_norm {rows}x{dim} -> {out_dtype}"))
}

pub fn gated_rms_norm(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (rows, dim) = (c.rng.range(1, 20), pick(&mut c.rng, &[64, 100, 128]));
    let (x, xf) = c.act("x", rows, dim, 1.0);
    let (z, zf) = c.act("z", rows, dim, 2.0);
    let (w, wf) = c.weight("w", DType::F32, &[dim], 0.5);
    let out = c.g.gated_rms_norm("gnorm", x, z, w, dim, 1e-6);
    let n = r::rms_norm(&xf, &wf, dim, 1e-6, false);
    c.check_floats(out, n.iter().zip(&zf).map(|(a, z)| a * r::silu(*z)).collect());
    c.finish(format!("gated_rms_norm {rows}x{dim}"))
}

pub fn rope(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (tokens, heads, hd) = (
        c.rng.range(1, 8),
        c.rng.range(1, 6),
        pick(&mut c.rng, &[64, 128, 256]),
    );
    let partial = pick(&mut c.rng, &[1.0, 0.25, 0.5]);
    let scaling = if c.rng.next_f32() < 0.5 {
        RopeScaling::None
    } else {
        RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        }
    };
    let table = RopeTable::new(1e6, hd, partial, &scaling);
    let (freq, _) = c.weight_from("inv_freq", DType::F32, &[table.rot_dim / 2], &table.inv_freq);
    let start = c.rng.range(0, 40_000) as u32;
    let pos: Vec<u32> = (0..tokens as u32).map(|t| start + t).collect();
    let p = c.positions("pos", &pos);
    let (x, xf) = c.act("x", tokens, heads * hd, 1.0);
    c.g.rope(
        "rope",
        x,
        p,
        freq,
        heads,
        hd,
        table.rot_dim,
        table.attention_scaling,
    );
    let mut expect = xf.clone();
    r::rope(&mut expect, hd, &pos, &table.inv_freq, table.attention_scaling);
    c.check_floats(x, expect);
    c.finish(format!(
        "rope {tokens}x{heads}x{hd} rot {} from {start}",
        table.rot_dim
    ))
}

/// The quantised formats cases draw from: MLX's 4- and 8-bit defaults (groups of 64), 4-bit in
/// groups of 32 and 8-bit in groups of 128; and the two GGUF's block formats load as, with f32
/// scales and biases: 4-bit in groups of 32 (Q4_0, Q4_1, Q4_K) and 8-bit in groups of 16 (Q6_K).
pub const QUANT_FORMATS: [QuantFormat; 6] = [
    QuantFormat::Q4,
    QuantFormat::Q8,
    QuantFormat::mlx(4, 32),
    QuantFormat::mlx(8, 128),
    QuantFormat::f32_scales(4, 32),
    QuantFormat::f32_scales(8, 16),
];

/// The formats a GGUF file's k-quant experts are held in, their scales factored (rows of whole
/// 256-value super-blocks): 4-bit in groups of 32 (Q4_K) and 8-bit in groups of 16 (Q6_K).
pub const FACTORED_FORMATS: [QuantFormat; 2] = [QuantFormat::factored(4, 32), QuantFormat::factored(8, 16)];

pub fn linear(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let [q4, q8, q4g32, q8g128, q4f, q8f] = QUANT_FORMATS;
    let format = pick(
        &mut c.rng,
        &[
            None,
            None,
            Some(q4),
            Some(q8),
            Some(q4g32),
            Some(q8g128),
            Some(q4f),
            Some(q8f),
        ],
    );
    // Quantised: any whole number of groups, or a multiple of 8 groups (what the pipelined
    // one-token kernel needs; other sizes take the general one).
    let in_dim = match format {
        Some(f) if c.rng.range(0, 2) == 0 => 8 * f.group_size * c.rng.range(1, 4),
        Some(f) => f.group_size.max(64) * c.rng.range(1, 12),
        None => c.rng.range(1, 700),
    };
    // 1,100 tokens: a many-token product well past one tile in every dimension. Quantised
    // products of many tokens with whole 64-column tiles take CUDA's tensor-core path.
    let tokens = pick(&mut c.rng, &[1, 1, 2, 5, 17, 1100]);
    let out_dim = if format.is_some() && tokens > 16 && c.rng.range(0, 2) == 0 {
        64 * c.rng.range(1, 10)
    } else {
        c.rng.range(1, 600)
    };
    let in_dim = if tokens > 1000 && format.is_none() {
        8 * c.rng.range(1, 80)
    } else {
        in_dim
    };
    let dtype = pick(&mut c.rng, &[DType::BF16, DType::F16, DType::F32]);
    let (w, wf) = c.linear_weight("w", out_dim, in_dim, format, dtype);
    // Sometimes x as a norm writes it for tensor-core products: bf16.
    let x_bf16 = c.rng.range(0, 3) == 0;
    let (y, xf) = if x_bf16 {
        let (x, xf) = c.normed_bf16("x", tokens, in_dim, 1.0);
        (c.g.linear("proj", x, &w), xf)
    } else {
        let (x, xf) = c.act("x", tokens, in_dim, 1.0);
        (c.g.linear("proj", x, &w), xf)
    };
    c.rounded_activations = format.is_some() || dtype == DType::BF16;
    c.check_floats(y, r::linear(&xf, &wf, in_dim, out_dim));
    let xd = if x_bf16 { " x bf16" } else { "" };
    c.finish(format!(
        "linear {tokens}x{in_dim}->{out_dim} {format:?} {dtype}{xd}"
    ))
}

/// A quantised projection of `tokens` tokens at a given shape, on f32 activations.
pub fn linear_shape(rng: Rng, tokens: usize, (in_dim, out_dim): (usize, usize), format: QuantFormat) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (x, xf) = c.act("x", tokens, in_dim, 1.0);
    c.checked_product(("w", "proj"), (x, &xf), (in_dim, out_dim), format);
    c.finish(format!("linear {tokens}x{in_dim}->{out_dim} {format:?}"))
}

/// One token's RMS norm, with a residual add or without (standard or zero-centred, f32 or bf16
/// weights), and a quantised projection of its output, at rows of up to 4,096 values in whole
/// pieces of 8 groups: the pair CUDA runs as one kernel (`matvec_norm_*_dp4a`). Checks the
/// product, the normed row and the new residual. In a third of the cases a second product reads
/// the normed row too.
pub fn norm_then_linear_decode(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let format = pick(&mut c.rng, &QUANT_FORMATS);
    let unit = (8 * format.group_size).max(64);
    let in_dim = unit * c.rng.range(1, 4096 / unit + 1);
    let out_dim = c.rng.range(1, 700);
    let (normed, nf, norm) = random_norm(&mut c, 1, in_dim);
    c.checked_product(("w", "proj"), (normed, &nf), (in_dim, out_dim), format);
    // A third of the cases give the normed row a second product (as a DeltaNet layer's input
    // products share theirs), which a backend fuses into neither.
    let second = c.rng.range(0, 3) == 0;
    if second {
        // At least 8 outputs: the check is one relative L2 error over them, and of a single
        // output it is the ratio of two random sums, whose tail the int8 bound does not hold
        // (a 1-output product drawn at 0.065 against 6.45 of |w x| missed it by int8 rounding
        // alone, 3.4e-2).
        let other_dim = c.rng.range(8, 40);
        c.checked_product(("w2", "proj2"), (normed, &nf), (in_dim, other_dim), format);
    }
    c.check_floats(normed, nf);
    let and = if second { ", and a second product" } else { "" };
    c.finish(format!(
        "{norm} then linear 1x{in_dim}->{out_dim} {format:?}{and}"
    ))
}

/// A random RMS norm of `tokens` rows of `dim` values for the cases that put products behind
/// it: standard or zero-centred, f32 or bf16 weights, with a residual add (the new residual
/// checked) or without, writing f32. Returns the normed rows, their reference values and the
/// norm's description for the case's name.
fn random_norm(c: &mut CaseBuilder, tokens: usize, dim: usize) -> (BufId<Normed>, Vec<f64>, String) {
    let kind = pick(&mut c.rng, &[NormKind::Standard, NormKind::ZeroCentered]);
    let wdtype = pick(&mut c.rng, &[DType::BF16, DType::F32]);
    let (nw, nwf) = c.weight("norm_w", wdtype, &[dim], 0.5);
    let with_residual = c.rng.range(0, 2) == 0;
    let (normed, rows) = if with_residual {
        let (res, rf) = c.residual("res", tokens, dim);
        let (x, xf) = c.act("x", tokens, dim, 1.0);
        let out =
            c.g.add_rms_norm_to("add_norm", res, x, nw, 1e-6, kind, DType::F32);
        let sum: Vec<f64> = rf.iter().zip(&xf).map(|(a, b)| a + b).collect();
        c.g.mark_output(res);
        c.checks.push((res.raw(), Expect::Floats(sum.clone())));
        (out, sum)
    } else {
        let (x, xf) = c.residual("x", tokens, dim);
        (c.g.rms_norm_to("norm", x, nw, 1e-6, kind, DType::F32), xf)
    };
    let nf = r::rms_norm(&rows, &nwf, dim, 1e-6, kind == NormKind::ZeroCentered);
    let add = if with_residual { "add_" } else { "" };
    (normed, nf, format!("{add}rms_norm {kind:?} {wdtype}"))
}

/// A batched step's few tokens (2 to 15) through an RMS norm, with a residual add or without,
/// read by one or two quantised products, as a batched step's token mixer has them: CUDA stores
/// the normed rows rounded to bf16 when every reader rounds them anyway (the skinny products),
/// so no conversion runs, and in f32 when a reader takes another product (outputs not in whole
/// 16s: in a quarter of the cases the second product's) or the rows are checked too (a third of
/// the cases: an output). Checks the products and the new residual.
pub fn norm_then_linears_few_tokens(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let tokens = c.rng.range(2, 16);
    let format = pick(&mut c.rng, &QUANT_FORMATS);
    let in_dim = 256 * c.rng.range(1, 17);
    let (normed, nf, norm) = random_norm(&mut c, tokens, in_dim);
    let out_dim = 16 * c.rng.range(1, 40);
    c.checked_product(("w", "proj"), (normed, &nf), (in_dim, out_dim), format);
    let second = c.rng.range(0, 2) == 0;
    let mut other = String::new();
    if second {
        let other_dim = if c.rng.range(0, 4) == 0 {
            16 * c.rng.range(1, 20) + c.rng.range(1, 16)
        } else {
            16 * c.rng.range(1, 20)
        };
        c.checked_product(("w2", "proj2"), (normed, &nf), (in_dim, other_dim), format);
        other = format!(" and ->{other_dim}");
    }
    let checked = c.rng.range(0, 3) == 0;
    if checked {
        c.check_floats(normed, nf);
    }
    let rows_checked = if checked { ", normed rows checked" } else { "" };
    c.finish(format!(
        "{norm} then linear {tokens}x{in_dim}->{out_dim}{other} {format:?}{rows_checked}"
    ))
}

/// A few tokens' residual add and RMS norm in front of a router's product and its choice of
/// experts, as a MoE layer of a decode step has them: the three CUDA runs as one kernel, a
/// cluster a token, for up to 8 tokens (`route_norm_*`; 9 tokens take the kernels apart). Router
/// weights 4- or 8-bit with bf16 scales, or dense bf16 or f32. Checks the new residual, the normed
/// row, the logits, the chosen experts and their weights. Drawn again while a choice is a near
/// tie (`clear_choice`).
pub fn norm_then_router(rng: Rng) -> Case {
    redrawn(rng, norm_then_router_drawn)
}

fn norm_then_router_drawn(rng: Rng) -> Option<Case> {
    let mut c = CaseBuilder::new(rng);
    let tokens = pick(&mut c.rng, &[1, 2, 3, 5, 8, 9]);
    let hidden = 64 * c.rng.range(1, 33);
    let experts = pick(&mut c.rng, &[16, 60, 128, 512]);
    let k = c.rng.range(1, 9);
    let format = pick(
        &mut c.rng,
        &[Some(QuantFormat::Q4), Some(QuantFormat::Q8), None, None],
    );
    let dense = pick(&mut c.rng, &[DType::BF16, DType::F32]);
    let kind = pick(&mut c.rng, &[NormKind::Standard, NormKind::ZeroCentered]);
    let wdtype = pick(&mut c.rng, &[DType::BF16, DType::F32]);
    let normalize = c.rng.range(0, 2) == 0;
    let (nw, nwf) = c.weight("norm_w", wdtype, &[hidden], 0.5);
    let (res, rf) = c.residual("res", tokens, hidden);
    let (x, xf) = c.act("x", tokens, hidden, 1.0);
    let normed =
        c.g.add_rms_norm_to("add_norm", res, x, nw, 1e-6, kind, DType::F32);
    let sum: Vec<f64> = rf.iter().zip(&xf).map(|(a, b)| a + b).collect();
    let nf = r::rms_norm(&sum, &nwf, hidden, 1e-6, kind == NormKind::ZeroCentered);
    let (w, wf) = c.linear_weight("gate", experts, hidden, format, dense);
    let logits = c.g.linear("gate", normed, &w);
    let (ids, weights) = c.g.router("router", logits, k, normalize);
    let lf = r::linear(&nf, &wf, hidden, experts);
    let (exp_ids, exp_w) = expected_choice(&lf, experts, k, normalize);
    let clear = clear_choice(&lf, experts, k);
    c.check_floats(logits, lf);
    c.check_ids(ids, exp_ids);
    c.check_floats(weights, exp_w);
    c.check_floats(normed, nf);
    c.g.mark_output(res);
    c.checks.push((res.raw(), Expect::Floats(sum)));
    let weight = format.map_or_else(|| format!("{dense:?}"), |f| format!("{f:?}"));
    let case = c.finish(format!(
        "add_rms_norm {kind:?} {wdtype} then router t{tokens} {hidden}->{experts} top{k} {weight} norm={normalize}"
    ));
    clear.then_some(case)
}

pub fn elementwise(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (rows, groups) = (c.rng.range(1, 6), c.rng.range(1, 5));
    let widths = [c.rng.range(1, 40), c.rng.range(1, 40)];
    let total = widths[0] + widths[1];
    let (x, xf) = c.act("x", rows, groups * total, 1.0);
    let parts = c.g.split("split", x, groups, &widths);
    let part = |k: usize| -> Vec<f64> {
        let off = if k == 0 { 0 } else { widths[0] };
        (0..rows * groups)
            .flat_map(|rg| xf[rg * total + off..rg * total + off + widths[k]].to_vec())
            .collect()
    };
    let (p0, p1) = (part(0), part(1));
    let cols0 = groups * widths[0];
    // sigmoid gate with a one-column gate over part 0, swiglu and add over parts of equal width
    let (gate1, g1f) = c.act("gate1", rows, 1, 2.0);
    let gated = c.g.sigmoid_gate("gate", parts[0], gate1);
    let gated_f: Vec<f64> = p0
        .iter()
        .enumerate()
        .map(|(i, v)| v * r::sigmoid(g1f[i / cols0]))
        .collect();
    let (u, uf) = c.act("u", rows, cols0, 1.0);
    let sw = c.g.swiglu("swiglu", gated, u);
    let sw_f: Vec<f64> = gated_f.iter().zip(&uf).map(|(g, u)| r::silu(*g) * u).collect();
    let (gate_full, gff) = c.act("gate_full", rows, cols0, 2.0);
    let gg = c.g.sigmoid_gate("gate2", sw, gate_full);
    let gg_f: Vec<f64> = sw_f.iter().zip(&gff).map(|(v, g)| v * r::sigmoid(*g)).collect();
    let sum = c.g.add("add", gg, u);
    let sum_f: Vec<f64> = gg_f.iter().zip(&uf).map(|(a, b)| a + b).collect();
    let last = c.g.last_row("last", sum);
    let last_f = sum_f[(rows - 1) * cols0..].to_vec();
    // concatenating the parts back gives x, as [rows * groups, total] rows only when groups == 1
    let cat = c.g.concat("concat", &[parts[1], parts[0]]);
    let cat_f: Vec<f64> = (0..rows)
        .flat_map(|r| {
            let mut row = p1[r * groups * widths[1]..(r + 1) * groups * widths[1]].to_vec();
            row.extend_from_slice(&p0[r * cols0..(r + 1) * cols0]);
            row
        })
        .collect();
    c.check_floats(cat, cat_f);
    c.check_floats(parts[1], p1);
    c.check_floats(sum, sum_f);
    c.check_floats(last, last_f);
    c.finish(format!("split/gates/swiglu/add {rows}x{groups}x{widths:?}"))
}

/// Random pages of KV caches: the tokens of a case, where they go and what the caches hold.
struct PagedTokens {
    pages: KvPages,
    /// Rows of the caches.
    rows: usize,
    /// Each token's sequence and position.
    seq: Vec<usize>,
    pos: Vec<u32>,
    table: Vec<u32>,
}

impl PagedTokens {
    /// Either `tokens` tokens of one sequence after its cached ones (a prefill chunk or a decode
    /// step; the sequence is the last of one or two), or, when `batched`, one token of each of
    /// `tokens` sequences (a batched decode step), each after its own number of cached ones.
    /// Blocks are of a random power-of-two size, dealt from a shuffled pool with a few spare
    /// blocks, so no sequence's rows are contiguous by chance. `long` allows caches of hundreds of
    /// positions.
    fn new(c: &mut CaseBuilder, tokens: usize, batched: bool, long: bool) -> PagedTokens {
        Self::with_chunk(c, tokens, batched.then_some(tokens), long)
    }

    /// With `own: Some(n)`, the first `n` tokens each of its own sequence and the others a chunk
    /// of one more (a mixed step; `n == tokens`: a batched decode step); else as `new` without
    /// `batched`.
    fn with_chunk(c: &mut CaseBuilder, tokens: usize, own: Option<usize>, long: bool) -> PagedTokens {
        Self::with_runs(c, tokens, own, None, false, long)
    }

    /// As `with_chunk`, and with `runs: Some(run)` the tokens past the first `n` are runs of
    /// `run` tokens, each of a sequence of its own (several prompts' chunks). With `joined`,
    /// token `n - 1` is instead the next of the last chunk's sequence, as a prompt's last token
    /// is one of a step's outputs while the rest of its chunk runs in the same step.
    fn with_runs(
        c: &mut CaseBuilder,
        tokens: usize,
        own: Option<usize>,
        runs: Option<usize>,
        joined: bool,
        long: bool,
    ) -> PagedTokens {
        let batched = own.is_some();
        let seqs = match (own, runs) {
            (Some(n), Some(run)) => n + (tokens - n).div_ceil(run),
            (Some(n), None) if n < tokens => n + 1,
            (Some(n), None) => n,
            (None, _) => c.rng.range(1, 3),
        };
        let past: Vec<usize> = (0..seqs)
            .map(|_| {
                if long && c.rng.range(0, 2) == 0 {
                    c.rng.range(0, 700)
                } else {
                    c.rng.range(0, 90)
                }
            })
            .collect();
        let (mut seq, mut pos): (Vec<usize>, Vec<u32>) = if let (Some(n), Some(run)) = (own, runs) {
            (0..tokens)
                .map(|t| match t < n {
                    true => (t, past[t] as u32),
                    false => {
                        let s = n + (t - n) / run;
                        (s, (past[s] + (t - n) % run) as u32)
                    }
                })
                .unzip()
        } else if let Some(n) = own {
            (0..tokens)
                .map(|t| match t < n {
                    true => (t, past[t] as u32),
                    false => (n, (past[n] + t - n) as u32),
                })
                .unzip()
        } else {
            (0..tokens)
                .map(|t| (seqs - 1, (past[seqs - 1] + t) as u32))
                .unzip()
        };
        if let (true, Some(n)) = (joined, own.filter(|&n| n > 0 && n < tokens)) {
            seq[n - 1] = seq[tokens - 1];
            pos[n - 1] = pos[tokens - 1] + 1;
        }
        let len = pos.iter().map(|&p| p as usize + 1).max().unwrap_or(1) + c.rng.range(0, 20);
        let block = pick(&mut c.rng, &[16, 1, 4, 8, 64]);
        let max_blocks = len.div_ceil(block);
        let blocks = seqs * max_blocks + c.rng.range(1, 4);
        let mut pool: Vec<u32> = (0..blocks as u32).collect();
        for i in (1..pool.len()).rev() {
            pool.swap(i, c.rng.range(0, i + 1));
        }
        let table = pool[..seqs * max_blocks].to_vec();
        let t = c.g.page_table_input("kv.table", seqs, max_blocks);
        c.set(t, bytemuck::cast_slice(&table).to_vec());
        let ids: Vec<u32> = if batched {
            seq.iter().map(|&s| s as u32).collect()
        } else {
            vec![(seqs - 1) as u32]
        };
        let sq = c.g.seq_input("kv.seq", ids.len());
        c.set(sq, bytemuck::cast_slice(&ids).to_vec());
        let pages = c.g.kv_pages("kv.pages", t, sq, block);
        PagedTokens {
            pages,
            rows: blocks * block,
            seq,
            pos,
            table,
        }
    }

    /// The cache row of position `p` of sequence `s`.
    fn row(&self, s: usize, p: usize) -> usize {
        let b = self.pages.block;
        self.table[s * self.pages.max_blocks + p / b] as usize * b + p % b
    }

    fn describe(&self) -> String {
        let kind = if self.pages.one_seq {
            "one sequence"
        } else {
            "batched"
        };
        format!("{kind}, blocks of {}, {} rows", self.pages.block, self.rows)
    }
}

/// Pages over caches for `seqs` sequences of `ctx` positions in blocks of `block` rows, every
/// block of every sequence at a random place of the pool (`seqs * ctx` rows): the pages, the
/// caches' rows, and the table's and the sequence ids' buffers with what they must hold (each
/// token of its own sequence when `per_token`, else every token of sequence 0).
pub fn shuffled_pages(
    g: &mut GraphBuilder,
    rng: &mut Rng,
    seqs: usize,
    ctx: usize,
    block: usize,
    per_token: bool,
) -> (KvPages, usize, Vec<(Buf, Vec<u8>)>) {
    let max_blocks = ctx.div_ceil(block);
    let mut table: Vec<u32> = (0..(seqs * max_blocks) as u32).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, rng.range(0, i + 1));
    }
    let ids: Vec<u32> = if per_token {
        (0..seqs as u32).collect()
    } else {
        vec![0]
    };
    let t = g.page_table_input("kv.table", seqs, max_blocks);
    let sq = g.seq_input("kv.seq", ids.len());
    let pages = g.kv_pages("kv.pages", t, sq, block);
    let data = vec![
        (t.raw(), bytemuck::cast_slice(&table).to_vec()),
        (sq.raw(), bytemuck::cast_slice(&ids).to_vec()),
    ];
    (pages, seqs * max_blocks * block, data)
}

/// KV append of new tokens (a chunk of one sequence, or one token of each of several
/// sequences) into paged caches, then causal GQA attention over each token's sequence.
pub fn attention(rng: Rng) -> Case {
    attention_of(rng, None, None)
}

/// [`attention`] of a batched step's own tokens and then several prompts' chunks, in runs of
/// 16 or 8 tokens each of its own sequence (`QueryChunk::run`).
pub fn attention_runs(rng: Rng) -> Case {
    attention_of(rng, Some(2), Some(false))
}

/// [`attention`] with its output read by a quantised product (as a layer's o_proj reads it), the
/// product's result checked and, in a third of the cases, the attention's output too (an output
/// of the program); mostly at the shapes CUDA's decode kernel takes. Where only products that
/// round their input to bf16 read it (the skinny products of 2 to 128 tokens, outputs in whole
/// 16s), that kernel stores it rounded.
pub fn attention_then_product(rng: Rng) -> Case {
    attention_of(rng, None, Some(true))
}

/// `product`: whether a quantised product reads the output (None: in a quarter of the cases, when
/// the row of heads fits an 8- or 4-bit format's groups).
fn attention_of(rng: Rng, kind: Option<usize>, product: Option<bool>) -> Case {
    let mut c = CaseBuilder::new(rng);
    let forced = kind.is_some();
    let kv_heads = c.rng.range(1, 4);
    // Groups above 8 query heads per KV head take several blocks per head on CUDA. Runs mostly
    // take groups whose CUDA flash blocks hold whole tokens of a run (4, 8, 16), and some not.
    let group = match forced {
        true => pick(&mut c.rng, &[8, 4, 16, 3]),
        false => c.rng.range(1, 13),
    };
    let heads = kv_heads * group;
    // 16 and 40: head sizes without a tensor-core kernel, which half caches send to the others.
    // A case read by a product mostly takes the shapes CUDA's decode kernel runs (a token of each
    // of several sequences, half caches, its head dims), where it may store its output rounded.
    let decode_mostly = product == Some(true);
    let hd = match (forced, decode_mostly) {
        (true, _) => pick(&mut c.rng, &[128, 64, 40]),
        (false, true) => pick(&mut c.rng, &[128, 64, 256, 96, 40]),
        (false, false) => pick(&mut c.rng, &[64, 128, 96, 256, 16, 40]),
    };
    // One sequence's tokens, a token of each of several, or a mixed step: tokens of their own
    // sequences, then a chunk of one more (whose queries the op is told share a sequence).
    let kind = kind.unwrap_or_else(|| match decode_mostly && c.rng.range(0, 2) == 0 {
        true => 0,
        false => c.rng.range(0, 4),
    });
    let (tokens, own) = match kind {
        0 => {
            let n = pick(&mut c.rng, &[2, 5, 9]);
            (n, Some(n))
        }
        1 => {
            let n = pick(&mut c.rng, &[1, 2, 5]);
            (n + pick(&mut c.rng, &[3, 19, 70]), Some(n))
        }
        // Several prompts' chunks: runs of 16 (or 8) tokens, each of its own sequence.
        2 if forced || c.rng.range(0, 2) == 0 => {
            let n = pick(&mut c.rng, &[1, 2, 5]);
            (
                n + pick(&mut c.rng, &[2, 3, 5]) * pick(&mut c.rng, &[16, 8]),
                Some(n),
            )
        }
        _ => (pick(&mut c.rng, &[1, 1, 3, 19, 70]), None),
    };
    let runs = match (kind, own) {
        (2, Some(n)) if n < tokens => Some(if (tokens - n) % 16 == 0 { 16 } else { 8 }),
        _ => None,
    };
    let chunk = own.filter(|&n| n < tokens).map(|from| QueryChunk {
        from,
        run: runs.unwrap_or(0),
    });
    // Sometimes a longer cache, so decode spans several tiles and splits.
    let long = own.is_some() || tokens <= 3;
    // Sometimes the last of the step's own tokens ends the chunk's sequence (a prompt's last
    // token among the outputs): it reads rows the step writes for its other tokens.
    let joined = own.is_some_and(|n| n < tokens) && c.rng.range(0, 2) == 0;
    let pt = PagedTokens::with_runs(&mut c, tokens, own, runs, joined, long);
    let rows = pt.rows;
    let dtype = match forced || decode_mostly {
        true => pick(&mut c.rng, &[DType::BF16, DType::F16, DType::BF16, DType::F32]),
        false => pick(&mut c.rng, &[DType::F32, DType::BF16, DType::F16]),
    };
    // Every row holds something: earlier tokens, or rows no token may read.
    let kc = c.randn(kv_heads * rows * hd, 1.0);
    let vc = c.randn(kv_heads * rows * hd, 1.0);
    let kcache = c.g.cache("k_cache", dtype, kv_heads, rows, hd);
    let vcache = c.g.cache("v_cache", dtype, kv_heads, rows, hd);
    let (kb, mut kf) = stored(&kc, dtype);
    let (vb, mut vf) = stored(&vc, dtype);
    c.set(kcache, kb);
    c.set(vcache, vb);
    let (k, knew) = c.act("k", tokens, kv_heads * hd, 1.0);
    let (v, vnew) = c.act("v", tokens, kv_heads * hd, 1.0);
    let (q, qf) = c.act("q", tokens, heads * hd, 1.0);
    let p = c.positions("pos", &pt.pos);
    c.g.kv_append("append", k, v, p, kcache, vcache, pt.pages);
    // Tensor-core attention on half caches rounds queries and probabilities to the cache's type.
    c.rounded_activations = dtype != DType::F32;
    let scale = 1.0 / (hd as f32).sqrt();
    let out =
        c.g.attention_chunked("attn", q, (kcache, vcache), p, pt.pages, heads, scale, chunk);
    // The appended rows as the cache stores them.
    let round = |x: f64| -> f64 {
        match dtype {
            // The inputs are f32 values; the cache rounds from f32 (half's f64 path breaks ties
            // differently).
            DType::BF16 => bf16::from_f32(x as f32).to_f64(),
            DType::F16 => f16::from_f32(x as f32).to_f64(),
            _ => x as f32 as f64,
        }
    };
    for t in 0..tokens {
        let r = pt.row(pt.seq[t], pt.pos[t] as usize);
        for h in 0..kv_heads {
            for d in 0..hd {
                kf[(h * rows + r) * hd + d] = round(knew[(t * kv_heads + h) * hd + d]);
                vf[(h * rows + r) * hd + d] = round(vnew[(t * kv_heads + h) * hd + d]);
            }
        }
    }
    let group = heads / kv_heads;
    let mut expect = vec![0f64; tokens * heads * hd];
    for t in 0..tokens {
        let at: Vec<usize> = (0..=pt.pos[t] as usize).map(|j| pt.row(pt.seq[t], j)).collect();
        for h in 0..heads {
            let kvh = h / group;
            let qv = &qf[(t * heads + h) * hd..][..hd];
            let s: Vec<f64> = at
                .iter()
                .map(|&r| {
                    scale as f64
                        * (0..hd)
                            .map(|d| qv[d] * kf[(kvh * rows + r) * hd + d])
                            .sum::<f64>()
                })
                .collect();
            let p = r::softmax(&s);
            for d in 0..hd {
                expect[(t * heads + h) * hd + d] = at
                    .iter()
                    .zip(&p)
                    .map(|(&r, p)| p * vf[(kvh * rows + r) * hd + d])
                    .sum();
            }
        }
    }
    // The product's format: one whose groups and 16-byte runs tile the row of heads (4-bit: 128
    // values, 8-bit: 64), either when both do.
    let width = heads * hd;
    let fits: Vec<QuantFormat> = [(QuantFormat::Q4, 128), (QuantFormat::Q8, 64)]
        .into_iter()
        .filter(|&(_, unit)| width % unit == 0)
        .map(|(f, _)| f)
        .collect();
    let product = !fits.is_empty() && product.unwrap_or_else(|| c.rng.range(0, 4) == 0);
    let mut read_by = String::new();
    if product {
        let format = pick(&mut c.rng, &fits);
        let out_dim = match c.rng.range(0, 4) {
            0 => 16 * c.rng.range(1, 20) + c.rng.range(1, 16),
            _ => 16 * c.rng.range(1, 20),
        };
        c.checked_product(("o", "o_proj"), (out, &expect), (width, out_dim), format);
        let checked = c.rng.range(0, 3) == 0;
        if checked {
            c.check_floats(out, expect);
        }
        read_by = format!(
            ", read by a {format:?} product ->{out_dim}{}",
            if checked { ", checked too" } else { "" }
        );
    } else {
        c.check_floats(out, expect);
    }
    c.finish(format!(
        "attention t{tokens} at {:?} ({}{}{}) h{heads}/{kv_heads} d{hd} {dtype}{read_by}",
        &pt.pos[..pt.pos.len().min(4)],
        pt.describe(),
        chunk.map_or(String::new(), |q| match q.run {
            0 => format!(", a chunk from token {}", q.from),
            r => format!(", runs of {r} from token {}", q.from),
        }),
        if joined {
            ", its last output token ending the last chunk"
        } else {
            ""
        }
    ))
}

/// Per-head norms, rotation and cache append in one op from a fused q/k/v projection (gated
/// or not), then attention over the caches. q and the gates are checked against the float64
/// reference; f32 caches directly, half ones through the attention that reads them, between
/// backends (a computed key may round to either neighbouring half value).
pub fn attention_inputs(rng: Rng) -> Case {
    attention_inputs_of(rng, Inputs::Any)
}

/// As `attention_inputs`, always 128 tokens or more (of one sequence or of several), where CUDA
/// takes four heads of a token a warp (`attention_inputs_rows_*`) for the head dims and rotations
/// that kernel has, or a head a warp.
pub fn attention_inputs_many(rng: Rng) -> Case {
    attention_inputs_of(rng, Inputs::Many)
}

/// Which tokens an `attention_inputs` case draws.
#[derive(Clone, Copy, PartialEq)]
enum Inputs {
    Any,
    Decode,
    Many,
}

/// As `attention_inputs`, always one token (of one sequence, or of a batched step's pool) on a
/// half cache of up to hundreds of positions, at the head sizes CUDA's decode kernel takes: the
/// pair CUDA runs as one kernel (`decode_attention_inputs_*`).
pub fn attention_inputs_decode(rng: Rng) -> Case {
    attention_inputs_of(rng, Inputs::Decode)
}

fn attention_inputs_of(rng: Rng, kind: Inputs) -> Case {
    let decode = kind == Inputs::Decode;
    let mut c = CaseBuilder::new(rng);
    let kv_heads = c.rng.range(1, 4);
    let heads = kv_heads * c.rng.range(1, 9);
    let hd = match decode {
        true => pick(&mut c.rng, &[64, 128, 256]),
        false => pick(&mut c.rng, &[64, 128, 256, 40]),
    };
    let partial = pick(&mut c.rng, &[1.0, 0.25, 0.5]);
    let batched = c.rng.range(0, 3) == 0;
    // From 128 tokens CUDA takes four heads a warp (or one) rather than a head a block.
    let tokens = match (kind, batched) {
        (Inputs::Decode, _) => 1,
        (Inputs::Many, _) => c.rng.range(128, 300),
        (Inputs::Any, true) => pick(&mut c.rng, &[2, 7, 130]),
        (Inputs::Any, false) => pick(&mut c.rng, &[1, 1, 3, 19, 150]),
    };
    let pt = PagedTokens::new(&mut c, tokens, batched, decode);
    let rows = pt.rows;
    let dtype = match decode {
        true => pick(&mut c.rng, &[DType::BF16, DType::F16]),
        false => pick(&mut c.rng, &[DType::F32, DType::BF16, DType::F16]),
    };
    let gated = c.rng.next_f32() < 0.5;
    let q_stride = if gated { 2 * hd } else { hd };
    let cols = heads * q_stride + 2 * kv_heads * hd;
    let table = RopeTable::new(1e6, hd, partial, &RopeScaling::None);
    let (freq, _) = c.weight_from("inv_freq", DType::F32, &[table.rot_dim / 2], &table.inv_freq);
    let kc = c.randn(kv_heads * rows * hd, 1.0);
    let vc = c.randn(kv_heads * rows * hd, 1.0);
    let kcache = c.g.cache("k_cache", dtype, kv_heads, rows, hd);
    let vcache = c.g.cache("v_cache", dtype, kv_heads, rows, hd);
    let (kb, mut kf) = stored(&kc, dtype);
    let (vb, mut vf) = stored(&vc, dtype);
    c.set(kcache, kb);
    c.set(vcache, vb);
    let (qkv, xf) = c.act("qkv", tokens, cols, 1.0);
    // The parts of each row.
    let (mut qx, mut gx, mut kx, mut vx) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for row in xf.chunks(cols) {
        for h in 0..heads {
            qx.extend_from_slice(&row[h * q_stride..][..hd]);
            if gated {
                gx.extend_from_slice(&row[h * q_stride + hd..][..hd]);
            }
        }
        kx.extend_from_slice(&row[heads * q_stride..][..kv_heads * hd]);
        vx.extend_from_slice(&row[heads * q_stride + kv_heads * hd..][..kv_heads * hd]);
    }
    let kind = pick(&mut c.rng, &[NormKind::Standard, NormKind::ZeroCentered]);
    let norms = if c.rng.next_f32() < 0.7 {
        let wdtype = pick(&mut c.rng, &[DType::BF16, DType::F32]);
        let (qw, qwf) = c.weight("q_norm", wdtype, &[hd], 0.5);
        let (kw, kwf) = c.weight("k_norm", wdtype, &[hd], 0.5);
        let zc = kind == NormKind::ZeroCentered;
        qx = r::rms_norm(&qx, &qwf, hd, 1e-6, zc);
        kx = r::rms_norm(&kx, &kwf, hd, 1e-6, zc);
        Some((qw, kw, 1e-6, kind))
    } else {
        None
    };
    let p = c.positions("pos", &pt.pos);
    let (q, gate) = c.g.attention_inputs(
        "inputs",
        qkv,
        gated,
        norms,
        p,
        freq,
        table.rot_dim,
        table.attention_scaling,
        kcache,
        vcache,
        pt.pages,
    );
    r::rope(&mut qx, hd, &pt.pos, &table.inv_freq, table.attention_scaling);
    r::rope(&mut kx, hd, &pt.pos, &table.inv_freq, table.attention_scaling);
    c.check_floats(q, qx);
    if let Some(g) = gate {
        c.check_floats(g, gx);
    }
    if dtype == DType::F32 {
        for t in 0..tokens {
            let r = pt.row(pt.seq[t], pt.pos[t] as usize);
            for h in 0..kv_heads {
                for d in 0..hd {
                    let at = (h * rows + r) * hd + d;
                    kf[at] = kx[(t * kv_heads + h) * hd + d] as f32 as f64;
                    vf[at] = vx[(t * kv_heads + h) * hd + d] as f32 as f64;
                }
            }
        }
        c.check_floats(kcache, kf);
        c.check_floats(vcache, vf);
    } else {
        c.rounded_activations = true;
        let out = c.g.attention(
            "attn",
            q,
            kcache,
            vcache,
            p,
            pt.pages,
            heads,
            1.0 / (hd as f32).sqrt(),
        );
        c.check_backends(out);
    }
    c.finish(format!(
        "attention_inputs t{tokens} at {:?} ({}) h{heads}/{kv_heads} d{hd} rot {} {dtype} norms {} gated {gated}",
        &pt.pos[..pt.pos.len().min(4)],
        pt.describe(),
        table.rot_dim,
        norms.is_some()
    ))
}

/// Writes `values` (row-major `[rows, cols]`) into an expert span in `format`; returns what the
/// kernels must see.
fn store_matrix(
    span: &mut [u8],
    m: MatrixSpan,
    format: ExpertFormat,
    values: &[f32],
    rows: usize,
    cols: usize,
) -> Vec<f64> {
    match format {
        ExpertFormat::Bf16 => {
            let (bytes, f) = stored(values, DType::BF16);
            span[m.weight..m.weight + bytes.len()].copy_from_slice(&bytes);
            f
        }
        ExpertFormat::Quant(q) => {
            let qm = QuantMatrix::quantize(values, rows, cols, q);
            let (s, b) = qm.group_bytes().expect("the quantiser's scales fit its format");
            let w: &[u8] = bytemuck::cast_slice(&qm.weight);
            span[m.weight..m.weight + w.len()].copy_from_slice(w);
            span[m.scales..m.scales + s.len()].copy_from_slice(&s);
            span[m.biases..m.biases + b.len()].copy_from_slice(&b);
            qm.dequantize().iter().map(|&v| v as f64).collect()
        }
    }
}

/// The experts of one layer: the byte blob and, per expert, (gate, up, down) as f64.
pub type ExpertValues = Vec<(Vec<f64>, Vec<f64>, Vec<f64>)>;

pub fn random_experts(c: &mut CaseBuilder, layout: &ExpertLayout) -> (Vec<u8>, ExpertValues) {
    let mut blob = vec![0u8; layout.total_bytes()];
    let span = layout.span_bytes();
    let (h, i) = (layout.hidden, layout.inter);
    let mut values = Vec::new();
    for e in 0..layout.experts {
        let s = &mut blob[e * span..(e + 1) * span];
        let gv = c.randn(i * h, 1.0 / (h as f32).sqrt());
        let uv = c.randn(i * h, 1.0 / (h as f32).sqrt());
        let dv = c.randn(h * i, 1.0 / (i as f32).sqrt());
        let g = store_matrix(s, layout.gate(), layout.format, &gv, i, h);
        let u = store_matrix(s, layout.up(), layout.format, &uv, i, h);
        let d = store_matrix(s, layout.down_span(), layout.down, &dv, h, i);
        values.push((g, u, d));
    }
    (blob, values)
}

/// Whether every token's k-th largest logit (of `logits`, the f64 reference) lies above its
/// (k+1)-th by more than a relative 1e-4 of the row's largest magnitude. Backends add a logit's
/// terms in f32, each in its own order, so logits nearer than their rounding may be chosen either
/// way (a drawn case had two at 1.2283646 and 1.2283647: the CPU's f32 sums put them one way, the
/// GPU's and f64 the other), while the tests check the choice exactly.
fn clear_choice(logits: &[f64], experts: usize, k: usize) -> bool {
    k >= experts
        || logits.chunks(experts).all(|row| {
            let mut sorted = row.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let scale = sorted.iter().fold(0f64, |m, v| m.max(v.abs()));
            sorted[k - 1] - sorted[k] > 1e-4 * scale
        })
}

/// The first case `build` makes from generators drawn from `rng` (it makes none where a router's
/// choice would be a near tie, `clear_choice`), of 100 draws: past them the generator, not chance,
/// is at fault.
fn redrawn(mut rng: Rng, build: impl Fn(Rng) -> Option<Case>) -> Case {
    for _ in 0..100 {
        if let Some(case) = build(Rng::new(rng.next_u64())) {
            return case;
        }
    }
    panic!("100 draws of a router case in a row held a near tie")
}

/// The expected choice of a router: per token, the top k of the softmax of its logits (the
/// lower index first among equals) and their probabilities, renormalised when asked.
fn expected_choice(logits: &[f64], experts: usize, k: usize, normalize: bool) -> (Vec<u32>, Vec<f64>) {
    let (mut ids, mut weights) = (Vec::new(), Vec::new());
    for l in logits.chunks(experts) {
        let p = r::softmax(l);
        let top = r::top_k(&p, k);
        let total: f64 = top.iter().map(|&i| p[i]).sum();
        for &e in &top {
            ids.push(e as u32);
            weights.push(if normalize { p[e] / total } else { p[e] });
        }
    }
    (ids, weights)
}

/// A router as models build it: its product (bf16, f32 or 4-/8-bit weights; up to 512
/// experts), then the choice. CUDA does a one-token pair in one kernel where it can. Drawn again
/// while a choice is a near tie (`clear_choice`).
pub fn router(rng: Rng) -> Case {
    redrawn(rng, router_drawn)
}

fn router_drawn(rng: Rng) -> Option<Case> {
    let mut c = CaseBuilder::new(rng);
    let (small, large) = (c.rng.range(2, 129), c.rng.range(129, 513));
    let experts = pick(&mut c.rng, &[128, 512, small, large]);
    let k = c.rng.range(1, experts.min(10) + 1);
    let format = pick(
        &mut c.rng,
        &[None, None, Some(QuantFormat::Q4), Some(QuantFormat::Q8)],
    );
    // Rows of any multiple of 8 values (dense) or of whole groups, or of whole 128-value steps.
    let in_dim = match format {
        Some(_) | None if c.rng.range(0, 2) == 0 => 128 * c.rng.range(1, 20),
        Some(f) => f.group_size * c.rng.range(1, 40),
        None => 8 * c.rng.range(1, 300),
    };
    let dtype = pick(&mut c.rng, &[DType::BF16, DType::BF16, DType::F32]);
    // 40 tokens: more than one tile of tokens.
    let tokens = pick(&mut c.rng, &[1, 1, 1, 3, 40]);
    let normalize = c.rng.next_f32() < 0.5;
    let (w, wf) = c.linear_weight("gate", experts, in_dim, format, dtype);
    // Sometimes the residual add and norm in front, as a MoE layer has them (CUDA folds them
    // into its one-token router kernel where they fit).
    let norm = pick(
        &mut c.rng,
        &[None, Some(NormKind::Standard), Some(NormKind::ZeroCentered)],
    );
    let (logits, xf) = match norm {
        None => {
            let (x, xf) = c.act("x", tokens, in_dim, 1.0);
            (c.g.linear("gate", x, &w), xf)
        }
        Some(kind) => {
            let (res, rf) = c.residual("res", tokens, in_dim);
            let (a, af) = c.act("attn", tokens, in_dim, 1.0);
            let nw_dtype = pick(&mut c.rng, &[DType::BF16, DType::F32]);
            let (nw, nwf) = c.weight("ln", nw_dtype, &[in_dim], 0.5);
            let h = c.g.add_rms_norm_to("ln", res, a, nw, 1e-6, kind, DType::F32);
            let sum: Vec<f64> = rf.iter().zip(&af).map(|(x, y)| x + y).collect();
            let hf = r::rms_norm(&sum, &nwf, in_dim, 1e-6, kind == NormKind::ZeroCentered);
            c.g.mark_output(res);
            c.checks.push((res.raw(), Expect::Floats(sum)));
            c.check_floats(h, hf.clone());
            (c.g.linear("gate", h, &w), hf)
        }
    };
    let (ids, weights) = c.g.router("topk", logits, k, normalize);
    let lf = r::linear(&xf, &wf, in_dim, experts);
    let (exp_ids, exp_w) = expected_choice(&lf, experts, k, normalize);
    let clear = clear_choice(&lf, experts, k);
    c.check_floats(logits, lf);
    c.check_ids(ids, exp_ids);
    c.check_floats(weights, exp_w);
    let case = c.finish(format!(
        "router {tokens}x{in_dim} -> top-{k} of {experts} {format:?} {dtype} normalize={normalize} norm={norm:?}"
    ));
    clear.then_some(case)
}

/// A router's product and renormalised choice of `tokens` tokens (`hidden` values, top `k` of
/// `experts`) whose logits nothing else reads, so CUDA may bound them first, with ties planted
/// where the choice is decided: the experts come in pairs (2i, 2i + 1) whose rows are equal
/// (even i) or one step of q apart in one column (odd i), where every token's x is a millionth
/// of its size, so with `k` odd the k-th place usually falls inside a pair. Token 0's x is zeros
/// (every logit ties), token 1's overflows f32 in the product, token 2's holds a NaN. The chosen
/// ids and weights are checked against the other backends only: a near tie may go either way
/// between the CPU and CUDA.
pub fn router_choice(
    rng: Rng,
    tokens: usize,
    (hidden, experts, k): (usize, usize, usize),
    format: QuantFormat,
) -> Case {
    let mut c = CaseBuilder::new(rng);
    let values = c.randn(experts * hidden, 1.0 / (hidden as f32).sqrt());
    let mut m = QuantMatrix::quantize(&values, experts, hidden, format);
    let (words, groups) = (format.words_per_row(hidden), format.groups_per_row(hidden));
    let column = hidden / 3;
    let (vpw, bits) = (format.values_per_word(), format.bits as usize);
    for e in (1..experts).step_by(2) {
        m.weight.copy_within((e - 1) * words..e * words, e * words);
        m.scales.copy_within((e - 1) * groups..e * groups, e * groups);
        m.biases.copy_within((e - 1) * groups..e * groups, e * groups);
        if e % 4 == 3 {
            let q = m.q(e, column);
            let nudged = if q == 0 { 1 } else { q - 1 };
            let (word, shift) = (e * words + column / vpw, bits * (column % vpw));
            m.weight[word] = (m.weight[word] & !(((1u32 << bits) - 1) << shift)) | (nudged << shift);
        }
    }
    let w = c.quant_weight("gate", &m);
    let mut x = c.randn(tokens * hidden, 1.0);
    for t in 0..tokens {
        x[t * hidden + column] *= 1e-6;
    }
    x[..hidden].fill(0.0);
    if tokens > 2 {
        x[hidden..2 * hidden].iter_mut().for_each(|v| *v *= 1e37);
        x[2 * hidden + 7] = f32::NAN;
    }
    let xb = c.g.act_input("x", tokens, hidden);
    c.set(xb, bytemuck::cast_slice(&x).to_vec());
    let logits = c.g.linear("gate", xb, &w);
    let (ids, weights) = c.g.router("topk", logits, k, true);
    c.check_backends(ids);
    c.check_backends(weights);
    c.finish(format!(
        "router choice of {tokens} tokens, {hidden} -> top-{k} of {experts}, {format:?}"
    ))
}

/// The routed experts of a MoE layer on random shapes: their router's choice from given logits
/// or, for one token, sometimes with the router's product in front, as models build it (CUDA
/// then does the product and the choice as one kernel where it can).
pub fn moe(rng: Rng) -> Case {
    redrawn(rng, moe_drawn)
}

fn moe_drawn(rng: Rng) -> Option<Case> {
    let mut c = CaseBuilder::new(rng);
    let experts = c.rng.range(2, 17);
    let k = c.rng.range(1, experts.min(8) + 1);
    let format = pick(
        &mut c.rng,
        &[
            ExpertFormat::Bf16,
            ExpertFormat::Quant(QuantFormat::Q4),
            ExpertFormat::Quant(QuantFormat::Q8),
            ExpertFormat::Quant(QuantFormat::f32_scales(4, 32)),
            ExpertFormat::Quant(QuantFormat::f32_scales(8, 16)),
            ExpertFormat::Quant(FACTORED_FORMATS[0]),
            ExpertFormat::Quant(FACTORED_FORMATS[1]),
        ],
    );
    let (hidden, inter) = match format {
        // Factored scales take rows of whole super-blocks.
        ExpertFormat::Quant(q) if q.scale == ScaleType::Factored => {
            (256 * c.rng.range(1, 5), 256 * c.rng.range(1, 3))
        }
        // Sometimes whole 64-wide tiles, so many-token bf16 experts take the grouped GEMMs.
        ExpertFormat::Bf16 if c.rng.range(0, 2) == 0 => (64 * c.rng.range(1, 4), 64 * c.rng.range(1, 3)),
        ExpertFormat::Bf16 => (8 * c.rng.range(1, 25), 8 * c.rng.range(1, 19)),
        // Odd and even numbers of groups a row, rows shorter and longer than 32 vectors.
        ExpertFormat::Quant(_) => (64 * c.rng.range(1, 21), 64 * c.rng.range(1, 5)),
    };
    // 33 and 300 tokens take CUDA's grouped GEMMs (300: experts with more than one row tile).
    let tokens = pick(&mut c.rng, &[1, 1, 4, 33, 300]);
    let normalize = c.rng.next_f32() < 0.5;
    // A quantised router product only where its rows are whole groups (bf16 experts' hidden
    // size may not be).
    let router = (tokens == 1 && c.rng.range(0, 2) == 0).then(|| {
        pick(&mut c.rng, &[None, Some(QuantFormat::Q4), Some(QuantFormat::Q8)]).filter(|q| q.fits(hidden))
    });
    // Sometimes down in a format of its own, as a GGUF Q4_K_M file's Q6_K down beside Q4_K gate
    // and up (and MLX's 4-bit beside 8-bit), or 4 bits beside 8-bit gate and up.
    let other = |q: QuantFormat| {
        [
            (QuantFormat::f32_scales(4, 32), QuantFormat::f32_scales(8, 16)),
            (QuantFormat::Q4, QuantFormat::Q8),
            (FACTORED_FORMATS[0], FACTORED_FORMATS[1]),
        ]
        .into_iter()
        .find_map(|(a, b)| (q == a).then_some(b).or((q == b).then_some(a)))
    };
    let down = match format {
        ExpertFormat::Quant(q) if c.rng.range(0, 2) == 0 => other(q).map_or(format, ExpertFormat::Quant),
        _ => format,
    };
    let layout = ExpertLayout {
        down,
        ..ExpertLayout::uniform(experts, hidden, inter, format)
    };
    moe_case(c, layout, tokens, k, normalize, router)
}

/// One MoE layer's experts at the shape of Qwen3-30B-A3B (hidden 2048, expert width 768, top-8,
/// 4-bit experts in groups of 64) for one token, the router's 8-bit product in front, with 32
/// experts instead of 128 so the CPU reference stays quick.
pub fn moe_decode_model_shape(rng: Rng) -> Case {
    let layout = ExpertLayout::uniform(32, 2048, 768, ExpertFormat::Quant(QuantFormat::Q4));
    let router = Some(Some(QuantFormat::Q8));
    redrawn(rng, |r| moe_case(CaseBuilder::new(r), layout, 1, 8, true, router))
}

/// `moe_decode_model_shape` with a GGUF Q4_K_M file's experts: gate and up as Q4_K, down as
/// Q6_K, their scales factored, behind a dense router (f32 as such files hold it, or bf16).
pub fn moe_decode_gguf_shape(rng: Rng) -> Case {
    let layout = ExpertLayout {
        down: ExpertFormat::Quant(FACTORED_FORMATS[1]),
        ..ExpertLayout::uniform(32, 2048, 768, ExpertFormat::Quant(FACTORED_FORMATS[0]))
    };
    redrawn(rng, |r| {
        moe_case(CaseBuilder::new(r), layout, 1, 8, true, Some(None))
    })
}

/// One MoE layer's experts as wide as Qwen3.5-397B-A17B's (expert width 1,024, top-10, 4-bit in
/// groups of 64) for one token, the router's 8-bit product in front; hidden 1,024 and 24 experts
/// so the CPU reference stays quick. A row of `down` has 10 x 32 (slot, vector) pairs: more than
/// CUDA's one-token kernel loads in one round.
pub fn moe_decode_wide_shape(rng: Rng) -> Case {
    let layout = ExpertLayout::uniform(24, 1024, 1024, ExpertFormat::Quant(QuantFormat::Q4));
    let router = Some(Some(QuantFormat::Q8));
    redrawn(rng, |r| {
        moe_case(CaseBuilder::new(r), layout, 1, 10, true, router)
    })
}

/// Routed experts of several tokens at a shape CUDA's skinny products take in each of their
/// forms: 32 experts, top-8, hidden 1,024 and expert width 640; `tokens` sets the rows an expert
/// gets on average (2: a half, 12: 3, 30: 7.5, 80: 20, 120: 30, 170: 42.5), and with them the row tiles a
/// warp or warpgroup takes and whether warps split K. Up to 80 tokens the router's 8-bit product
/// is in front, as a batched step runs it; beyond, the router takes given logits, since the
/// backends' f32 sums of that product differ in their last bits and, over a thousand choices, a
/// near-tie for the eighth place falls the other way now and then (one in 960 was seen; cases
/// with such a tie are now drawn again, `clear_choice`, which over hundreds of tokens would
/// redraw often).
/// Gate and up in `format`, down in `down`; with factored scales, whose rows are whole 256-value
/// super-blocks, an expert width of 768.
pub fn moe_batch_shape(rng: Rng, tokens: usize, format: QuantFormat, down: QuantFormat) -> Case {
    let factored = [format, down].iter().any(|f| f.scale == ScaleType::Factored);
    let inter = if factored { 768 } else { 640 };
    let layout = ExpertLayout {
        down: ExpertFormat::Quant(down),
        ..ExpertLayout::uniform(32, 1024, inter, ExpertFormat::Quant(format))
    };
    let router = (tokens <= 80).then_some(Some(QuantFormat::Q8));
    redrawn(rng, |r| {
        moe_case(CaseBuilder::new(r), layout, tokens, 8, true, router)
    })
}

/// Router logits of `tokens` tokens at Qwen3-30B-A3B's router shape (2,048 → 128, `format`
/// weights, or dense ones in `dense`: bf16 as a bf16 checkpoint's, f32 as a GGUF file's) in
/// front of the choice of 8, so a backend computes them as precisely as a choice needs (the
/// choice itself is not checked: near-ties may fall either way between backends); checked
/// against the reference. The weight is drawn before x: cases of one seed share it, whatever
/// their number of tokens.
pub fn router_shape(rng: Rng, tokens: usize, format: Option<QuantFormat>, dense: DType) -> Case {
    let mut c = CaseBuilder::new(rng);
    let (hidden, experts, k) = (2048, 128, 8);
    let (w, wf) = c.linear_weight("gate", experts, hidden, format, dense);
    let (x, xf) = c.act("x", tokens, hidden, 1.0);
    let logits = c.g.linear("gate", x, &w);
    c.g.router("router", logits, k, true);
    c.check_floats(logits, r::linear(&xf, &wf, hidden, experts));
    let weight = format.map_or_else(|| format!("{dense:?}"), |f| format!("{f:?}"));
    c.finish(format!("router logits of {tokens} tokens, {weight}"))
}

/// `router`: None takes random logits; Some(format) computes them from x with a router weight
/// of that format (None: bf16).
fn moe_case(
    mut c: CaseBuilder,
    layout: ExpertLayout,
    tokens: usize,
    k: usize,
    normalize: bool,
    router: Option<Option<QuantFormat>>,
) -> Option<Case> {
    let (experts, hidden, inter, format) = (layout.experts, layout.hidden, layout.inter, layout.format);
    let (x, xf) = c.act("x", tokens, hidden, 1.0);
    let (ids, weights, lf) = match router {
        None => {
            let (logits, lf) = c.act("router_logits", tokens, experts, 2.0);
            let (ids, weights) = c.g.router("router", logits, k, normalize);
            (ids, weights, lf)
        }
        Some(rf) => {
            // A dense router in bf16 (MLX, transformers) or f32 (GGUF).
            let dtype = if rf.is_none() && c.rng.range(0, 2) == 0 {
                DType::F32
            } else {
                DType::BF16
            };
            let (w, wf) = c.linear_weight("gate", experts, hidden, rf, dtype);
            let logits = c.g.linear("gate", x, &w);
            let (ids, weights) = c.g.router("router", logits, k, normalize);
            let lf = r::linear(&xf, &wf, hidden, experts);
            // The backends compute these logits each in its own order: a near tie could go
            // either way (given logits are the same f32 values on both).
            if !clear_choice(&lf, experts, k) {
                return None;
            }
            c.check_floats(logits, lf.clone());
            (ids, weights, lf)
        }
    };
    let (blob, ev) = random_experts(&mut c, &layout);
    let eb = c.g.weight("experts", DType::U8, [layout.total_bytes()]);
    c.set(eb, blob);
    let out = c.g.moe_experts("experts", x, ids, weights, eb, layout);
    // CUDA rounds activations to int8 for quantised experts on one token, and to bf16 for the
    // skinny products and grouped tensor-core GEMMs of several.
    c.rounded_activations = format != ExpertFormat::Bf16 || tokens >= 16;
    let (exp_ids, exp_w) = expected_choice(&lf, experts, k, normalize);
    let mut expect = vec![0f64; tokens * hidden];
    for t in 0..tokens {
        for j in 0..k {
            let (e, w) = (exp_ids[t * k + j] as usize, exp_w[t * k + j]);
            let xt = &xf[t * hidden..(t + 1) * hidden];
            let (g, u, d) = &ev[e];
            let gx = r::linear(xt, g, hidden, inter);
            let ux = r::linear(xt, u, hidden, inter);
            let act: Vec<f64> = gx.iter().zip(&ux).map(|(g, u)| r::silu(*g) * u).collect();
            let y = r::linear(&act, d, inter, hidden);
            for (o, y) in expect[t * hidden..(t + 1) * hidden].iter_mut().zip(y) {
                *o += w * y;
            }
        }
    }
    c.check_ids(ids, exp_ids);
    c.check_floats(weights, exp_w);
    c.check_floats(out, expect);
    let product = match router {
        None => String::new(),
        Some(f) => format!(" router product {f:?}"),
    };
    Some(c.finish(format!(
        "moe t{tokens} top{k}/{experts} {hidden}x{inter} {format:?} norm={normalize}{product}"
    )))
}

/// Conv1d from a random state, the gates, and the delta rule from a random state with `algo`:
/// states of one row, or a row per sequence with the tokens one sequence's chunk (from a row
/// picked at random) or each the next of its own sequence (a batched decode step, rows shuffled).
pub fn deltanet(rng: Rng, algo: DeltaAlgo) -> Case {
    let mut c = CaseBuilder::new(rng);
    let k_heads = c.rng.range(1, 3);
    let v_heads = k_heads * c.rng.range(1, 3);
    // 64 and 128 (the models' key size) take CUDA's register-state kernel, the others the
    // shared-memory one; value sizes not a multiple of 32 leave a partial column block.
    let (dk, dv) = (
        pick(&mut c.rng, &[16, 48, 64, 128]),
        pick(&mut c.rng, &[16, 40, 72, 128]),
    );
    // 0: one row; 1: one sequence's chunk among several rows; 2: a token per sequence.
    let mode = c.rng.range(0, 3);
    let tokens = if mode == 2 {
        pick(&mut c.rng, &[1, 3, 7])
    } else {
        pick(&mut c.rng, &[1, 5, 7, 64, 70, 100])
    };
    let seqs = match mode {
        0 => 1,
        1 => c.rng.range(2, 5),
        _ => tokens + c.rng.range(0, 3),
    };
    let mut order: Vec<usize> = (0..seqs).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, c.rng.range(0, i + 1));
    }
    // (row, its tokens in order)
    let runs: Vec<(usize, Vec<usize>)> = match mode {
        0 => vec![(0, (0..tokens).collect())],
        1 => vec![(order[0], (0..tokens).collect())],
        _ => (0..tokens).map(|t| (order[t], vec![t])).collect(),
    };
    let rows = match mode {
        0 => None,
        _ => {
            let ids: Vec<u32> = if mode == 1 {
                vec![order[0] as u32]
            } else {
                order[..tokens].iter().map(|&r| r as u32).collect()
            };
            let seq = c.g.seq_input("seq", ids.len());
            c.set(seq, bytemuck::cast_slice(&ids).to_vec());
            Some(c.g.state_rows(seq, seqs))
        }
    };
    let kernel = 4;
    let hist = kernel - 1;
    let channels = 2 * k_heads * dk + v_heads * dv;
    let (x, xf) = c.act("mixed", tokens, channels, 1.0);
    let (w, wf) = c.weight("conv", DType::BF16, &[channels, kernel], 0.5);
    let (cs, csf) = c.state("conv_state", &[seqs, channels, hist], 1.0);
    let conv = c.g.causal_conv1d("conv", x, w, cs, rows);
    let parts =
        c.g.split("qkv", conv, 1, &[k_heads * dk, k_heads * dk, v_heads * dv]);
    let (a, af) = c.act("a", tokens, v_heads, 1.0);
    let (b, bf) = c.act("b", tokens, v_heads, 1.0);
    // Checkpoints mix dtypes here (A_log in f32, dt_bias in bf16 is common).
    let (ad, dd) = (
        pick(&mut c.rng, &[DType::F32, DType::BF16]),
        pick(&mut c.rng, &[DType::F32, DType::BF16, DType::F16]),
    );
    let (alog, alf) = c.weight("A_log", ad, &[v_heads], 1.0);
    let (dt, dtf) = c.weight("dt_bias", dd, &[v_heads], 1.0);
    let (g, beta) = c.g.delta_gates("gates", a, b, alog, dt);
    let (st, stf) = c.state("state", &[seqs, v_heads, dk, dv], 0.3);
    let out = c.g.delta_rule(
        "delta", parts[0], parts[1], parts[2], g, beta, st, rows, k_heads, dk, v_heads, dv, algo,
    );

    // conv reference, run by run from each run's row
    let mut conv_f = vec![0f64; tokens * channels];
    let mut new_cs = csf.clone();
    for (row, ts) in &runs {
        let cs_row = &mut new_cs[row * channels * hist..(row + 1) * channels * hist];
        for ch in 0..channels {
            let seq: Vec<f64> = cs_row[ch * hist..(ch + 1) * hist]
                .iter()
                .copied()
                .chain(ts.iter().map(|&t| xf[t * channels + ch]))
                .collect();
            for (i, &t) in ts.iter().enumerate() {
                conv_f[t * channels + ch] =
                    r::silu((0..kernel).map(|j| wf[ch * kernel + j] * seq[i + j]).sum());
            }
            cs_row[ch * hist..(ch + 1) * hist].copy_from_slice(&seq[seq.len() - hist..]);
        }
    }
    let gf: Vec<f64> = (0..tokens * v_heads)
        .map(|i| -alf[i % v_heads].exp() * r::softplus(af[i] + dtf[i % v_heads]))
        .collect();
    let betaf: Vec<f64> = bf.iter().map(|&b| r::sigmoid(b)).collect();
    let mut state = stf.clone();
    let mut expect = vec![0f64; tokens * v_heads * dv];
    let ratio = v_heads / k_heads;
    let size = v_heads * dk * dv;
    for (row, ts) in &runs {
        for h in 0..v_heads {
            let kh = h / ratio;
            let qs: Vec<Vec<f64>> = ts
                .iter()
                .map(|&t| conv_f[t * channels + kh * dk..][..dk].to_vec())
                .collect();
            let ks: Vec<Vec<f64>> = ts
                .iter()
                .map(|&t| conv_f[t * channels + k_heads * dk + kh * dk..][..dk].to_vec())
                .collect();
            let vs: Vec<Vec<f64>> = ts
                .iter()
                .map(|&t| conv_f[t * channels + 2 * k_heads * dk + h * dv..][..dv].to_vec())
                .collect();
            let gh: Vec<f64> = ts.iter().map(|&t| gf[t * v_heads + h]).collect();
            let bh: Vec<f64> = ts.iter().map(|&t| betaf[t * v_heads + h]).collect();
            let at = row * size + h * dk * dv;
            let outs = r::delta_head(&qs, &ks, &vs, &gh, &bh, &mut state[at..at + dk * dv], dk, dv);
            for (&t, o) in ts.iter().zip(&outs) {
                expect[(t * v_heads + h) * dv..][..dv].copy_from_slice(o);
            }
        }
    }
    c.check_floats(conv, conv_f);
    c.check_floats(g, gf);
    c.check_floats(beta, betaf);
    c.check_floats(out, expect);
    c.checks.push((cs.raw(), Expect::Floats(new_cs)));
    c.checks.push((st.raw(), Expect::Floats(state)));
    let kind = ["one row", "one sequence of several", "a token per sequence"][mode];
    c.finish(format!(
        "deltanet t{tokens} heads {k_heads}/{v_heads} dk{dk} dv{dv} {algo:?}, {kind} ({seqs} rows)"
    ))
}

pub fn head(rng: Rng) -> Case {
    let mut c = CaseBuilder::new(rng);
    // Sometimes a vocabulary's length, which CUDA's argmax spreads over many blocks.
    let vocab = if c.rng.next_f32() < 0.5 {
        c.rng.range(2, 5000)
    } else {
        c.rng.range(8000, 160_000)
    };
    let (rows, k) = (c.rng.range(1, 5), c.rng.range(1, 9));
    let k = k.min(vocab);
    let values = c.randn(rows * vocab, 3.0);
    let lg = c.g.logits_input("logits", rows, vocab);
    c.set(lg, bytemuck::cast_slice(&values).to_vec());
    let am = c.g.argmax("argmax", lg);
    let (ids, vals) = c.g.top_k("topk", lg, k);
    let vf: Vec<f64> = values.iter().map(|&v| v as f64).collect();
    let mut am_e = Vec::new();
    let (mut ids_e, mut vals_e) = (Vec::new(), Vec::new());
    for row in vf.chunks(vocab) {
        let t = r::top_k(row, k);
        am_e.push(t[0] as u32);
        ids_e.extend(t.iter().map(|&i| i as u32));
        vals_e.extend(t.iter().map(|&i| row[i]));
    }
    c.check_ids(am, am_e);
    c.check_ids(ids, ids_e);
    c.check_floats(vals, vals_e);
    c.finish(format!("argmax/top-{k} {rows}x{vocab}"))
}

/// Every case family with a fresh random draw.
pub fn all_cases(rng: &mut Rng) -> Vec<Case> {
    let mut seed = || Rng::new(rng.next_u64());
    vec![
        embed(seed()),
        rms_norm(seed()),
        head_norm(seed()),
        add_rms_norm(seed()),
        gated_rms_norm(seed()),
        norm_then_linear_decode(seed()),
        norm_then_linears_few_tokens(seed()),
        norm_then_router(seed()),
        rope(seed()),
        linear(seed()),
        elementwise(seed()),
        attention(seed()),
        attention_runs(seed()),
        attention_inputs(seed()),
        router(seed()),
        moe(seed()),
        deltanet(seed(), DeltaAlgo::Recurrent),
        deltanet(seed(), DeltaAlgo::Chunked { chunk: 16 }),
        deltanet(seed(), DeltaAlgo::Auto),
        head(seed()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The router cases whose logits both backends compute hold no near tie at the k-th place:
    /// every token's k-th largest reference logit lies clear of its (k+1)-th. Over these seeds a
    /// draw without `redrawn` would hold one now and then (`clear_choice` rejects some). (The MoE
    /// cases go through the same `redrawn`; their experts' references take too long to draw here
    /// in numbers.)
    #[test]
    fn router_cases_are_drawn_clear_of_near_ties() {
        let mut rejected = 0;
        for seed in 0..200u64 {
            let case = match seed % 2 {
                0 => norm_then_router(Rng::new(seed + 1)),
                _ => router(Rng::new(seed + 1)),
            };
            rejected += usize::from(norm_then_router_drawn(Rng::new(seed + 1)).is_none());
            let (logits, experts, k) = case
                .graph
                .nodes
                .iter()
                .find_map(|n| match n.op {
                    Op::Router {
                        logits, experts, k, ..
                    } => Some((logits, experts, k)),
                    _ => None,
                })
                .expect("a router");
            let reference = case.checks.iter().find_map(|c| match &c.expect {
                Expect::Floats(v) if c.buf == logits => Some(v.clone()),
                _ => None,
            });
            let reference = reference.expect("the logits are checked");
            assert!(clear_choice(&reference, experts, k), "seed {seed}: {}", case.name);
        }
        assert!(rejected > 0, "no draw was rejected: the check may not run");
    }

    /// A product's outputs are measured against their terms' scale only where they are smaller
    /// than it, and a wide product's outputs have that scale.
    #[test]
    fn products_are_measured_against_their_terms() {
        let (got, want) = ([0.11f32, -0.09], [0.1, -0.1]);
        assert!((rel_l2(&got, &want) - 0.1).abs() < 1e-6);
        assert!((rel_l2_over(&got, &want, Some(1.0)) - 0.01).abs() < 1e-6);
        assert_eq!(rel_l2_over(&got, &want, Some(0.01)), rel_l2(&got, &want));
        let mut wide = 0;
        for seed in 0..40u64 {
            let case = norm_then_linear_decode(Rng::new(seed + 1));
            for check in &case.checks {
                let (Expect::Floats(v), Some(t)) = (&check.expect, check.term_rms) else {
                    continue;
                };
                if v.len() >= 100 {
                    let rms = (v.iter().map(|y| y * y).sum::<f64>() / v.len() as f64).sqrt();
                    assert!((0.7..1.4).contains(&(rms / t)), "seed {seed}: {rms} against {t}");
                    wide += 1;
                }
            }
        }
        assert!(wide > 20, "{wide} wide products drawn");
    }
}
