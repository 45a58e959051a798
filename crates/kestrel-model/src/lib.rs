//! Kestrel's model side: what a model directory declares about its architecture
//! ([`ModelConfig`], from Hugging Face and MLX `config.json` files of both generations) and its
//! memory-mapped weights ([`Weights`]).

pub mod config;
pub mod error;
pub mod weights;

pub use config::{
    Arch, LayerKind, LinearAttnConfig, MlpKind, ModelConfig, MoeConfig, QuantConfig, RopeConfig,
};
pub use error::{ModelError, Result};
pub use weights::{Tensor, Weights};
