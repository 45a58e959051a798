//! `kestrel run`: generation under a model directory, from text (`-p`, `-f`; the model's chat
//! template applied unless `--raw`) or from token ids (`--prompt-tokens`). The prompt runs as a
//! prefill (in chunks with `--prefill-chunk`), then one token at a time through the single-token
//! path. Sampling settings default to the model's `generation_config.json` and flags override
//! them; plain greedy decoding takes the argmax on the backend and reads back one id a token.
//! Generation stops at the model's end-of-sequence tokens (unless `--ignore-eos`), at a stop
//! string (`--stop`, not printed) or after `-n` tokens. Text streams to stdout as it completes
//! (never half a character); load time and speeds go to stderr. With `--json` the last stdout
//! line is one JSON object instead.

use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, Config, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, Device, RunMode};
use kestrel_model::Session;
use kestrel_text::{ChatInput, GenerationConfig, Sampler, SamplingParams, StopStrings, Tokenizer};

use crate::logits::{default_backend, BackendChoice, QuantArgs};

#[derive(Args)]
pub struct RunArgs {
    /// Model directory (config.json, safetensors weights, tokenizer files).
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
    /// Temperature; 0 picks the most likely token (default: the model's generation config,
    /// else 0).
    #[arg(long = "temp", alias = "temperature")]
    temperature: Option<f32>,
    /// Keep the k most likely tokens (0: all).
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
    /// A system message, for models with a chat template.
    #[arg(long)]
    system: Option<String>,
    /// Use the prompt as it is, without the chat template.
    #[arg(long)]
    raw: bool,
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

/// The sampling settings: the model's defaults, then the flags.
fn sampling(a: &RunArgs, generation: &GenerationConfig, seed: u64) -> SamplingParams {
    let d = generation.sampling();
    SamplingParams {
        temperature: a.temperature.unwrap_or(d.temperature),
        top_k: a.top_k.unwrap_or(d.top_k),
        top_p: a.top_p.unwrap_or(d.top_p),
        min_p: a.min_p.unwrap_or(d.min_p),
        repetition_penalty: a.repeat_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: a.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: a.frequency_penalty.unwrap_or(d.frequency_penalty),
        seed,
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
        ..Default::default()
    })?;
    Ok(t.encode(&rendered, false)?)
}

struct Outcome {
    prompt_len: usize,
    tokens: Vec<u32>,
    /// The generated text, when the model has a tokenizer.
    text: Option<String>,
    load_s: f64,
    stop_reason: &'static str,
    prefill_s: f64,
    decode_s: f64,
}

/// Where generated text goes: streamed to stdout, or kept for the JSON line.
struct Sink<'t> {
    stream: Option<kestrel_text::TextStream<'t>>,
    stops: StopStrings,
    print: bool,
    text: String,
}

