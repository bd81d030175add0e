//! The streaming expert cache with Lookahead Expert Scheduling.
//!
//! * A fixed pool of expert **slots** sized from the memory budget; each slot owns one buffer for
//!   the whole run (no per-load allocation, so memory stays flat).
//! * An **I/O pool** of worker threads reads experts from an [`ExpertStore`] in priority order:
//!   demand misses first, then prefetches by lookahead distance. Prefetches never occupy every
//!   worker, so a demand miss always starts at once.
//! * **Lookahead**: when layer *l*'s FFN input is known, the routers of layers *l+1..l+D* are
//!   applied to it (cross-layer prediction) and, optionally, the previous token's experts of those
//!   layers are added (temporal prediction); predicted experts are prefetched.
//! * When the real router decides, resident experts are handed to the model first and misses as
//!   their bytes arrive. Stale prefetches for layers already decided are cancelled.
//! * Eviction never touches a slot in use or loading; unused prefetches go first, then the
//!   policy's choice (LRU, frequency-aware, with an optional pinned hot set).
//!
//! The model combines expert outputs in rank order, so all of this changes only *when* bytes
//! arrive, never the logits.

use super::governor::{Arm, Governor, GovernorConfig, GovernorStats};
use super::io::{AsyncIo, AsyncReader, Inline, ReadExecutor, Threads};
use super::store::ExpertStore;
use super::{ExpertBlock, ExpertError, ExpertLayout, ExpertSource};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use web_time::Instant;

/// Per-token decay of the use counts behind [`Policy::Lfu`] and [`Policy::NextUse`].
const FREQ_DECAY: f32 = 0.95;

/// Eviction policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Frequency-aware: lowest exponentially decayed use count, ties by recency.
    Lfu,
    /// Belady-like: evict the expert whose next use is estimated farthest away, in layer steps:
    /// the layers until its layer runs again, plus `n_layer × (1/p − 1)` for the tokens until it
    /// is routed again, with `p` its decayed use frequency per token (experts predicted for
    /// the coming layers are protected separately).
    NextUse,
}

impl Policy {
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Lfu => "lfu",
            Policy::NextUse => "next-use",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "lru" => Some(Policy::Lru),
            "lfu" | "freq" => Some(Policy::Lfu),
            "next-use" | "nextuse" => Some(Policy::NextUse),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Expert slots (from the memory budget).
    pub slots: usize,
    pub policy: Policy,
    /// Lookahead prefetching on/off.
    pub prefetch: bool,
    /// Lookahead depth D (layers ahead).
    pub depth: usize,
    /// Extra candidates per predicted layer beyond the top-k (cross-layer prediction).
    pub extra: usize,
    /// Add the previous token's experts of the predicted layers (temporal prediction).
    pub temporal: bool,
    /// I/O worker threads (reads in flight).
    pub io_threads: usize,
    /// Prefetch reads (chunks) allowed in flight at once.
    pub max_prefetch_inflight: usize,
    /// Prefetches are read in chunks of at most this many bytes (aligned to multiples of it in
    /// the file) and only while no demand read is queued or in flight (queued only, on a store
    /// that serves reads in submission order: there a chunk queued behind a demand read cannot
    /// slow it): a demand miss waits for at most the chunks in flight, and a stale prefetch is
    /// cancelled between chunks. So prefetching uses only I/O time the store would otherwise
    /// leave idle.
    pub prefetch_chunk: usize,
    /// Second lookahead stage: re-predict layer l+1 and predict l+2 from layer l's output.
    /// Off by default: higher recall (80% vs 56%) but measured slower (BENCHMARKS.md).
    pub residual_stage: bool,
    /// Refinement: as soon as layer l's first expert has been computed, route the residual plus
    /// that expert's output with router l+1 and put its picks ahead of the first stage's
    /// (queued prefetches of l+1 it does not confirm are dropped). Offline on SmolMoE-32x2
    /// (`tools/predictor_recall.py --partial`): recall 68-71% vs 56%, available before the
    /// layer's misses have arrived; online 69.3% (`les run --store phone-4GBps`). On by default.
    pub refine: bool,
    /// Layers ahead prefetched from a draft's hidden states ([`ExpertSource::on_draft_hidden`]).
    pub draft_depth: usize,
    /// Experts never evicted (layer, expert), e.g. from a recorded routing trace.
    pub pinned: Vec<(usize, usize)>,
    /// Record a Chrome trace-event timeline.
    pub trace: bool,
    /// With `prefetch`: measure while decoding whether prefetching makes tokens faster and turn
    /// it off while it does not ([`super::governor`]). Off: prefetch always.
    pub adaptive: bool,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self { slots: 64, policy: Policy::NextUse, prefetch: true, depth: 2, extra: 0, temporal: true, io_threads: 4, max_prefetch_inflight: 1, prefetch_chunk: 1 << 20, residual_stage: false, refine: true, draft_depth: 4, pinned: vec![], trace: false, adaptive: true }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Empty,
    Queued,
    Loading,
    Ready,
}

#[derive(Clone, Debug)]
struct Slot {
    key: Option<(usize, usize)>,
    state: State,
    pins: u32,
    last_use: u64,
    /// Loaded by a prefetch and not used since.
    prefetched_unused: bool,
    hot: bool,
    /// Error text of the last failed load (state is Empty then).
    failed: Option<String>,
    /// A prefetch in flight that the router has made stale: its worker drops it at the next chunk.
    cancel: bool,
}

#[derive(Clone, Copy, Debug)]
struct Req {
    slot: usize,
    key: (usize, usize),
    demand: bool,
    dist: usize,
    seq: u64,
    /// Bytes already read (a chunked prefetch that yielded to a demand read).
    done: usize,
}

/// Per-layer counters.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LayerStats {
    /// Routed experts resident when the router decided.
    pub hits: u64,
    /// Routed experts whose prefetch was still in flight.
    pub late: u64,
    /// Routed experts not resident and not in flight.
    pub misses: u64,
    /// Per lookahead distance d (index d-1): routed experts that were predicted (true positives),
    /// all predictions made, all routed experts seen with a prediction for that distance.
    pub pred_tp: Vec<u64>,
    pub pred_made: Vec<u64>,
    pub pred_routed: Vec<u64>,
    pub stall_ms: f64,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StreamStats {
    pub tokens: u64,
    pub bytes_read: u64,
    pub reads: u64,
    pub demand_loads: u64,
    pub prefetch_loads: u64,
    pub prefetch_used: u64,
    pub prefetch_evicted_unused: u64,
    pub prefetch_cancelled: u64,
    /// Times a chunked prefetch paused to let a demand read use the store.
    pub prefetch_yields: u64,
    /// Draft-hidden-state predictions (speculative verification): routed experts that were
    /// predicted, experts predicted, experts routed in layers that had a prediction.
    pub draft_pred_tp: u64,
    pub draft_pred_made: u64,
    pub draft_pred_routed: u64,
    /// Refined predictions of layer l+1 (from layer l's partial output): true positives, made,
    /// routed experts of layers that had one.
    pub refine_pred_tp: u64,
    pub refine_pred_made: u64,
    pub refine_pred_routed: u64,
    pub load_failures: u64,
    pub stall_ms: f64,
    /// Sum over workers of time spent reading.
    pub io_busy_ms: f64,
    pub wall_ms: f64,
    pub layers: Vec<LayerStats>,
    /// Tokens of the forwards the prefetch governor measured with prefetching on / off.
    pub prefetch_on_tokens: u64,
    pub prefetch_off_tokens: u64,
    /// The governor since the source was made (None: prefetching off, or always on).
    pub governor: Option<GovernorStats>,
}

