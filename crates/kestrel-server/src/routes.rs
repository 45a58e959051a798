//! The HTTP routes: `/v1/chat/completions` and `/v1/completions` (a JSON answer, or server-sent
//! events with `stream`), `/v1/models`, `/health` and `/metrics`; the API key check; errors as
//! OpenAI error objects.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request as HttpRequest, State};
use axum::http::{header, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use kestrel_engine::{ModelText, StopReason};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::chat_output::{Part, Splitter};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::request::{parse, Endpoint, Input};
use crate::worker::{Event, Job, Logprobs};

/// What the routes share.
pub struct AppState {
    /// The name `/v1/models` lists and requests may give.
    pub model_name: String,
    pub api_key: Option<String>,
    pub max_body: usize,
    /// Requests that may wait for the engine.
    pub max_queue: usize,
    /// Set once the model has loaded.
    pub ready: OnceLock<Ready>,
    pub jobs: SyncSender<Job>,
    pub metrics: Arc<Metrics>,
    /// When the server started (Unix seconds), for `/v1/models`.
    pub started: u64,
    pub next_id: AtomicU64,
}

/// What requests need of the loaded model.
pub struct Ready {
    /// The model's tokenizer and chat template (a copy of the engine's, for the handlers).
    pub text: ModelText,
    pub ctx: usize,
    pub vocab: usize,
    /// Sequences the engine generates at once: requests up to this many run, `max_queue` more
    /// wait.
    pub slots: usize,
}

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .layer(axum::extract::DefaultBodyLimit::max(state.max_body))
        .with_state(state)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Equal in time that does not depend on where the two differ.
fn same_key(given: &[u8], key: &[u8]) -> bool {
    let mut diff = (given.len() != key.len()) as u8;
    for (i, k) in key.iter().enumerate() {
        diff |= k ^ given.get(i).copied().unwrap_or(!k);
    }
    diff == 0
}

async fn authorize(State(s): State<Arc<AppState>>, req: HttpRequest, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if !same_key(given.as_bytes(), key.as_bytes()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    match s.ready.get() {
        Some(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.render(&s.model_name),
    )
        .into_response()
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    let mut model = json!({
        "id": s.model_name,
        "object": "model",
        "created": s.started,
        "owned_by": "kestrel",
    });
    if let Some(r) = s.ready.get() {
        model["max_model_len"] = r.ctx.into();
        model["vocab_size"] = r.vocab.into();
    }
    Json(json!({"object": "list", "data": [model]})).into_response()
}

async fn chat(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(s, Endpoint::Chat, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    complete(s, Endpoint::Completions, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// How a chat answer's text is split into reasoning, content and tool calls.
#[derive(Debug, Clone, Copy)]
struct Split {
    /// The model writes a thinking section (its vocabulary has `<think>` and `</think>`).
    thinking: bool,
    /// The prompt ends inside it (the template opened it).
    opened: bool,
    /// Tool calls are parsed.
    tools: bool,
}

impl Split {
    fn splitter(self) -> Splitter {
        Splitter::new(self.thinking, self.opened, self.tools)
    }
}

/// A checked request's prompt: its tokens, the text `echo` repeats, and for chat how the answer
/// splits.
type Prompt = (Vec<u32>, Option<String>, Option<Split>);

fn prompt_ids(ready: &Ready, input: &Input) -> Result<Prompt, ApiError> {
    let text = &ready.text;
    let no_tokenizer =
        || ApiError::bad("this model has no tokenizer: give the prompt as token ids (`prompt: [1, 2, ...]`)");
    match input {
        Input::Chat {
            messages,
            tools,
            parse_tools,
            template_kwargs,
        } => {
            let (Some(tok), Some(_)) = (&text.tokenizer, &text.template) else {
                return Err(ApiError::bad(
                    "this model has no chat template: use /v1/completions with a prompt",
                ));
            };
            let ids = text
                .encode_chat_with_tools(messages, tools.as_deref(), template_kwargs)
                .map_err(|e| ApiError::field("messages", format!("rendering the chat template: {e}")))?;
            let thinking = tok.token_id("<think>").is_some() && tok.token_id("</think>").is_some();
            let tail = tok
                .decode(&ids[ids.len().saturating_sub(4)..], false)
                .unwrap_or_default();
            let split = Split {
                thinking,
                opened: thinking && tail.trim_end().ends_with("<think>"),
                tools: *parse_tools,
            };
            Ok((ids, None, Some(split)))
        }
        Input::Text(t) => {
            let tok = text.tokenizer.as_ref().ok_or_else(no_tokenizer)?;
            let ids = tok
                .encode(t, true)
                .map_err(|e| ApiError::field("prompt", format!("encoding the prompt: {e}")))?;
            Ok((ids, Some(t.clone()), None))
        }
        Input::Ids(ids) => {
            if let Some(i) = ids.iter().position(|&t| t as usize >= ready.vocab) {
                return Err(ApiError::field(
                    format!("prompt.{i}"),
                    format!(
                        "token id {} is past the vocabulary of {} ids",
                        ids[i], ready.vocab
                    ),
                ));
            }
            let echo = text.tokenizer.as_ref().and_then(|t| t.decode(ids, false).ok());
            Ok((ids.clone(), echo, None))
        }
    }
}

async fn complete(
    s: Arc<AppState>,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(s.max_body),
        _ => ApiError::bad(e.body_text()),
    })?;
    let ready = s.ready.get().ok_or_else(ApiError::loading)?;
    let req = parse(endpoint, &body)?;
    if let Some(m) = &req.model {
        if *m != s.model_name {
            return Err(ApiError::unknown_model(m, &s.model_name));
        }
    }
    // Rendering and encoding may take a while (the template renders on a thread of its own).
    let (ids, echo, split) = {
        let s = s.clone();
        let input = req.input.clone();
        tokio::task::spawn_blocking(move || match s.ready.get() {
            Some(ready) => prompt_ids(ready, &input),
            None => Err(ApiError::loading()),
        })
        .await
        .map_err(|e| ApiError::internal(format!("encoding the prompt: {e}")))??
    };
    let field = match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
    };
    if ids.is_empty() {
        return Err(ApiError::field(field, "the prompt is empty"));
    }
    if ids.len() >= ready.ctx {
        return Err(ApiError::field(
            field,
            format!(
                "the prompt is {} tokens and this server's context is {} tokens: it leaves no room for a completion",
                ids.len(),
                ready.ctx
            ),
        ));
    }
    let room = ready.ctx - ids.len();
    let max_tokens = match req.max_tokens {
        Some(m) if m > room => {
            return Err(ApiError::field(
                "max_tokens",
                format!(
                    "this server's context is {} tokens; the prompt is {} tokens and {m} more were asked for",
                    ready.ctx,
                    ids.len()
                ),
            ))
        }
        Some(m) => m,
        None => room,
    };
    let base = req.sampling.resolve(&ready.text.generation);
    let sampling = (0..req.n)
        .map(|i| kestrel_text::SamplingParams {
            seed: base.seed.wrapping_add(i as u64),
            ..base
        })
        .collect();
    kestrel_text::Sampler::new(base).map_err(|e| ApiError::bad(e.to_string()))?;
    let (tx, rx) = unbounded_channel();
    let prompt_tokens = ids.len();
    let job = Job {
        ids,
        max_tokens,
        sampling,
        stop: req.stop.clone(),
        ignore_eos: req.ignore_eos,
        logprobs: req.logprobs,
        arrived,
        events: tx,
    };
    // Requests beyond those running (at most one a slot) and those waiting are refused.
    let running = s.metrics.running.load(Ordering::Relaxed) as usize;
    let waiting = s.metrics.waiting.fetch_add(1, Ordering::Relaxed) as usize;
    if waiting + running.min(ready.slots) >= s.max_queue + ready.slots {
        s.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::queue_full(s.max_queue));
    }
    match s.jobs.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            s.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(ApiError::queue_full(s.max_queue));
        }
        Err(TrySendError::Disconnected(_)) => {
            s.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
            return Err(ApiError::internal("the engine has stopped"));
        }
    }
    let id = format!(
        "{}-{:x}{:08x}",
        match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        },
        s.started,
        s.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let answer = Answer {
        id,
        endpoint,
        model: s.model_name.clone(),
        created: unix_now(),
        prompt_tokens,
        split,
        logprobs: req.logprobs.is_some(),
    };
    if req.stream {
        Ok(Sse::new(answer.stream(rx, req.n, req.include_usage)).into_response())
    } else {
        answer.collect(rx, req.n, echo.filter(|_| req.echo)).await
    }
}

