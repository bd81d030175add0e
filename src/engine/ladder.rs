//! The ladder benchmark: the same prompts, in one process, through each rung of the stack —
//! resident → on-demand (no prefetch, LRU) → + lookahead (LRU) → + the chosen eviction policy
//! (when not LRU) → + packed bundle → (+ mixed precision:
//! a bundle with per-layer expert types, when given; lossy) → + speculative decoding (draft model
//! or prompt lookup, from the last bundle with lookahead); or, with [`Rungs::alone`], each rung
//! alone as on-demand plus that one thing — with per-rung
//! tokens/s, ratio to on-demand, hit rate, recall, MB read per token and stall ms per token, plus
//! two bounds from the recorded routing trace: pure I/O time (the bytes a Belady-optimal cache of
//! the same size must still read, at the store's measured throughput) and the oracle
//! (Belady-optimal cache with perfect prediction: I/O fully overlapped with compute).

use super::sampling::SamplerConfig;
use super::draft::DraftSpec;
use super::speculative::{self, Draft, SpecOptions};
use super::stream::{open_streaming, open_streaming_from_memory, StreamOptions, Streaming};
use super::Session;
use crate::expert::stream::{belady_misses, Policy, StreamingExperts};
use crate::model::ExpertMode;
use crate::store::dedup::DedupSource;
use crate::store::{ByteSource, FileSource};
use std::sync::Arc;
use std::time::Instant;

/// A rung opened and decoding (see [`run`]).
struct Live {
    name: String,
    st: Streaming,
    io_threads: usize,
    /// The speculative rung: its draft and γ.
    draft: Option<(Box<dyn Draft>, usize)>,
    t: usize,
    ms: f64,
    /// Wall time of this rung's turns.
    active_ms: f64,
    loads: u64,
    bytes: u64,
    drafted: u64,
    accepted: u64,
    /// Decode tokens/s of each prompt.
    per_prompt: Vec<f64>,
    /// What the user waits for, per token: see [`Waits`].
    waits: Waits,
}

/// The times a user waits: from the request to the first token of each prompt (prompt
/// processing included) and between consecutive output tokens (as the caller receives them:
/// a speculative rung hands over its accepted tokens together).
#[derive(Clone, Debug, Default)]
struct Waits {
    ttft: Vec<f64>,
    gaps: Vec<f64>,
}

impl Waits {
    /// A callback for one generation's tokens (`start`: when the request was made).
    fn on_token(&mut self, start: Instant) -> impl FnMut() + '_ {
        let mut last: Option<Instant> = None;
        move || {
            let now = Instant::now();
            match last {
                None => self.ttft.push((now - start).as_secs_f64() * 1000.0),
                Some(l) => self.gaps.push((now - l).as_secs_f64() * 1000.0),
            }
            last = Some(now);
        }
    }
}

/// The distribution of a rung's waits (ms): time to first token (median over prompts) and the
/// inter-token latency's percentiles (nearest rank: the smallest value with at least p% of the
/// gaps at or below it) and the longest stall.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Latency {
    pub ttft_p50_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p95_ms: f64,
    pub itl_p99_ms: f64,
    pub longest_ms: f64,
    /// Gaps measured (output tokens after each prompt's first).
    pub gaps: usize,
}

/// The nearest-rank `p`-th percentile (0 < p ≤ 100) of `v` (sorted ascending); 0 when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

