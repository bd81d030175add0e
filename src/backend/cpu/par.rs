//! Data parallelism for the CPU kernels: a pool of spinning workers, as ggml's CPU thread pool
//! (`ggml-cpu.c`: workers poll for the next graph node before they sleep, and synchronise once
//! per node).
//!
//! A parallel section ([`for_each_chunk`]) publishes its chunks; the caller and `n - 1` workers
//! claim them (each its own contiguous range first, then what is left of the others) and the
//! caller returns once every chunk is done. After a
//! section a worker keeps polling for the next one for about [`SPIN`] before it sleeps, so the
//! few hundred sections of a token cost a few atomic operations each instead of two thread
//! wake-ups (rayon's fork-join, used before: measured in BENCHMARKS.md). The forward stays on the
//! calling thread (no hand-over to a pool thread first).
//!
//! Each op is split into the same chunks whatever the thread count, and every chunk is computed
//! the same way on whichever thread, so results never depend on threads.
//!
//! Natively the workers are plain threads, started at the first section. The browser's threaded
//! build (wasm32 with `+atomics`, `www/les/pkg-mt`) runs them as long-lived tasks on rayon's web
//! workers (`wasm-bindgen-rayon`), started by [`set_pool_ready`]; the engine's own worker is the
//! caller. The plain wasm32 build runs every section sequentially.

