//! Many sequences generated at once (continuous batching). A [`Batcher`] holds an [`Engine`]
//! whose KV caches are a pool of blocks ([`EngineOptions::max_seqs`]) and the sequences it is
//! generating. Each [`Batcher::step`] admits waiting sequences into free slots, then runs the
//! next token of every sequence that is decoding and the next chunk of a prompt (or chunks of
//! several prompts near their start, up to [`STEP_PROMPT_TOKENS`] tokens) as one step, so the
//! weights are read once for all of them and running sequences wait for at most that many
//! prompt tokens. (Models with recurrent states take one token a sequence a step: their prompts
//! run first, each in its own chunks, then the decoding sequences' batched step.) A sequence's
//! blocks
//! are taken as it grows and given back when it ends; when none is free, the sequence admitted
//! last is preempted (its blocks freed, its tokens kept and prefilled again when a slot frees
//! up), so a full cache slows generation down instead of failing it. Full blocks are kept by the
//! hash of the tokens up to their end ([`crate::blocks`]): a sequence admitted with the same
//! first tokens as one before (a shared system prompt, the next turn of a conversation, a
//! preempted sequence coming back) takes those blocks as they are and prefills only the rest.
//! A model with recurrent states needs their values at the block boundary too: with
//! [`EngineOptions::state_snapshots`], a prompt's states are copied aside where its chunks end
//! on a block boundary and at its last full block, and a sequence whose first blocks are found
//! goes on from the deepest of them with a snapshot (least recently used snapshots give way).
//! Tokens come out as
//! [`Batcher::generate_pieces`] gives them: whole characters, stop strings held back, the
//! end-of-sequence id not told; greedy sequences take the backend's argmax, sampled ones are
//! drawn on the backend, each with its own settings and generator (kept here, sent with the
//! step and taken back after it). When some sequence's settings are ones the backend does not
//! draw with (top-k 0 or above 64) or it wants log-probabilities, the step's logits
//! come back and every row is chosen on the host, all rows at once on the host's cores, with
//! the same algorithm and generators.
//!
//! [`EngineOptions::max_seqs`]: crate::EngineOptions::max_seqs
//! [`EngineOptions::state_snapshots`]: crate::EngineOptions::state_snapshots

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use crate::blocks::{Blocks, ROOT};

use kestrel_core::sample::backend_draws;
use kestrel_model::{BatchOutput, Want, KV_BLOCK};
use kestrel_text::{IdStream, Sampler, SamplingParams, StopStrings, Tokenizer};

use crate::engine::{on_session, Engine, TokenLogprobs};
use crate::error::{EngineError, Result};

/// Prompt tokens of one prompt prefilled in one step beside decoding sequences, at most (unless
/// the engine's prefill chunk is smaller). With none decoding, a step takes the engine's
/// prefill chunk of a prompt (this many when it has none).
const PREFILL_CHUNK: usize = 512;

/// Prompt tokens one step runs at most, of several prompts' chunks together: running
/// sequences wait for no more than this between tokens. A step's decoding tokens spread over
/// most of the experts a layer has, which the step reads once for every token in it, so a
/// step of more prompt tokens costs less a token (on an H200 at Qwen3-30B-A3B's shapes, 64
/// decoding sequences beside one 512-token chunk took 27.5 ms, beside none 10.5 ms; 2,048
/// tokens alone 55.5 ms).
const STEP_PROMPT_TOKENS: usize = 2048;

/// A prompt's chunk shares a step with other prompts' only when it starts before this
/// position: several prompts' tokens run their attention in runs of 16 tokens (CUDA: a flash
/// block a run where its rows fit one, else each token reading the cache on its own, which
/// costs little only near a prompt's start).
const SHARED_CHUNK_DEPTH: usize = PREFILL_CHUNK;

/// What a sequence is told of each generated token.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    /// The token; None for text released without a token of its own.
    pub id: Option<u32>,
    /// The text it completes (possibly empty).
    pub text: &'a str,
    /// Its log-probabilities, when the request asked for them ([`SeqRequest::logprobs`]).
    pub logprobs: Option<&'a TokenLogprobs>,
}

/// Why a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The token limit.
    Length,
    /// An end-of-sequence id.
    Eos,
    /// A stop string.
    Stop,
    /// The caller's cancel flag.
    Interrupted,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Length => "length",
            StopReason::Eos => "eos",
            StopReason::Stop => "stop",
            StopReason::Interrupted => "interrupted",
        }
    }
}

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct SeqRequest {
    /// The prompt's ids (at least one).
    pub ids: Vec<u32>,
    pub max_tokens: usize,
    pub stops: Vec<String>,
    pub sampling: SamplingParams,
    /// Generate past end-of-sequence ids.
    pub ignore_eos: bool,
    /// Each token's log-probability and this many alternatives' (None: none).
    pub logprobs: Option<usize>,
}

