use thiserror::Error;

/// One error tree; the Python bindings map each variant to its own exception class.
#[derive(Debug, Error)]
pub enum Error {
    /// The GGUF file is malformed, truncated, or holds something we cannot read.
    #[error("{0}")]
    Gguf(String),
    /// The file is fine but names an architecture or layout we do not implement.
    #[error("{0}")]
    UnsupportedModel(String),
    /// A session would run past the model's context window.
    #[error("{0}")]
    ContextOverflow(String),
    /// A caller passed something out of range (token id, parameter).
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;
