//! Images in: a vision tower from an mmproj GGUF (llama.cpp `tools/mtmd`, `clip.cpp`), run once
//! per image, whose output rows replace token embeddings in the text model's batch.
//!
//! - [`image`]: decoding, Pillow's bicubic resampling, MiniCPM-V's slicing, normalisation.
//! - [`minicpmv`]: the `minicpmv4_6` projector (SigLIP ViT, a window-attention ViT merger after
//!   `clip.vision.wa_layer_indexes[0]`, a 2×2 DownsampleMLP merger), written against the op
//!   contract ([`crate::backend::ops::Ops`]).
//! - [`Mmproj`]: the file's hyper-parameters (`clip.*` keys, `clip-impl.h`) and weights.
//! - [`layout`]: where an image's pieces go in the prompt (mtmd's marker tokens around the
//!   overview and slices, `mtmd.cpp` `MTMD_SLICE_TMPL_MINICPMV_2_6`) and their M-RoPE positions.

pub mod image;
pub mod layout;
pub mod minicpmv;

use crate::backend::cpu::exec::CpuExec;
use crate::backend::cpu::kv::KvCache;
use crate::backend::ops::{self, OpError, Weights};
use crate::backend::wgpu::exec::{GpuBackend, GpuOptions, GpuShapes};
use crate::backend::wgpu::GpuContext;
use std::sync::Arc;
use crate::gguf::{GgufError, GgufFile};
use crate::model::{DenseStreaming, Loader, ModelError};
use crate::store::{ByteSource, StoreError};

#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("not an mmproj file: general.architecture is '{0}' (expected 'clip')")]
    NotClip(String),
    #[error("the mmproj has no vision encoder (clip.has_vision_encoder is false)")]
    NoVision,
    #[error("unsupported projector type '{0}' (LES runs minicpmv4_6)")]
    Projector(String),
    #[error("invalid mmproj hyper-parameter {key} = {value}: {why}")]
    Invalid { key: String, value: String, why: &'static str },
    #[error("the mmproj's output width {mmproj} does not match the text model's embedding width {text}")]
    Width { mmproj: usize, text: usize },
    #[error("image format {0} is not supported (PNG and JPEG are)")]
    Format(String),
    #[error("the image could not be decoded: {0}")]
    Decode(String),
    #[error("the image is empty ({w}×{h})")]
    Empty { w: u32, h: u32 },
    #[error("the image is {w}×{h}; at most {max_side} pixels per side and {max_pixels} pixels are accepted")]
    TooLarge { w: u32, h: u32, max_side: u32, max_pixels: u64 },
    #[error("the text model has no token '{0}' (the marker mtmd puts around an image)")]
    NoMarker(String),
    #[error(transparent)]
    Gpu(#[from] crate::backend::wgpu::GpuError),
}

impl From<OpError> for VisionError {
    fn from(e: OpError) -> Self {
        VisionError::Model(e.into())
    }
}

/// The FFN activation of the ViT layers (`clip.use_gelu` → GELU tanh; `clip.use_silu`; else
/// GELU-quick, llama.cpp's default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VitAct {
    Gelu,
    Silu,
    GeluQuick,
}

/// The vision hyper-parameters (`clip.vision.*`).
#[derive(Clone, Debug)]
pub struct VisionConfig {
    pub projector: String,
    pub image_size: usize,
    pub patch_size: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub eps: f32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub act: VitAct,
    /// `clip.vision.projector.scale_factor` (4: ViT merger + final merger; 2: final merger only).
    pub n_merge: usize,
    /// The layer after which the ViT merger runs (`clip.vision.wa_layer_indexes[0]`).
    pub insert_layer: usize,
}

/// Whether a tensor is one of the tower's matrices (what [`Mmproj::load_with`] can stream).
fn is_matrix(t: &crate::gguf::TensorInfo) -> bool {
    t.name.ends_with(".weight") && t.dims.len() == 2 && t.dims[1] > 1 && t.name != "v.position_embd.weight"
}

/// The read-ahead window of a tower read from storage: an eighth of its matrices' bytes, at
/// least 1 MiB, at most 16 MiB.
fn stream_window(g: &GgufFile) -> usize {
    let m: u64 = g.tensors.iter().filter(|t| is_matrix(t)).map(|t| t.size).sum();
    ((m / 8) as usize).clamp(1 << 20, 16 << 20)
}

/// A loaded mmproj: hyper-parameters and the vision tower's weights.
pub struct Mmproj {
    pub cfg: VisionConfig,
    pub weights: Weights,
    pub tower: minicpmv::Tower,
    /// The width of the embeddings it produces (`mm.down` rows).
    pub n_embd_out: usize,
    /// Bytes of weights held.
    pub bytes: usize,
    /// The tower's weights on a GPU (uploaded at the first image encoded there; made again
    /// for a piece with more patches than it was made for).
    gpu: std::sync::Mutex<Option<Arc<GpuBackend>>>,
}

