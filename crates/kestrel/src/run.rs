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
use kestrel_core::Config;
use kestrel_engine::{Batcher, Engine, EngineOptions, Model};

use crate::args::{
    at_least_one, BackendArgs, LengthArgs, MemoryArgs, ModelArgs, QuantArgs, SamplingArgs, TemplateArgs,
};

/// Prompts longer than this run in chunks of [`PROGRESS_CHUNK`] (unless `--prefill-chunk` says
/// otherwise), so their prefill shows progress.
const LONG_PROMPT: usize = 4096;
const PROGRESS_CHUNK: usize = 2048;

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
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
    #[command(flatten)]
    backend: BackendArgs,
    /// Positions the KV caches hold; default prompt plus generated tokens.
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    #[command(flatten)]
    length: LengthArgs,
    /// Prefill the prompt in chunks of at most this many tokens (default: one chunk, or chunks
    /// of 2048 with progress on stderr for prompts over 4096 tokens).
    #[arg(long, value_parser = at_least_one)]
    prefill_chunk: Option<usize>,
    #[command(flatten)]
    quant: QuantArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Print one JSON object (tokens, text, timings) as the last stdout line, instead of
    /// streaming the text.
    #[arg(long)]
    json: bool,
}

/// The most bytes `-f` reads: far more text than the longest trained context holds (262,144
/// tokens are about a megabyte), so a wrong file (`/dev/zero`, a model's weights) is refused
/// instead of filling memory.
const MAX_PROMPT_BYTES: u64 = 64 << 20;

/// The prompt file `f`, at most [`MAX_PROMPT_BYTES`] of UTF-8 text.
fn read_prompt(f: &std::path::Path) -> Result<String> {
    use std::io::Read as _;
    let file = std::fs::File::open(f).with_context(|| format!("reading the prompt from {}", f.display()))?;
    let mut bytes = Vec::new();
    file.take(MAX_PROMPT_BYTES + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading the prompt from {}", f.display()))?;
    if bytes.len() as u64 > MAX_PROMPT_BYTES {
        bail!(
            "the prompt file {} holds more than {} MiB, far more than any model's context: is it the right file?",
            f.display(),
            MAX_PROMPT_BYTES >> 20
        );
    }
    String::from_utf8(bytes).with_context(|| format!("the prompt file {} is not UTF-8 text", f.display()))
}

/// The prompt in tokens.
fn prompt_ids(a: &RunArgs, model: &Model) -> Result<Vec<u32>> {
    if let Some(ids) = &a.prompt_tokens {
        return Ok(ids.clone());
    }
    let text = match (&a.prompt, &a.file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => read_prompt(f)?,
        (None, None) => bail!("give a prompt: -p TEXT, -f FILE or --prompt-tokens IDS"),
    };
    Ok(model
        .text
        .encode_prompt(&text, a.system.as_deref(), a.raw, &a.template.extra()?)?)
}

pub fn run(config: &Config, a: RunArgs) -> Result<std::process::ExitCode> {
    if a.stop.iter().any(String::is_empty) {
        bail!("--stop \"\" would stop before the first token: give a non-empty string");
    }
    let load = Instant::now();
    let model = Model::open(&a.model.source())?;
    let prompt = prompt_ids(&a, &model)?;
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    let trained = model.config.max_position_embeddings;
    a.length.check(
        trained,
        prompt.len(),
        &format!("a prompt of {} tokens", prompt.len()),
        "shorten it",
    )?;
    if let Some(c) = a.ctx {
        a.length
            .check(trained, c, &format!("a context of {c} (-c)"), "give a smaller -c")?;
    }
    // Without -c the context is the prompt and the new tokens, up to the trained length.
    let limit = if a.length.allow_long_context {
        usize::MAX
    } else {
        trained
    };
    let ctx = a
        .ctx
        .unwrap_or_else(|| prompt.len().saturating_add(a.n_predict).min(limit));
    let n_predict = match a.ctx {
        Some(_) => a.n_predict,
        None => a.n_predict.min(ctx - prompt.len()),
    };
    if prompt.len().saturating_add(n_predict) > ctx {
        bail!(
            "{} prompt tokens and {n_predict} new ones do not fit a context of {ctx} (-c / --ctx)",
            prompt.len(),
        );
    }
    if n_predict < a.n_predict {
        errln!(
            "-n {} stops at {n_predict}: the prompt's {} tokens and the new ones fill the {trained} \
             positions the model was trained for (--allow-long-context goes past them)",
            a.n_predict,
            prompt.len()
        );
    }
    let label = model.label.clone();
    let mut opts = EngineOptions::with_ctx(ctx);
    a.backend.apply(&mut opts);
    opts.quant = a.quant.format()?;
    opts.allow_long_context = a.length.allow_long_context;
    // A prompt runs in one go unless it is long (or `--prefill-chunk` says otherwise).
    let chunk = match a.prefill_chunk {
        Some(c) => Some(c),
        None if prompt.len() > LONG_PROMPT => Some(PROGRESS_CHUNK),
        None => None,
    };
    opts.prefill_chunk = Some(chunk.unwrap_or(prompt.len()));
    if chunk.is_some_and(|c| c < prompt.len()) {
        opts.prefill_progress = Some(Box::new(crate::progress::prefill()));
    }
    opts.sampling = Some(a.sampling.params(&model.text.generation));
    opts.ignore_eos = a.ignore_eos;
    opts.progress = Some(Box::new(crate::progress::loading(&label)));
    a.memory.apply(&mut opts);
    let engine = Engine::new(model, config, opts).with_context(|| format!("opening {label}"))?;
    crate::progress::placement(&engine);
    // The weights go to the backend with the first program.
    let mut batcher = Batcher::new(engine);
    batcher.prepare(prompt.len())?;
    let load_s = load.elapsed().as_secs_f64();
    let mut stdout = |s: &str| -> std::io::Result<()> {
        if a.json {
            Ok(())
        } else {
            crate::out::stdout_text(s)
        }
    };
    let t = batcher.generate(&prompt, n_predict, &a.stop, &mut stdout, &AtomicBool::new(false))?;
    let total_s = load.elapsed().as_secs_f64();
    let engine = batcher.engine();
    let backend = engine.backend();
    // Decode speed over the tokens after the first (the first comes with the prefill).
    let decode_tps = t.decode_tps();
    if a.json {
        let v = serde_json::json!({
            "tokens": t.tokens,
            "text": t.text,
            "stop_reason": t.stop_reason.as_str(),
            "prompt_tokens": prompt.len(),
            "load_s": load_s,
            "backend": backend.name(),
            "prefill_s": t.prefill_s,
            "decode_tokens_per_s": decode_tps,
        });
        outln!("{v}")?;
    } else {
        match &t.text {
            // The text was streamed; end its line.
            Some(_) => outln!()?,
            // No tokenizer: the ids.
            None => {
                let ids: Vec<String> = t.tokens.iter().map(|t| t.to_string()).collect();
                outln!("{}", ids.join(" "))?;
            }
        }
        let prompt_tps = prompt.len() as f64 / t.prefill_s.max(1e-9);
        errln!("load: {load_s:.2} s");
        errln!(
            "prompt: {} tokens in {:.3} s ({prompt_tps:.1} tokens/s)",
            prompt.len(),
            t.prefill_s
        );
        errln!(
            "generated: {} tokens ({}), {decode_tps:.1} tokens/s; {total_s:.2} s in all",
            t.tokens.len(),
            t.stop_reason.as_str()
        );
    }
    crate::progress::host_tier_warning(engine);
    Ok(std::process::ExitCode::SUCCESS)
}
