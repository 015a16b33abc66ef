//! The forward pass's thread team: workers that spin between the dozens of parallel loops of one
//! forward pass (a sleep and wake per loop would cost more than a decode-sized matmul) and park on
//! a condvar between passes, so an idle engine uses no CPU.
//!
//! One atomic word, `claim`, packs (loop epoch, task count, next task index). A thread owns a task
//! only through a successful compare-exchange on it, which proves the loop it read the job pointer
//! for is still the open one, so no thread can run a task with a stale job.
//!
//! A task that panics is caught where it ran: a worker that unwound would leave the loop's
//! publisher spinning forever, and a publisher that unwound would free the job on its stack while
//! workers still run it. The first panic's payload is kept and re-raised by `parallel_for` once
//! every task of the loop has finished, so the caller sees an ordinary panic it can catch, and the
//! team is ready for the next loop.

use crate::quant::switches::{self, Choice};
use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

type Job<'a> = &'a (dyn Fn(usize) + Sync);

const IDX_BITS: u32 = 20;
const MAX_TASKS: usize = (1 << IDX_BITS) - 1;

fn pack(epoch: u64, n: usize, idx: usize) -> u64 {
    (epoch << (2 * IDX_BITS)) | ((n as u64) << IDX_BITS) | idx as u64
}

fn unpack(c: u64) -> (u64, usize, usize) {
    let mask = (1u64 << IDX_BITS) - 1;
    (c >> (2 * IDX_BITS), ((c >> IDX_BITS) & mask) as usize, (c & mask) as usize)
}

struct Shared {
    claim: AtomicU64,
    /// Points at the open loop's `Job`, which lives on the publishing thread's stack.
    job: AtomicPtr<Job<'static>>,
    remaining: AtomicUsize,
    /// Inside a forward pass: workers spin instead of parking.
    spinning: AtomicBool,
    /// The team was dropped: parked workers exit (a runtime's team lives as long as the runtime).
    stop: AtomicBool,
    park: Mutex<()>,
    wake: Condvar,
    /// The first panic of the open loop, re-raised by its publisher when the loop is done.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// Test hook: the next task this team runs panics (`Team::inject_fault`).
    #[cfg(feature = "fault-injection")]
    armed: AtomicBool,
}

pub struct Team {
    shared: Arc<Shared>,
    /// One forward pass drives the team at a time.
    lock: Mutex<()>,
    n: usize,
    /// The kernels its runtime chose: its workers carry them, and so does a session's caller.
    kernels: Choice,
}

impl Team {
    /// A team of `n` threads, this one included (`n - 1` workers are started), on the process's
    /// default kernels.
    pub fn new(n: usize) -> Team {
        Team::with_kernels(n, Choice::default())
    }

    /// A team of `n` threads running the kernels `kernels` chooses.
    pub fn with_kernels(n: usize, kernels: Choice) -> Team {
        let shared = Arc::new(Shared {
            claim: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            remaining: AtomicUsize::new(0),
            spinning: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            park: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
            #[cfg(feature = "fault-injection")]
            armed: AtomicBool::new(false),
        });
        for i in 1..n {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(format!("dasllama-team-{i}"))
                .spawn(move || {
                    switches::adopt(kernels);
                    worker(&s)
                })
                .expect("failed to start a dasllama worker thread");
        }
        Team { shared, lock: Mutex::new(()), n, kernels }
    }

    pub fn threads(&self) -> usize {
        self.n
    }

    /// Fault injection, for tests of the paths a panic takes: the next task this team runs
    /// panics (once).
    #[cfg(feature = "fault-injection")]
    pub fn inject_fault(&self) {
        self.shared.armed.store(true, Ordering::SeqCst);
    }

