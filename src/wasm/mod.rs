//! The browser entry points (wasm-bindgen). The engine runs in a dedicated worker (`www/les/
//! worker.js`); the worker hands it a synchronous byte reader over the model (OPFS
//! `FileSystemSyncAccessHandle`, IndexedDB chunks, or a synchronous HTTP `Range` request for bytes
//! not stored yet) and drives generation one token per promise, so the worker stays responsive to
//! `abort` and `stats` between tokens. Expert streaming, lookahead prediction and the slot cache are
//! the native ones (`expert::stream`); only the execution of reads differs ([`io`]): a missed
//! expert is read on the calling thread, predicted experts are read asynchronously by the page
//! (`www/les/io.js`) while the engine computes. Without that reader (or for bytes not stored
//! yet), predictions become `hint`s to the store, which fetches them by range in the background.
//! Images (issue 36): `loadMmproj` reads a vision tower whole; `beginImages` takes a chat prompt
//! with media markers and the images' file bytes (decoded, encoded and prefilled as `les serve`
//! does: `Session::mm_prompt` + `prefill_mm_async`), then `step` generates as for text.

pub mod io;

use crate::engine::sampling::SamplerConfig;
use crate::engine::stream::{open_streaming_sources, BudgetPlan, OpenError, StreamOptions};
use crate::engine::{chat, Generation, Session};
use crate::expert::stream::{Policy, StreamConfig, StreamStats, StreamingExperts};
use crate::model::{ExpertMode, Logits};
use crate::store::{check_range, ByteSource, StoreError};
use crate::vision::Mmproj;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

/// The allocator gives back an emergency reserve when the wasm heap cannot grow, so a forward
/// goes on and the session lowers its budget ([`crate::engine::reserve`]).
#[global_allocator]
static ALLOC: crate::engine::reserve::Reserve<std::alloc::System> = crate::engine::reserve::Reserve(std::alloc::System);
use wasm_bindgen::prelude::*;

#[wasm_bindgen(start)]
pub fn start() {
    console_error_panic_hook::set_once();
}

/// The threaded build (`www/les/pkg-mt`, wasm32 with `+atomics`): `initThreadPool(n)` starts
/// n - 1 web workers over the shared memory, rayon's pool for the CPU kernels (the calling worker
/// computes too). The CPU kernels split each op into the same chunks as with one thread, so
/// results do not depend on the thread count.
#[cfg(target_feature = "atomics")]
pub use wasm_bindgen_rayon::init_thread_pool;

/// The threaded build: `initThreadPool` has resolved; parallel sections use the pool from now on.
#[cfg(target_feature = "atomics")]
#[wasm_bindgen(js_name = threadPoolReady)]
pub fn thread_pool_ready() {
    crate::backend::cpu::par::set_pool_ready();
}

/// Tests: a parallel section whose chunks panic on the pool's workers (see
/// [`crate::backend::cpu::par::debug_panic_on_a_worker`]); it must end in an error, not a hang.
#[cfg(target_feature = "atomics")]
#[wasm_bindgen(js_name = debugPanicOnAWorker)]
pub fn debug_panic_on_a_worker() {
    crate::backend::cpu::par::debug_panic_on_a_worker();
}

/// A streamed harmony (gpt-oss) reply split into reasoning and content as it arrives
/// ([`chat::HarmonyStream`]; other replies pass through as content). `push` and `finish` return
/// `[reasoning, content]`.
#[wasm_bindgen]
#[derive(Default)]
pub struct HarmonySplit {
    inner: chat::HarmonyStream,
}

#[wasm_bindgen]
impl HarmonySplit {
    #[wasm_bindgen(constructor)]
    pub fn new() -> Self {
        Self::default()
    }
    pub fn push(&mut self, text: &str) -> Vec<String> {
        let (r, c) = self.inner.push(text);
        vec![r, c]
    }
    pub fn finish(&mut self) -> Vec<String> {
        let (r, c) = self.inner.finish();
        vec![r, c]
    }
}

/// Threads the CPU kernels run on (1 in the plain build).
#[wasm_bindgen(js_name = cpuThreads)]
pub fn cpu_threads() -> u32 {
    crate::backend::cpu::par::n_threads() as u32
}

/// Measure matrix-vector products on 1 to all of the pool's threads
/// (`backend::cpu::matmul::time_threads`: 5 rounds of 32 products, interleaved, the best round) and run the CPU kernels on the
/// fewest threads within 5% of the fastest from now on. Returns `{"times_ms": [per count],
/// "threads": chosen}` as JSON; the threaded build only (else one thread, nothing measured).
#[wasm_bindgen(js_name = tuneThreads)]
pub fn tune_threads() -> String {
    use crate::backend::cpu::{matmul, par};
    if par::pool_threads() < 2 {
        return serde_json::json!({ "times_ms": [], "threads": 1 }).to_string();
    }
    let times = matmul::time_threads(5, 32, crate::clock::now_ms);
    let n = matmul::pick_threads(&times);
    par::use_threads(n);
    serde_json::json!({ "times_ms": times, "threads": n }).to_string()
}

/// Run the CPU kernels on `n` of the pool's threads (1 to the pool's size) from now on.
#[wasm_bindgen(js_name = setCpuThreads)]
pub fn set_cpu_threads(n: u32) -> u32 {
    crate::backend::cpu::par::use_threads(n as usize);
    crate::backend::cpu::par::n_threads() as u32
}

/// Per-op wall time of the CPU forward (`src/backend/profile.rs`, as `les bench pp-tg
/// --profile`): `on` starts recording (clearing the table) or stops it. Benchmarks only.
#[wasm_bindgen(js_name = profileOps)]
pub fn profile_ops(on: bool) {
    crate::backend::profile::enable(on);
}

