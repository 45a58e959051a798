//! The `kestrel` command line: `doctor` checks the CUDA set-up, `bench` measures (a model's
//! tokens/s, the runtime, the hot ops), `logits` runs a model directory over a token sequence,
//! `run` generates from a prompt, `chat` holds a conversation, `inspect` describes a model
//! directory, `quantize` rewrites one at 4 or 8 bits, `synth` writes a random one at real shapes.
//!
//! A library behind the binary (`main.rs` calls [`main`]) so the fuzz targets can parse flags
//! exactly as the binary does ([`parse`]).

#[macro_use]
mod out;

mod args;
mod bench;
mod bench_model;
mod bench_ops;
mod bench_serve;
mod chat;
mod doctor;
mod inspect;
mod logits;
mod progress;
mod quantize;
mod run;
mod serve;
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
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The command line `args` (the program's name first) parsed as the binary parses them.
pub fn parse<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    Cli::try_parse_from(args)
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
    /// Serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions,
    /// /v1/models, /health, /metrics).
    Serve(serve::ServeArgs),
    /// What a model directory holds: architecture, parameters, formats, memory at a context.
    Inspect(inspect::InspectArgs),
    /// Rewrite a dense model directory as an MLX-format quantised one.
    Quantize(quantize::QuantizeArgs),
    /// Write a named real configuration with random weights as an MLX-format model directory.
    Synth(synth::SynthArgs),
}

/// The binary: parses the process's arguments (clap prints help or an error and exits), runs
/// the command, and turns its outcome into the exit status.
pub fn main() -> std::process::ExitCode {
    run(Cli::parse())
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> std::process::ExitCode {
    // A variable with a bad value stops only what reads it (the CUDA backend): see
    // `Config::check`.
    let config = Config::from_env();
    let outcome = match cli.command {
        Command::Doctor {
            kernel_options: true, ..
        } => doctor::kernel_options(),
        Command::Doctor { device, .. } => doctor::run(&config, device),
        Command::Bench(args) => bench::run(&config, args),
        Command::Logits(args) => logits::run(&config, args),
        Command::Run(args) => run::run(&config, args),
        Command::Chat(args) => chat::run(&config, args),
        Command::Serve(args) => serve::run(&config, args),
        Command::Inspect(args) => inspect::run(&config, args),
        Command::Quantize(args) => quantize::run(args),
        Command::Synth(args) => synth::run(args),
    };
    match outcome {
        Ok(_) if out::stderr_failed() => std::process::ExitCode::FAILURE,
        Ok(code) => code,
        // The reader of stdout went away (`| head`): nothing more to say, as Unix tools do.
        Err(e) if out::is_closed_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            errln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
