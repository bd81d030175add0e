//! How the streaming cache's reads are executed, apart from what is read and when.
//!
//! [`super::stream`] is the policy: the slot cache, predictions, the request queue (demand
//! misses first, then prefetches by lookahead distance), eviction, chunking, cancellation and the
//! statistics. It hands out [`Job`]s. An executor runs them:
//!
//! * [`Threads`] (native): I/O worker threads at the lowest CPU priority read jobs while the
//!   compute thread computes; the compute thread waits on a condition variable for its misses.
//! * [`Inline`] (no I/O threads; `--io-threads 0`): the thread that needs an expert reads it
//!   itself. Prefetches cannot run ahead of the compute they should overlap, so predictions only
//!   become hints to the byte source ([`super::store::ExpertStore::hint`]).
//! * [`AsyncIo`] (the browser, with `crate::wasm::io`'s reader): prefetch pieces become
//!   asynchronous reads by the page (an I/O worker writing into shared memory, or promises the
//!   engine's worker collects at its next await), taken in at layer boundaries; demand reads run
//!   on the compute thread.
//!
//! Every executor calls the same policy functions ([`Shared::take_job`], [`Shared::piece`],
//! [`Shared::fill`], [`Shared::piece_done`]), so priorities, preemption by demand reads and
//! stale-prefetch drops are decided in one place.

use super::queue::{Inner, Job, Next, Shared, Take};
use super::ExpertError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use web_time::Instant;

/// Runs the policy's reads.
pub(crate) trait ReadExecutor: Send + Sync {
    /// Prefetch reads that may be in flight at once. 0: nothing is read ahead; predictions are
    /// passed to the byte source as hints instead (it may fetch them on its own).
    fn prefetch_lanes(&self) -> usize;
    /// Requests were queued or their priorities changed (called on the compute thread at every
    /// MoE layer): start what may start, take in what has arrived.
    fn kick(&self, sh: &Shared);
    /// The compute thread waits for a demanded expert: make progress and return the lock.
    /// `Err` (with the lock): nothing can progress (no read in flight and none may start).
    fn wait<'a>(&self, sh: &'a Shared, g: MutexGuard<'a, Inner>) -> Result<MutexGuard<'a, Inner>, MutexGuard<'a, Inner>>;
    /// The cache is dropped: stop (join threads, forget reads in flight).
    fn shutdown(&self, _sh: &Shared) {}
    /// A line for statistics: what executes reads.
    fn describe(&self) -> String;
}

/// Read `job` to its end on this thread through the store (a demand read, or a prefetch until
/// the policy stops it between chunks).
pub(crate) fn run_job(sh: &Shared, mut job: Job, lane: usize) {
    loop {
        let (off, len) = sh.piece(&job);
        let t = Instant::now();
        let (layer, expert) = job.key();
        let res = if len == 0 { Ok(()) } else { sh.fill(&job, len, |dst| sh.store().read_range(layer, expert, off, dst)) };
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if sh.piece_done(&mut job, len, res, ms, lane) == Next::Stop {
            return;
        }
    }
}

/// Native I/O worker threads.
pub(crate) struct Threads {
    n: usize,
    lanes: usize,
    workers: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// Set when this executor is replaced or dropped: its workers exit.
    stop: Arc<AtomicBool>,
}

impl Threads {
    /// `n` worker threads; prefetches may use all of them but one (so a demand miss always starts
    /// at once), at most `max_prefetch_inflight`, and the only one when `n == 1`.
    pub(crate) fn spawn(sh: &Arc<Shared>, n: usize, max_prefetch_inflight: usize) -> Self {
        let lanes = if n == 1 { 1 } else { max_prefetch_inflight.min(n - 1) };
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..n)
            .map(|w| {
                let (sh, stop) = (sh.clone(), stop.clone());
                std::thread::Builder::new().name(format!("les-io-{w}")).spawn(move || io_worker(sh, w, lanes, stop)).expect("spawn I/O worker")
            })
            .collect();
        Self { n, lanes, workers: std::sync::Mutex::new(workers), stop }
    }
}

