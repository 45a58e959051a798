//! The `kestrel` command line: `doctor` checks the CUDA set-up, `bench` measures (a model's
//! tokens/s, the runtime, the hot ops), `logits` runs a model directory over a token sequence,
//! `run` generates from a prompt, `chat` holds a conversation, `inspect` describes a model
//! directory, `quantize` rewrites one at 4 or 8 bits, `synth` writes a random one at real shapes.

mod args;
mod bench;
mod bench_model;
mod bench_ops;
mod chat;
mod doctor;
mod inspect;
mod logits;
mod progress;
mod quantize;
mod run;
mod stats;
mod synth;

use clap::{Parser, Subcommand};
use kestrel_core::Config;

#[derive(Parser)]
#[command(
    name = "kestrel",
    version,
    about = "Mixture-of-Experts inference on NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List CUDA devices and, on each, compile, run and check a small kernel and a cuBLAS product.
    Doctor {
        /// Check only this device ordinal.
        #[arg(long)]
        device: Option<usize>,
        /// Print every kernel module's NVRTC definitions and headers as JSON and exit (no GPU
        /// needed).
        #[arg(long)]
        kernel_options: bool,
    },
    /// Benchmarks: a model's prompt processing and generation in tokens/s (`--model DIR` or
    /// `--synthetic NAME`), or the runtime and the hot ops (`runtime`, `ops`); medians of
    /// repeated runs after warm-up.
    Bench(bench::BenchArgs),
    /// Logits of a token sequence under a model directory, written to a safetensors file.
    Logits(logits::LogitsArgs),
    /// Generate text (or ids) from a prompt under a model directory.
    Run(run::RunArgs),
    /// Talk with a model that has a chat template.
    Chat(chat::ChatArgs),
    /// What a model directory holds: architecture, parameters, formats, memory at a context.
    Inspect(inspect::InspectArgs),
    /// Rewrite a dense model directory as an MLX-format quantised one.
    Quantize(quantize::QuantizeArgs),
    /// Write a named real configuration with random weights as an MLX-format model directory.
    Synth(synth::SynthArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let config = match Config::from_env() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let outcome = match cli.command {
        Command::Doctor {
            kernel_options: true, ..
        } => doctor::kernel_options(),
        Command::Doctor { device, .. } => doctor::run(&config, device),
        Command::Bench(args) => bench::run(&config, args),
        Command::Logits(args) => logits::run(&config, args),
        Command::Run(args) => run::run(&config, args),
        Command::Chat(args) => chat::run(&config, args),
        Command::Inspect(args) => inspect::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Synth(args) => synth::run(args),
    };
    match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
