//! Transformer models, one file per architecture family, each written once against the op
//! contract ([`crate::backend::ops::Ops`]) and run by every backend:
//! - [`llama`]: llama (dense) and Mixtral-style MoE (`src/models/llama.cpp` in llama.cpp);
//! - [`qwen2moe`]: Q/K/V biases, a sigmoid-gated shared expert (`qwen2moe.cpp`);
//! - [`qwen3moe`]: per-head QK-norm (`qwen3moe.cpp`);
//! - [`olmoe`]: QK-norm over whole Q / K (`olmoe.cpp`);
//! - [`qwen35moe`]: Gated DeltaNet + gated attention hybrid, `qwen35moe` and `qwen3next`;
//! - [`gpt_oss`]: biased attention with sinks and sliding windows, YaRN, biased MXFP4 experts;
//! - [`smallthinker`]: the router before attention (exact expert lookahead), ReGLU experts, NoPE;
//! - [`lfm2moe`]: short-convolution layers between GQA layers, dense leading layers, a biased sigmoid router.
//!
//! Each architecture file holds its tensor list (as llama.cpp's `load_arch_tensors`) and its
//! forward (as the graph builder), made of the shared blocks in [`blocks`] (as
//! `src/llama-graph.cpp`: attention, SwiGLU FFN, MoE FFN, output). Experts are reached only
//! through [`ExpertSource`]. Adding an architecture: one file here, one variant in [`Arch`]
//! (and in `Layers` below when it brings its own decoder), plus kernels for any op it introduces.

pub mod blocks;
pub mod config;
pub mod gpt_oss;
pub mod lfm2moe;
pub mod llama;
pub mod olmoe;
pub mod qwen2moe;
pub mod qwen35moe;
pub mod qwen3moe;
pub mod smallthinker;

use crate::backend::cpu::exec::CpuExec;
use crate::backend::cpu::matmul::Weight;
use crate::backend::cpu::ops as cpu_ops;
use crate::backend::ops::{self, Mat, OpError, Ops, Vector, Weights};
use crate::backend::wgpu::exec::{GpuBackend, GpuShapes, GPU_BATCH};
use crate::expert::{ExpertError, ExpertSource, GgufExpertTensors, ResidentExperts};
use crate::gguf::{GgufError, GgufFile};
use crate::quant::{GgmlType, QuantError};
use crate::store::{ByteSource, StoreError};
pub use crate::backend::cpu::kv::KvCache;
pub use blocks::Input;
pub use config::{Arch, Config, ConfigError};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error(transparent)]
    Expert(#[from] ExpertError),
    #[error("tensor '{name}' has shape {got:?}, expected {want:?}")]
    Shape { name: String, got: Vec<u64>, want: Vec<u64> },
    #[error("token id {0} is outside the vocabulary")]
    BadToken(u32),
    #[error("context full: {0} positions (raise --ctx-size)")]
    ContextFull(usize),
    #[error("a MoE layer has no expert source")]
    NoExperts,
    #[error(transparent)]
    Gpu(#[from] crate::backend::wgpu::GpuError),
    /// The backend cannot run this model yet.
    #[error("{0}")]
    Unsupported(String),
    /// A backend broke the op contract (a bug, reported instead of a panic).
    #[error("internal error: {0}")]
    Internal(String),
    /// A buffer the model needs could not be allocated.
    #[error("out of memory: cannot allocate {bytes} bytes for the {what} (lower --ctx-size or the memory budget)")]
    OutOfMemory { what: &'static str, bytes: usize },
}

impl From<OpError> for ModelError {
    fn from(e: OpError) -> Self {
        match e {
            OpError::Gpu(g) => ModelError::Gpu(g),
            OpError::Expert(x) => ModelError::Expert(x),
            OpError::Quant(q) => ModelError::Quant(q),
            OpError::Store(s) => ModelError::Store(s),
            OpError::NotReady | OpError::NoState(_) | OpError::NoKv(_) => ModelError::Internal(e.to_string()),
            OpError::Unsupported { .. } => ModelError::Unsupported(e.to_string()),
        }
    }
}

/// What a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Logits of the last token only.
    Last,
    /// Logits of every token in the batch (teacher forcing, speculative verification).
    All,
}

/// Dense matrices read from storage at each use instead of held in memory, for a memory budget
/// below the dense weights (chosen by `engine::stream`). Only matrices loaded whole
/// ([`Loader::mat`]) are streamed; the CPU backend runs them (the wgpu backend refuses).
#[derive(Clone)]
pub struct DenseStreaming {
    /// GGUF tensor names to stream.
    pub names: std::collections::HashSet<String>,
    /// The bytes to read them from (the same offsets as the GGUF being loaded; a throttled
    /// source models a device's storage).
    pub src: Arc<dyn ByteSource>,
    /// Read-ahead window (bytes held at most) and the largest piece a matrix is split into.
    pub window: usize,
    pub piece: usize,
}

/// A byte range of the model file: (offset, length).
type Piece = (u64, usize);

/// A matrix loaded whole from one tensor ([`Loader::mat`]): what dense streaming may read from
/// storage, now or after a re-plan ([`Model::replan_dense`]).
#[derive(Clone, Debug)]
struct WholeMat {
    m: Mat,
    name: String,
    offset: u64,
    /// Where its pieces go in the read-ahead cycle (the forward's use order); `None` for an
    /// untied `token_embd`, only ever looked up row by row.
    rank: Option<usize>,
}

/// The pieces of a `rows` × `rb`-byte matrix at `offset`, at most `piece` bytes each (a multiple
/// of 8 rows: the batched kernels' row groups, 4 and Q4_K's 8, fall as in the whole matrix, so
/// every output keeps its bits). Returns rows per piece and the pieces.
fn pieces_of(offset: u64, rows: usize, rb: usize, piece: usize) -> (usize, Vec<Piece>) {
    let rows_per = (piece / rb.max(1)).clamp(1, rows.max(1));
    let rows_per = if rows_per >= 8 { rows_per - rows_per % 8 } else { rows_per.min(rows.min(8)) };
    (rows_per, (0..rows).step_by(rows_per).map(|r0| (offset + (r0 * rb) as u64, rb * rows_per.min(rows - r0))).collect())
}

/// Order the streamed matrices' pieces in `cycle` (rank, matrix, pieces) as the forward uses
/// them (stable: load order within a layer is use order): each matrix's first piece in the
/// cycle, and the whole cycle.
fn number_cycle(mut cycle: Vec<(usize, Mat, Vec<Piece>)>) -> (Vec<(Mat, usize)>, Vec<Piece>) {
    cycle.sort_by_key(|c| c.0);
    let mut pieces = Vec::new();
    let firsts = cycle
        .into_iter()
        .map(|(_, m, p)| {
            let first = pieces.len();
            pieces.extend(p);
            (m, first)
        })
        .collect();
    (firsts, pieces)
}

/// Reads a GGUF's tensors into a [`Weights`] table, checking shapes (llama.cpp's `create_tensor`).
pub struct Loader<'a> {
    src: &'a dyn ByteSource,
    pub g: &'a GgufFile,
    pub w: Weights,
    stream: Option<&'a DenseStreaming>,
    /// Streamed matrices in load order: (position in the forward's use order, matrix, pieces).
    cycle: Vec<(usize, Mat, Vec<Piece>)>,
    /// Every matrix loaded whole, streamed or not.
    whole: Vec<WholeMat>,
}

