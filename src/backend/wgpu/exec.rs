//! [`Ops`] on the GPU: dense weights, the KV cache and activations in GPU buffers, experts in
//! the slot pool. Ops are recorded into one command buffer ([`Recorder`]) and run when it is
//! submitted; the only waits are [`Ops::read`] (router logits once per MoE layer, logits once per
//! forward). The forward pass itself is the architecture's, in `src/model/`.
//!
//! Activations live in pooled buffers (power-of-two size classes) that return to the pool when
//! their tensor is dropped: reusing a buffer inside one recording is safe because the commands
//! of a command buffer run in order.

use super::experts::{GpuExpertPool, PoolStats, SlotLayout};
use super::kernels::Kernels;
use super::kernels::{pair_words, BindCache, List};
use super::{GpuContext, GpuCounts, GpuError, GpuRates, Recorder};
use crate::backend::cpu::matmul::Weight;
use crate::backend::cpu::kv::StateEvent;
use crate::backend::cpu::ops::rope_cache_ext;
use crate::backend::rope::RopeKind;
use crate::backend::ops::{Attn, DeltaNet, ExpertFfn, Mat, OpError, Ops, Rope, Route, RouteSpec, Sigmoid, Vector, Weights};
use crate::clock::now_ms;
use crate::expert::{ExpertError, ExpertLayout, ExpertSource};
use crate::quant::{vec_dot_type, GgmlType};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// Tokens per GPU pass (longer inputs run in chunks).
pub const GPU_BATCH: usize = 32;

/// A weight matrix on the GPU, split by rows into parts that each fit one binding.
pub struct GpuWeight {
    pub ty: GgmlType,
    pub cols: usize,
    pub rows: usize,
    parts: Vec<(wgpu::Buffer, usize, usize)>,
}

impl GpuWeight {
    pub fn upload(ctx: &GpuContext, name: &str, w: &Weight) -> Result<Self, GpuError> {
        if !super::kernels::supports(w.ty) {
            return Err(GpuError::Unsupported(w.ty.name()));
        }
        let rb = w.ty.row_bytes(w.cols as u64).unwrap_or(0) as usize;
        let per = ((ctx.max_binding() as usize) / rb.max(1)).max(1);
        let mut parts = Vec::new();
        let mut r0 = 0;
        while r0 < w.rows {
            let n = per.min(w.rows - r0);
            parts.push((ctx.upload(name, &w.data[r0 * rb..(r0 + n) * rb])?, r0, n));
            r0 += n;
        }
        Ok(Self { ty: w.ty, cols: w.cols, rows: w.rows, parts })
    }
}

/// Quantized activations a forward keeps for reuse (the decode FFN input serves the router,
/// every routed expert's gate and up and the shared expert: quantized once per layer).
const QUANT_KEPT: usize = 4;

/// Options of the GPU backend.
#[derive(Clone, Debug, Default)]
pub struct GpuOptions {
    /// Expert slots on the GPU (default: every expert, at most 1 GiB of slots).
    pub expert_slots: Option<usize>,
    /// The exact path: every kernel computes the CPU backend's portable kernels' f32 results bit
    /// for bit (one thread per matvec row, sums in the CPU's order; see shaders/exact.wgsl), so
    /// logits equal the CPU's with `LES_NO_SIMD=1` (and on wasm32 and aarch64, where the portable
    /// kernels are the CPU backend). `None`: exact on CPU-type adapters (lavapipe, SwiftShader),
    /// where one thread per row is also the fastest; up to 64 threads per row (another summation
    /// order) on hardware GPUs.
    pub exact: Option<bool>,
    /// Route a decode token on the GPU when every expert of the layer is in a slot of one slab
    /// (shaders/route.wgsl: one submit and one readback per token). `None`: on hardware GPUs,
    /// off on software adapters (on lavapipe the one-invocation router took 68 ms per layer on
    /// rand-llama-moe's 8 experts, 0.1 ms on others: not understood yet); `LES_GPU_ROUTE=1` /
    /// `=0` override.
    pub device_routing: Option<bool>,
}

/// [`GpuOptions::device_routing`]'s default on this adapter.
fn default_device_routing(info: &wgpu::AdapterInfo) -> bool {
    match std::env::var("LES_GPU_ROUTE").ok().as_deref() {
        Some("1") => true,
        Some("0") => false,
        _ => info.device_type != wgpu::DeviceType::Cpu,
    }
}

/// Counters of the GPU forward (readbacks are the GPU→CPU synchronisations).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GpuStats {
    pub forwards: u64,
    /// Time spent waiting in readbacks (`counts.readbacks` of them).
    pub readback_ms: f64,
    /// Every call counted over all forwards (expert uploads included).
    pub counts: GpuCounts,
    /// Forwards of one row (decode tokens) and their calls: `decode` / `decode_forwards` is the
    /// per-token cost the cost model prices (`engine::gpu_cost`).
    pub decode_forwards: u64,
    pub decode: GpuCounts,
    /// `decode` per decode forward (as [`GpuStats::per_token`]), for JSON readers (the C ABI's
    /// `les_stats_json`, the browser's stats).
    pub per_token: GpuRates,
    /// Bind groups held for reuse.
    pub bind_groups_cached: usize,
    pub experts: PoolStats,
}

impl GpuStats {
    /// The calls of one decode token (mean over the decode forwards).
    pub fn per_token(&self) -> GpuRates {
        self.decode.per(self.decode_forwards)
    }
}

/// The shapes the backend allocates for: the KV cache and the routed experts.
#[derive(Clone, Copy, Debug)]
pub struct GpuShapes {
    /// Layers with routed experts (numbered as the expert source numbers them: the model's
    /// leading dense layers are not counted).
    pub n_moe_layer: usize,
    /// Layers with keys and values for every position (attention layers; a hybrid's recurrent
    /// layers hold none).
    pub kv_layers: usize,
    /// Sliding-window attention layers (gpt-oss's even layers): each a ring of `swa_cells`
    /// positions, position `p` in cell `p mod swa_cells`.
    pub swa_layers: usize,
    pub swa_cells: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// KV positions held on the GPU.
    pub n_ctx: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
}

type BufPool = Arc<Mutex<HashMap<u64, Vec<wgpu::Buffer>>>>;

