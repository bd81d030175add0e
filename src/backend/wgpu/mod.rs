//! The wgpu backend: WebGPU in the browser, Metal on Apple devices, Vulkan/DX12 elsewhere.
//!
//! Layout (one file per concern, each kernel's WGSL in `shaders/` named like the Rust that
//! dispatches it, each tested against the CPU backend in `tests/suite/wgpu_kernels.rs`):
//! - this file: adapter/device ([`GpuContext`]), typed errors, the command [`Recorder`] that batches
//!   dispatches into one command buffer (per MoE layer) with their parameters in one upload arena;
//! - [`kernels`]: pipelines and one dispatch function per kernel (matvec per GGML type,
//!   activation quantization, RMSNorm, RoPE, KV store, attention, element-wise ops);
//! - [`experts`]: a pool of fixed-size GPU expert slots fed through the [`crate::expert::ExpertSource`];
//! - [`exec`]: the [`crate::backend::ops::Ops`] contract on the GPU (weights, KV cache and
//!   activation buffers; the forward pass itself is the architecture's, in `src/model/`).
//!
//! Synchronisation: one GPU→CPU readback per MoE layer (the router logits, plus the FFN input for
//! the lookahead predictor when decoding), one for the output logits.

pub mod exec;
pub mod experts;
pub mod kernels;
pub mod probe;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter found (wgpu backends: {0}); run with --backend cpu, or install a driver (e.g. mesa-vulkan-drivers for lavapipe)")]
    NoAdapter(String),
    #[error("could not open the GPU device: {0}")]
    Device(String),
    #[error("GPU limit too small: {what} needs {need} bytes, the adapter allows {have}")]
    Limit { what: String, need: u64, have: u64 },
    #[error("GPU device lost ({0}); this session cannot continue, start a new one")]
    Lost(String),
    #[error("GPU validation error: {0}")]
    Validation(String),
    #[error("the wgpu backend has no kernel for tensor type {0}")]
    Unsupported(&'static str),
    #[error("GPU readback failed: {0}")]
    Map(String),
    #[error("the wgpu backend needs every dense weight in memory, and this model reads {0} MiB of them from storage at each use (raise --memory-budget, or run with --backend cpu)")]
    StreamedDense(u64),
}

/// What the backend asked of the device since it was opened: one counter per kind of call that
/// costs CPU or driver time on a real GPU (per-call prices: `engine::gpu_cost`). Counted where
/// the call is made, so every path (forward, expert uploads, probes) is included.
#[derive(Default)]
pub struct Counters {
    submits: AtomicU64,
    readbacks: AtomicU64,
    dispatches: AtomicU64,
    passes: AtomicU64,
    bind_groups: AtomicU64,
    buffers: AtomicU64,
    clears: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
}

/// A snapshot of [`Counters`] (or the difference of two): per forward, per token, per run.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct GpuCounts {
    /// `queue.submit` calls.
    pub submits: u64,
    /// GPU→CPU synchronisations (submit, `map_async`, wait).
    pub readbacks: u64,
    /// `dispatch_workgroups` calls.
    pub dispatches: u64,
    /// Compute passes begun.
    pub passes: u64,
    /// Bind groups created.
    pub bind_groups: u64,
    /// Buffers created.
    pub buffers: u64,
    /// `clear_buffer` commands.
    pub clears: u64,
    /// `queue.write_buffer` calls and their bytes.
    pub writes: u64,
    pub write_bytes: u64,
}