impl<'a> Loader<'a> {
    pub fn new(src: &'a dyn ByteSource, g: &'a GgufFile) -> Self {
        Self { src, g, w: Weights::default(), stream: None, cycle: Vec::new(), whole: Vec::new() }
    }

    /// Stream the matrices `s` names (see [`DenseStreaming`]).
    pub fn with_streaming(mut self, s: Option<&'a DenseStreaming>) -> Self {
        self.stream = s;
        self
    }

    /// Register `name` ([cols, rows]) as streamed. Its pieces join the read-ahead cycle in the
    /// order a forward uses them (layer by layer, the output matrix last), except an untied
    /// `token_embd`, which is only ever looked up row by row.
    fn streamed_mat(&mut self, s: &DenseStreaming, name: &str, shape: [usize; 2]) -> Result<Mat, ModelError> {
        let t = self.tensor(name, &shape)?;
        let [cols, rows] = shape;
        let rb = t.ty.row_bytes(cols as u64).unwrap_or(0) as usize;
        if rb == 0 || (rb * rows) as u64 != t.size {
            return Err(ModelError::Shape { name: name.into(), got: t.dims.clone(), want: shape.iter().map(|&x| x as u64).collect() });
        }
        let (rows_per, pieces) = pieces_of(t.offset, rows, rb, s.piece);
        // `first` is numbered by `finish`, once the cycle's order is known.
        let m = self.w.add_streamed(t.ty, cols, rows, ops::StreamedMat { first: 0, n: pieces.len(), rows_per, offset: t.offset });
        if let Some(rank) = self.cycle_rank(name) {
            self.cycle.push((rank, m, pieces));
        }
        Ok(m)
    }

    /// A matrix's place in the read-ahead cycle (`None`: an untied `token_embd`, read by rows).
    fn cycle_rank(&self, name: &str) -> Option<usize> {
        let untied_embd = name == "token_embd.weight" && self.has("output.weight");
        (!untied_embd).then(|| config::tensor_block(name).unwrap_or(usize::MAX))
    }

    /// The loaded weights, with the streamed matrices' read-ahead set up.
    pub fn finish(mut self) -> Result<Weights, ModelError> {
        let Some(s) = self.stream else { return Ok(self.w) };
        if !self.w.has_streamed() {
            return Ok(self.w);
        }
        let (firsts, pieces) = number_cycle(std::mem::take(&mut self.cycle));
        for (m, first) in firsts {
            let sm = self.w.streamed(m).ok_or_else(|| ModelError::Internal("streamed matrix without its entry".into()))?;
            self.w.set_streamed(m, ops::StreamedMat { first, ..sm });
        }
        let ra = crate::store::ahead::ReadAhead::new(s.src.clone(), pieces, s.window, cfg!(not(target_arch = "wasm32")))?;
        self.w.set_read_ahead(ra);
        Ok(self.w)
    }

    pub fn has(&self, name: &str) -> bool {
        self.g.tensor(name).is_some()
    }

