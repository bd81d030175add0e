//! Pipelines and dispatch functions, one per kernel. Each kernel's WGSL lives in `shaders/`
//! (`matvec.wgsl` + `shaders/quant/<type>.wgsl`, `act_quant.wgsl`, `rms_norm.wgsl`, `rope.wgsl`,
//! `kv_store.wgsl`, `attention.wgsl`, `elementwise.wgsl`); its CPU reference is named in the
//! shader's header and checked in `tests/suite/wgpu_kernels.rs`.

use super::{GpuContext, GpuError, Recorder, LIST_BYTES, PARAM_BYTES};
use crate::backend::ops::ExpertAct;
use crate::quant::{vec_dot_type, GgmlType};
use std::collections::HashMap;
use std::sync::Mutex;

const COMMON: &str = include_str!("../../../shaders/common.wgsl");
const F16_EMUL: &str = include_str!("../../../shaders/f16_emul.wgsl");
const F16_NATIVE: &str = include_str!("../../../shaders/f16_native.wgsl");
const MATVEC: &str = include_str!("../../../shaders/matvec.wgsl");
const MATVEC_TREE: &str = include_str!("../../../shaders/matvec_tree.wgsl");
const MATVEC_SUBGROUP: &str = include_str!("../../../shaders/matvec_subgroup.wgsl");
const MATVEC_FLOAT_SEQ: &str = include_str!("../../../shaders/matvec_float_seq.wgsl");
const EXACT: &str = include_str!("../../../shaders/exact.wgsl");
const K4: &str = include_str!("../../../shaders/quant/k4.wgsl");
const LUT: &str = include_str!("../../../shaders/quant/lut.wgsl");
const ACT_QUANT: &str = include_str!("../../../shaders/act_quant.wgsl");
const RMS_NORM: &str = include_str!("../../../shaders/rms_norm.wgsl");
const ROPE: &str = include_str!("../../../shaders/rope.wgsl");
const KV_STORE: &str = include_str!("../../../shaders/kv_store.wgsl");
const ATTENTION: &str = include_str!("../../../shaders/attention.wgsl");
const ELEMENTWISE: &str = include_str!("../../../shaders/elementwise.wgsl");
const DELTA_NET: &str = include_str!("../../../shaders/delta_net.wgsl");
const VISION: &str = include_str!("../../../shaders/vision.wgsl");
const ROUTE: &str = include_str!("../../../shaders/route.wgsl");

/// The WGSL block-dot source for a weight type (appended to matvec.wgsl).
fn quant_source(ty: GgmlType) -> Option<String> {
    use GgmlType::*;
    let s = match ty {
        F32 => include_str!("../../../shaders/quant/f32.wgsl"),
        F16 => include_str!("../../../shaders/quant/f16.wgsl"),
        BF16 => include_str!("../../../shaders/quant/bf16.wgsl"),
        Q4_0 => include_str!("../../../shaders/quant/q4_0.wgsl"),
        Q4_1 => include_str!("../../../shaders/quant/q4_1.wgsl"),
        Q5_0 => include_str!("../../../shaders/quant/q5_0.wgsl"),
        Q5_1 => include_str!("../../../shaders/quant/q5_1.wgsl"),
        Q8_0 => include_str!("../../../shaders/quant/q8_0.wgsl"),
        Q2K => include_str!("../../../shaders/quant/q2_k.wgsl"),
        Q3K => include_str!("../../../shaders/quant/q3_k.wgsl"),
        Q4K => return Some(format!("{K4}\n{}", include_str!("../../../shaders/quant/q4_k.wgsl"))),
        Q5K => return Some(format!("{K4}\n{}", include_str!("../../../shaders/quant/q5_k.wgsl"))),
        Q6K => include_str!("../../../shaders/quant/q6_k.wgsl"),
        IQ4NL => return Some(format!("{LUT}\n{}", include_str!("../../../shaders/quant/iq4_nl.wgsl"))),
        IQ4XS => return Some(format!("{LUT}\n{}", include_str!("../../../shaders/quant/iq4_xs.wgsl"))),
        MXFP4 => return Some(format!("{LUT}\n{}", include_str!("../../../shaders/quant/mxfp4.wgsl"))),
        _ => return None,
    };
    Some(s.to_string())
}

/// Weight types the GPU matvec supports.
pub fn supports(ty: GgmlType) -> bool {
    quant_source(ty).is_some()
}

/// A binding of a kernel's layout: a buffer the caller names, or the recorder's arena at a
/// dynamic offset (the kernel's parameters, an index list), so one bind group serves every
/// dispatch with the same buffers.
#[derive(Clone, Copy, PartialEq)]
enum Bind {
    Read,
    ReadWrite,
    /// The parameters: a uniform of [`PARAM_BYTES`] in the arena.
    Uniform,
    /// An index list: a storage read of [`LIST_BYTES`] in the arena.
    List,
}

/// A bind group layout and what each of its bindings is.
struct Layout {
    id: u8,
    layout: wgpu::BindGroupLayout,
    binds: Vec<Bind>,
}

struct Kernel {
    layout: Layout,
    pipelines: HashMap<&'static str, wgpu::ComputePipeline>,
}

impl Kernel {
    fn new(ctx: &GpuContext, prelude: &str, name: &str, src: &str, binds: &[Bind], entries: &[&'static str], id: u8) -> Self {
        let layout = Layout { id, layout: bind_layout(ctx, name, binds), binds: binds.to_vec() };
        let layout_ref = &layout.layout;
        let module = ctx.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(format!("{prelude}\n{src}").into()),
        });
        let pl = ctx.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor { label: Some(name), bind_group_layouts: &[Some(layout_ref)], immediate_size: 0 });
        let pipelines = entries
            .iter()
            .map(|&e| {
                let p = ctx.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(e),
                    layout: Some(&pl),
                    module: &module,
                    entry_point: Some(e),
                    compilation_options: Default::default(),
                    cache: None,
                });
                (e, p)
            })
            .collect();
        Self { layout, pipelines }
    }
}

