//! Kestrel's model side: what a model directory declares about its architecture
//! ([`ModelConfig`], from Hugging Face and MLX `config.json` files of both generations), its
//! memory-mapped weights ([`Weights`]), a layer's experts packed for the engine
//! ([`pack_experts`]), forward graphs of every supported architecture ([`Forward`]) and a model
//! running on a backend ([`Session`]).

pub mod config;
pub mod error;
pub mod experts;
pub mod graph;
pub mod quantize;
pub mod session;
pub mod weights;

pub use config::{
    Arch, LayerKind, LinearAttnConfig, MlpKind, ModelConfig, MoeConfig, QuantConfig, RopeConfig,
};
pub use error::{ModelError, Result};
pub use experts::{expert_source, pack_experts, ExpertSource};
pub use graph::{Forward, ForwardSpec};
pub use quantize::{quantize_dir, QuantizeReport};
pub use session::Session;
pub use weights::{Tensor, Weights};
