//! The op graph: a forward pass as a list of ops over buffer ids.
//!
//! Buffers are declared with a label, a dtype, a shape and a kind (weights and states persist
//! across runs and graphs, inputs and outputs are never aliased, transients are planned into a
//! shared arena). Every op declares what it reads and writes ([`Op::io`]); the memory planner
//! and the CUDA dependency inference both start from that declaration.
//!
//! Graphs are built through [`GraphBuilder`], whose methods take and return typed ids
//! [`BufId<R>`]: the role `R` records what a buffer holds, so wiring mistakes do not compile. A
//! projection takes a normalised input, never the residual stream:
//!
//! ```compile_fail,E0277
//! use kestrel_core::ir::LinearWeight;
//! use kestrel_core::GraphBuilder;
//! use kestrel_core::DType;
//! let mut g = GraphBuilder::new();
//! let x = g.residual_input("x", 4, 64);
//! let w = LinearWeight::Dense(g.weight("w", DType::BF16, [32, 64]));
//! let y = g.linear("proj", x, &w); // error: the residual stream is not a projection input
//! ```
//!
//! while the same wiring through a norm compiles:
//!
//! ```
//! use kestrel_core::ir::{LinearWeight, NormKind};
//! use kestrel_core::GraphBuilder;
//! use kestrel_core::DType;
//! let mut g = GraphBuilder::new();
//! let x = g.residual_input("x", 4, 64);
//! let nw = g.weight("norm", DType::BF16, [64]);
//! let w = LinearWeight::Dense(g.weight("w", DType::BF16, [32, 64]));
//! let h = g.rms_norm("norm", x, nw, 1e-6, NormKind::Standard);
//! let y = g.linear("proj", h, &w);
//! g.mark_output(y);
//! assert!(g.finish().is_ok());
//! ```

use std::fmt;
use std::marker::PhantomData;

use crate::dtype::DType;
use crate::quant::QuantFormat;

/// An untyped buffer index into a graph's declarations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Buf(pub u32);

