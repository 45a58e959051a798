//! What a model is made of before it meets a backend: where it comes from ([`ModelSource`]),
//! its files read once ([`Model`]), and the sampling settings it defaults to with the caller's
//! overrides ([`SamplingOverrides`]).

use std::path::{Path, PathBuf};

use kestrel_core::quant::QuantFormat;
use kestrel_core::rng::Rng;
use kestrel_model::{synthetic_model, ModelConfig, Weights};
use kestrel_text::{ChatInput, ChatTemplate, GenerationConfig, SamplingParams, TextError, Tokenizer};
use serde_json::{Map, Value};

use crate::builtin;
use crate::error::{EngineError, Result};

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelSource {
    /// A Hugging Face or MLX model directory, or a GGUF file (the first or any split of one).
    Dir(PathBuf),
    /// The small model built into the binary (`models/kestrel-tiny` in the repository).
    Builtin,
    /// A named real configuration with random weights built in memory (see
    /// [`kestrel_model::SYNTHETIC_MODELS`]), optionally cut to its first `layers`.
    Synthetic {
        name: String,
        layers: Option<usize>,
        format: QuantFormat,
        seed: u64,
    },
}

impl ModelSource {
    /// The directory if given, else the built-in model.
    pub fn dir_or_builtin(dir: Option<PathBuf>) -> ModelSource {
        dir.map_or(ModelSource::Builtin, ModelSource::Dir)
    }
}

/// A model's files, read once: config, weights (memory-mapped for a directory), and the text
/// side.
pub struct Model {
    /// How messages name the model: its directory, or a description.
    pub label: String,
    pub config: ModelConfig,
    pub weights: Weights,
    pub text: ModelText,
}

/// What turns text into a model's token ids and back: the tokenizer (when there is one), the
/// chat template (compiled once) and the generation config.
pub struct ModelText {
    /// How messages name the model.
    label: String,
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub generation: GenerationConfig,
}

impl Model {
    /// Reads the model `source` names. A directory that does not exist is an error saying so.
    pub fn open(source: &ModelSource) -> Result<Model> {
        match source {
            ModelSource::Dir(file) if file.is_file() => open_gguf_file(file),
            ModelSource::Dir(dir) => {
                if !dir.is_dir() {
                    let what = if dir.exists() {
                        "is neither a directory nor a file"
                    } else {
                        "does not exist"
                    };
                    let kind = if dir.extension().is_some_and(|e| e == "gguf") {
                        "file"
                    } else {
                        "directory"
                    };
                    return Err(EngineError::Invalid(format!(
                        "the model {kind} {} {what}",
                        dir.display()
                    )));
                }
                let label = dir.display().to_string();
                Ok(Model {
                    config: ModelConfig::from_dir(dir)?,
                    weights: Weights::open(dir)?,
                    text: ModelText::new(
                        &label,
                        Tokenizer::from_dir(dir)?,
                        GenerationConfig::from_dir(dir)?,
                    )?,
                    label,
                })
            }
            ModelSource::Builtin => open_builtin(),
            ModelSource::Synthetic {
                name,
                layers,
                format,
                seed,
            } => {
                let (config, weights) = synthetic_model(name, *layers, *format, *seed)?;
                let label = format!(
                    "{name} (synthetic, {} layers, {}-bit)",
                    config.layers, format.bits
                );
                Ok(Model {
                    config,
                    weights,
                    text: ModelText::new(&label, None, GenerationConfig::default())?,
                    label,
                })
            }
        }
    }
}

/// A GGUF file: its config, weights, tokenizer, chat template and special tokens, all from the
/// file (nothing beside it is read).
fn open_gguf_file(path: &Path) -> Result<Model> {
    let m = kestrel_model::open_gguf(path)?;
    let label = path.display().to_string();
    let tokenizer = match &m.tokenizer {
        Some(json) => {
            let json = serde_json::to_vec(json).map_err(|e| EngineError::Invalid(format!("{label}: {e}")))?;
            let config = m.tokenizer_config.to_string();
            Some(Tokenizer::from_bytes(&json, Some(&config), path, path)?)
        }
        None => None,
    };
    let generation =
        GenerationConfig::from_json(&m.generation_config.to_string()).map_err(|reason| TextError::File {
            path: path.to_path_buf(),
            reason,
        })?;
    Ok(Model {
        config: m.config,
        weights: m.weights,
        text: ModelText::new(&label, tokenizer, generation)?,
        label,
    })
}

