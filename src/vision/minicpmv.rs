//! The `minicpmv4_6` vision tower (MiniCPM-V 4.6; llama.cpp `tools/mtmd/models/minicpmv.cpp`,
//! `clip_graph_minicpmv4_6`; tensors as `conversion/minicpm.py` writes them, `clip-impl.h`).
//!
//! One image piece of `W × H` pixels (multiples of `patch · n_merge`), `P = patch`:
//! 1. Patch embedding: a `P × P` stride-`P` convolution (`v.patch_embd.weight` [P, P, 3, D],
//!    `v.patch_embd.bias`) = a matrix product of the unfolded patches, rows `py · (W/P) + px`.
//! 2. `+ v.position_embd.weight[bucket]`, the SigLIP buckets `⌊70·i/ph⌋ · 70 + ⌊70·j/pw⌋`.
//! 3. ViT layers (`v.blk.N.*`): `x += attn_out(attn(ln1(x)))`, `x += ffn_down(gelu(ffn_up(ln2(x))))`,
//!    layer norms with bias, attention over all patches (heads of `D / n_head`, scale
//!    `1/√head`), biases on every projection.
//! 4. With `n_merge = 4`, after layer `insert_layer`: the ViT merger — window attention over
//!    each 2×2 block of patches (`v.vit_merger.ln1`, `attn_{q,k,v,out}`; window-major reorder,
//!    a block-diagonal mask, then back), residual; then 2×2 → 1 (`ds_ln` over the four rows
//!    concatenated, `ds_ffn_up` → GELU tanh → `ds_ffn_down`, plus the four rows' mean); the
//!    remaining layers run on the merged rows.
//! 5. `v.post_ln`, then the final merger: 2×2 → 1 again (`mm.input_norm` over the four rows
//!    concatenated, `mm.up` → GELU erf → `mm.down`), the text model's width.

use super::image::RgbF32;
use super::{VisionConfig, VisionError};
use crate::backend::ops::{Gelu, Mat, Ops, SelfAttn, Vector, Weights};
use crate::model::{Loader, ModelError};

/// A layer norm's weight and optional bias.
#[derive(Clone, Copy)]
pub struct Norm {
    pub w: Vector,
    pub b: Option<Vector>,
}

/// A projection's matrix and optional bias.
#[derive(Clone, Copy)]
pub struct Lin {
    pub w: Mat,
    pub b: Option<Vector>,
}

pub struct Block {
    pub ln1: Norm,
    pub q: Lin,
    pub k: Lin,
    pub v: Lin,
    pub o: Lin,
    pub ln2: Norm,
    pub up: Lin,
    pub down: Lin,
}

/// The ViT merger (window attention + 2×2 downsample MLP).
pub struct VitMerger {
    pub ln1: Norm,
    pub q: Lin,
    pub k: Lin,
    pub v: Lin,
    pub o: Lin,
    pub ds_ln: Norm,
    pub ds_up: Lin,
    pub ds_down: Lin,
}

pub struct Tower {
    pub patch: Mat,
    pub patch_b: Option<Vector>,
    pub pos: Mat,
    pub pre_ln: Option<Norm>,
    pub blocks: Vec<Block>,
    pub merger: Option<VitMerger>,
    pub post_ln: Option<Norm>,
    pub mm_norm: Norm,
    pub mm_up: Lin,
    pub mm_down: Lin,
}

/// The SigLIP position table's side (`70 × 70` buckets).
const BUCKETS: usize = 70;

fn norm(ld: &mut Loader<'_>, stem: &str, n: usize, required: bool) -> Result<Option<Norm>, ModelError> {
    let (w, b) = (format!("{stem}.weight"), format!("{stem}.bias"));
    if !required && !ld.has(&w) {
        return Ok(None);
    }
    Ok(Some(Norm { w: ld.vec(&w, n)?, b: ld.opt_vec(&b, n)? }))
}

fn lin(ld: &mut Loader<'_>, stem: &str, cols: usize, rows: usize) -> Result<Lin, ModelError> {
    Ok(Lin { w: ld.mat(&format!("{stem}.weight"), [cols, rows])?, b: ld.opt_vec(&format!("{stem}.bias"), rows)? })
}

fn req(n: Option<Norm>) -> Result<Norm, ModelError> {
    n.ok_or_else(|| ModelError::Internal("a required norm was not loaded".into()))
}