#[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
mod pool {
    use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::SeqCst};
    use std::sync::{Condvar, Mutex, OnceLock};

    /// How long a worker polls for the next section before it sleeps. ggml's default poll level
    /// spins for a comparable time; sections within a token are microseconds apart, while a wait
    /// for an expert read (milliseconds) should leave the core to the I/O threads.
    #[cfg(not(target_arch = "wasm32"))]
    pub const SPIN: std::time::Duration = std::time::Duration::from_micros(100);
    /// Without a clock on wasm32's pool threads: polling rounds (an atomic load each).
    #[cfg(target_arch = "wasm32")]
    const SPIN_ROUNDS: u32 = 1 << 15;

    /// Most threads a section splits into ranges for (more threads share the last ranges).
    const RANGES: usize = 16;

    /// One section: `f(i)` for every `i < n`. The chunks are cut into one contiguous range per
    /// thread (thread `k` of `t` owns chunks `k·n/t .. (k+1)·n/t`, as ggml hands thread `ith` its
    /// first chunk), so each thread streams its own part of a weight matrix; a thread done with its
    /// range takes chunks from the next ones (a worker that is late or asleep loses nothing).
    struct Job {
        f: *const (dyn Fn(usize) + Sync),
        n: usize,
        ranges: usize,
        /// Chunks claimed in each range.
        claimed: [AtomicUsize; RANGES],
        done: AtomicUsize,
        panicked: AtomicBool,
    }

    impl Job {
        fn new(f: *const (dyn Fn(usize) + Sync), n: usize, threads: usize) -> Self {
            Job {
                f,
                n,
                ranges: threads.clamp(1, RANGES).min(n),
                claimed: std::array::from_fn(|_| AtomicUsize::new(0)),
                done: AtomicUsize::new(0),
                panicked: AtomicBool::new(false),
            }
        }

        /// Claim and run chunks, from range `k` on, until none are left.
        fn work(&self, k: usize) {
            for r in 0..self.ranges {
                let r = (k + r) % self.ranges;
                let (a, b) = (r * self.n / self.ranges, (r + 1) * self.n / self.ranges);
                loop {
                    let i = a + self.claimed[r].fetch_add(1, SeqCst);
                    if i >= b {
                        break;
                    }
                    // SAFETY: `f` outlives the section: the caller waits for `done == n` and then
                    // for every worker to leave (see `Pool::run`).
                    let f = unsafe { &*self.f };
                    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| f(i))) {
                        self.panicked.store(true, SeqCst);
                        // Not dropped here: a payload whose drop panics would escape with the
                        // section open.
                        std::mem::forget(payload);
                    }
                    self.done.fetch_add(1, SeqCst);
                }
            }
        }
    }

    pub struct Pool {
        /// Worker threads besides the caller.
        pub workers: usize,
        /// One section at a time; a caller that finds it taken (another session's thread, or a
        /// section started inside a chunk) runs its section alone.
        busy: Mutex<()>,
        /// Odd while a section is open; each open and each close adds one.
        epoch: AtomicUsize,
        job: AtomicPtr<Job>,
        /// Workers inside the current section (they may still read `job`).
        active: AtomicUsize,
        sleepers: AtomicUsize,
        sleep: Mutex<()>,
        wake: Condvar,
        /// Threads that take part in sections (the caller and workers `1..use_threads`), at most
        /// `workers + 1`: the browser measures at load how many pay ([`set_use_threads`]).
        use_threads: AtomicUsize,
        /// Workers at or above `use_threads` wait here (not woken by every section).
        parked: Condvar,
    }

    // SAFETY: the raw pointers are only dereferenced while the section that owns them is open.
    unsafe impl Sync for Pool {}
    unsafe impl Send for Pool {}

    impl Pool {
        fn new(workers: usize) -> Self {
            Pool {
                workers,
                busy: Mutex::new(()),
                epoch: AtomicUsize::new(0),
                job: AtomicPtr::new(std::ptr::null_mut()),
                active: AtomicUsize::new(0),
                sleepers: AtomicUsize::new(0),
                sleep: Mutex::new(()),
                wake: Condvar::new(),
                use_threads: AtomicUsize::new(workers + 1),
                parked: Condvar::new(),
            }
        }

        /// Threads sections run on now.
        pub fn threads(&self) -> usize {
            self.use_threads.load(SeqCst).clamp(1, self.workers + 1)
        }

        /// Run sections on `n` threads from now on (the caller and `n - 1` workers; at least 1,
        /// at most all); the others wait until a later call wants them.
        pub fn set_threads(&self, n: usize) {
            self.use_threads.store(n.clamp(1, self.workers + 1), SeqCst);
            let _g = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.parked.notify_all();
        }

        /// Run `f(i)` for `i < n` on the caller and the workers; false if the pool was busy
        /// (nothing ran).
        pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> bool {
            let threads = self.threads();
            if threads < 2 {
                return false;
            }
            // A poisoned lock only means an earlier section's chunk panicked (re-raised below after
            // the section closed): the pool is fine.
            let section = match self.busy.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return false,
            };
            check_trapped();
            // SAFETY: only the lifetime is erased; the pointer is not used after this call returns.
            let f: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
            let job = Job::new(f, n, threads);
            self.job.store(&job as *const Job as *mut Job, SeqCst);
            self.epoch.fetch_add(1, SeqCst); // open
            if self.sleepers.load(SeqCst) > 0 {
                let _g = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
                self.wake.notify_all();
            }
            job.work(0);
            while job.done.load(SeqCst) < n {
                check_trapped();
                std::hint::spin_loop();
            }
            self.epoch.fetch_add(1, SeqCst); // close: no worker joins from now on
            // A worker that joined before the close may still hold `job`; wait until it has left.
            while self.active.load(SeqCst) > 0 {
                check_trapped();
                std::hint::spin_loop();
            }
            self.job.store(std::ptr::null_mut(), SeqCst);
            drop(section);
            if job.panicked.load(SeqCst) {
                resume_unwind(Box::new("a parallel CPU kernel panicked"));
            }
            true
        }

        /// A worker: wait for an open section it has not seen, join it, work, leave.
        pub fn worker(&self, k: usize) {
            let mut seen = 0usize;
            loop {
                if k >= self.threads() {
                    self.park(k);
                }
                let e = self.wait_open(seen);
                seen = e;
                if k >= self.threads() {
                    continue;
                }
                self.active.fetch_add(1, SeqCst);
                // Joined only if the section is still the open one (else its job may be gone).
                if self.epoch.load(SeqCst) == e {
                    let job = self.job.load(SeqCst);
                    // SAFETY: the section `e` is open and we are counted in `active`, so its
                    // caller has not returned.
                    if let Some(job) = unsafe { job.as_ref() } {
                        job.work(k);
                    }
                }
                self.active.fetch_sub(1, SeqCst);
            }
        }

        /// Wait until sections want worker `k` again.
        fn park(&self, k: usize) {
            let mut g = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
            while k >= self.threads() {
                g = self.parked.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }

        fn is_new_open(&self, seen: usize) -> Option<usize> {
            let e = self.epoch.load(SeqCst);
            (e & 1 == 1 && e != seen).then_some(e)
        }

        /// Poll for a new open section, then sleep.
        fn wait_open(&self, seen: usize) -> usize {
            #[cfg(not(target_arch = "wasm32"))]
            let t0 = std::time::Instant::now();
            let mut rounds = 0u32;
            loop {
                if let Some(e) = self.is_new_open(seen) {
                    return e;
                }
                std::hint::spin_loop();
                rounds = rounds.wrapping_add(1);
                #[cfg(not(target_arch = "wasm32"))]
                let spun = rounds % 64 == 0 && t0.elapsed() > SPIN;
                #[cfg(target_arch = "wasm32")]
                let spun = rounds >= SPIN_ROUNDS;
                if spun {
                    break;
                }
            }
            let mut g = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.sleepers.fetch_add(1, SeqCst);
            let e = loop {
                if let Some(e) = self.is_new_open(seen) {
                    break e;
                }
                g = self.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            };
            self.sleepers.fetch_sub(1, SeqCst);
            e
        }
    }

    /// Threads asked for (0: not set).
    #[cfg(not(target_arch = "wasm32"))]
    static WANT: AtomicUsize = AtomicUsize::new(0);
    static POOL: OnceLock<&'static Pool> = OnceLock::new();

    #[cfg(not(target_arch = "wasm32"))]
    pub fn set_threads(n: usize) {
        WANT.store(n.max(1), SeqCst);
    }

    /// The pool, started on first use.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn get() -> Option<&'static Pool> {
        let p = POOL.get_or_init(|| {
            let mut n = WANT.load(SeqCst);
            if n == 0 {
                n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            }
            let pool: &'static Pool = Box::leak(Box::new(Pool::new(n - 1)));
            for i in 0..pool.workers {
                let spawned = std::thread::Builder::new().name(format!("les-cpu-{i}")).spawn(move || pool.worker(i + 1));
                if spawned.is_err() {
                    // Never claimed work can be left undone: an absent worker simply takes no chunk.
                    break;
                }
            }
            pool
        });
        Some(p)
    }

    /// The browser's threaded build: the pool once [`start_wasm`] ran.
    #[cfg(target_arch = "wasm32")]
    pub fn get() -> Option<&'static Pool> {
        POOL.get().copied()
    }

    /// The browser's threaded build is `panic = abort`: a panicking thread traps, and a pool worker
    /// that traps never finishes its chunk. A panic hook (every thread's) records it, so a caller
    /// waiting for that chunk panics (traps) too and the engine's JS sees an error instead of a
    /// hang.
    #[cfg(target_arch = "wasm32")]
    static TRAPPED: AtomicBool = AtomicBool::new(false);

    #[cfg(target_arch = "wasm32")]
    fn check_trapped() {
        if TRAPPED.load(SeqCst) {
            panic!("a CPU worker thread trapped (a kernel panicked): this engine cannot go on");
        }
    }
    #[cfg(not(target_arch = "wasm32"))]
    fn check_trapped() {}

    /// Start the workers on rayon's web workers (all but one: the engine's worker computes too).
    #[cfg(target_arch = "wasm32")]
    pub fn start_wasm() {
        POOL.get_or_init(|| {
            let hook = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                TRAPPED.store(true, SeqCst);
                hook(info);
            }));
            let pool: &'static Pool = Box::leak(Box::new(Pool::new(rayon::current_num_threads().saturating_sub(1))));
            for i in 0..pool.workers {
                rayon::spawn(move || pool.worker(i + 1));
            }
            pool
        });
    }

    #[cfg(all(test, not(target_arch = "wasm32")))]
    mod tests {
        use super::*;
        use std::collections::HashSet;

        /// Threads that ran chunks of one section of 48 chunks (2 ms each), by name.
        fn names(pool: &Pool) -> (bool, HashSet<String>) {
            let seen = Mutex::new(HashSet::new());
            let ran = pool.run(48, &|_| {
                seen.lock().unwrap().insert(std::thread::current().name().unwrap_or("caller").to_string());
                std::thread::sleep(std::time::Duration::from_millis(2));
            });
            (ran, seen.into_inner().unwrap())
        }

        /// `set_threads(n)`: workers `n..` take no chunk (parked, not polling) until a later
        /// call wants them again; one thread runs the section on the caller alone.
        #[test]
        fn workers_beyond_the_thread_count_take_no_chunks_until_wanted() {
            let pool: &'static Pool = Box::leak(Box::new(Pool::new(2)));
            for k in 1..=2 {
                std::thread::Builder::new().name(format!("w{k}")).spawn(move || pool.worker(k)).unwrap();
            }
            pool.set_threads(2);
            assert_eq!(pool.threads(), 2);
            for _ in 0..5 {
                let (ran, seen) = names(pool);
                assert!(ran);
                assert!(!seen.contains("w2"), "{seen:?}");
            }
            pool.set_threads(1);
            assert!(!names(pool).0, "one thread: the caller runs the section alone");
            pool.set_threads(9);
            assert_eq!(pool.threads(), 3);
            assert!((0..50).any(|_| names(pool).1.contains("w2")), "worker 2 never came back");
        }
    }
}

