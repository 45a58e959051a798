//! Kestrel's OpenAI-compatible HTTP server, a front end on `kestrel-engine`.
//!
//! [`serve`] binds first (so `/health` answers 503 while the model loads), then loads the model
//! on the engine's thread, which owns the [`Engine`](kestrel_engine::Engine) and runs requests
//! from a bounded queue (a full queue answers 429). Handlers check each request's fields
//! ([`request`]), render and encode its prompt off the async threads, check it against the
//! context before anything is queued, and stream the tokens back as server-sent events or as one
//! JSON answer. A client that disconnects stops its generation within one token.
//!
//! The engine runs one sequence at a time; running many together (continuous batching) is the
//! engine's next step, and the queue, metrics and handlers here do not change with it.

pub mod chat_output;
pub mod error;
pub mod metrics;
pub mod request;
mod routes;
mod worker;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, OnceLock};

use kestrel_engine::Engine;
use tokio::net::TcpListener;

pub use error::{ApiError, ServerError};
use metrics::Metrics;
use routes::{AppState, Ready};

/// How the server listens and what it accepts.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    /// 0: a free port (the address is told to `on_listen`).
    pub port: u16,
    /// Requests to `/v1/*` must carry `Authorization: Bearer KEY`.
    pub api_key: Option<String>,
    /// The name `/v1/models` lists and requests may give as `model`.
    pub model_name: String,
    /// Bytes a request body may have (413 past it).
    pub max_body: usize,
    /// Requests that may wait for the engine (429 past it), beyond those it runs.
    pub max_queue: usize,
    /// Sequences the engine may run at once (its `max_seqs`; fewer when the model runs one at
    /// a time): the queue holds these and `max_queue` more.
    pub max_seqs: usize,
}

/// Serves until the process is interrupted (Ctrl-C), or returns the error that stopped it:
/// the address taken, or the model failing to load. `load` runs on the engine's thread;
/// `on_listen` is told the bound address once the server listens.
pub fn serve(
    opts: ServeOptions,
    load: impl FnOnce() -> Result<Engine, String> + Send + 'static,
    on_listen: impl FnOnce(SocketAddr),
) -> Result<(), ServerError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kestrel-http")
        .build()?;
    runtime.block_on(async move {
        let addr = format!("{}:{}", opts.host, opts.port);
        let listener = TcpListener::bind(&addr)
            .await
            .map_err(|source| ServerError::Bind {
                addr: addr.clone(),
                source,
            })?;
        let local = listener.local_addr()?;
        let (jobs, queue) = sync_channel(opts.max_queue + opts.max_seqs);
        let state = Arc::new(AppState {
            model_name: opts.model_name.clone(),
            api_key: opts.api_key.clone(),
            max_body: opts.max_body,
            max_queue: opts.max_queue,
            ready: OnceLock::new(),
            jobs,
            metrics: Arc::new(Metrics::default()),
            started: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            next_id: AtomicU64::new(0),
        });
        let (failed_tx, mut failed) = tokio::sync::mpsc::unbounded_channel::<String>();
        {
            let state = state.clone();
            std::thread::Builder::new()
                .name("kestrel-engine".into())
                .spawn(move || {
                    let engine = match load() {
                        Ok(e) => e,
                        Err(e) => {
                            let _ = failed_tx.send(e);
                            return;
                        }
                    };
                    let ready = engine.text().fork().map(|text| Ready {
                        text,
                        ctx: engine.ctx(),
                        vocab: engine.config().vocab,
                        slots: engine.max_seqs(),
                    });
                    match ready {
                        Ok(r) => {
                            let _ = state.ready.set(r);
                        }
                        Err(e) => {
                            let _ = failed_tx.send(e.to_string());
                            return;
                        }
                    }
                    worker::run(engine, queue, state.metrics.clone());
                })?;
        }
        on_listen(local);
        let app = routes::router(state);
        let load_error = Arc::new(std::sync::Mutex::new(None));
        let slot = load_error.clone();
        let shutdown = async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                e = failed.recv() => {
                    if let Some(e) = e {
                        *slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(e);
                    } else {
                        // The engine's thread ended after loading: wait for Ctrl-C.
                        let _ = tokio::signal::ctrl_c().await;
                    }
                }
            }
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await?;
        let e = load_error
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        match e {
            Some(e) => Err(ServerError::Load(e)),
            None => Ok(()),
        }
    })
}