/// What every part of one answer repeats.
struct Answer {
    id: String,
    endpoint: Endpoint,
    model: String,
    created: u64,
    prompt_tokens: usize,
    /// How chat answers split (None: text completions).
    split: Option<Split>,
    /// Whether tokens' log-probabilities were asked for.
    logprobs: bool,
}

/// One chat choice's answer, gathered.
#[derive(Default)]
struct Gathered {
    reasoning: String,
    content: String,
    calls: Vec<(String, String)>,
}

/// A token's log-probabilities as a chat answer gives them.
fn chat_logprob(lp: &Logprobs) -> Value {
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|(t, l)| json!({"token": t, "logprob": l, "bytes": t.as_bytes()}))
        .collect();
    json!({"token": lp.token, "logprob": lp.logprob, "bytes": lp.token.as_bytes(), "top_logprobs": top})
}

/// Tokens' log-probabilities as a text completion gives them, each token with the character
/// offset in the text where it starts.
fn completion_logprobs(lps: &[(Logprobs, usize)]) -> Value {
    let top: Vec<Value> = lps
        .iter()
        .map(|(lp, _)| Value::Object(lp.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect()))
        .collect();
    json!({
        "tokens": lps.iter().map(|(lp, _)| lp.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|(lp, _)| lp.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": lps.iter().map(|(_, at)| *at).collect::<Vec<_>>(),
    })
}

impl Gathered {
    fn add(&mut self, parts: Vec<Part>) {
        for p in parts {
            match p {
                Part::Reasoning(t) => self.reasoning.push_str(&t),
                Part::Content(t) => self.content.push_str(&t),
                Part::ToolCall { name, arguments } => self.calls.push((name, arguments)),
            }
        }
    }
}

/// The finish reason of a choice that ended for `r`, having made `calls` tool calls.
fn finish_reason(r: StopReason, calls: usize) -> &'static str {
    match r {
        StopReason::Length => "length",
        _ if calls > 0 => "tool_calls",
        StopReason::Eos | StopReason::Stop | StopReason::Interrupted => "stop",
    }
}

