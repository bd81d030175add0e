//! Opening a model for streaming under a memory budget: the budget plan, the expert store
//! (GGUF ranges or a packed bundle; buffered or O_DIRECT; optionally throttled to a device
//! profile) and the [`StreamingExperts`] cache behind the model.

use super::{EngineError, Session};
use crate::expert::bundle::{is_bundle, Bundle, BundleError};
use crate::expert::store::{ExpertStore, GgufExpertStore};
use crate::expert::stream::{StreamConfig, StreamingExperts};
use crate::expert::GgufExpertTensors;
use crate::gguf::GgufFile;
use crate::model::{Config, DenseStreaming, ExpertMode};
use crate::quant;
#[cfg(not(target_arch = "wasm32"))]
use crate::store::throttle::{DeviceProfile, Throttled};
#[cfg(not(target_arch = "wasm32"))]
use crate::store::FileSource;
use crate::store::{ByteSource, StoreError};
use std::sync::Arc;

/// Parse a byte size: `123`, `400MiB`, `1.5GiB`, `512KiB`, `400MB` (10^6), `2G` (= GiB).
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| format!("invalid size '{s}' (examples: 400MiB, 1.5GiB, 123456)"))?;
    let mul: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1048576.0,
        "g" | "gib" => 1073741824.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        u => return Err(format!("unknown size unit '{u}' in '{s}' (use B, KiB, MiB, GiB, KB, MB, GB)")),
    };
    Ok((v * mul) as u64)
}

/// How a memory budget is spent (bytes).
#[derive(Clone, Debug, serde::Serialize)]
pub struct BudgetPlan {
    pub budget: u64,
    pub dense: u64,
    pub kv: u64,
    pub scratch: u64,
    pub expert_bytes_max: u64,
    pub slots: usize,
    /// Of `slots`, how many are GPU slots (0: no GPU pool; see `StreamOptions::gpu_pool`); the
    /// CPU cache has the other `slots - gpu_slots`.
    pub gpu_slots: usize,
    /// Smallest budget this model runs in with these settings.
    pub minimum: u64,
    pub total_expert_bytes: u64,
    /// Dense bytes read from storage at each use instead of held (not in `dense`), and what the
    /// read-ahead holding the next of them may take (in `dense`); 0 when every dense weight is held.
    pub dense_streamed: u64,
    pub dense_window: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    #[error("memory budget {budget} bytes ({budget_mib:.1} MiB) is below the minimum this model runs in: {minimum} bytes ({minimum_mib:.1} MiB) = dense weights {dense} + KV cache {kv} + scratch {scratch} + {min_slots} expert slots of {slot} bytes (lower --ctx-size to shrink the KV cache)")]
    TooSmall { budget: u64, budget_mib: f64, minimum: u64, minimum_mib: f64, dense: u64, kv: u64, scratch: u64, min_slots: usize, slot: u64 },
    #[error("the memory budget's {gpu_slots} GPU expert slots are not reachable from its control (BudgetControl::with_gpu_pool was not given the session's pool)")]
    GpuPool { gpu_slots: usize },
}

/// Shared by a streaming session and its [`BudgetControl`]: the dense weights' plan the budget
/// asked for, taken by the session before its next forward ([`Session::apply_budget`]).
#[derive(Default)]
pub struct DenseReplan {
    pending: std::sync::Mutex<Option<DenseStreaming>>,
    /// The session runs on a GPU, which holds its own copy of the dense weights: no re-plan.
    pub(crate) on_gpu: std::sync::atomic::AtomicBool,
}

impl DenseReplan {
    /// The plan asked for and not taken yet.
    pub(crate) fn take(&self) -> Option<DenseStreaming> {
        self.pending.lock().unwrap().take()
    }
}

/// What [`BudgetControl`] needs to re-plan the dense weights (CPU backend, native).
struct DenseCtl {
    /// [`streamable_dense`], in the order they are given up.
    cands: Vec<(String, u64)>,
    opts: DenseOptions,
    /// Where streamed matrices are read from (and held ones read back).
    src: Arc<dyn ByteSource>,
    /// Every dense weight's bytes, held or not.
    dense: u64,
    /// The matrices streamed as last planned.
    names: std::collections::HashSet<String>,
}

/// The memory budget of a running streaming session, changeable from any thread while the
/// model runs (an app's memory warning, `les serve`'s `/les/budget`, the `--adapt-budget`
/// watchdog, the browser page): the KV cache and scratch stay as planned at load, and the
/// expert cache takes what is left ([`StreamingExperts::set_slots`]). When dense streaming is
/// allowed (native CPU), a budget below the dense weights re-plans which matrices are read from
/// storage at each use (as at load: [`plan_dense_streaming`]) and a higher one takes them back;
/// the session applies that before its next forward. The conversation and the logits are
/// unchanged: only which experts and matrices are resident changes.
#[derive(Clone)]
pub struct BudgetControl {
    experts: Arc<StreamingExperts>,
    plan: Arc<std::sync::Mutex<BudgetPlan>>,
    /// Bytes of the user's budget held beside the model (a draft model, an MTP block, a vision
    /// tower): [`Self::set`] takes the whole budget and leaves these out.
    reserve: u64,
    /// The GPU expert pool, when the plan split the slots for one.
    gpu: Option<crate::backend::wgpu::exec::PoolHandle>,
    /// Dense re-planning, when allowed: what plans it, and the plan handed to the session.
    dense: Option<Arc<std::sync::Mutex<DenseCtl>>>,
    replan: Option<Arc<DenseReplan>>,
    /// Expert slots the model needs at least (one layer's top-k + 1).
    min_slots: usize,
}

