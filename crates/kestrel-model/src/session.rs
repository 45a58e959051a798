//! A model on a backend: the directory's config and weights, the weights uploaded with the first
//! program, and forward passes over chunks of tokens at given positions (KV caches and recurrent
//! states persist between them on the backend).

use std::path::Path;

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
    uploaded: bool,
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
            uploaded: false,
        })
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
        let spec = ForwardSpec {
            tokens: ids.len(),
            past,
            ctx: self.ctx,
            cache_dtype: self.cache_dtype,
            all_logits,
        };
        let f = Forward::build(&self.config, &self.weights, spec)?;
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let mut p = self.backend.prepare(&f.graph).map_err(backend_err)?;
        if !self.uploaded {
            f.upload(&self.weights, &mut self.backend, &mut p)?;
            self.uploaded = true;
        }
        let pos: Vec<u32> = (past..past + ids.len()).map(|p| p as u32).collect();
        self.backend.upload(&mut p, f.tokens, ids).map_err(backend_err)?;
        self.backend
            .upload(&mut p, f.positions, &pos)
            .map_err(backend_err)?;
        self.backend.run(&mut p).map_err(backend_err)?;
        self.backend.download::<f32>(&p, f.logits).map_err(backend_err)
    }
}
