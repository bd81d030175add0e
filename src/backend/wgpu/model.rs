//! The forward pass on the GPU: the same steps, in the same order, as [`crate::model::Model::forward`]
//! on the CPU, with dense weights and the KV cache in GPU buffers and experts in the slot pool.
//!
//! Per layer: RMSNorm → Q/K/V matvecs (+ biases, + Q/K norms) → RoPE → KV store → attention →
//! output projection → residual add → RMSNorm → FFN → residual add. MoE layers read back the router
//! logits (and, when decoding, the FFN input for the lookahead predictor) in one synchronisation,
//! route on the CPU with the CPU's own code ([`crate::model::route`]), then run the routed experts
//! as the expert source delivers them and combine them in rank order on the GPU.

use super::experts::{GpuExpertPool, PoolStats, SlotLayout};
use super::kernels::Kernels;
use super::{GpuContext, GpuError, Recorder};
use crate::backend::cpu::matmul::Weight;
use crate::backend::cpu::ops;
use crate::model::{route, Config, Ffn, KvCache, Logits, Model, ModelError};
use crate::quant::{vec_dot_type, GgmlType};
use std::sync::Arc;

/// `LES_DEBUG_DUMP=1`: print an intermediate's sum in the CPU forward's format (one extra
/// readback each; a debugging aid only).
async fn dump(rec: &mut Recorder<'_>, name: &str, il: usize, b: &wgpu::Buffer, n: usize) -> Result<(), GpuError> {
    if crate::model::dump_enabled() {
        let v = rec.readback(&[(b, 0, 4 * n as u64)]).await?.remove(0);
        crate::model::dump(name, il, &v);
    }
    Ok(())
}

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

fn vec_buf(ctx: &GpuContext, name: &str, v: &[f32]) -> Result<wgpu::Buffer, GpuError> {
    ctx.upload(name, bytemuck::cast_slice(v))
}

fn opt_buf(ctx: &GpuContext, name: &str, v: &Option<Vec<f32>>) -> Result<Option<wgpu::Buffer>, GpuError> {
    v.as_ref().map(|v| vec_buf(ctx, name, v)).transpose()
}

struct GpuShared {
    gate: GpuWeight,
    up: GpuWeight,
    down: GpuWeight,
    gate_inp: Option<GpuWeight>,
}

enum GpuFfn {
    Dense { gate: GpuWeight, up: GpuWeight, down: GpuWeight },
    Moe { router: GpuWeight, shared: Option<GpuShared> },
}

struct GpuLayer {
    attn_norm: wgpu::Buffer,
    wq: GpuWeight,
    wk: GpuWeight,
    wv: GpuWeight,
    wo: GpuWeight,
    bq: Option<wgpu::Buffer>,
    bk: Option<wgpu::Buffer>,
    bv: Option<wgpu::Buffer>,
    q_norm: Option<(wgpu::Buffer, usize)>,
    k_norm: Option<(wgpu::Buffer, usize)>,
    ffn_norm: wgpu::Buffer,
    ffn: GpuFfn,
}

/// Activation scratch types, one buffer each.
const ACT_TYPES: [GgmlType; 5] = [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K, GgmlType::F16, GgmlType::BF16];

struct Scratch {
    x: wgpu::Buffer,
    cur: wgpu::Buffer,
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    attn: wgpu::Buffer,
    g: wgpu::Buffer,
    u: wgpu::Buffer,
    h: wgpu::Buffer,
    ffo: wgpu::Buffer,
    xin: wgpu::Buffer,
    ye: wgpu::Buffer,
    per: wgpu::Buffer,
    rlog: wgpu::Buffer,
    sgate: wgpu::Buffer,
    hout: wgpu::Buffer,
    logits: wgpu::Buffer,
    cs: wgpu::Buffer,
    scores: wgpu::Buffer,
    acts: Vec<wgpu::Buffer>,
    arena: wgpu::Buffer,
}

/// Options of the GPU model.
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
}