impl Mmproj {
    pub fn load(src: &dyn ByteSource) -> Result<Self, VisionError> {
        Self::load_with(src, None)
    }

    /// [`Self::load`], the tower's matrices read from `stream` (the same file) at each use
    /// through a bounded read-ahead instead of held in memory: for a memory budget that cannot
    /// hold them (the CPU backend; the same bits).
    pub fn load_with(src: &dyn ByteSource, stream: Option<Arc<dyn ByteSource>>) -> Result<Self, VisionError> {
        let g = GgufFile::read(src)?;
        let arch = g.architecture().unwrap_or("").to_string();
        if arch != "clip" {
            return Err(VisionError::NotClip(arch));
        }
        if g.get("clip.has_vision_encoder").and_then(|v| v.as_bool()) == Some(false) {
            return Err(VisionError::NoVision);
        }
        let proj = g.get_str("clip.vision.projector_type").or_else(|| g.get_str("clip.projector_type")).unwrap_or("").to_string();
        if proj != "minicpmv4_6" {
            return Err(VisionError::Projector(if proj.is_empty() { "(none)".into() } else { proj }));
        }
        let u = |k: &str| -> Result<usize, VisionError> { Ok(g.req_u64(k)? as usize) };
        let inval = |key: &str, value: String, why: &'static str| VisionError::Invalid { key: key.into(), value, why };
        let triple = |k: &str, def: [f32; 3]| -> Result<[f32; 3], VisionError> {
            match g.get(k).and_then(|v| v.as_array()) {
                None => Ok(def),
                Some(a) if a.len() == 3 => Ok([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(f64::NAN) as f32)),
                Some(a) => Err(inval(k, format!("{} values", a.len()), "must have 3 values")),
            }
        };
        let use_gelu = g.get("clip.use_gelu").and_then(|v| v.as_bool()).unwrap_or(false);
        let use_silu = g.get("clip.use_silu").and_then(|v| v.as_bool()).unwrap_or(false);
        let cfg = VisionConfig {
            projector: proj,
            image_size: u("clip.vision.image_size")?,
            patch_size: u("clip.vision.patch_size")?,
            n_embd: u("clip.vision.embedding_length")?,
            n_ff: u("clip.vision.feed_forward_length")?,
            n_layer: u("clip.vision.block_count")?,
            n_head: u("clip.vision.attention.head_count")?,
            eps: g.get_f32("clip.vision.attention.layer_norm_epsilon").unwrap_or(1e-6),
            mean: triple("clip.vision.image_mean", [0.5; 3])?,
            std: triple("clip.vision.image_std", [0.5; 3])?,
            act: if use_gelu { VitAct::Gelu } else if use_silu { VitAct::Silu } else { VitAct::GeluQuick },
            n_merge: g.get_u64("clip.vision.projector.scale_factor").unwrap_or(4) as usize,
            insert_layer: match g.get("clip.vision.wa_layer_indexes").and_then(|v| v.as_array()) {
                Some(a) if !a.is_empty() => a[0].as_i64().unwrap_or(-1).max(-1) as isize as usize,
                _ => 0,
            },
        };
        let c = &cfg;
        let check = |key: &str, v: usize, ok: bool, why: &'static str| if ok { Ok(()) } else { Err(inval(key, v.to_string(), why)) };
        check("clip.vision.patch_size", c.patch_size, (1..=64).contains(&c.patch_size), "must be in 1..=64")?;
        check("clip.vision.image_size", c.image_size, c.image_size >= c.patch_size * 4 && c.image_size <= 4096, "must be in 4·patch_size..=4096")?;
        check("clip.vision.embedding_length", c.n_embd, (1..=1 << 14).contains(&c.n_embd), "must be in 1..=16384")?;
        check("clip.vision.feed_forward_length", c.n_ff, (1..=1 << 16).contains(&c.n_ff), "must be in 1..=65536")?;
        check("clip.vision.block_count", c.n_layer, (1..=256).contains(&c.n_layer), "must be in 1..=256")?;
        check("clip.vision.attention.head_count", c.n_head, c.n_head > 0 && c.n_embd % c.n_head == 0, "must divide embedding_length")?;
        check("clip.vision.projector.scale_factor", c.n_merge, c.n_merge == 2 || c.n_merge == 4, "must be 2 or 4")?;
        check("clip.vision.wa_layer_indexes", c.insert_layer, c.insert_layer < c.n_layer, "must name a layer")?;
        if c.act != VitAct::Gelu {
            return Err(inval("clip.use_gelu", "false".into(), "LES runs the ViT's FFN with GELU (tanh) only"));
        }
        if c.std.iter().any(|&s| !(s.is_finite() && s != 0.0)) || c.mean.iter().any(|m| !m.is_finite()) {
            return Err(inval("clip.vision.image_std", format!("{:?}", c.std), "mean and std must be finite, std non-zero"));
        }
        let window = stream_window(&g);
        let dense = stream.map(|src| DenseStreaming { names: g.tensors.iter().filter(|t| is_matrix(t)).map(|t| t.name.clone()).collect(), src, window, piece: window / 4 });
        let mut ld = Loader::new(src, &g).with_streaming(dense.as_ref());
        let (tower, n_embd_out) = minicpmv::Tower::load(&mut ld, c)?;
        let weights = ld.finish()?;
        let bytes = g.tensors.iter().map(|t| t.size as usize).sum::<usize>() - weights.streamed_bytes() as usize;
        Ok(Self { cfg, weights, tower, n_embd_out, bytes, gpu: std::sync::Mutex::new(None) })
    }

