//! The op contract: what an architecture file (`src/model/<arch>.rs`) may ask of a backend.
//!
//! A forward pass is written once against [`Ops`]; the CPU backend ([`super::cpu::exec::CpuExec`])
//! computes each op at once, the wgpu backend ([`super::wgpu::exec::GpuExec`]) records it into a
//! command buffer. Backends know ops and shapes, never architectures or tensor names: weights
//! reach them as [`Mat`] / [`Vector`] handles into the model's [`Weights`] table.
//!
//! Two points are explicit here because they cost a GPU→CPU synchronisation:
//! - [`Ops::read`] brings rows of tensors to the host (router logits, the lookahead inputs the
//!   expert scheduler is told about, logits); one call is one synchronisation, however many
//!   tensors it reads. On the CPU it is a copy.
//! - [`Ops::experts`] runs the routed experts (ids decided on the host by the model's router,
//!   as llama.cpp's `build_moe_ffn` + `ggml_mul_mat_id` do on the device) and combines them in
//!   rank order, so the lossless rule — results never depend on which experts were resident —
//!   has one home per backend.
//!
//! Shapes: a tensor is `rows × cols` f32 values, row-major; a row is one token.
//! `docs/ops.md` lists the ops per backend (checked by `tests/portable/ops.rs`).

