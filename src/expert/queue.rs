//! The scheduler's shared state: the slot cache, the request queue (demand misses first, then
//! prefetches by lookahead distance), eviction, chunked reads and their cancellation. The
//! policy side ([`super::stream::StreamingExperts`]) queues requests and waits for slots; the
//! executors ([`super::io`]) take [`Job`]s and report their pieces. Both import this module;
//! it imports neither.

use super::governor::Governor;
use super::policy::{Policy, StreamConfig};
use super::stats::{StreamStats, TraceEvent};
use super::store::ExpertStore;
use super::{ExpertBlock, ExpertError};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Condvar, Mutex, RwLock};
use web_time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum State {
    Empty,
    Queued,
    Loading,
    Ready,
}

#[derive(Clone, Debug)]
pub(super) struct Slot {
    pub(super) key: Option<(usize, usize)>,
    pub(super) state: State,
    pub(super) pins: u32,
    pub(super) last_use: u64,
    /// Loaded by a prefetch and not used since.
    pub(super) prefetched_unused: bool,
    pub(super) hot: bool,
    /// Error text of the last failed load (state is Empty then).
    pub(super) failed: Option<String>,
    /// A prefetch in flight that the router has made stale: its worker drops it at the next chunk.
    pub(super) cancel: bool,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Req {
    pub(super) slot: usize,
    pub(super) key: (usize, usize),
    pub(super) demand: bool,
    pub(super) dist: usize,
    pub(super) seq: u64,
    /// Bytes already read (a chunked prefetch that yielded to a demand read).
    pub(super) done: usize,
}

/// The policy's state, behind [`Shared`]'s lock.
pub(crate) struct Inner {
    /// Every slot the cache may use (one per expert of the model at most); only the first
    /// `limit` are used now.
    pub(super) slots: Vec<Slot>,
    /// Slots in use now ([`super::stream::StreamingExperts::set_slots`]: the budget may change
    /// while the model runs).
    pub(super) limit: usize,
    /// Slots at or above `limit` and below `high` may still hold an expert (a shrink waits for
    /// the ones in use or being read); `high <= limit` once they are all freed.
    pub(super) high: usize,
    pub(super) map: HashMap<(usize, usize), usize>,
    pub(super) queue: Vec<Req>,
    pub(super) seq: u64,
    pub(super) clock: u64,
    pub(super) freq: HashMap<(usize, usize), f32>,
    pub(super) inflight_prefetch: usize,
    pub(super) inflight_demand: usize,
    /// Prefetches may start while a demand read is in flight: the store serves reads in
    /// submission order ([`ExpertStore::serves_in_order`]), so one queued behind the demand
    /// read cannot slow it. They still yield to a demand read that is queued.
    pub(super) pf_overlap: bool,
    /// The MoE layer whose experts were requested last (eviction by next use).
    pub(super) cur_layer: usize,
    pub(super) n_layers: usize,
    /// predictions[layer][d-1] = experts predicted for `layer` at distance d this step.
    pub(super) predictions: Vec<Vec<Vec<usize>>>,
    /// Experts each layer used in the previous step (temporal predictor).
    pub(super) last_route: Vec<Vec<usize>>,
    /// Per layer: the union of experts a draft's hidden states route to for the coming forward.
    pub(super) draft_hints: Vec<Vec<usize>>,
    /// Per layer: the refined prediction made from the previous layer's partial output.
    pub(super) refined: Vec<Vec<usize>>,
    /// Per layer: the experts the model named before the layer ran (exact lookahead,
    /// `ExpertSource::on_route`).
    pub(super) exact: Vec<Vec<usize>>,
    pub(super) stats: StreamStats,
    pub(super) trace: Vec<TraceEvent>,
    /// Every routed (layer, expert) in order (for oracle bounds).
    pub(super) route_log: Vec<(u32, u32)>,
    pub(super) shutdown: bool,
    /// Prefetching on or off ([`StreamConfig::adaptive`]).
    pub(super) gov: Option<Governor>,
    /// The forward being measured: its start (µs since `t0`), tokens, and whether it counts
    /// (decode or speculative verification, not a prompt).
    pub(super) fwd: Option<(f64, usize, bool)>,
    /// When the last `with_experts` call returned (µs since `t0`).
    pub(super) fwd_end: f64,
    /// The next forward verifies a draft (set by `on_draft_hidden`).
    pub(super) verifying: bool,
}

/// The policy: its state, the slot buffers and the store, shared with the executor's threads.
pub(crate) struct Shared {
    pub(super) inner: Mutex<Inner>,
    /// Signalled when requests were queued (executor threads wait on it).
    pub(crate) io_cv: Condvar,
    /// Signalled when a read finished (the compute thread waits on it).
    pub(crate) done_cv: Condvar,
    pub(super) bufs: Vec<RwLock<ExpertBlock>>,
    /// The largest expert's bytes: each slot's buffer is reserved at this size when first used,
    /// so it never grows again.
    pub(super) slot_bytes: usize,
    /// The fewest slots the cache works with (top-k + 1): an out-of-memory shrink stops there.
    pub(super) min_slots: usize,
    pub(super) store: Arc<dyn ExpertStore>,
    pub(super) cfg: StreamConfig,
    pub(super) t0: Instant,
    /// Prefetching runs now: `cfg.prefetch`, and the governor's arm when adaptive.
    pub(super) pf_on: AtomicBool,
}

pub(super) fn now_us(sh: &Shared) -> f64 {
    sh.t0.elapsed().as_secs_f64() * 1e6
}

/// Two blocks this close on storage are read together when both are wanted ([`Shared::take_adjacent`]):
/// a bundle's blocks are 4096-aligned, so the next one starts within 4096 bytes of the end.
pub(crate) const MERGE_GAP: u64 = 4096;

/// The best queued request: demand first, then the nearest prefetch, FIFO within a class.
/// At most `lanes` prefetches are in flight, and they start only while no demand read is in
/// flight (they use idle I/O time), or on a store that serves reads in order while no demand
/// read is queued. `take` limits the class.
fn pick_request(g: &mut Inner, lanes: usize, take: Take) -> Option<Req> {
    let store_free = if g.pf_overlap { !g.queue.iter().any(|r| r.demand) } else { g.inflight_demand == 0 };
    let pf_ok = take != Take::Demand && g.inflight_prefetch < lanes && store_free;
    let best = g.queue.iter().enumerate().filter(|(_, r)| if r.demand { take != Take::Prefetch } else { pf_ok }).min_by_key(|(_, r)| (!r.demand, r.dist, r.seq)).map(|(i, _)| i)?;
    let r = g.queue.swap_remove(best);
    g.slots[r.slot].state = State::Loading;
    if r.demand {
        g.inflight_demand += 1;
    } else {
        g.inflight_prefetch += 1;
    }
    Some(r)
}

/// The next piece of an expert's read at buffer offset `done`: (file offset, length). Chunked
/// pieces end at multiples of `chunk` in the file; unchunked ones run to the end of the range.
fn next_piece(ranges: &[(u64, usize)], done: usize, chunk: Option<usize>) -> (u64, usize) {
    let mut at = 0;
    for &(off, len) in ranges {
        if done < at + len {
            let f = off + (done - at) as u64;
            let rest = at + len - done;
            return match chunk {
                Some(c) if c > 0 => (f, rest.min(c - (f % c as u64) as usize)),
                _ => (f, rest),
            };
        }
        at += len;
    }
    (0, 0)
}

/// One expert read the policy has handed to an executor ([`super::io`]): which slot, which
/// bytes, how far it got. The executor reads its pieces ([`Shared::piece`], [`Shared::fill`])
/// and reports each ([`Shared::piece_done`]); the policy decides between pieces whether the read
/// goes on, yields to a demand read or is dropped.
pub(crate) struct Job {
    req: Req,
    ranges: Vec<(u64, usize)>,
    total: usize,
    /// `ranges` could not be listed: the job fails at its first report.
    err: Option<ExpertError>,
}

impl Job {
    /// The cache slot the bytes go to.
    pub(crate) fn slot(&self) -> usize {
        self.req.slot
    }
    pub(crate) fn key(&self) -> (usize, usize) {
        self.req.key
    }
    /// The expert's bytes in all.
    pub(crate) fn total_len(&self) -> usize {
        self.total
    }
}

/// Which requests an executor takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Take {
    /// Demand reads first, then prefetches.
    Any,
    /// Demand reads only (the compute thread reads what it waits for).
    Demand,
    /// Prefetches only (asynchronous reads ahead of the compute).
    Prefetch,
}

