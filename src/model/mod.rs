//! Transformer models: llama (dense and Mixtral-style MoE), qwen2moe, qwen3moe, olmoe.
//!
//! One forward pass follows llama.cpp's graphs (`src/models/llama.cpp`, `qwen2moe.cpp`,
//! `qwen3moe.cpp`, `olmoe.cpp`): RMSNorm → attention (GQA, RoPE, optional biases / QK-norm) →
//! residual → RMSNorm → FFN (dense SwiGLU, or router softmax → top-k → experts combined in rank
//! order, plus an optional shared expert) → residual. Experts are reached only through
//! [`ExpertSource`].

pub mod config;
pub mod kv;

use crate::backend::cpu::matmul::{matmul, Acts, RowMode, Weight};
use crate::backend::cpu::{ops, par};
use crate::expert::{ExpertError, ExpertSource, GgufExpertTensors, ResidentExperts};
use crate::gguf::{GgufError, GgufFile};
use crate::quant::{GgmlType, QuantError};
use crate::store::{ByteSource, StoreError};
pub use config::{Arch, Config, ConfigError};
pub use kv::KvCache;
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
    #[error(transparent)]
    Gpu(#[from] crate::backend::wgpu::GpuError),
}

pub(crate) struct SharedExpert {
    pub(crate) gate: Weight,
    pub(crate) up: Weight,
    pub(crate) down: Weight,
    /// qwen2moe: a 1-row gate whose sigmoid scales the shared expert's output.
    pub(crate) gate_inp: Option<Weight>,
}

pub(crate) enum Ffn {
    Dense { gate: Weight, up: Weight, down: Weight },
    Moe { router: Weight, shared: Option<SharedExpert> },
}

pub(crate) struct Layer {
    pub(crate) attn_norm: Vec<f32>,
    pub(crate) wq: Weight,
    pub(crate) wk: Weight,
    pub(crate) wv: Weight,
    pub(crate) wo: Weight,
    pub(crate) bq: Option<Vec<f32>>,
    pub(crate) bk: Option<Vec<f32>>,
    pub(crate) bv: Option<Vec<f32>>,
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) ffn_norm: Vec<f32>,
    pub(crate) ffn: Ffn,
}

/// What a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Logits of the last token only.
    Last,
    /// Logits of every token in the batch (teacher forcing, speculative verification).
    All,
}

pub struct Model {
    pub cfg: Config,
    pub(crate) tok_embd: Weight,
    pub(crate) output_norm: Vec<f32>,
    pub(crate) output: Option<Weight>,
    pub(crate) layers: Vec<Layer>,
    experts: Option<Arc<dyn ExpertSource>>,
    /// Where each MoE layer's experts live in the GGUF (for streaming stores).
    pub expert_tensors: Vec<GgufExpertTensors>,
    /// Bytes of dense (non-expert) weights held in memory.
    pub dense_bytes: usize,
    /// When set, each forward appends the last row of every layer's FFN input (the residual
    /// stream before `ffn_norm`) to `capture[layer]` (a draft's hidden states, used by a
    /// streamed target as a lookahead signal).
    capture: Option<std::sync::Mutex<Vec<Vec<f32>>>>,
}

fn load_weight(src: &dyn ByteSource, g: &GgufFile, name: &str, want: &[usize]) -> Result<Weight, ModelError> {
    let t = g.req_tensor(name)?;
    let mut dims: Vec<u64> = t.dims.clone();
    while dims.len() > want.len() && dims.last() == Some(&1) {
        dims.pop();
    }
    if dims.len() != want.len() || dims.iter().zip(want).any(|(&a, &b)| a as usize != b) {
        return Err(ModelError::Shape { name: name.into(), got: t.dims.clone(), want: want.iter().map(|&x| x as u64).collect() });
    }
    let data = src.read_vec(t.offset, t.size as usize)?;
    let rows = if want.len() > 1 { want[1] } else { 1 };
    Ok(Weight { ty: t.ty, cols: want[0], rows, data })
}

fn load_vec(src: &dyn ByteSource, g: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
    Ok(load_weight(src, g, name, &[n])?.to_f32()?)
}

