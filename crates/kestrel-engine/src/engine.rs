//! `Engine`: a model on the backend chosen for it, with the settings every step shares (context,
//! quantisation on load, prefill chunk, sampling, end-of-sequence ids). The backend's type is
//! decided here, once; callers see one type whatever it is.

use std::fmt;
use std::str::FromStr;

use kestrel_core::quant::QuantFormat;
use kestrel_core::{Config, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, Device, Exact, RunMode};
use kestrel_model::{
    BatchOutput, CacheStats, DiskStats, Eviction, Forward, ForwardSpec, KvPool, ModelConfig, Output, Session,
    StageAhead, Want, Weights, KV_BLOCK,
};
use kestrel_text::SamplingParams;

use crate::error::{EngineError, Result};
use crate::model::{Model, ModelText};
use crate::placement::{Placement, RunShape};

/// GPU memory left out of the default budget, at least (or a twentieth of what is free):
/// the CUDA context, cuBLAS's workspace, kernel modules and allocator slack.
const GPU_MARGIN: u64 = 1 << 30;

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// The reference backend (f32, f32 KV caches).
    Cpu,
    /// The CUDA backend (CUDA graphs, bf16 KV caches).
    Cuda,
}

impl BackendChoice {
    pub fn name(self) -> &'static str {
        match self {
            BackendChoice::Cpu => "cpu",
            BackendChoice::Cuda => "cuda",
        }
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(BackendChoice::Cpu),
            "cuda" => Ok(BackendChoice::Cuda),
            other => Err(format!("unknown backend {other:?}: cpu or cuda")),
        }
    }
}

/// CUDA when a device is present, else the CPU.
pub fn default_backend() -> BackendChoice {
    match kestrel_cuda::device_count() {
        Ok(n) if n > 0 => BackendChoice::Cuda,
        _ => BackendChoice::Cpu,
    }
}

/// How closely a backend follows the f32 reference.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Precision {
    /// The fast paths: on CUDA bf16 KV caches, and many-token products on tensor cores over
    /// activations rounded to bf16 (router logits always exact).
    #[default]
    Fast,
    /// f32 activations and KV caches everywhere (`kestrel_cuda::Exact::ALL`): a bf16 checkpoint
    /// gives the CPU reference's logits to float rounding, at the cost of the tensor cores
    /// (BENCHMARKS.md). Quantised experts keep their rounded activations.
    Exact,
}

/// The KV caches' element type on a backend: f32 on the reference and in exact mode, bf16 on
/// CUDA.
pub fn cache_dtype(backend: BackendChoice, precision: Precision) -> DType {
    match (backend, precision) {
        (BackendChoice::Cpu, _) | (_, Precision::Exact) => DType::F32,
        (BackendChoice::Cuda, Precision::Fast) => DType::BF16,
    }
}