impl ReadExecutor for Threads {
    fn prefetch_lanes(&self) -> usize {
        self.lanes
    }
    fn kick(&self, sh: &Shared) {
        sh.io_cv.notify_all();
    }
    fn wait<'a>(&self, sh: &'a Shared, g: MutexGuard<'a, Inner>) -> Result<MutexGuard<'a, Inner>, MutexGuard<'a, Inner>> {
        Ok(sh.done_cv.wait(g).unwrap())
    }
    fn shutdown(&self, sh: &Shared) {
        {
            // Under the policy's lock, so no worker misses the wake-up between its check and its wait.
            let _g = sh.lock();
            self.stop.store(true, Ordering::Release);
            sh.io_cv.notify_all();
        }
        for w in self.workers.lock().unwrap().drain(..) {
            let _ = w.join();
        }
    }
    fn describe(&self) -> String {
        format!("{} I/O threads", self.n)
    }
}

/// Bytes one merged read may span ([`Shared::take_adjacent`]).
const MERGE_MAX: usize = 64 << 20;

fn io_worker(sh: Arc<Shared>, w: usize, lanes: usize, stop: Arc<AtomicBool>) {
    lower_io_priority();
    let mut span_buf = Vec::new();
    loop {
        let (job, more) = {
            let mut g = sh.lock();
            loop {
                if Shared::shutting_down(&g) || stop.load(Ordering::Acquire) {
                    return;
                }
                if let Some(j) = sh.take_job(&mut g, lanes, Take::Any) {
                    let more = sh.take_adjacent(&mut g, &j, MERGE_MAX);
                    break (j, more);
                }
                g = sh.io_cv.wait(g).unwrap();
            }
        };
        if more.is_empty() {
            run_job(&sh, job, w);
        } else {
            let mut jobs = vec![job];
            jobs.extend(more);
            run_merged(&sh, jobs, w, &mut span_buf);
        }
    }
}

/// Demand reads of adjacent blocks in one read of their span (into `buf`), then each job's
/// bytes into its slot; each job is verified and published as if read alone.
fn run_merged(sh: &Shared, jobs: Vec<Job>, lane: usize, buf: &mut Vec<u8>) {
    let ((off, len), at) = Shared::span(&jobs);
    let t = Instant::now();
    buf.resize(len, 0);
    let (layer, expert) = jobs[0].key();
    let res = sh.store().read_range(layer, expert, off, buf);
    let ms = t.elapsed().as_secs_f64() * 1000.0;
    let n = jobs.len();
    for (i, mut job) in jobs.into_iter().enumerate() {
        let total = job.total_len();
        let r = match &res {
            Ok(()) => sh.fill(&job, total, |dst| {
                dst.copy_from_slice(&buf[at[i]..at[i] + total]);
                Ok(())
            }),
            Err(e) => Err(ExpertError::Invalid { layer: job.key().0, expert: job.key().1, why: format!("merged read of {n} adjacent experts failed: {e}") }),
        };
        // The read's time and count go to the first job; the others came with it.
        sh.piece_done(&mut job, total, r, if i == 0 { ms } else { 0.0 }, lane);
    }
    sh.count_merged(n - 1);
}

/// I/O workers run at the lowest CPU priority (Linux: nice 19 for this thread), so the CPU work
/// of a read (the copy out of the page cache, the wake-ups) never preempts a compute thread:
/// it runs on cores the compute leaves idle (while it waits for a demand read, or between
/// parallel sections). `LES_IO_NICE=0` keeps the default priority.
fn lower_io_priority() {
    #[cfg(target_os = "linux")]
    {
        let nice: i32 = std::env::var("LES_IO_NICE").ok().and_then(|v| v.parse().ok()).unwrap_or(19);
        // SAFETY: setpriority on this thread's id (Linux nice values are per thread).
        unsafe {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            libc::setpriority(libc::PRIO_PROCESS, tid, nice);
        }
    }
}

/// Reads on the thread that needs the expert, when it needs it.
pub(crate) struct Inline;