impl GpuCounts {
    fn fields(&mut self) -> [&mut u64; 9] {
        [&mut self.submits, &mut self.readbacks, &mut self.dispatches, &mut self.passes, &mut self.bind_groups, &mut self.buffers, &mut self.clears, &mut self.writes, &mut self.write_bytes]
    }
    /// `self - earlier` (counters only grow).
    pub fn since(mut self, mut earlier: GpuCounts) -> GpuCounts {
        for (a, b) in self.fields().into_iter().zip(earlier.fields()) {
            *a = a.saturating_sub(*b);
        }
        self
    }
    pub fn add(&mut self, mut other: GpuCounts) {
        for (a, b) in self.fields().into_iter().zip(other.fields()) {
            *a += *b;
        }
    }
    /// Each count divided by `n` (per token, per forward).
    pub fn per(&self, n: u64) -> GpuRates {
        let d = n.max(1) as f64;
        GpuRates {
            submits: self.submits as f64 / d,
            readbacks: self.readbacks as f64 / d,
            dispatches: self.dispatches as f64 / d,
            passes: self.passes as f64 / d,
            bind_groups: self.bind_groups as f64 / d,
            buffers: self.buffers as f64 / d,
            clears: self.clears as f64 / d,
            writes: self.writes as f64 / d,
            write_bytes: self.write_bytes as f64 / d,
        }
    }
}

/// [`GpuCounts`] per token (or per forward).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct GpuRates {
    pub submits: f64,
    pub readbacks: f64,
    pub dispatches: f64,
    pub passes: f64,
    pub bind_groups: f64,
    pub buffers: f64,
    pub clears: f64,
    pub writes: f64,
    pub write_bytes: f64,
}

impl std::fmt::Display for GpuRates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.1} submits, {:.1} readbacks, {:.1} dispatches in {:.1} compute passes, {:.1} bind groups and {:.1} buffers created, {:.1} clears, {:.1} writes ({:.0} B)",
            self.submits, self.readbacks, self.dispatches, self.passes, self.bind_groups, self.buffers, self.clears, self.writes, self.write_bytes
        )
    }
}

impl Counters {
    pub fn snapshot(&self) -> GpuCounts {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        GpuCounts {
            submits: g(&self.submits),
            readbacks: g(&self.readbacks),
            dispatches: g(&self.dispatches),
            passes: g(&self.passes),
            bind_groups: g(&self.bind_groups),
            buffers: g(&self.buffers),
            clears: g(&self.clears),
            writes: g(&self.writes),
            write_bytes: g(&self.write_bytes),
        }
    }
    fn bump(a: &AtomicU64, n: u64) {
        a.fetch_add(n, Ordering::Relaxed);
    }
}

/// An adapter, its device and queue, and what they allow.
pub struct GpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    lost: Arc<Mutex<Option<String>>>,
    error: Arc<Mutex<Option<String>>>,
    /// Calls made on the device and queue ([`Self::counts`]).
    pub counters: Counters,
    /// The readback staging buffer, reused by every readback that fits it (grown by powers of two).
    staging: Mutex<Option<wgpu::Buffer>>,
}