/// The wgpu backend's state for one model: uploaded weights, KV cache, expert slots, scratch.
pub struct GpuBackend {
    pub ctx: Arc<GpuContext>,
    k: Kernels,
    /// Device copies of the model's matrices (`None`: used on the host only) and vectors,
    /// indexed as in [`Weights`].
    mats: Vec<Option<GpuWeight>>,
    vecs: Vec<(wgpu::Buffer, usize)>,
    kc: wgpu::Buffer,
    vc: wgpu::Buffer,
    /// The layer holding each KV slot, in the order layers first attended: `kc`/`vc` hold
    /// `kv_layers` slots of `n_ctx` positions, then `swa_layers` rings of `swa_cells`.
    kv_slots: Mutex<(Vec<usize>, Vec<usize>)>,
    kv_layers: usize,
    swa_layers: usize,
    swa_cells: usize,
    n_ctx: usize,
    arena: wgpu::Buffer,
    /// RoPE cos/sin tables per (n_rot, base and YaRN bits), rewritten by each forward.
    rope: Mutex<HashMap<(usize, u32), wgpu::Buffer>>,
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    probe: wgpu::Buffer,
    bufs: BufPool,
    pool: Arc<Mutex<Option<GpuExpertPool>>>,
    stats: Mutex<GpuStats>,
    /// Recurrent states of Gated DeltaNet layers (conv, delta rule), zeroed when first used, and
    /// their saved copies ([`StateEvent::Checkpoint`]).
    rs: Mutex<RecStates>,
    /// GELU's f16 table (ggml `ggml_table_gelu_f16`, made on the host), uploaded on first use.
    gelu_tab: std::sync::OnceLock<wgpu::Buffer>,
    /// Most rows in one forward ([`GPU_BATCH`] unless made [`Self::with_rows`]).
    max_rows: usize,
    /// The router's output on the device (route.wgsl): one 256-byte region per MoE layer.
    routes: wgpu::Buffer,
    n_expert: usize,
    /// Route decode tokens on the device where the pool allows ([`GpuOptions::device_routing`]).
    device_routing: bool,
}

/// Per layer: conv state and delta-rule state buffers, and the saved copy of each.
#[derive(Default)]
struct RecStates {
    conv: HashMap<usize, wgpu::Buffer>,
    ssm: HashMap<usize, wgpu::Buffer>,
    saved: HashMap<(bool, usize), wgpu::Buffer>,
}

/// Resizes a [`GpuBackend`]'s expert slot pool ([`GpuBackend::expert_pool`]). The forward holds
/// the pool's lock for each layer's experts, so a resize lands between layers.
#[derive(Clone)]
pub struct PoolHandle {
    pool: Arc<Mutex<Option<GpuExpertPool>>>,
    ctx: Arc<GpuContext>,
    /// Emptied on a resize: cached bind groups would keep dropped slabs alive.
    binds: BindCache,
}

impl PoolHandle {
    /// Slots now.
    pub fn slots(&self) -> usize {
        self.pool.lock().unwrap().as_ref().map(|p| p.n_slots()).unwrap_or(0)
    }
    /// Resize to `n` slots (at least 1); returns the count.
    pub fn set_slots(&self, n: usize) -> usize {
        let mut g = self.pool.lock().unwrap();
        match g.as_mut() {
            Some(p) => {
                // Resized slabs are new buffers: cached bind groups would keep the old ones alive.
                if n.max(1) != p.n_slots() {
                    self.binds.clear();
                }
                p.resize(&self.ctx, n);
                p.n_slots()
            }
            None => 0,
        }
    }
    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.pool.lock().unwrap().as_ref().map(|p| p.slot_bytes()).unwrap_or(0)
    }
}

impl GpuBackend {
    /// Upload `w`'s device matrices and vectors, make a KV cache of `s.n_ctx` positions and, for
    /// a MoE model, an expert slot pool fed by `experts`.
    pub fn new(ctx: Arc<GpuContext>, w: &Weights, s: GpuShapes, experts: Option<&Arc<dyn ExpertSource>>, opts: &GpuOptions) -> Result<Self, GpuError> {
        Self::with_rows(ctx, w, s, experts, opts, GPU_BATCH)
    }

    /// [`Self::new`] for forwards of up to `max_rows` rows (a vision tower's patches) instead of
    /// [`GPU_BATCH`] (the activation scratch grows with it).
    pub fn with_rows(ctx: Arc<GpuContext>, w: &Weights, s: GpuShapes, experts: Option<&Arc<dyn ExpertSource>>, opts: &GpuOptions, max_rows: usize) -> Result<Self, GpuError> {
        let max_rows = max_rows.max(1);
        if w.has_streamed() {
            return Err(GpuError::StreamedDense(w.streamed_bytes() >> 20));
        }
        let g = &*ctx;
        let mut k = Kernels::new(g);
        match opts.exact {
            Some(true) => k.max_tpr = 1,
            Some(false) if k.max_tpr == 1 => k.max_tpr = 64,
            _ => {}
        }
        let mut mats = Vec::with_capacity(w.mats().len());
        for (i, m) in w.mats().iter().enumerate() {
            mats.push(if w.host_only(i) { None } else { Some(GpuWeight::upload(g, &format!("mat-{i}"), m)?) });
        }
        let vecs = w.vecs().iter().enumerate().map(|(i, v)| Ok((g.upload(&format!("vec-{i}"), bytemuck::cast_slice(v))?, v.len()))).collect::<Result<Vec<_>, GpuError>>()?;
        let swa_cells = s.swa_cells.min(s.n_ctx);
        let kv_bytes = ((s.kv_layers * s.n_ctx + s.swa_layers * swa_cells) * s.n_head_kv * s.head_dim * 2).max(4);
        if kv_bytes as u64 > g.max_binding() {
            return Err(GpuError::Limit { what: format!("KV cache of {} positions (lower --ctx-size)", s.n_ctx), need: kv_bytes as u64, have: g.max_binding() });
        }
        let kc = g.scratch("kv-k", kv_bytes)?;
        let vc = g.scratch("kv-v", kv_bytes)?;
        let layouts: Vec<&ExpertLayout> = match experts {
            Some(src) => (0..s.n_moe_layer).map(|l| src.layout(l)).collect(),
            None => Vec::new(),
        };
        let arena = Recorder::arena_buffer(g);
        let pool = match experts {
            Some(src) => {
                let slot_bytes = layouts.iter().map(|l| SlotLayout::bytes_for(l)).max().unwrap_or(0);
                let all = s.n_moe_layer * s.n_expert;
                let n = opts.expert_slots.unwrap_or_else(|| all.min(((1usize << 30) / slot_bytes.max(1)).max(s.n_expert_used * 2)));
                let mut pool = GpuExpertPool::new(g, n.min(all), slot_bytes)?;
                pool.set_table(g, s.n_moe_layer, s.n_expert)?;
                src.set_holder(pool.held.clone());
                // A resident source whose experts all fit: every one in a slot now, so decode
                // tokens route on the device from the first (no readback per layer).
                if src.resident() && n >= all && all > 0 {
                    pool.fill(&mut Recorder::new(g, &arena), s.n_moe_layer, s.n_expert, &**src)?;
                }
                Some(pool)
            }
            None => None,
        };
        Ok(Self {
            k,
            mats,
            vecs,
            kc,
            vc,
            kv_slots: Mutex::new(Default::default()),
            kv_layers: s.kv_layers,
            swa_layers: s.swa_layers,
            swa_cells,
            n_ctx: s.n_ctx,
            arena,
            routes: g.scratch("routes", s.n_moe_layer * 256 + super::LIST_BYTES as usize)?,
            n_expert: s.n_expert,
            device_routing: opts.device_routing.unwrap_or_else(|| default_device_routing(&ctx.info)),
            rope: Mutex::new(HashMap::new()),
            probe: g.scratch("probe", 4)?,
            bufs: Default::default(),
            pool: Arc::new(Mutex::new(pool)),
            stats: Default::default(),
            rs: Default::default(),
            gelu_tab: Default::default(),
            max_rows,
            ctx,
        })
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// The adapter's name and backend, for reports.
    pub fn adapter_name(&self) -> String {
        format!("{} ({:?})", self.ctx.info.name, self.ctx.info.backend)
    }

    /// Bytes of the KV cache on the device (keys and values).
    pub fn kv_bytes(&self) -> u64 {
        self.kc.size() + self.vc.size()
    }

    /// Layer `il`'s KV slot as (offset in u32 words of `kc`/`vc`, cells per KV head): the next
    /// free one of its kind (a ring for a sliding-window layer) when it first attends; `None`
    /// when all are taken.
    fn kv_slot(&self, il: usize, windowed: bool, n_head_kv: usize, head_dim: usize) -> Option<(usize, usize)> {
        let mut g = self.kv_slots.lock().unwrap_or_else(|e| e.into_inner());
        let ring = windowed && self.swa_layers > 0;
        let (list, cap, cells, first) = if ring {
            (&mut g.1, self.swa_layers, self.swa_cells, self.kv_layers * self.n_ctx)
        } else {
            (&mut g.0, self.kv_layers, self.n_ctx, 0)
        };
        let i = match list.iter().position(|&l| l == il) {
            Some(i) => i,
            None if list.len() < cap => {
                list.push(il);
                list.len() - 1
            }
            None => return None,
        };
        Some(((first + i * cells) * n_head_kv * head_dim / 2, cells))
    }

    /// The kernel variants in use, for logs: the exact path or the parallel matvec reduction,
    /// and native or emulated f16 conversions.
    pub fn kernel_variant(&self) -> String {
        let red = if self.k.max_tpr == 1 {
            "exact (bit-identical to the CPU's portable kernels)".to_string()
        } else {
            format!("parallel (up to {} threads per row{})", self.k.max_tpr, if self.k.use_subgroups { ", subgroups" } else { "" })
        };
        format!("{red}, f16 {}", if self.k.uses_f16() { "native (shader-f16)" } else { "emulated" })
    }

    pub fn stats(&self) -> GpuStats {
        let mut s = self.stats.lock().unwrap().clone();
        s.bind_groups_cached = self.k.bind_cache.len();
        s.per_token = s.per_token();
        if let Some(p) = self.pool.lock().unwrap().as_ref() {
            s.experts = p.stats.clone();
        }
        s
    }

    /// The cost of one GPU→CPU synchronisation with nothing to wait for: mean ms of `n`
    /// 4-byte readbacks on an idle queue (the per-MoE-layer price of routing on the CPU).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn probe_sync_ms(&self, n: usize) -> Result<f64, GpuError> {
        let mut rec = Recorder::new(&self.ctx, &self.arena);
        super::block_on(rec.readback(&[(&self.probe, 0, 4)]))?;
        let t0 = now_ms();
        for _ in 0..n.max(1) {
            super::block_on(rec.readback(&[(&self.probe, 0, 4)]))?;
        }
        Ok((now_ms() - t0) / n.max(1) as f64)
    }

