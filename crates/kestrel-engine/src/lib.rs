//! Kestrel's engine, the library under every front end (the CLI and the HTTP server).
//!
//! [`Model::open`] reads what a model needs once: config, weights, tokenizer, generation
//! config, from a directory, from the model built into the binary, or built in memory at a
//! real configuration's shapes. [`Engine::new`] picks the backend (CUDA when a device is
//! present, else the CPU, unless the caller says) and the KV-cache type in one place and holds
//! the model's [`Session`](kestrel_model::Session) on it. [`Engine::step`] runs tokens and
//! hands back what the caller asked for ([`Want`]). A [`Batcher`] over the engine is the one
//! generation path (continuous batching over the engine's pool of KV blocks): many sequences
//! at once for the server, or one turn at a time ([`Batcher::generate`]) for `run` and `chat`:
//! reuse of what the caches hold, prefill, sampling, end-of-sequence and stop strings, text
//! streamed to a callback, timings. For models larger than the GPU, [`Placement`] says where
//! the bytes go (resident weights, a GPU cache of experts, host memory, disk) and
//! [`expert_cache`] sums what the caches did.

mod batch;
mod blocks;
mod builtin;
mod engine;
mod error;
mod generate;
mod model;
pub mod placement;

pub use batch::{Batcher, CountSink, Piece, SeqEvent, SeqRequest, Sink, StepKinds, StepTimes, StopReason};
pub use engine::{
    cache_dtype, default_backend, BackendChoice, Engine, EngineOptions, Precision, TokenLogprobs,
};
pub use error::{EngineError, Result};
pub use generate::Turn;
pub use kestrel_model::{expert_cache, BatchOutput, Output, Want, KV_BLOCK};
pub use model::{Model, ModelSource, ModelText, SamplingOverrides};
pub use placement::{ByteSize, Placement, RunShape};
