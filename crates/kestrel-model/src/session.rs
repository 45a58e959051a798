//! A model on a backend: the directory's config and weights, the weights uploaded with the first
//! program, and forward passes over chunks of tokens at given positions (KV caches and recurrent
//! states persist between them on the backend). Positions are data, not part of a graph, so a
//! program is prepared once per chunk length and replayed: every decode step after the first
//! is one run of the same program (one CUDA graph replay).

use std::collections::HashMap;
use std::path::Path;

use kestrel_core::quant::QuantFormat;
use kestrel_core::{Backend, DType};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::graph::{Forward, ForwardSpec};
use crate::weights::Weights;

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
    /// Prepared programs by (tokens, all_logits).
    programs: HashMap<(usize, bool), (Forward, B::Program)>,
}

impl<B: Backend> Session<B> {
    /// Opens the model directory `dir` for `backend`, with caches of `ctx` positions.
    pub fn open(dir: &Path, backend: B, ctx: usize, cache_dtype: DType) -> Result<Session<B>> {
        Ok(Session {
            config: ModelConfig::from_dir(dir)?,
            weights: Weights::open(dir)?,
            backend,
            ctx,
            cache_dtype,
            quant: None,
            uploaded: false,
            programs: HashMap::new(),
        })
    }

    /// Quantises the checkpoint's dense projections and experts to `format` on load.
    pub fn with_quant(mut self, format: Option<QuantFormat>) -> Session<B> {
        self.quant = format;
        self
    }

    /// Runs a prompt from position `past` in chunks of at most `chunk` tokens (one graph per
    /// chunk length, the caches and states carrying over) and returns the last token's logits,
    /// or with `all_logits` every token's, `[ids.len(), vocab]`.
    pub fn prefill(&mut self, ids: &[u32], past: usize, chunk: usize, all_logits: bool) -> Result<Vec<f32>> {
        if chunk == 0 {
            return Err(ModelError::Config {
                key: "prefill chunk".into(),
                reason: "must be at least one token".into(),
            });
        }
        let mut out = Vec::new();
        for (i, part) in ids.chunks(chunk).enumerate() {
            let last = (i + 1) * chunk >= ids.len();
            let logits = self.forward(part, past + i * chunk, all_logits)?;
            if all_logits || last {
                out.extend(logits);
            }
        }
        Ok(out)
    }

    /// Runs `ids` at positions `past..past + ids.len()` and returns the logits, `[ids.len(),
    /// vocab]` with `all_logits`, else those of the last token.
    pub fn forward(&mut self, ids: &[u32], past: usize, all_logits: bool) -> Result<Vec<f32>> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab) {
            return Err(ModelError::Config {
                key: "vocab_size".into(),
                reason: format!("token {bad} is outside the vocabulary of {}", self.config.vocab),
            });
        }
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
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let key = (ids.len(), all_logits);
        if !self.programs.contains_key(&key) {
            let spec = ForwardSpec {
                tokens: ids.len(),
                past,
                ctx: self.ctx,
                cache_dtype: self.cache_dtype,
                all_logits,
                quant: self.quant,
            };
            let f = Forward::build(&self.config, &self.weights, spec)?;
            let mut p = self.backend.prepare(&f.graph).map_err(backend_err)?;
            if !self.uploaded {
                f.upload(&self.weights, &mut self.backend, &mut p)?;
                self.uploaded = true;
            }
            self.programs.insert(key, (f, p));
        }
        let (f, p) = self.programs.get_mut(&key).expect("inserted above");
        let pos: Vec<u32> = (past..past + ids.len()).map(|p| p as u32).collect();
        self.backend.upload(p, f.tokens, ids).map_err(backend_err)?;
        self.backend.upload(p, f.positions, &pos).map_err(backend_err)?;
        self.backend.run(p).map_err(backend_err)?;
        self.backend.download::<f32>(p, f.logits).map_err(backend_err)
    }
}
