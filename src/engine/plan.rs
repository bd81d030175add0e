//! "Will it fit, and how fast?" (`les plan`): the budget plan of a model without loading it
//! (what the budget holds, the minimum, the largest context), the expert cache's hit rate (from
//! a recorded routing trace, replayed through the cache's eviction policy; without one, uniform
//! routing), the bytes read per token, and the prompt and decode speed with the bound that
//! limits them, from measured pieces: the forward's compute measured on this machine (the real
//! forward of the model, its experts served from one resident block per layer, so no reads),
//! and the reads from the device profile (`--store`) or a probe of the file's reads.
//!
//! The decode forecast is on-demand's: each token computes, then waits for its misses (per MoE
//! layer: the device's latency once when anything misses, the transfers one after another on
//! its channel, as [`crate::store::throttle`] models them). Lookahead prefetching can hide
//! reads behind compute; the forecast also gives that bound (perfect overlap).

use super::stream::{open_parts, BudgetPlan, Footprint, OpenError, StreamOptions, PREFILL_BATCH};
use super::gpu_cost::{price, GpuBreakdown, GpuDevice};
use super::{EngineError, Session};
use crate::backend::wgpu::GpuRates;
use crate::expert::policy::{Policy, FREQ_DECAY};
use crate::expert::store::ExpertStore;
use crate::expert::{ExpertBlock, ExpertError, ExpertLayout, ExpertSource};
use crate::model::{ExpertMode, Logits};
use crate::store::throttle::DeviceProfile;
use crate::store::ByteSource;
use std::collections::HashMap;
use std::sync::Arc;
use web_time::Instant;

/// What `les plan` is asked.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub budget: u64,
    pub n_ctx: usize,
    /// The device the experts are read from (`None`: this machine's file, probed).
    pub profile: Option<DeviceProfile>,
    /// A routing trace of this model (`les run --routes`): every routed (layer, expert) in order.
    pub routes: Option<Vec<(u32, u32)>>,
    pub policy: Policy,
    /// Measure the forward's compute on this machine (loads the dense weights); off: fit only.
    pub probe: bool,
    /// Tokens of the prompt whose speed is forecast (a session's first prompt: cold cache).
    pub prompt_tokens: usize,
    /// GPU devices to forecast a decode token on ([`super::gpu_cost`]); the calls per token are
    /// counted on this machine's adapter (needs one; lavapipe will do). Empty: none.
    pub gpu_devices: Vec<GpuDevice>,
}

/// The GPU's side of a forecast: the calls of one decode token counted on a real forward of the
/// model on this machine's adapter (every expert served from one resident block per layer, as
/// the compute probe does), the weights it reads, and the token priced on each device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuPlan {
    pub adapter: String,
    pub per_token: GpuRates,
    pub weight_bytes: f64,
    /// The weight type with the most bytes per token (what `les bench gpu-probe` should time).
    pub main_type: &'static str,
    /// Decode ms per token on this adapter, measured on the same forwards.
    pub measured_ms_per_token: f64,
    pub forecasts: Vec<GpuBreakdown>,
}

/// How fast reads are: a device profile, or this machine's file measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReadModel {
    pub source: String,
    /// Per read (seconds), overlapping other reads; transfers share one channel (bytes/s).
    pub latency_s: f64,
    pub bandwidth: f64,
}

impl ReadModel {
    /// Seconds for one MoE layer's reads: `misses` experts of `bytes` each, `p_any` the chance
    /// that the layer misses at all.
    fn layer_time(&self, misses: f64, bytes: f64, p_any: f64) -> f64 {
        p_any * self.latency_s + misses * bytes / self.bandwidth
    }
}

/// Compute measured on this machine (the real forward, no reads).
#[derive(Clone, Debug, serde::Serialize)]
pub struct ComputeProbe {
    /// How it was measured ("probe": [`probe_compute`]; or the caller's own runs).
    pub source: &'static str,
    pub decode_ms_per_token: f64,
    pub prompt_ms_per_token: f64,
    /// Tokens per prompt batch when streaming ([`PREFILL_BATCH`]).
    pub prompt_batch: usize,
    pub threads: usize,
}

