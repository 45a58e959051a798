//! `kestrel quantize`: a dense model directory rewritten as an MLX-format 4- or 8-bit one
//! (`kestrel_model::quantize_dir`), so quantisation is done once.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::logits::QuantArgs;

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
}

pub fn run(a: QuantizeArgs) -> Result<std::process::ExitCode> {
    let Some(format) = a.quant.format()? else {
        bail!("--quant q4 or q8 is needed");
    };
    let r = kestrel_model::quantize_dir(&a.model, &a.out, format)
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
