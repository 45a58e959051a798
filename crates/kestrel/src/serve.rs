//! `kestrel serve`: the model behind an OpenAI-compatible HTTP API (`kestrel-server`). It
//! listens at once (`/health` answers 503 until the model has loaded), prints the address on
//! stderr, and serves until Ctrl-C.

use anyhow::{Context, Result};
use clap::Args;
use kestrel_core::Config;
use kestrel_engine::{Engine, EngineOptions, Model, Want};
use kestrel_server::ServeOptions;

use crate::args::{at_least_one, BackendArgs, LengthArgs, MemoryArgs, ModelArgs, QuantArgs, SyntheticArgs};

/// The context when `-c` is not given (at most the model's trained length).
const DEFAULT_CTX: usize = 8192;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    synthetic: SyntheticArgs,
    /// The address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// The port to listen on (0: any free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests to /v1/* must send `Authorization: Bearer KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// The model's name in /v1/models and in requests (default: the directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Positions the KV cache holds: prompt and answer of a request together (default 8192, or
    /// the model's trained length if shorter).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    /// Sequences generated at once (each choice of a request is one): their next tokens run
    /// as one batched step. Each holds a context's KV cache (-c), so this times -c is the KV
    /// memory reserved, unless --kv-blocks says less (models with recurrent states, Qwen3-Next
    /// and Qwen3.5, also keep those states for each).
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    max_num_seqs: usize,
    /// KV cache blocks of 16 positions shared by the sequences (default: every sequence's whole
    /// context, or on a GPU as much of it as fits beside the model; at least one sequence's).
    /// Fewer let more sequences run while their lengths allow; when they run out, the newest
    /// sequence is paused and recomputed later.
    #[arg(long)]
    kv_blocks: Option<usize>,
    /// For models with recurrent states (Qwen3-Next, Qwen3.5): copies of a prompt's states kept
    /// at block boundaries (its chunks' ends and its last full block), so that a later request
    /// starting with the same tokens skips them, as prefix caching does for the KV cache. Each
    /// holds one sequence's states (about 75 MB for Qwen3-Next-80B-A3B); 0 turns it off.
    #[arg(long, default_value_t = 16)]
    state_snapshots: usize,
    /// Requests that may wait for the engine; more are answered 429.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    max_queue: usize,
    /// Bytes a request body may have; larger ones are answered 413. The default holds far more
    /// text than a context of 262,144 tokens, and keeps a chat template's render well inside
    /// its memory bound.
    #[arg(long, default_value_t = 2 << 20, value_parser = at_least_one)]
    max_body: usize,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    length: LengthArgs,
    #[command(flatten)]
    quant: QuantArgs,
    #[command(flatten)]
    memory: MemoryArgs,
}

pub fn run(config: &Config, a: ServeArgs) -> Result<std::process::ExitCode> {
    let quant = a.quant.format()?;
    anyhow::ensure!(
        a.model.model.is_none() || a.synthetic.synthetic.is_none(),
        "give -m DIR or --synthetic NAME, not both"
    );
    let source = match a.synthetic.source(quant, 0)? {
        Some(s) => s,
        None => a.model.source(),
    };
    let name =
        a.served_model_name
            .clone()
            .unwrap_or_else(|| match (&a.model.model, &a.synthetic.synthetic) {
                (_, Some(name)) => name.clone(),
                (Some(dir), None) => dir
                    .canonicalize()
                    .ok()
                    .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .unwrap_or_else(|| dir.display().to_string()),
                (None, None) => "kestrel-tiny".to_string(),
            });
    let opts = ServeOptions {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        model_name: name.clone(),
        max_body: a.max_body,
        max_queue: a.max_queue,
        max_seqs: a.max_num_seqs,
    };
    let config = config.clone();
    let (backend, length, memory, ctx) = (a.backend, a.length, a.memory, a.ctx);
    let (max_seqs, kv_blocks, snapshots) = (a.max_num_seqs, a.kv_blocks, a.state_snapshots);
    let load = move || -> Result<Engine, String> {
        let load = || -> Result<Engine> {
            let start = std::time::Instant::now();
            let model = Model::open(&source)?;
            let label = model.label.clone();
            let trained = model.config.max_position_embeddings;
            let ctx = ctx.unwrap_or(DEFAULT_CTX.min(trained));
            length.check(
                trained,
                ctx,
                &format!("a context of {ctx} (-c)"),
                "give a smaller -c",
            )?;
            let mut opts = EngineOptions::with_ctx(ctx);
            opts.allow_long_context = length.allow_long_context;
            backend.apply(&mut opts);
            opts.quant = quant;
            memory.apply(&mut opts);
            opts.max_seqs = Some(max_seqs);
            opts.kv_blocks = kv_blocks;
            opts.state_snapshots = snapshots;
            let mut engine = Engine::new(model, &config, opts).with_context(|| format!("opening {label}"))?;
            crate::progress::placement(&engine);
            // The engine loaded every kernel module, so no request waits for NVRTC.
            engine.prepare(1, Want::LastLogits)?;
            let p = engine.kv_pool();
            let at_once = match p.seqs {
                1 => "one sequence at a time".to_string(),
                n => format!(
                    "up to {n} sequences at once, a KV cache of {} positions",
                    p.blocks * kestrel_engine::KV_BLOCK
                ),
            };
            errln!(
                "loaded {label} on {} in {:.2} s, context {ctx}, {at_once}",
                engine.backend(),
                start.elapsed().as_secs_f64()
            );
            Ok(engine)
        };
        load().map_err(|e| format!("{e:#}"))
    };
    kestrel_server::serve(opts, load, |addr| {
        errln!("serving {name} at http://{addr}/v1 (the model is loading; /health says when it is ready)");
    })?;
    Ok(std::process::ExitCode::SUCCESS)
}