fn bind_layout(ctx: &GpuContext, name: &str, binds: &[Bind]) -> wgpu::BindGroupLayout {
    let entries: Vec<wgpu::BindGroupLayoutEntry> = binds
        .iter()
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupLayoutEntry {
            binding: i as u32,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: match b {
                    Bind::Read | Bind::List => wgpu::BufferBindingType::Storage { read_only: true },
                    Bind::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                    Bind::Uniform => wgpu::BufferBindingType::Uniform,
                },
                has_dynamic_offset: matches!(b, Bind::Uniform | Bind::List),
                min_binding_size: None,
            },
            count: None,
        })
        .collect();
    ctx.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(name), entries: &entries })
}

/// A buffer region as a kernel argument: (buffer, offset in f32 elements or bytes as documented).
pub type Buf<'a> = &'a wgpu::Buffer;

/// All pipelines of the backend. Matvec pipelines are compiled on first use per weight type.
pub struct Kernels {
    matvec_layout: Layout,
    /// Bind groups made so far, by layout, arena and buffers ([`BindCache`]).
    pub bind_cache: BindCache,
    matvec: Mutex<HashMap<(GgmlType, Reduce), std::sync::Arc<wgpu::ComputePipeline>>>,
    act: Kernel,
    norm: Kernel,
    rope: Kernel,
    kv: Kernel,
    attn: Kernel,
    ew: Kernel,
    /// Gated DeltaNet kernels, compiled on first use (only hybrid models need them).
    dn: std::sync::OnceLock<Kernel>,
    /// Vision encoder kernels (shaders/vision.wgsl), compiled on first use.
    vis: std::sync::OnceLock<Kernel>,
    /// The router on the device (shaders/route.wgsl), compiled on first use.
    route: std::sync::OnceLock<Kernel>,
    /// Bound where a kernel does not use a binding.
    pub dummy: wgpu::Buffer,
    pub dummy2: wgpu::Buffer,
    /// Most threads per matvec row (see matvec.wgsl).
    pub max_tpr: usize,
    /// Reduce rows with subgroupAdd when a row has the whole workgroup (the device has the
    /// `subgroups` feature and subgroups of at most 64 lanes).
    pub use_subgroups: bool,
    /// The f16 variant is in use (see [`Self::with_f16`]).
    f16: bool,
    /// What every shader starts with (the f16 conversions and common.wgsl).
    prelude: String,
}

/// How a matvec sums a row's block contributions (the entry-point file appended to matvec.wgsl).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Reduce {
    /// Per-thread partial sums, then a shared-memory tree (matvec_tree.wgsl). With one thread per
    /// row this is the CPU's order.
    Tree,
    /// Per-thread partial sums, then subgroupAdd (matvec_subgroup.wgsl).
    Subgroup,
    /// F32/F16/BF16 weights, one thread per row, in the CPU's eight-accumulator order
    /// (matvec_float_seq.wgsl).
    FloatSeq,
}

/// Bind groups by (layout, arena, buffers): made once, reused by every later dispatch with the
/// same buffers (parameters come at dynamic offsets). A bind group keeps its buffers alive, so
/// the cache is emptied when the expert pool drops slots ([`Self::clear`]) and when it grows
/// past [`BIND_CACHE_MAX`] entries.
#[derive(Clone, Default)]
pub struct BindCache(std::sync::Arc<Mutex<HashMap<(u8, wgpu::Buffer, Vec<wgpu::Buffer>), wgpu::BindGroup>>>);

/// Most cached bind groups (SmolMoE-32x2 resident uses ~3,000 after every expert has run).
pub const BIND_CACHE_MAX: usize = 16384;

impl BindCache {
    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn bytes_of(words: &[u32]) -> Vec<u8> {
    bytemuck::cast_slice(words).to_vec()
}

/// A kernel's index list: the host's words (uploaded in the arena after the parameters), or
/// already on the device (the router's output, route.wgsl): `buf` from byte `at` (a multiple of
/// 256, bound at a dynamic offset), the list `word` words further in.
#[derive(Clone, Copy)]
pub enum List<'a> {
    Host(&'a [u32]),
    Device { buf: &'a wgpu::Buffer, at: u32, word: u32 },
}

/// `(a, b)` pairs as one list of words: a0, b0, a1, b1, …
pub fn pair_words(pairs: &[(u32, u32)]) -> Vec<u32> {
    pairs.iter().flat_map(|&(a, b)| [a, b]).collect()
}

/// An index list of `words` u32 fits one list binding ([`LIST_BYTES`]).
fn list_fits(kernel: &str, words: usize) -> Result<(), GpuError> {
    if 4 * words as u64 > LIST_BYTES {
        return Err(GpuError::Limit { what: format!("the index list of '{kernel}'"), need: 4 * words as u64, have: LIST_BYTES });
    }
    Ok(())
}

/// A host list has `words` words and fits its binding (a device list is the router's: sized).
fn host_list_fits(kernel: &str, list: List<'_>, words: usize) -> Result<(), GpuError> {
    match list {
        List::Host(l) if l.len() != words => Err(GpuError::Validation(format!("{kernel}: {} list words, {words} expected", l.len()))),
        List::Host(l) => list_fits(kernel, l.len()),
        List::Device { .. } => Ok(()),
    }
}

/// Push the parameters `item` into the arena with a host list 256 bytes after them; returns the
/// parameters' offset, the list's offset (in the arena, or the device list's `at`) and the
/// device list's buffer.
fn push_with_list<'b>(rec: &mut Recorder<'_>, mut item: Vec<u8>, list: List<'b>) -> (u32, u32, Option<&'b wgpu::Buffer>) {
    match list {
        List::Host(l) if !l.is_empty() => {
            item.resize(256, 0);
            item.extend_from_slice(&bytes_of(l));
            let at = rec.push(&item).0 as u32;
            (at, at + 256, None)
        }
        List::Host(_) => (rec.push(&item).0 as u32, 0, None),
        List::Device { buf, at, .. } => (rec.push(&item).0 as u32, at, Some(buf)),
    }
}

/// Workgroups for `n` invocations of 64 threads, spread over x and y when x would exceed the limit.
fn groups_1d(n: usize) -> (u32, u32, u32) {
    let g = n.div_ceil(64).max(1);
    if g <= 65535 {
        (g as u32, 1, 1)
    } else {
        (65535, g.div_ceil(65535) as u32, 1)
    }
}

impl Kernels {
    /// Every pipeline, with native f16 conversions where the device has `shader-f16` (unless
    /// `LES_NO_F16` is set).
    pub fn new(ctx: &GpuContext) -> Self {
        let f16 = ctx.device.features().contains(wgpu::Features::SHADER_F16) && std::env::var_os("LES_NO_F16").is_none();
        Self::with_f16(ctx, f16)
    }

