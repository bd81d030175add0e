//! The streaming cache's configuration and eviction policies ([`Policy`]: LRU, frequency-aware,
//! next use), used by [`super::stream::StreamingExperts`] and ranked by [`super::queue`].

/// Per-token decay of the use counts behind [`Policy::Lfu`] and [`Policy::NextUse`].
pub(crate) const FREQ_DECAY: f32 = 0.95;

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

    /// How much the policy wants an expert of `layer` kept (higher: keep; LRU: 0, the caller
    /// breaks ties by last use), given its decayed use count `freq` ([`FREQ_DECAY`] per token),
    /// the MoE layer that ran last and the number of MoE layers. Next-use: minus the estimated
    /// layers until its next use.
    pub(crate) fn retention(self, freq: f64, layer: usize, cur_layer: usize, n_layers: usize) -> f64 {
        match self {
            Policy::Lru => 0.0,
            Policy::Lfu => freq,
            Policy::NextUse => {
                let n = n_layers.max(1);
                let layers_until = (layer + n - cur_layer % n - 1) % n;
                // Uses per token ≈ decayed count × (1 − decay) (decay 0.95 per token).
                let p = (freq * (1.0 - FREQ_DECAY as f64)).clamp(0.002, 0.99);
                -(layers_until as f64 + n as f64 * (1.0 / p - 1.0))
            }
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
    /// Exact lookahead: where the model names a layer's experts before the layer runs
    /// ([`crate::expert::ExpertSource::on_route`]: smallthinker's router reads the layer's input),
    /// read the missing ones at once, as demand reads, while the layer's attention computes. Every such read is one the layer needs, so the governor does not
    /// gate it. On by default.
    pub exact: bool,
}

impl Default for StreamConfig {
    fn default() -> Self {
        Self { slots: 64, policy: Policy::NextUse, prefetch: true, depth: 2, extra: 0, temporal: true, io_threads: 4, max_prefetch_inflight: 1, prefetch_chunk: 1 << 20, residual_stage: false, refine: true, draft_depth: 4, pinned: vec![], trace: false, adaptive: true, exact: true }
    }
}
