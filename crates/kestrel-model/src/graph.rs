//! Forward-pass graphs of a model directory: from its [`ModelConfig`] and the tensor names of its
//! [`Weights`], one op graph for a chunk of `tokens` tokens at positions `past..past + tokens`
//! (prefill when `past` is 0 and there are several, a decode step for one), with the KV caches
//! and recurrent states as persistent buffers shared by every graph of the same model on a
//! backend. [`Forward::upload`] writes every weight; a backend shares weights by label, so that
//! is needed once per backend and model.
//!
//! Weight buffers are labelled with the checkpoint's tensor names, so a program's weights are
//! the file's tensors; packed experts, rotary tables and weights quantised on load
//! ([`ForwardSpec::quant`]) are derived on the host.

use std::collections::HashMap;

use kestrel_core::expert_slots::{table_words, SlotPolicy};
use kestrel_core::ir::BufKind;
use kestrel_core::ir::{
    Buf, BufId, Drawn, Draws, ExpertFormat, ExpertIds, ExpertLayout, ExpertWeights, Graph, KvPages,
    LinearWeight, Logits, NormKind, Normed, Op, PageTable, Positions, QueryChunk, Residual, SeqIds,
    StateRows, TokenIds, Tokens, Weight,
};
use kestrel_core::quant::{QuantFormat, QuantMatrix};
use kestrel_core::rope::RopeTable;
use kestrel_core::{Backend, DType, GraphBuilder};

use crate::config::{LayerKind, MlpKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::experts::pack_experts;
use crate::weights::Weights;

/// Rows of a block of the KV caches (see `KvPages`); a cache holds whole blocks, so its rows
/// are the context rounded up to a block.
pub const KV_BLOCK: usize = 16;

/// In a batched step with several prompts' chunks, each prompt's tokens past the outputs are
/// padded to whole runs of this many tokens, a run's queries attending to one sequence
/// (`QueryChunk::run`), so a backend can share each key between them.
pub const CHUNK_RUN: usize = 16;

/// What one forward graph covers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ForwardSpec {
    /// Tokens in this chunk, at positions `past..past + tokens`.
    pub tokens: usize,
    pub past: usize,
    /// Positions the KV caches hold.
    pub ctx: usize,
    /// Element type of the KV caches (f32, bf16 or f16).
    pub cache_dtype: DType,
    /// Element type of the norm outputs that only projections read (the token mixers' inputs,
    /// dense MLPs' inputs): f32, or bf16 where the backend's products of this many tokens round
    /// their activations to bf16 anyway (`Backend::projection_input_dtype`). MoE inputs stay
    /// f32: the router's logits are computed exactly.
    pub projection_inputs: DType,
    /// Logits for every token of the chunk, or only the last.
    pub all_logits: bool,
    /// Quantise the checkpoint's dense projections and experts to this format on load (routers
    /// and the shared-expert gate at 8 bits, as MLX does; matrices whose rows do not divide into
    /// groups stay dense). Already-quantised tensors keep their own format.
    pub quant: Option<QuantFormat>,
    /// Routed experts streamed through a cache of slots per MoE layer instead of all resident.
    pub streaming: Option<Streamed>,
    /// The KV caches as a pool shared by many sequences (None: one sequence over `ctx`
    /// positions, its blocks in order).
    pub pool: Option<KvPool>,
    /// The tokens each belong to a sequence of the pool (a batched step: positions and
    /// sequences are inputs, every token's logits are computed unless `logit_rows` says
    /// otherwise), not a chunk of one sequence.
    pub batched: bool,
    /// In a batched step, the logits of only the first this many tokens: the others only fill
    /// the caches (prompts' chunks riding along with other sequences' next tokens).
    pub logit_rows: Option<usize>,
    /// In a batched step with tokens past its `logit_rows`: they are one sequence's chunk (else
    /// several prompts' chunks, each padded to whole runs of [`CHUNK_RUN`] tokens, its own
    /// sequence's; see `QueryChunk`).
    pub one_chunk: bool,
    /// Also draw each logits row's next token on the backend with that row's own settings and
    /// generator (`Op::SampleRows`; see [`Forward::drawn`]), with a row of token counts for
    /// each sequence of the pool (`sampler.counts`, a state) for the penalties.
    pub draw_rows: bool,
}

/// KV caches as a pool of `blocks` blocks of [`KV_BLOCK`] rows, shared by up to `seqs`
/// sequences of up to `ForwardSpec::ctx` positions each, through a block table the caller
/// writes (`Forward::page_table`, `[seqs, ctx / KV_BLOCK]`). The recurrent states (hybrids)
/// hold a row per sequence and `snapshots` rows more, which no step reads or writes: copies of
/// a sequence's states at a block boundary, for a later sequence with the same prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvPool {
    pub seqs: usize,
    pub blocks: usize,
    pub snapshots: usize,
}

/// How a forward graph streams its routed experts. Each MoE layer has a cache of `slots`
/// expert-sized slots (`{mlp}.experts.cache`). The first `host_layers` MoE layers keep their
/// packed experts in host memory the device reads (`{mlp}.experts.host`, which the caller fills,
/// see [`Forward::host_experts`]), and the graph brings their experts in itself: a chunk whose
/// experts fit the slots (`tokens * k <= slots`) fetches them into the cache
/// (`Op::ExpertFetch`, with the books in `{mlp}.experts.table`); a longer one stages every
/// expert it uses into `experts.staging`, a layer's worth shared by all layers
/// (`Op::ExpertStage`). With `stage_ahead`, a chunk long enough to use most of a layer's
/// experts (`tokens * k >= experts`) stages every expert of the layer instead (from its slot or
/// host memory), two layers ahead into one of two staging buffers (`experts.staging`,
/// `experts.staging.1`) used in turn, so the copy overlaps the layers in between
/// (`Op::ExpertStageAll`). The other layers' experts are brought
/// in by the host between segments ([`Forward::moe_steps`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Streamed {
    pub slots: usize,
    pub host_layers: usize,
    pub policy: SlotPolicy,
    pub stage_ahead: bool,
}