/// What a sequence tells its owner.
#[derive(Debug)]
pub enum SeqEvent<'a> {
    /// A generated token and the text it completes, or text released without a token (see
    /// [`Piece`]).
    Piece(Piece<'a>),
    /// The sequence ended: why, and how many tokens it generated.
    /// The sequence ended: why, how many tokens it generated, and how many of its prompt's
    /// it found in the caches (prefix caching).
    Done {
        reason: StopReason,
        tokens: usize,
        reused: usize,
    },
    /// The sequence failed; nothing more comes.
    Failed(&'a EngineError),
}

/// Where a sequence's events go; `false` means the owner is gone (the sequence is dropped).
pub type Sink = Box<dyn FnMut(SeqEvent) -> bool>;

/// Told a batcher's [`StepTimes`] each time a step has counted its tokens (see
/// [`Batcher::on_counted`]).
pub type CountSink = Box<dyn FnMut(StepTimes)>;

struct Seq {
    /// The slot (row of the block table) while admitted.
    slot: Option<usize>,
    /// Its blocks, in position order, and the prefix hashes of those that are full.
    blocks: Vec<u32>,
    hashes: Vec<u64>,
    /// Prompt tokens found in the caches when it was first admitted.
    reused: Option<usize>,
    /// The prompt and every token generated so far.
    tokens: Vec<u32>,
    /// Tokens whose keys and values the caches hold (from position 0).
    cached: usize,
    generated: usize,
    max_tokens: usize,
    stops: StopStrings,
    stream: IdStream,
    /// None: greedy, the backend's argmax.
    sampler: Option<Sampler>,
    /// The backend's token counts for its slot are those of `tokens` (penalties drawn there).
    counts_synced: bool,
    logprobs: Option<usize>,
    ignore_eos: bool,
    sink: Sink,
}

impl Seq {
    /// Whether the host needs its logits (to sample, or for log-probabilities).
    fn wants_logits(&self) -> bool {
        self.sampler.is_some() || self.logprobs.is_some()
    }

    /// Whether a batched step must bring its logits to the host: log-probabilities, or settings
    /// the backend does not draw with (top-k 0 or past the backend's bound).
    fn needs_host(&self) -> bool {
        self.logprobs.is_some() || self.sampler.as_ref().is_some_and(|s| !backend_draws(&s.params))
    }
}

/// What choosing one sequence's next token from its logits takes: the row, the sampler (None:
/// greedy), the tokens so far (for penalties) and the log-probabilities asked for.
struct Pick<'a> {
    row: &'a mut [f32],
    sampler: Option<&'a mut Sampler>,
    history: &'a [u32],
    logprobs: Option<usize>,
}

/// A sequence that ended, kept with its slot, its blocks and the tokens its caches and states
/// hold, so that a sequence continuing it (a conversation's next turn) goes on from there: the
/// only reuse a model with recurrent states has, and for the others the last block that no
/// hash finds. Given back, oldest first, when a slot or a block is needed.
struct Parked {
    slot: usize,
    blocks: Vec<u32>,
    hashes: Vec<u64>,
    tokens: Vec<u32>,
}

/// Copies of recurrent states at block boundaries of prompts (the session's snapshot rows),
/// each found by the prefix hash of the block that ends there and checked against the prefix's
/// tokens.
struct Snapshots {
    /// Rows the session holds, and those holding nothing.
    rows: usize,
    free: Vec<usize>,
    /// By prefix hash: the row and the prefix's tokens.
    held: HashMap<u64, (usize, Vec<u32>)>,
    /// The hashes held, least recently used first.
    order: VecDeque<u64>,
}

impl Snapshots {
    fn new(rows: usize) -> Snapshots {
        Snapshots {
            rows,
            free: (0..rows).rev().collect(),
            held: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn touch(&mut self, hash: u64) {
        self.order.retain(|&h| h != hash);
        self.order.push_back(hash);
    }

    /// The row holding the states after `prefix` (whose last block's hash is `hash`), if one does.
    fn find(&mut self, hash: u64, prefix: &[u32]) -> Option<usize> {
        let row = match self.held.get(&hash) {
            Some((row, tokens)) if tokens[..] == *prefix => *row,
            _ => return None,
        };
        self.touch(hash);
        Some(row)
    }

    /// A row to copy the states after `prefix` into: None when one holds them already (or
    /// there are no rows); else a free row or the least recently used one's.
    fn take(&mut self, hash: u64, prefix: &[u32]) -> Option<usize> {
        if self.rows == 0 || self.find(hash, prefix).is_some() {
            return None;
        }
        let row = match self.free.pop() {
            Some(row) => row,
            None => {
                let old = self.order.pop_front().expect("every row is held");
                self.held.remove(&old).expect("ordered hashes are held").0
            }
        };
        self.held.insert(hash, (row, prefix.to_vec()));
        self.order.push_back(hash);
        Some(row)
    }

    /// The row taken for `hash` holds nothing after all (its copy failed).
    fn drop_row(&mut self, hash: u64) {
        if let Some((row, _)) = self.held.remove(&hash) {
            self.free.push(row);
        }
        self.order.retain(|&h| h != hash);
    }
}

/// How a batcher's steps chose their tokens, counted since it began.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepKinds {
    /// Every output greedy: the backend's argmax.
    pub argmax: u64,
    /// Some output sampled, every one drawn on the backend.
    pub drawn: u64,
    /// The logits came back and the host chose every output.
    pub host: u64,
}

/// Where a batcher's time went, counted since it began: its steps, with prompt tokens (a
/// prompt's chunk, with or without decoding sequences beside it) and without (decoding only),
/// each from its admissions to its tokens handed out.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    pub prompt_steps: u64,
    pub prompt_seconds: f64,
    pub decode_steps: u64,
    pub decode_seconds: f64,
    /// Tokens the steps ran: prompt tokens, and tokens decoded.
    pub prompt_tokens: u64,
    pub decoded_tokens: u64,
    /// Prompts' chunks the steps ran (more than `prompt_steps` where steps took several).
    pub prompt_chunks: u64,
    /// Programs the session prepared (in the steps' time), and the seconds that took (see
    /// `Session::programs_prepared`).
    pub programs: u64,
    pub program_seconds: f64,
    /// Programs the session dropped to make room for another's memory (see
    /// `Session::programs_evicted_for_memory`): a server that keeps dropping them is short of
    /// device memory for its step shapes, and pays for preparing them again.
    pub programs_evicted: u64,
}

/// How one sequence's step ended.
enum Next {
    Going,
    /// Ended (its `Done` sent), or its owner went away.
    Ended,
}

