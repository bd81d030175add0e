//! What the streaming cache measures: per-layer hits / late / misses, prediction recall and
//! precision per lookahead distance, bytes and stalls ([`StreamStats`]), the Chrome trace
//! ([`TraceEvent`]) and the Belady bound ([`belady_misses`]) the ladder compares against.

use super::governor::GovernorStats;
use std::collections::HashMap;

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
    /// Exact lookahead ([`crate::expert::ExpertSource::on_route`]): routed experts named before
    /// their layer ran, experts named, routed experts of layers that were named. Recall is 1
    /// by construction when the model's router runs first; less would mean a bug.
    pub exact_pred_tp: u64,
    pub exact_pred_made: u64,
    pub exact_pred_routed: u64,
    pub load_failures: u64,
    /// Expert loads that came in the same read as another (adjacent blocks, one read: `reads`
    /// counts that read once).
    pub merged_loads: u64,
    /// Times the number of expert slots was changed while running (a budget change) and the
    /// bytes of slot buffers freed by them.
    pub slot_changes: u64,
    pub slot_bytes_freed: u64,
    /// Of `slot_changes`, those made because an expert buffer could not be allocated.
    pub oom_shrinks: u64,
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
    pub(super) fn empty(n_layers: usize, d: usize) -> Self {
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
    /// Recall of the exact lookahead's names (None: the model named no layer's experts early).
    pub fn exact_recall(&self) -> Option<f64> {
        (self.exact_pred_routed > 0).then(|| self.exact_pred_tp as f64 / self.exact_pred_routed as f64)
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

/// Score a prediction (experts of one layer) against the routed `keys`: add its true positives,
/// its size and the routed count to `(tp, made, routed)`. An empty prediction counts nothing.
pub(super) fn tally(pred: &[usize], keys: &[(usize, usize)], (tp, made, routed): (&mut u64, &mut u64, &mut u64)) {
    if pred.is_empty() {
        return;
    }
    *tp += keys.iter().filter(|k| pred.contains(&k.1)).count() as u64;
    *made += pred.len() as u64;
    *routed += keys.len() as u64;
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
