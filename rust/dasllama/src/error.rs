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
    /// The paged KV pool has no free page and nothing left to evict: retry when streams finish.
    #[error("{0}")]
    PoolFull(String),
    /// A bug: a panic inside the engine, caught at the boundary. The call was abandoned; the
    /// model and its other sessions are intact.
    #[error("{0}")]
    Internal(String),
    /// The GPU device failed: lost mid-step, out of memory, or unusable. The call was abandoned;
    /// the session's rows before it are intact where the device still answers.
    #[error("{0}")]
    Device(String),
    /// The GPU device was lost (driver reset, GPU fault): nothing on it answers again, and what
    /// it held for its models is gone.
    #[error("{0}")]
    DeviceLost(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// A short machine-readable name of the kind, for events and HTTP error codes.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Gguf(_) => "gguf",
            Error::UnsupportedModel(_) => "unsupported_model",
            Error::ContextOverflow(_) => "context_length_exceeded",
            Error::InvalidArgument(_) => "invalid_argument",
            Error::PoolFull(_) => "kv_pool_full",
            Error::Internal(_) => "internal",
            Error::Device(_) | Error::DeviceLost(_) => "device",
            Error::Io(_) => "io",
        }
    }

    /// Turn a caught panic into an `Internal` error naming what was running.
    pub fn from_panic(what: &str, payload: Box<dyn std::any::Any + Send>) -> Error {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Error::Internal(format!("{what} failed inside the engine ({msg}); this is a bug in dasllama: please report it"))
    }
}

/// Run `f`, turning a panic into `Error::Internal` naming `what`.
pub fn catch<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| Err(Error::from_panic(what, p)))
}