/// The per-op table so far as JSON `[{op, calls, ms}]`, slowest first.
#[wasm_bindgen(js_name = profileTable)]
pub fn profile_table() -> String {
    serde_json::Value::Array(crate::backend::profile::table().into_iter().map(|t| serde_json::json!({ "op": t.op, "calls": t.calls, "ms": t.ms })).collect()).to_string()
}

/// The SIMD instructions this build's kernels use: "relaxed-simd" (the pkg*-relaxed builds) or
/// "simd128". Both compute the same bits (src/quant/wasm.rs).
#[wasm_bindgen(js_name = wasmSimd)]
pub fn wasm_simd() -> String {
    if cfg!(target_feature = "relaxed-simd") { "relaxed-simd" } else { "simd128" }.into()
}

/// A modelled flash device (`--store` profiles natively, src/store/throttle.rs) as JSON
/// `{name, bandwidth, latency, queue_depth}` (bytes/s, s), or undefined for an unknown name.
#[wasm_bindgen(js_name = deviceProfile)]
pub fn device_profile(name: &str) -> Option<String> {
    let p = crate::store::throttle::DeviceProfile::by_name(name)?;
    Some(serde_json::json!({ "name": p.name, "bandwidth": p.bandwidth, "latency": p.latency, "queue_depth": p.queue_depth }).to_string())
}