/// The browser's threaded build: JS has started rayon's web workers (`initThreadPool`); start
/// the pool's workers on them.
#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
pub fn set_pool_ready() {
    pool::start_wasm();
}

/// Tests of the browser's threaded build: a parallel section whose chunks panic on the pool's
/// workers (not on the calling thread), as a kernel's bug would. The caller must then fail
/// (trap), not wait forever for the trapped worker's chunk.
#[cfg(all(target_arch = "wasm32", target_feature = "atomics"))]
pub fn debug_panic_on_a_worker() {
    thread_local!(static CALLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    CALLER.with(|c| c.set(true));
    for_each(64, |_| {
        if !CALLER.with(|c| c.get()) {
            panic!("debug: a chunk panicked on a pool worker");
        }
        // Leave the workers time to wake up and join.
        let t = js_sys::Date::now();
        while js_sys::Date::now() - t < 2.0 {
            std::hint::spin_loop();
        }
    });
    CALLER.with(|c| c.set(false));
}

/// Run `f(i)` for every `i < n`, in parallel where threads exist (each index once, on some
/// thread; `f` must give the same result wherever it runs).
pub fn for_each<F>(n: usize, f: F)
where
    F: Fn(usize) + Send + Sync,
{
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    if n > 1 {
        if let Some(p) = pool::get().filter(|p| p.workers > 0) {
            if p.run(n, &f) {
                return;
            }
        }
    }
    (0..n).for_each(f);
}

/// Split `y` into chunks of `chunk` elements and run `f(chunk_index, chunk)` on each, in parallel
/// where threads exist.
pub fn for_each_chunk<T: Send, F>(y: &mut [T], chunk: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Send + Sync,
{
    let chunk = chunk.max(1);
    let (base, len) = (SharedMut(y.as_mut_ptr()), y.len());
    for_each(len.div_ceil(chunk), |i| {
        let (a, b) = (i * chunk, ((i + 1) * chunk).min(len));
        // SAFETY: each chunk index runs once, so the slices are disjoint, and `y` is borrowed
        // mutably until every chunk is done.
        f(i, unsafe { base.slice(a, b - a) })
    });
}

/// A mutable buffer that parallel chunks write disjoint parts of.
pub struct SharedMut<T>(*mut T);

impl<T> Clone for SharedMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SharedMut<T> {}

// SAFETY: users write disjoint elements only (see the methods' contracts).
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(y: &mut [T]) -> Self {
        SharedMut(y.as_mut_ptr())
    }
    /// `len` elements from `at`.
    ///
    /// # Safety
    /// In bounds of the buffer given to [`SharedMut::new`], which must still be borrowed, and no
    /// other thread touches these elements meanwhile.
    pub unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
    /// Write element `at`.
    ///
    /// # Safety
    /// As [`SharedMut::slice`].
    pub unsafe fn write(self, at: usize, v: T) {
        self.0.add(at).write(v)
    }
}

/// Number of threads parallel ops run on.
pub fn n_threads() -> usize {
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    if let Some(p) = pool::get() {
        return p.threads();
    }
    1
}

/// The threads a pool was started with (the caller included): the most [`use_threads`] can ask.
pub fn pool_threads() -> usize {
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    if let Some(p) = pool::get() {
        return p.workers + 1;
    }
    1
}

/// Run parallel ops on `n` of the pool's threads from now on (clamped to 1..=[`pool_threads`]);
/// results never depend on it. The others wait without polling.
pub fn use_threads(n: usize) {
    #[cfg(any(not(target_arch = "wasm32"), target_feature = "atomics"))]
    if let Some(p) = pool::get() {
        p.set_threads(n);
    }
    #[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
    let _ = n;
}

/// Set the thread count (natively; call once before any work). The browser's threaded build
/// sizes its pool from JS (`initThreadPool`).
pub fn init_threads(n: usize) {
    #[cfg(not(target_arch = "wasm32"))]
    {
        pool::set_threads(n);
        // `les pack --mixed` re-quantizes with rayon.
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global();
    }
    #[cfg(target_arch = "wasm32")]
    let _ = n;
}

#[cfg(all(test, not(target_arch = "wasm32")))]
mod tests {
    use super::*;

    /// Every element written once by the chunk that owns it, over many sections in a row and
    /// from several callers at once (one gets the pool, the others run alone).
    #[test]
    fn every_chunk_runs_once_from_concurrent_callers() {
        std::thread::scope(|s| {
            for caller in 0..3u32 {
                s.spawn(move || {
                    for round in 0..300u32 {
                        let mut y = vec![0u32; 1000 + round as usize];
                        for_each_chunk(&mut y, 7, |i, c| {
                            for (j, v) in c.iter_mut().enumerate() {
                                *v += (i * 7 + j) as u32 ^ caller;
                            }
                        });
                        assert!(y.iter().enumerate().all(|(k, &v)| v == k as u32 ^ caller), "caller {caller} round {round}");
                    }
                });
            }
        });
    }

    /// A panicking chunk reaches the caller after every other chunk finished, and the pool keeps
    /// working.
    #[test]
    fn a_panicking_chunk_reaches_the_caller() {
        let mut y = vec![0u8; 64];
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for_each_chunk(&mut y, 1, |i, c| {
                if i == 40 {
                    panic!("chunk 40");
                }
                c[0] = 1;
            })
        }));
        assert!(r.is_err());
        assert_eq!(y.iter().filter(|&&v| v == 1).count(), 63);
        let mut z = vec![0u8; 64];
        for_each_chunk(&mut z, 1, |_, c| c[0] = 2);
        assert!(z.iter().all(|&v| v == 2));
        // Still parallel afterwards (a poisoned lock once made every later section run alone).
        // Other tests may hold the pool for a moment: try a few times.
        if n_threads() > 1 {
            let parallel = (0..50).any(|_| {
                let ids = std::sync::Mutex::new(std::collections::HashSet::new());
                for_each(8, |_| {
                    ids.lock().unwrap().insert(std::thread::current().id());
                    std::thread::sleep(std::time::Duration::from_millis(2));
                });
                let n = ids.lock().unwrap().len();
                n > 1
            });
            assert!(parallel, "after a panicking chunk, sections no longer run on the pool");
        }
    }
}
