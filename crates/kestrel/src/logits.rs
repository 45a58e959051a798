//! `kestrel logits`: the logits of a token sequence under a model directory, written as one f32
//! tensor `logits` `[tokens, vocab]` in a safetensors file. `prefill` runs the sequence as one
//! chunk; `decode` runs the first token as the prompt and every following one through the
//! single-token path, as generation would.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kestrel_core::quant::QuantFormat;
use kestrel_core::{Backend, Config, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, Device, RunMode};
use kestrel_model::Session;
use safetensors::tensor::{serialize_to_file, Dtype, TensorView};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    Cpu,
    Cuda,
}

/// Quantisation on load of a dense checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Quant {
    None,
    Q4,
    Q8,
}

/// Options shared by the commands that load a model.
#[derive(Args, Clone, Copy)]
pub struct QuantArgs {
    /// Quantise dense weights on load (4 or 8 bits; routers at 8); quantised checkpoints keep
    /// their own format.
    #[arg(long, value_enum, default_value = "none")]
    quant: Quant,
    /// Values per quantisation group.
    #[arg(long, default_value_t = 64)]
    group_size: usize,
}

impl QuantArgs {
    pub fn format(&self) -> Result<Option<QuantFormat>> {
        let bits = match self.quant {
            Quant::None => return Ok(None),
            Quant::Q4 => 4,
            Quant::Q8 => 8,
        };
        if self.group_size == 0 || self.group_size % 32 != 0 {
            bail!("--group-size {} is not a multiple of 32", self.group_size);
        }
        Ok(Some(QuantFormat {
            bits,
            group_size: self.group_size,
        }))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Prefill,
    Decode,
}

#[derive(Args)]
pub struct LogitsArgs {
    /// Model directory (config.json and safetensors weights).
    #[arg(long)]
    model: PathBuf,
    /// Token ids, comma separated.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    /// Backend; default CUDA when a device is present, else the CPU.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    #[arg(long, value_enum, default_value = "prefill")]
    mode: Mode,
    /// Positions the KV caches hold; default the number of tokens.
    #[arg(long)]
    ctx: Option<usize>,
    /// In prefill mode, chunks of at most this many tokens (default: one chunk).
    #[arg(long)]
    prefill_chunk: Option<usize>,
    #[command(flatten)]
    quant: QuantArgs,
    /// Output file.
    #[arg(long)]
    out: PathBuf,
}

/// CUDA when a device is present, else the CPU.
pub fn default_backend() -> BackendChoice {
    match kestrel_cuda::device_count() {
        Ok(n) if n > 0 => BackendChoice::Cuda,
        _ => BackendChoice::Cpu,
    }
}

fn logits_with<B: Backend>(a: &LogitsArgs, backend: B, cache: DType) -> Result<(Vec<f32>, usize)> {
    let ctx = a.ctx.unwrap_or(a.tokens.len());
    if a.tokens.len() > ctx {
        bail!("{} tokens do not fit a context of {ctx} (--ctx)", a.tokens.len());
    }
    let mut s = Session::open(&a.model, backend, ctx, cache)
        .with_context(|| format!("opening {}", a.model.display()))?
        .with_quant(a.quant.format()?);
    let vocab = s.config.vocab;
    let rows = match a.mode {
        Mode::Prefill => s.prefill(&a.tokens, 0, a.prefill_chunk.unwrap_or(a.tokens.len()), true)?,
        Mode::Decode => {
            let mut rows = Vec::with_capacity(a.tokens.len() * vocab);
            for (t, &id) in a.tokens.iter().enumerate() {
                rows.extend(s.forward(&[id], t, false)?);
            }
            rows
        }
    };
    Ok((rows, vocab))
}

fn write(out: &Path, rows: &[f32], tokens: usize, vocab: usize) -> Result<()> {
    let bytes: &[u8] = bytemuck::cast_slice(rows);
    let view = TensorView::new(Dtype::F32, vec![tokens, vocab], bytes)?;
    serialize_to_file([("logits", view)], None, out).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

pub fn run(config: &Config, a: LogitsArgs) -> Result<std::process::ExitCode> {
    let (rows, vocab) = match a.backend.unwrap_or_else(default_backend) {
        BackendChoice::Cpu => logits_with(&a, CpuBackend::new(), DType::F32)?,
        BackendChoice::Cuda => {
            let dev = Device::open(config.device, config)?;
            logits_with(&a, CudaBackend::new(dev, RunMode::Graph), DType::BF16)?
        }
    };
    write(&a.out, &rows, a.tokens.len(), vocab)?;
    eprintln!(
        "wrote logits [{}, {vocab}] to {}",
        a.tokens.len(),
        a.out.display()
    );
    Ok(std::process::ExitCode::SUCCESS)
}