impl StreamStats {
    /// Zeroed counters for `n_layers` layers and lookahead depth `d`.
    fn empty(n_layers: usize, d: usize) -> Self {
        let layer = LayerStats { pred_tp: vec![0; d], pred_made: vec![0; d], pred_routed: vec![0; d], ..Default::default() };
        Self { layers: vec![layer; n_layers], ..Default::default() }
    }
    pub fn hit_rate(&self) -> f64 {
        let (h, t) = self.layers.iter().fold((0, 0), |(h, t), l| (h + l.hits, t + l.hits + l.late + l.misses));
        if t == 0 { 0.0 } else { h as f64 / t as f64 }
    }
    /// Recall at lookahead distance d (1-based): routed experts that had been predicted.
    pub fn recall(&self, d: usize) -> f64 {
        let (tp, r) = self.layers.iter().fold((0, 0), |(a, b), l| (a + l.pred_tp.get(d - 1).copied().unwrap_or(0), b + l.pred_routed.get(d - 1).copied().unwrap_or(0)));
        if r == 0 { 0.0 } else { tp as f64 / r as f64 }
    }
    pub fn precision(&self, d: usize) -> f64 {
        let (tp, m) = self.layers.iter().fold((0, 0), |(a, b), l| (a + l.pred_tp.get(d - 1).copied().unwrap_or(0), b + l.pred_made.get(d - 1).copied().unwrap_or(0)));
        if m == 0 { 0.0 } else { tp as f64 / m as f64 }
    }
    /// Recall and precision of the experts predicted from a draft's hidden states (None: no draft
    /// predictions were made).
    pub fn draft_recall(&self) -> Option<f64> {
        (self.draft_pred_routed > 0).then(|| self.draft_pred_tp as f64 / self.draft_pred_routed as f64)
    }
    pub fn draft_precision(&self) -> Option<f64> {
        (self.draft_pred_made > 0).then(|| self.draft_pred_tp as f64 / self.draft_pred_made as f64)
    }
    /// Recall of the refined l+1 predictions (None: refinement off or never fired).
    pub fn refine_recall(&self) -> Option<f64> {
        (self.refine_pred_routed > 0).then(|| self.refine_pred_tp as f64 / self.refine_pred_routed as f64)
    }
    pub fn refine_precision(&self) -> Option<f64> {
        (self.refine_pred_made > 0).then(|| self.refine_pred_tp as f64 / self.refine_pred_made as f64)
    }
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes_read as f64 / self.tokens.max(1) as f64
    }
    pub fn stall_ms_per_token(&self) -> f64 {
        self.stall_ms / self.tokens.max(1) as f64
    }
    /// Fraction of wall time the I/O pool was busy (summed worker time / (wall × workers)).
    pub fn io_busy_fraction(&self, workers: usize) -> f64 {
        if self.wall_ms <= 0.0 { 0.0 } else { self.io_busy_ms / (self.wall_ms * workers.max(1) as f64) }
    }
    /// Share of the measured tokens that ran with prefetching on (None: no governor).
    pub fn prefetch_on_share(&self) -> Option<f64> {
        let n = self.prefetch_on_tokens + self.prefetch_off_tokens;
        (self.governor.is_some() && n > 0).then(|| self.prefetch_on_tokens as f64 / n as f64)
    }
}

/// A Chrome trace event (`chrome://tracing`, Perfetto).
#[derive(Clone, Debug, serde::Serialize)]
pub struct TraceEvent {
    pub name: String,
    pub cat: &'static str,
    pub ph: &'static str,
    pub ts: f64,
    pub dur: f64,
    pub pid: u32,
    pub tid: u32,
}

/// The policy's state, behind [`Shared`]'s lock.
pub(crate) struct Inner {
    slots: Vec<Slot>,
    map: HashMap<(usize, usize), usize>,
    queue: Vec<Req>,
    seq: u64,
    clock: u64,
    freq: HashMap<(usize, usize), f32>,
    inflight_prefetch: usize,
    inflight_demand: usize,
    /// Prefetches may start while a demand read is in flight: the store serves reads in
    /// submission order ([`ExpertStore::serves_in_order`]), so one queued behind the demand
    /// read cannot slow it. They still yield to a demand read that is queued.
    pf_overlap: bool,
    /// The MoE layer whose experts were requested last (eviction by next use).
    cur_layer: usize,
    n_layers: usize,
    /// predictions[layer][d-1] = experts predicted for `layer` at distance d this step.
    predictions: Vec<Vec<Vec<usize>>>,
    /// Experts each layer used in the previous step (temporal predictor).
    last_route: Vec<Vec<usize>>,
    /// Per layer: the union of experts a draft's hidden states route to for the coming forward.
    draft_hints: Vec<Vec<usize>>,
    /// Per layer: the refined prediction made from the previous layer's partial output.
    refined: Vec<Vec<usize>>,
    stats: StreamStats,
    trace: Vec<TraceEvent>,
    /// Every routed (layer, expert) in order (for oracle bounds).
    route_log: Vec<(u32, u32)>,
    shutdown: bool,
    /// Prefetching on or off ([`StreamConfig::adaptive`]).
    gov: Option<Governor>,
    /// The forward being measured: its start (µs since `t0`), tokens, and whether it counts
    /// (decode or speculative verification, not a prompt).
    fwd: Option<(f64, usize, bool)>,
    /// When the last `with_experts` call returned (µs since `t0`).
    fwd_end: f64,
    /// The next forward verifies a draft (set by `on_draft_hidden`).
    verifying: bool,
}

/// The policy: its state, the slot buffers and the store, shared with the executor's threads.
pub(crate) struct Shared {
    inner: Mutex<Inner>,
    /// Signalled when requests were queued (executor threads wait on it).
    pub(crate) io_cv: Condvar,
    /// Signalled when a read finished (the compute thread waits on it).
    pub(crate) done_cv: Condvar,
    bufs: Vec<RwLock<ExpertBlock>>,
    store: Arc<dyn ExpertStore>,
    cfg: StreamConfig,
    t0: Instant,
    /// Prefetching runs now: `cfg.prefetch`, and the governor's arm when adaptive.
    pf_on: AtomicBool,
}

/// [`ExpertSource`] backed by a slot cache over an [`ExpertStore`], with lookahead prefetch.
pub struct StreamingExperts {
    sh: Arc<Shared>,
    /// Who executes the reads ([`super::io`]).
    exec: RwLock<Arc<dyn ReadExecutor>>,
    /// Router weights per MoE layer as f32 [n_expert × n_embd] (for cross-layer prediction).
    routers: Vec<Vec<f32>>,
    n_expert: usize,
    n_used: usize,
    hidden: Mutex<Vec<f32>>,
    /// Per-layer FFN norm weights (`ffn_norm`), to re-weight layer l's normed hidden state as
    /// layer l+d's norm would before applying l+d's router. Empty: use the state as it is.
    ffn_norms: Vec<Vec<f32>>,
    /// Per-layer router biases (`ffn_gate_inp.bias`, gpt-oss), added to the predicted logits.
    router_b: Vec<Vec<f32>>,
    /// Experts a consumer (GPU slots) holds: never prefetched.
    holder: std::sync::RwLock<Option<Arc<dyn super::ExpertHolder>>>,
}

impl StreamingExperts {
    /// Give the predictor each layer's router bias (`ffn_gate_inp.bias`; empty: none).
    pub fn with_router_biases(mut self, b: Vec<Vec<f32>>) -> Self {
        self.router_b = b;
        self
    }

    /// Give the predictor each layer's `ffn_norm` weights (improves cross-layer recall).
    pub fn with_ffn_norms(mut self, norms: Vec<Vec<f32>>) -> Self {
        self.ffn_norms = norms;
        self
    }