    /// Every pipeline; `f16`: the f16 variant (shaders/f16_native.wgsl: the hardware's f16 type
    /// for f32 <-> f16 conversions, needs `shader-f16`) instead of integer emulation
    /// (f16_emul.wgsl). Both give the same bits where the hardware rounds to nearest even.
    pub fn with_f16(ctx: &GpuContext, f16: bool) -> Self {
        use Bind::*;
        let prelude = format!("{}\n{COMMON}", if f16 { F16_NATIVE } else { F16_EMUL });
        let p = prelude.as_str();
        let act = Kernel::new(ctx, p, "act_quant", ACT_QUANT, &[Read, ReadWrite, Uniform], &["quant_q8_0", "quant_q8_1", "quant_q8_k", "quant_f16", "quant_bf16"], 1);
        let norm = Kernel::new(ctx, p, "rms_norm", &format!("{EXACT}\n{RMS_NORM}"), &[ReadWrite, Read, ReadWrite, Uniform], &["main", "inplace"], 2);
        let rope = Kernel::new(ctx, p, "rope", &format!("{EXACT}\n{ROPE}"), &[ReadWrite, Read, Uniform], &["main"], 3);
        let kv = Kernel::new(ctx, p, "kv_store", KV_STORE, &[Read, Read, ReadWrite, ReadWrite, Uniform], &["main"], 4);
        let attn = Kernel::new(ctx, p, "attention", &format!("{EXACT}\n{ATTENTION}"), &[Read, Read, Read, ReadWrite, ReadWrite, Uniform, Read], &["scores", "factors", "softmax_v"], 5);
        let ew = Kernel::new(ctx, p, "elementwise", &format!("{EXACT}\n{ELEMENTWISE}"), &[Read, Read, ReadWrite, List, Uniform], &["add", "swiglu", "swiglu_oai", "reglu", "gather", "scatter", "combine", "combine_w", "add_rows", "gate_add", "expf", "gate_add_exp", "mul", "mul_sigmoid", "mul_silu"], 6);
        let mv_binds = [Read, Read, ReadWrite, Uniform, List];
        let matvec_layout = Layout { id: 0, layout: bind_layout(ctx, "matvec", &mv_binds), binds: mv_binds.to_vec() };
        let mk = |l| ctx.device.create_buffer(&wgpu::BufferDescriptor { label: Some(l), size: 256, usage: wgpu::BufferUsages::STORAGE, mapped_at_creation: false });
        Self {
            matvec_layout,
            bind_cache: BindCache::default(),
            matvec: Mutex::new(HashMap::new()),
            act,
            norm,
            rope,
            kv,
            attn,
            ew,
            dn: std::sync::OnceLock::new(),
            vis: std::sync::OnceLock::new(),
            route: std::sync::OnceLock::new(),
            dummy: mk("dummy"),
            dummy2: mk("dummy2"),
            max_tpr: Self::default_tpr(ctx),
            use_subgroups: ctx.device.features().contains(wgpu::Features::SUBGROUP) && ctx.info.subgroup_min_size >= 1 && ctx.info.subgroup_max_size <= 64,
            f16,
            prelude,
        }
    }

    /// Whether the kernels use the f16 variant.
    pub fn uses_f16(&self) -> bool {
        self.f16
    }

    /// Threads per matvec row: a software rasterizer (lavapipe, SwiftShader) runs a workgroup's
    /// barriers as coroutine switches, so one thread per row is fastest there (4.4x on Q4_1,
    /// examples/gpu_prof.rs); hardware GPUs get up to 64 threads per row. `LES_TPR` overrides.
    fn default_tpr(ctx: &GpuContext) -> usize {
        if let Some(v) = std::env::var("LES_TPR").ok().and_then(|v| v.parse::<usize>().ok()) {
            return v.clamp(1, 64).next_power_of_two();
        }
        if ctx.info.device_type == wgpu::DeviceType::Cpu {
            1
        } else {
            64
        }
    }