use super::cpu::matmul::{Weight, WeightRef};
use crate::store::ahead::ReadAhead;
use crate::store::StoreError;
pub use super::rope::{RopeKind, Yarn};
use crate::expert::{ExpertError, ExpertSource};
use std::ops::Range;

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error(transparent)]
    Gpu(#[from] super::wgpu::GpuError),
    #[error(transparent)]
    Expert(#[from] ExpertError),
    #[error(transparent)]
    Quant(#[from] crate::quant::QuantError),
    /// A streamed dense matrix could not be read.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A recurrent op ran on a layer whose state is missing or of another shape (a bug).
    #[error("layer {0} has no recurrent state of the shape this op needs")]
    NoState(usize),
    /// An attention layer beyond the backend's KV slots (the model's attention layer count was
    /// given wrong: a bug).
    #[error("layer {0} has no KV cache slot on this backend")]
    NoKv(usize),
    /// The backend has no kernel for an op this model needs.
    #[error("the {backend} backend does not run {op} yet")]
    Unsupported { backend: &'static str, op: &'static str },
    /// A forward that needed an asynchronous backend was run by a synchronous caller.
    #[error("the backend did not complete synchronously")]
    NotReady,
}

/// A matrix in the model's [`Weights`] table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mat(u32);

/// An f32 vector (norm weight, bias) in the model's [`Weights`] table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Vector(u32);

/// A matrix read from storage at each use instead of held (a memory budget below the dense
/// weights): rows `[k × rows_per, (k + 1) × rows_per)` are piece `first + k` of the table's
/// [`ReadAhead`] cycle; `offset` is where its first row starts in the read-ahead's source (row
/// lookups read from there directly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamedMat {
    /// Numbered when the cycle is complete (`Loader::finish`); an untied `token_embd` is looked
    /// up row by row and is not in the cycle.
    pub first: usize,
    pub n: usize,
    pub rows_per: usize,
    pub offset: u64,
}

/// A model's dense tensors as loaded: matrices in their GGML block formats and f32 vectors.
/// Architecture files hold handles into it; the CPU backend reads it in place, the wgpu backend
/// uploads it once, entry by entry, without knowing what any entry is. A streamed matrix
/// ([`StreamedMat`]) has no bytes here: the CPU backend takes its pieces from the read-ahead.
#[derive(Default)]
pub struct Weights {
    mats: Vec<Weight>,
    vecs: Vec<Vec<f32>>,
    /// Matrices only the host reads (token embeddings looked up row by row): not uploaded.
    host: Vec<bool>,
    streamed: Vec<Option<StreamedMat>>,
    ahead: Option<ReadAhead>,
}

impl Weights {
    pub fn add_mat(&mut self, w: Weight) -> Mat {
        self.mats.push(w);
        self.host.push(false);
        self.streamed.push(None);
        Mat(self.mats.len() as u32 - 1)
    }
    /// A matrix of `ty`, `cols` × `rows` read from storage at each use (`s`; its pieces are
    /// numbered by the caller, who then sets the read-ahead with [`Self::set_read_ahead`]).
    pub fn add_streamed(&mut self, ty: crate::quant::GgmlType, cols: usize, rows: usize, s: StreamedMat) -> Mat {
        let m = self.add_mat(Weight::new(ty, cols, rows, Vec::new()));
        self.streamed[m.0 as usize] = Some(s);
        m
    }
    pub fn set_streamed(&mut self, m: Mat, s: StreamedMat) {
        self.streamed[m.0 as usize] = Some(s);
    }
    pub fn set_read_ahead(&mut self, ra: ReadAhead) {
        self.ahead = Some(ra);
    }
    /// Drop the read-ahead (its reader stops).
    pub fn clear_read_ahead(&mut self) {
        self.ahead = None;
    }
    /// Hold matrix `m`'s bytes (`data`: the whole matrix) instead of streaming it.
    pub fn set_resident(&mut self, m: Mat, data: Vec<u8>) {
        self.mats[m.0 as usize].data = data;
        self.mats[m.0 as usize].repacked = false;
        self.streamed[m.0 as usize] = None;
    }
    /// Stream matrix `m` as `s` says, freeing the bytes it held.
    pub fn stream_instead(&mut self, m: Mat, s: StreamedMat) {
        self.mats[m.0 as usize].data = Vec::new();
        self.mats[m.0 as usize].repacked = false;
        self.streamed[m.0 as usize] = Some(s);
    }
    pub fn read_ahead(&self) -> Option<&ReadAhead> {
        self.ahead.as_ref()
    }
    pub fn streamed(&self, m: Mat) -> Option<StreamedMat> {
        self.streamed.get(m.0 as usize).copied().flatten()
    }
    /// Some matrix is read from storage at each use (only the CPU backend runs such a model).
    pub fn has_streamed(&self) -> bool {
        self.streamed.iter().any(|s| s.is_some())
    }
    /// Bytes of the streamed matrices (not held in memory).
    pub fn streamed_bytes(&self) -> u64 {
        self.mats.iter().zip(&self.streamed).filter(|(_, s)| s.is_some()).map(|(w, _)| w.ty.row_bytes(w.cols as u64).unwrap_or(0) * w.rows as u64).sum()
    }
    /// Row `r` of matrix `m` as f32 (embedding lookup; a streamed matrix's row is read from storage).
    pub fn row_f32(&self, m: Mat, r: usize, out: &mut [f32]) -> Result<(), OpError> {
        let w = self.mat(m);
        match (self.streamed(m), &self.ahead) {
            (Some(s), Some(ra)) => {
                let rb = w.ty.row_bytes(w.cols as u64).unwrap_or(0) as usize;
                let bytes = ra.source().read_vec(s.offset + (r * rb) as u64, rb)?;
                Ok(crate::quant::dequantize_row(w.ty, &bytes, out)?)
            }
            _ => Ok(w.row_f32(r, out)?),
        }
    }
    /// Call `f(first_row, piece)` for each piece of matrix `m` in row order: the whole matrix
    /// once when it is held, else each piece as the read-ahead hands it over.
    pub fn for_pieces(&self, m: Mat, mut f: impl FnMut(usize, WeightRef<'_>)) -> Result<(), OpError> {
        let w = self.mat(m);
        let (Some(s), Some(ra)) = (self.streamed(m), &self.ahead) else {
            f(0, w.as_ref());
            return Ok(());
        };
        for k in 0..s.n {
            let row0 = k * s.rows_per;
            let rows = s.rows_per.min(w.rows - row0);
            let data = ra.get(s.first + k)?;
            f(row0, WeightRef { ty: w.ty, cols: w.cols, rows, data: &data, repacked: false });
        }
        Ok(())
    }
    /// Put the matrices the CPU reads in [`crate::quant::repack`]'s layout where it
    /// [pays](crate::quant::repack::pays) (`always`: wherever the type has one; tests): held
    /// matrices that are not host-only lookups. Returns the bytes repacked.
    pub fn repack(&mut self, always: bool) -> usize {
        let mut bytes = 0;
        for (i, w) in self.mats.iter_mut().enumerate() {
            if self.streamed[i].is_none() && !self.host[i] && !w.repacked && w.repack(always) {
                bytes += w.data.len();
            }
        }
        bytes
    }
    /// Every matrix in the file's layout again (before a backend uploads the bytes as they are).
    pub fn unpack(&mut self) {
        self.mats.iter_mut().for_each(Weight::unpack);
    }
    pub fn add_vec(&mut self, v: Vec<f32>) -> Vector {
        self.vecs.push(v);
        Vector(self.vecs.len() as u32 - 1)
    }
    /// Mark `m` as read on the host only (a device backend does not upload it).
    pub fn set_host_only(&mut self, m: Mat) {
        self.host[m.0 as usize] = true;
    }
    pub fn host_only(&self, i: usize) -> bool {
        self.host.get(i).copied().unwrap_or(false)
    }
    pub fn mat(&self, m: Mat) -> &Weight {
        &self.mats[m.0 as usize]
    }
    pub fn vec(&self, v: Vector) -> &[f32] {
        &self.vecs[v.0 as usize]
    }
    pub fn mats(&self) -> &[Weight] {
        &self.mats
    }
    pub fn vecs(&self) -> &[Vec<f32>] {
        &self.vecs
    }
    /// The handle's index in [`Self::mats`] / [`Self::vecs`] (a backend's own copy is indexed alike).
    pub fn mat_index(m: Mat) -> usize {
        m.0 as usize
    }
    pub fn vec_index(v: Vector) -> usize {
        v.0 as usize
    }
}

/// Rotary position embedding of one tensor (ggml `rope_ext`): heads of `head_dim` values, the
/// first `n_rot` of each rotated; YaRN scaling when `yarn` is set (else ext_factor 0, freq_scale 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    pub head_dim: usize,
    pub n_rot: usize,
    pub base: f32,
    pub kind: RopeKind,
    pub yarn: Option<Yarn>,
}

/// Causal attention over the backend's KV cache (ggml `flash_attn_ext` with an f16 cache):
/// queries `n_head × head_dim`, keys and values `n_head_kv × head_dim` per row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attn {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window: query at position p sees keys p0 with `p − p0 < window` (0: all; llama.cpp
    /// `LLAMA_SWA_TYPE_STANDARD`, `llama-hparams.cpp` `is_masked_swa`).
    pub window: usize,
    /// Attention sinks (gpt-oss): one logit per head that joins each softmax's denominator only
    /// (ggml `flash_attn_ext` with `sinks`, `ggml_flash_attn_ext_add_sinks`).
    pub sinks: Option<Vector>,
}