    /// Bytes an mmproj file takes in memory when loaded and encoding its largest piece, from
    /// its header alone (for a memory budget): the tensors as stored, plus the encoder's
    /// activations at `(image_size / patch_size)²` patches (the residual stream, Q/K/V, the
    /// attention output and its f16 K/V copies, the FFN's hidden rows; f32).
    /// `streamed`: with its matrices read from storage ([`Self::load_with`]) through the
    /// read-ahead's window instead.
    pub fn footprint(src: &dyn ByteSource, streamed: bool) -> Result<u64, VisionError> {
        let g = GgufFile::read(src)?;
        let weights: u64 = g.tensors.iter().filter(|t| !streamed || !is_matrix(t)).map(|t| t.size).sum();
        let u = |k: &str| g.get_u64(k).unwrap_or(0);
        let (side, d, ff) = (u("clip.vision.image_size") / u("clip.vision.patch_size").max(1), u("clip.vision.embedding_length"), u("clip.vision.feed_forward_length"));
        let rows = side * side;
        Ok(weights + rows * (6 * d + ff) * 4 + if streamed { stream_window(&g) as u64 } else { 0 })
    }

    /// The slicing this projector's preprocessing uses.
    pub fn slicing(&self) -> image::Slicing {
        let c = &self.cfg;
        image::Slicing { image_size: c.image_size, align: c.patch_size * c.n_merge, small_keeps_aspect: c.n_merge == 2 }
    }

    /// Decode and prepare an image file's bytes (overview + slices).
    pub fn prepare(&self, bytes: &[u8]) -> Result<image::Prepared, VisionError> {
        let img = image::decode(bytes)?;
        Ok(image::prepare(&img, &self.slicing(), self.cfg.mean, self.cfg.std))
    }

    /// The embeddings of one prepared image piece (`rows × n_embd_out`), on the CPU.
    pub fn encode(&self, img: &image::RgbF32) -> Result<Vec<f32>, VisionError> {
        let mut kv = KvCache::hybrid(&[], 0, 1, 2);
        let mut b = CpuExec::new(&self.weights, &mut kv, false);
        if crate::backend::profile::enabled() {
            let t0 = crate::clock::now_ms();
            let r = ops::ready(self.tower.encode(&mut crate::backend::profile::Profiled(&mut b), &self.cfg, &self.weights, img))?;
            crate::backend::profile::record("encode", crate::clock::now_ms() - t0);
            return r;
        }
        ops::ready(self.tower.encode(&mut b, &self.cfg, &self.weights, img))?
    }

    /// [`Self::encode`] on the GPU of `ctx` (the weights go there at the first call; every op
    /// is the CPU's portable kernels' bits on the exact path, `tests/portable/ops.rs`).
    pub async fn encode_gpu(&self, ctx: &Arc<GpuContext>, opts: &GpuOptions, img: &image::RgbF32) -> Result<Vec<f32>, VisionError> {
        let rows = (img.w / self.cfg.patch_size) * (img.h / self.cfg.patch_size);
        let mut slot = self.gpu.lock().unwrap_or_else(|e| e.into_inner());
        if slot.as_ref().is_none_or(|g| g.max_rows() < rows) {
            let side = self.cfg.image_size / self.cfg.patch_size + self.cfg.n_merge;
            let s = GpuShapes { n_moe_layer: 0, kv_layers: 0, swa_layers: 0, swa_cells: 0, n_head_kv: 1, head_dim: 2, n_ctx: 1, n_expert: 0, n_expert_used: 0 };
            *slot = Some(Arc::new(GpuBackend::with_rows(ctx.clone(), &self.weights, s, None, opts, rows.max(side * side))?));
        }
        let g = slot.clone().ok_or_else(|| VisionError::Model(ModelError::Internal("the vision tower's GPU backend".into())))?;
        drop(slot);
        let mut b = g.exec()?;
        let out = self.tower.encode(&mut b, &self.cfg, &self.weights, img).await?;
        b.finish()?;
        Ok(out)
    }

    /// The number of embedding rows a piece of `w × h` pixels gives.
    pub fn n_tokens(&self, w: usize, h: usize) -> usize {
        let (pw, ph) = (w / self.cfg.patch_size, h / self.cfg.patch_size);
        (pw / self.cfg.n_merge) * (ph / self.cfg.n_merge)
    }
}
