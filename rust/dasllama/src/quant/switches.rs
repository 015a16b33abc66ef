//! The kernel switches: which vector kernels this process may use, fixed once before the first
//! kernel runs and read-only after (as CPU-feature detection is). The edge sets them: the Python
//! bindings from the `DASLLAMA_NO_SIMD`, `DASLLAMA_NO_AVX512`, `DASLLAMA_NO_VNNI`,
//! `DASLLAMA_NO_AMX`, `DASLLAMA_AMX`, `DASLLAMA_AMX_LOG` and `DASLLAMA_PREFETCH` variables
//! (`dasllama.runtime`); nothing below reads the environment.
//!
//! Within what the process allows, each runtime picks its own kernels (`Choice`: the scalar twins
//! or the vector kernels, AMX on or off). A runtime's threads carry its choice: its team's
//! workers and load pool's threads from their start, and the thread that drives a pass or a load
//! for the length of it (`with`). Weights are laid out at load for the kernels their runtime
//! chose (tiles for the vector kernels, GGUF rows for the scalar ones), so two runtimes in one
//! process can run the same model on the scalar and the vector kernels side by side.

use std::cell::Cell;
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

/// The kernels one runtime runs, within the process switches (a runtime cannot turn on what
/// they turned off, nor what the CPU lacks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Choice {
    /// The scalar twins for every kernel (no vector code, no AMX).
    pub scalar: bool,
    /// AMX for the large GEMMs: None as the process switches say, Some(false) off, Some(true) on
    /// where the CPU and OS allow it (even if `DASLLAMA_AMX=0` turned the process default off).
    pub amx: Option<bool>,
}

thread_local! {
    /// The choice of the runtime this thread works for (the process default on other threads).
    static CHOICE: Cell<Choice> = const { Cell::new(Choice { scalar: false, amx: None }) };
}

/// The kernel choice in force on this thread.
#[inline(always)]
pub fn current() -> Choice {
    CHOICE.with(|c| c.get())
}

/// Whether this thread runs the scalar twins (its runtime chose them).
#[inline(always)]
pub fn scalar() -> bool {
    CHOICE.with(|c| c.get().scalar)
}

/// Make `choice` this thread's for good: the first thing a runtime's own worker thread does.
pub fn adopt(choice: Choice) {
    CHOICE.with(|c| c.set(choice));
}

/// Run `f` with `choice` in force on this thread, then put back what was (also on a panic): a
/// thread that drives a runtime's pass or load runs that runtime's kernels while it does.
pub fn with<R>(choice: Choice, f: impl FnOnce() -> R) -> R {
    struct Restore(Choice);
    impl Drop for Restore {
        fn drop(&mut self) {
            adopt(self.0);
        }
    }
    let _restore = Restore(current());
    adopt(choice);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_choice_holds_inside_with_and_is_put_back_after_even_on_a_panic() {
        let scalar = Choice { scalar: true, amx: Some(false) };
        assert_eq!(current(), Choice::default());
        assert!(with(scalar, scalar_now));
        assert_eq!(current(), Choice::default());
        let r = std::panic::catch_unwind(|| with(scalar, || panic!("inside")));
        assert!(r.is_err());
        assert_eq!(current(), Choice::default());
        // Per thread: another thread keeps its own.
        with(scalar, || assert!(!std::thread::spawn(scalar_now).join().unwrap()));
    }

    fn scalar_now() -> bool {
        scalar()
    }
}