/// Attention of a tensor's rows among themselves, no cache and no causal mask (a vision
/// encoder's patches; clip's `build_attn` → ggml `flash_attn_ext` with K and V cast to f16):
/// queries, keys and values `n_head × head_dim` per row. `block` 0: every row sees every row;
/// `block` n: row t sees the rows of its block `t / n` only (the block-diagonal mask of a
/// window attention after its window-major reorder, `minicpmv4_6`'s ViT merger).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelfAttn {
    pub n_head: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub block: usize,
}

/// GELU's two forms (ggml `gelu`, `gelu_erf`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gelu {
    /// `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))`, looked up as ggml-cpu does: the value at
    /// x rounded to f16, stored as f16 (`ggml_table_gelu_f16`); x for |x| ≥ 10 (0 below −10).
    Tanh,
    /// `0.5·x·(1 + erf(x/√2))` in f32 (PyTorch `nn.GELU()`).
    Erf,
}

/// One Gated DeltaNet layer's recurrence (ggml `gated_delta_net` with its inputs prepared as
/// llama.cpp's `build_layer_attn_linear` prepares them): from the conv output (`[q | k | v]`,
/// `2·n_group·d_state + dt_rank·d_state` columns), the `alpha` and `beta` projections
/// (`dt_rank` columns each) and the layer's `ssm_dt.bias` / `ssm_a` vectors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaNet {
    pub dt_bias: Vector,
    pub a: Vector,
    /// Key heads H_k, value heads H_v, head size S.
    pub n_group: usize,
    pub dt_rank: usize,
    pub d_state: usize,
    /// v-head `h` uses k-head `h % H_k` (true, qwen35moe) or `h / (H_v / H_k)` (qwen3next).
    pub tiled: bool,
    /// The q/k L2-norm's epsilon (`attention.layer_norm_rms_epsilon`).
    pub eps: f32,
}

