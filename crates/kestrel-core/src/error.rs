//! The error type of the core crate: configuration and shape errors.

use std::path::PathBuf;

pub type Result<T, E = CoreError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("configuration variable {var}={value:?} is invalid: {reason}")]
    InvalidConfig {
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error("configuration path {path} for {var} does not exist")]
    MissingPath { var: &'static str, path: PathBuf },
    #[error("shape {shape:?} holds {elems} elements but {expected} were expected")]
    ShapeMismatch {
        shape: Vec<usize>,
        elems: usize,
        expected: usize,
    },
}