/// CRC-32 (IEEE) of `data`, as the bundle manifest records it (`crc32fast`).
#[wasm_bindgen]
pub fn crc32(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// Collect per-op sums of the CPU forward (the native `LES_DEBUG_DUMP=1` lines) from now on.
#[wasm_bindgen(js_name = setDebugDump)]
pub fn set_debug_dump(on: bool) {
    crate::model::DUMP_ON.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The collected debug lines (and clear them).
#[wasm_bindgen(js_name = takeDebugDump)]
pub fn take_debug_dump() -> String {
    std::mem::take(&mut *crate::model::DUMP_BUF.lock().unwrap())
}

/// Debug: `x` rounded to IEEE halves four lanes at a time, as the CPU backend's f16 vector loops
/// do (`backend::cpu::lanes::round_half`, which rounds normal halves in place and the rest
/// through `half`; numerics checks against the browser's `Float16Array`). A tail of fewer than
/// four values goes through `half`.
#[cfg(target_feature = "simd128")]
#[wasm_bindgen(js_name = debugF16Round)]
pub fn debug_f16_round(x: &[f32]) -> Vec<u16> {
    use core::arch::wasm32::*;
    let mut out = Vec::with_capacity(x.len());
    let mut chunks = x.chunks_exact(4);
    for c in &mut chunks {
        let h = crate::backend::cpu::lanes::round_half(f32x4(c[0], c[1], c[2], c[3]));
        out.extend([f32x4_extract_lane::<0>(h), f32x4_extract_lane::<1>(h), f32x4_extract_lane::<2>(h), f32x4_extract_lane::<3>(h)].map(|v| half::f16::from_f32(v).to_bits()));
    }
    out.extend(chunks.remainder().iter().map(|&v| half::f16::from_f32(v).to_bits()));
    out
}

/// Debug: IEEE halves (bits) widened to f32 eight at a time, as the CPU backend's f16 loops and
/// block scales do (`quant::f16x8_to_f32`; numerics checks every half against `Float16Array`).
/// A tail of fewer than eight goes through `half`.
#[cfg(target_feature = "simd128")]
#[wasm_bindgen(js_name = debugF16Widen)]
pub fn debug_f16_widen(h: &[u16]) -> Vec<f32> {
    use core::arch::wasm32::*;
    let mut out = Vec::with_capacity(h.len());
    let mut chunks = h.chunks_exact(8);
    for c in &mut chunks {
        // SAFETY: SIMD128 is compiled in; the load reads the chunk's 16 bytes.
        let (a, b) = unsafe { crate::quant::f16x8_to_f32(v128_load(c.as_ptr() as *const v128)) };
        for v in [a, b] {
            out.extend([f32x4_extract_lane::<0>(v), f32x4_extract_lane::<1>(v), f32x4_extract_lane::<2>(v), f32x4_extract_lane::<3>(v)]);
        }
    }
    out.extend(chunks.remainder().iter().map(|&b| half::f16::from_bits(b).to_f32()));
    out
}

/// Whether this browser's `f32x4.relaxed_madd` rounds once (a fused multiply-add), so the
/// relaxed build's f32 lanes use it (`backend::cpu::lanes`); false in the SIMD128 builds.
#[wasm_bindgen(js_name = wasmFusedMadd)]
pub fn wasm_fused_madd() -> bool {
    #[cfg(target_feature = "simd128")]
    return crate::backend::cpu::lanes::relaxed_madd_is_fused();
    #[cfg(not(target_feature = "simd128"))]
    false
}

/// Debug: the f32 loops that run four lanes at a time on wasm, on the values `x`
/// (`backend::cpu::ops::numerics_probe`; numerics checks them against a native run).
#[wasm_bindgen(js_name = debugF32Ops)]
pub fn debug_f32_ops(x: &[f32]) -> Vec<f32> {
    crate::backend::cpu::ops::numerics_probe(x)
}

/// Debug: the CPU backend's batched product (prompt tiles) of the weight rows `w` (ggml type
/// `ty`) with the tokens `x` (rows of `cols`), token-major (`backend::cpu::matmul::matmul_probe`;
/// numerics checks it against a native run); `repack`: the rows repacked first
/// (`quant::repack`, where the type has that layout).
#[wasm_bindgen(js_name = debugMatmul)]
pub fn debug_matmul(ty: u32, w: &[u8], x: &[f32], cols: usize, repack: Option<bool>) -> Vec<f32> {
    crate::backend::cpu::matmul::matmul_probe(ty, w, x, cols, repack.unwrap_or(false))
}

/// Debug: `x` quantized to the activation type of ggml type `ty`, then dotted with each row of
/// `w` (cross-platform numerics checks against a native run). Returns [dots..., act bytes as f32].
/// `repack`: the rows repacked first (`quant::repack`, where the type has that layout).
#[wasm_bindgen(js_name = debugMatvec)]
pub fn debug_matvec(ty: u32, w: &[u8], x: &[f32], repack: Option<bool>) -> Vec<f32> {
    let Some(mut p) = MatvecProbe::new(ty, w, x, repack == Some(true)) else { return vec![] };
    p.run();
    let MatvecProbe { mut y, act, .. } = p;
    y.extend(act.iter().map(|&b| b as f32));
    y
}

/// A matrix-vector product of the debug exports: the weights copied into the engine's memory
/// (and repacked where asked and the type has that layout), the activation quantized once.
struct MatvecProbe {
    ty: crate::quant::GgmlType,
    n: usize,
    data: Vec<u8>,
    packed: bool,
    act: Vec<u8>,
    y: Vec<f32>,
}

impl MatvecProbe {
    /// One output per whole row of `x.len()` elements in `w`; None for an unknown type or an
    /// activation that does not quantize.
    fn new(ty: u32, w: &[u8], x: &[f32], repack: bool) -> Option<Self> {
        use crate::quant::{self, GgmlType};
        let ty = GgmlType::from_u32(ty)?;
        let mut act = Vec::new();
        quant::quantize_activation(quant::vec_dot_type(ty), x, &mut act).ok()?;
        let rb = ty.row_bytes(x.len() as u64).unwrap_or(0) as usize;
        let rows = if rb == 0 { 0 } else { w.len() / rb };
        let mut data = w.to_vec();
        let packed = repack && quant::repack::pack(ty, x.len(), rows, &mut data);
        Some(Self { ty, n: x.len(), data, packed, act, y: vec![0f32; rows] })
    }

    fn run(&mut self) {
        use crate::quant;
        if self.packed {
            quant::repack::matvec(self.ty, self.n, &self.data, &self.act, &mut self.y)
        } else {
            quant::matvec(self.ty, self.n, &self.data, &self.act, &mut self.y)
        }
    }
}

/// Debug (`tests/e2e/kernel_bench.mjs`): milliseconds per matrix-vector product of the rows `w`
/// (ggml type `ty`) with `x` on this thread, `reps` products timed together after one warm-up;
/// the weights copied into the engine's memory once (and `repack`ed first where the type has
/// that layout), the activation quantized once. NaN for an unknown type or a bad size.
#[wasm_bindgen(js_name = debugMatvecBench)]
pub fn debug_matvec_bench(ty: u32, w: &[u8], x: &[f32], reps: u32, repack: bool) -> f64 {
    let rb = crate::quant::GgmlType::from_u32(ty).and_then(|t| t.row_bytes(x.len() as u64)).unwrap_or(0) as usize;
    if rb == 0 || w.len() % rb != 0 {
        return f64::NAN;
    }
    let Some(mut p) = MatvecProbe::new(ty, w, x, repack) else { return f64::NAN };
    p.run();
    let t0 = crate::clock::now_ms();
    for _ in 0..reps.max(1) {
        p.run();
    }
    (crate::clock::now_ms() - t0) / reps.max(1) as f64
}

/// A [`ByteSource`] over a JavaScript function `read(offset, length, into)` (synchronous; it may
/// throw, which becomes a [`StoreError::Io`] carrying the message). `into` is a `Uint8Array` view
/// of the destination in the engine's memory, `length` bytes: the function fills it and returns
/// `true`, or returns a new `Uint8Array` of `length` bytes, which is copied there.
struct JsSource {
    read: js_sys::Function,
    /// `hint(offset, length)`: lookahead (the store may start fetching); errors are ignored.
    hint: Option<js_sys::Function>,
    len: u64,
    /// The page's store checked every bundle block's CRC-32 before storing it.
    verified: bool,
}

// The engine runs on one thread (its worker); in the threaded build only the CPU kernels' pool
// runs elsewhere, and it never touches JS objects. So the JS function is only ever called here.
unsafe impl Send for JsSource {}
unsafe impl Sync for JsSource {}

impl ByteSource for JsSource {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), StoreError> {
        let len = buf.len();
        check_range(offset, len, self.len)?;
        let io = |msg: String| StoreError::Io { offset, len, source: std::io::Error::other(msg) };
        // SAFETY: the view covers `buf`, which outlives the call; nothing runs wasm code (so the
        // memory neither grows nor moves) while the synchronous JS function fills it.
        let into = unsafe { js_sys::Uint8Array::view_mut_raw(buf.as_mut_ptr(), len) };
        let v = self
            .read
            .call3(&JsValue::NULL, &JsValue::from_f64(offset as f64), &JsValue::from_f64(len as f64), &into)
            .map_err(|e| io(js_error_text(&e)))?;
        if v.as_bool() == Some(true) {
            return Ok(());
        }
        let a: js_sys::Uint8Array = v.dyn_into().map_err(|_| io("the reader did not return a Uint8Array".into()))?;
        if a.length() as usize != len {
            return Err(StoreError::ShortRead { offset, wanted: len, got: a.length() as usize });
        }
        a.copy_to(buf);
        Ok(())
    }
    fn verified_at_rest(&self) -> bool {
        self.verified
    }
    fn hint(&self, offset: u64, len: usize) {
        if let Some(h) = &self.hint {
            let _ = h.call2(&JsValue::NULL, &JsValue::from_f64(offset as f64), &JsValue::from_f64(len as f64));
        }
    }
}

fn js_error_text(e: &JsValue) -> String {
    if let Some(err) = e.dyn_ref::<js_sys::Error>() {
        return String::from(err.message());
    }
    e.as_string().unwrap_or_else(|| format!("{e:?}"))
}

fn err(e: impl std::fmt::Display) -> JsError {
    JsError::new(&e.to_string())
}

struct Inner {
    session: Session,
    /// The model's bytes and name (`plan`).
    src: Arc<dyn ByteSource>,
    name: String,
    experts: Option<Arc<StreamingExperts>>,
    plan: Option<BudgetPlan>,
    backend: String,
    gen: Option<Generation>,
    model_bytes: u64,
    /// FNV-1a over the bits of every logit row of the current generation (tests compare runs).
    logits_fnv: u64,
    /// Streaming counters when the prompt's step ended (decode-only figures are the difference).
    at_first_token: Option<StreamStats>,
    /// The vision tower (`loadMmproj`): chat prompts may then carry images (`beginImages`).
    mmproj: Option<Mmproj>,
    /// What the current generation's image prefill did (`beginImages`; `None` for a text prompt).
    mm: Option<MmRun>,
}

/// An image prompt's prefill ([`crate::engine::multimodal::MmPrefill`]'s figures).
#[derive(Clone, Copy)]
struct MmRun {
    reused: usize,
    encoded: usize,
    encode_ms: f64,
    ms: f64,
    image_rows: usize,
}

/// Engine options (JSON from JS; every field optional).
#[derive(serde::Deserialize)]
#[serde(default)]
struct EngineOptions {
    /// Lookahead prefetching (on by default).
    prefetch: bool,
    /// Prefetch on every token (off by default: the governor measures whether prefetching pays).
    prefetch_always: bool,
    /// Split the budget's expert slots into a small CPU staging cache and a GPU pool (the page
    /// is about to call `useWebGpu`), as natively with `--backend wgpu`.
    gpu_pool: bool,
    /// Asynchronous prefetch reads in flight at once.
    io_lanes: usize,
    /// Expert cache slots, instead of what the budget allows (tests and benchmarks: a cache of a
    /// given fraction of the experts).
    expert_slots: Option<usize>,
    /// Eviction policy (`lru`, `lfu`, `next-use`; default next-use, as `les run`).
    policy: Option<String>,
    /// Lookahead depth in layers (default 1, as `les run --lookahead`).
    lookahead: usize,
    /// The page's store verified each bundle block's CRC-32 when it stored it (`CachedModel`):
    /// reads are not checked again on the engine's thread.
    verified_at_rest: bool,
    /// Matrices held in memory (dense, resident experts) in `quant::repack`'s layout where the
    /// build's kernels read it (default true; false: the file's layout, for comparisons; the
    /// same bits either way).
    repack: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self { prefetch: true, prefetch_always: false, gpu_pool: false, io_lanes: 1, expert_slots: None, policy: None, lookahead: 1, verified_at_rest: false, repack: true }
    }
}