    /// Run `f` with the team spinning, ready for `parallel_for`; it parks again afterwards.
    pub fn session<R>(&self, f: impl FnOnce(&Session) -> R) -> R {
        let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        {
            let _p = self.shared.park.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.spinning.store(true, Ordering::SeqCst);
        }
        self.shared.wake.notify_all();
        struct Stop<'a>(&'a Shared);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.spinning.store(false, Ordering::SeqCst);
            }
        }
        let _stop = Stop(&self.shared);
        // The caller is one of the team for the session: it runs the runtime's kernels too.
        switches::with(self.kernels, || f(&Session { shared: &self.shared, threads: self.n }))
    }
}

impl Drop for Team {
    fn drop(&mut self) {
        // No session is open (it borrows the team), so every worker is parked or about to park;
        // it reads `stop` under `park` before it waits, so this wakeup cannot be missed.
        {
            let _p = self.shared.park.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.stop.store(true, Ordering::SeqCst);
        }
        self.shared.wake.notify_all();
    }
}

/// A team held spinning for one forward pass.
pub struct Session<'a> {
    shared: &'a Shared,
    threads: usize,
}

impl Session<'_> {
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Call `f(i)` for every i in 0..n_tasks across the team, this thread included; return when all are done.
    pub fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(n_tasks <= MAX_TASKS, "too many tasks in one parallel loop");
        if n_tasks == 0 {
            return;
        }
        let s = self.shared;
        let job: Job<'_> = f;
        let job_ptr = &job as *const Job<'_> as *mut Job<'static>;
        let (epoch, _, _) = unpack(s.claim.load(Ordering::Relaxed));
        s.job.store(job_ptr, Ordering::Relaxed);
        s.remaining.store(n_tasks, Ordering::Relaxed);
        s.claim.store(pack(epoch + 1, n_tasks, 0), Ordering::Release);
        drain(s);
        while s.remaining.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        if let Some(payload) = s.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(payload);
        }
    }
}

/// Claim and run tasks of the open loop until none are left. Returns whether any ran.
fn drain(s: &Shared) -> bool {
    let mut ran = false;
    loop {
        let c = s.claim.load(Ordering::Acquire);
        let (_, n, idx) = unpack(c);
        if idx >= n {
            return ran;
        }
        let job = s.job.load(Ordering::Acquire);
        if s.claim.compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            // A panic must not unwind past this frame (see the module doc): it is caught, kept,
            // and the task still counts as done.
            let run = catch_unwind(AssertUnwindSafe(|| {
                #[cfg(feature = "fault-injection")]
                if s.armed.load(Ordering::Relaxed) && s.armed.swap(false, Ordering::SeqCst) {
                    panic!("injected fault in a kernel task");
                }
                // SAFETY: the exchange succeeded on the word of the loop whose job we loaded after
                // it was published (Acquire on `claim` orders the earlier `job` store before our
                // load), so that loop is open and its publisher is blocked until `remaining`
                // reaches 0, which our own decrement below keeps from happening while this runs.
                unsafe { (*job)(idx) }
            }));
            if let Err(payload) = run {
                s.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(payload);
            }
            s.remaining.fetch_sub(1, Ordering::Release);
            ran = true;
        }
    }
}

fn worker(s: &Shared) {
    loop {
        if drain(s) {
            continue;
        }
        if s.spinning.load(Ordering::Relaxed) {
            std::hint::spin_loop();
            continue;
        }
        let guard = s.park.lock().unwrap_or_else(|e| e.into_inner());
        if s.stop.load(Ordering::SeqCst) {
            return;
        }
        if !s.spinning.load(Ordering::SeqCst) {
            drop(s.wake.wait(guard).unwrap_or_else(|e| e.into_inner()));
        }
    }
}

/// Chunks of one slice handed to different tasks.
struct SlicePtr<T>(*mut T, usize);
impl<T> Clone for SlicePtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SlicePtr<T> {}
// SAFETY: `for_each_chunk_mut` gives each task a disjoint chunk and joins before returning.
unsafe impl<T: Send> Send for SlicePtr<T> {}
unsafe impl<T: Send> Sync for SlicePtr<T> {}

