//! [`Ops`] on the CPU: every op computes at once with the kernels of this folder; `read` is a copy.

use super::kv::KvCache;
use super::matmul::{matmul, matmul_part, Acts, RowMode, WeightRef};
use super::{delta, flash, ops, par};
use crate::backend::ops::{Attn, DeltaNet, ExpertAct, ExpertFfn, Mat, OpError, Ops, Rope, Route, Sigmoid, Vector, Weights};
use crate::expert::{ExpertError, ExpertSource};
use std::ops::Range;

/// A CPU tensor: `v.len() / cols` rows of `cols` values.
pub struct CpuT {
    pub v: Vec<f32>,
    pub cols: usize,
}

impl CpuT {
    fn rows(&self) -> usize {
        self.v.len() / self.cols.max(1)
    }
    fn row(&self, t: usize) -> &[f32] {
        &self.v[t * self.cols..(t + 1) * self.cols]
    }
}

/// One forward pass's CPU executor: the weights, the KV cache it appends to, and the row mode.
pub struct CpuExec<'a> {
    w: &'a Weights,
    kv: &'a mut KvCache,
    /// Every row computed as a single-row product ([`RowMode::PerRow`]) instead of with
    /// llama.cpp's batch kernels.
    per_row: bool,
    /// RoPE cos/sin tables of this forward's positions: (pos0, n_rot, base bits, YaRN) → one
    /// per row.
    rope: Vec<((usize, usize, u32, Option<[u32; 3]>), Vec<Vec<f32>>)>,
}

impl<'a> CpuExec<'a> {
    pub fn new(w: &'a Weights, kv: &'a mut KvCache, per_row: bool) -> Self {
        Self { w, kv, per_row, rope: Vec::new() }
    }

    fn dense_mode(&self) -> RowMode {
        if self.per_row {
            RowMode::PerRow
        } else {
            RowMode::Batch
        }
    }
}

/// `down(silu(gate x) * up x)` of `x` (rows of `gate.cols`), the products in `mode`.
pub fn swiglu_ffn(gate: WeightRef<'_>, up: WeightRef<'_>, down: WeightRef<'_>, x: &[f32], mode: RowMode) -> Vec<f32> {
    expert_ffn(gate, up, down, x, mode, ExpertAct::Silu, None)
}

/// `x[t] += b` for every row (`cols` values) of `x` (ggml `add` / `add_id` with one bias row).
fn add_bias(x: &mut [f32], cols: usize, b: &[f32]) {
    for r in x.chunks_mut(cols.max(1)) {
        for (v, &bb) in r.iter_mut().zip(b) {
            *v += bb;
        }
    }
}

/// One expert's FFN of `x` with activation `act` and, when given, its bias rows
/// (gate, up, down) added after each product (llama.cpp's `build_moe_ffn`: `mul_mat_id`, then
/// `add_id`).
pub fn expert_ffn(gate: WeightRef<'_>, up: WeightRef<'_>, down: WeightRef<'_>, x: &[f32], mode: RowMode, act: ExpertAct, bias: Option<[&[f32]; 3]>) -> Vec<f32> {
    let e = gate.cols;
    let t_n = x.len() / e;
    let ff = gate.rows;
    let mut g = vec![0f32; t_n * ff];
    let mut u = vec![0f32; t_n * ff];
    {
        let mut a = Acts::with_mode(x, e, mode);
        matmul(gate, &mut a, &mut g);
        matmul(up, &mut a, &mut u);
    }
    if let Some([bg, bu, _]) = bias {
        add_bias(&mut g, ff, bg);
        add_bias(&mut u, ff, bu);
    }
    let mut h = vec![0f32; t_n * ff];
    match act {
        ExpertAct::Silu => ops::swiglu(&g, &u, &mut h),
        ExpertAct::SwigluOai { alpha, limit } => ops::swiglu_oai(&g, &u, &mut h, alpha, limit),
        ExpertAct::Relu => ops::reglu(&g, &u, &mut h),
    }
    let mut y = vec![0f32; t_n * down.rows];
    let mut a = Acts::with_mode(&h, ff, mode);
    matmul(down, &mut a, &mut y);
    if let Some([_, _, bd]) = bias {
        add_bias(&mut y, down.rows, bd);
    }
    y
}

