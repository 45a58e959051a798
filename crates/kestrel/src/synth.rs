//! `kestrel synth`: a named real configuration with random weights (what `bench --synthetic`
//! builds in memory) written as an MLX-format model directory, so runs that read a model from
//! disk can use real shapes without a download. The directory has no tokenizer: give prompts
//! as token ids, or measure it with `bench -m DIR`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{ensure, Result};
use clap::Args;
use kestrel_core::quant::QuantFormat;
use kestrel_engine::ByteSize;
use kestrel_model::{check_empty_dst, synthetic_model_json, write_model_dir, SYNTHETIC_MODELS};

#[derive(Args)]
pub struct SynthArgs {
    /// The configuration: qwen3-30b-a3b, qwen3-next-80b-a3b or qwen3.5-397b-a17b.
    name: String,
    /// The directory to write; it must be missing or empty.
    #[arg(long)]
    out: PathBuf,
    /// Decoder layers (default: all of the configuration's).
    #[arg(long)]
    layers: Option<usize>,
    /// Bits of the weights (4 or 8; routers at 8), in groups of 64.
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Shards of about this many MiB.
    #[arg(long, default_value_t = 4096)]
    shard_size: usize,
}

pub fn run(a: SynthArgs) -> Result<std::process::ExitCode> {
    ensure!(
        SYNTHETIC_MODELS.contains(&a.name.as_str()),
        "unknown configuration {:?}: {}",
        a.name,
        SYNTHETIC_MODELS.join(", ")
    );
    ensure!(matches!(a.bits, 4 | 8), "--bits {}: 4 or 8", a.bits);
    ensure!(a.shard_size >= 1, "--shard-size must be at least 1 MiB");
    // Refused before the weights are built, which takes a while for the large configurations.
    check_empty_dst(&a.out)?;
    let start = Instant::now();
    let format = QuantFormat::mlx(a.bits, 64);
    let (json, config, weights) = synthetic_model_json(&a.name, a.layers, format, a.seed)?;
    let bytes = write_model_dir(&a.out, &json, &weights, a.shard_size << 20)?;
    errln!(
        "wrote {} ({} layers, {}-bit, seed {}) to {}: {} of weights in {:.1} s",
        a.name,
        config.layers,
        a.bits,
        a.seed,
        a.out.display(),
        ByteSize(bytes as u64),
        start.elapsed().as_secs_f64()
    );
    Ok(std::process::ExitCode::SUCCESS)
}
