//! dasllama core: GGUF block formats and their kernels, the forward pass of the supported
//! architectures, sessions, the tokenizer and sampling. No Python here: `dasllama-py` wraps it.

/// Defines functions whose loop (`$body`, `#[inline(always)]`) is written once, plainly, and
/// compiled twice: as is, and with AVX2 and FMA enabled, where `mul_add` is one instruction
/// instead of a libm call and integer sums vectorize. No float operation is reordered (Rust never
/// reassociates them), so both give the same bits; the plain one is the scalar twin.
macro_rules! twice {
    ($($(#[$doc:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $body:path;)*) => {$(
        $(#[$doc])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            if $crate::quant::avx2::has_avx2() {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                // SAFETY: AVX2 and FMA were detected.
                return unsafe { fast($($arg),*) };
            }
            $body($($arg),*)
        }
    )*};
}

pub mod backend;
pub mod constrain;
pub mod cpu;
pub mod embed;
pub mod error;
pub mod kv;
pub mod model;
pub mod quant;
pub mod record;
pub mod runtime;
pub mod sampling;
pub mod sched;
pub mod session;
pub mod spec;
pub mod tokenizer;
pub mod vision;
pub mod vulkan;

pub use error::{Error, Result};
