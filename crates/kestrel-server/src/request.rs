//! Requests of the OpenAI API read from their JSON, every field checked for its type and range
//! with the field named in the error: `/v1/chat/completions` and `/v1/completions` bodies become
//! a [`Request`]. Fields OpenAI or vLLM define that Kestrel does not implement (`logit_bias`,
//! `suffix`, a `response_format` other than text, ...) are refused by name rather than ignored,
//! and so are unknown ones.

use kestrel_engine::SamplingOverrides;
use serde_json::{Map, Value};

use crate::error::ApiError;

/// The most stop strings a request may give.
pub const MAX_STOPS: usize = 16;
/// The most choices (`n`) a request may ask for.
pub const MAX_N: usize = 16;

/// What a request asks the model for.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A conversation, rendered through the chat template with `tools` and `template_kwargs`.
    Chat {
        messages: Vec<Value>,
        tools: Option<Vec<Value>>,
        /// Whether the answer's tool calls are parsed (tools given, `tool_choice` not "none").
        parse_tools: bool,
        template_kwargs: Map<String, Value>,
    },
    /// A text prompt, encoded as it is (with the tokenizer's special tokens).
    Text(String),
    /// A prompt given as token ids.
    Ids(Vec<u32>),
}

/// A checked completion request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The model named (None: whichever is served).
    pub model: Option<String>,
    pub input: Input,
    pub stream: bool,
    /// With `stream`: a last chunk with the usage.
    pub include_usage: bool,
    /// None: up to the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingOverrides,
    pub stop: Vec<String>,
    pub n: usize,
    /// Completions: the prompt's text before the completion.
    pub echo: bool,
    /// Generate past end-of-sequence ids (vLLM's extension; for benchmarks).
    pub ignore_eos: bool,
    /// Each token's log-probability and those of this many most likely tokens (None: none).
    pub logprobs: Option<usize>,
}

/// The most alternatives a token's log-probabilities may list.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Which endpoint a body came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// Fields either endpoint accepts.
const COMMON: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "n",
    "user",
    "logprobs",
    "logit_bias",
    "ignore_eos",
];
const CHAT_ONLY: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",
    "top_logprobs",
    "response_format",
];
const COMPLETIONS_ONLY: &[&str] = &["prompt", "echo", "suffix", "best_of"];

