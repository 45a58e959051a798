//! `kestrel chat`: a conversation with a model that has a chat template. Each turn renders the
//! whole conversation and prefills only what follows the part the KV cache already holds; the
//! answer streams to stdout, a line of figures goes to stderr. Line editing and history come from
//! rustyline (plain lines when stdin is not a terminal); `/help`, `/system TEXT`, `/clear`,
//! `/exit`. Ctrl-C stops the current answer, not the program (at the prompt it clears the line;
//! Ctrl-D or `/exit` leaves).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use kestrel_core::{Backend, Config, DType};
use kestrel_cpu::CpuBackend;
use kestrel_cuda::{CudaBackend, Device, RunMode};
use kestrel_model::Session;
use kestrel_text::{ChatInput, GenerationConfig, Sampler, Tokenizer};
use rustyline::error::ReadlineError;
use serde_json::{json, Value};

use crate::generate::Generator;
use crate::logits::{default_backend, BackendChoice, QuantArgs};
use crate::run::{eos_ids, SamplingArgs, TemplateArgs};

#[derive(Args)]
pub struct ChatArgs {
    /// Model directory (config.json, safetensors weights, tokenizer with a chat template);
    /// default the built-in model.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Tokens an answer may have at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    n_predict: usize,
    /// Positions the KV caches hold: the conversation's limit.
    #[arg(short = 'c', long, default_value_t = 4096)]
    ctx: usize,
    /// The system message to start with.
    #[arg(long)]
    system: Option<String>,
    /// Stop an answer when it contains this string (repeatable; not printed).
    #[arg(long)]
    stop: Vec<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    template: TemplateArgs,
    /// Backend; default CUDA when a device is present, else the CPU.
    #[arg(long, value_enum)]
    backend: Option<BackendChoice>,
    #[command(flatten)]
    quant: QuantArgs,
}

const HELP: &str = "/help            this list
/system TEXT     set the system message and start over
/clear           forget the conversation
/exit            leave (or Ctrl-D); Ctrl-C stops an answer";

fn start(system: &Option<String>) -> Vec<Value> {
    system
        .iter()
        .map(|s| json!({"role": "system", "content": s}))
        .collect()
}

fn converse<B: Backend>(a: &ChatArgs, dir: &std::path::Path, backend: B, cache: DType) -> Result<()> {
    let tokenizer = Tokenizer::from_dir(dir)?
        .with_context(|| format!("{} has no tokenizer.json: chat needs text", dir.display()))?;
    let Some(template) = tokenizer.template()? else {
        bail!(
            "{} has no chat template (tokenizer_config.json or chat_template.jinja)",
            dir.display()
        );
    };
    let generation = GenerationConfig::from_dir(dir)?;
    let sampler = Sampler::new(a.sampling.params(&generation))?;
    let load = Instant::now();
    let mut s = Session::open(dir, backend, a.ctx, cache)
        .with_context(|| format!("opening {}", dir.display()))?
        .with_quant(a.quant.format()?)
        .with_progress(crate::progress::loading(&dir.display().to_string()))
        .with_sampling(sampler.params);
    s.prepare(1, false)?;
    eprintln!(
        "loaded {} in {:.2} s; /help for commands",
        dir.display(),
        load.elapsed().as_secs_f64()
    );
    let mut g = Generator::new(
        s,
        Some(&tokenizer),
        sampler,
        eos_ids(&generation, Some(&tokenizer)),
        None,
    );
    // Ctrl-C while an answer streams stops it; the flag is read after each token.
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let cancel = cancel.clone();
        ctrlc::set_handler(move || cancel.store(true, Ordering::Relaxed))
            .context("installing the Ctrl-C handler")?;
    }
    let extra = a.template.extra()?;
    let mut editor = rustyline::DefaultEditor::new().context("opening the line editor")?;
    let mut system = a.system.clone();
    let mut messages = start(&system);
    loop {
        let line = match editor.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("reading a line"),
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(line);
        if let Some(command) = line.strip_prefix('/') {
            let (name, rest) = command.split_once(' ').unwrap_or((command, ""));
            match name {
                "exit" | "quit" => break,
                "help" => eprintln!("{HELP}"),
                "clear" => {
                    messages = start(&system);
                    g.clear()?;
                    eprintln!("(conversation cleared)");
                }
                "system" => {
                    system = (!rest.trim().is_empty()).then(|| rest.trim().to_string());
                    messages = start(&system);
                    g.clear()?;
                    eprintln!("(system message set; conversation cleared)");
                }
                other => eprintln!("unknown command /{other}; /help lists them"),
            }
            continue;
        }
        messages.push(json!({"role": "user", "content": line}));
        let rendered = template.render(&ChatInput {
            messages: &messages,
            add_generation_prompt: true,
            bos_token: tokenizer.bos_token.as_deref(),
            eos_token: tokenizer.eos_token.as_deref(),
            extra: extra.clone(),
            ..Default::default()
        })?;
        let ids = tokenizer.encode(&rendered, false)?;
        cancel.store(false, Ordering::Relaxed);
        let turn = match g.turn(
            &ids,
            a.n_predict.min(a.ctx.saturating_sub(ids.len())),
            &a.stop,
            true,
            &cancel,
        ) {
            Ok(t) => t,
            Err(e) => {
                // The conversation outgrew the context (or the turn failed): say so and go on.
                messages.pop();
                eprintln!("error: {e:#}");
                continue;
            }
        };
        println!();
        eprintln!(
            "({} tokens reused, {} prefilled, {} generated at {:.1} tokens/s; {})",
            turn.reused,
            turn.prefilled,
            turn.tokens.len(),
            turn.decode_tps(),
            turn.stop_reason
        );
        messages.push(json!({"role": "assistant", "content": turn.text.unwrap_or_default()}));
    }
    Ok(())
}

pub fn run(config: &Config, a: ChatArgs) -> Result<std::process::ExitCode> {
    let dir = crate::run::model_dir(&a.model)?;
    match a.backend.unwrap_or_else(default_backend) {
        BackendChoice::Cpu => converse(&a, &dir, CpuBackend::new(), DType::F32)?,
        BackendChoice::Cuda => {
            let dev = Device::open(config.device, config)?;
            converse(&a, &dir, CudaBackend::new(dev, RunMode::Graph), DType::BF16)?
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