impl GpuContext {
    /// The default adapter (high performance), with the adapter's own limits requested.
    pub async fn new_async() -> Result<Self, GpuError> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = instance
            .request_adapter(&wgpu::RequestAdapterOptions { power_preference: wgpu::PowerPreference::HighPerformance, ..Default::default() })
            .await
            .map_err(|e| GpuError::NoAdapter(e.to_string()))?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let features = adapter.features();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("les"),
                // Optional features the kernels use when present.
                required_features: features & (wgpu::Features::SUBGROUP | wgpu::Features::SHADER_F16),
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::Device(e.to_string()))?;
        let lost = Arc::new(Mutex::new(None));
        let error = Arc::new(Mutex::new(None));
        {
            let lost = lost.clone();
            device.set_device_lost_callback(move |reason, msg| {
                *lost.lock().unwrap() = Some(format!("{reason:?}: {msg}"));
            });
            let error = error.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                let mut g = error.lock().unwrap();
                if g.is_none() {
                    *g = Some(e.to_string());
                }
            }));
        }
        Ok(Self { device, queue, info, limits, features, lost, error, counters: Counters::default(), staging: Mutex::new(None) })
    }

    /// Whether `--backend auto` runs on this adapter: a hardware GPU, not a software rasterizer
    /// (lavapipe, SwiftShader), which is slower than the CPU backend.
    pub fn auto_takes(info: &wgpu::AdapterInfo) -> bool {
        info.device_type != wgpu::DeviceType::Cpu
    }

    /// The default adapter's description, without opening a device (for `--backend auto`).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn probe() -> Result<wgpu::AdapterInfo, GpuError> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions { power_preference: wgpu::PowerPreference::HighPerformance, ..Default::default() }))
            .map_err(|e| GpuError::NoAdapter(e.to_string()))?;
        Ok(adapter.get_info())
    }

    /// Blocking [`Self::new_async`] (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Self, GpuError> {
        pollster::block_on(Self::new_async())
    }

    /// A device-lost or validation error seen since the last check.
    pub fn check(&self) -> Result<(), GpuError> {
        if let Some(m) = self.lost.lock().unwrap().clone() {
            return Err(GpuError::Lost(m));
        }
        if let Some(m) = self.error.lock().unwrap().take() {
            return Err(GpuError::Validation(m));
        }
        Ok(())
    }

    /// Simulate losing the device (tests of the error path).
    pub fn destroy(&self) {
        self.device.destroy();
    }

    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Adapter, backend, limits and features, for `les inspect --device`.
    pub fn describe(&self) -> String {
        let l = &self.limits;
        format!(
            "adapter: {} ({:?}, {:?}, driver {} {})\nlimits: max_buffer_size {} B, max_storage_buffer_binding_size {} B, max_compute_workgroup_storage_size {} B, max_compute_invocations_per_workgroup {}, max_compute_workgroups_per_dimension {}, max_storage_buffers_per_shader_stage {}\nfeatures: shader-f16 {}, subgroups {}, timestamp-query {}",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            self.info.driver,
            self.info.driver_info,
            l.max_buffer_size,
            l.max_storage_buffer_binding_size,
            l.max_compute_workgroup_storage_size,
            l.max_compute_invocations_per_workgroup,
            l.max_compute_workgroups_per_dimension,
            l.max_storage_buffers_per_shader_stage,
            self.features.contains(wgpu::Features::SHADER_F16),
            self.features.contains(wgpu::Features::SUBGROUP),
            self.features.contains(wgpu::Features::TIMESTAMP_QUERY),
        )
    }

    /// The calls made so far.
    pub fn counts(&self) -> GpuCounts {
        self.counters.snapshot()
    }

    /// `device.create_buffer`, counted.
    pub fn create_buffer(&self, desc: &wgpu::BufferDescriptor<'_>) -> wgpu::Buffer {
        Counters::bump(&self.counters.buffers, 1);
        self.device.create_buffer(desc)
    }

    /// `device.create_bind_group`, counted.
    pub fn create_bind_group(&self, desc: &wgpu::BindGroupDescriptor<'_>) -> wgpu::BindGroup {
        Counters::bump(&self.counters.bind_groups, 1);
        self.device.create_bind_group(desc)
    }

    /// `queue.write_buffer`, counted.
    pub fn write(&self, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        Counters::bump(&self.counters.writes, 1);
        Counters::bump(&self.counters.write_bytes, data.len() as u64);
        self.queue.write_buffer(buf, offset, data);
    }

    /// A storage buffer of `bytes` (rounded up to 4) holding `data` (zero-padded).
    pub fn upload(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer, GpuError> {
        let size = pad4(data.len().max(4)) as u64;
        if size > self.max_binding() {
            return Err(GpuError::Limit { what: format!("buffer '{label}'"), need: size, have: self.max_binding() });
        }
        let buf = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        write_padded(self, &buf, 0, data);
        Ok(buf)
    }

    /// A zeroed storage buffer of `bytes` (rounded up to 4).
    pub fn scratch(&self, label: &str, bytes: usize) -> Result<wgpu::Buffer, GpuError> {
        let size = pad4(bytes.max(4)) as u64;
        if size > self.max_binding() {
            return Err(GpuError::Limit { what: format!("buffer '{label}'"), need: size, have: self.max_binding() });
        }
        Ok(self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        }))
    }
}

pub(crate) fn pad4(n: usize) -> usize {
    (n + 3) & !3
}

/// Bytes per `write_buffer` call: uploads go through wgpu's staging memory in pieces of this size,
/// so no upload ever needs a staging buffer as large as a tensor or an expert.
pub const UPLOAD_CHUNK: usize = 1 << 20;