/// How an [`Engine`] runs its model.
pub struct EngineOptions {
    /// None: CUDA when a device is present, else the CPU.
    pub backend: Option<BackendChoice>,
    /// Positions the KV caches hold.
    pub ctx: usize,
    /// Dense weights quantised on load to this format.
    pub quant: Option<QuantFormat>,
    /// Steps of more tokens run in chunks of at most this many (None: in one go).
    pub prefill_chunk: Option<usize>,
    /// How generation ([`crate::Batcher::generate`]) picks tokens: greedy when None.
    pub sampling: Option<SamplingParams>,
    /// Generation does not stop at the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Told (bytes done, bytes in all) as the weights go to the backend.
    pub progress: Option<Box<dyn FnMut(u64, u64)>>,
    /// Told (tokens done, tokens in all) after each chunk of a step run in chunks.
    pub prefill_progress: Option<Box<dyn FnMut(usize, usize)>>,
    /// Allow a context past the model's trained length (`max_position_embeddings`).
    pub allow_long_context: bool,
    /// Fast paths, or f32 everywhere.
    pub precision: Precision,
    /// Memory the backend may hold (None: on CUDA what the device has free, less a margin; on
    /// the CPU no limit). A model larger than this streams its routed experts through a cache.
    pub gpu_mem: Option<u64>,
    /// Host memory for the experts the GPU does not hold (None: no limit).
    pub host_mem: Option<u64>,
    /// Which cached expert leaves when a streamed one needs its slot.
    pub eviction: Eviction,
    /// Sequences generated at once by a [`crate::Batcher`] (None: 1). The KV caches are a pool
    /// of blocks for that many sequences of `ctx` positions each, and recurrent states
    /// (hybrids) a row per sequence.
    pub max_seqs: Option<usize>,
    /// Blocks of [`KV_BLOCK`] positions in the pool (None: every sequence's whole context; at
    /// least one sequence's). Fewer than that: sequences share them as they grow, and the
    /// newest are preempted while too few are free.
    pub kv_blocks: Option<usize>,
    /// For models with recurrent states (hybrids): copies of a sequence's states kept at block
    /// boundaries of its prompt, so that a later sequence starting with the same tokens goes on
    /// from there (prefix caching for hybrids; 0: none). Each holds one sequence's states.
    pub state_snapshots: usize,
}

impl EngineOptions {
    /// Caches of `ctx` positions, everything else by default.
    pub fn with_ctx(ctx: usize) -> EngineOptions {
        EngineOptions {
            backend: None,
            ctx,
            quant: None,
            prefill_chunk: None,
            sampling: None,
            ignore_eos: false,
            progress: None,
            prefill_progress: None,
            allow_long_context: false,
            precision: Precision::Fast,
            gpu_mem: None,
            host_mem: None,
            eviction: Eviction::Lru,
            max_seqs: None,
            kv_blocks: None,
            state_snapshots: 0,
        }
    }
}

/// The model's session on whichever backend was chosen.
pub(crate) enum AnySession {
    Cpu(Session<CpuBackend>),
    Cuda(Session<CudaBackend>),
}

/// Calls the same method on the session whatever its backend.
macro_rules! on_session {
    ($s:expr, $v:ident => $e:expr) => {
        match $s {
            $crate::engine::AnySession::Cpu($v) => $e,
            $crate::engine::AnySession::Cuda($v) => $e,
        }
    };
}
pub(crate) use on_session;

/// The log-probabilities of one generated token under the model (the raw logits' softmax,
/// before sampling settings).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The chosen token's.
    pub logprob: f32,
    /// The most likely tokens and theirs, most likely first (as many as asked for).
    pub top: Vec<(u32, f32)>,
}

/// A model opened on a backend: [`Engine::step`] runs tokens; generation goes through a
/// [`crate::Batcher`] over the engine, for one sequence as for many.
pub struct Engine {
    pub(crate) label: String,
    pub(crate) text: ModelText,
    pub(crate) session: AnySession,
    /// The KV caches: a pool of blocks for the sequences a [`crate::Batcher`] generates.
    pub(crate) pool: KvPool,
    backend: BackendChoice,
    device: Option<Device>,
    /// Where the bytes went, when the model streams its experts.
    placement: Option<Placement>,
    /// Generation's settings unless a request gives its own.
    pub(crate) sampling: SamplingParams,
    pub(crate) ignore_eos: bool,
    /// The model's end-of-sequence ids.
    pub(crate) eos: Vec<u32>,
}