impl BudgetControl {
    pub fn new(experts: Arc<StreamingExperts>, mut plan: BudgetPlan) -> Self {
        if plan.gpu_slots == 0 {
            // The cache's own count (at most one slot per expert).
            plan.slots = experts.slots();
        }
        let min_slots = (plan.minimum.saturating_sub(plan.dense + plan.kv + plan.scratch) / plan.expert_bytes_max.max(1)) as usize;
        Self { experts, plan: Arc::new(std::sync::Mutex::new(plan)), reserve: 0, gpu: None, dense: None, replan: None, min_slots }
    }

    /// Allow re-planning the dense weights (`streamed`: the matrices streamed at load);
    /// `minimum` is the one with every candidate streamed ([`Footprint::minimum`]).
    fn with_dense(mut self, cands: Vec<(String, u64)>, opts: DenseOptions, src: Arc<dyn ByteSource>, dense: u64, streamed: std::collections::HashSet<String>, minimum: u64) -> Self {
        {
            let mut p = self.plan.lock().unwrap();
            p.minimum = p.minimum.min(minimum);
        }
        self.dense = Some(Arc::new(std::sync::Mutex::new(DenseCtl { cands, opts, src, dense, names: streamed })));
        self.replan = Some(Arc::default());
        self
    }

    /// The dense re-plans this budget hands its session ([`Session::apply_budget`]).
    pub(crate) fn dense_replan(&self) -> Option<&Arc<DenseReplan>> {
        self.replan.as_ref()
    }

    /// The expert cache it sizes.
    pub fn experts(&self) -> &Arc<StreamingExperts> {
        &self.experts
    }

    /// The session's GPU expert pool ([`crate::backend::wgpu::exec::GpuBackend::expert_pool`]):
    /// a budget split for one (`BudgetPlan::gpu_slots`) resizes it too.
    pub fn with_gpu_pool(mut self, pool: Option<crate::backend::wgpu::exec::PoolHandle>) -> Self {
        self.gpu = pool;
        self
    }

    /// Count `bytes` of every budget given to [`Self::set`] as held beside the model.
    pub fn with_reserve(mut self, bytes: u64) -> Self {
        self.reserve = bytes;
        self
    }

    /// The plan now (its `budget` and `minimum` without the reserve; `slots`: the cache's, which
    /// an out-of-memory shrink may have lowered since).
    pub fn plan(&self) -> BudgetPlan {
        let mut p = self.plan.lock().unwrap().clone();
        if p.gpu_slots == 0 {
            p.slots = self.experts.slots();
        }
        p
    }

    /// The whole budget now and the smallest one [`Self::set`] accepts (reserve included).
    pub fn budget(&self) -> u64 {
        self.plan.lock().unwrap().budget + self.reserve
    }
    pub fn minimum(&self) -> u64 {
        self.plan.lock().unwrap().minimum + self.reserve
    }

    /// The budget as a host reads it (the C ABI's `les_stats_json`, the browser's
    /// `engine.memoryBudget()`): `budget`, `minimum`, `expert_slots`, `expert_bytes_held`,
    /// `dense_streamed` (bytes read from storage at each use), and the allocator's emergency
    /// reserve (`reserve_bytes`, `reserve_releases`: allocations the heap refused).
    pub fn summary_json(&self) -> serde_json::Value {
        let p = self.plan();
        serde_json::json!({
            "budget": self.budget(),
            "minimum": self.minimum(),
            "expert_slots": p.slots,
            "expert_bytes_held": self.experts.held_bytes(),
            "dense_streamed": p.dense_streamed,
            "reserve_bytes": super::reserve::reserve_bytes(),
            "reserve_releases": super::reserve::releases(),
        })
    }

