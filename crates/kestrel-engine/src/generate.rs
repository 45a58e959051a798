//! The generation loop every front end shares. A turn runs a sequence of token ids, reusing
//! what the caches hold of it (the longest common prefix with the ids they hold from position
//! 0, so a conversation's next turn prefills only what is new; attention-only models rewind by
//! overwriting cache rows, hybrids, whose recurrent states cannot rewind, start over unless
//! the turn extends what is held), then generates until an end-of-sequence id, a stop string,
//! the token limit or a cancel. Text streams to a callback in whole characters, with stop
//! strings held back until they cannot match. The next token comes from the backend's argmax
//! (greedy), the backend's sampler (which draws as the host sampler does), or the host sampler
//! on the logits (settings the backend's sampler cannot take).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kestrel_model::Want;
use kestrel_text::StopStrings;

use crate::engine::{on_session, Engine, Pick, TokenLogprobs};
use crate::error::{EngineError, Result};

/// What [`Engine::generate_pieces`] tells of each generated token.
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    /// The token; None for text released without a token of its own.
    pub id: Option<u32>,
    /// The text it completes (possibly empty).
    pub text: &'a str,
    /// Its log-probabilities, when [`Engine::set_logprobs`] asked for them.
    pub logprobs: Option<&'a TokenLogprobs>,
}

/// Why a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The token limit.
    Length,
    /// An end-of-sequence id.
    Eos,
    /// A stop string.
    Stop,
    /// The caller's cancel flag.
    Interrupted,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Length => "length",
            StopReason::Eos => "eos",
            StopReason::Stop => "stop",
            StopReason::Interrupted => "interrupted",
        }
    }
}

/// One turn's result.
#[derive(Debug, Clone)]
pub struct Turn {
    /// Prompt tokens prefilled this turn (those after the reused prefix).
    pub prefilled: usize,
    /// Prompt tokens whose caches were reused.
    pub reused: usize,
    /// The generated ids (without the end-of-sequence id).
    pub tokens: Vec<u32>,
    /// The generated text, when the model has a tokenizer.
    pub text: Option<String>,
    pub stop_reason: StopReason,
    /// Time to the first generated token, and for the tokens after it.
    pub prefill_s: f64,
    pub decode_s: f64,
}

impl Turn {
    /// Tokens per second after the first token (the first comes with the prefill).
    pub fn decode_tps(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        if self.decode_s > 0.0 {
            n as f64 / self.decode_s
        } else {
            0.0
        }
    }
}

impl Engine {
    /// Runs the sequence `ids` (reusing what the caches hold of it), then generates up to
    /// `max_tokens` tokens. Text goes to `on_text` as it completes; `stops` end the turn (the
    /// stop string is not passed on); setting `cancel` ends it after the current token.
    pub fn generate(
        &mut self,
        ids: &[u32],
        max_tokens: usize,
        stops: &[String],
        on_text: &mut dyn FnMut(&str) -> std::io::Result<()>,
        cancel: &AtomicBool,
    ) -> Result<Turn> {
        let mut on_piece = |p: Piece| {
            if p.text.is_empty() {
                Ok(())
            } else {
                on_text(p.text)
            }
        };
        self.generate_pieces(ids, max_tokens, stops, &mut on_piece, cancel)
    }