    /// Tensor `name`, checked to have the dimensions `want` (GGUF order; trailing 1s ignored).
    fn tensor(&self, name: &str, want: &[usize]) -> Result<&'a crate::gguf::TensorInfo, ModelError> {
        let t = self.g.req_tensor(name)?;
        let mut dims: Vec<u64> = t.dims.clone();
        while dims.len() > want.len() && dims.last() == Some(&1) {
            dims.pop();
        }
        if dims.len() != want.len() || dims.iter().zip(want).any(|(&a, &b)| a as usize != b) {
            return Err(ModelError::Shape { name: name.into(), got: t.dims.clone(), want: want.iter().map(|&x| x as u64).collect() });
        }
        Ok(t)
    }

    fn weight(&self, name: &str, want: &[usize]) -> Result<Weight, ModelError> {
        let t = self.tensor(name, want)?;
        let data = self.src.read_vec(t.offset, t.size as usize)?;
        let rows = if want.len() > 1 { want[1] } else { 1 };
        Ok(Weight::new(t.ty, want[0], rows, data))
    }

    /// A matrix of `shape` = [cols, rows] (GGUF dimension order).
    pub fn mat(&mut self, name: &str, shape: [usize; 2]) -> Result<Mat, ModelError> {
        let m = match self.stream.filter(|s| s.names.contains(name)) {
            Some(s) => self.streamed_mat(s, name, shape)?,
            None => {
                let w = self.weight(name, &shape)?;
                self.w.add_mat(w)
            }
        };
        let offset = self.g.req_tensor(name)?.offset;
        self.whole.push(WholeMat { m, name: name.into(), offset, rank: self.cycle_rank(name) });
        Ok(m)
    }

    /// A tensor of `shape` (GGUF order, ≥ 2 dims) as a matrix: one row per index of the last
    /// dimension, the others flattened into its columns (a conv kernel [kw, kh, c_in, c_out] as
    /// `c_out` rows of `kw·kh·c_in`, as ggml's `im2col` + `mul_mat` reads it).
    pub fn mat_nd(&mut self, name: &str, shape: &[usize]) -> Result<Mat, ModelError> {
        let mut w = self.weight(name, shape)?;
        let (last, rest) = shape.split_last().ok_or_else(|| ModelError::Internal("mat_nd without a shape".into()))?;
        w.cols = rest.iter().product();
        w.rows = *last;
        Ok(self.w.add_mat(w))
    }

    /// A one-row matrix of `cols` values (kept in its block format: a 1-row gate).
    pub fn row(&mut self, name: &str, cols: usize) -> Result<Mat, ModelError> {
        let w = self.weight(name, &[cols])?;
        Ok(self.w.add_mat(w))
    }

    /// An f32 vector of `n` values (norm weights, biases; dequantized if stored otherwise).
    pub fn vec(&mut self, name: &str, n: usize) -> Result<Vector, ModelError> {
        let v = self.weight(name, &[n])?.to_f32()?;
        Ok(self.w.add_vec(v))
    }

    /// An f32 tensor of any `shape` (GGUF order), flattened (e.g. `ssm_conv1d` [d_conv, channels]).
    pub fn vec_shaped(&mut self, name: &str, shape: &[usize]) -> Result<Vector, ModelError> {
        let v = self.weight(name, shape)?.to_f32()?;
        Ok(self.w.add_vec(v))
    }

    /// The rows of matrix `name` ([cols, rows]) split into one matrix per part, each part a list
    /// of row ranges taken in order (a fused projection read as separate ones: each output row
    /// is its own dot product, so the results are the fused product's bits).
    pub fn mat_parts(&mut self, name: &str, shape: [usize; 2], parts: &[Vec<std::ops::Range<usize>>]) -> Result<Vec<Mat>, ModelError> {
        let w = self.weight(name, &shape)?;
        let rb = w.data.len() / w.rows.max(1);
        let mut out = Vec::with_capacity(parts.len());
        for p in parts {
            let mut data = Vec::new();
            let mut rows = 0;
            for r in p {
                if r.end > w.rows || r.start > r.end {
                    return Err(ModelError::Shape { name: name.into(), got: vec![w.cols as u64, w.rows as u64], want: vec![w.cols as u64, r.end as u64] });
                }
                data.extend_from_slice(&w.data[r.start * rb..r.end * rb]);
                rows += r.len();
            }
            out.push(self.w.add_mat(Weight::new(w.ty, w.cols, rows, data)));
        }
        Ok(out)
    }

    /// [`Self::vec`] for an optional tensor (llama.cpp's `TENSOR_NOT_REQUIRED`).
    pub fn opt_vec(&mut self, name: &str, n: usize) -> Result<Option<Vector>, ModelError> {
        if self.has(name) {
            Ok(Some(self.vec(name, n)?))
        } else {
            Ok(None)
        }
    }
}

/// The architecture's layers: one variant per decoder (`llama` serves the four families today).
pub(crate) enum Layers {
    Llama(llama::Llama),
    Hybrid(qwen35moe::Hybrid),
    SmallThinker(smallthinker::SmallThinker),
    Lfm2Moe(lfm2moe::Lfm2Moe),
}

pub struct Model {
    pub cfg: Config,
    /// Every dense tensor (the CPU's copy; a GPU backend uploads it).
    pub weights: Weights,
    pub(crate) tok_embd: Mat,
    pub(crate) output_norm: Vector,
    /// The output matrix (`output.weight`, or `token_embd.weight` when tied).
    pub(crate) output: Mat,
    pub(crate) layers: Layers,
    experts: Option<Arc<dyn ExpertSource>>,
    /// Where each MoE layer's experts live in the GGUF (for streaming stores).
    pub expert_tensors: Vec<GgufExpertTensors>,
    /// Bytes of dense (non-expert) weights held in memory.
    pub dense_bytes: usize,
    /// When set, each forward appends the last row of every layer's FFN input (the residual
    /// stream before `ffn_norm`) to `capture[layer]` (a draft's hidden states, used by a
    /// streamed target as a lookahead signal).
    capture: Option<std::sync::Mutex<Vec<Vec<f32>>>>,
    /// When `Some`, each forward appends every row's output-normed hidden state (`rows ×
    /// n_embd`, llama.cpp's `h_nextn`): what a multi-token-prediction draft reads.
    hidden: std::sync::Mutex<Option<Vec<f32>>>,
    /// The multi-token-prediction block, once [`Model::load_mtp`] loaded it.
    pub mtp: Option<qwen35moe::Mtp>,
    /// The trunk's matrices loaded whole (what [`Model::replan_dense`] may stream or take back).
    whole: Vec<WholeMat>,
}