    /// Change the budget to `budget` bytes (the whole budget, as `--memory-budget`): below the
    /// model's minimum it is refused ([`BudgetError::TooSmall`]) and nothing changes. A lower
    /// budget frees expert slots at once (those in use when the forward using them is done) and
    /// returns the freed memory to the system; a higher one gives the cache more slots, up to
    /// one per expert. Where dense streaming is allowed, a budget that cannot hold the dense
    /// weights streams some of them (the session frees them before its next forward) and a
    /// higher one holds them again. Returns the new plan.
    pub fn set(&self, budget: u64) -> Result<BudgetPlan, BudgetError> {
        let mut p = self.plan.lock().unwrap();
        let pool = match (&self.gpu, p.gpu_slots) {
            (_, 0) => None,
            (Some(h), _) => Some(h),
            (None, n) => return Err(BudgetError::GpuPool { gpu_slots: n }),
        };
        let min_slots = self.min_slots;
        let whole = |e: BudgetError| match e {
            BudgetError::TooSmall { minimum, dense, kv, scratch, min_slots, slot, .. } => {
                let minimum = minimum + self.reserve;
                BudgetError::TooSmall { budget, budget_mib: budget as f64 / 1048576.0, minimum, minimum_mib: minimum as f64 / 1048576.0, dense, kv, scratch, min_slots, slot }
            }
            e => e,
        };
        let on_gpu = self.replan.as_ref().is_some_and(|r| r.on_gpu.load(std::sync::atomic::Ordering::Relaxed));
        let ctl = self.dense.as_ref().filter(|_| pool.is_none() && !on_gpu).map(|c| c.lock().unwrap());
        let b = budget.saturating_sub(self.reserve);
        let (mut q, replanned) = match ctl {
            None => (plan_budget(b, p.dense, p.kv, p.scratch, p.expert_bytes_max, p.total_expert_bytes, min_slots).map_err(whole)?, false),
            Some(mut c) => {
                // As at load: every dense weight held when that leaves the minimum slots, else the
                // fewest matrices streamed that leave two layers' experts (or at least the minimum).
                let (max_e, total_e) = (p.expert_bytes_max, p.total_expert_bytes);
                let d = match plan_budget(b, c.dense, p.kv, p.scratch, max_e, total_e, min_slots) {
                    Ok(_) => DensePlan::default(),
                    Err(_) => {
                        let rooms = (2 * min_slots as u64 * max_e, min_slots as u64 * max_e);
                        let least = DensePlan::first(&c.cands, c.cands.len(), &c.opts);
                        plan_dense_streaming(&c.cands, b, c.dense, p.kv, p.scratch, rooms, &c.opts).unwrap_or(least)
                    }
                };
                let mut q = plan_budget(b, d.resident(c.dense), p.kv, p.scratch, max_e, total_e, min_slots).map_err(whole)?;
                (q.minimum, q.dense_streamed, q.dense_window) = (p.minimum, d.streamed, d.held());
                if let Some(r) = self.replan.as_ref().filter(|_| d.names != c.names) {
                    *r.pending.lock().unwrap() = Some(DenseStreaming { names: d.names.clone(), src: c.src.clone(), window: d.window as usize, piece: d.piece as usize });
                    c.names = d.names;
                }
                (q, true)
            }
        };
        let before = self.experts.slots() + pool.map_or(0, |h| h.slots());
        match pool {
            // Split as at load: a small CPU staging cache in front of the GPU pool.
            Some(h) => {
                let (cpu, gpu) = split_gpu_slots(q.slots.max(min_slots), min_slots - 1, self.experts.config().depth);
                let cpu = self.experts.set_slots(cpu);
                q.gpu_slots = h.set_slots(gpu.min(self.experts.max_slots()));
                q.slots = cpu + q.gpu_slots;
            }
            None => q.slots = self.experts.set_slots(q.slots),
        }
        if !replanned {
            (q.dense_streamed, q.dense_window) = (p.dense_streamed, p.dense_window);
        }
        if q.slots < before {
            release_freed_memory();
        }
        *p = q.clone();
        Ok(q)
    }
}

/// After the dense weights were re-planned: large blocks freed from now on leave the process,
/// and the freed matrices' memory goes back to the system.
pub(crate) fn after_dense_replan() {
    return_large_frees_to_the_os();
    release_freed_memory();
}

/// Hand the memory of freed expert buffers back to the system: glibc keeps freed blocks below
/// its mmap threshold in the heap; `malloc_trim(0)` returns their whole pages (`malloc_trim(3)`).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap memory; it is safe to call at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Tokens per prefill batch when streaming (bounds scratch memory).
pub const PREFILL_BATCH: usize = 32;

/// Scratch bytes a forward pass of `batch` tokens needs (activations, quantized copies, logits).
pub fn scratch_bytes(c: &Config, batch: usize) -> u64 {
    let ff = c.n_ff.max(c.n_ff_exp * c.n_expert_used).max(c.n_ff_shexp);
    let per_tok = 16 * c.n_embd + 6 * ff + c.n_expert_used * c.n_embd + c.n_expert;
    (8 << 20) + (batch * per_tok * 4) as u64 + (3 * c.n_vocab * 4) as u64
}

/// Split `slots` expert slots between a CPU staging cache and a GPU pool: staging holds the
/// routed experts of the layers the lookahead reaches (`n_expert_used` × (`depth` + 2)), at least
/// `n_expert_used + 1` and at most half; the GPU pool gets the rest (at least `n_expert_used + 1`,
/// which can exceed `slots` only at the model's minimum budget). Returns (cpu, gpu).
pub fn split_gpu_slots(slots: usize, n_expert_used: usize, depth: usize) -> (usize, usize) {
    let min = n_expert_used + 1;
    let cpu = (n_expert_used * (depth + 2)).min(slots / 2).max(min);
    (cpu, slots.saturating_sub(cpu).max(min))
}

