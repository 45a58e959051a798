//! Kestrel's text side: a model directory's tokenizer ([`Tokenizer`], through the Hugging Face
//! `tokenizers` crate) with streaming detokenisation ([`TextStream`]), chat templates rendered as
//! transformers renders them ([`ChatTemplate`]), stop strings ([`StopStrings`]), the sampling
//! defaults of `generation_config.json` ([`GenerationConfig`]) and the host sampler
//! ([`Sampler`]). Chat templates render in a sandbox ([`sandbox`]) whose memory bound needs
//! [`BoundedAlloc`] as the binary's global allocator.

pub mod error;
pub mod generation;
pub mod sample;
pub mod sandbox;
pub mod stop;
pub mod template;
pub mod tokenizer;

pub use error::{Result, TextError};
pub use generation::GenerationConfig;
pub use sample::{argmax, Sampler, SamplingParams};
pub use sandbox::BoundedAlloc;
pub use stop::{Released, StopStrings};
pub use template::{ChatInput, ChatTemplate, RenderLimits, MAX_ABANDONED};
pub use tokenizer::{IdStream, TextStream, Tokenizer, TokenizerConfig, MAX_TOKENIZER_BYTES};
