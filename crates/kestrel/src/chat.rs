//! `kestrel chat`: a conversation with a model that has a chat template. Each turn renders the
//! whole conversation and prefills only what follows the part the KV cache already holds; the
//! answer streams to stdout, a line of figures goes to stderr. Line editing and history come from
//! rustyline on a terminal (otherwise plain lines, each at most 64 MiB); `/help`, `/system TEXT`, `/clear`,
//! `/exit`. Ctrl-C stops the current answer, not the program (at the prompt it clears the line;
//! Ctrl-D or `/exit` leaves).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use kestrel_core::Config;
use kestrel_engine::{Batcher, Engine, EngineOptions, Model};
use rustyline::error::ReadlineError;
use serde_json::{json, Value};

use crate::args::{BackendArgs, LengthArgs, MemoryArgs, ModelArgs, QuantArgs, SamplingArgs, TemplateArgs};

/// The context when `-c` is not given (or the model's trained length, if shorter).
const DEFAULT_CTX: usize = 4096;

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens an answer may have at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    n_predict: usize,
    /// Positions the KV caches hold: the conversation's limit (default 4096, or the model's
    /// trained length if that is shorter).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    #[command(flatten)]
    length: LengthArgs,
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
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    quant: QuantArgs,
    #[command(flatten)]
    memory: MemoryArgs,
}

const HELP: &str = "/help            this list
/system TEXT     set the system message and start over
/clear           forget the conversation
/exit            leave (or Ctrl-D); Ctrl-C stops an answer";

/// The most bytes one line of input may have: far more than any model's context holds, so
/// input without line breaks (`chat < /dev/zero`) is refused instead of filling memory.
const MAX_LINE_BYTES: u64 = 64 << 20;

/// Where lines come from: the line editor on a terminal, plain bounded lines otherwise.
enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Plain(std::io::StdinLock<'static>),
}

impl Input {
    fn open() -> Result<Input> {
        use std::io::IsTerminal as _;
        Ok(if std::io::stdin().is_terminal() {
            Input::Editor(Box::new(
                rustyline::DefaultEditor::new().context("opening the line editor")?,
            ))
        } else {
            Input::Plain(std::io::stdin().lock())
        })
    }

    /// The next line (Ctrl-C at the prompt gives an empty one), or None at the end of input.
    fn line(&mut self) -> Result<Option<String>> {
        match self {
            Input::Editor(editor) => match editor.readline("> ") {
                Ok(line) => Ok(Some(line)),
                Err(ReadlineError::Interrupted) => Ok(Some(String::new())),
                Err(ReadlineError::Eof) => Ok(None),
                Err(e) => Err(e).context("reading a line"),
            },
            Input::Plain(stdin) => {
                use std::io::{BufRead as _, Read as _};
                let mut bytes = Vec::new();
                stdin
                    .take(MAX_LINE_BYTES + 1)
                    .read_until(b'\n', &mut bytes)
                    .context("reading a line")?;
                if bytes.is_empty() {
                    return Ok(None);
                }
                if bytes.len() as u64 > MAX_LINE_BYTES {
                    anyhow::bail!(
                        "a line of input is longer than {} MiB, more than any model's context",
                        MAX_LINE_BYTES >> 20
                    );
                }
                String::from_utf8(bytes)
                    .map(Some)
                    .context("a line of input is not UTF-8 text")
            }
        }
    }

    /// Adds `line` to the editor's history.
    fn remember(&mut self, line: &str) {
        if let Input::Editor(editor) = self {
            let _ = editor.add_history_entry(line);
        }
    }
}

fn start(system: &Option<String>) -> Vec<Value> {
    system
        .iter()
        .map(|s| json!({"role": "system", "content": s}))
        .collect()
}

