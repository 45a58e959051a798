//! `kestrel run`: generation under a model directory, from text (`-p`, `-f`; the model's chat
//! template applied unless `--raw`) or from token ids (`--prompt-tokens`). The prompt runs as a
//! prefill (in chunks with `--prefill-chunk`), then one token at a time through the single-token
//! path. Sampling settings default to the model's `generation_config.json` and flags override
//! them; plain greedy decoding takes the argmax on the backend and reads back one id a token.
//! Generation stops at the model's end-of-sequence tokens (unless `--ignore-eos`), at a stop
//! string (`--stop`, not printed) or after `-n` tokens. Text streams to stdout as it completes
//! (never half a character); load time and speeds go to stderr. With `--json` the last stdout
//! line is one JSON object instead.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, Config, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, Device, RunMode};
use kestrel_model::Session;
use kestrel_text::{ChatInput, GenerationConfig, Sampler, SamplingParams, Tokenizer};

use crate::generate::{Generator, Turn};
use crate::logits::{default_backend, BackendChoice, QuantArgs};

#[derive(Args)]
pub struct RunArgs {
    /// Model directory (config.json, safetensors weights, tokenizer files); default the built-in
    /// model.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// The prompt, as text.
    #[arg(short = 'p', long, conflicts_with_all = ["file", "prompt_tokens"])]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long, conflicts_with = "prompt_tokens")]
    file: Option<PathBuf>,
    /// The prompt as token ids, comma separated (no tokenizer involved).
    #[arg(long, value_delimiter = ',')]
    prompt_tokens: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(
        short = 'n',
        long = "n-predict",
        alias = "max-new-tokens",
        default_value_t = 128
    )]
    n_predict: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A system message, for models with a chat template.
    #[arg(long)]
    system: Option<String>,
    /// Use the prompt as it is, without the chat template.
    #[arg(long)]
    raw: bool,
    #[command(flatten)]
    template: TemplateArgs,
    /// Stop when the generated text contains this string (repeatable; not printed).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Backend; default CUDA when a device is present, else the CPU.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    /// Positions the KV caches hold; default prompt plus generated tokens.
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    /// Prefill the prompt in chunks of at most this many tokens (default: one chunk).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    #[command(flatten)]
    quant: QuantArgs,
    /// Print one JSON object (tokens, text, timings) as the last stdout line, instead of
    /// streaming the text.
    #[arg(long)]
    json: bool,
}

/// Chat-template variables shared by `run` and `chat`.
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
    /// The variables for `ChatInput::extra`.
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

/// The sampling flags shared by `run` and `chat`, as llama.cpp names them.
#[derive(Args, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 picks the most likely token (default: the model's generation config,
    /// else 0).
    #[arg(long = "temp", alias = "temperature")]
    temperature: Option<f32>,
    /// Keep the k most likely tokens (0: all; default: the model's generation config, else 50
    /// as in transformers).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the most likely tokens up to this probability mass (1: all).
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep tokens at least this fraction as likely as the most likely one (0: all).
    #[arg(long)]
    min_p: Option<f32>,
    /// Repetition penalty on tokens seen before (1: none).
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Presence penalty (0: none).
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// Frequency penalty (0: none).
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// Seed of the sampler (default: drawn from the clock and printed).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The model's defaults, then the flags; the seed drawn from the clock when not given.
    pub fn params(&self, generation: &GenerationConfig) -> SamplingParams {
        let d = generation.sampling();
        let temperature = self.temperature.unwrap_or(d.temperature);
        SamplingParams {
            temperature,
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repeat_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: seed_of(self.seed, temperature),
        }
    }
}

/// What the prompt is, in tokens, with the tokenizer that made them (if any).
fn prompt_ids(a: &RunArgs, tokenizer: Option<&Tokenizer>) -> Result<Vec<u32>> {
    if let Some(ids) = &a.prompt_tokens {
        return Ok(ids.clone());
    }
    let text = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("reading the prompt from {}", f.display()))?
        }
        (None, None) => bail!("give a prompt: -p TEXT, -f FILE or --prompt-tokens IDS"),
    };
    let Some(t) = tokenizer else {
        bail!("the model directory has no tokenizer.json: give the prompt as --prompt-tokens");
    };
    let template = if a.raw { None } else { t.template()? };
    let Some(template) = template else {
        return Ok(t.encode(&text, true)?);
    };
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": text}));
    let rendered = template.render(&ChatInput {
        messages: &messages,
        add_generation_prompt: true,
        bos_token: t.bos_token.as_deref(),
        eos_token: t.eos_token.as_deref(),
        extra: a.template.extra()?,
        ..Default::default()
    })?;
    Ok(t.encode(&rendered, false)?)
}

struct Outcome {
    prompt_len: usize,
    turn: Turn,
    load_s: f64,
}