impl Ops for CpuExec<'_> {
    type T = CpuT;
    const BACKEND: &'static str = "cpu";

    fn shape(t: &CpuT) -> (usize, usize) {
        (t.rows(), t.cols)
    }

    fn input(&mut self, x: Vec<f32>, cols: usize) -> Result<CpuT, OpError> {
        Ok(CpuT { v: x, cols })
    }

    fn rms_norm(&mut self, x: &CpuT, w: Vector, eps: f32) -> Result<CpuT, OpError> {
        let w = self.w.vec(w);
        let mut y = vec![0f32; x.v.len()];
        let c = x.cols;
        par::for_each_chunk(&mut y, c, |r, yr| ops::rms_norm(&x.v[r * c..(r + 1) * c], w, eps, yr));
        Ok(CpuT { v: y, cols: x.cols })
    }

    fn rms_norm_groups(&mut self, x: &mut CpuT, w: Vector, eps: f32) -> Result<(), OpError> {
        ops::rms_norm_groups(&mut x.v, self.w.vec(w), eps);
        Ok(())
    }

    fn matmul(&mut self, x: &CpuT, ws: &[Mat]) -> Result<Vec<CpuT>, OpError> {
        let mut a = Acts::with_mode(&x.v, x.cols, self.dense_mode());
        let mut out = Vec::with_capacity(ws.len());
        for &m in ws {
            let rows = self.w.mat(m).rows;
            let mut y = vec![0f32; x.rows() * rows];
            if self.w.streamed(m).is_none() {
                matmul(self.w.mat(m).as_ref(), &mut a, &mut y);
            } else {
                // Piece by piece as storage hands them over: each output row is its own dot
                // product, so the bits are the whole matrix's.
                let mut part = Vec::new();
                self.w.for_pieces(m, |row0, p| {
                    part.clear();
                    part.resize(x.rows() * p.rows, 0f32);
                    matmul_part(p, &mut a, &mut part, rows);
                    for (yr, pr) in y.chunks_mut(rows).zip(part.chunks(p.rows)) {
                        yr[row0..row0 + p.rows].copy_from_slice(pr);
                    }
                })?;
            }
            out.push(CpuT { v: y, cols: rows });
        }
        Ok(out)
    }

    fn add_row(&mut self, x: &mut CpuT, b: Vector) -> Result<(), OpError> {
        add_bias(&mut x.v, x.cols, self.w.vec(b));
        Ok(())
    }

    fn add(&mut self, x: &mut CpuT, y: &CpuT) -> Result<(), OpError> {
        for (a, &b) in x.v.iter_mut().zip(&y.v) {
            *a += b;
        }
        Ok(())
    }

    fn rope(&mut self, x: &mut CpuT, pos0: usize, p: &Rope) -> Result<(), OpError> {
        let key = (pos0, p.n_rot, p.base.to_bits(), p.yarn.map(|y| [y.freq_scale.to_bits(), y.ext_factor.to_bits(), y.attn_factor.to_bits()]));
        let rows = x.rows();
        let i = match self.rope.iter().position(|(k, t)| *k == key && t.len() >= rows) {
            Some(i) => i,
            None => {
                let tabs = (0..rows)
                    .map(|t| {
                        let mut c = Vec::new();
                        ops::rope_cache_ext(pos0 + t, p.n_rot, p.base, p.yarn.as_ref(), &mut c);
                        c
                    })
                    .collect();
                self.rope.push((key, tabs));
                self.rope.len() - 1
            }
        };
        let tabs = &self.rope[i].1;
        for (t, r) in x.v.chunks_mut(x.cols).enumerate() {
            ops::rope(r, p.head_dim, p.n_rot, p.kind, &tabs[t]);
        }
        Ok(())
    }

    fn attention(&mut self, il: usize, q: &CpuT, k: &CpuT, v: &CpuT, pos0: usize, p: &Attn) -> Result<CpuT, OpError> {
        let t_n = q.rows();
        self.kv.make_room(il, pos0, t_n);
        for t in 0..t_n {
            self.kv.store(il, pos0 + t, k.row(t), v.row(t));
        }
        let (hd, nq) = (p.head_dim, q.cols);
        let group = p.n_head / p.n_head_kv;
        let mut out = vec![0f32; t_n * nq];
        let kv = &*self.kv;
        let sinks = p.sinks.map(|s| self.w.vec(s));
        // Cells, not positions: a sliding-window layer's first cell holds position `base`.
        let base = kv.base(il);
        let range = |t: usize| {
            let n_kv = pos0 + t + 1;
            (if p.window > 0 { n_kv.saturating_sub(p.window) } else { 0 }) - base..n_kv - base
        };
        if t_n >= flash::FA_TILE_Q && !self.per_row && crate::quant::Simd::best() == crate::quant::Simd::Avx2 {
            // llama.cpp's tiled flash attention (batches of ≥ 64 rows on x86): one task per
            // (tile of 64 query rows, head), the tiles with the most positions first.
            let n_tiles = t_n.div_ceil(flash::FA_TILE_Q);
            let y = par::SharedMut::new(&mut out);
            par::for_each(n_tiles * p.n_head, |i| {
                let (tile, h) = (n_tiles - 1 - i / p.n_head, i % p.n_head);
                let t0 = tile * flash::FA_TILE_Q;
                let rows = (t_n - t0).min(flash::FA_TILE_Q);
                let (kr, vr) = kv.head(il, h / group, pos0 + t0 + rows);
                let sink = sinks.and_then(|s| s.get(h).copied());
                thread_local!(static SCRATCH: std::cell::RefCell<flash::FaScratch> = Default::default());
                SCRATCH.with(|sc| {
                    let q0 = t0 * nq + h * hd;
                    flash::attend_tiled(&q.v[q0..], nq, rows, &|r| range(t0 + r), flash::FaKv::F16 { k: kr, v: vr }, hd, sink, p.scale, &mut |r, o| {
                        // SAFETY: row t0 + r, head h: each (row, head) is written by one task only.
                        unsafe { y.slice((t0 + r) * nq + h * hd, hd) }.copy_from_slice(o)
                    }, &mut sc.borrow_mut());
                });
            });
            return Ok(CpuT { v: out, cols: nq });
        }
        // One task per (token, head), or per (token, KV head) where the query heads sharing a
        // KV head go together (`ops::attend_heads_grouped`: wasm widens each key and value once).
        let per_task = if ops::attend_heads_grouped(hd) { group } else { 1 };
        let tasks_per_row = p.n_head / per_task;
        par::for_each_chunk(&mut out, per_task * hd, |i, o| {
            let (t, h0) = (i / tasks_per_row, i % tasks_per_row * per_task);
            let kv_range = range(t);
            let (kr, vr) = kv.head(il, h0 / group, kv_range.end + base);
            let qh = &q.v[t * nq + h0 * hd..t * nq + (h0 + per_task) * hd];
            let sink = sinks.map(|s| &s[h0.min(s.len())..(h0 + per_task).min(s.len())]);
            ops::attend_heads(qh, per_task, kr, vr, hd, kv_range, sink, p.scale, o);
        });
        Ok(CpuT { v: out, cols: nq })
    }

    fn swiglu(&mut self, g: &CpuT, u: &CpuT) -> Result<CpuT, OpError> {
        let mut h = vec![0f32; g.v.len()];
        const CHUNK: usize = 1 << 14; // element-wise: any split gives the same bits
        par::for_each_chunk(&mut h, CHUNK, |i, hc| ops::swiglu(&g.v[i * CHUNK..], &u.v[i * CHUNK..], hc));
        Ok(CpuT { v: h, cols: g.cols })
    }

    fn gate_add(&mut self, x: &mut CpuT, y: &CpuT, g: &CpuT, f: Sigmoid) -> Result<(), OpError> {
        for (t, (xr, yr)) in x.v.chunks_mut(x.cols).zip(y.v.chunks(y.cols)).enumerate() {
            let s = match f {
                Sigmoid::SiluDiv => ops::sigmoid(g.v[t]),
                Sigmoid::Exp => ops::sigmoid_exp(g.v[t]),
            };
            for (o, &yy) in xr.iter_mut().zip(yr) {
                *o += yy * s;
            }
        }
        Ok(())
    }

    fn mul_sigmoid(&mut self, x: &mut CpuT, g: &CpuT) -> Result<(), OpError> {
        for (a, &b) in x.v.iter_mut().zip(&g.v) {
            *a *= ops::sigmoid_exp(b);
        }
        Ok(())
    }

    fn mul(&mut self, x: &mut CpuT, y: &CpuT) -> Result<(), OpError> {
        for (a, &b) in x.v.iter_mut().zip(&y.v) {
            *a *= b;
        }
        Ok(())
    }

    fn ssm_conv(&mut self, il: usize, x: &CpuT, w: Vector, d_conv: usize, silu: bool) -> Result<CpuT, OpError> {
        let w = self.w.vec(w);
        let st = self.kv.rs.get_mut(il).and_then(|r| r.as_mut()).ok_or(OpError::NoState(il))?;
        let c = x.cols;
        if st.conv.len() != c * (d_conv - 1) || w.len() != c * d_conv {
            return Err(OpError::NoState(il));
        }
        let mut y = vec![0f32; x.v.len()];
        let t_n = x.rows();
        if t_n == 1 || d_conv < 2 {
            for (xr, yr) in x.v.chunks(c).zip(y.chunks_mut(c)) {
                ops::conv_silu_step(&mut st.conv, w, d_conv, xr, yr, silu);
            }
            return Ok(CpuT { v: y, cols: c });
        }
        // Prompts: blocks of channels in parallel, each channel through every token.
        const CH: usize = 64;
        let kc = d_conv - 1;
        let yp = par::SharedMut::new(&mut y);
        par::for_each_chunk(&mut st.conv, CH * kc, |bi, stb| {
            let c0 = bi * CH;
            let wb = &w[c0 * d_conv..(c0 + stb.len() / kc) * d_conv];
            // SAFETY: block `bi` alone writes its channels' outputs.
            ops::conv_silu_channels(stb, wb, d_conv, &x.v, c, c0, t_n, silu, &mut |t, vals| unsafe { yp.slice(t * c + c0, vals.len()) }.copy_from_slice(vals));
        });
        Ok(CpuT { v: y, cols: c })
    }

    fn delta_net(&mut self, il: usize, x: &mut CpuT, alpha: &CpuT, beta: &CpuT, p: &DeltaNet) -> Result<CpuT, OpError> {
        let (hk, hv, s) = (p.n_group, p.dt_rank, p.d_state);
        let t_n = x.rows();
        let (dt, a) = (self.w.vec(p.dt_bias), self.w.vec(p.a));
        let st = self.kv.rs.get_mut(il).and_then(|r| r.as_mut()).ok_or(OpError::NoState(il))?;
        if x.cols != (2 * hk + hv) * s || st.ssm.len() != hv * s * s || alpha.cols != hv || beta.cols != hv {
            return Err(OpError::NoState(il));
        }
        // Per token: q and k L2-normalised per head (in place); beta = sigmoid(b);
        // g = softplus(a + dt) · A and its decay expf(g).
        let cols = x.cols;
        let mut gb = vec![0f32; t_n * 2 * hv];
        for t in 0..t_n {
            for head in x.v[t * cols..t * cols + 2 * hk * s].chunks_mut(s) {
                ops::l2_norm(head, p.eps);
            }
            for h in 0..hv {
                let g = ops::softplus(alpha.v[t * hv + h] + dt[h]) * a[h];
                gb[(t * hv + h) * 2] = super::cmath::expf(g);
                gb[(t * hv + h) * 2 + 1] = ops::sigmoid_exp(beta.v[t * hv + h]);
            }
        }
        let mut out = vec![0f32; t_n * hv * s];
        let o = par::SharedMut::new(&mut out);
        let qk = &x.v;
        // Tasks of `rb` state rows of one value head, each row through every token in order
        // (`delta::delta_rule_rows`: a row of the state evolves on its own; same bits as
        // ggml's token-by-token passes).
        let rb = if s % 16 == 0 { 16 } else { s };
        par::for_each_chunk(&mut st.ssm, rb * s, |ci, m| {
            let (h, j0) = (ci / (s / rb), (ci % (s / rb)) * rb);
            let kh = if p.tiled { h % hk } else { h / (hv / hk) };
            let head = delta::DeltaHead { x: qk, stride: cols, q: kh * s, k: (hk + kh) * s, v: (2 * hk + h) * s, gb: &gb, gb_stride: 2 * hv, gb_off: 2 * h, n_tok: t_n };
            let rows = m.len() / s;
            let mut buf = vec![0f32; rows * t_n];
            delta::delta_rule_rows(m, j0, s, &head, &mut buf);
            for r in 0..rows {
                for t in 0..t_n {
                    // SAFETY: each (token, head, row) is written by the one task holding the row.
                    unsafe { o.write(t * hv * s + h * s + j0 + r, buf[r * t_n + t]) };
                }
            }
        });
        Ok(CpuT { v: out, cols: hv * s })
    }

    fn norm_gated(&mut self, x: &mut CpuT, w: Vector, z: &CpuT, eps: f32) -> Result<(), OpError> {
        ops::rms_norm_groups(&mut x.v, self.w.vec(w), eps);
        for (a, &b) in x.v.iter_mut().zip(&z.v) {
            *a *= ops::silu(b);
        }
        Ok(())
    }

    fn last_row(&mut self, mut x: CpuT) -> Result<CpuT, OpError> {
        let n = x.rows();
        if n > 1 {
            x.v.drain(..(n - 1) * x.cols);
        }
        Ok(x)
    }

    fn experts(&mut self, il: usize, src: &dyn ExpertSource, x: &CpuT, r: Route<'_>, f: &ExpertFfn, partial: Option<&CpuT>) -> Result<CpuT, OpError> {
        let mode = if self.per_row { RowMode::PerRow } else { RowMode::Experts };
        let (e, t_n, k) = (x.cols, x.rows(), r.k);
        let union = r.union();
        // Per (token, rank) expert outputs, each already multiplied by its weight.
        let mut per = vec![0f32; t_n * k * e];
        let mut err = None;
        let mut handed = 0;
        src.with_experts(il, &union, &mut |ui, blk| {
            let ex = union[ui];
            let slots: Vec<usize> = (0..t_n * k).filter(|&s| r.sel[s] == ex).collect();
            let mut xin = Vec::with_capacity(slots.len() * e);
            for &s in &slots {
                xin.extend_from_slice(x.row(s / k));
            }
            let (g, u, d) = (blk.gate(), blk.up(), blk.down());
            if g.cols != e || d.rows != e {
                err = Some(ExpertError::Invalid { layer: il, expert: ex as usize, why: "expert shape does not match n_embd".into() });
                return;
            }
            let ff = g.rows;
            let bias = f.bias.map(|[bg, bu, bd]| {
                let (bg, bu, bd) = (self.w.vec(bg), self.w.vec(bu), self.w.vec(bd));
                fn at(v: &[f32], i: usize, n: usize) -> Option<&[f32]> {
                    v.get(i * n..(i + 1) * n)
                }
                [at(bg, ex as usize, ff), at(bu, ex as usize, ff), at(bd, ex as usize, e)]
            });
            let bias = match bias {
                None => None,
                Some([Some(bg), Some(bu), Some(bd)]) => Some([bg, bu, bd]),
                Some(_) => {
                    err = Some(ExpertError::Invalid { layer: il, expert: ex as usize, why: "expert biases do not cover this expert".into() });
                    return;
                }
            };
            let y = expert_ffn(g, u, d, &xin, mode, f.act, bias);
            for (j, &s) in slots.iter().enumerate() {
                let w = r.wts[s];
                for (o, &yy) in per[s * e..(s + 1) * e].iter_mut().zip(&y[j * e..(j + 1) * e]) {
                    *o = yy * w;
                }
            }
            handed += 1;
            if let Some(res) = partial {
                if t_n == 1 && handed == 1 && union.len() > 1 {
                    // One token: its layer output so far predicts the next layer's experts.
                    let p: Vec<f32> = res.v.iter().zip(&per[slots[0] * e..(slots[0] + 1) * e]).map(|(a, b)| a + b).collect();
                    src.on_partial(il, &p);
                }
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
            for rk in 1..k {
                let s = t * k + rk;
                for (oo, &p) in o.iter_mut().zip(&per[s * e..(s + 1) * e]) {
                    *oo += p;
                }
            }
        }
        Ok(CpuT { v: out, cols: e })
    }

    fn layer_norm(&mut self, x: &CpuT, w: Vector, b: Option<Vector>, eps: f32) -> Result<CpuT, OpError> {
        let (w, b) = (self.w.vec(w), b.map(|b| self.w.vec(b)));
        let mut y = vec![0f32; x.v.len()];
        let cols = x.cols;
        par::for_each_chunk(&mut y, cols, |t, yr| ops::layer_norm_row(&x.v[t * cols..(t + 1) * cols], w, b, eps, yr));
        Ok(CpuT { v: y, cols })
    }

    fn gelu(&mut self, x: &mut CpuT, kind: crate::backend::ops::Gelu) -> Result<(), OpError> {
        const CHUNK: usize = 1 << 14; // element-wise: any split gives the same bits
        par::for_each_chunk(&mut x.v, CHUNK, |_, c| match kind {
            crate::backend::ops::Gelu::Tanh => ops::gelu_tanh(c),
            crate::backend::ops::Gelu::Erf => ops::gelu_erf(c),
        });
        Ok(())
    }

    fn self_attention(&mut self, q: &CpuT, k: &CpuT, v: &CpuT, p: &crate::backend::ops::SelfAttn) -> Result<CpuT, OpError> {
        let (n, hd, nh) = (q.rows(), p.head_dim, p.n_head);
        let cols = nh * hd;
        if q.cols != cols || k.cols != cols || v.cols != cols || k.rows() != n || v.rows() != n || (p.block > 0 && n % p.block != 0) {
            return Err(OpError::Unsupported { backend: "cpu", op: "self_attention with these shapes" });
        }
        // K and V cast to f16, head-major (clip's flash-attention path: `ggml_cast(k, F16)`).
        let to_heads = |x: &CpuT| -> Vec<half::f16> {
            let mut o = vec![half::f16::ZERO; n * cols];
            for h in 0..nh {
                for t in 0..n {
                    for d in 0..hd {
                        o[(h * n + t) * hd + d] = half::f16::from_f32(x.v[t * cols + h * hd + d]);
                    }
                }
            }
            o
        };
        let (kh, vh) = (to_heads(k), to_heads(v));
        let mut out = vec![0f32; n * cols];
        let range = |t: usize| if p.block > 0 { (t / p.block) * p.block..(t / p.block + 1) * p.block } else { 0..n };
        if n >= flash::FA_TILE_Q && crate::quant::Simd::best() == crate::quant::Simd::Avx2 {
            // ggml's tiled flash attention on x86 for ≥ 64 query rows, as the text path.
            // Every query tile reads its head's (or window's) keys: widened once, not per tile.
            let wide: Vec<flash::FaKvF32> = (0..nh).map(|h| flash::FaKvF32::new(&kh[h * n * hd..(h + 1) * n * hd], &vh[h * n * hd..(h + 1) * n * hd], hd)).collect();
            let n_tiles = n.div_ceil(flash::FA_TILE_Q);
            let y = par::SharedMut::new(&mut out);
            par::for_each(n_tiles * nh, |i| {
                let (tile, h) = (i / nh, i % nh);
                let t0 = tile * flash::FA_TILE_Q;
                let rows = (n - t0).min(flash::FA_TILE_Q);
                thread_local!(static SCRATCH: std::cell::RefCell<flash::FaScratch> = Default::default());
                SCRATCH.with(|sc| {
                    flash::attend_tiled(&q.v[t0 * cols + h * hd..], cols, rows, &|r| range(t0 + r), flash::FaKv::F32(&wide[h]), hd, None, p.scale, &mut |r, o| {
                        // SAFETY: row t0 + r, head h: each (row, head) is written by one task only.
                        unsafe { y.slice((t0 + r) * cols + h * hd, hd) }.copy_from_slice(o)
                    }, &mut sc.borrow_mut());
                });
            });
            return Ok(CpuT { v: out, cols });
        }
        par::for_each_chunk(&mut out, hd, |i, o| {
            let (t, h) = (i / nh, i % nh);
            let (kr, vr) = (&kh[h * n * hd..(h + 1) * n * hd], &vh[h * n * hd..(h + 1) * n * hd]);
            ops::attend_heads(&q.v[t * cols + h * hd..t * cols + (h + 1) * hd], 1, kr, vr, hd, range(t), None, p.scale, o);
        });
        Ok(CpuT { v: out, cols })
    }

    fn gather_rows(&mut self, x: &CpuT, idx: &[u32]) -> Result<CpuT, OpError> {
        let rows = x.rows();
        let mut v = Vec::with_capacity(idx.len() * x.cols);
        for &i in idx {
            if i as usize >= rows {
                return Err(OpError::Unsupported { backend: "cpu", op: "gather_rows with an index past the rows" });
            }
            v.extend_from_slice(x.row(i as usize));
        }
        Ok(CpuT { v, cols: x.cols })
    }

    fn concat_cols(&mut self, xs: &[&CpuT]) -> Result<CpuT, OpError> {
        let rows = xs.first().map(|x| x.rows()).unwrap_or(0);
        if xs.iter().any(|x| x.rows() != rows) {
            return Err(OpError::Unsupported { backend: "cpu", op: "concat_cols of unequal row counts" });
        }
        let cols: usize = xs.iter().map(|x| x.cols).sum();
        let mut v = Vec::with_capacity(rows * cols);
        for t in 0..rows {
            for x in xs {
                v.extend_from_slice(x.row(t));
            }
        }
        Ok(CpuT { v, cols })
    }

    fn scale(&mut self, x: &mut CpuT, s: f32) -> Result<(), OpError> {
        x.v.iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    async fn read(&mut self, parts: &[(&CpuT, Range<usize>)]) -> Result<Vec<Vec<f32>>, OpError> {
        Ok(parts.iter().map(|(t, rows)| t.v[rows.start * t.cols..rows.end * t.cols].to_vec()).collect())
    }
}
