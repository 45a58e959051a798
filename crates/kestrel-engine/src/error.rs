//! `EngineError`: what opening a model, choosing a backend or generating can fail with.

use kestrel_cuda::CudaError;
use kestrel_model::ModelError;
use kestrel_text::TextError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Text(#[from] TextError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A request the engine cannot carry out as given (an empty prompt, a context too small).
    #[error("{0}")]
    Invalid(String),
    /// A sequence of a batched step failed; the message names the cause.
    #[error("{0}")]
    Sequence(String),
    /// The caller's text callback failed (for example stdout was closed).
    #[error("writing the generated text: {0}")]
    Output(#[source] std::io::Error),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