/// The sigmoid a gate applies: qwen2moe's graph writes `silu(x) / x`, others ggml's `sigmoid`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sigmoid {
    /// `silu(x) / x` ([`super::cpu::ops::sigmoid`]).
    SiluDiv,
    /// `1 / (1 + exp(-x))` ([`super::cpu::ops::sigmoid_exp`]).
    Exp,
}

/// The gated activation of the experts' FFN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// `silu(gate) · up` (ggml `swiglu`).
    Silu,
    /// gpt-oss: `x = min(gate, limit)`, `y = clamp(up, −limit, limit)`,
    /// `x / (1 + expf(−alpha·x)) · (y + 1)` (ggml `swiglu_oai`, `ggml-cpu/ops.cpp`).
    SwigluOai { alpha: f32, limit: f32 },
    /// `gate > 0 ? gate · up : 0` (ggml `reglu`, `ggml_vec_reglu_f32`: smallthinker's experts,
    /// llama.cpp `LLM_FFN_RELU` with a gate).
    Relu,
}

/// How the routed experts' FFN is formed: its activation, and per-expert biases (gpt-oss:
/// `ffn_{gate,up,down}_exps.bias`, `n_expert` rows of `n_ff_exp` / `n_ff_exp` / `n_embd` values
/// each, added with ggml `add_id` after each product).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertFfn {
    pub act: ExpertAct,
    pub bias: Option<[Vector; 3]>,
}

impl ExpertFfn {
    pub const SWIGLU: ExpertFfn = ExpertFfn { act: ExpertAct::Silu, bias: None };
}

/// A router's decision for `rows` tokens: `sel[t * k + r]` is token t's rank-r expert, `wts` its
/// weight (already normalised / scaled as the architecture says).
#[derive(Clone, Copy, Debug)]
pub struct Route<'a> {
    pub sel: &'a [u32],
    pub wts: &'a [f32],
    pub k: usize,
}

impl Route<'_> {
    /// The chosen experts, each once, in first-seen order (the order they are asked for).
    pub fn union(&self) -> Vec<u32> {
        let mut u: Vec<u32> = Vec::new();
        for &ex in self.sel {
            if !u.contains(&ex) {
                u.push(ex);
            }
        }
        u
    }
}

/// Router gating (llama.cpp `llama_expert_gating_func_type`, GGUF `<arch>.expert_gating_func`:
/// 1 softmax, 2 sigmoid, 3 softmax_weight).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert, then top-k of the probabilities (`SOFTMAX`).
    Softmax,
    /// Top-k of the raw logits, then softmax over the k (`SOFTMAX_WEIGHT`: gpt-oss).
    SoftmaxWeight,
    /// `1 / (1 + expf(−x))` of every logit (ggml `sigmoid`), then top-k of those (`SIGMOID`:
    /// smallthinker's sigmoid routers).
    Sigmoid,
}

/// How a router turns logits into experts and weights ([`crate::model`]'s `route`, llama.cpp
/// `build_moe_ffn`): softmax (or sigmoid) then top-k (weights normalised when `norm_topk`), or
/// top-k then softmax of the k (gpt-oss); then times `scale` (unless 0 or 1).
#[derive(Clone, Copy, Debug)]
pub struct RouteSpec {
    pub n_expert: usize,
    pub k: usize,
    pub gating: Gating,
    pub norm_topk: bool,
    pub scale: f32,
}

/// The ops a forward pass is written against. Every op keeps the CPU backend's bits on the CPU
/// (llama.cpp's orders with AVX2, portable orders elsewhere) and the wgpu backend's exact path
/// reproduces the portable orders bit for bit (`tests/portable/ops.rs`, `tests/portable/wgpu_model.rs`).
#[allow(async_fn_in_trait)]
pub trait Ops {
    /// An activation tensor, `rows × cols` f32.
    type T;

    fn shape(t: &Self::T) -> (usize, usize);