/// Counters of the GPU forward (readbacks are the GPU→CPU synchronisations).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GpuStats {
    pub forwards: u64,
    pub readbacks: u64,
    pub readback_ms: f64,
    pub submits: u64,
    pub dispatches: u64,
    pub experts: PoolStats,
}

pub struct GpuModel {
    pub ctx: Arc<GpuContext>,
    k: Kernels,
    cfg: Config,
    layers: Vec<GpuLayer>,
    output_norm: wgpu::Buffer,
    output: GpuWeight,
    kc: wgpu::Buffer,
    vc: wgpu::Buffer,
    n_ctx: usize,
    s: Scratch,
    pool: std::sync::Mutex<Option<GpuExpertPool>>,
    stats: std::sync::Mutex<GpuStats>,
}

/// A row set of f32 activations and which vec-dot conversions of it are already made.
struct ActIn<'a> {
    x: &'a wgpu::Buffer,
    off: usize,
    cols: usize,
    n_tok: usize,
    done: u8,
}

impl<'a> ActIn<'a> {
    fn new(x: &'a wgpu::Buffer, off: usize, cols: usize, n_tok: usize) -> Self {
        Self { x, off, cols, n_tok, done: 0 }
    }
}

impl GpuModel {
    /// Upload `m`'s dense weights and make a KV cache of `n_ctx` positions.
    pub fn new(ctx: Arc<GpuContext>, m: &Model, n_ctx: usize, opts: &GpuOptions) -> Result<Self, GpuError> {
        let c = m.cfg.clone();
        let g = &*ctx;
        let mut k = Kernels::new(g);
        match opts.exact {
            Some(true) => k.max_tpr = 1,
            Some(false) if k.max_tpr == 1 => k.max_tpr = 64,
            _ => {}
        }
        let mut layers = Vec::with_capacity(c.n_layer);
        for (il, l) in m.layers.iter().enumerate() {
            let n = |s: &str| format!("blk.{il}.{s}");
            let ffn = match &l.ffn {
                Ffn::Dense { gate, up, down } => GpuFfn::Dense {
                    gate: GpuWeight::upload(g, &n("ffn_gate"), gate)?,
                    up: GpuWeight::upload(g, &n("ffn_up"), up)?,
                    down: GpuWeight::upload(g, &n("ffn_down"), down)?,
                },
                Ffn::Moe { router, shared } => GpuFfn::Moe {
                    router: GpuWeight::upload(g, &n("ffn_gate_inp"), router)?,
                    shared: match shared {
                        Some(sh) => Some(GpuShared {
                            gate: GpuWeight::upload(g, &n("ffn_gate_shexp"), &sh.gate)?,
                            up: GpuWeight::upload(g, &n("ffn_up_shexp"), &sh.up)?,
                            down: GpuWeight::upload(g, &n("ffn_down_shexp"), &sh.down)?,
                            gate_inp: sh.gate_inp.as_ref().map(|w| GpuWeight::upload(g, &n("ffn_gate_inp_shexp"), w)).transpose()?,
                        }),
                        None => None,
                    },
                },
            };
            layers.push(GpuLayer {
                attn_norm: vec_buf(g, &n("attn_norm"), &l.attn_norm)?,
                wq: GpuWeight::upload(g, &n("attn_q"), &l.wq)?,
                wk: GpuWeight::upload(g, &n("attn_k"), &l.wk)?,
                wv: GpuWeight::upload(g, &n("attn_v"), &l.wv)?,
                wo: GpuWeight::upload(g, &n("attn_output"), &l.wo)?,
                bq: opt_buf(g, &n("attn_q.bias"), &l.bq)?,
                bk: opt_buf(g, &n("attn_k.bias"), &l.bk)?,
                bv: opt_buf(g, &n("attn_v.bias"), &l.bv)?,
                q_norm: l.q_norm.as_ref().map(|v| vec_buf(g, &n("attn_q_norm"), v).map(|b| (b, v.len()))).transpose()?,
                k_norm: l.k_norm.as_ref().map(|v| vec_buf(g, &n("attn_k_norm"), v).map(|b| (b, v.len()))).transpose()?,
                ffn_norm: vec_buf(g, &n("ffn_norm"), &l.ffn_norm)?,
                ffn,
            });
        }
        let output_norm = vec_buf(g, "output_norm", &m.output_norm)?;
        let output = GpuWeight::upload(g, "output", m.output.as_ref().unwrap_or(&m.tok_embd))?;
        let kv_bytes = c.n_layer * c.n_head_kv * n_ctx * c.head_dim * 2;
        if kv_bytes as u64 > g.max_binding() {
            return Err(GpuError::Limit { what: format!("KV cache of {n_ctx} positions (lower --ctx-size)"), need: kv_bytes as u64, have: g.max_binding() });
        }
        let kc = g.scratch("kv-k", kv_bytes)?;
        let vc = g.scratch("kv-v", kv_bytes)?;
        let t = GPU_BATCH;
        let (e, nq, nkv) = (c.n_embd, c.n_embd_q(), c.n_embd_kv());
        let ff = c.n_ff.max(c.n_ff_exp).max(c.n_ff_shexp);
        let k_used = c.n_expert_used.max(1);
        let max_cols = e.max(nq).max(ff);
        let f = |name: &str, n: usize| g.scratch(name, 4 * n);
        let acts = ACT_TYPES
            .iter()
            .map(|ty| {
                let row = ty.row_bytes(max_cols.div_ceil(256) as u64 * 256).unwrap_or(4 * max_cols as u64) as usize;
                g.scratch(ty.name(), t * row + 4)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let s = Scratch {
            x: f("x", t * e)?,
            cur: f("cur", t * e)?,
            q: f("q", t * nq)?,
            k: f("k", t * nkv)?,
            v: f("v", t * nkv)?,
            attn: f("attn", t * nq)?,
            g: f("g", t * ff)?,
            u: f("u", t * ff)?,
            h: f("h", t * ff)?,
            ffo: f("ffo", t * e)?,
            xin: f("xin", t * e)?,
            ye: f("ye", t * e)?,
            per: f("per", t * k_used * e)?,
            rlog: f("rlog", t * c.n_expert.max(1))?,
            sgate: f("sgate", t)?,
            hout: f("hout", t * e)?,
            logits: f("logits", t * output.rows)?,
            cs: f("rope-cs", t * c.n_rot.max(2))?,
            scores: f("attention-scores", t * c.n_head * n_ctx)?,
            acts,
            arena: Recorder::arena_buffer(g),
        };
        let pool = if c.is_moe() {
            let src = m.experts().ok_or(GpuError::Validation("MoE model without experts".into()))?;
            let slot_bytes = (0..c.n_layer).map(|l| SlotLayout::bytes_for(src.layout(l))).max().unwrap_or(0);
            let all = c.n_layer * c.n_expert;
            let n = opts.expert_slots.unwrap_or_else(|| all.min(((1usize << 30) / slot_bytes.max(1)).max(c.n_expert_used * 2)));
            let pool = GpuExpertPool::new(g, n.min(all), slot_bytes)?;
            src.set_holder(pool.held.clone());
            Some(pool)
        } else {
            None
        };
        Ok(Self { ctx, k, cfg: c, layers, output_norm, output, kc, vc, n_ctx, s, pool: std::sync::Mutex::new(pool), stats: Default::default() })
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
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
        if let Some(p) = self.pool.lock().unwrap().as_ref() {
            s.experts = p.stats.clone();
        }
        s
    }

    /// The cost of one GPU→CPU synchronisation with nothing to wait for: mean ms of `n`
    /// 4-byte readbacks on an idle queue (the per-MoE-layer price of routing on the CPU).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn probe_sync_ms(&self, n: usize) -> Result<f64, GpuError> {
        let mut rec = Recorder::new(&self.ctx, &self.s.arena);
        super::block_on(rec.readback(&[(&self.s.sgate, 0, 4)]))?;
        let t0 = crate::engine::now_ms();
        for _ in 0..n.max(1) {
            super::block_on(rec.readback(&[(&self.s.sgate, 0, 4)]))?;
        }
        Ok((crate::engine::now_ms() - t0) / n.max(1) as f64)
    }

    pub fn expert_slots(&self) -> usize {
        self.pool.lock().unwrap().as_ref().map(|p| p.n_slots()).unwrap_or(0)
    }

    /// y = W · a for every part of W (rows split across buffers).
    fn mm<'b>(&'b self, rec: &mut Recorder<'_>, w: &GpuWeight, a: &mut ActIn<'b>, y: &wgpu::Buffer, y_off: usize, y_stride: usize) -> Result<(), GpuError> {
        let (abuf, a_off) = self.act_for(rec, w.ty, a)?;
        for (buf, r0, n) in &w.parts {
            self.k.matvec(rec, w.ty, w.cols, *n, buf, 0, abuf, a_off, y, y_off + r0, y_stride, a.n_tok)?;
        }
        Ok(())
    }