/// Generation options (JSON from JS; every field optional).
#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct GenOptions {
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
    seed: Option<u64>,
    ignore_eos: bool,
    /// Stop strings (OpenAI `stop`; the JS side passes an array).
    #[serde(default)]
    stop: Vec<String>,
    /// Context shift when the context is full, keeping this many tokens (absent: stop there).
    n_keep: Option<usize>,
}

/// One loaded model and its generation state.
#[wasm_bindgen]
pub struct Engine {
    inner: Rc<RefCell<Inner>>,
    /// The budget of a streamed model, changeable while a generation runs (outside `inner`,
    /// which a step holds across its awaits).
    budget: Rc<RefCell<Option<crate::engine::stream::BudgetControl>>>,
    /// The last stats JSON (answered while a step holds the engine).
    last_stats: Rc<RefCell<String>>,
}

#[wasm_bindgen]
impl Engine {
    /// Load a model (GGUF or `.les` bundle) of `len` bytes through `read(offset, length)` (and
    /// `hint(offset, length)` for lookahead range fetches, optional). `budget_bytes > 0` streams
    /// experts under that memory budget; `0` keeps every expert resident. `options`: JSON
    /// `{prefetch, gpu_pool, io_lanes}`; `reads`: the page's asynchronous reader (`AsyncReads`
    /// of `io.js`) that loads predicted experts while the engine computes.
    #[wasm_bindgen(constructor)]
    pub fn new(read: js_sys::Function, hint: Option<js_sys::Function>, len: f64, budget_bytes: f64, n_ctx: u32, name: String, options: Option<String>, reads: Option<io::AsyncReads>) -> Result<Engine, JsError> {
        let eo: EngineOptions = match options.as_deref() {
            None | Some("") => EngineOptions::default(),
            Some(j) => serde_json::from_str(j).map_err(err)?,
        };
        let policy = match eo.policy.as_deref() {
            None => StreamConfig::default().policy,
            Some(p) => Policy::parse(p).ok_or_else(|| err(format!("unknown eviction policy {p:?} (lru, lfu, next-use)")))?,
        };
        let src: Arc<dyn ByteSource> = Arc::new(JsSource { read, hint, len: len as u64, verified: eo.verified_at_rest });
        crate::quant::repack::set_enabled(eo.repack);
        let n_ctx = if n_ctx == 0 { 2048 } else { n_ctx as usize };
        // A bundle is always read through the expert cache (its experts are not GGUF tensors);
        // without a budget the cache holds every expert.
        let streamed = if budget_bytes > 0.0 || crate::expert::bundle::is_bundle(&*src) {
            let opts = StreamOptions {
                budget: budget_bytes as u64,
                n_ctx,
                direct: false,
                cache: StreamConfig { io_threads: 0, prefetch: eo.prefetch, adaptive: !eo.prefetch_always, policy, depth: eo.lookahead.max(1), ..Default::default() },
                slots: if budget_bytes > 0.0 { eo.expert_slots } else { Some(usize::MAX) },
                gpu_pool: eo.gpu_pool && budget_bytes > 0.0,
                dense: Default::default(),
            };
            match open_streaming_sources(src.clone(), src.clone(), src.clone(), &name, &opts) {
                Ok(s) => Some((s.session, Some(s.experts), Some(s.plan), Some(s.budget))),
                Err(OpenError::NotMoe(_)) => None, // a dense model: the budget does not apply
                Err(e) => return Err(err(e)),
            }
        } else {
            None
        };
        let (session, experts, plan, budget) = match streamed {
            Some((s, Some(ex), plan, budget)) => {
                if let (Some(r), true) = (reads, eo.prefetch) {
                    ex.use_async_reader(io::JsReads::new(r), eo.io_lanes);
                }
                (s, Some(ex), plan, budget)
            }
            Some(x) => x,
            None => (Session::load_with_batch(&*src, ExpertMode::Resident, n_ctx, 32).map_err(err)?, None, None, None),
        };
        let mut session = session;
        // A chat re-sends the conversation: its common prefix with the cache is not run again.
        session.reuse_prefix = true;
        let inner = Inner { session, src: src.clone(), name: name.clone(), experts, plan, backend: "cpu (wasm)".into(), gen: None, model_bytes: len as u64, logits_fnv: FNV_OFFSET, at_first_token: None, mmproj: None, mm: None };
        Ok(Engine { inner: Rc::new(RefCell::new(inner)), budget: Rc::new(RefCell::new(budget)), last_stats: Rc::new(RefCell::new("{}".into())) })
    }