/// The forecast.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Forecast {
    pub arch: String,
    pub n_layer: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub store: &'static str,
    /// Whether the budget holds the model, and how (None: it does not; `why` says).
    pub fits: bool,
    pub why: Option<String>,
    pub plan: Option<BudgetPlan>,
    /// The least budget the model runs in at this context, and the longest context this budget
    /// holds (with the fewest expert slots); both reading dense matrices from storage if they
    /// must (CPU backend), as `les run` would.
    pub minimum: u64,
    pub largest_context: usize,
    /// Of every routed expert (as `les run` reports it), and of decode steps alone.
    pub hit_rate: f64,
    pub decode_hit_rate: f64,
    pub hit_rate_source: String,
    /// Decode: experts read, bytes read (experts and streamed dense matrices) per token.
    pub reads_per_token: f64,
    pub bytes_per_token: f64,
    pub read: ReadModel,
    pub read_ms_per_token: f64,
    pub compute: Option<ComputeProbe>,
    pub decode_tokens_per_s: Option<f64>,
    /// With every read hidden behind compute (lookahead at its best).
    pub decode_tokens_per_s_overlapped: Option<f64>,
    /// "compute" or "reads": the larger share of a decode step.
    pub decode_bound: Option<&'static str>,
    /// A first prompt of `prompt_tokens` tokens (cold cache).
    pub prompt_tokens: usize,
    pub prompt_tokens_per_s: Option<f64>,
    pub prompt_bound: Option<&'static str>,
    /// Decode on the GPU devices asked for (`PlanOptions::gpu_devices`).
    pub gpu: Option<GpuPlan>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("routing trace: {0}")]
    Routes(String),
    #[error(transparent)]
    Expert(#[from] ExpertError),
}

/// Plan `path` (a GGUF or a `.les` bundle), measuring compute here when `o.probe`.
#[cfg(not(target_arch = "wasm32"))]
pub fn plan(path: &str, o: &PlanOptions) -> Result<Forecast, PlanError> {
    let file: Arc<dyn ByteSource> = Arc::new(crate::store::FileSource::open(path).map_err(OpenError::from)?);
    plan_source(file, path, o, None)
}

