//! `kestrel quantize`: a dense model directory rewritten as an MLX-format 4- or 8-bit one
//! (`kestrel_model::quantize::quantize_dir_sharded`, a layer at a time into shards), so
//! quantisation is done once.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use crate::args::quant_format;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Bits {
    Q4,
    Q8,
}

#[derive(Args)]
pub struct QuantizeArgs {
    /// Dense model directory to read.
    #[arg(long)]
    model: PathBuf,
    /// Directory to write: a new or empty one (no file is ever overwritten).
    #[arg(long)]
    out: PathBuf,
    /// 4 or 8 bits (routers and gates at 8).
    #[arg(long, value_enum)]
    quant: Bits,
    /// Values per quantisation group.
    #[arg(long, default_value_t = 64)]
    group_size: usize,
    /// Largest output file, in MiB; past it the weights are written in shards with an index.
    #[arg(long, default_value_t = 4096)]
    shard_size: usize,
}

pub fn run(a: QuantizeArgs) -> Result<std::process::ExitCode> {
    let bits = match a.quant {
        Bits::Q4 => 4,
        Bits::Q8 => 8,
    };
    let format = quant_format(bits, a.group_size)?;
    if a.shard_size == 0 {
        bail!("--shard-size must be at least 1 MiB");
    }
    let r = kestrel_model::quantize::quantize_dir_sharded(&a.model, &a.out, format, a.shard_size << 20)
        .with_context(|| format!("quantising {} into {}", a.model.display(), a.out.display()))?;
    outln!(
        "wrote {} ({}-bit, groups of {}): {} matrices quantised, {} tensors copied, {:.1} MiB",
        a.out.display(),
        format.bits,
        format.group_size,
        r.quantized,
        r.copied,
        r.bytes as f64 / (1u64 << 20) as f64
    )?;
    Ok(std::process::ExitCode::SUCCESS)
}
