//! The flags several commands share, defined once: the model, the backend, quantisation on
//! load, memory budgets, sampling and chat-template variables.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use kestrel_core::quant::QuantFormat;
use kestrel_engine::expert_cache::Eviction;
use kestrel_engine::{BackendChoice, ByteSize, EngineOptions, ModelSource, Precision, SamplingOverrides};
use kestrel_text::{GenerationConfig, SamplingParams};

/// `-m DIR`: a model directory, else the built-in model.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Model directory (config.json, safetensors weights, tokenizer files); default the built-in
    /// model.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
}

impl ModelArgs {
    pub fn source(&self) -> ModelSource {
        ModelSource::dir_or_builtin(self.model.clone())
    }
}

/// `--synthetic NAME [--layers N] [--bits B]`: a named real configuration with random weights
/// built in memory, in the MLX layout.
#[derive(Args, Clone)]
pub struct SyntheticArgs {
    /// A named real configuration with random weights built in memory, in the MLX layout:
    /// qwen3-30b-a3b, qwen3-next-80b-a3b or qwen3.5-397b-a17b.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Decoder layers of the synthetic model (default: all of the configuration's).
    #[arg(long, requires = "synthetic")]
    pub layers: Option<usize>,
    /// Bits of the synthetic model's weights (4 or 8; routers at 8), in groups of 64.
    #[arg(long, default_value_t = 4, requires = "synthetic")]
    pub bits: u32,
}

impl SyntheticArgs {
    /// The synthetic model named, with weights drawn from `seed` (None when none is named);
    /// `quant` must be None (a synthetic model's format is `--bits`).
    pub fn source(&self, quant: Option<QuantFormat>, seed: u64) -> Result<Option<ModelSource>> {
        let Some(name) = &self.synthetic else {
            return Ok(None);
        };
        anyhow::ensure!(
            quant.is_none(),
            "--quant applies to checkpoints; a synthetic model's format is --bits"
        );
        anyhow::ensure!(matches!(self.bits, 4 | 8), "--bits {}: 4 or 8", self.bits);
        Ok(Some(ModelSource::Synthetic {
            name: name.clone(),
            layers: self.layers,
            format: QuantFormat::mlx(self.bits, 64),
            seed,
        }))
    }