/// Plan the model in `src` (`name` for errors). Compute: `measured` when given (e.g. a running
/// engine's own decode and prompt times, reads left out), else the probe when `o.probe`.
pub fn plan_source(src: Arc<dyn ByteSource>, name: &str, o: &PlanOptions, measured: Option<ComputeProbe>) -> Result<Forecast, PlanError> {
    let parts = open_parts(src.clone(), src.clone(), src, name)?;
    let (g, c, store) = (&parts.g, &parts.c, parts.store.clone());
    let fp = Footprint::new(g, c, &*store);
    let opts = StreamOptions {
        budget: o.budget,
        n_ctx: o.n_ctx,
        direct: false,
        #[cfg(not(target_arch = "wasm32"))]
        profile: None,
        cache: Default::default(),
        slots: None,
        gpu_pool: false,
        dense: Default::default(),
    };
    let (plan, fits, why) = match fp.plan(g, c, &opts) {
        Ok((p, _)) => (Some(p), true, None),
        Err(e) => (None, false, Some(e.to_string())),
    };
    let minimum = fp.minimum(g, c, &opts);
    let largest_context = largest_context(c.n_ctx_train.max(1), &|n| fp.minimum(g, c, &StreamOptions { n_ctx: n, ..opts.clone() }) <= o.budget);
    let slots = plan.as_ref().map_or(fp.min_slots, |p| p.slots.clamp(fp.min_slots, c.n_moe_layers() * c.n_expert));
    // Hit rates: the whole run's (as `les run` reports it), decode's, and a prompt batch's
    // misses per layer (None: from the uniform model below).
    let (hit_rate, decode_hit, prompt_misses, hit_rate_source) = match &o.routes {
        Some(r) => {
            for &(l, e) in r {
                if l as usize >= c.n_moe_layers() || e as usize >= c.n_expert {
                    return Err(PlanError::Routes(format!("[{l}, {e}] is outside this model's {} MoE layers × {} experts", c.n_moe_layers(), c.n_expert)));
                }
            }
            let groups = replay_groups(r, slots, o.policy, c.n_moe_layers());
            let rate = |gs: &mut dyn Iterator<Item = &Group>| {
                let (m, n) = gs.fold((0, 0), |(m, n), g| (m + g.misses, n + g.routed));
                (n > 0).then(|| 1.0 - m as f64 / n as f64)
            };
            let all = rate(&mut groups.iter()).unwrap_or(0.0);
            let decode = rate(&mut groups.iter().filter(|g| g.routed <= c.n_expert_used)).unwrap_or(all);
            let batches: Vec<&Group> = groups.iter().filter(|g| g.routed > c.n_expert_used).collect();
            let prompt = (!batches.is_empty()).then(|| batches.iter().map(|g| g.misses as f64).sum::<f64>() / batches.len() as f64);
            (all, decode, prompt, format!("{} routed experts of a recorded run replayed through {} slots ({})", r.len(), slots, o.policy.name()))
        }
        None => {
            let h = (slots as f64 / (c.n_moe_layers() * c.n_expert) as f64).min(1.0);
            (h, h, None, "uniform routing (no trace: real routing is skewed, so this is low; pass --routes from les run --routes)".into())
        }
    };
    let read = match o.profile {
        Some(p) => ReadModel { source: format!("device profile {}", p.name), latency_s: p.latency, bandwidth: p.bandwidth },
        None => probe_reads(&*store, c.n_expert)?,
    };
    let k = c.n_expert_used as f64;
    let miss = 1.0 - decode_hit;
    let mean_bytes = fp.expert_bytes.iter().sum::<u64>() as f64 / fp.expert_bytes.len().max(1) as f64;
    // A layer misses at all unless each of its k experts hits (independence assumed).
    let p_any = 1.0 - decode_hit.powf(k);
    let reads_per_token = c.n_moe_layers() as f64 * k * miss;
    let dense_streamed = plan.as_ref().map_or(0, |p| p.dense_streamed) as f64;
    let bytes_per_token = reads_per_token * mean_bytes + dense_streamed;
    let read_s: f64 = fp.expert_bytes.iter().map(|&b| read.layer_time(k * miss, b as f64, p_any)).sum::<f64>() + dense_streamed / read.bandwidth;
    let compute = match measured {
        Some(m) => Some(m),
        None if o.probe && fits => Some(probe_compute(&parts.dense_src, store, c.n_moe_layers(), o.n_ctx, o.prompt_tokens)?),
        None => None,
    };
    let (mut decode, mut overlapped, mut decode_bound, mut prompt, mut prompt_bound) = (None, None, None, None, None);
    if let Some(cp) = &compute {
        let comp = cp.decode_ms_per_token / 1000.0;
        decode = Some(1.0 / (comp + read_s));
        overlapped = Some(1.0 / comp.max(read_s));
        decode_bound = Some(if comp >= read_s { "compute" } else { "reads" });
        // A prompt of P tokens (a session's first: the cache starts empty) runs in batches of
        // B; each reads the union of its experts per layer, each expert routed by some token of
        // the batch with probability 1 − (1 − k/n)^B. Without a trace: the first batch misses
        // everything, later ones hit what the cache holds of the model's experts.
        let b = cp.prompt_batch.min(o.prompt_tokens.max(1)) as f64;
        let batches = (o.prompt_tokens.max(1) as f64 / b).ceil();
        let n = c.n_expert as f64;
        let union = n * (1.0 - (1.0 - k / n).powf(b));
        let held = (slots as f64 / (c.n_moe_layers() * c.n_expert) as f64).min(1.0);
        // With a trace: its prompt batches' misses per layer, as the replayed cache had them.
        let misses = prompt_misses.unwrap_or(union * (1.0 + (batches - 1.0) * (1.0 - held)) / batches);
        let batch_read: f64 = fp.expert_bytes.iter().map(|&x| read.layer_time(misses, x as f64, if misses > 0.0 { 1.0 } else { 0.0 })).sum::<f64>() + dense_streamed / read.bandwidth;
        let batch_comp = cp.prompt_ms_per_token / 1000.0 * b;
        prompt = Some(b / (batch_comp + batch_read));
        prompt_bound = Some(if batch_comp >= batch_read { "compute" } else { "reads" });
    }
    let gpu = if o.gpu_devices.is_empty() || !fits || !o.probe {
        None
    } else {
        let (adapter, per_token, weight_bytes, main_type, measured) = probe_gpu(&parts.dense_src, parts.store.clone(), c.n_moe_layers(), o.n_ctx)?;
        let forecasts = o
            .gpu_devices
            .iter()
            .map(|d| {
                // The device's own storage: its reads per token as above.
                let rm = DeviceProfile::by_name(d.store).map(|p| ReadModel { source: p.name.into(), latency_s: p.latency, bandwidth: p.bandwidth }).unwrap_or_else(|| read.clone());
                let rs: f64 = fp.expert_bytes.iter().map(|&b| rm.layer_time(k * miss, b as f64, p_any)).sum();
                price(d, per_token, weight_bytes, rs * 1000.0)
            })
            .collect();
        Some(GpuPlan { adapter, per_token, weight_bytes, main_type, measured_ms_per_token: measured, forecasts })
    };
    Ok(Forecast {
        gpu,
        arch: c.arch.name().into(),
        n_layer: c.n_layer,
        n_expert: c.n_expert,
        n_expert_used: c.n_expert_used,
        store: parts.kind,
        fits,
        why,
        plan,
        minimum,
        largest_context,
        hit_rate,
        decode_hit_rate: decode_hit,
        hit_rate_source,
        reads_per_token,
        bytes_per_token,
        read,
        read_ms_per_token: read_s * 1000.0,
        compute,
        decode_tokens_per_s: decode,
        decode_tokens_per_s_overlapped: overlapped,
        decode_bound,
        prompt_tokens: o.prompt_tokens,
        prompt_tokens_per_s: prompt,
        prompt_bound,
    })
}