fn opt_vec(src: &dyn ByteSource, g: &GgufFile, name: &str, n: usize) -> Result<Option<Vec<f32>>, ModelError> {
    if g.tensor(name).is_some() {
        Ok(Some(load_vec(src, g, name, n)?))
    } else {
        Ok(None)
    }
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
        let cfg = Config::from_gguf(g)?;
        let (e, v) = (cfg.n_embd, cfg.n_vocab);
        let tok_embd = load_weight(src, g, "token_embd.weight", &[e, v])?;
        let output_norm = load_vec(src, g, "output_norm.weight", e)?;
        let output = if g.tensor("output.weight").is_some() { Some(load_weight(src, g, "output.weight", &[e, v])?) } else { None };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        let mut expert_tensors = Vec::new();
        // With an external expert source (a streaming cache, or a bundle whose dense GGUF has no
        // expert tensors) the model needs no expert tensor at all.
        let resident = matches!(mode, ExpertMode::Resident);
        let (nq, nkv) = (cfg.n_embd_q(), cfg.n_embd_kv());
        for il in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}");
            let (q_norm, k_norm) = match cfg.arch {
                Arch::Qwen3Moe => (Some(load_vec(src, g, &n("attn_q_norm.weight"), cfg.head_dim)?), Some(load_vec(src, g, &n("attn_k_norm.weight"), cfg.head_dim)?)),
                Arch::Olmoe => (Some(load_vec(src, g, &n("attn_q_norm.weight"), nq)?), Some(load_vec(src, g, &n("attn_k_norm.weight"), nkv)?)),
                _ => (None, None),
            };
            let ffn = if cfg.is_moe() {
                let router = load_weight(src, g, &n("ffn_gate_inp.weight"), &[e, cfg.n_expert])?;
                if resident {
                    expert_tensors.push(GgufExpertTensors::find(g, il, e, cfg.n_expert)?);
                }
                let shared = if g.tensor(&n("ffn_gate_shexp.weight")).is_some() {
                    let sh = g.req_tensor(&n("ffn_gate_shexp.weight"))?.dims.get(1).copied().unwrap_or(0) as usize;
                    Some(SharedExpert {
                        gate: load_weight(src, g, &n("ffn_gate_shexp.weight"), &[e, sh])?,
                        up: load_weight(src, g, &n("ffn_up_shexp.weight"), &[e, sh])?,
                        down: load_weight(src, g, &n("ffn_down_shexp.weight"), &[sh, e])?,
                        gate_inp: if g.tensor(&n("ffn_gate_inp_shexp.weight")).is_some() {
                            Some(load_weight(src, g, &n("ffn_gate_inp_shexp.weight"), &[e])?)
                        } else {
                            None
                        },
                    })
                } else {
                    None
                };
                Ffn::Moe { router, shared }
            } else {
                Ffn::Dense {
                    gate: load_weight(src, g, &n("ffn_gate.weight"), &[e, cfg.n_ff])?,
                    up: load_weight(src, g, &n("ffn_up.weight"), &[e, cfg.n_ff])?,
                    down: load_weight(src, g, &n("ffn_down.weight"), &[cfg.n_ff, e])?,
                }
            };
            layers.push(Layer {
                attn_norm: load_vec(src, g, &n("attn_norm.weight"), e)?,
                wq: load_weight(src, g, &n("attn_q.weight"), &[e, nq])?,
                wk: load_weight(src, g, &n("attn_k.weight"), &[e, nkv])?,
                wv: load_weight(src, g, &n("attn_v.weight"), &[e, nkv])?,
                wo: load_weight(src, g, &n("attn_output.weight"), &[nq, e])?,
                bq: opt_vec(src, g, &n("attn_q.bias"), nq)?,
                bk: opt_vec(src, g, &n("attn_k.bias"), nkv)?,
                bv: opt_vec(src, g, &n("attn_v.bias"), nkv)?,
                q_norm,
                k_norm,
                ffn_norm: load_vec(src, g, &n("ffn_norm.weight"), e)?,
                ffn,
            });
        }
        let experts: Option<Arc<dyn ExpertSource>> = match (cfg.is_moe(), mode) {
            (false, _) => None,
            (true, ExpertMode::Resident) => Some(Arc::new(ResidentExperts::load(src, &expert_tensors, cfg.n_expert)?)),
            (true, ExpertMode::External(s)) => Some(s),
        };
        let dense_bytes = g.tensors.iter().filter(|t| !t.name.contains("_exps.")).map(|t| t.size as usize).sum();
        Ok(Self { cfg, tok_embd, output_norm, output, layers, experts, expert_tensors, dense_bytes, capture: None })
    }

    pub fn new_kv(&self, n_ctx: usize) -> KvCache {
        KvCache::new(self.cfg.n_layer, n_ctx, self.cfg.n_head_kv, self.cfg.head_dim)
    }

    /// Start (or stop) recording each forward's last-row FFN inputs per layer.
    pub fn set_capture(&mut self, on: bool) {
        self.capture = on.then(|| std::sync::Mutex::new(vec![Vec::new(); self.layers.len()]));
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

    pub fn experts(&self) -> Option<&Arc<dyn ExpertSource>> {
        self.experts.as_ref()
    }

    /// Route a MoE model's experts through `src` from now on (the dense weights stay).
    #[cfg(not(target_arch = "wasm32"))]
    pub(crate) fn set_experts(&mut self, src: Arc<dyn ExpertSource>) {
        if self.experts.is_some() {
            self.experts = Some(src);
        }
    }

    /// Run `tokens` at positions `kv.len ..`, appending to the KV cache. Returns logits
    /// (`n_vocab` values for `Logits::Last`, `tokens.len() * n_vocab` for `Logits::All`).
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        par::in_pool(|| self.forward_with(tokens, kv, want, false))
    }

    /// [`Model::forward`] with every row computed exactly as a single-token forward computes it
    /// (`per_row`), instead of with llama.cpp's batch kernels: speculative verification needs the
    /// logits of a batch to be the bits of feeding its tokens one at a time.
    pub fn forward_per_row(&self, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        par::in_pool(|| self.forward_with(tokens, kv, want, true))
    }

    fn forward_with(&self, tokens: &[u32], kv: &mut KvCache, want: Logits, per_row: bool) -> Result<Vec<f32>, ModelError> {
        let c = &self.cfg;
        let mode = |experts: bool| match (per_row, experts) {
            (true, _) => RowMode::PerRow,
            (false, true) => RowMode::Experts,
            (false, false) => RowMode::Batch,
        };
        let t_n = tokens.len();
        let e = c.n_embd;
        let pos0 = kv.len;
        if pos0 + t_n > kv.n_ctx {
            return Err(ModelError::ContextFull(kv.n_ctx));
        }
        // Embedding lookup.
        let mut x = vec![0f32; t_n * e];
        for (t, &tok) in tokens.iter().enumerate() {
            if tok as usize >= self.tok_embd.rows {
                return Err(ModelError::BadToken(tok));
            }
            self.tok_embd.row_f32(tok as usize, &mut x[t * e..(t + 1) * e])?;
        }
        dump("embd", 0, &x);
        let mut cur = vec![0f32; t_n * e];
        let (nq, nkv) = (c.n_embd_q(), c.n_embd_kv());
        let mut q = vec![0f32; t_n * nq];
        let mut k = vec![0f32; t_n * nkv];
        let mut v = vec![0f32; t_n * nkv];
        let mut attn = vec![0f32; t_n * nq];
        let mut rope_cache = Vec::new();
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let mut n_rows = t_n; // rows still carried (the last layer may drop all but the last)
        for (il, l) in self.layers.iter().enumerate() {
            // Attention.
            for t in 0..t_n {
                ops::rms_norm(&x[t * e..(t + 1) * e], &l.attn_norm, c.rms_eps, &mut cur[t * e..(t + 1) * e]);
            }
            dump("attn_norm", il, &cur);
            {
                let mut a = Acts::with_mode(&cur, e, mode(false));
                matmul(l.wq.as_ref(), &mut a, &mut q);
                matmul(l.wk.as_ref(), &mut a, &mut k);
                matmul(l.wv.as_ref(), &mut a, &mut v);
            }
            dump("Qcur", il, &q);
            dump("Kcur", il, &k);
            dump("Vcur", il, &v);
            for t in 0..t_n {
                let (qt, kt, vt) = (&mut q[t * nq..(t + 1) * nq], &mut k[t * nkv..(t + 1) * nkv], &mut v[t * nkv..(t + 1) * nkv]);
                add_bias(qt, &l.bq);
                add_bias(kt, &l.bk);
                add_bias(vt, &l.bv);
                if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
                    ops::rms_norm_groups(qt, qn, c.rms_eps);
                    ops::rms_norm_groups(kt, kn, c.rms_eps);
                }
                ops::rope_cache(pos0 + t, c.n_rot, c.rope_base, &mut rope_cache);
                ops::rope(qt, c.head_dim, c.n_rot, c.rope, &rope_cache);
                ops::rope(kt, c.head_dim, c.n_rot, c.rope, &rope_cache);
                kv.store(il, pos0 + t, kt, vt);
            }
            dump("Qrope", il, &q);
            dump("Krope", il, &k);
            self.attention(il, kv, pos0, t_n, &q, &mut attn, scale);
            dump("kqv_out", il, &attn);
            {
                let mut a = Acts::with_mode(&attn, nq, mode(false));
                matmul(l.wo.as_ref(), &mut a, &mut cur);
            }
            dump("attn_out", il, &cur);
            if il + 1 == self.layers.len() && want == Logits::Last && n_rows > 1 {
                // Only the last position's logits are wanted: the last layer's FFN runs on that
                // row alone, as llama.cpp's graph does (`inp_out_ids`), so its kernels see one
                // row just as llama.cpp's do.
                x.drain(..(n_rows - 1) * e);
                cur.drain(..(n_rows - 1) * e);
                n_rows = 1;
            }
            for (xi, &ci) in x.iter_mut().zip(&cur) {
                *xi += ci;
            }
            dump("ffn_inp", il, &x);
            if let Some(c) = &self.capture {
                if let Some(rows) = c.lock().unwrap().get_mut(il) {
                    rows.extend_from_slice(&x[(n_rows - 1) * e..n_rows * e]);
                }
            }
            // FFN.
            for t in 0..n_rows {
                ops::rms_norm(&x[t * e..(t + 1) * e], &l.ffn_norm, c.rms_eps, &mut cur[t * e..(t + 1) * e]);
            }
            dump("ffn_norm", il, &cur);
            let out = match &l.ffn {
                Ffn::Dense { gate, up, down } => swiglu_ffn(gate, up, down, &cur, e, mode(false)),
                Ffn::Moe { router, shared } => self.moe(il, router, shared.as_ref(), &cur, &x[(n_rows - 1) * e..n_rows * e], per_row)?,
            };
            dump("ffn_out", il, &out);
            for (xi, &o) in x.iter_mut().zip(&out) {
                *xi += o;
            }
            dump("l_out", il, &x);
            if let Some(ex) = &self.experts {
                ex.on_residual(il, &x[(n_rows - 1) * e..n_rows * e], n_rows);
            }
        }
        kv.len = pos0 + t_n;
        // Output head.
        let rows: Vec<usize> = match want {
            Logits::Last => vec![n_rows - 1],
            Logits::All => (0..t_n).collect(),
        };
        let mut h = vec![0f32; rows.len() * e];
        for (i, &t) in rows.iter().enumerate() {
            ops::rms_norm(&x[t * e..(t + 1) * e], &self.output_norm, c.rms_eps, &mut h[i * e..(i + 1) * e]);
        }
        let out_w = self.output.as_ref().unwrap_or(&self.tok_embd);
        dump("result_norm", 0, &h);
        let mut logits = vec![0f32; rows.len() * out_w.rows];
        let mut a = Acts::with_mode(&h, e, mode(false));
        matmul(out_w.as_ref(), &mut a, &mut logits);
        dump("result_output", 0, &logits);
        Ok(logits)
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(&self, il: usize, kv: &KvCache, pos0: usize, _t_n: usize, q: &[f32], out: &mut [f32], scale: f32) {
        let c = &self.cfg;
        let (hd, nq) = (c.head_dim, c.n_embd_q());
        let group = c.n_head / c.n_head_kv;
        // One task per (token, head).
        par::for_each_chunk(out, hd, |i, o| {
            let (t, h) = (i / c.n_head, i % c.n_head);
            let n_kv = pos0 + t + 1;
            let (kr, vr) = kv.head(il, h / group, n_kv);
            let qh = &q[t * nq + h * hd..t * nq + (h + 1) * hd];
            let (mut qb, mut acc) = (Vec::new(), Vec::new());
            ops::attend_head(qh, kr, vr, hd, n_kv, scale, o, &mut qb, &mut acc);
        });
    }

    /// `resid`: the residual stream entering this FFN (last row), for the scheduler's refinement.
    #[allow(clippy::too_many_arguments)]
    fn moe(&self, il: usize, router: &Weight, shared: Option<&SharedExpert>, cur: &[f32], resid: &[f32], per_row: bool) -> Result<Vec<f32>, ModelError> {
        let (dense_mode, expert_mode) = if per_row { (RowMode::PerRow, RowMode::PerRow) } else { (RowMode::Batch, RowMode::Experts) };
        let c = &self.cfg;
        let e = c.n_embd;
        let t_n = cur.len() / e;
        let experts = self.experts.as_ref().expect("MoE model without experts");
        experts.on_hidden(il, cur, t_n);
        // Router: logits → softmax → top-k → weights (normalised for llama/qwen3moe).
        let mut logits = vec![0f32; t_n * c.n_expert];
        let mut acts = Acts::with_mode(cur, e, dense_mode);
        matmul(router.as_ref(), &mut acts, &mut logits);
        dump("ffn_moe_logits", il, &logits);
        let k = c.n_expert_used;
        let (sel, wts) = route(c, &logits, t_n);
        dump("ffn_moe_weights", il, &wts);
        dump("ffn_moe_topk", il, &sel.iter().map(|&v| v as f32).collect::<Vec<_>>());
        // Union of chosen experts (first-seen order) and, per expert, the (token, rank) pairs.
        let mut union: Vec<u32> = Vec::new();
        for &ex in &sel {
            if !union.contains(&ex) {
                union.push(ex);
            }
        }
        // Per (token, rank) expert outputs, each already multiplied by its weight.
        let mut per = vec![0f32; t_n * k * e];
        let mut err = None;
        let mut handed = 0;
        experts.with_experts(il, &union, &mut |ui, blk| {
            let ex = union[ui];
            let slots: Vec<usize> = (0..t_n * k).filter(|&s| sel[s] == ex).collect();
            let mut xin = Vec::with_capacity(slots.len() * e);
            for &s in &slots {
                let t = s / k;
                xin.extend_from_slice(&cur[t * e..(t + 1) * e]);
            }
            let (g, u, d) = (blk.gate(), blk.up(), blk.down());
            if g.cols != e || d.rows != e {
                err = Some(ExpertError::Invalid { layer: il, expert: ex as usize, why: "expert shape does not match n_embd".into() });
                return;
            }
            let y = swiglu_ffn_ref(g, u, d, &xin, e, expert_mode);
            for (j, &s) in slots.iter().enumerate() {
                let w = wts[s];
                for (o, &yy) in per[s * e..(s + 1) * e].iter_mut().zip(&y[j * e..(j + 1) * e]) {
                    *o = yy * w;
                }
            }
            handed += 1;
            if t_n == 1 && handed == 1 && union.len() > 1 {
                // One token: its layer output so far predicts the next layer's experts.
                let partial: Vec<f32> = resid.iter().zip(&per[slots[0] * e..(slots[0] + 1) * e]).map(|(r, p)| r + p).collect();
                experts.on_partial(il, &partial);
            }
        })?;
        if let Some(er) = err {
            return Err(er.into());
        }
        // Combine in rank order (fixed, independent of which experts were resident).
        let mut out = vec![0f32; t_n * e];
        for t in 0..t_n {
            let o = &mut out[t * e..(t + 1) * e];
            o.copy_from_slice(&per[(t * k) * e..(t * k + 1) * e]);
            for r in 1..k {
                let s = t * k + r;
                for (oo, &p) in o.iter_mut().zip(&per[s * e..(s + 1) * e]) {
                    *oo += p;
                }
            }
        }
        if let Some(sh) = shared {
            dump("ffn_moe_out", il, &out);
            let y = swiglu_ffn(&sh.gate, &sh.up, &sh.down, cur, e, dense_mode);
            dump("ffn_shexp", il, &y);
            let mut gate = vec![1f32; t_n];
            if let Some(gi) = &sh.gate_inp {
                matmul(gi.as_ref(), &mut acts, &mut gate);
                dump("ffn_shexp_gate_inp", il, &gate);
                for g in gate.iter_mut() {
                    *g = ops::sigmoid(*g);
                }
                dump("ffn_shexp_gate", il, &gate);
            }
            for t in 0..t_n {
                for (o, &yy) in out[t * e..(t + 1) * e].iter_mut().zip(&y[t * e..(t + 1) * e]) {
                    *o += yy * gate[t];
                }
            }
        }
        Ok(out)
    }

    /// The output embedding matrix type (for reporting).
    pub fn output_type(&self) -> GgmlType {
        self.output.as_ref().unwrap_or(&self.tok_embd).ty
    }
}