impl Engine {
    /// Puts `model` on its backend (see [`EngineOptions`]); the weights are uploaded with the
    /// first program (see [`Engine::prepare`]).
    pub fn new(model: Model, config: &Config, opts: EngineOptions) -> Result<Engine> {
        // Positions are 32-bit throughout the graph.
        if opts.ctx == 0 || opts.ctx > u32::MAX as usize {
            return Err(EngineError::Invalid(format!(
                "a context of {} positions: it must hold 1 to {} positions",
                opts.ctx,
                u32::MAX
            )));
        }
        let trained = model.config.max_position_embeddings;
        if opts.ctx > trained && !opts.allow_long_context {
            return Err(EngineError::Invalid(format!(
                "a context of {} positions is past {}'s trained length of {trained} positions \
                 (max_position_embeddings); use a smaller context, or allow going past it \
                 (--allow-long-context)",
                opts.ctx, model.label
            )));
        }
        let backend = opts.backend.unwrap_or_else(default_backend);
        let eos = model.text.eos_ids();
        let sampling = opts.sampling.unwrap_or(SamplingParams {
            temperature: 0.0,
            ..Default::default()
        });
        sampling.validate().map_err(EngineError::Invalid)?;
        let ignore_eos = opts.ignore_eos;
        let cache = cache_dtype(backend, opts.precision);
        let device = match backend {
            BackendChoice::Cuda => {
                let dev = Device::open(config.device, config)?;
                // Every kernel module now: those the disk cache lacks (a first start) are
                // compiled at the same time rather than one after another as steps need them.
                dev.registry().load_modules(kestrel_cuda::MODULES)?;
                Some(dev)
            }
            BackendChoice::Cpu => None,
        };
        // What the backend may hold: the caller's budget, else the device's free memory less a
        // margin for the CUDA context, cuBLAS and the kernels (the CPU has no limit of its own).
        let budget = match (opts.gpu_mem, &device) {
            (Some(b), _) => Some(b),
            (None, Some(dev)) => {
                let free = dev.memory_info()?.0 as u64;
                Some(free.saturating_sub(GPU_MARGIN.max(free / 20)))
            }
            (None, None) => None,
        };
        let shape = RunShape {
            ctx: opts.ctx,
            cache_dtype: cache,
            quant: opts.quant,
            prefill_chunk: opts.prefill_chunk.unwrap_or(opts.ctx),
            pool: None,
        };
        // The caller's blocks (at least one sequence's whole context), else every sequence's
        // whole context, or for several under a GPU budget what fits beside the model.
        let per_seq = opts.ctx.div_ceil(KV_BLOCK);
        let seqs = opts.max_seqs.unwrap_or(1).max(1);
        // Snapshots only where there are states to copy.
        let snapshots = match model.config.arch.is_hybrid() {
            true => opts.state_snapshots,
            false => 0,
        };
        // The CUDA backend's bf16 copies of the projections it dequantises
        // (`Config::projection_copies`): kept, and taken from the budget, where the model with
        // one sequence's caches stays resident beside them; else not kept (the experts would
        // stream to make room for them).
        let copies = match &device {
            Some(dev) if dev.projection_copies() && opts.precision == Precision::Fast => {
                let spec = ForwardSpec {
                    quant: opts.quant,
                    ..ForwardSpec::new(1, opts.ctx, cache)
                };
                let forward = Forward::build(&model.config, &model.weights, spec)?;
                kestrel_cuda::projection_copy_bytes(&forward.graph, dev.dequant_projections_from())
            }
            _ => 0,
        };
        let least = RunShape {
            pool: Some(KvPool {
                seqs,
                blocks: per_seq,
                snapshots,
            }),
            ..shape
        };
        let keep_copies = copies > 0
            && budget.is_none_or(|gpu| {
                Placement::resident_beside(&model.config, &model.weights, least, gpu, copies)
            });
        let budget = match keep_copies {
            true => budget.map(|gpu| gpu - copies),
            false => budget,
        };
        let pool = match (opts.kv_blocks, budget) {
            (Some(blocks), _) => KvPool {
                seqs,
                blocks: blocks.max(per_seq),
                snapshots,
            },
            (None, Some(gpu)) if seqs > 1 => {
                Placement::kv_pool(&model.config, &model.weights, shape, seqs, snapshots, gpu)?
            }
            (None, _) => KvPool {
                seqs,
                blocks: seqs * per_seq,
                snapshots,
            },
        };
        let placement = match budget {
            Some(gpu) => {
                let shape = RunShape {
                    pool: Some(pool),
                    ..shape
                };
                let p = Placement::plan(&model.config, &model.weights, shape, gpu, opts.host_mem)?;
                (!p.resident()).then_some(p)
            }
            None => None,
        };
        let Model {
            label,
            config: model_config,
            weights,
            text,
        } = model;
        /// The same settings on a session of either backend.
        fn configure<B: kestrel_core::Backend>(
            s: Session<B>,
            opts: EngineOptions,
            placement: Option<&Placement>,
            pool: KvPool,
        ) -> Result<Session<B>> {
            let mut s = s
                .with_quant(opts.quant)
                .with_kv_pool(pool.seqs, pool.blocks)?
                .with_state_snapshots(pool.snapshots)?;
            if let Some(p) = placement {
                s = s
                    .with_expert_cache(p.slots_per_layer, opts.eviction)?
                    .with_host_layers(p.host_layers(opts.host_mem))
                    .with_stage_ahead(if p.stage_ahead {
                        StageAhead::Auto
                    } else {
                        StageAhead::Off
                    });
            }
            if let Some(p) = opts.progress {
                s = s.with_progress(p);
            }
            if let Some(p) = opts.prefill_progress {
                s = s.with_step_progress(p);
            }
            Ok(s.with_prefill_chunk(opts.prefill_chunk)?)
        }
        let ctx = opts.ctx;
        let precision = opts.precision;
        let session = match &device {
            None => {
                let s = Session::new(model_config, weights, CpuBackend::new(), ctx, cache);
                AnySession::Cpu(configure(s, opts, placement.as_ref(), pool)?)
            }
            Some(dev) => {
                let exact = match precision {
                    Precision::Fast => Exact::default(),
                    Precision::Exact => Exact::ALL,
                };
                let cuda = CudaBackend::new(dev.clone(), RunMode::Graph)
                    .with_exact(exact)
                    .with_projection_copies(keep_copies);
                let s = Session::new(model_config, weights, cuda, ctx, cache);
                AnySession::Cuda(configure(s, opts, placement.as_ref(), pool)?)
            }
        };
        Ok(Engine {
            label,
            text,
            session,
            pool,
            backend,
            device,
            placement,
            sampling,
            ignore_eos,
            eos,
        })
    }