/// The longest context (tokens, at most `n_train`) that `fits`; 0 when not even one token does.
fn largest_context(n_train: usize, fits: &dyn Fn(usize) -> bool) -> usize {
    if !fits(1) {
        return 0;
    }
    let (mut lo, mut hi) = (1, n_train);
    if fits(hi) {
        return hi;
    }
    // fits(lo), !fits(hi)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// One MoE layer's experts of one forward in a replayed trace: how many were routed (a decode
/// step's top-k, a prompt batch's union) and how many missed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub layer: usize,
    pub routed: usize,
    pub misses: usize,
}

/// Hit rate of `slots` expert slots over a routing trace under `policy` ([`replay_groups`]).
pub fn replay(routes: &[(u32, u32)], slots: usize, policy: Policy, n_layers: usize) -> f64 {
    let (m, n) = replay_groups(routes, slots, policy, n_layers).iter().fold((0, 0), |(m, n), g| (m + g.misses, n + g.routed));
    if n == 0 {
        0.0
    } else {
        1.0 - m as f64 / n as f64
    }
}

/// Replay a routing trace through `slots` expert slots as the cache evicts without prefetching
/// (`crate::expert::queue`'s victim: an empty slot first, then the lowest retention under
/// `policy`, ties by least recent use; a layer's own experts are never evicted for each other).
/// A forward ends where the layer number falls; use counts decay by [`FREQ_DECAY`] per forward.
pub fn replay_groups(routes: &[(u32, u32)], slots: usize, policy: Policy, n_layers: usize) -> Vec<Group> {
    let slots = slots.max(1);
    let mut resident: HashMap<(usize, usize), u64> = HashMap::new(); // key → last use
    let mut freq: HashMap<(usize, usize), f32> = HashMap::new();
    let (mut clock, mut prev_layer) = (0u64, usize::MAX);
    let mut out = Vec::new();
    let mut i = 0;
    while i < routes.len() {
        let layer = routes[i].0 as usize;
        if prev_layer != usize::MAX && layer <= prev_layer {
            for v in freq.values_mut() {
                *v *= FREQ_DECAY;
            }
        }
        prev_layer = layer;
        // One layer's experts together (a decode step's top-k, or a prompt batch's union).
        let mut j = i;
        while j < routes.len() && routes[j].0 as usize == layer {
            j += 1;
        }
        let keys: Vec<(usize, usize)> = routes[i..j].iter().map(|&(l, e)| (l as usize, e as usize)).collect();
        let mut misses = 0;
        for &k in &keys {
            if resident.contains_key(&k) {
                continue;
            }
            misses += 1;
            if resident.len() >= slots {
                let victim = resident
                    .iter()
                    .filter(|(k2, _)| !keys.contains(k2))
                    .map(|(&k2, &t)| (policy.retention(freq.get(&k2).copied().unwrap_or(0.0) as f64, k2.0, layer, n_layers), t, k2))
                    .min_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal).then(a.1.cmp(&b.1)))
                    .map(|x| x.2);
                match victim {
                    Some(v) => {
                        resident.remove(&v);
                    }
                    None => continue, // every slot holds this layer's experts
                }
            }
            resident.insert(k, clock);
        }
        for &k in &keys {
            clock += 1;
            if let Some(t) = resident.get_mut(&k) {
                *t = clock;
            }
            *freq.entry(k).or_insert(0.0) += 1.0;
        }
        out.push(Group { layer, routed: keys.len(), misses });
        i = j;
    }
    out
}