/// Plan the budget: what is left after dense weights, KV cache and scratch becomes expert slots.
pub fn plan_budget(budget: u64, dense: u64, kv: u64, scratch: u64, expert_bytes_max: u64, total_expert_bytes: u64, min_slots: usize) -> Result<BudgetPlan, BudgetError> {
    let fixed = dense + kv + scratch;
    let minimum = fixed + min_slots as u64 * expert_bytes_max;
    if budget < minimum {
        return Err(BudgetError::TooSmall {
            budget,
            budget_mib: budget as f64 / 1048576.0,
            minimum,
            minimum_mib: minimum as f64 / 1048576.0,
            dense,
            kv,
            scratch,
            min_slots,
            slot: expert_bytes_max,
        });
    }
    let slots = ((budget - fixed) / expert_bytes_max.max(1)) as usize;
    Ok(BudgetPlan { budget, dense, kv, scratch, expert_bytes_max, slots, gpu_slots: 0, minimum, total_expert_bytes, dense_streamed: 0, dense_window: 0 })
}

/// Options for [`open_streaming`].
#[derive(Clone, Debug)]
pub struct StreamOptions {
    pub budget: u64,
    pub n_ctx: usize,
    /// Read experts with O_DIRECT (bypass the page cache).
    pub direct: bool,
    /// Throttle expert reads to a device profile. `open_streaming` first reads the file once
    /// through the page cache, so the modelled device, not the real disk, sets read times.
    #[cfg(not(target_arch = "wasm32"))]
    pub profile: Option<DeviceProfile>,
    /// Cache and scheduler settings (`slots` is replaced by the budget plan's).
    pub cache: StreamConfig,
    /// Use exactly this many expert slots instead of deriving them from `budget` (tests).
    pub slots: Option<usize>,
    /// The experts will be cached in a GPU slot pool (wgpu backend): the plan's expert slots are
    /// split into a small CPU staging cache (the scheduler's reads and prefetches land there) and
    /// the GPU pool (`BudgetPlan::gpu_slots`, the rest), so both together stay within the budget.
    pub gpu_pool: bool,
    /// When the budget cannot hold the dense weights: which may be read from storage instead.
    pub dense: DenseOptions,
}

/// Dense weights read from storage when the budget cannot hold them (CPU backend; see
/// [`plan_dense_streaming`]).
#[derive(Clone, Copy, Debug)]
pub struct DenseOptions {
    /// Allowed at all (native default; the wgpu backend needs its dense weights resident).
    pub stream: bool,
    /// Largest piece a streamed matrix is read in (bytes).
    pub piece: usize,
    /// Read-ahead window: streamed bytes held at most (the current piece and the next ones);
    /// at most a quarter of the bytes streamed each token.
    pub window: usize,
}

impl Default for DenseOptions {
    fn default() -> Self {
        Self { stream: cfg!(not(target_arch = "wasm32")), piece: 16 << 20, window: 64 << 20 }
    }
}

/// Dense matrices that can be read from storage at each use, in the order they are given up:
/// an untied `token_embd` first (only its rows are read, one per token), then the largest.
/// Only matrices the architectures load whole qualify (the hybrids' fused `attn_q` is split at
/// load, so it stays); routers stay (the lookahead predictor reads them every layer).
pub fn streamable_dense(g: &GgufFile, c: &Config) -> Vec<(String, u64)> {
    let tied = g.tensor("output.weight").is_none();
    let mut out: Vec<(String, u64)> = Vec::new();
    let mut rest: Vec<(String, u64)> = Vec::new();
    for t in &g.tensors {
        let n = t.name.as_str();
        let layer_mat = n.starts_with("blk.")
            && !c.is_nextn_tensor(n)
            && n.ends_with(".weight")
            && !n.contains("_exps")
            && t.dims.iter().filter(|&&d| d > 1).count() == 2
            && ["attn_k.", "attn_v.", "attn_output.", "attn_qkv.", "attn_gate.", "ssm_out.", "ffn_gate.", "ffn_up.", "ffn_down.", "ffn_gate_shexp.", "ffn_up_shexp.", "ffn_down_shexp."]
                .iter()
                .chain(if c.ssm.is_none() { &["attn_q."][..] } else { &[][..] })
                .any(|k| n.contains(&format!(".{k}")));
        if n == "token_embd.weight" && !tied {
            out.push((n.into(), t.size));
        } else if n == "output.weight" || (n == "token_embd.weight" && tied) || layer_mat {
            rest.push((n.into(), t.size));
        }
    }
    rest.sort_by_key(|r| std::cmp::Reverse(r.1));
    out.extend(rest);
    out
}

/// Dense matrices read from storage at each use ([`plan_dense_streaming`]).
#[derive(Clone, Debug, Default)]
pub struct DensePlan {
    pub names: std::collections::HashSet<String>,
    /// Their bytes (not held).
    pub streamed: u64,
    /// Read-ahead window (0 when only an untied `token_embd`'s rows are read) and piece size (at
    /// most half the window, so the reader can work on the next piece while one is in use).
    pub window: u64,
    pub piece: u64,
}