/// The sequences an [`Engine`] with a pool of KV blocks generates at once.
pub struct Batcher {
    engine: Engine,
    tokenizer: Option<Tokenizer>,
    /// The model has recurrent states (a row per slot, zeroed or loaded from a snapshot at
    /// admission).
    hybrid: bool,
    /// Rows of the block table (sequences at once), and blocks a row holds.
    slots: usize,
    max_blocks: usize,
    table: Vec<u32>,
    table_changed: bool,
    free_slots: Vec<usize>,
    blocks: Blocks,
    /// Admitted sequences in the order they came in (the last is preempted first), and those
    /// waiting for a slot (preempted ones first).
    running: Vec<Seq>,
    waiting: VecDeque<Seq>,
    parked: VecDeque<Parked>,
    /// How many kept sequences hold each block they hold (for [`Batcher::kv_blocks`]).
    parked_uses: HashMap<u32, u32>,
    /// Hybrids: recurrent states kept at prompts' block boundaries.
    snapshots: Snapshots,
    /// Prompt tokens of one prompt a step runs beside decoding sequences, and with none
    /// decoding; tokens a step runs at most (the memory planned for a step's activations, see
    /// `RunShape::prefill_chunk`), which bounds [`STEP_PROMPT_TOKENS`].
    chunk: usize,
    lone_chunk: usize,
    step_tokens: usize,
    /// Sequences preempted so far.
    preempted: u64,
    kinds: StepKinds,
    times: StepTimes,
    counted: Option<CountSink>,
}

