//! Gated DeltaNet's recurrence over many tokens (prompts), row by row of the state.
//!
//! ggml's `gated_delta_net` (`ggml-cpu/ops.cpp`, `ggml_compute_forward_gated_delta_net_one_chunk`),
//! which llama.cpp's CPU backend runs for prompts and decode alike, takes each token through four
//! passes over a head's S×S state `M` (stored transposed: row `j` is value index `j`):
//! `M *= expf(g)`; `d[j] = (v[j] − M_j·k) · β`; `M_j += d[j] · k`; `o[j] = (M_j·q) / √S`.
//! Row `j` only ever meets `v[j]` and `d[j]`, which it computes itself: each row evolves on its
//! own. So [`delta_rule_rows`] takes one row (or a few) through every token while it sits in
//! registers (or L1), instead of every row through one token, which streams the whole state
//! through the caches four times per token. Same operations on the same values in the same
//! order: the bits of [`super::ops::delta_rule_step`] token after token (tested below).

/// One value head's inputs over `n_tok` tokens.
pub struct DeltaHead<'a> {
    /// Token `t`'s q, k (L2-normalised) and v at `x[t · stride + q | k | v ..][..S]`.
    pub x: &'a [f32],
    pub stride: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    /// Token `t`'s decay `expf(g)` and `β` at `gb[t · gb_stride + gb_off]` and `+ 1`.
    pub gb: &'a [f32],
    pub gb_stride: usize,
    pub gb_off: usize,
    pub n_tok: usize,
}

/// Rows `j0 .. j0 + m.len() / s` of one head's transposed state `m` (S = `s` values each)
/// through every token of `h`, in order: `out[(j − j0) · n_tok + t]` = token `t`'s `o[j]`.
/// Panics if `h`'s slices do not hold its tokens.
pub fn delta_rule_rows(m: &mut [f32], j0: usize, s: usize, h: &DeltaHead<'_>, out: &mut [f32]) {
    let rows = m.len() / s;
    let n = h.n_tok;
    assert!(out.len() >= rows * n && h.gb.len() >= (n.max(1) - 1) * h.gb_stride + h.gb_off + 2 || n == 0);
    assert!(n == 0 || h.x.len() >= (n - 1) * h.stride + h.q.max(h.k).max(h.v) + s);
    assert!(j0 + rows <= s);
    #[cfg(target_arch = "x86_64")]
    if crate::quant::has_avx512() && matches!(s, 64 | 128 | 256) {
        // SAFETY: AVX-512F/VL present; bounds asserted above.
        unsafe { x86::rows(m, j0, s, h, out) };
        return;
    }
    let dot = crate::quant::F32Dot::new();
    let scale = 1.0f32 / (s as f32).sqrt();
    for (r, row) in m.chunks_exact_mut(s).enumerate() {
        let j = j0 + r;
        for t in 0..n {
            let xt = &h.x[t * h.stride..];
            let (q, k, v) = (&xt[h.q..h.q + s], &xt[h.k..h.k + s], xt[h.v + j]);
            let (decay, beta) = (h.gb[t * h.gb_stride + h.gb_off], h.gb[t * h.gb_stride + h.gb_off + 1]);
            for x in row.iter_mut() {
                *x *= decay;
            }
            let d = (v - dot.dot(row, k)) * beta;
            for (mi, &ki) in row.iter_mut().zip(k) {
                *mi = ki.mul_add(d, *mi);
            }
            out[r * n + t] = dot.dot(row, q) * scale;
        }
    }
}