impl ForwardSpec {
    /// `tokens` tokens from position 0 with caches of `ctx` positions of `cache_dtype`; the
    /// last token's logits, f32 norm outputs, weights as stored, no sampling, every expert
    /// resident. Set the other fields with struct update syntax.
    pub const fn new(tokens: usize, ctx: usize, cache_dtype: DType) -> ForwardSpec {
        ForwardSpec {
            tokens,
            past: 0,
            ctx,
            cache_dtype,
            projection_inputs: DType::F32,
            all_logits: false,
            quant: None,
            streaming: None,
            pool: None,
            batched: false,
            logit_rows: None,
            one_chunk: true,
            draw_rows: false,
        }
    }

    /// Blocks a sequence's table row holds.
    pub fn max_blocks(&self) -> usize {
        self.ctx.div_ceil(KV_BLOCK)
    }
}

/// A streamed MoE layer whose experts the host brings in (one past `Streamed::host_layers`):
/// the graph is cut before `node`, and between the segments the host reads the router's
/// expert ids from `ids` and either gives them slots of the layer's cache `into` (its own books,
/// the misses copied in, the slots written into `ids` in their place) or, when `staged`, copies
/// every expert they name to its own index of the staging buffer `into`.
#[derive(Debug, Clone)]
pub struct MoeStep {
    /// Index of the layer's `MoeExperts` node in the graph.
    pub node: usize,
    /// The layer's index among the MoE layers.
    pub layer: usize,
    /// The router's choice, `[tokens, k]` u32.
    pub ids: Buf,
    pub into: Buf,
    pub staged: bool,
    /// The checkpoint's MLP prefix and the layer's experts as stored (all of them).
    pub mlp: String,
    pub layout: ExpertLayout,
}

/// A streamed layer's packed experts in host memory (`BufKind::HostWeight`), which the caller
/// allocates, fills with `pack_experts(mlp, layout)` and hands the backend (`adopt_host`) before
/// the first program is prepared; `Forward::upload` leaves them alone.
#[derive(Debug, Clone)]
pub struct HostExperts {
    pub label: String,
    pub mlp: String,
    pub layout: ExpertLayout,
}

/// Where a weight buffer's bytes come from.
#[derive(Debug, Clone)]
enum Source {
    /// The checkpoint tensors of these names, as stored, one after the other (several when
    /// projections that read the same input are fused into one).
    Tensors(Vec<String>),
    /// Computed on the host.
    Bytes(Vec<u8>),
    /// The experts of the MoE block at this path, packed for `layout`.
    Experts { mlp: String, layout: ExpertLayout },
    /// The dense tensors `parts` (each `[rows, cols]`, stacked by rows) quantised on the host;
    /// this buffer gets the weight words, `scales` and `biases` the rest.
    Quantized {
        parts: Vec<(String, usize)>,
        cols: usize,
        format: QuantFormat,
        scales: Buf,
        biases: Buf,
    },
}

/// How a projection's weight is held on the backend.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Held {
    /// As stored, dense, of this dtype.
    Dense(DType),
    /// As stored, MLX-quantised in this format.
    Stored(QuantFormat),
    /// Stored dense, quantised on load to this format.
    OnLoad(QuantFormat),
}

/// The backend's sampler in a forward graph (`ForwardSpec::draw_rows`).
#[derive(Debug, Clone, Copy)]
pub struct Drawing {
    /// Each row's settings and generator, an input written before each run (`u32 [rows,
    /// DRAW_WORDS]`).
    pub draws: BufId<Draws>,
    /// How often each sequence has seen each token (`u32 [seqs, vocab]`, a state every program
    /// shares), for the penalties.
    pub counts: BufId<kestrel_core::ir::State>,
    /// Each row's token and generator after the draw (`u32 [rows, DRAWN_WORDS]`).
    pub out: BufId<Drawn>,
}

/// A built forward graph and what it needs before it runs.
pub struct Forward {
    pub graph: Graph,
    pub tokens: BufId<Tokens>,
    pub positions: BufId<Positions>,
    /// The block table of the KV caches and the sequence the tokens belong to: one sequence
    /// over the whole cache, written once (see [`Forward::write_pages`]).
    pub page_table: BufId<PageTable>,
    pub seq: BufId<SeqIds>,
    pub logits: BufId<Logits>,
    /// The most likely next token of each logits row (lower id on ties), computed on the
    /// backend, so greedy decoding reads back one id instead of the vocabulary's logits.
    pub argmax: BufId<TokenIds>,
    /// With `spec.draw_rows`: what the backend's sampler reads and writes.
    pub drawn: Option<Drawing>,
    pub spec: ForwardSpec,
    /// The recurrent and convolution states of the linear-attention layers (not the KV caches):
    /// what a new sequence must start from zero.
    pub states: Vec<Buf>,
    /// With `spec.streaming`: the layers whose experts the host brings in, in order.
    pub moe_steps: Vec<MoeStep>,
    /// With `spec.streaming`: the layers whose experts the graph brings in from host memory,
    /// and their books (`expert_slots` tables, for the statistics).
    pub host_experts: Vec<HostExperts>,
    pub expert_tables: Vec<Buf>,
    sources: Vec<(Buf, Source)>,
}

struct Build<'a> {
    c: &'a ModelConfig,
    w: &'a Weights,
    g: GraphBuilder,
    sources: Vec<(Buf, Source)>,
    states: Vec<Buf>,
    /// `model` or `model.language_model`.
    prefix: &'static str,
    norm: NormKind,
    quant: Option<QuantFormat>,
    streaming: Option<Streamed>,
    /// MoE layers built so far.
    moe_layers: usize,
    /// The staging buffer of longer chunks, once a streamed layer made it.
    staging: Option<BufId<Weight>>,
    /// The second staging buffer, once a layer staged ahead into it.
    staging_ahead: Option<BufId<Weight>>,
    /// Tokens of the chunk.
    tokens: usize,
    /// The MLP prefix of each MoE layer, in order.
    moe_mlps: Vec<String>,
    /// Each host-served MoE layer's packed experts in host memory and its books, once declared.
    host_bufs: HashMap<usize, (BufId<Weight>, BufId<kestrel_core::ir::State>)>,
    /// Each streamed MoE layer's cache of slots, once declared.
    caches: HashMap<usize, BufId<Weight>>,
    moe_steps: Vec<MoeStep>,
    host_experts: Vec<HostExperts>,
    expert_tables: Vec<Buf>,
    /// Rows of the KV caches.
    cache_rows: usize,
    /// With a pool: the rows of the recurrent states, one a sequence.
    state_rows: Option<StateRows>,
}

