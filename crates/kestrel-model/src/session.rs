//! A model on a backend: the directory's config and weights, the weights uploaded with the first
//! program, and forward passes over chunks of tokens at given positions (KV caches and recurrent
//! states persist between them on the backend). Positions are data, not part of a graph, so a
//! program is prepared once per chunk length and replayed: every decode step after the first
//! is one run of the same program (one CUDA graph replay). With an expert cache, the routed
//! experts stream through a cache of slots per MoE layer: for the layers whose packed experts
//! the host tier holds (page-locked host memory the device reads), the graph itself resolves
//! the router's choice and copies the misses in, so a decode step is still one replay; the
//! other layers' experts are read from the checkpoint by the host, between segments of the
//! program cut before those layers' experts.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Instant;

use kestrel_core::ir::BufKind;
use kestrel_core::quant::QuantFormat;
use kestrel_core::sample::{
    backend_draws, counts_of, draw_words, rng_state, SamplingParams, BACKEND_MAX_TOP_K, DRAWN_WORDS,
    DRAW_WORDS, NO_COUNTS,
};
use kestrel_core::{Backend, DType};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use kestrel_core::expert_slots::{self, resolve, stage_sources, table_words};

use crate::expert_cache::{CacheStats, Eviction};
use crate::expert_disk::{DiskStats, ExpertReader};
use crate::experts::{expert_copy_parts, expert_tensor_names, pack_expert, pack_experts_into, CopyPart};
use crate::graph::{Forward, ForwardSpec, KvPool, MoeStep, Streamed, CHUNK_RUN, KV_BLOCK};
use crate::weights::Weights;

/// What a caller wants from a [`Session::step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Every token's logits, `[ids.len(), vocab]`.
    AllLogits,
    /// The last token's logits, `[vocab]`.
    LastLogits,
    /// The most likely next token, chosen on the backend (only its id is read back).
    Argmax,
    /// Tokens drawn on the backend, each output with its own settings and generator
    /// ([`Session::step_mixed_drawn`], [`Session::prepare_mixed`]); a chunk of one sequence
    /// ([`Session::step`]) does not take it.
    Sample,
}

/// What a [`Session::step`] hands back: logits for the `*Logits` wants, a token id for the
/// others.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Logits(Vec<f32>),
    Token(u32),
}

/// What a [`Session::step_batch`] hands back: each token's argmax, or each token's logits
/// (`[tokens, vocab]`).
#[derive(Debug, Clone, PartialEq)]
pub enum BatchOutput {
    Tokens(Vec<u32>),
    Logits(Vec<f32>),
}

impl BatchOutput {
    pub fn into_tokens(self) -> Option<Vec<u32>> {
        match self {
            BatchOutput::Tokens(t) => Some(t),
            BatchOutput::Logits(_) => None,
        }
    }

    pub fn into_logits(self) -> Option<Vec<f32>> {
        match self {
            BatchOutput::Logits(l) => Some(l),
            BatchOutput::Tokens(_) => None,
        }
    }
}

impl Output {
    /// The token id, for [`Want::Argmax`].
    pub fn token(&self) -> Option<u32> {
        match self {
            Output::Token(t) => Some(*t),
            Output::Logits(_) => None,
        }
    }

    /// The logits, for [`Want::AllLogits`] and [`Want::LastLogits`].
    pub fn into_logits(self) -> Option<Vec<f32>> {
        match self {
            Output::Logits(l) => Some(l),
            Output::Token(_) => None,
        }
    }
}

/// What a program computes at its end: every token's logits, or the last token's (and its
/// argmax), or a batched step's rows drawn on the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Outputs {
    All,
    Last,
    /// A batched step's rows, each also drawn with its own settings (`Op::SampleRows`).
    Draw,
}

impl Outputs {
    fn of(all_logits: bool) -> Outputs {
        if all_logits {
            Outputs::All
        } else {
            Outputs::Last
        }
    }

    /// What a chunk of one sequence computes for `want`.
    fn for_want(want: Want) -> Result<Outputs> {
        match want {
            Want::AllLogits => Ok(Outputs::All),
            Want::LastLogits | Want::Argmax => Ok(Outputs::Last),
            Want::Sample => Err(not_sampling()),
        }
    }
}

fn no_pool() -> ModelError {
    ModelError::Config {
        key: "kv pool".into(),
        reason: "the session's caches are not a pool (Session::with_kv_pool)".into(),
    }
}

fn bad_batch(reason: String) -> ModelError {
    ModelError::Config {
        key: "batch".into(),
        reason,
    }
}

fn not_sampling() -> ModelError {
    ModelError::Config {
        key: "sampling".into(),
        reason: "a chunk of one sequence gives logits or its argmax; tokens drawn on the backend \
                 come from a batched step (Session::step_mixed_drawn)"
            .into(),
    }
}

/// A prepared program: (tokens, outputs, whole layers staged ahead, a batched step's rows of
/// logits (None: a chunk of one sequence)).
type Key = (usize, Outputs, bool, Option<(usize, bool)>);

/// KV caches as a pool of blocks shared by sequences (see [`Session::with_kv_pool`]).
struct Pool {
    /// Sequences and blocks the caller uses. The table has one more row, `seqs`, whose every
    /// entry is block `blocks`, one more: where the padding tokens of a batched step go.
    seqs: usize,
    blocks: usize,
    /// `[seqs + 1, max_blocks]`, and its version (bumped by every change).
    table: Vec<u32>,
    /// Rows of the recurrent states past the sequences' and the padding row's: snapshots.
    snapshots: usize,
    version: u64,
    /// The sequence the chunks of [`Session::step`] belong to.
    current: u32,
}

/// The batch sizes a batched step is padded to (one program each); past the last, multiples
/// of it. A padding row costs a real one's work in one token's expert kernels (up to 8 tokens),
/// hence 3 and 6, and 12 between 8 and 16.
const BATCH_BUCKETS: [usize; 12] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64];

/// The bucket `n` tokens are padded to.
pub fn batch_bucket(n: usize) -> usize {
    let top = BATCH_BUCKETS[BATCH_BUCKETS.len() - 1];
    BATCH_BUCKETS
        .iter()
        .copied()
        .find(|&b| b >= n)
        .unwrap_or_else(|| n.div_ceil(top) * top)
}

/// Whether chunks long enough to use most of a layer's experts stage whole layers ahead (see
/// [`Streamed`]): that copies every expert of the layer, which pays when the chunk uses most of
/// them (as trained routers spread a long prompt) and costs when it uses few.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageAhead {
    Off,
    On,
    /// Decided by the first such chunk, which runs without: on if it used at least three
    /// quarters of the experts of every layer, on average.
    Auto,
}

/// The share of the experts the first long chunk must use for [`StageAhead::Auto`] to turn on.
const AHEAD_SHARE: f64 = 0.75;

/// A prepared program: the forward graph and its segments on the backend, which run in order
/// (one segment, unless the host brings some layers' experts in: then the graph is cut before
/// each of those layers' experts).
struct Prog<B: Backend> {
    f: Forward,
    segments: Vec<B::Program>,
    /// When it was last asked for ([`Session::clock`]).
    used: u64,
    /// With a pool of KV blocks: the version of the block table its inputs hold (0: none),
    /// the sequence a chunk program's input names, and a batched program's tokens' sequences
    /// (each input written only when it changes: a copy to the device costs a round trip).
    table_version: u64,
    seq: Option<u32>,
    seqs: Vec<u32>,
}