/// `queue.write_buffer` in [`UPLOAD_CHUNK`] pieces, the data zero-padded to a multiple of 4 bytes.
pub(crate) fn write_padded(ctx: &GpuContext, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
    let whole = data.len() & !3;
    let mut at = 0;
    while at < whole {
        let n = UPLOAD_CHUNK.min(whole - at);
        ctx.write(buf, offset + at as u64, &data[at..at + n]);
        at += n;
    }
    if whole < data.len() {
        let mut tail = [0u8; 4];
        tail[..data.len() - whole].copy_from_slice(&data[whole..]);
        ctx.write(buf, offset + whole as u64, &tail);
    }
}

const ARENA_BYTES: usize = 1 << 20;
const ARENA_ALIGN: usize = 256;
/// Bytes of a kernel's parameter binding (a uniform at a dynamic offset into the arena): the
/// largest parameter struct is 64 bytes.
pub const PARAM_BYTES: u64 = 256;
/// Bytes of an index-list binding (a storage read at a dynamic offset into the arena):
/// `gather` / `scatter` lists of up to 16,384 words.
pub const LIST_BYTES: u64 = 64 << 10;

/// Records dispatches into one command encoder, all of them in one compute pass until a copy,
/// a clear or the submit ends it (WebGPU orders the dispatches of a pass: each is its own usage
/// scope). Kernel parameters (and small index lists) go into a CPU-side arena that is uploaded
/// with one `write_buffer` right before the submit; kernels bind the arena once, at dynamic
/// offsets, so their bind groups are made once and reused ([`crate::backend::wgpu::kernels`]).
pub struct Recorder<'c> {
    pub ctx: &'c GpuContext,
    encoder: Option<wgpu::CommandEncoder>,
    pass: Option<wgpu::ComputePass<'static>>,
    arena: Vec<u8>,
    arena_buf: &'c wgpu::Buffer,
    /// Recording generation: advanced by every [`Self::submit`] (commands marked with an older
    /// value are no longer pending). The calls themselves are counted in [`GpuContext::counters`].
    pub submits: usize,
}

impl<'c> Recorder<'c> {
    pub fn new(ctx: &'c GpuContext, arena_buf: &'c wgpu::Buffer) -> Self {
        Self { ctx, encoder: None, pass: None, arena: Vec::with_capacity(64 << 10), arena_buf, submits: 0 }
    }