/// The rows in 16-lane registers: `R` rows at once (independent chains hide each token's
/// reduction latency), `NV` = S / 16 registers each. The dots are `ggml_vec_dot_f32` as ggml's
/// AVX-512 build sums them (four accumulators over 64-element steps, `(0 + 2) + (1 + 3)`, then
/// `_mm512_reduce_add_ps`'s order), as `quant`'s F32 dot emulates on AVX2: the same bits.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::DeltaHead;
    use std::arch::x86_64::*;

    /// `_mm512_reduce_add_ps` in GCC's order (upper 256 + lower 256, upper 128 + lower 128,
    /// lanes (0 + 2, 1 + 3), then 0 + 1).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn reduce(v: __m512) -> f32 {
        let h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))), _mm512_castps512_ps256(v));
        let s = _mm_add_ps(_mm256_extractf128_ps::<1>(h), _mm256_castps256_ps128(h));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn dot<const NV: usize>(row: &[__m512; NV], x: *const f32) -> f32 {
        let mut acc = [_mm512_setzero_ps(); 4];
        for (i, r) in row.iter().enumerate() {
            acc[i % 4] = _mm512_fmadd_ps(*r, _mm512_loadu_ps(x.add(16 * i)), acc[i % 4]);
        }
        reduce(_mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])))
    }

    #[inline(never)]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn group<const R: usize, const NV: usize>(m: *mut f32, j0: usize, h: &DeltaHead<'_>, out: *mut f32) {
        let s = 16 * NV;
        let n = h.n_tok;
        let scale = 1.0f32 / (s as f32).sqrt();
        let mut rows: [[__m512; NV]; R] = std::array::from_fn(|r| std::array::from_fn(|i| _mm512_loadu_ps(m.add(r * s + 16 * i))));
        let (x, gb) = (h.x.as_ptr(), h.gb.as_ptr());
        for t in 0..n {
            let xt = x.add(t * h.stride);
            let (q, k, v) = (xt.add(h.q), xt.add(h.k), xt.add(h.v + j0));
            let g = gb.add(t * h.gb_stride + h.gb_off);
            let (decay, beta) = (_mm512_set1_ps(*g), *g.add(1));
            for (r, row) in rows.iter_mut().enumerate() {
                for x in row.iter_mut() {
                    *x = _mm512_mul_ps(*x, decay);
                }
                let d = _mm512_set1_ps((*v.add(r) - dot(row, k)) * beta);
                for (i, x) in row.iter_mut().enumerate() {
                    *x = _mm512_fmadd_ps(_mm512_loadu_ps(k.add(16 * i)), d, *x);
                }
                *out.add(r * n + t) = dot(row, q) * scale;
            }
        }
        for (r, row) in rows.iter().enumerate() {
            for (i, x) in row.iter().enumerate() {
                _mm512_storeu_ps(m.add(r * s + 16 * i), *x);
            }
        }
    }

    /// `s` is 64, 128 or 256; the caller checked the bounds.
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    pub(super) unsafe fn rows(m: &mut [f32], j0: usize, s: usize, h: &DeltaHead<'_>, out: &mut [f32]) {
        let n_rows = m.len() / s;
        let (mp, op) = (m.as_mut_ptr(), out.as_mut_ptr());
        let mut r = 0;
        macro_rules! run {
            ($r:literal, $nv:literal) => {{
                while r + $r <= n_rows {
                    group::<$r, $nv>(mp.add(r * s), j0 + r, h, op.add(r * h.n_tok));
                    r += $r;
                }
                while r < n_rows {
                    group::<1, $nv>(mp.add(r * s), j0 + r, h, op.add(r * h.n_tok));
                    r += 1;
                }
            }};
        }
        match s {
            64 => run!(4, 4),
            128 => run!(2, 8),
            _ => run!(1, 16),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::ops;

    /// Every head size the kernels special-case and two they do not, state rows split in
    /// blocks of every size: the bits of `delta_rule_step` applied token by token (ggml's
    /// per-token order) for the outputs and the final state.
    #[test]
    fn rows_through_all_tokens_equal_tokens_through_all_rows() {
        let mut rnd = crate::backend::cpu::ops::test_rng(0x2545_f491);
        for s in [64usize, 128, 256, 48, 32] {
            let n = 13;
            let stride = 3 * s + 5;
            let mut x: Vec<f32> = (0..n * stride).map(|_| rnd()).collect();
            for t in 0..n {
                ops::l2_norm(&mut x[t * stride..t * stride + s], 1e-6);
                ops::l2_norm(&mut x[t * stride + s..t * stride + 2 * s], 1e-6);
            }
            let g: Vec<f32> = (0..n).map(|_| -rnd().abs() * 2.0).collect();
            let beta: Vec<f32> = (0..n).map(|_| rnd().abs()).collect();
            let m0: Vec<f32> = (0..s * s).map(|_| rnd() * 0.5).collect();
            // The reference: every row through one token at a time.
            let mut m_ref = m0.clone();
            let mut o_ref = vec![0f32; n * s];
            let mut d = vec![0f32; s];
            for t in 0..n {
                let xt = &x[t * stride..];
                ops::delta_rule_step(&mut m_ref, &xt[..s], &xt[s..2 * s], &xt[2 * s + 5..3 * s + 5], g[t], beta[t], &mut d, &mut o_ref[t * s..(t + 1) * s]);
            }
            let gb: Vec<f32> = (0..n).flat_map(|t| [crate::backend::cpu::cmath::expf(g[t]), beta[t]]).collect();
            let h = DeltaHead { x: &x, stride, q: 0, k: s, v: 2 * s + 5, gb: &gb, gb_stride: 2, gb_off: 0, n_tok: n };
            for block in [1, 3, 4, s] {
                let mut m = m0.clone();
                for (bi, mb) in m.chunks_mut(block * s).enumerate() {
                    let rows = mb.len() / s;
                    let mut out = vec![0f32; rows * n];
                    delta_rule_rows(mb, bi * block, s, &h, &mut out);
                    for r in 0..rows {
                        for t in 0..n {
                            let (got, want) = (out[r * n + t], o_ref[t * s + bi * block + r]);
                            assert_eq!(got.to_bits(), want.to_bits(), "S {s} block {block} row {} token {t}: {got} vs {want}", bi * block + r);
                        }
                    }
                }
                assert!(m.iter().zip(&m_ref).all(|(a, b)| a.to_bits() == b.to_bits()), "S {s} block {block}: final state differs");
            }
        }
    }
}