impl Build<'_> {
    fn err(&self, name: &str, reason: String) -> ModelError {
        ModelError::Tensor {
            name: name.to_string(),
            reason,
        }
    }

    /// A weight buffer holding the tensor `name` as stored, of the expected shape.
    fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<BufId<Weight>> {
        let t = self.w.get(name)?;
        // Checkpoints store convolutions as `[C, 1, K]` where the graph wants `[C, K]`: shapes
        // agree once dimensions of size 1 are dropped (a transposed matrix still does not).
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(t.shape) != squeeze(shape) {
            return Err(self.err(
                name,
                format!("shape {:?}, config.json implies {shape:?}", t.shape),
            ));
        }
        let b = self.g.weight(name, t.dtype, shape.to_vec());
        self.sources
            .push((b.raw(), Source::Tensors(vec![name.to_string()])));
        Ok(b)
    }

    /// How the projection `base` (`[rows, cols]`) is held: dense as stored, MLX-quantised as
    /// stored (`.scales` beside it), or quantised on load. Checks the stored shapes.
    fn stored_as(&self, base: &str, rows: usize, cols: usize) -> Result<Held> {
        let name = format!("{base}.weight");
        let t = self.w.get(&name)?;
        if !self.w.contains(&format!("{base}.scales")) {
            if t.shape != [rows, cols] {
                return Err(self.err(
                    &name,
                    format!("shape {:?}, config.json implies [{rows}, {cols}]", t.shape),
                ));
            }
            // Routers and gates decide discrete things: 8 bits whatever the rest gets.
            let router = base.ends_with(".mlp.gate") || base.ends_with(".shared_expert_gate");
            let format = self
                .quant
                .map(|q| if router { QuantFormat { bits: 8, ..q } } else { q });
            return Ok(match format {
                Some(format) if format.fits(cols) => Held::OnLoad(format),
                _ => Held::Dense(t.dtype),
            });
        }
        if t.dtype != DType::U32 || t.shape.len() != 2 || t.shape[0] != rows || t.shape[1] == 0 {
            return Err(self.err(
                &name,
                format!(
                    "{} {:?}, config.json implies u32 [{rows}, words]",
                    t.dtype, t.shape
                ),
            ));
        }
        let bits = (32 * t.shape[1] / cols) as u32;
        let s = self.w.get(&format!("{base}.scales"))?;
        let groups = s.shape.get(1).copied().unwrap_or(0);
        if groups == 0 || cols % groups != 0 {
            return Err(self.err(
                &format!("{base}.scales"),
                format!("shape {:?} for the {cols} columns config.json implies", s.shape),
            ));
        }
        let b = self.w.get(&format!("{base}.biases"))?;
        let scale = match crate::experts::scale_type(s.dtype) {
            Some(scale) if b.dtype == s.dtype && b.shape == s.shape && s.shape == [rows, groups] => scale,
            _ => {
                return Err(self.err(
                    &format!("{base}.scales"),
                    format!(
                        "{} {:?} beside biases {} {:?}: expected bf16 or f32 [{rows}, {groups}] both",
                        s.dtype, s.shape, b.dtype, b.shape
                    ),
                ))
            }
        };
        let format = QuantFormat {
            bits,
            group_size: cols / groups,
            scale,
        };
        if let Some(q) = &self.c.quant {
            if let Some(want) = q.format_for(base) {
                if (want.bits, want.group_size) != (format.bits, format.group_size) {
                    return Err(self.err(&name, format!("stored as {format:?}, config.json says {want:?}")));
                }
            }
        }
        Ok(Held::Stored(format))
    }

    /// A projection `[rows, cols]`: dense as stored, or MLX-quantised (`.scales` beside it).
    fn linear(&mut self, base: &str, rows: usize, cols: usize) -> Result<LinearWeight> {
        let held = self.stored_as(base, rows, cols)?;
        Ok(self.stacked(base, &[(base, rows)], cols, held))
    }

    /// The projections `parts` (name, rows), all of `cols` columns, as one weight of their
    /// stacked rows labelled `label`, when they are held alike (else None: the caller runs
    /// them one by one).
    fn linear_rows(
        &mut self,
        label: &str,
        parts: &[(&str, usize)],
        cols: usize,
    ) -> Result<Option<LinearWeight>> {
        let held = parts
            .iter()
            .map(|&(base, rows)| self.stored_as(base, rows, cols))
            .collect::<Result<Vec<_>>>()?;
        if held.windows(2).any(|w| w[0] != w[1]) {
            return Ok(None);
        }
        Ok(Some(self.stacked(label, parts, cols, held[0])))
    }

    fn stacked(&mut self, label: &str, parts: &[(&str, usize)], cols: usize, held: Held) -> LinearWeight {
        let rows = parts.iter().map(|p| p.1).sum();
        let names = |suffix: &str| {
            parts
                .iter()
                .map(|(b, _)| format!("{b}.{suffix}"))
                .collect::<Vec<_>>()
        };
        match held {
            Held::Dense(dtype) => {
                // A single projection keeps its tensor's name as its label.
                let label = if parts.len() == 1 {
                    format!("{label}.weight")
                } else {
                    label.to_string()
                };
                let b = self.g.weight(&label, dtype, [rows, cols]);
                self.sources.push((b.raw(), Source::Tensors(names("weight"))));
                LinearWeight::Dense(b)
            }
            Held::Stored(format) | Held::OnLoad(format) => {
                let lw = self.g.quant_weight(label, rows, cols, format);
                let LinearWeight::Quant {
                    weight,
                    scales,
                    biases,
                    ..
                } = lw
                else {
                    unreachable!("quant_weight makes a quantised weight")
                };
                if matches!(held, Held::Stored(_)) {
                    for (b, suffix) in [(weight, "weight"), (scales, "scales"), (biases, "biases")] {
                        self.sources.push((b.raw(), Source::Tensors(names(suffix))));
                    }
                } else {
                    let parts = parts.iter().map(|&(b, r)| (format!("{b}.weight"), r)).collect();
                    self.sources.push((
                        weight.raw(),
                        Source::Quantized {
                            parts,
                            cols,
                            format,
                            scales: scales.raw(),
                            biases: biases.raw(),
                        },
                    ));
                }
                lw
            }
        }
    }

    fn norm_weight(&mut self, name: &str, dim: usize) -> Result<BufId<Weight>> {
        self.tensor(name, &[dim])
    }
}