/// How expert weights are provided when loading.
pub enum ExpertMode {
    /// Load every expert into memory.
    Resident,
    /// Use an external source (a streaming cache); the model loads no expert bytes.
    External(Arc<dyn ExpertSource>),
}

impl Model {
    /// Load dense weights from `src` (and experts as `mode` says).
    pub fn load(src: &dyn ByteSource, g: &GgufFile, mode: ExpertMode) -> Result<Self, ModelError> {
        Self::load_with(src, g, mode, None)
    }

    /// [`Model::load`], reading the matrices `dense` names from storage at each use.
    pub fn load_with(src: &dyn ByteSource, g: &GgufFile, mode: ExpertMode, dense: Option<&DenseStreaming>) -> Result<Self, ModelError> {
        let cfg = Config::from_gguf(g)?;
        let (e, v) = (cfg.n_embd, cfg.n_vocab);
        let mut ld = Loader::new(src, g).with_streaming(dense);
        let tok_embd = ld.mat("token_embd.weight", [e, v])?;
        let output_norm = ld.vec(cfg.output_norm_name(), e)?;
        let output = if ld.has("output.weight") { ld.mat("output.weight", [e, v])? } else { tok_embd };
        if output != tok_embd {
            ld.w.set_host_only(tok_embd);
        }
        let layers = match cfg.arch {
            Arch::Llama => Layers::Llama(llama::Llama::load(&mut ld, &cfg)?),
            Arch::Qwen2Moe => Layers::Llama(qwen2moe::load(&mut ld, &cfg)?),
            Arch::Qwen3Moe => Layers::Llama(qwen3moe::load(&mut ld, &cfg)?),
            Arch::Olmoe => Layers::Llama(olmoe::load(&mut ld, &cfg)?),
            Arch::GptOss => Layers::Llama(gpt_oss::load(&mut ld, &cfg)?),
            Arch::Qwen35Moe | Arch::Qwen35 | Arch::Qwen3Next => Layers::Hybrid(qwen35moe::Hybrid::load(&mut ld, &cfg)?),
            Arch::SmallThinker => Layers::SmallThinker(smallthinker::SmallThinker::load(&mut ld, &cfg)?),
            Arch::Lfm2Moe => Layers::Lfm2Moe(lfm2moe::Lfm2Moe::load(&mut ld, &cfg)?),
        };
        // With an external expert source (a streaming cache, or a bundle whose dense GGUF has no
        // expert tensors) the model needs no expert tensor at all.
        let mut expert_tensors = Vec::new();
        if cfg.is_moe() && matches!(mode, ExpertMode::Resident) {
            for il in cfg.n_dense_lead..cfg.n_layer {
                expert_tensors.push(GgufExpertTensors::find(g, il, e, cfg.n_expert)?);
            }
        }
        let experts: Option<Arc<dyn ExpertSource>> = match (cfg.is_moe(), mode) {
            (false, _) => None,
            (true, ExpertMode::Resident) => Some(Arc::new(ResidentExperts::load(src, &expert_tensors, cfg.n_expert)?)),
            (true, ExpertMode::External(s)) => Some(s),
        };
        let whole = std::mem::take(&mut ld.whole);
        let mut weights = ld.finish()?;
        // The layout the CPU kernels read fastest, where it pays (wasm relaxed SIMD).
        weights.repack(false);
        let dense_bytes = g.tensors.iter().filter(|t| !t.name.contains("_exps.weight") && !cfg.is_nextn_tensor(&t.name)).map(|t| t.size as usize).sum::<usize>().saturating_sub(weights.streamed_bytes() as usize);
        Ok(Self { cfg, weights, tok_embd, output_norm, output, layers, experts, expert_tensors, dense_bytes, capture: None, hidden: Default::default(), mtp: None, whole })
    }

    /// Change which matrices are read from storage at each use while the model runs (a memory
    /// budget lowered below the dense weights, or raised again): the matrices `dense` names are
    /// streamed from `dense.src` (their bytes freed), the others held (read back from
    /// `dense.src`, which must hold the same bytes as the file loaded). The results keep their
    /// bits either way (pieces of whole row groups). On an error (a failed read) nothing
    /// changes. CPU backend only: a GPU holds its own copy of the weights. Returns the dense
    /// bytes now held.
    pub fn replan_dense(&mut self, dense: &DenseStreaming) -> Result<usize, ModelError> {
        let want = |w: &WholeMat| dense.names.contains(&w.name);
        // Read what becomes resident first: a failed read leaves everything as it was.
        let mut reads = Vec::new();
        for w in self.whole.iter().filter(|w| !want(w) && self.weights.streamed(w.m).is_some()) {
            let m = self.weights.mat(w.m);
            let len = m.ty.row_bytes(m.cols as u64).unwrap_or(0) as usize * m.rows;
            reads.push((w.m, dense.src.read_vec(w.offset, len)?));
        }
        // The new streamed entries and their cycle.
        let (mut streamed, mut cycle) = (std::collections::HashMap::new(), Vec::new());
        for w in self.whole.iter().filter(|w| want(w)) {
            let m = self.weights.mat(w.m);
            let rb = m.ty.row_bytes(m.cols as u64).unwrap_or(0) as usize;
            let (rows_per, pieces) = pieces_of(w.offset, m.rows, rb, dense.piece);
            streamed.insert(w.m, ops::StreamedMat { first: 0, n: pieces.len(), rows_per, offset: w.offset });
            if let Some(rank) = w.rank {
                cycle.push((rank, w.m, pieces));
            }
        }
        let (firsts, pieces) = number_cycle(cycle);
        for (m, first) in firsts {
            if let Some(sm) = streamed.get_mut(&m) {
                sm.first = first;
            }
        }
        let ra = if streamed.is_empty() { None } else { Some(crate::store::ahead::ReadAhead::new(dense.src.clone(), pieces, dense.window, cfg!(not(target_arch = "wasm32")))?) };
        // Commit (nothing below fails): the old read-ahead stops, streamed bytes are freed.
        let total = self.dense_bytes + self.weights.streamed_bytes() as usize;
        self.weights.clear_read_ahead();
        for (m, data) in reads {
            self.weights.set_resident(m, data);
        }
        for (m, s) in streamed {
            self.weights.stream_instead(m, s);
        }
        if let Some(ra) = ra {
            self.weights.set_read_ahead(ra);
        }
        self.dense_bytes = total.saturating_sub(self.weights.streamed_bytes() as usize);
        Ok(self.dense_bytes)
    }