    fn matvec_pipeline(&self, ctx: &GpuContext, ty: GgmlType, reduce: Reduce) -> Result<std::sync::Arc<wgpu::ComputePipeline>, GpuError> {
        let mut m = self.matvec.lock().unwrap();
        if let Some(p) = m.get(&(ty, reduce)) {
            return Ok(p.clone());
        }
        let q = quant_source(ty).ok_or(GpuError::Unsupported(ty.name()))?;
        let entry = match reduce {
            Reduce::Tree => MATVEC_TREE,
            Reduce::Subgroup => MATVEC_SUBGROUP,
            Reduce::FloatSeq => MATVEC_FLOAT_SEQ,
        };
        let src = format!("{}\n{EXACT}\n{MATVEC}\n{entry}\n{q}", self.prelude);
        let module = ctx.device.create_shader_module(wgpu::ShaderModuleDescriptor { label: Some("matvec"), source: wgpu::ShaderSource::Wgsl(src.into()) });
        let pl = ctx.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor { label: Some("matvec"), bind_group_layouts: &[Some(&self.matvec_layout.layout)], immediate_size: 0 });
        let p = std::sync::Arc::new(ctx.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(ty.name()),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        }));
        m.insert((ty, reduce), p.clone());
        Ok(p)
    }

    /// The bind group of `layout` with `bufs` (whole buffers, in binding order, the arena's
    /// bindings left out), from the cache or made once.
    fn bind(&self, rec: &Recorder<'_>, layout: &Layout, bufs: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        self.bind_list(rec, layout, bufs, None)
    }

    /// [`Self::bind`] with the list binding on `list` (a device buffer: the router's output)
    /// instead of the arena.
    fn bind_list(&self, rec: &Recorder<'_>, layout: &Layout, bufs: &[&wgpu::Buffer], list: Option<&wgpu::Buffer>) -> wgpu::BindGroup {
        let arena = rec.arena();
        let mut key_bufs: Vec<wgpu::Buffer> = bufs.iter().map(|&b| b.clone()).collect();
        key_bufs.extend(list.cloned());
        let key = (layout.id | if list.is_some() { 0x80 } else { 0 }, arena.clone(), key_bufs);
        let mut cache = self.bind_cache.0.lock().unwrap();
        if let Some(bg) = cache.get(&key) {
            return bg.clone();
        }
        let mut it = bufs.iter();
        let entries: Vec<wgpu::BindGroupEntry> = layout
            .binds
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let resource = match b {
                    Bind::Uniform => wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer: arena, offset: 0, size: wgpu::BufferSize::new(PARAM_BYTES) }),
                    Bind::List => wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer: list.unwrap_or(arena), offset: 0, size: wgpu::BufferSize::new(LIST_BYTES) }),
                    _ => it.next().expect("a buffer for every binding").as_entire_binding(),
                };
                wgpu::BindGroupEntry { binding: i as u32, resource }
            })
            .collect();
        let bg = rec.ctx.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &layout.layout, entries: &entries });
        if cache.len() >= BIND_CACHE_MAX {
            cache.clear();
        }
        cache.insert(key, bg.clone());
        bg
    }

    /// `y[t * y_stride + y_off + r] = dot(W row r, A row t)` for `rows` rows and `n_tok` tokens.
    /// `w_off` / `a_off` are byte offsets; `a` holds rows of `a_row_bytes` in the weight type's
    /// vec_dot_type (see [`Self::quant_act`]).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec(&self, rec: &mut Recorder<'_>, ty: GgmlType, cols: usize, rows: usize, w: Buf, w_off: u64, a: Buf, a_off: u64, y: Buf, y_off: usize, y_stride: usize, n_tok: usize) -> Result<(), GpuError> {
        self.matvec_any(rec, ty, cols, rows, w, w_off, a, a_off, None, y, y_off, y_stride, n_tok, List::Host(&[]))
    }

    /// The `mul_mat_id` form: for each of the `n` `(base, row)` pairs of `list`,
    /// `y[row * y_stride + y_off + r] = dot(W row r at byte w_off + base, A row a)`, where `a` is
    /// `row` when `a_per_row`, else 0 (one activation row for every expert) — the routed experts
    /// of a decode token in one dispatch, from the slots of one slab. A device list must start
    /// at its binding (`word` 0).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_id(&self, rec: &mut Recorder<'_>, ty: GgmlType, cols: usize, rows: usize, w: Buf, w_off: u64, a: Buf, a_per_row: bool, y: Buf, y_off: usize, y_stride: usize, list: List<'_>, n: usize) -> Result<(), GpuError> {
        match list {
            List::Host(l) if l.len() != 2 * n => return Err(GpuError::Validation(format!("matvec_id: {} words for {n} pairs", l.len()))),
            List::Host(l) => list_fits("matvec_id", l.len())?,
            List::Device { word, .. } if word != 0 => return Err(GpuError::Validation("matvec_id reads its list from the start of its binding".into())),
            List::Device { .. } => {}
        }
        self.matvec_any(rec, ty, cols, rows, w, w_off, a, 0, Some(a_per_row), y, y_off, y_stride, n, list)
    }

    #[allow(clippy::too_many_arguments)]
    fn matvec_any(&self, rec: &mut Recorder<'_>, ty: GgmlType, cols: usize, rows: usize, w: Buf, w_off: u64, a: Buf, a_off: u64, a_per_row: Option<bool>, y: Buf, y_off: usize, y_stride: usize, n_tok: usize, list: List<'_>) -> Result<(), GpuError> {
        let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        if float && cols % 4 != 0 {
            return Err(GpuError::Validation(format!("{} matvec needs a multiple of 4 columns, got {cols}", ty.name())));
        }
        // Float kernels take four elements per "block".
        let n_blocks = if float { cols / 4 } else { cols / ty.block_size() };
        let tpr = n_blocks.next_power_of_two().clamp(1, self.max_tpr);
        let groups = rows.div_ceil(64 / tpr);
        let reduce = if float && tpr == 1 {
            Reduce::FloatSeq
        } else if self.use_subgroups && tpr == 64 {
            Reduce::Subgroup
        } else {
            Reduce::Tree
        };
        let p = self.matvec_pipeline(rec.ctx, ty, reduce)?;
        let w_row = ty.row_bytes(cols as u64).unwrap_or(0) as u32;
        let a_row = match a_per_row {
            Some(false) => 0,
            _ => vec_dot_type(ty).row_bytes(cols as u64).unwrap_or(0) as u32,
        };
        let grid_x = groups.min(65535);
        let grid_y = groups.div_ceil(grid_x);
        let item = bytes_of(&[rows as u32, n_blocks as u32, w_row, a_row, w_off as u32, a_off as u32, y_off as u32, y_stride as u32, grid_x as u32, n_tok as u32, tpr as u32, 0, a_per_row.is_some() as u32, 0, 0, 0]);
        let (at, list_off, dev) = push_with_list(rec, item, list);
        let bg = self.bind_list(rec, &self.matvec_layout, &[w, a, y], dev);
        rec.dispatch(&p, &bg, &[at, list_off], (grid_x as u32, grid_y as u32, n_tok as u32));
        Ok(())
    }

    /// Convert `n_tok` rows of `cols` f32 values (at element `x_off`) to `act_ty` (Q8_0, Q8_1,
    /// Q8_K, F16 or BF16) at byte offset `o_off` of `o`, rows of `act_ty.row_bytes(cols)` bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn quant_act(&self, rec: &mut Recorder<'_>, act_ty: GgmlType, x: Buf, x_off: usize, cols: usize, n_tok: usize, o: Buf, o_off: u64) -> Result<(), GpuError> {
        let entry = match act_ty {
            GgmlType::Q8_0 => "quant_q8_0",
            GgmlType::Q8_1 => "quant_q8_1",
            GgmlType::Q8K => "quant_q8_k",
            GgmlType::F16 => "quant_f16",
            GgmlType::BF16 => "quant_bf16",
            _ => return Err(GpuError::Unsupported(act_ty.name())),
        };
        // No clear: each row's workgroup zeroes its own bytes first (act_quant.wgsl).
        let row = act_ty.row_bytes(cols as u64).unwrap_or(0);
        let prm = rec.push(&bytes_of(&[cols as u32, n_tok as u32, x_off as u32, o_off as u32, row as u32, 0, 0, 0]));
        let bg = self.bind(rec, &self.act.layout, &[x, o]);
        rec.dispatch(&self.act.pipelines[entry], &bg, &[prm.0 as u32], (n_tok as u32, 1, 1));
        Ok(())
    }

    /// RMSNorm of `rows` rows of `n` values: `y[r] = x[r] / rms(x[r]) * w`. In place when `y` is None.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(&self, rec: &mut Recorder<'_>, x: Buf, x_off: usize, w: Buf, n: usize, rows: usize, eps: f32, y: Option<(Buf, usize)>) {
        let (entry, yb, y_off) = match y {
            Some((b, o)) => ("main", b, o),
            None => ("inplace", &self.dummy, 0),
        };
        self.norm_rows(rec, entry, x, w, yb, [n as u32, rows as u32, x_off as u32, y_off as u32, eps.to_bits(), 0, 0, 0, 0, 0, 0, 0]);
    }

    fn norm_rows(&self, rec: &mut Recorder<'_>, entry: &str, x: Buf, w: Buf, y: Buf, words: [u32; 12]) {
        let prm = rec.push(&bytes_of(&words));
        let bg = self.bind(rec, &self.norm.layout, &[x, w, y]);
        rec.dispatch(&self.norm.pipelines[entry], &bg, &[prm.0 as u32], (words[1], 1, 1));
    }

    /// RoPE in place on `n_tok` rows of `n_head` heads; `cs` holds (cos, sin) per token and pair.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(&self, rec: &mut Recorder<'_>, x: Buf, x_off: usize, cs: Buf, n_head: usize, head_dim: usize, n_rot: usize, neox: bool, n_tok: usize) {
        let prm = rec.push(&bytes_of(&[n_head as u32, head_dim as u32, n_rot as u32, neox as u32, x_off as u32, n_tok as u32, 0, 0]));
        let bg = self.bind(rec, &self.rope.layout, &[x, cs]);
        rec.dispatch(&self.rope.pipelines["main"], &bg, &[prm.0 as u32], (n_tok as u32, 1, 1));
    }

    /// Store K/V rows (`n_tok` rows of `n_head_kv * head_dim`) at positions `pos0..` of the slot
    /// at u32 word `off` of `kc`/`vc` holding `cells` positions per KV head (position `p` in cell
    /// `p mod cells`: a sliding-window layer's ring).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(&self, rec: &mut Recorder<'_>, k: Buf, v: Buf, kc: Buf, vc: Buf, n_head_kv: usize, head_dim: usize, cells: usize, off: usize, pos0: usize, n_tok: usize) {
        let prm = rec.push(&bytes_of(&[n_head_kv as u32, head_dim as u32, cells as u32, off as u32, pos0 as u32, n_tok as u32, 0, 0]));
        let bg = self.bind(rec, &self.kv.layout, &[k, v, kc, vc]);
        rec.dispatch(&self.kv.pipelines["main"], &bg, &[prm.0 as u32], (n_tok as u32, 1, 1));
    }

    /// Causal attention for `n_tok` query rows at positions `pos0..` over the KV slot at u32 word
    /// `off` with `cells` positions per KV head (as [`Self::kv_store`]).
    /// `scores` needs `n_tok * n_head * (pos0 + n_tok + 1)` f32 values.
    /// `window`: sliding window (0: none); `sinks`: one logit per head (attention sinks).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(&self, rec: &mut Recorder<'_>, q: Buf, kc: Buf, vc: Buf, o: Buf, scores: Buf, n_head: usize, n_head_kv: usize, head_dim: usize, cells: usize, off: usize, pos0: usize, n_tok: usize, scale: f32, window: usize, sinks: Option<Buf>) {
        self.attention_blocks(rec, q, kc, vc, o, scores, [n_head, n_head_kv, head_dim, cells, off, pos0, n_tok], scale, window, sinks, 0);
    }

    /// [`Self::attention`] with `block` > 0: no causal mask, query t sees the rows of its block of
    /// `block` (pos0 0; a vision encoder's self-attention: block = n_tok for all rows).
    /// `dims`: n_head, n_head_kv, head_dim, cells, off, pos0, n_tok.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_blocks(&self, rec: &mut Recorder<'_>, q: Buf, kc: Buf, vc: Buf, o: Buf, scores: Buf, dims: [usize; 7], scale: f32, window: usize, sinks: Option<Buf>, block: usize) {
        let [n_head, n_head_kv, head_dim, cells, off, pos0, n_tok] = dims;
        let words = [n_head as u32, n_head_kv as u32, head_dim as u32, cells as u32, off as u32, pos0 as u32, n_tok as u32, scale.to_bits(), 0, 0, 0, 0, window as u32, sinks.is_some() as u32, block as u32, 0];
        let prm = rec.push(&bytes_of(&words));
        let bg = self.bind(rec, &self.attn.layout, &[q, kc, vc, o, scores, sinks.unwrap_or(&self.dummy)]);
        let off = [prm.0 as u32];
        rec.dispatch(&self.attn.pipelines["scores"], &bg, &off, groups_1d(n_tok * n_head * (pos0 + n_tok)));
        rec.dispatch(&self.attn.pipelines["factors"], &bg, &off, groups_1d(n_tok * n_head));
        rec.dispatch(&self.attn.pipelines["softmax_v"], &bg, &off, (n_tok as u32, n_head as u32, 1));
    }

    #[allow(clippy::too_many_arguments)]
    fn vision(&self, rec: &mut Recorder<'_>, entry: &str, x: Buf, a: Buf, b: Buf, y: Buf, words: [u32; 8], groups: (u32, u32, u32)) {
        use Bind::*;
        let k = self.vis.get_or_init(|| Kernel::new(rec.ctx, &self.prelude, "vision", &format!("{EXACT}\n{VISION}"), &[Read, Read, Read, ReadWrite, Uniform], &["layer_norm", "gelu_tanh", "gelu_erf", "place", "scale"], 7));
        let prm = rec.push(&bytes_of(&words));
        let bg = self.bind(rec, &k.layout, &[x, a, b, y]);
        rec.dispatch(&k.pipelines[entry], &bg, &[prm.0 as u32], groups);
    }

    /// Layer norm of `rows` rows of `n` (shaders/vision.wgsl): `y = norm(x) · w (+ b)`.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(&self, rec: &mut Recorder<'_>, x: Buf, w: Buf, b: Option<Buf>, y: Buf, n: usize, rows: usize, eps: f32) {
        let words = [n as u32, rows as u32, eps.to_bits(), b.is_some() as u32, 0, 0, 0, 0];
        self.vision(rec, "layer_norm", x, w, b.unwrap_or(&self.dummy), y, words, (rows as u32, 1, 1));
    }

    /// GELU in place on `n` values: `tab` (the f16 table, two per u32) for the tanh form, `None`
    /// for the erf form.
    pub fn gelu(&self, rec: &mut Recorder<'_>, y: Buf, n: usize, tab: Option<Buf>) {
        let entry = if tab.is_some() { "gelu_tanh" } else { "gelu_erf" };
        self.vision(rec, entry, &self.dummy, tab.unwrap_or(&self.dummy), &self.dummy, y, [n as u32, 1, 0, 0, 0, 0, 0, 0], groups_1d(n));
    }

    /// `y[r · k + c0 + c] = x[r · n + c]` for `rows` rows (a part of a column concatenation).
    #[allow(clippy::too_many_arguments)]
    pub fn place(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize, rows: usize, k: usize, c0: usize) {
        self.vision(rec, "place", x, &self.dummy, &self.dummy, y, [n as u32, rows as u32, 0, 0, k as u32, c0 as u32, 0, 0], groups_1d(n * rows));
    }

    /// `y[i] *= s` for `n` values.
    pub fn scale(&self, rec: &mut Recorder<'_>, y: Buf, n: usize, s: f32) {
        self.vision(rec, "scale", &self.dummy, &self.dummy, &self.dummy, y, [n as u32, 1, s.to_bits(), 0, 0, 0, 0, 0], groups_1d(n));
    }

    /// An element-wise kernel; `extra`: its index list (at most [`LIST_BYTES`]: [`list_fits`]).
    #[allow(clippy::too_many_arguments)]
    fn ew(&self, rec: &mut Recorder<'_>, entry: &str, x: Buf, x2: Buf, y: Buf, words: [u32; 8], extra: &[u32], count: usize) {
        self.ew_list(rec, entry, x, x2, y, words, List::Host(extra), count);
    }

    /// An element-wise kernel with its index list wherever it is (a device list's word offset
    /// becomes the parameters' `idx_off`, `words[6]`).
    #[allow(clippy::too_many_arguments)]
    fn ew_list(&self, rec: &mut Recorder<'_>, entry: &str, x: Buf, x2: Buf, y: Buf, mut words: [u32; 8], list: List<'_>, count: usize) {
        if let List::Device { word, .. } = list {
            words[6] = word;
        }
        let (at, list_off, dev) = push_with_list(rec, bytes_of(&words), list);
        let bg = self.bind_list(rec, &self.ew.layout, &[x, x2, y], dev);
        rec.dispatch(&self.ew.pipelines[entry], &bg, &[list_off, at], groups_1d(count));
    }

    /// `y[y_off + i] += x[x_off + (i % period or i)]` for `n` values (period 0: none).
    pub fn add(&self, rec: &mut Recorder<'_>, x: Buf, x_off: usize, y: Buf, y_off: usize, n: usize, period: usize) {
        self.ew(rec, "add", x, &self.dummy, y, [n as u32, 1, x_off as u32, y_off as u32, 0, period as u32, 0, 0], &[], n);
    }

    /// `y[i] = e^x[i]` for `n` values, as the CPU's `cmath::expf` (glibc) computes it: the
    /// emulation attention and the qwen2moe gate use, on its own for tests.
    pub fn expf(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize) {
        self.ew(rec, "expf", x, &self.dummy, y, [n as u32, 1, 0, 0, 0, 0, 0, 0], &[], n);
    }

    /// `y[i] = silu(g[i]) * u[i]` for `n` values.
    pub fn swiglu(&self, rec: &mut Recorder<'_>, g: Buf, u: Buf, y: Buf, n: usize) {
        self.glu(rec, g, u, 0, y, n, ExpertAct::Silu);
    }

    /// The experts' gated activation `act` of gate values `g` and up values `u`, `n` of each
    /// (`u_off` values into `u`): [`crate::backend::cpu::ops::swiglu`], `swiglu_oai` (gpt-oss)
    /// or `reglu` (smallthinker).
    pub fn glu(&self, rec: &mut Recorder<'_>, g: Buf, u: Buf, u_off: usize, y: Buf, n: usize, act: ExpertAct) {
        let (entry, a, b) = match act {
            ExpertAct::Silu => ("swiglu", 0, 0),
            ExpertAct::SwigluOai { alpha, limit } => ("swiglu_oai", alpha.to_bits(), limit.to_bits()),
            ExpertAct::Relu => ("reglu", 0, 0),
        };
        self.ew(rec, entry, g, u, y, [n as u32, 1, 0, 0, u_off as u32, a, b, 0], &[], n);
    }

    /// `y[r] = x[idx[r]]`, rows of `n`.
    pub fn gather(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize, idx: &[u32]) -> Result<(), GpuError> {
        list_fits("gather", idx.len())?;
        self.ew(rec, "gather", x, &self.dummy, y, [n as u32, idx.len() as u32, 0, 0, 0, 0, 0, 0], idx, n * idx.len());
        Ok(())
    }

    /// `y[idx[r]] = x[r] * w[r]`, rows of `n`.
    pub fn scatter(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize, idx: &[u32], w: &[f32]) -> Result<(), GpuError> {
        list_fits("scatter", 2 * idx.len())?;
        let mut list = idx.to_vec();
        list.extend(w.iter().map(|v| v.to_bits()));
        self.ew(rec, "scatter", x, &self.dummy, y, [n as u32, idx.len() as u32, 0, 0, 0, 0, 0, 0], &list, n * idx.len());
        Ok(())
    }

    /// The router of a decode token on the device (shaders/route.wgsl): logits at element
    /// `logits_off` of `logits` → the layer's region (word `out_word`) of `out`: the expert
    /// kernels' lists, the weights, the ids. `slot_of`: the pool's table (from word `table_off`).
    #[allow(clippy::too_many_arguments)]
    /// `sel_bias`: a selection bias (`n_expert` values) added for the top-k choice only.
    pub fn route(&self, rec: &mut Recorder<'_>, logits: Buf, logits_off: usize, slot_of: Buf, table_off: usize, out: Buf, out_word: usize, spec: &crate::backend::ops::RouteSpec, up_delta: u32, sel_bias: Option<Buf>) {
        use Bind::*;
        let k = self.route.get_or_init(|| Kernel::new(rec.ctx, &self.prelude, "route", &format!("{EXACT}\n{ROUTE}"), &[Read, Read, ReadWrite, Read, Uniform], &["main"], 9));
        let gating = match spec.gating {
            crate::backend::ops::Gating::Softmax => 0u32,
            crate::backend::ops::Gating::SoftmaxWeight => 1,
            crate::backend::ops::Gating::Sigmoid => 2,
        };
        let words = [spec.n_expert as u32, spec.k as u32, gating, spec.norm_topk as u32, spec.scale.to_bits(), table_off as u32, out_word as u32, up_delta, logits_off as u32, 0, sel_bias.is_some() as u32, 0];
        let prm = rec.push(&bytes_of(&words));
        let bg = self.bind(rec, &k.layout, &[logits, slot_of, out, sel_bias.unwrap_or(&self.dummy)]);
        rec.dispatch(&k.pipelines["main"], &bg, &[prm.0 as u32], (1, 1, 1));
    }

    /// `y = sum_r x[r] * w[r]` over `k` rows of `x` in rank order, the weights' bits in `w`
    /// (each product rounded to f32 first, as `scatter` then `combine` compute it): a decode
    /// token's routed experts weighted and combined, `n` values.
    pub fn combine_w(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize, w: List<'_>, k: usize) -> Result<(), GpuError> {
        host_list_fits("combine_w", w, k)?;
        self.ew_list(rec, "combine_w", x, &self.dummy, y, [n as u32, 1, 0, 0, 0, k as u32, 0, 0], w, n);
        Ok(())
    }

    /// `y[y_off + row * n + c] += b[ex * n + c]` for each of the `k` `(row, ex)` pairs of
    /// `pairs` (ggml `add_id`: each routed expert's bias row added to its own output row).
    #[allow(clippy::too_many_arguments)]
    pub fn add_rows(&self, rec: &mut Recorder<'_>, b: Buf, y: Buf, y_off: usize, n: usize, pairs: List<'_>, k: usize) -> Result<(), GpuError> {
        host_list_fits("add_rows", pairs, 2 * k)?;
        self.ew_list(rec, "add_rows", b, &self.dummy, y, [n as u32, k as u32, 0, y_off as u32, 0, 0, 0, 0], pairs, n * k);
        Ok(())
    }

    /// `y[t] = sum_r x[t * k + r]` in rank order, `rows` tokens of `n`.
    pub fn combine(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize, rows: usize, k: usize) {
        self.ew(rec, "combine", x, &self.dummy, y, [n as u32, rows as u32, 0, 0, 0, k as u32, 0, 0], &[], n * rows);
    }

    /// `y[t] += x[t] * sigmoid(g[t])`, `rows` tokens of `n`; `exp`: `1 / (1 + e^-g)` (ggml's
    /// sigmoid), else qwen2moe's `silu(g) / g`.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_add(&self, rec: &mut Recorder<'_>, x: Buf, g: Buf, y: Buf, n: usize, rows: usize, exp: bool) {
        self.ew(rec, if exp { "gate_add_exp" } else { "gate_add" }, x, g, y, [n as u32, rows as u32, 0, 0, 0, 0, 0, 0], &[], n * rows);
    }

    /// `y[i] *= sigmoid(x[i])` (ggml's sigmoid) for `n` values.
    /// `y[i] *= x[i]` for `n` values (ggml `mul`).
    pub fn mul(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize) {
        self.ew(rec, "mul", x, &self.dummy, y, [n as u32, 1, 0, 0, 0, 0, 0, 0], &[], n);
    }

    pub fn mul_sigmoid(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize) {
        self.ew(rec, "mul_sigmoid", x, &self.dummy, y, [n as u32, 1, 0, 0, 0, 0, 0, 0], &[], n);
    }

    /// `y[i] *= silu(x[i])` for `n` values.
    pub fn mul_silu(&self, rec: &mut Recorder<'_>, x: Buf, y: Buf, n: usize) {
        self.ew(rec, "mul_silu", x, &self.dummy, y, [n as u32, 1, 0, 0, 0, 0, 0, 0], &[], n);
    }

    #[allow(clippy::too_many_arguments)]
    fn dn(&self, rec: &mut Recorder<'_>, entry: &str, bufs: [Buf; 7], words: [u32; 12], groups: (u32, u32, u32)) {
        use Bind::*;
        let dn = self.dn.get_or_init(|| {
            Kernel::new(rec.ctx, &self.prelude, "delta_net", &format!("{EXACT}\n{DELTA_NET}"), &[Read, Read, Read, Read, Read, ReadWrite, ReadWrite, Uniform], &["conv_silu", "delta_net"], 8)
        });
        let prm = rec.push(&bytes_of(&words));
        let bg = self.bind(rec, &dn.layout, &bufs);
        rec.dispatch(&dn.pipelines[entry], &bg, &[prm.0 as u32], groups);
    }

    /// Causal conv1d + SiLU over `n_tok` rows of `cols` channels (shaders/delta_net.wgsl
    /// `conv_silu`): `w` the layer's weights (`d_conv` per channel), `state` its conv state.
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    pub fn ssm_conv(&self, rec: &mut Recorder<'_>, x: Buf, w: Buf, state: Buf, y: Buf, cols: usize, d_conv: usize, n_tok: usize, silu: bool) {
        let d = &self.dummy;
        self.dn(rec, "conv_silu", [x, w, d, d, d, state, y], [n_tok as u32, cols as u32, d_conv as u32, silu as u32, 0, 0, 0, 0, 0, 0, 0, 0], groups_1d(cols));
    }

    /// The gated delta rule over `n_tok` rows (shaders/delta_net.wgsl `delta_net`): one
    /// workgroup per value head and block of 64 state rows (one row per thread, through every
    /// token), after rms_norm.wgsl has L2-normalised the q and k heads of `x` in place.
    #[allow(clippy::too_many_arguments)]
    pub fn delta_net(&self, rec: &mut Recorder<'_>, x: Buf, alpha: Buf, beta: Buf, dt_bias: Buf, a: Buf, state: Buf, y: Buf, n_tok: usize, hk: usize, hv: usize, s: usize, tiled: bool, eps: f32) {
        let cols = (2 * hk + hv) * s;
        // q and k L2-normalised in place (ops.rs `l2_norm`): rms_norm(eps / S) * (1 / sqrt(S)).
        let (eps_n, w_all) = (eps / s as f32, 1.0f32 / (s as f32).sqrt());
        self.norm_rows(rec, "inplace", x, &self.dummy2, &self.dummy, [s as u32, (n_tok * 2 * hk) as u32, 0, 0, eps_n.to_bits(), 0, cols as u32, (2 * hk) as u32, w_all.to_bits(), 0, 0, 0]);
        let words = [n_tok as u32, cols as u32, 0, hk as u32, hv as u32, s as u32, tiled as u32, eps.to_bits(), 0, 0, 0, 0];
        self.dn(rec, "delta_net", [x, alpha, beta, dt_bias, a, state, y], words, (hv as u32, s.div_ceil(64) as u32, 1));
    }
}