/// Time whole experts read from the file as the cache reads them (every range of a few
/// experts spread over the layers; buffered reads, as `les run --store disk`): per expert,
/// taken as all transfer (latency 0) at the measured rate.
fn probe_reads(store: &dyn ExpertStore, n_expert: usize) -> Result<ReadModel, PlanError> {
    let n = store.n_layers();
    let mut buf = Vec::new();
    let (mut bytes, mut secs) = (0usize, 0f64);
    for i in 0..16.min(n * n_expert) {
        let (l, e) = (i * 7 % n, (i * 13 + 5) % n_expert);
        let t0 = Instant::now();
        store.read_expert(l, e, &mut buf)?;
        secs += t0.elapsed().as_secs_f64();
        bytes += buf.len();
    }
    Ok(ReadModel { source: format!("this machine's file, probed ({} experts, {:.0} MB/s)", 16.min(n * n_expert), bytes as f64 / secs.max(1e-9) / 1e6), latency_s: 0.0, bandwidth: bytes as f64 / secs.max(1e-9) })
}

/// Experts for a compute probe: one real expert block per layer handed out for every routed
/// id, so the forward computes at its real shapes and types without reading anything.
struct ProbeExperts {
    blocks: Vec<ExpertBlock>,
}

impl ExpertSource for ProbeExperts {
    fn layout(&self, layer: usize) -> &ExpertLayout {
        &self.blocks[layer].layout
    }
    fn with_experts(&self, layer: usize, ids: &[u32], f: &mut dyn FnMut(usize, &ExpertBlock)) -> Result<(), ExpertError> {
        for i in 0..ids.len() {
            f(i, &self.blocks[layer]);
        }
        Ok(())
    }
}