impl Answer {
    fn usage(&self, completion: usize, reused: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": reused},
        })
    }

    /// The whole answer as one JSON object, once every choice is done.
    async fn collect(
        self,
        mut rx: UnboundedReceiver<Event>,
        n: usize,
        echo: Option<String>,
    ) -> Result<Response, ApiError> {
        let mut texts = vec![echo.unwrap_or_default(); n];
        let mut splitters: Vec<Option<Splitter>> = (0..n).map(|_| self.split.map(Split::splitter)).collect();
        let mut gathered: Vec<Gathered> = (0..n).map(|_| Gathered::default()).collect();
        let mut lps: Vec<Vec<(Logprobs, usize)>> = vec![Vec::new(); n];
        let mut reasons = vec![None; n];
        let (mut completion, mut reused) = (0, 0);
        while reasons.iter().any(Option::is_none) {
            match rx.recv().await {
                Some(Event::Piece {
                    index,
                    text,
                    logprobs,
                }) => {
                    if let Some(lp) = logprobs {
                        lps[index].push((lp, texts[index].chars().count()));
                    }
                    match &mut splitters[index] {
                        Some(sp) => gathered[index].add(sp.push(&text)),
                        None => texts[index].push_str(&text),
                    }
                }
                Some(Event::Done {
                    index,
                    reason,
                    tokens,
                    reused: r,
                }) => {
                    if let Some(sp) = &mut splitters[index] {
                        gathered[index].add(sp.finish());
                    }
                    reasons[index] = Some(finish_reason(reason, gathered[index].calls.len()));
                    completion += tokens;
                    if index == 0 {
                        reused = r;
                    }
                }
                Some(Event::Failed(e)) => return Err(ApiError::internal(e)),
                None => {
                    return Err(ApiError::internal(
                        "the engine stopped before the answer was complete",
                    ))
                }
            }
        }
        let choices: Vec<Value> = (0..n)
            .map(|index| match self.endpoint {
                Endpoint::Chat => {
                    let g = &gathered[index];
                    let mut message = json!({"role": "assistant", "content": g.content});
                    if g.content.is_empty() && !g.calls.is_empty() {
                        message["content"] = Value::Null;
                    }
                    if !g.reasoning.is_empty() {
                        message["reasoning_content"] = g.reasoning.clone().into();
                    }
                    if !g.calls.is_empty() {
                        let calls: Vec<Value> = g
                            .calls
                            .iter()
                            .enumerate()
                            .map(|(k, (name, args))| self.tool_call(index, k, name, args, None))
                            .collect();
                        message["tool_calls"] = calls.into();
                    }
                    let logprobs = self.logprobs.then(|| {
                        json!({"content": lps[index].iter().map(|(lp, _)| chat_logprob(lp)).collect::<Vec<_>>()})
                    });
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": reasons[index],
                    })
                }
                Endpoint::Completions => json!({
                    "index": index,
                    "text": texts[index],
                    "logprobs": self.logprobs.then(|| completion_logprobs(&lps[index])),
                    "finish_reason": reasons[index],
                }),
            })
            .collect();
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
        };
        Ok(Json(json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(completion, reused),
        }))
        .into_response())
    }

    /// Tool call `k` of choice `index`, as a message holds it (or a streamed delta, with
    /// `position`).
    fn tool_call(
        &self,
        index: usize,
        k: usize,
        name: &str,
        arguments: &str,
        position: Option<usize>,
    ) -> Value {
        let mut call = json!({
            "id": format!("call_{}_{index}_{k}", self.id),
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        });
        if let Some(p) = position {
            call["index"] = p.into();
        }
        call
    }

    /// One chunk of a streamed answer.
    fn chunk(&self, choices: Value, usage: Option<Value>) -> SseEvent {
        let object = match self.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut c = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let Some(u) = usage {
            c["usage"] = u;
        }
        SseEvent::default().data(c.to_string())
    }

    fn choice(&self, index: usize, text: Option<&str>, reason: Option<&str>, first: bool) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": reason})
            }
            Endpoint::Completions => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": reason})
            }
        }
    }

    /// The chunks of chat choice `index` for `parts` (the first also says the role); calls
    /// made so far are counted in `calls`.
    fn part_chunks(
        &self,
        index: usize,
        parts: Vec<Part>,
        first: &mut bool,
        calls: &mut usize,
        logprobs: Option<&Logprobs>,
    ) -> Vec<SseEvent> {
        let mut out = Vec::new();
        // A token's log-probabilities go with its first chunk, or alone when its text is held.
        let mut lp = logprobs.map(|lp| json!({"content": [chat_logprob(lp)]}));
        if parts.is_empty() {
            if let Some(lp) = lp.take() {
                let mut delta = serde_json::Map::new();
                if std::mem::take(first) {
                    delta.insert("role".into(), "assistant".into());
                }
                let choice = json!({"index": index, "delta": delta, "logprobs": lp, "finish_reason": null});
                out.push(self.chunk(json!([choice]), None));
            }
        }
        for p in parts {
            let mut delta = serde_json::Map::new();
            if std::mem::take(first) {
                delta.insert("role".into(), "assistant".into());
            }
            match p {
                Part::Reasoning(t) => {
                    delta.insert("reasoning_content".into(), t.into());
                }
                Part::Content(t) => {
                    delta.insert("content".into(), t.into());
                }
                Part::ToolCall { name, arguments } => {
                    let call = self.tool_call(index, *calls, &name, &arguments, Some(*calls));
                    delta.insert("tool_calls".into(), json!([call]));
                    *calls += 1;
                }
            }
            let choice =
                json!({"index": index, "delta": delta, "logprobs": lp.take(), "finish_reason": null});
            out.push(self.chunk(json!([choice]), None));
        }
        out
    }

    /// The answer as server-sent events: a chunk a token (for chat, a chunk a part of the
    /// split text; the first of each choice with the role), a last chunk a choice with its
    /// finish reason, the usage if asked, `[DONE]`. Dropping the stream (the client went away)
    /// drops `rx`, which stops the job.
    fn stream(
        self,
        rx: UnboundedReceiver<Event>,
        n: usize,
        include_usage: bool,
    ) -> impl Stream<Item = Result<SseEvent, Infallible>> {
        struct St {
            a: Answer,
            rx: UnboundedReceiver<Event>,
            /// Each choice's splitter (chat), whether its role was sent, its tool calls.
            splitters: Vec<Option<Splitter>>,
            first: Vec<bool>,
            calls: Vec<usize>,
            /// Characters of each choice's text so far (text completions' offsets).
            offsets: Vec<usize>,
            open: usize,
            completion: usize,
            reused: usize,
            include_usage: bool,
            finished: bool,
        }
        let st = St {
            splitters: (0..n).map(|_| self.split.map(Split::splitter)).collect(),
            a: self,
            rx,
            first: vec![true; n],
            calls: vec![0; n],
            offsets: vec![0; n],
            open: n,
            completion: 0,
            reused: 0,
            include_usage,
            finished: false,
        };
        stream::unfold(st, |mut st| async move {
            if st.finished {
                return None;
            }
            if st.open == 0 {
                st.finished = true;
                let mut events = Vec::new();
                if st.include_usage {
                    events.push(st.a.chunk(json!([]), Some(st.a.usage(st.completion, st.reused))));
                }
                events.push(SseEvent::default().data("[DONE]"));
                return Some((events, st));
            }
            let events = match st.rx.recv().await {
                Some(Event::Piece {
                    index,
                    text,
                    logprobs,
                }) => match &mut st.splitters[index] {
                    Some(sp) => {
                        let parts = sp.push(&text);
                        let (first, calls) = (&mut st.first[index], &mut st.calls[index]);
                        st.a.part_chunks(index, parts, first, calls, logprobs.as_ref())
                    }
                    None => {
                        let first = std::mem::take(&mut st.first[index]);
                        let mut choice = st.a.choice(index, Some(&text), None, first);
                        if let Some(lp) = logprobs {
                            let at = st.offsets[index];
                            choice["logprobs"] = match st.a.endpoint {
                                Endpoint::Chat => json!({"content": [chat_logprob(&lp)]}),
                                Endpoint::Completions => completion_logprobs(&[(lp, at)]),
                            };
                        }
                        st.offsets[index] += text.chars().count();
                        vec![st.a.chunk(json!([choice]), None)]
                    }
                },
                Some(Event::Done {
                    index,
                    reason,
                    tokens,
                    reused,
                }) => {
                    st.open -= 1;
                    st.completion += tokens;
                    if index == 0 {
                        st.reused = reused;
                    }
                    let mut events = match &mut st.splitters[index] {
                        Some(sp) => {
                            let parts = sp.finish();
                            st.a.part_chunks(index, parts, &mut st.first[index], &mut st.calls[index], None)
                        }
                        None => Vec::new(),
                    };
                    let first = std::mem::take(&mut st.first[index]);
                    let reason = finish_reason(reason, st.calls[index]);
                    events.push(st.a.chunk(json!([st.a.choice(index, None, Some(reason), first)]), None));
                    events
                }
                Some(Event::Failed(e)) => {
                    st.finished = true;
                    vec![SseEvent::default().data(ApiError::internal(e).body().to_string())]
                }
                None => {
                    st.finished = true;
                    let e = ApiError::internal("the engine stopped before the answer was complete");
                    vec![SseEvent::default().data(e.body().to_string())]
                }
            };
            Some((events, st))
        })
        .flat_map(|events| stream::iter(events.into_iter().map(Ok)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer() -> Answer {
        Answer {
            id: "chatcmpl-t".into(),
            endpoint: Endpoint::Chat,
            model: "m".into(),
            created: 0,
            prompt_tokens: 3,
            split: Some(Split {
                thinking: true,
                opened: false,
                tools: true,
            }),
            logprobs: false,
        }
    }

    /// The events of one choice answering with thinking, text and a tool call, in pieces.
    fn events() -> UnboundedReceiver<Event> {
        let (tx, rx) = unbounded_channel();
        let text = "<think>The user wants weather.</think>\n\nChecking.<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        for piece in text.as_bytes().chunks(5) {
            let text = String::from_utf8(piece.to_vec()).unwrap();
            tx.send(Event::Piece {
                index: 0,
                text,
                logprobs: None,
            })
            .unwrap();
        }
        tx.send(Event::Done {
            index: 0,
            reason: StopReason::Eos,
            tokens: 30,
            reused: 0,
        })
        .unwrap();
        rx
    }

    #[tokio::test]
    async fn a_chat_answer_splits_into_reasoning_content_and_tool_calls() {
        let response = answer().collect(events(), 1, None).await.unwrap();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        let m = &choice["message"];
        assert_eq!(m["reasoning_content"], "The user wants weather.");
        assert_eq!(m["content"], "Checking.");
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "weather");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], r#"{"city":"Oslo"}"#);
        assert_eq!(v["usage"]["completion_tokens"], 30);
    }

    #[tokio::test]
    async fn a_streamed_chat_answer_splits_the_same_way() {
        let response = Sse::new(answer().stream(events(), 1, true)).into_response();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let text = String::from_utf8(body.to_vec()).unwrap();
        let data: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(data.last(), Some(&"[DONE]"));
        let chunks: Vec<Value> = data[..data.len() - 1]
            .iter()
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let join = |key: &str| -> String {
            chunks
                .iter()
                .filter_map(|c| c["choices"].get(0)?["delta"][key].as_str())
                .collect()
        };
        assert_eq!(join("reasoning_content"), "The user wants weather.");
        assert_eq!(join("content"), "Checking.");
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0)?["delta"].get("tool_calls"))
            .collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0][0]["index"], 0);
        assert_eq!(calls[0][0]["function"]["arguments"], r#"{"city":"Oslo"}"#);
        let finish = &chunks[chunks.len() - 2]["choices"][0]["finish_reason"];
        assert_eq!(finish, "tool_calls");
        assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 30);
    }

    #[test]
    fn keys_compare_whole() {
        assert!(same_key(b"secret", b"secret"));
        for other in [&b"secreT"[..], b"secre", b"secrets", b"", b"Secret"] {
            assert!(!same_key(other, b"secret"), "{other:?}");
        }
    }
}
