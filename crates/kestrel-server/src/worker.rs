//! The engine's thread: it owns the [`Engine`] and runs the queued [`Job`]s one at a time, each
//! choice with its own sampling settings, sending every generated token's text back to the
//! request's handler as it comes. A handler that has gone (its client disconnected) makes the
//! next send fail, and the job ends there, within one token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use kestrel_engine::{Engine, EngineError, Piece, StopReason, TokenLogprobs};
use kestrel_text::{SamplingParams, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// One request's generation, its prompt already checked against the context.
pub struct Job {
    pub ids: Vec<u32>,
    pub max_tokens: usize,
    /// One entry a choice (`n`), each with its own seed.
    pub sampling: Vec<SamplingParams>,
    pub stop: Vec<String>,
    /// Generate past end-of-sequence ids.
    pub ignore_eos: bool,
    /// Each token's log-probability and this many alternatives' (None: none).
    pub logprobs: Option<usize>,
    /// When the request arrived, for the latency metrics.
    pub arrived: Instant,
    pub events: UnboundedSender<Event>,
}

/// What a job tells its handler.
#[derive(Debug)]
pub enum Event {
    /// Choice `index` generated a token completing `text` (possibly empty; with its
    /// log-probabilities when asked for), or released text held back.
    Piece {
        index: usize,
        text: String,
        logprobs: Option<Logprobs>,
    },
    /// Choice `index` ended.
    Done {
        index: usize,
        reason: StopReason,
        tokens: usize,
        reused: usize,
    },
    /// The job failed; nothing more comes.
    Failed(String),
}

/// A generated token's log-probability and the most likely alternatives', tokens as text.
#[derive(Debug, Clone, PartialEq)]
pub struct Logprobs {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// The text of token `id` alone (its id when the model has no tokenizer).
fn token_text(tokenizer: Option<&Tokenizer>, id: u32) -> String {
    tokenizer
        .and_then(|t| t.decode(&[id], false).ok())
        .unwrap_or_else(|| format!("token_id:{id}"))
}

fn named(tokenizer: Option<&Tokenizer>, id: u32, lp: &TokenLogprobs) -> Logprobs {
    Logprobs {
        token: token_text(tokenizer, id),
        logprob: lp.logprob,
        top: lp
            .top
            .iter()
            .map(|&(t, l)| (token_text(tokenizer, t), l))
            .collect(),
    }
}

/// Runs jobs from `jobs` until every sender is gone.
pub fn run(mut engine: Engine, jobs: Receiver<Job>, metrics: Arc<Metrics>) {
    metrics.kv_total.store(engine.ctx() as u64, Ordering::Relaxed);
    // The engine is busy generating while tokens are named.
    let tokenizer = engine.text().tokenizer.clone();
    while let Ok(job) = jobs.recv() {
        metrics.waiting.fetch_sub(1, Ordering::Relaxed);
        metrics.running.fetch_add(1, Ordering::Relaxed);
        let outcome = run_job(&mut engine, &job, &metrics, tokenizer.as_ref());
        // The counters are up to date before the handler hears the end.
        metrics.running.fetch_sub(1, Ordering::Relaxed);
        match outcome {
            Ok(Some(last)) => {
                metrics.requests_ok.fetch_add(1, Ordering::Relaxed);
                metrics.request_latency(job.arrived.elapsed().as_secs_f64());
                let _ = job.events.send(last);
            }
            Ok(None) => {
                metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                metrics.requests_failed.fetch_add(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Failed(e.to_string()));
            }
        }
    }
}

/// Runs every choice of `job`, sending all but the last choice's end: that one comes back for
/// the caller to send (None when the handler went away first).
fn run_job(
    engine: &mut Engine,
    job: &Job,
    metrics: &Metrics,
    tokenizer: Option<&Tokenizer>,
) -> Result<Option<Event>, EngineError> {
    let cancel = AtomicBool::new(false);
    engine.set_ignore_eos(job.ignore_eos);
    engine.set_logprobs(job.logprobs);
    for (index, params) in job.sampling.iter().enumerate() {
        engine.set_sampling(*params)?;
        let mut last = None::<Instant>;
        let mut gone = false;
        let mut on_piece = |p: Piece| -> std::io::Result<()> {
            if p.id.is_some() {
                let now = Instant::now();
                match last {
                    None if index == 0 => metrics.time_to_first_token(job.arrived.elapsed().as_secs_f64()),
                    None => {}
                    Some(t) => metrics.inter_token(now.duration_since(t).as_secs_f64()),
                }
                last = Some(now);
                metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
            }
            let piece = Event::Piece {
                index,
                text: p.text.to_string(),
                logprobs: p.id.zip(p.logprobs).map(|(id, lp)| named(tokenizer, id, lp)),
            };
            job.events.send(piece).map_err(|_| {
                gone = true;
                std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client went away")
            })
        };
        let turn = engine.generate_pieces(&job.ids, job.max_tokens, &job.stop, &mut on_piece, &cancel);
        metrics
            .kv_used
            .store(engine.positions_held() as u64, Ordering::Relaxed);
        let turn = match turn {
            // The sequence stops here; the caches keep what it ran, for a next request that
            // shares its beginning.
            Err(_) if gone => return Ok(None),
            Ok(t) => t,
            Err(e) => {
                engine.reset()?;
                return Err(e);
            }
        };
        metrics
            .prompt_tokens
            .fetch_add(job.ids.len() as u64, Ordering::Relaxed);
        let done = Event::Done {
            index,
            reason: turn.stop_reason,
            tokens: turn.tokens.len(),
            reused: turn.reused,
        };
        if index + 1 == job.sampling.len() {
            return Ok(Some(done));
        }
        if job.events.send(done).is_err() {
            return Ok(None);
        }
    }
    Ok(None)
}