/// Programs of chunks a session keeps at most: each holds its own activations, and steps of
/// many different lengths (a server's prompts) would otherwise keep one each. The least
/// recently used one goes first. Batched steps' programs (one per pair of buckets of tokens
/// and of rows of logits) are counted apart, up to `MAX_BATCH_PROGRAMS`.
pub const MAX_PROGRAMS: usize = 12;
pub const MAX_BATCH_PROGRAMS: usize = 20;

impl<B: Backend> Prog<B> {
    /// The segment holding the outputs (and, like every segment, the states).
    fn last(&mut self) -> &mut B::Program {
        self.segments.last_mut().expect("a program has a segment")
    }
}

/// Experts streamed through a cache of `slots` slots per MoE layer. The first `host_layers`
/// MoE layers' packed experts are placed in the backend's host memory (page-locked on CUDA)
/// when the first program is prepared, and the graph serves them; the others are served by the
/// host from the checkpoint, with books of their own.
struct Streaming<H> {
    slots: usize,
    policy: Eviction,
    host_layers: usize,
    /// Long chunks stage whole layers ahead, in two staging buffers (see [`Streamed`]): as
    /// asked, and what was decided (None: [`StageAhead::Auto`] before its first long chunk).
    stage_ahead: StageAhead,
    ahead: Option<bool>,
    /// The host tier is in place (the first program was prepared).
    placed: bool,
    /// Books of the layers the host serves, by MoE layer (made on their first decode step).
    books: Vec<Option<Vec<u32>>>,
    /// Experts the host staged for longer chunks.
    host_staged: u64,
    /// Why the host tier holds fewer layers than it was given, or the disk tier stages through
    /// pageable memory, if either is so.
    note: Option<String>,
    /// How the host reads the experts of the layers outside the host tier (made on first use).
    disk: Option<DiskTier<H>>,
    /// Seconds the host spent bringing experts between segments (the device waits meanwhile).
    host_seconds: f64,
}

impl<H> Streaming<H> {
    fn add_note(&mut self, note: String) {
        self.note = Some(match self.note.take() {
            Some(n) => format!("{n}; {note}"),
            None => note,
        });
    }
}

/// Bytes of each of the disk tier's two staging buffers.
const STAGING_BYTES: usize = 64 << 20;

/// The experts of the layers outside the host tier, read from the weight files by parallel
/// direct reads into staging memory and copied to the device from there; layers whose spans
/// are not byte copies of the files (packing converts them), or weights held in memory, are
/// packed from the weights' map instead.
struct DiskTier<H> {
    reader: ExpertReader,
    /// By MoE layer: where its experts come from, once worked out.
    parts: Vec<LayerSource>,
    staging: Staging<H>,
}

/// Where a disk-tier layer's experts come from.
#[derive(Clone)]
enum LayerSource {
    /// Not worked out yet (the layer has not missed).
    Unknown,
    /// Read from these pieces of the weight files.
    Files(Vec<CopyPart>),
    /// Packed from the weights' map (the spans are not byte copies of the files, or the
    /// weights are held in memory).
    Packed,
}

/// Where read experts wait for their copy to the device.
enum Staging<H> {
    /// Not made yet (no layer's experts were read so far).
    Unmade,
    /// Two buffers of page-locked memory used in turn, so reading one batch overlaps copying
    /// the one before.
    Pinned { bufs: [H; 2], next: usize },
    /// Page-locked memory ran out: one pageable buffer.
    Pageable(Vec<u8>),
}

pub struct Session<B: Backend> {
    pub config: ModelConfig,
    pub weights: Weights,
    pub backend: B,
    /// Positions the KV caches hold.
    pub ctx: usize,
    pub cache_dtype: DType,
    /// Dense weights quantised on load to this format (see [`ForwardSpec::quant`]).
    quant: Option<QuantFormat>,
    uploaded: bool,
    /// Prepared programs by (tokens, outputs).
    programs: HashMap<Key, Prog<B>>,
    /// Counts requests for programs, to find the least recently used.
    clock: u64,
    /// Programs prepared so far, and the time that took (see [`Session::programs_prepared`]).
    prepared: (u64, std::time::Duration),
    /// Programs dropped to make room for another's memory ([`Session::programs_evicted_for_memory`]).
    evicted_for_memory: u64,
    /// Routed experts read through caches of slots instead of all resident.
    streaming: Option<Streaming<B::HostBuffer>>,
    /// Told (bytes done, bytes in all) while the weights upload.
    progress: Option<Box<dyn FnMut(u64, u64)>>,
    /// Told (tokens done, tokens in all) after each chunk of a step that runs in chunks.
    step_progress: Option<Box<dyn FnMut(usize, usize)>>,
    /// A batched step's logits go here, when a caller gave one back (see [`Session::recycle`]):
    /// fresh memory of 39 MB a step (64 rows of 152k) is a page fault every 4 KB.
    spare_logits: Vec<f32>,
    /// Steps of more tokens run in chunks of at most this many (see [`Session::step`]).
    chunk: Option<usize>,
    /// The KV caches as a pool shared by sequences.
    pool: Option<Pool>,
}

impl<B: Backend> Session<B> {
    /// Opens the model directory `dir` for `backend`, with caches of `ctx` positions.
    pub fn open(dir: &Path, backend: B, ctx: usize, cache_dtype: DType) -> Result<Session<B>> {
        let config = ModelConfig::from_dir(dir)?;
        let weights = Weights::open(dir)?;
        Ok(Session::new(config, weights, backend, ctx, cache_dtype))
    }

    /// A model given by its config and weights (for example a synthetic one) on `backend`.
    pub fn new(
        config: ModelConfig,
        weights: Weights,
        backend: B,
        ctx: usize,
        cache_dtype: DType,
    ) -> Session<B> {
        Session {
            config,
            weights,
            backend,
            ctx,
            cache_dtype,
            quant: None,
            uploaded: false,
            programs: HashMap::new(),
            clock: 0,
            prepared: (0, std::time::Duration::ZERO),
            evicted_for_memory: 0,
            streaming: None,
            progress: None,
            step_progress: None,
            spare_logits: Vec::new(),
            chunk: None,
            pool: None,
        }
    }

    /// Lays the KV caches out as a pool of `blocks` blocks of [`KV_BLOCK`] rows shared by up to
    /// `seqs` sequences of up to `ctx` positions each, through a block table the caller keeps
    /// ([`Session::set_page_table`]; until then sequence `s` holds blocks `s * max_blocks`, ...
    /// in order); [`Session::select_seq`] says which sequence `step` runs,
    /// [`Session::step_batch`] runs the next token of many. Recurrent states (hybrids) hold a
    /// row per sequence, which [`Session::reset_seq`] zeroes for a new one. Call before the
    /// first step.
    pub fn with_kv_pool(mut self, seqs: usize, blocks: usize) -> Result<Session<B>> {
        let bad = |reason: String| ModelError::Config {
            key: "kv pool".into(),
            reason,
        };
        if seqs == 0 || blocks == 0 || !self.programs.is_empty() {
            return Err(bad(format!(
                "{seqs} sequences over {blocks} blocks, asked for before any step"
            )));
        }
        let max_blocks = self.ctx.div_ceil(KV_BLOCK);
        // Until the caller says otherwise, sequence s holds blocks s * max_blocks, ... in order
        // (each its own range when the pool holds every sequence's whole context).
        let mut table: Vec<u32> = (0..seqs * max_blocks).map(|i| (i % blocks) as u32).collect();
        table.extend(std::iter::repeat_n(blocks as u32, max_blocks));
        self.pool = Some(Pool {
            seqs,
            blocks,
            snapshots: 0,
            table,
            version: 1,
            current: 0,
        });
        Ok(self)
    }

