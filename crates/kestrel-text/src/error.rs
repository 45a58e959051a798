//! Errors of the text side: each names the file or the template at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("reading {}: {error}", path.display())]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("sampling: {0}")]
    Sampling(String),
}

pub type Result<T> = std::result::Result<T, TextError>;