impl DensePlan {
    /// The first `take` of `cands` ([`streamable_dense`]): the window is a quarter of the bytes
    /// read in the forward's cycle, at most `o.window`.
    pub fn first(cands: &[(String, u64)], take: usize, o: &DenseOptions) -> Self {
        let untied = cands.iter().any(|c| c.0 == "output.weight");
        let mut p = DensePlan::default();
        let mut cycle = 0u64;
        for (n, size) in cands.iter().take(take) {
            if !(untied && n == "token_embd.weight") {
                cycle += size;
            }
            p.names.insert(n.clone());
            p.streamed += size;
        }
        p.window = (cycle / 4).min(o.window as u64);
        p.piece = (p.window / 2).min(o.piece as u64).max(1);
        p
    }

    /// Memory the read-ahead may hold: the window, plus one piece being read while a miss reads
    /// another.
    pub fn held(&self) -> u64 {
        if self.window == 0 {
            0
        } else {
            self.window + self.piece
        }
    }

    /// Dense bytes held with this plan, out of `dense`.
    pub fn resident(&self, dense: u64) -> u64 {
        dense.saturating_sub(self.streamed) + self.held()
    }
}

/// Which dense matrices to read from storage so that `budget` holds the rest, the KV cache,
/// scratch and `room.0` bytes of experts (the caller asks for two layers' routed experts: one
/// computing, one prefetched); as few as possible, since each streamed byte is read again every
/// token (but `token_embd`'s rows, one per token). When every candidate streamed still leaves
/// less than `room.0`, `room.1` (the minimum expert slots) is enough. `None` when nothing fits.
pub fn plan_dense_streaming(cands: &[(String, u64)], budget: u64, dense: u64, kv: u64, scratch: u64, room: (u64, u64), o: &DenseOptions) -> Option<DensePlan> {
    let fits = |p: &DensePlan, room: u64| p.resident(dense) + kv + scratch + room <= budget;
    let mut last = None;
    for take in 1..=cands.len() {
        let p = DensePlan::first(cands, take, o);
        if fits(&p, room.0) {
            return Some(p);
        }
        last = Some(p);
    }
    last.filter(|p| fits(p, room.1))
}

impl StreamOptions {
    /// A cache with a slot for every expert (a bundle read as if resident; the budget is the
    /// model's own size).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn every_expert(n_ctx: usize) -> Self {
        Self { budget: 0, n_ctx, direct: false, profile: None, cache: StreamConfig::default(), slots: Some(usize::MAX), gpu_pool: false, dense: DenseOptions::default() }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Budget(#[from] BudgetError),
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0} is not a MoE model (no experts to stream); run it without --memory-budget")]
    NotMoe(String),
}

/// A streaming session and its cache.
pub struct Streaming {
    pub session: Session,
    pub experts: Arc<StreamingExperts>,
    /// The plan at load ([`BudgetControl::plan`] follows later changes).
    pub plan: BudgetPlan,
    pub store_kind: &'static str,
    /// Changes the budget while the session runs.
    pub budget: BudgetControl,
}

/// A whole tensor dequantized to f32 (routers, norms).
pub fn tensor_f32(g: &GgufFile, src: &dyn ByteSource, name: &str) -> Result<Vec<f32>, OpenError> {
    let t = g.req_tensor(name).map_err(EngineError::from)?;
    let bytes = src.read_vec(t.offset, t.size as usize)?;
    let mut w = vec![0f32; t.n_elements() as usize];
    quant::dequantize_row(t.ty, &bytes, &mut w).map_err(|e| EngineError::Model(e.into()))?;
    Ok(w)
}

/// What a model's budget plan is made of (bytes), from its metadata and expert layouts only.
#[derive(Clone, Debug)]
pub struct Footprint {
    /// Every tensor but the stacked expert weights (gpt-oss's `_exps.bias` rows stay resident;
    /// an MTP block is not counted), plus the routers' f32 copies for the lookahead predictor.
    pub dense: u64,
    /// Scratch for a forward of [`PREFILL_BATCH`] tokens, plus the vocabulary on the host: each
    /// token string lives three times (the GGUF's parsed metadata, the tokenizer's list and its
    /// lookup table), each with 24-40 bytes of headers against ~16 bytes per entry in the file's
    /// metadata: about 6× the metadata's size (5.6 MB for a 201k-token vocabulary: 34 MB).
    pub scratch: u64,
    /// One expert's bytes (gate + up + down) per MoE layer, and the largest (a slot's size).
    pub expert_bytes: Vec<u64>,
    pub expert_bytes_max: u64,
    pub total_expert_bytes: u64,
    /// Slots the model needs at least: one layer's top-k + 1.
    pub min_slots: usize,
}

