//! `kestrel quantize`: a dense model directory rewritten as an MLX-format 4- or 8-bit one
//! (`kestrel_model::quantize::quantize_dir_sharded`, a layer at a time into shards), so
//! quantisation is done once.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::args::QuantArgs;

#[derive(Args)]
pub struct QuantizeArgs {
    /// Dense model directory to read.
    #[arg(long)]
    model: PathBuf,
    /// Directory to write (created; must not hold a model).
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    quant: QuantArgs,
    /// Largest output file, in MiB; past it the weights are written in shards with an index.
    #[arg(long, default_value_t = 4096)]
    shard_size: usize,
}

pub fn run(a: QuantizeArgs) -> Result<std::process::ExitCode> {
    let Some(format) = a.quant.format()? else {
        bail!("--quant q4 or q8 is needed");
    };
    if a.shard_size == 0 {
        bail!("--shard-size must be at least 1 MiB");
    }
    let r = kestrel_model::quantize::quantize_dir_sharded(&a.model, &a.out, format, a.shard_size << 20)
        .with_context(|| format!("quantising {} into {}", a.model.display(), a.out.display()))?;
    println!(
        "wrote {} ({}-bit, groups of {}): {} matrices quantised, {} tensors copied, {:.1} MiB",
        a.out.display(),
        format.bits,
        format.group_size,
        r.quantized,
        r.copied,
        r.bytes as f64 / (1u64 << 20) as f64
    );
    Ok(std::process::ExitCode::SUCCESS)
}