    /// Move the model to WebGPU (resolves with a line describing the adapter; rejects when there
    /// is no adapter or a limit is too small, and the engine stays on the CPU).
    #[wasm_bindgen(js_name = useWebGpu)]
    pub fn use_webgpu(&self, expert_slots: Option<u32>) -> js_sys::Promise {
        let inner = self.inner.clone();
        let budget = self.budget.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let ctx = crate::backend::wgpu::GpuContext::new_async().await.map_err(|e| JsValue::from(err(e)))?;
            let i = &ctx.info;
            let what = [i.name.as_str(), i.driver.as_str(), i.driver_info.as_str()].into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>().join(", ");
            let line = if what.is_empty() { "webgpu".to_string() } else { format!("webgpu ({what})") };
            let mut g = inner.try_borrow_mut().map_err(|_| JsValue::from(err("engine busy")))?;
            // The budget's GPU pool when the plan was split for one (`gpu_pool`), else its slots.
            let slots = expert_slots.map(|n| n as usize).or(g.plan.as_ref().map(|p| if p.gpu_slots > 0 { p.gpu_slots } else { p.slots }));
            let opts = crate::backend::wgpu::exec::GpuOptions { expert_slots: slots, ..Default::default() };
            g.session.use_gpu(ctx, &opts).map_err(|e| JsValue::from(err(e)))?;
            // A budget split for a GPU pool resizes it too.
            let pool = g.session.gpu.as_ref().and_then(|x| x.expert_pool());
            let mut b = budget.borrow_mut();
            *b = b.take().map(|b| b.with_gpu_pool(pool));
            g.backend = line.clone();
            Ok(JsValue::from_str(&line))
        })
    }

    /// Model, plan and backend as JSON.
    pub fn info(&self) -> Result<String, JsError> {
        let g = self.inner.try_borrow().map_err(|_| err("engine busy"))?;
        let c = &g.session.model.cfg;
        Ok(serde_json::json!({
            "arch": g.session.gguf.get_str("general.architecture"),
            "name": g.session.gguf.get_str("general.name"),
            "n_layer": c.n_layer, "n_moe_layer": c.n_moe_layers(), "n_embd": c.n_embd, "n_expert": c.n_expert, "n_expert_used": c.n_expert_used,
            "n_vocab": c.n_vocab, "n_ctx": g.session.kv.n_ctx, "model_bytes": g.model_bytes,
            "plan": g.plan, "backend": g.backend, "has_chat_template": g.session.gguf.get_str("tokenizer.chat_template").is_some(),
            "vision": g.mmproj.as_ref().map(mmproj_info),
        })
        .to_string())
    }

    /// Render `messages` (JSON `[{role, content}]`) with the model's chat template.
    #[wasm_bindgen(js_name = chatPrompt)]
    pub fn chat_prompt(&self, messages_json: &str) -> Result<String, JsError> {
        let g = self.inner.try_borrow().map_err(|_| err("engine busy"))?;
        let msgs: Vec<chat::Message> = serde_json::from_str(messages_json).map_err(err)?;
        g.session.chat_prompt(&msgs).map_err(err)
    }

    /// Token ids of `text` (as llama-completion tokenizes a prompt).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, JsError> {
        let g = self.inner.try_borrow().map_err(|_| err("engine busy"))?;
        Ok(g.session.tokenize(text))
    }

    /// Start a generation (options JSON: max_tokens, temperature, top_k, top_p, min_p,
    /// repeat_penalty, seed, ignore_eos). Returns the number of prompt tokens.
    pub fn begin(&self, prompt: &str, options_json: &str) -> Result<u32, JsError> {
        let mut g = self.inner.try_borrow_mut().map_err(|_| err("engine busy"))?;
        let go = gen_options(options_json)?;
        let inner = &mut *g;
        let toks = inner.session.tokenize(prompt);
        if let Some(e) = &inner.experts {
            e.reset_stats();
        }
        let gen = Generation::with_options(&mut inner.session, &toks, &go).map_err(err)?;
        inner.gen = Some(gen);
        inner.mm = None;
        inner.logits_fnv = FNV_OFFSET;
        inner.at_first_token = None;
        Ok(toks.len() as u32)
    }

    /// Load a vision tower (an mmproj GGUF of `len` bytes through `read(offset, length)`; its
    /// weights are read into memory) for chat prompts with images. Returns
    /// `{projector, n_embd_out, image_size, bytes}` as JSON; refuses a tower whose output width
    /// is not the model's embedding width.
    #[wasm_bindgen(js_name = loadMmproj)]
    pub fn load_mmproj(&self, read: js_sys::Function, len: f64) -> Result<String, JsError> {
        let mut g = self.inner.try_borrow_mut().map_err(|_| err("engine busy"))?;
        let src = JsSource { read, hint: None, len: len as u64, verified: false };
        let mp = Mmproj::load(&src).map_err(err)?;
        let text = g.session.model.cfg.n_embd;
        if mp.n_embd_out != text {
            return Err(err(crate::vision::VisionError::Width { mmproj: mp.n_embd_out, text }));
        }
        let info = mmproj_info(&mp).to_string();
        g.mmproj = Some(mp);
        Ok(info)
    }

    /// Start a generation whose prompt holds images: `prompt` is the chat-templated text with
    /// `<__media__>` where each image goes (in order), `images` the images' PNG / JPEG file bytes
    /// (`Uint8Array`s). Decodes and encodes the images the cache does not hold (on the session's
    /// backend: WebGPU awaits its readbacks), runs all but the prompt's last token, then starts
    /// the generation as `begin` does (the first `step` runs the last token). Resolves with the
    /// number of prompt positions (text tokens and image rows); rejects with the vision error
    /// (an image that does not decode, no vision tower loaded, ...).
    #[wasm_bindgen(js_name = beginImages)]
    pub fn begin_images(&self, prompt: String, images: js_sys::Array, options_json: String) -> js_sys::Promise {
        let inner = self.inner.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let mut g = inner.try_borrow_mut().map_err(|_| JsValue::from(err("engine busy")))?;
            begin_images(&mut g, &prompt, &images, &options_json).await.map(|n| JsValue::from_f64(n as f64)).map_err(JsValue::from)
        })
    }

    /// Run one step (the whole prompt first, then one token). Resolves with
    /// `{token, text, done}`; `token` is -1 when the step ended the generation without a token.
    pub fn step(&self) -> js_sys::Promise {
        let inner = self.inner.clone();
        let last_stats = self.last_stats.clone();
        wasm_bindgen_futures::future_to_promise(async move {
            let mut g = inner.try_borrow_mut().map_err(|_| JsValue::from(err("engine busy")))?;
            let r = step(&mut g).await.map_err(|e| JsValue::from(err(e)))?;
            *last_stats.borrow_mut() = stats_json(&g);
            Ok(r)
        })
    }

    /// End the current generation after the step in progress.
    pub fn stop(&self) {
        if let Ok(mut g) = self.inner.try_borrow_mut() {
            if let Some(gen) = &mut g.gen {
                gen.stop();
            }
        }
    }

    /// The memory budget as JSON ([`crate::engine::stream::BudgetControl::summary_json`]);
    /// `null` for a model held whole (no budget).
    #[wasm_bindgen(js_name = memoryBudget)]
    pub fn memory_budget(&self) -> String {
        match &*self.budget.borrow() {
            Some(b) => budget_json(b),
            None => "null".into(),
        }
    }

    /// Change the memory budget to `bytes`, also while a generation runs (between its steps):
    /// the expert cache shrinks at once (experts a running layer uses, when it is done) or may
    /// grow again; the conversation and the output do not change. Below the model's minimum it
    /// throws and nothing changes. Returns [`Self::memory_budget`]'s JSON. The wasm heap itself
    /// never shrinks (WebAssembly memory only grows): what the cache gives back is reused inside
    /// it (the KV cache, images) instead of growing it.
    #[wasm_bindgen(js_name = setMemoryBudget)]
    pub fn set_memory_budget(&self, bytes: f64) -> Result<String, JsError> {
        let b = self.budget.borrow().clone().ok_or_else(|| err("this model is held whole (loaded without a memory budget): there is no budget to change"))?;
        if !(bytes.is_finite() && bytes >= 0.0) {
            return Err(err(format!("memory budget {bytes}: not a size in bytes")));
        }
        b.set(bytes.round() as u64).map_err(err)?;
        Ok(budget_json(&b))
    }

    /// Will it fit, and how fast? The forecast (`les plan`'s JSON) for this engine's model with
    /// `options_json`: `memory_budget` (bytes; default the budget now), `n_ctx` (default the
    /// engine's), `store` (a device profile; default: this page's storage, probed), `prompt_tokens`
    /// (512). The hit rate replays the routing the engine has seen so far (else uniform); compute
    /// comes from the last generation (its decode time less its read stalls, its prompt time):
    /// none before the first, which then leaves the speeds out. The dense weights are not loaded
    /// again (the wasm heap never shrinks).
    pub fn plan(&self, options_json: &str) -> Result<String, JsError> {
        #[derive(serde::Deserialize, Default)]
        #[serde(deny_unknown_fields)]
        struct O {
            memory_budget: Option<f64>,
            n_ctx: Option<usize>,
            store: Option<String>,
            prompt_tokens: Option<usize>,
        }
        let o: O = if options_json.trim().is_empty() { O::default() } else { serde_json::from_str(options_json).map_err(err)? };
        let g = self.inner.try_borrow().map_err(|_| err("engine busy (a generation step is running)"))?;
        let profile = match o.store.as_deref() {
            None => None,
            Some(n) => Some(crate::store::throttle::DeviceProfile::by_name(n).ok_or_else(|| err(format!("unknown store profile '{n}'")))?),
        };
        let budget = o.memory_budget.map(|b| b.max(0.0) as u64).or(self.budget.borrow().as_ref().map(|b| b.budget())).unwrap_or(g.model_bytes);
        let routes = g.experts.as_ref().map(|e| e.route_log()).filter(|r| !r.is_empty());
        // The last generation's compute: decode less its read stalls; the prompt as it ran.
        let compute = g.gen.as_ref().map(|x| &x.stats).filter(|st| st.gen_tokens > 1 && st.prompt_tokens > st.prompt_reused).map(|st| {
            let stall = match (g.experts.as_ref().map(|e| e.stats()), &g.at_first_token) {
                (Some(now), Some(f)) => now.stall_ms - f.stall_ms,
                _ => 0.0,
            };
            crate::engine::plan::ComputeProbe {
                source: "the engine's last generation",
                decode_ms_per_token: ((st.gen_ms - stall) / st.gen_tokens as f64).max(0.0),
                prompt_ms_per_token: st.prompt_ms / (st.prompt_tokens - st.prompt_reused) as f64,
                prompt_batch: crate::engine::stream::PREFILL_BATCH,
                threads: crate::backend::cpu::par::n_threads(),
            }
        });
        let po = crate::engine::plan::PlanOptions { budget, n_ctx: o.n_ctx.unwrap_or(g.session.kv.n_ctx), profile, routes, policy: Policy::NextUse, probe: false, prompt_tokens: o.prompt_tokens.unwrap_or(512), gpu_devices: Vec::new() };
        let f = crate::engine::plan::plan_source(g.src.clone(), &g.name, &po, compute).map_err(err)?;
        serde_json::to_string(&f).map_err(err)
    }

    /// Forget the cached conversation: the next prompt is run from its first token.
    #[wasm_bindgen(js_name = resetChat)]
    pub fn reset_chat(&self) -> Result<(), JsError> {
        let mut g = self.inner.try_borrow_mut().map_err(|_| err("engine busy"))?;
        g.gen = None;
        g.mm = None;
        g.session.reset();
        Ok(())
    }

    /// Tokens generated so far in the current generation.
    pub fn tokens(&self) -> Vec<u32> {
        self.inner.try_borrow().ok().and_then(|g| g.gen.as_ref().map(|x| x.out.clone())).unwrap_or_default()
    }

    /// Generation and streaming counters as JSON (per layer: hits, late, misses, stall ms,
    /// prediction counts per lookahead distance).
    pub fn stats(&self) -> String {
        match self.inner.try_borrow() {
            Ok(g) => stats_json(&g),
            Err(_) => self.last_stats.borrow().clone(),
        }
    }
}