impl Buf {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// What a buffer holds; the type parameter of [`BufId`].
pub trait Role: 'static {}

macro_rules! roles {
    ($($(#[$m:meta])* $name:ident),* $(,)?) => {
        $( $(#[$m])* #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)] pub struct $name; impl Role for $name {} )*
    };
}

roles!(
    /// The residual stream `[tokens, hidden]`, f32.
    Residual,
    /// The output of a norm, the input of projections: f32, or bf16 where only projections
    /// read it.
    Normed,
    /// Any other f32 activation (projection outputs, attention outputs, gates).
    Act,
    /// A read-only parameter.
    Weight,
    /// Token ids, u32 `[tokens]`.
    Tokens,
    /// Absolute positions of the tokens, u32 `[tokens]`.
    Positions,
    /// A key or value cache: a pool of blocks of rows, `[kv_heads, rows, head_dim]` (see
    /// [`KvPages`]).
    Cache,
    /// The block table of the sequences a graph's attention reads, u32 `[seqs, max_blocks]`.
    PageTable,
    /// The sequence (row of the block table) of each token, or of all of them, u32.
    SeqIds,
    /// Recurrent or convolution state, f32, persistent.
    State,
    /// Selected experts, u32 `[tokens, top_k]`.
    ExpertIds,
    /// Routing weights, f32 `[tokens, top_k]`.
    ExpertWeights,
    /// Logits `[tokens, vocab]`, f32.
    Logits,
    /// Selected token ids, u32.
    TokenIds,
    /// Each row's sampling settings and generator, u32 `[rows, DRAW_WORDS]` (see
    /// [`crate::sample::draw_words`]).
    Draws,
    /// Each row's drawn token and generator after the draw, u32 `[rows, DRAWN_WORDS]`.
    Drawn,
);

/// A typed buffer id: the index plus the role the builder checks at compile time.
pub struct BufId<R: Role> {
    buf: Buf,
    _role: PhantomData<R>,
}

impl<R: Role> Clone for BufId<R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<R: Role> Copy for BufId<R> {}
impl<R: Role> PartialEq for BufId<R> {
    fn eq(&self, other: &Self) -> bool {
        self.buf == other.buf
    }
}
impl<R: Role> Eq for BufId<R> {}
impl<R: Role> fmt::Debug for BufId<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "BufId<{}>({})",
            std::any::type_name::<R>().rsplit("::").next().unwrap_or("?"),
            self.buf.0
        )
    }
}

impl<R: Role> BufId<R> {
    /// Only the builder mints ids, so a role is always the one it was declared with.
    pub(crate) fn from_raw(buf: Buf) -> Self {
        BufId {
            buf,
            _role: PhantomData,
        }
    }

    pub fn raw(self) -> Buf {
        self.buf
    }
}

impl<R: Role> From<BufId<R>> for Buf {
    fn from(id: BufId<R>) -> Buf {
        id.buf
    }
}

/// Roles that may feed a projection: normalised inputs and other activations, not the residual.
pub trait ProjectionInput: Role {}
impl ProjectionInput for Normed {}
impl ProjectionInput for Act {}

/// Roles that may be normalised.
pub trait NormInput: Role {}
impl NormInput for Residual {}
impl NormInput for Act {}

/// Activations of any role (f32; a bf16 `Normed` only feeds projections, which the builder
/// checks).
pub trait Activation: Role {}
impl Activation for Residual {}
impl Activation for Normed {}
impl Activation for Act {}

/// How a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufKind {
    /// Uploaded once, read-only, shared by every graph that declares the same label.
    Weight,
    /// A weight kept in host memory that the device reads in place (page-locked and mapped on
    /// CUDA): the packed experts a streamed layer copies into its cache of slots.
    HostWeight,
    /// Persistent and read-write (KV caches, recurrent and convolution states), shared by label.
    State,
    /// Written by the host before the runs that read it (it keeps what was last written);
    /// never aliased.
    Input,
    /// Read back by the host after a run; never aliased.
    Output,
    /// Lives from its first to its last use inside one run; may share memory with others.
    Transient,
}

impl BufKind {
    /// Persistent buffers keep their contents between runs and graphs.
    pub fn is_persistent(self) -> bool {
        matches!(self, BufKind::Weight | BufKind::HostWeight | BufKind::State)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BufDecl {
    pub label: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub kind: BufKind,
}

impl BufDecl {
    /// A host weight of `bytes` bytes (`BufKind::HostWeight`), as graphs declare it and as a
    /// backend adopting host memory for it (`Backend::adopt_host`) records it.
    pub fn host_weight(label: &str, bytes: usize) -> BufDecl {
        BufDecl {
            label: label.to_string(),
            dtype: DType::U8,
            shape: vec![bytes],
            kind: BufKind::HostWeight,
        }
    }

    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn byte_len(&self) -> usize {
        self.elem_count() * self.dtype.size_in_bytes()
    }
}

/// Weights of one linear layer `y = x · Wᵀ`, `W: [out, in]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearWeight {
    /// bf16, f16 or f32 `[out, in]`.
    Dense(BufId<Weight>),
    /// Affine quantisation: `weight: u32 [out, in*bits/32]`, `scales`, `biases: [out, in/group]` in
    /// the format's scale type.
    Quant {
        weight: BufId<Weight>,
        scales: BufId<Weight>,
        biases: BufId<Weight>,
        format: QuantFormat,
    },
}

impl LinearWeight {
    pub fn bufs(&self) -> Vec<Buf> {
        match self {
            LinearWeight::Dense(w) => vec![w.raw()],
            LinearWeight::Quant {
                weight,
                scales,
                biases,
                ..
            } => vec![weight.raw(), scales.raw(), biases.raw()],
        }
    }
}

/// Storage format of an expert's matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertFormat {
    /// bf16 matrices.
    Bf16,
    Quant(QuantFormat),
}

/// Where each matrix of one expert lives inside the expert's contiguous span. All experts of a
/// layer share one buffer `[experts, span_bytes]` (u8), so moving an expert is one copy.
/// Span order: gate, up (both `[inter, hidden]`), down (`[hidden, inter]`); for quantised
/// experts each matrix is its weight words, then its scales, then its biases. Gate and up share
/// a format (one kernel reads both); down may have its own (GGUF's Q4_K_M keeps some layers'
/// down matrices at 6 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertLayout {
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
    /// Gate and up.
    pub format: ExpertFormat,
    pub down: ExpertFormat,
}

/// Byte offsets of one matrix inside an expert span; `end` is where the next part may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixSpan {
    pub weight: usize,
    pub scales: usize,
    pub biases: usize,
    pub end: usize,
}

impl ExpertLayout {
    /// Every matrix in `format`.
    pub fn uniform(experts: usize, hidden: usize, inter: usize, format: ExpertFormat) -> ExpertLayout {
        ExpertLayout {
            experts,
            hidden,
            inter,
            format,
            down: format,
        }
    }

    /// Both formats, gate/up's then down's.
    pub fn formats(&self) -> [ExpertFormat; 2] {
        [self.format, self.down]
    }

