//! The error type of the core crate: configuration and shape errors.

pub type Result<T, E = CoreError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("configuration variable {var}={value:?} is invalid: {reason}")]
    InvalidConfig {
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error("buffer {label} holds {buffer}, the host data is {host}")]
    DTypeMismatch {
        label: String,
        buffer: crate::DType,
        host: crate::DType,
    },
    #[error("buffer {label}: {len} elements at offset {offset} exceed its {capacity}")]
    OutOfBounds {
        label: String,
        offset: usize,
        len: usize,
        capacity: usize,
    },
    #[error("shape {shape:?} holds {elems} elements but {expected} were expected")]
    ShapeMismatch {
        shape: Vec<usize>,
        elems: usize,
        expected: usize,
    },
}