    /// Gives the pool's recurrent states `n` rows more, snapshots: [`Session::save_states`]
    /// copies a sequence's states into one, [`Session::load_states`] copies one back into a
    /// sequence's. Call after [`Session::with_kv_pool`], before the first step.
    pub fn with_state_snapshots(mut self, n: usize) -> Result<Session<B>> {
        let early = self.programs.is_empty();
        match self.pool.as_mut() {
            Some(pool) if early => pool.snapshots = n,
            _ => {
                return Err(ModelError::Config {
                    key: "state snapshots".into(),
                    reason: format!("{n} asked for without a pool or after a step"),
                })
            }
        }
        Ok(self)
    }

    /// Copies sequence `seq`'s recurrent and convolution states into snapshot `snap`.
    pub fn save_states(&mut self, seq: usize, snap: usize) -> Result<()> {
        let (seq_row, snap_row) = self.state_rows(seq, snap)?;
        self.copy_state_row(seq_row, snap_row)
    }

    /// Sets sequence `seq`'s recurrent and convolution states to those of snapshot `snap`.
    pub fn load_states(&mut self, snap: usize, seq: usize) -> Result<()> {
        let (seq_row, snap_row) = self.state_rows(seq, snap)?;
        self.copy_state_row(snap_row, seq_row)
    }

    /// The state rows of sequence `seq` and of snapshot `snap` (past the padding row).
    fn state_rows(&self, seq: usize, snap: usize) -> Result<(usize, usize)> {
        let pool = self.pool.as_ref().ok_or_else(no_pool)?;
        if seq >= pool.seqs || snap >= pool.snapshots {
            return Err(ModelError::Config {
                key: "state snapshot".into(),
                reason: format!(
                    "sequence {seq} and snapshot {snap}: the pool has {} and {}",
                    pool.seqs, pool.snapshots
                ),
            });
        }
        Ok((seq, pool.seqs + 1 + snap))
    }

    /// Copies row `from` of every recurrent and convolution state into row `to`.
    fn copy_state_row(&mut self, from: usize, to: usize) -> Result<()> {
        if self.programs.is_empty() {
            self.program(1, 0, Outputs::Last, None)?;
        }
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let prog = self.programs.values_mut().next().expect("built above");
        for &b in &prog.f.states {
            let len = {
                let d = prog.f.graph.decl(b);
                d.byte_len() / d.shape[0]
            };
            let p = prog.segments.last_mut().expect("a program has a segment");
            self.backend
                .copy_bytes(p, b, from * len, to * len, len)
                .map_err(backend_err)?;
        }
        Ok(())
    }

    /// Blocks a sequence's row of the page table holds (the context over [`KV_BLOCK`]).
    pub fn max_blocks(&self) -> usize {
        self.ctx.div_ceil(KV_BLOCK)
    }

    /// Sets the block table of the pool: `[seqs, max_blocks]`, every entry below `blocks`
    /// (entries past what a sequence holds are never read).
    pub fn set_page_table(&mut self, table: &[u32]) -> Result<()> {
        let max_blocks = self.max_blocks();
        let pool = self.pool.as_mut().ok_or_else(no_pool)?;
        let n = pool.seqs * max_blocks;
        if table.len() != n || table.iter().any(|&b| b as usize >= pool.blocks) {
            return Err(ModelError::Config {
                key: "page table".into(),
                reason: format!(
                    "{} entries, expected {n}, each below {} blocks",
                    table.len(),
                    pool.blocks
                ),
            });
        }
        pool.table[..n].copy_from_slice(table);
        pool.version += 1;
        Ok(())
    }

    /// Starts sequence `seq` of the pool afresh: its rows of the recurrent and convolution
    /// states go back to zero (KV caches need nothing: positions say which rows count).
    pub fn reset_seq(&mut self, seq: usize) -> Result<()> {
        let seqs = self.pool.as_ref().ok_or_else(no_pool)?.seqs;
        if seq >= seqs {
            return Err(ModelError::Config {
                key: "sequence".into(),
                reason: format!("{seq} is not one of the pool's {seqs} sequences"),
            });
        }
        if self.programs.is_empty() {
            self.program(1, 0, Outputs::Last, None)?;
        }
        self.zero_states(Some(seq))
    }