/// Reads a request body of `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<Request, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(o) = value else {
        return Err(ApiError::bad("the body must be a JSON object"));
    };
    let own = match endpoint {
        Endpoint::Chat => CHAT_ONLY,
        Endpoint::Completions => COMPLETIONS_ONLY,
    };
    if let Some(k) = o
        .keys()
        .find(|k| !COMMON.contains(&k.as_str()) && !own.contains(&k.as_str()))
    {
        return Err(ApiError::field(k, format!("unrecognized request argument `{k}`")));
    }
    let f = Fields(&o);
    let input = match endpoint {
        Endpoint::Chat => chat_input(&f)?,
        Endpoint::Completions => prompt_input(&f)?,
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match o.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(so)) => {
            if !stream {
                return Err(ApiError::field(
                    "stream_options",
                    "`stream_options` is only allowed with `stream: true`",
                ));
            }
            if let Some(k) = so.keys().find(|k| *k != "include_usage") {
                return Err(ApiError::field(
                    format!("stream_options.{k}"),
                    format!("unrecognized argument `{k}`"),
                ));
            }
            Fields(so)
                .bool("include_usage")
                .map_err(|e| prefix("stream_options", e))?
                .unwrap_or(false)
        }
        Some(_) => {
            return Err(ApiError::field(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };
    let max_tokens = match (f.count("max_tokens")?, f.count("max_completion_tokens")?) {
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "max_tokens",
                "give `max_tokens` or `max_completion_tokens`, not both",
            ))
        }
        (a, b) => a.or(b),
    };
    if max_tokens == Some(0) {
        let name = if o.contains_key("max_tokens") {
            "max_tokens"
        } else {
            "max_completion_tokens"
        };
        return Err(ApiError::field(name, format!("`{name}` must be at least 1")));
    }
    let sampling = SamplingOverrides {
        temperature: f.number("temperature", 0.0, 2.0)?,
        top_p: match f.number("top_p", 0.0, 1.0)? {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::field("top_p", "`top_p` must be above 0 and at most 1"))
            }
            p => p,
        },
        top_k: match o.get("top_k") {
            None | Some(Value::Null) => None,
            // vLLM's "no limit".
            Some(v) if v.as_i64() == Some(-1) => Some(0),
            _ => f
                .count("top_k")
                .map_err(|_| ApiError::field("top_k", "`top_k` must be -1, 0 or a positive integer"))?,
        },
        min_p: f.number("min_p", 0.0, 1.0)?,
        presence_penalty: f.number("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: f.number("frequency_penalty", -2.0, 2.0)?,
        repetition_penalty: match f.number("repetition_penalty", 0.0, 1e6)? {
            Some(r) if r <= 0.0 => {
                return Err(ApiError::field(
                    "repetition_penalty",
                    "`repetition_penalty` must be above 0",
                ))
            }
            r => r,
        },
        seed: match o.get("seed") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_i64()
                    .map(|s| s as u64)
                    .or_else(|| v.as_u64())
                    .ok_or_else(|| ApiError::field("seed", "`seed` must be an integer"))?,
            ),
        },
    };
    let stop = match o.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::field(format!("stop.{i}"), "each stop sequence must be a string")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::field(
                "stop",
                "`stop` must be a string or an array of strings",
            ))
        }
    };
    if stop.len() > MAX_STOPS {
        return Err(ApiError::field(
            "stop",
            format!("`stop` may hold at most {MAX_STOPS} strings"),
        ));
    }
    if let Some(i) = stop.iter().position(String::is_empty) {
        return Err(ApiError::field(
            format!("stop.{i}"),
            "a stop sequence must not be empty",
        ));
    }
    let n = f.count("n")?.unwrap_or(1);
    if n == 0 || n > MAX_N {
        return Err(ApiError::field("n", format!("`n` must be 1 to {MAX_N}")));
    }
    f.string("user")?;
    let logprobs = match endpoint {
        Endpoint::Chat => {
            let on = f.bool("logprobs")?.unwrap_or(false);
            match f.count("top_logprobs")? {
                Some(_) if !on => {
                    return Err(ApiError::field(
                        "top_logprobs",
                        "`top_logprobs` needs `logprobs: true`",
                    ))
                }
                Some(k) if k > MAX_TOP_LOGPROBS => {
                    return Err(ApiError::field(
                        "top_logprobs",
                        format!("`top_logprobs` must be 0 to {MAX_TOP_LOGPROBS}"),
                    ))
                }
                k => on.then(|| k.unwrap_or(0)),
            }
        }
        Endpoint::Completions => match f.count("logprobs")? {
            Some(k) if k > MAX_TOP_LOGPROBS => {
                return Err(ApiError::field(
                    "logprobs",
                    format!("`logprobs` must be 0 to {MAX_TOP_LOGPROBS}"),
                ))
            }
            k => k,
        },
    };
    // Fields Kestrel does not implement: refused unless they ask for nothing.
    match o.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(_) => {
            return Err(ApiError::field(
                "logit_bias",
                "`logit_bias` is not supported by this server",
            ))
        }
    }
    match o.get("response_format") {
        None | Some(Value::Null) => {}
        Some(v) if v.get("type").and_then(Value::as_str) == Some("text") => {}
        Some(_) => {
            return Err(ApiError::field(
                "response_format",
                "only `{\"type\": \"text\"}` is supported as `response_format`",
            ))
        }
    }
    if o.get("suffix").is_some_and(|v| !v.is_null()) {
        return Err(ApiError::field(
            "suffix",
            "`suffix` is not supported by this server",
        ));
    }
    match f.count("best_of")? {
        None => {}
        Some(b) if b == n => {}
        Some(_) => {
            return Err(ApiError::field(
                "best_of",
                "`best_of` other than `n` is not supported by this server",
            ))
        }
    }
    let echo = f.bool("echo")?.unwrap_or(false);
    if echo && stream {
        return Err(ApiError::field(
            "echo",
            "`echo` is not supported with `stream: true`",
        ));
    }
    Ok(Request {
        model: f.string("model")?,
        input,
        stream,
        include_usage,
        max_tokens,
        sampling,
        stop,
        n,
        echo,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        logprobs,
    })
}