impl Forward {
    /// The graph of `spec` for the model `c` whose tensors are `w`.
    pub fn build(c: &ModelConfig, w: &Weights, spec: ForwardSpec) -> Result<Forward> {
        if spec.tokens == 0 || (!spec.batched && spec.past + spec.tokens > spec.ctx) {
            return Err(ModelError::Config {
                key: "ctx".into(),
                reason: format!(
                    "{} tokens at position {} do not fit a context of {}",
                    spec.tokens, spec.past, spec.ctx
                ),
            });
        }
        let mut b = Build {
            c,
            w,
            g: GraphBuilder::new(),
            sources: Vec::new(),
            states: Vec::new(),
            prefix: if c.nested_text {
                "model.language_model"
            } else {
                "model"
            },
            quant: spec.quant,
            streaming: spec.streaming,
            moe_layers: 0,
            staging: None,
            staging_ahead: None,
            tokens: spec.tokens,
            moe_mlps: Vec::new(),
            host_bufs: HashMap::new(),
            caches: HashMap::new(),
            moe_steps: Vec::new(),
            host_experts: Vec::new(),
            expert_tables: Vec::new(),
            cache_rows: 0,
            state_rows: None,
            norm: if c.arch.is_hybrid() {
                NormKind::ZeroCentered
            } else {
                NormKind::Standard
            },
        };
        let prefix = b.prefix;
        b.moe_mlps = (0..c.layers)
            .filter(|&i| c.mlp_kinds[i] == MlpKind::Moe)
            .map(|i| format!("{prefix}.layers.{i}.mlp"))
            .collect();
        let tokens = b.g.tokens_input("tokens", spec.tokens);
        let positions = b.g.positions_input("positions", spec.tokens);
        if spec.batched && spec.pool.is_none() {
            return Err(ModelError::Config {
                key: "batch".into(),
                reason: "a batched step needs a pool of KV blocks".into(),
            });
        }
        if let Some(r) = spec.logit_rows {
            if !spec.batched || r == 0 || r > spec.tokens {
                return Err(ModelError::Config {
                    key: "batch".into(),
                    reason: format!("logits of {r} rows of {} tokens", spec.tokens),
                });
            }
        }
        // The block table (one sequence's blocks in order, or the pool's sequences) and the
        // tokens' sequence (one for a chunk, one each for a batched step).
        let (seqs, blocks) = spec.pool.map_or((1, spec.max_blocks()), |p| (p.seqs, p.blocks));
        let page_table = b.g.page_table_input("kv.table", seqs, spec.max_blocks());
        let seq =
            b.g.seq_input("kv.seq", if spec.batched { spec.tokens } else { 1 });
        let pages = b.g.kv_pages("kv.pages", page_table, seq, KV_BLOCK);
        b.cache_rows = blocks * KV_BLOCK;
        // With a pool, recurrent states hold a row per sequence, found as the pages are.
        b.state_rows = spec.pool.map(|p| b.g.state_rows(seq, p.seqs + p.snapshots));
        let embed = b.linear(&format!("{prefix}.embed_tokens"), c.vocab, c.hidden)?;
        let x: BufId<Residual> = b.g.embed("embed", &embed, tokens);
        // The first two MoE layers' experts, when whole layers are staged ahead.
        stage_ahead(&mut b, 0);
        stage_ahead(&mut b, 1);
        // One rotary table for every layer.
        let table = RopeTable::new(
            c.rope.theta,
            c.head_dim,
            c.rope.partial_rotary_factor,
            &c.rope.scaling,
        );
        let inv_freq = b.g.weight("rope.inv_freq", DType::F32, [table.rot_dim / 2]);
        b.sources.push((
            inv_freq.raw(),
            Source::Bytes(bytemuck::cast_slice(&table.inv_freq).to_vec()),
        ));
        // Each layer's feed-forward output joins the residual in the next layer's input norm (one
        // add-and-norm instead of an add and a norm).
        let mut pending: Option<BufId<kestrel_core::ir::Act>> = None;
        for i in 0..c.layers {
            let l = format!("{prefix}.layers.{i}");
            let in_ln = b.norm_weight(&format!("{l}.input_layernorm.weight"), c.hidden)?;
            let name = format!("{l}.input_layernorm");
            let eps = c.norm_eps as f32;
            let pi = spec.projection_inputs;
            let h = match pending.take() {
                Some(m) => b.g.add_rms_norm_to(&name, x, m, in_ln, eps, b.norm, pi),
                None => b.g.rms_norm_to(&name, x, in_ln, eps, b.norm, pi),
            };
            let mixed = match c.layer_kinds[i] {
                LayerKind::FullAttention => {
                    attention(&mut b, &l, h, positions, pages, inv_freq, &table, spec)?
                }
                LayerKind::LinearAttention => linear_attention(&mut b, &l, h)?,
            };
            let post_ln = b.norm_weight(&format!("{l}.post_attention_layernorm.weight"), c.hidden)?;
            let h2 = b.g.add_rms_norm_to(
                &format!("{l}.post_attention_layernorm"),
                x,
                mixed,
                post_ln,
                c.norm_eps as f32,
                b.norm,
                match c.mlp_kinds[i] {
                    MlpKind::Dense => pi,
                    MlpKind::Moe => DType::F32,
                },
            );
            let m = match c.mlp_kinds[i] {
                MlpKind::Dense => dense_mlp(&mut b, &format!("{l}.mlp"), h2, c.intermediate)?,
                MlpKind::Moe => moe(&mut b, &format!("{l}.mlp"), h2)?,
            };
            pending = Some(m);
        }
        let final_ln = b.norm_weight(&format!("{prefix}.norm.weight"), c.hidden)?;
        let (name, eps) = (format!("{prefix}.norm"), c.norm_eps as f32);
        let h = match pending {
            Some(m) => b.g.add_rms_norm(&name, x, m, final_ln, eps, b.norm),
            None => b.g.rms_norm(&name, x, final_ln, eps, b.norm),
        };
        // The lm_head runs on the last token's row only, unless every token's logits are wanted
        // (in a batched step, every token is the last of its sequence, or the first
        // `logit_rows` are).
        let h = match spec.logit_rows {
            Some(r) if r < spec.tokens => b.g.first_rows("logit_rows", h, r),
            _ if spec.all_logits || spec.batched || spec.tokens == 1 => h,
            _ => b.g.last_row("last_row", h),
        };
        let head = if c.tie_embeddings && !w.contains("lm_head.weight") {
            embed
        } else {
            b.linear("lm_head", c.vocab, c.hidden)?
        };
        let logits = b.g.lm_head("lm_head", h, &head);
        let argmax = b.g.argmax("argmax", logits);
        b.g.mark_output(logits);
        b.g.mark_output(argmax);
        let drawn = spec.draw_rows.then(|| {
            let rows = b.g.decl(logits).shape[0];
            let seqs = spec.pool.map_or(1, |p| p.seqs);
            let draws = b.g.draws_input("draws", rows);
            let counts = b.g.state("sampler.counts", DType::U32, [seqs, c.vocab]);
            let out = b.g.sample_rows("sample_rows", logits, draws, counts);
            b.g.mark_output(out);
            Drawing { draws, counts, out }
        });
        let graph = b.g.finish().map_err(|e| ModelError::Config {
            key: "graph".into(),
            reason: e.to_string(),
        })?;
        // Each host-served layer's experts node.
        let mut moe_steps = b.moe_steps;
        for step in &mut moe_steps {
            let label = format!("{}.experts", step.mlp);
            step.node = graph
                .nodes
                .iter()
                .position(|n| n.label == label && matches!(n.op, Op::MoeExperts { .. }))
                .expect("every streamed layer has an experts node");
        }
        Ok(Forward {
            graph,
            tokens,
            positions,
            page_table,
            seq,
            logits,
            argmax,
            drawn,
            spec,
            states: b.states,
            moe_steps,
            host_experts: b.host_experts,
            expert_tables: b.expert_tables,
            sources: b.sources,
        })
    }

