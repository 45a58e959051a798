//! One turn of generation, for front ends that generate one sequence at a time (`run`, `chat`):
//! the [`Batcher`] runs it as it runs any of many sequences, so there is one generation path.
//! A turn reuses what the caches hold (the sequence the last turn left, when this one extends
//! it: a conversation's next turn prefills only what is new, for hybrids too; else the full
//! blocks prefix caching finds), then generates until an end-of-sequence id, a stop string,
//! the token limit or a cancel. Text streams to a callback in whole characters, with stop
//! strings held back until they cannot match.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::batch::{Batcher, Piece, SeqEvent, SeqRequest, StopReason};
use crate::engine::TokenLogprobs;
use crate::error::{EngineError, Result};

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

/// What a turn's sequence told, kept until the step that produced it is over.
enum Told {
    Piece(Option<u32>, String, Option<TokenLogprobs>),
    Done(StopReason, usize),
    Failed(String),
}

impl Batcher {
    /// Runs the sequence `ids` (continuing what the caches hold of it: a conversation's next
    /// turn prefills only what is new), then generates up to `max_tokens` tokens with the
    /// engine's sampling settings ([`crate::EngineOptions::sampling`], `ignore_eos`). Text goes
    /// to `on_text` as it completes; `stops` end the turn (the stop string is not passed on);
    /// setting `cancel` ends it after the current token.
    pub fn generate(
        &mut self,
        ids: &[u32],
        max_tokens: usize,
        stops: &[String],
        on_text: &mut dyn FnMut(&str) -> std::io::Result<()>,
        cancel: &AtomicBool,
    ) -> Result<Turn> {
        let req = SeqRequest {
            ids: ids.to_vec(),
            max_tokens,
            stops: stops.to_vec(),
            sampling: self.engine().sampling,
            ignore_eos: self.engine().ignore_eos,
            logprobs: None,
        };
        let mut on_piece = |p: Piece| {
            if p.text.is_empty() {
                Ok(())
            } else {
                on_text(p.text)
            }
        };
        self.generate_pieces(req, &mut on_piece, cancel)
    }

    /// One turn of one sequence, `req`, run by the batcher as any sequence is (the batcher must
    /// have nothing else to do), telling `on_piece` of every generated token as it comes (a
    /// [`Piece`] with the token, the text it completes, possibly empty: part of a character, a
    /// stop string held back, no tokenizer; and its log-probabilities if asked for), and of
    /// text released without a token of its own (`id` None). An end-of-sequence id is not
    /// told. With `max_tokens` 0 the prompt still runs (its time is the prefill's).
    pub fn generate_pieces(
        &mut self,
        req: SeqRequest,
        on_piece: &mut dyn FnMut(Piece) -> std::io::Result<()>,
        cancel: &AtomicBool,
    ) -> Result<Turn> {
        if !self.is_idle() {
            return Err(EngineError::Invalid(
                "a turn runs alone, and the batcher is generating other sequences".into(),
            ));
        }
        let start = Instant::now();
        let prompt = req.ids.len();
        let told: Rc<RefCell<Vec<Told>>> = Rc::default();
        let sink = {
            let told = told.clone();
            Box::new(move |e: SeqEvent| {
                told.borrow_mut().push(match e {
                    SeqEvent::Piece(p) => Told::Piece(p.id, p.text.to_string(), p.logprobs.cloned()),
                    SeqEvent::Done { reason, reused, .. } => Told::Done(reason, reused),
                    SeqEvent::Failed(e) => Told::Failed(e.to_string()),
                });
                true
            })
        };
        self.add(req, sink)?;
        let mut turn = Turn {
            prefilled: prompt,
            reused: 0,
            tokens: Vec::new(),
            text: self.engine().text.tokenizer.as_ref().map(|_| String::new()),
            stop_reason: StopReason::Length,
            prefill_s: 0.0,
            decode_s: 0.0,
        };
        let mut first = None::<Instant>;
        loop {
            if first.is_some() && cancel.swap(false, Ordering::Relaxed) {
                self.interrupt();
            } else {
                self.step();
            }
            let events = std::mem::take(&mut *told.borrow_mut());
            for e in events {
                match e {
                    Told::Piece(id, text, lp) => {
                        if id.is_some() && first.is_none() {
                            first = Some(Instant::now());
                        }
                        turn.tokens.extend(id);
                        if let Some(t) = &mut turn.text {
                            t.push_str(&text);
                        }
                        let piece = Piece {
                            id,
                            text: &text,
                            logprobs: lp.as_ref(),
                        };
                        if let Err(e) = on_piece(piece) {
                            self.interrupt();
                            return Err(EngineError::Output(e));
                        }
                    }
                    Told::Done(reason, reused) => {
                        let end = Instant::now();
                        let first = first.unwrap_or(end);
                        turn.stop_reason = reason;
                        (turn.reused, turn.prefilled) = (reused, prompt - reused);
                        turn.prefill_s = (first - start).as_secs_f64();
                        turn.decode_s = (end - first).as_secs_f64();
                        return Ok(turn);
                    }
                    Told::Failed(e) => return Err(EngineError::Sequence(e)),
                }
            }
            if self.is_idle() {
                return Err(EngineError::Sequence("the sequence ended without a word".into()));
            }
        }
    }
}