    /// `routers[l]`: layer l's router (`ffn_gate_inp`) as f32, row-major [n_expert][n_embd].
    pub fn new(store: Arc<dyn ExpertStore>, routers: Vec<Vec<f32>>, n_expert: usize, n_used: usize, cfg: StreamConfig) -> Self {
        let n_layers = store.n_layers();
        let max_bytes = (0..n_layers).map(|l| store.layout(l).bytes()).max().unwrap_or(0);
        let bufs = (0..cfg.slots)
            .map(|_| RwLock::new(ExpertBlock { data: Vec::with_capacity(max_bytes), layout: store.layout(0).clone() }))
            .collect();
        let empty = Slot { key: None, state: State::Empty, pins: 0, last_use: 0, prefetched_unused: false, hot: false, failed: None, cancel: false };
        let d = cfg.depth.max(1);
        let stats = StreamStats::empty(n_layers, d);
        let inner = Inner {
            slots: vec![empty; cfg.slots],
            map: HashMap::new(),
            queue: Vec::new(),
            seq: 0,
            clock: 0,
            freq: HashMap::new(),
            inflight_prefetch: 0,
            inflight_demand: 0,
            pf_overlap: store.serves_in_order(),
            cur_layer: 0,
            n_layers,
            predictions: vec![vec![Vec::new(); d]; n_layers],
            last_route: vec![Vec::new(); n_layers],
            draft_hints: vec![Vec::new(); n_layers],
            refined: vec![Vec::new(); n_layers],
            stats,
            trace: Vec::new(),
            route_log: Vec::new(),
            shutdown: false,
            gov: (cfg.prefetch && cfg.adaptive).then(|| Governor::new(GovernorConfig::default())),
            fwd: None,
            fwd_end: 0.0,
            verifying: false,
        };
        let pf_on = AtomicBool::new(cfg.prefetch);
        let sh = Arc::new(Shared { inner: Mutex::new(inner), io_cv: Condvar::new(), done_cv: Condvar::new(), bufs, store, cfg: cfg.clone(), t0: Instant::now(), pf_on });
        // `io_threads == 0` (always on wasm32, which has no threads): no workers; the thread
        // that needs an expert reads it itself (the browser installs its own executor).
        let n_workers = if cfg!(target_arch = "wasm32") { 0 } else { cfg.io_threads };
        let exec: Arc<dyn ReadExecutor> = if n_workers == 0 { Arc::new(Inline) } else { Arc::new(Threads::spawn(&sh, n_workers, cfg.max_prefetch_inflight)) };
        let s = Self { sh, exec: RwLock::new(exec), routers, n_expert, n_used, hidden: Mutex::new(Vec::new()), ffn_norms: Vec::new(), router_b: Vec::new(), holder: std::sync::RwLock::new(None) };
        s.load_pinned();
        s
    }

    /// Load the pinned hot set (blocking), marking those slots never-evict.
    fn load_pinned(&self) {
        let pins = self.sh.cfg.pinned.clone();
        for (l, e) in pins {
            if l >= self.routers.len() || e >= self.n_expert {
                continue;
            }
            let ok = self.with_experts(l, &[e as u32], &mut |_, _| {}).is_ok();
            let mut g = self.sh.inner.lock().unwrap();
            if let (true, Some(&s)) = (ok, g.map.get(&(l, e))) {
                g.slots[s].hot = true;
            }
        }
        let mut g = self.sh.inner.lock().unwrap();
        let d = self.sh.cfg.depth.max(1);
        g.stats = StreamStats::empty(self.routers.len(), d);
    }