    /// Zeroes the recurrent and convolution states: row `row` of each (a pool's sequence), or
    /// all of them. States are shared by label: zeroing them through one program zeroes them
    /// for all (with no program yet, there is nothing to zero).
    fn zero_states(&mut self, row: Option<usize>) -> Result<()> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let Some(prog) = self.programs.values_mut().next() else {
            return Ok(());
        };
        for &b in &prog.f.states {
            let d = prog.f.graph.decl(b);
            let (at, len) = match row {
                Some(r) => {
                    let len = d.byte_len() / d.shape[0];
                    (r * len, len)
                }
                None => (0, d.byte_len()),
            };
            let p = prog.segments.last_mut().expect("a program has a segment");
            self.backend.zero_bytes(p, b, at, len).map_err(backend_err)?;
        }
        Ok(())
    }

    /// Steps of more tokens run in chunks of at most this many (None: in one go).
    pub fn prefill_chunk(&self) -> Option<usize> {
        self.chunk
    }

    /// The sequence of the pool the next [`Session::step`]s run.
    pub fn select_seq(&mut self, seq: usize) -> Result<()> {
        let pool = self.pool.as_mut().ok_or_else(no_pool)?;
        if seq >= pool.seqs {
            return Err(ModelError::Config {
                key: "sequence".into(),
                reason: format!("{seq} is not one of the pool's {} sequences", pool.seqs),
            });
        }
        pool.current = seq as u32;
        Ok(())
    }

    /// One token of each of several sequences of the pool: `ids[i]` at `positions[i]` of
    /// sequence `seqs[i]` (each sequence at most once), each token's argmax ([`Want::Argmax`])
    /// or logits ([`Want::AllLogits`], `[ids.len(), vocab]`): [`Session::step_mixed`] with
    /// every token an output.
    pub fn step_batch(
        &mut self,
        seqs: &[u32],
        ids: &[u32],
        positions: &[u32],
        want: Want,
    ) -> Result<BatchOutput> {
        self.step_mixed(seqs, ids, positions, ids.len(), want)
    }

    /// Tokens of several sequences of the pool as one step: `ids[i]` at `positions[i]` of
    /// sequence `seqs[i]`. The first `outputs` tokens give their argmax ([`Want::Argmax`]) or
    /// logits ([`Want::AllLogits`], `[outputs, vocab]`); the others only fill the caches
    /// (prompts' chunks: a prompt's last token is an output, or its rest comes in a later step).
    /// A sequence may have several tokens, at distinct positions, in models without recurrent
    /// states (their state advances one token a step: one token a sequence there); a token
    /// sees its sequence's positions before it, in the caches or in this step. Tokens past the
    /// outputs all of one sequence run their attention as that sequence's prefill; of several
    /// sequences (each one's tokens together), each sequence's are padded to whole runs of
    /// [`CHUNK_RUN`] tokens whose attention reads that sequence (a program of its own). Runs the
    /// program of the step's buckets ([`batch_bucket`] of the outputs, and of all the tokens),
    /// the padding in a block of its own.
    pub fn step_mixed(
        &mut self,
        seqs: &[u32],
        ids: &[u32],
        positions: &[u32],
        outputs: usize,
        want: Want,
    ) -> Result<BatchOutput> {
        let kind = match want {
            Want::Argmax => Outputs::Last,
            Want::AllLogits => Outputs::All,
            _ => return Err(bad_batch("a batched step gives argmax ids or logits".into())),
        };
        let key = self.run_batch(seqs, ids, positions, outputs, kind, None)?;
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let prog = self.programs.get_mut(&key).expect("run above");
        if want == Want::Argmax {
            let argmax = prog.f.argmax;
            let mut out = self
                .backend
                .download::<u32>(prog.last(), argmax)
                .map_err(backend_err)?;
            out.truncate(outputs);
            return Ok(BatchOutput::Tokens(out));
        }
        // The outputs' rows only, into the memory of an earlier step's when given back.
        let mut logits = std::mem::take(&mut self.spare_logits);
        logits.resize(outputs * self.config.vocab, 0.0);
        let buf = prog.f.logits.raw();
        self.backend
            .read_bytes(prog.last(), buf, bytemuck::cast_slice_mut(&mut logits))
            .map_err(backend_err)?;
        Ok(BatchOutput::Logits(logits))
    }

    /// [`Session::step_mixed`] whose `params.len()` outputs are drawn on the backend: output `o`
    /// with `params[o]` (which [`backend_draws`] must accept; temperature 0 is the argmax) and
    /// the generator state `states[o]`, which moves on as the host's `Rng` would have. An
    /// output with penalties is penalised by the token counts the backend keeps for its
    /// sequence (see [`Session::set_draw_counts`]), which count the token drawn. Only the tokens
    /// and the generators come back, not the logits.
    pub fn step_mixed_drawn(
        &mut self,
        seqs: &[u32],
        ids: &[u32],
        positions: &[u32],
        params: &[SamplingParams],
        states: &mut [[u64; 4]],
    ) -> Result<Vec<u32>> {
        let outputs = params.len();
        if states.len() != outputs || outputs > seqs.len() {
            return Err(bad_batch(format!(
                "{outputs} outputs' settings with {} generators for {} tokens",
                states.len(),
                seqs.len()
            )));
        }
        if let Some(p) = params.iter().find(|p| !backend_draws(p)) {
            return Err(bad_batch(format!(
                "the backend does not draw with {p:?} (more than {BACKEND_MAX_TOP_K} candidates)"
            )));
        }
        // Padding rows draw nothing: temperature 0, no counts.
        let mut words = vec![0u32; batch_bucket(outputs.max(1)) * DRAW_WORDS];
        for w in words.chunks_mut(DRAW_WORDS).skip(outputs) {
            w[7] = NO_COUNTS;
        }
        for (o, (w, p)) in words.chunks_mut(DRAW_WORDS).zip(params).enumerate() {
            let counts = p.has_penalties().then(|| seqs[o]);
            w.copy_from_slice(&draw_words(p, states[o], counts));
        }
        let key = self.run_batch(seqs, ids, positions, outputs, Outputs::Draw, Some(&words))?;
        let prog = self.programs.get_mut(&key).expect("run above");
        let out = prog.f.drawn.expect("a drawing program").out;
        let drawn = self
            .backend
            .download::<u32>(prog.last(), out)
            .map_err(|e| ModelError::Backend(Box::new(e)))?;
        let mut tokens = Vec::with_capacity(outputs);
        for (row, state) in drawn.chunks(DRAWN_WORDS).zip(states.iter_mut()) {
            tokens.push(row[0]);
            *state = rng_state(&row[1..]);
        }
        Ok(tokens)
    }

    /// Checks a batched step, pads it to its buckets and runs it (with `draws`, the rows'
    /// settings, for [`Outputs::Draw`]); the program's key.
    fn run_batch(
        &mut self,
        seqs: &[u32],
        ids: &[u32],
        positions: &[u32],
        outputs: usize,
        kind: Outputs,
        draws: Option<&[u32]>,
    ) -> Result<Key> {
        let pool = self.pool.as_ref().ok_or_else(no_pool)?;
        let n = ids.len();
        if n == 0 || seqs.len() != n || positions.len() != n || outputs == 0 || outputs > n {
            return Err(bad_batch(format!(
                "{n} tokens with {} sequences, {} positions and {outputs} outputs",
                seqs.len(),
                positions.len()
            )));
        }
        let recurrent = self.config.arch.is_hybrid();
        let mut seen = HashSet::with_capacity(n);
        for (&s, &p) in seqs.iter().zip(positions) {
            if s as usize >= pool.seqs {
                return Err(bad_batch(format!("sequence {s} is not in the pool")));
            }
            if p as usize >= self.ctx {
                return Err(bad_batch(format!("position {p} past a context of {}", self.ctx)));
            }
            if !seen.insert((s, if recurrent { 0 } else { p })) {
                return Err(bad_batch(match recurrent {
                    true => format!("sequence {s} twice (its recurrent state takes one token a step)"),
                    false => format!("sequence {s} twice at position {p}"),
                }));
            }
        }
        // The tokens past the outputs as one sequence's chunk (its attention a prefill of that
        // sequence, see `Op::Attention`), or as several sequences' runs of tokens: each
        // sequence's tokens (together, in the order given) padded to whole runs of CHUNK_RUN.
        let rest = &seqs[outputs..];
        let one_chunk = rest.windows(2).all(|w| w[0] == w[1]);
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for (i, &s) in rest.iter().enumerate() {
            match groups.last_mut() {
                Some(g) if rest[g.0] == s => g.1 = i + 1,
                _ => groups.push((i, i + 1)),
            }
        }
        if !one_chunk && groups.len() != groups.iter().map(|g| rest[g.0]).collect::<HashSet<_>>().len() {
            return Err(bad_batch(
                "each sequence's tokens past the outputs come together".to_string(),
            ));
        }
        let run = |len: usize| {
            if one_chunk {
                len
            } else {
                len.next_multiple_of(CHUNK_RUN)
            }
        };
        let rest_len: usize = groups.iter().map(|g| run(g.1 - g.0)).sum();
        // Outputs padded to their bucket, then the other tokens, the whole padded to its own.
        let rows = batch_bucket(outputs);
        let total = match rest_len {
            0 => rows,
            rest => batch_bucket(rows + rest),
        };
        let scratch = pool.seqs as u32;
        let padded = |v: &[u32], fill: u32| -> Vec<u32> {
            let mut out = Vec::with_capacity(total);
            out.extend_from_slice(&v[..outputs]);
            out.resize(rows, fill);
            for &(a, b) in &groups {
                out.extend_from_slice(&v[outputs + a..outputs + b]);
                out.resize(out.len() + run(b - a) - (b - a), fill);
            }
            out.resize(total, fill);
            out
        };
        let (ids, pos, seq) = (padded(ids, 0), padded(positions, 0), padded(seqs, scratch));
        self.run_tokens(&ids, &pos, Some((&seq, rows, one_chunk)), kind, draws)
    }

    /// Takes back a batched step's output once read, so the next step's logits reuse its
    /// memory.
    pub fn recycle(&mut self, out: BatchOutput) {
        if let BatchOutput::Logits(l) = out {
            if l.capacity() > self.spare_logits.capacity() {
                self.spare_logits = l;
            }
        }
    }

    /// How many programs (one a step length and output) the session holds now: at most
    /// [`MAX_PROGRAMS`].
    pub fn programs_held(&self) -> usize {
        self.programs.len()
    }

    /// Programs prepared so far (a step of a length, or a batched step of buckets, not held
    /// yet), and the time their preparation took: the forward graph built and planned, its
    /// memory allocated, its dispatches encoded and captured, the one it evicted freed (the
    /// weights' upload with the first program not counted).
    pub fn programs_prepared(&self) -> (u64, std::time::Duration) {
        self.prepared
    }

    /// Programs dropped so far because the backend had no memory for another's activations
    /// (the least recently used first; each is prepared again when next needed).
    pub fn programs_evicted_for_memory(&self) -> u64 {
        self.evicted_for_memory
    }

    /// Sets the token counts the backend's sampler keeps for sequence `seq` of the pool to
    /// those of `history`, for the penalties of [`Session::step_mixed_drawn`]: call it before a
    /// sequence with penalties is first drawn there, and again when its tokens were chosen
    /// elsewhere since (a drawn step counts the token it draws).
    pub fn set_draw_counts(&mut self, seq: usize, history: &[u32]) -> Result<()> {
        let seqs = self.pool.as_ref().ok_or_else(no_pool)?.seqs;
        if seq >= seqs {
            return Err(bad_batch(format!("sequence {seq} is not in the pool")));
        }
        // The counts are a state every drawing program shares.
        let key = match self.programs.keys().find(|k| k.1 == Outputs::Draw) {
            Some(&k) => k,
            None => self.program(1, 0, Outputs::Draw, Some((1, true)))?,
        };
        let vocab = self.config.vocab;
        let prog = self.programs.get_mut(&key).expect("prepared above");
        let counts = prog.f.drawn.expect("a drawing program").counts;
        self.backend
            .upload_at(prog.last(), counts, seq * vocab, &counts_of(history, vocab))
            .map_err(|e| ModelError::Backend(Box::new(e)))
    }

    /// Calls `f(bytes done, bytes in all)` as the weights go to the backend.
    pub fn with_progress(mut self, f: impl FnMut(u64, u64) + 'static) -> Session<B> {
        self.progress = Some(Box::new(f));
        self
    }

    /// Streams the routed experts through a cache of `slots` expert-sized slots per MoE layer
    /// instead of holding them all, evicting by `policy`. A decode step's experts must fit:
    /// `slots` at least the experts a token takes. Call before the first step.
    pub fn with_expert_cache(mut self, slots: usize, policy: Eviction) -> Result<Session<B>> {
        let layers = self.config.moe_layers();
        let Some(moe) = self.config.moe.as_ref().filter(|_| layers > 0) else {
            return Err(ModelError::Config {
                key: "expert cache".into(),
                reason: "the model has no routed experts to stream".into(),
            });
        };
        if slots < moe.experts_per_token {
            return Err(ModelError::Config {
                key: "expert cache".into(),
                reason: format!(
                    "{slots} slots a layer do not hold the {} experts a token takes",
                    moe.experts_per_token
                ),
            });
        }
        self.streaming = Some(Streaming {
            slots: slots.min(moe.experts),
            policy,
            host_layers: layers,
            stage_ahead: StageAhead::Off,
            ahead: Some(false),
            placed: false,
            books: vec![None; layers],
            host_staged: 0,
            note: None,
            disk: None,
            host_seconds: 0.0,
        });
        Ok(self)
    }

    /// With streamed experts: hold at most `layers` MoE layers' experts in host memory (the
    /// first ones); the others' are read from the checkpoint each time they are needed. Call
    /// before the first step.
    pub fn with_host_layers(mut self, layers: usize) -> Session<B> {
        if let Some(st) = &mut self.streaming {
            st.host_layers = layers.min(st.books.len());
        }
        self
    }

    /// With streamed experts: chunks long enough to use most of a layer's experts copy whole
    /// layers two layers ahead, into two staging buffers used in turn, so the copies overlap the
    /// layers in between (one layer's experts of device memory more). Call before the first step.
    pub fn with_stage_ahead(mut self, mode: StageAhead) -> Session<B> {
        if let Some(st) = &mut self.streaming {
            st.stage_ahead = mode;
            st.ahead = match mode {
                StageAhead::Off => Some(false),
                StageAhead::On => Some(true),
                StageAhead::Auto => None,
            };
        }
        self
    }

    /// Whether long chunks stage whole layers ahead now (see [`StageAhead`]).
    pub fn stages_ahead(&self) -> bool {
        self.streaming.as_ref().is_some_and(|s| s.ahead == Some(true))
    }

    /// Why the host tier of streamed experts holds fewer layers than it was given, or the
    /// experts read from disk are staged in pageable memory (page-locked memory ran out), if
    /// either is so.
    pub fn host_tier_note(&self) -> Option<&str> {
        self.streaming.as_ref()?.note.as_deref()
    }

    /// What the reads of experts from the weight files did so far (None unless some layers'
    /// experts are read from them), and whether they bypass the page cache.
    pub fn disk_stats(&self) -> Option<(DiskStats, bool)> {
        let d = self.streaming.as_ref()?.disk.as_ref()?;
        Some((d.reader.stats, d.reader.direct()))
    }

    /// Seconds the host has spent bringing experts between segments of a program so far (the
    /// device idles meanwhile); 0 unless some layers are served by the host.
    pub fn host_seconds(&self) -> f64 {
        self.streaming.as_ref().map_or(0.0, |s| s.host_seconds)
    }

    /// The read bandwidth of the disk holding the weight files, measured over up to `bytes` in
    /// large parallel reads starting `from` bytes into the files (the bound for experts read
    /// from them): (bytes, seconds), or None when experts do not stream from files (all in the
    /// host tier, or weights in memory).
    pub fn measure_disk(&mut self, bytes: u64, from: u64) -> Result<Option<(u64, f64)>> {
        let Some(st) = self.streaming.as_mut() else {
            return Ok(None);
        };
        if st.host_layers >= st.books.len() || self.weights.file(0).is_none() {
            return Ok(None);
        }
        let disk = disk_tier(st, &self.weights);
        disk.reader.disk_bandwidth(bytes, from).map(Some)
    }

    /// What the expert caches did so far (None unless experts stream): the books of the layers
    /// the graph serves are read from the backend.
    pub fn expert_stats(&mut self) -> Result<Option<CacheStats>> {
        let Some(st) = &self.streaming else {
            return Ok(None);
        };
        let mut stats = CacheStats::default();
        let Some(prog) = self.programs.values_mut().next() else {
            return Ok(Some(stats));
        };
        let span = prog
            .f
            .host_experts
            .first()
            .map(|h| h.layout.span_bytes())
            .or_else(|| prog.f.moe_steps.first().map(|m| m.layout.span_bytes()))
            .unwrap_or(0) as u64;
        for &t in &prog.f.expert_tables {
            let p = prog.segments.last_mut().expect("a program has a segment");
            let table = self
                .backend
                .download::<u32>(p, t)
                .map_err(|e| ModelError::Backend(Box::new(e)))?;
            stats.add_layer(expert_slots::stats(&table), st.slots, span);
        }
        for t in st.books.iter().flatten() {
            stats.add_layer(expert_slots::stats(t), st.slots, span);
        }
        stats.staged += st.host_staged;
        stats.bytes_copied += st.host_staged * span;
        Ok(Some(stats))
    }

    /// Calls `f(tokens done, tokens in all)` after each chunk of a step that runs in chunks
    /// (see [`Session::with_prefill_chunk`]), so a long prefill can show its progress.
    pub fn with_step_progress(mut self, f: impl FnMut(usize, usize) + 'static) -> Session<B> {
        self.step_progress = Some(Box::new(f));
        self
    }

    /// Runs steps of more than `chunk` tokens in chunks of at most `chunk` (None: in one go).
    pub fn with_prefill_chunk(mut self, chunk: Option<usize>) -> Result<Session<B>> {
        if chunk == Some(0) {
            return Err(ModelError::Config {
                key: "prefill chunk".into(),
                reason: "chunks must hold at least one token".into(),
            });
        }
        self.chunk = chunk;
        Ok(self)
    }

    /// Quantises the checkpoint's dense projections and experts to `format` on load.
    pub fn with_quant(mut self, format: Option<QuantFormat>) -> Session<B> {
        self.quant = format;
        self
    }

    /// Tells the step progress callback ([`Session::with_step_progress`]) that `done` of `total`
    /// tokens have run: for callers that run a prompt in chunks of their own.
    pub fn report_progress(&mut self, done: usize, total: usize) {
        if let Some(f) = &mut self.step_progress {
            f(done, total);
        }
    }

    /// Runs `ids` at positions `past..past + ids.len()` and hands back what `want` asks for.
    /// Longer than the prefill chunk (see [`Session::with_prefill_chunk`]), they run in chunks
    /// (one program per chunk length, caches and states carrying over); only the last chunk
    /// computes what is wanted, except that [`Want::AllLogits`] gathers every chunk's rows.
    pub fn step(&mut self, ids: &[u32], past: usize, want: Want) -> Result<Output> {
        let chunk = self.chunk.unwrap_or(ids.len()).max(1);
        if ids.is_empty() {
            return Err(ModelError::Config {
                key: "tokens".into(),
                reason: "a step needs at least one token".into(),
            });
        }
        let mut gathered = Vec::new();
        let heads = (ids.len() - 1) / chunk;
        for i in 0..heads {
            let part = &ids[i * chunk..(i + 1) * chunk];
            let outputs = if want == Want::AllLogits {
                Outputs::All
            } else {
                Outputs::Last
            };
            let key = self.run(part, past + i * chunk, outputs)?;
            if want == Want::AllLogits {
                gathered.extend(self.logits_of(key)?);
            }
            if let Some(f) = &mut self.step_progress {
                f((i + 1) * chunk, ids.len());
            }
        }
        let (tail, at) = (&ids[heads * chunk..], past + heads * chunk);
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        match want {
            Want::AllLogits | Want::LastLogits => {
                let key = self.run(tail, at, Outputs::of(want == Want::AllLogits))?;
                gathered.extend(self.logits_of(key)?);
                Ok(Output::Logits(gathered))
            }
            Want::Argmax => {
                let key = self.run(tail, at, Outputs::Last)?;
                let prog = self.programs.get_mut(&key).expect("run above");
                let argmax = prog.f.argmax;
                let ids = self
                    .backend
                    .download::<u32>(prog.last(), argmax)
                    .map_err(backend_err)?;
                Ok(Output::Token(ids[0]))
            }
            Want::Sample => Err(not_sampling()),
        }
    }

    /// The logits a program's last run left in its buffers.
    fn logits_of(&mut self, key: Key) -> Result<Vec<f32>> {
        let prog = self.programs.get_mut(&key).expect("run before");
        let logits = prog.f.logits;
        self.backend
            .download::<f32>(prog.last(), logits)
            .map_err(|e| ModelError::Backend(Box::new(e)))
    }

    /// Starts a new sequence: the linear-attention layers' recurrent and convolution states go
    /// back to zero. (KV caches need nothing: positions say which rows count.) Call it before
    /// running from position 0 again.
    pub fn reset_states(&mut self) -> Result<()> {
        self.zero_states(None)
    }

    /// Prepares the program for chunks of `tokens` with `want`'s outputs (uploading the weights
    /// with the first one), so that loading can be timed apart from running.
    pub fn prepare(&mut self, tokens: usize, want: Want) -> Result<()> {
        if tokens == 0 || tokens > self.ctx {
            return Err(ModelError::Config {
                key: "ctx".into(),
                reason: format!("{tokens} tokens do not fit a context of {}", self.ctx),
            });
        }
        self.program(tokens, 0, Outputs::for_want(want)?, None)
            .map(|_| ())
    }

    /// Prepares the program of a batched step ([`Session::step_mixed`]) of `tokens` tokens
    /// whose first `outputs` give `want` ([`Want::Argmax`], [`Want::AllLogits`], or
    /// [`Want::Sample`] for [`Session::step_mixed_drawn`]), uploading the weights with the first
    /// program, so that a caller can time the step apart from building it.
    pub fn prepare_mixed(&mut self, outputs: usize, tokens: usize, want: Want) -> Result<()> {
        if self.pool.is_none() {
            return Err(no_pool());
        }
        if outputs == 0 || outputs > tokens || tokens > self.ctx {
            return Err(bad_batch(format!(
                "{tokens} tokens with {outputs} outputs in a context of {}",
                self.ctx
            )));
        }
        let kind = match want {
            Want::Argmax => Outputs::Last,
            Want::AllLogits => Outputs::All,
            Want::Sample => Outputs::Draw,
            Want::LastLogits => return Err(bad_batch("a batched step gives argmax ids or logits".into())),
        };
        let rows = batch_bucket(outputs);
        let total = match tokens - outputs {
            0 => rows,
            rest => batch_bucket(rows + rest),
        };
        self.program(total, 0, kind, Some((rows, true))).map(|_| ())
    }

    /// The program for `tokens` tokens (with `batched`, a batched step's: the logits of its
    /// first rows, and whether the tokens past them are one sequence's chunk), built, prepared
    /// and (the first time) given the weights.
    fn program(
        &mut self,
        tokens: usize,
        past: usize,
        outputs: Outputs,
        batched: Option<(usize, bool)>,
    ) -> Result<Key> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let ahead = self.streaming.as_ref().is_some_and(|s| s.ahead == Some(true));
        let key = (tokens, outputs, ahead, batched);
        let all_logits = outputs == Outputs::All;
        if !self.programs.contains_key(&key) {
            let started = std::time::Instant::now();
            let spec = ForwardSpec {
                tokens,
                past,
                ctx: self.ctx,
                cache_dtype: self.cache_dtype,
                projection_inputs: self.backend.projection_input_dtype(tokens),
                all_logits,
                quant: self.quant,
                streaming: self.streaming.as_ref().map(|s| Streamed {
                    slots: s.slots,
                    host_layers: s.host_layers,
                    policy: s.policy,
                    stage_ahead: ahead,
                }),
                // The padding row and block past the caller's.
                pool: self.pool.as_ref().map(|p| KvPool {
                    seqs: p.seqs + 1,
                    blocks: p.blocks + 1,
                    snapshots: p.snapshots,
                }),
                batched: batched.is_some(),
                logit_rows: batched.map(|b| b.0),
                one_chunk: batched.is_none_or(|b| b.1),
                draw_rows: outputs == Outputs::Draw,
            };
            let mut f = Forward::build(&self.config, &self.weights, spec)?;
            if self.streaming.as_ref().is_some_and(|s| !s.placed) {
                let held = self.place_host_tier(&f)?;
                let st = self.streaming.as_mut().expect("checked above");
                st.placed = true;
                if held < st.host_layers {
                    st.host_layers = held;
                    let spec = ForwardSpec {
                        streaming: spec.streaming.map(|s| Streamed {
                            host_layers: held,
                            ..s
                        }),
                        ..spec
                    };
                    f = Forward::build(&self.config, &self.weights, spec)?;
                }
            }
            let prepare_all = |backend: &mut B| -> std::result::Result<Vec<B::Program>, B::Error> {
                if f.moe_steps.is_empty() {
                    return Ok(vec![backend.prepare(&f.graph)?]);
                }
                let cuts: Vec<usize> = f.moe_steps.iter().map(|s| s.node).collect();
                f.graph.split(&cuts).iter().map(|g| backend.prepare(g)).collect()
            };
            // Out of memory, the programs held longest unused go, one at a time, until this one
            // fits (each holds its own activations) or none is left.
            let segments = loop {
                match prepare_all(&mut self.backend) {
                    Ok(segments) => break segments,
                    Err(e) if B::is_out_of_memory(&e) && !self.programs.is_empty() => {
                        let oldest = (self.programs.iter().min_by_key(|(_, p)| p.used)).map(|(k, _)| *k);
                        if let Some(k) = oldest {
                            self.programs.remove(&k);
                            self.evicted_for_memory += 1;
                        }
                    }
                    Err(e) => return Err(backend_err(e)),
                }
            };
            let mut prog = Prog {
                f,
                segments,
                used: 0,
                table_version: 0,
                seq: None,
                seqs: Vec::new(),
            };
            // One sequence over the whole cache: its block table never changes. (A pool's
            // table goes in before each run that finds it changed.)
            if self.pool.is_none() {
                for p in &mut prog.segments {
                    prog.f.write_pages(&mut self.backend, p)?;
                }
            }
            // Weights and states are shared by label: every segment declares them all. (Their
            // upload is not counted as the program's preparation.)
            let mut uploading = std::time::Duration::ZERO;
            if !self.uploaded {
                let upload_started = std::time::Instant::now();
                let (f, p) = (&prog.f, &mut prog.segments[0]);
                match &mut self.progress {
                    Some(cb) => f.upload_with(&self.weights, &mut self.backend, p, cb.as_mut())?,
                    None => f.upload(&self.weights, &mut self.backend, p)?,
                }
                self.uploaded = true;
                uploading = upload_started.elapsed();
            }
            // Chunks' programs and batched steps' are counted apart.
            let kind = |k: &Key| k.3.is_some() == batched.is_some();
            let held = self.programs.keys().filter(|k| kind(k)).count();
            let most = if batched.is_some() {
                MAX_BATCH_PROGRAMS
            } else {
                MAX_PROGRAMS
            };
            if held >= most {
                let oldest = (self.programs.iter())
                    .filter(|(k, _)| kind(k))
                    .min_by_key(|(_, p)| p.used)
                    .map(|(k, _)| *k);
                if let Some(k) = oldest {
                    self.programs.remove(&k);
                }
            }
            self.programs.insert(key, prog);
            self.prepared.0 += 1;
            self.prepared.1 += started.elapsed().saturating_sub(uploading);
        }
        self.clock += 1;
        if let Some(p) = self.programs.get_mut(&key) {
            p.used = self.clock;
        }
        Ok(key)
    }

    /// Places the host tier of streamed experts: each layer `f` serves from host memory gets
    /// its packed experts in the backend's host memory, handed to the backend for every
    /// program. Returns how many layers it placed: fewer than asked when host memory runs out
    /// (noted; the rest are read from the checkpoint). Experts held in memory rather than
    /// mapped (a synthetic model's) are dropped once packed, so they are not held twice.
    fn place_host_tier(&mut self, f: &Forward) -> Result<usize> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let total: u64 = f.host_experts.iter().map(|h| h.layout.total_bytes() as u64).sum();
        let mut done = 0;
        for (i, h) in f.host_experts.iter().enumerate() {
            let bytes = h.layout.total_bytes();
            let mut host = match self.backend.alloc_host(bytes) {
                Ok(host) => host,
                Err(e) => {
                    let st = self.streaming.as_mut().expect("streaming");
                    st.note = Some(format!(
                        "host memory for experts ran out after {i} of {} layers ({e}); the other \
                         layers' experts are read from the checkpoint each time they are needed",
                        st.host_layers
                    ));
                    return Ok(i);
                }
            };
            let dst = B::host_bytes_mut(&mut host).map_err(backend_err)?;
            pack_experts_into(&self.weights, &h.mlp, &h.layout, dst)?;
            self.backend.adopt_host(&h.label, host).map_err(backend_err)?;
            for name in expert_tensor_names(&self.weights, &h.mlp, h.layout.experts)? {
                self.weights.release(&name);
            }
            done += bytes as u64;
            if let Some(cb) = &mut self.progress {
                cb(done, total);
            }
        }
        Ok(f.host_experts.len())
    }

    /// Runs `ids` at positions `past..` through the program for their length (prepared on first
    /// use), leaving the outputs in its buffers; returns the program's key.
    fn run(&mut self, ids: &[u32], past: usize, outputs: Outputs) -> Result<Key> {
        if ids.is_empty() || past + ids.len() > self.ctx {
            return Err(ModelError::Config {
                key: "ctx".into(),
                reason: format!(
                    "{} tokens at position {past} do not fit a context of {}",
                    ids.len(),
                    self.ctx
                ),
            });
        }
        let pos: Vec<u32> = (past..past + ids.len()).map(|p| p as u32).collect();
        self.run_tokens(ids, &pos, None, outputs, None)
    }

    /// Runs `ids` at positions `pos` (a chunk of the selected sequence, or with `batch`, a
    /// batched step: each token's sequence, the rows of logits, and whether the tokens past
    /// them are one sequence's chunk) through the program for their number.
    fn run_tokens(
        &mut self,
        ids: &[u32],
        pos: &[u32],
        batch: Option<(&[u32], usize, bool)>,
        outputs: Outputs,
        draws: Option<&[u32]>,
    ) -> Result<Key> {
        let seq = batch.map(|b| b.0);
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(ModelError::Config {
                key: "vocab_size".into(),
                reason: format!("token {bad} is outside the vocabulary of {}", self.config.vocab),
            });
        }
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let key = self.program(ids.len(), pos[0] as usize, outputs, batch.map(|b| (b.1, b.2)))?;
        // The first chunk long enough to stage whole layers decides whether they are (Auto).
        let decide = self.streaming.as_ref().is_some_and(|st| {
            let n = ids.len() * self.config.moe.as_ref().map_or(0, |m| m.experts_per_token);
            let experts = self.config.moe.as_ref().map_or(usize::MAX, |m| m.experts);
            st.ahead.is_none() && n > st.slots && n >= experts
        });
        let before = if decide { self.expert_stats()? } else { None };
        let prog = self.programs.get_mut(&key).expect("prepared above");
        let f = &prog.f;
        // With a pool: the table when it changed since this program's last run, the sequence
        // of a chunk when it is another one, a batched step's sequences every time.
        let current;
        let (table, seq_now) = match &self.pool {
            Some(pool) => {
                let table = (prog.table_version != pool.version).then_some(&pool.table[..]);
                current = [pool.current];
                let seq_now: Option<&[u32]> = match seq {
                    Some(s) => (prog.seqs != s).then_some(s),
                    None => (prog.seq != Some(pool.current)).then_some(&current[..]),
                };
                prog.table_version = pool.version;
                if seq.is_none() {
                    prog.seq = Some(pool.current);
                }
                (table, seq_now)
            }
            None => (None, None),
        };
        let last = prog.segments.len() - 1;
        for (i, p) in prog.segments.iter_mut().enumerate() {
            // Each segment gets the inputs it reads.
            if B::graph(p).decl(f.tokens).kind == BufKind::Input {
                self.backend.upload(p, f.tokens, ids).map_err(backend_err)?;
            }
            if B::graph(p).decl(f.positions).kind == BufKind::Input {
                self.backend.upload(p, f.positions, pos).map_err(backend_err)?;
            }
            if let Some(t) = table.filter(|_| B::graph(p).decl(f.page_table).kind == BufKind::Input) {
                self.backend.upload(p, f.page_table, t).map_err(backend_err)?;
            }
            if let Some(s) = seq_now
                .as_ref()
                .filter(|_| B::graph(p).decl(f.seq).kind == BufKind::Input)
            {
                self.backend.upload(p, f.seq, s).map_err(backend_err)?;
            }
            if let (Some(d), Some(drawing)) = (draws, f.drawn) {
                if B::graph(p).decl(drawing.draws).kind == BufKind::Input {
                    self.backend.upload(p, drawing.draws, d).map_err(backend_err)?;
                }
            }
            self.backend.run(p).map_err(backend_err)?;
            if let (Some(s), true) = (seq, i == last) {
                if prog.seqs != s {
                    prog.seqs = s.to_vec();
                }
            }
            if i < last {
                let streaming = self.streaming.as_mut().expect("segments only when streaming");
                bring_experts(&mut self.backend, p, &f.moe_steps[i], streaming, &self.weights)?;
            }
        }
        // Only then are the books read back: a decode step reads nothing but its outputs.
        if let Some(before) = before {
            if let (Some(after), Some(st)) = (self.expert_stats()?, self.streaming.as_mut()) {
                // Every layer's staged experts; the graph's count those not in its cache,
                // which is all of them unless decode steps filled it first.
                let layers = self.config.moe_layers();
                let experts = self.config.moe.as_ref().map_or(1, |m| m.experts);
                let share = (after.staged - before.staged) as f64 / (layers * experts) as f64;
                st.ahead = Some(share >= AHEAD_SHARE);
            }
        }
        Ok(key)
    }
}