impl Footprint {
    pub fn new(g: &GgufFile, c: &Config, store: &dyn ExpertStore) -> Self {
        let routers = (c.n_moe_layers() * c.n_expert * c.n_embd * 4) as u64;
        let dense = g.tensors.iter().filter(|t| !t.name.contains("_exps.weight") && !c.is_nextn_tensor(&t.name)).map(|t| t.size).sum::<u64>() + routers;
        let expert_bytes: Vec<u64> = (0..store.n_layers()).map(|l| store.layout(l).bytes() as u64).collect();
        Self {
            dense,
            scratch: scratch_bytes(c, PREFILL_BATCH) + 6 * g.data_offset,
            expert_bytes_max: expert_bytes.iter().copied().max().unwrap_or(0),
            total_expert_bytes: expert_bytes.iter().map(|b| b * c.n_expert as u64).sum(),
            expert_bytes,
            min_slots: c.n_expert_used + 1,
        }
    }

    /// The least budget `opts` can open with (its context; reading dense matrices from
    /// storage when `opts.dense.stream` allows, as [`Self::plan`] would).
    pub fn minimum(&self, g: &GgufFile, c: &Config, opts: &StreamOptions) -> u64 {
        let kv = c.cache_bytes(opts.n_ctx.min(c.n_ctx_train.max(1))) as u64;
        let slots = self.min_slots as u64 * self.expert_bytes_max;
        let resident = self.dense + kv + self.scratch + slots;
        if !opts.dense.stream || opts.gpu_pool {
            return resident;
        }
        let cands = streamable_dense(g, c);
        let least = DensePlan::first(&cands, cands.len(), &opts.dense).resident(self.dense);
        resident.min(least + kv + self.scratch + slots)
    }

    /// The plan for `opts` (its budget, context, slot override, dense streaming and GPU pool
    /// settings): what the budget holds, and the dense matrices read from storage when it
    /// cannot hold them all (CPU backend). Refused below the minimum, which the error names.
    pub fn plan(&self, g: &GgufFile, c: &Config, opts: &StreamOptions) -> Result<(BudgetPlan, Option<DensePlan>), OpenError> {
        let (dense, scratch, max_e, total_e, min_slots) = (self.dense, self.scratch, self.expert_bytes_max, self.total_expert_bytes, self.min_slots);
        let kv = c.cache_bytes(opts.n_ctx.min(c.n_ctx_train.max(1))) as u64;
        if let Some(n) = opts.slots {
            let n = n.min(c.n_expert * c.n_moe_layers());
            let p = BudgetPlan { budget: dense + kv + scratch + n as u64 * max_e, dense, kv, scratch, expert_bytes_max: max_e, slots: n, gpu_slots: 0, minimum: dense + kv + scratch + min_slots as u64 * max_e, total_expert_bytes: total_e, dense_streamed: 0, dense_window: 0 };
            return Ok((p, None));
        }
        let e = match plan_budget(opts.budget, dense, kv, scratch, max_e, total_e, min_slots) {
            Ok(p) => return Ok((p, None)),
            Err(e) => e,
        };
        // Below the dense weights: read some of them from storage (CPU backend).
        let (room, min_room) = (2 * min_slots as u64 * max_e, min_slots as u64 * max_e);
        if !opts.dense.stream || opts.gpu_pool {
            return Err(e.into());
        }
        let cands = streamable_dense(g, c);
        let Some(d) = plan_dense_streaming(&cands, opts.budget, dense, kv, scratch, (room, min_room), &opts.dense) else {
            // Name the minimum with every candidate streamed.
            let least = DensePlan::first(&cands, cands.len(), &opts.dense).resident(dense);
            return Err(plan_budget(opts.budget, least, kv, scratch, max_e, total_e, min_slots).err().map(OpenError::from).unwrap_or(e.into()));
        };
        let mut p = plan_budget(opts.budget, d.resident(dense), kv, scratch, max_e, total_e, min_slots)?;
        (p.dense_streamed, p.dense_window) = (d.streamed, d.held());
        Ok((p, Some(d)))
    }
}

/// Under a budget, memory freed must leave the process: glibc's malloc raises its mmap threshold
/// to the size of each large block freed (up to 32 MiB), after which 16 MiB read buffers (dense
/// pieces, O_DIRECT bounce buffers) come from the heap and stay mapped once freed: with
/// gpt-oss-20b's shapes at 1 GiB that held ~125 MiB beyond the budget. A fixed 1 MiB threshold
/// keeps every large block an mmap of its own, unmapped on free (`mallopt(3)`, `M_MMAP_THRESHOLD`).
/// Called when dense weights are streamed (it changes the process's allocator: an embedding
/// host sees it too).
fn return_large_frees_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

/// Open `path` (a GGUF or a `.les` bundle) for streaming under `opts.budget`.
#[cfg(not(target_arch = "wasm32"))]
pub fn open_streaming(path: &str, opts: &StreamOptions) -> Result<Streaming, OpenError> {
    let file = if opts.direct { FileSource::open_direct(path)? } else { FileSource::open(path)? };
    if opts.profile.is_some() && !opts.direct {
        // The profile alone must set the timing: its reads come from the page cache.
        file.warm_page_cache()?;
    }
    let raw: Arc<dyn ByteSource> = Arc::new(file);
    let expert_src: Arc<dyn ByteSource> = match opts.profile {
        Some(p) => Arc::new(Throttled::new(raw.clone(), p)),
        None => raw.clone(),
    };
    // Dense weights are read once at load, without throttling.
    let dense_plain: Arc<dyn ByteSource> = Arc::new(FileSource::open(path)?);
    open_streaming_sources(raw, expert_src, dense_plain, path, opts)
}