    /// Read prefetches through `reader` from now on ([`AsyncIo`]: the browser page's
    /// asynchronous reads, `lanes` in flight); demand reads run on the compute thread.
    pub fn use_async_reader<R: AsyncReader + 'static>(&self, reader: R, lanes: usize) {
        self.set_executor(Arc::new(AsyncIo::new(reader, lanes)));
    }

    /// Run reads with `exec` from now on. The previous executor is shut down; requests it had
    /// not started stay queued for the new one.
    fn set_executor(&self, exec: Arc<dyn ReadExecutor>) {
        let old = std::mem::replace(&mut *self.exec.write().unwrap(), exec);
        old.shutdown(&self.sh);
        self.kick();
    }

    /// What executes the reads (for statistics).
    pub fn executor(&self) -> String {
        self.exec().describe()
    }

    fn exec(&self) -> Arc<dyn ReadExecutor> {
        self.exec.read().unwrap().clone()
    }

    fn kick(&self) {
        self.exec().kick(&self.sh);
    }

    pub fn stats(&self) -> StreamStats {
        let g = self.sh.inner.lock().unwrap();
        let mut s = g.stats.clone();
        s.wall_ms = self.sh.t0.elapsed().as_secs_f64() * 1000.0;
        s.governor = g.gov.as_ref().map(|v| v.stats());
        s
    }

    /// Whether lookahead prefetching runs now (configured on, and the governor's choice).
    pub fn prefetching(&self) -> bool {
        self.sh.pf_on.load(Ordering::Relaxed)
    }

    /// A forward's first MoE layer: close the measurement of the one before (from its first
    /// layer to its last `with_experts` return) and hand it to the governor.
    fn start_forward(&self, g: &mut Inner, n_tok: usize) {
        let now = now_us(&self.sh);
        if let (Some((start, n, true)), Some(gov)) = (g.fwd, g.gov.as_mut()) {
            if g.fwd_end > start {
                let arm = gov.arm();
                let next = gov.record((g.fwd_end - start) / 1000.0, n as u32);
                match arm {
                    Arm::On => g.stats.prefetch_on_tokens += n as u64,
                    Arm::Off => g.stats.prefetch_off_tokens += n as u64,
                }
                if next != arm {
                    self.sh.pf_on.store(next == Arm::On, Ordering::Relaxed);
                    if next == Arm::Off {
                        // Queued prefetches not started yet would still cost their reads.
                        g.drop_queued(|r, slot| r.done == 0 && slot.pins == 0);
                    }
                }
            }
        }
        let counts = n_tok == 1 || std::mem::take(&mut g.verifying);
        g.fwd = Some((now, n_tok, counts));
    }

    /// Reset counters (not the cache contents).
    pub fn reset_stats(&self) {
        let mut g = self.sh.inner.lock().unwrap();
        let d = self.sh.cfg.depth.max(1);
        g.stats = StreamStats::empty(self.routers.len(), d);
        g.trace.clear();
        g.route_log.clear();
    }

    /// Load `ids` of `layer` through the cache (benchmarks: measures store throughput).
    pub fn with_experts_for_bench(&self, layer: usize, ids: &[u32]) -> Result<(), ExpertError> {
        self.with_experts(layer, ids, &mut |_, _| {})
    }

    /// The routed (layer, expert) sequence since the last call.
    pub fn take_route_log(&self) -> Vec<(u32, u32)> {
        std::mem::take(&mut self.sh.inner.lock().unwrap().route_log)
    }

    pub fn take_trace(&self) -> Vec<TraceEvent> {
        std::mem::take(&mut self.sh.inner.lock().unwrap().trace)
    }

    /// Lookahead: apply the routers of layers layer+1..layer+D to the stored hidden state of
    /// `layer` and queue prefetches for predicted experts that are not resident.
    /// Queue prefetches for the layers after `layer` (`None`: from layer 0, before a forward,
    /// from a draft's hidden states).
    fn prefetch_after(&self, after: Option<usize>) {
        let sh = &self.sh;
        let h = if after.is_some() { self.hidden.lock().unwrap().clone() } else { Vec::new() };
        let layer = after.unwrap_or(0);
        let first = after.map_or(0, |l| l + 1);
        let n_layers = self.routers.len();
        let mut plans = Vec::new();
        // Experts routed from a draft's hidden states (speculative verification), nearest first.
        {
            let g = sh.inner.lock().unwrap();
            for l2 in first..(first + sh.cfg.draft_depth).min(n_layers) {
                if !g.draft_hints[l2].is_empty() {
                    plans.push((l2, l2 + 1 - first, g.draft_hints[l2].clone(), false));
                }
            }
        }
        for d in 1..=sh.cfg.depth {
            if h.is_empty() {
                break;
            }
            let l2 = layer + d;
            if l2 >= n_layers {
                break;
            }
            let hp: Vec<f32> = match (self.ffn_norms.get(layer), self.ffn_norms.get(l2)) {
                (Some(a), Some(b)) if a.len() == h.len() && b.len() == h.len() => {
                    h.iter().zip(a).zip(b).map(|((&x, &wa), &wb)| if wa.abs() > 1e-6 { x / wa * wb } else { 0.0 }).collect()
                }
                _ => h.clone(),
            };
            plans.push((l2, d, self.predict(l2, &hp), true));
        }
        self.queue_plans(plans);
    }

    /// Two-stage lookahead: layer `layer`'s output (the residual after its FFN) routes layer
    /// l+1 far better than its FFN input did (SmolMoE-32x2: recall 74.8% vs 56.4%,
    /// `tools/predictor_recall.py`) with less time left, and layer l+2 about as well as the
    /// first stage routed l+1, with more. Queued prefetches of l+1 that the second stage does not
    /// confirm are dropped; its picks go first.
    ///
    /// `partial`: `x` holds only some of layer l's experts (refinement, [`StreamConfig::refine`]):
    /// re-predict l+1 only, and count its recall on its own.
    fn prefetch_from_residual(&self, layer: usize, x: &[f32], partial: bool) {
        let sh = &self.sh;
        let n_layers = self.routers.len();
        let mut plans = Vec::new();
        let s = rms_scale(x);
        for (l2, d) in [(layer + 1, 0), (layer + 2, 1)] {
            if l2 >= n_layers || (partial && d > 0) {
                continue;
            }
            let p = self.predict(l2, &self.ffn_normed(l2, x, s));
            if d == 0 {
                // Drop queued (not started) prefetches of l+1 this stage does not confirm.
                let mut g = sh.inner.lock().unwrap();
                g.drop_queued(|r, slot| r.done == 0 && r.key.0 == l2 && !p.contains(&r.key.1) && slot.pins == 0);
                if partial {
                    g.refined[l2] = p.clone();
                } else {
                    // Recall@1 counts what the two stages predicted together.
                    let mut all = g.predictions[l2][0].clone();
                    all.extend(p.iter().copied().filter(|e| !g.predictions[l2][0].contains(e)));
                    g.predictions[l2][0] = all;
                }
            }
            plans.push((l2, d, p, false));
        }
        self.queue_plans(plans);
    }

    /// Queue prefetches: `(layer, queue distance, experts, add temporal candidates)`.
    fn queue_plans(&self, plans: Vec<(usize, usize, Vec<usize>, bool)>) {
        let sh = &self.sh;
        if plans.is_empty() {
            return;
        }
        let holder = self.holder.read().unwrap().clone();
        let lanes = self.exec().prefetch_lanes();
        let mut g = sh.inner.lock().unwrap();
        let mut protect: HashSet<(usize, usize)> = HashSet::new();
        for (l2, _, p, _) in &plans {
            protect.extend(p.iter().map(|&e| (*l2, e)));
        }
        // When the executor cannot read ahead (no I/O threads), a prefetch could only run on
        // this thread, before the compute it should overlap: give the byte source a hint instead
        // (the browser store starts an asynchronous range fetch) and keep the slots for demand
        // loads.
        let mut hints: Vec<(usize, usize)> = Vec::new();
        for (l2, d, mut p, cross_layer) in plans {
            if cross_layer {
                g.predictions[l2][d - 1] = p.clone();
            }
            // Load order: the router's top-k, then the previous token's experts, then the extra
            // candidates (most likely first).
            if cross_layer && sh.cfg.temporal {
                let extras = p.split_off(self.n_used.min(p.len()));
                for e in g.last_route[l2].clone().into_iter().chain(extras) {
                    if !p.contains(&e) {
                        p.push(e);
                    }
                }
            }
            for e in p {
                let key = (l2, e);
                if g.map.contains_key(&key) || holder.as_ref().is_some_and(|h| h.holds(l2, e)) {
                    continue;
                }
                if lanes == 0 {
                    hints.push(key);
                    continue;
                }
                match g.victim(sh.cfg.policy, &protect) {
                    Some(v) => g.assign(v, key, false, d),
                    None => break,
                }
            }
        }
        drop(g);
        for (l, e) in hints {
            sh.store.hint(l, e);
        }
        self.kick();
    }

    pub fn config(&self) -> &StreamConfig {
        &self.sh.cfg
    }

    /// Experts resident now (for tests and inspection).
    pub fn resident(&self) -> Vec<(usize, usize)> {
        let g = self.sh.inner.lock().unwrap();
        g.slots.iter().filter(|s| s.state == State::Ready).filter_map(|s| s.key).collect()
    }

    /// `x · scale`, times layer `l`'s `ffn_norm` weights when known: a residual-stream row as
    /// layer `l`'s router sees it (up to the norm's epsilon, which cannot change the top-k).
    fn ffn_normed(&self, l: usize, x: &[f32], scale: f32) -> Vec<f32> {
        match self.ffn_norms.get(l) {
            Some(w) if w.len() == x.len() => x.iter().zip(w).map(|(v, w)| v * scale * w).collect(),
            _ => x.iter().map(|v| v * scale).collect(),
        }
    }

    fn predict(&self, layer: usize, h: &[f32]) -> Vec<usize> {
        let r = &self.routers[layer];
        let b = self.router_b.get(layer).filter(|b| b.len() == self.n_expert);
        let n_embd = h.len();
        let mut logits: Vec<(f32, usize)> = (0..self.n_expert)
            .map(|e| {
                let w = &r[e * n_embd..(e + 1) * n_embd];
                (dot8(w, h) + b.map_or(0.0, |b| b[e]), e)
            })
            .collect();
        logits.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1)));
        logits.iter().take(self.n_used + self.sh.cfg.extra).map(|x| x.1).collect()
    }
}

impl Drop for StreamingExperts {
    fn drop(&mut self) {
        self.sh.inner.lock().unwrap().shutdown = true;
        self.exec().shutdown(&self.sh);
    }
}

/// f32 dot product with eight independent partial sums (vectorised by the compiler). The
/// predictor runs on the compute thread for every layer, so its router products must be cheap;
/// their rounding only orders I/O, never the logits.
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Score a prediction (experts of one layer) against the routed `keys`: add its true positives,
/// its size and the routed count to `(tp, made, routed)`. An empty prediction counts nothing.
fn tally(pred: &[usize], keys: &[(usize, usize)], (tp, made, routed): (&mut u64, &mut u64, &mut u64)) {
    if pred.is_empty() {
        return;
    }
    *tp += keys.iter().filter(|k| pred.contains(&k.1)).count() as u64;
    *made += pred.len() as u64;
    *routed += keys.len() as u64;
}

/// 1 / RMS(x): RMSNorm's scale.
fn rms_scale(x: &[f32]) -> f32 {
    let ss = x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32;
    1.0 / (ss + 1e-6).sqrt()
}

fn now_us(sh: &Shared) -> f64 {
    sh.t0.elapsed().as_secs_f64() * 1e6
}

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
        if err.is_none() && req.done == 0 {
            let mut b = self.bufs[req.slot].write().unwrap();
            b.layout = self.store.layout(layer).clone();
            b.data.resize(total, 0);
        }
        Some(Job { req, ranges, total, err })
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

    /// Does the compute thread wait for (or use) `slot`?
    pub(crate) fn pinned(g: &Inner, slot: usize) -> bool {
        g.slots[slot].pins > 0
    }
}

