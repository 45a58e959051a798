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

/// What a caller wants from a [`Session::step`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// Every token's logits, `[ids.len(), vocab]`.
    AllLogits,
    /// The last token's logits, `[vocab]`.
    LastLogits,
    /// The most likely next token, chosen on the backend (only its id is read back).
    Argmax,
    /// The next token drawn by the backend's sampler (see [`Session::with_sampling`]); the
    /// sampler's counts and generator advance.
    Sample,
}

/// What a [`Session::step`] hands back: logits for the `*Logits` wants, a token id for the
/// others.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    Logits(Vec<f32>),
    Token(u32),
}

impl Output {
    /// The token id, for [`Want::Argmax`] and [`Want::Sample`].
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

    fn for_want(want: Want) -> Outputs {
        match want {
            Want::AllLogits => Outputs::All,
            Want::LastLogits | Want::Argmax => Outputs::Last,
            Want::Sample => Outputs::Sample,
        }
    }
}

fn not_sampling() -> ModelError {
    ModelError::Config {
        key: "sampling".into(),
        reason: "the backend does not sample with these settings".into(),
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
    /// Steps of more tokens run in chunks of at most this many (see [`Session::step`]).
    chunk: Option<usize>,
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
            chunk: None,
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
            return Err(not_sampling());
        };
        let counts = counts_of(history, self.config.vocab);
        self.backend.upload(p, s.counts, &counts).map_err(backend_err)
    }

    /// Calls `f(bytes done, bytes in all)` as the weights go to the backend.
    pub fn with_progress(mut self, f: impl FnMut(u64, u64) + 'static) -> Session<B> {
        self.progress = Some(Box::new(f));
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
                let (f, p) = &self.programs[&key];
                let ids = self.backend.download::<u32>(p, f.argmax).map_err(backend_err)?;
                Ok(Output::Token(ids[0]))
            }
            Want::Sample => {
                let key = self.run(tail, at, Outputs::Sample)?;
                let (f, p) = &self.programs[&key];
                let Some(s) = f.sampled else {
                    return Err(not_sampling());
                };
                Ok(Output::Token(
                    self.backend.download::<u32>(p, s.token).map_err(backend_err)?[0],
                ))
            }
        }
    }

    /// The logits a program's last run left in its buffers.
    fn logits_of(&mut self, key: Key) -> Result<Vec<f32>> {
        let (f, p) = &self.programs[&key];
        self.backend
            .download::<f32>(p, f.logits)
            .map_err(|e| ModelError::Backend(Box::new(e)))
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

    /// Prepares the program for chunks of `tokens` with `want`'s outputs (uploading the weights
    /// with the first one), so that loading can be timed apart from running.
    pub fn prepare(&mut self, tokens: usize, want: Want) -> Result<()> {
        if tokens == 0 || tokens > self.ctx {
            return Err(ModelError::Config {
                key: "ctx".into(),
                reason: format!("{tokens} tokens do not fit a context of {}", self.ctx),
            });
        }
        self.program(tokens, 0, Outputs::for_want(want)).map(|_| ())
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