impl Latency {
    fn of(w: &Waits) -> Option<Latency> {
        if w.ttft.is_empty() {
            return None;
        }
        let sorted = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v
        };
        let (t, g) = (sorted(&w.ttft), sorted(&w.gaps));
        Some(Latency { ttft_p50_ms: percentile(&t, 50.0), itl_p50_ms: percentile(&g, 50.0), itl_p95_ms: percentile(&g, 95.0), itl_p99_ms: percentile(&g, 99.0), longest_ms: g.last().copied().unwrap_or(0.0), gaps: g.len() })
    }
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Rung {
    pub name: String,
    pub tokens_per_s: f64,
    pub ratio_to_on_demand: f64,
    pub hit_rate: f64,
    pub recall_d1: f64,
    pub precision_d1: f64,
    pub mb_read_per_token: f64,
    pub stall_ms_per_token: f64,
    pub io_busy: f64,
    pub tokens: usize,
    /// Speculative rung: draft tokens accepted / proposed.
    pub acceptance_rate: Option<f64>,
    /// Decode only (after the prompt), per output token (every output token is one the target
    /// accepted): experts loaded (demand + prefetch) and MB read. Streamed rungs.
    pub experts_per_token: Option<f64>,
    pub mb_per_accepted_token: Option<f64>,
    /// Recall of the refined layer l+1 predictions (from layer l's partial output), when made.
    pub refine_recall: Option<f64>,
    /// Recall of the exact lookahead's named experts (smallthinker: 1), when named.
    pub exact_recall: Option<f64>,
    /// Share of decode tokens the prefetch governor ran with prefetching on (None: no governor).
    pub prefetch_on: Option<f64>,
    /// The prefetch governor's last measurements and estimate (None: no governor).
    pub governor: Option<crate::expert::governor::GovernorStats>,
    /// Decode tokens/s of each prompt, in prompt order (the rungs ran prompt `i` within seconds
    /// of each other, so a slow spell of the machine shows as one prompt's dip in every rung
    /// that ran then).
    pub prompt_tokens_per_s: Vec<f64>,
    /// The median over prompts of this rung's tokens/s over on-demand's on the same prompt.
    pub prompt_ratio_median: Option<f64>,
    /// Time to first token and the inter-token latency distribution.
    pub latency: Option<Latency>,
    /// Storage reads per output token, the prompts' included (a read may bring several
    /// neighbouring experts), and the share of expert loads that came in such merged reads.
    pub reads_per_token: Option<f64>,
    pub merged_share: Option<f64>,
}