    /// The per-sequence cache: keys and values of the attention layers, recurrent states of the
    /// Gated DeltaNet layers.
    pub fn new_kv(&self, n_ctx: usize) -> Result<KvCache, ModelError> {
        let c = &self.cfg;
        let layers: Vec<Option<(usize, usize)>> =
            (0..c.n_layer).map(|il| c.state_lens(il)).collect();
        let windows: Vec<usize> = (0..c.n_layer).map(|il| c.window(il)).collect();
        KvCache::try_with_windows(&layers, &windows, n_ctx, c.n_head_kv, c.head_dim).map_err(|bytes| ModelError::OutOfMemory { what: "KV cache", bytes })
    }

    /// Start (or stop) recording each forward's last-row FFN inputs per layer.
    pub fn set_capture(&mut self, on: bool) {
        self.capture = on.then(|| std::sync::Mutex::new(vec![Vec::new(); self.cfg.n_layer]));
    }
    /// The recorded FFN inputs per layer (`rows × n_embd`, one row per forward since the last
    /// call), emptying the record.
    pub fn take_captured(&self) -> Vec<Vec<f32>> {
        match &self.capture {
            Some(c) => {
                let mut g = c.lock().unwrap();
                let out = g.clone();
                g.iter_mut().for_each(|r| r.clear());
                out
            }
            None => Vec::new(),
        }
    }