impl ReadExecutor for Inline {
    fn prefetch_lanes(&self) -> usize {
        0
    }
    fn kick(&self, _sh: &Shared) {}
    fn wait<'a>(&self, sh: &'a Shared, g: MutexGuard<'a, Inner>) -> Result<MutexGuard<'a, Inner>, MutexGuard<'a, Inner>> {
        read_demand_here(sh, g)
    }
    fn describe(&self) -> String {
        "on the compute thread".into()
    }
}

/// Read the next demanded expert on this thread (Err: none is queued).
pub(crate) fn read_demand_here<'a>(sh: &'a Shared, mut g: MutexGuard<'a, Inner>) -> Result<MutexGuard<'a, Inner>, MutexGuard<'a, Inner>> {
    match sh.take_job(&mut g, 0, Take::Demand) {
        Some(job) => {
            drop(g);
            run_job(sh, job, 0);
            Ok(sh.lock())
        }
        None => Err(g),
    }
}

/// Reads started on one call and finished later by someone else: the browser page's
/// `AsyncReads` (`www/les/io.js`). All calls come from the compute thread.
pub trait AsyncReader: Send + Sync {
    /// Start read `id`: the byte ranges `(file offset, length)`, one after the other into one
    /// buffer (at most [`Self::max_piece`] bytes in all). False: these bytes cannot be read
    /// asynchronously (e.g. not stored yet) or no lane is free.
    /// `dest` (given only to a [`Self::direct`] reader): where the bytes go, their total length
    /// long; nothing else touches that memory until the read is taken or cancelled.
    fn submit(&self, id: u32, ranges: &[(u64, usize)], dest: Option<*mut u8>) -> bool;
    /// Whether reads land straight in the `dest` given to [`Self::submit`] (the browser's I/O
    /// worker writing into the engine's shared wasm memory): then [`Self::take`] copies nothing
    /// and [`Self::cancel`] returns only once the read no longer writes.
    fn direct(&self) -> bool {
        false
    }
    /// Reads finished (or failed) since the last call.
    fn poll(&self) -> Vec<u32>;
    /// Copy finished read `id` into `dest` (its length; a direct read is already there); Err: the
    /// read failed.
    fn take(&self, id: u32, dest: &mut [u8]) -> Result<(), String>;
    /// Block until read `id` has finished. False: this reader cannot block (or gave up).
    fn wait(&self, id: u32) -> bool;
    /// Forget read `id` (its bytes, when they come, are dropped).
    fn cancel(&self, id: u32);
    /// Most bytes one read may take.
    fn max_piece(&self) -> usize;
    fn describe(&self) -> String;
}

/// A piece in flight: its job, its length, when it started (ms).
struct Flight {
    job: Job,
    len: usize,
    t0: f64,
}

/// Prefetch pieces as asynchronous reads (the browser); demand reads on the compute thread.
///
/// At every kick (each MoE layer) the pieces that have arrived are copied into their slots and
/// reported to the policy, and new prefetch pieces start while fewer than `lanes` are in flight.
/// When the router waits for an expert whose piece is still in flight, the reader blocks on it
/// where it can (shared memory); otherwise the piece is abandoned and the rest of the expert read
/// here. A prefetch whose bytes cannot be read asynchronously is dropped like a stale one.
pub struct AsyncIo<R: AsyncReader> {
    reader: R,
    lanes: usize,
    flights: Mutex<HashMap<u32, Flight>>,
    next_id: AtomicU32,
}

impl<R: AsyncReader> AsyncIo<R> {
    pub fn new(reader: R, lanes: usize) -> Self {
        Self { reader, lanes: lanes.max(1), flights: Mutex::new(HashMap::new()), next_id: AtomicU32::new(1) }
    }

    /// Take in the pieces that have arrived; returns how many.
    fn take_in(&self, sh: &Shared) -> usize {
        let ids = self.reader.poll();
        for &id in &ids {
            let f = self.flights.lock().unwrap().remove(&id);
            if let Some(f) = f {
                self.finish(sh, id, f);
            }
        }
        ids.len()
    }

