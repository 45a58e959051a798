//! Kestrel's text side: chat templates rendered as transformers renders them ([`ChatTemplate`]).

pub mod error;
pub mod template;

pub use error::{Result, TextError};
pub use template::{ChatInput, ChatTemplate};