impl Tower {
    /// The tensors (`clip.cpp` `load_tensors`, `PROJECTOR_TYPE_MINICPMV4_6`); returns the tower
    /// and its output width.
    pub fn load(ld: &mut Loader<'_>, c: &VisionConfig) -> Result<(Self, usize), VisionError> {
        let (d, p, ff) = (c.n_embd, c.patch_size, c.n_ff);
        let patch = ld.mat_nd("v.patch_embd.weight", &[p, p, 3, d])?;
        let patch_b = ld.opt_vec("v.patch_embd.bias", d)?;
        let pos_rows = ld.g.tensor("v.position_embd.weight").map(|t| t.n_rows() as usize).unwrap_or(0);
        if pos_rows < BUCKETS * BUCKETS {
            return Err(VisionError::Invalid { key: "v.position_embd.weight".into(), value: format!("{pos_rows} rows"), why: "needs 70 × 70 = 4900 position rows (SigLIP buckets)" });
        }
        let pos = ld.mat("v.position_embd.weight", [d, pos_rows])?;
        let pre_ln = norm(ld, "v.pre_ln", d, false)?;
        let mut blocks = Vec::with_capacity(c.n_layer);
        for il in 0..c.n_layer {
            let s = |x: &str| format!("v.blk.{il}.{x}");
            if ld.has(&s("ls1.weight")) || ld.has(&s("attn_qkv.weight")) {
                return Err(VisionError::Invalid { key: s("ls1 / attn_qkv"), value: "present".into(), why: "layer scales and fused QKV are not part of minicpmv4_6" });
            }
            blocks.push(Block {
                ln1: req(norm(ld, &s("ln1"), d, true)?)?,
                q: lin(ld, &s("attn_q"), d, d)?,
                k: lin(ld, &s("attn_k"), d, d)?,
                v: lin(ld, &s("attn_v"), d, d)?,
                o: lin(ld, &s("attn_out"), d, d)?,
                ln2: req(norm(ld, &s("ln2"), d, true)?)?,
                up: lin(ld, &s("ffn_up"), d, ff)?,
                down: lin(ld, &s("ffn_down"), ff, d)?,
            });
        }
        let merger = if c.n_merge == 4 {
            let ds_ff = ld.g.tensor("v.vit_merger.ds_ffn_up.weight").map(|t| t.n_rows() as usize).unwrap_or(0);
            Some(VitMerger {
                ln1: req(norm(ld, "v.vit_merger.ln1", d, true)?)?,
                q: lin(ld, "v.vit_merger.attn_q", d, d)?,
                k: lin(ld, "v.vit_merger.attn_k", d, d)?,
                v: lin(ld, "v.vit_merger.attn_v", d, d)?,
                o: lin(ld, "v.vit_merger.attn_out", d, d)?,
                ds_ln: req(norm(ld, "v.vit_merger.ds_ln", 4 * d, true)?)?,
                ds_up: lin(ld, "v.vit_merger.ds_ffn_up", 4 * d, ds_ff)?,
                ds_down: lin(ld, "v.vit_merger.ds_ffn_down", ds_ff, d)?,
            })
        } else {
            None
        };
        let post_ln = norm(ld, "v.post_ln", d, false)?;
        let mm_ff = ld.g.tensor("mm.up.weight").map(|t| t.n_rows() as usize).unwrap_or(0);
        let n_out = ld.g.tensor("mm.down.weight").map(|t| t.n_rows() as usize).unwrap_or(0);
        let mm_norm = Norm { w: ld.vec("mm.input_norm.weight", 4 * d)?, b: ld.opt_vec("mm.input_norm.bias", 4 * d)? };
        let mm_up = lin(ld, "mm.up", 4 * d, mm_ff)?;
        let mm_down = lin(ld, "mm.down", mm_ff, n_out)?;
        Ok((Self { patch, patch_b, pos, pre_ln, blocks, merger, post_ln, mm_norm, mm_up, mm_down }, n_out))
    }

