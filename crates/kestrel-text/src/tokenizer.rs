//! A model directory's tokenizer: `tokenizer.json` through the Hugging Face `tokenizers` crate,
//! with what `tokenizer_config.json` (and `chat_template.jinja`) add: the special tokens' text
//! and the chat template.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Result, TextError};
use crate::template::ChatTemplate;

#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// The text of the beginning- and end-of-sequence tokens, when the config names them.
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The template's source, from `chat_template.jinja` or `tokenizer_config.json`.
    pub chat_template: Option<String>,
    /// The file the template came from, named in its errors.
    pub chat_template_path: Option<PathBuf>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TextError + '_ {
    move |error| TextError::Io {
        path: path.to_path_buf(),
        error,
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> TextError {
    TextError::File {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A special token as `tokenizer_config.json` gives it: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// What `tokenizer_config.json` adds to `tokenizer.json`: the special tokens' text and the chat
/// template (a string, or the one named "default" of a list of named templates).
#[derive(Debug, Default)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// The config in `text`, the contents of the file `path` (named in errors).
    pub fn parse(text: &str, path: &Path) -> Result<TokenizerConfig> {
        let config: Value =
            serde_json::from_str(text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
        let chat_template = match config.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|e| e.get("template")?.as_str())
                .map(str::to_string),
            _ => None,
        };
        Ok(TokenizerConfig {
            bos_token: token_text(config.get("bos_token")),
            eos_token: token_text(config.get("eos_token")),
            chat_template,
        })
    }
}

/// The largest `tokenizer.json` read (published ones are tens of MiB at most): its parse holds a
/// few times its size.
pub const MAX_TOKENIZER_BYTES: usize = 256 << 20;

impl Tokenizer {
    /// The tokenizer of model directory `dir`, or None when it has no `tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Option<Tokenizer>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let size = std::fs::metadata(&path).map_err(io(&path))?.len();
        if size > MAX_TOKENIZER_BYTES as u64 {
            return Err(bad(
                &path,
                format!("{size} bytes, more than a tokenizer holds (at most {MAX_TOKENIZER_BYTES})"),
            ));
        }
        let json = std::fs::read(&path).map_err(io(&path))?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            Some(std::fs::read_to_string(&config_path).map_err(io(&config_path))?)
        } else {
            None
        };
        let mut t = Tokenizer::from_bytes(&json, config.as_deref(), &path, &config_path)?;
        let jinja: PathBuf = dir.join("chat_template.jinja");
        if jinja.exists() {
            t.chat_template = Some(std::fs::read_to_string(&jinja).map_err(io(&jinja))?);
            t.chat_template_path = Some(jinja);
        }
        Ok(Some(t))
    }

    /// A tokenizer from the contents of `tokenizer.json` and (if any) `tokenizer_config.json`;
    /// `json_path` and `config_path` name them in errors.
    pub fn from_bytes(
        json: &[u8],
        config: Option<&str>,
        json_path: &Path,
        config_path: &Path,
    ) -> Result<Tokenizer> {
        if json.len() > MAX_TOKENIZER_BYTES {
            return Err(bad(
                json_path,
                format!(
                    "{} bytes, more than a tokenizer holds (at most {MAX_TOKENIZER_BYTES})",
                    json.len()
                ),
            ));
        }
        // Parsed as JSON first, then read by the tokenizers crate from the parsed value: from
        // the bytes it panics (instead of failing) on some invalid JSON (bytes that are not
        // UTF-8, bad escapes) inside its `decoder` section.
        let value: Value =
            serde_json::from_slice(json).map_err(|e| bad(json_path, format!("not valid JSON: {e}")))?;
        let inner: tokenizers::Tokenizer =
            serde_json::from_value(value).map_err(|e| bad(json_path, e.to_string()))?;
        let config = match config {
            Some(text) => TokenizerConfig::parse(text, config_path)?,
            None => TokenizerConfig::default(),
        };
        let chat_template_path = config.chat_template.as_ref().map(|_| config_path.to_path_buf());
        Ok(Tokenizer {
            inner,
            bos_token: config.bos_token,
            eos_token: config.eos_token,
            chat_template: config.chat_template,
            chat_template_path,
        })
    }

    /// The compiled chat template, if the model has one; an error names the file it came from.
    pub fn template(&self) -> Result<Option<ChatTemplate>> {
        let Some(source) = self.chat_template.as_deref() else {
            return Ok(None);
        };
        ChatTemplate::new(source)
            .map(Some)
            .map_err(|e| self.in_template_file(e))
    }

    /// `e`, a chat template's error, as an error of the file the template came from.
    pub fn in_template_file(&self, e: TextError) -> TextError {
        match &self.chat_template_path {
            Some(path) => bad(path, e.to_string()),
            None => e,
        }
    }

    /// Token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds
    /// (a BOS, for Llama), as for a raw prompt. Text rendered by a chat template already holds
    /// its special tokens: encode it without.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// The id of a token given by its text (special tokens included).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// A streaming decoder for generated ids (special tokens skipped).
    pub fn stream(&self) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            ids: IdStream::default(),
        }
    }
}

/// Text of generated ids as they arrive: each push returns the text that is complete, holding
/// back ids whose bytes do not yet end a character (a character split over tokens is never
/// printed in halves), and decoding with a little left context, as the whole sequence would.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    ids: IdStream,
}

impl TextStream<'_> {
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(self.tokenizer, id)
    }

    /// Whatever is still held back (at the end of generation), replacement characters and all.
    pub fn finish(&mut self) -> Result<String> {
        self.ids.finish(self.tokenizer)
    }
}

/// [`TextStream`]'s state without the tokenizer, which each call is given: for holders of
/// many streams over one tokenizer (a batch of sequences).
#[derive(Debug, Clone, Default)]
pub struct IdStream {
    ids: Vec<u32>,
    /// `ids[prefix..read]` was printed already and is kept as context.
    prefix: usize,
    read: usize,
}

impl IdStream {
    /// [`TextStream::push`].
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], true)?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(now[before.len()..].to_string());
        }
        Ok(String::new())
    }

    /// [`TextStream::finish`].
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], true)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}
