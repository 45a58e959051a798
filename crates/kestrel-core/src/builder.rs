//! [`GraphBuilder`]: builds a [`Graph`] op by op with typed buffer ids, creating each op's
//! output buffer and checking shapes as it goes. The first inconsistency is kept and returned
//! by [`GraphBuilder::finish`], so building code stays free of error plumbing.

use crate::dtype::DType;
use crate::ir::*;
use crate::quant::{QuantFormat, ScaleType};

#[derive(Debug, Default)]
pub struct GraphBuilder {
    bufs: Vec<BufDecl>,
    nodes: Vec<Node>,
    error: Option<GraphError>,
}

impl GraphBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    fn declare<R: Role>(&mut self, label: &str, dtype: DType, shape: Vec<usize>, kind: BufKind) -> BufId<R> {
        self.bufs.push(BufDecl {
            label: label.to_string(),
            dtype,
            shape,
            kind,
        });
        BufId::<R>::from_raw(Buf(self.bufs.len() as u32 - 1))
    }

    fn transient<R: Role>(&mut self, label: &str, dtype: DType, shape: Vec<usize>) -> BufId<R> {
        self.declare(label, dtype, shape, BufKind::Transient)
    }

    fn push(&mut self, label: &str, op: Op) {
        self.nodes.push(Node {
            label: label.to_string(),
            op,
        });
    }

    fn fail(&mut self, node: &str, reason: String) {
        if self.error.is_none() {
            self.error = Some(GraphError {
                node: node.to_string(),
                reason,
            });
        }
    }

    /// Records an error unless `ok`.
    fn check(&mut self, node: &str, ok: bool, reason: impl FnOnce() -> String) {
        if !ok {
            self.fail(node, reason());
        }
    }

    pub fn decl(&self, b: impl Into<Buf>) -> &BufDecl {
        &self.bufs[b.into().index()]
    }

    /// `[rows, cols]` of a buffer viewed as a matrix whose rows are its last dimension.
    pub fn rows_cols(&self, b: impl Into<Buf>) -> (usize, usize) {
        let d = self.decl(b);
        let cols = d.shape.last().copied().unwrap_or(1);
        (d.elem_count() / cols.max(1), cols)
    }

    fn check_cols(&mut self, node: &str, b: impl Into<Buf>, cols: usize) {
        let b = b.into();
        let (_, c) = self.rows_cols(b);
        let label = self.decl(b).label.clone();
        self.check(node, c == cols, || {
            format!("{label} has {c} columns, expected {cols}")
        });
    }

    fn check_dtype(&mut self, node: &str, b: impl Into<Buf>, ok: &[DType]) {
        let d = self.decl(b).clone();
        self.check(node, ok.contains(&d.dtype), || {
            format!("{} is {}, expected one of {ok:?}", d.label, d.dtype)
        });
    }

    fn check_len(&mut self, node: &str, b: impl Into<Buf>, len: usize) {
        let d = self.decl(b).clone();
        self.check(node, d.elem_count() == len, || {
            format!("{} holds {} elements, expected {len}", d.label, d.elem_count())
        });
    }

    // ---- declarations ----

    pub fn weight(&mut self, label: &str, dtype: DType, shape: impl Into<Vec<usize>>) -> BufId<Weight> {
        self.declare(label, dtype, shape.into(), BufKind::Weight)
    }

    /// A dense `[rows, cols]` projection weight.
    pub fn dense_weight(&mut self, label: &str, dtype: DType, rows: usize, cols: usize) -> LinearWeight {
        LinearWeight::Dense(self.weight(label, dtype, [rows, cols]))
    }

    /// A quantised `[rows, cols]` projection weight: `{label}.weight`, `.scales`, `.biases`.
    pub fn quant_weight(
        &mut self,
        label: &str,
        rows: usize,
        cols: usize,
        format: QuantFormat,
    ) -> LinearWeight {
        if !format.fits(cols) {
            self.fail(label, format!("{cols} columns do not fit {format:?}"));
        }
        if format.scale == ScaleType::Factored {
            self.fail(
                label,
                "factored group scales are held by routed experts only".to_string(),
            );
        }
        let scale = scale_dtype(format.scale);
        LinearWeight::Quant {
            weight: self.weight(
                &format!("{label}.weight"),
                DType::U32,
                [rows, format.words_per_row(cols)],
            ),
            scales: self.weight(
                &format!("{label}.scales"),
                scale,
                [rows, format.groups_per_row(cols)],
            ),
            biases: self.weight(
                &format!("{label}.biases"),
                scale,
                [rows, format.groups_per_row(cols)],
            ),
            format,
        }
    }

    /// A buffer of `bytes` of expert spans that the host fills while a run goes on (a cache of
    /// experts streamed in): `moe_experts` reads it as its experts, but it is a state, shared by
    /// label and never uploaded as a weight.
    pub fn expert_cache(&mut self, label: &str, bytes: usize) -> BufId<Weight> {
        self.declare(label, DType::U8, vec![bytes], BufKind::State)
    }

    /// A weight of `bytes` bytes kept in host memory that the device reads in place (a streamed
    /// layer's packed experts, which `expert_fetch` and `expert_stage` copy from).
    pub fn host_weight(&mut self, label: &str, bytes: usize) -> BufId<Weight> {
        self.declare(label, DType::U8, vec![bytes], BufKind::HostWeight)
    }

    pub fn state(&mut self, label: &str, dtype: DType, shape: impl Into<Vec<usize>>) -> BufId<State> {
        self.declare(label, dtype, shape.into(), BufKind::State)
    }

    /// A key or value cache of `rows` rows, `[kv_heads, rows, head_dim]` (f32, bf16 or f16),
    /// read through [`KvPages`].
    pub fn cache(
        &mut self,
        label: &str,
        dtype: DType,
        kv_heads: usize,
        rows: usize,
        head_dim: usize,
    ) -> BufId<Cache> {
        self.check(
            label,
            matches!(dtype, DType::F32 | DType::BF16 | DType::F16),
            || format!("cache dtype {dtype}"),
        );
        self.declare(label, dtype, vec![kv_heads, rows, head_dim], BufKind::State)
    }

    /// The block table of `seqs` sequences of up to `max_blocks` blocks, written by the host.
    pub fn page_table_input(&mut self, label: &str, seqs: usize, max_blocks: usize) -> BufId<PageTable> {
        self.declare(label, DType::U32, vec![seqs, max_blocks], BufKind::Input)
    }

    /// The sequence of each of `n` tokens (or, with `n` 1, of every token), written by the host.
    pub fn seq_input(&mut self, label: &str, n: usize) -> BufId<SeqIds> {
        self.declare(label, DType::U32, vec![n], BufKind::Input)
    }

    /// The pages of caches of `block`-row blocks (a power of two) through `table`, each token's
    /// sequence in `seq` (one entry: every token's).
    pub fn kv_pages(
        &mut self,
        name: &str,
        table: BufId<PageTable>,
        seq: BufId<SeqIds>,
        block: usize,
    ) -> KvPages {
        let t = self.decl(table).shape.clone();
        self.check(name, t.len() == 2 && t[0] > 0 && t[1] > 0, || {
            format!("block table of shape {t:?}")
        });
        self.check(name, block.is_power_of_two(), || {
            format!("blocks of {block} rows")
        });
        self.check_dtype(name, table, &[DType::U32]);
        self.check_dtype(name, seq, &[DType::U32]);
        KvPages {
            table: table.raw(),
            seq: seq.raw(),
            one_seq: self.decl(seq).elem_count() == 1,
            block,
            max_blocks: t.get(1).copied().unwrap_or(0),
            seqs: t.first().copied().unwrap_or(0),
        }
    }

    /// Checks that `pages` fit caches of `rows` rows and tell the sequence of `tokens` tokens.
    fn check_pages(&mut self, name: &str, pages: &KvPages, rows: usize, tokens: usize) {
        self.check(name, rows % pages.block == 0, || {
            format!("{rows} cache rows are not blocks of {}", pages.block)
        });
        if !pages.one_seq {
            self.check_len(name, pages.seq, tokens);
        }
    }

    pub fn tokens_input(&mut self, label: &str, tokens: usize) -> BufId<Tokens> {
        self.declare(label, DType::U32, vec![tokens], BufKind::Input)
    }

    pub fn positions_input(&mut self, label: &str, tokens: usize) -> BufId<Positions> {
        self.declare(label, DType::U32, vec![tokens], BufKind::Input)
    }

    pub fn residual_input(&mut self, label: &str, tokens: usize, hidden: usize) -> BufId<Residual> {
        self.declare(label, DType::F32, vec![tokens, hidden], BufKind::Input)
    }

    /// An f32 activation supplied by the host (tests, or a pass split across graphs).
    pub fn act_input(&mut self, label: &str, rows: usize, cols: usize) -> BufId<Act> {
        self.declare(label, DType::F32, vec![rows, cols], BufKind::Input)
    }

    /// A norm's output supplied by the host, f32 or bf16 (tests and benchmarks of projections).
    pub fn normed_input(&mut self, label: &str, rows: usize, cols: usize, dtype: DType) -> BufId<Normed> {
        self.check_normed_dtype(label, dtype);
        self.declare(label, dtype, vec![rows, cols], BufKind::Input)
    }

    /// A router's choice supplied by the host, `[tokens, k]` (tests of the streaming ops).
    pub fn expert_ids_input(&mut self, label: &str, tokens: usize, k: usize) -> BufId<ExpertIds> {
        self.declare(label, DType::U32, vec![tokens, k], BufKind::Input)
    }

    /// Logits supplied by the host (sampling on logits computed elsewhere, tests).
    pub fn logits_input(&mut self, label: &str, rows: usize, vocab: usize) -> BufId<Logits> {
        self.declare(label, DType::F32, vec![rows, vocab], BufKind::Input)
    }

    /// Keeps a transient buffer for the host to read after the run.
    pub fn mark_output<R: Role>(&mut self, id: BufId<R>) {
        let d = &mut self.bufs[id.raw().index()];
        if d.kind == BufKind::Transient {
            d.kind = BufKind::Output;
        }
    }

    // ---- ops ----

    pub fn embed(&mut self, name: &str, table: &LinearWeight, ids: BufId<Tokens>) -> BufId<Residual> {
        let tokens = self.decl(ids).elem_count();
        let hidden = match table {
            LinearWeight::Dense(w) => {
                self.check_dtype(name, *w, &[DType::BF16, DType::F16, DType::F32]);
                self.rows_cols(*w).1
            }
            LinearWeight::Quant { scales, format, .. } => self.rows_cols(*scales).1 * format.group_size,
        };
        let out = self.transient(name, DType::F32, vec![tokens, hidden]);
        self.push(
            name,
            Op::Embed {
                table: *table,
                ids: ids.raw(),
                out: out.raw(),
                hidden,
            },
        );
        out
    }

    fn norm_weight(&mut self, name: &str, w: BufId<Weight>, dim: usize) {
        self.check_dtype(name, w, &[DType::BF16, DType::F16, DType::F32]);
        self.check_len(name, w, dim);
    }

    pub fn rms_norm<R: NormInput>(
        &mut self,
        name: &str,
        x: BufId<R>,
        w: BufId<Weight>,
        eps: f32,
        kind: NormKind,
    ) -> BufId<Normed> {
        self.rms_norm_to(name, x, w, eps, kind, DType::F32)
    }

    /// `rms_norm` with its output stored as `dtype`: f32, or bf16 for projections that read
    /// bf16 (see [`crate::Backend::projection_input_dtype`]).
    pub fn rms_norm_to<R: NormInput>(
        &mut self,
        name: &str,
        x: BufId<R>,
        w: BufId<Weight>,
        eps: f32,
        kind: NormKind,
        dtype: DType,
    ) -> BufId<Normed> {
        let (rows, dim) = self.rows_cols(x);
        self.norm_weight(name, w, dim);
        self.check_normed_dtype(name, dtype);
        let out = self.transient(name, dtype, vec![rows, dim]);
        self.push(
            name,
            Op::RmsNorm {
                x: x.raw(),
                w: w.raw(),
                out: out.raw(),
                dim,
                eps,
                kind,
            },
        );
        out
    }

    fn check_normed_dtype(&mut self, name: &str, dtype: DType) {
        self.check(name, matches!(dtype, DType::F32 | DType::BF16), || {
            format!("a norm writes f32 or bf16, not {dtype}")
        });
    }

    /// Per-head norm: `x: [tokens, heads * head_dim]` normalised in rows of `head_dim`.
    pub fn head_norm(
        &mut self,
        name: &str,
        x: BufId<Act>,
        w: BufId<Weight>,
        head_dim: usize,
        eps: f32,
        kind: NormKind,
    ) -> BufId<Act> {
        let (rows, cols) = self.rows_cols(x);
        self.check(name, cols % head_dim == 0, || {
            format!("{cols} columns are not whole heads of {head_dim}")
        });
        self.norm_weight(name, w, head_dim);
        let out = self.transient(name, DType::F32, vec![rows, cols]);
        self.push(
            name,
            Op::RmsNorm {
                x: x.raw(),
                w: w.raw(),
                out: out.raw(),
                dim: head_dim,
                eps,
                kind,
            },
        );
        out
    }

    /// `residual += x`, then the norm of the new residual.
    pub fn add_rms_norm(
        &mut self,
        name: &str,
        residual: BufId<Residual>,
        x: BufId<Act>,
        w: BufId<Weight>,
        eps: f32,
        kind: NormKind,
    ) -> BufId<Normed> {
        self.add_rms_norm_to(name, residual, x, w, eps, kind, DType::F32)
    }

    /// `add_rms_norm` with its output stored as `dtype` (f32 or bf16, as for `rms_norm_to`).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm_to(
        &mut self,
        name: &str,
        residual: BufId<Residual>,
        x: BufId<Act>,
        w: BufId<Weight>,
        eps: f32,
        kind: NormKind,
        dtype: DType,
    ) -> BufId<Normed> {
        let (rows, dim) = self.rows_cols(residual);
        self.check_len(name, x, rows * dim);
        self.norm_weight(name, w, dim);
        self.check_normed_dtype(name, dtype);
        let out = self.transient(name, dtype, vec![rows, dim]);
        self.push(
            name,
            Op::AddRmsNorm {
                residual: residual.raw(),
                x: x.raw(),
                w: w.raw(),
                out: out.raw(),
                dim,
                eps,
                kind,
            },
        );
        out
    }

    pub fn gated_rms_norm(
        &mut self,
        name: &str,
        x: BufId<Act>,
        z: BufId<Act>,
        w: BufId<Weight>,
        dim: usize,
        eps: f32,
    ) -> BufId<Act> {
        let n = self.decl(x).elem_count();
        self.check(name, n % dim == 0, || {
            format!("{n} elements are not rows of {dim}")
        });
        self.check_len(name, z, n);
        self.norm_weight(name, w, dim);
        let shape = self.decl(x).shape.clone();
        let out = self.transient(name, DType::F32, shape);
        self.push(
            name,
            Op::GatedRmsNorm {
                x: x.raw(),
                z: z.raw(),
                w: w.raw(),
                out: out.raw(),
                dim,
                eps,
            },
        );
        out
    }

    /// Rotates `x: [tokens, heads * head_dim]` in place.
    #[allow(clippy::too_many_arguments)]
    pub fn rope<R: Activation>(
        &mut self,
        name: &str,
        x: BufId<R>,
        positions: BufId<Positions>,
        inv_freq: BufId<Weight>,
        heads: usize,
        head_dim: usize,
        rot_dim: usize,
        scaling: f32,
    ) {
        self.check_dtype(name, x, &[DType::F32]);
        let (tokens, cols) = self.rows_cols(x);
        self.check(name, cols == heads * head_dim, || {
            format!("{cols} columns, expected {heads} heads of {head_dim}")
        });
        self.check(name, rot_dim % 2 == 0 && rot_dim <= head_dim, || {
            format!("rot_dim {rot_dim} for head_dim {head_dim}")
        });
        self.check_len(name, positions, tokens);
        self.check_len(name, inv_freq, rot_dim / 2);
        self.check_dtype(name, inv_freq, &[DType::F32]);
        self.push(
            name,
            Op::Rope {
                x: x.raw(),
                positions: positions.raw(),
                inv_freq: inv_freq.raw(),
                heads,
                head_dim,
                rot_dim,
                scaling,
            },
        );
    }

    fn linear_dims(&mut self, name: &str, w: &LinearWeight) -> (usize, usize) {
        match w {
            LinearWeight::Dense(w) => {
                self.check_dtype(name, *w, &[DType::BF16, DType::F16, DType::F32]);
                self.rows_cols(*w)
            }
            LinearWeight::Quant {
                weight,
                scales,
                biases,
                format,
            } => {
                let scale = scale_dtype(format.scale);
                self.check_dtype(name, *weight, &[DType::U32]);
                self.check_dtype(name, *scales, &[scale]);
                self.check_dtype(name, *biases, &[scale]);
                let (rows, words) = self.rows_cols(*weight);
                (rows, words * format.values_per_word())
            }
        }
    }

    fn linear_to<R: ProjectionInput, O: Role>(
        &mut self,
        name: &str,
        x: BufId<R>,
        w: &LinearWeight,
    ) -> BufId<O> {
        let (out_dim, in_dim) = self.linear_dims(name, w);
        self.check_dtype(name, x, &[DType::F32, DType::BF16]);
        let (tokens, cols) = self.rows_cols(x);
        self.check(name, cols == in_dim, || {
            format!("input has {cols} columns, the weight takes {in_dim}")
        });
        let out = self.transient(name, DType::F32, vec![tokens, out_dim]);
        self.push(
            name,
            Op::Linear {
                x: x.raw(),
                w: *w,
                out: out.raw(),
                tokens,
                in_dim,
                out_dim,
            },
        );
        out
    }

    /// `y = x · Wᵀ`.
    pub fn linear<R: ProjectionInput>(&mut self, name: &str, x: BufId<R>, w: &LinearWeight) -> BufId<Act> {
        self.linear_to(name, x, w)
    }

    /// The output projection to logits.
    pub fn lm_head(&mut self, name: &str, x: BufId<Normed>, w: &LinearWeight) -> BufId<Logits> {
        self.linear_to(name, x, w)
    }

    /// Splits each row of `x`, viewed as `groups` groups of `Σ widths` columns, into parts.
    pub fn split(&mut self, name: &str, x: BufId<Act>, groups: usize, widths: &[usize]) -> Vec<BufId<Act>> {
        let (rows, cols) = self.rows_cols(x);
        let total: usize = widths.iter().sum();
        self.check(name, cols == groups * total, || {
            format!("{cols} columns, expected {groups} groups of {total}")
        });
        let parts: Vec<BufId<Act>> = widths
            .iter()
            .enumerate()
            .map(|(k, &w)| self.transient(&format!("{name}.{k}"), DType::F32, vec![rows, groups * w]))
            .collect();
        self.push(
            name,
            Op::Split {
                x: x.raw(),
                parts: parts.iter().zip(widths).map(|(p, &w)| (p.raw(), w)).collect(),
                rows,
                groups,
            },
        );
        parts
    }

    /// Concatenates the columns of `parts` (all with the same rows).
    pub fn concat(&mut self, name: &str, parts: &[BufId<Act>]) -> BufId<Act> {
        let rows = parts.first().map(|p| self.rows_cols(*p).0).unwrap_or(0);
        let mut widths = Vec::new();
        for p in parts {
            let (r, c) = self.rows_cols(*p);
            self.check(name, r == rows, || format!("parts with {r} and {rows} rows"));
            widths.push(c);
        }
        let out = self.transient(name, DType::F32, vec![rows, widths.iter().sum()]);
        self.push(
            name,
            Op::Concat {
                parts: parts.iter().zip(&widths).map(|(p, &w)| (p.raw(), w)).collect(),
                out: out.raw(),
                rows,
            },
        );
        out
    }

    pub fn swiglu(&mut self, name: &str, gate: BufId<Act>, up: BufId<Act>) -> BufId<Act> {
        let shape = self.decl(gate).shape.clone();
        let len = self.decl(gate).elem_count();
        self.check_len(name, up, len);
        let out = self.transient(name, DType::F32, shape);
        self.push(
            name,
            Op::SwiGlu {
                gate: gate.raw(),
                up: up.raw(),
                out: out.raw(),
                len,
            },
        );
        out
    }

    /// `x * sigmoid(gate)`; `gate` has the same columns as `x`, or one.
    pub fn sigmoid_gate(&mut self, name: &str, x: BufId<Act>, gate: BufId<Act>) -> BufId<Act> {
        let (rows, cols) = self.rows_cols(x);
        let (grows, gate_cols) = self.rows_cols(gate);
        self.check(
            name,
            grows == rows && (gate_cols == cols || gate_cols == 1),
            || format!("gate [{grows}, {gate_cols}] for x [{rows}, {cols}]"),
        );
        let out = self.transient(name, DType::F32, vec![rows, cols]);
        self.push(
            name,
            Op::SigmoidGate {
                x: x.raw(),
                gate: gate.raw(),
                out: out.raw(),
                rows,
                cols,
                gate_cols,
            },
        );
        out
    }

    /// `a + b` as a new residual.
    pub fn add_residual(&mut self, name: &str, residual: BufId<Residual>, x: BufId<Act>) -> BufId<Residual> {
        self.add_to(name, residual.raw(), x.raw())
    }

    /// `a + b`.
    pub fn add(&mut self, name: &str, a: BufId<Act>, b: BufId<Act>) -> BufId<Act> {
        self.add_to(name, a.raw(), b.raw())
    }

    fn add_to<O: Role>(&mut self, name: &str, a: Buf, b: Buf) -> BufId<O> {
        let shape = self.decl(a).shape.clone();
        let len = self.decl(a).elem_count();
        self.check_len(name, b, len);
        let out = self.transient(name, DType::F32, shape);
        self.push(
            name,
            Op::Add {
                a,
                b,
                out: out.raw(),
                len,
            },
        );
        out
    }

    /// The last row of `x` (the token whose logits decode needs).
    pub fn last_row<R: Activation>(&mut self, name: &str, x: BufId<R>) -> BufId<R> {
        self.check_dtype(name, x, &[DType::F32]);
        let (rows, cols) = self.rows_cols(x);
        let out = self.transient(name, DType::F32, vec![1, cols]);
        self.push(
            name,
            Op::CopyRows {
                x: x.raw(),
                out: out.raw(),
                start: rows.saturating_sub(1),
                rows: 1,
                cols,
            },
        );
        out
    }

    /// The first `n` rows of `x` (f32), as their own buffer.
    pub fn first_rows<R: Activation>(&mut self, name: &str, x: BufId<R>, n: usize) -> BufId<R> {
        self.check_dtype(name, x, &[DType::F32]);
        let (rows, cols) = self.rows_cols(x);
        self.check(name, n >= 1 && n <= rows, || {
            format!("the first {n} of {rows} rows")
        });
        let out = self.transient(name, DType::F32, vec![n, cols]);
        self.push(
            name,
            Op::CopyRows {
                x: x.raw(),
                out: out.raw(),
                start: 0,
                rows: n,
                cols,
            },
        );
        out
    }

    fn cache_dims(&self, c: BufId<Cache>) -> (usize, usize, usize) {
        let s = &self.decl(c).shape;
        (s[0], s[1], s[2])
    }

    #[allow(clippy::too_many_arguments)]
    pub fn kv_append(
        &mut self,
        name: &str,
        k: BufId<Act>,
        v: BufId<Act>,
        positions: BufId<Positions>,
        k_cache: BufId<Cache>,
        v_cache: BufId<Cache>,
        pages: KvPages,
    ) {
        let (kv_heads, rows, head_dim) = self.cache_dims(k_cache);
        self.check(
            name,
            self.cache_dims(v_cache) == (kv_heads, rows, head_dim),
            || "k and v caches differ".into(),
        );
        let (tokens, _) = self.rows_cols(k);
        self.check_cols(name, k, kv_heads * head_dim);
        self.check_cols(name, v, kv_heads * head_dim);
        self.check_len(name, positions, tokens);
        self.check_pages(name, &pages, rows, tokens);
        self.push(
            name,
            Op::KvAppend {
                k: k.raw(),
                v: v.raw(),
                positions: positions.raw(),
                k_cache: k_cache.raw(),
                v_cache: v_cache.raw(),
                pages,
                tokens,
                kv_heads,
                head_dim,
                rows,
            },
        );
    }

    /// Per-head norms (when given) and rotation of the queries and keys of the fused projection
    /// `qkv`, and the new keys and values appended to the caches: [`Op::AttentionInputs`]. Returns
    /// the queries and, when `gated`, the gates.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_inputs(
        &mut self,
        name: &str,
        qkv: BufId<Act>,
        gated: bool,
        norms: Option<(BufId<Weight>, BufId<Weight>, f32, NormKind)>,
        positions: BufId<Positions>,
        inv_freq: BufId<Weight>,
        rot_dim: usize,
        scaling: f32,
        k_cache: BufId<Cache>,
        v_cache: BufId<Cache>,
        pages: KvPages,
    ) -> (BufId<Act>, Option<BufId<Act>>) {
        let (kv_heads, rows, head_dim) = self.cache_dims(k_cache);
        self.check(
            name,
            self.cache_dims(v_cache) == (kv_heads, rows, head_dim),
            || "k and v caches differ".into(),
        );
        let (tokens, cols) = self.rows_cols(qkv);
        let q_stride = if gated { 2 * head_dim } else { head_dim };
        let kv_cols = 2 * kv_heads * head_dim;
        self.check(
            name,
            cols > kv_cols && (cols - kv_cols) % q_stride == 0,
            || format!("{cols} columns are not query heads of {q_stride} and keys and values of {kv_heads} heads of {head_dim}"),
        );
        let heads = cols.saturating_sub(kv_cols) / q_stride;
        self.check_len(name, positions, tokens);
        self.check_pages(name, &pages, rows, tokens);
        self.check(name, rot_dim % 2 == 0 && rot_dim <= head_dim, || {
            format!("rot_dim {rot_dim} for head_dim {head_dim}")
        });
        self.check_len(name, inv_freq, rot_dim / 2);
        self.check_dtype(name, inv_freq, &[DType::F32]);
        let norms = norms.map(|(qw, kw, eps, kind)| {
            self.norm_weight(name, qw, head_dim);
            self.norm_weight(name, kw, head_dim);
            HeadNorms {
                q: qw.raw(),
                k: kw.raw(),
                eps,
                kind,
            }
        });
        let q: BufId<Act> = self.transient(&format!("{name}.q"), DType::F32, vec![tokens, heads * head_dim]);
        let gate: Option<BufId<Act>> = gated.then(|| {
            self.transient(
                &format!("{name}.gate"),
                DType::F32,
                vec![tokens, heads * head_dim],
            )
        });
        self.push(
            name,
            Op::AttentionInputs {
                qkv: qkv.raw(),
                q: q.raw(),
                gate: gate.map(|g| g.raw()),
                norms,
                positions: positions.raw(),
                inv_freq: inv_freq.raw(),
                k_cache: k_cache.raw(),
                v_cache: v_cache.raw(),
                pages,
                tokens,
                heads,
                kv_heads,
                head_dim,
                rot_dim,
                scaling,
                rows,
            },
        );
        (q, gate)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn attention<R: Activation>(
        &mut self,
        name: &str,
        q: BufId<R>,
        k_cache: BufId<Cache>,
        v_cache: BufId<Cache>,
        positions: BufId<Positions>,
        pages: KvPages,
        heads: usize,
        scale: f32,
    ) -> BufId<Act> {
        self.attention_chunked(name, q, (k_cache, v_cache), positions, pages, heads, scale, None)
    }

    /// [`GraphBuilder::attention`] whose queries from token `chunk` on attend to the sequence of
    /// that token (see [`Op::Attention`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_chunked<R: Activation>(
        &mut self,
        name: &str,
        q: BufId<R>,
        (k_cache, v_cache): (BufId<Cache>, BufId<Cache>),
        positions: BufId<Positions>,
        pages: KvPages,
        heads: usize,
        scale: f32,
        chunk: Option<QueryChunk>,
    ) -> BufId<Act> {
        let (kv_heads, rows, head_dim) = self.cache_dims(k_cache);
        self.check_dtype(name, q, &[DType::F32]);
        let (tokens, _) = self.rows_cols(q);
        self.check_cols(name, q, heads * head_dim);
        self.check(name, kv_heads > 0 && heads % kv_heads == 0, || {
            format!("{heads} heads over {kv_heads} kv heads")
        });
        self.check_len(name, positions, tokens);
        self.check_pages(name, &pages, rows, tokens);
        self.check(
            name,
            chunk.is_none_or(|c| c.from < tokens && !pages.one_seq),
            || format!("a chunk {chunk:?} of {tokens} tokens (of sequences of their own)"),
        );
        let out = self.transient(name, DType::F32, vec![tokens, heads * head_dim]);
        self.push(
            name,
            Op::Attention {
                q: q.raw(),
                k_cache: k_cache.raw(),
                v_cache: v_cache.raw(),
                positions: positions.raw(),
                pages,
                out: out.raw(),
                tokens,
                heads,
                kv_heads,
                head_dim,
                rows,
                scale,
                chunk,
            },
        );
        out
    }

    pub fn router(
        &mut self,
        name: &str,
        logits: BufId<Act>,
        k: usize,
        normalize: bool,
    ) -> (BufId<ExpertIds>, BufId<ExpertWeights>) {
        let (tokens, experts) = self.rows_cols(logits);
        self.check(name, k >= 1 && k <= experts, || {
            format!("top-{k} of {experts} experts")
        });
        let ids = self.transient(&format!("{name}.ids"), DType::U32, vec![tokens, k]);
        let weights = self.transient(&format!("{name}.weights"), DType::F32, vec![tokens, k]);
        self.push(
            name,
            Op::Router {
                logits: logits.raw(),
                ids: ids.raw(),
                weights: weights.raw(),
                tokens,
                experts,
                k,
                normalize,
            },
        );
        (ids, weights)
    }

    pub fn moe_experts<R: ProjectionInput>(
        &mut self,
        name: &str,
        x: BufId<R>,
        ids: BufId<ExpertIds>,
        weights: BufId<ExpertWeights>,
        experts: BufId<Weight>,
        layout: ExpertLayout,
    ) -> BufId<Act> {
        self.check_dtype(name, x, &[DType::F32]);
        let (tokens, hidden) = self.rows_cols(x);
        let (_, k) = self.rows_cols(ids);
        self.check(name, hidden == layout.hidden, || {
            format!("input has {hidden} columns, experts take {}", layout.hidden)
        });
        self.check_dtype(name, experts, &[DType::U8]);
        self.check_len(name, experts, layout.total_bytes());
        self.check(name, layout.hidden % 8 == 0 && layout.inter % 8 == 0, || {
            format!(
                "expert dims {}x{} are not multiples of 8",
                layout.hidden, layout.inter
            )
        });
        // Gate and up have rows of hidden values, down of inter.
        for (format, cols) in [(layout.format, layout.hidden), (layout.down, layout.inter)] {
            if let ExpertFormat::Quant(q) = format {
                self.check(name, q.fits(cols), || {
                    format!("expert dims {}x{} do not fit {q:?}", layout.hidden, layout.inter)
                });
            }
        }
        let out = self.transient(name, DType::F32, vec![tokens, hidden]);
        self.push(
            name,
            Op::MoeExperts {
                x: x.raw(),
                ids: ids.raw(),
                weights: weights.raw(),
                experts: experts.raw(),
                layout,
                out: out.raw(),
                tokens,
                k,
            },
        );
        out
    }

    /// Checks what `expert_fetch` and `expert_stage` share: ids of `experts` experts, and the
    /// streamed layer (`check_streamed_layer`).
    #[allow(clippy::too_many_arguments)]
    fn check_streamed(
        &mut self,
        name: &str,
        ids: BufId<ExpertIds>,
        table: BufId<State>,
        src: BufId<Weight>,
        cache: BufId<Weight>,
        experts: usize,
        slots: usize,
        span: usize,
    ) {
        self.check_dtype(name, ids, &[DType::U32]);
        self.check_streamed_layer(name, table, src, cache, (experts, slots, span));
    }

    /// Checks what every streaming op shares: the books of `slots` slots, the layer's `experts`
    /// experts in `src` and a cache of `slots` spans of `span` bytes.
    fn check_streamed_layer(
        &mut self,
        name: &str,
        table: BufId<State>,
        src: BufId<Weight>,
        cache: BufId<Weight>,
        (experts, slots, span): (usize, usize, usize),
    ) {
        self.check_dtype(name, table, &[DType::U32]);
        self.check_len(name, table, crate::expert_slots::table_words(slots, experts));
        self.check_dtype(name, src, &[DType::U8]);
        self.check_len(name, src, experts * span);
        self.check_len(name, cache, slots * span);
        self.check(name, span % 16 == 0 && slots >= 1, || {
            format!("{slots} slots of {span} bytes (spans are copied 16 bytes at a time)")
        });
    }

    /// The slots of the experts `ids` names in one layer's cache, copying the missing ones in
    /// from `src` (see `Op::ExpertFetch`): the slots take the ids' place for `moe_experts`.
    #[allow(clippy::too_many_arguments)]
    pub fn expert_fetch(
        &mut self,
        name: &str,
        ids: BufId<ExpertIds>,
        table: BufId<State>,
        src: BufId<Weight>,
        cache: BufId<Weight>,
        (experts, slots, span): (usize, usize, usize),
        policy: crate::expert_slots::SlotPolicy,
    ) -> BufId<ExpertIds> {
        self.check_streamed(name, ids, table, src, cache, experts, slots, span);
        let (tokens, k) = self.rows_cols(ids);
        self.check(name, tokens * k <= slots, || {
            format!("{tokens} tokens of {k} experts do not fit {slots} slots")
        });
        let out = self.transient(&format!("{name}.slots"), DType::U32, vec![tokens, k]);
        self.push(
            name,
            Op::ExpertFetch {
                ids: ids.raw(),
                table: table.raw(),
                src: src.raw(),
                cache: cache.raw(),
                out: out.raw(),
                tokens,
                k,
                experts,
                slots,
                span,
                policy,
            },
        );
        out
    }

    /// Copies the experts `ids` names into `staging` at their own indices, from the layer's
    /// cache or `src` (see `Op::ExpertStage`).
    #[allow(clippy::too_many_arguments)]
    pub fn expert_stage(
        &mut self,
        name: &str,
        ids: BufId<ExpertIds>,
        table: BufId<State>,
        src: BufId<Weight>,
        cache: BufId<Weight>,
        staging: BufId<Weight>,
        (experts, slots, span): (usize, usize, usize),
    ) {
        self.check_streamed(name, ids, table, src, cache, experts, slots, span);
        self.check_len(name, staging, experts * span);
        let (tokens, k) = self.rows_cols(ids);
        self.push(
            name,
            Op::ExpertStage {
                ids: ids.raw(),
                table: table.raw(),
                src: src.raw(),
                cache: cache.raw(),
                staging: staging.raw(),
                tokens,
                k,
                experts,
                slots,
                span,
            },
        );
    }

    /// Copies all of a layer's experts from host memory to `staging` (see
    /// [`Op::ExpertStageAll`]).
    pub fn expert_stage_all(
        &mut self,
        name: &str,
        table: BufId<State>,
        src: BufId<Weight>,
        cache: BufId<Weight>,
        staging: BufId<Weight>,
        (experts, slots, span): (usize, usize, usize),
    ) {
        self.check_streamed_layer(name, table, src, cache, (experts, slots, span));
        self.check_len(name, staging, experts * span);
        self.push(
            name,
            Op::ExpertStageAll {
                table: table.raw(),
                src: src.raw(),
                cache: cache.raw(),
                staging: staging.raw(),
                experts,
                slots,
                span,
            },
        );
    }

    /// The rows of recurrent states of `seqs` sequences, each token's sequence in `seq` (one
    /// entry: every token's, a chunk of one sequence).
    pub fn state_rows(&mut self, seq: BufId<SeqIds>, seqs: usize) -> StateRows {
        StateRows {
            seq: seq.raw(),
            one_seq: self.decl(seq).elem_count() == 1,
            seqs,
        }
    }

    /// Checks `rows` against the `tokens` of an op and returns the state rows it implies.
    fn check_rows(&mut self, name: &str, rows: Option<StateRows>, tokens: usize) -> usize {
        match rows {
            None => 1,
            Some(r) => {
                if !r.one_seq {
                    self.check_len(name, r.seq, tokens);
                }
                self.check_dtype(name, r.seq, &[DType::U32]);
                r.seqs
            }
        }
    }

    pub fn causal_conv1d(
        &mut self,
        name: &str,
        x: BufId<Act>,
        w: BufId<Weight>,
        state: BufId<State>,
        rows: Option<StateRows>,
    ) -> BufId<Act> {
        let (tokens, channels) = self.rows_cols(x);
        let (wc, kernel) = self.rows_cols(w);
        self.check(name, wc == channels && kernel >= 1, || {
            format!("conv weight [{wc}, {kernel}] for {channels} channels")
        });
        self.check_dtype(name, w, &[DType::BF16, DType::F16, DType::F32]);
        self.check_dtype(name, state, &[DType::F32]);
        let seqs = self.check_rows(name, rows, tokens);
        self.check_len(name, state, seqs * channels * kernel.saturating_sub(1));
        let out = self.transient(name, DType::F32, vec![tokens, channels]);
        self.push(
            name,
            Op::CausalConv1d {
                x: x.raw(),
                w: w.raw(),
                state: state.raw(),
                rows,
                out: out.raw(),
                tokens,
                channels,
                kernel,
            },
        );
        out
    }

    pub fn delta_gates(
        &mut self,
        name: &str,
        a: BufId<Act>,
        b: BufId<Act>,
        a_log: BufId<Weight>,
        dt_bias: BufId<Weight>,
    ) -> (BufId<Act>, BufId<Act>) {
        let (tokens, heads) = self.rows_cols(a);
        self.check_len(name, b, tokens * heads);
        self.check_len(name, a_log, heads);
        self.check_len(name, dt_bias, heads);
        self.check_dtype(name, a_log, &[DType::BF16, DType::F16, DType::F32]);
        self.check_dtype(name, dt_bias, &[DType::BF16, DType::F16, DType::F32]);
        let g = self.transient(&format!("{name}.g"), DType::F32, vec![tokens, heads]);
        let beta = self.transient(&format!("{name}.beta"), DType::F32, vec![tokens, heads]);
        self.push(
            name,
            Op::DeltaGates {
                a: a.raw(),
                b: b.raw(),
                a_log: a_log.raw(),
                dt_bias: dt_bias.raw(),
                g: g.raw(),
                beta: beta.raw(),
                tokens,
                heads,
            },
        );
        (g, beta)
    }

    /// The gated delta rule; `q`, `k: [tokens, k_heads * k_dim]`, `v: [tokens, v_heads * v_dim]`,
    /// `g`, `beta: [tokens, v_heads]`, `state: [v_heads, k_dim, v_dim]` f32.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_rule(
        &mut self,
        name: &str,
        q: BufId<Act>,
        k: BufId<Act>,
        v: BufId<Act>,
        g: BufId<Act>,
        beta: BufId<Act>,
        state: BufId<State>,
        rows: Option<StateRows>,
        k_heads: usize,
        k_dim: usize,
        v_heads: usize,
        v_dim: usize,
        algo: DeltaAlgo,
    ) -> BufId<Act> {
        let (tokens, _) = self.rows_cols(q);
        self.check_len(name, q, tokens * k_heads * k_dim);
        self.check_len(name, k, tokens * k_heads * k_dim);
        self.check_len(name, v, tokens * v_heads * v_dim);
        self.check_len(name, g, tokens * v_heads);
        self.check_len(name, beta, tokens * v_heads);
        let seqs = self.check_rows(name, rows, tokens);
        self.check_len(name, state, seqs * v_heads * k_dim * v_dim);
        self.check_dtype(name, state, &[DType::F32]);
        self.check(name, k_heads > 0 && v_heads % k_heads == 0, || {
            format!("{v_heads} value heads over {k_heads} key heads")
        });
        if let DeltaAlgo::Chunked { chunk } = algo {
            self.check(name, chunk > 0, || "chunk size 0".into());
        }
        let out = self.transient(name, DType::F32, vec![tokens, v_heads * v_dim]);
        self.push(
            name,
            Op::DeltaRule {
                q: q.raw(),
                k: k.raw(),
                v: v.raw(),
                g: g.raw(),
                beta: beta.raw(),
                state: state.raw(),
                rows,
                out: out.raw(),
                tokens,
                k_heads,
                v_heads,
                k_dim,
                v_dim,
                algo,
            },
        );
        out
    }

    pub fn argmax(&mut self, name: &str, logits: BufId<Logits>) -> BufId<TokenIds> {
        let (rows, cols) = self.rows_cols(logits);
        let out = self.transient(name, DType::U32, vec![rows]);
        self.push(
            name,
            Op::Argmax {
                logits: logits.raw(),
                out: out.raw(),
                rows,
                cols,
            },
        );
        out
    }

    /// Each row's sampling settings and generator, supplied by the host before each run
    /// ([`Op::SampleRows`]).
    pub fn draws_input(&mut self, label: &str, rows: usize) -> BufId<Draws> {
        self.declare(
            label,
            DType::U32,
            vec![rows, crate::sample::DRAW_WORDS],
            BufKind::Input,
        )
    }

    /// The next token of each row of `logits`, drawn with that row's settings and generator
    /// in `draws` ([`Op::SampleRows`]) and penalised by its sequence's row of `counts` (`u32
    /// [seqs, cols]`, a state the op keeps up to date); each output row is the token and the
    /// generator after it.
    pub fn sample_rows(
        &mut self,
        name: &str,
        logits: BufId<Logits>,
        draws: BufId<Draws>,
        counts: BufId<State>,
    ) -> BufId<Drawn> {
        let (rows, cols) = self.rows_cols(logits);
        self.check_dtype(name, draws, &[DType::U32]);
        self.check_len(name, draws, rows * crate::sample::DRAW_WORDS);
        self.check_dtype(name, counts, &[DType::U32]);
        let c = self.decl(counts).shape.clone();
        self.check(name, c.len() == 2 && c[1] == cols, || {
            format!("token counts of shape {c:?} for {cols} logits a row")
        });
        let out = self.transient(name, DType::U32, vec![rows, crate::sample::DRAWN_WORDS]);
        self.push(
            name,
            Op::SampleRows {
                logits: logits.raw(),
                draws: draws.raw(),
                counts: counts.raw(),
                out: out.raw(),
                rows,
                cols,
            },
        );
        out
    }

    pub fn top_k(&mut self, name: &str, logits: BufId<Logits>, k: usize) -> (BufId<TokenIds>, BufId<Act>) {
        let (rows, cols) = self.rows_cols(logits);
        self.check(name, k >= 1 && k <= cols, || format!("top-{k} of {cols}"));
        let ids = self.transient(&format!("{name}.ids"), DType::U32, vec![rows, k]);
        let values = self.transient(&format!("{name}.values"), DType::F32, vec![rows, k]);
        self.push(
            name,
            Op::TopK {
                logits: logits.raw(),
                ids: ids.raw(),
                values: values.raw(),
                rows,
                cols,
                k,
            },
        );
        (ids, values)
    }

    /// The validated graph, or the first inconsistency found while building it.
    pub fn finish(self) -> Result<Graph, GraphError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let mut labels = std::collections::HashMap::new();
        for d in self.bufs.iter().filter(|d| d.kind.is_persistent()) {
            if let Some(prev) = labels.insert(d.label.as_str(), d) {
                return Err(GraphError {
                    node: d.label.clone(),
                    reason: format!(
                        "persistent label declared twice ({:?} and {:?})",
                        prev.shape, d.shape
                    ),
                });
            }
        }
        Ok(Graph {
            bufs: self.bufs,
            nodes: self.nodes,
        })
    }
}

/// The dtype of a quantised projection's scales and biases (factored ones, which projections do
/// not take, as their bytes).
fn scale_dtype(t: ScaleType) -> DType {
    match t {
        ScaleType::Bf16 => DType::BF16,
        ScaleType::F32 => DType::F32,
        ScaleType::Factored => DType::U8,
    }
}