pub fn run(config: &Config, a: ChatArgs) -> Result<std::process::ExitCode> {
    let model = Model::open(&a.model.source())?;
    let label = model.label.clone();
    if model.text.tokenizer.is_none() {
        anyhow::bail!("{label} has no tokenizer.json: chat needs text");
    }
    if model.text.template.is_none() {
        anyhow::bail!("{label} has no chat template (tokenizer_config.json or chat_template.jinja)");
    }
    if a.stop.iter().any(String::is_empty) {
        anyhow::bail!("--stop \"\" would stop before the first token: give a non-empty string");
    }
    let trained = model.config.max_position_embeddings;
    let ctx = a.ctx.unwrap_or(DEFAULT_CTX.min(trained));
    a.length.check(
        trained,
        ctx,
        &format!("a context of {ctx} (-c)"),
        "give a smaller -c",
    )?;
    let mut opts = EngineOptions::with_ctx(ctx);
    opts.allow_long_context = a.length.allow_long_context;
    a.backend.apply(&mut opts);
    opts.quant = a.quant.format()?;
    opts.sampling = Some(a.sampling.params(&model.text.generation));
    opts.progress = Some(Box::new(crate::progress::loading(&label)));
    let load = Instant::now();
    a.memory.apply(&mut opts);
    let engine = Engine::new(model, config, opts).with_context(|| format!("opening {label}"))?;
    crate::progress::placement(&engine);
    let mut batcher = Batcher::new(engine);
    batcher.prepare(1)?;
    errln!(
        "loaded {label} in {:.2} s; /help for commands",
        load.elapsed().as_secs_f64()
    );
    // Ctrl-C while an answer streams stops it; the flag is read after each token.
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let cancel = cancel.clone();
        ctrlc::set_handler(move || cancel.store(true, Ordering::Relaxed))
            .context("installing the Ctrl-C handler")?;
    }
    let extra = a.template.extra()?;
    let mut input = Input::open()?;
    let mut system = a.system.clone();
    let mut messages = start(&system);
    // The host tier's shortfall is said once, after the turn that met it.
    let mut warned = false;
    let mut stdout = crate::out::stdout_text;
    loop {
        let Some(line) = input.line()? else { break };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        input.remember(line);
        if let Some(command) = line.strip_prefix('/') {
            let (name, rest) = command.split_once(' ').unwrap_or((command, ""));
            match name {
                "exit" | "quit" => break,
                "help" => errln!("{HELP}"),
                "clear" => {
                    messages = start(&system);
                    batcher.forget();
                    errln!("(conversation cleared)");
                }
                "system" => {
                    system = (!rest.trim().is_empty()).then(|| rest.trim().to_string());
                    messages = start(&system);
                    batcher.forget();
                    errln!("(system message set; conversation cleared)");
                }
                other => errln!("unknown command /{other}; /help lists them"),
            }
            continue;
        }
        messages.push(json!({"role": "user", "content": line}));
        let ids = batcher.engine().text().encode_chat(&messages, &extra)?;
        cancel.store(false, Ordering::Relaxed);
        // An answer needs room for at least one token after the conversation so far.
        if ids.len() >= ctx {
            messages.pop();
            errln!(
                "the conversation with this message is {} tokens, and the context holds {ctx}: \
                 /clear to start over (keeping the system message), or restart with a larger -c",
                ids.len()
            );
            continue;
        }
        let n = a.n_predict.min(ctx - ids.len());
        let turn = match batcher.generate(&ids, n, &a.stop, &mut stdout, &cancel) {
            Ok(t) => t,
            // Stdout is gone: nobody reads the answers any more.
            Err(e @ kestrel_engine::EngineError::Output(_)) => return Err(e.into()),
            Err(e) => {
                // The turn failed: say so and go on with the conversation as it was.
                messages.pop();
                errln!("error: {e:#}");
                continue;
            }
        };
        outln!()?;
        errln!(
            "({} tokens reused, {} prefilled, {} generated at {:.1} tokens/s; {})",
            turn.reused,
            turn.prefilled,
            turn.tokens.len(),
            turn.decode_tps(),
            turn.stop_reason.as_str()
        );
        messages.push(json!({"role": "assistant", "content": turn.text.unwrap_or_default()}));
        if !warned && batcher.engine().host_tier_note().is_some() {
            crate::progress::host_tier_warning(batcher.engine());
            warned = true;
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
