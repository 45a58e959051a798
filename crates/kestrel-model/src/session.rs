//! A model on a backend: the directory's config and weights, the weights uploaded with the first
//! program, and forward passes over chunks of tokens at given positions (KV caches and recurrent
//! states persist between them on the backend). Positions are data, not part of a graph, so a
//! program is prepared once per chunk length and replayed: every decode step after the first
//! is one run of the same program (one CUDA graph replay).

use std::collections::HashMap;
use std::path::Path;

use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_core::sample::{counts_of, rng_words, SamplingParams};
use kestrel_core::{Backend, DType};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::graph::{Forward, ForwardSpec};
use crate::weights::Weights;

/// What a program computes at its end: every token's logits, the last token's (and its
/// argmax), or those and the backend's sample (which advances the sampler's state, so only the
/// step that wants a sample runs it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Outputs {
    All,
    Last,
    Sample,
}

impl Outputs {
    fn of(all_logits: bool) -> Outputs {
        if all_logits {
            Outputs::All
        } else {
            Outputs::Last
        }
    }
}

/// A prepared program: (tokens, outputs).
type Key = (usize, Outputs);

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
    programs: HashMap<Key, (Forward, B::Program)>,
    /// Told (bytes done, bytes in all) while the weights upload.
    progress: Option<Box<dyn FnMut(u64, u64)>>,
    /// Sample on the backend with these settings (see [`Session::with_sampling`]).
    sampling: Option<SamplingParams>,
    /// The backend sampler's generator was seeded.
    seeded: bool,
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
            progress: None,
            sampling: None,
            seeded: false,
        }
    }

    /// Samples the next token on the backend with `params` (`sample_next_token`), when the
    /// backend's sampler can keep the candidates they need; check [`Session::samples_on_backend`].
    pub fn with_sampling(mut self, params: SamplingParams) -> Session<B> {
        self.sampling = Some(params);
        self
    }

    /// Whether `sample_next_token` is available.
    pub fn samples_on_backend(&self) -> bool {
        self.sampling.is_some_and(|p| p.backend_candidates().is_some())
    }

    /// Tells the backend's sampler which tokens the sequence holds (for the penalties): call it
    /// with the whole sequence before a turn's first sample.
    pub fn set_sample_history(&mut self, history: &[u32]) -> Result<()> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let key = self.program(1, 0, Outputs::Sample)?;
        let (f, p) = self.programs.get_mut(&key).expect("prepared above");
        let Some(s) = f.sampled else {
            return Err(ModelError::Config {
                key: "sampling".into(),
                reason: "the backend does not sample with these settings".into(),
            });
        };
        let counts = counts_of(history, self.config.vocab);
        self.backend.upload(p, s.counts, &counts).map_err(backend_err)
    }

    /// Runs `ids` at positions `past..` and samples the next token on the backend (only the id
    /// is read back); the sampler's counts and generator advance.
    pub fn sample_next_token(&mut self, ids: &[u32], past: usize) -> Result<u32> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let key = self.run(ids, past, Outputs::Sample)?;
        let (f, p) = &self.programs[&key];
        let Some(s) = f.sampled else {
            return Err(ModelError::Config {
                key: "sampling".into(),
                reason: "the backend does not sample with these settings".into(),
            });
        };
        Ok(self.backend.download::<u32>(p, s.token).map_err(backend_err)?[0])
    }

    /// The same after a prefill in chunks.
    pub fn prefill_sample_next_token(&mut self, ids: &[u32], past: usize, chunk: usize) -> Result<u32> {
        let (tail, at, _) = self.prefill_head(ids, past, chunk, false)?;
        self.sample_next_token(tail, at)
    }

    /// Calls `f(bytes done, bytes in all)` as the weights go to the backend.
    pub fn with_progress(mut self, f: impl FnMut(u64, u64) + 'static) -> Session<B> {
        self.progress = Some(Box::new(f));
        self
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
        let (tail, at, mut out) = self.prefill_head(ids, past, chunk, all_logits)?;
        out.extend(self.forward(tail, at, all_logits)?);
        Ok(out)
    }

    /// The same prefill, returning only the most likely next token (computed on the backend).
    pub fn prefill_next_token(&mut self, ids: &[u32], past: usize, chunk: usize) -> Result<u32> {
        let (tail, at, _) = self.prefill_head(ids, past, chunk, false)?;
        self.next_token(tail, at)
    }

    /// Runs every chunk but the last and returns the last chunk, its position and (with
    /// `all_logits`) the logits of the chunks run.
    fn prefill_head<'a>(
        &mut self,
        ids: &'a [u32],
        past: usize,
        chunk: usize,
        all_logits: bool,
    ) -> Result<(&'a [u32], usize, Vec<f32>)> {
        if chunk == 0 || ids.is_empty() {
            return Err(ModelError::Config {
                key: "prefill chunk".into(),
                reason: format!("{} tokens in chunks of {chunk}: both must be positive", ids.len()),
            });
        }
        let mut gathered = Vec::new();
        let heads = (ids.len() - 1) / chunk;
        for i in 0..heads {
            let part = &ids[i * chunk..(i + 1) * chunk];
            if all_logits {
                let logits = self.forward(part, past + i * chunk, true)?;
                gathered.extend(logits);
            } else {
                self.run(part, past + i * chunk, Outputs::Last)?;
            }
        }
        Ok((&ids[heads * chunk..], past + heads * chunk, gathered))
    }

    /// Runs `ids` at positions `past..` and returns the most likely next token after the last
    /// one, computed on the backend (only the id is read back).
    pub fn next_token(&mut self, ids: &[u32], past: usize) -> Result<u32> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let key = self.run(ids, past, Outputs::Last)?;
        let (f, p) = &self.programs[&key];
        let ids = self.backend.download::<u32>(p, f.argmax).map_err(backend_err)?;
        Ok(ids[0])
    }

    /// Runs `ids` at positions `past..past + ids.len()` and returns the logits, `[ids.len(),
    /// vocab]` with `all_logits`, else those of the last token.
    pub fn forward(&mut self, ids: &[u32], past: usize, all_logits: bool) -> Result<Vec<f32>> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let key = self.run(ids, past, Outputs::of(all_logits))?;
        let (f, p) = &self.programs[&key];
        self.backend.download::<f32>(p, f.logits).map_err(backend_err)
    }

    /// Starts a new sequence: the linear-attention layers' recurrent and convolution states go
    /// back to zero. (KV caches need nothing: positions say which rows count.) Call it before
    /// running from position 0 again.
    pub fn reset_states(&mut self) -> Result<()> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        // States are shared by label: zeroing them through one program zeroes them for all.
        let Some((f, p)) = self.programs.values_mut().next() else {
            return Ok(());
        };
        for &b in &f.states {
            let zeros = vec![0u8; f.graph.decl(b).byte_len()];
            self.backend.write_bytes(p, b, 0, &zeros).map_err(backend_err)?;
        }
        Ok(())
    }

    /// Prepares the program for chunks of `tokens` (uploading the weights with the first one),
    /// so that loading can be timed apart from running.
    pub fn prepare(&mut self, tokens: usize, all_logits: bool) -> Result<()> {
        if tokens == 0 || tokens > self.ctx {
            return Err(ModelError::Config {
                key: "ctx".into(),
                reason: format!("{tokens} tokens do not fit a context of {}", self.ctx),
            });
        }
        self.program(tokens, 0, Outputs::of(all_logits)).map(|_| ())
    }

    /// The program for `tokens` tokens, built, prepared and (the first time) given the weights.
    fn program(&mut self, tokens: usize, past: usize, outputs: Outputs) -> Result<Key> {
        let backend_err = |e: B::Error| ModelError::Backend(Box::new(e));
        let key = (tokens, outputs);
        let all_logits = outputs == Outputs::All;
        if !self.programs.contains_key(&key) {
            let spec = ForwardSpec {
                tokens,
                past,
                ctx: self.ctx,
                cache_dtype: self.cache_dtype,
                projection_inputs: self.backend.projection_input_dtype(tokens),
                all_logits,
                quant: self.quant,
                sampling: self.sampling.filter(|_| outputs == Outputs::Sample),
            };
            let f = Forward::build(&self.config, &self.weights, spec)?;
            let mut p = self.backend.prepare(&f.graph).map_err(backend_err)?;
            if !self.uploaded {
                match &mut self.progress {
                    Some(cb) => f.upload_with(&self.weights, &mut self.backend, &mut p, cb.as_mut())?,
                    None => f.upload(&self.weights, &mut self.backend, &mut p)?,
                }
                self.uploaded = true;
            }
            // The sampler's generator starts from the seed, once per session.
            if let (Some(s), Some(params), false) = (f.sampled, self.sampling, self.seeded) {
                let words = rng_words(Rng::new(params.seed).state());
                self.backend.upload(&mut p, s.rng, &words).map_err(backend_err)?;
                self.seeded = true;
            }
            self.programs.insert(key, (f, p));
        }
        Ok(key)
    }

    /// Runs `ids` at positions `past..` through the program for their length (prepared on first
    /// use), leaving the outputs in its buffers; returns the program's key.
    fn run(&mut self, ids: &[u32], past: usize, outputs: Outputs) -> Result<Key> {
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
        let key = self.program(ids.len(), past, outputs)?;
        let (f, p) = self.programs.get_mut(&key).expect("prepared above");
        let pos: Vec<u32> = (past..past + ids.len()).map(|p| p as u32).collect();
        self.backend.upload(p, f.tokens, ids).map_err(backend_err)?;
        self.backend.upload(p, f.positions, &pos).map_err(backend_err)?;
        self.backend.run(p).map_err(backend_err)?;
        Ok(key)
    }
}