/// What an executor does after reporting a piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Next {
    /// Read the job's next piece.
    Piece,
    /// The job is over (finished, failed, dropped as stale, or put back in the queue).
    Stop,
}

impl Shared {
    /// Take the best request the policy allows now (see [`pick_request`]) and size its slot's
    /// buffer. `lanes`: prefetch reads allowed in flight.
    pub(crate) fn take_job(&self, g: &mut Inner, lanes: usize, take: Take) -> Option<Job> {
        let req = pick_request(g, lanes, take)?;
        let (layer, expert) = req.key;
        let (ranges, err) = match self.store.ranges(layer, expert) {
            Ok(r) => (r, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let total = ranges.iter().map(|x| x.1).sum();
        let err = match err {
            None if req.done == 0 => self.size_slot(g, req.slot, layer, expert, total).err(),
            e => e,
        };
        Some(Job { req, ranges, total, err })
    }

    /// Demand reads queued whose bytes continue `job`'s on storage, after or before it (each one
    /// block, within [`MERGE_GAP`] bytes of the span read so far: a bundle's neighbouring block
    /// beyond its alignment padding), taken with it so that one read fetches them all ([`super::io`]'s
    /// merged reads; experts packed by co-activation sit next to each other). At most
    /// `max_bytes` in the span. Empty unless `job` is a whole demand read of one range.
    pub(crate) fn take_adjacent(&self, g: &mut Inner, job: &Job, max_bytes: usize) -> Vec<Job> {
        let mut out: Vec<Job> = Vec::new();
        if !job.req.demand || job.req.done > 0 || job.err.is_some() || job.ranges.len() != 1 {
            return out;
        }
        let mut start = job.ranges[0].0;
        let mut end = start + job.ranges[0].1 as u64;
        loop {
            // The next block after the span, or the one before it.
            let next = g.queue.iter().enumerate().filter(|(_, r)| r.demand && r.done == 0).find_map(|(i, r)| match self.store.ranges(r.key.0, r.key.1) {
                Ok(v) if v.len() == 1 => {
                    let (o, e) = (v[0].0, v[0].0 + v[0].1 as u64);
                    let after = o >= end && o - end < MERGE_GAP && (e - start) as usize <= max_bytes;
                    let before = e <= start && start - e < MERGE_GAP && (end - o) as usize <= max_bytes;
                    (after || before).then_some((i, v))
                }
                _ => None,
            });
            let Some((i, ranges)) = next else { break };
            let r = g.queue.swap_remove(i);
            g.slots[r.slot].state = State::Loading;
            g.inflight_demand += 1;
            let total = ranges[0].1;
            let err = self.size_slot(g, r.slot, r.key.0, r.key.1, total).err();
            start = start.min(ranges[0].0);
            end = end.max(ranges[0].0 + total as u64);
            out.push(Job { req: r, ranges, total, err });
        }
        out
    }

    /// A merged read's bytes ([`Self::take_adjacent`]): (file offset, length) of the span from
    /// the first job's start to the last one's end, and each job's offset in it.
    pub(crate) fn span(jobs: &[Job]) -> ((u64, usize), Vec<usize>) {
        let start = jobs.iter().map(|j| j.ranges[0].0).min().unwrap_or(0);
        let end = jobs.iter().map(|j| j.ranges[0].0 + j.ranges[0].1 as u64).max().unwrap_or(start);
        ((start, (end - start) as usize), jobs.iter().map(|j| (j.ranges[0].0 - start) as usize).collect())
    }

    /// The job's next piece: (file offset, length). A prefetch nobody waits for is read in chunks
    /// of [`StreamConfig::prefetch_chunk`]; a demand read (or a prefetch the router now waits
    /// for) in one piece per range. `(_, 0)`: nothing left (the job fails or finishes at its report).
    pub(crate) fn piece(&self, job: &Job) -> (u64, usize) {
        if job.err.is_some() {
            return (0, 0);
        }
        let waited_on = self.inner.lock().unwrap().slots[job.req.slot].pins > 0;
        let chunk = if job.req.demand || waited_on { None } else { Some(self.cfg.prefetch_chunk) };
        next_piece(&job.ranges, job.req.done, chunk)
    }

    /// The job's remaining byte ranges from where it got, up to `max_bytes` in all (at least one
    /// piece): what an asynchronous reader reads in one go. It does not need the chunking that
    /// lets a demand read overtake a prefetch on shared I/O threads (demand reads do not wait
    /// behind it), and each of its reads completes only at the next layer.
    pub(crate) fn pieces(&self, job: &Job, max_bytes: usize) -> Vec<(u64, usize)> {
        let mut out = Vec::new();
        if job.err.is_some() {
            return out;
        }
        let (mut done, mut left) = (job.req.done, max_bytes.max(1));
        while left > 0 {
            let (off, len) = next_piece(&job.ranges, done, None);
            if len == 0 {
                break;
            }
            let len = len.min(left);
            out.push((off, len));
            done += len;
            left -= len;
        }
        out
    }

    /// Where the next `len` bytes of the job's slot are (a direct asynchronous read's
    /// destination); None when they fall outside the slot's buffer.
    pub(crate) fn piece_dest(&self, job: &Job, len: usize) -> Option<*mut u8> {
        let mut b = self.bufs[job.req.slot].write().unwrap();
        let at = job.req.done;
        b.data.get_mut(at..at + len).map(|d| d.as_mut_ptr())
    }

    /// Let `read` fill the next `len` bytes of the job's slot (its argument: the destination).
    pub(crate) fn fill(&self, job: &Job, len: usize, read: impl FnOnce(&mut [u8]) -> Result<(), ExpertError>) -> Result<(), ExpertError> {
        let mut b = self.bufs[job.req.slot].write().unwrap();
        let at = job.req.done;
        match b.data.get_mut(at..at + len) {
            Some(dst) => read(dst),
            None => Err(ExpertError::Invalid { layer: job.req.key.0, expert: job.req.key.1, why: format!("piece {at}+{len} outside the expert's {} bytes", b.data.len()) }),
        }
    }

    /// Report a piece of `len` bytes (`res`: its read's outcome; `ms`: how long it took;
    /// `lane`: the executor's lane, for the trace). The policy then finishes the job (verify,
    /// publish), or between a prefetch's chunks drops it when the router made it stale or puts
    /// it back in the queue (keeping what it has read) when a demand read needs the store.
    pub(crate) fn piece_done(&self, job: &mut Job, len: usize, res: Result<(), ExpertError>, ms: f64, lane: usize) -> Next {
        let req = &mut job.req;
        let (layer, expert) = req.key;
        let mut res = match job.err.take() {
            Some(e) => Err(e),
            None => res,
        };
        if len > 0 || res.is_err() {
            let mut g = self.inner.lock().unwrap();
            g.stats.io_busy_ms += ms;
            g.stats.reads += 1;
            if self.cfg.trace {
                let ts = now_us(self) - ms * 1000.0;
                g.trace.push(TraceEvent {
                    name: format!("{} L{layer} E{expert}", if req.demand { "demand" } else { "prefetch" }),
                    cat: "io",
                    ph: "X",
                    ts,
                    dur: ms * 1000.0,
                    pid: 1,
                    tid: 100 + lane as u32,
                });
            }
            if res.is_ok() {
                g.stats.bytes_read += len as u64;
                req.done += len;
                if req.done < job.total && !req.demand {
                    let slot = &mut g.slots[req.slot];
                    if slot.pins == 0 {
                        if slot.cancel {
                            // Stale: the router of its layer has decided without it.
                            g.drop_prefetch(req.slot);
                            g.inflight_prefetch -= 1;
                            self.retire(&mut g);
                            drop(g);
                            self.io_cv.notify_all();
                            return Next::Stop;
                        }
                        if (g.inflight_demand > 0 && !g.pf_overlap) || g.queue.iter().any(|r| r.demand) {
                            // Yield the store to the demand read; resume later from `done`.
                            g.slots[req.slot].state = State::Queued;
                            g.inflight_prefetch -= 1;
                            g.stats.prefetch_yields += 1;
                            g.queue.push(*req);
                            drop(g);
                            self.io_cv.notify_all();
                            return Next::Stop;
                        }
                    }
                }
            }
        }
        if res.is_ok() && req.done < job.total {
            return Next::Piece;
        }
        if res.is_ok() {
            let b = self.bufs[req.slot].read().unwrap();
            res = self.store.verify(layer, expert, &b.data);
        }
        let mut g = self.inner.lock().unwrap();
        if req.demand {
            g.inflight_demand -= 1;
        } else {
            g.inflight_prefetch -= 1;
        }
        match res {
            Ok(()) => {
                let slot = &mut g.slots[req.slot];
                slot.state = State::Ready;
                slot.failed = None;
                slot.cancel = false;
                if req.demand {
                    g.stats.demand_loads += 1;
                } else {
                    g.stats.prefetch_loads += 1;
                }
            }
            Err(e) => {
                // Never keep a partly read expert: the slot becomes empty again.
                g.stats.load_failures += 1;
                let slot = &mut g.slots[req.slot];
                slot.state = State::Empty;
                slot.failed = Some(e.to_string());
                slot.cancel = false;
                if slot.pins == 0 {
                    slot.key = None;
                    g.map.remove(&req.key);
                }
            }
        }
        self.retire(&mut g);
        drop(g);
        self.done_cv.notify_all();
        self.io_cv.notify_all();
        Next::Stop
    }

    /// A prefetch job its executor cannot run (e.g. the browser cannot read those bytes
    /// asynchronously): it is dropped like a stale one and the slot freed.
    pub(crate) fn abandon(&self, job: Job) {
        let mut g = self.inner.lock().unwrap();
        if job.req.demand {
            g.inflight_demand -= 1;
        } else {
            g.inflight_prefetch -= 1;
        }
        if g.slots[job.req.slot].pins == 0 && !job.req.demand {
            g.drop_prefetch(job.req.slot);
            self.retire(&mut g);
        } else {
            // Somebody waits for it: back to the queue as a demand read.
            g.slots[job.req.slot].state = State::Queued;
            let mut r = job.req;
            r.demand = true;
            g.queue.push(r);
        }
        drop(g);
        self.done_cv.notify_all();
        self.io_cv.notify_all();
    }

    /// `n` loads came in a merged read with another: count the read once.
    pub(crate) fn count_merged(&self, n: usize) {
        let mut g = self.inner.lock().unwrap();
        g.stats.merged_loads += n as u64;
        g.stats.reads -= n as u64;
    }

    pub(crate) fn store(&self) -> &dyn ExpertStore {
        &*self.store
    }

    /// The policy's lock (executors wait on [`Shared::io_cv`] / [`Shared::done_cv`] with it).
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap()
    }

    /// The executor shuts down (its owner is dropped).
    pub(crate) fn shutting_down(g: &Inner) -> bool {
        g.shutdown
    }

    /// Make `slot`'s buffer hold `total` bytes for expert (`layer`, `expert`): a slot used for the
    /// first time (or again after a shrink freed it) gets the largest expert's size, so it never
    /// grows again. When memory runs out (a failed allocation: the browser's heap cannot grow,
    /// a process limit), the cache gives back half the slots that hold experts (never below
    /// top-k + 1) and tries once more; failing again, the read fails with an error instead of
    /// the process aborting.
    fn size_slot(&self, g: &mut Inner, slot: usize, layer: usize, expert: usize, total: usize) -> Result<(), ExpertError> {
        let cap = self.slot_bytes.max(total);
        let reserve = |b: &mut ExpertBlock| {
            let want = cap.saturating_sub(b.data.len());
            if b.data.capacity() >= cap || b.data.try_reserve_exact(want).is_ok() {
                b.data.resize(total, 0);
                b.layout = self.store.layout(layer).clone();
                b.repacked = [false; 3];
                true
            } else {
                false
            }
        };
        if reserve(&mut self.bufs[slot].write().unwrap()) {
            return Ok(());
        }
        // Half of the slots that hold (or are getting) an expert now: shrinking an empty tail
        // would free nothing.
        let top = g.high.max(g.limit);
        let held = g.slots[..top].iter().filter(|s| s.key.is_some()).count();
        let keep = (held / 2).max(self.min_slots);
        if keep < g.limit {
            g.limit = keep;
            g.stats.slot_changes += 1;
            g.stats.oom_shrinks += 1;
            self.retire(g);
        }
        if reserve(&mut self.bufs[slot].write().unwrap()) {
            return Ok(());
        }
        Err(ExpertError::Invalid { layer, expert, why: format!("out of memory for its {cap}-byte buffer, also after the expert cache gave back slots (now {})", g.limit) })
    }

    /// Free the slots at or above the limit that nobody uses or reads now (after a shrink):
    /// their experts leave the cache and their buffers the process. Prefetches still being
    /// read into them are cancelled (dropped at their next chunk, then freed here). Cheap when
    /// nothing is left to free. Returns the bytes freed.
    pub(super) fn retire(&self, g: &mut Inner) -> usize {
        if g.high <= g.limit {
            return 0;
        }
        let (mut freed, mut busy_top) = (0, g.limit);
        for s in g.limit..g.high {
            let sl = &mut g.slots[s];
            if sl.pins > 0 || sl.state == State::Loading {
                if sl.pins == 0 && sl.prefetched_unused {
                    sl.cancel = true;
                }
                busy_top = s + 1;
                continue;
            }
            if sl.state == State::Queued {
                // A prefetch nobody waits for (a waited-for request holds a pin).
                g.queue.retain(|r| r.slot != s);
                g.stats.prefetch_cancelled += 1;
            }
            let sl = &mut g.slots[s];
            if let Some(k) = sl.key.take() {
                g.map.remove(&k);
            }
            let sl = &mut g.slots[s];
            sl.state = State::Empty;
            sl.hot = false;
            sl.prefetched_unused = false;
            sl.cancel = false;
            sl.failed = None;
            // Nobody holds this buffer's lock: readers pin the slot, writers load it.
            let mut b = self.bufs[s].write().unwrap();
            freed += b.data.capacity();
            b.data = Vec::new();
        }
        g.high = busy_top;
        g.stats.slot_bytes_freed += freed as u64;
        freed
    }

    /// Does the compute thread wait for (or use) `slot`?
    pub(crate) fn pinned(g: &Inner, slot: usize) -> bool {
        g.slots[slot].pins > 0
    }
}

impl Inner {
    /// A slot to (re)use, or None if every slot is busy (loading, pinned, hot or protected).
    /// Empty slots go first, then stale prefetches (their layer's router has decided without
    /// them), then the policy's choice.
    pub(super) fn victim(&self, policy: Policy, protect: &HashSet<(usize, usize)>) -> Option<usize> {
        let mut best: Option<(usize, (u8, f64, u64))> = None;
        for (i, s) in self.slots[..self.limit].iter().enumerate() {
            if s.pins > 0 || matches!(s.state, State::Queued | State::Loading) || s.hot {
                continue;
            }
            if let Some(k) = s.key {
                if protect.contains(&k) {
                    continue;
                }
            }
            let class = match (s.state, s.prefetched_unused, s.key) {
                (State::Empty, _, _) | (_, _, None) => 0u8,
                (_, true, Some(k)) if k.0 <= self.cur_layer => 1,
                _ => 2,
            };
            let primary = self.retention(policy, s.key.unwrap_or((0, 0)));
            let score = (class, primary, s.last_use);
            let better = match &best {
                None => true,
                Some((_, b)) => score.0 < b.0 || (score.0 == b.0 && (score.1 < b.1 || (score.1 == b.1 && score.2 < b.2))),
            };
            if better {
                best = Some((i, score));
            }
        }
        best.map(|b| b.0)
    }