    /// Start the counters anew (after a warm-up, so what follows is the steady state).
    pub fn reset_stats(&self) {
        *self.stats.lock().unwrap() = GpuStats::default();
        if let Some(p) = self.pool.lock().unwrap().as_mut() {
            p.stats = Default::default();
        }
    }

    /// Put every expert of `src` (`n_layer` × `n_expert`) in a GPU slot now (a warm-up: every
    /// later token is a hit; [`GpuExpertPool::fill`]).
    pub fn preload_all(&self, src: &dyn ExpertSource, n_layer: usize, n_expert: usize) -> Result<(), GpuError> {
        match self.pool.lock().unwrap().as_mut() {
            Some(p) => p.fill(&mut Recorder::new(&self.ctx, &self.arena), n_layer, n_expert, src),
            None => Ok(()),
        }
    }

    pub fn expert_slots(&self) -> usize {
        self.pool.lock().unwrap().as_ref().map(|p| p.n_slots()).unwrap_or(0)
    }

    /// A handle that resizes the expert slot pool from any thread (a memory budget changed while
    /// the model runs); `None` without a pool.
    pub fn expert_pool(&self) -> Option<PoolHandle> {
        self.pool.lock().unwrap().is_some().then(|| PoolHandle { pool: self.pool.clone(), ctx: self.ctx.clone(), binds: self.k.bind_cache.clone() })
    }

    /// The most rows one forward takes.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// An executor for one forward pass of at most [`Self::max_rows`] rows.
    pub fn exec(&self) -> Result<GpuExec<'_>, GpuError> {
        self.ctx.check()?;
        // Every forward takes pooled buffers in the same order (each size class's free list
        // sorted), so equal forwards bind equal buffers and reuse the cached bind groups.
        for v in self.bufs.lock().unwrap().values_mut() {
            v.sort_unstable_by(|a, b| b.cmp(a));
        }
        Ok(GpuExec { g: self, rec: Recorder::new(&self.ctx, &self.arena), rb_ms: 0.0, rope_pos: Vec::new(), quant: Vec::new(), at_start: self.ctx.counts(), max_rows_seen: 0 })
    }
}

struct Pooled {
    buf: wgpu::Buffer,
    class: u64,
    pool: BufPool,
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pool.lock() {
            p.entry(self.class).or_default().push(self.buf.clone());
        }
    }
}

/// A GPU tensor: `rows × cols` f32 at the start of a pooled buffer. `version` names its
/// contents: new for every tensor and every op that writes it in place ([`Self::buf_mut`]), so
/// a quantized copy made for one version is never used for another.
pub struct GpuT {
    b: Pooled,
    rows: usize,
    cols: usize,
    version: u64,
}

static VERSIONS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn new_version() -> u64 {
    VERSIONS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl GpuT {
    fn buf(&self) -> &wgpu::Buffer {
        &self.b.buf
    }
    /// The buffer, for an op that writes it in place (the contents get a new version).
    fn buf_mut(&mut self) -> &wgpu::Buffer {
        self.version = new_version();
        &self.b.buf
    }
}

/// Rows of f32 activations to multiply: a tensor's version, its buffer and shape.
struct ActIn<'a> {
    x: &'a wgpu::Buffer,
    version: u64,
    cols: usize,
    n_tok: usize,
}

impl<'a> ActIn<'a> {
    fn new(t: &'a GpuT) -> Self {
        Self { x: t.buf(), version: t.version, cols: t.cols, n_tok: t.rows }
    }
}

/// Ask `src` for the routed experts of `union` not `held` in GPU slots and `run` each as it
/// arrives, after checking its shape against (n_embd, the layer's n_ff); the first error wins
/// (the source still hands over the rest: its reads are not wasted).
fn with_misses(il: usize, src: &dyn ExpertSource, union: &[u32], held: &[bool], (e, ff): (usize, Option<usize>), mut run: impl FnMut(u32, &crate::expert::ExpertBlock) -> Result<(), GpuError>) -> Result<(), OpError> {
    let mut err: Option<OpError> = None;
    let held_fn = |ex: u32| union.iter().position(|&u| u == ex).is_some_and(|i| held[i]);
    src.with_experts_except(il, union, &held_fn, &mut |ui, blk| {
        if err.is_some() {
            return;
        }
        let ex = union[ui];
        if blk.gate().cols != e || blk.down().rows != e || ff.is_some_and(|f| blk.layout.n_ff != f) {
            err = Some(ExpertError::Invalid { layer: il, expert: ex as usize, why: "expert shape does not match the layer's".into() }.into());
            return;
        }
        if let Err(er) = run(ex, blk) {
            err = Some(er.into());
        }
    })?;
    err.map_or(Ok(()), Err)
}

