//! Elementwise and normalisation ops, each following the ggml CPU kernel it mirrors.

use half::f16;

/// RMSNorm (ggml `rms_norm`): the sum of squares is accumulated in f64 as ggml does, then
/// `y = x / sqrt(mean + eps)`, then multiplied by `w` (a separate `ggml_mul` in llama.cpp).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let mut sum = 0f64;
    for &v in x {
        sum += (v * v) as f64;
    }
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * g;
    }
}

/// In-place RMSNorm over consecutive groups of `w.len()` elements (per-head QK-norm).
pub fn rms_norm_groups(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    let mut tmp = vec![0f32; n];
    for g in x.chunks_mut(n) {
        rms_norm(g, w, eps, &mut tmp);
        g.copy_from_slice(&tmp);
    }
}

/// RoPE variants (llama.cpp `llama_rope_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKind {
    /// Rotate adjacent pairs (x[2i], x[2i+1]) (`LLAMA_ROPE_TYPE_NORM`: llama, mixtral).
    Norm,
    /// Rotate (x[i], x[i + n_rot/2]) (`LLAMA_ROPE_TYPE_NEOX`: qwen2moe, qwen3moe, olmoe).
    Neox,
}

/// cos/sin table for one position, as ggml's `ggml_rope_cache_init` builds it: theta starts at
/// the position and is multiplied by `base^(-2/n_rot)` per pair, in f32 (iterated, not powf per
/// pair), with no YaRN extrapolation (ext_factor 0, freq_scale 1, attn_factor 1).
pub fn rope_cache(pos: usize, n_rot: usize, base: f32, cache: &mut Vec<f32>) {
    cache.clear();
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    let mut theta = pos as f32;
    for _ in 0..n_rot / 2 {
        cache.push(theta.cos());
        cache.push(theta.sin());
        theta *= theta_scale;
    }
}

/// Apply RoPE in place to `n_heads` consecutive heads of `head_dim` values each (only the first
/// `n_rot` dims of each head rotate).
pub fn rope(x: &mut [f32], head_dim: usize, n_rot: usize, kind: RopeKind, cache: &[f32]) {
    for h in x.chunks_mut(head_dim) {
        match kind {
            RopeKind::Norm => {
                for i in 0..n_rot / 2 {
                    let (c, s) = (cache[2 * i], cache[2 * i + 1]);
                    let (x0, x1) = (h[2 * i], h[2 * i + 1]);
                    h[2 * i] = x0 * c - x1 * s;
                    h[2 * i + 1] = x0 * s + x1 * c;
                }
            }
            RopeKind::Neox => {
                let half = n_rot / 2;
                for i in 0..half {
                    let (c, s) = (cache[2 * i], cache[2 * i + 1]);
                    let (x0, x1) = (h[i], h[i + half]);
                    h[i] = x0 * c - x1 * s;
                    h[i + half] = x0 * s + x1 * c;
                }
            }
        }
    }
}

/// SiLU as ggml computes it: x / (1 + e^-x).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// SwiGLU (ggml `swiglu_split`): out = silu(gate) * up.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// Softmax (ggml `soft_max`): max-subtracted exponentials, sum accumulated in f64.
pub fn softmax(x: &[f32], y: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f64;
    for (o, &v) in y.iter_mut().zip(x) {
        let e = (v - max).exp();
        *o = e;
        sum += e as f64;
    }
    let inv = (1.0 / sum) as f32;
    for o in y.iter_mut() {
        *o *= inv;
    }
}

/// Sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].partial_cmp(&x[a]).unwrap_or(std::cmp::Ordering::Equal).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Dot product of an f16 vector with an f16 vector, accumulated in f32 (ggml `vec_dot_f16`).
#[inline]
pub fn dot_f16(a: &[f16], b: &[f16]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l].to_f32() * b[c * 8 + l].to_f32();
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i].to_f32() * b[i].to_f32();
    }
    s
}

/// One query head attending over `n_kv` cached positions, as ggml's CPU flash-attention kernel
/// (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`) does with an f16 KV cache: Q is rounded
/// to f16, scores are f16 dots scaled by `scale`, the softmax is online, and the V accumulator is
/// kept in f16.
pub fn attend_head(q: &[f32], k_rows: &[f16], v_rows: &[f16], head_dim: usize, n_kv: usize, scale: f32, out: &mut [f32], qh: &mut Vec<f16>, acc: &mut Vec<f16>) {
    qh.clear();
    qh.extend(q.iter().map(|&v| f16::from_f32(v)));
    acc.clear();
    acc.resize(head_dim, f16::ZERO);
    let mut s_sum = 0f32;
    let mut m = f32::NEG_INFINITY;
    for j in 0..n_kv {
        let k = &k_rows[j * head_dim..(j + 1) * head_dim];
        let s = dot_f16(k, qh) * scale;
        let mut ms = 1.0f32;
        let mut vs = 1.0f32;
        if s > m {
            let m_old = m;
            m = s;
            ms = (m_old - m).exp();
            for a in acc.iter_mut() {
                *a = f16::from_f32(a.to_f32() * ms);
            }
        } else {
            vs = (s - m).exp();
        }
        let v = &v_rows[j * head_dim..(j + 1) * head_dim];
        for (a, &vv) in acc.iter_mut().zip(v) {
            *a = f16::from_f32(a.to_f32() + vv.to_f32() * vs);
        }
        s_sum = s_sum * ms + vs;
    }
    let inv = if s_sum == 0.0 { 0.0 } else { 1.0 / s_sum };
    for (o, a) in out.iter_mut().zip(acc.iter()) {
        *o = a.to_f32() * inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_norm_rotates_pairs_by_position_angle() {
        // n_rot = 2: a single pair rotated by theta = pos (base^0 = 1).
        let mut cache = Vec::new();
        rope_cache(3, 2, 10000.0, &mut cache);
        let mut x = [1.0f32, 0.0];
        rope(&mut x, 2, 2, RopeKind::Norm, &cache);
        assert!((x[0] - 3f32.cos()).abs() < 1e-6 && (x[1] - 3f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn top_k_orders_by_value() {
        assert_eq!(top_k(&[0.1, 0.7, 0.3, 0.7], 3), vec![1, 3, 2]);
    }

    #[test]
    fn attention_single_position_returns_v() {
        let k = vec![f16::from_f32(1.0); 4];
        let v: Vec<f16> = [1.0f32, -2.0, 0.5, 4.0].iter().map(|&x| f16::from_f32(x)).collect();
        let mut out = vec![0f32; 4];
        attend_head(&[0.3, 0.1, 0.2, 0.4], &k, &v, 4, 1, 0.5, &mut out, &mut Vec::new(), &mut Vec::new());
        assert_eq!(out, vec![1.0, -2.0, 0.5, 4.0]);
    }
}