    /// Forget a prefetch that will not be used (queued, or stopped between chunks): its slot
    /// becomes empty.
    pub(super) fn drop_prefetch(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        if let Some(k) = s.key.take() {
            self.map.remove(&k);
        }
        s.state = State::Empty;
        s.prefetched_unused = false;
        s.cancel = false;
        self.stats.prefetch_cancelled += 1;
    }

    /// Drop the queued prefetches (never demand reads) that `stale` picks.
    pub(super) fn drop_queued(&mut self, stale: impl Fn(&Req, &Slot) -> bool) {
        for r in std::mem::take(&mut self.queue) {
            if !r.demand && stale(&r, &self.slots[r.slot]) {
                self.drop_prefetch(r.slot);
            } else {
                self.queue.push(r);
            }
        }
    }

    pub(super) fn assign(&mut self, slot: usize, key: (usize, usize), demand: bool, dist: usize) {
        if let Some(old) = self.slots[slot].key.take() {
            if self.slots[slot].prefetched_unused && self.slots[slot].state == State::Ready {
                self.stats.prefetch_evicted_unused += 1;
            }
            self.map.remove(&old);
        }
        let s = &mut self.slots[slot];
        s.key = Some(key);
        s.state = State::Queued;
        s.prefetched_unused = !demand;
        s.failed = None;
        s.cancel = false;
        s.last_use = self.clock;
        self.map.insert(key, slot);
        self.seq += 1;
        self.queue.push(Req { slot, key, demand, dist, seq: self.seq, done: 0 });
    }

    /// How much `policy` wants expert `k` kept (higher: keep; LRU: 0, the caller breaks ties by
    /// last use). Next-use: minus the estimated layers until its next use.
    pub(super) fn retention(&self, policy: Policy, k: (usize, usize)) -> f64 {
        policy.retention(self.freq.get(&k).copied().unwrap_or(0.0) as f64, k.0, self.cur_layer, self.n_layers)
    }

    pub(super) fn touch(&mut self, slot: usize) {
        self.clock += 1;
        let s = &mut self.slots[slot];
        s.last_use = self.clock;
        if s.prefetched_unused {
            s.prefetched_unused = false;
            self.stats.prefetch_used += 1;
        }
        if let Some(k) = s.key {
            self.count_use(k);
        }
    }

    /// One use of expert `k` toward the decayed frequencies of [`Policy::Lfu`] / `NextUse`.
    pub(super) fn count_use(&mut self, k: (usize, usize)) {
        *self.freq.entry(k).or_insert(0.0) += 1.0;
    }
}