/// A session of the model whose experts are served by [`ProbeExperts`] (one real block per
/// layer, read once).
fn probe_session(dense: &Arc<dyn ByteSource>, store: &dyn ExpertStore, n_layer: usize, n_ctx: usize) -> Result<Session, PlanError> {
    let mut blocks = Vec::with_capacity(n_layer);
    for l in 0..n_layer {
        let mut data = Vec::new();
        store.read_expert(l, 0, &mut data)?;
        blocks.push(ExpertBlock::new(data, store.layout(l).clone()));
    }
    Ok(Session::load_streaming_dense(&**dense, ExpertMode::External(Arc::new(ProbeExperts { blocks })), n_ctx.max(128), PREFILL_BATCH, None)?)
}

/// The median of timed runs (ms).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    times[times.len() / 2]
}

/// The forward's compute on this machine, with every expert "resident" ([`ProbeExperts`]): a
/// prompt of `prompt_tokens` (at most 512, at least two streaming batches; within the context)
/// in streaming batches, then decode steps after it (the first two not timed: attention's cost
/// grows with the context, so decode is measured where a first reply starts).
fn probe_compute(dense: &Arc<dyn ByteSource>, store: Arc<dyn ExpertStore>, n_layer: usize, n_ctx: usize, prompt_tokens: usize) -> Result<ComputeProbe, PlanError> {
    let mut s = probe_session(dense, &*store, n_layer, n_ctx)?;
    let n_vocab = s.model.cfg.n_vocab as u32;
    let n_prompt = prompt_tokens.clamp(2 * PREFILL_BATCH, 512).min(s.kv.n_ctx.saturating_sub(16)).max(1);
    let prompt: Vec<u32> = (0..n_prompt as u32).map(|i| (i * 7919 + 13) % n_vocab).collect();
    let t0 = Instant::now();
    s.prefill(&prompt)?;
    let prompt_ms = t0.elapsed().as_secs_f64() * 1000.0 / prompt.len() as f64;
    let mut times = Vec::new();
    for i in 0..10u32 {
        let t0 = Instant::now();
        s.model.forward(&[(i * 104729 + 7) % n_vocab], &mut s.kv, Logits::Last).map_err(EngineError::from)?;
        if i >= 2 {
            times.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Ok(ComputeProbe { source: "probe", decode_ms_per_token: median(times), prompt_ms_per_token: prompt_ms, prompt_batch: PREFILL_BATCH, threads: crate::backend::cpu::par::n_threads() })
}

/// One decode token on this machine's GPU adapter ([`ProbeExperts`], so no reads; every expert
/// in a GPU slot first where 2 GiB of slots hold them): the calls counted by the backend (after
/// warm-up tokens), the weight bytes a token reads (the matrices on
/// the device, and the routed experts' per MoE layer), the type with the most of them, and the
/// measured ms per token (median).
#[cfg(not(target_arch = "wasm32"))]
pub fn probe_gpu(dense: &Arc<dyn ByteSource>, store: Arc<dyn ExpertStore>, n_layer: usize, n_ctx: usize) -> Result<(String, GpuRates, f64, &'static str, f64), PlanError> {
    use crate::backend::wgpu::{exec::GpuOptions, GpuContext};
    let mut s = probe_session(dense, &*store, n_layer, n_ctx)?;
    let ctx = GpuContext::new().map_err(EngineError::from)?;
    let adapter = format!("{} ({:?}, {:?})", ctx.info.name, ctx.info.backend, ctx.info.device_type);
    // Every expert in a slot where 2 GiB holds them (a resident token's calls), else the default pool.
    let c = &s.model.cfg;
    let (all, c_n_expert) = (c.n_moe_layers() * c.n_expert, c.n_expert);
    let slot = (0..n_layer).map(|l| crate::backend::wgpu::experts::SlotLayout::bytes_for(store.layout(l))).max().unwrap_or(1).max(1);
    let resident = all * slot <= 2 << 30;
    let opts = GpuOptions { expert_slots: resident.then_some(all), ..Default::default() };
    s.use_gpu(ctx, &opts)?;
    if resident {
        // Every expert uploaded first: the tokens measured are a resident model's.
        let src = s.model.experts().expect("a MoE model").clone();
        s.gpu.as_ref().expect("on the GPU").preload_all(&*src, n_layer, c_n_expert).map_err(EngineError::from)?;
    }
    // Bytes per decode token by type: every device matrix (the host-only embedding lookup
    // aside), and k routed experts per MoE layer.
    let mut by_type: HashMap<&'static str, f64> = HashMap::new();
    let w = &s.model.weights;
    for (i, m) in w.mats().iter().enumerate() {
        if !w.host_only(i) {
            *by_type.entry(m.ty.name()).or_default() += m.ty.row_bytes(m.cols as u64).unwrap_or(0) as f64 * m.rows as f64;
        }
    }
    if s.model.cfg.is_moe() {
        let k = s.model.cfg.n_expert_used as f64;
        for l in 0..n_layer {
            let lay = store.layout(l);
            for (ty, b) in [(lay.gate_ty, lay.gate_bytes), (lay.up_ty, lay.up_bytes), (lay.down_ty, lay.down_bytes)] {
                *by_type.entry(ty.name()).or_default() += k * b as f64;
            }
        }
    }
    let weight_bytes = by_type.values().sum();
    let main_type = by_type.iter().max_by(|a, b| a.1.partial_cmp(b.1).unwrap_or(std::cmp::Ordering::Equal)).map(|(t, _)| *t).unwrap_or("F32");
    let n_vocab = s.model.cfg.n_vocab as u32;
    let prompt: Vec<u32> = (0..8u32).map(|i| (i * 7919 + 13) % n_vocab).collect();
    s.prefill(&prompt)?;
    let mut times = Vec::new();
    for i in 0..12u32 {
        if i == 4 {
            s.gpu.as_ref().expect("on the GPU").reset_stats();
        }
        let t0 = Instant::now();
        s.forward(&[(i * 104729 + 7) % n_vocab], Logits::Last)?;
        if i >= 4 {
            times.push(t0.elapsed().as_secs_f64() * 1000.0);
        }
    }
    let per_token = s.gpu.as_ref().expect("on the GPU").stats().per_token();
    Ok((adapter, per_token, weight_bytes, main_type, median(times)))
}

#[cfg(target_arch = "wasm32")]
pub fn probe_gpu(_: &Arc<dyn ByteSource>, _: Arc<dyn ExpertStore>, _: usize, _: usize) -> Result<(String, GpuRates, f64, &'static str, f64), PlanError> {
    Err(PlanError::Engine(EngineError::Gpu(crate::backend::wgpu::GpuError::NoAdapter("the plan's GPU probe runs natively".into()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_counts_hits_as_an_lru_cache_would() {
        // Two layers, top-1. With 2 slots under LRU every expert stays: only first uses miss.
        let r = [(0, 1), (1, 2), (0, 1), (1, 2), (0, 3), (1, 2)];
        assert!((replay(&r, 2, Policy::Lru, 2) - 3.0 / 6.0).abs() < 1e-12);
        // One slot: the layer-1 expert evicts the layer-0 one each step: no hits.
        assert_eq!(replay(&r[..4], 1, Policy::Lru, 2), 0.0);
        // Ample slots: all but the distinct first uses hit.
        assert!((replay(&r, 10, Policy::NextUse, 2) - 3.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn largest_context_is_the_last_that_fits() {
        // 120 fixed, 2 bytes per token: 1000 holds 440 tokens.
        let fits = |budget: u64| move |n: usize| 120 + 2 * n as u64 <= budget;
        assert_eq!(largest_context(100_000, &fits(1000)), 440);
        assert_eq!(largest_context(300, &fits(1000)), 300);
        assert_eq!(largest_context(300, &fits(100)), 0);
    }
}