/// `messages`, `tools`, `tool_choice` and `chat_template_kwargs` of a chat request.
fn chat_input(f: &Fields) -> Result<Input, ApiError> {
    let messages = match f.0.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => return Err(ApiError::field("messages", "`messages` must not be empty")),
        Some(_) => {
            return Err(ApiError::field(
                "messages",
                "`messages` must be an array of messages",
            ))
        }
        None => return Err(ApiError::field("messages", "`messages` is required")),
    };
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(m).map_err(|e| prefix(&format!("messages.{i}"), e)))
        .collect::<Result<Vec<_>, _>>()?;
    let tools = match f.0.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) => {
            for (i, tool) in t.iter().enumerate() {
                let ok = tool.get("type").and_then(Value::as_str) == Some("function")
                    && tool
                        .get("function")
                        .and_then(|f| f.get("name"))
                        .is_some_and(Value::is_string);
                if !ok {
                    return Err(ApiError::field(
                        format!("tools.{i}"),
                        "a tool must be `{\"type\": \"function\", \"function\": {\"name\": ...}}`",
                    ));
                }
            }
            Some(t.clone())
        }
        Some(_) => return Err(ApiError::field("tools", "`tools` must be an array")),
    };
    let parse_tools = match f.0.get("tool_choice") {
        None | Some(Value::Null) => tools.is_some(),
        Some(Value::String(s)) if s == "auto" => tools.is_some(),
        Some(Value::String(s)) if s == "none" => false,
        Some(_) => {
            return Err(ApiError::field(
                "tool_choice",
                "`tool_choice` may be \"auto\" or \"none\" (a forced tool is not supported)",
            ))
        }
    };
    f.bool("parallel_tool_calls")?;
    let template_kwargs = match f.0.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(_) => {
            return Err(ApiError::field(
                "chat_template_kwargs",
                "`chat_template_kwargs` must be an object",
            ))
        }
    };
    Ok(Input::Chat {
        messages,
        tools,
        parse_tools,
        template_kwargs,
    })
}

/// One message, checked: a known role, and content as a string, text parts (joined) or null
/// where OpenAI allows it. Other fields (`name`, `tool_calls`, `tool_call_id`,
/// `reasoning_content`) pass to the template as they are.
fn message(m: &Value) -> Result<Value, ApiError> {
    let Value::Object(o) = m else {
        return Err(ApiError::bad("a message must be an object"));
    };
    let role = match o.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(_) => return Err(ApiError::field("role", "`role` must be a string")),
        None => return Err(ApiError::field("role", "`role` is required")),
    };
    if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
        return Err(ApiError::field(
            "role",
            format!("unknown role `{role}`: system, developer, user, assistant or tool"),
        ));
    }
    let content = match o.get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (i, p) in parts.iter().enumerate() {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some("text"), None) => {
                        return Err(ApiError::field(
                            format!("content.{i}.text"),
                            "a text part needs `text`",
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::field(
                            format!("content.{i}.type"),
                            format!("content parts of type `{other}` are not supported (text only)"),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::field(
                            format!("content.{i}.type"),
                            "a content part needs `type`",
                        ))
                    }
                }
            }
            Value::String(text)
        }
        None | Some(Value::Null) if role == "assistant" => Value::Null,
        None | Some(Value::Null) => return Err(ApiError::field("content", "`content` is required")),
        Some(_) => {
            return Err(ApiError::field(
                "content",
                "`content` must be a string or an array of text parts",
            ))
        }
    };
    let mut out = o.clone();
    out.insert("content".into(), content);
    Ok(Value::Object(out))
}

