//! The kernel switches: which vector kernels this process may use, fixed once before the first
//! kernel runs and read-only after (as CPU-feature detection is). The edge sets them: the Python
//! bindings from the `DASLLAMA_NO_SIMD`, `DASLLAMA_NO_AVX512`, `DASLLAMA_NO_VNNI`,
//! `DASLLAMA_NO_AMX`, `DASLLAMA_AMX`, `DASLLAMA_AMX_LOG` and `DASLLAMA_PREFETCH` variables
//! (`dasllama.runtime`); nothing below reads the environment. They are process-wide, not a
//! runtime's, because weights are laid out at load for the kernels chosen (tiles for the vector
//! kernels) and each kernel family caches its choice; the scalar twins are checked against the
//! vector kernels by the Rust tests, in one process.

use std::sync::OnceLock;

/// What the kernels may use. The default uses everything the CPU has (AMX as `amx` says).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Switches {
    /// Every vector kernel off: the scalar twins run.
    pub no_simd: bool,
    pub no_avx512: bool,
    pub no_vnni: bool,
    pub no_amx: bool,
    /// `DASLLAMA_AMX`: Some(true) asks for the AMX tile kernel, Some(false) refuses it.
    pub amx: Option<bool>,
    /// Say once on stderr whether AMX runs, and why.
    pub amx_log: bool,
    /// Decode prefetch: bytes ahead and the cache (0: L1, 1: L2), for measurements.
    pub prefetch: Option<(usize, Option<u8>)>,
    /// The variables set, by name, for the kernels' "turned off by ..." reasons.
    pub set: Vec<&'static str>,
}

static SWITCHES: OnceLock<Switches> = OnceLock::new();

/// Fix the switches for this process. Err (with the switches in force) once any kernel has read
/// them, or a second time with other values.
pub fn set(s: Switches) -> Result<(), Switches> {
    let now = SWITCHES.get_or_init(|| s.clone());
    if *now == s {
        Ok(())
    } else {
        Err(now.clone())
    }
}

/// The switches in force (the defaults, if nothing set them before the first kernel ran; the
/// crate's own tests take them from the environment, so `DASLLAMA_NO_SIMD=1 cargo test` runs the
/// scalar twins).
pub fn get() -> &'static Switches {
    SWITCHES.get_or_init(|| {
        #[cfg(test)]
        return from_env_for_tests();
        #[cfg(not(test))]
        Switches::default()
    })
}

#[cfg(test)]
fn from_env_for_tests() -> Switches {
    let on = |k: &str| std::env::var_os(k).is_some();
    let names = ["DASLLAMA_NO_SIMD", "DASLLAMA_NO_AVX512", "DASLLAMA_NO_VNNI", "DASLLAMA_NO_AMX"];
    Switches {
        no_simd: on("DASLLAMA_NO_SIMD"),
        no_avx512: on("DASLLAMA_NO_AVX512"),
        no_vnni: on("DASLLAMA_NO_VNNI"),
        no_amx: on("DASLLAMA_NO_AMX"),
        amx: std::env::var("DASLLAMA_AMX").ok().map(|v| v == "1"),
        amx_log: false,
        prefetch: None,
        set: names.into_iter().filter(|k| on(k)).collect(),
    }
}
