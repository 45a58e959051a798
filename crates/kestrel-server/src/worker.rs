//! The engine's thread: it owns the [`Engine`] and runs the queued [`Job`]s, sending every
//! generated token's text back to the request's handler as it comes. A [`Batcher`] generates
//! every choice of every job it has room for at once (the engine's `max_seqs` slots; with one,
//! choice after choice), taking jobs from the queue while slots are free. A handler that has
//! gone (its client disconnected) makes the next send fail, and its sequences end there,
//! within one step.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use kestrel_engine::{Batcher, Engine, SeqEvent, SeqRequest, StopReason, TokenLogprobs, KV_BLOCK};
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

/// Runs jobs from `jobs` until every sender is gone, as many sequences at once as the engine's
/// pool has slots for (one at a time with `max_seqs` 1).
pub fn run(engine: Engine, jobs: Receiver<Job>, metrics: Arc<Metrics>) {
    run_batched(Batcher::new(engine), jobs, metrics)
}

/// A job's progress while its choices run in the batcher.
struct JobState {
    events: UnboundedSender<Event>,
    arrived: Instant,
    prompt: usize,
    /// Choices not ended yet.
    left: usize,
    /// The job was counted as ended (finished, failed or its handler gone).
    ended: bool,
    /// The first token of choice 0 was seen (time to first token).
    first: bool,
}

impl JobState {
    /// Counts the job's end once: `running` down, and the outcome's counter up.
    fn end(&mut self, metrics: &Metrics, counter: &std::sync::atomic::AtomicU64) {
        if !self.ended {
            self.ended = true;
            metrics.running.fetch_sub(1, Ordering::Relaxed);
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The events of choice `index` of a job, as the batcher gives them, sent to its handler with
/// the metrics counted; false once the handler is gone or the job failed.
fn sink(
    index: usize,
    state: Rc<RefCell<JobState>>,
    metrics: Arc<Metrics>,
    tokenizer: Rc<Option<Tokenizer>>,
) -> kestrel_engine::Sink {
    let mut last = None::<Instant>;
    Box::new(move |e: SeqEvent| {
        let mut st = state.borrow_mut();
        // A job whose handler went away or that failed: its other choices end too.
        if st.ended {
            return false;
        }
        let event = match e {
            SeqEvent::Piece(p) => {
                if p.id.is_some() {
                    let now = Instant::now();
                    match last {
                        None if index == 0 && !st.first => {
                            st.first = true;
                            metrics.time_to_first_token(st.arrived.elapsed().as_secs_f64());
                        }
                        None => {}
                        Some(t) => metrics.inter_token(now.duration_since(t).as_secs_f64()),
                    }
                    last = Some(now);
                    metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
                }
                Event::Piece {
                    index,
                    text: p.text.to_string(),
                    logprobs: p
                        .id
                        .zip(p.logprobs)
                        .map(|(id, lp)| named(tokenizer.as_ref().as_ref(), id, lp)),
                }
            }
            SeqEvent::Done {
                reason,
                tokens,
                reused,
            } => {
                st.left -= 1;
                metrics
                    .prompt_tokens
                    .fetch_add(st.prompt as u64, Ordering::Relaxed);
                if st.left == 0 {
                    // The counters are up to date before the handler hears the end.
                    metrics.request_latency(st.arrived.elapsed().as_secs_f64());
                    st.end(&metrics, &metrics.requests_ok);
                }
                Event::Done {
                    index,
                    reason,
                    tokens,
                    reused,
                }
            }
            SeqEvent::Failed(e) => {
                st.end(&metrics, &metrics.requests_failed);
                let _ = st.events.send(Event::Failed(e.to_string()));
                return false;
            }
        };
        if st.events.send(event).is_err() {
            st.end(&metrics, &metrics.requests_cancelled);
            return false;
        }
        true
    })
}

/// Hands `job`'s choices to the batcher.
fn start(b: &mut Batcher, job: Job, metrics: &Arc<Metrics>, tokenizer: &Rc<Option<Tokenizer>>) {
    metrics.waiting.fetch_sub(1, Ordering::Relaxed);
    metrics.running.fetch_add(1, Ordering::Relaxed);
    let state = Rc::new(RefCell::new(JobState {
        events: job.events.clone(),
        arrived: job.arrived,
        prompt: job.ids.len(),
        left: job.sampling.len(),
        ended: false,
        first: false,
    }));
    for (index, params) in job.sampling.iter().enumerate() {
        let req = SeqRequest {
            ids: job.ids.clone(),
            max_tokens: job.max_tokens,
            stops: job.stop.clone(),
            sampling: *params,
            ignore_eos: job.ignore_eos,
            logprobs: job.logprobs,
        };
        let s = sink(index, state.clone(), metrics.clone(), tokenizer.clone());
        if let Err(e) = b.add(req, s) {
            state.borrow_mut().end(metrics, &metrics.requests_failed);
            let _ = job.events.send(Event::Failed(e.to_string()));
            return;
        }
    }
}

/// Takes jobs while the batcher has free slots (waiting for one when it has nothing to do) and
/// steps it, until every sender is gone and the last sequence ended.
fn run_batched(mut b: Batcher, jobs: Receiver<Job>, metrics: Arc<Metrics>) {
    // A step's tokens are in /metrics before any of them reaches its client.
    let counts = metrics.clone();
    b.on_counted(move |t| counts.set_steps(t));
    let (_, total) = b.kv_blocks();
    metrics
        .kv_total
        .store((total * KV_BLOCK) as u64, Ordering::Relaxed);
    let tokenizer = Rc::new(b.engine().text().tokenizer.clone());
    let mut open = true;
    loop {
        while open && (b.is_idle() || b.free_slots() > 0) {
            let job = if b.is_idle() {
                match jobs.recv() {
                    Ok(job) => job,
                    Err(_) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(job) => job,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            start(&mut b, job, &metrics, &tokenizer);
        }
        if b.is_idle() {
            if !open {
                return;
            }
            continue;
        }
        b.step();
        metrics.set_steps(b.step_times());
        let (used, _) = b.kv_blocks();
        metrics.kv_used.store((used * KV_BLOCK) as u64, Ordering::Relaxed);
    }
}