    fn matrix(&self, start: usize, rows: usize, cols: usize, format: ExpertFormat) -> MatrixSpan {
        // Every part starts 16-byte aligned, so kernels may read it in 16-byte vectors.
        let a = |n: usize| n.div_ceil(16) * 16;
        match format {
            ExpertFormat::Bf16 => {
                let end = a(start + rows * cols * 2);
                MatrixSpan {
                    weight: start,
                    scales: end,
                    biases: end,
                    end,
                }
            }
            ExpertFormat::Quant(q) => {
                let scales = a(start + rows * q.words_per_row(cols) * 4);
                let biases = a(scales + q.scale_part(rows, cols));
                MatrixSpan {
                    weight: start,
                    scales,
                    biases,
                    end: a(biases + q.bias_part(rows, cols)),
                }
            }
        }
    }

    pub fn gate(&self) -> MatrixSpan {
        self.matrix(0, self.inter, self.hidden, self.format)
    }

    pub fn up(&self) -> MatrixSpan {
        self.matrix(self.gate().end, self.inter, self.hidden, self.format)
    }

    pub fn down_span(&self) -> MatrixSpan {
        self.matrix(self.up().end, self.hidden, self.inter, self.down)
    }

    /// Bytes of one expert, rounded up to 256 so every span starts aligned.
    pub fn span_bytes(&self) -> usize {
        self.down_span().end.div_ceil(256) * 256
    }

    pub fn total_bytes(&self) -> usize {
        self.experts * self.span_bytes()
    }
}

/// Where the keys and values of each token's sequence live in the caches. A cache is a pool of
/// blocks of `block` rows (`[kv_heads, rows, head_dim]`, `rows` a multiple of `block`); the
/// position `p` of sequence `s` is cache row `table[s][p / block] * block + p % block`, so a
/// sequence holds positions below `max_blocks * block`. Token `t` belongs to sequence
/// `seq[t]`, or, when `one_seq`, every token to `seq[0]` (a chunk of one sequence: backends may
/// share each key between its tokens). One sequence whose table is `0, 1, 2, ...` is a plain
/// contiguous cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvPages {
    /// u32 `[seqs, max_blocks]`.
    pub table: Buf,
    /// u32 `[tokens]`, or `[1]` when `one_seq`.
    pub seq: Buf,
    pub one_seq: bool,
    /// Rows of a block, a power of two.
    pub block: usize,
    pub max_blocks: usize,
    /// Sequences the table holds.
    pub seqs: usize,
}

impl KvPages {
    /// The positions a sequence can hold.
    pub fn max_ctx(&self) -> usize {
        self.max_blocks * self.block
    }

    /// The sequence token `t` belongs to, from the contents of `seq`.
    pub fn seq_of(&self, seq: &[u32], t: usize) -> usize {
        seq[if self.one_seq { 0 } else { t }] as usize
    }

    /// The cache row of position `pos` of sequence `s`, from the contents of `table`; `None`
    /// past the sequence's blocks or where the table names a block past the cache's `rows`.
    pub fn row(&self, table: &[u32], s: usize, pos: usize, rows: usize) -> Option<usize> {
        if s >= self.seqs || pos >= self.max_ctx() {
            return None;
        }
        let at = table[s * self.max_blocks + pos / self.block] as usize * self.block + pos % self.block;
        (at < rows).then_some(at)
    }

    /// The buffers the ops that carry these pages read.
    pub fn bufs(&self) -> [Buf; 2] {
        [self.table, self.seq]
    }
}

/// Which row of a recurrent state each token's sequence uses: the state holds `seqs` rows, token
/// `t`'s is `seq[t]` (each token then the next of its own sequence: a batched decode step; a row
/// two tokens name, as the padding of such a step does, holds something unspecified after), or,
/// when `one_seq`, every token's is `seq[0]` (a chunk of one sequence, in order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateRows {
    pub seq: Buf,
    pub one_seq: bool,
    pub seqs: usize,
}

impl StateRows {
    /// The row of token `t`, from the contents of `seq`.
    pub fn row_of(&self, seq: &[u32], t: usize) -> usize {
        seq[if self.one_seq { 0 } else { t }] as usize
    }
}

/// Per-head RMS norms of queries and keys (`[head_dim]` weights each), as Qwen3 applies them
/// before the rotation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadNorms {
    pub q: Buf,
    pub k: Buf,
    pub eps: f32,
    pub kind: NormKind,
}

/// RMS norm weight convention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NormKind {
    /// `x / rms(x) * w` (Llama, Qwen3).
    Standard,
    /// `x / rms(x) * (1 + w)` (Qwen3-Next, Qwen3.5).
    ZeroCentered,
}

/// Which delta-rule algorithm a backend uses; both compute the same recurrence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeltaAlgo {
    /// Recurrent for one token, chunked for more.
    Auto,
    Recurrent,
    Chunked {
        chunk: usize,
    },
}

