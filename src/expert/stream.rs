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

use super::governor::{Arm, Governor, GovernorConfig};
use super::io::{AsyncIo, AsyncReader, Inline, ReadExecutor, Threads};
use super::queue::{now_us, Inner, Req, Shared, Slot, State};
use super::stats::tally;
use super::store::ExpertStore;
use super::{ExpertBlock, ExpertError, ExpertLayout, ExpertSource};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use web_time::Instant;

pub use super::policy::{Policy, StreamConfig};
use super::policy::FREQ_DECAY;
pub use super::stats::{belady_misses, LayerStats, StreamStats, TraceEvent};

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
        // A slot for every expert the budget may ever grow to; each gets its buffer when first
        // filled (`Shared::size_slot`), so only slots in use hold memory.
        let n_slots = cfg.slots.max(n_layers * n_expert);
        let bufs = (0..n_slots).map(|_| RwLock::new(ExpertBlock::new(Vec::new(), store.layout(0).clone()))).collect();
        let empty = Slot { key: None, state: State::Empty, pins: 0, last_use: 0, prefetched_unused: false, hot: false, failed: None, cancel: false };
        let d = cfg.depth.max(1);
        let stats = StreamStats::empty(n_layers, d);
        let inner = Inner {
            slots: vec![empty; n_slots],
            limit: cfg.slots,
            high: cfg.slots,
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
            exact: vec![Vec::new(); n_layers],
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
        let sh = Arc::new(Shared { inner: Mutex::new(inner), io_cv: Condvar::new(), done_cv: Condvar::new(), bufs, slot_bytes: max_bytes, min_slots: n_used + 1, store, cfg: cfg.clone(), t0: Instant::now(), pf_on });
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

    /// A copy of the routed (layer, expert) sequence recorded so far.
    pub fn route_log(&self) -> Vec<(u32, u32)> {
        self.sh.inner.lock().unwrap().route_log.clone()
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
        self.queue_plans(plans, false);
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
        self.queue_plans(plans, false);
    }

    /// Queue reads of experts not held yet: `(layer, queue distance, experts, add temporal
    /// candidates)`; prefetches, or demand reads (`demand`: experts the model has named, exact
    /// lookahead).
    fn queue_plans(&self, plans: Vec<(usize, usize, Vec<usize>, bool)>, demand: bool) {
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
                    Some(v) => g.assign(v, key, demand, d),
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

    /// Expert slots in use now (`config().slots` at the start; [`Self::set_slots`] changes it).
    pub fn slots(&self) -> usize {
        self.sh.inner.lock().unwrap().limit
    }

    /// The most slots the cache can have: one per expert of the model.
    pub fn max_slots(&self) -> usize {
        self.sh.bufs.len()
    }

    /// Bytes the slot buffers hold now (reserved at the largest expert's size when first used,
    /// freed when a shrink retires them).
    pub fn held_bytes(&self) -> u64 {
        let g = self.sh.inner.lock().unwrap();
        let top = g.high.max(g.limit);
        self.sh.bufs[..top].iter().map(|b| b.read().unwrap().data.capacity() as u64).sum()
    }

    /// Change the number of expert slots while the model runs (a budget lowered under memory
    /// pressure, raised when it passes), from any thread, also during a forward: the first `n`
    /// slots stay (clamped to top-k + 1 ..= [`Self::max_slots`]); the experts in the others
    /// leave the cache and their buffers are freed at once, or as soon as the forward using
    /// them or the read filling them is done. Growing only makes more slots available (their
    /// buffers are allocated when first filled). Which experts are resident changes, never what
    /// the model computes: the router decides and a miss is read again. Returns the new count.
    pub fn set_slots(&self, n: usize) -> usize {
        let n = n.clamp(self.n_used + 1, self.max_slots());
        let mut g = self.sh.inner.lock().unwrap();
        if n != g.limit {
            g.stats.slot_changes += 1;
        }
        g.limit = n;
        g.high = g.high.max(n);
        self.sh.retire(&mut g);
        drop(g);
        self.sh.done_cv.notify_all();
        self.kick();
        n
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

/// 1 / RMS(x): RMSNorm's scale.
fn rms_scale(x: &[f32]) -> f32 {
    let ss = x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32;
    1.0 / (ss + 1e-6).sqrt()
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

    fn on_route(&self, layer: usize, ids: &[u32], _n_tok: usize) {
        if !self.sh.cfg.exact || layer >= self.routers.len() {
            return;
        }
        let p: Vec<usize> = ids.iter().map(|&e| e as usize).filter(|&e| e < self.n_expert).collect();
        self.sh.inner.lock().unwrap().exact[layer] = p.clone();
        // Every named expert will be asked for: its read is a demand read (all I/O lanes, ahead
        // of any prediction), none evicting another of them.
        self.queue_plans(vec![(layer, 0, p, false)], true);
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
            let top = g.high.max(g.limit);
            for sl in g.slots[..top].iter_mut() {
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
            let exact = std::mem::take(&mut g.exact[layer]);
            let st = &mut g.stats;
            tally(&exact, &keys, (&mut st.exact_pred_tp, &mut st.exact_pred_made, &mut st.exact_pred_routed));
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
            sh.retire(&mut g);
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

#[cfg(test)]
mod tests;