/// The lists one group of a decode token's experts runs from ([`GpuExec::run_group`]): `slots`
/// its `n` (slot offset, rank) pairs (gate, up and down), `gate_up` those followed by up's
/// (slot offset + up's offset, k + rank), `bias` its (rank, expert id) pairs.
struct GroupLists<'a> {
    slots: List<'a>,
    gate_up: List<'a>,
    bias: List<'a>,
    n: usize,
}

/// A decode token's per-rank rows of its routed experts: gate, up, activation, output.
struct DecodeRows {
    /// Gate rows (one per rank), then up rows.
    gu: GpuT,
    h: GpuT,
    ye: GpuT,
}

/// One forward pass's recording on the GPU.
pub struct GpuExec<'a> {
    g: &'a GpuBackend,
    rec: Recorder<'a>,
    rb_ms: f64,
    /// RoPE tables written in this forward: (n_rot, base and YaRN bits, pos0, rows).
    rope_pos: Vec<(usize, u32, usize, usize)>,
    /// Quantized activations kept for reuse: (tensor version, type, buffer), most recent last.
    quant: Vec<(u64, GgmlType, Pooled)>,
    /// The device's counters when this forward began.
    at_start: GpuCounts,
    /// The most rows of any input of this forward (1: a decode token).
    max_rows_seen: usize,
}

impl<'a> GpuExec<'a> {
    /// Mirror what the host did to the sequence's recurrent state since the last forward (save a
    /// copy, go back to it, zero it), recorded before this forward's ops.
    pub fn apply_state_events(&mut self, events: &[StateEvent]) -> Result<(), GpuError> {
        let mut rs = self.g.rs.lock().unwrap();
        let RecStates { conv, ssm, saved } = &mut *rs;
        for ev in events {
            for (is_conv, m) in [(true, &*conv), (false, &*ssm)] {
                for (&il, b) in m {
                    let key = (is_conv, il);
                    match ev {
                        StateEvent::Checkpoint => {
                            if !saved.contains_key(&key) {
                                saved.insert(key, self.g.ctx.scratch("recurrent-state-saved", b.size() as usize)?);
                            }
                            self.rec.encoder().copy_buffer_to_buffer(b, 0, &saved[&key], 0, b.size());
                        }
                        StateEvent::Restore => match saved.get(&key) {
                            Some(sv) => self.rec.encoder().copy_buffer_to_buffer(sv, 0, b, 0, b.size()),
                            None => self.rec.clear(b, 0, None),
                        },
                        StateEvent::Clear => self.rec.clear(b, 0, None),
                    }
                }
            }
        }
        Ok(())
    }

    /// Layer `il`'s conv (`conv`) or delta-rule state buffer of `len` f32, made zeroed on first use.
    fn state(&self, il: usize, conv: bool, len: usize) -> Result<wgpu::Buffer, GpuError> {
        let mut rs = self.g.rs.lock().unwrap();
        let m = if conv { &mut rs.conv } else { &mut rs.ssm };
        if let Some(b) = m.get(&il) {
            if b.size() as usize >= 4 * len {
                return Ok(b.clone());
            }
        }
        let b = self.g.ctx.scratch("recurrent-state", 4 * len)?;
        m.insert(il, b.clone());
        Ok(b)
    }

    /// Submit what is still recorded and add this forward's counters to the backend's.
    pub fn finish(mut self) -> Result<(), GpuError> {
        self.rec.submit();
        self.g.ctx.check()?;
        let counts = self.g.ctx.counts().since(self.at_start);
        let mut st = self.g.stats.lock().unwrap();
        st.forwards += 1;
        st.readback_ms += self.rb_ms;
        st.counts.add(counts);
        if self.max_rows_seen == 1 {
            st.decode_forwards += 1;
            st.decode.add(counts);
        }
        Ok(())
    }

    fn alloc(&self, rows: usize, cols: usize) -> Result<GpuT, GpuError> {
        Ok(GpuT { b: self.pooled((4 * rows * cols) as u64)?, rows, cols, version: new_version() })
    }

    /// A pooled buffer of at least `bytes` (power-of-two size classes).
    fn pooled(&self, bytes: u64) -> Result<Pooled, GpuError> {
        let bytes = bytes.max(4);
        let max = self.g.ctx.max_binding();
        let class = if bytes.next_power_of_two() <= max { bytes.next_power_of_two().max(256) } else { bytes };
        let reused = self.g.bufs.lock().unwrap().get_mut(&class).and_then(|v| v.pop());
        let buf = match reused {
            Some(b) => b,
            None => self.g.ctx.scratch("activation", class as usize)?,
        };
        Ok(Pooled { buf, class, pool: self.g.bufs.clone() })
    }

