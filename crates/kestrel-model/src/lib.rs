//! Kestrel's model side: what a model directory declares about its architecture
//! ([`ModelConfig`], from Hugging Face and MLX `config.json` files of both generations), its
//! memory-mapped weights ([`Weights`]), a layer's experts packed for the engine
//! ([`pack_experts`]), forward graphs of every supported architecture ([`Forward`]), a model
//! running on a backend ([`Session`]) and random models at real shapes ([`synthetic_model`]).

pub mod config;
pub mod error;
pub mod expert_cache;
pub mod expert_disk;
pub mod experts;
pub mod footprint;
pub mod gguf;
pub mod gguf_dequant;
pub mod gguf_model;
pub mod graph;
pub mod quantize;
pub mod session;
pub mod synthetic;
pub mod weights;

pub use config::{
    Arch, LayerKind, LinearAttnConfig, MlpKind, ModelConfig, MoeConfig, QuantConfig, RopeConfig,
};
pub use error::{ModelError, Result};
pub use expert_cache::{CacheStats, Eviction};
pub use expert_disk::{DiskStats, ExpertReader};
pub use experts::{
    expert_copy_parts, expert_source, expert_tensor_names, pack_experts, pack_experts_into, CopyPart,
    ExpertSource, PartSource,
};
pub use footprint::{footprint, Footprint};
pub use gguf_model::{gguf_from_bytes, open_gguf, GgufModel};
pub use graph::{Forward, ForwardSpec, HostExperts, KvPool, MoeStep, Streamed, CHUNK_RUN, KV_BLOCK};
pub use quantize::{check_empty_dst, quantize_dir, write_model_dir, QuantizeReport};
pub use session::{batch_bucket, BatchOutput, Output, Session, StageAhead, Want, MAX_PROGRAMS};
pub use synthetic::{synthetic_model, synthetic_model_json, synthetic_weights, SYNTHETIC_MODELS};
pub use weights::{FileIdent, FileSpan, FileTensor, HeldBytes, MappedFile, OwnedTensor, Tensor, Weights};
