//! `kestrel run`: generation from prompt token ids under a model directory. The prompt runs as
//! a prefill (in chunks with `--prefill-chunk`), then one token at a time through the single-token path; each next token is the
//! most likely one (`--temperature 0`) or drawn from the softmax of the logits divided by the
//! temperature (seeded). Prints the generated ids, or with `--json` one JSON object as the last
//! stdout line. Text in and out comes with the tokenizer.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel_core::rng::Rng;
use kestrel_core::{Backend, Config, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, Device, RunMode};
use kestrel_model::Session;

use crate::logits::{default_backend, BackendChoice, QuantArgs};

#[derive(Args)]
pub struct RunArgs {
    /// Model directory (config.json and safetensors weights).
    #[arg(long)]
    model: PathBuf,
    /// Prompt token ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    prompt_tokens: Vec<u32>,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 24)]
    max_new_tokens: usize,
    /// 0 picks the most likely token; above 0, tokens are sampled at this temperature.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Seed of the sampler (with a temperature above 0).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Backend; default CUDA when a device is present, else the CPU.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    /// Positions the KV caches hold; default prompt plus generated tokens.
    #[arg(long)]
    ctx: Option<usize>,
    /// Prefill the prompt in chunks of at most this many tokens (default: one chunk).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    #[command(flatten)]
    quant: QuantArgs,
    /// Print one JSON object (tokens, timings) as the last stdout line.
    #[arg(long)]
    json: bool,
}

/// The next token from one row of logits.
fn pick(logits: &[f32], temperature: f32, rng: &mut Rng) -> u32 {
    let best = logits
        .iter()
        .enumerate()
        .fold(0, |b, (i, &v)| if v > logits[b] { i } else { b });
    if temperature == 0.0 {
        return best as u32;
    }
    let max = logits[best];
    let weights: Vec<f64> = logits
        .iter()
        .map(|&v| (((v - max) / temperature) as f64).exp())
        .collect();
    let mut u = rng.next_f32() as f64 * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    best as u32
}

struct Outcome {
    tokens: Vec<u32>,
    prefill_s: f64,
    decode_s: f64,
}

fn generate<B: Backend>(a: &RunArgs, backend: B, cache: DType) -> Result<Outcome> {
    let prompt = &a.prompt_tokens;
    let ctx = a.ctx.unwrap_or(prompt.len() + a.max_new_tokens);
    if prompt.len() + a.max_new_tokens > ctx {
        bail!(
            "{} prompt tokens and {} new ones do not fit a context of {ctx} (--ctx)",
            prompt.len(),
            a.max_new_tokens
        );
    }
    let mut s = Session::open(&a.model, backend, ctx, cache)
        .with_context(|| format!("opening {}", a.model.display()))?
        .with_quant(a.quant.format()?);
    let mut rng = Rng::new(a.seed);
    let start = Instant::now();
    let chunk = a.prefill_chunk.unwrap_or(prompt.len());
    // Greedy decoding takes the argmax on the backend and reads back one id a token.
    let greedy = a.temperature == 0.0;
    let first = if greedy {
        s.prefill_next_token(prompt, 0, chunk)?
    } else {
        pick(&s.prefill(prompt, 0, chunk, false)?, a.temperature, &mut rng)
    };
    let prefill_s = start.elapsed().as_secs_f64();
    let mut tokens = Vec::with_capacity(a.max_new_tokens);
    if a.max_new_tokens > 0 {
        tokens.push(first);
    }
    let start = Instant::now();
    while tokens.len() < a.max_new_tokens {
        let last = *tokens.last().expect("one token was picked after the prompt");
        let at = prompt.len() + tokens.len() - 1;
        let next = if greedy {
            s.next_token(&[last], at)?
        } else {
            pick(&s.forward(&[last], at, false)?, a.temperature, &mut rng)
        };
        tokens.push(next);
    }
    Ok(Outcome {
        tokens,
        prefill_s,
        decode_s: start.elapsed().as_secs_f64(),
    })
}

pub fn run(config: &Config, a: RunArgs) -> Result<std::process::ExitCode> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature must be 0 or more, not {}", a.temperature);
    }
    let backend = a.backend.unwrap_or_else(default_backend);
    let out = match backend {
        BackendChoice::Cpu => generate(&a, CpuBackend::new(), DType::F32)?,
        BackendChoice::Cuda => {
            let dev = Device::open(config.device, config)?;
            generate(&a, CudaBackend::new(dev, RunMode::Graph), DType::BF16)?
        }
    };
    let decoded = out.tokens.len().saturating_sub(1);
    if a.json {
        let v = serde_json::json!({
            "tokens": out.tokens,
            "prompt_tokens": a.prompt_tokens.len(),
            "backend": format!("{backend:?}").to_lowercase(),
            "prefill_s": out.prefill_s,
            "decode_tokens_per_s": if out.decode_s > 0.0 { decoded as f64 / out.decode_s } else { 0.0 },
        });
        println!("{v}");
    } else {
        let ids: Vec<String> = out.tokens.iter().map(|t| t.to_string()).collect();
        println!("{}", ids.join(" "));
    }
    Ok(std::process::ExitCode::SUCCESS)
}