    /// Sequences the engine's caches hold at once ([`EngineOptions::max_seqs`]).
    pub fn max_seqs(&self) -> usize {
        self.pool.seqs
    }

    /// The pool of KV blocks.
    pub fn kv_pool(&self) -> KvPool {
        self.pool
    }

    /// How messages name the model (its directory, or a description).
    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn config(&self) -> &ModelConfig {
        on_session!(&self.session, s => &s.config)
    }

    pub fn weights(&self) -> &Weights {
        on_session!(&self.session, s => &s.weights)
    }

    /// The tokenizer, chat template and generation config.
    pub fn text(&self) -> &ModelText {
        &self.text
    }

    pub fn backend(&self) -> BackendChoice {
        self.backend
    }

    /// Where the model's bytes went, when its routed experts stream (None: all resident).
    pub fn placement(&self) -> Option<&Placement> {
        self.placement.as_ref()
    }

    /// What the expert caches did so far, when experts stream.
    pub fn expert_stats(&mut self) -> Result<Option<CacheStats>> {
        Ok(on_session!(&mut self.session, s => s.expert_stats())?)
    }

    /// What the reads of experts from the weight files did so far, and whether they bypass the
    /// page cache (None unless some layers' experts are read from the files).
    pub fn disk_stats(&self) -> Option<(DiskStats, bool)> {
        on_session!(&self.session, s => s.disk_stats())
    }

    /// Seconds the host has spent bringing experts between segments of a program so far.
    pub fn host_seconds(&self) -> f64 {
        on_session!(&self.session, s => s.host_seconds())
    }