    /// The embeddings of one piece: `(W/P/n_merge) · (H/P/n_merge)` rows, row-major over the
    /// merged grid.
    pub async fn encode<B: Ops>(&self, b: &mut B, c: &VisionConfig, w: &Weights, img: &RgbF32) -> Result<Vec<f32>, VisionError> {
        let p = c.patch_size;
        let (pw, ph) = (img.w / p, img.h / p);
        if pw == 0 || ph == 0 || img.w % p != 0 || img.h % p != 0 || pw % c.n_merge != 0 || ph % c.n_merge != 0 {
            return Err(VisionError::Invalid { key: "image piece".into(), value: format!("{}×{}", img.w, img.h), why: "sides must be multiples of patch_size × n_merge" });
        }
        let d = c.n_embd;
        // 1. Unfold the patches: row (py, px), columns (channel, ky, kx) as im2col lays them.
        let mut cols = vec![0f32; pw * ph * 3 * p * p];
        for py in 0..ph {
            for px in 0..pw {
                let row = &mut cols[(py * pw + px) * 3 * p * p..][..3 * p * p];
                for ch in 0..3 {
                    for ky in 0..p {
                        for kx in 0..p {
                            row[(ch * p + ky) * p + kx] = img.px[((py * p + ky) * img.w + px * p + kx) * 3 + ch];
                        }
                    }
                }
            }
        }
        let inp = b.input(cols, 3 * p * p)?;
        let [mut x] = mm(b, &inp, [self.patch])?;
        if let Some(pb) = self.patch_b {
            b.add_row(&mut x, pb)?;
        }
        // 2. Learned positions (SigLIP buckets), looked up on the host.
        let mut pos = vec![0f32; pw * ph * d];
        let bucket = |i: usize, n: usize| (BUCKETS as f64 * i as f64 / n as f64).floor() as usize;
        for i in 0..ph {
            for j in 0..pw {
                let r = bucket(i, ph) * BUCKETS + bucket(j, pw);
                w.row_f32(self.pos, r, &mut pos[(i * pw + j) * d..(i * pw + j + 1) * d]).map_err(ModelError::from)?;
            }
        }
        let pos = b.input(pos, d)?;
        b.add(&mut x, &pos)?;
        if let Some(n) = self.pre_ln {
            x = b.layer_norm(&x, n.w, n.b, c.eps)?;
        }
        let attn = SelfAttn { n_head: c.n_head, head_dim: d / c.n_head, scale: 1.0 / ((d / c.n_head) as f32).sqrt(), block: 0 };
        let (first, rest) = match &self.merger {
            Some(_) => self.blocks.split_at(c.insert_layer + 1),
            None => (&self.blocks[..], &[][..]),
        };
        for blk in first {
            x = self.layer(b, c, x, blk, &attn)?;
        }
        let (mut gw, mut gh) = (pw, ph);
        if let Some(m) = &self.merger {
            // Window attention within each 2×2 block: window-major order, blocks of 4.
            let cur = b.layer_norm(&x, m.ln1.w, m.ln1.b, c.eps)?;
            let win = window_order(gw, gh);
            let cur = b.gather_rows(&cur, &win)?;
            let [q, k, v] = projs(b, &cur, [m.q, m.k, m.v])?;
            let o = b.self_attention(&q, &k, &v, &SelfAttn { block: 4, ..attn })?;
            let o = proj(b, &o, m.o)?;
            let mut inv = vec![0u32; win.len()];
            for (i, &w) in win.iter().enumerate() {
                inv[w as usize] = i as u32;
            }
            let mut o = b.gather_rows(&o, &inv)?;
            b.add(&mut o, &x)?;
            x = o;
            // 2×2 → 1: MLP of the four rows side by side, plus their mean.
            let [p0, p1, p2, p3] = corners(b, &x, gw, gh)?;
            let quad = b.concat_cols(&[&p0, &p1, &p2, &p3])?;
            // ((p0 + p1) + p2) + p3, then · 0.25 (ggml's adds and scale, in that order).
            let mut mean = p0;
            for p in [&p1, &p2, &p3] {
                b.add(&mut mean, p)?;
            }
            b.scale(&mut mean, 0.25)?;
            let cur = b.layer_norm(&quad, m.ds_ln.w, m.ds_ln.b, c.eps)?;
            let mut h = proj(b, &cur, m.ds_up)?;
            b.gelu(&mut h, Gelu::Tanh)?;
            let y = proj(b, &h, m.ds_down)?;
            b.add(&mut mean, &y)?;
            x = mean;
            (gw, gh) = (gw / 2, gh / 2);
            for blk in rest {
                x = self.layer(b, c, x, blk, &attn)?;
            }
        }
        if let Some(n) = self.post_ln {
            x = b.layer_norm(&x, n.w, n.b, c.eps)?;
        }
        // The final merger: 2×2 → 1, erf GELU.
        let [p0, p1, p2, p3] = corners(b, &x, gw, gh)?;
        let quad = b.concat_cols(&[&p0, &p1, &p2, &p3])?;
        let cur = b.layer_norm(&quad, self.mm_norm.w, self.mm_norm.b, c.eps)?;
        let mut h = proj(b, &cur, self.mm_up)?;
        b.gelu(&mut h, Gelu::Erf)?;
        let y = proj(b, &h, self.mm_down)?;
        let rows = B::shape(&y).0;
        Ok(b.read(&[(&y, 0..rows)]).await?.remove(0))
    }