    /// Start (or stop) recording every forward's output-normed hidden rows.
    pub fn set_record_hidden(&self, on: bool) {
        *self.hidden.lock().unwrap() = on.then(Vec::new);
    }
    pub(crate) fn records_hidden(&self) -> bool {
        self.hidden.lock().unwrap().is_some()
    }
    pub(crate) fn push_hidden(&self, rows: &[f32]) {
        if let Some(h) = self.hidden.lock().unwrap().as_mut() {
            h.extend_from_slice(rows);
        }
    }
    /// The hidden rows recorded since the last call (`rows × n_embd`, in forward order).
    pub fn take_hidden(&self) -> Vec<f32> {
        self.hidden.lock().unwrap().as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Load the multi-token-prediction (NextN) block that follows the trunk (`qwen35moe`,
    /// `qwen35`, `qwen3next` files with `nextn_predict_layers` ≥ 1; llama.cpp's `load_block_mtp`
    /// and `graph_mtp`, `src/models/qwen35moe.cpp`): its weights join the model's (the token
    /// embeddings and output matrix stay shared), its experts are held in memory. Returns the
    /// bytes it holds.
    pub fn load_mtp(&mut self, src: &dyn ByteSource, g: &GgufFile) -> Result<usize, ModelError> {
        self.load_mtp_with(src, g, None)
    }

    /// As [`Self::load_mtp`], the block's experts given (read from a `.les` bundle:
    /// [`crate::engine::mtp::load_mtp_file`]) where `g` (a bundle's dense GGUF) holds none.
    pub fn load_mtp_with(&mut self, src: &dyn ByteSource, g: &GgufFile, experts: Option<ResidentExperts>) -> Result<usize, ModelError> {
        let Layers::Hybrid(_) = &self.layers else {
            return Err(ModelError::Unsupported(format!("{}: multi-token prediction is implemented for qwen35moe, qwen35 and qwen3next", self.cfg.arch.name())));
        };
        if self.cfg.n_nextn == 0 {
            return Err(ModelError::Unsupported("the model has no multi-token-prediction block (nextn_predict_layers is 0 or absent)".into()));
        }
        let mut ld = Loader::new(src, g);
        ld.w = std::mem::take(&mut self.weights);
        let r = qwen35moe::Mtp::load(&mut ld, &self.cfg, self.tok_embd, self.output_norm, self.output);
        self.weights = ld.w;
        self.weights.repack(false);
        let mut mtp = r?;
        let il = self.cfg.n_layer;
        let mut bytes = self.cfg.mtp_bytes(g) as usize;
        if let Some(x) = experts {
            bytes += x.bytes();
            mtp.experts = Some(Arc::new(x));
        } else if self.cfg.is_moe() {
            let t = GgufExpertTensors::find(g, il, self.cfg.n_embd, self.cfg.n_expert)?;
            mtp.experts = Some(Arc::new(ResidentExperts::load(src, &[t], self.cfg.n_expert)?));
        }
        mtp.bytes = bytes;
        self.mtp = Some(mtp);
        Ok(bytes)
    }

    /// The MTP block's forward on the CPU: `tokens` at positions `kv.len..` of the block's own
    /// cache (one attention layer, [`Self::new_mtp_kv`]), each paired with the hidden state `h`
    /// (`tokens.len() × n_embd`) of the position before it. Returns the last row's logits and its
    /// output-normed hidden state (the next draft step's `h`).
    pub fn forward_mtp(&self, tokens: &[u32], h: &[f32], kv: &mut KvCache) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
        let (Some(mtp), Layers::Hybrid(hy)) = (&self.mtp, &self.layers) else {
            return Err(ModelError::Unsupported("no multi-token-prediction block is loaded".into()));
        };
        if h.len() != tokens.len() * self.cfg.n_embd || tokens.is_empty() {
            return Err(ModelError::Internal(format!("{} hidden values for {} MTP rows of {}", h.len(), tokens.len(), self.cfg.n_embd)));
        }
        let pos0 = kv.len;
        if pos0 + tokens.len() > kv.n_ctx {
            return Err(ModelError::ContextFull(kv.n_ctx));
        }
        kv.take_events();
        let out = {
            let mut b = CpuExec::new(&self.weights, kv, false);
            let mut f = blocks::Fwd::new(self, &mut b, pos0, Input::Tokens(tokens), Some(Logits::Last));
            f.experts = mtp.experts.clone();
            f.record = false;
            ops::ready(hy.forward_mtp(&mut f, mtp, h))??
        };
        kv.len = pos0 + tokens.len();
        Ok(out)
    }

    /// Token embeddings (`get_rows` of `token_embd`), `tokens.len() × n_embd` (the MTP draft's
    /// cross-token lookahead: the rows a coming forward starts from).
    pub fn token_rows(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let e = self.cfg.n_embd;
        let mut x = vec![0f32; tokens.len() * e];
        for (row, &t) in x.chunks_mut(e).zip(tokens) {
            if t as usize >= self.cfg.n_vocab {
                return Err(ModelError::Internal(format!("token {t} outside the vocabulary of {}", self.cfg.n_vocab)));
            }
            self.weights.row_f32(self.tok_embd, t as usize, row)?;
        }
        Ok(x)
    }

    /// The MTP block's cache: one attention layer.
    pub fn new_mtp_kv(&self, n_ctx: usize) -> Result<KvCache, ModelError> {
        KvCache::try_with_windows(&[None], &[], n_ctx, self.cfg.n_head_kv, self.cfg.head_dim).map_err(|bytes| ModelError::OutOfMemory { what: "MTP block's KV cache", bytes })
    }

    pub fn experts(&self) -> Option<&Arc<dyn ExpertSource>> {
        self.experts.as_ref()
    }

    /// Route a MoE model's experts through `src` from now on (the dense weights stay).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn set_experts(&mut self, src: Arc<dyn ExpertSource>) {
        if self.experts.is_some() {
            self.experts = Some(src);
        }
    }