/// Which rungs run beyond the base ones, and how they stack.
#[derive(Clone, Debug, Default)]
pub struct Rungs {
    /// The draft (a draft model, the model's MTP block); `None`: prompt lookup.
    pub draft: Option<DraftSpec>,
    /// γ (default per draft: [`DraftSpec::default_max`]).
    pub draft_max: Option<usize>,
    /// A bundle with per-layer expert types: runs as the `+ mixed precision` rung (after
    /// `+ bundle`), and the `+ speculative` rung runs on it.
    pub mixed_bundle: Option<String>,
    /// The model packed with its experts ordered by co-activation (`les pack --order
    /// coactivation`): runs as the `+ co-activation order` rung, after `+ bundle` (issue 39
    /// item 3's layout A/B, interleaved with the index-order bundle).
    pub coactivation_bundle: Option<String>,
    /// Each rung alone: on-demand plus that one thing (lookahead; the eviction policy; the
    /// bundle; the mixed bundle; speculative decoding on the model's file, without prefetch),
    /// instead of each rung adding one thing to the rung before.
    pub alone: bool,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LadderReport {
    pub model: String,
    pub store: String,
    /// `stacked` (each rung adds one thing to the one before) or `alone` (on-demand plus one thing).
    pub stacking: String,
    /// Bytes the in-memory copies of the files took (a device profile; [`DedupSource`] keeps
    /// each distinct page once).
    pub memory_copy_bytes: u64,
    pub budget: u64,
    pub slots: usize,
    pub slot_fraction: f64,
    pub rungs: Vec<Rung>,
    /// Decode tokens/s with I/O fully hidden behind compute and a Belady-optimal cache.
    pub oracle_tokens_per_s: f64,
    /// Time per token spent only reading what a Belady-optimal cache misses (ms).
    pub pure_io_ms_per_token: f64,
    pub belady_hit_rate: f64,
    pub store_mb_per_s: f64,
    pub per_layer: Vec<(usize, f64, f64, f64)>,
    /// How the speculative rung ran (draft source, γ, memory).
    pub spec_note: String,
    /// What makes the run reproducible (filled by the caller: model digest, commit, command).
    pub artifacts: std::collections::BTreeMap<String, String>,
}

impl LadderReport {
    pub fn table(&self) -> String {
        let mut s = format!(
            "ladder ({}): {} | store {}{} | budget {:.0} MiB | {} expert slots ({:.1}% of experts)\n{:<20} {:>9} {:>9} {:>8} {:>9} {:>10} {:>10} {:>8} {:>8}\n",
            self.stacking,
            self.model,
            self.store,
            if self.memory_copy_bytes > 0 { format!(" (files copied to memory: {:.0} MiB)", self.memory_copy_bytes as f64 / 1048576.0) } else { String::new() },
            self.budget as f64 / 1048576.0,
            self.slots,
            100.0 * self.slot_fraction,
            "rung",
            "tok/s",
            "×on-dem",
            "hit %",
            "recall %",
            "MB/token",
            "stall ms",
            "I/O %",
            "pf on %"
        );
        for r in &self.rungs {
            s += &format!(
                "{:<20} {:>9.2} {:>9.2} {:>8.1} {:>9.1} {:>10.2} {:>10.2} {:>8.0} {:>8}\n",
                r.name,
                r.tokens_per_s,
                r.ratio_to_on_demand,
                100.0 * r.hit_rate,
                100.0 * r.recall_d1,
                r.mb_read_per_token,
                r.stall_ms_per_token,
                100.0 * r.io_busy,
                r.prefetch_on.map(|p| format!("{:.0}", 100.0 * p)).unwrap_or_else(|| "-".into())
            );
        }
        let refined: Vec<String> = self.rungs.iter().filter_map(|r| r.refine_recall.map(|x| format!("{} {:.1}%", r.name, 100.0 * x))).collect();
        let exact: Vec<String> = self.rungs.iter().filter_map(|r| r.exact_recall.map(|x| format!("{} {:.1}%", r.name, 100.0 * x))).collect();
        if !exact.is_empty() {
            s += &format!("recall of the exact lookahead (experts named before their layer ran): {}\n", exact.join(", "));
        }
        if !refined.is_empty() {
            s += &format!("recall of the refined l+1 predictions (after layer l's first expert): {}\n", refined.join(", "));
        }
        s += &format!("decode only, per output (accepted) token:\n{:<20} {:>8} {:>14} {:>12}\n", "rung", "accept %", "experts/token", "MB/token");
        for r in self.rungs.iter().filter(|r| r.experts_per_token.is_some()) {
            let acc = r.acceptance_rate.map(|a| format!("{:.1}", 100.0 * a)).unwrap_or_else(|| "-".into());
            s += &format!("{:<20} {:>8} {:>14.1} {:>12.2}\n", r.name, acc, r.experts_per_token.unwrap_or(0.0), r.mb_per_accepted_token.unwrap_or(0.0));
        }
        s += "storage reads per output token (prompts included) and expert loads in merged reads:\n";
        for r in self.rungs.iter().filter(|r| r.reads_per_token.is_some()) {
            s += &format!("{:<20} {:>9.1} {:>8.1}%\n", r.name, r.reads_per_token.unwrap_or(0.0), 100.0 * r.merged_share.unwrap_or(0.0));
        }
        s += &format!("waits (ms): time to first token (median over prompts), then between tokens\n{:<20} {:>9} {:>9} {:>9} {:>9} {:>9}\n", "rung", "TTFT p50", "p50", "p95", "p99", "longest");
        for r in &self.rungs {
            if let Some(l) = &r.latency {
                s += &format!("{:<20} {:>9.1} {:>9.2} {:>9.2} {:>9.2} {:>9.2}\n", r.name, l.ttft_p50_ms, l.itl_p50_ms, l.itl_p95_ms, l.itl_p99_ms, l.longest_ms);
            }
        }
        if !self.spec_note.is_empty() {
            s += &format!("{}\n", self.spec_note);
            if self.rungs.iter().any(|r| r.name == "+ mixed precision") {
                s += "+ mixed precision changes the weights (not lossless): its quality is `les eval ppl --model BUNDLE --base MODEL`\n";
            }
        }
        s += &format!(
            "bounds: oracle {:.2} tok/s (Belady hit rate {:.1}%, I/O hidden behind compute) | pure I/O {:.2} ms/token at {:.0} MB/s measured\n",
            self.oracle_tokens_per_s,
            100.0 * self.belady_hit_rate,
            self.pure_io_ms_per_token,
            self.store_mb_per_s
        );
        s
    }
}

/// A streamed rung's figures: `t` output tokens in `ms`, `loads` experts and `bytes` read while
/// decoding, cache statistics `s`.
/// `active_ms`: the rung's own wall time (its prompts, prefill included), for the I/O share.
fn streamed_rung(name: &str, t: usize, ms: f64, s: &crate::expert::stream::StreamStats, io_threads: usize, loads: u64, bytes: u64, active_ms: f64) -> Rung {
    Rung {
        name: name.into(),
        tokens_per_s: t as f64 / (ms / 1000.0),
        hit_rate: s.hit_rate(),
        recall_d1: s.recall(1),
        precision_d1: s.precision(1),
        mb_read_per_token: s.bytes_per_token() / 1e6,
        stall_ms_per_token: s.stall_ms_per_token(),
        io_busy: if active_ms > 0.0 { s.io_busy_ms / (active_ms * io_threads.max(1) as f64) } else { 0.0 },
        tokens: t,
        experts_per_token: Some(loads as f64 / t.max(1) as f64),
        mb_per_accepted_token: Some(bytes as f64 / 1e6 / t.max(1) as f64),
        refine_recall: s.refine_recall(),
        exact_recall: s.exact_recall(),
        prefetch_on: s.prefetch_on_share(),
        governor: s.governor.clone(),
        reads_per_token: Some(s.reads as f64 / t.max(1) as f64),
        merged_share: Some(s.merged_loads as f64 / (s.demand_loads + s.prefetch_loads).max(1) as f64),
        ..Default::default()
    }
}

/// Expert loads and bytes read so far.
fn io_counts(ex: &StreamingExperts) -> (u64, u64) {
    let s = ex.stats();
    (s.demand_loads + s.prefetch_loads, s.bytes_read)
}

/// Decode every prompt; returns output tokens, decode ms and, when `ex` is given, the expert loads
/// and bytes read after each prompt (counted from the first output token, which the prompt's
/// forward pass produces).
fn decode_all(sess: &mut Session, prompts: &[String], n: usize, ex: Option<&StreamingExperts>, waits: &mut Waits) -> Result<(usize, f64, u64, u64), Box<dyn std::error::Error>> {
    let (mut toks, mut ms, mut loads, mut bytes) = (0, 0.0, 0, 0);
    for p in prompts {
        let start = Instant::now();
        let t = sess.tokenize(p);
        let mut at_first = None;
        let mut tick = waits.on_token(start);
        let (_, st) = sess.generate(&t, n, &SamplerConfig::greedy(), true, &mut |tok, _| {
            // (u32::MAX: the text left over at the end, not a token.)
            if tok != u32::MAX {
                tick();
            }
            if at_first.is_none() {
                at_first = ex.map(io_counts);
            }
            true
        })?;
        if let (Some(e), Some((l0, b0))) = (ex, at_first) {
            let (l1, b1) = io_counts(e);
            loads += l1 - l0;
            bytes += b1 - b0;
        }
        toks += st.gen_tokens;
        ms += st.gen_ms;
    }
    Ok((toks, ms, loads, bytes))
}

fn evict(path: &str) {
    if let Ok(f) = FileSource::open(path) {
        f.evict_page_cache();
    }
}

/// Moves a session to a compute backend (see [`run`]).
pub type Backend<'a> = dyn Fn(&mut Session, Option<usize>) -> Result<(), Box<dyn std::error::Error>> + 'a;

/// Run the ladder. Decode time only (prefill excluded). Every streamed rung starts cold (its own
/// empty cache; the file evicted from the page cache) and the rungs take turns prompt by prompt
/// (the rung that goes first rotates), so their times interleave. A device profile reads from a
/// copy of each file in memory ([`open_streaming_from_memory`]: the profile alone sets read
/// times; [`DedupSource`], so that the full-size random models, which repeat their blocks, fit);
/// on the plain `disk` store the rungs share the page cache.
/// `backend` moves each rung's session to the compute backend (given the GPU pool's slots under
/// the budget, `None` for the resident rung); the CPU's is a no-op.
pub fn run(model: &str, bundle: &str, opts: &StreamOptions, prompts: &[String], n: usize, resident: bool, spec: &Rungs, backend: &Backend<'_>) -> Result<LadderReport, Box<dyn std::error::Error>> {
    let mut rep = LadderReport { model: model.into(), stacking: if spec.alone { "alone" } else { "stacked" }.into(), store: opts.profile.map(|p| p.name.to_string()).unwrap_or_else(|| if opts.direct { "disk (O_DIRECT)".into() } else { "disk".into() }), budget: opts.budget, ..Default::default() };
    let mut compute_ms_per_tok = None;
    if resident {
        let src = FileSource::open(model)?;
        let mut s = Session::load(&src, ExpertMode::Resident, opts.n_ctx)?;
        backend(&mut s, None)?;
        let mut waits = Waits::default();
        let (t, ms, _, _) = decode_all(&mut s, prompts, n, None, &mut waits)?;
        compute_ms_per_tok = Some(ms / t.max(1) as f64);
        rep.rungs.push(Rung { name: "resident".into(), tokens_per_s: t as f64 / (ms / 1000.0), hit_rate: 1.0, tokens: t, latency: Latency::of(&waits), ..Default::default() });
    }
    let mut route = Vec::new();
    let mut expert_bytes_max = 0u64;
    // (name, prefetch, file, eviction policy). Stacked: each rung adds one thing to the one
    // before; alone: each adds one thing to on-demand.
    let policy = opts.cache.policy;
    let evict_name = format!("+ {} eviction", policy.name());
    // (name, prefetch, exact lookahead, file, eviction policy). Where the router runs before
    // the layer (smallthinker), `+ exact lookahead` reads each layer's named experts while its
    // attention runs; the rungs before it do not, the ones after it do (stacked).
    let early = {
        let src = FileSource::open(model)?;
        crate::model::Config::from_gguf(&crate::gguf::GgufFile::read(&src)?)?.routes_early()
    };
    let mut rungs: Vec<(String, bool, bool, &str, Policy)> = vec![("on-demand".into(), false, false, model, Policy::Lru), ("+ lookahead".into(), true, false, model, Policy::Lru)];
    let (pf, pol) = if spec.alone { (false, Policy::Lru) } else { (true, policy) };
    if early {
        rungs.push(("+ exact lookahead".into(), pf, true, model, Policy::Lru));
    }
    let ex = early && !spec.alone;
    if policy != Policy::Lru {
        rungs.push((evict_name, pf, ex, model, policy));
    }
    rungs.push(("+ bundle".into(), pf, ex, bundle, pol));
    if let Some(cb) = &spec.coactivation_bundle {
        rungs.push(("+ co-activation order".into(), pf, ex, cb, pol));
    }
    if let Some(mb) = &spec.mixed_bundle {
        rungs.push(("+ mixed precision".into(), pf, ex, mb, pol));
    }
    let spec_file = if spec.alone { model } else { spec.mixed_bundle.as_deref().unwrap_or(bundle) };
    // A device profile reads from one copy of each file in memory, shared by the rungs, within
    // the memory the sessions leave.
    let in_memory = opts.profile.is_some() && !opts.direct;
    let n_sessions = rungs.len() as u64 + 1;
    let copy_limit = crate::engine::pressure::available_memory().map_or(u64::MAX, |a| a.saturating_sub(n_sessions * opts.budget + (256 << 20)));
    let mut copies: std::collections::HashMap<String, Arc<dyn ByteSource>> = Default::default();
    let mut copied = 0u64;
    let mut open = |path: &str, o: &StreamOptions| -> Result<Streaming, Box<dyn std::error::Error>> {
        evict(path);
        if !in_memory {
            return Ok(open_streaming(path, o)?);
        }
        let mem = match copies.get(path) {
            Some(m) => m.clone(),
            None => {
                let f = FileSource::open(path)?;
                let d = DedupSource::copy_of(&f, copy_limit.saturating_sub(copied))
                    .map_err(|e| format!("{path}: the device profile's in-memory copy does not fit beside {n_sessions} sessions of the budget ({e}); use --direct to read the disk"))?;
                evict(path);
                copied += d.resident_bytes();
                let m: Arc<dyn ByteSource> = Arc::new(d);
                copies.insert(path.to_string(), m.clone());
                m
            }
        };
        Ok(open_streaming_from_memory(mem, path, o)?)
    };
    // Every rung is opened first (each cold: its own empty cache); then the prompts run one at a
    // time through every rung, the first rung rotating, so the rungs' times interleave within
    // seconds and a slow spell of a shared machine falls on all of them.
    let mut live: Vec<Live> = Vec::new();
    for (name, prefetch, exact, path, policy) in rungs {
        let mut o = opts.clone();
        o.cache.prefetch = prefetch;
        o.cache.exact = exact;
        o.cache.policy = policy;
        let st = open(path, &o)?;
        if name == "on-demand" {
            // The header's cache size: the original model's (a mixed bundle's experts are smaller).
            rep.slots = st.experts.config().slots;
            expert_bytes_max = st.plan.expert_bytes_max;
            rep.slot_fraction = (rep.slots as u64 * st.plan.expert_bytes_max) as f64 / st.plan.total_expert_bytes.max(1) as f64;
        }
        live.push(Live { name, st, io_threads: o.cache.io_threads, draft: None, t: 0, ms: 0.0, active_ms: 0.0, loads: 0, bytes: 0, drafted: 0, accepted: 0, per_prompt: Vec::new(), waits: Waits::default() });
    }
    // + speculative: the bundle rung's settings (alone: on-demand's), decoding through
    // speculative verification. A
    // draft's weights and KV cache (a draft model's, the MTP block's) come out of the same
    // budget (fewer expert slots).
    {
        let mut o = opts.clone();
        o.cache.prefetch = !spec.alone;
        o.cache.exact = ex;
        o.cache.policy = pol;
        let ds = spec.draft.clone().unwrap_or(DraftSpec::Lookup);
        let target: Arc<dyn ByteSource> = Arc::new(FileSource::open(spec_file)?);
        let extra = ds.reserve(target.clone(), o.n_ctx)?;
        o.budget = o.budget.saturating_sub(extra);
        let mut st = open(spec_file, &o)?;
        let d = ds.open(target, &mut st.session)?;
        let gamma = spec.draft_max.unwrap_or(ds.default_max());
        rep.spec_note = format!("+ speculative: {} (γ {gamma})", ds.name());
        if extra > 0 {
            rep.spec_note += &format!(", its weights + KV ({:.1} MiB) taken from the budget", extra as f64 / 1048576.0);
        }
        rep.spec_note += &format!(", {} expert slots, on {spec_file}", st.experts.config().slots);
        let draft: Box<dyn Draft> = d.draft;
        live.push(Live { name: "+ speculative".into(), st, io_threads: o.cache.io_threads, draft: Some((draft, gamma)), t: 0, ms: 0.0, active_ms: 0.0, loads: 0, bytes: 0, drafted: 0, accepted: 0, per_prompt: Vec::new(), waits: Waits::default() });
    }
    rep.memory_copy_bytes = copied;
    for l in &mut live {
        backend(&mut l.st.session, Some(l.st.plan.gpu_slots))?;
        l.st.experts.reset_stats();
    }
    let nr = live.len();
    for (i, p) in prompts.iter().enumerate() {
        for k in 0..nr {
            let l = &mut live[(i + k) % nr];
            let turn = Instant::now();
            let (t0, ms0) = (l.t, l.ms);
            match &mut l.draft {
                None => {
                    let (t, ms, loads, bytes) = decode_all(&mut l.st.session, std::slice::from_ref(p), n, Some(&l.st.experts), &mut l.waits)?;
                    (l.t, l.ms, l.loads, l.bytes) = (l.t + t, l.ms + ms, l.loads + loads, l.bytes + bytes);
                }
                Some((draft, gamma)) => {
                    let ex = l.st.experts.clone();
                    let probe = move || io_counts(&ex);
                    let so = SpecOptions { draft_max: *gamma, io: Some(&probe), verify_first: false };
                    let start = Instant::now();
                    let toks = l.st.session.tokenize(p);
                    let mut tick = l.waits.on_token(start);
                    let (_, g, sp) = speculative::generate(&mut l.st.session, Some(&mut **draft), &so, &toks, n, &SamplerConfig::greedy(), true, &mut |tok, _| {
                        if tok != u32::MAX {
                            tick();
                        }
                        true
                    })?;
                    l.t += g.gen_tokens;
                    l.ms += g.gen_ms;
                    l.drafted += sp.drafted;
                    l.accepted += sp.accepted;
                    l.loads += sp.expert_loads.unwrap_or(0);
                    l.bytes += sp.bytes_read.unwrap_or(0);
                }
            }
            l.active_ms += turn.elapsed().as_secs_f64() * 1000.0;
            l.per_prompt.push((l.t - t0) as f64 / ((l.ms - ms0) / 1000.0).max(1e-9));
        }
    }
    for l in live {
        let s = l.st.experts.stats();
        if l.name == "on-demand" {
            route = l.st.experts.take_route_log();
            rep.per_layer = s.layers.iter().enumerate().map(|(i, x)| {
                let tot = (x.hits + x.late + x.misses).max(1) as f64;
                (i, x.hits as f64 / tot, x.stall_ms, 0.0)
            }).collect();
        }
        if l.name == "+ lookahead" {
            for (i, x) in s.layers.iter().enumerate() {
                if let Some(pl) = rep.per_layer.get_mut(i) {
                    let r = x.pred_routed.first().copied().unwrap_or(0).max(1) as f64;
                    pl.3 = x.pred_tp.first().copied().unwrap_or(0) as f64 / r;
                }
            }
        }
        let mut r = streamed_rung(&l.name, l.t, l.ms, &s, l.io_threads, l.loads, l.bytes, l.active_ms);
        r.prompt_tokens_per_s = l.per_prompt.clone();
        r.latency = Latency::of(&l.waits);
        if l.draft.is_some() {
            if let (Some(rc), Some(pr)) = (s.draft_recall(), s.draft_precision()) {
                rep.spec_note += &format!("; verification experts predicted from the draft's hidden states: recall {:.1}%, precision {:.1}%", 100.0 * rc, 100.0 * pr);
            }
            r.acceptance_rate = Some(l.accepted as f64 / l.drafted.max(1) as f64);
        }
        rep.rungs.push(r);
    }
    let on_demand = rep.rungs.iter().find(|r| r.name == "on-demand").map(|r| r.tokens_per_s).unwrap_or(1.0);
    let od_prompts = rep.rungs.iter().find(|r| r.name == "on-demand").map(|r| r.prompt_tokens_per_s.clone()).unwrap_or_default();
    for r in &mut rep.rungs {
        r.ratio_to_on_demand = r.tokens_per_s / on_demand;
        if !r.prompt_tokens_per_s.is_empty() && r.prompt_tokens_per_s.len() == od_prompts.len() {
            let mut q: Vec<f64> = r.prompt_tokens_per_s.iter().zip(&od_prompts).map(|(a, b)| a / b).collect();
            q.sort_by(f64::total_cmp);
            let n = q.len();
            r.prompt_ratio_median = Some(if n % 2 == 1 { q[n / 2] } else { (q[n / 2 - 1] + q[n / 2]) / 2.0 });
        }
    }
    // Store throughput: a device profile's bandwidth is the store's throughput by definition;
    // on the real disk, read a spread of experts with the configured parallelism (only there: the
    // probe opens the file again, which would warm the page cache under a profile for nothing).
    let mbps = if let Some(p) = opts.profile {
        p.bandwidth / 1e6
    } else {
        let mut o = opts.clone();
        o.cache.prefetch = false;
        evict(model);
        let st = open_streaming(model, &o)?;
        let n_layer = st.session.model.cfg.n_layer;
        let n_exp = st.session.model.cfg.n_expert;
        let t0 = Instant::now();
        let mut bytes = 0u64;
        let mut ids: Vec<u32> = Vec::new();
        for l in 0..n_layer.min(8) {
            ids.clear();
            ids.extend((0..n_exp.min(st.experts.config().slots.saturating_sub(1)).min(16)).map(|e| ((e * 7 + l) % n_exp) as u32));
            ids.sort();
            ids.dedup();
            st.experts.with_experts_for_bench(l, &ids)?;
            bytes += ids.len() as u64 * st.plan.expert_bytes_max;
        }
        bytes as f64 / t0.elapsed().as_secs_f64() / 1e6
    };
    rep.store_mb_per_s = mbps;
    let tokens = rep.rungs.iter().find(|r| r.name == "on-demand").map(|r| r.tokens).unwrap_or(1).max(1);
    let misses = belady_misses(&route, rep.slots);
    rep.belady_hit_rate = 1.0 - misses as f64 / route.len().max(1) as f64;
    let per_expert = expert_bytes_max as f64;
    rep.pure_io_ms_per_token = misses as f64 * per_expert / (mbps * 1e6) * 1000.0 / tokens as f64;
    let compute = compute_ms_per_tok.unwrap_or(0.0);
    rep.oracle_tokens_per_s = 1000.0 / compute.max(rep.pure_io_ms_per_token).max(1e-9);
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::percentile;

    /// Nearest rank (NIST / Hyndman-Fan definition 1): the value at rank ⌈p·n/100⌉.
    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 10.0);
        assert_eq!(percentile(&v, 95.0), 19.0);
        assert_eq!(percentile(&v, 99.0), 20.0);
        assert_eq!(percentile(&v, 100.0), 20.0);
        assert_eq!(percentile(&[3.0], 50.0), 3.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }
}