    /// Copy a finished piece into its slot and report it; start the job's next piece.
    fn finish(&self, sh: &Shared, id: u32, f: Flight) {
        let Flight { mut job, len, t0 } = f;
        let (layer, expert) = job.key();
        let res = sh.fill(&job, len, |dst| self.reader.take(id, dst).map_err(|why| ExpertError::Invalid { layer, expert, why: format!("asynchronous read failed: {why}") }));
        let ms = crate::clock::now_ms() - t0;
        if sh.piece_done(&mut job, len, res, ms, 0) == Next::Piece {
            self.start(sh, job);
        }
    }

    /// Start the job's next piece as an asynchronous read (or hand the job back).
    fn start(&self, sh: &Shared, mut job: Job) {
        loop {
            let ranges = sh.pieces(&job, self.reader.max_piece());
            let len: usize = ranges.iter().map(|r| r.1).sum();
            if len == 0 {
                // Nothing left to read (or the job failed): the report finishes it.
                if sh.piece_done(&mut job, 0, Ok(()), 0.0, 0) == Next::Piece {
                    continue;
                }
                return;
            }
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            // A direct reader writes into the slot itself: the slot stays loading (not reused,
            // resized or freed) until the piece is taken in or cancelled.
            let dest = if self.reader.direct() { sh.piece_dest(&job, len) } else { None };
            if self.reader.submit(id, &ranges, dest) {
                self.flights.lock().unwrap().insert(id, Flight { job, len, t0: crate::clock::now_ms() });
            } else {
                // The router reads it on demand if it picks it.
                sh.abandon(job);
            }
            return;
        }
    }

    /// Finish a piece the compute thread needs now: block on it where the reader can, else stop
    /// waiting for it and read the rest of its job here.
    fn finish_now(&self, sh: &Shared, id: u32) {
        if self.reader.wait(id) {
            self.take_in(sh);
            let f = self.flights.lock().unwrap().remove(&id);
            if let Some(f) = f {
                // Finished but reported by an earlier poll that missed it: take it now.
                self.finish(sh, id, f);
            }
            return;
        }
        self.reader.cancel(id);
        let f = self.flights.lock().unwrap().remove(&id);
        if let Some(f) = f {
            run_job(sh, f.job, 0);
        }
    }

    /// Pieces in flight (tests).
    pub fn in_flight(&self) -> usize {
        self.flights.lock().unwrap().len()
    }
}

impl<R: AsyncReader> ReadExecutor for AsyncIo<R> {
    fn prefetch_lanes(&self) -> usize {
        self.lanes
    }

    fn kick(&self, sh: &Shared) {
        self.take_in(sh);
        while self.in_flight() < self.lanes {
            let job = {
                let mut g = sh.lock();
                sh.take_job(&mut g, self.lanes, Take::Prefetch)
            };
            match job {
                Some(j) => self.start(sh, j),
                None => break,
            }
        }
    }

    fn wait<'a>(&self, sh: &'a Shared, g: MutexGuard<'a, Inner>) -> Result<MutexGuard<'a, Inner>, MutexGuard<'a, Inner>> {
        drop(g);
        if self.take_in(sh) > 0 {
            return Ok(sh.lock());
        }
        // A demanded expert not in flight: read it here.
        let g = match read_demand_here(sh, sh.lock()) {
            Ok(g) => return Ok(g),
            Err(g) => g,
        };
        // A piece the router waits for (its slot is pinned), else any (its slot may be the one
        // a waiting expert needs).
        let ids: Vec<(u32, usize)> = self.flights.lock().unwrap().iter().map(|(&id, f)| (id, f.job.slot())).collect();
        let pick = ids.iter().find(|(_, s)| Shared::pinned(&g, *s)).or(ids.first()).map(|x| x.0);
        drop(g);
        match pick {
            Some(id) => {
                self.finish_now(sh, id);
                Ok(sh.lock())
            }
            None => Err(sh.lock()),
        }
    }

    fn shutdown(&self, _sh: &Shared) {
        for (id, _) in self.flights.lock().unwrap().drain() {
            self.reader.cancel(id);
        }
    }

    fn describe(&self) -> String {
        format!("asynchronous reads ({}, {} lanes)", self.reader.describe(), self.lanes)
    }
}