/// Generation options from the JSON `begin` takes.
fn gen_options(options_json: &str) -> Result<crate::engine::GenOptions, JsError> {
    let o: GenOptions = if options_json.is_empty() { GenOptions::default() } else { serde_json::from_str(options_json).map_err(err)? };
    let d = SamplerConfig::default();
    let sc = SamplerConfig {
        temperature: o.temperature.unwrap_or(d.temperature),
        top_k: o.top_k.unwrap_or(d.top_k),
        top_p: o.top_p.unwrap_or(d.top_p),
        min_p: o.min_p.unwrap_or(d.min_p),
        repeat_penalty: o.repeat_penalty.unwrap_or(d.repeat_penalty),
        seed: o.seed.unwrap_or(d.seed),
        ..d
    };
    Ok(crate::engine::GenOptions {
        n: o.max_tokens.unwrap_or(256),
        sampler: sc,
        ignore_eos: o.ignore_eos,
        stop: o.stop,
        context: o.n_keep.map(|n_keep| crate::engine::ContextMode::Shift { n_keep }).unwrap_or_default(),
    })
}

fn mmproj_info(mp: &Mmproj) -> serde_json::Value {
    serde_json::json!({ "projector": mp.cfg.projector, "n_embd_out": mp.n_embd_out, "image_size": mp.cfg.image_size, "bytes": mp.bytes })
}