/// `prompt` of a completions request: a string, token ids, or an array holding one of either.
fn prompt_input(f: &Fields) -> Result<Input, ApiError> {
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter()
            .map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect()
    };
    match f.0.get("prompt") {
        Some(Value::String(s)) if !s.is_empty() => Ok(Input::Text(s.clone())),
        Some(Value::Array(a)) if !a.is_empty() => {
            if let Some(ids) = ids(a) {
                return Ok(Input::Ids(ids));
            }
            match a.as_slice() {
                [Value::String(s)] if !s.is_empty() => Ok(Input::Text(s.clone())),
                [Value::Array(inner)] if !inner.is_empty() => ids(inner).map(Input::Ids).ok_or_else(|| {
                    ApiError::field("prompt.0", "token ids must be integers from 0 to 2^32 - 1")
                }),
                [_] => Err(ApiError::field(
                    "prompt.0",
                    "a prompt must be a non-empty string or token ids",
                )),
                _ => Err(ApiError::field(
                    "prompt",
                    "one prompt a request: batch prompts are not supported",
                )),
            }
        }
        Some(Value::String(_)) | Some(Value::Array(_)) => {
            Err(ApiError::field("prompt", "the prompt is empty"))
        }
        Some(_) => Err(ApiError::field(
            "prompt",
            "`prompt` must be a string or token ids",
        )),
        None => Err(ApiError::field("prompt", "`prompt` is required")),
    }
}

/// An error about a field inside `outer`, named with its path.
fn prefix(outer: &str, mut e: ApiError) -> ApiError {
    e.param = Some(match e.param {
        Some(p) => format!("{outer}.{p}"),
        None => outer.to_string(),
    });
    e
}