/// Where an [`Op::Attention`]'s queries share sequences: from token `from` on, in runs of
/// `run` tokens (0: one run to the end), each run's queries attend to the sequence of the run's
/// first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryChunk {
    pub from: usize,
    pub run: usize,
}

impl QueryChunk {
    /// The token whose sequence query `t` (at least `from`) attends to.
    pub fn leader(&self, t: usize) -> usize {
        match self.run {
            0 => self.from,
            r => self.from + (t - self.from) / r * r,
        }
    }
}

/// One operation. All activations are f32; shapes are given as `[rows, cols]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    /// `out[t] = table[ids[t]]`, table dense `[vocab, hidden]` or quantised.
    Embed {
        table: LinearWeight,
        ids: Buf,
        out: Buf,
        hidden: usize,
    },
    /// Rows of `dim`: `out = x / sqrt(mean(x²) + eps) * w` (or `* (1 + w)`). `out` is f32, or
    /// bf16 (the f32 result rounded to nearest even) for projections that read bf16.
    RmsNorm {
        x: Buf,
        w: Buf,
        out: Buf,
        dim: usize,
        eps: f32,
        kind: NormKind,
    },
    /// `residual += x; out = rms_norm(residual)`; `out` f32 or bf16, as for `RmsNorm`.
    AddRmsNorm {
        residual: Buf,
        x: Buf,
        w: Buf,
        out: Buf,
        dim: usize,
        eps: f32,
        kind: NormKind,
    },
    /// Rows of `dim`: `out = x / rms(x) * w * silu(z)`.
    GatedRmsNorm {
        x: Buf,
        z: Buf,
        w: Buf,
        out: Buf,
        dim: usize,
        eps: f32,
    },
    /// In place on `x: [tokens, heads, head_dim]`: neox rotation of the first `rot_dim` dims by
    /// angle `positions[t] * inv_freq[i]`, cos and sin scaled by `scaling`.
    Rope {
        x: Buf,
        positions: Buf,
        inv_freq: Buf,
        heads: usize,
        head_dim: usize,
        rot_dim: usize,
        scaling: f32,
    },
    /// `out[t, :] = x[t, :] · Wᵀ`; `x` f32 or bf16, `out` f32.
    Linear {
        x: Buf,
        w: LinearWeight,
        out: Buf,
        tokens: usize,
        in_dim: usize,
        out_dim: usize,
    },
    /// Column split: `x` viewed as `[rows * groups, Σ widths]`; part k takes its columns and is
    /// stored as `[rows, groups * widths[k]]`.
    Split {
        x: Buf,
        parts: Vec<(Buf, usize)>,
        rows: usize,
        groups: usize,
    },
    /// Column concatenation: `out[r] = [parts[0][r], parts[1][r], ...]`, part k `[rows, widths[k]]`.
    Concat {
        parts: Vec<(Buf, usize)>,
        out: Buf,
        rows: usize,
    },
    /// `out = silu(gate) * up`.
    SwiGlu {
        gate: Buf,
        up: Buf,
        out: Buf,
        len: usize,
    },
    /// `out[t, i] = x[t, i] * sigmoid(gate[t, i or 0])`; `gate` has `cols` or one column.
    SigmoidGate {
        x: Buf,
        gate: Buf,
        out: Buf,
        rows: usize,
        cols: usize,
        gate_cols: usize,
    },
    /// `out = a + b`.
    Add { a: Buf, b: Buf, out: Buf, len: usize },
    /// `out = x[start .. start + n]` as rows of `cols`.
    CopyRows {
        x: Buf,
        out: Buf,
        start: usize,
        rows: usize,
        cols: usize,
    },
    /// Writes `k`, `v: [tokens, kv_heads, head_dim]` into the caches (`[kv_heads, rows,
    /// head_dim]`) at the rows of `positions[t]` of each token's sequence.
    KvAppend {
        k: Buf,
        v: Buf,
        positions: Buf,
        k_cache: Buf,
        v_cache: Buf,
        pages: KvPages,
        tokens: usize,
        kv_heads: usize,
        head_dim: usize,
        rows: usize,
    },
    /// The inputs of attention for new tokens in one op, from the fused projection `qkv:
    /// [tokens, heads * q_stride + 2 * kv_heads * head_dim]` (a row holds each query head's
    /// `head_dim` values, followed by its gate's when gated, `q_stride = 2 * head_dim`, else
    /// `head_dim`; then the keys; then the values): each head of q and k RMS-normalised with
    /// `norms` when given, then rotated as [`Op::Rope`] rotates; q written to `q: [tokens, heads,
    /// head_dim]`, the gates (when gated) to `gate`, the new keys and values into the caches at
    /// `positions[t]` as [`Op::KvAppend`] stores them.
    AttentionInputs {
        qkv: Buf,
        q: Buf,
        gate: Option<Buf>,
        norms: Option<HeadNorms>,
        positions: Buf,
        inv_freq: Buf,
        k_cache: Buf,
        v_cache: Buf,
        pages: KvPages,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rot_dim: usize,
        scaling: f32,
        rows: usize,
    },
    /// Causal attention with GQA: query token t attends to positions `0 ..= positions[t]` of
    /// its sequence; with `chunk: Some(c)`, the queries from token `c.from` on attend to the
    /// sequence of the first token of their run (all of them to token `c.from`'s when `c.run`
    /// is 0, else in runs of `c.run` tokens from `c.from`): prompts' chunks after a batched
    /// step's tokens of their own sequences, so backends may share each key between a run's
    /// queries. A token of another sequence in a run (padding) gets an output of no meaning.
    Attention {
        q: Buf,
        k_cache: Buf,
        v_cache: Buf,
        positions: Buf,
        pages: KvPages,
        out: Buf,
        tokens: usize,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rows: usize,
        scale: f32,
        chunk: Option<QueryChunk>,
    },
    /// Softmax over `experts`, top `k` (ties to the lower index), optional renormalisation.
    Router {
        logits: Buf,
        ids: Buf,
        weights: Buf,
        tokens: usize,
        experts: usize,
        k: usize,
        normalize: bool,
    },
    /// `out[t] = Σ_j weights[t, j] · down_e(silu(gate_e x) * up_e x)` with `e = ids[t, j]`.
    MoeExperts {
        x: Buf,
        ids: Buf,
        weights: Buf,
        experts: Buf,
        layout: ExpertLayout,
        out: Buf,
        tokens: usize,
        k: usize,
    },
    /// One decode-sized step of a streamed layer: gives each expert `ids` (`[tokens, k]`)
    /// names a slot of the layer's cache (`cache`: `slots` expert spans of `span` bytes) and
    /// writes the slots to `out` (`[tokens, k]`), following `expert_slots::resolve` with the
    /// books in `table`: hits keep their slot, misses take a free slot or evict by `policy` and
    /// are copied in from `src` (the layer's `experts` experts, packed, in host memory).
    /// Built only when the step's experts fit: `tokens * k <= slots`.
    ExpertFetch {
        ids: Buf,
        table: Buf,
        src: Buf,
        cache: Buf,
        out: Buf,
        tokens: usize,
        k: usize,
        experts: usize,
        slots: usize,
        span: usize,
        policy: crate::expert_slots::SlotPolicy,
    },
    /// Copies every expert `ids` (`[tokens, k]`) names to its own index of `staging` (laid out
    /// as `src`, the layer's `experts` experts packed): from the layer's cache of `slots` slots
    /// where `table` says it holds the expert, else from `src` in host memory. For chunks whose
    /// experts do not fit the cache; the experts op then reads `staging` with the ids as they are.
    ExpertStage {
        ids: Buf,
        table: Buf,
        src: Buf,
        cache: Buf,
        staging: Buf,
        tokens: usize,
        k: usize,
        experts: usize,
        slots: usize,
        span: usize,
    },
    /// `ExpertStage` of every one of the layer's `experts` experts: each copied to its index of
    /// `staging` from the slot of `cache` that holds it, else from `src` in host memory. For
    /// chunks long enough to use most of a layer's experts, built ahead of the layer (two
    /// staging buffers in turn) so the copy overlaps the layers before it.
    ExpertStageAll {
        table: Buf,
        src: Buf,
        cache: Buf,
        staging: Buf,
        experts: usize,
        slots: usize,
        span: usize,
    },
    /// Depthwise causal conv1d over `x: [tokens, channels]` with `w: [channels, kernel]`, SiLU,
    /// continuing from `state: [channels, kernel - 1]` (the previous inputs), which it updates;
    /// with `rows`, from and into each token's sequence's row of `state: [seqs, channels,
    /// kernel - 1]`.
    CausalConv1d {
        x: Buf,
        w: Buf,
        state: Buf,
        rows: Option<StateRows>,
        out: Buf,
        tokens: usize,
        channels: usize,
        kernel: usize,
    },
    /// `g = -exp(a_log) * softplus(a + dt_bias)`, `beta = sigmoid(b)`, per `[tokens, heads]`.
    DeltaGates {
        a: Buf,
        b: Buf,
        a_log: Buf,
        dt_bias: Buf,
        g: Buf,
        beta: Buf,
        tokens: usize,
        heads: usize,
    },
    /// The gated delta rule over `tokens` from and into `state: [v_heads, k_dim, v_dim]`, with
    /// L2-normalised q and k (eps 1e-6) and q scaled by `k_dim^-1/2`; with `rows`, from and into
    /// each token's sequence's row of `state: [seqs, v_heads, k_dim, v_dim]`.
    DeltaRule {
        q: Buf,
        k: Buf,
        v: Buf,
        g: Buf,
        beta: Buf,
        state: Buf,
        rows: Option<StateRows>,
        out: Buf,
        tokens: usize,
        k_heads: usize,
        v_heads: usize,
        k_dim: usize,
        v_dim: usize,
        algo: DeltaAlgo,
    },
    /// Index of the largest logit of each row (the lower index on ties).
    Argmax {
        logits: Buf,
        out: Buf,
        rows: usize,
        cols: usize,
    },
    /// The next token of each row of `logits`, each with its own settings and generator: row
    /// `r` draws with `draws[r]` (`u32 [rows, DRAW_WORDS]`, see [`crate::sample::draw_words`]:
    /// temperature, top-k, top-p, min-p, the penalties and the row of `counts` its sequence
    /// keeps) and writes its token and the generator state after the draw to `out[r]` (`u32
    /// [rows, DRAWN_WORDS]`), as [`crate::sample::draw_row`] does. `counts` (`u32 [seqs,
    /// cols]`, a state) holds how often each sequence has seen each token: a row that names one
    /// is penalised by it and counts its drawn token there. The generators live with the
    /// caller. A backend may bound top-k (CUDA: 1 to 64, or temperature 0; see
    /// [`crate::sample::backend_draws`]).
    SampleRows {
        logits: Buf,
        draws: Buf,
        counts: Buf,
        out: Buf,
        rows: usize,
        cols: usize,
    },
    /// The `k` largest logits of each row, descending (lower index first on ties).
    TopK {
        logits: Buf,
        ids: Buf,
        values: Buf,
        rows: usize,
        cols: usize,
        k: usize,
    },
}