impl Batcher {
    /// The batcher of `engine`, generating up to its [`crate::EngineOptions::max_seqs`]
    /// sequences at once.
    pub fn new(engine: Engine) -> Batcher {
        let pool = engine.pool;
        let max_blocks = engine.ctx().div_ceil(KV_BLOCK);
        let lone_chunk = on_session!(&engine.session, s => s.prefill_chunk()).unwrap_or(PREFILL_CHUNK);
        let chunk = lone_chunk.min(PREFILL_CHUNK);
        let step_tokens = on_session!(&engine.session, s => s.prefill_chunk())
            .unwrap_or(engine.ctx())
            .min(engine.ctx());
        Batcher {
            tokenizer: engine.text.tokenizer.clone(),
            hybrid: engine.config().arch.is_hybrid(),
            slots: pool.seqs,
            max_blocks,
            table: vec![0; pool.seqs * max_blocks],
            table_changed: true,
            free_slots: (0..pool.seqs).rev().collect(),
            blocks: Blocks::new(pool.blocks),
            running: Vec::new(),
            waiting: VecDeque::new(),
            parked: VecDeque::new(),
            parked_uses: HashMap::new(),
            snapshots: Snapshots::new(pool.snapshots),
            chunk,
            lone_chunk,
            step_tokens,
            preempted: 0,
            kinds: StepKinds::default(),
            times: StepTimes::default(),
            counted: None,
            engine,
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Sequences generated at once, at most.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Slots no sequence holds or waits for (those of ended sequences kept for a continuation
    /// count as free).
    pub fn free_slots(&self) -> usize {
        (self.free_slots.len() + self.parked.len()).saturating_sub(self.waiting.len())
    }

    /// Sequences admitted (holding a slot), and waiting for one.
    pub fn counts(&self) -> (usize, usize) {
        (self.running.len(), self.waiting.len())
    }

    /// KV blocks in use and in all, of [`KV_BLOCK`] positions each (blocks only ended sequences
    /// keep for a continuation are not in use: they are given back when needed).
    pub fn kv_blocks(&self) -> (usize, usize) {
        let only = (self.parked_uses.iter())
            .filter(|&(&b, &n)| self.blocks.uses(b) == n)
            .count();
        (self.blocks.used() - only, self.blocks.total())
    }

    /// Forgets the ended sequences kept for a continuation: what comes next starts afresh
    /// (but for the blocks prefix caching finds).
    pub fn forget(&mut self) {
        while self.reclaim() {}
    }

    /// Sequences preempted so far (their blocks taken for others, their tokens run again).
    pub fn preempted(&self) -> u64 {
        self.preempted
    }

    /// How the batched steps so far chose their tokens.
    pub fn step_kinds(&self) -> StepKinds {
        self.kinds
    }

    /// Calls `f` with [`Batcher::step_times`] each time a step has counted the tokens it runs,
    /// before any token it makes reaches a sink: whoever reads `f`'s figures after a sequence's
    /// token arrived sees that token's step counted (its steps and seconds are counted when it
    /// ends, so those may lag by the one step).
    pub fn on_counted(&mut self, f: impl FnMut(StepTimes) + 'static) {
        self.counted = Some(Box::new(f));
    }

    /// Tells [`Batcher::on_counted`]'s function the counts as they stand.
    fn tell_counted(&mut self) {
        if let Some(mut f) = self.counted.take() {
            f(self.step_times());
            self.counted = Some(f);
        }
    }

    /// Where the steps' time went so far.
    pub fn step_times(&self) -> StepTimes {
        let (programs, spent) = on_session!(&self.engine.session, s => s.programs_prepared());
        StepTimes {
            programs,
            program_seconds: spent.as_secs_f64(),
            programs_evicted: on_session!(&self.engine.session, s => s.programs_evicted_for_memory()),
            ..self.times
        }
    }

    /// Nothing to generate.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Queues a sequence; its events go to `sink`. A prompt that is empty or does not fit the
    /// context with its tokens is refused here.
    pub fn add(&mut self, req: SeqRequest, sink: Sink) -> Result<()> {
        let ctx = self.engine.ctx();
        if req.ids.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        if req.ids.len() + req.max_tokens > ctx {
            return Err(EngineError::Invalid(format!(
                "{} prompt tokens and {} new ones do not fit a context of {ctx} (-c / --ctx)",
                req.ids.len(),
                req.max_tokens
            )));
        }
        if let Some(&bad) = req
            .ids
            .iter()
            .find(|&&t| t as usize >= self.engine.config().vocab)
        {
            return Err(EngineError::Invalid(format!(
                "token {bad} is outside the vocabulary of {}",
                self.engine.config().vocab
            )));
        }
        let sampler = if req.sampling.is_plain_greedy() {
            None
        } else {
            Some(Sampler::new(req.sampling)?)
        };
        let seq = Seq {
            slot: None,
            blocks: Vec::new(),
            hashes: Vec::new(),
            reused: None,
            tokens: req.ids,
            cached: 0,
            generated: 0,
            max_tokens: req.max_tokens,
            stops: StopStrings::new(req.stops),
            stream: IdStream::default(),
            sampler,
            counts_synced: false,
            logprobs: req.logprobs,
            ignore_eos: req.ignore_eos,
            sink,
        };
        // With no token asked for the prompt still runs: its time is a prefill's, and the
        // caches hold it for what comes next.
        self.waiting.push_back(seq);
        Ok(())
    }

    /// Prepares the programs a lone sequence runs with the engine's sampling settings: its
    /// prompt's first step (of `tokens` tokens) and its one-token steps (uploading the weights
    /// with the first), so that a caller can time loading apart from the prompt and the decode
    /// (building and capturing a 48-layer step's graph takes milliseconds).
    pub fn prepare(&mut self, tokens: usize) -> Result<()> {
        let n = tokens.clamp(1, self.lone_chunk);
        let params = self.engine.sampling;
        let want = if params.is_plain_greedy() {
            Want::Argmax
        } else if backend_draws(&params) {
            Want::Sample
        } else {
            Want::AllLogits
        };
        on_session!(&mut self.engine.session, s => {
            if self.hybrid {
                // A hybrid's prompt runs as one sequence's chunks.
                let first = if want == Want::Argmax { Want::Argmax } else { Want::LastLogits };
                s.prepare(n, first)?;
            } else {
                s.prepare_mixed(1, n, want)?;
            }
            s.prepare_mixed(1, 1, want)?;
        });
        Ok(())
    }

    /// Ends every sequence now, as a cancel would: what each held back is released and it is
    /// told `Done` with [`StopReason::Interrupted`]; admitted ones are kept for a continuation.
    pub fn interrupt(&mut self) {
        for mut seq in std::mem::take(&mut self.running) {
            finish(&mut seq, self.tokenizer.as_ref(), StopReason::Interrupted);
            self.retire(seq);
        }
        for mut seq in std::mem::take(&mut self.waiting) {
            finish(&mut seq, self.tokenizer.as_ref(), StopReason::Interrupted);
            self.release(&mut seq);
        }
    }

    /// One step: admissions, then the decoding sequences' next tokens and up to a chunk's
    /// worth of prompt tokens (prompts in the order they came) as one step, or for models with
    /// recurrent states, the prompt tokens first (a prompt per run) and then one batched decode
    /// step. Failures end the sequences they touch (told as [`SeqEvent::Failed`]), not the
    /// batcher.
    pub fn step(&mut self) {
        let started = Instant::now();
        let (prompt, decoded) = (self.times.prompt_tokens, self.times.decoded_tokens);
        self.admit();
        if self.hybrid {
            let decoding = self.running.iter().any(|s| s.tokens.len() - s.cached == 1);
            let mut budget = if decoding { self.chunk } else { self.lone_chunk };
            while budget > 0 {
                match self.prefill_one(budget) {
                    0 => break,
                    n => budget -= n,
                }
            }
            self.decode();
        } else {
            self.mixed();
        }
        let seconds = started.elapsed().as_secs_f64();
        let t = &mut self.times;
        if t.prompt_tokens > prompt {
            t.prompt_steps += 1;
            t.prompt_seconds += seconds;
        } else if t.decoded_tokens > decoded {
            t.decode_steps += 1;
            t.decode_seconds += seconds;
        }
    }

    /// One step of every sequence with tokens to run: a decoding sequence's next token, and the
    /// next chunk of the first prompt not all in the caches, with more prompts' chunks (each
    /// near its start) up to [`STEP_PROMPT_TOKENS`]. The tokens that end a sequence's run of its
    /// tokens (its next token to choose) come first, as the step's outputs.
    fn mixed(&mut self) {
        // (sequence, first token, end) of each sequence that runs.
        let mut runs: Vec<(usize, usize, usize)> = Vec::new();
        // With nothing decoding, nobody waits for the chunk.
        let decoding = self
            .running
            .iter()
            .filter(|s| s.tokens.len() - s.cached == 1)
            .count();
        let limit = if decoding > 0 { self.chunk } else { self.lone_chunk };
        // Prompt tokens the step may still take (one prompt's chunk whatever the plan), and
        // whether another prompt may join (not after a chunk deep in its prompt, whose
        // attention runs as one sequence's).
        let planned = self.step_tokens.saturating_sub(decoding);
        let mut budget = STEP_PROMPT_TOKENS.min(planned).max(limit);
        let (mut prompts, mut shared) = (0u64, true);
        let mut i = 0;
        while i < self.running.len() {
            let seq = &self.running[i];
            let (start, len) = (seq.cached, seq.tokens.len());
            let end = match len - start {
                0 => {
                    i += 1;
                    continue;
                }
                1 => start + 1,
                // Another prompt joins only with its whole chunk: split, its rest would run
                // later as a chunk of its own.
                left if prompts > 0
                    && !(shared && start < SHARED_CHUNK_DEPTH && left.min(limit) <= budget) =>
                {
                    i += 1;
                    continue;
                }
                left => {
                    let take = left.min(limit).min(budget);
                    prompts += 1;
                    budget -= take;
                    shared &= start < SHARED_CHUNK_DEPTH;
                    start + take
                }
            };
            // Growing may preempt sequences after this one (never one already taken).
            if !self.grow(i, end) {
                // Not even this sequence fits what the ones before it leave: it waits.
                self.preempt(i);
                break;
            }
            runs.push((i, start, end));
            i += 1;
        }
        if runs.is_empty() {
            return;
        }
        let outs: Vec<usize> = (0..runs.len())
            .filter(|&r| runs[r].2 == self.running[runs[r].0].tokens.len())
            .collect();
        let (mut seqs, mut ids, mut pos) = (Vec::new(), Vec::new(), Vec::new());
        let mut push = |seq: &Seq, p: usize| {
            seqs.push(seq.slot.expect("admitted") as u32);
            ids.push(seq.tokens[p]);
            pos.push(p as u32);
        };
        for &r in &outs {
            let (i, _, end) = runs[r];
            push(&self.running[i], end - 1);
        }
        for &(i, start, end) in &runs {
            let seq = &self.running[i];
            let last = if end == seq.tokens.len() { end - 1 } else { end };
            for p in start..last {
                push(seq, p);
            }
        }
        let rows: Vec<usize> = outs.iter().map(|&r| runs[r].0).collect();
        // A decoding sequence's run is its one token; the others' are prompt tokens.
        let decoded = runs
            .iter()
            .filter(|r| r.2 - r.1 == 1 && r.1 + 1 == self.running[r.0].tokens.len());
        let decoded = decoded.count() as u64;
        self.times.decoded_tokens += decoded;
        self.times.prompt_tokens += ids.len() as u64 - decoded;
        self.times.prompt_chunks += prompts;
        self.tell_counted();
        let mut out = match self.run_step(&rows, &seqs, &ids, &pos) {
            Ok(out) => out,
            Err(e) => {
                let ids: Vec<usize> = runs.iter().map(|r| r.0).collect();
                return self.fail(&ids, &e);
            }
        };
        for &(i, _, end) in &runs {
            self.running[i].cached = end;
            self.register_full(i);
            let len = self.running[i].tokens.len();
            if end < len {
                on_session!(&mut self.engine.session, s => s.report_progress(end, len));
            }
        }
        let mut ended = self.take_outputs(&rows, &mut out);
        on_session!(&mut self.engine.session, s => s.recycle(out));
        ended.sort_unstable();
        for &i in ended.iter().rev() {
            let seq = self.running.remove(i);
            self.retire(seq);
        }
    }

    /// Waiting sequences into free slots, in order, each with the blocks that hold its first
    /// tokens already (all but the last token's: that one runs, to give the next token).
    fn admit(&mut self) {
        while let Some(mut seq) = self.waiting.pop_front() {
            // A kept sequence this one continues: its slot, blocks and states as they are.
            let continued = (self.parked.iter().enumerate())
                .filter(|(_, p)| p.tokens.len() < seq.tokens.len() && seq.tokens.starts_with(&p.tokens))
                .max_by_key(|(_, p)| p.tokens.len())
                .map(|(j, _)| j);
            if let Some(p) = continued.and_then(|j| self.parked.remove(j)) {
                self.unpark_blocks(&p.blocks);
                seq.slot = Some(p.slot);
                (seq.blocks, seq.hashes, seq.cached) = (p.blocks, p.hashes, p.tokens.len());
                seq.reused.get_or_insert(seq.cached);
                self.running.push(seq);
                continue;
            }
            if self.free_slots.is_empty() && !self.reclaim() {
                self.waiting.push_front(seq);
                break;
            }
            let slot = self.free_slots.pop().expect("checked above");
            seq.slot = Some(slot);
            let mut parent = ROOT;
            // A hybrid's found blocks are of use only up to a boundary whose states are kept.
            let shareable = match self.hybrid && self.snapshots.rows == 0 {
                true => 0,
                false => (seq.tokens.len() - 1) / KV_BLOCK,
            };
            for j in 0..shareable {
                let Some((b, hash)) = self
                    .blocks
                    .find(parent, &seq.tokens[j * KV_BLOCK..(j + 1) * KV_BLOCK])
                else {
                    break;
                };
                self.table[slot * self.max_blocks + j] = b;
                seq.blocks.push(b);
                seq.hashes.push(hash);
                parent = hash;
                self.table_changed = true;
            }
            if self.hybrid {
                if let Err(e) = self.start_states(&mut seq, slot) {
                    (seq.sink)(SeqEvent::Failed(&e));
                    self.release(&mut seq);
                    continue;
                }
            }
            seq.cached = seq.blocks.len() * KV_BLOCK;
            seq.reused.get_or_insert(seq.cached);
            self.running.push(seq);
        }
    }

    /// A hybrid's new sequence in `slot`: its states are those kept at the deepest of its found
    /// blocks that has a snapshot (the blocks past it given back), or zero (none kept).
    fn start_states(&mut self, seq: &mut Seq, slot: usize) -> Result<()> {
        let kept = (1..=seq.hashes.len()).rev().find_map(|j| {
            let row = self
                .snapshots
                .find(seq.hashes[j - 1], &seq.tokens[..j * KV_BLOCK])?;
            Some((j, row))
        });
        let j = kept.map_or(0, |(j, _)| j);
        for b in seq.blocks.drain(j..) {
            self.blocks.release(b);
        }
        seq.hashes.truncate(j);
        match kept {
            Some((_, row)) => on_session!(&mut self.engine.session, s => s.load_states(row, slot))?,
            None => on_session!(&mut self.engine.session, s => s.reset_seq(slot))?,
        }
        Ok(())
    }

    /// Keeps a copy of hybrid sequence `i`'s states, now at block boundary `end` of its prompt.
    fn snapshot(&mut self, i: usize, end: usize) -> Result<()> {
        let seq = &self.running[i];
        let Some(&hash) = seq.hashes.get(end / KV_BLOCK - 1) else {
            return Ok(());
        };
        let Some(row) = self.snapshots.take(hash, &seq.tokens[..end]) else {
            return Ok(());
        };
        let slot = seq.slot.expect("admitted");
        let saved = on_session!(&mut self.engine.session, s => s.save_states(slot, row));
        if saved.is_err() {
            self.snapshots.drop_row(hash);
        }
        Ok(saved?)
    }

    /// Gives back the slot and blocks of the ended sequence kept longest; false when none is.
    fn reclaim(&mut self) -> bool {
        let Some(p) = self.parked.pop_front() else {
            return false;
        };
        self.unpark_blocks(&p.blocks);
        for b in p.blocks {
            self.blocks.release(b);
        }
        self.free_slots.push(p.slot);
        true
    }

    /// A kept sequence's `blocks` leave the kept ones' books.
    fn unpark_blocks(&mut self, blocks: &[u32]) {
        for b in blocks {
            if let Some(n) = self.parked_uses.get_mut(b) {
                *n -= 1;
                if *n == 0 {
                    self.parked_uses.remove(b);
                }
            }
        }
    }

    /// Ends `seq`: kept with what its caches hold, for a sequence that continues it, or given
    /// back when they hold nothing.
    fn retire(&mut self, mut seq: Seq) {
        match seq.slot {
            Some(slot) if seq.cached > 0 => {
                seq.tokens.truncate(seq.cached);
                for &b in &seq.blocks {
                    *self.parked_uses.entry(b).or_insert(0) += 1;
                }
                self.parked.push_back(Parked {
                    slot,
                    blocks: std::mem::take(&mut seq.blocks),
                    hashes: std::mem::take(&mut seq.hashes),
                    tokens: std::mem::take(&mut seq.tokens),
                });
            }
            _ => self.release(&mut seq),
        }
    }

    /// Records sequence `i`'s blocks that its last step filled, for later sequences to find.
    fn register_full(&mut self, i: usize) {
        let seq = &mut self.running[i];
        while (seq.hashes.len() + 1) * KV_BLOCK <= seq.cached {
            let j = seq.hashes.len();
            let parent = seq.hashes.last().copied().unwrap_or(ROOT);
            let tokens = &seq.tokens[j * KV_BLOCK..(j + 1) * KV_BLOCK];
            seq.hashes
                .push(self.blocks.register(seq.blocks[j], parent, tokens));
        }
    }

    /// Gives sequence `i`'s blocks the positions below `end`, preempting the sequences admitted
    /// after it while none is free. False when even that leaves too few (the sequence itself
    /// must wait).
    fn grow(&mut self, i: usize, end: usize) -> bool {
        let need = end.div_ceil(KV_BLOCK);
        while self.running[i].blocks.len() < need {
            let Some(b) = self.blocks.take() else {
                if self.reclaim() {
                    continue;
                }
                if self.running.len() - 1 > i {
                    let last = self.running.len() - 1;
                    self.preempt(last);
                    continue;
                }
                return false;
            };
            let seq = &mut self.running[i];
            let slot = seq.slot.expect("admitted");
            self.table[slot * self.max_blocks + seq.blocks.len()] = b;
            seq.blocks.push(b);
            self.table_changed = true;
        }
        true
    }

    /// Sends running sequence `i` back to wait (first in line), its blocks and slot freed and
    /// its tokens to be prefilled again.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        self.release(&mut seq);
        seq.cached = 0;
        // Its next slot's counts are another sequence's.
        seq.counts_synced = false;
        self.preempted += 1;
        self.waiting.push_front(seq);
    }

    fn release(&mut self, seq: &mut Seq) {
        for b in seq.blocks.drain(..) {
            self.blocks.release(b);
        }
        seq.hashes.clear();
        if let Some(slot) = seq.slot.take() {
            self.free_slots.push(slot);
        }
    }

    fn sync_table(&mut self) -> Result<()> {
        if self.table_changed {
            let table = &self.table;
            on_session!(&mut self.engine.session, s => s.set_page_table(table))?;
            self.table_changed = false;
        }
        Ok(())
    }

    /// Ends the sequences at `ids` (indices of `running`, ascending) with `e`.
    fn fail(&mut self, ids: &[usize], e: &EngineError) {
        for &i in ids.iter().rev() {
            let mut seq = self.running.remove(i);
            (seq.sink)(SeqEvent::Failed(e));
            self.release(&mut seq);
        }
    }

    /// The next chunk, of at most `limit` tokens, of the first sequence whose tokens are not
    /// all in the caches but for the last one or more; the tokens it ran (0: none).
    fn prefill_one(&mut self, limit: usize) -> usize {
        let Some(i) = self.running.iter().position(|s| s.tokens.len() - s.cached > 1) else {
            return 0;
        };
        let (start, len) = (self.running[i].cached, self.running[i].tokens.len());
        let mut end = (start + limit).min(len);
        // With snapshots, a prompt stops first at its last block boundary, to keep its states
        // there (the tokens after it run next).
        let boundary = (len - 1) / KV_BLOCK * KV_BLOCK;
        if self.snapshots.rows > 0 && end == len && boundary > start {
            end = boundary;
        }
        if !self.grow(i, end) {
            // Not even this sequence's prompt fits what the others leave: it waits.
            self.preempt(i);
            return 0;
        }
        let outcome = (|| -> Result<kestrel_model::Output> {
            self.sync_table()?;
            let seq = &self.running[i];
            let ids = &seq.tokens[start..end];
            let want = if end == len && seq.wants_logits() {
                Want::LastLogits
            } else {
                Want::Argmax
            };
            let slot = seq.slot.expect("admitted");
            Ok(on_session!(&mut self.engine.session, s => {
                s.select_seq(slot)?;
                s.step(ids, start, want)
            })?)
        })();
        self.times.prompt_tokens += (end - start) as u64;
        self.times.prompt_chunks += 1;
        self.tell_counted();
        let out = match outcome {
            Ok(out) => out,
            Err(e) => {
                self.fail(&[i], &e);
                return end - start;
            }
        };
        self.running[i].cached = end;
        self.register_full(i);
        if self.snapshots.rows > 0 && end % KV_BLOCK == 0 {
            if let Err(e) = self.snapshot(i, end) {
                self.fail(&[i], &e);
                return end - start;
            }
        }
        if end < len {
            on_session!(&mut self.engine.session, s => s.report_progress(end, len));
            return end - start;
        }
        // The prompt is in: its last token's output is the first generated token.
        let mut out = match out {
            kestrel_model::Output::Token(t) => BatchOutput::Tokens(vec![t]),
            kestrel_model::Output::Logits(l) => BatchOutput::Logits(l),
        };
        if !self.take_outputs(&[i], &mut out).is_empty() {
            let seq = self.running.remove(i);
            self.retire(seq);
        }
        end - start
    }

    /// The next token of every sequence with one token left to run, as one batched step.
    fn decode(&mut self) {
        let mut live: Vec<usize> = Vec::new();
        for i in 0..self.running.len() {
            if i >= self.running.len() {
                break;
            }
            let seq = &self.running[i];
            if seq.tokens.len() - seq.cached != 1 {
                continue;
            }
            let end = seq.cached + 1;
            // Growing may preempt sequences after this one (never one already in `live`).
            if self.grow(i, end) {
                live.push(i);
            } else {
                self.preempt(i);
                break;
            }
        }
        if live.is_empty() {
            return;
        }
        let seqs: Vec<u32> = live
            .iter()
            .map(|&i| self.running[i].slot.expect("admitted") as u32)
            .collect();
        let ids: Vec<u32> = live
            .iter()
            .map(|&i| self.running[i].tokens[self.running[i].cached])
            .collect();
        let pos: Vec<u32> = live.iter().map(|&i| self.running[i].cached as u32).collect();
        self.times.decoded_tokens += live.len() as u64;
        self.tell_counted();
        let mut out = match self.run_step(&live, &seqs, &ids, &pos) {
            Ok(out) => out,
            Err(e) => return self.fail(&live, &e),
        };
        for &i in &live {
            self.running[i].cached += 1;
            self.register_full(i);
        }
        let ended = self.take_outputs(&live, &mut out);
        on_session!(&mut self.engine.session, s => s.recycle(out));
        for &i in ended.iter().rev() {
            let seq = self.running.remove(i);
            self.retire(seq);
        }
    }

    /// Runs a batched step whose first `rows.len()` tokens (at least one) are outputs, for the
    /// sequences `rows` (indices of `running`; none: the step's first token stands as one and
    /// nothing is chosen from it). The tokens are drawn on the backend when some output samples
    /// and every output's settings allow it (each sequence's generator goes there and back);
    /// else they are the backend's argmax, or the logits come back when some output needs them.
    fn run_step(&mut self, rows: &[usize], seqs: &[u32], ids: &[u32], pos: &[u32]) -> Result<BatchOutput> {
        self.sync_table()?;
        let n = rows.len().max(1);
        let host = rows.iter().any(|&i| self.running[i].needs_host());
        if host || rows.iter().all(|&i| self.running[i].sampler.is_none()) {
            let want = if host { Want::AllLogits } else { Want::Argmax };
            *(if host {
                &mut self.kinds.host
            } else {
                &mut self.kinds.argmax
            }) += 1;
            // Tokens chosen here are not in the backend's counts.
            for &i in rows {
                self.running[i].counts_synced = false;
            }
            return Ok(on_session!(&mut self.engine.session, s => s.step_mixed(seqs, ids, pos, n, want))?);
        }
        // Penalised sequences' counts on the backend, where they are not up to date.
        for &i in rows {
            let seq = &mut self.running[i];
            if seq.counts_synced || !seq.sampler.as_ref().is_some_and(|s| s.params.has_penalties()) {
                continue;
            }
            let slot = seq.slot.expect("admitted");
            on_session!(&mut self.engine.session, s => s.set_draw_counts(slot, &seq.tokens))?;
            seq.counts_synced = true;
        }
        let greedy = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let (mut params, mut states) = (vec![greedy; n], vec![[0u64; 4]; n]);
        for (o, &i) in rows.iter().enumerate() {
            if let Some(s) = &self.running[i].sampler {
                (params[o], states[o]) = (s.params, s.rng_state());
            }
        }
        let tokens = on_session!(&mut self.engine.session, s => {
            s.step_mixed_drawn(seqs, ids, pos, &params, &mut states)
        })?;
        for (&i, state) in rows.iter().zip(states) {
            if let Some(s) = &mut self.running[i].sampler {
                s.set_rng_state(state);
            }
        }
        self.kinds.drawn += 1;
        Ok(BatchOutput::Tokens(tokens))
    }

    /// Each of the sequences `rows[o]` (indices of `running`, ascending) takes output `o` of a
    /// step: the backend's argmax, or a token chosen here from its row of logits (sampled and
    /// its log-probabilities found on all cores at once: a vocabulary of 152k takes a core
    /// 0.3-1.4 ms a row). The indices of those that ended, ascending.
    fn take_outputs(&mut self, rows: &[usize], out: &mut BatchOutput) -> Vec<usize> {
        use rayon::prelude::*;
        let vocab = self.engine.config().vocab;
        let picks: Vec<(u32, Option<TokenLogprobs>)> = match out {
            BatchOutput::Tokens(t) => t[..rows.len()].iter().map(|&id| (id, None)).collect(),
            BatchOutput::Logits(l) => {
                // Each row's sampler and history, borrowed apart from the rest of its sequence.
                let mut work: Vec<Pick> = Vec::new();
                let mut at = 0;
                let mut chunks = l.chunks_mut(vocab);
                for (i, seq) in self.running.iter_mut().enumerate() {
                    if rows.get(at) != Some(&i) {
                        continue;
                    }
                    let row = chunks.next().expect("a row of logits an output");
                    work.push(Pick {
                        row,
                        sampler: seq.sampler.as_mut(),
                        history: &seq.tokens,
                        logprobs: seq.logprobs,
                    });
                    at += 1;
                }
                work.into_par_iter()
                    .map(|p| {
                        let id = match p.sampler {
                            // Penalties change the logits; log-probabilities are the model's.
                            Some(s) if s.params.has_penalties() => s.sample(&mut p.row.to_vec(), p.history),
                            Some(s) => s.sample(p.row, p.history),
                            None => kestrel_core::sample::argmax(p.row),
                        };
                        (id, p.logprobs.map(|k| logprobs_of(p.row, k, id)))
                    })
                    .collect()
            }
        };
        let mut ended = Vec::new();
        for (&i, (id, lp)) in rows.iter().zip(picks) {
            if let Next::Ended = self.accept(i, id, lp) {
                ended.push(i);
            }
        }
        ended
    }

    /// Takes sequence `i`'s next token `id` (with its log-probabilities when asked for); tells
    /// it, and ends the sequence at an end-of-sequence id, a stop string or its token limit.
    fn accept(&mut self, i: usize, id: u32, lp: Option<TokenLogprobs>) -> Next {
        let eos_ids = &self.engine.eos;
        let tokenizer = self.tokenizer.as_ref();
        let seq = &mut self.running[i];
        if seq.max_tokens == 0 {
            return finish(seq, tokenizer, StopReason::Length);
        }
        if !seq.ignore_eos && eos_ids.contains(&id) {
            return finish(seq, tokenizer, StopReason::Eos);
        }
        seq.tokens.push(id);
        seq.generated += 1;
        let told = match tokenizer {
            Some(t) => {
                let text = match seq.stream.push(t, id) {
                    Ok(text) => text,
                    Err(e) => {
                        let e = EngineError::from(e);
                        (seq.sink)(SeqEvent::Failed(&e));
                        return Next::Ended;
                    }
                };
                let released = seq.stops.push(&text);
                if released.stopped {
                    let ok = released.text.is_empty()
                        || (seq.sink)(SeqEvent::Piece(Piece {
                            id: None,
                            text: &released.text,
                            logprobs: None,
                        }));
                    if !ok {
                        return Next::Ended;
                    }
                    (seq.sink)(SeqEvent::Done {
                        reason: StopReason::Stop,
                        tokens: seq.generated,
                        reused: seq.reused.unwrap_or(0),
                    });
                    return Next::Ended;
                }
                (seq.sink)(SeqEvent::Piece(Piece {
                    id: Some(id),
                    text: &released.text,
                    logprobs: lp.as_ref(),
                }))
            }
            None => (seq.sink)(SeqEvent::Piece(Piece {
                id: Some(id),
                text: "",
                logprobs: lp.as_ref(),
            })),
        };
        if !told {
            return Next::Ended;
        }
        if seq.generated == seq.max_tokens {
            return finish(seq, tokenizer, StopReason::Length);
        }
        Next::Going
    }
}

/// Ends `seq` for `reason`: what its stream and stop strings held back, then `Done`.
fn finish(seq: &mut Seq, tokenizer: Option<&Tokenizer>, reason: StopReason) -> Next {
    if let Some(t) = tokenizer {
        let tail = match seq.stream.finish(t) {
            Ok(text) => text,
            Err(e) => {
                let e = EngineError::from(e);
                (seq.sink)(SeqEvent::Failed(&e));
                return Next::Ended;
            }
        };
        let released = seq.stops.push(&tail);
        let mut text = released.text;
        if !released.stopped {
            text.push_str(&seq.stops.finish());
        }
        if !text.is_empty()
            && !(seq.sink)(SeqEvent::Piece(Piece {
                id: None,
                text: &text,
                logprobs: None,
            }))
        {
            return Next::Ended;
        }
    }
    (seq.sink)(SeqEvent::Done {
        reason,
        tokens: seq.generated,
        reused: seq.reused.unwrap_or(0),
    });
    Next::Ended
}

/// The log-probabilities of token `id` and of the `k` most likely tokens under `logits`.
pub(crate) fn logprobs_of(logits: &[f32], k: usize, id: u32) -> TokenLogprobs {
    let (lse, top) = logprobs(logits, k);
    TokenLogprobs {
        logprob: logits_at(logits, id, lse),
        top,
    }
}

/// The log-sum-exp of `logits` and its `k` most likely tokens with their log-probabilities.
fn logprobs(logits: &[f32], k: usize) -> (f64, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(order.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    }
    order.truncate(k);
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    let top = order
        .into_iter()
        .map(|t| (t, (f64::from(logits[t as usize]) - lse) as f32))
        .collect();
    (lse, top)
}

/// The log-probability of `id` given the log-sum-exp of the (unpenalised) logits.
fn logits_at(logits: &[f32], id: u32, lse: f64) -> f32 {
    (f64::from(logits[id as usize]) - lse) as f32
}

#[cfg(test)]
mod tests {
    use super::Snapshots;

    #[test]
    fn snapshots_are_found_by_hash_and_tokens_and_give_way_least_recently_used_first() {
        let mut s = Snapshots::new(2);
        let (a, b, c) = ([1u32, 2], [3u32, 4], [5u32, 6]);
        let ra = s.take(10, &a).expect("a free row");
        let rb = s.take(20, &b).expect("the other free row");
        assert_ne!(ra, rb);
        assert_eq!(s.take(10, &a), None, "held already: nothing to copy");
        assert_eq!(s.find(10, &a), Some(ra));
        assert_eq!(s.find(10, &b), None, "the same hash over other tokens is not it");
        // a was used last: b gives way.
        assert_eq!(s.take(30, &c), Some(rb));
        assert_eq!(s.find(20, &b), None);
        assert_eq!(s.find(10, &a), Some(ra));
        // A failed copy frees its row for the next.
        s.drop_row(30);
        assert_eq!(s.find(30, &c), None);
        assert_eq!(s.take(20, &b), Some(rb));
        assert_eq!(Snapshots::new(0).take(10, &a), None, "no rows: nothing kept");
    }
}
