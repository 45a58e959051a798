//! Generation as `run` and `chat` share it: a session, the sampler, the end-of-sequence ids, and
//! the token ids the session holds (positions `0..`), so a new turn prefills only what follows
//! the longest common prefix with them. Attention-only models rewind by overwriting cache rows;
//! hybrids, whose recurrent states cannot rewind, start over when a turn does not extend what is
//! held. Each turn streams its text (whole characters, stop strings held back) to stdout or keeps
//! it. The next token comes from the backend's argmax (greedy), the backend's sampler (which
//! draws as the host sampler does), or the host sampler on the logits (settings the backend's
//! sampler cannot take).

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{bail, Result};
use kestrel_core::Backend;
use kestrel_model::Session;
use kestrel_text::{Sampler, StopStrings, Tokenizer};

/// Where the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pick {
    /// Greedy without penalties: the backend's argmax.
    Argmax,
    /// The backend's sampler (the session samples with the same settings).
    BackendSampler,
    /// The logits come back and the host samples (settings the backend cannot take).
    HostSampler,
}

pub struct Generator<'t, B: Backend> {
    pub session: Session<B>,
    tokenizer: Option<&'t Tokenizer>,
    sampler: Sampler,
    /// How the next token is chosen.
    pick: Pick,
    eos: Vec<u32>,
    /// Prefill in chunks of at most this many tokens.
    chunk: Option<usize>,
    /// The ids the session's caches and states hold, from position 0.
    held: Vec<u32>,
}

/// One turn's result.
pub struct Turn {
    /// Prompt tokens prefilled this turn (those after the reused prefix).
    pub prefilled: usize,
    /// Prompt tokens whose caches were reused.
    pub reused: usize,
    pub tokens: Vec<u32>,
    /// The generated text, when there is a tokenizer.
    pub text: Option<String>,
    /// `length`, `eos`, `stop` or `interrupted`.
    pub stop_reason: &'static str,
    /// Time to the first generated token, and for the tokens after it.
    pub prefill_s: f64,
    pub decode_s: f64,
}

impl Turn {
    /// Tokens per second after the first token.
    pub fn decode_tps(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        if self.decode_s > 0.0 {
            n as f64 / self.decode_s
        } else {
            0.0
        }
    }
}

impl<'t, B: Backend> Generator<'t, B> {
    pub fn new(
        session: Session<B>,
        tokenizer: Option<&'t Tokenizer>,
        sampler: Sampler,
        eos: Vec<u32>,
        chunk: Option<usize>,
    ) -> Generator<'t, B> {
        let pick = if sampler.params.is_plain_greedy() {
            Pick::Argmax
        } else if session.samples_on_backend() {
            Pick::BackendSampler
        } else {
            Pick::HostSampler
        };
        Generator {
            pick,
            session,
            tokenizer,
            sampler,
            eos,
            chunk,
            held: Vec::new(),
        }
    }

    /// Forgets the sequence: the next turn starts from position 0.
    pub fn clear(&mut self) -> Result<()> {
        self.held.clear();
        self.session.reset_states()?;
        Ok(())
    }

    /// Runs the sequence `ids` (reusing what the session holds of it), then generates up to `n`
    /// tokens. `print` streams the text to stdout; `stops` end the turn; setting `cancel` ends it
    /// after the current token.
    pub fn turn(
        &mut self,
        ids: &[u32],
        n: usize,
        stops: &[String],
        print: bool,
        cancel: &AtomicBool,
    ) -> Result<Turn> {
        if ids.is_empty() {
            bail!("the prompt is empty");
        }
        let ctx = self.session.ctx;
        if ids.len() + n > ctx {
            bail!(
                "{} prompt tokens and {n} new ones do not fit a context of {ctx} (-c / --ctx)",
                ids.len()
            );
        }
        let hybrid = self.session.config.arch.is_hybrid();
        let mut keep = self.held.iter().zip(ids).take_while(|(a, b)| a == b).count();
        if hybrid && (keep < self.held.len() || keep == ids.len()) {
            // Recurrent states hold everything they saw: only an extension can reuse them.
            self.session.reset_states()?;
            keep = 0;
        }
        // At least one token must run to produce the next one.
        keep = keep.min(ids.len() - 1);
        self.held.truncate(keep);
        let start = Instant::now();
        let new = &ids[keep..];
        let chunk = self.chunk.unwrap_or(new.len()).max(1);
        let mut turn = Turn {
            prefilled: new.len(),
            reused: keep,
            tokens: Vec::new(),
            text: None,
            stop_reason: "length",
            prefill_s: 0.0,
            decode_s: 0.0,
        };
        if n == 0 {
            return Ok(turn);
        }
        let mut history = ids.to_vec();
        if self.pick == Pick::BackendSampler {
            self.session.set_sample_history(&history)?;
        }
        let mut id = match self.pick {
            Pick::Argmax => self.session.prefill_next_token(new, keep, chunk)?,
            Pick::BackendSampler => self.session.prefill_sample_next_token(new, keep, chunk)?,
            Pick::HostSampler => {
                let mut logits = self.session.prefill(new, keep, chunk, false)?;
                self.sampler.sample(&mut logits, &history)
            }
        };
        self.held.extend_from_slice(new);
        turn.prefill_s = start.elapsed().as_secs_f64();
        let decode = Instant::now();
        let mut stream = self.tokenizer.map(|t| t.stream());
        let mut stopper = StopStrings::new(stops.iter().cloned());
        let mut text = String::new();
        let emit = |s: &str, text: &mut String| -> Result<()> {
            if !s.is_empty() {
                text.push_str(s);
                if print {
                    let mut out = std::io::stdout().lock();
                    out.write_all(s.as_bytes())?;
                    out.flush()?;
                }
            }
            Ok(())
        };
        loop {
            if self.eos.contains(&id) {
                turn.stop_reason = "eos";
                break;
            }
            turn.tokens.push(id);
            history.push(id);
            if let Some(stream) = &mut stream {
                let released = stopper.push(&stream.push(id)?);
                emit(&released.text, &mut text)?;
                if released.stopped {
                    turn.stop_reason = "stop";
                    break;
                }
            }
            if turn.tokens.len() == n {
                break;
            }
            if cancel.swap(false, Ordering::Relaxed) {
                turn.stop_reason = "interrupted";
                break;
            }
            let at = self.held.len();
            id = match self.pick {
                Pick::Argmax => self.session.next_token(&[id], at)?,
                Pick::BackendSampler => self.session.sample_next_token(&[id], at)?,
                Pick::HostSampler => {
                    let mut logits = self.session.forward(&[id], at, false)?;
                    self.sampler.sample(&mut logits, &history)
                }
            };
            self.held.push(history[history.len() - 1]);
        }
        turn.decode_s = decode.elapsed().as_secs_f64();
        if let Some(stream) = &mut stream {
            if turn.stop_reason != "stop" {
                let released = stopper.push(&stream.finish()?);
                emit(&released.text, &mut text)?;
                if !released.stopped {
                    emit(&stopper.finish(), &mut text)?;
                }
            }
            turn.text = Some(text);
        }
        Ok(turn)
    }
}