impl Sink<'_> {
    /// Takes one generated id; true when a stop string ended generation.
    fn push(&mut self, id: u32) -> Result<bool> {
        let Some(stream) = &mut self.stream else {
            return Ok(false);
        };
        let piece = stream.push(id)?;
        let released = self.stops.push(&piece);
        self.emit(&released.text)?;
        Ok(released.stopped)
    }

    fn finish(&mut self) -> Result<()> {
        if let Some(stream) = &mut self.stream {
            let rest = stream.finish()?;
            let released = self.stops.push(&rest);
            self.emit(&released.text)?;
            if !released.stopped {
                let held = self.stops.finish();
                self.emit(&held)?;
            }
        }
        Ok(())
    }

    fn emit(&mut self, s: &str) -> Result<()> {
        if s.is_empty() {
            return Ok(());
        }
        self.text.push_str(s);
        if self.print {
            let mut out = std::io::stdout().lock();
            out.write_all(s.as_bytes())?;
            out.flush()?;
        }
        Ok(())
    }
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
            "{} prompt tokens and {} new ones do not fit a context of {ctx} (--ctx)",
            prompt.len(),
            a.n_predict
        );
    }
    let seed = a.seed.unwrap_or_else(|| {
        let (_, seed) = Rng::from_time();
        seed
    });
    let params = sampling(a, &generation, seed);
    let mut sampler = Sampler::new(params)?;
    if params.temperature > 0.0 && a.seed.is_none() {
        eprintln!("seed {seed}");
    }
    let mut eos: Vec<u32> = generation.eos_token_ids.clone();
    if let Some(t) = tokenizer
        .as_ref()
        .and_then(|t| t.eos_token.as_deref().and_then(|e| t.token_id(e)))
    {
        eos.push(t);
    }
    if a.ignore_eos {
        eos.clear();
    }
    let chunk = a.prefill_chunk.unwrap_or(prompt.len()).max(1);
    let start = Instant::now();
    let mut s = Session::open(dir, backend, ctx, cache)
        .with_context(|| format!("opening {}", dir.display()))?
        .with_quant(a.quant.format()?);
    // The weights go to the backend with the first program.
    s.prepare(chunk.min(prompt.len()), false)?;
    let load_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let mut sink = Sink {
        stream: tokenizer.as_ref().map(|t| t.stream()),
        stops: StopStrings::new(a.stop.iter().cloned()),
        print: !a.json,
        text: String::new(),
    };
    // Plain greedy decoding takes the argmax on the backend and reads back one id a token.
    let greedy = params.is_plain_greedy();
    let mut history = prompt.clone();
    let mut next =
        |s: &mut Session<B>, ids: &[u32], at: usize, first: bool, history: &[u32]| -> Result<u32> {
            Ok(match (greedy, first) {
                (true, true) => s.prefill_next_token(ids, at, chunk)?,
                (true, false) => s.next_token(ids, at)?,
                (false, true) => sampler.sample(&mut s.prefill(ids, at, chunk, false)?, history),
                (false, false) => sampler.sample(&mut s.forward(ids, at, false)?, history),
            })
        };
    let mut tokens = Vec::with_capacity(a.n_predict);
    let mut stop_reason = "length";
    let mut prefill_s = 0.0;
    let decode_start = if a.n_predict > 0 {
        let first = next(&mut s, &prompt, 0, true, &history)?;
        prefill_s = start.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut id = first;
        loop {
            if eos.contains(&id) {
                stop_reason = "eos";
                break;
            }
            tokens.push(id);
            history.push(id);
            if sink.push(id)? {
                stop_reason = "stop";
                break;
            }
            if tokens.len() == a.n_predict {
                break;
            }
            let at = prompt.len() + tokens.len() - 1;
            id = next(&mut s, &[id], at, false, &history)?;
        }
        t
    } else {
        Instant::now()
    };
    let decode_s = decode_start.elapsed().as_secs_f64();
    sink.finish()?;
    Ok(Outcome {
        prompt_len: prompt.len(),
        tokens,
        text: sink.stream.is_some().then_some(sink.text),
        load_s,
        stop_reason,
        prefill_s,
        decode_s,
    })
}

pub fn run(config: &Config, a: RunArgs) -> Result<std::process::ExitCode> {
    let Some(dir) = a.model.clone() else {
        bail!("no model: give -m DIR (this build has no built-in model yet)");
    };
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
    // Decode speed over the tokens after the first (the first comes with the prefill).
    let decoded = out.tokens.len().saturating_sub(1);
    let decode_tps = if out.decode_s > 0.0 {
        decoded as f64 / out.decode_s
    } else {
        0.0
    };
    if a.json {
        let v = serde_json::json!({
            "tokens": out.tokens,
            "text": out.text,
            "stop_reason": out.stop_reason,
            "prompt_tokens": out.prompt_len,
            "load_s": out.load_s,
            "backend": format!("{backend:?}").to_lowercase(),
            "prefill_s": out.prefill_s,
            "decode_tokens_per_s": decode_tps,
        });
        println!("{v}");
    } else {
        match &out.text {
            // The text was streamed; end its line.
            Some(_) => println!(),
            // No tokenizer: the ids.
            None => {
                let ids: Vec<String> = out.tokens.iter().map(|t| t.to_string()).collect();
                println!("{}", ids.join(" "));
            }
        }
        let prompt_tps = out.prompt_len as f64 / out.prefill_s.max(1e-9);
        eprintln!("load: {:.2} s", out.load_s);
        eprintln!(
            "prompt: {} tokens in {:.3} s ({prompt_tps:.1} tokens/s)",
            out.prompt_len, out.prefill_s
        );
        eprintln!(
            "generated: {} tokens ({}), {decode_tps:.1} tokens/s; {total_s:.2} s in all",
            out.tokens.len(),
            out.stop_reason
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}