    /// Host rows (`x.len() / cols` of them) as a tensor (embeddings are looked up on the host).
    fn input(&mut self, x: Vec<f32>, cols: usize) -> Result<Self::T, OpError>;
    /// RMSNorm of each row times `w` (ggml `rms_norm` + `mul`).
    fn rms_norm(&mut self, x: &Self::T, w: Vector, eps: f32) -> Result<Self::T, OpError>;
    /// In-place RMSNorm over consecutive groups of `len(w)` values of each row (QK-norm per head,
    /// or over a whole row when `len(w) == cols`).
    fn rms_norm_groups(&mut self, x: &mut Self::T, w: Vector, eps: f32) -> Result<(), OpError>;
    /// `y_i = W_i · x` for each matrix (ggml `mul_mat`); the activation conversion to each
    /// weight type's vec-dot type is made once for all of them.
    fn matmul(&mut self, x: &Self::T, ws: &[Mat]) -> Result<Vec<Self::T>, OpError>;
    /// `x[t] += b` for every row (biases).
    fn add_row(&mut self, x: &mut Self::T, b: Vector) -> Result<(), OpError>;
    /// `x += y`.
    fn add(&mut self, x: &mut Self::T, y: &Self::T) -> Result<(), OpError>;
    /// RoPE in place; row t is at position `pos0 + t`.
    fn rope(&mut self, x: &mut Self::T, pos0: usize, p: &Rope) -> Result<(), OpError>;
    /// Store `k`, `v` at positions `pos0..` of layer `il`'s cache, then causal attention of `q`
    /// over positions `0..=pos0 + t` (ggml `cpy` into the cache + `flash_attn_ext`).
    fn attention(&mut self, il: usize, q: &Self::T, k: &Self::T, v: &Self::T, pos0: usize, p: &Attn) -> Result<Self::T, OpError>;
    /// `silu(g) * u` (ggml `swiglu`).
    fn swiglu(&mut self, g: &Self::T, u: &Self::T) -> Result<Self::T, OpError>;
    /// `x[t] += y[t] * sigmoid(g[t])`, `g` one column (the shared-expert gate of qwen2moe and
    /// qwen35moe).
    fn gate_add(&mut self, x: &mut Self::T, y: &Self::T, g: &Self::T, f: Sigmoid) -> Result<(), OpError>;
    /// `x *= sigmoid(g)` element by element (qwen35moe's attention output gate; ggml `sigmoid`).
    fn mul_sigmoid(&mut self, x: &mut Self::T, g: &Self::T) -> Result<(), OpError>;
    /// `x *= y` element by element (ggml `mul`: lfm2's short-convolution gates).
    fn mul(&mut self, x: &mut Self::T, y: &Self::T) -> Result<(), OpError>;
    /// Layer `il`'s causal depthwise conv1d over the rows of `x` (ggml `ssm_conv`; weights `w`,
    /// `d_conv` per channel, f32), starting from and advancing the layer's conv state, then SiLU
    /// when `silu` (Gated DeltaNet; lfm2's short convolution has none).
    fn ssm_conv(&mut self, il: usize, x: &Self::T, w: Vector, d_conv: usize, silu: bool) -> Result<Self::T, OpError>;
    /// Layer `il`'s Gated DeltaNet over the rows of `x` (the conv output), token by token from and
    /// into the layer's recurrent state: `H_v · S` columns out (see [`DeltaNet`]). The q and k
    /// heads of `x` are L2-normalised in place on the way.
    fn delta_net(&mut self, il: usize, x: &mut Self::T, alpha: &Self::T, beta: &Self::T, p: &DeltaNet) -> Result<Self::T, OpError>;
    /// `x = rms_norm_groups(x, w) * silu(z)` (llama.cpp's `build_norm_gated`).
    fn norm_gated(&mut self, x: &mut Self::T, w: Vector, z: &Self::T, eps: f32) -> Result<(), OpError>;
    /// The last row alone (llama.cpp's `inp_out_ids` when only the last logits are wanted).
    fn last_row(&mut self, x: Self::T) -> Result<Self::T, OpError>;
    /// The routed experts of layer `il` on `x` (one row per token), weighted and combined in rank
    /// order: `y[t] = Σ_r wts[t,r] · down(silu(gate x_t) · up x_t)` of expert `sel[t,r]`, summed
    /// r = 0, 1, … (ggml `mul_mat_id` ×3 + `swiglu` + `mul` + the views added in order); `f` may
    /// change the activation and add per-expert biases after each product. Experts
    /// come from `src` (resident, cached or streamed). `partial`: the residual entering this FFN
    /// (single-token forwards); a backend that sees expert outputs on the host calls
    /// [`ExpertSource::on_partial`] with it plus the first expert's output (the CPU does; wgpu
    /// does not, as it would cost a synchronisation).
    fn experts(&mut self, il: usize, src: &dyn ExpertSource, x: &Self::T, r: Route<'_>, f: &ExpertFfn, partial: Option<&Self::T>) -> Result<Self::T, OpError>;
    /// Whether [`Self::experts_routed`] runs layer `il`'s decode token on this backend: the
    /// router's choice made where the logits are, with no synchronisation (a GPU holding every
    /// one of the layer's `n_expert` experts in one slab). The default: no.
    fn routes_on_device(&mut self, _il: usize, _src: &dyn ExpertSource, _n_expert: usize) -> bool {
        false
    }
    /// One decode row: route `logits` (one row of `spec.n_expert`) as `model::route` does, bit
    /// for bit, then run and combine the chosen experts of `x` as [`Self::experts`] does: the
    /// same output without bringing the logits to the host. Only where
    /// [`Self::routes_on_device`] said yes.
    fn experts_routed(&mut self, _il: usize, _src: &dyn ExpertSource, _x: &Self::T, _logits: &Self::T, _spec: &RouteSpec, _sel_bias: Option<Vector>, _f: &ExpertFfn) -> Result<Self::T, OpError> {
        Err(OpError::Unsupported { backend: Self::BACKEND, op: "routing on the device" })
    }
    /// The backend's name in errors (`cpu`, `wgpu`).
    const BACKEND: &'static str;

    // ---- Vision encoders (`src/vision`): defaults refuse, backends override what they run ----

    /// Layer norm of each row: `(x − mean) / sqrt(var + eps) · w + b` (ggml `norm`, `mul`, `add`).
    fn layer_norm(&mut self, x: &Self::T, w: Vector, b: Option<Vector>, eps: f32) -> Result<Self::T, OpError> {
        let _ = (x, w, b, eps);
        Err(OpError::Unsupported { backend: Self::BACKEND, op: "layer_norm" })
    }
    /// GELU in place.
    fn gelu(&mut self, x: &mut Self::T, kind: Gelu) -> Result<(), OpError> {
        let _ = (x, kind);
        Err(OpError::Unsupported { backend: Self::BACKEND, op: "gelu" })
    }
    /// Non-causal attention of `q` over `k`, `v` (same rows); see [`SelfAttn`].
    fn self_attention(&mut self, q: &Self::T, k: &Self::T, v: &Self::T, p: &SelfAttn) -> Result<Self::T, OpError> {
        let _ = (q, k, v, p);
        Err(OpError::Unsupported { backend: Self::BACKEND, op: "self_attention" })
    }
    /// Rows `x[idx[0]], x[idx[1]], …` (ggml `get_rows`).
    fn gather_rows(&mut self, x: &Self::T, idx: &[u32]) -> Result<Self::T, OpError> {
        let _ = (x, idx);
        Err(OpError::Unsupported { backend: Self::BACKEND, op: "gather_rows" })
    }
    /// The tensors side by side, row by row (ggml `concat` on dim 0); equal row counts.
    fn concat_cols(&mut self, xs: &[&Self::T]) -> Result<Self::T, OpError> {
        let _ = xs;
        Err(OpError::Unsupported { backend: Self::BACKEND, op: "concat_cols" })
    }
    /// `x *= s` (ggml `scale`).
    fn scale(&mut self, x: &mut Self::T, s: f32) -> Result<(), OpError> {
        let _ = (x, s);
        Err(OpError::Unsupported { backend: Self::BACKEND, op: "scale" })
    }

    /// Rows of tensors to the host, in one synchronisation.
    async fn read(&mut self, parts: &[(&Self::T, Range<usize>)]) -> Result<Vec<Vec<f32>>, OpError>;
}

/// Run a future that a synchronous backend completes without waiting (the CPU's: every op is
/// done when called, so its forward is ready at the first poll).
pub fn ready<F: std::future::Future>(f: F) -> Result<F::Output, OpError> {
    let mut f = std::pin::pin!(f);
    let waker = futures::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    match f.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Ok(v),
        std::task::Poll::Pending => Err(OpError::NotReady),
    }
}