/// Typed reads of an object's fields; a null field is an absent one.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_bool()
                    .ok_or_else(|| ApiError::field(name, format!("`{name}` must be true or false")))
            })
            .transpose()
    }

    fn string(&self, name: &str) -> Result<Option<String>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::field(name, format!("`{name}` must be a string")))
            })
            .transpose()
    }

    /// A non-negative integer that fits a `usize`.
    fn count(&self, name: &str) -> Result<Option<usize>, ApiError> {
        self.get(name)
            .map(|v| {
                v.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| ApiError::field(name, format!("`{name}` must be a non-negative integer")))
            })
            .transpose()
    }

    /// A number in `lo..=hi`, as f32.
    fn number(&self, name: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        self.get(name)
            .map(|v| match v.as_f64() {
                Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x as f32),
                Some(_) => Err(ApiError::field(
                    name,
                    format!("`{name}` must be from {lo} to {hi}"),
                )),
                None => Err(ApiError::field(name, format!("`{name}` must be a number"))),
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<Request, ApiError> {
        parse(Endpoint::Chat, body.as_bytes())
    }

    const HI: &str = r#""messages": [{"role": "user", "content": "Hi"}]"#;

    #[test]
    fn a_plain_chat_request_reads() {
        let r = chat(&format!(
            r#"{{{HI}, "max_tokens": 5, "temperature": 0, "stop": "x", "seed": -1}}"#
        ))
        .unwrap();
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling.temperature, Some(0.0));
        assert_eq!(r.sampling.seed, Some(u64::MAX));
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert_eq!(r.n, 1);
        assert!(!r.stream);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (format!(r#"{{{HI}, "temperature": "hot"}}"#), "temperature"),
            (format!(r#"{{{HI}, "temperature": -1}}"#), "temperature"),
            (format!(r#"{{{HI}, "top_p": 0}}"#), "top_p"),
            (format!(r#"{{{HI}, "top_k": -2}}"#), "top_k"),
            (format!(r#"{{{HI}, "max_tokens": -3}}"#), "max_tokens"),
            (format!(r#"{{{HI}, "max_tokens": 0}}"#), "max_tokens"),
            (
                format!(r#"{{{HI}, "max_tokens": 1, "max_completion_tokens": 1}}"#),
                "max_tokens",
            ),
            (format!(r#"{{{HI}, "n": 0}}"#), "n"),
            (format!(r#"{{{HI}, "stop": [""]}}"#), "stop.0"),
            (format!(r#"{{{HI}, "stop": [1]}}"#), "stop.0"),
            (format!(r#"{{{HI}, "frobnicate": 1}}"#), "frobnicate"),
            (format!(r#"{{{HI}, "prompt": "x"}}"#), "prompt"),
            (
                format!(r#"{{{HI}, "stream_options": {{"include_usage": true}}}}"#),
                "stream_options",
            ),
            (
                format!(r#"{{{HI}, "stream": true, "stream_options": {{"x": 1}}}}"#),
                "stream_options.x",
            ),
            (format!(r#"{{{HI}, "logprobs": 2}}"#), "logprobs"),
            (format!(r#"{{{HI}, "top_logprobs": 2}}"#), "top_logprobs"),
            (
                format!(r#"{{{HI}, "logprobs": true, "top_logprobs": 21}}"#),
                "top_logprobs",
            ),
            (
                format!(r#"{{{HI}, "repetition_penalty": 0}}"#),
                "repetition_penalty",
            ),
            (
                format!(r#"{{{HI}, "tools": [{{"type": "function"}}]}}"#),
                "tools.0",
            ),
            (r#"{"messages": []}"#.to_string(), "messages"),
            (
                r#"{"messages": [{"role": "robot", "content": "x"}]}"#.to_string(),
                "messages.0.role",
            ),
            (
                r#"{"messages": [{"role": "user"}]}"#.to_string(),
                "messages.0.content",
            ),
            (
                r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#.to_string(),
                "messages.0.content.0.type",
            ),
        ];
        for (body, field) in cases {
            let e = chat(&body).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
    }

    #[test]
    fn bodies_that_are_not_objects_are_refused() {
        for body in ["", "[]", "nul", "{\"messages\": NaN}", "{\"temperature\": 1e999}"] {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
        }
    }

    #[test]
    fn logprobs_read_per_endpoint() {
        let r = chat(&format!(r#"{{{HI}, "logprobs": true, "top_logprobs": 3}}"#)).unwrap();
        assert_eq!(r.logprobs, Some(3));
        assert_eq!(
            chat(&format!(r#"{{{HI}, "logprobs": true}}"#)).unwrap().logprobs,
            Some(0)
        );
        assert_eq!(
            chat(&format!(r#"{{{HI}, "logprobs": false}}"#)).unwrap().logprobs,
            None
        );
        let c = |b: &str| parse(Endpoint::Completions, b.as_bytes());
        assert_eq!(c(r#"{"prompt": "a", "logprobs": 5}"#).unwrap().logprobs, Some(5));
        assert_eq!(
            c(r#"{"prompt": "a", "logprobs": 21}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("logprobs")
        );
        assert_eq!(
            c(r#"{"prompt": "a", "logprobs": true}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("logprobs")
        );
    }

    #[test]
    fn prompts_read_as_text_or_ids() {
        let p = |b: &str| parse(Endpoint::Completions, b.as_bytes()).map(|r| r.input);
        assert_eq!(p(r#"{"prompt": "a"}"#).unwrap(), Input::Text("a".into()));
        assert_eq!(p(r#"{"prompt": ["a"]}"#).unwrap(), Input::Text("a".into()));
        assert_eq!(p(r#"{"prompt": [1, 2]}"#).unwrap(), Input::Ids(vec![1, 2]));
        assert_eq!(p(r#"{"prompt": [[3]]}"#).unwrap(), Input::Ids(vec![3]));
        for bad in [
            r#"{"prompt": ""}"#,
            r#"{"prompt": ["a", "b"]}"#,
            r#"{"prompt": [-1]}"#,
            r#"{"prompt": 3}"#,
            "{}",
        ] {
            assert_eq!(
                p(bad).unwrap_err().param.as_deref().map(|s| &s[..6]),
                Some("prompt"),
                "{bad}"
            );
        }
    }

    #[test]
    fn content_parts_join() {
        let r = chat(r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}"#)
            .unwrap();
        let Input::Chat { messages, .. } = r.input else {
            panic!()
        };
        assert_eq!(messages[0]["content"], "ab");
    }
}