    /// [`Engine::generate`], telling `on_piece` of every generated token as it comes (a
    /// [`Piece`] with the token, the text it completes, possibly empty: part of a character, a
    /// stop string held back, no tokenizer; and its log-probabilities if asked for), and of text
    /// released without a token of its own (`id` None): what a token completing a stop string
    /// releases before the stop, and at the end what was held back. An end-of-sequence id is
    /// not told.
    pub fn generate_pieces(
        &mut self,
        ids: &[u32],
        max_tokens: usize,
        stops: &[String],
        on_piece: &mut dyn FnMut(Piece) -> std::io::Result<()>,
        cancel: &AtomicBool,
    ) -> Result<Turn> {
        if ids.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        let ctx = self.ctx();
        if ids.len() + max_tokens > ctx {
            return Err(EngineError::Invalid(format!(
                "{} prompt tokens and {max_tokens} new ones do not fit a context of {ctx} (-c / --ctx)",
                ids.len()
            )));
        }
        let hybrid = self.config().arch.is_hybrid();
        let mut keep = self.held.iter().zip(ids).take_while(|(a, b)| a == b).count();
        if hybrid && (keep < self.held.len() || keep == ids.len()) {
            // Recurrent states hold everything they saw: only an extension can reuse them.
            on_session!(&mut self.session, s => s.reset_states())?;
            keep = 0;
        }
        // At least one token must run to produce the next one.
        keep = keep.min(ids.len() - 1);
        self.held.truncate(keep);
        let start = Instant::now();
        let new = &ids[keep..];
        let mut turn = Turn {
            prefilled: new.len(),
            reused: keep,
            tokens: Vec::new(),
            text: None,
            stop_reason: StopReason::Length,
            prefill_s: 0.0,
            decode_s: 0.0,
        };
        let mut history = ids.to_vec();
        if self.pick == Pick::BackendSampler {
            on_session!(&mut self.session, s => s.set_sample_history(&history))?;
        }
        // The prompt runs even when no token is asked for (its time is the prefill's), so
        // the caches hold it for the next turn.
        let mut id = self.next(new, keep, &history)?;
        self.held.extend_from_slice(new);
        turn.prefill_s = start.elapsed().as_secs_f64();
        if max_tokens == 0 {
            if self.text.tokenizer.is_some() {
                turn.text = Some(String::new());
            }
            return Ok(turn);
        }
        let decode = Instant::now();
        // The tokenizer is taken out for the turn, so that stepping can borrow the engine.
        let tokenizer = self.text.tokenizer.take();
        let mut stream = tokenizer.as_ref().map(|t| t.stream());
        let mut stopper = StopStrings::new(stops.iter().cloned());
        let mut text = String::new();
        let mut emit =
            |id: Option<u32>, s: &str, lp: Option<&TokenLogprobs>, text: &mut String| -> Result<()> {
                text.push_str(s);
                if id.is_some() || !s.is_empty() {
                    let piece = Piece {
                        id,
                        text: s,
                        logprobs: lp,
                    };
                    on_piece(piece).map_err(EngineError::Output)?;
                }
                Ok(())
            };
        let outcome = (|| -> Result<()> {
            loop {
                if self.eos.contains(&id) {
                    turn.stop_reason = StopReason::Eos;
                    break;
                }
                turn.tokens.push(id);
                history.push(id);
                let lp = self.last_logprobs.take();
                match &mut stream {
                    Some(stream) => {
                        let released = stopper.push(&stream.push(id)?);
                        if released.stopped {
                            emit(None, &released.text, None, &mut text)?;
                            turn.stop_reason = StopReason::Stop;
                            break;
                        }
                        emit(Some(id), &released.text, lp.as_ref(), &mut text)?;
                    }
                    None => emit(Some(id), "", lp.as_ref(), &mut text)?,
                }
                if turn.tokens.len() == max_tokens {
                    break;
                }
                if cancel.swap(false, Ordering::Relaxed) {
                    turn.stop_reason = StopReason::Interrupted;
                    break;
                }
                let at = self.held.len();
                id = self.next(&[id], at, &history)?;
                self.held.push(history[history.len() - 1]);
            }
            turn.decode_s = decode.elapsed().as_secs_f64();
            if let Some(stream) = &mut stream {
                if turn.stop_reason != StopReason::Stop {
                    let released = stopper.push(&stream.finish()?);
                    emit(None, &released.text, None, &mut text)?;
                    if !released.stopped {
                        emit(None, &stopper.finish(), None, &mut text)?;
                    }
                }
            }
            Ok(())
        })();
        drop(stream);
        self.text.tokenizer = tokenizer;
        outcome?;
        if self.text.tokenizer.is_some() {
            turn.text = Some(text);
        }
        Ok(turn)
    }

    /// Runs `ids` at `past` and picks the token after them; `history` is the whole sequence
    /// (for the host sampler's penalties). With log-probabilities asked for, the logits come
    /// back whatever the pick, and the chosen token's are kept for the caller.
    fn next(&mut self, ids: &[u32], past: usize, history: &[u32]) -> Result<u32> {
        let want = match (self.pick, self.logprobs) {
            (_, Some(_)) | (Pick::HostSampler, None) => Want::LastLogits,
            (Pick::Argmax, None) => Want::Argmax,
            (Pick::BackendSampler, None) => Want::Sample,
        };
        let out = on_session!(&mut self.session, s => s.step(ids, past, want))?;
        match out {
            kestrel_model::Output::Token(t) => Ok(t),
            kestrel_model::Output::Logits(mut logits) => {
                // The sampler penalises the logits in place: the log-probabilities are the raw ones.
                let raw = self.logprobs.map(|k| (logprobs(&logits, k), logits.clone()));
                let id = match self.pick {
                    Pick::Argmax => kestrel_core::sample::argmax(&logits),
                    Pick::BackendSampler | Pick::HostSampler => self.sampler.sample(&mut logits, history),
                };
                self.last_logprobs = raw.map(|((lse, top), raw)| TokenLogprobs {
                    logprob: logits_at(&raw, id, lse),
                    top,
                });
                Ok(id)
            }
        }
    }
}

/// The log-probabilities of token `id` and of the `k` most likely tokens under `logits`.
pub(crate) fn logprobs_of(logits: &[f32], k: usize, id: u32) -> TokenLogprobs {
    let (lse, top) = logprobs(logits, k);
    TokenLogprobs {
        logprob: logits_at(logits, id, lse),
        top,
    }
}

/// The log-sum-exp of `logits` and its `k` most likely tokens with their log-probabilities.
fn logprobs(logits: &[f32], k: usize) -> (f64, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(order.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
    }
    order.truncate(k);
    order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    let top = order
        .into_iter()
        .map(|t| (t, (f64::from(logits[t as usize]) - lse) as f32))
        .collect();
    (lse, top)
}

/// The log-probability of `id` given the log-sum-exp of the (unpenalised) logits.
fn logits_at(logits: &[f32], id: u32, lse: f64) -> f32 {
    (f64::from(logits[id as usize]) - lse) as f32
}