    /// One ViT layer (`build_vit_layers`).
    fn layer<B: Ops>(&self, b: &mut B, c: &VisionConfig, x: B::T, l: &Block, attn: &SelfAttn) -> Result<B::T, VisionError> {
        let cur = b.layer_norm(&x, l.ln1.w, l.ln1.b, c.eps)?;
        let [q, k, v] = projs(b, &cur, [l.q, l.k, l.v])?;
        let o = b.self_attention(&q, &k, &v, attn)?;
        let mut o = proj(b, &o, l.o)?;
        b.add(&mut o, &x)?;
        let x = o;
        let cur = b.layer_norm(&x, l.ln2.w, l.ln2.b, c.eps)?;
        let mut h = proj(b, &cur, l.up)?;
        b.gelu(&mut h, Gelu::Tanh)?;
        let mut y = proj(b, &h, l.down)?;
        b.add(&mut y, &x)?;
        Ok(y)
    }
}

fn mm<B: Ops, const N: usize>(b: &mut B, x: &B::T, ws: [Mat; N]) -> Result<[B::T; N], VisionError> {
    b.matmul(x, &ws)?.try_into().map_err(|_| VisionError::Model(ModelError::Internal("matmul returned the wrong number of tensors".into())))
}

fn proj<B: Ops>(b: &mut B, x: &B::T, l: Lin) -> Result<B::T, VisionError> {
    let [y] = projs(b, x, [l])?;
    Ok(y)
}

/// Several projections of one input (its activation conversion made once), biases added.
fn projs<B: Ops, const N: usize>(b: &mut B, x: &B::T, ls: [Lin; N]) -> Result<[B::T; N], VisionError> {
    let mut ys = mm(b, x, ls.map(|l| l.w))?;
    for (y, l) in ys.iter_mut().zip(ls) {
        if let Some(bias) = l.b {
            b.add_row(y, bias)?;
        }
    }
    Ok(ys)
}

/// Rows of the 2×2 windows, window by window (`vit_merger_window_idx`).
fn window_order(w: usize, h: usize) -> Vec<u32> {
    let mut v = Vec::with_capacity(w * h);
    for wi in 0..h / 2 {
        for wj in 0..w / 2 {
            for (r, c) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                v.push(((2 * wi + r) * w + 2 * wj + c) as u32);
            }
        }
    }
    v
}

/// Row `(2i + r) · w + 2j + c` for each merged cell (i, j) (`make_ds_idx`).
fn ds_index(r: usize, c: usize, w: usize, h: usize) -> Vec<u32> {
    let mut v = Vec::with_capacity(w * h / 4);
    for i in 0..h / 2 {
        for j in 0..w / 2 {
            v.push(((2 * i + r) * w + 2 * j + c) as u32);
        }
    }
    v
}

/// The rows of each 2×2 cell's top-left, top-right, bottom-left and bottom-right patch
/// (`merger_ds_idx_0..3`), one tensor each.
fn corners<B: Ops>(b: &mut B, x: &B::T, w: usize, h: usize) -> Result<[B::T; 4], VisionError> {
    Ok([
        b.gather_rows(x, &ds_index(0, 0, w, h))?,
        b.gather_rows(x, &ds_index(0, 1, w, h))?,
        b.gather_rows(x, &ds_index(1, 0, w, h))?,
        b.gather_rows(x, &ds_index(1, 1, w, h))?,
    ])
}