/// The most tokens of a norm that `Op::may_join` lets a backend run with the product after it.
pub const JOIN_MAX_TOKENS: usize = 8;

impl Op {
    /// Whether a backend may run this op and `next`, the node after it, as one kernel whose
    /// blocks write `next`'s outputs while other blocks still read this op's buffers: one
    /// token's attention inputs and the attention reading them (its queries, over the same
    /// caches, positions and pages, at the same shape, not a prompt's chunk), and the norm of up
    /// to `JOIN_MAX_TOKENS` tokens and the product reading it (one token's quantised product, or
    /// a few tokens' router product). The planner keeps this op's buffers live through `next`,
    /// so none shares bytes with `next`'s outputs; a backend fuses no other pair.
    pub fn may_join(&self, next: &Op) -> bool {
        use Op::*;
        match (self, next) {
            (
                AttentionInputs {
                    q,
                    k_cache,
                    v_cache,
                    positions,
                    pages,
                    tokens: 1,
                    heads,
                    kv_heads,
                    head_dim,
                    rows,
                    ..
                },
                Attention {
                    q: aq,
                    k_cache: ak,
                    v_cache: av,
                    positions: ap,
                    pages: apages,
                    tokens: 1,
                    heads: ah,
                    kv_heads: akv,
                    head_dim: ahd,
                    rows: arows,
                    chunk: None,
                    ..
                },
            ) => {
                (
                    q, k_cache, v_cache, positions, pages, heads, kv_heads, head_dim, rows,
                ) == (aq, ak, av, ap, apages, ah, akv, ahd, arows)
            }
            (RmsNorm { out, .. } | AddRmsNorm { out, .. }, Linear { x, tokens, .. }) => {
                out == x && *tokens <= JOIN_MAX_TOKENS
            }
            _ => false,
        }
    }