/// The built-in model's files, read from the binary.
fn open_builtin() -> Result<Model> {
    let at = |file: &str| Path::new(builtin::LABEL).join(file);
    let generation = GenerationConfig::from_json(builtin::GENERATION).map_err(|reason| TextError::File {
        path: at("generation_config.json"),
        reason,
    })?;
    let tokenizer = Tokenizer::from_bytes(
        builtin::TOKENIZER,
        Some(builtin::TOKENIZER_CONFIG),
        &at("tokenizer.json"),
        &at("tokenizer_config.json"),
    )?;
    Ok(Model {
        label: builtin::LABEL.to_string(),
        config: ModelConfig::from_json(builtin::CONFIG)?,
        weights: Weights::from_safetensors_bytes(builtin::LABEL, builtin::WEIGHTS.to_vec())?,
        text: ModelText::new(builtin::LABEL, Some(tokenizer), generation)?,
    })
}

impl ModelText {
    /// The text side of the model `label` names; its chat template is compiled here.
    pub fn new(label: &str, tokenizer: Option<Tokenizer>, generation: GenerationConfig) -> Result<ModelText> {
        let template = match &tokenizer {
            Some(t) => t.template()?,
            None => None,
        };
        Ok(ModelText {
            label: label.to_string(),
            tokenizer,
            template,
            generation,
        })
    }

    /// A copy for another thread: the same tokenizer and generation config, the chat template
    /// compiled again (renders on one copy never wait on the other's).
    pub fn fork(&self) -> Result<ModelText> {
        Ok(ModelText {
            label: self.label.clone(),
            tokenizer: self.tokenizer.clone(),
            template: self.template.as_ref().map(ChatTemplate::fork).transpose()?,
            generation: self.generation.clone(),
        })
    }

    /// How messages name the model.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The end-of-sequence ids: the generation config's and the tokenizer's EOS token.
    pub fn eos_ids(&self) -> Vec<u32> {
        let mut eos = self.generation.eos_token_ids.clone();
        let tokenizer_eos = self
            .tokenizer
            .as_ref()
            .and_then(|t| t.eos_token.as_deref().and_then(|e| t.token_id(e)));
        if let Some(t) = tokenizer_eos {
            if !eos.contains(&t) {
                eos.push(t);
            }
        }
        eos
    }

    /// The prompt as token ids: `text` through the chat template (with a system message and
    /// the template variables `extra`) when the model has one and `raw` is false, else encoded
    /// as it is with the tokenizer's special tokens.
    pub fn encode_prompt(
        &self,
        text: &str,
        system: Option<&str>,
        raw: bool,
        extra: &Map<String, Value>,
    ) -> Result<Vec<u32>> {
        let Some(t) = &self.tokenizer else {
            return Err(EngineError::Invalid(format!(
                "{} has no tokenizer.json: give the prompt as token ids (--prompt-tokens)",
                self.label
            )));
        };
        match (&self.template, raw) {
            (Some(_), false) => {
                let mut messages = Vec::new();
                if let Some(s) = system {
                    messages.push(serde_json::json!({"role": "system", "content": s}));
                }
                messages.push(serde_json::json!({"role": "user", "content": text}));
                self.encode_chat(&messages, extra)
            }
            _ => Ok(t.encode(text, true)?),
        }
    }

    /// A conversation (objects with `role` and `content`) rendered through the chat template,
    /// ending with the opening of an assistant turn, as token ids.
    pub fn encode_chat(&self, messages: &[Value], extra: &Map<String, Value>) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, None, extra)
    }

    /// [`ModelText::encode_chat`] with tool descriptions (JSON schemas) given to the template.
    pub fn encode_chat_with_tools(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        extra: &Map<String, Value>,
    ) -> Result<Vec<u32>> {
        let (Some(t), Some(template)) = (&self.tokenizer, &self.template) else {
            return Err(EngineError::Invalid(format!(
                "{} has no chat template (tokenizer_config.json or chat_template.jinja)",
                self.label
            )));
        };
        let rendered = template
            .render(&ChatInput {
                messages,
                tools,
                add_generation_prompt: true,
                bos_token: t.bos_token.as_deref(),
                eos_token: t.eos_token.as_deref(),
                extra: extra.clone(),
            })
            .map_err(|e| t.in_template_file(e))?;
        Ok(t.encode(&rendered, false)?)
    }
}

/// Sampling settings a caller gives; each one left `None` takes the model's
/// `generation_config.json` value (transformers' default without one).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// The generator's seed; drawn from the clock when not given.
    pub seed: Option<u64>,
}

impl SamplingOverrides {
    /// The model's defaults, then these; the seed drawn from the clock when not given.
    pub fn resolve(&self, generation: &GenerationConfig) -> SamplingParams {
        let d = generation.sampling();
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed.unwrap_or_else(|| Rng::from_time().1),
        }
    }
}