    /// Run `tokens` at positions `kv.len ..` on the CPU, appending to the KV cache. Returns logits
    /// (`n_vocab` values for `Logits::Last`, `tokens.len() * n_vocab` for `Logits::All`).
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        self.forward_cpu(Input::Tokens(tokens), kv, want, false)
    }

    /// [`Model::forward`] with every row computed exactly as a single-token forward computes it
    /// (`per_row`), instead of with llama.cpp's batch kernels: speculative verification needs the
    /// logits of a batch to be the bits of feeding its tokens one at a time.
    pub fn forward_per_row(&self, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        self.forward_cpu(Input::Tokens(tokens), kv, want, true)
    }

    fn forward_cpu(&self, input: Input<'_>, kv: &mut KvCache, want: Logits, per_row: bool) -> Result<Vec<f32>, ModelError> {
        let pos0 = kv.len;
        let n = input.rows(self.cfg.n_embd);
        if pos0 + n > kv.n_ctx {
            return Err(ModelError::ContextFull(kv.n_ctx));
        }
        kv.take_events(); // the CPU's states are the cache's own
        let logits = {
            let mut b = CpuExec::new(&self.weights, kv, per_row);
            if crate::backend::profile::enabled() {
                let t0 = crate::clock::now_ms();
                let l = ops::ready(self.forward_input(&mut crate::backend::profile::Profiled(&mut b), input, pos0, Some(want)))??;
                crate::backend::profile::record("forward", crate::clock::now_ms() - t0);
                l
            } else {
                ops::ready(self.forward_input(&mut b, input, pos0, Some(want)))??
            }
        };
        kv.len = pos0 + n;
        Ok(logits)
    }

    /// `n` rows of embeddings (`embd`: `n × n_embd`, an image's) at positions `kv.len..` on the
    /// CPU, as llama.cpp decodes an image chunk (`mtmd_helper_decode_image_chunk`: one batch,
    /// causal; a MiniCPM-V piece's rows take consecutive positions in every M-RoPE section).
    pub fn forward_embd(&self, embd: &[f32], n: usize, kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        self.check_embd(embd, n)?;
        self.forward_cpu(Input::Embd(embd), kv, want, false)
    }

    /// [`Self::forward_embd`] on the wgpu backend `g`, in chunks of [`GPU_BATCH`] rows.
    pub async fn forward_gpu_embd(&self, g: &GpuBackend, embd: &[f32], n: usize, kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        self.check_embd(embd, n)?;
        self.forward_gpu_input(g, Input::Embd(embd), kv, want).await
    }

    fn check_embd(&self, embd: &[f32], n: usize) -> Result<(), ModelError> {
        if embd.len() != n * self.cfg.n_embd {
            return Err(ModelError::Unsupported(format!("{} embedding values for {n} rows of {}", embd.len(), self.cfg.n_embd)));
        }
        Ok(())
    }

    /// The forward pass on any backend: `tokens` at positions `pos0..`; logits as `want` says
    /// (`None`: none, for all but the last chunk of a prompt). The caller owns the position count.
    pub async fn forward_on<B: Ops>(&self, b: &mut B, tokens: &[u32], pos0: usize, want: Option<Logits>) -> Result<Vec<f32>, ModelError> {
        self.forward_input(b, Input::Tokens(tokens), pos0, want).await
    }

    /// [`Self::forward_on`] for tokens or embeddings.
    pub async fn forward_input<B: Ops>(&self, b: &mut B, input: Input<'_>, pos0: usize, want: Option<Logits>) -> Result<Vec<f32>, ModelError> {
        let mut f = blocks::Fwd::new(self, b, pos0, input, want);
        match &self.layers {
            Layers::Llama(a) => a.forward(&mut f).await,
            Layers::Hybrid(a) => a.forward(&mut f).await,
            Layers::SmallThinker(a) => a.forward(&mut f).await,
            Layers::Lfm2Moe(a) => a.forward(&mut f).await,
        }
    }

    /// What the wgpu backend allocates for this model with `n_ctx` positions: a slot of `n_ctx`
    /// cells per attention layer, a ring of [`crate::backend::cpu::kv::swa_ring_cells`] per
    /// sliding-window layer (fewer than the host's bounded cells, which the budget plan
    /// counts: [`Config::cache_bytes`]).
    pub fn gpu_shapes(&self, n_ctx: usize) -> GpuShapes {
        let c = &self.cfg;
        let swa_layers = (0..c.n_layer).filter(|&il| !c.is_recurrent(il) && c.window(il) > 0).count();
        GpuShapes {
            n_moe_layer: c.n_moe_layers(),
            kv_layers: c.n_attn_layers() - swa_layers,
            swa_layers,
            swa_cells: if swa_layers > 0 { crate::backend::cpu::kv::swa_ring_cells(c.n_swa, GPU_BATCH, n_ctx) } else { 0 },
            n_head_kv: c.n_head_kv,
            head_dim: c.head_dim,
            n_ctx,
            n_expert: c.n_expert,
            n_expert_used: c.n_expert_used,
        }
    }

    /// The forward pass on the wgpu backend `g`, in chunks of [`GPU_BATCH`] tokens. Keys and values
    /// live on the GPU; `kv` keeps only the position count. Returns logits as [`Model::forward`].
    pub async fn forward_gpu(&self, g: &GpuBackend, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        self.forward_gpu_input(g, Input::Tokens(tokens), kv, want).await
    }

    async fn forward_gpu_input(&self, g: &GpuBackend, input: Input<'_>, kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        let n = input.rows(self.cfg.n_embd);
        let n_ctx = g.n_ctx().min(kv.n_ctx);
        if kv.len + n > n_ctx {
            return Err(ModelError::ContextFull(n_ctx));
        }
        let mut out = Vec::new();
        let mut events = kv.take_events();
        let n_chunks = n.div_ceil(GPU_BATCH);
        for i in 0..n_chunks {
            let ch = input.slice(i * GPU_BATCH, ((i + 1) * GPU_BATCH).min(n), self.cfg.n_embd);
            let w = match want {
                Logits::All => Some(Logits::All),
                Logits::Last if i + 1 == n_chunks => Some(Logits::Last),
                Logits::Last => None,
            };
            let mut b = g.exec()?;
            b.apply_state_events(&std::mem::take(&mut events))?;
            let l = self.forward_input(&mut b, ch, kv.len, w).await?;
            b.finish()?;
            kv.len += ch.rows(self.cfg.n_embd);
            out.extend_from_slice(&l);
        }
        Ok(out)
    }

    /// Blocking [`Self::forward_gpu`] (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_gpu_blocking(&self, g: &GpuBackend, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        crate::backend::wgpu::block_on(self.forward_gpu(g, tokens, kv, want))
    }

    /// The output embedding matrix type (for reporting).
    pub fn output_type(&self) -> GgmlType {
        self.weights.mat(self.output).ty
    }
}

/// Router logits (`t_n` rows of `n_expert`) → expert ids (rank order) and weights, as llama.cpp's
/// `build_moe_ffn` (src/llama-graph.cpp): [`Gating::Softmax`]: softmax → top-k of the
/// probabilities → normalised for llama/qwen3moe; [`Gating::SoftmaxWeight`] (gpt-oss): top-k of
/// the raw logits → softmax over those k; then scaled by `expert_weights_scale`. Shared by every
/// backend so routing is identical.
/// `sel_bias`: a selection bias (`exp_probs_b`, lfm2moe) added to the probabilities for the
/// top-k choice only; the weights are the unbiased probabilities (`build_moe_ffn`).
pub(crate) fn route(c: &Config, logits: &[f32], t_n: usize, sel_bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
    route_biased(&c.route_spec(), logits, t_n, sel_bias)
}

/// [`route`] for a router described by `c` ([`RouteSpec`]): the host's reference for the
/// device's router (shaders/route.wgsl).
pub fn route_with(c: &crate::backend::ops::RouteSpec, logits: &[f32], t_n: usize) -> (Vec<u32>, Vec<f32>) {
    route_biased(c, logits, t_n, None)
}