    /// The arena: [`ARENA_BYTES`] plus room for a list binding at the last offset.
    pub fn arena_buffer(ctx: &GpuContext) -> wgpu::Buffer {
        ctx.create_buffer(&wgpu::BufferDescriptor {
            label: Some("les-arena"),
            size: (ARENA_BYTES as u64) + LIST_BYTES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    pub fn arena(&self) -> &'c wgpu::Buffer {
        self.arena_buf
    }

    /// The command encoder, with the open compute pass (if any) ended: for copies and clears.
    pub fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        self.encoder.get_or_insert_with(|| self.ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("les") }))
    }

    /// `clear_buffer`, counted.
    pub fn clear(&mut self, buf: &wgpu::Buffer, offset: u64, size: Option<u64>) {
        Counters::bump(&self.ctx.counters.clears, 1);
        self.encoder().clear_buffer(buf, offset, size);
    }

    /// Put `bytes` in the arena; returns its (offset, size). Submits first when full.
    pub fn push(&mut self, bytes: &[u8]) -> (u64, u64) {
        let size = pad4(bytes.len().max(4));
        assert!(size <= ARENA_BYTES, "arena item too large");
        if pad_to(self.arena.len(), ARENA_ALIGN) + size > ARENA_BYTES {
            self.submit();
        }
        let off = pad_to(self.arena.len(), ARENA_ALIGN);
        self.arena.resize(off, 0);
        self.arena.extend_from_slice(bytes);
        self.arena.resize(off + size, 0);
        (off as u64, size as u64)
    }

    /// A binding of the arena at `at` (offset, size): for kernels whose layouts take no dynamic
    /// offsets (tests of one kernel).
    pub fn arena_binding(&self, at: (u64, u64)) -> wgpu::BindingResource<'c> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer: self.arena_buf, offset: at.0, size: wgpu::BufferSize::new(at.1) })
    }

    /// One dispatch in the open compute pass (begun if none is), with the bind group's dynamic
    /// offsets (the arena items of its parameters and list).
    pub fn dispatch(&mut self, pipeline: &wgpu::ComputePipeline, bind: &wgpu::BindGroup, offsets: &[u32], groups: (u32, u32, u32)) {
        if self.pass.is_none() {
            let enc = self.encoder();
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: None, timestamp_writes: None }).forget_lifetime();
            self.pass = Some(pass);
            Counters::bump(&self.ctx.counters.passes, 1);
        }
        let pass = self.pass.as_mut().expect("a compute pass is open");
        pass.set_pipeline(pipeline);
        pass.set_bind_group(0, bind, offsets);
        pass.dispatch_workgroups(groups.0, groups.1, groups.2);
        Counters::bump(&self.ctx.counters.dispatches, 1);
    }

    /// Upload the arena and submit what was recorded.
    pub fn submit(&mut self) {
        self.pass = None;
        if !self.arena.is_empty() {
            self.ctx.write(self.arena_buf, 0, &self.arena);
            self.arena.clear();
        }
        if let Some(enc) = self.encoder.take() {
            self.ctx.queue.submit(Some(enc.finish()));
            Counters::bump(&self.ctx.counters.submits, 1);
        }
        // A new generation even when nothing was recorded: whatever was marked as used by this
        // recording is no longer waiting for a submit (the expert pool relies on it).
        self.submits += 1;
    }

    /// Copy `ranges` (buffer, byte offset, bytes) into the context's staging buffer, submit,
    /// wait, and return their contents as f32 — one GPU→CPU synchronisation for all of them.
    /// The staging buffer is reused (made anew only when a readback outgrows it).
    pub async fn readback(&mut self, ranges: &[(&wgpu::Buffer, u64, u64)]) -> Result<Vec<Vec<f32>>, GpuError> {
        let total: u64 = ranges.iter().map(|r| r.2).sum();
        let staging = match self.ctx.staging.lock().unwrap().take() {
            Some(b) if b.size() >= total.max(4) => b,
            _ => self.ctx.create_buffer(&wgpu::BufferDescriptor {
                label: Some("les-readback"),
                size: total.max(4).next_power_of_two().max(64 << 10),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        let mut at = 0;
        for &(b, off, n) in ranges {
            self.encoder().copy_buffer_to_buffer(b, off, &staging, at, n);
            at += n;
        }
        self.submit();
        Counters::bump(&self.ctx.counters.readbacks, 1);
        let (tx, rx) = futures::channel::oneshot::channel();
        staging.slice(..total.max(4)).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        #[cfg(not(target_arch = "wasm32"))]
        self.ctx.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Map(e.to_string()))?;
        self.ctx.check()?;
        rx.await.map_err(|_| GpuError::Map("the map callback was dropped".into()))?.map_err(|e| GpuError::Map(e.to_string()))?;
        let data = staging.slice(..total.max(4)).get_mapped_range().map_err(|e| GpuError::Map(e.to_string()))?;
        let all: &[f32] = bytemuck::cast_slice(&data[..total as usize]);
        let mut out = Vec::with_capacity(ranges.len());
        let mut at = 0usize;
        for &(_, _, n) in ranges {
            let k = n as usize / 4;
            out.push(all[at..at + k].to_vec());
            at += k;
        }
        drop(data);
        staging.unmap();
        *self.ctx.staging.lock().unwrap() = Some(staging);
        self.ctx.check()?;
        Ok(out)
    }
}

fn pad_to(n: usize, a: usize) -> usize {
    n.div_ceil(a) * a
}

/// Run a future to completion on native targets.
#[cfg(not(target_arch = "wasm32"))]
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    pollster::block_on(f)
}