/// As [`open_streaming`], from a copy of the file held in memory (`mem`, e.g. a
/// [`crate::store::MemSource`]; benchmarks: `les bench ladder`); a device profile throttles its
/// reads, O_DIRECT does not apply. The page cache is not a reliable stand-in for a profile's
/// source: proactive reclaim drops a file's pages between uses (these machines run DAMON's
/// `pageout` on unmapped file pages: a 1.6 GB model read at once kept ~97% of its pages for 30 s
/// and 4% after a few idle minutes), and each read that goes to the real disk adds its own time
/// to the modelled one. The copy costs the file's size in memory outside the budget, so peak
/// RSS is not the budget's here.
#[cfg(not(target_arch = "wasm32"))]
pub fn open_streaming_from_memory(mem: Arc<dyn ByteSource>, path: &str, opts: &StreamOptions) -> Result<Streaming, OpenError> {
    let expert_src: Arc<dyn ByteSource> = match opts.profile {
        Some(p) => Arc::new(Throttled::new(mem.clone(), p)),
        None => mem.clone(),
    };
    open_streaming_sources(mem.clone(), expert_src, mem, path, opts)
}

/// A MoE model's parts for streaming ([`open_parts`]).
pub struct Opened {
    /// The dense weights' bytes (read once at load), and the same read through the expert
    /// source's path (dense matrices the budget cannot hold: read at each use).
    pub dense_src: Arc<dyn ByteSource>,
    pub dense_stream_src: Arc<dyn ByteSource>,
    pub store: Arc<dyn ExpertStore>,
    /// "gguf" or "bundle".
    pub kind: &'static str,
    /// The dense part's metadata and its configuration.
    pub g: GgufFile,
    pub c: Config,
}

/// Open a GGUF or a `.les` bundle's parts: `raw` is the model, `expert_src` the same bytes as
/// experts are read (possibly throttled), `dense_plain` the same bytes for the one-time dense
/// load. A model without experts is refused ([`OpenError::NotMoe`], `path` names it).
pub fn open_parts(raw: Arc<dyn ByteSource>, expert_src: Arc<dyn ByteSource>, dense_plain: Arc<dyn ByteSource>, path: &str) -> Result<Opened, OpenError> {
    // Dense matrices the budget cannot hold are read through `expert_src` (the modelled device).
    let (dense_src, dense_stream_src, store, kind): (Arc<dyn ByteSource>, Arc<dyn ByteSource>, Arc<dyn ExpertStore>, &'static str) = if is_bundle(&*raw) {
        let b = Bundle::open(expert_src.clone())?;
        let dense: Arc<dyn ByteSource> = Arc::new(Bundle::open(dense_plain)?.dense_source());
        (dense, Arc::new(b.dense_source()), Arc::new(b.expert_store()), "bundle")
    } else {
        let g = GgufFile::read(&*dense_plain).map_err(EngineError::from)?;
        let c = Config::from_gguf(&g).map_err(|e| EngineError::Model(e.into()))?;
        if !c.is_moe() {
            return Err(OpenError::NotMoe(path.into()));
        }
        let tensors = (c.n_dense_lead..c.n_layer)
            .map(|il| GgufExpertTensors::find(&g, il, c.n_embd, c.n_expert))
            .collect::<Result<Vec<_>, _>>()
            .map_err(EngineError::from)?;
        (dense_plain.clone(), expert_src.clone(), Arc::new(GgufExpertStore::new(expert_src.clone(), tensors, c.n_expert)), "gguf")
    };
    let g = GgufFile::read(&*dense_src).map_err(EngineError::from)?;
    let c = Config::from_gguf(&g).map_err(|e| EngineError::Model(e.into()))?;
    if !c.is_moe() {
        return Err(OpenError::NotMoe(path.into()));
    }
    Ok(Opened { dense_src, dense_stream_src, store, kind, g, c })
}

