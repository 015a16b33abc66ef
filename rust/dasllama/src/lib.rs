//! dasllama core: GGUF block formats and their kernels, the forward pass of the supported
//! architectures, sessions, the tokenizer and sampling. No Python here: `dasllama-py` wraps it.

pub mod cpu;
pub mod error;
pub mod kv;
pub mod model;
pub mod quant;
pub mod sampling;
pub mod sched;
pub mod session;
pub mod tokenizer;

pub use error::{Error, Result};