    /// Writes `page_table` and `seq` for the one sequence this graph runs into `program` (this
    /// graph or a segment of it; where the segment reads them): blocks `0, 1, 2, ...` (the
    /// caches are contiguous) and sequence 0. Once per program: inputs keep what was written.
    pub fn write_pages<B: Backend>(&self, backend: &mut B, program: &mut B::Program) -> Result<()> {
        let blocks = self.graph.decl(self.page_table).elem_count() as u32;
        let table: Vec<u32> = (0..blocks).collect();
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        if B::graph(program).decl(self.page_table).kind == BufKind::Input {
            backend
                .upload(program, self.page_table, &table)
                .map_err(backend_err)?;
        }
        if B::graph(program).decl(self.seq).kind == BufKind::Input {
            backend.upload(program, self.seq, &[0u32]).map_err(backend_err)?;
        }
        Ok(())
    }

    /// Writes every weight into `program`'s buffers. Weights are shared by label between the
    /// programs of one backend, so this is needed once per backend and model.
    pub fn upload<B: Backend>(&self, w: &Weights, backend: &mut B, program: &mut B::Program) -> Result<()> {
        self.upload_with(w, backend, program, &mut |_, _| {})
    }

    /// `upload`, calling `progress(done, total)` in bytes of weight buffers after each one.
    pub fn upload_with<B: Backend>(
        &self,
        w: &Weights,
        backend: &mut B,
        program: &mut B::Program,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let size = |b: &Buf| self.graph.decl(*b).byte_len() as u64;
        let total: u64 = self.sources.iter().map(|(b, _)| size(b)).sum();
        let mut done = 0;
        for (buf, src) in &self.sources {
            match src {
                Source::Tensors(names) => {
                    let mut at = 0;
                    for name in names {
                        let bytes = w.get(name)?.bytes;
                        backend
                            .write_bytes(program, *buf, at, bytes)
                            .map_err(backend_err)?;
                        at += bytes.len();
                    }
                    Ok(())
                }
                Source::Bytes(bytes) => backend.write_bytes(program, *buf, 0, bytes),
                Source::Quantized {
                    parts,
                    cols,
                    format,
                    scales,
                    biases,
                } => {
                    let (mut row, wpr) = (0, format.words_per_row(*cols));
                    for (name, rows) in parts {
                        let t = w.get(name)?;
                        let v = crate::experts::dense_values(&t, 0, rows * cols)?;
                        let q = QuantMatrix::quantize(&v, *rows, *cols, *format);
                        let (sb, bb) = q.group_bytes().ok_or_else(|| ModelError::Tensor {
                            name: name.clone(),
                            reason: format!("its group scales cannot be held as {format:?}"),
                        })?;
                        backend
                            .write_bytes(program, *scales, format.scale_part(row, *cols), &sb)
                            .map_err(backend_err)?;
                        backend
                            .write_bytes(program, *biases, format.bias_part(row, *cols), &bb)
                            .map_err(backend_err)?;
                        backend
                            .write_bytes(program, *buf, row * wpr * 4, bytemuck::cast_slice(&q.weight))
                            .map_err(backend_err)?;
                        row += rows;
                    }
                    Ok(())
                }
                Source::Experts { mlp, layout } => {
                    backend.write_bytes(program, *buf, 0, &pack_experts(w, mlp, layout)?)
                }
            }
            .map_err(backend_err)?;
            done += size(buf);
            progress(done, total);
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn attention(
    b: &mut Build,
    l: &str,
    h: BufId<Normed>,
    pos: BufId<Positions>,
    pages: KvPages,
    inv_freq: BufId<Weight>,
    table: &RopeTable,
    spec: ForwardSpec,
) -> Result<BufId<kestrel_core::ir::Act>> {
    let c = b.c;
    let (heads, kv, hd) = (c.heads, c.kv_heads, c.head_dim);
    let a = format!("{l}.self_attn");
    // The hybrids gate the attention output: q_proj gives each head its queries, then a gate.
    let gated = c.arch.is_hybrid();
    let q_rows = if gated { 2 * heads * hd } else { heads * hd };
    let ow = b.linear(&format!("{a}.o_proj"), c.hidden, heads * hd)?;
    // q, k and v read the same input: one product over their stacked weights when they are
    // held alike (always, in published checkpoints), else three and a concatenation.
    let (qn, kn, vn) = (
        format!("{a}.q_proj"),
        format!("{a}.k_proj"),
        format!("{a}.v_proj"),
    );
    let parts = [
        (qn.as_str(), q_rows),
        (kn.as_str(), kv * hd),
        (vn.as_str(), kv * hd),
    ];
    let qkv = match b.linear_rows(&format!("{a}.qkv_proj"), &parts, c.hidden)? {
        Some(w) => b.g.linear(&format!("{a}.qkv_proj"), h, &w),
        None => {
            let mut outs = Vec::new();
            for (base, rows) in parts {
                let w = b.linear(base, rows, c.hidden)?;
                outs.push(b.g.linear(base, h, &w));
            }
            b.g.concat(&format!("{a}.qkv"), &outs)
        }
    };
    // Qwen3 families normalise each head of q and k before the rotation.
    let norms = if b.w.contains(&format!("{a}.q_norm.weight")) {
        let (qn, kn) = (
            b.norm_weight(&format!("{a}.q_norm.weight"), hd)?,
            b.norm_weight(&format!("{a}.k_norm.weight"), hd)?,
        );
        Some((qn, kn, c.norm_eps as f32, b.norm))
    } else {
        None
    };
    let rows = b.cache_rows;
    let kc = b.g.cache(&format!("{l}.k_cache"), spec.cache_dtype, kv, rows, hd);
    let vc = b.g.cache(&format!("{l}.v_cache"), spec.cache_dtype, kv, rows, hd);
    // Norms, rotation, the gate split and the cache append in one op.
    let (q, gate) = b.g.attention_inputs(
        &format!("{a}.inputs"),
        qkv,
        gated,
        norms,
        pos,
        inv_freq,
        table.rot_dim,
        table.attention_scaling,
        kc,
        vc,
        pages,
    );
    // A batched step's tokens past its outputs: one prompt's chunk, or several prompts' in runs
    // of CHUNK_RUN tokens (each prompt's tokens padded to whole runs).
    let chunk = spec
        .logit_rows
        .filter(|&r| spec.batched && r < spec.tokens)
        .map(|from| QueryChunk {
            from,
            run: if spec.one_chunk { 0 } else { CHUNK_RUN },
        });
    let mut o = b.g.attention_chunked(
        &format!("{a}.attention"),
        q,
        (kc, vc),
        pos,
        pages,
        heads,
        1.0 / (hd as f32).sqrt(),
        chunk,
    );
    if let Some(gate) = gate {
        o = b.g.sigmoid_gate(&format!("{a}.gate"), o, gate);
    }
    Ok(b.g.linear(&format!("{a}.o_proj"), o, &ow))
}

/// Gated DeltaNet. Qwen3-Next fuses the input projections per key head
/// (`in_proj_qkvz`: q, k, v, z; `in_proj_ba`: b, a); Qwen3.5 keeps them apart
/// (`in_proj_qkv` with q, k and v one after the other, `in_proj_z`, `in_proj_b`, `in_proj_a`).
fn linear_attention(b: &mut Build, l: &str, h: BufId<Normed>) -> Result<BufId<kestrel_core::ir::Act>> {
    let c = b.c;
    let la = c
        .linear_attn
        .as_ref()
        .expect("hybrid configs carry linear-attention sizes");
    let (nk, nv, dk, dv, kernel) = (
        la.key_heads,
        la.value_heads,
        la.key_head_dim,
        la.value_head_dim,
        la.conv_kernel,
    );
    let r = nv / nk;
    let (key_dim, value_dim) = (nk * dk, nv * dv);
    let conv_dim = 2 * key_dim + value_dim;
    let p = format!("{l}.linear_attn");
    let (mixed, z, beta_in, a_in) = if b.w.contains(&format!("{p}.in_proj_qkvz.weight")) {
        let qkvz_w = b.linear(
            &format!("{p}.in_proj_qkvz"),
            2 * key_dim + 2 * value_dim,
            c.hidden,
        )?;
        let ba_w = b.linear(&format!("{p}.in_proj_ba"), 2 * nv, c.hidden)?;
        let qkvz = b.g.linear(&format!("{p}.in_proj_qkvz"), h, &qkvz_w);
        let ba = b.g.linear(&format!("{p}.in_proj_ba"), h, &ba_w);
        let parts =
            b.g.split(&format!("{p}.qkvz"), qkvz, nk, &[dk, dk, r * dv, r * dv]);
        let bap = b.g.split(&format!("{p}.ba"), ba, nk, &[r, r]);
        let mixed =
            b.g.concat(&format!("{p}.mixed_qkv"), &[parts[0], parts[1], parts[2]]);
        (mixed, parts[3], bap[0], bap[1])
    } else {
        let qkv_w = b.linear(&format!("{p}.in_proj_qkv"), conv_dim, c.hidden)?;
        let z_w = b.linear(&format!("{p}.in_proj_z"), value_dim, c.hidden)?;
        let b_w = b.linear(&format!("{p}.in_proj_b"), nv, c.hidden)?;
        let a_w = b.linear(&format!("{p}.in_proj_a"), nv, c.hidden)?;
        (
            b.g.linear(&format!("{p}.in_proj_qkv"), h, &qkv_w),
            b.g.linear(&format!("{p}.in_proj_z"), h, &z_w),
            b.g.linear(&format!("{p}.in_proj_b"), h, &b_w),
            b.g.linear(&format!("{p}.in_proj_a"), h, &a_w),
        )
    };
    let conv_w = b.tensor(&format!("{p}.conv1d.weight"), &[conv_dim, kernel])?;
    let a_log = b.tensor(&format!("{p}.A_log"), &[nv])?;
    let dt_bias = b.tensor(&format!("{p}.dt_bias"), &[nv])?;
    let norm_w = b.tensor(&format!("{p}.norm.weight"), &[dv])?;
    let out_w = b.linear(&format!("{p}.out_proj"), c.hidden, value_dim)?;
    // With a pool, a row of each state per sequence.
    let rows = b.state_rows;
    let per_seq = |shape: &[usize]| match rows {
        Some(r) => [&[r.seqs][..], shape].concat(),
        None => shape.to_vec(),
    };
    let conv_state = b.g.state(
        &format!("{l}.conv_state"),
        DType::F32,
        per_seq(&[conv_dim, kernel - 1]),
    );
    let state = b.g.state(
        &format!("{l}.recurrent_state"),
        DType::F32,
        per_seq(&[nv, dk, dv]),
    );
    b.states.extend([conv_state.raw(), state.raw()]);
    let conv =
        b.g.causal_conv1d(&format!("{p}.conv1d"), mixed, conv_w, conv_state, rows);
    let qkv =
        b.g.split(&format!("{p}.qkv"), conv, 1, &[key_dim, key_dim, value_dim]);
    let (g, beta) =
        b.g.delta_gates(&format!("{p}.gates"), a_in, beta_in, a_log, dt_bias);
    let o = b.g.delta_rule(
        &format!("{p}.delta_rule"),
        qkv[0],
        qkv[1],
        qkv[2],
        g,
        beta,
        state,
        rows,
        nk,
        dk,
        nv,
        dv,
        kestrel_core::ir::DeltaAlgo::Auto,
    );
    let o =
        b.g.gated_rms_norm(&format!("{p}.norm"), o, z, norm_w, dv, c.norm_eps as f32);
    Ok(b.g.linear(&format!("{p}.out_proj"), o, &out_w))
}

fn dense_mlp(b: &mut Build, m: &str, h: BufId<Normed>, inter: usize) -> Result<BufId<kestrel_core::ir::Act>> {
    let hidden = b.c.hidden;
    let gw = b.linear(&format!("{m}.gate_proj"), inter, hidden)?;
    let uw = b.linear(&format!("{m}.up_proj"), inter, hidden)?;
    let dw = b.linear(&format!("{m}.down_proj"), hidden, inter)?;
    let g = b.g.linear(&format!("{m}.gate_proj"), h, &gw);
    let u = b.g.linear(&format!("{m}.up_proj"), h, &uw);
    let a = b.g.swiglu(&format!("{m}.act"), g, u);
    Ok(b.g.linear(&format!("{m}.down_proj"), a, &dw))
}

/// The packed experts in host memory and the books of host-tier MoE layer `layer` (whose MLP
/// prefix is `m`), declared the first time they are asked for.
fn host_bufs(
    b: &mut Build,
    layer: usize,
    m: &str,
    layout: ExpertLayout,
    slots: usize,
) -> (BufId<Weight>, BufId<kestrel_core::ir::State>) {
    if let Some(&bufs) = b.host_bufs.get(&layer) {
        return bufs;
    }
    let label = format!("{m}.experts.host");
    let src = b.g.host_weight(&label, layout.total_bytes());
    b.host_experts.push(HostExperts {
        label,
        mlp: m.to_string(),
        layout,
    });
    let table = b.g.state(
        &format!("{m}.experts.table"),
        DType::U32,
        [table_words(slots, layout.experts)],
    );
    b.expert_tables.push(table.raw());
    b.host_bufs.insert(layer, (src, table));
    (src, table)
}

/// The cache of `slots` slots of MoE layer `layer` (MLP prefix `m`), declared the first time
/// it is asked for.
fn cache_of(b: &mut Build, layer: usize, m: &str, bytes: usize) -> BufId<Weight> {
    if let Some(&c) = b.caches.get(&layer) {
        return c;
    }
    let c = b.g.expert_cache(&format!("{m}.experts.cache"), bytes);
    b.caches.insert(layer, c);
    c
}

/// Whether MoE layer `layer` has its whole layer of experts staged ahead (see [`Streamed`]).
fn stages_all(b: &Build, layer: usize) -> bool {
    let (Some(st), Some(moe)) = (b.streaming, b.c.moe.as_ref()) else {
        return false;
    };
    let n = b.tokens * moe.experts_per_token;
    st.stage_ahead && layer < st.host_layers && layer < b.moe_mlps.len() && n > st.slots && n >= moe.experts
}

/// The staging buffer MoE layer `layer` stages into: the two alternate when whole layers are
/// staged ahead (one being filled while the other is read).
fn staging_of(b: &mut Build, layer: usize, bytes: usize) -> BufId<Weight> {
    let (slot, label) = if stages_all(b, layer) && layer % 2 == 1 {
        (&mut b.staging_ahead, "experts.staging.1")
    } else {
        (&mut b.staging, "experts.staging")
    };
    match *slot {
        Some(s) => s,
        None => *slot.insert(b.g.expert_cache(label, bytes)),
    }
}

/// Copies MoE layer `layer`'s experts whole into its staging buffer, when it stages ahead: built
/// two MoE layers before it (after the experts that last read that buffer), so the copy runs
/// beside the layers in between.
fn stage_ahead(b: &mut Build, layer: usize) {
    if !stages_all(b, layer) {
        return;
    }
    let st = b.streaming.expect("stages_all checked it");
    let m = b.moe_mlps[layer].clone();
    let layout = expert_layout(b, &m);
    let (src, table) = host_bufs(b, layer, &m, layout, st.slots);
    let cache = cache_of(b, layer, &m, st.slots * layout.span_bytes());
    let staging = staging_of(b, layer, layout.total_bytes());
    let sizes = (layout.experts, st.slots, layout.span_bytes());
    b.g.expert_stage_all(&format!("{m}.stage_all"), table, src, cache, staging, sizes);
}

/// A streamed layer's experts (see [`Streamed`]): fetched into the layer's cache or staged,
/// by the graph from host memory or by the host between segments.
fn streamed_experts(
    b: &mut Build,
    m: &str,
    h: BufId<Normed>,
    (ids, weights): (BufId<ExpertIds>, BufId<ExpertWeights>),
    layout: ExpertLayout,
    layer: usize,
    st: Streamed,
) -> BufId<kestrel_core::ir::Act> {
    let span = layout.span_bytes();
    let (tokens, k) = b.g.rows_cols(ids);
    let cache = cache_of(b, layer, m, st.slots * span);
    let cached = ExpertLayout {
        experts: st.slots,
        ..layout
    };
    let fetch = tokens * k <= st.slots;
    let staging = (!fetch).then(|| staging_of(b, layer, layout.total_bytes()));
    // The ids the experts node reads: the router's, or the slots a fetch gave them.
    let read_ids = if stages_all(b, layer) {
        // Staged whole, two layers ago.
        ids
    } else if layer < st.host_layers {
        let (src, table) = host_bufs(b, layer, m, layout, st.slots);
        let sizes = (layout.experts, st.slots, span);
        match staging {
            None => {
                b.g.expert_fetch(&format!("{m}.fetch"), ids, table, src, cache, sizes, st.policy)
            }
            Some(staging) => {
                b.g.expert_stage(&format!("{m}.stage"), ids, table, src, cache, staging, sizes);
                ids
            }
        }
    } else {
        b.moe_steps.push(MoeStep {
            node: 0,
            layer,
            ids: ids.raw(),
            into: staging.unwrap_or(cache).raw(),
            staged: staging.is_some(),
            mlp: m.to_string(),
            layout,
        });
        ids
    };
    let name = format!("{m}.experts");
    let out = match staging {
        None => b.g.moe_experts(&name, h, read_ids, weights, cache, cached),
        Some(staging) => b.g.moe_experts(&name, h, read_ids, weights, staging, layout),
    };
    // The layer after next stages into the buffer these experts just read.
    stage_ahead(b, layer + 2);
    out
}

/// How MoE block `m`'s experts are laid out on the device: quantised as stored (gate and up in
/// one format, down in its own), or dense experts quantised on load when asked (and every
/// matrix divides into groups), else bf16.
fn expert_layout(b: &Build, m: &str) -> ExpertLayout {
    let c = b.c;
    let moe = c.moe.as_ref().expect("MoE layers come with a MoE config");
    let mut layout =
        ExpertLayout::uniform(moe.experts, c.hidden, moe.expert_intermediate, ExpertFormat::Bf16);
    if !b.w.contains(&format!("{m}.switch_mlp.gate_proj.scales")) {
        if let Some(q) = b
            .quant
            .filter(|q| q.fits(c.hidden) && q.fits(moe.expert_intermediate))
        {
            layout = ExpertLayout::uniform(
                layout.experts,
                layout.hidden,
                layout.inter,
                ExpertFormat::Quant(q),
            );
        }
        return layout;
    }
    // Each in the format its stored tensors give (the scale type is only in their dtype),
    // unless the quantisation config says other bits or groups (packing then reports the
    // mismatch). Tensors that cannot be read (malformed, or dropped from memory once a streamed
    // layer was packed) leave it to the config, or to packing to report.
    let pick = |down: bool| {
        let proj = if down { "down_proj" } else { "gate_proj" };
        let stored = crate::experts::stored_format(b.w, m, &layout, down).ok();
        match (stored, config_format(c, m, proj)) {
            (Some(s), Some(q)) if (s.bits, s.group_size) == (q.bits, q.group_size) => ExpertFormat::Quant(s),
            (_, Some(q)) => ExpertFormat::Quant(q),
            (Some(s), None) => ExpertFormat::Quant(s),
            (None, None) => ExpertFormat::Bf16,
        }
    };
    let (format, down) = (pick(false), pick(true));
    ExpertLayout {
        format,
        down,
        ..layout
    }
}

/// The quantisation config's format for matrix `proj` of `m`'s experts: its own entry, else the
/// experts' (`switch_mlp`), else the default; None without a config or where it says unquantised.
fn config_format(c: &ModelConfig, m: &str, proj: &str) -> Option<QuantFormat> {
    let q = c.quant.as_ref()?;
    q.overrides
        .get(&format!("{m}.switch_mlp.{proj}"))
        .or_else(|| q.overrides.get(&format!("{m}.switch_mlp")))
        .copied()
        .unwrap_or(Some(q.default))
}

fn moe(b: &mut Build, m: &str, h: BufId<Normed>) -> Result<BufId<kestrel_core::ir::Act>> {
    let c = b.c;
    let moe = c.moe.as_ref().expect("MoE layers come with a MoE config");
    let router = b.linear(&format!("{m}.gate"), moe.experts, c.hidden)?;
    let layout = expert_layout(b, m);
    let logits = b.g.linear(&format!("{m}.gate"), h, &router);
    let (ids, weights) = b.g.router(
        &format!("{m}.topk"),
        logits,
        moe.experts_per_token,
        moe.norm_topk_prob,
    );
    let layer = b.moe_layers;
    b.moe_layers += 1;
    let out = match b.streaming {
        None => {
            let eb =
                b.g.weight(&format!("{m}.experts.packed"), DType::U8, [layout.total_bytes()]);
            b.sources.push((
                eb.raw(),
                Source::Experts {
                    mlp: m.to_string(),
                    layout,
                },
            ));
            b.g.moe_experts(&format!("{m}.experts"), h, ids, weights, eb, layout)
        }
        Some(st) => streamed_experts(b, m, h, (ids, weights), layout, layer, st),
    };
    let Some(si) = moe.shared_intermediate else {
        return Ok(out);
    };
    // The hybrids add a shared expert, scaled by a sigmoid gate of its own.
    let shared = dense_mlp(b, &format!("{m}.shared_expert"), h, si)?;
    let sg_w = b.linear(&format!("{m}.shared_expert_gate"), 1, c.hidden)?;
    let sg = b.g.linear(&format!("{m}.shared_expert_gate"), h, &sg_w);
    let shared = b.g.sigmoid_gate(&format!("{m}.shared_gated"), shared, sg);
    Ok(b.g.add(&format!("{m}.sum"), out, shared))
}