impl Inner {
    /// A slot to (re)use, or None if every slot is busy (loading, pinned, hot or protected).
    /// Empty slots go first, then stale prefetches (their layer's router has decided without
    /// them), then the policy's choice.
    fn victim(&self, policy: Policy, protect: &HashSet<(usize, usize)>) -> Option<usize> {
        let mut best: Option<(usize, (u8, f64, u64))> = None;
        for (i, s) in self.slots.iter().enumerate() {
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
    fn drop_prefetch(&mut self, slot: usize) {
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
    fn drop_queued(&mut self, stale: impl Fn(&Req, &Slot) -> bool) {
        for r in std::mem::take(&mut self.queue) {
            if !r.demand && stale(&r, &self.slots[r.slot]) {
                self.drop_prefetch(r.slot);
            } else {
                self.queue.push(r);
            }
        }
    }

    fn assign(&mut self, slot: usize, key: (usize, usize), demand: bool, dist: usize) {
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
    fn retention(&self, policy: Policy, k: (usize, usize)) -> f64 {
        let f = self.freq.get(&k).copied().unwrap_or(0.0) as f64;
        match policy {
            Policy::Lru => 0.0,
            Policy::Lfu => f,
            Policy::NextUse => {
                let n = self.n_layers.max(1);
                let layers_until = (k.0 + n - self.cur_layer % n - 1) % n;
                // Uses per token ≈ decayed count × (1 − decay) (decay 0.95 per token).
                let p = (f * (1.0 - FREQ_DECAY as f64)).clamp(0.002, 0.99);
                -(layers_until as f64 + n as f64 * (1.0 / p - 1.0))
            }
        }
    }

    fn touch(&mut self, slot: usize) {
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
    fn count_use(&mut self, k: (usize, usize)) {
        *self.freq.entry(k).or_insert(0.0) += 1.0;
    }
}

impl ExpertSource for StreamingExperts {
    fn layout(&self, layer: usize) -> &ExpertLayout {
        self.sh.store.layout(layer)
    }

    fn retention(&self, layer: usize, expert: usize) -> Option<f64> {
        let policy = self.sh.cfg.policy;
        if policy == Policy::Lru {
            return None;
        }
        Some(self.sh.inner.lock().unwrap().retention(policy, (layer, expert)))
    }

    fn on_hidden(&self, layer: usize, h: &[f32], n_tok: usize) {
        let sh = &self.sh;
        if layer == 0 {
            let mut g = sh.inner.lock().unwrap();
            self.start_forward(&mut g, n_tok);
            g.stats.tokens += n_tok as u64;
            // Decay frequencies once per step.
            for v in g.freq.values_mut() {
                *v *= FREQ_DECAY;
            }
        }
        // Keep the hidden state; predictions are issued once this layer's own experts are
        // pinned (in `with_experts`), so a prefetch can never evict them.
        let mut hs = self.hidden.lock().unwrap();
        hs.clear();
        if self.prefetching() && n_tok == 1 {
            hs.extend_from_slice(h);
        }
    }

    fn with_experts(&self, layer: usize, ids: &[u32], f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError> {
        self.with_experts_except(layer, ids, &|_| false, f)
    }

    fn wants_residual(&self) -> bool {
        self.sh.cfg.prefetch && self.sh.cfg.residual_stage
    }

    fn on_residual(&self, layer: usize, x: &[f32], n_tok: usize) {
        if self.prefetching() && self.sh.cfg.residual_stage && n_tok == 1 && layer < self.routers.len() {
            self.prefetch_from_residual(layer, x, false);
        }
    }

    fn on_partial(&self, layer: usize, x: &[f32]) {
        if self.prefetching() && self.sh.cfg.refine && layer + 1 < self.routers.len() {
            self.prefetch_from_residual(layer, x, true);
        }
    }

    fn on_draft_hidden(&self, rows: &[Vec<f32>]) {
        self.sh.inner.lock().unwrap().verifying = true;
        if !self.prefetching() || self.sh.cfg.draft_depth == 0 {
            return;
        }
        // Each row through layer l's own norm and router: the union of its top-k per layer.
        let n_layers = self.routers.len();
        let mut hints = vec![Vec::new(); n_layers];
        for (l, r) in rows.iter().enumerate().take(n_layers) {
            let e = self.routers[l].len() / self.n_expert.max(1);
            if e == 0 || r.len() % e != 0 {
                continue;
            }
            for x in r.chunks(e) {
                for ex in self.predict(l, &self.ffn_normed(l, x, rms_scale(x))).into_iter().take(self.n_used) {
                    if !hints[l].contains(&ex) {
                        hints[l].push(ex);
                    }
                }
            }
        }
        self.sh.inner.lock().unwrap().draft_hints = hints;
        // The first layers' experts now; later ones as the forward reaches them.
        self.prefetch_after(None);
    }

    fn set_holder(&self, holder: Arc<dyn super::ExpertHolder>) {
        *self.holder.write().unwrap() = Some(holder);
    }

    fn with_experts_except(&self, layer: usize, ids: &[u32], held: &dyn Fn(u32) -> bool, f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError> {
        let sh = &self.sh;
        let keys: Vec<(usize, usize)> = ids.iter().map(|&e| (layer, e as usize)).collect();
        for &(_, e) in &keys {
            if e >= self.n_expert {
                return Err(ExpertError::Invalid { layer, expert: e, why: format!("only {} experts", self.n_expert) });
            }
        }
        let needed: HashSet<(usize, usize)> = keys.iter().copied().collect();
        let mut ready: Vec<(usize, usize)> = Vec::new(); // (index, slot)
        let mut waiting: Vec<(usize, usize)> = Vec::new();
        let mut unassigned: Vec<usize> = Vec::new();
        {
            let mut g = sh.inner.lock().unwrap();
            // Cancel queued prefetches for this layer and earlier ones that the router did not pick.
            g.drop_queued(|r, _| r.key.0 <= layer && !needed.contains(&r.key));
            // In-flight ones: their workers drop them at the next chunk.
            for sl in g.slots.iter_mut() {
                if let (State::Loading, true, Some(k), 0) = (sl.state, sl.prefetched_unused, sl.key, sl.pins) {
                    if k.0 <= layer && !needed.contains(&k) {
                        sl.cancel = true;
                    }
                }
            }
            g.cur_layer = layer;
            // Prediction accounting for this layer.
            for d in 0..sh.cfg.depth {
                let p = std::mem::take(&mut g.predictions[layer][d]);
                if p.is_empty() {
                    continue;
                }
                let ls = &mut g.stats.layers[layer];
                tally(&p, &keys, (&mut ls.pred_tp[d], &mut ls.pred_made[d], &mut ls.pred_routed[d]));
            }
            let refined = std::mem::take(&mut g.refined[layer]);
            let st = &mut g.stats;
            tally(&refined, &keys, (&mut st.refine_pred_tp, &mut st.refine_pred_made, &mut st.refine_pred_routed));
            let hint = std::mem::take(&mut g.draft_hints[layer]);
            let st = &mut g.stats;
            tally(&hint, &keys, (&mut st.draft_pred_tp, &mut st.draft_pred_made, &mut st.draft_pred_routed));
            g.last_route[layer] = keys.iter().map(|k| k.1).collect();
            g.route_log.extend(keys.iter().map(|k| (k.0 as u32, k.1 as u32)));
            for (i, &key) in keys.iter().enumerate() {
                if held(key.1 as u32) {
                    // Held by the consumer (a GPU slot): a hit that needs no bytes from here.
                    // Its use still counts toward the policy's frequencies, which rank the
                    // consumer's slots too (`retention`).
                    g.stats.layers[layer].hits += 1;
                    g.count_use(key);
                    continue;
                }
                match g.map.get(&key).copied() {
                    Some(s) => {
                        g.slots[s].pins += 1;
                        match g.slots[s].state {
                            State::Ready => {
                                g.stats.layers[layer].hits += 1;
                                ready.push((i, s));
                            }
                            _ => {
                                g.stats.layers[layer].late += 1;
                                // Promote an in-flight or queued prefetch to demand priority.
                                if let Some(r) = g.queue.iter_mut().find(|r| r.slot == s) {
                                    r.demand = true;
                                }
                                waiting.push((i, s));
                            }
                        }
                    }
                    None => {
                        g.stats.layers[layer].misses += 1;
                        unassigned.push(i);
                    }
                }
            }
            let protect = needed.clone();
            unassigned.retain(|&i| match g.victim(sh.cfg.policy, &protect) {
                Some(v) => {
                    g.assign(v, keys[i], true, 0);
                    g.slots[v].pins += 1;
                    waiting.push((i, v));
                    false
                }
                None => true,
            });
        }
        self.kick();
        self.prefetch_after(Some(layer));
        let exec = self.exec();
        let unpin = |slot: usize| {
            let mut g = sh.inner.lock().unwrap();
            g.touch(slot);
            g.slots[slot].pins -= 1;
            drop(g);
            sh.done_cv.notify_all();
        };
        // Hits first.
        for (i, s) in ready {
            {
                let b = sh.bufs[s].read().unwrap();
                f(i, &b);
            }
            unpin(s);
        }
        // Then misses, as their bytes arrive.
        let mut retried: HashSet<usize> = HashSet::new();
        while !waiting.is_empty() || !unassigned.is_empty() {
            let t_wait = Instant::now();
            let ts = now_us(sh);
            let next = {
                let mut g = sh.inner.lock().unwrap();
                loop {
                    // Slots freed by our own unpins let unassigned experts start. Experts of this
                    // call already handed to the model may be evicted now.
                    let protect: HashSet<(usize, usize)> = unassigned.iter().map(|&i| keys[i]).chain(waiting.iter().map(|&(i, _)| keys[i])).collect();
                    while let Some(&i) = unassigned.first() {
                        match g.victim(sh.cfg.policy, &protect) {
                            Some(v) => {
                                g.assign(v, keys[i], true, 0);
                                g.slots[v].pins += 1;
                                waiting.push((i, v));
                                unassigned.remove(0);
                                sh.io_cv.notify_all();
                            }
                            None => break,
                        }
                    }
                    if let Some(pos) = waiting.iter().position(|&(_, s)| g.slots[s].state == State::Ready) {
                        break Ok(waiting.swap_remove(pos));
                    }
                    // A failed load: retry once, then report.
                    if let Some(pos) = waiting.iter().position(|&(_, s)| g.slots[s].state == State::Empty) {
                        let (i, s) = waiting[pos];
                        let msg = g.slots[s].failed.clone().unwrap_or_default();
                        if retried.insert(i) {
                            let key = keys[i];
                            g.map.insert(key, s);
                            g.slots[s].key = Some(key);
                            g.slots[s].state = State::Queued;
                            g.seq += 1;
                            let seq = g.seq;
                            g.queue.push(Req { slot: s, key, demand: true, dist: 0, seq, done: 0 });
                            sh.io_cv.notify_all();
                        } else {
                            // Give up: release everything we hold.
                            for &(_, s2) in &waiting {
                                g.slots[s2].pins -= 1;
                                if g.slots[s2].state == State::Empty {
                                    if let Some(k) = g.slots[s2].key.take() {
                                        g.map.remove(&k);
                                    }
                                }
                            }
                            waiting.clear();
                            break Err(ExpertError::Invalid { layer, expert: keys[i].1, why: format!("load failed twice: {msg}") });
                        }
                    }
                    g = match exec.wait(sh, g) {
                        Ok(g) => g,
                        Err(mut g) => {
                            for &(_, s2) in &waiting {
                                g.slots[s2].pins -= 1;
                            }
                            waiting.clear();
                            break Err(ExpertError::Invalid { layer, expert: keys[unassigned.first().copied().unwrap_or(0)].1, why: "no slot free and nothing to load (cache too small for one layer's experts)".into() });
                        }
                    };
                }
            };
            let (i, s) = match next {
                Ok(x) => x,
                Err(e) => {
                    sh.done_cv.notify_all();
                    return Err(e);
                }
            };
            let waited = t_wait.elapsed().as_secs_f64() * 1000.0;
            {
                let mut g = sh.inner.lock().unwrap();
                g.stats.stall_ms += waited;
                g.stats.layers[layer].stall_ms += waited;
                if sh.cfg.trace && waited > 0.01 {
                    g.trace.push(TraceEvent { name: format!("stall L{layer}"), cat: "stall", ph: "X", ts, dur: waited * 1000.0, pid: 1, tid: 1 });
                }
            }
            {
                let b = sh.bufs[s].read().unwrap();
                f(i, &b);
            }
            unpin(s);
        }
        sh.inner.lock().unwrap().fwd_end = now_us(sh);
        Ok(())
    }
}

/// Misses of a Belady-optimal cache (evict the entry used farthest in the future) of `capacity`
/// entries on `seq`, with experts of one layer step never evicting each other (`group` = top-k).
pub fn belady_misses(seq: &[(u32, u32)], capacity: usize) -> usize {
    use std::collections::BTreeSet;
    let n = seq.len();
    let mut next = vec![usize::MAX; n];
    let mut last: HashMap<(u32, u32), usize> = HashMap::new();
    for i in (0..n).rev() {
        next[i] = last.get(&seq[i]).copied().unwrap_or(usize::MAX);
        last.insert(seq[i], i);
    }
    // Resident keys ordered by next use.
    let mut by_next: BTreeSet<(usize, (u32, u32))> = BTreeSet::new();
    let mut cur_next: HashMap<(u32, u32), usize> = HashMap::new();
    let mut misses = 0;
    for i in 0..n {
        let k = seq[i];
        if let Some(nx) = cur_next.remove(&k) {
            by_next.remove(&(nx, k));
        } else {
            misses += 1;
            if cur_next.len() >= capacity.max(1) {
                if let Some(&far) = by_next.iter().next_back() {
                    by_next.remove(&far);
                    cur_next.remove(&far.1);
                }
            }
        }
        cur_next.insert(k, next[i]);
        by_next.insert((next[i], k));
    }
    misses
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expert::ExpertLayout;
    use crate::quant::GgmlType;

    /// Experts of `bytes` per matrix whose byte i is `(layer·7 + expert·3 + i) mod 251`; every
    /// range read sleeps `delay` (a slow device).
    struct SlowStore {
        layout: ExpertLayout,
        n_layers: usize,
        delay: std::time::Duration,
        /// What [`ExpertStore::serves_in_order`] answers.
        in_order: bool,
        /// Every range read: (layer, start, end).
        log: Mutex<Vec<(usize, Instant, Instant)>>,
    }

    impl SlowStore {
        fn byte(layer: usize, expert: usize, i: usize) -> u8 {
            ((layer * 7 + expert * 3 + i) % 251) as u8
        }
    }

    impl ExpertStore for SlowStore {
        fn n_layers(&self) -> usize {
            self.n_layers
        }
        fn layout(&self, _layer: usize) -> &ExpertLayout {
            &self.layout
        }
        fn ranges(&self, layer: usize, expert: usize) -> Result<Vec<(u64, usize)>, ExpertError> {
            // Offsets encode (layer, expert) so read_range can fill the right bytes.
            let base = ((layer * 64 + expert) as u64) << 32;
            let b = self.layout.gate_bytes;
            Ok((0..3).map(|m| (base + (m * b) as u64, b)).collect())
        }
        fn read_range(&self, l: usize, _e: usize, off: u64, buf: &mut [u8]) -> Result<(), ExpertError> {
            let t = Instant::now();
            std::thread::sleep(self.delay);
            let (key, at) = ((off >> 32) as usize, (off & 0xffff_ffff) as usize);
            for (i, v) in buf.iter_mut().enumerate() {
                *v = Self::byte(key / 64, key % 64, at + i);
            }
            self.log.lock().unwrap().push((l, t, Instant::now()));
            Ok(())
        }
        fn serves_in_order(&self) -> bool {
            self.in_order
        }
        fn reads_per_expert(&self) -> usize {
            3
        }
        fn name(&self) -> &'static str {
            "slow test store"
        }
    }

    /// A [`SlowStore`] of `n_layers` layers of 4 experts (4-wide, F32, `bytes` per matrix) and a
    /// router whose rows are unit vectors: a hidden state along axis k routes to expert k.
    fn unit_router_store(bytes: usize, n_layers: usize, delay_ms: u64) -> (Arc<SlowStore>, Vec<f32>, usize) {
        let (n_embd, n_expert) = (4, 4);
        let layout = ExpertLayout { n_embd, n_ff: 1, gate_ty: GgmlType::F32, up_ty: GgmlType::F32, down_ty: GgmlType::F32, gate_bytes: bytes, up_bytes: bytes, down_bytes: bytes };
        let store = Arc::new(SlowStore { layout, n_layers, delay: std::time::Duration::from_millis(delay_ms), in_order: false, log: Mutex::new(Vec::new()) });
        let router = (0..n_expert * n_embd).map(|i| if i / n_embd == i % n_embd { 1.0 } else { 0.0 }).collect();
        (store, router, n_expert)
    }

    /// A prefetch in flight yields to a demand read between its chunks and resumes later, and the
    /// expert it finally hands over has exactly the store's bytes.
    #[test]
    fn chunked_prefetch_yields_to_a_demand_read_and_resumes() {
        let bytes = 64 << 10;
        let (store, router, n_expert) = unit_router_store(bytes, 3, 2);
        let cfg = StreamConfig { slots: 8, prefetch: true, depth: 2, temporal: false, io_threads: 3, max_prefetch_inflight: 1, prefetch_chunk: 2048, ..Default::default() };
        let ex = StreamingExperts::new(store, vec![router; 3], n_expert, 1, cfg);
        // Layer 0 decides expert 0; its hidden state predicts expert 2 for layers 1 and 2.
        ex.on_hidden(0, &[0.0, 0.0, 1.0, 0.0], 1);
        ex.with_experts(0, &[0], &mut |_, _| {}).unwrap();
        // Wait until the layer-1 prefetch is done (96 chunks × 2 ms) and the layer-2 one has read
        // a chunk (it then needs about 190 ms more): polled, not slept, so a loaded machine
        // cannot reorder the steps.
        let t0 = std::time::Instant::now();
        loop {
            let s = ex.stats();
            if s.prefetch_loads >= 1 && s.bytes_read > 6 * bytes as u64 {
                break;
            }
            assert!(t0.elapsed().as_secs() < 20, "prefetches did not progress: {s:?}");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Layer 1 needs expert 2 (prefetched) and expert 3 (a demand read): the layer-2
        // prefetch in flight must pause for it.
        let mut seen = Vec::new();
        ex.with_experts(1, &[2, 3], &mut |i, b| seen.push((i, b.data.clone()))).unwrap();
        let s = ex.stats();
        assert!(s.prefetch_yields > 0, "the layer-2 prefetch did not yield: {s:?}");
        let mut got = None;
        ex.with_experts(2, &[2], &mut |_, b| got = Some(b.data.clone())).unwrap();
        let want: Vec<u8> = (0..3 * bytes).map(|i| SlowStore::byte(2, 2, i)).collect();
        assert_eq!(got.unwrap(), want, "a resumed prefetch must hold exactly the store's bytes");
        for (i, data) in seen {
            let e = [2, 3][i];
            let want: Vec<u8> = (0..3 * bytes).map(|j| SlowStore::byte(1, e, j)).collect();
            assert_eq!(data, want);
        }
        assert_eq!(ex.stats().load_failures, 0);
    }

    /// A prefetch waits while a demand read is in flight, unless the store serves reads in
    /// submission order: then it starts at once (queued behind the demand read on the device).
    #[test]
    fn prefetch_overlaps_a_demand_read_only_on_a_store_that_serves_in_order() {
        for in_order in [false, true] {
            let (store, router, n_expert) = unit_router_store(4 << 10, 2, 40);
            let store = Arc::new(SlowStore { in_order, log: Mutex::new(Vec::new()), ..Arc::into_inner(store).unwrap() });
            let cfg = StreamConfig { slots: 8, prefetch: true, adaptive: false, depth: 1, temporal: false, refine: false, io_threads: 3, ..Default::default() };
            let ex = StreamingExperts::new(store.clone(), vec![router; 2], n_expert, 1, cfg);
            // Layer 0's FFN input predicts expert 2 for layer 1 (queued once layer 0's own
            // expert 0, a demand read of 3 × 40 ms, has its slot).
            ex.on_hidden(0, &[0.0, 0.0, 1.0, 0.0], 1);
            ex.with_experts(0, &[0], &mut |_, _| {}).unwrap();
            ex.with_experts(1, &[2], &mut |_, _| {}).unwrap();
            let log = store.log.lock().unwrap().clone();
            let demand_end = log.iter().filter(|r| r.0 == 0).map(|r| r.2).max().unwrap();
            let prefetch_start = log.iter().filter(|r| r.0 == 1).map(|r| r.1).min().unwrap();
            assert_eq!(prefetch_start < demand_end, in_order, "in_order {in_order}: {log:?}");
        }
    }

    /// Refinement: a partial layer output that routes layer 1 elsewhere replaces the first
    /// stage's queued (not started) prefetch, and its pick is what layer 1 finds resident.
    #[test]
    fn refinement_replaces_a_queued_prefetch() {
        let (store, router, n_expert) = unit_router_store(4 << 10, 2, 20);
        let cfg = StreamConfig { slots: 8, prefetch: true, depth: 1, temporal: false, io_threads: 3, refine: true, ..Default::default() };
        let ex = Arc::new(StreamingExperts::new(store, vec![router; 2], n_expert, 1, cfg));
        // Layer 0's FFN input predicts expert 2 for layer 1; its own expert 0 is a demand read
        // (3 × 20 ms), so the prefetch waits in the queue.
        ex.on_hidden(0, &[0.0, 0.0, 1.0, 0.0], 1);
        let ex2 = ex.clone();
        let h = std::thread::spawn(move || ex2.with_experts(0, &[0], &mut |_, _| {}));
        std::thread::sleep(std::time::Duration::from_millis(15));
        // The partial output routes layer 1 to expert 3.
        ex.on_partial(0, &[0.0, 0.0, 0.0, 1.0]);
        h.join().unwrap().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(150));
        let resident = ex.resident();
        assert!(resident.contains(&(1, 3)), "refined pick not loaded: {resident:?}");
        assert!(!resident.contains(&(1, 2)), "the dropped first-stage prefetch was loaded: {resident:?}");
        ex.with_experts(1, &[3], &mut |_, _| {}).unwrap();
        let s = ex.stats();
        assert_eq!((s.refine_pred_tp, s.refine_pred_made, s.refine_pred_routed), (1, 1, 1));
        assert_eq!((s.layers[1].hits, s.layers[1].misses), (1, 0));
        assert_eq!(s.recall(1), 0.0, "the first stage's own recall stays separate");
    }

    /// A reader like the browser page's: a read submitted now finishes at the second poll after
    /// it (or at `wait`, when it may block); every `refuse_every`-th submission is refused.
    struct PageReader {
        store: Arc<SlowStore>,
        pending: Mutex<Vec<(u32, Vec<(u64, usize)>, u32)>>,
        done: Mutex<HashMap<u32, Vec<(u64, usize)>>>,
        submits: std::sync::atomic::AtomicUsize,
        can_block: bool,
        refuse_every: usize,
        max_piece: usize,
        /// Every this-many-th finished read fails (0: none).
        fail_every: usize,
        takes: std::sync::atomic::AtomicUsize,
    }

    impl AsyncReader for Arc<PageReader> {
        fn submit(&self, id: u32, ranges: &[(u64, usize)]) -> bool {
            let n = self.submits.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if n % self.refuse_every == 0 {
                return false;
            }
            assert!(ranges.iter().map(|r| r.1).sum::<usize>() <= self.max_piece());
            self.pending.lock().unwrap().push((id, ranges.to_vec(), 0));
            true
        }
        fn poll(&self) -> Vec<u32> {
            let mut p = self.pending.lock().unwrap();
            let mut out = Vec::new();
            p.retain_mut(|(id, ranges, age)| {
                *age += 1;
                if *age < 2 {
                    return true;
                }
                self.done.lock().unwrap().insert(*id, std::mem::take(ranges));
                out.push(*id);
                false
            });
            out
        }
        fn take(&self, id: u32, dest: &mut [u8]) -> Result<(), String> {
            let ranges = self.done.lock().unwrap().remove(&id).ok_or("not finished")?;
            let n = self.takes.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if self.fail_every > 0 && n % self.fail_every == 0 {
                return Err("injected read failure".into());
            }
            assert_eq!(ranges.iter().map(|r| r.1).sum::<usize>(), dest.len());
            let mut at = 0;
            for (off, len) in ranges {
                self.store.read_range(0, 0, off, &mut dest[at..at + len]).map_err(|e| e.to_string())?;
                at += len;
            }
            Ok(())
        }
        fn wait(&self, id: u32) -> bool {
            if !self.can_block {
                return false;
            }
            let mut p = self.pending.lock().unwrap();
            if let Some(i) = p.iter().position(|x| x.0 == id) {
                let (id, ranges, _) = p.remove(i);
                self.done.lock().unwrap().insert(id, ranges);
            }
            true
        }
        fn cancel(&self, id: u32) {
            self.pending.lock().unwrap().retain(|x| x.0 != id);
            self.done.lock().unwrap().remove(&id);
        }
        fn max_piece(&self) -> usize {
            self.max_piece
        }
        fn describe(&self) -> String {
            "test page".into()
        }
    }

    /// The browser's executor ([`AsyncIo`]) against a page-like reader: reads shorter than one
    /// range and reads spanning several ranges, reads that land only at later layers, refused
    /// submissions (dropped prefetches), pieces the router waits for (blocked on, or abandoned and
    /// read here), failed reads (a failed prefetch costs nothing: the expert is read on demand if
    /// the router picks it). Every expert handed to the model has exactly the store's bytes, and
    /// prefetches do load.
    #[test]
    fn asynchronous_reads_hand_over_the_stores_bytes() {
        // The last case starts with native I/O threads: replacing them must stop them (not hang).
        for (can_block, max_piece, io_threads, fail_every) in [(true, 3000, 0, 0), (false, 3000, 0, 0), (true, 12000, 0, 0), (false, 12000, 2, 0), (true, 12000, 0, 3), (false, 3000, 0, 4)] {
            let bytes = 5000;
            let (store, router, n_expert) = unit_router_store(bytes, 3, 0);
            let cfg = StreamConfig { slots: 5, prefetch: true, depth: 2, temporal: true, io_threads, prefetch_chunk: 2048, ..Default::default() };
            let ex = StreamingExperts::new(store.clone(), vec![router.clone(); 3], n_expert, 1, cfg);
            let reader = Arc::new(PageReader { store, pending: Mutex::new(Vec::new()), done: Mutex::new(HashMap::new()), submits: Default::default(), can_block, refuse_every: 7, max_piece, fail_every, takes: Default::default() });
            ex.use_async_reader(reader.clone(), 2);
            assert!(ex.executor().contains("test page"));
            let mut handed = 0;
            for t in 0..40usize {
                for layer in 0..3usize {
                    // Routed expert and a hidden state that predicts the next layer's pick
                    // right two times in three.
                    let e = (t * 5 + layer * 3) % n_expert;
                    let next = (t * 5 + (layer + 1) * 3 + usize::from(t % 3 == 0)) % n_expert;
                    let mut h = vec![0.0f32; 4];
                    h[next] = 1.0;
                    ex.on_hidden(layer, &h, 1);
                    ex.with_experts(layer, &[e as u32], &mut |_, b| {
                        assert_eq!(b.data.len(), 3 * bytes);
                        for (i, &v) in b.data.iter().enumerate() {
                            assert_eq!(v, SlowStore::byte(layer, e, i), "L{layer} E{e} byte {i} (can_block {can_block})");
                        }
                        handed += 1;
                    })
                    .unwrap();
                }
            }
            assert_eq!(handed, 120);
            let s = ex.stats();
            assert!(s.prefetch_loads > 0 && s.prefetch_used > 0, "{s:?}");
            assert!(s.prefetch_cancelled > 0, "refused submissions drop their prefetch: {s:?}");
            assert_eq!(s.load_failures > 0, fail_every > 0, "{s:?}");
        }
    }

    #[test]
    fn dot8_matches_a_plain_dot_product_at_every_length() {
        for n in 0..40 {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 1.3).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot8(&a, &b) as f64 - want).abs() < 1e-5, "n = {n}");
        }
    }

    #[test]
    fn belady_textbook_example() {
        // Reference string 7 0 1 2 0 3 0 4 2 3 0 3 2 with 3 frames: 7 faults (OPT).
        let s: Vec<(u32, u32)> = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2].iter().map(|&e| (0, e)).collect();
        assert_eq!(belady_misses(&s, 3), 7);
        assert_eq!(belady_misses(&s, 100), 6);
    }

    /// Decode `tokens` one-token forwards through the two layers of a [`unit_router_store`]:
    /// token t routes layer 0 to `route(t).0` and layer 1 to `route(t).1`, layer 0's FFN input
    /// points at `route(t).2` (what the predictor will guess for layer 1), and `compute_ms`
    /// passes between the layers.
    fn decode(ex: &StreamingExperts, tokens: std::ops::Range<usize>, route: impl Fn(usize) -> (u32, u32, usize), compute_ms: u64) {
        for t in tokens {
            let (e0, e1, guess) = route(t);
            let mut h = [0.0f32; 4];
            h[guess] = 1.0;
            ex.on_hidden(0, &h, 1);
            ex.with_experts(0, &[e0], &mut |_, _| {}).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(compute_ms));
            ex.on_hidden(1, &[1.0, 0.0, 0.0, 0.0], 1);
            ex.with_experts(1, &[e1], &mut |_, _| {}).unwrap();
        }
    }

    /// Prefetches that only evict what the next token needs make tokens slower: after the
    /// warm-up (16 tokens of each, alternating) the governor turns prefetching off, and no prefetch is
    /// read while it stays off.
    #[test]
    fn governor_turns_off_prefetches_that_cost() {
        // Two slots; every token routes (0, 0) then (1, 1); layer 0's input predicts (1, 2),
        // which can only be loaded by evicting (1, 1). Off: both stay resident, no reads.
        let (store, router, n_expert) = unit_router_store(4 << 10, 2, 3);
        let cfg = StreamConfig { slots: 2, prefetch: true, depth: 1, temporal: false, io_threads: 2, refine: false, policy: Policy::Lru, ..Default::default() };
        let ex = StreamingExperts::new(store, vec![router; 2], n_expert, 1, cfg);
        assert!(ex.prefetching());
        decode(&ex, 0..33, |_| (0, 1, 2), 0);
        assert!(!ex.prefetching(), "{:?}", ex.stats().governor);
        let s = ex.stats();
        let g = s.governor.clone().unwrap();
        assert!(g.last_on_ms.unwrap() > g.last_off_ms.unwrap(), "{g:?}");
        assert_eq!((s.prefetch_on_tokens, s.prefetch_off_tokens), (16, 16));
        // The next 32 tokens run without prefetching: nothing is read.
        decode(&ex, 33..56, |_| (0, 1, 2), 0);
        let s2 = ex.stats();
        assert_eq!((s2.prefetch_loads, s2.bytes_read), (s.prefetch_loads, s.bytes_read), "{s2:?}");
        // With prefetching, the evicted (1, 1) was read again on demand.
        assert!(s.demand_loads > 2, "{s:?}");
    }

    /// Prefetches that hide reads behind compute make tokens faster: the governor keeps them.
    #[test]
    fn governor_keeps_prefetches_that_pay() {
        // Two slots; token t routes (0, t mod 4) then (1, t+1 mod 4), and layer 0's input
        // predicts layer 1 right: with prefetching, layer 1's read (3 × 3 ms) runs during the
        // 12 ms of compute between the layers; without, it stalls.
        let (store, router, n_expert) = unit_router_store(4 << 10, 2, 3);
        let cfg = StreamConfig { slots: 2, prefetch: true, depth: 1, temporal: false, io_threads: 2, refine: false, policy: Policy::Lru, ..Default::default() };
        let ex = StreamingExperts::new(store, vec![router; 2], n_expert, 1, cfg);
        let route = |t: usize| ((t % 4) as u32, ((t + 1) % 4) as u32, (t + 1) % 4);
        decode(&ex, 0..33, route, 12);
        let s = ex.stats();
        let g = s.governor.clone().unwrap();
        assert!(ex.prefetching(), "{g:?}");
        assert!(g.last_on_ms.unwrap() < g.last_off_ms.unwrap(), "{g:?}");
        decode(&ex, 33..56, route, 12);
        assert!(ex.stats().prefetch_loads > s.prefetch_loads);
        assert!(ex.prefetching());
    }
}