/// [`Engine::begin_images`]: as `les serve` runs a chat request with images (`mm_prompt`,
/// `prefill_mm`, then the generation from the token record with the prefix reused).
async fn begin_images(g: &mut Inner, prompt: &str, images: &js_sys::Array, options_json: &str) -> Result<u32, JsError> {
    let mut go = gen_options(options_json)?;
    // A context shift recomputes the kept tokens from their ids, which an image's rows are not
    // (llama-server turns the shift off with --mmproj; so does `les serve`).
    go.context = crate::engine::ContextMode::Stop;
    let mut bytes = Vec::with_capacity(images.length() as usize);
    for (i, v) in images.iter().enumerate() {
        let a: js_sys::Uint8Array = v.dyn_into().map_err(|_| err(format!("image {i}: expected the file's bytes as a Uint8Array")))?;
        bytes.push(a.to_vec());
    }
    let Inner { session, experts, mmproj, gen, mm, logits_fnv, at_first_token, .. } = g;
    let mp = mmproj.as_ref().ok_or_else(|| err("no vision tower is loaded: images need an mmproj (createEngine's `mmproj` option)"))?;
    // The previous generation ends here (its state is replaced whatever happens next).
    *gen = None;
    *mm = None;
    let p = session.mm_prompt(mp, prompt, &bytes).map_err(err)?;
    if p.tokens.len() >= session.kv.n_ctx {
        return Err(err(crate::engine::EngineError::PromptTooLong(p.tokens.len(), session.kv.n_ctx)));
    }
    if let Some(e) = experts.as_ref() {
        e.reset_stats();
    }
    let run = session.prefill_mm_async(mp, &p).await.map_err(err)?;
    let g2 = Generation::with_options(session, &run.tokens, &go).map_err(err)?;
    *gen = Some(g2);
    *mm = Some(MmRun { reused: run.reused, encoded: run.encoded, encode_ms: run.encode_ms, ms: run.ms, image_rows: p.image_rows });
    *logits_fnv = FNV_OFFSET;
    *at_first_token = None;
    Ok(run.tokens.len() as u32)
}