/// Between the segment before a host-served layer's experts and the next: reads the router's
/// expert ids and brings the experts from the checkpoint, into the layer's cache slots (its
/// books on the host; the slots written where the ids were) or, for a longer chunk, each to
/// its own index of the staging buffer.
fn bring_experts<B: Backend>(
    backend: &mut B,
    p: &mut B::Program,
    step: &MoeStep,
    st: &mut Streaming<B::HostBuffer>,
    weights: &Weights,
) -> Result<()> {
    let start = Instant::now();
    let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
    let cache_err = |reason: String| ModelError::Config {
        key: "expert cache".into(),
        reason,
    };
    let experts = step.layout.experts;
    let ids = backend.download::<u32>(p, step.ids).map_err(backend_err)?;
    // (expert, index of `into` it goes to).
    let (wanted, slots) = if step.staged {
        // Every expert from the checkpoint: the books say which are cached, but the slots are
        // on the device and the checkpoint is where the host reads from.
        let mut table = vec![0u32; table_words(st.slots, experts)];
        let used = stage_sources(&mut table, st.slots, experts, &ids).map_err(cache_err)?;
        st.host_staged += used.len() as u64;
        (
            used.iter().map(|&(e, _)| (e, e as usize)).collect::<Vec<_>>(),
            None,
        )
    } else {
        let table = st.books[step.layer].get_or_insert_with(|| vec![0u32; table_words(st.slots, experts)]);
        let mut slots = vec![0u32; ids.len()];
        let fills = resolve(table, st.slots, experts, st.policy, &ids, &mut slots).map_err(cache_err)?;
        (
            fills.iter().map(|f| (f.expert, f.slot as usize)).collect(),
            Some(slots),
        )
    };
    let disk = disk_tier(st, weights);
    if let LayerSource::Unknown = disk.parts[step.layer] {
        disk.parts[step.layer] = match expert_copy_parts(weights, &step.mlp, &step.layout)? {
            Some(parts) => LayerSource::Files(parts),
            None => LayerSource::Packed,
        };
    }
    let reads = matches!(disk.parts[step.layer], LayerSource::Files(_));
    if reads && matches!(disk.staging, Staging::Unmade) {
        let bytes = STAGING_BYTES.max(step.layout.span_bytes());
        match (backend.alloc_host(bytes), backend.alloc_host(bytes)) {
            (Ok(a), Ok(b)) => {
                disk.staging = Staging::Pinned {
                    bufs: [a, b],
                    next: 0,
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                disk.staging = Staging::Pageable(vec![0; bytes]);
                st.add_note(format!(
                    "page-locked memory for staging experts read from disk ran out ({e}); they \
                     are staged in pageable memory, which copies to the device more slowly"
                ));
            }
        }
    }
    let disk = st.disk.as_mut().expect("made above");
    match &disk.parts[step.layer] {
        LayerSource::Files(parts) => read_experts(
            backend,
            p,
            step,
            parts,
            &mut disk.reader,
            &mut disk.staging,
            &wanted,
        )?,
        _ => {
            let span = step.layout.span_bytes();
            for &(e, at) in &wanted {
                let bytes = pack_expert(weights, &step.mlp, &step.layout, e as usize)?;
                backend
                    .write_bytes(p, step.into, at * span, &bytes)
                    .map_err(backend_err)?;
            }
        }
    }
    if let Some(slots) = slots {
        backend.upload(p, step.ids, &slots).map_err(backend_err)?;
    }
    st.host_seconds += start.elapsed().as_secs_f64();
    Ok(())
}

/// The streaming's disk tier, made on first use with two staging buffers of page-locked memory
/// (or, when that runs out, noted, one of pageable memory).
fn disk_tier<'s, H>(st: &'s mut Streaming<H>, weights: &Weights) -> &'s mut DiskTier<H> {
    if st.disk.is_none() {
        st.disk = Some(DiskTier {
            reader: ExpertReader::new(weights),
            parts: vec![LayerSource::Unknown; st.books.len()],
            staging: Staging::Unmade,
        });
    }
    st.disk.as_mut().expect("made above")
}