    /// The buffers the op reads and the buffers it writes; read-write buffers are in both.
    pub fn io(&self) -> (Vec<Buf>, Vec<Buf>) {
        use Op::*;
        match self {
            Embed { table, ids, out, .. } => {
                let mut r = table.bufs();
                r.push(*ids);
                (r, vec![*out])
            }
            RmsNorm { x, w, out, .. } => (vec![*x, *w], vec![*out]),
            AddRmsNorm {
                residual, x, w, out, ..
            } => (vec![*residual, *x, *w], vec![*residual, *out]),
            GatedRmsNorm { x, z, w, out, .. } => (vec![*x, *z, *w], vec![*out]),
            Rope {
                x,
                positions,
                inv_freq,
                ..
            } => (vec![*x, *positions, *inv_freq], vec![*x]),
            Linear { x, w, out, .. } => {
                let mut r = vec![*x];
                r.extend(w.bufs());
                (r, vec![*out])
            }
            Split { x, parts, .. } => (vec![*x], parts.iter().map(|p| p.0).collect()),
            Concat { parts, out, .. } => (parts.iter().map(|p| p.0).collect(), vec![*out]),
            SwiGlu { gate, up, out, .. } => (vec![*gate, *up], vec![*out]),
            SigmoidGate { x, gate, out, .. } => (vec![*x, *gate], vec![*out]),
            Add { a, b, out, .. } => (vec![*a, *b], vec![*out]),
            CopyRows { x, out, .. } => (vec![*x], vec![*out]),
            KvAppend {
                k,
                v,
                positions,
                k_cache,
                v_cache,
                pages,
                ..
            } => {
                let mut r = vec![*k, *v, *positions, *k_cache, *v_cache];
                r.extend(pages.bufs());
                (r, vec![*k_cache, *v_cache])
            }
            AttentionInputs {
                qkv,
                q,
                gate,
                norms,
                positions,
                inv_freq,
                k_cache,
                v_cache,
                pages,
                ..
            } => {
                let mut r = vec![*qkv, *positions, *inv_freq, *k_cache, *v_cache];
                r.extend(pages.bufs());
                r.extend(norms.iter().flat_map(|n| [n.q, n.k]));
                let mut w = vec![*q, *k_cache, *v_cache];
                w.extend(gate);
                (r, w)
            }
            Attention {
                q,
                k_cache,
                v_cache,
                positions,
                pages,
                out,
                ..
            } => {
                let mut r = vec![*q, *k_cache, *v_cache, *positions];
                r.extend(pages.bufs());
                (r, vec![*out])
            }
            Router {
                logits, ids, weights, ..
            } => (vec![*logits], vec![*ids, *weights]),
            MoeExperts {
                x,
                ids,
                weights,
                experts,
                out,
                ..
            } => (vec![*x, *ids, *weights, *experts], vec![*out]),
            ExpertFetch {
                ids,
                table,
                src,
                cache,
                out,
                ..
            } => (vec![*ids, *table, *src], vec![*table, *cache, *out]),
            ExpertStage {
                ids,
                table,
                src,
                cache,
                staging,
                ..
            } => (vec![*ids, *table, *src, *cache], vec![*table, *staging]),
            ExpertStageAll {
                table,
                src,
                cache,
                staging,
                ..
            } => (vec![*table, *src, *cache], vec![*table, *staging]),
            CausalConv1d {
                x,
                w,
                state,
                rows,
                out,
                ..
            } => {
                let mut r = vec![*x, *w, *state];
                r.extend(rows.map(|s| s.seq));
                (r, vec![*state, *out])
            }
            DeltaGates {
                a,
                b,
                a_log,
                dt_bias,
                g,
                beta,
                ..
            } => (vec![*a, *b, *a_log, *dt_bias], vec![*g, *beta]),
            DeltaRule {
                q,
                k,
                v,
                g,
                beta,
                state,
                rows,
                out,
                ..
            } => {
                let mut r = vec![*q, *k, *v, *g, *beta, *state];
                r.extend(rows.map(|s| s.seq));
                (r, vec![*state, *out])
            }
            Argmax { logits, out, .. } => (vec![*logits], vec![*out]),
            SampleRows {
                logits,
                draws,
                counts,
                out,
                ..
            } => (vec![*logits, *draws, *counts], vec![*out, *counts]),
            TopK {
                logits, ids, values, ..
            } => (vec![*logits], vec![*ids, *values]),
        }
    }