    fn mat(&self, m: Mat) -> Result<&'a GpuWeight, GpuError> {
        self.g.mats.get(Weights::mat_index(m)).and_then(|w| w.as_ref()).ok_or_else(|| GpuError::Validation("matrix not on the device".into()))
    }

    fn vec(&self, v: Vector) -> &'a wgpu::Buffer {
        &self.g.vecs[Weights::vec_index(v)].0
    }

    /// y = W · a for every part of W (rows split across buffers).
    fn mm(&mut self, w: &GpuWeight, a: &ActIn<'_>, y: &wgpu::Buffer, y_stride: usize) -> Result<(), GpuError> {
        let abuf = self.act_for(w.ty, a)?;
        for (buf, r0, n) in &w.parts {
            self.g.k.matvec(&mut self.rec, w.ty, w.cols, *n, buf, 0, &abuf, 0, y, *r0, y_stride, a.n_tok)?;
        }
        Ok(())
    }

    /// The activation rows converted to `wty`'s vec_dot_type: made once per tensor version and
    /// type while it is among the last [`QUANT_KEPT`] conversions of this forward.
    fn act_for(&mut self, wty: GgmlType, a: &ActIn<'_>) -> Result<wgpu::Buffer, GpuError> {
        let vty = vec_dot_type(wty);
        if vty == GgmlType::F32 {
            return Ok(a.x.clone());
        }
        if let Some(i) = self.quant.iter().position(|q| q.0 == a.version && q.1 == vty) {
            let q = self.quant.remove(i);
            let b = q.2.buf.clone();
            self.quant.push(q);
            return Ok(b);
        }
        let row = vty.row_bytes(a.cols as u64).ok_or(GpuError::Unsupported(vty.name()))?;
        let out = self.pooled(row * a.n_tok as u64 + 4)?;
        self.g.k.quant_act(&mut self.rec, vty, a.x, 0, a.cols, a.n_tok, &out.buf, 0)?;
        let b = out.buf.clone();
        if self.quant.len() >= QUANT_KEPT {
            self.quant.remove(0);
        }
        self.quant.push((a.version, vty, out));
        Ok(b)
    }

    /// One routed expert (in GPU slot `slot`): gather its tokens' rows, SwiGLU FFN from the slot,
    /// scatter the outputs times the router weights into their (token, rank) rows of `per`.
    #[allow(clippy::too_many_arguments)]
    fn run_expert(&mut self, (buf, base): (&wgpu::Buffer, u64), layout: &ExpertLayout, x: &GpuT, per: &GpuT, ex: u32, r: &Route<'_>, f: &ExpertFfn) -> Result<(), GpuError> {
        let (e, t_n, kk) = (x.cols, x.rows, r.k);
        let mut lay = SlotLayout::of_layout(layout);
        (lay.gate, lay.up, lay.down) = (base + lay.gate, base + lay.up, base + lay.down);
        let slots: Vec<u32> = (0..t_n * kk).filter(|&i| r.sel[i] == ex).map(|i| i as u32).collect();
        let toks: Vec<u32> = slots.iter().map(|&i| i / kk as u32).collect();
        let w: Vec<f32> = slots.iter().map(|&i| r.wts[i as usize]).collect();
        let n = slots.len();
        let gathered;
        let xin = if t_n == 1 {
            x
        } else {
            gathered = self.alloc(n, e)?;
            self.g.k.gather(&mut self.rec, x.buf(), gathered.buf(), e, &toks)?;
            &gathered
        };
        let ff = layout.n_ff;
        let (g, u, h, ye) = (self.alloc(n, ff)?, self.alloc(n, ff)?, self.alloc(n, ff)?, self.alloc(n, e)?);
        let a = ActIn::new(xin);
        let ab = self.act_for(layout.gate_ty, &a)?;
        self.g.k.matvec(&mut self.rec, layout.gate_ty, e, ff, buf, lay.gate, &ab, 0, g.buf(), 0, ff, n)?;
        let ab = self.act_for(layout.up_ty, &a)?;
        self.g.k.matvec(&mut self.rec, layout.up_ty, e, ff, buf, lay.up, &ab, 0, u.buf(), 0, ff, n)?;
        let ex_at = ex as usize;
        if let Some([bg, bu, _]) = f.bias {
            // ggml `add_id`: expert ex's bias row added to each of its rows.
            let (bg, bu) = (self.vec(bg), self.vec(bu));
            self.g.k.add(&mut self.rec, bg, ex_at * ff, g.buf(), 0, n * ff, ff);
            self.g.k.add(&mut self.rec, bu, ex_at * ff, u.buf(), 0, n * ff, ff);
        }
        self.g.k.glu(&mut self.rec, g.buf(), u.buf(), 0, h.buf(), n * ff, f.act);
        let a = ActIn::new(&h);
        let ab = self.act_for(layout.down_ty, &a)?;
        self.g.k.matvec(&mut self.rec, layout.down_ty, ff, e, buf, lay.down, &ab, 0, ye.buf(), 0, e, n)?;
        if let Some([_, _, bd]) = f.bias {
            let bd = self.vec(bd);
            self.g.k.add(&mut self.rec, bd, ex_at * e, ye.buf(), 0, n * e, e);
        }
        self.g.k.scatter(&mut self.rec, ye.buf(), per.buf(), e, &slots, &w)?;
        Ok(())
    }

    /// A decode token's routed experts, `mul_mat_id`-style: those held in GPU slots run first,
    /// one group per slab (gate, up, activation, down of every expert of the group in one
    /// dispatch each; [`Kernels::matvec_id`]), then each miss as its source hands it over; the
    /// outputs, one row per rank, weighted and combined in rank order ([`Kernels::combine_w`]),
    /// so the result never depends on which experts were held.
    fn experts_decode(&mut self, il: usize, src: &dyn ExpertSource, x: &GpuT, r: Route<'_>, f: &ExpertFfn) -> Result<GpuT, OpError> {
        let (e, k) = (x.cols, r.k);
        let ff = src.layout(il).n_ff;
        let mut rows = DecodeRows { gu: self.alloc(2 * k, ff)?, h: self.alloc(k, ff)?, ye: self.alloc(k, e)? };
        let union = r.union();
        let rank_of = |ex: u32| r.sel[..k].iter().position(|&s| s == ex).unwrap_or(0) as u32;
        let g: &GpuBackend = self.g;
        let mut pool_g = g.pool.lock().unwrap();
        let pool = pool_g.as_mut().ok_or(GpuError::Validation("no expert pool".into()))?;
        let held: Vec<bool> = union.iter().map(|&ex| pool.holds(il, ex as usize)).collect();
        // (slab, layout, [(slot offset, rank)], [(rank, expert)])
        let mut groups: Vec<(usize, ExpertLayout, Vec<(u32, u32)>, Vec<(u32, u32)>)> = Vec::new();
        for (ui, &ex) in union.iter().enumerate() {
            if held[ui] {
                let (slot, lay) = pool.hit(&self.rec, il, ex as usize).ok_or(GpuError::Validation("slot vanished".into()))?;
                let (_, slab, base) = pool.buffer(slot);
                let rank = rank_of(ex);
                match groups.iter_mut().find(|gr| gr.0 == slab && gr.1 == lay) {
                    Some(gr) => {
                        gr.2.push((base as u32, rank));
                        gr.3.push((rank, ex));
                    }
                    None => groups.push((slab, lay, vec![(base as u32, rank)], vec![(rank, ex)])),
                }
            }
        }
        for (slab, lay, list, pairs) in &groups {
            self.run_group_host(pool.slab(*slab), lay, x, &mut rows, list, pairs, f)?;
        }
        with_misses(il, src, &union, &held, (e, Some(ff)), |ex, blk| {
            let rank = rank_of(ex);
            let slot = pool.ensure(&mut self.rec, il, ex as usize, blk, &|l, x| src.retention(l, x))?;
            let (b, _, base) = pool.buffer(slot);
            self.run_group_host(b, &blk.layout, x, &mut rows, &[(base as u32, rank)], &[(rank, ex)], f)
        })?;
        drop(pool_g);
        let out = self.alloc(1, e)?;
        let w: Vec<u32> = r.wts[..k].iter().map(|v| v.to_bits()).collect();
        self.g.k.combine_w(&mut self.rec, rows.ye.buf(), out.buf(), e, List::Host(&w), k)?;
        Ok(out)
    }

    /// Experts of one slab for a decode token ([`GroupLists`]): gate and up from the token's FFN
    /// input (quantized once per layer; one dispatch for both where their types agree), the
    /// activation over all k rows (rows of other groups are recomputed by their own group, from
    /// their own gate and up), down into the ranks' rows of `ye`.
    fn run_group(&mut self, slab: &wgpu::Buffer, layout: &ExpertLayout, x: &GpuT, rows: &mut DecodeRows, lists: &GroupLists<'_>, f: &ExpertFfn) -> Result<(), GpuError> {
        let (e, ff, k, n) = (x.cols, layout.n_ff, rows.h.rows, lists.n);
        let lay = SlotLayout::of_layout(layout);
        let kk = &self.g.k;
        let a = ActIn::new(x);
        let ab = self.act_for(layout.gate_ty, &a)?;
        let gu = rows.gu.buf().clone();
        if layout.gate_ty == layout.up_ty {
            kk.matvec_id(&mut self.rec, layout.gate_ty, e, ff, slab, lay.gate, &ab, false, &gu, 0, ff, lists.gate_up, 2 * n)?;
        } else {
            kk.matvec_id(&mut self.rec, layout.gate_ty, e, ff, slab, lay.gate, &ab, false, &gu, 0, ff, lists.slots, n)?;
            let ab = self.act_for(layout.up_ty, &a)?;
            kk.matvec_id(&mut self.rec, layout.up_ty, e, ff, slab, lay.up, &ab, false, &gu, k * ff, ff, lists.slots, n)?;
        }
        if let Some([bg, bu, _]) = f.bias {
            // ggml `add_id`: each expert's bias row added to its own rows.
            let (bg, bu) = (self.vec(bg), self.vec(bu));
            kk.add_rows(&mut self.rec, bg, &gu, 0, ff, lists.bias, n)?;
            kk.add_rows(&mut self.rec, bu, &gu, k * ff, ff, lists.bias, n)?;
        }
        let h = rows.h.buf_mut().clone();
        kk.glu(&mut self.rec, &gu, &gu, k * ff, &h, k * ff, f.act);
        let a = ActIn::new(&rows.h);
        let ab = self.act_for(layout.down_ty, &a)?;
        kk.matvec_id(&mut self.rec, layout.down_ty, ff, e, slab, lay.down, &ab, true, rows.ye.buf(), 0, e, lists.slots, n)?;
        if let Some([_, _, bd]) = f.bias {
            let bd = self.vec(bd);
            kk.add_rows(&mut self.rec, bd, rows.ye.buf(), 0, e, lists.bias, n)?;
        }
        Ok(())
    }

    /// [`Self::run_group`] for `n` experts listed by the host: `slots` their (slot offset, rank),
    /// `pairs` their (rank, expert id).
    #[allow(clippy::too_many_arguments)]
    fn run_group_host(&mut self, slab: &wgpu::Buffer, layout: &ExpertLayout, x: &GpuT, rows: &mut DecodeRows, slots: &[(u32, u32)], pairs: &[(u32, u32)], f: &ExpertFfn) -> Result<(), GpuError> {
        let (k, up) = (rows.h.rows as u32, (SlotLayout::of_layout(layout).up - SlotLayout::of_layout(layout).gate) as u32);
        let down = pair_words(slots);
        let gate_up: Vec<u32> = down.iter().copied().chain(pair_words(&slots.iter().map(|&(b, r)| (b + up, k + r)).collect::<Vec<_>>())).collect();
        let bias = pair_words(pairs);
        let lists = GroupLists { slots: List::Host(&down), gate_up: List::Host(&gate_up), bias: List::Host(&bias), n: slots.len() };
        self.run_group(slab, layout, x, rows, &lists, f)
    }
}