    /// The activation rows converted to `wty`'s vec_dot_type (made once per ActIn and type).
    fn act_for<'b>(&'b self, rec: &mut Recorder<'_>, wty: GgmlType, a: &mut ActIn<'b>) -> Result<(&'b wgpu::Buffer, u64), GpuError> {
        let vty = vec_dot_type(wty);
        if vty == GgmlType::F32 {
            return Ok((a.x, 4 * a.off as u64));
        }
        let i = ACT_TYPES.iter().position(|&t| t == vty).ok_or(GpuError::Unsupported(vty.name()))?;
        if a.done & (1 << i) == 0 {
            self.k.quant_act(rec, vty, a.x, a.off, a.cols, a.n_tok, &self.s.acts[i], 0)?;
            a.done |= 1 << i;
        }
        Ok((&self.s.acts[i], 0))
    }

    /// Blocking [`Self::forward_async`] (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward(&self, m: &Model, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        super::block_on(self.forward_async(m, tokens, kv, want))
    }

    /// Run `tokens` at positions `kv.len ..` (the KV cache's positions are bookkeeping only: the
    /// keys and values live on the GPU). Returns logits as [`Model::forward`] does.
    pub async fn forward_async(&self, m: &Model, tokens: &[u32], kv: &mut KvCache, want: Logits) -> Result<Vec<f32>, ModelError> {
        if kv.len + tokens.len() > self.n_ctx.min(kv.n_ctx) {
            return Err(ModelError::ContextFull(self.n_ctx.min(kv.n_ctx)));
        }
        let mut out = Vec::new();
        let chunks: Vec<&[u32]> = tokens.chunks(GPU_BATCH).collect();
        for (i, ch) in chunks.iter().enumerate() {
            let last = i + 1 == chunks.len();
            let w = match want {
                Logits::All => Some(Logits::All),
                Logits::Last if last => Some(Logits::Last),
                Logits::Last => None,
            };
            let l = self.forward_chunk(m, ch, kv, w).await?;
            out.extend_from_slice(&l);
        }
        Ok(out)
    }

    async fn forward_chunk(&self, m: &Model, tokens: &[u32], kv: &mut KvCache, want: Option<Logits>) -> Result<Vec<f32>, ModelError> {
        let c = &self.cfg;
        let g = &*self.ctx;
        g.check()?;
        let s = &self.s;
        let t_n = tokens.len();
        let (e, nq, nkv) = (c.n_embd, c.n_embd_q(), c.n_embd_kv());
        let pos0 = kv.len;
        // Embedding rows and the RoPE table are made on the CPU (exactly as the CPU backend does).
        let mut x = vec![0f32; t_n * e];
        for (t, &tok) in tokens.iter().enumerate() {
            if tok as usize >= m.tok_embd.rows {
                return Err(ModelError::BadToken(tok));
            }
            m.tok_embd.row_f32(tok as usize, &mut x[t * e..(t + 1) * e])?;
        }
        g.queue.write_buffer(&s.x, 0, bytemuck::cast_slice(&x));
        let mut cs = Vec::with_capacity(t_n * c.n_rot);
        let mut one = Vec::new();
        for t in 0..t_n {
            ops::rope_cache(pos0 + t, c.n_rot, c.rope_base, &mut one);
            cs.extend_from_slice(&one);
        }
        if !cs.is_empty() {
            g.queue.write_buffer(&s.cs, 0, bytemuck::cast_slice(&cs));
        }
        let mut rec = Recorder::new(g, &s.arena);
        let k = &self.k;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        let neox = c.rope == ops::RopeKind::Neox;
        let (mut readbacks, mut rb_ms) = (0u64, 0f64);
        for (il, l) in self.layers.iter().enumerate() {
            k.rms_norm(&mut rec, &s.x, 0, &l.attn_norm, e, t_n, c.rms_eps, Some((&s.cur, 0)));
            {
                let mut a = ActIn::new(&s.cur, 0, e, t_n);
                self.mm(&mut rec, &l.wq, &mut a, &s.q, 0, nq)?;
                self.mm(&mut rec, &l.wk, &mut a, &s.k, 0, nkv)?;
                self.mm(&mut rec, &l.wv, &mut a, &s.v, 0, nkv)?;
            }
            for (b, y, n) in [(&l.bq, &s.q, nq), (&l.bk, &s.k, nkv), (&l.bv, &s.v, nkv)] {
                if let Some(b) = b {
                    k.add(&mut rec, b, 0, y, 0, t_n * n, n);
                }
            }
            if let (Some((qn, qlen)), Some((kn, klen))) = (&l.q_norm, &l.k_norm) {
                k.rms_norm(&mut rec, &s.q, 0, qn, *qlen, t_n * nq / qlen, c.rms_eps, None);
                k.rms_norm(&mut rec, &s.k, 0, kn, *klen, t_n * nkv / klen, c.rms_eps, None);
            }
            k.rope(&mut rec, &s.q, 0, &s.cs, c.n_head, c.head_dim, c.n_rot, neox, t_n);
            k.rope(&mut rec, &s.k, 0, &s.cs, c.n_head_kv, c.head_dim, c.n_rot, neox, t_n);
            k.kv_store(&mut rec, &s.k, &s.v, &self.kc, &self.vc, c.n_head_kv, c.head_dim, self.n_ctx, il, pos0, t_n);
            k.attention(&mut rec, &s.q, &self.kc, &self.vc, &s.attn, &s.scores, c.n_head, c.n_head_kv, c.head_dim, self.n_ctx, il, pos0, t_n, scale);
            {
                let mut a = ActIn::new(&s.attn, 0, nq, t_n);
                self.mm(&mut rec, &l.wo, &mut a, &s.cur, 0, e)?;
            }
            k.add(&mut rec, &s.cur, 0, &s.x, 0, t_n * e, 0);
            dump(&mut rec, "attn_out", il, &s.cur, t_n * e).await?;
            dump(&mut rec, "ffn_inp", il, &s.x, t_n * e).await?;
            k.rms_norm(&mut rec, &s.x, 0, &l.ffn_norm, e, t_n, c.rms_eps, Some((&s.cur, 0)));
            match &l.ffn {
                GpuFfn::Dense { gate, up, down } => {
                    self.swiglu_ffn(&mut rec, gate, up, down, &s.cur, t_n, &s.ffo)?;
                }
                GpuFfn::Moe { router, shared } => {
                    let mut a = ActIn::new(&s.cur, 0, e, t_n);
                    self.mm(&mut rec, router, &mut a, &s.rlog, 0, c.n_expert)?;
                    let experts = m.experts().ok_or(GpuError::Validation("MoE model without experts".into()))?;
                    // One synchronisation: router logits (+ the FFN input for the predictor).
                    let t0 = crate::engine::now_ms();
                    let mut ranges = vec![(&s.rlog, 0u64, (4 * t_n * c.n_expert) as u64)];
                    if t_n == 1 {
                        ranges.push((&s.cur, 0, (4 * e) as u64));
                    }
                    let back = rec.readback(&ranges).await?;
                    rb_ms += crate::engine::now_ms() - t0;
                    readbacks += 1;
                    experts.on_hidden(il, back.get(1).map(|v| v.as_slice()).unwrap_or(&[]), t_n);
                    let kk = c.n_expert_used;
                    let (sel, wts) = route(c, &back[0], t_n);
                    let mut union: Vec<u32> = Vec::new();
                    for &ex in &sel {
                        if !union.contains(&ex) {
                            union.push(ex);
                        }
                    }
                    let mut pool_g = self.pool.lock().unwrap();
                    let pool = pool_g.as_mut().ok_or(GpuError::Validation("no expert pool".into()))?;
                    // Experts already in GPU slots run first; the expert source is asked only for
                    // the others (it counts the held ones as hits and keeps predicting).
                    let held: Vec<bool> = union.iter().map(|&ex| pool.holds(il, ex as usize)).collect();
                    for (ui, &ex) in union.iter().enumerate() {
                        if held[ui] {
                            let (slot, lay) = pool.hit(&rec, il, ex as usize).ok_or(GpuError::Validation("slot vanished".into()))?;
                            self.run_expert(&mut rec, pool, slot, &lay, ex, &sel, &wts, t_n, kk)?;
                        }
                    }
                    let mut err: Option<ModelError> = None;
                    let held_fn = |ex: u32| union.iter().position(|&u| u == ex).is_some_and(|i| held[i]);
                    experts.with_experts_except(il, &union, &held_fn, &mut |ui, blk| {
                        if err.is_some() {
                            return;
                        }
                        let ex = union[ui];
                        if blk.gate().cols != e || blk.down().rows != e {
                            err = Some(crate::expert::ExpertError::Invalid { layer: il, expert: ex as usize, why: "expert shape does not match n_embd".into() }.into());
                            return;
                        }
                        let r = pool.ensure(&mut rec, il, ex as usize, blk, &|l, x| experts.retention(l, x)).and_then(|slot| self.run_expert(&mut rec, pool, slot, &blk.layout, ex, &sel, &wts, t_n, kk));
                        if let Err(er) = r {
                            err = Some(er.into());
                        }
                    })?;
                    drop(pool_g);
                    if let Some(er) = err {
                        return Err(er);
                    }
                    k.combine(&mut rec, &s.per, &s.ffo, e, t_n, kk);
                    if let Some(sh) = shared {
                        self.swiglu_ffn(&mut rec, &sh.gate, &sh.up, &sh.down, &s.cur, t_n, &s.ye)?;
                        match &sh.gate_inp {
                            Some(gi) => {
                                let mut a = ActIn::new(&s.cur, 0, e, t_n);
                                self.mm(&mut rec, gi, &mut a, &s.sgate, 0, 1)?;
                                k.gate_add(&mut rec, &s.ye, &s.sgate, &s.ffo, e, t_n);
                            }
                            None => k.add(&mut rec, &s.ye, 0, &s.ffo, 0, t_n * e, 0),
                        }
                    }
                }
            }
            dump(&mut rec, "ffn_out", il, &s.ffo, t_n * e).await?;
            k.add(&mut rec, &s.ffo, 0, &s.x, 0, t_n * e, 0);
            dump(&mut rec, "l_out", il, &s.x, t_n * e).await?;
        }
        kv.len = pos0 + t_n;
        let mut logits = Vec::new();
        if let Some(want) = want {
            let (row0, rows) = match want {
                Logits::Last => (t_n - 1, 1),
                Logits::All => (0, t_n),
            };
            k.rms_norm(&mut rec, &s.x, row0 * e, &self.output_norm, e, rows, c.rms_eps, Some((&s.hout, 0)));
            let mut a = ActIn::new(&s.hout, 0, e, rows);
            self.mm(&mut rec, &self.output, &mut a, &s.logits, 0, self.output.rows)?;
            let t0 = crate::engine::now_ms();
            let back = rec.readback(&[(&s.logits, 0, (4 * rows * self.output.rows) as u64)]).await?;
            rb_ms += crate::engine::now_ms() - t0;
            readbacks += 1;
            logits = back.into_iter().next().unwrap_or_default();
        } else {
            rec.submit();
        }
        g.check()?;
        let mut st = self.stats.lock().unwrap();
        st.forwards += 1;
        st.readbacks += readbacks;
        st.readback_ms += rb_ms;
        st.submits += rec.queue_submits as u64;
        st.dispatches += rec.dispatches as u64;
        Ok(logits)
    }

    /// SwiGLU FFN of `t_n` rows of `x` (n_embd) into `y`: down(silu(gate x) * up x).
    #[allow(clippy::too_many_arguments)]
    fn swiglu_ffn(&self, rec: &mut Recorder<'_>, gate: &GpuWeight, up: &GpuWeight, down: &GpuWeight, x: &wgpu::Buffer, t_n: usize, y: &wgpu::Buffer) -> Result<(), GpuError> {
        let (e, ff) = (self.cfg.n_embd, gate.rows);
        let s = &self.s;
        let mut a = ActIn::new(x, 0, e, t_n);
        self.mm(rec, gate, &mut a, &s.g, 0, ff)?;
        self.mm(rec, up, &mut a, &s.u, 0, ff)?;
        self.k.swiglu(rec, &s.g, &s.u, &s.h, t_n * ff);
        let mut a = ActIn::new(&s.h, 0, ff, t_n);
        self.mm(rec, down, &mut a, y, 0, e)
    }

    /// One routed expert (in GPU slot `slot`): gather its tokens' rows, SwiGLU FFN from the slot,
    /// scatter the outputs times the router weights into their (token, rank) rows of `per`.
    #[allow(clippy::too_many_arguments)]
    fn run_expert(&self, rec: &mut Recorder<'_>, pool: &GpuExpertPool, slot: usize, layout: &crate::expert::ExpertLayout, ex: u32, sel: &[u32], wts: &[f32], t_n: usize, kk: usize) -> Result<(), GpuError> {
        let s = &self.s;
        let e = self.cfg.n_embd;
        let lay = SlotLayout::of_layout(layout);
        let buf = pool.buffer(slot);
        let slots: Vec<u32> = (0..t_n * kk).filter(|&i| sel[i] == ex).map(|i| i as u32).collect();
        let toks: Vec<u32> = slots.iter().map(|&i| i / kk as u32).collect();
        let w: Vec<f32> = slots.iter().map(|&i| wts[i as usize]).collect();
        let n = slots.len();
        let xin = if t_n == 1 {
            &s.cur
        } else {
            self.k.gather(rec, &s.cur, &s.xin, e, &toks);
            &s.xin
        };
        let ff = layout.n_ff;
        let mut a = ActIn::new(xin, 0, e, n);
        let (ab, ao) = self.act_for(rec, layout.gate_ty, &mut a)?;
        self.k.matvec(rec, layout.gate_ty, e, ff, buf, lay.gate, ab, ao, &s.g, 0, ff, n)?;
        let (ab, ao) = self.act_for(rec, layout.up_ty, &mut a)?;
        self.k.matvec(rec, layout.up_ty, e, ff, buf, lay.up, ab, ao, &s.u, 0, ff, n)?;
        self.k.swiglu(rec, &s.g, &s.u, &s.h, n * ff);
        let mut a = ActIn::new(&s.h, 0, ff, n);
        let (ab, ao) = self.act_for(rec, layout.down_ty, &mut a)?;
        self.k.matvec(rec, layout.down_ty, ff, e, buf, lay.down, ab, ao, &s.ye, 0, e, n)?;
        self.k.scatter(rec, &s.ye, &s.per, e, &slots, &w);
        Ok(())
    }
}