    /// The read bandwidth of the disk holding the weights over up to `bytes` in large parallel
    /// reads starting `from` bytes into the files: (bytes, seconds), or None unless experts
    /// stream from the files.
    pub fn measure_disk(&mut self, bytes: u64, from: u64) -> Result<Option<(u64, f64)>> {
        Ok(on_session!(&mut self.session, s => s.measure_disk(bytes, from))?)
    }

    /// Why streamed experts come from slower memory than planned (page-locked host memory ran
    /// out), if they do: for the front end to show as a warning.
    pub fn host_tier_note(&self) -> Option<String> {
        on_session!(&self.session, s => s.host_tier_note().map(str::to_string))
    }

    /// The CUDA device, on the CUDA backend.
    pub fn device(&self) -> Option<&Device> {
        self.device.as_ref()
    }

    /// Positions the KV caches hold.
    pub fn ctx(&self) -> usize {
        on_session!(&self.session, s => s.ctx)
    }

    /// The sampling settings generation uses unless a request gives its own.
    pub fn sampling(&self) -> SamplingParams {
        self.sampling
    }

    /// The session on the CUDA backend (for run-mode switches and counters), if that is where
    /// the model runs.
    pub fn cuda_session(&mut self) -> Option<&mut Session<CudaBackend>> {
        match &mut self.session {
            AnySession::Cuda(s) => Some(s),
            AnySession::Cpu(_) => None,
        }
    }

    /// Runs `ids` at positions `past..` (in chunks of the prefill chunk) and hands back what
    /// `want` asks for, in the first sequence of the pool. A [`crate::Batcher`] keeps its own
    /// record of what the caches hold: do not step by hand an engine it generates with.
    pub fn step(&mut self, ids: &[u32], past: usize, want: Want) -> Result<Output> {
        Ok(on_session!(&mut self.session, s => s.step(ids, past, want))?)
    }

    /// With several sequences ([`EngineOptions::max_seqs`]): the sequence whose tokens the next
    /// [`Engine::step`]s run, starting afresh (its recurrent states zeroed) when `fresh`. Until
    /// a [`crate::Batcher`] takes the caches over, sequence `s` holds its own range of blocks.
    pub fn select_seq(&mut self, seq: usize, fresh: bool) -> Result<()> {
        on_session!(&mut self.session, s => {
            s.select_seq(seq)?;
            if fresh {
                s.reset_seq(seq)?;
            }
        });
        Ok(())
    }

    /// With several sequences: the next token of each sequence `seqs[i]`, `ids[i]` at
    /// `positions[i]`, as one batched step (see [`kestrel_model::Session::step_batch`]).
    pub fn step_batch(
        &mut self,
        seqs: &[u32],
        ids: &[u32],
        positions: &[u32],
        want: Want,
    ) -> Result<BatchOutput> {
        Ok(on_session!(&mut self.session, s => s.step_batch(seqs, ids, positions, want))?)
    }

    /// Tokens of several sequences as one step, the first `outputs` of them giving outputs and
    /// the rest prompts' chunks, one sequence's or several (see
    /// [`kestrel_model::Session::step_mixed`]).
    pub fn step_mixed(
        &mut self,
        seqs: &[u32],
        ids: &[u32],
        positions: &[u32],
        outputs: usize,
        want: Want,
    ) -> Result<BatchOutput> {
        Ok(on_session!(&mut self.session, s => s.step_mixed(seqs, ids, positions, outputs, want))?)
    }

    /// Prepares the program for `tokens` tokens with `want`'s outputs, uploading the weights
    /// with the first one, so loading can be timed apart from running.
    pub fn prepare(&mut self, tokens: usize, want: Want) -> Result<()> {
        Ok(on_session!(&mut self.session, s => s.prepare(tokens, want))?)
    }

    /// Starts a new sequence for [`Engine::step`]: the linear-attention states go back to zero.
    pub fn reset(&mut self) -> Result<()> {
        Ok(on_session!(&mut self.session, s => s.reset_states())?)
    }
}