/// [`route_with`] with an optional selection bias ([`route`]).
pub fn route_biased(c: &crate::backend::ops::RouteSpec, logits: &[f32], t_n: usize, sel_bias: Option<&[f32]>) -> (Vec<u32>, Vec<f32>) {
    let k = c.k;
    let mut sel = vec![0u32; t_n * k];
    let mut wts = vec![0f32; t_n * k];
    let mut probs = vec![0f32; c.n_expert];
    for t in 0..t_n {
        let row = &logits[t * c.n_expert..(t + 1) * c.n_expert];
        if c.gating == crate::backend::ops::Gating::SoftmaxWeight {
            let top = cpu_ops::top_k(row, k);
            let picked: Vec<f32> = top.iter().map(|&ex| row[ex]).collect();
            cpu_ops::softmax(&picked, &mut wts[t * k..(t + 1) * k]);
            for (r, &ex) in top.iter().enumerate() {
                sel[t * k + r] = ex as u32;
            }
        } else {
            if c.gating == crate::backend::ops::Gating::Sigmoid {
                for (p, &x) in probs.iter_mut().zip(row) {
                    *p = cpu_ops::sigmoid_exp(x);
                }
            } else {
                cpu_ops::softmax(row, &mut probs);
            }
            let top = match sel_bias.filter(|b| b.len() == probs.len()) {
                Some(b) => cpu_ops::top_k(&probs.iter().zip(b).map(|(p, b)| p + b).collect::<Vec<f32>>(), k),
                None => cpu_ops::top_k(&probs, k),
            };
            // ggml_sum_rows (`ggml_vec_sum_f32`) adds in f64 and rounds once.
            let mut sum = 0f64;
            for (r, &ex) in top.iter().enumerate() {
                sel[t * k + r] = ex as u32;
                wts[t * k + r] = probs[ex];
                sum += probs[ex] as f64;
            }
            if c.norm_topk {
                let sum = (sum as f32).max(6.103515625e-5);
                for w in &mut wts[t * k..(t + 1) * k] {
                    *w /= sum;
                }
            }
        }
        if c.scale != 0.0 && c.scale != 1.0 {
            for w in &mut wts[t * k..(t + 1) * k] {
                *w *= c.scale;
            }
        }
    }
    (sel, wts)
}

/// `LES_DEBUG_DUMP=1`: print each intermediate's sum and first values (as llama.cpp's
/// `llama-eval-callback` does) to compare runs op by op. On wasm32 the lines collect in a buffer
/// (`setDebugDump` / `takeDebugDump` in the JS API) to compare the browser with a native run.
pub(crate) fn dump(name: &str, il: usize, x: &[f32]) {
    #[cfg(not(target_arch = "wasm32"))]
    dump_file(name, il, x);
    if dump_enabled() {
        let sum: f64 = x.iter().map(|&v| v as f64).sum();
        // FNV-1a of the bits: equal hashes mean bit-identical tensors.
        let h = x.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, v| (h ^ v.to_bits() as u64).wrapping_mul(0x100_0000_01b3));
        let line = format!("{name}-{il}: sum = {sum:.6} first = {:?} bits = {h:016x}", &x[..x.len().min(3)]);
        #[cfg(not(target_arch = "wasm32"))]
        eprintln!("{line}");
        #[cfg(target_arch = "wasm32")]
        {
            let mut b = DUMP_BUF.lock().unwrap();
            b.push_str(&line);
            b.push('\n');
        }
    }
}

/// `LES_DEBUG_DUMP_DIR=DIR`: write each intermediate as raw little-endian f32 to
/// `DIR/<forward call>/<name>-<layer>.f32`, for element-wise comparison with llama.cpp's tensors
/// (`tools/llama_ref.cpp --dump`, compared by `tools/cmp_dumps.py`).
#[cfg(not(target_arch = "wasm32"))]
fn dump_file(name: &str, il: usize, x: &[f32]) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;
    static DIR: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    static STEP: AtomicUsize = AtomicUsize::new(usize::MAX);
    let Some(dir) = DIR.get_or_init(|| std::env::var_os("LES_DEBUG_DUMP_DIR").map(Into::into)) else { return };
    if name == "embd" {
        STEP.fetch_add(1, Ordering::Relaxed);
    }
    let d = dir.join(STEP.load(Ordering::Relaxed).to_string());
    let _ = std::fs::create_dir_all(&d);
    let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let _ = std::fs::write(d.join(format!("{name}-{il}.f32")), bytes);
}

#[cfg(target_arch = "wasm32")]
pub(crate) static DUMP_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
#[cfg(target_arch = "wasm32")]
pub(crate) static DUMP_BUF: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// Whether `LES_DEBUG_DUMP` is set (read once).
/// Whether intermediates are dumped at all (`LES_DEBUG_DUMP` or `LES_DEBUG_DUMP_DIR`): only
/// then does a forward read them back from a GPU.
pub(crate) fn dump_wanted() -> bool {
    #[cfg(not(target_arch = "wasm32"))]
    {
        use std::sync::OnceLock;
        static DIR: OnceLock<bool> = OnceLock::new();
        dump_enabled() || *DIR.get_or_init(|| std::env::var_os("LES_DEBUG_DUMP_DIR").is_some())
    }
    #[cfg(target_arch = "wasm32")]
    {
        dump_enabled()
    }
}

#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn dump_enabled() -> bool {
    use std::sync::OnceLock;
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("LES_DEBUG_DUMP").is_some())
}

#[cfg(target_arch = "wasm32")]
pub(crate) fn dump_enabled() -> bool {
    DUMP_ON.load(std::sync::atomic::Ordering::Relaxed)
}