/// [`open_streaming`] over byte sources (the browser's OPFS / HTTP range stores): `raw` is the
/// model (GGUF or bundle), `expert_src` the same bytes as experts are read (possibly throttled),
/// `dense_plain` the same bytes for the one-time dense load. `name` is used in errors.
pub fn open_streaming_sources(raw: Arc<dyn ByteSource>, expert_src: Arc<dyn ByteSource>, dense_plain: Arc<dyn ByteSource>, path: &str, opts: &StreamOptions) -> Result<Streaming, OpenError> {
    let Opened { dense_src, dense_stream_src, store, kind: store_kind, g, c } = open_parts(raw, expert_src, dense_plain, path)?;
    // Routers as f32 for the cross-layer predictor.
    // (The expert source numbers the MoE layers only: `Config::expert_layer`.)
    let moe_layers = c.n_dense_lead..c.n_layer;
    let routers = moe_layers.clone().map(|il| tensor_f32(&g, &*dense_src, &format!("blk.{il}.ffn_gate_inp.weight"))).collect::<Result<Vec<_>, _>>()?;
    let fp = Footprint::new(&g, &c, &*store);
    let min_slots = fp.min_slots;
    let n_ctx = opts.n_ctx.min(c.n_ctx_train.max(1));
    let (plan, dense_plan) = fp.plan(&g, &c, opts)?;
    let dense_streaming = dense_plan.map(|d| {
        return_large_frees_to_the_os();
        DenseStreaming { names: d.names, src: dense_stream_src.clone(), window: d.window as usize, piece: d.piece as usize }
    });
    let mut plan = plan;
    let mut cfg = opts.cache.clone();
    cfg.slots = plan.slots.max(min_slots).min(c.n_expert * c.n_moe_layers());
    if opts.gpu_pool {
        let (cpu, gpu) = split_gpu_slots(cfg.slots, c.n_expert_used, cfg.depth);
        cfg.slots = cpu;
        plan.gpu_slots = gpu;
    }
    // The FFN's input norm (the predictor applies it to hidden states): `post_attention_norm`
    // in the hybrid graphs and gpt-oss.
    let ffn_norm = if c.ssm.is_some() || c.arch == crate::model::Arch::GptOss { "post_attention_norm" } else { "ffn_norm" };
    // (smallthinker's router reads the layer's un-normed input: no norm to apply.)
    let norms = if c.routes_early() { Vec::new() } else { moe_layers.clone().map(|il| tensor_f32(&g, &*dense_src, &format!("blk.{il}.{ffn_norm}.weight"))).collect::<Result<Vec<_>, _>>()? };
    let router_b = moe_layers
        .map(|il| {
            let name = format!("blk.{il}.ffn_gate_inp.bias");
            if g.tensor(&name).is_some() { tensor_f32(&g, &*dense_src, &name) } else { Ok(Vec::new()) }
        })
        .collect::<Result<Vec<_>, _>>()?;
    let experts = Arc::new(StreamingExperts::new(store, routers, c.n_expert, c.n_expert_used, cfg).with_ffn_norms(norms).with_router_biases(router_b));
    let mut session = Session::load_streaming_dense(&*dense_src, ExpertMode::External(experts.clone()), n_ctx, PREFILL_BATCH, dense_streaming.as_ref())?;
    let mut budget = BudgetControl::new(experts.clone(), plan.clone());
    if opts.dense.stream && !opts.gpu_pool && opts.slots.is_none() {
        // The budget may re-plan the dense weights while the session runs.
        let streamed = dense_streaming.map(|d| d.names).unwrap_or_default();
        budget = budget.with_dense(streamable_dense(&g, &c), opts.dense, dense_stream_src, fp.dense, streamed, fp.minimum(&g, &c, opts));
    }
    session.budget_ctl = Some(budget.clone());
    super::reserve::set_reserve(super::reserve::reserve_for(opts.budget));
    Ok(Streaming { session, experts, plan, store_kind, budget })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_split_keeps_staging_small_and_the_sum_within_the_slots() {
        // 185 slots, top-2, lookahead depth 2: staging for 4 layers' routed experts (8), the rest
        // (177) on the GPU.
        assert_eq!(split_gpu_slots(185, 2, 2), (8, 177));
        // Few slots: staging is at most half, never below top-k + 1, and so is the GPU pool.
        assert_eq!(split_gpu_slots(10, 4, 2), (5, 5));
        assert_eq!(split_gpu_slots(5, 4, 2), (5, 5));
        for slots in 3..300 {
            for k in 1..9 {
                let (cpu, gpu) = split_gpu_slots(slots, k, 2);
                assert!(cpu > k && gpu > k, "{slots} slots, top-{k}: {cpu} + {gpu}");
                assert!(cpu + gpu <= slots || slots < 2 * (k + 1), "{slots} slots, top-{k}: {cpu} + {gpu}");
            }
        }
    }

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("400MiB").unwrap(), 400 << 20);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 1610612736);
        assert_eq!(parse_bytes("123").unwrap(), 123);
        assert_eq!(parse_bytes("2k").unwrap(), 2048);
        assert_eq!(parse_bytes("400MB").unwrap(), 400_000_000);
        assert!(parse_bytes("12 parsecs").is_err());
        assert!(parse_bytes("MiB").is_err());
    }

    #[test]
    fn budget_below_minimum_names_the_minimum() {
        let e = plan_budget(100, 50, 20, 10, 30, 300, 3).unwrap_err();
        let BudgetError::TooSmall { minimum, .. } = e else { panic!("{e}") };
        assert_eq!(minimum, 50 + 20 + 10 + 90);
        let p = plan_budget(1000, 50, 20, 10, 30, 300, 3).unwrap();
        assert_eq!(p.slots, (1000 - 80) / 30);
    }
}