    /// A short name for labels and profiles.
    pub fn name(&self) -> &'static str {
        use Op::*;
        match self {
            Embed { .. } => "embed",
            RmsNorm { .. } => "rms_norm",
            AddRmsNorm { .. } => "add_rms_norm",
            GatedRmsNorm { .. } => "gated_rms_norm",
            Rope { .. } => "rope",
            Linear { .. } => "linear",
            Split { .. } => "split",
            Concat { .. } => "concat",
            SwiGlu { .. } => "swiglu",
            SigmoidGate { .. } => "sigmoid_gate",
            Add { .. } => "add",
            CopyRows { .. } => "copy_rows",
            KvAppend { .. } => "kv_append",
            AttentionInputs { .. } => "attention_inputs",
            Attention { .. } => "attention",
            Router { .. } => "router",
            MoeExperts { .. } => "moe_experts",
            ExpertFetch { .. } => "expert_fetch",
            ExpertStage { .. } => "expert_stage",
            ExpertStageAll { .. } => "expert_stage_all",
            CausalConv1d { .. } => "causal_conv1d",
            DeltaGates { .. } => "delta_gates",
            DeltaRule { .. } => "delta_rule",
            Argmax { .. } => "argmax",
            SampleRows { .. } => "sample_rows",
            TopK { .. } => "top_k",
        }
    }
}

/// An op plus the label it was built under (`layer3.attn.q_proj`).
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub label: String,
    pub op: Op,
}

