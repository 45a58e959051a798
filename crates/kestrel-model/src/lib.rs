//! Kestrel's model side: what a model directory declares about its architecture
//! ([`ModelConfig`]), read from Hugging Face and MLX `config.json` files of both generations.

pub mod config;
pub mod error;

pub use config::{
    Arch, LayerKind, LinearAttnConfig, MlpKind, ModelConfig, MoeConfig, QuantConfig, RopeConfig,
};
pub use error::{ModelError, Result};