/// Reads `wanted` (expert, index of `step.into`) from the weight files, in batches that fill a
/// staging buffer, each copied to the device while the next is read.
fn read_experts<B: Backend>(
    backend: &mut B,
    p: &mut B::Program,
    step: &MoeStep,
    parts: &[CopyPart],
    reader: &mut ExpertReader,
    staging: &mut Staging<B::HostBuffer>,
    wanted: &[(u32, usize)],
) -> Result<()> {
    let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
    let span = step.layout.span_bytes();
    let batch = STAGING_BYTES.max(span) / span;
    for chunk in wanted.chunks(batch) {
        let ids: Vec<u32> = chunk.iter().map(|&(e, _)| e).collect();
        match staging {
            Staging::Unmade => unreachable!("made before the first read"),
            Staging::Pinned { bufs, next } => {
                let host = &mut bufs[*next];
                *next = 1 - *next;
                reader.read(parts, span, &ids, B::host_bytes_mut(host).map_err(backend_err)?)?;
                for (i, &(_, at)) in chunk.iter().enumerate() {
                    backend
                        .write_from_host(p, step.into, at * span, host, i * span..(i + 1) * span)
                        .map_err(backend_err)?;
                }
            }
            Staging::Pageable(buf) => {
                reader.read(parts, span, &ids, buf)?;
                for (i, &(_, at)) in chunk.iter().enumerate() {
                    backend
                        .write_bytes(p, step.into, at * span, &buf[i * span..(i + 1) * span])
                        .map_err(backend_err)?;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod bucket_tests {
    use super::batch_bucket;

    /// Steps are padded to the next bucket, and past 64 to multiples of it.
    #[test]
    fn steps_pad_to_the_next_bucket() {
        let padded: Vec<usize> = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 33, 64, 65, 200]
            .into_iter()
            .map(batch_bucket)
            .collect();
        assert_eq!(padded, [1, 2, 3, 4, 6, 6, 8, 8, 12, 16, 24, 48, 64, 128, 256]);
    }
}