    /// The same flags again, for a command started by this one.
    pub fn flags(&self) -> Vec<String> {
        let Some(name) = &self.synthetic else {
            return Vec::new();
        };
        let mut f = vec![
            "--synthetic".to_string(),
            name.clone(),
            "--bits".into(),
            self.bits.to_string(),
        ];
        if let Some(l) = self.layers {
            f.extend(["--layers".to_string(), l.to_string()]);
        }
        f
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PrecisionFlag {
    /// Tensor cores over bf16 activations for many tokens, bf16 KV caches on CUDA.
    Fast,
    /// f32 activations and KV caches everywhere: the CPU reference's logits for a bf16
    /// checkpoint, slower prefill (quantised experts keep rounded activations).
    Exact,
}

/// `--backend cpu|cuda` and `--precision fast|exact`.
#[derive(Args, Clone, Copy)]
pub struct BackendArgs {
    /// Backend; default CUDA when a device is present, else the CPU.
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// How closely CUDA follows the f32 reference.
    #[arg(long, value_enum, default_value = "fast")]
    pub precision: PrecisionFlag,
}

impl BackendArgs {
    /// The choice, None for the engine's default.
    pub fn choice(&self) -> Option<BackendChoice> {
        self.backend.map(|b| match b {
            Backend::Cpu => BackendChoice::Cpu,
            Backend::Cuda => BackendChoice::Cuda,
        })
    }

    /// The backend and precision into `opts`.
    pub fn apply(&self, opts: &mut EngineOptions) {
        opts.backend = self.choice();
        opts.precision = match self.precision {
            PrecisionFlag::Fast => Precision::Fast,
            PrecisionFlag::Exact => Precision::Exact,
        };
    }
}

/// Quantisation on load of a dense checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Quant {
    None,
    Q4,
    Q8,
}

/// `--quant` and `--group-size`.
#[derive(Args, Clone, Copy)]
pub struct QuantArgs {
    /// Quantise dense weights on load (4 or 8 bits; routers at 8); quantised checkpoints keep
    /// their own format.
    #[arg(long, value_enum, default_value = "none")]
    pub quant: Quant,
    /// Values per quantisation group.
    #[arg(long, default_value_t = 64)]
    pub group_size: usize,
}

impl QuantArgs {
    pub fn format(&self) -> Result<Option<QuantFormat>> {
        let bits = match self.quant {
            Quant::None => return Ok(None),
            Quant::Q4 => 4,
            Quant::Q8 => 8,
        };
        quant_format(bits, self.group_size).map(Some)
    }
}

/// `bits` in groups of `group_size`, checked.
pub fn quant_format(bits: u32, group_size: usize) -> Result<QuantFormat> {
    if group_size == 0 || group_size % 32 != 0 {
        bail!("--group-size {group_size} is not a multiple of 32 (the usual sizes are 32, 64 and 128)");
    }
    Ok(QuantFormat::mlx(bits, group_size))
}

/// A count that must be at least 1 (`--prefill-chunk`), for clap's `value_parser`.
pub fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// `--allow-long-context`: positions past the model's trained length.
#[derive(Args, Clone, Copy)]
pub struct LengthArgs {
    /// Allow more positions than the model was trained for (`max_position_embeddings` in its
    /// config.json); past them its output is not what it was trained to give.
    #[arg(long)]
    pub allow_long_context: bool,
}

impl LengthArgs {
    /// Refuses `positions` past the model's trained length, unless allowed; `what` names them
    /// with their number ("a prompt of 4558 tokens"), `hint` says what to change.
    pub fn check(&self, trained: usize, positions: usize, what: &str, hint: &str) -> Result<()> {
        if positions > trained && !self.allow_long_context {
            bail!(
                "{what}: more than the {trained} positions the model was trained for \
                 (max_position_embeddings); {hint}, or pass --allow-long-context to go past them"
            );
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EvictionFlag {
    /// The least recently used expert leaves.
    Lru,
    /// The least often used leaves, uses halving every 64 steps; ties by recency.
    Freq,
}

/// `--gpu-mem`, `--host-mem`, `--expert-eviction`: memory budgets, and how experts stream when
/// the model does not fit.
#[derive(Args, Clone, Copy)]
pub struct MemoryArgs {
    /// Memory the backend may hold, e.g. 16GiB (default: on CUDA what the device has free, less
    /// a margin; on the CPU no limit). A model larger than this streams its routed experts.
    #[arg(long)]
    pub gpu_mem: Option<ByteSize>,
    /// Host memory for the experts the GPU does not hold, e.g. 64GiB (default: no limit).
    #[arg(long)]
    pub host_mem: Option<ByteSize>,
    /// Which cached expert leaves when a streamed one needs its slot.
    #[arg(long, value_enum, default_value = "lru")]
    pub expert_eviction: EvictionFlag,
}

impl MemoryArgs {
    /// The budgets and policy into `opts`.
    pub fn apply(&self, opts: &mut EngineOptions) {
        opts.gpu_mem = self.gpu_mem.map(|b| b.0);
        opts.host_mem = self.host_mem.map(|b| b.0);
        opts.eviction = match self.expert_eviction {
            EvictionFlag::Lru => Eviction::Lru,
            EvictionFlag::Freq => Eviction::Frequency { half_life: 64 },
        };
    }
}

/// The sampling flags, as llama.cpp names them.
#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 picks the most likely token (default: the model's generation config,
    /// else 0).
    #[arg(long = "temp", alias = "temperature", allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Keep the k most likely tokens (0: all; default: the model's generation config, else 50
    /// as in transformers).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the most likely tokens up to this probability mass (1: all).
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Keep tokens at least this fraction as likely as the most likely one (0: all).
    #[arg(long, allow_negative_numbers = true)]
    min_p: Option<f32>,
    /// Repetition penalty on tokens seen before (1: none).
    #[arg(long, allow_negative_numbers = true)]
    repeat_penalty: Option<f32>,
    /// Presence penalty (0: none).
    #[arg(long, allow_negative_numbers = true)]
    presence_penalty: Option<f32>,
    /// Frequency penalty (0: none).
    #[arg(long, allow_negative_numbers = true)]
    frequency_penalty: Option<f32>,
    /// Seed of the sampler (default: drawn from the clock and printed).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The model's defaults, then the flags. A seed drawn from the clock is printed when it
    /// matters (a temperature above 0), so the run can be repeated.
    pub fn params(&self, generation: &GenerationConfig) -> SamplingParams {
        let params = SamplingOverrides {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
        }
        .resolve(generation);
        if self.seed.is_none() && params.temperature > 0.0 {
            errln!("seed {}", params.seed);
        }
        params
    }
}

/// Chat-template variables.
#[derive(Args, Clone)]
pub struct TemplateArgs {
    /// Ask a model with a thinking switch (Qwen3) to answer without thinking
    /// (`enable_thinking: false`).
    #[arg(long)]
    no_think: bool,
    /// More template variables, as a JSON object (`{"enable_thinking": false}`).
    #[arg(long)]
    chat_template_kwargs: Option<String>,
}

impl TemplateArgs {
    /// The variables to render the template with.
    pub fn extra(&self) -> Result<serde_json::Map<String, serde_json::Value>> {
        let mut extra = match &self.chat_template_kwargs {
            Some(text) => match serde_json::from_str(text) {
                Ok(serde_json::Value::Object(m)) => m,
                _ => bail!("--chat-template-kwargs {text:?} is not a JSON object"),
            },
            None => serde_json::Map::new(),
        };
        if self.no_think {
            extra.insert("enable_thinking".into(), false.into());
        }
        Ok(extra)
    }
}
