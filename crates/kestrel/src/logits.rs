//! `kestrel logits`: the logits of a token sequence under a model directory, written as one f32
//! tensor `logits` `[tokens, vocab]` in a safetensors file. `prefill` runs the sequence as one
//! chunk; `decode` runs the first token as the prompt and every following one through the
//! single-token path, as generation would.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kestrel_core::Config;
use kestrel_engine::{Engine, EngineOptions, Model, Output, Want};
use safetensors::tensor::{serialize, Dtype, TensorView};

use crate::args::{at_least_one, BackendArgs, LengthArgs, MemoryArgs, ModelArgs, QuantArgs};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Prefill,
    Decode,
}

#[derive(Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Token ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    #[command(flatten)]
    backend: BackendArgs,
    #[arg(long, value_enum, default_value = "prefill")]
    mode: Mode,
    /// Positions the KV caches hold; default the number of tokens.
    #[arg(long)]
    ctx: Option<usize>,
    #[command(flatten)]
    length: LengthArgs,
    /// In prefill mode, chunks of at most this many tokens (default: one chunk).
    #[arg(long, value_parser = at_least_one)]
    prefill_chunk: Option<usize>,
    #[command(flatten)]
    quant: QuantArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    /// Output file (must not exist yet).
    #[arg(long)]
    out: PathBuf,
}

/// Writes the logits into `out`, a new file: one that exists is the user's and is left alone.
fn write(out: &Path, rows: &[f32], tokens: usize, vocab: usize) -> Result<()> {
    let bytes: &[u8] = bytemuck::cast_slice(rows);
    let view = TensorView::new(Dtype::F32, vec![tokens, vocab], bytes)?;
    let data = serialize([("logits", view)], None)?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)
        .with_context(|| format!("creating {} (--out must name a new file)", out.display()))?;
    if let Err(e) = file.write_all(&data) {
        drop(file);
        let _ = std::fs::remove_file(out);
        return Err(e).with_context(|| format!("writing {}", out.display()));
    }
    Ok(())
}

pub fn run(config: &Config, a: LogitsArgs) -> Result<std::process::ExitCode> {
    let ctx = a.ctx.unwrap_or(a.tokens.len());
    if a.tokens.len() > ctx {
        bail!("{} tokens do not fit a context of {ctx} (--ctx)", a.tokens.len());
    }
    if a.out.exists() {
        bail!("{} exists: --out must name a new file", a.out.display());
    }
    let model = Model::open(&a.model.source())?;
    a.length.check(
        model.config.max_position_embeddings,
        ctx,
        &format!("{} tokens in a context of {ctx}", a.tokens.len()),
        "give fewer tokens or a smaller --ctx",
    )?;
    let label = model.label.clone();
    let vocab = model.config.vocab;
    let mut opts = EngineOptions::with_ctx(ctx);
    a.backend.apply(&mut opts);
    opts.quant = a.quant.format()?;
    opts.allow_long_context = a.length.allow_long_context;
    if a.mode == Mode::Prefill {
        opts.prefill_chunk = a.prefill_chunk;
    }
    a.memory.apply(&mut opts);
    let mut engine = Engine::new(model, config, opts).with_context(|| format!("opening {label}"))?;
    crate::progress::placement(&engine);
    let logits = |o: Output| o.into_logits().context("the step returned no logits");
    let rows = match a.mode {
        Mode::Prefill => logits(engine.step(&a.tokens, 0, Want::AllLogits)?)?,
        Mode::Decode => {
            let mut rows = Vec::with_capacity(a.tokens.len() * vocab);
            for (t, &id) in a.tokens.iter().enumerate() {
                rows.extend(logits(engine.step(&[id], t, Want::LastLogits)?)?);
            }
            rows
        }
    };
    write(&a.out, &rows, a.tokens.len(), vocab)?;
    errln!(
        "wrote logits [{}, {vocab}] to {}",
        a.tokens.len(),
        a.out.display()
    );
    crate::progress::host_tier_warning(&engine);
    Ok(std::process::ExitCode::SUCCESS)
}