/// The end-of-sequence ids: the generation config's and the tokenizer's EOS token.
pub(crate) fn eos_ids(generation: &GenerationConfig, tokenizer: Option<&Tokenizer>) -> Vec<u32> {
    let mut eos = generation.eos_token_ids.clone();
    if let Some(t) = tokenizer.and_then(|t| t.eos_token.as_deref().and_then(|e| t.token_id(e))) {
        if !eos.contains(&t) {
            eos.push(t);
        }
    }
    eos
}

/// The sampler's seed: the flag's, or one drawn from the clock (printed when it matters).
pub(crate) fn seed_of(flag: Option<u64>, temperature: f32) -> u64 {
    flag.unwrap_or_else(|| {
        let (_, seed) = Rng::from_time();
        if temperature > 0.0 {
            eprintln!("seed {seed}");
        }
        seed
    })
}

fn generate<B: Backend>(a: &RunArgs, dir: &std::path::Path, backend: B, cache: DType) -> Result<Outcome> {
    let tokenizer = Tokenizer::from_dir(dir)?;
    let generation = GenerationConfig::from_dir(dir)?;
    let prompt = prompt_ids(a, tokenizer.as_ref())?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let ctx = a.ctx.unwrap_or(prompt.len() + a.n_predict);
    if prompt.len() + a.n_predict > ctx {
        bail!(
            "{} prompt tokens and {} new ones do not fit a context of {ctx} (-c / --ctx)",
            prompt.len(),
            a.n_predict
        );
    }
    let sampler = Sampler::new(a.sampling.params(&generation))?;
    let eos = if a.ignore_eos {
        Vec::new()
    } else {
        eos_ids(&generation, tokenizer.as_ref())
    };
    let start = Instant::now();
    let mut s = Session::open(dir, backend, ctx, cache)
        .with_context(|| format!("opening {}", dir.display()))?
        .with_quant(a.quant.format()?)
        .with_progress(crate::progress::loading(&dir.display().to_string()))
        .with_sampling(sampler.params);
    // The weights go to the backend with the first program.
    let chunk = a.prefill_chunk.unwrap_or(prompt.len()).max(1);
    s.prepare(chunk.min(prompt.len()), false)?;
    let load_s = start.elapsed().as_secs_f64();
    let mut g = Generator::new(s, tokenizer.as_ref(), sampler, eos, a.prefill_chunk);
    let turn = g.turn(&prompt, a.n_predict, &a.stop, !a.json, &AtomicBool::new(false))?;
    Ok(Outcome {
        prompt_len: prompt.len(),
        turn,
        load_s,
    })
}

/// Where the built-in model lives in a checkout (`scripts/train-builtin-model.py` makes it).
const BUILTIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/kestrel-tiny");

/// The model directory: the flag's, else the built-in model.
pub(crate) fn model_dir(flag: &Option<PathBuf>) -> Result<PathBuf> {
    if let Some(dir) = flag {
        return Ok(dir.clone());
    }
    let builtin = PathBuf::from(BUILTIN);
    if !builtin.join("config.json").exists() {
        bail!(
            "no model given and no built-in model at {} (scripts/train-builtin-model.py makes it): give -m DIR",
            builtin.display()
        );
    }
    Ok(builtin)
}

pub fn run(config: &Config, a: RunArgs) -> Result<std::process::ExitCode> {
    let dir = model_dir(&a.model)?;
    let backend = a.backend.unwrap_or_else(default_backend);
    let load = Instant::now();
    let out = match backend {
        BackendChoice::Cpu => generate(&a, &dir, CpuBackend::new(), DType::F32)?,
        BackendChoice::Cuda => {
            let dev = Device::open(config.device, config)?;
            generate(&a, &dir, CudaBackend::new(dev, RunMode::Graph), DType::BF16)?
        }
    };
    let total_s = load.elapsed().as_secs_f64();
    let t = &out.turn;
    // Decode speed over the tokens after the first (the first comes with the prefill).
    let decode_tps = t.decode_tps();
    if a.json {
        let v = serde_json::json!({
            "tokens": t.tokens,
            "text": t.text,
            "stop_reason": t.stop_reason,
            "prompt_tokens": out.prompt_len,
            "load_s": out.load_s,
            "backend": format!("{backend:?}").to_lowercase(),
            "prefill_s": t.prefill_s,
            "decode_tokens_per_s": decode_tps,
        });
        println!("{v}");
    } else {
        match &t.text {
            // The text was streamed; end its line.
            Some(_) => println!(),
            // No tokenizer: the ids.
            None => {
                let ids: Vec<String> = t.tokens.iter().map(|t| t.to_string()).collect();
                println!("{}", ids.join(" "));
            }
        }
        let prompt_tps = out.prompt_len as f64 / t.prefill_s.max(1e-9);
        eprintln!("load: {:.2} s", out.load_s);
        eprintln!(
            "prompt: {} tokens in {:.3} s ({prompt_tps:.1} tokens/s)",
            out.prompt_len, t.prefill_s
        );
        eprintln!(
            "generated: {} tokens ({}), {decode_tps:.1} tokens/s; {total_s:.2} s in all",
            t.tokens.len(),
            t.stop_reason
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