impl Session<'_> {
    /// `f(i, chunk_i)` over `data.chunks_mut(chunk)`, in parallel.
    pub fn for_each_chunk_mut<T: Send>(&self, data: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
        let n = data.len().div_ceil(chunk);
        let p = SlicePtr(data.as_mut_ptr(), data.len());
        self.parallel_for(n, &|i| {
            // Capture the whole (Sync) wrapper, not its raw-pointer field.
            #[allow(clippy::redundant_locals)]
            let p = p;
            let lo = i * chunk;
            let len = chunk.min(p.1 - lo);
            // SAFETY: chunk i covers lo..lo+len, disjoint from every other task's and within the
            // slice, which stays borrowed mutably until parallel_for has joined.
            f(i, unsafe { std::slice::from_raw_parts_mut(p.0.add(lo), len) });
        });
    }

    /// As `for_each_chunk_mut`, for many chunks of equal and small cost (a row each of a norm,
    /// RoPE, quantization): runs of consecutive chunks, two per thread, make the tasks, since
    /// claiming a task moves a cache line between cores and can cost more than a row's work.
    pub fn for_each_row_mut<T: Send>(&self, data: &mut [T], chunk: usize, f: &(dyn Fn(usize, &mut [T]) + Sync)) {
        let per = data.len().div_ceil(chunk).div_ceil(2 * self.threads).max(1);
        self.for_each_chunk_mut(data, chunk * per, &|i, run| {
            for (j, c) in run.chunks_mut(chunk).enumerate() {
                f(i * per + j, c);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn two_teams_run_at_once_and_a_dropped_team_ends_its_workers() {
        let (a, b) = (Team::new(2), Team::new(3));
        let sums: Vec<u64> = std::thread::scope(|sc| {
            let run = |t: &Team| {
                let n = AtomicU64::new(0);
                for _ in 0..50 {
                    t.session(|s| {
                        s.parallel_for(40, &|i| {
                            n.fetch_add(i as u64, Ordering::Relaxed);
                        })
                    });
                }
                n.load(Ordering::Relaxed)
            };
            let (ta, tb) = (&a, &b);
            let ha = sc.spawn(move || run(ta));
            let hb = sc.spawn(move || run(tb));
            [ha, hb].map(|h| h.join().unwrap_or_else(|_| panic!("a team's loop panicked"))).to_vec()
        });
        assert_eq!(sums, vec![50 * 780; 2]);
        let shared = Arc::downgrade(&b.shared);
        drop(b);
        // Each worker holds the shared state until it returns.
        let t0 = std::time::Instant::now();
        while shared.strong_count() > 0 {
            assert!(t0.elapsed().as_secs() < 5, "the dropped team's workers are still running");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        a.session(|s| s.parallel_for(4, &|_| {}));
    }

    #[test]
    fn a_panicking_task_is_raised_after_the_loop_and_the_team_goes_on() {
        let t = Team::new(3);
        for bad in [0usize, 5, 63] {
            let hits: Vec<AtomicU32> = (0..64).map(|_| AtomicU32::new(0)).collect();
            let r = std::panic::catch_unwind(AssertUnwindSafe(|| {
                t.session(|s| {
                    s.parallel_for(64, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                        assert!(i != bad, "task {i} fails");
                    })
                })
            }));
            let msg = r.expect_err("the panic reaches the caller");
            assert_eq!(msg.downcast_ref::<String>().map(String::as_str), Some(format!("task {bad} fails").as_str()));
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "every other task still ran once");
            let n = AtomicU32::new(0);
            t.session(|s| {
                s.parallel_for(100, &|_| {
                    n.fetch_add(1, Ordering::Relaxed);
                })
            });
            assert_eq!(n.load(Ordering::Relaxed), 100);
        }
    }

    #[test]
    fn every_task_runs_exactly_once() {
        let t = Team::new(3);
        t.session(|s| {
            for n in [1usize, 2, 7, 64, 1000] {
                let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                s.parallel_for(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        });
    }
}
