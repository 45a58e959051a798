//! Errors of reading model directories: each names the file, key or architecture at fault.

use std::path::{Path, PathBuf};

/// Each message carries its cause in full (no separate `source`, so chains do not repeat it).
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("reading {}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("not valid JSON: {0}")]
    Json(String),
    #[error("config key `{key}`: {reason}")]
    Config { key: String, reason: String },
    #[error("unknown model_type {model_type:?}; supported: {supported}")]
    UnknownArch { model_type: String, supported: String },
    #[error("tensor {name} not found in the weights of {}", dir.display())]
    MissingTensor { name: String, dir: PathBuf },
    #[error("{}: {reason}", path.display())]
    Weights { path: PathBuf, reason: String },
    #[error("tensor {name}: {reason}")]
    Tensor { name: String, reason: String },
    #[error("backend: {0}")]
    Backend(Box<dyn std::error::Error + Send + Sync>),
    #[error("{}: {inner}", path.display())]
    InFile { path: PathBuf, inner: Box<ModelError> },
}

impl ModelError {
    /// The same error, naming the file it came from.
    pub(crate) fn in_file(self, path: &Path) -> ModelError {
        ModelError::InFile {
            path: path.to_path_buf(),
            inner: Box::new(self),
        }
    }
}

pub type Result<T> = std::result::Result<T, ModelError>;