/// Router logits (`t_n` rows of `n_expert`) → softmax → top-k expert ids (rank order) and their
/// weights, normalised for llama/qwen3moe and scaled by `expert_weights_scale`, as llama.cpp's
/// `build_moe_ffn` (src/llama-graph.cpp). Shared by every backend so routing is identical.
pub(crate) fn route(c: &Config, logits: &[f32], t_n: usize) -> (Vec<u32>, Vec<f32>) {
    let k = c.n_expert_used;
    let mut sel = vec![0u32; t_n * k];
    let mut wts = vec![0f32; t_n * k];
    let mut probs = vec![0f32; c.n_expert];
    for t in 0..t_n {
        ops::softmax(&logits[t * c.n_expert..(t + 1) * c.n_expert], &mut probs);
        let top = ops::top_k(&probs, k);
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
        if c.expert_weights_scale != 0.0 && c.expert_weights_scale != 1.0 {
            for w in &mut wts[t * k..(t + 1) * k] {
                *w *= c.expert_weights_scale;
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
/// (`tools/llama_ref.cpp --dump`, compared by `tools/cmp_dumps.py`). `il == 99` (the FFN helper)
/// is replaced by the layer of the previous dump.
#[cfg(not(target_arch = "wasm32"))]
fn dump_file(name: &str, il: usize, x: &[f32]) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;
    static DIR: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    static STEP: AtomicUsize = AtomicUsize::new(usize::MAX);
    static LAYER: AtomicUsize = AtomicUsize::new(0);
    let Some(dir) = DIR.get_or_init(|| std::env::var_os("LES_DEBUG_DUMP_DIR").map(Into::into)) else { return };
    if name == "embd" {
        STEP.fetch_add(1, Ordering::Relaxed);
    }
    let il = if il == 99 { LAYER.load(Ordering::Relaxed) } else { LAYER.swap(il, Ordering::Relaxed); il };
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

fn add_bias(x: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for (a, &bb) in x.iter_mut().zip(b) {
            *a += bb;
        }
    }
}

fn swiglu_ffn(gate: &Weight, up: &Weight, down: &Weight, x: &[f32], e: usize, mode: RowMode) -> Vec<f32> {
    swiglu_ffn_ref(gate.as_ref(), up.as_ref(), down.as_ref(), x, e, mode)
}

fn swiglu_ffn_ref(gate: crate::backend::cpu::matmul::WeightRef<'_>, up: crate::backend::cpu::matmul::WeightRef<'_>, down: crate::backend::cpu::matmul::WeightRef<'_>, x: &[f32], e: usize, mode: RowMode) -> Vec<f32> {
    let t_n = x.len() / e;
    let ff = gate.rows;
    let mut g = vec![0f32; t_n * ff];
    let mut u = vec![0f32; t_n * ff];
    {
        let mut a = Acts::with_mode(x, e, mode);
        matmul(gate, &mut a, &mut g);
        matmul(up, &mut a, &mut u);
    }
    let mut h = vec![0f32; t_n * ff];
    ops::swiglu(&g, &u, &mut h);
    dump("ffn_gate", 99, &g);
    dump("ffn_up", 99, &u);
    dump("ffn_swiglu", 99, &h);
    let mut y = vec![0f32; t_n * e];
    let mut a = Acts::with_mode(&h, ff, mode);
    matmul(down, &mut a, &mut y);
    y
}