impl Ops for GpuExec<'_> {
    const BACKEND: &'static str = "wgpu";
    type T = GpuT;

    fn shape(t: &GpuT) -> (usize, usize) {
        (t.rows, t.cols)
    }

    fn input(&mut self, x: Vec<f32>, cols: usize) -> Result<GpuT, OpError> {
        let rows = x.len() / cols.max(1);
        if rows > self.g.max_rows {
            return Err(GpuError::Validation(format!("{rows} rows in one GPU forward (at most {})", self.g.max_rows)).into());
        }
        // `write_buffer` lands before the next submit: recorded commands that still use a
        // pooled buffer must run first.
        self.rec.submit();
        self.max_rows_seen = self.max_rows_seen.max(rows);
        let t = self.alloc(rows, cols)?;
        self.g.ctx.write(t.buf(), 0, bytemuck::cast_slice(&x));
        Ok(t)
    }

    fn rms_norm(&mut self, x: &GpuT, w: Vector, eps: f32) -> Result<GpuT, OpError> {
        let y = self.alloc(x.rows, x.cols)?;
        let wb = self.vec(w);
        self.g.k.rms_norm(&mut self.rec, x.buf(), 0, wb, x.cols, x.rows, eps, Some((y.buf(), 0)));
        Ok(y)
    }

    fn rms_norm_groups(&mut self, x: &mut GpuT, w: Vector, eps: f32) -> Result<(), OpError> {
        let n = self.g.vecs[Weights::vec_index(w)].1.max(1);
        let wb = self.vec(w);
        let rows = x.rows * x.cols / n;
        self.g.k.rms_norm(&mut self.rec, x.buf_mut(), 0, wb, n, rows, eps, None);
        Ok(())
    }

    fn matmul(&mut self, x: &GpuT, ws: &[Mat]) -> Result<Vec<GpuT>, OpError> {
        let a = ActIn::new(x);
        let mut out = Vec::with_capacity(ws.len());
        for &m in ws {
            let w = self.mat(m)?;
            let y = self.alloc(x.rows, w.rows)?;
            self.mm(w, &a, y.buf(), w.rows)?;
            out.push(y);
        }
        Ok(out)
    }

    fn add_row(&mut self, x: &mut GpuT, b: Vector) -> Result<(), OpError> {
        let bb = self.vec(b);
        let (n, cols) = (x.rows * x.cols, x.cols);
        self.g.k.add(&mut self.rec, bb, 0, x.buf_mut(), 0, n, cols);
        Ok(())
    }

    fn add(&mut self, x: &mut GpuT, y: &GpuT) -> Result<(), OpError> {
        let n = x.rows * x.cols;
        self.g.k.add(&mut self.rec, y.buf(), 0, x.buf_mut(), 0, n, 0);
        Ok(())
    }

    fn rope(&mut self, x: &mut GpuT, pos0: usize, p: &Rope) -> Result<(), OpError> {
        // The table's identity: n_rot and the bits of base and YaRN (FNV-1a over them).
        let bits = [p.base.to_bits()].into_iter().chain(p.yarn.iter().flat_map(|y| [y.freq_scale.to_bits(), y.ext_factor.to_bits(), y.attn_factor.to_bits(), y.beta_fast.to_bits(), y.beta_slow.to_bits(), y.n_ctx_orig as u32]));
        let id = if p.yarn.is_none() { p.base.to_bits() } else { bits.fold(0x811c_9dc5u32, |h, b| (h ^ b).wrapping_mul(0x0100_0193)) };
        let key = (p.n_rot, id);
        let mut tabs = self.g.rope.lock().unwrap();
        if !tabs.contains_key(&key) {
            tabs.insert(key, self.g.ctx.scratch("rope-cs", 4 * GPU_BATCH * p.n_rot.max(2))?);
        }
        let cs = tabs[&key].clone();
        drop(tabs);
        if !self.rope_pos.contains(&(key.0, key.1, pos0, x.rows)) {
            // Made on the CPU, exactly as the CPU backend makes them. The table's readers so
            // far must run before it is rewritten (`write_buffer` lands before the next submit).
            if self.rope_pos.iter().any(|r| (r.0, r.1) == key) {
                self.rec.submit();
            }
            let mut all = Vec::with_capacity(x.rows * p.n_rot);
            let mut one = Vec::new();
            for t in 0..x.rows {
                rope_cache_ext(pos0 + t, p.n_rot, p.base, p.yarn.as_ref(), &mut one);
                all.extend_from_slice(&one);
            }
            if !all.is_empty() {
                self.g.ctx.write(&cs, 0, bytemuck::cast_slice(&all));
            }
            self.rope_pos.push((key.0, key.1, pos0, x.rows));
        }
        let (n_head, rows) = (x.cols / p.head_dim, x.rows);
        self.g.k.rope(&mut self.rec, x.buf_mut(), 0, &cs, n_head, p.head_dim, p.n_rot, p.kind == RopeKind::Neox, rows);
        Ok(())
    }

    fn attention(&mut self, il: usize, q: &GpuT, k: &GpuT, v: &GpuT, pos0: usize, p: &Attn) -> Result<GpuT, OpError> {
        let t_n = q.rows;
        let n_ctx = self.g.n_ctx;
        let o = self.alloc(t_n, q.cols)?;
        // One more column per row: the sink's factor.
        let scores = self.alloc(t_n * p.n_head, n_ctx + 1)?;
        let sinks = p.sinks.map(|v| self.vec(v));
        let (off, cells) = self.g.kv_slot(il, p.window > 0, p.n_head_kv, p.head_dim).ok_or(OpError::NoKv(il))?;
        // A ring holds the window of the batch's first query and every row after it.
        if cells < n_ctx && p.window + t_n > cells + 1 {
            return Err(OpError::Unsupported { backend: "wgpu", op: "a batch larger than a sliding-window layer's ring" });
        }
        let kk = &self.g.k;
        kk.kv_store(&mut self.rec, k.buf(), v.buf(), &self.g.kc, &self.g.vc, p.n_head_kv, p.head_dim, cells, off, pos0, t_n);
        kk.attention(&mut self.rec, q.buf(), &self.g.kc, &self.g.vc, o.buf(), scores.buf(), p.n_head, p.n_head_kv, p.head_dim, cells, off, pos0, t_n, p.scale, p.window, sinks);
        Ok(o)
    }

    fn swiglu(&mut self, g: &GpuT, u: &GpuT) -> Result<GpuT, OpError> {
        let h = self.alloc(g.rows, g.cols)?;
        self.g.k.swiglu(&mut self.rec, g.buf(), u.buf(), h.buf(), g.rows * g.cols);
        Ok(h)
    }

    fn gate_add(&mut self, x: &mut GpuT, y: &GpuT, g: &GpuT, f: Sigmoid) -> Result<(), OpError> {
        let (cols, rows) = (x.cols, x.rows);
        self.g.k.gate_add(&mut self.rec, y.buf(), g.buf(), x.buf_mut(), cols, rows, f == Sigmoid::Exp);
        Ok(())
    }

    fn mul_sigmoid(&mut self, x: &mut GpuT, g: &GpuT) -> Result<(), OpError> {
        let n = x.rows * x.cols;
        self.g.k.mul_sigmoid(&mut self.rec, g.buf(), x.buf_mut(), n);
        Ok(())
    }

    fn mul(&mut self, x: &mut GpuT, y: &GpuT) -> Result<(), OpError> {
        let n = x.rows * x.cols;
        self.g.k.mul(&mut self.rec, y.buf(), x.buf_mut(), n);
        Ok(())
    }

    fn ssm_conv(&mut self, il: usize, x: &GpuT, w: Vector, d_conv: usize, silu: bool) -> Result<GpuT, OpError> {
        let st = self.state(il, true, x.cols * (d_conv - 1))?;
        let y = self.alloc(x.rows, x.cols)?;
        let wb = self.vec(w);
        self.g.k.ssm_conv(&mut self.rec, x.buf(), wb, &st, y.buf(), x.cols, d_conv, x.rows, silu);
        Ok(y)
    }

    fn delta_net(&mut self, il: usize, x: &mut GpuT, alpha: &GpuT, beta: &GpuT, p: &DeltaNet) -> Result<GpuT, OpError> {
        let (hv, s) = (p.dt_rank, p.d_state);
        if s > 1024 || x.cols != (2 * p.n_group + hv) * s {
            return Err(OpError::NoState(il));
        }
        let st = self.state(il, false, hv * s * s)?;
        let y = self.alloc(x.rows, hv * s)?;
        let (dt, a) = (self.vec(p.dt_bias), self.vec(p.a));
        let rows = x.rows;
        self.g.k.delta_net(&mut self.rec, x.buf_mut(), alpha.buf(), beta.buf(), dt, a, &st, y.buf(), rows, p.n_group, hv, s, p.tiled, p.eps);
        Ok(y)
    }

    fn norm_gated(&mut self, x: &mut GpuT, w: Vector, z: &GpuT, eps: f32) -> Result<(), OpError> {
        self.rms_norm_groups(x, w, eps)?;
        let n = x.rows * x.cols;
        self.g.k.mul_silu(&mut self.rec, z.buf(), x.buf_mut(), n);
        Ok(())
    }

    fn layer_norm(&mut self, x: &GpuT, w: Vector, b: Option<Vector>, eps: f32) -> Result<GpuT, OpError> {
        let y = self.alloc(x.rows, x.cols)?;
        let (wb, bb) = (self.vec(w), b.map(|b| self.vec(b)));
        self.g.k.layer_norm(&mut self.rec, x.buf(), wb, bb, y.buf(), x.cols, x.rows, eps);
        Ok(y)
    }

    fn gelu(&mut self, x: &mut GpuT, kind: crate::backend::ops::Gelu) -> Result<(), OpError> {
        let tab = match kind {
            crate::backend::ops::Gelu::Tanh => {
                if self.g.gelu_tab.get().is_none() {
                    let t = crate::backend::cpu::ops::gelu_tanh_table();
                    let buf = self.g.ctx.scratch("gelu-f16", 2 * t.len())?;
                    self.g.ctx.write(&buf, 0, bytemuck::cast_slice(&t));
                    let _ = self.g.gelu_tab.set(buf);
                }
                self.g.gelu_tab.get()
            }
            crate::backend::ops::Gelu::Erf => None,
        };
        let n = x.rows * x.cols;
        self.g.k.gelu(&mut self.rec, x.buf_mut(), n, tab);
        Ok(())
    }

    fn self_attention(&mut self, q: &GpuT, k: &GpuT, v: &GpuT, p: &crate::backend::ops::SelfAttn) -> Result<GpuT, OpError> {
        let (n, cols, hd, nh) = (q.rows, q.cols, p.head_dim, p.n_head);
        if cols != nh * hd || k.cols != cols || v.cols != cols || k.rows != n || v.rows != n || hd % 2 != 0 || (p.block > 0 && n % p.block != 0) {
            return Err(OpError::Unsupported { backend: "wgpu", op: "self_attention with these shapes" });
        }
        // K and V as an f16 cache of one layer and n positions, then the cache attention kernel
        // with blocks instead of the causal mask.
        let (kc, vc) = (self.alloc(n, cols / 2)?, self.alloc(n, cols / 2)?);
        let scores = self.alloc(n * nh, n + 1)?;
        let o = self.alloc(n, cols)?;
        let kk = &self.g.k;
        kk.kv_store(&mut self.rec, k.buf(), v.buf(), kc.buf(), vc.buf(), nh, hd, n, 0, 0, n);
        let block = if p.block > 0 { p.block } else { n };
        kk.attention_blocks(&mut self.rec, q.buf(), kc.buf(), vc.buf(), o.buf(), scores.buf(), [nh, nh, hd, n, 0, 0, n], p.scale, 0, None, block);
        Ok(o)
    }

    fn gather_rows(&mut self, x: &GpuT, idx: &[u32]) -> Result<GpuT, OpError> {
        if idx.iter().any(|&i| i as usize >= x.rows) {
            return Err(OpError::Unsupported { backend: "wgpu", op: "gather_rows with an index past the rows" });
        }
        let y = self.alloc(idx.len(), x.cols)?;
        self.g.k.gather(&mut self.rec, x.buf(), y.buf(), x.cols, idx)?;
        Ok(y)
    }

    fn concat_cols(&mut self, xs: &[&GpuT]) -> Result<GpuT, OpError> {
        let rows = xs.first().map(|x| x.rows).unwrap_or(0);
        if xs.iter().any(|x| x.rows != rows) {
            return Err(OpError::Unsupported { backend: "wgpu", op: "concat_cols of unequal row counts" });
        }
        let k: usize = xs.iter().map(|x| x.cols).sum();
        let y = self.alloc(rows, k)?;
        let mut c0 = 0;
        for x in xs {
            self.g.k.place(&mut self.rec, x.buf(), y.buf(), x.cols, rows, k, c0);
            c0 += x.cols;
        }
        Ok(y)
    }

    fn scale(&mut self, x: &mut GpuT, s: f32) -> Result<(), OpError> {
        let n = x.rows * x.cols;
        self.g.k.scale(&mut self.rec, x.buf_mut(), n, s);
        Ok(())
    }

    fn last_row(&mut self, x: GpuT) -> Result<GpuT, OpError> {
        if x.rows <= 1 {
            return Ok(x);
        }
        let y = self.alloc(1, x.cols)?;
        let row = (4 * x.cols) as u64;
        self.rec.encoder().copy_buffer_to_buffer(x.buf(), (x.rows as u64 - 1) * row, y.buf(), 0, row);
        Ok(y)
    }

    fn experts(&mut self, il: usize, src: &dyn ExpertSource, x: &GpuT, r: Route<'_>, f: &ExpertFfn, _partial: Option<&GpuT>) -> Result<GpuT, OpError> {
        let (e, t_n) = (x.cols, x.rows);
        if t_n == 1 {
            return self.experts_decode(il, src, x, r, f);
        }
        let union = r.union();
        let per = self.alloc(t_n * r.k, e)?;
        let g: &GpuBackend = self.g;
        let mut pool_g = g.pool.lock().unwrap();
        let pool = pool_g.as_mut().ok_or(GpuError::Validation("no expert pool".into()))?;
        // Experts already in GPU slots run first; the expert source is asked only for the others
        // (it counts the held ones as hits and keeps predicting).
        let held: Vec<bool> = union.iter().map(|&ex| pool.holds(il, ex as usize)).collect();
        for (ui, &ex) in union.iter().enumerate() {
            if held[ui] {
                let (slot, lay) = pool.hit(&self.rec, il, ex as usize).ok_or(GpuError::Validation("slot vanished".into()))?;
                let (b, _, base) = pool.buffer(slot);
                self.run_expert((b, base), &lay, x, &per, ex, &r, f)?;
            }
        }
        with_misses(il, src, &union, &held, (e, None), |ex, blk| {
            let slot = pool.ensure(&mut self.rec, il, ex as usize, blk, &|l, x| src.retention(l, x))?;
            let (b, _, base) = pool.buffer(slot);
            self.run_expert((b, base), &blk.layout, x, &per, ex, &r, f)
        })?;
        drop(pool_g);
        let out = self.alloc(t_n, e)?;
        self.g.k.combine(&mut self.rec, per.buf(), out.buf(), e, t_n, r.k);
        Ok(out)
    }

    fn routes_on_device(&mut self, il: usize, src: &dyn ExpertSource, n_expert: usize) -> bool {
        self.g.device_routing && n_expert == self.g.n_expert && self.g.pool.lock().unwrap().as_ref().is_some_and(|p| p.holds_layer(il, n_expert, src.layout(il)))
    }

    fn experts_routed(&mut self, il: usize, src: &dyn ExpertSource, x: &GpuT, logits: &GpuT, spec: &RouteSpec, sel_bias: Option<Vector>, f: &ExpertFfn) -> Result<GpuT, OpError> {
        let (e, k) = (x.cols, spec.k);
        if x.rows != 1 || k == 0 || k > 8 || logits.cols != spec.n_expert {
            return Err(OpError::Unsupported { backend: "wgpu", op: "routing on the device for this shape" });
        }
        let layout = src.layout(il).clone();
        let (ff, lay) = (layout.n_ff, SlotLayout::of_layout(&layout));
        let g: &GpuBackend = self.g;
        let pool_g = g.pool.lock().unwrap();
        // `routes_on_device` checked the layouts too; the slots may have changed since (a resize).
        let pool = pool_g.as_ref().filter(|p| p.holds_layer_slots(il, spec.n_expert)).ok_or(OpError::Unsupported { backend: "wgpu", op: "routing on the device without every expert in one slab" })?;
        let (slab, table) = (pool.slab(0), pool.table().expect("holds_layer_slots checks the table"));
        // The router writes the layer's lists into its 256-byte region of `routes` (route.wgsl).
        let bias = sel_bias.map(|v| self.vec(v));
        g.k.route(&mut self.rec, logits.buf(), 0, table, il * spec.n_expert, &g.routes, il * 64, spec, (lay.up - lay.gate) as u32, bias);
        let at = (il * 256) as u32;
        let region = |word: usize| List::Device { buf: &g.routes, at, word: word as u32 };
        let lists = GroupLists { slots: region(0), gate_up: region(0), bias: region(5 * k), n: k };
        let mut rows = DecodeRows { gu: self.alloc(2 * k, ff)?, h: self.alloc(k, ff)?, ye: self.alloc(k, e)? };
        self.run_group(slab, &layout, x, &mut rows, &lists, f)?;
        drop(pool_g);
        let out = self.alloc(1, e)?;
        g.k.combine_w(&mut self.rec, rows.ye.buf(), out.buf(), e, region(4 * k), k)?;
        Ok(out)
    }

    async fn read(&mut self, parts: &[(&GpuT, Range<usize>)]) -> Result<Vec<Vec<f32>>, OpError> {
        let ranges: Vec<(&wgpu::Buffer, u64, u64)> = parts.iter().map(|(t, rows)| (t.buf(), (4 * rows.start * t.cols) as u64, (4 * rows.len() * t.cols) as u64)).collect();
        let t0 = now_ms();
        let back = self.rec.readback(&ranges).await?;
        self.rb_ms += now_ms() - t0;
        Ok(back)
    }
}