/// A finished, validated graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Graph {
    pub bufs: Vec<BufDecl>,
    pub nodes: Vec<Node>,
}

impl Graph {
    pub fn decl(&self, b: impl Into<Buf>) -> &BufDecl {
        &self.bufs[b.into().index()]
    }

    /// Per node, its reads and writes.
    pub fn io(&self) -> Vec<(Vec<Buf>, Vec<Buf>)> {
        self.nodes.iter().map(|n| n.op.io()).collect()
    }

    /// Per buffer, the nodes that read it, in order (each once, however many of its operands
    /// the buffer is).
    pub fn readers(&self) -> Vec<Vec<usize>> {
        let mut readers = vec![Vec::new(); self.bufs.len()];
        for (i, node) in self.nodes.iter().enumerate() {
            for b in node.op.io().0 {
                let r: &mut Vec<usize> = &mut readers[b.index()];
                if r.last() != Some(&i) {
                    r.push(i);
                }
            }
        }
        readers
    }

    /// The graph cut before each node index of `cuts` into segments that run one after
    /// another, as separate programs, with the host free to act between them (read a router's
    /// choice, bring experts in). Every segment declares every buffer, so buffer ids stay
    /// valid in all of them. A transient that more than one segment touches is carried between
    /// them as a state labelled by its label, dtype and shape (`carry:` prefix; the segments of
    /// every program of the same shapes share it, which is sound because they run in order);
    /// inputs and outputs a segment does not touch become unused transients there, so it
    /// holds no memory for them. Cuts out of range, repeated or unsorted are ignored.
    pub fn split(&self, cuts: &[usize]) -> Vec<Graph> {
        let mut bounds = vec![0];
        for &c in cuts {
            if c > *bounds.last().expect("starts with 0") && c < self.nodes.len() {
                bounds.push(c);
            }
        }
        bounds.push(self.nodes.len());
        let io = self.io();
        // The segments that touch each buffer.
        let mut touched: Vec<Vec<usize>> = vec![Vec::new(); self.bufs.len()];
        for (seg, w) in bounds.windows(2).enumerate() {
            for (reads, writes) in &io[w[0]..w[1]] {
                for b in reads.iter().chain(writes) {
                    let t = &mut touched[b.index()];
                    if t.last() != Some(&seg) {
                        t.push(seg);
                    }
                }
            }
        }
        let mut carried = self.bufs.clone();
        for (d, t) in carried.iter_mut().zip(&touched) {
            if d.kind == BufKind::Transient && t.len() > 1 {
                d.label = format!("carry:{}:{}{:?}", d.label, d.dtype, d.shape);
                d.kind = BufKind::State;
            }
        }
        bounds
            .windows(2)
            .enumerate()
            .map(|(seg, w)| {
                let mut bufs = carried.clone();
                for (d, t) in bufs.iter_mut().zip(&touched) {
                    if matches!(d.kind, BufKind::Input | BufKind::Output) && !t.contains(&seg) {
                        d.kind = BufKind::Transient;
                    }
                }
                Graph {
                    bufs,
                    nodes: self.nodes[w[0]..w[1]].to_vec(),
                }
            })
            .collect()
    }
}

/// A graph that failed validation: which node, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("graph node {node:?}: {reason}")]
pub struct GraphError {
    pub node: String,
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, GraphBuilder};

    /// Each buffer's readers are the nodes that take it as an operand, in order, a node once
    /// however many of its operands the buffer is; written-only and unread buffers have none.
    #[test]
    fn readers_are_the_nodes_that_take_a_buffer() {
        let mut g = GraphBuilder::new();
        let x = g.act_input("x", 3, 64);
        let w = LinearWeight::Dense(g.weight("w", DType::BF16, [64, 64]));
        let nw = g.weight("norm", DType::F32, [64]);
        let a = g.linear("a", x, &w);
        let n = g.rms_norm("n", a, nw, 1e-6, NormKind::Standard);
        let b = g.linear("b", n, &w);
        let c = g.linear("c", n, &w);
        let d = g.add("d", b, b);
        g.mark_output(c);
        g.mark_output(d);
        let graph = g.finish().unwrap();
        let readers = graph.readers();
        let of = |b: Buf| readers[b.index()].clone();
        assert_eq!(of(x.raw()), vec![0]);
        assert_eq!(of(w.bufs()[0]), vec![0, 2, 3]);
        assert_eq!(of(a.raw()), vec![1]);
        assert_eq!(of(n.raw()), vec![2, 3]);
        assert_eq!(of(b.raw()), vec![4]);
        assert_eq!(of(c.raw()), Vec::<usize>::new());
        assert_eq!(of(d.raw()), Vec::<usize>::new());
    }
}