/// Tests: refuse the `n`-th allocation of at least 64 KiB from now on, once, as a heap that
/// cannot grow would ([`crate::engine::reserve`]: the reserve is given back, the forward goes on
/// and the engine lowers its budget).
#[wasm_bindgen(js_name = debugRefuseAlloc)]
pub fn debug_refuse_alloc(n: u32) {
    crate::engine::reserve::debug_refuse_once(n as usize, 64 << 10);
}

fn budget_json(b: &crate::engine::stream::BudgetControl) -> String {
    b.summary_json().to_string()
}

fn stats_json(g: &Inner) -> String {
    let s = g.experts.as_ref().map(|e| e.stats());
    let gen = g.gen.as_ref().map(|x| x.stats.clone()).unwrap_or_default();
    let gpu = g.session.gpu.as_ref().map(|x| x.stats());
    // With images the prompt ran in `beginImages` (all but its last token): its reuse and time.
    let (prompt_reused, prompt_ms) = match &g.mm {
        Some(m) => (m.reused, gen.prompt_ms + m.ms),
        None => (gen.prompt_reused, gen.prompt_ms),
    };
    serde_json::json!({
        "prompt_tokens": gen.prompt_tokens, "prompt_reused": prompt_reused, "finish_reason": gen.finish_reason, "prompt_ms": prompt_ms, "gen_tokens": gen.gen_tokens, "gen_ms": gen.gen_ms,
        "images": g.mm.map(|m| serde_json::json!({ "encoded": m.encoded, "encode_ms": m.encode_ms, "image_rows": m.image_rows, "prefill_ms": m.ms })),
        "tokens_per_s": if gen.gen_tokens > 1 { gen.gen_tps() } else { 0.0 },
        "hit_rate": s.as_ref().map(|s| s.hit_rate()), "recall_d1": s.as_ref().map(|s| s.recall(1)),
        "bytes_per_token": s.as_ref().map(|s| s.bytes_per_token()),
        "stream": s, "gpu": gpu, "backend": g.backend,
        "reads": g.experts.as_ref().map(|e| e.executor()),
        "cpu_threads": crate::backend::cpu::par::n_threads(),
        "logits_fnv": format!("{:016x}", g.logits_fnv),
        // Reads and stalls of the decode steps only (after the prompt's step), as `les bench ladder` counts them.
        "decode": match (&s, &g.at_first_token) {
            (Some(now), Some(f)) => serde_json::json!({ "bytes_read": now.bytes_read - f.bytes_read, "stall_ms": now.stall_ms - f.stall_ms, "loads": (now.demand_loads + now.prefetch_loads) - (f.demand_loads + f.prefetch_loads) }),
            _ => serde_json::Value::Null,
        },
        // The wasm linear memory (grows, never shrinks): the model never passes through it whole.
        "wasm_heap_bytes": core::arch::wasm32::memory_size::<0>() as u64 * 65536,
    })
    .to_string()
}

async fn step(g: &mut Inner) -> Result<JsValue, crate::engine::EngineError> {
    let Inner { session, gen, logits_fnv, at_first_token, experts, .. } = g;
    let Some(gen) = gen.as_mut() else { return Ok(step_result(-1, "", true)) };
    let Some(input) = gen.next_input() else {
        let rest = gen.finish();
        return Ok(step_result(-1, &rest, true));
    };
    let logits = if session.gpu.is_some() {
        // The GPU forward runs a prompt in batches of GPU_BATCH itself.
        session.forward_async(&input, Logits::Last).await?
    } else if input.len() > 1 {
        session.prefill(&input)?
    } else {
        session.forward(&input, Logits::Last)?
    };
    if at_first_token.is_none() {
        *at_first_token = experts.as_ref().map(|e| e.stats());
    }
    for v in logits.iter() {
        for b in v.to_bits().to_le_bytes() {
            *logits_fnv = (*logits_fnv ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    Ok(match gen.feed(session, &logits) {
        Some((tok, text)) => {
            let done = gen.is_done();
            let text = if done { text + &gen.finish() } else { text };
            step_result(tok as i64, &text, done)
        }
        None => {
            let rest = gen.finish();
            step_result(-1, &rest, true)
        }
    })
}

const FNV_OFFSET: u64 = 0xcbf29ce484222325;

fn step_result(token: i64, text: &str, done: bool) -> JsValue {
    let o = js_sys::Object::new();
    let _ = js_sys::Reflect::set(&o, &"token".into(), &JsValue::from_f64(token as f64));
    let _ = js_sys::Reflect::set(&o, &"text".into(), &JsValue::from_str(text));
    let _ = js_sys::Reflect::set(&o, &"done".into(), &JsValue::from_bool(done));
    o.into()
}
